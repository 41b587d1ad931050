//! A bounded soak: peers that connect (plain tcp, shm, sessions over tcp, sessions through a
//! relay that cuts connections), stream echoes and are killed with SIGKILL mid-stream, round
//! after round; at the end this process's file descriptors, threads and memory are back to
//! where they were after the first round.
//!
//! `HF_SOAK_SECS` sets the length (default 5 s; `.ci/run` runs 60 s in release). The peer is
//! this binary re-executed (`soak_peer`, active only with `HF_SOAK_PEER` set).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hyperframes::session::{Reconnect, SessionConfig};
use hyperframes::{Channel, Context, Listener, Message};
use tokio::task::JoinHandle;

#[path = "common/counting_alloc.rs"]
mod counting_alloc;

const BEAT: Duration = Duration::from_millis(100);

fn context() -> Context {
    Context::builder()
        .heartbeat(Some(BEAT), 5)
        .connect_timeout(Duration::from_millis(500))
        .session(SessionConfig::default().resume_within(Duration::from_millis(300)))
        .build()
        .unwrap()
}

fn status(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with(field)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn memfds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|p| p.to_string_lossy().starts_with("/memfd:"))
        .count()
}

#[derive(Debug, PartialEq, Clone, Copy)]
struct Counts {
    fds: usize,
    memfds: usize,
    threads: u64,
    /// Held from the allocator (RSS keeps what the allocator keeps for reuse: not a leak).
    heap_kib: u64,
    rss_kib: u64,
}

fn counts() -> Counts {
    Counts {
        fds: open_fds(),
        memfds: memfds(),
        threads: status("Threads:"),
        heap_kib: counting_alloc::live_kib(),
        rss_kib: status("VmRSS:"),
    }
}

/// The peer: connect to each URL (`kind=url`, space separated) and echo until killed.
#[test]
fn soak_peer() {
    let Ok(spec) = std::env::var("HF_SOAK_PEER") else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let ctx = context();
        let mut tasks = Vec::new();
        for item in spec.split(' ') {
            let (kind, url) = item.split_once('=').unwrap();
            let ch = match kind {
                "session" => {
                    let policy =
                        Reconnect::exponential(Duration::from_millis(5), Duration::from_millis(50));
                    ctx.connect_with(url, policy).await.unwrap()
                }
                _ => ctx.connect(url).await.unwrap(),
            };
            tasks.push(tokio::spawn(echo(ch)));
        }
        println!("READY");
        for t in tasks {
            let _ = t.await;
        }
    });
}

async fn echo(ch: Channel) {
    let (mut tx, mut rx) = ch.split();
    while let Some(Ok(m)) = rx.recv().await {
        if tx.send(m).await.is_err() {
            return;
        }
    }
}

#[path = "common/relay.rs"]
mod relay;
use relay::Relay;

struct Stats {
    live: AtomicUsize,
    echoed: AtomicU64,
    channels: AtomicU64,
}

/// Streams numbered messages on `ch` and checks the echoes (in order), until it breaks.
async fn drive(ch: Channel, stats: Arc<Stats>) {
    stats.live.fetch_add(1, Ordering::SeqCst);
    stats.channels.fetch_add(1, Ordering::Relaxed);
    let (mut tx, mut rx) = ch.split();
    let sender = tokio::spawn(async move {
        for i in 0u64.. {
            let len = (i * 7919 % 50_000) as usize;
            let m = Message::new("soak.data")
                .unwrap()
                .with_meta("i", i)
                .unwrap()
                .with_body(vec![i as u8; len]);
            if tx.send(m).await.is_err() {
                return;
            }
        }
    });
    let mut next = 0u64;
    while let Some(Ok(m)) = rx.recv().await {
        assert_eq!(
            m.meta().get("i"),
            Some(next.to_string().as_str()),
            "in order"
        );
        next += 1;
    }
    sender.abort();
    let _ = sender.await;
    stats.echoed.fetch_add(next, Ordering::Relaxed);
    stats.live.fetch_sub(1, Ordering::SeqCst);
}

fn serve(mut listener: Listener, stats: Arc<Stats>) -> JoinHandle<()> {
    tokio::spawn(async move {
        while let Ok(ch) = listener.accept().await {
            tokio::spawn(drive(ch, stats.clone()));
        }
    })
}

fn start_peer(spec: &str) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "soak_peer", "--nocapture", "--test-threads=1"])
        .env("HF_SOAK_PEER", spec)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.contains("READY") => break,
            Some(_) => {}
            None => panic!("soak peer exited early"),
        }
    }
    child
}

/// Runs rounds until `deadline`: a peer connects every kind, streams, and is killed.
async fn rounds(
    urls: &str,
    relay: &Relay,
    stats: &Arc<Stats>,
    deadline: Instant,
    mut round: u64,
) -> u64 {
    loop {
        let spec = urls.to_owned();
        let mut child = tokio::task::spawn_blocking(move || start_peer(&spec))
            .await
            .unwrap();
        let life = 100 + (round * 37 % 300);
        tokio::time::sleep(Duration::from_millis(life / 2)).await;
        relay.cut().await; // the session through the relay reconnects
        tokio::time::sleep(Duration::from_millis(life / 2)).await;
        child.kill().unwrap();
        child.wait().unwrap();
        round += 1;
        // Every channel of that peer ends (sessions after resume_within).
        let settle = Instant::now() + Duration::from_secs(10);
        while stats.live.load(Ordering::SeqCst) > 0 {
            assert!(Instant::now() < settle, "channels of a killed peer live on");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if Instant::now() >= deadline {
            return round;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_connect_stream_kill_leaves_nothing_behind() {
    let secs: u64 = std::env::var("HF_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let ctx = context();
    let stats = Arc::new(Stats {
        live: AtomicUsize::new(0),
        echoed: AtomicU64::new(0),
        channels: AtomicU64::new(0),
    });
    let tcp = ctx.bind("tcp://127.0.0.1:0").await.unwrap();
    let shm_name = format!("hf-soak-{}", std::process::id());
    let shm = ctx.bind(&format!("shm://{shm_name}")).await.unwrap();
    let sessions = ctx.bind_sessions("tcp://127.0.0.1:0").await.unwrap();
    let relay = Relay::start(sessions.local_url()).await;
    let urls = [
        format!("tcp={}", tcp.local_url()),
        format!("tcp={}", tcp.local_url()),
        format!("shm={}", shm.local_url()),
        format!("session={}", sessions.local_url()),
        format!("session={}", relay.url),
    ]
    .join(" ");
    let servers = [
        serve(tcp, stats.clone()),
        serve(shm, stats.clone()),
        serve(sessions, stats.clone()),
    ];
    // A first round brings up what lives as long as the context (I/O threads, runtime
    // workers, allocator arenas); what follows must come back to it.
    let start = Instant::now();
    let mut round = rounds(&urls, &relay, &stats, Instant::now(), 0).await;
    let before = counts();
    round = rounds(
        &urls,
        &relay,
        &stats,
        Instant::now() + Duration::from_secs(secs),
        round,
    )
    .await;
    // Give closed sockets, finished tasks and the messages they held a moment to go (on a
    // loaded machine the last round's channels can still be winding down).
    let settle = Instant::now() + Duration::from_secs(5);
    let mut after = counts();
    while (after.fds != before.fds
        || after.threads != before.threads
        || after.heap_kib >= before.heap_kib + 8 * 1024)
        && Instant::now() < settle
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
        after = counts();
    }
    let channels = stats.channels.load(Ordering::Relaxed);
    let echoed = stats.echoed.load(Ordering::Relaxed);
    println!(
        "soak: {round} peers killed in {:.1?}, {channels} channels, {echoed} messages echoed in order; \
         before {before:?}, after {after:?}",
        start.elapsed()
    );
    assert!(round >= 2 && echoed > 0);
    assert_eq!(after.fds, before.fds, "file descriptors leaked");
    assert_eq!(after.memfds, before.memfds, "shared-memory segments leaked");
    assert_eq!(after.threads, before.threads, "threads leaked");
    // What the allocator holds comes back (a margin for buffers that grew, and the
    // relay's and tokio's bookkeeping).
    assert!(
        after.heap_kib < before.heap_kib + 8 * 1024,
        "heap grew by {} KiB",
        after.heap_kib.saturating_sub(before.heap_kib)
    );
    for s in servers {
        s.abort();
    }
}
