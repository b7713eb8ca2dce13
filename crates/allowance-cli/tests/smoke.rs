//! The service starts, answers health, and stops cleanly on SIGTERM.
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
