//! Device bodies (feature `cuda`) on every transport, through the stand-in device (host
//! memory handled as a device, copies on a thread of its own) here, and through a real GPU
//! in the `#[ignore = "needs a GPU"]` tests.

#![cfg(all(feature = "cuda", feature = "tcp", feature = "shm", feature = "inproc"))]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use hyperframes::device::{Gpu, Staging};
use hyperframes::{Body, Channel, Context, ErrorKind, Flags, Header, Location, Message};
use tokio::time::timeout;

const GUARD: Duration = Duration::from_secs(60);
static NAME: AtomicUsize = AtomicUsize::new(0);

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|j| (j as u64).wrapping_mul(131).wrapping_add(u64::from(seed)) as u8)
        .collect()
}

fn url(scheme: &str) -> String {
    let n = NAME.fetch_add(1, Ordering::Relaxed);
    match scheme {
        "tcp" => "tcp://127.0.0.1:0".into(),
        "shm" => format!("shm://dev-{}-{n}", std::process::id()),
        "rdma+sim" => format!("rdma+sim://dev-{n}"),
        "rdma" => "rdma://127.0.0.1:0".into(),
        _ => format!("inproc://dev-{n}"),
    }
}

async fn pair(ctx: &Context, scheme: &str) -> (Channel, Channel) {
    let mut l = ctx.bind(&url(scheme)).await.unwrap();
    let at = l.local_url().to_owned();
    let (c, s) = tokio::join!(ctx.connect(&at), l.accept());
    (c.unwrap(), s.unwrap())
}

fn small_staging(gpu: &Gpu) -> Gpu {
    gpu.with_staging(Staging {
        chunk: 64 << 10,
        buffers: 3,
    })
    .unwrap()
}

/// A host message, a device body of an odd length (many chunks), an empty device body, a
/// host message: all arrive, in order, with type, metadata and header; the device body's
/// bytes are exact wherever it lands.
async fn round_trip(scheme: &str, land: bool) {
    let gpu = small_staging(&Gpu::stand_in());
    let ctx = Context::builder()
        .shm_segment(256, 4 << 20)
        .build()
        .unwrap();
    let (mut a, mut b) = pair(&ctx, scheme).await;
    if land {
        b.halves_mut().1.land_on(Some(gpu.clone()));
    }
    let len = (1 << 20) + 12_345;
    let bytes = pattern(len, 7);
    let body = gpu.upload(&bytes).unwrap();
    let header = Header {
        flags: Flags::REQUEST,
        correlation: 42,
    };
    let sent = vec![
        Message::new("t.before").unwrap().with_body("host"),
        Message::new("t.device")
            .unwrap()
            .with_meta("k", "v")
            .unwrap()
            .with_header(header)
            .with_body(body.clone()),
        Message::new("t.empty")
            .unwrap()
            .with_body(gpu.alloc(0).unwrap()),
        Message::new("t.after").unwrap().with_body("host too"),
    ];
    let send = async {
        for m in sent.clone() {
            a.send(m).await.unwrap();
        }
        a.flush().await.unwrap();
        a
    };
    let recv = async {
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(b.recv().await.unwrap().unwrap());
        }
        (b, got)
    };
    let (_a, (_b, got)) = timeout(GUARD, async { tokio::join!(send, recv) })
        .await
        .expect("no hang");
    let kinds: Vec<&str> = got.iter().map(|m| m.kind().as_str()).collect();
    assert_eq!(kinds, ["t.before", "t.device", "t.empty", "t.after"]);
    let d = &got[1];
    assert_eq!(
        d.header(),
        header,
        "flags and correlation kept, channel bits cleared"
    );
    assert_eq!(d.meta().get("k"), Some("v"));
    assert_eq!(d.meta().len(), 1);
    assert_eq!(d.body().len(), len);
    if scheme == "inproc" {
        // In-process: the very memory, no copy.
        assert!(d.body().as_device().unwrap().same_memory(&body));
    } else if land {
        assert_eq!(d.body().location(), Location::StandIn);
        let dev = d.body().as_device().unwrap();
        assert!(!dev.same_memory(&body));
        assert_eq!(dev.to_host().unwrap(), bytes);
    } else {
        assert_eq!(d.body().location(), Location::Host);
        assert_eq!(d.body().as_bytes().unwrap(), &bytes[..]);
    }
    assert_eq!(got[2].body().len(), 0);
    assert_eq!(got[3].body().as_bytes().unwrap(), "host too");
    assert_eq!(
        _a.info().device_path(),
        match (scheme, land) {
            ("inproc", _) => "in-process",
            // The receiver maps the sender's memory (the stand-in's memfds; CUDA IPC on a GPU).
            ("shm", true) => "cuda-ipc",
            // The NIC reads the sender's memory (the stand-in's memfd as the dma-buf).
            ("rdma+sim", _) => "gpudirect",
            _ => "staged",
        }
    );
    // Every staging buffer went back to the pool; never more than configured were made.
    let (made, in_use) = gpu.staging_in_use();
    assert!(made <= 3, "{made} staging buffers for a pool of 3");
    assert_eq!(in_use, 0);
}

#[tokio::test]
async fn tcp_lands_in_host_memory() {
    round_trip("tcp", false).await;
}

#[tokio::test]
async fn tcp_lands_in_device_memory() {
    round_trip("tcp", true).await;
}

#[tokio::test]
async fn shm_staged_to_host_lent_to_a_device() {
    round_trip("shm", false).await;
    round_trip("shm", true).await;
}

/// Waits (at most `GUARD`) until `done` holds: what another task or process releases.
async fn settle(what: &str, mut done: impl FnMut() -> bool) {
    let until = tokio::time::Instant::now() + GUARD;
    while !done() {
        assert!(tokio::time::Instant::now() < until, "never settled: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn shm_ctx() -> Context {
    Context::builder()
        .shm_segment(256, 4 << 20)
        .build()
        .unwrap()
}

/// Two stand-in devices, the sender's and the receiver's, and a `shm://` channel whose
/// receiving end (`b`) lands bodies on the second.
async fn lending_pair() -> (Gpu, Gpu, Channel, Channel) {
    let (ours, theirs) = (Gpu::stand_in(), Gpu::stand_in());
    let (a, mut b) = pair(&shm_ctx(), "shm").await;
    b.halves_mut().1.land_on(Some(theirs.clone()));
    (ours, theirs, a, b)
}

/// `shm://` to a receiver that lands on a device: bodies are lent (CUDA IPC on a GPU; the
/// stand-in's memfds here), never staged, and the sender's memory stays allocated until the
/// receiver drops what it mapped, and no longer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_lends_device_memory_until_the_receiver_drops_it() {
    let (ours, theirs, mut a, mut b) = lending_pair().await;
    let mut got = Vec::new();
    // The last is larger than the arena: lending does not care.
    for (i, len) in [1usize, 4097, (5 << 20) + 5].into_iter().enumerate() {
        let bytes = pattern(len, i as u8);
        let m = Message::new("l.dev")
            .unwrap()
            .with_meta("i", i as u64)
            .unwrap()
            .with_body(ours.upload(&bytes).unwrap());
        timeout(GUARD, a.send(m)).await.unwrap().unwrap();
        let m = timeout(GUARD, b.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(m.meta().get("i"), Some(i.to_string().as_str()));
        assert_eq!(m.body().location(), Location::StandIn);
        assert_eq!(m.body().as_device().unwrap().to_host().unwrap(), bytes);
        got.push(m);
    }
    assert_eq!(a.info().device_path(), "cuda-ipc");
    assert_eq!(ours.staging_in_use(), (0, 0), "nothing was staged");
    assert_eq!(
        ours.live_blocks(),
        3,
        "the sender keeps what the receiver maps"
    );
    assert_eq!(theirs.live_blocks(), 3);
    got.remove(1);
    settle("one released", || ours.live_blocks() == 2).await;
    assert_eq!(theirs.live_blocks(), 2);
    got.clear();
    settle("all released", || ours.live_blocks() == 0).await;
    assert_eq!(theirs.live_blocks(), 0);
}

/// The sender drops its channel while the receiver still maps what it lent: the memory
/// stays allocated until the receiver drops the body (the connection's watcher outlives
/// the halves while bodies are lent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lent_body_outlives_the_senders_channel() {
    let (ours, _theirs, mut a, mut b) = lending_pair().await;
    let bytes = pattern(100_000, 3);
    let m = Message::new("o.dev")
        .unwrap()
        .with_body(ours.upload(&bytes).unwrap());
    timeout(GUARD, a.send(m)).await.unwrap().unwrap();
    let got = timeout(GUARD, b.recv()).await.unwrap().unwrap().unwrap();
    drop(a);
    // The receiver sees the channel end after the body, which it still holds.
    assert!(timeout(GUARD, b.recv()).await.unwrap().is_none());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(ours.live_blocks(), 1, "freed while the receiver maps it");
    assert_eq!(got.body().as_device().unwrap().to_host().unwrap(), bytes);
    drop(got);
    settle("released after the sender's channel went", || {
        ours.live_blocks() == 0
    })
    .await;
    drop(b);
}

/// A receiving context that does not map lent memory (`shm_cuda_ipc(false)`) gets device
/// bodies staged, landing on its device all the same; so does one that admits peers of any
/// user (the default follows zero copy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_without_cuda_ipc_stages() {
    for builder in [
        Context::builder().shm_cuda_ipc(false),
        Context::builder().shm_allow_any_user(true),
    ] {
        let (ours, theirs) = (Gpu::stand_in(), Gpu::stand_in());
        let l_ctx = builder
            .shm_segment(256, 4 << 20)
            .land_on(theirs.clone())
            .build()
            .unwrap();
        let mut l = l_ctx.bind(&url("shm")).await.unwrap();
        let at = l.local_url().to_owned();
        let c_ctx = shm_ctx();
        let (a, b) = tokio::join!(c_ctx.connect(&at), l.accept());
        let (mut a, mut b) = (a.unwrap(), b.unwrap());
        let bytes = pattern(200_000, 4);
        let m = Message::new("n.dev")
            .unwrap()
            .with_body(ours.upload(&bytes).unwrap());
        timeout(GUARD, a.send(m)).await.unwrap().unwrap();
        let m = timeout(GUARD, b.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(m.body().location(), Location::StandIn);
        assert_eq!(m.body().as_device().unwrap().to_host().unwrap(), bytes);
        assert_eq!(a.info().device_path(), "staged");
        assert_eq!(a.info().device_bodies().staged, 1);
        assert_eq!(a.info().device_bodies().lent, 0);
    }
}

/// A body lent while the receiver landed on a device, received after it switched to host
/// memory: copied to the host and given back. The next body is staged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_lent_body_follows_a_change_of_landing() {
    let (ours, _theirs, mut a, mut b) = lending_pair().await;
    let bytes = pattern(70_000, 1);
    let body = Message::new("c.dev")
        .unwrap()
        .with_body(ours.upload(&bytes).unwrap());
    timeout(GUARD, a.send(body)).await.unwrap().unwrap();
    assert_eq!(a.info().device_path(), "cuda-ipc");
    b.halves_mut().1.land_on(None);
    let m = timeout(GUARD, b.recv()).await.unwrap().unwrap().unwrap();
    assert_eq!(m.body().as_bytes().unwrap(), &bytes[..]);
    settle("the copied body given back", || ours.live_blocks() == 0).await;
    let again = Message::new("c.dev")
        .unwrap()
        .with_body(ours.upload(&bytes).unwrap());
    timeout(GUARD, a.send(again)).await.unwrap().unwrap();
    assert_eq!(a.info().device_path(), "staged");
    let m = timeout(GUARD, b.recv()).await.unwrap().unwrap().unwrap();
    assert_eq!(m.body().as_bytes().unwrap(), &bytes[..]);
}

/// A receiver that holds every slot of the device table: further bodies are staged (never a
/// wait that only the receiver could end), and lending resumes once it lets go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_stages_while_the_receiver_holds_every_lent_body() {
    const SLOTS: usize = 256;
    let (ours, theirs) = (Gpu::stand_in(), Gpu::stand_in());
    let (a, b) = pair(&shm_ctx(), "shm").await;
    let (mut tx, _rx_a) = a.split();
    let (_tx_b, mut rx) = b.split();
    rx.land_on(Some(theirs.clone()));
    let n = SLOTS + 4;
    let g = ours.clone();
    let send = tokio::spawn(async move {
        for i in 0..n {
            let m = Message::new("f.dev")
                .unwrap()
                .with_body(g.upload(&pattern(64, i as u8)).unwrap());
            tx.send(m).await.unwrap();
        }
        tx
    });
    let mut held = Vec::new();
    for i in 0..n {
        let m = timeout(GUARD, rx.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(
            m.body().as_device().unwrap().to_host().unwrap(),
            pattern(64, i as u8)
        );
        held.push(m);
    }
    let mut tx = send.await.unwrap();
    assert_eq!(tx.info().device_path(), "staged");
    assert_eq!(ours.live_blocks(), SLOTS, "the lent ones, kept");
    assert!(ours.staging_in_use().0 > 0, "the rest were staged");
    held.clear();
    settle("all released", || ours.live_blocks() == 0).await;
    let m = Message::new("f.dev")
        .unwrap()
        .with_body(ours.upload(b"lent again").unwrap());
    timeout(GUARD, tx.send(m)).await.unwrap().unwrap();
    assert_eq!(tx.info().device_path(), "cuda-ipc");
    let m = timeout(GUARD, rx.recv()).await.unwrap().unwrap().unwrap();
    assert_eq!(
        m.body().as_device().unwrap().to_host().unwrap(),
        &b"lent again"[..]
    );
}

const CHILD_LEN: usize = 3 << 20;

/// The peer of `a_peer_that_dies_holding_lent_memory_releases_it`: lands on a stand-in
/// device, says so, takes one lent body, checks it, and holds it until killed.
#[test]
fn ipc_child() {
    let Ok(url) = std::env::var("HF_DEVICE_IPC_CHILD") else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let gpu = match std::env::var("HF_DEVICE_IPC_GPU").as_deref() {
            Ok("cuda") => Gpu::cuda(0).unwrap(),
            _ => Gpu::stand_in(),
        };
        let ctx = Context::builder().land_on(gpu.clone()).build().unwrap();
        let mut ch = ctx.connect(&url).await.unwrap();
        ch.send(Message::new("landed").unwrap()).await.unwrap();
        let m = ch.recv().await.unwrap().unwrap();
        let ok = m.body().location() == gpu.location()
            && m.body().as_device().unwrap().to_host().unwrap() == pattern(CHILD_LEN, 5);
        println!("HELD {ok} {}", gpu.live_blocks());
        tokio::time::sleep(Duration::from_secs(600)).await;
        drop(m);
    });
}

/// The receiving process dies while it maps a lent body: the sender lets the memory go
/// (its socket's end is the process's end), without waiting for its own channel to close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_dies_holding_lent_memory_releases_it() {
    lent_to_a_process_that_dies(Gpu::stand_in(), "stand-in").await;
}

/// The same with CUDA IPC between two processes on one GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU"]
async fn gpu_shm_ipc_between_processes() {
    lent_to_a_process_that_dies(Gpu::cuda(0).expect("a CUDA device"), "cuda").await;
}

async fn lent_to_a_process_that_dies(gpu: Gpu, kind: &str) {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let url = format!("shm://ipc-{}", std::process::id());
    let mut l = Context::new().bind(&url).await.unwrap();
    /// Kills the child when the test fails before it does.
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Reap(
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "ipc_child", "--nocapture", "--test-threads=1"])
            .env("HF_DEVICE_IPC_CHILD", &url)
            .env("HF_DEVICE_IPC_GPU", kind)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut ch = timeout(GUARD, l.accept()).await.unwrap().unwrap();
    let landed = timeout(GUARD, ch.recv()).await.unwrap().unwrap().unwrap();
    assert_eq!(landed.kind().as_str(), "landed");
    let body = gpu.upload(&pattern(CHILD_LEN, 5)).unwrap();
    timeout(GUARD, ch.send(Message::new("ipc").unwrap().with_body(body)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ch.info().device_path(), "cuda-ipc");
    let stdout = child.0.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map(|l| l.unwrap())
            // After libtest's "test ipc_child ... ".
            .find_map(|l| l.split_once("HELD ").map(|(_, r)| r.to_owned()))
    })
    .await
    .unwrap();
    assert_eq!(line.as_deref(), Some("true 1"), "the child mapped it");
    assert_eq!(gpu.live_blocks(), 1, "kept while the child maps it");
    drop(child);
    settle("released at the peer's death", || gpu.live_blocks() == 0).await;
    let r = timeout(GUARD, ch.recv()).await.unwrap();
    assert!(
        matches!(&r, Some(Err(e)) if e.kind() == ErrorKind::ConnectionLost),
        "{r:?}"
    );
}

#[tokio::test]
async fn inproc_hands_over_the_memory() {
    round_trip("inproc", true).await;
}

/// The context's landing applies to accepted and connected channels alike.
#[tokio::test]
async fn context_landing_and_sessions() {
    let gpu = small_staging(&Gpu::stand_in());
    let ctx = Context::builder().land_on(gpu.clone()).build().unwrap();
    let mut l = ctx.bind_sessions("tcp://127.0.0.1:0").await.unwrap();
    let at = l.local_url().to_owned();
    let (c, s) = tokio::join!(
        ctx.connect_with(&at, hyperframes::session::Reconnect::never()),
        l.accept()
    );
    let (mut c, mut s) = (c.unwrap(), s.unwrap());
    let bytes = pattern(300_001, 3);
    c.send(
        Message::new("s.dev")
            .unwrap()
            .with_body(gpu.upload(&bytes).unwrap()),
    )
    .await
    .unwrap();
    let m = timeout(GUARD, s.recv()).await.unwrap().unwrap().unwrap();
    assert_eq!(m.body().location(), Location::StandIn);
    assert_eq!(m.body().as_device().unwrap().to_host().unwrap(), bytes);
    timeout(GUARD, c.flush()).await.unwrap().unwrap();
}

/// Many device bodies back to back through a pool of one buffer: the sender waits for the
/// transport to give each buffer back (backpressure), nothing is lost or reordered.
#[tokio::test]
async fn one_buffer_pool_many_bodies() {
    let gpu = Gpu::stand_in()
        .with_staging(Staging {
            chunk: 4096,
            buffers: 1,
        })
        .unwrap();
    let ctx = Context::new();
    let (a, b) = pair(&ctx, "tcp").await;
    let (mut tx, _) = a.split();
    let (_, mut rx) = b.split();
    let bodies: Vec<Vec<u8>> = (0..20)
        .map(|i| pattern(10_000 + i * 977, i as u8))
        .collect();
    let expect = bodies.clone();
    let g = gpu.clone();
    let send = tokio::spawn(async move {
        for (i, b) in bodies.iter().enumerate() {
            let m = Message::new("p.dev")
                .unwrap()
                .with_meta("i", i as u64)
                .unwrap()
                .with_body(g.upload(b).unwrap());
            tx.send(m).await.unwrap();
        }
        tx.close().await.unwrap();
    });
    for (i, want) in expect.iter().enumerate() {
        let m = timeout(GUARD, rx.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(m.meta().get("i"), Some(i.to_string().as_str()));
        assert_eq!(m.body().as_bytes().unwrap(), &want[..]);
    }
    assert!(timeout(GUARD, rx.recv()).await.unwrap().is_none());
    send.await.unwrap();
    assert_eq!(gpu.staging_in_use(), (1, 0));
}

/// The pipeline hands the chunks over in order and exactly once each.
#[tokio::test]
async fn pipeline_chunks_in_order() {
    let gpu = Gpu::stand_in()
        .with_staging(Staging {
            chunk: 1000,
            buffers: 2,
        })
        .unwrap();
    let bytes = pattern(10_500, 9);
    let got = Arc::new(Mutex::new(Vec::new()));
    let sink = got.clone();
    // Copied out: a chunk holds its staging buffer until dropped (the pool has 2).
    hyperframes::device::stage_into(gpu.upload(&bytes).unwrap(), move |b| {
        sink.lock().unwrap().push(b.to_vec())
    })
    .await
    .unwrap();
    let got = got.lock().unwrap();
    let lens: Vec<usize> = got.iter().map(|b| b.len()).collect();
    assert_eq!(
        lens,
        [
            1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 500
        ]
    );
    assert_eq!(got.concat(), bytes);
}

/// A header carrying the channel's own bits is refused, the message handed back.
#[tokio::test]
async fn channel_flags_are_refused() {
    let ctx = Context::new();
    let (mut a, _b) = pair(&ctx, "tcp").await;
    let m = Message::new("x").unwrap().with_header(Header {
        flags: Flags::DEVICE,
        correlation: 0,
    });
    let mut e = a.send(m).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Mismatch);
    assert!(e.take_message().is_some());
}

/// A sender that dies in the middle of a device body: the receiver gets an error naming
/// the body, not a truncated message and not a hang.
#[tokio::test]
async fn sender_dropped_mid_body_is_an_error() {
    let gpu = Gpu::stand_in()
        .with_staging(Staging {
            chunk: 4096,
            buffers: 1,
        })
        .unwrap();
    // Hold the pool's only buffer: the channel's send stops right after the announcement.
    let (held_tx, held_rx) = tokio::sync::oneshot::channel();
    let mut held_tx = Some(held_tx);
    let hostage = tokio::spawn(hyperframes::device::stage_into(
        gpu.upload(&[0u8; 8192]).unwrap(),
        move |chunk| {
            if let Some(t) = held_tx.take() {
                let _ = t.send(chunk);
            }
        },
    ));
    let chunk = held_rx.await.unwrap();
    let ctx = Context::new();
    let (a, b) = pair(&ctx, "tcp").await;
    let (mut tx, rx_a) = a.split();
    let (tx_b, mut rx) = b.split();
    let body = gpu.upload(&pattern(1 << 20, 1)).unwrap();
    let cut = timeout(
        Duration::from_millis(200),
        tx.send(Message::new("cut").unwrap().with_body(body)),
    )
    .await;
    assert!(cut.is_err(), "the send waits for a staging buffer");
    drop((tx, rx_a));
    let r = timeout(GUARD, rx.recv()).await.expect("no hang");
    let e = match r {
        Some(Err(e)) => e,
        other => panic!("expected an error for the cut body, got {other:?}"),
    };
    assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e}");
    assert!(e.to_string().contains("sent from device memory"), "{e}");
    assert!(timeout(GUARD, rx.recv()).await.unwrap().is_none());
    drop((tx_b, chunk));
    hostage.abort();
}

#[test]
fn cuda_without_a_gpu_is_a_typed_error() {
    match Gpu::cuda(0) {
        Ok(gpu) => eprintln!("a GPU is here: {gpu:?}"),
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
            assert!(e.to_string().contains("hf doctor"), "{e}");
        }
    }
    match hyperframes::device::cuda_device_count() {
        Ok(n) => eprintln!("{n} CUDA devices"),
        Err(e) => assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}"),
    }
    // A device that cannot exist, on any host.
    let e = Gpu::cuda(10_000).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
}

#[test]
fn device_bodies_compare_by_memory() {
    let gpu = Gpu::stand_in();
    let a = gpu.upload(b"same bytes").unwrap();
    let b = gpu.upload(b"same bytes").unwrap();
    assert_eq!(Body::from(a.clone()), Body::from(a.clone()));
    assert_ne!(Body::from(a.clone()), Body::from(b));
    assert_ne!(Body::from(a), Body::from("same bytes"));
}

#[test]
fn only_host_bodies_convert_to_bytes() {
    let host = Body::from("host bytes");
    assert_eq!(Bytes::try_from(host).unwrap(), "host bytes");
    let device = Body::from(Gpu::stand_in().upload(b"device bytes").unwrap());
    let back = Bytes::try_from(device).unwrap_err();
    assert_eq!(back.len(), 12, "the body comes back whole");
    assert!(back.as_device().is_some());
}

// ---- rdma:// (GPUDirect RDMA over simulated verbs: the stand-in exports a memfd as its
// dma-buf, which the simulation maps as the NIC would reach it) ----

#[cfg(feature = "rdma")]
mod rdma {
    use super::*;
    use hyperframes::rdma::sim::{self, Faults, SimConfig};
    use hyperframes::rdma::{RdmaConfig, channel_pair};

    #[tokio::test]
    async fn rdma_lands_in_host_memory() {
        round_trip("rdma+sim", false).await;
    }

    #[tokio::test]
    async fn rdma_lands_in_device_memory() {
        round_trip("rdma+sim", true).await;
    }

    fn cfg() -> RdmaConfig {
        RdmaConfig {
            heartbeat_misses: 0,
            ..RdmaConfig::default()
        }
    }

    /// Small (below the eager size) and large bodies alike are read from device memory,
    /// each registered once, for exactly its bytes, released at its FIN; from 1 MiB they are
    /// read straight into device memory of the receiver's (smaller ones into host memory,
    /// then copied: device memory comes in whole blocks).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rdma_reads_device_bodies_where_they_lie() {
        let (ours, theirs) = (Gpu::stand_in(), Gpu::stand_in());
        let (sa, sb) = sim::pair(SimConfig::default());
        let (mut a, mut b) = channel_pair(sa.clone(), sb.clone(), cfg()).await.unwrap();
        b.halves_mut().1.land_on(Some(theirs.clone()));
        let lens = [1usize, 4097, (5 << 20) + 5];
        for (i, &len) in lens.iter().enumerate() {
            let bytes = pattern(len, i as u8);
            let body = ours.upload(&bytes).unwrap();
            a.send(Message::new("g.dev").unwrap().with_body(body))
                .await
                .unwrap();
            let m = timeout(GUARD, b.recv()).await.unwrap().unwrap().unwrap();
            assert_eq!(m.body().location(), Location::StandIn);
            assert_eq!(m.body().as_device().unwrap().to_host().unwrap(), bytes);
        }
        let n = a.info().device_bodies();
        assert_eq!((n.gpudirect, n.staged), (3, 0), "{n:?}");
        let st = sa.stats();
        assert_eq!(st.exposures, 3, "one registration per body: {st:?}");
        assert_eq!(st.dmabufs, 3, "lent from device memory: {st:?}");
        let rb = sb.stats();
        assert_eq!(
            rb.dmabufs, 1,
            "the 5 MiB body read into device memory: {rb:?}"
        );
        assert_eq!(rb.reads, 3, "{rb:?}");
        let regions = sa.exposed_regions();
        let lent: Vec<u64> = regions.iter().map(|r| r.len).collect();
        assert_eq!(lent, lens.map(|l| l as u64), "each covers its body alone");
        settle("the registrations are dropped at the FINs", || {
            sa.stats().exposed == 0 && ours.live_blocks() == 0
        })
        .await;
    }

    /// The sender's device memory stays allocated while the NIC may read it: until the
    /// peer's FIN, whatever the sender dropped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_the_nic_reads_is_kept_until_its_fin() {
        let ours = Gpu::stand_in();
        let (sa, sb) = sim::pair(SimConfig::default());
        // The receiver's reads complete late, so its FIN does.
        sb.set_faults(Faults {
            delay: Some((Duration::from_millis(800), Duration::from_millis(800))),
            ..Faults::default()
        });
        let (mut a, mut b) = channel_pair(sa.clone(), sb, cfg()).await.unwrap();
        let bytes = pattern(3 << 20, 9);
        a.send(
            Message::new("g.dev")
                .unwrap()
                .with_body(ours.upload(&bytes).unwrap()),
        )
        .await
        .unwrap();
        // Only the registration holds the body now.
        settle("the body is lent", || sa.stats().exposed == 3 << 20).await;
        assert_eq!(ours.live_blocks(), 1, "freed while the NIC may read it");
        let m = timeout(GUARD, b.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(m.body().as_bytes().unwrap(), &bytes[..]);
        settle("released at the FIN", || {
            sa.stats().exposed == 0 && ours.live_blocks() == 0
        })
        .await;
    }

    /// Staged pieces are buffers of the GPU's staging pool, shared by every channel on
    /// it: they return to the pool as soon as the driver has them (copied), not when the
    /// peer has read them, or one slow peer would stall staging on every channel.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn staged_pieces_do_not_hold_the_staging_pool_until_their_fin() {
        let gpu = small_staging(&Gpu::stand_in());
        let (sa, sb) = sim::pair(SimConfig::default());
        sb.set_faults(Faults {
            delay: Some((Duration::from_secs(2), Duration::from_secs(2))),
            ..Faults::default()
        });
        let cfg = RdmaConfig {
            gpudirect: false,
            ..cfg()
        };
        let (mut a, mut b) = channel_pair(sa.clone(), sb, cfg).await.unwrap();
        let bytes = pattern(1 << 20, 4);
        // 16 pieces of 64 KiB through a pool of 3 buffers, while the peer's FINs are late.
        timeout(Duration::from_secs(1), async {
            a.send(
                Message::new("g")
                    .unwrap()
                    .with_body(gpu.upload(&bytes).unwrap()),
            )
            .await
            .unwrap();
            a.flush().await.unwrap();
        })
        .await
        .expect("staging stalled behind the peer's FINs");
        settle("the pieces are handed to the driver", || {
            gpu.staging_in_use().1 == 0
        })
        .await;
        assert!(
            sa.stats().exposed > 0,
            "the pieces are still lent (as copies)"
        );
        let m = timeout(GUARD, b.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(m.body().as_bytes().unwrap(), &bytes[..]);
        assert_eq!(a.info().device_bodies().staged, 1);
    }

    /// A NIC whose driver takes no dma-bufs: on the sending side the bodies are staged (and
    /// counted so); on the receiving side they are read into host memory and copied to the
    /// device. Every byte arrives either way, where the receiver lands it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_dmabuf_support_bodies_are_staged_or_copied() {
        for refusing in ["sender", "receiver"] {
            let (ours, theirs) = (Gpu::stand_in(), Gpu::stand_in());
            let (sa, sb) = sim::pair(SimConfig::default());
            let no = Faults {
                no_dmabuf: true,
                ..Faults::default()
            };
            if refusing == "sender" { &sa } else { &sb }.set_faults(no);
            let (mut a, mut b) = channel_pair(sa.clone(), sb.clone(), cfg()).await.unwrap();
            b.halves_mut().1.land_on(Some(theirs.clone()));
            for (i, len) in [5000usize, (2 << 20) + 1].into_iter().enumerate() {
                let bytes = pattern(len, i as u8);
                a.send(
                    Message::new("g")
                        .unwrap()
                        .with_body(ours.upload(&bytes).unwrap()),
                )
                .await
                .unwrap();
                let m = timeout(GUARD, b.recv()).await.unwrap().unwrap().unwrap();
                assert_eq!(m.body().location(), Location::StandIn, "{refusing}");
                assert_eq!(
                    m.body().as_device().unwrap().to_host().unwrap(),
                    bytes,
                    "{refusing}"
                );
            }
            let n = a.info().device_bodies();
            let want = if refusing == "sender" { (0, 2) } else { (2, 0) };
            assert_eq!((n.gpudirect, n.staged), want, "{refusing}: {n:?}");
            assert_eq!(sb.stats().dmabufs, 0, "{refusing}");
        }
    }

    /// Where bodies land is the Receiver's choice when it takes them, also for bodies read
    /// ahead into device memory; a context's landing reaches rdma:// channels too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rdma_landing_follows_the_receiver() {
        let (ours, theirs) = (Gpu::stand_in(), Gpu::stand_in());
        let ctx = Context::builder().land_on(theirs.clone()).build().unwrap();
        let (mut a, mut b) = pair(&ctx, "rdma+sim").await;
        let bytes = pattern(3 << 20, 8);
        for _ in 0..2 {
            a.send(
                Message::new("g")
                    .unwrap()
                    .with_body(ours.upload(&bytes).unwrap()),
            )
            .await
            .unwrap();
        }
        let m = timeout(GUARD, b.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(
            m.body().location(),
            Location::StandIn,
            "the context's landing"
        );
        assert_eq!(m.body().as_device().unwrap().to_host().unwrap(), bytes);
        // The second was read ahead (into device memory); the Receiver now wants host memory.
        settle("the second body is read", || theirs.live_blocks() >= 2).await;
        b.halves_mut().1.land_on(None);
        let m = timeout(GUARD, b.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(m.body().location(), Location::Host);
        assert_eq!(m.body().as_bytes().unwrap(), &bytes[..]);
    }

    /// `rdma_gpudirect(false)`: staged through host memory, and counted so.
    #[tokio::test]
    async fn rdma_without_gpudirect_stages() {
        let gpu = Gpu::stand_in();
        let ctx = Context::builder().rdma_gpudirect(false).build().unwrap();
        let (mut a, mut b) = pair(&ctx, "rdma+sim").await;
        let bytes = pattern(100_000, 3);
        a.send(
            Message::new("g")
                .unwrap()
                .with_body(gpu.upload(&bytes).unwrap()),
        )
        .await
        .unwrap();
        let m = timeout(GUARD, b.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(m.body().as_bytes().unwrap(), &bytes[..]);
        let n = a.info().device_bodies();
        assert_eq!((n.gpudirect, n.staged), (0, 1), "{n:?}");
        assert_eq!(a.info().device_path(), "staged");
    }
}

// ---- on a GPU (run with `cargo test --features cuda --test device -- --ignored`) ----

async fn gpu_round_trip(scheme: &str) {
    let gpu = Gpu::cuda(0).expect("a CUDA device");
    let ctx = Context::builder()
        .shm_segment(256, 4 << 20)
        .build()
        .unwrap();
    let (mut a, mut b) = pair(&ctx, scheme).await;
    b.halves_mut().1.land_on(Some(gpu.clone()));
    for len in [0usize, 1, 4097, (8 << 20) + 3] {
        let bytes = pattern(len, len as u8);
        let body = gpu.upload(&bytes).unwrap();
        a.send(Message::new("g.dev").unwrap().with_body(body))
            .await
            .unwrap();
        let m = timeout(GUARD, b.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(m.body().len(), len);
        if len > 0 {
            assert!(matches!(m.body().location(), Location::Cuda { ordinal: 0 }));
            assert_eq!(
                m.body().as_device().unwrap().to_host().unwrap(),
                bytes,
                "{scheme} {len}"
            );
        }
    }
    if scheme == "rdma" {
        assert_eq!(
            a.info().device_path(),
            "gpudirect",
            "{:?}",
            a.info().device_bodies()
        );
    }
}

#[tokio::test]
#[ignore = "needs a GPU"]
async fn gpu_inproc() {
    gpu_round_trip("inproc").await;
}

#[tokio::test]
#[ignore = "needs a GPU"]
async fn gpu_tcp_staged() {
    gpu_round_trip("tcp").await;
}

/// GPUDirect RDMA: the NIC reads the body from device memory (needs an RDMA NIC whose driver
/// takes dma-bufs, and a GPU that exports them).
#[cfg(feature = "rdma")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU and an RDMA NIC"]
async fn gpu_rdma_gpudirect() {
    gpu_round_trip("rdma").await;
}

/// Within one process CUDA does not open its own IPC handles: staged, and said so.
#[tokio::test]
#[ignore = "needs a GPU"]
async fn gpu_shm_staged() {
    gpu_round_trip("shm").await;
}
