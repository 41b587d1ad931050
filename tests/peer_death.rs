//! A peer process killed with SIGKILL: both halves of the survivor's channel report
//! `ConnectionLost` promptly, including a sender blocked by backpressure. The test binary
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
}

/// The peer side. `send URL`: connect, send one message, idle. `sink URL`: connect and never
/// read.
#[test]
fn child_peer() {
    let Ok(spec) = std::env::var("HF_TEST_CHILD") else {
        return;
    };
    let (mode, url) = spec.split_once(' ').unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut ch = Context::new().connect(url).await.unwrap();
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
