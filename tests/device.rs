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
        if scheme == "inproc" {
            "in-process"
        } else {
            "staged"
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
async fn shm_staged_both_landings() {
    round_trip("shm", false).await;
    round_trip("shm", true).await;
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

#[tokio::test]
#[ignore = "needs a GPU"]
async fn gpu_shm_staged() {
    gpu_round_trip("shm").await;
}
