//! The kit against real `redis-server` processes.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use allowance_testkit::{
    RedisCluster, RedisOptions, RedisSentinel, RedisServer, command, command_timeout,
    redis_available,
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

fn tls() -> RedisOptions {
    RedisOptions {
        tls: true,
        ..RedisOptions::default()
    }
}

/// Runs `openssl args…` and returns its stdout, panicking with its stderr when it fails.
fn openssl(args: &[&str]) -> String {
    let output = Command::new("openssl").args(args).output().unwrap();
    assert!(
        output.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn plain_servers_have_no_tls() {
    let Some(()) = redis_available() else { return };
    let server = RedisServer::start();
    assert!(!server.is_tls());
    assert_eq!(server.ca_file(), None);
    assert!(!server.dir().join("ca.crt").exists());
}

#[test]
fn tls_server_answers_over_tls_only() {
    let Some(()) = redis_available() else { return };
    let mut server = RedisServer::start_with(tls());
    assert!(server.is_tls());
    assert_eq!(
        server.url(),
        format!("rediss://127.0.0.1:{}/0", server.port())
    );
    let ca = server.ca_file().expect("a TLS server has a CA").to_owned();
    assert_eq!(ca, server.dir().join("ca.crt"));
    assert_eq!(server.command(&["PING"]).unwrap(), "PONG");
    assert_eq!(server.command(&["SET", "k", "hello world"]).unwrap(), "OK");
    assert_eq!(server.command(&["GET", "k"]).unwrap(), "hello world");
    assert_eq!(server.command(&["GET", "missing"]).unwrap(), "(nil)");
    assert_eq!(server.command(&["RPUSH", "l", "a", "b"]).unwrap(), "2");
    assert_eq!(server.command(&["LRANGE", "l", "0", "-1"]).unwrap(), "a\nb");
    let err = server.command(&["NOSUCHCOMMAND"]).unwrap_err();
    assert!(err.to_string().contains("ERR"), "{err}");
    assert_eq!(
        server.command(&["CONFIG", "GET", "port"]).unwrap(),
        "port\n0",
        "no plain-text port"
    );
    assert_eq!(
        server.command(&["CONFIG", "GET", "tls-port"]).unwrap(),
        format!("tls-port\n{}", server.port())
    );
    // Plain text on the TLS port gets no Redis reply.
    assert!(command_timeout(server.port(), &["PING"], Duration::from_millis(500)).is_err());

    // A restart keeps the port and the CA, so clients' trust stays valid.
    let ca_pem = std::fs::read(&ca).unwrap();
    server.restart();
    assert_eq!(server.command(&["PING"]).unwrap(), "PONG");
    assert_eq!(std::fs::read(&ca).unwrap(), ca_pem);
}

#[test]
fn tls_certificate_is_for_127_0_0_1_and_signed_by_the_ca() {
    let Some(()) = redis_available() else { return };
    let server = RedisServer::start_with(tls());
    let dir = server.dir();
    let (ca, cert) = (dir.join("ca.crt"), dir.join("server.crt"));
    let (ca, cert) = (ca.to_str().unwrap(), cert.to_str().unwrap());
    let verified = openssl(&[
        "verify",
        "-CAfile",
        ca,
        "-purpose",
        "sslserver",
        "-verify_ip",
        "127.0.0.1",
        cert,
    ]);
    assert!(verified.contains(": OK"), "{verified}");
    let text = openssl(&["x509", "-in", cert, "-noout", "-text"]);
    assert!(text.contains("IP Address:127.0.0.1"), "{text}");
    assert!(text.contains("DNS:localhost"), "{text}");
    assert!(text.contains("CA:FALSE"), "{text}");
    // Not trusted by anyone else: the CA is self-signed and fresh.
    let other = RedisServer::start_with(tls());
    assert_ne!(
        std::fs::read(other.ca_file().unwrap()).unwrap(),
        std::fs::read(server.ca_file().unwrap()).unwrap()
    );
}

#[test]
fn tls_server_stop_makes_commands_time_out() {
    let Some(()) = redis_available() else { return };
    let server = RedisServer::start_with(tls());
    server.stop();
    let started = Instant::now();
    let err = server
        .command_timeout(&["PING"], Duration::from_millis(500))
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(3), "{err}");
    server.cont();
    assert_eq!(server.command(&["PING"]).unwrap(), "PONG");
    let pid = server.pid();
    drop(server);
    assert!(!process_exists(pid));
}

#[test]
fn replica_follows_its_master() {
    let Some(()) = redis_available() else { return };
    let master = RedisServer::start();
    master.command(&["SET", "before", "1"]).unwrap();
    let replica = RedisServer::replica_of(&master);
    let info = replica.command(&["INFO", "replication"]).unwrap();
    assert!(info.contains("role:slave"), "{info}");
    assert!(
        info.contains(&format!("master_port:{}", master.port())),
        "{info}"
    );
    master.command(&["SET", "after", "2"]).unwrap();
    master.wait_replicated(&replica, Duration::from_secs(10));
    assert_eq!(replica.command(&["GET", "before"]).unwrap(), "1");
    assert_eq!(replica.command(&["GET", "after"]).unwrap(), "2");
    let err = replica.command(&["SET", "x", "y"]).unwrap_err();
    assert!(err.to_string().contains("READONLY"), "{err}");
}

#[test]
fn sentinel_names_the_master_and_fails_over() {
    let Some(()) = redis_available() else { return };
    let mut master = RedisServer::start();
    let replica = RedisServer::replica_of(&master);
    let mut sentinel = RedisSentinel::start(&master, "kitmaster");
    assert_ne!(sentinel.port(), 6379);
    assert_eq!(
        sentinel.url("kitmaster"),
        format!("redis+sentinel://127.0.0.1:{}/kitmaster/0", sentinel.port())
    );
    assert_eq!(sentinel.master_port("kitmaster"), Some(master.port()));
    assert_eq!(sentinel.master_port("nosuchmaster"), None);
    assert_eq!(
        command(sentinel.port(), &["PING"]).unwrap(),
        sentinel.command(&["PING"]).unwrap()
    );
    assert!(sentinel.dir().join("sentinel.conf").exists());

    master.kill9();
    let deadline = Instant::now() + Duration::from_secs(30);
    while sentinel.master_port("kitmaster") != Some(replica.port()) {
        assert!(
            Instant::now() < deadline,
            "no failover to the replica within 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let info = replica.command(&["INFO", "replication"]).unwrap();
    assert!(info.contains("role:master"), "{info}");

    let pid = sentinel.pid();
    sentinel.kill9();
    assert!(!process_exists(pid));
    assert_eq!(sentinel.master_port("kitmaster"), None);
    let dir = sentinel.dir().to_owned();
    drop(sentinel);
    assert!(!dir.exists());
}

#[test]
fn dropped_sentinel_leaves_no_process_behind() {
    let Some(()) = redis_available() else { return };
    let master = RedisServer::start();
    let sentinel = RedisSentinel::start(&master, "m");
    let pid = sentinel.pid();
    assert!(process_exists(pid));
    drop(sentinel);
    assert!(!process_exists(pid));
}
