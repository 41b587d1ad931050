//! Replays the inputs kept for the fuzz targets (`fuzz/seeds/<target>/`): the seeds they
//! start from and whatever a fuzzing run found worth keeping (minimized). Each must pass its
//! target's checks without a panic, here in every `cargo test`.
//!
//! Fuzzing itself (nightly, cargo-fuzz): `scripts/fuzz.sh [seconds per target]`.
//! The seeds are written by `cargo test --all-features --test fuzz_corpus -- --ignored`.

use std::path::{Path, PathBuf};

use hyperframes::fuzzing;
use hyperframes::wire::{Batch, Control, Handshake};
use hyperframes::{Flags, Header, Limits, Message};

type Target = fn(&[u8]);

fn targets() -> Vec<(&'static str, Target)> {
    let mut t: Vec<(&'static str, Target)> = vec![
        ("frame_decoder", fuzzing::frame_decoder),
        ("handshake", fuzzing::handshake),
        ("session_control", fuzzing::session_control),
    ];
    #[cfg(feature = "shm")]
    t.push(("shm_descriptor", fuzzing::shm_descriptor));
    #[cfg(feature = "rdma")]
    t.push(("rdma_proto", fuzzing::rdma_proto));
    t
}

fn dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target)
}

#[test]
fn every_kept_input_passes_its_target() {
    let mut total = 0;
    for (name, run) in targets() {
        let Ok(entries) = std::fs::read_dir(dir(name)) else {
            panic!("no seeds for {name} in {}", dir(name).display());
        };
        let mut n = 0;
        for e in entries {
            let path = e.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            let r = std::panic::catch_unwind(|| run(&data));
            assert!(r.is_ok(), "{name}: {} fails its target", path.display());
            n += 1;
        }
        assert!(n > 0, "{name}: no inputs");
        total += n;
    }
    println!("{total} inputs replayed");
}

fn frames(msgs: &[Message], controls: &[Control]) -> Vec<u8> {
    let mut b = Batch::new(1 << 16);
    for m in msgs {
        b.push_message(m.clone());
    }
    for c in controls {
        b.push_control(c);
    }
    b.take().concat()
}

fn message(kind: &str, meta: &[(&str, &str)], body: usize) -> Message {
    let mut m = Message::new(kind).unwrap();
    for (k, v) in meta {
        m = m.with_meta(k, *v).unwrap();
    }
    m.with_body(vec![0x5a; body])
}

/// Writes the seeds: valid inputs of every structure the targets read.
#[test]
#[ignore = "writes fuzz/seeds; run by hand when the formats change"]
fn write_seeds() {
    let write = |target: &str, name: &str, data: &[u8]| {
        std::fs::create_dir_all(dir(target)).unwrap();
        std::fs::write(dir(target).join(name), data).unwrap();
    };
    // frame_decoder: the first byte picks the read size and the direct threshold.
    let msgs = [
        message("a", &[], 0),
        message(
            "ml.splitter.output",
            &[("frame", "12"), ("hf.seq", "1")],
            100,
        ),
        message("big", &[], 5000).with_header(Header {
            flags: Flags::REQUEST,
            correlation: 7,
        }),
    ];
    for (i, piece) in [0u8, 7, 63, 200].into_iter().enumerate() {
        let mut data = vec![piece];
        data.extend(frames(&msgs, &[Control::Close]));
        write("frame_decoder", &format!("messages-{i}"), &data);
    }
    write(
        "frame_decoder",
        "controls",
        &[
            vec![3],
            frames(&[], &[Control::Stop, Control::Heartbeat, Control::Close]),
        ]
        .concat(),
    );
    // handshake
    let mut hs = Vec::new();
    Handshake::new(Limits::default()).encode(&mut hs);
    write("handshake", "default", &hs);
    let mut hs2 = Vec::new();
    Handshake::new(Limits::default())
        .with_heartbeat(Some(std::time::Duration::from_secs(1)))
        .encode(&mut hs2);
    write("handshake", "heartbeat", &hs2);
    write("handshake", "short", &hs[..20]);
    // session_control: type \0 key=value ...
    for (name, text) in [
        ("data", "a.b\0hf.seq=1"),
        (
            "hello",
            "hf.session.hello\0v=1\0id=0123456789abcdef0123456789abcdef\0resume=1\0delivered=9",
        ),
        ("welcome", "hf.session.welcome\0v=1\0known=0\0delivered=0"),
        ("ack", "hf.session.ack\0seq=18446744073709551615"),
        ("fin", "hf.session.fin\0hf.seq=4"),
        ("stop", "hf.session.stop"),
    ] {
        write("session_control", name, text.as_bytes());
    }
    #[cfg(feature = "shm")]
    seeds_shm(&write);
    #[cfg(feature = "rdma")]
    seeds_rdma(&write);
}

#[cfg(feature = "shm")]
fn seeds_shm(write: &dyn Fn(&str, &str, &[u8])) {
    // Descriptor words: [0]=unused, [1]=kind|flags<<8|type_len<<16|place<<24|meta_len<<32,
    // [2]=correlation, [3]=body_len, [4]=body_at, [5]=head_at, [6..]=inline bytes; then the
    // arena size byte and the metadata bound byte.
    let desc = |w1: u64, body_len: u64, body_at: u64, head_at: u64| {
        let mut words = [0u64; 16];
        words[1] = w1;
        words[3] = body_len;
        words[4] = body_at;
        words[5] = head_at;
        words[6] = u64::from_le_bytes(*b"abcdefgh");
        let mut out: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        out.extend([15, 8]);
        out
    };
    const MESSAGE: u64 = 1;
    // Placement bits: head in arena 0b0001, body in arena 0b0010, external 0b0100,
    // inline 0b1000.
    write(
        "shm_descriptor",
        "inline",
        &desc(MESSAGE | (3 << 16), 0, 0, 0),
    );
    write(
        "shm_descriptor",
        "inline-body",
        &desc(MESSAGE | (3 << 16) | (0b1000 << 24), 5, 0, 0),
    );
    write(
        "shm_descriptor",
        "arena-body",
        &desc(MESSAGE | (3 << 16) | (0b0010 << 24), 4096, 4096, 0),
    );
    write(
        "shm_descriptor",
        "external-body",
        &desc(MESSAGE | (3 << 16) | (0b0100 << 24), 1 << 19, 3, 0),
    );
    write(
        "shm_descriptor",
        "arena-head",
        &desc(
            MESSAGE | (3 << 16) | (0b0001 << 24) | (40 << 32),
            0,
            0,
            8192,
        ),
    );
}

#[cfg(feature = "rdma")]
fn seeds_rdma(write: &dyn Fn(&str, &str, &[u8])) {
    let params = fuzzing::rdma_params();
    // Length-prefixed receive buffers, as the peer (which has our hello) transmits them.
    use hyperframes::rdma::proto::Connection;
    let mut ours = Connection::new(params);
    let mut peer = Connection::new(params);
    let mut buf = vec![0u8; 8192 + 512];
    let n = ours.poll_transmit(&mut buf).expect("our hello");
    peer.handle_recv(&buf[..n]).unwrap();
    // Its own hello: the target has one already.
    peer.poll_transmit(&mut buf).expect("the peer's hello");
    for i in 0..3 {
        peer.send_eager(message("rdma.data", &[("i", "1")], i * 100));
    }
    peer.close();
    let mut data = Vec::new();
    while let Some(n) = peer.poll_transmit(&mut buf) {
        data.extend((n as u16).to_le_bytes());
        data.extend_from_slice(&buf[..n]);
    }
    write("rdma_proto", "eager-and-close", &data);
    write("rdma_proto", "empty", &[]);
}
