//! How tcp connections end, on every engine: what `close()` promises survives the peer still
//! sending; a clean close stays clean; `STOP` after `CLOSE`; a driver whose runtime dies;
//! a connection that failed while its writer was blocked is really closed.

use std::io::{Read, Write};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hyperframes::wire::Handshake;
use hyperframes::{Context, ErrorKind, IoEngine, Limits, Message};
use tokio::time::timeout;

const GUARD: Duration = Duration::from_secs(30);

fn ctx(engine: IoEngine) -> Context {
    Context::builder()
        .io_engine(engine)
        .recv_queue(4, 1 << 20)
        .build()
        .unwrap()
}

/// The client sends, `close()`s (Ok), and drops the channel while the server is still
/// sending to it and reading slowly: the server must get every message, then a clean end.
/// (Closing a socket with unread data makes the kernel reset it, which destroys data the
/// peer has received but not yet read.)
async fn close_survives_a_peer_still_sending(engine: IoEngine) {
    let server_ctx = ctx(engine);
    let mut l = server_ctx.bind("tcp://127.0.0.1:0").await.unwrap();
    let url = l.local_url().to_owned();
    const N: usize = 200;
    let server = tokio::spawn(async move {
        let (mut tx, mut rx) = l.accept().await.unwrap().split();
        let noise = Bytes::from(vec![1u8; 64 << 10]);
        tokio::spawn(async move {
            while tx
                .send(Message::new("s").unwrap().with_body(noise.clone()))
                .await
                .is_ok()
            {}
        });
        let mut got = 0;
        loop {
            tokio::time::sleep(Duration::from_micros(200)).await; // a slow reader
            match rx.recv().await {
                Some(Ok(_)) => got += 1,
                Some(Err(e)) => return Err((got, e)),
                None => return Ok(got),
            }
        }
    });
    let mut ch = ctx(engine).connect(&url).await.unwrap();
    let body = Bytes::from(vec![7u8; 64 << 10]);
    for _ in 0..N {
        ch.send(Message::new("c").unwrap().with_body(body.clone()))
            .await
            .unwrap();
    }
    ch.close().await.unwrap();
    drop(ch);
    match timeout(GUARD, server).await.unwrap().unwrap() {
        Ok(got) => assert_eq!(got, N),
        Err((got, e)) => panic!("server got {got} of {N}, then {e}"),
    }
}

/// After the peer closed cleanly, a later failure of our write side (the peer went away
/// while we still sent) does not turn the ended stream into an error.
async fn a_clean_close_stays_clean(engine: IoEngine) {
    let c = ctx(engine);
    let mut l = c.bind("tcp://127.0.0.1:0").await.unwrap();
    let url = l.local_url().to_owned();
    let b = tokio::spawn(async move {
        let (mut tx, mut rx) = l.accept().await.unwrap().split();
        let body = Bytes::from(vec![1u8; 16 << 10]);
        tokio::spawn(async move {
            while tx
                .send(Message::new("b").unwrap().with_body(body.clone()))
                .await
                .is_ok()
            {}
        });
        tokio::time::sleep(Duration::from_millis(300)).await; // read late
        let mut got = 0;
        loop {
            match rx.recv().await {
                Some(Ok(_)) => got += 1,
                Some(Err(e)) => return Err(e),
                None => return Ok(got),
            }
        }
    });
    let mut a = c.connect(&url).await.unwrap();
    for _ in 0..10 {
        a.send(Message::new("a").unwrap()).await.unwrap();
    }
    a.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(a);
    let got = timeout(GUARD, b)
        .await
        .unwrap()
        .unwrap()
        .expect("a clean end");
    assert_eq!(got, 10);
}

/// A closes its Sender, keeps it, then drops its Receiver: B's Sender must fail with
/// `Closed` (a STOP sent after CLOSE), not with a broken connection.
async fn stop_after_close(engine: IoEngine) {
    let c = ctx(engine);
    let mut l = c.bind("tcp://127.0.0.1:0").await.unwrap();
    let url = l.local_url().to_owned();
    let b = tokio::spawn(async move {
        let (mut tx, mut rx) = l.accept().await.unwrap().split();
        assert!(rx.recv().await.is_none(), "A closed without sending");
        loop {
            if let Err(e) = tx.send(Message::new("b").unwrap()).await {
                return e;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    let (mut atx, arx) = c.connect(&url).await.unwrap().split();
    atx.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(arx);
    let e = timeout(GUARD, b).await.unwrap().unwrap();
    assert_eq!(e.kind(), ErrorKind::Closed, "{e}");
    drop(atx);
}

/// The TCP state (`/proc/net/tcp` "st" field, 0x01 = ESTABLISHED) of the IPv4 socket with
/// these local and remote ports.
fn tcp_state(local_port: u16, remote_port: u16) -> Option<u8> {
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let port = |a: &str| u16::from_str_radix(a.rsplit(':').next()?, 16).ok();
        (port(f.get(1)?)? == local_port && port(f.get(2)?)? == remote_port)
            .then(|| u8::from_str_radix(f.get(3)?, 16).ok())
            .flatten()
    })
}

/// A peer that never reads, so our writer blocks; then it breaks the protocol. Once the
/// failed channel is dropped our socket must leave ESTABLISHED (shut down and closed) even
/// though the peer still reads nothing: a writer stuck on such a peer must not keep it.
async fn a_failed_connection_with_a_blocked_writer_is_closed(engine: IoEngine) {
    let c = ctx(engine);
    let mut l = c.bind("tcp://127.0.0.1:0").await.unwrap();
    let addr = l.local_url().trim_start_matches("tcp://").to_owned();
    let listen_port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (port_tx, port_rx) = std::sync::mpsc::channel::<u16>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let peer = std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        port_tx.send(s.local_addr().unwrap().port()).unwrap();
        let mut hs = BytesMut::new();
        Handshake::new(Limits::default()).encode(&mut hs);
        s.write_all(&hs).unwrap();
        go_rx.recv().unwrap(); // our side has filled the socket
        s.write_all(&[9u8; 24]).unwrap(); // an unknown frame kind
        let _ = done_rx.recv(); // and never read
        let _ = s.read(&mut [0u8; 1]);
    });
    let peer_port = port_rx.recv().unwrap();
    let mut ch = l.accept().await.unwrap();
    let body = Bytes::from(vec![0u8; 1 << 20]);
    while timeout(
        Duration::from_millis(300),
        ch.send(Message::new("x").unwrap().with_body(body.clone())),
    )
    .await
    .is_ok_and(|r| r.is_ok())
    {}
    go_tx.send(()).unwrap();
    let e = timeout(GUARD, async {
        loop {
            if let Err(e) = ch.send(Message::new("x").unwrap()).await {
                return e;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
    drop(ch);
    let left = timeout(Duration::from_secs(10), async {
        while tcp_state(listen_port, peer_port) == Some(0x01) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    done_tx.send(()).unwrap();
    peer.join().unwrap();
    assert!(
        left.is_ok(),
        "the failed connection's socket stayed ESTABLISHED"
    );
}

/// A client that promised no heartbeats (it turned them off) and then says nothing is
/// dropped by the server after its idle timeout: both of the server's halves fail naming the
/// timeout, and the client is told. One that keeps talking is not.
async fn a_silent_peer_without_heartbeats_meets_the_idle_timeout(engine: IoEngine) {
    let idle = Duration::from_millis(300);
    let server_ctx = Context::builder()
        .io_engine(engine)
        .idle_timeout(Some(idle))
        .build()
        .unwrap();
    let quiet = Context::builder()
        .io_engine(engine)
        .heartbeat(None, 10)
        .idle_timeout(None)
        .build()
        .unwrap();
    let mut l = server_ctx.bind("tcp://127.0.0.1:0").await.unwrap();
    let url = l.local_url().to_owned();

    // Talking every 100 ms: never idle.
    let (c, s) = tokio::join!(quiet.connect(&url), l.accept());
    let (mut talker, mut s) = (c.unwrap(), s.unwrap());
    for _ in 0..8 {
        talker.send(Message::new("t.tick").unwrap()).await.unwrap();
        let got = timeout(GUARD, s.recv()).await.unwrap().unwrap();
        assert!(got.is_ok(), "{got:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Silent: dropped after the timeout.
    let (c, s) = tokio::join!(quiet.connect(&url), l.accept());
    let (mut silent, s) = (c.unwrap(), s.unwrap());
    let started = std::time::Instant::now();
    let (mut stx, mut srx) = s.split();
    let e = timeout(GUARD, srx.recv())
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    let took = started.elapsed();
    assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e}");
    assert!(e.to_string().contains("idle_timeout"), "{e}");
    assert!(took >= idle && took < idle * 4, "dropped after {took:?}");
    let e = stx.send(Message::new("t.late").unwrap()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e}");
    let told = timeout(GUARD, silent.recv())
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(told.to_string().contains("idle_timeout"), "{told}");
    drop(talker);
}

macro_rules! per_engine {
    ($($name:ident),* $(,)?) => {
        mod uring { $( #[tokio::test] async fn $name() { super::$name(hyperframes::IoEngine::Uring).await } )* }
        mod epoll { $( #[tokio::test] async fn $name() { super::$name(hyperframes::IoEngine::Epoll).await } )* }
        mod inline { $( #[tokio::test] async fn $name() { super::$name(hyperframes::IoEngine::Inline).await } )* }
    };
}

per_engine!(
    close_survives_a_peer_still_sending,
    a_clean_close_stays_clean,
    stop_after_close,
    a_failed_connection_with_a_blocked_writer_is_closed,
    a_silent_peer_without_heartbeats_meets_the_idle_timeout,
);

/// The inline engine's driver is a task on the caller's runtime: when that runtime shuts
/// down, the halves (used from another runtime) report it instead of waiting for ever.
#[test]
fn inline_driver_runtime_shut_down_fails_both_halves() {
    let rt_a = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let c = Context::builder()
        .io_engine(IoEngine::Inline)
        .send_queue(4, 1 << 20)
        .build()
        .unwrap();
    let (ch, _server) = rt_a.block_on(async {
        let mut l = c.bind("tcp://127.0.0.1:0").await.unwrap();
        let url = l.local_url().to_owned();
        let server = tokio::spawn(async move {
            let ch = l.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(ch)
        });
        (c.connect(&url).await.unwrap(), server)
    });
    drop(rt_a); // drops the driver tasks, possibly before they ever ran
    let (mut tx, mut rx) = ch.split();
    let rt_b = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt_b.block_on(async {
        let e = timeout(GUARD, rx.recv())
            .await
            .unwrap()
            .unwrap()
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
        let e = timeout(GUARD, async {
            loop {
                tx.send(Message::new("x").unwrap()).await?;
            }
            #[allow(unreachable_code)]
            Ok::<(), hyperframes::Error>(())
        })
        .await
        .unwrap()
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    });
}
