//! Real, throwaway `redis-server` processes for tests (and, in [`fuzz`],
//! random JSON for the APIs' property tests).
//!
//! Other crates' tests use this as a dev-dependency to run against a real
//! Redis without touching any server that is already running on the machine
//! (in particular never the one on `127.0.0.1:6379`): every [`RedisServer`]
//! is a child process of the test, listening on a free port of `127.0.0.1`,
//! with its own temporary directory, and is killed (`SIGKILL`, then reaped)
//! and its directory removed when it is dropped. Ports are picked below the
//! kernel's ephemeral range and kept for their server until it is dropped,
//! so a server killed to be restarted gets its own port back, and no other
//! server is found there meanwhile.
//!
//! Everything here is blocking `std` code (processes, `std::net::TcpStream`),
//! callable from sync tests and from async tests alike. Unix only: stopping
//! and continuing a server sends `SIGSTOP` / `SIGCONT` through `kill(1)`.
//!
//! Besides single nodes there are TLS servers ([`RedisOptions::tls`], with a
//! throwaway CA made by the `openssl` command-line tool), replicas
//! ([`RedisServer::replica_of`]), Sentinels ([`RedisSentinel`]) and clusters
//! ([`RedisCluster`]).
//!
//! ```no_run
//! use allowance_testkit::{RedisServer, redis_available};
//!
//! let Some(()) = redis_available() else { return };
//! let server = RedisServer::start();
//! assert_eq!(server.command(&["PING"]).unwrap(), "PONG");
//! ```

pub mod fuzz;

use std::fs::{self, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

/// The only address servers listen on.
const HOST: Ipv4Addr = Ipv4Addr::LOCALHOST;
/// Connect / read / write timeout of [`command`].
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// How many fresh ports a start tries when redis cannot bind the one picked.
const START_ATTEMPTS: usize = 5;
/// How long a (re)started server has to answer `PING` with `PONG`.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a restart keeps retrying while its port is briefly taken.
const RESTART_BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a new cluster has to report `cluster_state:ok` on every node.
const CLUSTER_TIMEOUT: Duration = Duration::from_secs(20);
/// Polling interval of every wait here.
const POLL: Duration = Duration::from_millis(10);
/// A cluster node's port must leave room for its bus port (port + 10000).
const MAX_CLUSTER_PORT: u16 = 55_000;
/// Redis' cluster bus listens on the client port plus this.
const CLUSTER_BUS_OFFSET: u16 = 10_000;
/// The server's own log file, inside its directory.
const LOG_FILE: &str = "redis.log";
/// The server's stdout and stderr (errors before the log file is open), inside its directory.
const STDIO_FILE: &str = "stdio.log";
/// A TLS server's CA certificate (PEM), inside its directory.
const CA_CERT_FILE: &str = "ca.crt";
/// A TLS server's CA private key, inside its directory.
const CA_KEY_FILE: &str = "ca.key";
/// A TLS server's certificate (PEM, signed by the CA), inside its directory.
const SERVER_CERT_FILE: &str = "server.crt";
/// A TLS server's private key, inside its directory.
const SERVER_KEY_FILE: &str = "server.key";
/// How long the generated certificates are valid.
const CERT_DAYS: &str = "7";
/// How long a new replica has to report `master_link_status:up`.
const REPLICA_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a new Sentinel has to name its master and see its replicas.
const SENTINEL_TIMEOUT: Duration = Duration::from_secs(15);
/// A Sentinel's configuration file, inside its directory (Sentinel rewrites it).
const SENTINEL_CONF: &str = "sentinel.conf";
/// A Sentinel's own log file, inside its directory.
const SENTINEL_LOG: &str = "sentinel.log";

/// Whether `redis-server` can be used by the tests of this run.
///
/// Returns `Some(())` when `redis-server` is an executable on `PATH`. When it
/// is missing: panics if the environment variable `CI` is set (non-empty) —
/// "redis-server is required in CI" — and otherwise prints a loud
/// "skipping: redis-server not found" to stderr and returns `None`, so a test
/// can start with `let Some(()) = redis_available() else { return };`.
pub fn redis_available() -> Option<()> {
    if find_on_path("redis-server").is_some() {
        return Some(());
    }
    if std::env::var_os("CI").is_some_and(|v| !v.is_empty()) {
        panic!("redis-server is required in CI, but it is not on PATH");
    }
    eprintln!(
        "\n************************************************************\n\
         *** skipping: redis-server not found on PATH             ***\n\
         ************************************************************\n"
    );
    None
}

/// The first executable file called `name` in a directory of `PATH`.
fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| {
            fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Sends one command to the Redis server on `127.0.0.1:port` and returns its reply as text.
///
/// A fresh connection per call, with a 5 s connect, read and write timeout
/// (see [`command_timeout`] for another one). The reply is rendered as:
/// simple strings and bulk strings as their text (bulk strings decoded as
/// lossy UTF-8, e.g. `INFO` keeps its `\r\n` line ends), integers in decimal,
/// a nil bulk string or nil array as `(nil)`, and arrays as their elements'
/// renderings joined by `\n`. An error reply (`-ERR …`) at the top level is
/// returned as an [`io::Error`] of kind [`io::ErrorKind::Other`] whose
/// message is the error text; inside an array it is rendered as its text.
pub fn command(port: u16, args: &[&str]) -> io::Result<String> {
    command_timeout(port, args, DEFAULT_TIMEOUT)
}

/// [`command`] with `timeout` as the connect, read and write timeout.
///
/// A stopped server (see [`RedisServer::stop`]) still accepts connections
/// (the kernel does that), so a command to it fails with a read timeout
/// ([`io::ErrorKind::WouldBlock`] or [`io::ErrorKind::TimedOut`]).
pub fn command_timeout(port: u16, args: &[&str], timeout: Duration) -> io::Result<String> {
    let stream = TcpStream::connect_timeout(&SocketAddr::from((HOST, port)), timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.set_nodelay(true)?;
    (&stream).write_all(&encode_command(args))?;
    match read_reply(&mut BufReader::new(&stream))? {
        Reply::Error(message) => Err(io::Error::other(message)),
        reply => Ok(reply.render()),
    }
}

/// `args` as a RESP array of bulk strings.
fn encode_command(args: &[&str]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// One RESP2 reply.
#[derive(Debug, PartialEq)]
enum Reply {
    /// `+text`
    Simple(String),
    /// `-text`
    Error(String),
    /// `:n`
    Integer(i64),
    /// `$len` + data, `None` for `$-1`.
    Bulk(Option<String>),
    /// `*len` + elements, `None` for `*-1`.
    Array(Option<Vec<Reply>>),
}

impl Reply {
    /// The textual form documented on [`command`].
    fn render(&self) -> String {
        match self {
            Reply::Simple(s) | Reply::Error(s) | Reply::Bulk(Some(s)) => s.clone(),
            Reply::Integer(n) => n.to_string(),
            Reply::Bulk(None) | Reply::Array(None) => "(nil)".to_owned(),
            Reply::Array(Some(items)) => items
                .iter()
                .map(Reply::render)
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

/// Reads one whole reply (recursively for arrays).
fn read_reply(reader: &mut impl BufRead) -> io::Result<Reply> {
    let line = read_line(reader)?;
    let (kind, rest) = line
        .split_at_checked(1)
        .ok_or_else(|| protocol_error("empty reply line"))?;
    let length = |rest: &str| -> io::Result<i64> {
        rest.parse()
            .map_err(|_| protocol_error(&format!("bad length {rest:?}")))
    };
    Ok(match kind {
        "+" => Reply::Simple(rest.to_owned()),
        "-" => Reply::Error(rest.to_owned()),
        ":" => Reply::Integer(length(rest)?),
        "$" => match usize::try_from(length(rest)?) {
            Err(_) => Reply::Bulk(None),
            Ok(len) => {
                let mut data = vec![0; len + 2];
                reader.read_exact(&mut data)?;
                if !data.ends_with(b"\r\n") {
                    return Err(protocol_error("bulk string not terminated by CRLF"));
                }
                data.truncate(len);
                Reply::Bulk(Some(String::from_utf8_lossy(&data).into_owned()))
            }
        },
        "*" => match usize::try_from(length(rest)?) {
            Err(_) => Reply::Array(None),
            Ok(len) => Reply::Array(Some(
                (0..len)
                    .map(|_| read_reply(reader))
                    .collect::<io::Result<_>>()?,
            )),
        },
        _ => return Err(protocol_error(&format!("unknown reply type in {line:?}"))),
    })
}

/// One CRLF-terminated line, without the CRLF.
fn read_line(reader: &mut impl BufRead) -> io::Result<String> {
    let mut line = Vec::new();
    reader.read_until(b'\n', &mut line)?;
    if !line.ends_with(b"\r\n") {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed mid-reply",
        ));
    }
    line.truncate(line.len() - 2);
    String::from_utf8(line).map_err(|_| protocol_error("reply line is not UTF-8"))
}

/// An [`io::ErrorKind::InvalidData`] error for a malformed reply.
fn protocol_error(message: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("RESP protocol error: {message}"),
    )
}

/// How a [`RedisServer`] is configured.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// `--appendonly yes|no`: whether writes go to the append-only file (in the server's directory).
    pub appendonly: bool,
    /// `--appendfsync`: `"always"`, `"everysec"` or `"no"`.
    pub appendfsync: &'static str,
    /// More command-line arguments, appended after the fixed ones (e.g. `["--maxmemory", "10mb"]`).
    ///
    /// If they contain `--cluster-enabled`, the port is chosen so that the
    /// cluster bus port (port + 10000) is free as well.
    pub extra: Vec<String>,
    /// Serve TLS only (no plain-text port).
    ///
    /// At its first start the server gets, in its directory and made with the
    /// `openssl` command-line tool, a throwaway CA (`ca.key`, `ca.crt`, see
    /// [`RedisServer::ca_file`]) and a certificate for IP `127.0.0.1` and DNS
    /// `localhost` signed by it (`server.key`, `server.crt`); it then runs
    /// with `--port 0 --tls-port P --tls-cert-file … --tls-key-file …
    /// --tls-ca-cert-file ca.crt --tls-auth-clients no`. Its
    /// [`RedisServer::url`] is `rediss://127.0.0.1:P/0`, and
    /// [`RedisServer::command`] talks to it through `openssl s_client`,
    /// verifying its certificate against the CA. Not supported for cluster
    /// nodes, replicas or Sentinel-monitored masters.
    pub tls: bool,
}

impl Default for RedisOptions {
    /// No append-only file, `everysec`, no extra arguments, no TLS.
    fn default() -> Self {
        RedisOptions {
            appendonly: false,
            appendfsync: "everysec",
            extra: Vec::new(),
            tls: false,
        }
    }
}

impl RedisOptions {
    /// Whether these options make a cluster node, which also listens on port + 10000.
    fn cluster_enabled(&self) -> bool {
        self.extra.iter().any(|arg| arg == "--cluster-enabled")
    }
}

/// Why launching a `redis-server` process did not give a ready server.
enum LaunchError {
    /// The port (or the cluster bus port) was taken: try again (another port, or later).
    PortBusy(String),
    /// Anything else: give up.
    Failed(String),
}

/// A `redis-server` child process listening on `127.0.0.1`, with its own temporary directory.
///
/// Dropping it kills the process with `SIGKILL`, reaps it (no zombie is left)
/// and removes the directory.
#[derive(Debug)]
pub struct RedisServer {
    /// The running process; `None` after [`RedisServer::kill9`].
    child: Option<Child>,
    /// The pid of the last process started.
    pid: u32,
    /// The port it listens on (kept across restarts).
    port: u16,
    /// The options it was started with (kept across restarts).
    opts: RedisOptions,
    /// Its `--dir`: log, append-only file, `nodes.conf`, TLS files.
    dir: tempfile::TempDir,
    /// `dir/ca.crt` (meaningful with TLS only).
    ca_path: PathBuf,
}

impl RedisServer {
    /// Starts a server with [`RedisOptions::default`]; see [`RedisServer::start_with`].
    pub fn start() -> RedisServer {
        RedisServer::start_with(RedisOptions::default())
    }

    /// Starts a server on a free port of `127.0.0.1` and waits until it answers `PING`.
    ///
    /// Runs `redis-server --bind 127.0.0.1 --port N --dir <tmp> --save ""
    /// --appendonly yes|no --appendfsync X --protected-mode no --daemonize no
    /// --logfile <tmp>/redis.log` followed by `opts.extra`. The port comes from
    /// binding `127.0.0.1:0`; since another test may grab it before redis
    /// does, the whole start is retried on a new port (up to 5 times) when
    /// redis reports the address in use. Waits up to 10 s, polling `PING`
    /// every 10 ms, for `PONG` from this very process (checked through
    /// `INFO server`'s `process_id`, so a server of another test that took
    /// the port is not mistaken for it).
    ///
    /// # Panics
    ///
    /// If `redis-server` cannot be spawned, exits, or does not answer in
    /// time; the message carries the tail of its log.
    pub fn start_with(opts: RedisOptions) -> RedisServer {
        let dir = new_tempdir();
        let mut server = RedisServer {
            child: None,
            pid: 0,
            port: 0,
            ca_path: dir.path().join(CA_CERT_FILE),
            dir,
            opts,
        };
        let mut last_error = String::new();
        for attempt in 1..=START_ATTEMPTS {
            server.port = free_port(server.opts.cluster_enabled());
            match server.launch() {
                Ok(()) => return server,
                Err(LaunchError::PortBusy(log)) => {
                    release_port(server.port, server.opts.cluster_enabled());
                    last_error = log;
                    // Whatever the failed attempt left (a nodes.conf naming the old port…) goes.
                    if attempt < START_ATTEMPTS {
                        server.dir = new_tempdir();
                        server.ca_path = server.dir.path().join(CA_CERT_FILE);
                    }
                }
                Err(LaunchError::Failed(message)) => panic!("{message}"),
            }
        }
        panic!(
            "redis-server could not bind a free port in {START_ATTEMPTS} attempts; last log:\n{last_error}"
        );
    }

    /// The port it listens on, on `127.0.0.1`.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its URL: `redis://127.0.0.1:PORT/0`, or `rediss://127.0.0.1:PORT/0` with [`RedisOptions::tls`].
    pub fn url(&self) -> String {
        let scheme = if self.opts.tls { "rediss" } else { "redis" };
        format!("{scheme}://{HOST}:{}/0", self.port)
    }

    /// Whether it serves TLS ([`RedisOptions::tls`]).
    pub fn is_tls(&self) -> bool {
        self.opts.tls
    }

    /// The CA certificate (PEM) its TLS certificate is signed by; `None` without [`RedisOptions::tls`].
    ///
    /// Trust this file (e.g. `SSL_CERT_FILE=<it>` for a client that reads
    /// the system roots) to verify the server. It stays the same across
    /// [`RedisServer::restart`]s.
    pub fn ca_file(&self) -> Option<&Path> {
        self.opts.tls.then_some(self.ca_path.as_path())
    }

    /// The pid of its process (of the latest one after a [`RedisServer::restart`]).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Its working directory (`--dir`): log file, append-only file, `nodes.conf`.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Kills the process with `SIGKILL` and waits for it; no-op if it is not running.
    ///
    /// The directory (and so the append-only file) is kept, for
    /// [`RedisServer::restart`].
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Fails only if it already exited; wait reaps it either way.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes the process with `SIGSTOP`, and returns once it is stopped.
    ///
    /// It keeps its port (connections are still accepted by the kernel) but
    /// answers nothing until [`RedisServer::cont`].
    ///
    /// # Panics
    ///
    /// If the server is not running or the signal cannot be sent.
    pub fn stop(&self) {
        self.signal("STOP");
        self.wait_for_state(|state| state == 'T', "stopped");
    }

    /// Resumes the process stopped by [`RedisServer::stop`] with `SIGCONT`, and returns once it runs.
    ///
    /// # Panics
    ///
    /// If the server is not running or the signal cannot be sent.
    pub fn cont(&self) {
        self.signal("CONT");
        self.wait_for_state(|state| state != 'T', "continued");
    }

    /// Starts the server again: same port, same directory, same options.
    ///
    /// If it is running, it is [`RedisServer::kill9`]ed first. With
    /// `appendonly`, it reloads its append-only file. Waits for `PONG` as
    /// [`RedisServer::start_with`] does; if the port is briefly taken by
    /// someone else, keeps retrying for up to 5 s.
    ///
    /// # Panics
    ///
    /// If it cannot start or does not answer in time.
    pub fn restart(&mut self) {
        self.kill9();
        let deadline = Instant::now() + RESTART_BUSY_TIMEOUT;
        loop {
            match self.launch() {
                Ok(()) => return,
                Err(LaunchError::PortBusy(_)) if Instant::now() < deadline => {
                    sleep(Duration::from_millis(100));
                }
                Err(LaunchError::PortBusy(log)) => panic!(
                    "redis-server could not get its port {} back within {RESTART_BUSY_TIMEOUT:?}; log:\n{log}",
                    self.port
                ),
                Err(LaunchError::Failed(message)) => panic!("{message}"),
            }
        }
    }

    /// Sends one command to this server; see the free function [`command`].
    ///
    /// With [`RedisOptions::tls`] the command goes through `openssl s_client`
    /// (a process per call), which verifies the server's certificate against
    /// [`RedisServer::ca_file`] and IP `127.0.0.1`; the reply is rendered the
    /// same way, and a failed handshake is an error carrying `openssl`'s
    /// messages.
    pub fn command(&self, args: &[&str]) -> io::Result<String> {
        self.command_timeout(args, DEFAULT_TIMEOUT)
    }

    /// [`RedisServer::command`] with `timeout` as the bound (connect, read and write; the whole call with TLS).
    pub fn command_timeout(&self, args: &[&str], timeout: Duration) -> io::Result<String> {
        if self.opts.tls {
            tls_command(self.port, &self.ca_path, args, timeout)
        } else {
            command_timeout(self.port, args, timeout)
        }
    }

    /// Starts a replica of `master` (`--replicaof 127.0.0.1 MASTER_PORT`), waiting until it is in sync.
    ///
    /// Default options otherwise; returns once the replica's `INFO
    /// replication` shows `master_link_status:up` (at most 10 s).
    ///
    /// # Panics
    ///
    /// If `master` serves TLS (not supported), or the replica does not
    /// start or link up in time (the message carries both logs' tails).
    pub fn replica_of(master: &RedisServer) -> RedisServer {
        assert!(
            !master.opts.tls,
            "replicas of TLS servers are not supported by the testkit"
        );
        let replica = RedisServer::start_with(RedisOptions {
            extra: vec![
                "--replicaof".into(),
                HOST.to_string(),
                master.port.to_string(),
            ],
            ..RedisOptions::default()
        });
        let deadline = Instant::now() + REPLICA_TIMEOUT;
        loop {
            let info = replica
                .command(&["INFO", "replication"])
                .unwrap_or_else(|e| format!("error: {e}"));
            if info
                .lines()
                .any(|line| line.trim_end() == "master_link_status:up")
            {
                return replica;
            }
            if Instant::now() >= deadline {
                panic!(
                    "replica on port {} of 127.0.0.1:{} not linked up within {REPLICA_TIMEOUT:?}; \
                     INFO replication:\n{info}\nreplica {}master {}",
                    replica.port,
                    master.port,
                    replica.log_tail(),
                    master.log_tail()
                );
            }
            sleep(POLL);
        }
    }

    /// Blocks until `replica` has everything this master has written so
    /// far: its `slave_repl_offset` reaches this master's
    /// `master_repl_offset`, with the link up.
    ///
    /// Not `WAIT`: it counts only the writes of the connection that sends
    /// it, so sent on a connection of its own (as [`RedisServer::command`]
    /// does) it answers at once, whatever the replica lacks.
    ///
    /// # Panics
    ///
    /// If either server does not answer, or the replica does not catch up
    /// within `within`.
    pub fn wait_replicated(&self, replica: &RedisServer, within: Duration) {
        fn offset(info: &str, field: &str) -> u64 {
            info.lines()
                .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("no {field} in INFO replication: {info}"))
        }
        let info = self
            .command(&["INFO", "replication"])
            .expect("the master answers INFO");
        let written = offset(&info, "master_repl_offset");
        let asked = Instant::now();
        loop {
            let info = replica
                .command(&["INFO", "replication"])
                .expect("the replica answers INFO");
            if info.contains("master_link_status:up")
                && offset(&info, "slave_repl_offset") >= written
            {
                return;
            }
            assert!(
                asked.elapsed() < within,
                "the replica did not reach offset {written} within {within:?}: {info}"
            );
            sleep(Duration::from_millis(20));
        }
    }

    /// Spawns `redis-server` on `self.port` in `self.dir` and waits until it answers.
    fn launch(&mut self) -> Result<(), LaunchError> {
        debug_assert!(self.child.is_none());
        let dir = self.dir.path().to_owned();
        if self.opts.tls && !dir.join(SERVER_CERT_FILE).exists() {
            make_certificates(&dir).map_err(LaunchError::Failed)?;
        }
        let stdio = OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(STDIO_FILE))
            .and_then(|file| Ok((file.try_clone()?, file)))
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.join(STDIO_FILE).display()));
        let mut cmd = Command::new("redis-server");
        cmd.arg("--bind").arg(HOST.to_string());
        if self.opts.tls {
            cmd.args(["--port", "0", "--tls-port"])
                .arg(self.port.to_string())
                .arg("--tls-cert-file")
                .arg(dir.join(SERVER_CERT_FILE))
                .arg("--tls-key-file")
                .arg(dir.join(SERVER_KEY_FILE))
                .arg("--tls-ca-cert-file")
                .arg(dir.join(CA_CERT_FILE))
                .args(["--tls-auth-clients", "no"]);
        } else {
            cmd.arg("--port").arg(self.port.to_string());
        }
        cmd.arg("--dir")
            .arg(&dir)
            .arg("--save")
            .arg("")
            .arg("--appendonly")
            .arg(if self.opts.appendonly { "yes" } else { "no" })
            .arg("--appendfsync")
            .arg(self.opts.appendfsync)
            .arg("--protected-mode")
            .arg("no")
            .arg("--daemonize")
            .arg("no")
            .arg("--logfile")
            .arg(dir.join(LOG_FILE))
            .args(&self.opts.extra)
            .stdin(Stdio::null())
            .stdout(stdio.0)
            .stderr(stdio.1);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot spawn redis-server: {e}"));
        self.pid = child.id();
        self.child = Some(child);

        let deadline = Instant::now() + READY_TIMEOUT;
        let pid_line = format!("process_id:{}", self.pid);
        loop {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                let log = self.log_tail();
                return Err(if log.contains("Address already in use") {
                    LaunchError::PortBusy(log)
                } else {
                    LaunchError::Failed(format!(
                        "redis-server on port {} exited ({status}) during startup; log:\n{log}",
                        self.port
                    ))
                });
            }
            // PONG may come from another test's server that took the port; ours then exits.
            if self
                .command_timeout(&["PING"], Duration::from_secs(1))
                .is_ok_and(|r| r == "PONG")
                && self
                    .command(&["INFO", "server"])
                    .is_ok_and(|info| info.lines().any(|line| line.trim_end() == pid_line))
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.kill9();
                return Err(LaunchError::Failed(format!(
                    "redis-server on port {} did not answer PING within {READY_TIMEOUT:?}; log:\n{}",
                    self.port,
                    self.log_tail()
                )));
            }
            sleep(POLL);
        }
    }

    /// Sends `SIGname` to the running process through `kill(1)`.
    fn signal(&self, name: &str) {
        assert!(
            self.child.is_some(),
            "redis-server on port {} is not running",
            self.port
        );
        let status = Command::new("kill")
            .args(["-s", name, &self.pid.to_string()])
            .status()
            .unwrap_or_else(|e| panic!("cannot run kill: {e}"));
        assert!(
            status.success(),
            "kill -s {name} {} failed: {status}",
            self.pid
        );
    }

    /// Waits (up to 5 s) until the process state letter in `/proc/PID/stat` satisfies `wanted`.
    fn wait_for_state(&self, wanted: impl Fn(char) -> bool, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let stat_path = format!("/proc/{}/stat", self.pid);
        loop {
            let state = fs::read_to_string(&stat_path).ok().and_then(|stat| {
                // "pid (comm) S ...": the comm may hold anything, so look after its last ')'.
                stat.rsplit_once(')')
                    .and_then(|(_, rest)| rest.trim_start().chars().next())
            });
            match state {
                Some(state) if wanted(state) => return,
                // No procfs (not Linux): trust the signal.
                None if !Path::new("/proc/self/stat").exists() => return,
                _ if Instant::now() >= deadline => {
                    panic!("redis-server (pid {}) was not {what} within 5 s", self.pid)
                }
                _ => sleep(POLL),
            }
        }
    }

    /// The last lines of its log file and of its stdout/stderr, for panic messages.
    fn log_tail(&self) -> String {
        log_tail(self.dir.path(), &[LOG_FILE, STDIO_FILE])
    }
}

/// The last lines of the files `names` in `dir`, for panic messages.
fn log_tail(dir: &Path, names: &[&str]) -> String {
    let mut out = String::new();
    for name in names {
        let text = fs::read_to_string(dir.join(name)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        out.push_str(&format!("--- {name} (last lines) ---\n"));
        for line in &lines[lines.len().saturating_sub(30)..] {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

impl Drop for RedisServer {
    /// `SIGKILL`s and reaps the process; the directory is removed afterwards.
    fn drop(&mut self) {
        self.kill9();
        release_port(self.port, self.opts.cluster_enabled());
    }
}

/// A fresh temporary directory for one server.
fn new_tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("allowance-redis-")
        .tempdir()
        .unwrap_or_else(|e| panic!("cannot create a temporary directory: {e}"))
}

/// Whether `127.0.0.1:port` can be bound right now.
fn port_is_free(port: u16) -> bool {
    TcpListener::bind((HOST, port)).is_ok()
}

/// Ports handed out by [`free_port`] whose server is alive, up or down: a
/// killed server gets its port back at restart, so no other server of this
/// process may take it meanwhile. (One did in CI: a test's store reached
/// another test's fresh server on the port of its killed master.)
static HELD_PORTS: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// Where [`free_port`] starts looking: below it sit the well-known ports.
const LOWEST_PORT: u16 = 10_000;

/// A port of `127.0.0.1` that was free a moment ago, held for its server
/// until [`release_port`].
///
/// Picked at random below the kernel's ephemeral range
/// (`/proc/sys/net/ipv4/ip_local_port_range`), where no `bind(0)` and no
/// outgoing connection of any process lands on it while its server is down
/// for a restart; from the kernel (port 0) when that range leaves no room.
///
/// With `cluster_bus`, the port is at most 55000 and port + 10000 was free too.
fn free_port(cluster_bus: bool) -> u16 {
    let mut held = HELD_PORTS.lock().unwrap_or_else(|e| e.into_inner());
    let ephemeral_start = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    // The bus port (+10000) stays below the ephemeral range too.
    let top = match cluster_bus {
        true => ephemeral_start.saturating_sub(CLUSTER_BUS_OFFSET),
        false => ephemeral_start,
    };
    let mut x = random_seed();
    let below_ephemeral = (0..1_000)
        .take_while(|_| top > LOWEST_PORT + 1_000)
        .map(|_| {
            // xorshift64: enough to spread concurrent test binaries apart.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            LOWEST_PORT + (x % u64::from(top - LOWEST_PORT)) as u16
        });
    let from_kernel = (0..10_000).map(|_| {
        TcpListener::bind((HOST, 0))
            .and_then(|listener| listener.local_addr())
            .unwrap_or_else(|e| panic!("cannot bind 127.0.0.1:0: {e}"))
            .port()
    });
    pick_port(below_ephemeral.chain(from_kernel), cluster_bus, &mut held).unwrap_or_else(|| {
        panic!("found no free port pair P, P+{CLUSTER_BUS_OFFSET} with P <= {MAX_CLUSTER_PORT}")
    })
}

/// The first of `candidates` that is free and not `held` (with its bus
/// port, for a cluster node), now held.
fn pick_port(
    candidates: impl Iterator<Item = u16>,
    cluster_bus: bool,
    held: &mut std::collections::BTreeSet<u16>,
) -> Option<u16> {
    let port = candidates
        .filter(|port| !held.contains(port) && port_is_free(*port))
        .find(|&port| {
            !cluster_bus
                || (port <= MAX_CLUSTER_PORT
                    && !held.contains(&(port + CLUSTER_BUS_OFFSET))
                    && port_is_free(port + CLUSTER_BUS_OFFSET))
        })?;
    held.insert(port);
    if cluster_bus {
        held.insert(port + CLUSTER_BUS_OFFSET);
    }
    Some(port)
}

/// Gives back a port from [`free_port`] (its server is gone for good).
fn release_port(port: u16, cluster_bus: bool) {
    let mut held = HELD_PORTS.lock().unwrap_or_else(|e| e.into_inner());
    held.remove(&port);
    if cluster_bus {
        held.remove(&(port + CLUSTER_BUS_OFFSET));
    }
}

/// A seed that differs between processes and calls.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish() | 1
}

/// A Redis Cluster of masters only (no replicas), each a [`RedisServer`], all slots assigned.
///
/// Dropping it drops (kills) every node.
#[derive(Debug)]
pub struct RedisCluster {
    /// Its nodes, in the order given to `redis-cli --cluster create`.
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts a cluster of `masters` masters with default node options; see [`RedisCluster::start_with`].
    pub fn start(masters: usize) -> RedisCluster {
        RedisCluster::start_with(masters, RedisOptions::default())
    }

    /// Starts `masters` cluster nodes with `opts` and joins them into one cluster.
    ///
    /// Each node is a [`RedisServer`] with `opts` plus `--cluster-enabled yes
    /// --cluster-config-file nodes.conf --cluster-node-timeout 5000`, on a
    /// port P ≤ 55000 whose bus port P + 10000 is free too. Then runs
    /// `redis-cli --cluster create 127.0.0.1:P1 … --cluster-replicas 0
    /// --cluster-yes`, which spreads the 16384 slots evenly, and waits up to
    /// 20 s until every node reports `cluster_state:ok` in `CLUSTER INFO`.
    ///
    /// # Panics
    ///
    /// If `masters < 3` (`redis-cli --cluster create` needs three), if
    /// `opts.tls` (not supported), if `redis-cli` is missing or fails, or if
    /// the cluster does not become ok in time.
    pub fn start_with(masters: usize, mut opts: RedisOptions) -> RedisCluster {
        assert!(
            !opts.tls,
            "TLS cluster nodes are not supported by the testkit"
        );
        assert!(
            masters >= 3,
            "redis-cli --cluster create needs at least 3 masters, got {masters}"
        );
        opts.extra.extend(
            [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "5000",
            ]
            .map(String::from),
        );
        let cluster = RedisCluster {
            nodes: (0..masters)
                .map(|_| RedisServer::start_with(opts.clone()))
                .collect(),
        };

        let output = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(
                cluster
                    .nodes
                    .iter()
                    .map(|node| format!("{HOST}:{}", node.port())),
            )
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run redis-cli (is it on PATH?): {e}"));
        let transcript = format!(
            "redis-cli --cluster create: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(output.status.success(), "{transcript}");

        let deadline = Instant::now() + CLUSTER_TIMEOUT;
        loop {
            let infos: Vec<String> = cluster
                .nodes
                .iter()
                .map(|node| {
                    node.command(&["CLUSTER", "INFO"])
                        .unwrap_or_else(|e| format!("error: {e}"))
                })
                .collect();
            if infos.iter().all(|info| {
                info.lines()
                    .any(|line| line.trim_end() == "cluster_state:ok")
            }) {
                return cluster;
            }
            if Instant::now() >= deadline {
                panic!(
                    "cluster not ok within {CLUSTER_TIMEOUT:?}; CLUSTER INFO per node: {infos:#?}\n{transcript}"
                );
            }
            sleep(POLL);
        }
    }

    /// Every node's URL (`redis://127.0.0.1:PORT/0`), in node order.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// Its nodes, in node order.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// Its nodes, mutably: to [`RedisServer::kill9`] or [`RedisServer::restart`] one.
    pub fn nodes_mut(&mut self) -> &mut [RedisServer] {
        &mut self.nodes
    }
}

/// Makes, with the `openssl` command-line tool, a throwaway CA and a server certificate for
/// `127.0.0.1` / `localhost` signed by it, in `dir` (see [`RedisOptions::tls`]).
fn make_certificates(dir: &Path) -> Result<(), String> {
    let ext = "subjectAltName = IP:127.0.0.1, DNS:localhost\n\
               basicConstraints = critical, CA:FALSE\n\
               keyUsage = critical, digitalSignature\n\
               extendedKeyUsage = serverAuth\n";
    fs::write(dir.join("server.ext"), ext)
        .map_err(|e| format!("cannot write {}: {e}", dir.join("server.ext").display()))?;
    let p256 = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let steps: [Vec<&str>; 3] = [
        [
            &["req", "-x509"][..],
            &p256,
            &["-keyout", CA_KEY_FILE, "-out", CA_CERT_FILE],
        ]
        .concat()
        .into_iter()
        .chain([
            "-days",
            CERT_DAYS,
            "-subj",
            "/CN=allowance-testkit CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ])
        .collect(),
        [&["req", "-new"][..], &p256, &["-keyout", SERVER_KEY_FILE]]
            .concat()
            .into_iter()
            .chain(["-out", "server.csr", "-subj", "/CN=127.0.0.1"])
            .collect(),
        vec![
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            CA_CERT_FILE,
            "-CAkey",
            CA_KEY_FILE,
            "-CAcreateserial",
            "-days",
            CERT_DAYS,
            "-extfile",
            "server.ext",
            "-out",
            SERVER_CERT_FILE,
        ],
    ];
    for step in steps {
        let output = Command::new("openssl")
            .args(&step)
            .current_dir(dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run openssl (is it on PATH?): {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "openssl {} failed ({}):\n{}{}",
                step.join(" "),
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
    Ok(())
}

/// [`command_timeout`] to a TLS server, through an `openssl s_client` process.
///
/// The server's certificate is verified against `ca_file` and IP
/// `127.0.0.1`. `timeout` bounds the whole call (handshake included): the
/// process is killed when it has not produced a complete reply by then
/// ([`io::ErrorKind::TimedOut`]). A failed connection or handshake is an
/// error carrying `openssl`'s messages.
fn tls_command(port: u16, ca_file: &Path, args: &[&str], timeout: Duration) -> io::Result<String> {
    let mut child = Command::new("openssl")
        .arg("s_client")
        .arg("-connect")
        .arg(format!("{HOST}:{port}"))
        // No session output on stdout (only the server's bytes), and the end
        // of stdin does not end the connection.
        .arg("-quiet")
        .arg("-verify_return_error")
        .arg("-CAfile")
        .arg(ca_file)
        .arg("-verify_ip")
        .arg(HOST.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| io::Error::new(e.kind(), format!("cannot run openssl s_client: {e}")))?;
    let stdout = child.stdout.take().expect("piped stdout");
    let (sender, receiver) = std::sync::mpsc::channel();
    // Ends when the reply is read or the process is gone (its stdout closes).
    std::thread::spawn(move || {
        let _ = sender.send(read_reply(&mut BufReader::new(stdout)));
    });
    // Fails only when the process already exited (refused, bad handshake): the reader says so.
    let _ = child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(&encode_command(args));
    let outcome = receiver.recv_timeout(timeout);
    let _ = child.kill();
    let _ = child.wait();
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        let _ = io::Read::read_to_string(&mut pipe, &mut stderr);
    }
    match outcome {
        Ok(Ok(Reply::Error(message))) => Err(io::Error::other(message)),
        Ok(Ok(reply)) => Ok(reply.render()),
        Ok(Err(e)) => Err(io::Error::new(
            e.kind(),
            format!(
                "TLS command to {HOST}:{port} failed: {e}; openssl s_client said: {}",
                stderr.trim()
            ),
        )),
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no reply over TLS from {HOST}:{port} within {timeout:?}"),
        )),
    }
}

/// A Redis Sentinel process monitoring one master, listening on `127.0.0.1`, with its own
/// temporary directory.
///
/// Dropping it kills the process with `SIGKILL`, reaps it and removes the
/// directory, like a [`RedisServer`].
#[derive(Debug)]
pub struct RedisSentinel {
    /// The running process; `None` after [`RedisSentinel::kill9`].
    child: Option<Child>,
    /// Its pid.
    pid: u32,
    /// The port it listens on.
    port: u16,
    /// Its directory: `sentinel.conf` (rewritten by Sentinel), its log.
    dir: tempfile::TempDir,
}

impl RedisSentinel {
    /// Starts a Sentinel monitoring `master` under `name`, with quorum 1.
    ///
    /// Writes, in its own temporary directory, a `sentinel.conf` with `port
    /// SP`, `bind 127.0.0.1`, `sentinel resolve-hostnames no`, `sentinel
    /// monitor NAME 127.0.0.1 MASTER_PORT 1`, `sentinel
    /// down-after-milliseconds NAME 1000` and `sentinel failover-timeout NAME
    /// 5000`, and runs `redis-server sentinel.conf --sentinel` (retried on a
    /// new port, up to 5 times, when the port is taken). Returns once
    /// `SENTINEL get-master-addr-by-name NAME` answers the master's port and
    /// the Sentinel knows as many replicas as the master has connected (so a
    /// failover can promote one), within 15 s.
    ///
    /// # Panics
    ///
    /// If `master` serves TLS (not supported), `name` is empty or holds
    /// whitespace, or the Sentinel cannot start or be ready in time (the
    /// message carries its log's tail).
    pub fn start(master: &RedisServer, name: &str) -> RedisSentinel {
        assert!(
            !master.opts.tls,
            "Sentinel over TLS is not supported by the testkit"
        );
        assert!(
            !name.is_empty() && !name.contains(char::is_whitespace),
            "bad master name {name:?}"
        );
        let mut last_error = String::new();
        for _ in 0..START_ATTEMPTS {
            let mut sentinel = RedisSentinel {
                child: None,
                pid: 0,
                port: free_port(false),
                dir: new_tempdir(),
            };
            match sentinel.launch(master, name) {
                Ok(()) => return sentinel,
                Err(LaunchError::PortBusy(log)) => last_error = log,
                Err(LaunchError::Failed(message)) => panic!("{message}"),
            }
        }
        panic!(
            "redis sentinel could not bind a free port in {START_ATTEMPTS} attempts; last log:\n{last_error}"
        );
    }

    /// The port it listens on, on `127.0.0.1`.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The store URL of the master it monitors as `name`: `redis+sentinel://127.0.0.1:SP/NAME/0`.
    pub fn url(&self, name: &str) -> String {
        format!("redis+sentinel://{HOST}:{}/{name}/0", self.port)
    }

    /// The pid of its process.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Its directory: `sentinel.conf`, `sentinel.log`.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Sends one command to it; see the free function [`command`].
    pub fn command(&self, args: &[&str]) -> io::Result<String> {
        command(self.port, args)
    }

    /// The port of the master it names for `name` now (`SENTINEL get-master-addr-by-name`).
    ///
    /// `None` when it does not answer or knows no such master.
    pub fn master_port(&self, name: &str) -> Option<u16> {
        let reply = self
            .command(&["SENTINEL", "get-master-addr-by-name", name])
            .ok()?;
        let mut lines = reply.lines();
        match (lines.next(), lines.next()) {
            (Some(_host), Some(port)) => port.trim().parse().ok(),
            _ => None,
        }
    }

    /// Kills the process with `SIGKILL` and waits for it; no-op if it is not running.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Writes the configuration, spawns the Sentinel and waits until it is ready (see [`RedisSentinel::start`]).
    fn launch(&mut self, master: &RedisServer, name: &str) -> Result<(), LaunchError> {
        let dir = self.dir.path().to_owned();
        let conf = format!(
            "port {port}\n\
             bind {HOST}\n\
             protected-mode no\n\
             daemonize no\n\
             dir {dir}\n\
             logfile {log}\n\
             sentinel resolve-hostnames no\n\
             sentinel monitor {name} {HOST} {master_port} 1\n\
             sentinel down-after-milliseconds {name} 1000\n\
             sentinel failover-timeout {name} 5000\n",
            port = self.port,
            dir = dir.display(),
            log = dir.join(SENTINEL_LOG).display(),
            master_port = master.port,
        );
        let conf_path = dir.join(SENTINEL_CONF);
        fs::write(&conf_path, conf)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", conf_path.display()));
        let stdio = OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(STDIO_FILE))
            .and_then(|file| Ok((file.try_clone()?, file)))
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.join(STDIO_FILE).display()));
        let child = Command::new("redis-server")
            .arg(&conf_path)
            .arg("--sentinel")
            .stdin(Stdio::null())
            .stdout(stdio.0)
            .stderr(stdio.1)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot spawn redis-server --sentinel: {e}"));
        self.pid = child.id();
        self.child = Some(child);

        let deadline = Instant::now() + SENTINEL_TIMEOUT;
        let pid_line = format!("process_id:{}", self.pid);
        let mut seen = String::new();
        loop {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                let log = log_tail(&dir, &[SENTINEL_LOG, STDIO_FILE]);
                return Err(if log.contains("Address already in use") {
                    LaunchError::PortBusy(log)
                } else {
                    LaunchError::Failed(format!(
                        "redis sentinel on port {} exited ({status}) during startup; log:\n{log}",
                        self.port
                    ))
                });
            }
            // Ours (not another test's process on the port), naming the master, seeing its replicas.
            let ours = command_timeout(self.port, &["INFO", "server"], Duration::from_secs(1))
                .is_ok_and(|info| info.lines().any(|line| line.trim_end() == pid_line));
            if ours && self.master_port(name) == Some(master.port) {
                let replicas = master
                    .command(&["INFO", "replication"])
                    .ok()
                    .and_then(|info| info_field(&info, "connected_slaves"));
                seen = self
                    .command(&["SENTINEL", "master", name])
                    .unwrap_or_else(|e| format!("error: {e}"));
                let known = field_after(&seen, "num-slaves");
                if replicas.is_some() && known >= replicas {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                self.kill9();
                return Err(LaunchError::Failed(format!(
                    "redis sentinel on port {} not ready for master {name} (127.0.0.1:{}) within \
                     {SENTINEL_TIMEOUT:?}; SENTINEL master: {seen:?}; log:\n{}",
                    self.port,
                    master.port,
                    log_tail(&dir, &[SENTINEL_LOG, STDIO_FILE])
                )));
            }
            sleep(POLL);
        }
    }
}

impl Drop for RedisSentinel {
    /// `SIGKILL`s and reaps the process; the directory is removed afterwards.
    fn drop(&mut self) {
        self.kill9();
        release_port(self.port, false);
    }
}

/// The number after `field:` in an `INFO` reply.
fn info_field(info: &str, field: &str) -> Option<u64> {
    info.lines()
        .find_map(|line| line.trim_end().strip_prefix(field)?.strip_prefix(':'))
        .and_then(|value| value.parse().ok())
}

/// The number on the line after the line `field` in a rendered flat key/value array.
fn field_after(rendered: &str, field: &str) -> Option<u64> {
    let mut lines = rendered.lines();
    lines.find(|line| *line == field)?;
    lines.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(bytes: &[u8]) -> io::Result<Reply> {
        read_reply(&mut BufReader::new(bytes))
    }

    #[test]
    fn encodes_commands_as_bulk_string_arrays() {
        assert_eq!(
            encode_command(&["SET", "k", ""]),
            b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n"
        );
    }

    #[test]
    fn parses_and_renders_replies() {
        assert_eq!(parse(b"+PONG\r\n").unwrap().render(), "PONG");
        assert_eq!(parse(b":42\r\n").unwrap().render(), "42");
        assert_eq!(parse(b"$5\r\na\r\nbc\r\n").unwrap().render(), "a\r\nbc");
        assert_eq!(parse(b"$-1\r\n").unwrap().render(), "(nil)");
        assert_eq!(parse(b"*-1\r\n").unwrap().render(), "(nil)");
        assert_eq!(
            parse(b"*3\r\n$1\r\na\r\n:1\r\n-ERR x\r\n")
                .unwrap()
                .render(),
            "a\n1\nERR x"
        );
        assert_eq!(
            parse(b"-ERR nope\r\n").unwrap(),
            Reply::Error("ERR nope".into())
        );
    }

    #[test]
    fn a_held_port_is_never_picked_again() {
        // Two ports the kernel says are free, the first held (a killed
        // server waiting for its restart): the pick skips it, and holds
        // what it picks.
        let free = || {
            TcpListener::bind((HOST, 0))
                .and_then(|l| l.local_addr())
                .unwrap()
                .port()
        };
        let (a, b) = (free(), free());
        let mut held = std::collections::BTreeSet::from([a]);
        assert_eq!(pick_port([a, b].into_iter(), false, &mut held), Some(b));
        assert!(held.contains(&b));
        assert_eq!(pick_port([a, b].into_iter(), false, &mut held), None);
        // A port in use is skipped too.
        let busy = TcpListener::bind((HOST, 0)).unwrap();
        let busy_port = busy.local_addr().unwrap().port();
        let c = free();
        let mut none_held = std::collections::BTreeSet::new();
        assert_eq!(
            pick_port([busy_port, c].into_iter(), false, &mut none_held),
            Some(c)
        );
    }

    #[test]
    fn ports_are_picked_below_the_ephemeral_range() {
        let start: u16 = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|r| r.split_whitespace().next()?.parse().ok())
            .unwrap_or(32_768);
        let port = free_port(false);
        release_port(port, false);
        if start > LOWEST_PORT + 1_000 {
            assert!((LOWEST_PORT..start).contains(&port), "{port}");
        }
    }

    #[test]
    fn rejects_truncated_and_malformed_replies() {
        assert_eq!(
            parse(b"+PON").unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
        assert_eq!(
            parse(b"$5\r\nab").unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
        assert_eq!(
            parse(b"?x\r\n").unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        assert_eq!(
            parse(b"$x\r\n").unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
    }
}
