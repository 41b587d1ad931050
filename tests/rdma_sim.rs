//! The RDMA protocol over simulated verbs (feature `rdma`): eager and rendezvous paths from
//! 0 B to 64 MiB with a checksum of every body, ordering, credits, pool backpressure, slow
//! and reordered completions, completion errors, peer loss; the simulation's own NIC rules;
//! the decoder against arbitrary bytes; and, for real, the "no RDMA device" error.
#![cfg(feature = "rdma")]

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use hyperframes::rdma::sim::{self, Faults, SimConfig, SimVerbs};
use hyperframes::rdma::verbs::{Access, Region, RemoteRegion, VerbOp, Verbs, WcStatus};
use hyperframes::rdma::{RdmaConfig, channel_pair, proto};
use hyperframes::{Channel, Context, ErrorKind, Message};
use tokio::time::timeout;

/// A hang guard, not a measurement.
const GUARD: Duration = Duration::from_secs(60);
/// For the test expected to show a stall (shorter, so a regression fails quickly).
const STALL: Duration = Duration::from_secs(10);

fn fnv(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for chunk in b.chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        h ^= u64::from_le_bytes(w);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn body(i: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for w in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        w.copy_from_slice(&b[..w.len()]);
    }
    v
}

fn msg(i: u64, len: usize) -> Message {
    let b = body(i, len);
    Message::new("test.rdma")
        .unwrap()
        .with_meta("i", i.to_string())
        .unwrap()
        .with_meta("sum", fnv(&b).to_string())
        .unwrap()
        .with_body(b)
}

/// Checks order and checksum; returns the message's number.
fn check(m: &Message, want: u64) {
    let i: u64 = m.meta().get("i").unwrap().parse().unwrap();
    assert_eq!(i, want, "out of order");
    let sum: u64 = m.meta().get("sum").unwrap().parse().unwrap();
    assert_eq!(fnv(m.body().as_bytes().unwrap()), sum, "body {i} corrupted");
}

fn small_cfg() -> RdmaConfig {
    RdmaConfig {
        keepalive: Duration::from_millis(50),
        // No heartbeat watch: these tests build bodies of up to 64 MiB on the runtime's
        // threads, seconds in a debug build, and a driver whose runtime is blocked that long
        // is rightly read as frozen. Heartbeats have their own test (the library's
        // `a_frozen_peer_is_found_by_its_heartbeat_counter`).
        heartbeat_misses: 0,
        ..RdmaConfig::default()
    }
}

async fn pair(cfg: RdmaConfig, sim: SimConfig) -> (Channel, Channel, SimVerbs, SimVerbs) {
    let (a, b) = sim::pair(sim);
    let (ca, cb) = channel_pair(a.clone(), b.clone(), cfg).await.unwrap();
    (ca, cb, a, b)
}

#[tokio::test]
async fn channel_pair_takes_its_handshake_timeout_from_the_config() {
    let (a, b) = sim::pair(SimConfig::default());
    let cfg = RdmaConfig {
        handshake_timeout: Duration::ZERO,
        ..small_cfg()
    };
    let e = channel_pair(a, b, cfg).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.to_string().contains("handshake timeout"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_and_rendezvous_sizes_with_checksums_in_order() {
    // No RNR retries: a sender overrunning the posted receives would fail at once.
    let sim = SimConfig {
        rnr_retry: Some(0),
        ..SimConfig::default()
    };
    let (a, b, sa, sb) = pair(small_cfg(), sim).await;
    let slot = RdmaConfig::default().slot_size as usize;
    // Around the eager/rendezvous boundary (type and meta take ~70 bytes + 40 of header).
    let mut sizes = vec![
        0,
        1,
        100,
        4096,
        slot - 200,
        slot - 100,
        slot,
        slot + 1,
        65536,
    ];
    sizes.extend([1 << 20, (4 << 20) + 3, 16 << 20, 64 << 20]);
    let n = sizes.len() as u64;
    let (mut tx, _rx_a) = a.split();
    let (_tx_b, mut rx) = b.split();
    let sizes2 = sizes.clone();
    let sender = tokio::spawn(async move {
        for (i, len) in sizes2.into_iter().enumerate() {
            tx.send(msg(i as u64, len)).await.unwrap();
        }
        tx.close().await.unwrap();
    });
    for (i, len) in sizes.iter().enumerate() {
        let m = timeout(GUARD, rx.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(m.body().len(), *len);
        check(&m, i as u64);
    }
    assert!(
        timeout(GUARD, rx.recv()).await.unwrap().is_none(),
        "ends after CLOSE"
    );
    sender.await.unwrap();
    let (ka, kb) = (sa.stats(), sb.stats());
    assert_eq!(ka.rnr_naks + kb.rnr_naks, 0);
    assert!(
        kb.reads >= 5,
        "bodies above the slot went by RDMA read: {kb:?}"
    );
    assert!(ka.sends >= n, "{ka:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_directions_at_once() {
    let (a, b, _sa, _sb) = pair(small_cfg(), SimConfig::default()).await;
    let (mut ta, mut ra) = a.split();
    let (mut tb, mut rb) = b.split();
    let n = 300u64;
    let len = |i: u64| {
        if i.is_multiple_of(7) {
            300_000
        } else {
            (i as usize * 37) % 5000
        }
    };
    let s1 = tokio::spawn(async move {
        for i in 0..n {
            ta.send(msg(i, len(i))).await.unwrap();
        }
        ta.close().await.unwrap();
        ta
    });
    let s2 = tokio::spawn(async move {
        for i in 0..n {
            tb.send(msg(i, len(i))).await.unwrap();
        }
        tb.close().await.unwrap();
        tb
    });
    for i in 0..n {
        check(
            &timeout(GUARD, ra.recv()).await.unwrap().unwrap().unwrap(),
            i,
        );
        check(
            &timeout(GUARD, rb.recv()).await.unwrap().unwrap().unwrap(),
            i,
        );
    }
    assert!(ra.recv().await.is_none());
    assert!(rb.recv().await.is_none());
    s1.await.unwrap();
    s2.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credit_exhaustion_blocks_then_recovers_without_rnr() {
    let cfg = RdmaConfig {
        recv_slots: 4,
        recv_queue: 1,
        send_queue: 1,
        ..small_cfg()
    };
    let sim = SimConfig {
        rnr_retry: Some(0),
        ..SimConfig::default()
    };
    let (a, b, sa, sb) = pair(cfg, sim).await;
    let (mut tx, _ra) = a.split();
    let (_tb, mut rx) = b.split();
    // The receiver takes nothing: the sender runs out of credits and queue room.
    let mut sent = 0u64;
    // A send that does not finish within a second is blocked: backpressure.
    while let Ok(r) = timeout(Duration::from_secs(1), tx.send(msg(sent, 64))).await {
        r.unwrap();
        sent += 1;
        assert!(sent < 100, "credits did not stop the sender");
    }
    assert!(sent >= 1, "nothing was sent before blocking");
    let total = sent + 500;
    let sender = tokio::spawn(async move {
        for i in sent..total {
            tx.send(msg(i, (i as usize * 13) % 2000)).await.unwrap();
        }
        tx.close().await.unwrap();
    });
    for i in 0..total {
        check(
            &timeout(GUARD, rx.recv()).await.unwrap().unwrap().unwrap(),
            i,
        );
    }
    sender.await.unwrap();
    assert_eq!(
        sa.stats().rnr_naks + sb.stats().rnr_naks,
        0,
        "a receiver was overrun"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_exhaustion_is_backpressure_not_failure() {
    let cfg = RdmaConfig {
        pool_bytes: 8 << 20,
        recv_queue: 1,
        limits: {
            let mut l = hyperframes::Limits::default();
            l.max_body = 4 << 20;
            l
        },
        ..small_cfg()
    };
    let (a, b, sa, _sb) = pair(cfg, SimConfig::default()).await;
    let (mut tx, _ra) = a.split();
    let (_tb, mut rx) = b.split();
    let n = 24u64;
    let sender = tokio::spawn(async move {
        for i in 0..n {
            // Heap bodies: each is copied into a 4 MiB pool buffer held until the peer's FIN.
            tx.send(msg(i, (4 << 20) - 7)).await.unwrap();
        }
        tx.close().await.unwrap();
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !sender.is_finished(),
        "the sender should be waiting for pool room"
    );
    for i in 0..n {
        let m = timeout(GUARD, rx.recv()).await.unwrap().unwrap().unwrap();
        check(&m, i);
    }
    timeout(GUARD, sender).await.unwrap().unwrap();
    let st = sa.stats();
    assert!(
        st.registered_peak <= (8 << 20) + (1 << 20),
        "pool bound exceeded: {st:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_both_ways_with_small_pools_do_not_deadlock() {
    // Each side's outgoing bodies fill its send pool while it waits for the peer's FINs;
    // receiving must still progress (a pool of its own).
    let cfg = RdmaConfig {
        pool_bytes: 8 << 20,
        limits: {
            let mut l = hyperframes::Limits::default();
            l.max_body = 4 << 20;
            l
        },
        ..small_cfg()
    };
    let (a, b, _sa, _sb) = pair(cfg, SimConfig::default()).await;
    let n = 24u64;
    let mut tasks = Vec::new();
    for ch in [a, b] {
        let (mut tx, mut rx) = ch.split();
        tasks.push(tokio::spawn(async move {
            for i in 0..n {
                tx.send(msg(i, 3 << 20)).await.unwrap();
            }
            tx.close().await.unwrap();
        }));
        tasks.push(tokio::spawn(async move {
            for i in 0..n {
                check(&rx.recv().await.unwrap().unwrap(), i);
            }
            assert!(rx.recv().await.is_none());
        }));
    }
    for t in tasks {
        timeout(GUARD, t).await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unread_receiver_does_not_stall_its_own_sender() {
    // A never reads what B sends it; A's own sending (whose pool buffers are freed by B's
    // FINs, which travel among B's messages) must not stall because of that.
    let cfg = RdmaConfig {
        pool_bytes: 8 << 20,
        recv_queue: 4,
        limits: {
            let mut l = hyperframes::Limits::default();
            l.max_body = 4 << 20;
            l
        },
        ..small_cfg()
    };
    let (a, b, _sa, _sb) = pair(cfg, SimConfig::default()).await;
    let (mut ta, _ra_never_read) = a.split();
    let (mut tb, mut rb) = b.split();
    // B fills A's receive side, then keeps trying (its sends block: backpressure, fine).
    let b_sender = tokio::spawn(async move {
        for i in 0..10_000u64 {
            if tb.send(msg(i, 100)).await.is_err() {
                break;
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let n = 40u64;
    let reader = tokio::spawn(async move {
        for i in 0..n {
            check(&rb.recv().await.unwrap().unwrap(), i);
        }
    });
    for i in 0..n {
        timeout(STALL, ta.send(msg(i, 3 << 20)))
            .await
            .expect("A's sender stalled behind its unread receiver")
            .unwrap();
    }
    timeout(GUARD, reader).await.unwrap().unwrap();
    b_sender.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rendezvous_body_is_lent_alone_until_its_fin() {
    let (a, b, sa, sb) = pair(small_cfg(), SimConfig::default()).await;
    let (mut tx, _ra) = a.split();
    let (_tb, mut rx) = b.split();
    let mut before = 0;
    let mut sent: Vec<Bytes> = Vec::new();
    for round in 0..2u64 {
        let n = if round == 0 { 8 } else { 64 };
        for i in 0..n {
            // `alloc`'d and plain bodies alike are registered where they lie.
            let body = if i % 2 == 0 {
                let mut body = tx.alloc(1 << 20).await.unwrap();
                body.fill(i as u8);
                body.freeze()
            } else {
                Bytes::from(vec![i as u8; (1 << 20) + 3]).into()
            };
            if round == 1 && i == 0 {
                sent.push(body.as_bytes().unwrap().clone());
            }
            tx.send(Message::new("test.alloc").unwrap().with_body(body))
                .await
                .unwrap();
            let m = timeout(GUARD, rx.recv()).await.unwrap().unwrap().unwrap();
            let b = m.body().as_bytes().unwrap();
            assert!(b.len() >= 1 << 20);
            assert!(b.iter().all(|&x| x == i as u8), "body {i}");
        }
        if round == 0 {
            before = sb.stats().registrations;
        }
    }
    // The sender registered each body once, for exactly its bytes, at the body itself (no
    // copy into registered memory)...
    let st = sa.stats();
    assert_eq!(st.exposures, 72, "{st:?}");
    let regions = sa.exposed_regions();
    let first = regions[regions.len() - 64];
    assert_eq!(first.addr, sent[0].as_ptr() as u64, "lent in place");
    assert_eq!(first.len, 1 << 20, "the key covers the body alone");
    // ... and deregistered each at its FIN.
    let t0 = std::time::Instant::now();
    while sa.stats().exposed != 0 {
        assert!(t0.elapsed() < GUARD, "bodies still lent: {:?}", sa.stats());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The receiver reads into its pool, reused: after warming up, 64 more messages register
    // (almost) nothing new.
    let rb = sb.stats().registrations - before;
    assert!(rb <= 4, "receiver registered {rb} more");
    assert!(sb.stats().reads >= 72, "bodies went by RDMA read");
    // A peer that kept a key reaches nothing with it after the FIN.
    let l = sb.register(1 << 20, Access::LOCAL).unwrap();
    let e = sb.post_read(l, first).await.unwrap_err();
    assert_eq!(e.status, WcStatus::RemoteAccess, "{e}");
    assert!(e.detail.contains("unknown rkey"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lent_body_is_readable_only_within_its_bytes() {
    // The receiver's reads complete late (so its FINs do): the bodies stay lent a while, and
    // the key it learned reaches the body's bytes and not one more.
    let (a, b, sa, sb) = pair(small_cfg(), SimConfig::default()).await;
    sb.set_faults(Faults {
        delay: Some((Duration::from_secs(3), Duration::from_secs(3))),
        ..Faults::default()
    });
    let (mut tx, _ra) = a.split();
    let (_tb, _rx) = b.split();
    let body = Bytes::from(vec![7u8; 100_000]);
    let whole = Bytes::from(vec![0u8; 1 << 20]);
    // A body that is a slice of a larger buffer: the rest of the buffer stays private.
    let body2 = whole.slice(4096..4096 + 100_000);
    tx.send(Message::new("t").unwrap().with_body(body.clone()))
        .await
        .unwrap();
    tx.send(Message::new("t").unwrap().with_body(body2.clone()))
        .await
        .unwrap();
    let t0 = std::time::Instant::now();
    while sa.stats().exposures < 2 {
        assert!(t0.elapsed() < GUARD);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = sa.exposed_regions()[1];
    assert_eq!((r.addr, r.len), (body2.as_ptr() as u64, 100_000));
    let beyond = RemoteRegion {
        addr: r.addr - 8,
        len: 8,
        ..r
    };
    assert_eq!(sa.stats().exposed, 200_000, "both still lent when probed");
    let l = sb.register(4096, Access::LOCAL).unwrap();
    // Checked when posted (the answer comes late, with the other delayed completions).
    let e = sb.post_read(l, beyond).await.unwrap_err();
    assert_eq!(e.status, WcStatus::RemoteAccess, "{e}");
    assert!(e.detail.contains("outside"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_reordered_completions_keep_order() {
    let (a, b, sa, sb) = pair(small_cfg(), SimConfig::default()).await;
    for (s, seed) in [(&sa, 7), (&sb, 11)] {
        s.set_faults(Faults {
            delay: Some((Duration::ZERO, Duration::from_micros(1500))),
            seed,
            ..Faults::default()
        });
    }
    let (mut tx, _ra) = a.split();
    let (_tb, mut rx) = b.split();
    let n = 400u64;
    let sender = tokio::spawn(async move {
        for i in 0..n {
            let len = if i.is_multiple_of(5) {
                100_000 + i as usize
            } else {
                i as usize % 3000
            };
            tx.send(msg(i, len)).await.unwrap();
        }
        tx.close().await.unwrap();
    });
    for i in 0..n {
        check(
            &timeout(GUARD, rx.recv()).await.unwrap().unwrap().unwrap(),
            i,
        );
    }
    assert!(rx.recv().await.is_none());
    sender.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_completion_error_names_the_operation_on_both_halves() {
    let (a, b, _sa, sb) = pair(small_cfg(), SimConfig::default()).await;
    // The receiver's second RDMA read fails (index 1; index 0 may be a keepalive... so
    // fail every read from the start).
    sb.set_faults(Faults {
        fail: Some((VerbOp::Read, 0, WcStatus::RemoteAccess)),
        ..Faults::default()
    });
    let (mut ta, mut ra) = a.split();
    let (_tb, mut rb) = b.split();
    ta.send(msg(0, 1 << 20)).await.unwrap();
    let e = timeout(GUARD, rb.recv())
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(e.to_string().contains("RDMA read failed"), "{e}");
    assert!(e.to_string().contains("IBV_WC_REM_ACCESS_ERR"), "{e}");
    assert!(rb.recv().await.is_none());
    // The sender's side learns through its next operation or its keepalive.
    let e = timeout(GUARD, async {
        loop {
            if let Err(e) = ta.send(msg(1, 10)).await {
                return e;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap();
    assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e}");
    let e = timeout(GUARD, ra.recv())
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_completion_error_fails_the_sender_side() {
    let (a, b, sa, _sb) = pair(small_cfg(), SimConfig::default()).await;
    sa.set_faults(Faults {
        fail: Some((VerbOp::Send, 3, WcStatus::LocalProtection)),
        ..Faults::default()
    });
    let (mut ta, mut ra) = a.split();
    let (_tb, mut rb) = b.split();
    let e = timeout(GUARD, async {
        for i in 0..1000 {
            if let Err(e) = ta.send(msg(i, 10)).await {
                return e;
            }
            tokio::task::yield_now().await;
        }
        panic!("the injected send failure never surfaced");
    })
    .await
    .unwrap();
    assert!(e.to_string().contains("send failed"), "{e}");
    assert!(e.to_string().contains("IBV_WC_LOC_PROT_ERR"), "{e}");
    let e = timeout(GUARD, ra.recv())
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(e.to_string().contains("send failed"), "{e}");
    // The peer: its receiver gets what arrived, then ConnectionLost (keepalive).
    let mut got = 0;
    let e = timeout(GUARD, async {
        loop {
            match rb.recv().await {
                Some(Ok(m)) => {
                    check(&m, got);
                    got += 1;
                }
                Some(Err(e)) => return e,
                None => panic!("ended without an error"),
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_lost_mid_rendezvous_is_an_error_on_both_halves() {
    let cfg = RdmaConfig {
        recv_queue_bytes: 1 << 20,
        ..small_cfg()
    };
    let (a, b, sa, _sb) = pair(cfg, SimConfig::default()).await;
    let (mut ta, _ra) = a.split();
    let (mut tb, mut rb) = b.split();
    // The first body, read and not taken, fills the receiver's read-ahead, so the read of
    // the second waits (its RTS has arrived)...
    ta.send(msg(0, 2 << 20)).await.unwrap();
    ta.send(msg(1, 8 << 20)).await.unwrap();
    ta.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    // ... and the sender dies before the body is read.
    sa.kill();
    check(
        &timeout(GUARD, rb.recv()).await.unwrap().unwrap().unwrap(),
        0,
    );
    let e = timeout(GUARD, rb.recv())
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e}");
    assert!(e.to_string().contains("RDMA read failed"), "{e}");
    let e = timeout(GUARD, tb.send(msg(2, 10)))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_peer_death_is_found_by_keepalive() {
    let (a, b, _sa, sb) = pair(small_cfg(), SimConfig::default()).await;
    let (mut ta, mut ra) = a.split();
    let (_tb, _rb) = b.split();
    sb.kill();
    // Nothing is sent: only the keepalive read can notice.
    let e = timeout(GUARD, ra.recv())
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e}");
    let e = ta.send(msg(0, 1)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_drop_stops_the_peer_sender() {
    let (a, b, _sa, _sb) = pair(small_cfg(), SimConfig::default()).await;
    let (mut ta, _ra) = a.split();
    let (_tb, rb) = b.split();
    drop(rb);
    let e = timeout(GUARD, async {
        for i in 0.. {
            if let Err(e) = ta
                .send(msg(i, if i.is_multiple_of(2) { 10 } else { 100_000 }))
                .await
            {
                return e;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        unreachable!()
    })
    .await
    .unwrap();
    assert_eq!(e.kind(), ErrorKind::Closed, "{e}");
}

#[tokio::test]
async fn rdma_sim_urls_work_through_a_context() {
    let ctx = Context::new();
    let mut l = ctx.bind("rdma+sim://here").await.unwrap();
    assert_eq!(l.local_url(), "rdma+sim://here");
    let (c, s) = tokio::join!(ctx.connect("rdma+sim://here"), l.accept());
    let (mut c, mut s) = (c.unwrap(), s.unwrap());
    c.send(msg(0, 200_000)).await.unwrap();
    check(&s.next().await.unwrap().unwrap(), 0);
    let e = ctx.connect("rdma+sim://nobody").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionRefused);
}

// ---------------------------------------------------------------------------------------
// The simulation enforces what a NIC enforces
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn sim_refuses_unregistered_out_of_bounds_and_unpermitted_access() {
    let (a, b) = sim::pair(SimConfig::default());
    let target = b.register(4096, Access::REMOTE_READ).unwrap();
    let local = a.register(8192, Access::LOCAL).unwrap();
    let ok = target.remote(0, 4096);
    let local = a.post_read(local, ok).await.unwrap();
    let cases = [
        (
            RemoteRegion {
                rkey: ok.rkey + 100,
                ..ok
            },
            "unknown rkey",
        ),
        (
            RemoteRegion {
                addr: ok.addr + 1,
                ..ok
            },
            "outside",
        ),
        (
            RemoteRegion {
                addr: ok.addr - 8,
                len: 8,
                ..ok
            },
            "outside",
        ),
    ];
    for (r, why) in cases {
        // Each failure puts the queue pair in the error state: use a fresh pair.
        let (a, b) = sim::pair(SimConfig::default());
        let t = b.register(4096, Access::REMOTE_READ).unwrap();
        let r = RemoteRegion {
            addr: t
                .remote(0, 0)
                .addr
                .wrapping_add(r.addr.wrapping_sub(ok.addr)),
            rkey: t
                .remote(0, 0)
                .rkey
                .wrapping_add(r.rkey.wrapping_sub(ok.rkey)),
            len: r.len,
        };
        let l = a.register(8192, Access::LOCAL).unwrap();
        let e = a.post_read(l, r).await.unwrap_err();
        assert_eq!(e.status, WcStatus::RemoteAccess, "{why}: {e}");
        assert!(e.detail.contains(why), "{e}");
        // Flushed from now on.
        let l = a.register(8, Access::LOCAL).unwrap();
        let e = a.post_send(l, 8).await.unwrap_err();
        assert_eq!(e.status, WcStatus::Flushed);
    }
    // Write into a region registered for read only.
    let e = a.post_write(local, target.remote(0, 8)).await.unwrap_err();
    assert_eq!(e.status, WcStatus::RemoteAccess);
    // A deregistered region is gone.
    let (a, b) = sim::pair(SimConfig::default());
    let t = b.register(64, Access::REMOTE_RW).unwrap();
    let r = t.remote(0, 64);
    drop(t);
    let l = a.register(64, Access::LOCAL).unwrap();
    assert_eq!(
        a.post_write(l, r).await.unwrap_err().status,
        WcStatus::RemoteAccess
    );
}

#[tokio::test]
async fn sim_rnr_and_too_small_receive_buffers() {
    let (a, b) = sim::pair(SimConfig {
        rnr_retry: Some(0),
        ..SimConfig::default()
    });
    let m = a.register(100, Access::LOCAL).unwrap();
    let e = a.post_send(m, 100).await.unwrap_err();
    assert_eq!(e.status, WcStatus::RnrRetryExceeded);
    assert_eq!(a.stats().rnr_naks, 1);
    drop(b);

    let (a, b) = sim::pair(SimConfig::default());
    let small = b.register(10, Access::LOCAL).unwrap();
    let recv = b.post_recv(small);
    let m = a.register(100, Access::LOCAL).unwrap();
    let e = a.post_send(m, 100).await.unwrap_err();
    assert_eq!(e.status, WcStatus::RemoteInvalidRequest);
    assert_eq!(recv.await.unwrap_err().status, WcStatus::LocalLength);

    // With retries forever, a send waits for the receive (and data arrives intact).
    let (a, b) = sim::pair(SimConfig::default());
    let mut m = a.register(5, Access::LOCAL).unwrap();
    m.as_mut_slice().copy_from_slice(b"hello");
    let send = a.post_send(m, 5);
    let r = b.register(64, Access::LOCAL).unwrap();
    let (r, n) = b.post_recv(r).await.unwrap();
    assert_eq!(&r.as_slice()[..n], b"hello");
    send.await.unwrap();
    assert_eq!(a.stats().rnr_naks, 1);
}

#[tokio::test]
async fn sim_memlock_limit_refuses_registration() {
    let (a, _b) = sim::pair(SimConfig {
        memlock: Some(1 << 20),
        ..SimConfig::default()
    });
    let _m = a.register(1 << 20, Access::LOCAL).unwrap();
    let e = a.register(1, Access::LOCAL).unwrap_err();
    assert_eq!(e.status, WcStatus::NoMemory);
    assert!(e.to_string().contains("memory registration failed"), "{e}");
}

// ---------------------------------------------------------------------------------------
// Decoder: arbitrary bytes never panic, never allocate beyond limits
// ---------------------------------------------------------------------------------------

mod props {
    use super::*;
    use proptest::prelude::*;

    fn params() -> proto::Params {
        proto::Params {
            recv_slots: 8,
            slot_size: 8192,
            limits: hyperframes::Limits::default(),
            keepalive: RemoteRegion {
                addr: 64,
                len: 8,
                rkey: 1,
            },
            beat_ms: 1000,
        }
    }

    fn connected() -> proto::Connection {
        let mut c = proto::Connection::new(params());
        let mut buf = vec![0u8; 8192];
        let n = proto::encode_hello(&mut buf, &params());
        c.handle_recv(&buf[..n]).unwrap();
        c
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = proto::decode(&bytes, &hyperframes::Limits::default());
            let _ = proto::frame_len(&bytes);
        }

        #[test]
        fn connection_never_panics_on_peer_bytes(
            kind in 1u8..=8,
            tail in proptest::collection::vec(any::<u8>(), 0..200),
            seq in 0u64..3,
        ) {
            let mut c = connected();
            let mut b = vec![0u8; 24];
            b[0] = kind;
            b[8..16].copy_from_slice(&(seq + 1).to_le_bytes());
            b.extend_from_slice(&tail);
            if b.len() > 24 { b[1] = tail[0] & 3; b[2] = tail.get(1).copied().unwrap_or(0); }
            let _ = c.handle_recv(&b);
            while c.poll_message().is_some() {}
            while c.poll_read().is_some() {}
            let mut out = vec![0u8; 8192];
            while c.poll_transmit(&mut out).is_some() {}
        }

        #[test]
        fn rendezvous_lengths_beyond_limits_are_refused(len in (64u64 << 20) + 1..u64::MAX) {
            let mut c = connected();
            let mut b = vec![0u8; proto::RTS_FIXED + 3];
            b[0] = 3; // RTS
            b[2] = 3;
            b[8..16].copy_from_slice(&1u64.to_le_bytes());
            b[32..40].copy_from_slice(&len.to_le_bytes());
            b[proto::RTS_FIXED..].copy_from_slice(b"a.b");
            let e = c.handle_recv(&b).unwrap_err();
            prop_assert!(e.is_limit());
            prop_assert!(c.poll_read().is_none());
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        /// Two protocol cores exchanging random traffic, with receive completions reported
        /// out of order: every message arrives once, in order, with its body; no sender ever
        /// finds the peer without a posted receive; nothing panics.
        #[test]
        fn two_cores_random_traffic_in_order_without_overrun(
            sizes in proptest::collection::vec(0usize..20_000, 1..120),
            picks in proptest::collection::vec(0usize..8, 400),
            slots in 4u32..10,
        ) {
            let p = proto::Params { recv_slots: slots, ..params() };
            let (mut a, mut b) = (proto::Connection::new(p), proto::Connection::new(p));
            // In flight per direction: transmitted, not yet handled.
            let (mut to_b, mut to_a): (Vec<Vec<u8>>, Vec<Vec<u8>>) = (Vec::new(), Vec::new());
            // Receives posted at each side.
            let (mut posted_a, mut posted_b) = (slots as usize, slots as usize);
            let mut next_send = 0usize;
            let mut got = 0usize;
            let mut pick = picks.iter().cycle();
            let body_of = |i: usize, len: usize| -> Vec<u8> { (0..len).map(|k| (i * 7 + k) as u8).collect() };
            let mut outstanding = std::collections::HashMap::new();
            for _round in 0..5000 {
                // A queues messages while it may.
                while next_send < sizes.len() && a.can_queue() {
                    let m = Message::new("p.t").unwrap()
                        .with_meta("i", next_send.to_string()).unwrap()
                        .with_body(body_of(next_send, sizes[next_send]));
                    if a.is_eager(&m) {
                        a.send_eager(m);
                    } else {
                        let len = m.body().len() as u64;
                        let rid = a.send_rendezvous(m.with_body(Vec::new()), RemoteRegion { addr: 4096, len, rkey: 9 });
                        outstanding.insert(rid, next_send);
                    }
                    next_send += 1;
                }
                if next_send == sizes.len() { a.close(); }
                // Transmit both ways; a transmit must find a posted receive.
                let mut buf = vec![0u8; 8192];
                while let Some(n) = a.poll_transmit(&mut buf) {
                    prop_assert!(posted_b > 0, "A overran B's receives");
                    posted_b -= 1;
                    to_b.push(buf[..n].to_vec());
                }
                while let Some(n) = b.poll_transmit(&mut buf) {
                    prop_assert!(posted_a > 0, "B overran A's receives");
                    posted_a -= 1;
                    to_a.push(buf[..n].to_vec());
                }
                // Completions reported in any order among the first few.
                if !to_b.is_empty() {
                    let i = pick.next().unwrap() % to_b.len().min(4);
                    let m = to_b.remove(i);
                    b.handle_recv(&m).unwrap();
                    posted_b += 1;
                }
                if !to_a.is_empty() {
                    let i = pick.next().unwrap() % to_a.len().min(4);
                    let m = to_a.remove(i);
                    a.handle_recv(&m).unwrap();
                    posted_a += 1;
                }
                // B fetches bodies (the "read" produces the sender's bytes).
                while let Some(r) = b.poll_read() {
                    let i = outstanding[&r.rid];
                    b.handle_read_done(r.rid, Bytes::from(body_of(i, r.body.len as usize))).unwrap();
                }
                while let Some(m) = b.poll_message() {
                    let i: usize = m.meta().get("i").unwrap().parse().unwrap();
                    prop_assert_eq!(i, got);
                    prop_assert_eq!(m.body().as_bytes().unwrap().as_ref(), &body_of(i, sizes[i])[..]);
                    got += 1;
                }
                while let Some(rid) = a.poll_release() {
                    outstanding.remove(&rid);
                }
                if b.peer_finished() && to_a.is_empty() && to_b.is_empty() && a.outstanding() == 0 {
                    break;
                }
            }
            prop_assert_eq!(got, sizes.len());
            prop_assert!(b.peer_finished());
            prop_assert_eq!(a.outstanding(), 0);
        }

    }
}

// ---------------------------------------------------------------------------------------
// The real backend on this host
// ---------------------------------------------------------------------------------------

fn host_has_rdma() -> bool {
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

#[tokio::test]
async fn real_backend_reports_no_rdma_device() {
    if host_has_rdma() {
        assert!(hyperframes::rdma::devices().is_ok());
        return;
    }
    let e = hyperframes::rdma::devices().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable);
    assert!(e.to_string().contains("no RDMA device"), "{e}");
    assert!(e.to_string().contains("hf doctor"), "{e}");
    let ctx = Context::new();
    let e = ctx.bind("rdma://127.0.0.1:0").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().contains("no RDMA device"), "{e}");
    let e = ctx.connect("rdma://127.0.0.1:9").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device (run with --ignored where one exists)"]
async fn hardware_loopback_eager_and_rendezvous() {
    let ctx = Context::new();
    let mut l = ctx.bind("rdma://127.0.0.1:0").await.unwrap();
    let url = l.local_url().to_owned();
    let (c, s) = tokio::join!(ctx.connect(&url), l.accept());
    let (c, s) = (c.unwrap(), s.unwrap());
    let (mut tx, _r) = c.split();
    let (_t, mut rx) = s.split();
    let sizes = [0usize, 10, 5000, 100_000, 4 << 20, 64 << 20];
    let sender = tokio::spawn(async move {
        for (i, len) in sizes.iter().enumerate() {
            tx.send(msg(i as u64, *len)).await.unwrap();
        }
        let mut b = tx.alloc(1 << 20).await.unwrap();
        b.fill(7);
        tx.send(Message::new("t.alloc").unwrap().with_body(b.freeze()))
            .await
            .unwrap();
        tx.close().await.unwrap();
    });
    for i in 0..sizes.len() {
        check(
            &timeout(GUARD, rx.recv()).await.unwrap().unwrap().unwrap(),
            i as u64,
        );
    }
    let m = rx.recv().await.unwrap().unwrap();
    assert!(m.body().as_bytes().unwrap().iter().all(|&b| b == 7));
    assert!(rx.recv().await.is_none());
    sender.await.unwrap();
}

#[allow(dead_code)]
fn _bytes_is_used(_: Bytes) {}
