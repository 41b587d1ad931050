//! `Context::stats`: what a dropped `Sender` or `Receiver` left behind is counted, exactly
//! where the transport can know it: every message accepted is either received by the peer
//! or counted in `unsent`; every message that arrived for a dropped Receiver is in `unread`.

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::SinkExt;
use hyperframes::{Channel, Context, ContextStats, ErrorKind, IoEngine, Message, Sender};
use tokio::time::timeout;

#[path = "common/relay.rs"]
mod relay;
use relay::Relay;

const GUARD: Duration = Duration::from_secs(30);
const LINGER: Duration = Duration::from_millis(300);

fn ctx(engine: IoEngine) -> Context {
    ctx_lingering(engine, LINGER)
}

fn ctx_lingering(engine: IoEngine, linger: Duration) -> Context {
    Context::builder()
        .io_engine(engine)
        .linger(linger)
        // The peer that does not read must not be dropped for its silence.
        .heartbeat(None, 2)
        .recv_queue(2, 128 << 10)
        .send_queue(256, 4 << 20)
        .shm_segment(64, 256 << 10)
        .build()
        .unwrap()
}

fn msg(i: u64, body: &Bytes) -> Message {
    Message::new("stats.probe")
        .unwrap()
        .with_meta("i", i)
        .unwrap()
        .with_body(body.clone())
}

/// Sends until the transport is full (nobody reads), then `feed`s a few more that wait
/// staged in the Sender where the transport stages. Returns how many were accepted.
async fn fill(ch: &mut Sender, body: &Bytes) -> u64 {
    let mut n = 0;
    let mut full = 0;
    while full < 3 {
        match ch.try_send(msg(n, body)) {
            Ok(()) => {
                n += 1;
                full = 0;
            }
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Full, "{e:#}");
                full += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    for _ in 0..4 {
        match timeout(Duration::from_millis(50), ch.feed(msg(n, body))).await {
            Ok(Ok(())) => n += 1,
            Ok(Err(e)) => panic!("{e:#}"),
            Err(_) => break, // waiting for room: not accepted (a cancelled send sent nothing)
        }
    }
    n
}

/// A channel from `client` to a listener of `server` at `url`, and its accepted end.
async fn connected(server: &Context, client: &Context, url: &str) -> (Channel, Channel) {
    let mut l = server.bind(url).await.unwrap();
    let url = l.local_url().to_owned();
    tokio::join!(
        async { timeout(GUARD, client.connect(&url)).await.unwrap().unwrap() },
        async { timeout(GUARD, l.accept()).await.unwrap().unwrap() },
    )
}

async fn wait_for(what: &str, ctx: &Context, done: impl Fn(ContextStats) -> bool) -> ContextStats {
    let deadline = Instant::now() + GUARD;
    loop {
        let s = ctx.stats();
        if done(s) {
            return s;
        }
        assert!(Instant::now() < deadline, "{what}: {s:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Reads until the stream ends (cleanly or not); how many messages came, checked in order.
async fn drain(ch: &mut Channel) -> u64 {
    let mut got = 0;
    while let Ok(Some(Ok(m))) = timeout(GUARD, ch.recv()).await {
        assert_eq!(m.meta().get("i"), Some(got.to_string().as_str()));
        got += 1;
    }
    got
}

/// `ChannelInfo::stats`: the Sender counts what it handed over (not what `try_send` handed
/// back for lack of room, nor a `feed` cancelled while it waited), the Receiver what it
/// yielded; with everything read, the two agree.
async fn channel_stats_count_what_each_half_handed_over(url: &str, engine: IoEngine, body: usize) {
    let server_ctx = ctx(engine);
    let client_ctx = if url.starts_with("inproc") {
        server_ctx.clone()
    } else {
        ctx(engine)
    };
    let (ch, mut server) = connected(&server_ctx, &client_ctx, url).await;
    let body = Bytes::from(vec![9u8; body]);
    let (mut tx, _rx) = ch.split();
    let sent = fill(&mut tx, &body).await;
    let len = body.len() as u64;
    let s = tx.info().stats();
    assert_eq!((s.sent, s.sent_bytes), (sent, sent * len), "{url}: {s:?}");
    assert_eq!((s.received, s.received_bytes), (0, 0));
    // Closing flushes what waits for the reader: read meanwhile.
    let (closed, got) = tokio::join!(timeout(GUARD, tx.close()), drain(&mut server));
    closed.unwrap().unwrap();
    assert_eq!(got, sent, "{url}");
    let r = server.info().stats();
    assert_eq!(
        (r.received, r.received_bytes, r.sent),
        (got, got * len, 0),
        "{url}: {r:?}"
    );
}

#[tokio::test]
async fn tcp_inline_channel_stats() {
    channel_stats_count_what_each_half_handed_over("tcp://127.0.0.1:0", IoEngine::Inline, 4096)
        .await;
}

#[tokio::test]
async fn epoll_channel_stats() {
    channel_stats_count_what_each_half_handed_over("tcp://127.0.0.1:0", IoEngine::Epoll, 4096)
        .await;
}

#[tokio::test]
async fn inproc_channel_stats() {
    channel_stats_count_what_each_half_handed_over("inproc://stats", IoEngine::Auto, 100).await;
}

#[tokio::test]
async fn shm_channel_stats() {
    // Bodies larger than the arena: try_send takes back what it staged for lack of room.
    let url = format!("shm://chstats-{}", std::process::id());
    channel_stats_count_what_each_half_handed_over(&url, IoEngine::Auto, 1 << 20).await;
}

/// The peer reads nothing until the dropped Sender's linger is over: what it then reads
/// and what the sender's context counts add up to what was accepted, exactly.
async fn a_dropped_sender_accounts_for_every_message(url: &str, engine: IoEngine, body: usize) {
    let server_ctx = ctx(engine);
    let client_ctx = ctx(engine);
    let (ch, accepted) = connected(&server_ctx, &client_ctx, url).await;
    let body = Bytes::from(vec![5u8; body]);
    let (mut tx, rx) = ch.split();
    let sent = fill(&mut tx, &body).await;
    let mut server = accepted;
    assert_eq!(client_ctx.stats(), ContextStats::default());
    drop((tx, rx));
    let after = wait_for("the linger runs out", &client_ctx, |s| s.unsent > 0).await;
    let got = drain(&mut server).await;
    println!(
        "{url} {engine:?}: accepted {sent}, received {got}, unsent {}",
        after.unsent
    );
    if matches!(engine, IoEngine::Uring | IoEngine::Epoll) {
        // The I/O threads count per write: a message of a write cut short may count although
        // it arrived. Never fewer than were lost.
        assert!(got + after.unsent >= sent, "{url} {engine:?}");
        assert!(after.unsent <= sent);
    } else {
        assert_eq!(got + after.unsent, sent, "{url} {engine:?}");
    }
    assert_eq!(client_ctx.stats(), after, "counted once");
}

#[tokio::test]
async fn tcp_inline_dropped_sender_accounts_for_every_message() {
    a_dropped_sender_accounts_for_every_message("tcp://127.0.0.1:0", IoEngine::Inline, 64 << 10)
        .await;
}

#[tokio::test]
async fn epoll_dropped_sender_accounts_for_every_message() {
    a_dropped_sender_accounts_for_every_message("tcp://127.0.0.1:0", IoEngine::Epoll, 64 << 10)
        .await;
}

#[tokio::test]
async fn uring_dropped_sender_accounts_for_every_message() {
    a_dropped_sender_accounts_for_every_message("tcp://127.0.0.1:0", IoEngine::Uring, 64 << 10)
        .await;
}

#[tokio::test]
async fn shm_dropped_sender_accounts_for_every_message() {
    let url = format!("shm://stats-{}", std::process::id());
    // Bodies larger than the arena (256 KiB) go in pieces: the rest waits staged.
    a_dropped_sender_accounts_for_every_message(&url, IoEngine::Auto, 1 << 20).await;
}

/// A dropped Sender's connection that fails before its linger is over: here the peer reads
/// five messages and goes without lingering (its kernel resets the connection).
/// What the peer's kernel had taken is lost with its socket (only sessions can know); what
/// never left us is counted. How much the kernel takes first varies from run to run, so
/// this checks that the counts never claim more than was sent and not received.
async fn threads_engine_counts_what_a_failed_connection_never_wrote(engine: IoEngine) {
    let server_ctx = ctx_lingering(engine, Duration::ZERO);
    let client_ctx = ctx(engine);
    let (ch, mut server) = connected(&server_ctx, &client_ctx, "tcp://127.0.0.1:0").await;
    let body = Bytes::from(vec![5u8; 64 << 10]);
    let (mut tx, rx) = ch.split();
    let sent = fill(&mut tx, &body).await;
    drop((tx, rx));
    for _ in 0..5 {
        timeout(GUARD, server.recv())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
    drop(server);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (unsent, unread) = (client_ctx.stats().unsent, server_ctx.stats().unread);
    println!("{engine:?}: accepted {sent}, received 5, unread {unread}, unsent {unsent}");
    assert!(
        5 + unread + unsent <= sent,
        "{unsent} unsent, {unread} unread, of {sent}"
    );
}

#[tokio::test]
async fn epoll_counts_what_a_failed_connection_never_wrote() {
    threads_engine_counts_what_a_failed_connection_never_wrote(IoEngine::Epoll).await;
}

#[tokio::test]
async fn uring_counts_what_a_failed_connection_never_wrote() {
    threads_engine_counts_what_a_failed_connection_never_wrote(IoEngine::Uring).await;
}

/// A Receiver dropped with messages waiting: each is counted as unread on its side.
/// (`inproc://` names live in one context: `one_context` makes both sides there.)
async fn a_dropped_receiver_counts_what_it_never_read(
    url: &str,
    engine: IoEngine,
    one_context: bool,
) {
    const N: u64 = 50;
    let server_ctx = ctx(engine);
    let client_ctx = if one_context {
        server_ctx.clone()
    } else {
        ctx(engine)
    };
    let (mut ch, server) = connected(&server_ctx, &client_ctx, url).await;
    let body = Bytes::from_static(b"small");
    let writer = tokio::spawn(async move {
        for i in 0..N {
            if ch.send(msg(i, &body)).await.is_err() {
                break;
            }
        }
        let _ = ch.close().await;
        ch
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (tx, rx) = server.split();
    drop(rx);
    let after = wait_for("the receiver's messages are counted", &server_ctx, |s| {
        s.unread == N
    })
    .await;
    assert_eq!(after.unsent, 0);
    drop(tx);
    drop(timeout(GUARD, writer).await.unwrap().unwrap());
    assert_eq!(server_ctx.stats().unread, N);
}

#[tokio::test]
async fn tcp_inline_dropped_receiver_counts_what_it_never_read() {
    a_dropped_receiver_counts_what_it_never_read("tcp://127.0.0.1:0", IoEngine::Inline, false)
        .await;
}

#[tokio::test]
async fn epoll_dropped_receiver_counts_what_it_never_read() {
    a_dropped_receiver_counts_what_it_never_read("tcp://127.0.0.1:0", IoEngine::Epoll, false).await;
}

#[tokio::test]
async fn inproc_dropped_receiver_counts_what_it_never_read() {
    let url = format!("inproc://stats-{}", std::process::id());
    a_dropped_receiver_counts_what_it_never_read(&url, IoEngine::Auto, true).await;
}

/// A session whose halves are both dropped while its peer cannot be reached goes on trying
/// for the linger time, then counts what it gives up on: nobody is left to take it back.
/// The connections under it count nothing (the session would have resent their messages).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_session_counts_what_it_gives_up() {
    use hyperframes::session::Reconnect;
    const N: u64 = 10;
    let server_ctx = ctx(IoEngine::Auto);
    let mut l = server_ctx.bind_sessions("tcp://127.0.0.1:0").await.unwrap();
    let relay = Relay::start(l.local_url()).await;
    let client_ctx = ctx(IoEngine::Auto);
    let policy = Reconnect::exponential(Duration::from_millis(2), Duration::from_millis(20));
    let (ch, _server) = tokio::join!(
        async {
            timeout(GUARD, client_ctx.connect_with(&relay.url, policy))
                .await
                .unwrap()
                .unwrap()
        },
        async { timeout(GUARD, l.accept()).await.unwrap().unwrap() },
    );
    // The peer cannot be reached any more: nothing will acknowledge what follows.
    relay.refuse(true);
    relay.cut().await;
    let (mut tx, rx) = ch.split();
    let body = Bytes::from_static(b"lost");
    for i in 0..N {
        timeout(GUARD, tx.feed(msg(i, &body)))
            .await
            .unwrap()
            .unwrap();
    }
    drop((tx, rx));
    let after = wait_for("the session gives up", &client_ctx, |s| s.unsent > 0).await;
    tokio::time::sleep(LINGER).await;
    assert_eq!(client_ctx.stats(), after, "counted once");
    assert_eq!(after.unsent, N, "{after:?}");
}
