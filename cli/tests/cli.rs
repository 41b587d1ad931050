//! The `hf` binary, end to end: `hf listen` and `hf send` as processes (and a library client
//! for `--echo`), their JSON lines, exit statuses and error lines.
//!
//! Synchronization is by output only: a listener is used once its `listening on` line is
//! read, and a run is over when its process exits. Every wait has a 30 s guard that fails
//! the test, and every spawned process is killed when its guard is dropped.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use hyperframes::wire::{Batch, HANDSHAKE_LEN, Handshake};
use hyperframes::{Context, Limits, Message};
use serde_json::Value;
use sha2::{Digest, Sha256};

const GUARD: Duration = Duration::from_secs(30);

fn hf() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hf"));
    cmd.env_remove("RUST_LOG").env_remove("HYPERFRAMES_IO");
    cmd
}

/// A spawned process, killed (and reaped) when dropped: a failing test leaves nothing behind.
struct Proc {
    child: Child,
    what: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Lines of a pipe, read on a thread; the channel disconnects at end of file.
fn lines_of(pipe: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Everything until end of file, or what came before the deadline.
fn collect(rx: &mpsc::Receiver<String>, deadline: Instant) -> Result<Vec<String>, Vec<String>> {
    let mut out = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => out.push(line),
            Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(out),
            Err(mpsc::RecvTimeoutError::Timeout) => return Err(out),
        }
    }
}

/// A `tracing` line (it starts with a timestamp), as opposed to one of `hf`'s own.
fn is_log_line(line: &str) -> bool {
    line.starts_with(|c: char| c.is_ascii_digit())
}

struct Finished {
    status: ExitStatus,
    stdout: Vec<String>,
    stderr: Vec<String>,
}

impl Finished {
    /// stderr without `tracing` log lines (they start with a timestamp).
    fn hf_stderr(&self) -> Vec<&str> {
        self.stderr
            .iter()
            .map(String::as_str)
            .filter(|l| !is_log_line(l))
            .collect()
    }
}

impl Proc {
    fn spawn(
        cmd: &mut Command,
        stdin: Stdio,
    ) -> (Proc, Option<ChildStdout>, mpsc::Receiver<String>) {
        let what = format!("{cmd:?}");
        let mut child = cmd
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {what}: {e}"));
        let stdout = child.stdout.take();
        let stderr = lines_of(child.stderr.take().expect("piped"));
        (Proc { child, what }, stdout, stderr)
    }

    /// Waits for the exit (the guard fails the test), given the output readers.
    fn finish(
        mut self,
        stdout: mpsc::Receiver<String>,
        stderr: mpsc::Receiver<String>,
        mut stderr_so_far: Vec<String>,
    ) -> Finished {
        let deadline = Instant::now() + GUARD;
        let stdout = collect(&stdout, deadline);
        let stderr = collect(&stderr, deadline);
        let (Ok(stdout), Ok(stderr)) = (&stdout, &stderr) else {
            panic!(
                "{}: still running after {GUARD:?}\nstdout so far: {stdout:#?}\n\
                 stderr so far: {stderr_so_far:#?}\n{stderr:#?}",
                self.what
            );
        };
        let stdout = stdout.clone();
        stderr_so_far.extend(stderr.iter().cloned());
        // Both pipes are closed: the process is exiting.
        let status = self.child.wait().expect("wait");
        Finished {
            status,
            stdout,
            stderr: stderr_so_far,
        }
    }
}

/// Runs `hf args…` to completion.
fn run(args: &[&str]) -> Finished {
    run_with(hf().args(args), None)
}

fn run_with(cmd: &mut Command, stdin: Option<&[u8]>) -> Finished {
    let piped = if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    };
    let (mut proc, stdout, stderr) = Proc::spawn(cmd, piped);
    if let Some(data) = stdin {
        let mut pipe = proc.child.stdin.take().expect("piped");
        pipe.write_all(data).expect("writing stdin");
    }
    let stdout = lines_of(stdout.expect("piped"));
    proc.finish(stdout, stderr, Vec::new())
}

/// `hf send` that must succeed.
fn send(url: &str, args: &[&str], env: &[(&str, &str)]) {
    let out = run_with(
        hf().arg("send")
            .arg(url)
            .args(args)
            .envs(env.iter().copied()),
        None,
    );
    assert!(
        out.status.success(),
        "hf send {url} {args:?}: {:?}\n{:#?}",
        out.status,
        out.stderr
    );
    assert!(
        out.stdout.is_empty(),
        "hf send wrote to stdout: {:?}",
        out.stdout
    );
    assert!(
        out.hf_stderr().is_empty(),
        "hf send wrote to stderr: {:?}",
        out.stderr
    );
}

/// A running `hf listen tcp://127.0.0.1:0 …`, bound.
struct Listening {
    proc: Proc,
    url: String,
    stdout: mpsc::Receiver<String>,
    stderr: mpsc::Receiver<String>,
    stderr_so_far: Vec<String>,
}

fn listen(args: &[&str], env: &[(&str, &str)]) -> Listening {
    listen_at("tcp://127.0.0.1:0", args, env)
}

fn listen_at(at: &str, args: &[&str], env: &[(&str, &str)]) -> Listening {
    let (proc, stdout, stderr) = Proc::spawn(
        hf().args(["listen", at])
            .args(args)
            .envs(env.iter().copied()),
        Stdio::null(),
    );
    let stdout = lines_of(stdout.expect("piped"));
    let deadline = Instant::now() + GUARD;
    let mut stderr_so_far = Vec::new();
    let url = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = stderr
            .recv_timeout(left)
            .unwrap_or_else(|e| panic!("no `listening on` line ({e}); stderr: {stderr_so_far:#?}"));
        if let Some(url) = line.strip_prefix("listening on ") {
            break url.to_owned();
        }
        stderr_so_far.push(line);
    };
    if let Some(scheme @ ("tcp://" | "tls://")) = at.get(..6) {
        assert!(url.starts_with(&format!("{scheme}127.0.0.1:")), "{url}");
        assert!(!url.ends_with(":0"), "the real port, not 0: {url}");
    } else {
        assert_eq!(url, at);
    }
    Listening {
        proc,
        url,
        stdout,
        stderr,
        stderr_so_far,
    }
}

impl Listening {
    fn next_stdout_line(&self) -> String {
        self.stdout
            .recv_timeout(GUARD)
            .unwrap_or_else(|e| panic!("no line on the listener's stdout: {e}"))
    }

    /// The next line `hf` itself writes on stderr (log lines aside).
    fn next_stderr_line(&mut self) -> String {
        loop {
            let line = self
                .stderr
                .recv_timeout(GUARD)
                .unwrap_or_else(|e| panic!("no line on the listener's stderr: {e}"));
            self.stderr_so_far.push(line.clone());
            if !is_log_line(&line) {
                return line;
            }
        }
    }

    /// Waits for the listener to exit by itself (`--count`), successfully.
    fn finish(self) -> Finished {
        let out = self
            .proc
            .finish(self.stdout, self.stderr, self.stderr_so_far);
        assert!(
            out.status.success(),
            "hf listen: {:?}\n{:#?}",
            out.status,
            out.stderr
        );
        out
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What `hf send --size N` sends: byte i is i mod 251.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

/// Checks one JSON line: type, metadata (in order), length and digest.
fn check_line(line: &str, kind: &str, meta: &[(&str, &str)], body: &[u8]) {
    let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
    let obj = v.as_object().expect("an object");
    assert_eq!(
        obj.keys().collect::<Vec<_>>(),
        ["type", "meta", "len", "sha256"],
        "{line}"
    );
    assert_eq!(v["type"], kind, "{line}");
    assert_eq!(v["len"], body.len() as u64, "{line}");
    assert_eq!(v["sha256"], sha256_hex(body), "{line}");
    let got = v["meta"].as_object().expect("meta is an object");
    assert_eq!(got.len(), meta.len(), "{line}");
    for (k, val) in meta {
        assert_eq!(got[*k], *val, "{line}");
    }
    // The order of the entries is the sender's: check the text as well.
    let in_order: Vec<String> = meta
        .iter()
        .map(|(k, v)| {
            format!(
                "{}:{}",
                serde_json::to_string(k).unwrap(),
                serde_json::to_string(v).unwrap()
            )
        })
        .collect();
    let expected = format!("\"meta\":{{{}}}", in_order.join(","));
    assert!(line.contains(&expected), "{line} lacks {expected}");
}

fn lines_of_type<'a>(lines: &'a [String], kind: &str) -> Vec<&'a String> {
    let needle = format!("{{\"type\":{},", serde_json::to_string(kind).unwrap());
    lines.iter().filter(|l| l.starts_with(&needle)).collect()
}

/// Several `hf send` runs into one `hf listen --count`: metadata, sizes and their units.
fn round_trip(env: &[(&str, &str)]) {
    round_trip_at("tcp://127.0.0.1:0", env);
}

fn round_trip_at(at: &str, env: &[(&str, &str)]) {
    let l = listen_at(at, &["--count", "9"], env);
    let small_meta = [
        ("z", "1"),
        ("a", "2"),
        ("q", "he said \"hi\" ✓"),
        ("expr", "x=y"),
        ("empty", ""),
    ];
    send(
        &l.url,
        &[
            "--type",
            "demo.small",
            "--meta",
            "z=1",
            "--meta",
            "a=2",
            "-m",
            "q=he said \"hi\" ✓",
            "--meta",
            "expr=x=y",
            "--meta",
            "empty=",
            "--size",
            "1KiB",
            "--count",
            "3",
        ],
        env,
    );
    send(
        &l.url,
        &["--type", "demo.big", "--size", "4MiB", "--count", "2"],
        env,
    );
    send(
        &l.url,
        &["-t", "demo.empty", "--size", "0", "-m", "k=v"],
        env,
    );
    send(&l.url, &["-t", "demo.none"], env);
    send(&l.url, &["-t", "demo.decimal", "-s", "1kB"], env);
    send(&l.url, &["-t", "demo.k", "-s", "4k"], env);
    let out = l.finish();

    assert_eq!(out.stdout.len(), 9, "{:#?}", out.stdout);
    let small = lines_of_type(&out.stdout, "demo.small");
    assert_eq!(small.len(), 3);
    for line in small {
        check_line(line, "demo.small", &small_meta, &pattern(1024));
    }
    let big = lines_of_type(&out.stdout, "demo.big");
    assert_eq!(big.len(), 2);
    for line in big {
        check_line(line, "demo.big", &[], &pattern(4 << 20));
    }
    let empty = lines_of_type(&out.stdout, "demo.empty");
    assert_eq!(empty.len(), 1);
    check_line(empty[0], "demo.empty", &[("k", "v")], b"");
    let none = lines_of_type(&out.stdout, "demo.none");
    assert_eq!(none.len(), 1);
    check_line(none[0], "demo.none", &[], b"");
    let decimal = lines_of_type(&out.stdout, "demo.decimal");
    assert_eq!(decimal.len(), 1);
    check_line(decimal[0], "demo.decimal", &[], &pattern(1000));
    let k = lines_of_type(&out.stdout, "demo.k");
    assert_eq!(k.len(), 1);
    check_line(k[0], "demo.k", &[], &pattern(4096));
    assert!(out.hf_stderr().is_empty(), "{:#?}", out.stderr);
}

#[test]
fn round_trip_with_meta_and_sizes() {
    round_trip(&[]);
}

#[test]
fn round_trip_on_epoll() {
    round_trip(&[("HYPERFRAMES_IO", "epoll")]);
}

#[test]
fn round_trip_over_shared_memory() {
    round_trip_at(&format!("shm://hf-cli-{}", std::process::id()), &[]);
}

#[test]
fn body_from_file_and_stdin() {
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hf-cli-body-{}.bin", std::process::id()));
    // Not the --size pattern: a simple LCG.
    let mut x = 12345u32;
    let data: Vec<u8> = (0..100_000)
        .map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            (x >> 16) as u8
        })
        .collect();
    std::fs::write(&path, &data).unwrap();

    let l = listen(&["--count", "3"], &[]);
    send(
        &l.url,
        &[
            "--type",
            "demo.file",
            "--file",
            path.to_str().unwrap(),
            "--count",
            "2",
        ],
        &[],
    );
    let out = run_with(
        hf().args(["send", &l.url, "--type", "demo.stdin", "--file", "-"]),
        Some(b"from stdin\n"),
    );
    assert!(out.status.success(), "{:#?}", out.stderr);
    let out = l.finish();
    let _ = std::fs::remove_file(&path);

    let file = lines_of_type(&out.stdout, "demo.file");
    assert_eq!(file.len(), 2, "{:#?}", out.stdout);
    for line in file {
        check_line(line, "demo.file", &[], &data);
    }
    let stdin = lines_of_type(&out.stdout, "demo.stdin");
    assert_eq!(stdin.len(), 1, "{:#?}", out.stdout);
    check_line(stdin[0], "demo.stdin", &[], b"from stdin\n");
}

#[test]
fn echo_to_a_library_client() {
    let l = listen(&["--echo", "--count", "3"], &[]);
    let sent = vec![
        Message::new("demo.echo.one")
            .unwrap()
            .with_meta("seq", "1")
            .unwrap()
            .with_meta("a", "b")
            .unwrap()
            .with_body(&b"hello"[..]),
        Message::new("demo.echo.two").unwrap(),
        Message::new("demo.echo.three")
            .unwrap()
            .with_meta("seq", "3")
            .unwrap()
            .with_body(pattern(1 << 20)),
    ];
    let rt = tokio::runtime::Runtime::new().unwrap();
    let echoed = rt.block_on(async {
        tokio::time::timeout(GUARD, async {
            let ctx = Context::new();
            let mut ch = ctx.connect(&l.url).await.expect("connect");
            for msg in &sent {
                ch.send(msg.clone()).await.expect("send");
            }
            ch.flush().await.expect("flush");
            let mut echoed = Vec::new();
            for _ in 0..sent.len() {
                echoed.push(ch.recv().await.expect("an echo").expect("no error"));
            }
            let _ = ch.close().await;
            echoed
        })
        .await
        .expect("echoes within the guard")
    });
    assert_eq!(echoed, sent);

    let out = l.finish();
    assert_eq!(out.stdout.len(), 3, "{:#?}", out.stdout);
    check_line(
        &out.stdout[0],
        "demo.echo.one",
        &[("seq", "1"), ("a", "b")],
        b"hello",
    );
    check_line(&out.stdout[1], "demo.echo.two", &[], b"");
    check_line(
        &out.stdout[2],
        "demo.echo.three",
        &[("seq", "3")],
        &pattern(1 << 20),
    );
}

/// `hf send` reads what an echoing peer sends back, so a long run neither stalls on full
/// queues nor gets reset; and it exits once the listener closes its side (the linger is far
/// longer than the guard, so an exit proves the close was seen).
#[test]
fn send_to_an_echoing_listener_finishes() {
    let l = listen(&["--echo"], &[]);
    send(
        &l.url,
        &[
            "--type",
            "demo.flood",
            "--size",
            "64k",
            "--count",
            "500",
            "--linger",
            "600",
        ],
        &[],
    );
    for _ in 0..500 {
        let line = l.next_stdout_line();
        assert!(line.starts_with("{\"type\":\"demo.flood\""), "{line}");
    }
    // Ctrl-C ends a listener without --count, successfully.
    let status = Command::new("kill")
        .args(["-INT", &l.proc.child.id().to_string()])
        .status()
        .expect("kill -INT");
    assert!(status.success());
    let out = l.finish();
    assert!(out.stdout.is_empty(), "{:#?}", out.stdout);
    assert!(out.hf_stderr().is_empty(), "{:#?}", out.stderr);
}

#[test]
fn count_spans_connections() {
    let l = listen(&["--count", "4"], &[]);
    let a = {
        let url = l.url.clone();
        thread::spawn(move || send(&url, &["-t", "demo.a", "-n", "2", "-s", "10"], &[]))
    };
    let b = {
        let url = l.url.clone();
        thread::spawn(move || send(&url, &["-t", "demo.b", "-n", "2", "-s", "20"], &[]))
    };
    a.join().unwrap();
    b.join().unwrap();
    let out = l.finish();
    assert_eq!(out.stdout.len(), 4, "{:#?}", out.stdout);
    for line in lines_of_type(&out.stdout, "demo.a") {
        check_line(line, "demo.a", &[], &pattern(10));
    }
    for line in lines_of_type(&out.stdout, "demo.b") {
        check_line(line, "demo.b", &[], &pattern(20));
    }
    assert_eq!(lines_of_type(&out.stdout, "demo.a").len(), 2);
}

/// A peer that dies in the middle of a message is reported on stderr, and the listener goes
/// on with the next connection.
#[test]
fn dead_peer_is_reported_and_listening_goes_on() {
    let mut l = listen(&["--count", "1"], &[]);
    let addr = l.url.strip_prefix("tcp://").unwrap().to_owned();
    {
        let mut raw = TcpStream::connect(&addr).unwrap();
        raw.set_read_timeout(Some(GUARD)).unwrap();
        let mut hs = Vec::new();
        Handshake::new(Limits::default()).encode(&mut hs);
        raw.write_all(&hs).unwrap();
        let mut theirs = [0u8; HANDSHAKE_LEN];
        raw.read_exact(&mut theirs).unwrap();
        assert_eq!(&theirs[..8], b"HYPERFRM");
        let mut batch = Batch::default();
        batch.push_message(Message::new("demo.cut").unwrap().with_body(pattern(10_000)));
        let frame: Vec<u8> = batch.take().iter().flat_map(|c| c.to_vec()).collect();
        raw.write_all(&frame[..frame.len() - 100]).unwrap();
        // Dropped here, without CLOSE, mid-frame.
    }
    let line = l.next_stderr_line();
    assert!(
        line.starts_with(&format!("hf: connection from tcp://{}", "127.0.0.1:")),
        "{line}"
    );
    assert!(line.contains("connection lost"), "{line}");

    send(&l.url, &["-t", "demo.after"], &[]);
    let out = l.finish();
    assert_eq!(out.stdout.len(), 1, "{:#?}", out.stdout);
    check_line(&out.stdout[0], "demo.after", &[], b"");
}

#[test]
fn listener_limits_are_respected() {
    let l = listen(&["--count", "1", "--max-body", "1KiB"], &[]);
    let out = run(&["send", &l.url, "-t", "demo.big", "-s", "1025"]);
    assert_eq!(out.status.code(), Some(1), "{:#?}", out.stderr);
    let err = one_error_line(&out);
    assert!(err.contains("max_body"), "{err}");
    send(&l.url, &["-t", "demo.fits", "-s", "1KiB"], &[]);
    let out = l.finish();
    assert_eq!(out.stdout.len(), 1);
    check_line(&out.stdout[0], "demo.fits", &[], &pattern(1024));
}

/// `--max-per-peer`: a connection past the address's share is refused, and the listener
/// serves again once a place frees; a limit of 0 is a usage error.
#[test]
fn admission_flags_are_respected() {
    let l = listen(&["--count", "1", "--max-per-peer", "1"], &[]);
    let held = TcpStream::connect(l.url.trim_start_matches("tcp://")).unwrap();
    // The held connection is in its handshake; wait for the listener to have taken it.
    let mut hs = vec![0u8; HANDSHAKE_LEN];
    (&held).read_exact(&mut hs).unwrap();
    let out = run(&["send", &l.url, "-t", "demo.refused"]);
    assert_eq!(out.status.code(), Some(1), "{:#?}", out.stderr);
    drop(held);
    // The listener may see the hang-up after the next connect: retry until served.
    let deadline = Instant::now() + GUARD;
    loop {
        let out = run(&["send", &l.url, "-t", "demo.admitted"]);
        if out.status.success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never admitted: {:#?}",
            out.stderr
        );
        thread::sleep(Duration::from_millis(20));
    }
    let out = l.finish();
    check_line(&out.stdout[0], "demo.admitted", &[], &pattern(0));
    for args in [
        &["listen", "tcp://127.0.0.1:0", "--max-connections", "0"][..],
        &["listen", "tcp://127.0.0.1:0", "--idle-timeout", "-1"],
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {:#?}", out.stderr);
    }
}

/// The single `hf: error: …` line of a failed run (log lines aside).
fn one_error_line(out: &Finished) -> String {
    let lines = out.hf_stderr();
    assert_eq!(lines.len(), 1, "one line on stderr: {:#?}", out.stderr);
    assert!(lines[0].starts_with("hf: error: "), "{}", lines[0]);
    assert!(out.stdout.is_empty(), "{:#?}", out.stdout);
    lines[0].to_owned()
}

#[test]
fn connection_refused() {
    let out = run(&["send", "tcp://127.0.0.1:1", "--type", "a.b"]);
    assert_eq!(out.status.code(), Some(1));
    let err = one_error_line(&out);
    assert!(err.contains("connection refused"), "{err}");
    assert!(err.contains("tcp://127.0.0.1:1"), "{err}");
    // shm: the socket path it tried (it depends on XDG_RUNTIME_DIR), which is what to check.
    let out = run(&["send", "shm://hf-test-nobody-listens", "--type", "a.b"]);
    assert_eq!(out.status.code(), Some(1));
    let err = one_error_line(&out);
    assert!(err.contains("connection refused"), "{err}");
    assert!(err.contains("hf-test-nobody-listens.sock"), "{err}");
}

#[test]
fn bad_urls() {
    for args in [
        &["send", "nonsense", "--type", "a.b"][..],
        &["send", "udp://host:1", "--type", "a.b"],
        &["send", "tcp://127.0.0.1", "--type", "a.b"],
        &["listen", "tcp://127.0.0.1:99999"],
        &["listen", "http://127.0.0.1:80"],
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {:#?}", out.stderr);
        let err = one_error_line(&out);
        assert!(err.contains("URL"), "{args:?}: {err}");
        assert!(err.contains(args[1]), "{args:?}: {err}");
    }
}

#[test]
fn bad_type() {
    for kind in ["bad type", "", "a..b", "trailing."] {
        let out = run(&["send", "tcp://127.0.0.1:1", "--type", kind]);
        assert_eq!(out.status.code(), Some(2), "{kind:?}: {:#?}", out.stderr);
        let err = one_error_line(&out);
        assert!(err.contains(&format!("--type {kind:?}")), "{err}");
        assert!(err.contains("message type"), "{err}");
    }
}

#[test]
fn bad_meta() {
    for (meta, needle) in [
        ("novalue", "KEY=VALUE"),
        ("bad key=v", "metadata key"),
        ("=v", "metadata key is empty"),
    ] {
        let out = run(&["send", "tcp://127.0.0.1:1", "--type", "a.b", "--meta", meta]);
        assert_eq!(out.status.code(), Some(2), "{meta:?}: {:#?}", out.stderr);
        let err = one_error_line(&out);
        assert!(err.contains(&format!("--meta {meta:?}")), "{err}");
        assert!(err.contains(needle), "{err}");
    }
}

#[test]
fn bad_size() {
    for size in ["4X", "1.5M", "-1", "lots"] {
        let out = run(&[
            "send",
            "tcp://127.0.0.1:1",
            "-t",
            "a.b",
            &format!("--size={size}"),
        ]);
        assert_eq!(out.status.code(), Some(2), "{size:?}: {:#?}", out.stderr);
        let err = one_error_line(&out);
        assert!(err.contains("--size"), "{err}");
    }
}

#[test]
fn unreadable_file() {
    let path = "/nonexistent/hf-cli-test/body.bin";
    let out = run(&["send", "tcp://127.0.0.1:1", "--type", "a.b", "--file", path]);
    assert_eq!(out.status.code(), Some(1));
    let err = one_error_line(&out);
    assert!(err.contains(path), "{err}");
    assert!(err.contains("cannot read"), "{err}");
}

#[test]
fn usage_and_help() {
    // clap's usage errors: status 2.
    for args in [
        &[][..],
        &["send", "tcp://127.0.0.1:1"],
        &[
            "send",
            "tcp://127.0.0.1:1",
            "-t",
            "a",
            "--size",
            "1",
            "--file",
            "x",
        ],
        &["listen"],
        &["frobnicate"],
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {:#?}", out.stderr);
    }
    for (args, needles) in [
        (&["--help"][..], &["listen", "send", "HYPERFRAMES_IO"][..]),
        (
            &["listen", "--help"],
            &["--count", "--echo", "listening on", "sha256"],
        ),
        (
            &["send", "--help"],
            &["--type", "--meta", "--size", "--file", "KiB", "kB"],
        ),
    ] {
        let out = run(args);
        assert!(out.status.success(), "{args:?}");
        let text = out.stdout.join("\n");
        for needle in needles {
            assert!(text.contains(needle), "{args:?} lacks {needle}: {text}");
        }
    }
}

/// Every check `hf doctor` runs, in its order.
const DOCTOR_CHECKS: [&str; 20] = [
    "io_uring",
    "memlock",
    "rdma",
    "uverbs",
    "rdma_cm",
    "cuda",
    "gpu",
    "gpudirect",
    "numa",
    "mtu",
    "cpu_governor",
    "thp",
    "hugepages",
    "net.core.rmem_max",
    "net.core.wmem_max",
    "net.ipv4.tcp_rmem",
    "net.ipv4.tcp_wmem",
    "shm",
    "dev_shm",
    "cuda_driver",
];

const DOCTOR_STATUSES: [&str; 5] = ["ok", "warn", "info", "absent", "error"];

#[test]
fn doctor_prints_a_line_per_check() {
    let out = run(&["doctor"]);
    assert_eq!(out.status.code(), Some(0), "{:#?}", out.stderr);
    // Finding lines start with a status; `fix:` lines are indented under them.
    let findings: Vec<(&str, &str)> = out
        .stdout
        .iter()
        .filter(|l| !l.starts_with(' ') && !l.is_empty())
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            Some((words.next()?, words.next()?))
        })
        .filter(|(status, _)| DOCTOR_STATUSES.contains(status))
        .collect();
    let mut checks: Vec<&str> = findings.iter().map(|(_, check)| *check).collect();
    checks.dedup();
    assert_eq!(checks, DOCTOR_CHECKS, "{:#?}", out.stdout);
    for line in out.stdout.iter().filter(|l| l.starts_with(' ')) {
        assert!(
            line.trim_start().starts_with("fix: ") || line.starts_with(&" ".repeat(30)),
            "an indented line that is not part of a fix: {line:?}"
        );
    }
    let last = out.stdout.last().expect("a summary line");
    assert!(
        last.starts_with(&format!("{} findings", findings.len())),
        "{last:?}"
    );
    // Both probes talk to the library: a loopback connection here must work.
    for (status, check) in &findings {
        if ["io_uring", "shm"].contains(check) {
            assert!(["ok", "warn"].contains(status), "{:#?}", out.stdout);
        }
    }
}

#[test]
fn doctor_json_lines() {
    let out = run_with(
        hf().args(["doctor", "--json"])
            .env("HYPERFRAMES_IO", "epoll"),
        None,
    );
    assert_eq!(out.status.code(), Some(0), "{:#?}", out.stderr);
    let mut checks = Vec::new();
    for line in &out.stdout {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
        let obj = v.as_object().expect("an object per line");
        assert_eq!(obj.len(), 4, "{line}");
        let check = v["check"].as_str().expect("check is a string");
        let status = v["status"].as_str().expect("status is a string");
        assert!(DOCTOR_STATUSES.contains(&status), "{line}");
        assert!(
            !v["found"].as_str().expect("found is a string").is_empty(),
            "{line}"
        );
        assert!(v["fix"].is_null() || v["fix"].is_string(), "{line}");
        if status == "warn" {
            assert!(v["fix"].is_string(), "a warning comes with its fix: {line}");
        }
        if check == "io_uring" {
            // The probe ignores the forcing variable but says it is set.
            assert!(
                v["found"]
                    .as_str()
                    .unwrap()
                    .contains("HYPERFRAMES_IO=epoll"),
                "{line}"
            );
        }
        if checks.last() != Some(&check.to_owned()) {
            checks.push(check.to_owned());
        }
    }
    assert_eq!(checks, DOCTOR_CHECKS, "{:#?}", out.stdout);
}

/// `inproc://` lives inside one process: `hf listen` and `hf send` refuse it (status 2),
/// saying what to use, instead of listening where nobody can ever connect.
#[test]
fn inproc_is_refused_by_listen_and_send() {
    for args in [
        &["listen", "inproc://x"][..],
        &["send", "inproc://x", "--type", "a.b"],
    ] {
        let out = hf().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("shm://") && err.contains("tcp://"), "{err}");
    }
}

/// A bad setting from the environment is a usage error too: status 2, one line naming it.
#[test]
fn a_bad_engine_in_the_environment_exits_2() {
    let out = hf()
        .args(["send", "tcp://127.0.0.1:1", "--type", "a.b"])
        .env("HYPERFRAMES_IO", "bogus")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("HYPERFRAMES_IO=\"bogus\""), "{err}");
}

#[test]
fn doctor_usage() {
    let out = run(&["doctor", "--frobnicate"]);
    assert_eq!(out.status.code(), Some(2), "{:#?}", out.stderr);
    let out = run(&["doctor", "--help"]);
    assert!(out.status.success());
    let text = out.stdout.join("\n");
    for needle in ["--json", "memlock", "absent", "fix"] {
        assert!(
            text.contains(needle),
            "doctor --help lacks {needle}: {text}"
        );
    }
    let out = run(&["--help"]);
    assert!(out.stdout.join("\n").contains("doctor"));
}

// -- tls:// ------------------------------------------------------------------------------------

#[cfg(feature = "tls")]
#[path = "../../tests/common/certs.rs"]
mod certs;

/// A CA, a server certificate for 127.0.0.1, a client certificate, and a certificate from a
/// CA nobody trusts, as PEM files in a directory removed on drop.
#[cfg(feature = "tls")]
struct TlsFiles {
    dir: std::path::PathBuf,
}

#[cfg(feature = "tls")]
impl TlsFiles {
    fn new(name: &str) -> TlsFiles {
        let dir = std::env::temp_dir().join(format!("hf-cli-tls-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = certs::Ca::new("hf test CA");
        let stranger = certs::Ca::new("nobody's CA").leaf("mallory", &["127.0.0.1"]);
        let server = ca.leaf("node-7", &["127.0.0.1"]);
        let client = ca.leaf("trainer-3", &["trainer-3.cluster"]);
        let write = |file: &str, pem: &str| std::fs::write(dir.join(file), pem).unwrap();
        write("ca.crt", &ca.pem);
        write("server.crt", &server.cert);
        write("server.key", &server.key);
        write("client.crt", &client.cert);
        write("client.key", &client.key);
        write("stranger.crt", &stranger.cert);
        write("stranger.key", &stranger.key);
        TlsFiles { dir }
    }

    fn path(&self, file: &str) -> String {
        self.dir.join(file).to_str().unwrap().to_owned()
    }

    /// `--cert WHO.crt --key WHO.key`, with `--ca ca.crt`.
    fn args(&self, who: &str) -> Vec<String> {
        vec![
            "--cert".into(),
            self.path(&format!("{who}.crt")),
            "--key".into(),
            self.path(&format!("{who}.key")),
            "--ca".into(),
            self.path("ca.crt"),
        ]
    }
}

#[cfg(feature = "tls")]
impl Drop for TlsFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(feature = "tls")]
fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Mutual TLS through `hf listen` and `hf send`: the listener names the client's verified
/// certificate; a client without a certificate, one from an unknown CA and one expecting
/// another server name are each refused with one line, and the listener goes on serving.
#[cfg(feature = "tls")]
#[test]
fn mutual_tls_listen_and_send() {
    let f = TlsFiles::new("mutual");
    let server = f.args("server");
    let mut args = strs(&server);
    args.extend(["--count", "1"]);
    let l = listen_at("tls://127.0.0.1:0", &args, &[]);

    // No client certificate: the listener asked for one.
    let out = run(&["send", &l.url, "-t", "demo.anon", "--ca", &f.path("ca.crt")]);
    assert_eq!(out.status.code(), Some(1), "{:#?}", out.stderr);
    let err = one_error_line(&out);
    eprintln!("{err}");
    assert!(err.contains("certificate"), "{err}");
    // A certificate from a CA the listener does not trust.
    let stranger = [
        "--cert",
        &f.path("stranger.crt"),
        "--key",
        &f.path("stranger.key"),
        "--ca",
        &f.path("ca.crt"),
    ];
    let mut cmd = vec!["send", &l.url, "-t", "demo.stranger"];
    cmd.extend(stranger);
    let out = run(&cmd);
    assert_eq!(out.status.code(), Some(1), "{:#?}", out.stderr);
    let err = one_error_line(&out);
    eprintln!("{err}");
    assert!(err.contains("certificate"), "{err}");
    // The right certificates, but expecting another server.
    let client = f.args("client");
    let mut cmd = vec!["send", &l.url, "-t", "demo.name", "--server-name", "db-1"];
    cmd.extend(strs(&client));
    let out = run(&cmd);
    assert_eq!(out.status.code(), Some(1), "{:#?}", out.stderr);
    let err = one_error_line(&out);
    eprintln!("{err}");
    assert!(err.contains("db-1"), "{err}");

    // A good client is served, and its certificate named.
    let mut args = vec!["-t", "demo.hello", "--meta", "k=v", "-s", "100KiB"];
    args.extend(strs(&client));
    send(&l.url, &args, &[]);
    let out = l.finish();
    // The refused clients' lines are the listener's log (WARN); the served one is named.
    let named: Vec<&str> = out
        .hf_stderr()
        .into_iter()
        .filter(|l| l.starts_with("hf: connection from "))
        .collect();
    assert_eq!(named.len(), 1, "{:#?}", out.stderr);
    for line in out.hf_stderr() {
        assert!(
            line.starts_with("hf: connection from ") || line.starts_with("listening on "),
            "unexpected on the listener's stderr: {line:?}\n{:#?}",
            out.stderr
        );
    }
    assert!(
        named[0].contains(": certificate CN=trainer-3,"),
        "{}",
        named[0]
    );
    assert!(named[0].contains(" trainer-3.cluster"), "{}", named[0]);
    assert_eq!(out.stdout.len(), 1, "{:#?}", out.stdout);
    check_line(
        &out.stdout[0],
        "demo.hello",
        &[("k", "v")],
        &pattern(100 * 1024),
    );
}

/// Without --ca the listener takes any client (encryption and server authentication only);
/// plaintext and TLS on the wrong side are refused, each side saying what to change.
#[cfg(feature = "tls")]
#[test]
fn server_only_tls_and_scheme_mismatches() {
    let f = TlsFiles::new("server-only");
    let (cert, key) = (f.path("server.crt"), f.path("server.key"));
    let l = listen_at(
        "tls://127.0.0.1:0",
        &["--cert", &cert, "--key", &key, "--count", "1"],
        &[],
    );
    // A plaintext client at the TLS listener.
    let plain = l.url.replacen("tls://", "tcp://", 1);
    let out = run(&["send", &plain, "-t", "demo.plain"]);
    assert_eq!(out.status.code(), Some(1), "{:#?}", out.stderr);
    let err = one_error_line(&out);
    eprintln!("{err}");
    assert!(err.contains("tls://"), "{err}");
    send(
        &l.url,
        &["-t", "demo.server.only", "--ca", &f.path("ca.crt")],
        &[],
    );
    let out = l.finish();
    assert_eq!(out.stdout.len(), 1, "{:#?}", out.stdout);
    check_line(&out.stdout[0], "demo.server.only", &[], &pattern(0));

    // A TLS client at a plaintext listener.
    let l = listen(&["--count", "1"], &[]);
    let secure = l.url.replacen("tcp://", "tls://", 1);
    let out = run(&["send", &secure, "-t", "demo.tls", "--ca", &f.path("ca.crt")]);
    assert_eq!(out.status.code(), Some(1), "{:#?}", out.stderr);
    let err = one_error_line(&out);
    eprintln!("{err}");
    assert!(err.contains("tcp://") || err.contains("plaintext"), "{err}");
    send(&l.url, &["-t", "demo.after"], &[]);
    l.finish();
}

/// Flags a URL cannot use, and tls:// without the flags it needs, are usage errors (2).
#[test]
fn tls_flags_are_checked() {
    let missing = std::env::temp_dir().join("hf-cli-no-such.pem");
    let missing = missing.to_str().unwrap();
    for (args, says) in [
        (&["listen", "tls://127.0.0.1:0"][..], "--cert"),
        (&["send", "tls://127.0.0.1:1", "-t", "a.b"], "--ca"),
        (
            &["send", "tcp://127.0.0.1:1", "-t", "a.b", "--ca", missing],
            "tls://",
        ),
        (&["listen", "tls://127.0.0.1:0", "--cert", missing], "--key"),
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {:#?}", out.stderr);
        let text = out.stderr.join("\n");
        assert!(text.contains(says), "{args:?}: {text}");
    }
    #[cfg(feature = "tls")]
    {
        let junk = std::env::temp_dir().join(format!("hf-cli-junk-{}.pem", std::process::id()));
        std::fs::write(&junk, "not a certificate\n").unwrap();
        let junk = junk.to_str().unwrap().to_owned();
        let out = run(&[
            "listen",
            "tls://127.0.0.1:0",
            "--cert",
            &junk,
            "--key",
            &junk,
        ]);
        assert_eq!(out.status.code(), Some(2), "{:#?}", out.stderr);
        let err = one_error_line(&out);
        assert!(err.contains(&junk), "names the file: {err}");
        let _ = std::fs::remove_file(&junk);
    }
}

/// `hf request` against `hf listen --echo`: the echo of a request is its response, printed
/// as a JSON line; `--body` prints the raw body instead.
#[test]
fn request_prints_the_reply() {
    let l = listen(&["--echo", "--count", "2"], &[]);
    let out = run(&[
        "request",
        &l.url,
        "--type",
        "demo.ping",
        "--meta",
        "k=v",
        "--size",
        "100",
    ]);
    assert!(out.status.success(), "{:?}\n{:#?}", out.status, out.stderr);
    assert_eq!(out.stdout.len(), 1, "{:#?}", out.stdout);
    check_line(&out.stdout[0], "demo.ping", &[("k", "v")], &pattern(100));
    let out = run_with(
        hf().args([
            "request",
            &l.url,
            "-t",
            "demo.text",
            "--file",
            "-",
            "--body",
        ]),
        Some(b"hello back\n"),
    );
    assert!(out.status.success(), "{:?}\n{:#?}", out.status, out.stderr);
    assert_eq!(out.stdout, ["hello back"]);
    l.finish();
}

/// A service's error reply is an error line naming the kind of refusal, exit 1; a peer that
/// never answers is one too, after `--timeout`.
#[test]
fn request_refused_or_unanswered_exits_1() {
    use hyperframes::middleware::{TypeFilterLayer, serve};
    use tower::Layer as _;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let url = rt.block_on(async {
        let l = Context::new().bind("tcp://127.0.0.1:0").await.unwrap();
        let url = l.local_url().to_owned();
        let svc = TypeFilterLayer::new(["svc.*"])
            .unwrap()
            .layer(tower::service_fn(|req: Message| async move {
                Ok::<_, hyperframes::middleware::BoxError>(Some(req))
            }));
        tokio::spawn(serve(l, tower::make::Shared::new(svc)).into_future());
        url
    });
    let out = run(&["request", &url, "--type", "other.thing"]);
    assert_eq!(out.status.code(), Some(1));
    let err = one_error_line(&out);
    assert!(
        err.contains("other.thing") && err.ends_with("(invalid-type)"),
        "{err}"
    );

    let silent = listen(&[], &[]);
    let out = run(&["request", &silent.url, "--type", "a.b", "--timeout", "0.3"]);
    assert_eq!(out.status.code(), Some(1));
    let err = one_error_line(&out);
    assert!(err.contains("no reply"), "{err}");
    drop(rt);
}
