//! The service starts, answers health, and stops cleanly on SIGTERM and
//! on SIGHUP (there is no reload; a hang-up must not drop requests).
mod common;
use common::*;

#[tokio::test]
async fn starts_answers_and_stops() {
    let s = Server::start();
    let r = s.get("/healthz", None).await.expect(200);
    assert_eq!(r.json, serde_json::Value::String("ok\n".into()));
    s.get("/readyz", None).await.expect(200);
    let status = s.terminate();
    assert!(status.success(), "exit status {status:?}");
}

#[tokio::test]
async fn a_hang_up_stops_it_cleanly() {
    let s = Server::start();
    s.get("/healthz", None).await.expect(200);
    let status = s.signal("HUP");
    assert!(
        status.success(),
        "exit status {status:?} (129 is SIGHUP's default action)"
    );
}
