//! Channel semantics, one suite run against every transport (inproc, tcp on io_uring, tcp on
//! epoll, tcp inline, shm, and with the `rdma` feature the RDMA transport over simulated
//! verbs): round trips, ordering, full duplex across tasks, half close, backpressure,
//! limits, receiver drop, reunite, cancel safety.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use hyperframes::{Channel, Context, ContextBuilder, ErrorKind, Flags, Header, IoEngine, Message};
use tokio::time::timeout;

#[derive(Clone, Copy, Debug)]
enum T {
    Inproc,
    Uring,
    Epoll,
    Inline,
    Shm,
    /// `rdma+sim://`: the RDMA protocol and driver over the simulated verbs.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    RdmaSim,
    /// `tls://` (mutual TLS) on the inline engine and on io_uring I/O threads.
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    TlsInline,
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    TlsUring,
}

#[cfg(feature = "tls")]
#[path = "common/certs.rs"]
mod certs;

#[cfg(feature = "tls")]
fn with_tls(b: ContextBuilder) -> ContextBuilder {
    b.tls(certs::mutual())
}
#[cfg(not(feature = "tls"))]
fn with_tls(_: ContextBuilder) -> ContextBuilder {
    unreachable!("tls:// cases run with the tls feature only")
}

static NAME: AtomicUsize = AtomicUsize::new(0);

const GUARD: Duration = Duration::from_secs(30);

impl T {
    fn ctx(self, b: ContextBuilder) -> Context {
        match self {
            T::Inproc => b.build().unwrap(),
            T::Uring => b.io_engine(IoEngine::Uring).build().unwrap(),
            T::Epoll => b.io_engine(IoEngine::Epoll).build().unwrap(),
            T::Inline => b.io_engine(IoEngine::Inline).build().unwrap(),
            T::Shm => b.shm_segment(256, 1 << 20).build().unwrap(),
            T::RdmaSim => b.build().unwrap(),
            T::TlsInline => with_tls(b).io_engine(IoEngine::Inline).build().unwrap(),
            T::TlsUring => with_tls(b).io_engine(IoEngine::Uring).build().unwrap(),
        }
    }

    fn url(self) -> String {
        match self {
            T::Inproc => format!("inproc://chan-{}", NAME.fetch_add(1, Ordering::Relaxed)),
            T::Uring | T::Epoll | T::Inline => "tcp://127.0.0.1:0".into(),
            T::TlsInline | T::TlsUring => "tls://127.0.0.1:0".into(),
            T::RdmaSim => format!("rdma+sim://chan-{}", NAME.fetch_add(1, Ordering::Relaxed)),
            T::Shm => format!(
                "shm://chan-{}-{}",
                std::process::id(),
                NAME.fetch_add(1, Ordering::Relaxed)
            ),
        }
    }

    /// tcp or tls: a port, not a name.
    fn is_tcp(self) -> bool {
        matches!(
            self,
            T::Uring | T::Epoll | T::Inline | T::TlsInline | T::TlsUring
        )
    }
}

/// A connected pair (client, server) on one context.
async fn pair_with(t: T, b: ContextBuilder) -> (Context, Channel, Channel) {
    let ctx = t.ctx(b);
    let mut l = ctx.bind(&t.url()).await.unwrap();
    let url = l.local_url().to_owned();
    let (c, s) = tokio::join!(ctx.connect(&url), l.accept());
    (ctx, c.unwrap(), s.unwrap())
}

async fn pair(t: T) -> (Context, Channel, Channel) {
    pair_with(t, Context::builder()).await
}

fn msg(i: u64, len: usize) -> Message {
    let body: Vec<u8> = (0..len)
        .map(|j| (j as u64).wrapping_mul(31).wrapping_add(i) as u8)
        .collect();
    Message::new("test.seq")
        .unwrap()
        .with_meta("i", i.to_string())
        .unwrap()
        .with_body(body)
}

fn seq(m: &Message) -> u64 {
    m.meta().get("i").unwrap().parse().unwrap()
}

async fn round_trip_every_field(t: T) {
    let (_ctx, mut c, mut s) = pair(t).await;
    for (i, len) in [0usize, 1, 64, 511, 512, 513, 65536, 300 << 10, 4 << 20]
        .into_iter()
        .enumerate()
    {
        let m = msg(i as u64, len)
            .with_meta("shape", "1920x1080")
            .unwrap()
            .with_header(Header {
                flags: Flags::REQUEST,
                correlation: 0xdead_beef_0000 + i as u64,
            });
        c.send(m.clone()).await.unwrap();
        let got = timeout(GUARD, s.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(got, m, "len {len}");
        // and back the other way
        s.send(got).await.unwrap();
        let back = timeout(GUARD, c.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(back, m);
    }
}

async fn in_order_under_load(t: T) {
    let (_ctx, c, s) = pair(t).await;
    let (mut tx, _crx) = c.split();
    let (_stx, mut rx) = s.split();
    const N: u64 = 20_000;
    let sender = tokio::spawn(async move {
        for i in 0..N {
            tx.send(msg(i, (i % 97) as usize * 13)).await.unwrap();
        }
        tx.close().await.unwrap();
    });
    for i in 0..N {
        let m = timeout(GUARD, rx.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(seq(&m), i);
        assert_eq!(m, msg(i, (i % 97) as usize * 13));
    }
    assert!(timeout(GUARD, rx.recv()).await.unwrap().is_none());
    sender.await.unwrap();
}

async fn full_duplex_across_tasks(t: T) {
    let (_ctx, c, s) = pair(t).await;
    const N: u64 = 2_000;
    let mut tasks = Vec::new();
    for ch in [c, s] {
        let (mut tx, mut rx) = ch.split();
        tasks.push(tokio::spawn(async move {
            for i in 0..N {
                tx.send(msg(i, 1000)).await.unwrap();
            }
            tx.close().await.unwrap();
        }));
        tasks.push(tokio::spawn(async move {
            let mut n = 0;
            while let Some(m) = timeout(GUARD, rx.recv()).await.unwrap() {
                assert_eq!(seq(&m.unwrap()), n);
                n += 1;
            }
            assert_eq!(n, N);
        }));
    }
    for t in tasks {
        timeout(GUARD, t).await.unwrap().unwrap();
    }
}

fn futures_executor_block_on<F: std::future::Future>(f: F) -> F::Output {
    // Polls a future on this thread with no runtime at all, as a non-tokio executor would.
    let waker = futures_util::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::yield_now();
    }
}

async fn half_close_keeps_the_other_direction(t: T) {
    let (_ctx, mut c, mut s) = pair(t).await;
    c.send(msg(1, 10)).await.unwrap();
    c.close().await.unwrap();
    assert_eq!(seq(&s.recv().await.unwrap().unwrap()), 1);
    assert!(
        timeout(GUARD, s.recv()).await.unwrap().is_none(),
        "stream ends after close"
    );
    assert!(s.recv().await.is_none(), "and stays ended");
    // the server can still talk to the client
    s.send(msg(2, 10)).await.unwrap();
    s.flush().await.unwrap();
    assert_eq!(
        seq(&timeout(GUARD, c.recv()).await.unwrap().unwrap().unwrap()),
        2
    );
    // sending on a closed sender is an error, not a hang
    let e = c.send(msg(3, 1)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Closed);
    s.close().await.unwrap();
    assert!(timeout(GUARD, c.recv()).await.unwrap().is_none());
}

async fn drop_is_a_close(t: T) {
    let (_ctx, c, mut s) = pair(t).await;
    let (mut tx, rx) = c.split();
    for i in 0..100 {
        tx.send(msg(i, 100)).await.unwrap();
    }
    drop(tx);
    drop(rx);
    for i in 0..100 {
        assert_eq!(
            seq(&timeout(GUARD, s.recv()).await.unwrap().unwrap().unwrap()),
            i
        );
    }
    assert!(timeout(GUARD, s.recv()).await.unwrap().is_none());
}

async fn backpressure_is_real(t: T) {
    let (_ctx, c, mut s) = pair_with(
        t,
        Context::builder()
            .send_queue(8, 1 << 20)
            .recv_queue(8, 1 << 20),
    )
    .await;
    let (mut tx, _rx) = c.split();
    let body = Bytes::from(vec![7u8; 64 << 10]);
    let mut sent = 0u64;
    // Nobody reads: the queues fill, then the kernel's socket buffers (which grow for a
    // while), and then the sender must stay blocked.
    loop {
        let m = Message::new("test.bp").unwrap().with_body(body.clone());
        match tx.try_send(m) {
            Ok(()) => sent += 1,
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Full);
                if timeout(Duration::from_millis(300), tx.ready())
                    .await
                    .is_err()
                {
                    break; // blocked for good while nobody reads
                }
            }
        }
        assert!(sent < 20_000, "no backpressure after {sent} x 64 KiB");
    }
    // Everything sent arrives once the receiver reads.
    let reader = tokio::spawn(async move {
        let mut n = 0u64;
        while let Some(m) = timeout(GUARD, s.recv()).await.unwrap() {
            assert_eq!(m.unwrap().body().len(), 64 << 10);
            n += 1;
        }
        n
    });
    tx.ready().await.unwrap();
    tx.close().await.unwrap();
    assert_eq!(reader.await.unwrap(), sent);
}

/// `send` cancelled at every point it can wait, under backpressure: a cancelled send sent
/// nothing (tokio mpsc's promise). The sender retries each message until a send completes,
/// so a cancelled send that went out anyway would arrive twice; the receiver, slow on
/// purpose, must see every message exactly once, in order.
async fn cancelled_sends_arrive_once_or_not_at_all(t: T) {
    let b = Context::builder()
        .send_queue(4, 64 << 10)
        .recv_queue(4, 64 << 10)
        .shm_segment(16, 64 << 10)
        .max_body(1 << 20);
    #[cfg(feature = "rdma")]
    let b = b.rdma_pool_bytes(2 << 20);
    let (_ctx, c, s) = pair_with(t, b).await;
    let (mut tx, _crx) = c.split();
    let (_stx, mut rx) = s.split();
    const N: u64 = 400;
    let reader = tokio::spawn(async move {
        let mut got = Vec::new();
        while let Some(m) = timeout(GUARD, rx.recv()).await.unwrap() {
            got.push(seq(&m.unwrap()));
            if got.len() % 16 == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        got
    });
    let mut cancelled = 0u64;
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    // Made once: the sender must outrun the reader (a debug build spends long making bodies).
    let bodies = [0usize, 100, 64 << 10, 256 << 10].map(|n| Bytes::from(vec![7u8; n]));
    for i in 0..N {
        loop {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            // 0 to 200 µs: from before the first poll to well into a wait for room.
            let patience = Duration::from_micros(rng % 200);
            let m = Message::new("test.seq")
                .unwrap()
                .with_meta("i", i)
                .unwrap()
                .with_body(bodies[(rng >> 20) as usize % 4].clone());
            match timeout(patience, tx.send(m)).await {
                Ok(r) => {
                    r.unwrap();
                    break;
                }
                Err(_) => cancelled += 1,
            }
        }
    }
    tx.close().await.unwrap();
    let got = timeout(GUARD, reader).await.unwrap().unwrap();
    assert_eq!(
        got,
        (0..N).collect::<Vec<_>>(),
        "each message exactly once, in order"
    );
    assert!(
        cancelled > 0,
        "no send was ever cancelled: the test proved nothing"
    );
}

async fn receiver_drop_fails_the_peers_sender(t: T) {
    let (_ctx, c, s) = pair(t).await;
    let (mut tx, _rx) = c.split();
    let (_stx, srx) = s.split();
    drop(srx);
    let res = timeout(GUARD, async {
        loop {
            if let Err(e) = tx.send(msg(0, 10)).await {
                return e;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap();
    assert_eq!(res.kind(), ErrorKind::Closed, "{res}");
}

async fn peer_limits_are_enforced_at_send(t: T) {
    let ctx = t.ctx(Context::builder().max_body(1024).max_meta_entries(2));
    let mut l = ctx.bind(&t.url()).await.unwrap();
    let url = l.local_url().to_owned();
    let (c, s) = tokio::join!(ctx.connect(&url), l.accept());
    let (mut c, mut s) = (c.unwrap(), s.unwrap());
    assert_eq!(c.info().peer_limits().max_body, 1024);
    let mut e = c.send(msg(1, 2048)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::LimitExceeded);
    assert!(e.to_string().contains("max_body"), "{e}");
    assert_eq!(
        e.take_message().unwrap().body().len(),
        2048,
        "message handed back"
    );
    let m = msg(2, 10)
        .with_meta("a", "1")
        .unwrap()
        .with_meta("b", "2")
        .unwrap();
    assert_eq!(
        c.send(m).await.unwrap_err().kind(),
        ErrorKind::LimitExceeded
    );
    // the channel is still usable
    c.send(msg(3, 1024)).await.unwrap();
    assert_eq!(
        seq(&timeout(GUARD, s.recv()).await.unwrap().unwrap().unwrap()),
        3
    );
}

async fn reunite_checks_identity(t: T) {
    let (_ctx, c, s) = pair(t).await;
    let (ctx_, ctx_rx) = c.split();
    let (stx, srx) = s.split();
    let err = ctx_.reunite(srx).unwrap_err();
    let (ctx_, srx) = (err.0, err.1);
    let mut c = ctx_.reunite(ctx_rx).unwrap();
    let mut s = srx.reunite(stx).unwrap();
    c.send(msg(5, 5)).await.unwrap();
    assert_eq!(
        seq(&timeout(GUARD, s.recv()).await.unwrap().unwrap().unwrap()),
        5
    );
}

async fn sink_and_stream_traits(t: T) {
    let (_ctx, c, s) = pair(t).await;
    let (mut tx, _) = c.split();
    let (_, rx) = s.split();
    // Receive concurrently: 500 messages need not fit in the transport's buffers.
    let reader = tokio::spawn(rx.map(|m| seq(&m.unwrap())).collect::<Vec<_>>());
    let mut items = futures_util::stream::iter((0..500).map(|i| Ok(msg(i, 64))));
    tx.send_all(&mut items).await.unwrap();
    SinkExt::close(&mut tx).await.unwrap();
    let got = timeout(GUARD, reader).await.unwrap().unwrap();
    assert_eq!(got, (0..500).collect::<Vec<_>>());
}

async fn recv_is_cancel_safe(t: T) {
    let (_ctx, c, mut s) = pair(t).await;
    let (mut tx, _) = c.split();
    let sender = tokio::spawn(async move {
        for i in 0..300 {
            tx.send(msg(i, 32)).await.unwrap();
            if i % 7 == 0 {
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        }
        tx.close().await.unwrap();
    });
    let mut next = 0;
    loop {
        // A recv cancelled by a short timeout must not lose the message.
        match timeout(Duration::from_micros(50), s.recv()).await {
            Err(_) => continue,
            Ok(None) => break,
            Ok(Some(m)) => {
                assert_eq!(seq(&m.unwrap()), next);
                next += 1;
            }
        }
    }
    assert_eq!(next, 300);
    sender.await.unwrap();
}

async fn many_peers_one_listener(t: T) {
    let ctx = t.ctx(Context::builder());
    let mut l = ctx.bind(&t.url()).await.unwrap();
    let url = l.local_url().to_owned();
    let server = tokio::spawn(async move {
        let mut handlers = Vec::new();
        for _ in 0..32 {
            let mut ch = l.accept().await.unwrap();
            handlers.push(tokio::spawn(async move {
                while let Some(m) = ch.recv().await {
                    ch.send(m.unwrap()).await.unwrap();
                }
                ch.close().await.unwrap();
            }));
        }
        for h in handlers {
            h.await.unwrap();
        }
    });
    let mut clients = Vec::new();
    for k in 0..32u64 {
        let ctx = ctx.clone();
        let url = url.clone();
        clients.push(tokio::spawn(async move {
            let mut ch = ctx.connect(&url).await.unwrap();
            for i in 0..50 {
                ch.send(msg(k * 1000 + i, 100)).await.unwrap();
                let back = ch.recv().await.unwrap().unwrap();
                assert_eq!(seq(&back), k * 1000 + i);
            }
            ch.close().await.unwrap();
            assert!(ch.recv().await.is_none());
        }));
    }
    for c in clients {
        timeout(GUARD, c).await.unwrap().unwrap();
    }
    timeout(GUARD, server).await.unwrap().unwrap();
}

/// Many strict request/response round trips: the receiving side keeps finding the ring
/// empty and a message arriving right after, the race where wake-ups get lost.
async fn ping_pong_many_times(t: T) {
    let (_ctx, mut c, s) = pair(t).await;
    let echo = tokio::spawn(async move {
        let mut s = s;
        while let Some(m) = s.recv().await {
            s.send(m.unwrap()).await.unwrap();
        }
    });
    for i in 0..20_000 {
        c.send(msg(i, 64)).await.unwrap();
        let back = timeout(Duration::from_secs(10), c.recv())
            .await
            .unwrap_or_else(|_| panic!("round trip {i} hung"))
            .unwrap()
            .unwrap();
        assert_eq!(seq(&back), i);
    }
    c.close().await.unwrap();
    timeout(GUARD, echo).await.unwrap().unwrap();
}

async fn channels_outlive_their_context(t: T) {
    let (ctx, mut c, mut s) = pair(t).await;
    drop(ctx);
    c.send(msg(9, 9)).await.unwrap();
    assert_eq!(
        seq(&timeout(GUARD, s.recv()).await.unwrap().unwrap().unwrap()),
        9
    );
}

async fn listener_reports_its_address(t: T) {
    let ctx = t.ctx(Context::builder());
    let url = t.url();
    let l = ctx.bind(&url).await.unwrap();
    if t.is_tcp() {
        let scheme = url.split("://").next().unwrap();
        assert!(
            l.local_url().starts_with(&format!("{scheme}://127.0.0.1:")),
            "{}",
            l.local_url()
        );
        assert!(
            !l.local_url().ends_with(":0"),
            "real port: {}",
            l.local_url()
        );
        let again = ctx.bind(l.local_url()).await.unwrap_err();
        assert_eq!(again.kind(), ErrorKind::AddrInUse, "{again}");
    } else {
        assert_eq!(l.local_url(), url);
        assert_eq!(
            ctx.bind(&url).await.unwrap_err().kind(),
            ErrorKind::AddrInUse
        );
        drop(l);
        ctx.bind(&url)
            .await
            .expect("name free again after the listener is dropped");
    }
}

/// A consumer that always finds a message waiting still lets the tasks of its runtime run
/// (every 512 receives): on a current-thread runtime the connection's own tasks (writes,
/// heartbeats, a session's driver) would otherwise wait for the whole queue.
async fn a_busy_receiver_lets_other_tasks_run(t: T) {
    let (_ctx, mut c, mut s) = pair(t).await;
    // As many as the transport holds without a reader, up to N.
    const N: u64 = 800;
    let mut n = 0;
    while n < N {
        match timeout(Duration::from_millis(200), c.send(msg(n, 16))).await {
            Ok(r) => r.unwrap(),
            Err(_) => break, // full: a cancelled send sent nothing
        }
        n += 1;
    }
    let _ = timeout(Duration::from_millis(500), c.flush()).await;
    if n <= 600 {
        eprintln!("skipped: {t:?} holds {n} messages without a reader, too few to show a yield");
        return;
    }
    // All of them waiting at the receiver.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let ran = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = ran.clone();
    tokio::spawn(async move { flag.store(true, Ordering::Relaxed) });
    let mut ran_at = None;
    for i in 0..n {
        let m = timeout(GUARD, s.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(seq(&m), i);
        if ran_at.is_none() && ran.load(Ordering::Relaxed) {
            ran_at = Some(i);
        }
    }
    assert!(
        ran_at.is_some(),
        "{n} receives in a row and the other task never ran"
    );
}

macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        mod inproc { $( #[tokio::test] async fn $name() { super::$name(super::T::Inproc).await } )* }
        mod tcp_uring { $( #[tokio::test] async fn $name() { super::$name(super::T::Uring).await } )* }
        mod tcp_epoll { $( #[tokio::test] async fn $name() { super::$name(super::T::Epoll).await } )* }
        mod tcp_inline { $( #[tokio::test] async fn $name() { super::$name(super::T::Inline).await } )* }
        mod shm { $( #[tokio::test] async fn $name() { super::$name(super::T::Shm).await } )* }
        #[cfg(feature = "rdma")]
        mod rdma_sim { $( #[tokio::test] async fn $name() { super::$name(super::T::RdmaSim).await } )* }
        #[cfg(feature = "tls")]
        mod tls_inline { $( #[tokio::test] async fn $name() { super::$name(super::T::TlsInline).await } )* }
        #[cfg(feature = "tls")]
        mod tls_uring { $( #[tokio::test] async fn $name() { super::$name(super::T::TlsUring).await } )* }
    };
}

suite!(
    round_trip_every_field,
    in_order_under_load,
    full_duplex_across_tasks,
    half_close_keeps_the_other_direction,
    drop_is_a_close,
    backpressure_is_real,
    cancelled_sends_arrive_once_or_not_at_all,
    receiver_drop_fails_the_peers_sender,
    peer_limits_are_enforced_at_send,
    reunite_checks_identity,
    sink_and_stream_traits,
    recv_is_cancel_safe,
    many_peers_one_listener,
    ping_pong_many_times,
    channels_outlive_their_context,
    listener_reports_its_address,
    a_busy_receiver_lets_other_tasks_run,
);

/// The same round trips with the two sides on different threads (a current-thread runtime
/// never runs them at once, so it cannot show races between them).
mod threaded {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ping_pong_inproc() {
        ping_pong_many_times(T::Inproc).await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ping_pong_uring() {
        ping_pong_many_times(T::Uring).await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ping_pong_inline() {
        ping_pong_many_times(T::Inline).await
    }
    #[cfg(feature = "rdma")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ping_pong_rdma_sim() {
        ping_pong_many_times(T::RdmaSim).await
    }
    #[cfg(feature = "rdma")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn in_order_under_load_rdma_sim() {
        in_order_under_load(T::RdmaSim).await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ping_pong_shm() {
        ping_pong_many_times(T::Shm).await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn in_order_under_load_shm() {
        in_order_under_load(T::Shm).await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn backpressure_shm() {
        backpressure_is_real(T::Shm).await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cancelled_sends_shm() {
        cancelled_sends_arrive_once_or_not_at_all(T::Shm).await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cancelled_sends_inline() {
        cancelled_sends_arrive_once_or_not_at_all(T::Inline).await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cancelled_sends_uring() {
        cancelled_sends_arrive_once_or_not_at_all(T::Uring).await
    }
    #[cfg(feature = "tls")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ping_pong_tls_inline() {
        ping_pong_many_times(T::TlsInline).await
    }
    #[cfg(feature = "tls")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn in_order_under_load_tls_inline() {
        in_order_under_load(T::TlsInline).await
    }
    #[cfg(feature = "tls")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cancelled_sends_tls_inline() {
        cancelled_sends_arrive_once_or_not_at_all(T::TlsInline).await
    }
}

// ---- tcp only ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_works_from_a_multi_thread_runtime() {
    round_trip_every_field(T::Uring).await;
    round_trip_every_field(T::Epoll).await;
    round_trip_every_field(T::Inline).await;
    in_order_under_load(T::Inline).await;
}

/// Large bodies arrive in many reads, each of which may end short (the socket empty for
/// now): the Receiver then forgets the socket's readiness and waits for epoll. On a
/// multi-thread runtime the reactor may record new data meanwhile, and forgetting that event
/// too stalled a transfer until the stall timeout (seen in `tcp_works_from_a_multi_thread_runtime`).
async fn large_bodies_keep_flowing(t: T) {
    let (_ctx, mut c, mut s) = pair(t).await;
    // A race of timing, caught only sometimes: against the faulty read, 1 run in 5 of this
    // test failed here alone, and 20 of 45 runs of `tcp_works_from_a_multi_thread_runtime`
    // with three at once.
    for i in 0..60u64 {
        let len = [(64 << 10) + 7, 300 << 10, (1 << 20) + 3][i as usize % 3];
        let m = msg(i, len);
        c.send(m.clone()).await.unwrap();
        let got = timeout(GUARD, s.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(got, m, "message {i}, {len} B");
        s.send(got).await.unwrap();
        let back = timeout(GUARD, c.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(back, m, "message {i} back, {len} B");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_keep_flowing_on_a_multi_thread_runtime() {
    large_bodies_keep_flowing(T::Inline).await;
    #[cfg(feature = "tls")]
    large_bodies_keep_flowing(T::TlsInline).await;
}

#[test]
fn inline_without_a_runtime_is_a_clear_error() {
    let ctx = Context::builder()
        .io_engine(IoEngine::Inline)
        .build()
        .unwrap();
    let e = futures_executor_block_on(ctx.bind("tcp://127.0.0.1:0")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable);
    assert!(e.to_string().contains("tokio runtime"), "{e}");
}

#[test]
fn tcp_works_without_any_runtime_in_the_caller() {
    // The context's own I/O threads do the work; the caller's executor needs no reactor.
    let ctx = Context::new();
    futures_executor_block_on(async {
        let mut l = ctx.bind("tcp://127.0.0.1:0").await.unwrap();
        let url = l.local_url().to_owned();
        let (c, s) = futures_util::future::join(ctx.connect(&url), l.accept()).await;
        let (mut c, mut s) = (c.unwrap(), s.unwrap());
        c.send(msg(1, 100)).await.unwrap();
        assert_eq!(seq(&s.recv().await.unwrap().unwrap()), 1);
    });
}

#[tokio::test]
async fn tcp_ipv6_loopback() {
    let ctx = Context::new();
    let mut l = match ctx.bind("tcp://[::1]:0").await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("no IPv6 loopback here, skipping: {e}");
            return;
        }
    };
    assert!(
        l.local_url().starts_with("tcp://[::1]:"),
        "{}",
        l.local_url()
    );
    let url = l.local_url().to_owned();
    let (c, s) = tokio::join!(ctx.connect(&url), l.accept());
    let (mut c, mut s) = (c.unwrap(), s.unwrap());
    assert!(s.info().peer_url().starts_with("tcp://[::1]:"));
    c.send(msg(1, 1 << 20)).await.unwrap();
    assert_eq!(s.recv().await.unwrap().unwrap(), msg(1, 1 << 20));
}

#[tokio::test]
async fn tcp_connect_refused_is_a_clear_error() {
    // Bind then drop to find a port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = Context::new()
        .connect(&format!("tcp://127.0.0.1:{port}"))
        .await
        .unwrap_err();
    assert_eq!(
        e.io_kind(),
        Some(std::io::ErrorKind::ConnectionRefused),
        "{e}"
    );
    assert!(e.to_string().contains("refused"), "{e}");
    assert!(e.to_string().contains(&port.to_string()), "{e}");
}

#[tokio::test]
async fn inproc_connect_to_nothing_is_refused() {
    let e = Context::new()
        .connect("inproc://nobody-here")
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionRefused);
}

#[tokio::test]
async fn inproc_names_are_per_context() {
    let a = Context::new();
    let b = Context::new();
    let _l = a.bind("inproc://same").await.unwrap();
    let _l2 = b.bind("inproc://same").await.unwrap();
    assert_eq!(
        Context::new()
            .connect("inproc://same")
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::ConnectionRefused
    );
}

#[tokio::test]
async fn io_engine_is_reported() {
    let ctx = Context::builder()
        .io_engine(IoEngine::Epoll)
        .build()
        .unwrap();
    assert_eq!(ctx.io_engine(), None);
    let _l = ctx.bind("tcp://127.0.0.1:0").await.unwrap();
    assert_eq!(ctx.io_engine(), Some(IoEngine::Epoll));
    let ctx = Context::builder()
        .io_engine(IoEngine::Uring)
        .build()
        .unwrap();
    let _l = ctx.bind("tcp://127.0.0.1:0").await.unwrap();
    assert_eq!(ctx.io_engine(), Some(IoEngine::Uring));
}

/// `Auto` runs a connection inline where a usable tokio runtime polls it, on I/O threads
/// elsewhere, and never panics on a runtime with its drivers off.
#[test]
fn auto_picks_inline_inside_a_tokio_runtime_and_threads_elsewhere() {
    let auto = || {
        Context::builder()
            .io_engine(IoEngine::Auto)
            .build()
            .unwrap()
    };
    let full = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let ctx = auto();
    full.block_on(async {
        let _l = ctx.bind("tcp://127.0.0.1:0").await.unwrap();
    });
    assert_eq!(ctx.io_engine(), Some(IoEngine::Inline));

    // A runtime without I/O or timers: tokio would panic on a socket; Auto uses threads.
    let bare = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let ctx = auto();
    let l = bare.block_on(ctx.bind("tcp://127.0.0.1:0")).unwrap();
    assert!(matches!(
        ctx.io_engine(),
        Some(IoEngine::Uring | IoEngine::Epoll)
    ));
    drop(l);
}

#[tokio::test]
async fn bad_urls_are_refused_before_any_io() {
    let ctx = Context::new();
    for (url, kind) in [
        ("tcp://127.0.0.1", ErrorKind::InvalidUrl),
        ("nope://x", ErrorKind::UnsupportedScheme),
        ("inproc://", ErrorKind::InvalidUrl),
    ] {
        assert_eq!(ctx.connect(url).await.unwrap_err().kind(), kind, "{url}");
        assert_eq!(ctx.bind(url).await.unwrap_err().kind(), kind, "{url}");
    }
    assert_eq!(ctx.io_engine(), None, "no I/O thread started for a bad URL");
}

/// inproc spins before it parks, and with busy-poll never parks: both must still deliver
/// everything in order, with the two ends on two threads (where spinning pays) and on one
/// single-threaded runtime (where the peer can only run once this side yields), with a
/// send queue small enough that the sender waits for room.
#[test]
fn inproc_spinning_and_busy_polling_lose_nothing_and_never_hang() {
    const N: u64 = 3000;
    async fn echo(ch: Channel) {
        let (mut tx, mut rx) = ch.split();
        while let Some(m) = rx.recv().await {
            tx.send(m.unwrap()).await.unwrap();
        }
    }
    async fn drive(ch: Channel) {
        let (mut tx, mut rx) = ch.split();
        // Streams ahead by up to 6 messages (less than both queues hold, or it would deadlock
        // by design), then reads the echoes back in order.
        let mut next = 0u64;
        for i in 0..N {
            let m = Message::new("t.spin")
                .unwrap()
                .with_meta("i", i.to_string())
                .unwrap();
            tx.send(m).await.unwrap();
            while next + 6 <= i || (i + 1 == N && next < N) {
                let m = rx.recv().await.unwrap().unwrap();
                assert_eq!(m.meta().get("i"), Some(next.to_string().as_str()));
                next += 1;
            }
        }
        assert_eq!(next, N);
    }
    for busy in [false, true] {
        let ctx = Context::builder()
            .busy_poll(busy)
            .send_queue(4, 1 << 20)
            .recv_queue(4, 1 << 20)
            .build()
            .unwrap();
        let rt = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
        };
        // One thread, one runtime.
        rt().block_on(async {
            let mut l = ctx.bind("inproc://spin-one").await.unwrap();
            let peer = tokio::spawn(async move { echo(l.accept().await.unwrap()).await });
            let ch = ctx.connect("inproc://spin-one").await.unwrap();
            timeout(GUARD, drive(ch)).await.expect("one thread: hung");
            timeout(GUARD, peer).await.unwrap().unwrap();
        });
        // Two threads.
        let mut l = rt().block_on(ctx.bind("inproc://spin-two")).unwrap();
        let peer = std::thread::spawn(move || {
            rt().block_on(async { echo(l.accept().await.unwrap()).await })
        });
        rt().block_on(async {
            let ch = ctx.connect("inproc://spin-two").await.unwrap();
            timeout(GUARD, drive(ch)).await.expect("two threads: hung");
        });
        peer.join().unwrap();
    }
}

/// A connection `Auto` ran inline lives on the runtime it was made in: once that runtime is
/// gone, both halves say so (from another runtime) instead of waiting forever.
#[test]
fn an_inline_connection_outliving_its_runtime_fails_clearly() {
    let rt = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    let ctx = Context::builder()
        .io_engine(IoEngine::Auto)
        .build()
        .unwrap();
    // The listener on a thread of its own, which keeps the accepted channel open.
    let server_ctx = ctx.clone();
    let (url_tx, url_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        rt().block_on(async {
            let mut l = server_ctx.bind("tcp://127.0.0.1:0").await.unwrap();
            url_tx.send(l.local_url().to_owned()).unwrap();
            let _ch = l.accept().await.unwrap();
            tokio::task::spawn_blocking(move || done_rx.recv())
                .await
                .unwrap()
                .ok();
        })
    });
    let url = url_rx.recv().unwrap();
    let first = rt();
    let ch = first.block_on(ctx.connect(&url)).unwrap();
    assert_eq!(ctx.io_engine(), Some(IoEngine::Inline));
    drop(first);
    let (mut tx, mut rx) = ch.split();
    rt().block_on(async {
        let sent = timeout(GUARD, tx.send(Message::new("t.orphan").unwrap()))
            .await
            .expect("send hung");
        assert_eq!(sent.unwrap_err().kind(), ErrorKind::Unavailable);
        let got = timeout(GUARD, rx.recv()).await.expect("recv hung");
        assert_eq!(got.unwrap().unwrap_err().kind(), ErrorKind::Unavailable);
    });
    done_tx.send(()).unwrap();
    server.join().unwrap();
}
