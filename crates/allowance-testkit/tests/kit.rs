//! The kit against real `redis-server` processes.

use std::path::Path;
use std::time::Duration;

use allowance_testkit::{
    RedisCluster, RedisOptions, RedisServer, command_timeout, redis_available,
};

fn process_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn starts_and_answers_ping() {
    let Some(()) = redis_available() else { return };
    let server = RedisServer::start();
    assert_eq!(server.command(&["PING"]).unwrap(), "PONG");
    assert_ne!(server.port(), 6379);
    assert_eq!(
        server.url(),
        format!("redis://127.0.0.1:{}/0", server.port())
    );
    assert!(process_exists(server.pid()));
    assert!(server.dir().join("redis.log").exists());
}

#[test]
fn set_and_get_through_command() {
    let Some(()) = redis_available() else { return };
    let server = RedisServer::start();
    assert_eq!(server.command(&["SET", "k", "hello world"]).unwrap(), "OK");
    assert_eq!(server.command(&["GET", "k"]).unwrap(), "hello world");
    assert_eq!(server.command(&["GET", "missing"]).unwrap(), "(nil)");
    assert_eq!(server.command(&["INCRBY", "n", "5"]).unwrap(), "5");
    assert_eq!(server.command(&["RPUSH", "l", "a", "b"]).unwrap(), "2");
    assert_eq!(server.command(&["LRANGE", "l", "0", "-1"]).unwrap(), "a\nb");
    let err = server.command(&["NOSUCHCOMMAND"]).unwrap_err();
    assert!(err.to_string().contains("ERR"), "{err}");
    // The fixed options took effect.
    assert_eq!(
        server.command(&["CONFIG", "GET", "save"]).unwrap(),
        "save\n"
    );
    assert_eq!(
        server.command(&["CONFIG", "GET", "appendonly"]).unwrap(),
        "appendonly\nno"
    );
}

#[test]
fn aof_always_survives_kill9_and_restart() {
    let Some(()) = redis_available() else { return };
    let mut server = RedisServer::start_with(RedisOptions {
        appendonly: true,
        appendfsync: "always",
        ..RedisOptions::default()
    });
    assert_eq!(
        server.command(&["CONFIG", "GET", "appendfsync"]).unwrap(),
        "appendfsync\nalways"
    );
    assert_eq!(server.command(&["SET", "k", "v"]).unwrap(), "OK");
    let (port, old_pid) = (server.port(), server.pid());

    server.kill9();
    assert!(!process_exists(old_pid), "killed process still present");
    assert!(server.command(&["PING"]).is_err());

    server.restart();
    assert_eq!(server.port(), port);
    assert_ne!(server.pid(), old_pid);
    assert_eq!(server.command(&["GET", "k"]).unwrap(), "v");
}

#[test]
fn restart_while_running_kills_first() {
    let Some(()) = redis_available() else { return };
    let mut server = RedisServer::start();
    let old_pid = server.pid();
    server.restart();
    assert!(!process_exists(old_pid));
    assert_eq!(server.command(&["PING"]).unwrap(), "PONG");
}

#[test]
fn stop_and_cont() {
    let Some(()) = redis_available() else { return };
    let server = RedisServer::start();
    let timeout = Duration::from_millis(300);
    server.stop();
    assert!(
        command_timeout(server.port(), &["PING"], timeout).is_err(),
        "a stopped server answered"
    );
    server.cont();
    assert_eq!(
        command_timeout(server.port(), &["PING"], timeout).unwrap(),
        "PONG"
    );
}

#[test]
fn three_master_cluster_comes_up() {
    let Some(()) = redis_available() else { return };
    let cluster = RedisCluster::start(3);
    assert_eq!(cluster.nodes().len(), 3);
    assert_eq!(cluster.urls().len(), 3);
    for node in cluster.nodes() {
        assert!(node.port() <= 55_000);
        let info = node.command(&["CLUSTER", "INFO"]).unwrap();
        assert!(info.contains("cluster_state:ok"), "{info}");
        assert!(info.contains("cluster_slots_assigned:16384"), "{info}");
        assert!(info.contains("cluster_known_nodes:3"), "{info}");
        assert!(node.dir().join("nodes.conf").exists());
    }
    let pids: Vec<u32> = cluster.nodes().iter().map(RedisServer::pid).collect();
    drop(cluster);
    for pid in pids {
        assert!(!process_exists(pid), "cluster node {pid} left behind");
    }
}

#[test]
fn drop_leaves_no_process_behind() {
    let Some(()) = redis_available() else { return };
    let server = RedisServer::start();
    let (pid, dir) = (server.pid(), server.dir().to_owned());
    assert!(process_exists(pid));
    drop(server);
    assert!(
        !process_exists(pid),
        "redis-server {pid} still present (or a zombie) after drop"
    );
    assert!(!dir.exists(), "directory {} left behind", dir.display());
}

#[test]
fn drop_of_a_stopped_server_leaves_no_process_behind() {
    let Some(()) = redis_available() else { return };
    let server = RedisServer::start();
    let pid = server.pid();
    server.stop();
    drop(server);
    assert!(!process_exists(pid));
}

#[test]
fn restart_waits_while_its_port_is_briefly_taken() {
    let Some(()) = redis_available() else { return };
    let mut server = RedisServer::start();
    server.command(&["SET", "k", "v"]).unwrap();
    server.kill9();
    let squatter = std::net::TcpListener::bind(("127.0.0.1", server.port())).unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        drop(squatter);
    });
    server.restart();
    release.join().unwrap();
    assert_eq!(server.command(&["PING"]).unwrap(), "PONG");
    // No appendonly, no save: a restart starts empty.
    assert_eq!(server.command(&["GET", "k"]).unwrap(), "(nil)");
}
