//! A flood of silent connections costs a listener little memory, is held to the limits, and
//! does not keep good clients out: on tcp:// and tls://, on the inline engine and on the I/O
//! threads. One test in its own binary, so that the process's memory is this test's alone.
//! Memory is counted by the allocator (bytes allocated and not yet freed), not read from
//! RSS: an allocation nobody has touched yet costs no RSS, but is memory all the same.

use std::time::{Duration, Instant};

use hyperframes::{Context, ContextBuilder, IoEngine, Message};

#[cfg(feature = "tls")]
#[path = "common/certs.rs"]
mod certs;

const GUARD: Duration = Duration::from_secs(30);
/// Silent connections from one address, more than it may hold.
const FLOOD: usize = 400;
const PER_PEER: usize = 300;

#[path = "common/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::live_kib;

async fn flood(scheme: &str, engine: IoEngine, b: ContextBuilder) {
    let ctx = b
        .io_engine(engine)
        .handshake_timeout(GUARD) // the silent ones keep their places for the whole test
        .max_connections_per_peer(PER_PEER)
        .build()
        .unwrap();
    let mut l = ctx.bind(&format!("{scheme}://127.0.0.1:0")).await.unwrap();
    let url = l.local_url().to_owned();
    let addr: std::net::SocketAddr = url.split("://").nth(1).unwrap().parse().unwrap();
    // What the previous case left winds down first.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = live_kib();
    let mut silent = Vec::with_capacity(FLOOD);
    for _ in 0..FLOOD {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        silent.push(s.connect(addr).await.unwrap());
    }
    let deadline = Instant::now() + GUARD;
    while l.rejected() < (FLOOD - PER_PEER) as u64 {
        assert!(Instant::now() < deadline, "rejected {}", l.rejected());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Let every held one reach its handshake wait.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let held = live_kib().saturating_sub(before);

    // A good client from another address is served while they sit there.
    let started = Instant::now();
    let (c, s) = tokio::join!(ctx.connect(&url), l.accept());
    let (mut c, mut s) = (c.unwrap(), s.unwrap());
    c.send(Message::new("t.hello").unwrap()).await.unwrap();
    let got = tokio::time::timeout(GUARD, s.recv()).await.unwrap();
    assert_eq!(got.unwrap().unwrap().kind(), "t.hello");
    let served_in = started.elapsed();
    println!(
        "{scheme} {engine}: {FLOOD} silent connections, {PER_PEER} held ({} refused), memory +{} KiB \
         ({:.1} KiB each), a good client served in {served_in:.1?}",
        l.rejected(),
        held,
        held as f64 / PER_PEER as f64
    );
    // The finding this guards against: ~284 KiB per silent connection (a 256 KiB read
    // buffer for the handshake).
    assert!(
        held < (PER_PEER as u64) * 24,
        "{scheme} {engine}: {held} KiB for {PER_PEER} silent connections"
    );
    assert_eq!(l.rejected(), (FLOOD - PER_PEER) as u64);
    drop(silent);
}

#[tokio::test]
async fn silent_connections_cost_little_and_keep_nobody_out() {
    for engine in [IoEngine::Inline, IoEngine::Epoll] {
        flood("tcp", engine, Context::builder()).await;
        #[cfg(feature = "tls")]
        flood("tls", engine, Context::builder().tls(certs::mutual())).await;
    }
}
