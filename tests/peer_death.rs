//! A peer process killed with SIGKILL, or frozen with SIGSTOP: both halves of the survivor's
//! channel report `ConnectionLost` promptly, including a sender blocked by backpressure; a
//! peer that is alive but does not read is not mistaken for a frozen one. The test binary
//! re-executes itself as the peer (`child_peer`, active only with `HF_TEST_CHILD` set).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use hyperframes::{Context, ErrorKind, IoEngine, Message};
use tokio::time::timeout;

const GUARD: Duration = Duration::from_secs(20);

/// Kills the child on drop, so a failing test leaves no process behind.
struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Peer {
    /// Starts the peer in `mode` against `url` and waits (off the runtime, which may have to
    /// answer the peer's handshake) until it says it is connected.
    async fn start(mode: &str, url: &str) -> Peer {
        let (mode, url) = (mode.to_owned(), url.to_owned());
        tokio::task::spawn_blocking(move || Peer::start_blocking(&mode, &url))
            .await
            .unwrap()
    }

    fn start_blocking(mode: &str, url: &str) -> Peer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_peer", "--nocapture", "--test-threads=1"])
            .env("HF_TEST_CHILD", format!("{mode} {url}"))
            .env("HF_TEST_HEARTBEAT_MS", BEAT.as_millis().to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        loop {
            let line = lines.next().expect("peer exited early").unwrap();
            if line.contains("READY") {
                break;
            }
        }
        Peer(child)
    }

    fn kill(&mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }

    /// SIGSTOP: the process stays, its sockets stay open, its kernel keeps acknowledging,
    /// and it runs nothing. (`Drop` kills it; SIGKILL ends a stopped process too.)
    fn freeze(&mut self) {
        let pid = self.0.id().to_string();
        let ok = Command::new("kill")
            .args(["-STOP", &pid])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -STOP {pid}");
    }
}

/// The heartbeat both sides of the frozen-peer tests use: lost after `MISSES` of these.
const BEAT: Duration = Duration::from_millis(100);
const MISSES: u32 = 5;

/// The peer side. `send URL`: connect, send one message, idle. `sink URL`: connect and never
/// read.
#[test]
fn child_peer() {
    let Ok(spec) = std::env::var("HF_TEST_CHILD") else {
        return;
    };
    let (mode, url) = spec.split_once(' ').unwrap();
    let beat = std::env::var("HF_TEST_HEARTBEAT_MS")
        .unwrap()
        .parse()
        .unwrap();
    let ctx = Context::builder()
        .heartbeat(Some(Duration::from_millis(beat)), MISSES)
        .build()
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut ch = ctx.connect(url).await.unwrap();
        if mode == "send" {
            ch.send(Message::new("peer.hello").unwrap()).await.unwrap();
            ch.flush().await.unwrap();
        }
        println!("READY");
        // Idle until killed; keep `ch` alive and never read.
        tokio::time::sleep(Duration::from_secs(600)).await;
        drop(ch);
    });
}

fn ctx(engine: IoEngine) -> Context {
    Context::builder().io_engine(engine).build().unwrap()
}

async fn killed_peer_fails_both_halves(engine: IoEngine) {
    let ctx = ctx(engine);
    let mut l = ctx.bind("tcp://127.0.0.1:0").await.unwrap();
    let mut peer = Peer::start("send", l.local_url()).await;
    let (mut tx, mut rx) = timeout(GUARD, l.accept()).await.unwrap().unwrap().split();
    let hello = timeout(GUARD, rx.recv()).await.unwrap().unwrap().unwrap();
    assert_eq!(hello.kind(), "peer.hello");

    peer.kill();

    let e = timeout(GUARD, rx.recv())
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e}");
    assert!(
        timeout(GUARD, rx.recv()).await.unwrap().is_none(),
        "ends after the error"
    );
    let e = timeout(GUARD, tx.send(Message::new("x").unwrap()))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e}");
}

async fn killed_peer_releases_a_blocked_sender(engine: IoEngine) {
    let ctx = Context::builder()
        .io_engine(engine)
        .send_queue(4, 1 << 20)
        .build()
        .unwrap();
    let mut l = ctx.bind("tcp://127.0.0.1:0").await.unwrap();
    let mut peer = Peer::start("sink", l.local_url()).await;
    let (mut tx, _rx) = timeout(GUARD, l.accept()).await.unwrap().unwrap().split();
    let body = bytes::Bytes::from(vec![1u8; 1 << 20]);
    // Fill everything until the sender blocks (the peer never reads).
    loop {
        let m = Message::new("x").unwrap().with_body(body.clone());
        if timeout(Duration::from_millis(300), tx.send(m))
            .await
            .is_err()
        {
            break;
        }
    }
    let blocked = tokio::spawn(async move {
        let m = Message::new("x").unwrap().with_body(body);
        tx.send(m).await
    });
    peer.kill();
    let e = timeout(GUARD, blocked).await.unwrap().unwrap().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e}");
}

#[tokio::test]
async fn uring_killed_peer_fails_both_halves() {
    killed_peer_fails_both_halves(IoEngine::Uring).await;
}

#[tokio::test]
async fn epoll_killed_peer_fails_both_halves() {
    killed_peer_fails_both_halves(IoEngine::Epoll).await;
}

#[tokio::test]
async fn uring_killed_peer_releases_a_blocked_sender() {
    killed_peer_releases_a_blocked_sender(IoEngine::Uring).await;
}

#[tokio::test]
async fn epoll_killed_peer_releases_a_blocked_sender() {
    killed_peer_releases_a_blocked_sender(IoEngine::Epoll).await;
}

#[tokio::test]
async fn inline_killed_peer_fails_both_halves() {
    killed_peer_fails_both_halves(IoEngine::Inline).await;
}

#[tokio::test]
async fn inline_killed_peer_releases_a_blocked_sender() {
    killed_peer_releases_a_blocked_sender(IoEngine::Inline).await;
}

// ---------------------------------------------------------------------------------------
// Frozen peers (SIGSTOP): found by heartbeats
// ---------------------------------------------------------------------------------------

/// Where a frozen-peer test listens: tcp on `engine`, or shm.
enum Over {
    Tcp(IoEngine),
    Shm,
}

impl Over {
    fn ctx(&self, send_queue: usize) -> Context {
        let b = Context::builder()
            .heartbeat(Some(BEAT), MISSES)
            .send_queue(send_queue, 1 << 20)
            .shm_segment(64, 1 << 20);
        match self {
            Over::Tcp(engine) => b.io_engine(*engine),
            Over::Shm => b,
        }
        .build()
        .unwrap()
    }

    fn url(&self, case: &str) -> String {
        match self {
            Over::Tcp(_) => "tcp://127.0.0.1:0".into(),
            Over::Shm => format!("shm://hf-frozen-{case}-{}", std::process::id()),
        }
    }

    fn name(&self) -> String {
        match self {
            Over::Tcp(engine) => format!("tcp/{engine}"),
            Over::Shm => "shm".into(),
        }
    }
}

/// What the survivor's halves must say about a frozen peer: lost, naming its silence.
fn assert_silent(e: &hyperframes::Error) {
    assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e}");
    assert!(e.to_string().contains("silent for"), "{e}");
}

async fn frozen_peer_fails_both_halves(over: Over) {
    let ctx = over.ctx(1024);
    let mut l = ctx.bind(&over.url("both")).await.unwrap();
    let mut peer = Peer::start("send", l.local_url()).await;
    let (mut tx, mut rx) = timeout(GUARD, l.accept()).await.unwrap().unwrap().split();
    let hello = timeout(GUARD, rx.recv()).await.unwrap().unwrap().unwrap();
    assert_eq!(hello.kind(), "peer.hello");
    // Idle and alive for several times the limit first: heartbeats keep it.
    tokio::time::sleep(BEAT * MISSES * 4).await;
    tx.send(Message::new("still.there").unwrap()).await.unwrap();

    let frozen = std::time::Instant::now();
    peer.freeze();
    let e = timeout(GUARD, rx.recv())
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    let found = frozen.elapsed();
    assert_silent(&e);
    let e = timeout(GUARD, tx.send(Message::new("x").unwrap()))
        .await
        .unwrap()
        .unwrap_err();
    assert_silent(&e);
    println!(
        "frozen peer over {}: both halves failed {found:.0?} after SIGSTOP (limit {:?}): {e}",
        over.name(),
        BEAT * MISSES
    );
}

async fn frozen_peer_releases_a_blocked_sender(over: Over) {
    let ctx = over.ctx(4);
    let mut l = ctx.bind(&over.url("blocked")).await.unwrap();
    let mut peer = Peer::start("sink", l.local_url()).await;
    let (mut tx, _rx) = timeout(GUARD, l.accept()).await.unwrap().unwrap().split();
    let body = bytes::Bytes::from(vec![1u8; 256 << 10]);
    let mut sent = 0;
    // Fill everything until the sender blocks (the peer never reads, and is alive: nothing
    // fails while it is).
    loop {
        let m = Message::new("x").unwrap().with_body(body.clone());
        match timeout(BEAT * MISSES * 3, tx.send(m)).await {
            Ok(r) => r.unwrap(),
            Err(_) => break,
        }
        sent += 1;
    }
    let blocked = tokio::spawn(async move {
        let m = Message::new("x").unwrap().with_body(body);
        tx.send(m).await
    });
    let frozen = std::time::Instant::now();
    peer.freeze();
    let e = timeout(GUARD, blocked).await.unwrap().unwrap().unwrap_err();
    assert_silent(&e);
    println!(
        "frozen peer over {}: the sender blocked after {sent} sends failed {:.0?} after SIGSTOP",
        over.name(),
        frozen.elapsed()
    );
}

/// A peer that is alive but does not read holds our sender back (backpressure) for far
/// longer than the heartbeat limit, and neither side is failed for it.
async fn peer_that_does_not_read_is_not_lost(over: Over) {
    let ctx = over.ctx(4);
    let mut l = ctx.bind(&over.url("sink")).await.unwrap();
    let _peer = Peer::start("sink", l.local_url()).await;
    let (mut tx, mut rx) = timeout(GUARD, l.accept()).await.unwrap().unwrap().split();
    let body = bytes::Bytes::from(vec![1u8; 256 << 10]);
    let send = async {
        loop {
            let m = Message::new("x").unwrap().with_body(body.clone());
            if let Err(e) = tx.send(m).await {
                return e;
            }
        }
    };
    let hold = BEAT * MISSES * 6;
    if let Ok(e) = timeout(hold, send).await {
        panic!("a live peer that does not read was failed: {e}");
    }
    // Nor did our receiving half hear of any failure.
    assert!(timeout(BEAT, rx.recv()).await.is_err());
}

#[tokio::test]
async fn uring_frozen_peer_fails_both_halves() {
    frozen_peer_fails_both_halves(Over::Tcp(IoEngine::Uring)).await;
}

#[tokio::test]
async fn epoll_frozen_peer_fails_both_halves() {
    frozen_peer_fails_both_halves(Over::Tcp(IoEngine::Epoll)).await;
}

#[tokio::test]
async fn inline_frozen_peer_fails_both_halves() {
    frozen_peer_fails_both_halves(Over::Tcp(IoEngine::Inline)).await;
}

#[tokio::test]
async fn shm_frozen_peer_fails_both_halves() {
    frozen_peer_fails_both_halves(Over::Shm).await;
}

#[tokio::test]
async fn epoll_frozen_peer_releases_a_blocked_sender() {
    frozen_peer_releases_a_blocked_sender(Over::Tcp(IoEngine::Epoll)).await;
}

#[tokio::test]
async fn inline_frozen_peer_releases_a_blocked_sender() {
    frozen_peer_releases_a_blocked_sender(Over::Tcp(IoEngine::Inline)).await;
}

#[tokio::test]
async fn shm_frozen_peer_releases_a_blocked_sender() {
    frozen_peer_releases_a_blocked_sender(Over::Shm).await;
}

#[tokio::test]
async fn epoll_peer_that_does_not_read_is_not_lost() {
    peer_that_does_not_read_is_not_lost(Over::Tcp(IoEngine::Epoll)).await;
}

#[tokio::test]
async fn inline_peer_that_does_not_read_is_not_lost() {
    peer_that_does_not_read_is_not_lost(Over::Tcp(IoEngine::Inline)).await;
}

#[tokio::test]
async fn shm_peer_that_does_not_read_is_not_lost() {
    peer_that_does_not_read_is_not_lost(Over::Shm).await;
}
