//! A slow consumer: the receiver takes one 64 KiB message every 2 ms while the sender sends as
//! fast as it may. The sender is held back (it sends about what the receiver takes, plus the
//! queues), and the memory both ends hold stays within the queues' bounds, measured by the
//! allocator (bytes allocated and not freed). One test per binary would be cleaner for the
//! counter; the cases run one after another in one test instead.

#[path = "common/counting_alloc.rs"]
mod counting_alloc;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hyperframes::session::{Reconnect, SessionConfig};
use hyperframes::{Channel, Context, IoEngine, Message};

const BODY: usize = 64 << 10;
const QUEUE_BYTES: usize = 4 << 20;

fn context(engine: IoEngine) -> Context {
    Context::builder()
        .io_engine(engine)
        .send_queue(1024, QUEUE_BYTES)
        .recv_queue(1024, QUEUE_BYTES)
        // shm: what is in flight waits in the arena (shared memory, not the heap).
        .shm_segment(4096, QUEUE_BYTES as u64)
        // Sessions: the bodies kept until acknowledged.
        .session(SessionConfig::default().window_bytes(QUEUE_BYTES as u64))
        .build()
        .unwrap()
}

/// Runs the slow consumer on `tx`→`rx` for `run`; returns (sent, received, peak heap KiB
/// above the start).
async fn slow(tx: Channel, rx: Channel, run: Duration) -> (u64, u64, u64) {
    let base = counting_alloc::live_kib();
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let (p, s) = (peak.clone(), stop.clone());
    let sampler = tokio::spawn(async move {
        while !s.load(Ordering::Relaxed) {
            p.fetch_max(counting_alloc::live_kib(), Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    let (mut tx, _tx_rx) = tx.split();
    let s = stop.clone();
    let sender = tokio::spawn(async move {
        let mut sent = 0u64;
        while !s.load(Ordering::Relaxed) {
            // A body of its own per message: each one counts by the bytes it holds.
            let m = Message::new("slow.data")
                .unwrap()
                .with_body(vec![7u8; BODY]);
            match tokio::time::timeout(Duration::from_millis(50), tx.send(m)).await {
                Ok(r) => {
                    r.unwrap();
                    sent += 1;
                }
                Err(_) => continue, // held back
            }
        }
        (sent, tx)
    });
    let (_rx_tx, mut rx) = rx.split();
    let started = Instant::now();
    let mut received = 0u64;
    while started.elapsed() < run {
        tokio::time::sleep(Duration::from_millis(2)).await;
        rx.recv().await.unwrap().unwrap();
        received += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let (sent, tx) = sender.await.unwrap();
    sampler.await.unwrap();
    drop((tx, rx));
    let peak = peak.load(Ordering::Relaxed).saturating_sub(base);
    (sent, received, peak)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_consumer_holds_the_sender_back_and_memory_bounded() {
    let run = Duration::from_secs(2);
    // Both queues full, the socket buffers (tcp: a few MiB on loopback), what is in hand.
    let bound_kib = ((2 * QUEUE_BYTES + (16 << 20)) / 1024) as u64;
    for case in ["tcp inline", "tcp epoll", "shm", "session over tcp"] {
        let engine = if case == "tcp epoll" {
            IoEngine::Epoll
        } else {
            IoEngine::Inline
        };
        let ctx = context(engine);
        let url = if case == "shm" {
            format!("shm://hf-slow-{}", std::process::id())
        } else {
            "tcp://127.0.0.1:0".into()
        };
        let (a, b) = if case.starts_with("session") {
            let mut l = ctx.bind_sessions(&url).await.unwrap();
            let a = ctx
                .connect_with(l.local_url(), Reconnect::never())
                .await
                .unwrap();
            (a, l.accept().await.unwrap())
        } else {
            let mut l = ctx.bind(&url).await.unwrap();
            let a = ctx.connect(l.local_url()).await.unwrap();
            (a, l.accept().await.unwrap())
        };
        let (sent, received, peak_kib) = slow(a, b, run).await;
        let in_flight = sent - received;
        println!(
            "slow consumer, {case}: received {received} x 64 KiB in {run:?}, sent {sent} \
             ({in_flight} in queues), heap peak +{} MiB (bound {} MiB)",
            peak_kib / 1024,
            bound_kib / 1024
        );
        assert!(received > 100, "{case}: the consumer starved");
        // Held back: what was sent beyond what was taken fits the queues.
        assert!(
            in_flight as usize * BODY <= 2 * QUEUE_BYTES + (16 << 20),
            "{case}: {in_flight} messages in flight"
        );
        assert!(peak_kib <= bound_kib, "{case}: heap peak +{peak_kib} KiB");
    }
}
