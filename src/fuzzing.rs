//! Entry points for the fuzz targets in `fuzz/` and for `tests/fuzz_corpus.rs`, which replays
//! what they found: each takes arbitrary bytes as a peer would send them, runs the decoder or
//! checker they reach, and checks what it accepted. None may panic, allocate past the limits
//! it was given, or accept what it should refuse.
//!
//! Not a stable API (hidden from the docs).

use bytes::BytesMut;

use crate::message::Limits;

/// Limits small enough that a fuzzer reaches them.
fn limits() -> Limits {
    Limits {
        max_body: 1 << 16,
        max_meta_bytes: 512,
        max_meta_entries: 8,
    }
}

/// The first byte, when there is one, and the rest.
fn split_first(data: &[u8]) -> (u8, &[u8]) {
    match data.split_first() {
        Some((&b, rest)) => (b, rest),
        None => (0, data),
    }
}

/// The byte-stream frame decoder (tcp, tls, the rdma set-up's framing): the input arrives in
/// pieces of sizes chosen by its first byte, as reads would deliver it.
pub fn frame_decoder(data: &[u8]) {
    use crate::wire::{Decoder, Frame};
    let (b, data) = split_first(data);
    let piece = usize::from(b % 64) + 1;
    let limits = limits();
    let mut dec = Decoder::new(limits).with_direct_threshold(usize::from(b) * 16 + 1);
    let mut buf = BytesMut::new();
    for chunk in data.chunks(piece) {
        buf.extend_from_slice(chunk);
        loop {
            match dec.decode(&mut buf) {
                Ok(Some(Frame::Message(m))) => {
                    assert!(m.body().len() as u64 <= limits.max_body);
                    assert!(m.meta().encoded_len() <= limits.max_meta_bytes as usize);
                    assert!(m.meta().len() <= usize::from(limits.max_meta_entries));
                    // A decoded message is a valid one: it classifies as a session would.
                    let _ = crate::session::fuzz_classify(m);
                }
                Ok(Some(_)) => {}
                Ok(None) => {
                    // A body being read into its own buffer: give it what there is.
                    if let Some((target, want)) = dec.body_target() {
                        assert!(want as u64 <= limits.max_body);
                        let n = want.min(buf.len());
                        target.extend_from_slice(&buf.split_to(n));
                        if n > 0 {
                            continue;
                        }
                    }
                    break;
                }
                Err(_) => return,
            }
        }
    }
}

/// The byte-stream handshake.
pub fn handshake(data: &[u8]) {
    use crate::wire::Handshake;
    if let Ok(Some((hs, used))) = Handshake::decode(data) {
        assert!(used <= data.len());
        // What was accepted encodes and decodes to itself.
        let mut out = BytesMut::new();
        hs.encode(&mut out);
        let (again, _) = Handshake::decode(&out).unwrap().unwrap();
        assert_eq!(again.limits, hs.limits);
    }
}

/// The check of a descriptor a shared-memory peer wrote: the words as loaded from the slot,
/// against bounds taken from the input too. What it accepts must lie inside them.
#[cfg(feature = "shm")]
pub fn shm_descriptor(data: &[u8]) {
    use crate::transport::shm::desc::{Bounds, Desc, Part, WORDS, check_words};
    let mut words = [0u64; WORDS];
    for (w, c) in words.iter_mut().zip(data.chunks(8)) {
        let mut b = [0u8; 8];
        b[..c.len()].copy_from_slice(c);
        *w = u64::from_le_bytes(b);
    }
    let tail = data.get(WORDS * 8..).unwrap_or_default();
    let (a, tail) = split_first(tail);
    let (m, _) = split_first(tail);
    let bounds = Bounds {
        max_meta_bytes: u32::from(m) * 16,
        max_body: 1 << 20,
        arena_len: (u64::from(a) + 1) << 12,
    };
    let Ok(layout) = check_words(&words, &bounds) else {
        return;
    };
    let check = |p: Part| match p {
        Part::Empty => 0,
        Part::Inline { at, len } => {
            assert!(at + len <= Desc::INLINE);
            len as u64
        }
        Part::Block { block, len } => {
            assert!(
                block
                    .checked_add(len)
                    .is_some_and(|e| e <= bounds.arena_len)
            );
            len
        }
        Part::External { len, .. } => len,
        Part::Device { slot, len } => {
            assert!(slot < crate::transport::shm::desc::DEVICE_SLOTS);
            len
        }
    };
    let head = check(layout.head);
    let type_len = layout.type_len as u64;
    assert!(type_len > 0 && head >= type_len);
    assert!(head - type_len <= u64::from(bounds.max_meta_bytes));
    assert!(check(layout.body) <= bounds.max_body);
}

/// The parameters both sides of [`rdma_proto`] offer (its seeds are written with them).
#[cfg(feature = "rdma")]
pub fn rdma_params() -> crate::transport::rdma::proto::Params {
    crate::transport::rdma::proto::Params {
        recv_slots: 8,
        slot_size: 8192 + 512,
        limits: Limits::default(),
        keepalive: crate::transport::rdma::verbs::RemoteRegion {
            addr: 1,
            len: 8,
            rkey: 2,
        },
        beat_ms: 10,
    }
}

/// The rdma protocol core: a connection that has our peer's hello (and sent its own) takes
/// the input as received buffers (`[len: u16 LE][bytes]`, repeated), answering as its driver
/// would (taking messages, sending what it must), and never holds more than its window.
#[cfg(feature = "rdma")]
pub fn rdma_proto(mut data: &[u8]) {
    use crate::transport::rdma::proto::{Connection, decode, encode_hello};
    let params = rdma_params();
    let mut conn = Connection::new(params);
    let mut out = vec![0u8; 8192 + 512];
    let mut hello = [0u8; 8192 + 512];
    let n = encode_hello(&mut hello, &params);
    while conn.poll_transmit(&mut out).is_some() {}
    if conn.handle_recv(&hello[..n]).is_err() {
        return;
    }
    while data.len() >= 2 {
        let len = usize::from(u16::from_le_bytes([data[0], data[1]]));
        let buf = &data[2..(2 + len).min(data.len())];
        data = &data[2 + buf.len()..];
        let _ = decode(buf, &params.limits);
        if conn.handle_recv(buf).is_err() {
            return;
        }
        assert!(conn.inbox_len() <= params.recv_slots as usize);
        while conn.poll_message().is_some() {}
        while conn.poll_read().is_some() {}
        while conn.poll_transmit(&mut out).is_some() {}
    }
}

/// The session protocol's reading of a message: built from the input's fields, classified.
pub fn session_control(data: &[u8]) {
    use crate::message::Message;
    // Type, then key=value pairs separated by NUL, as text.
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\0');
    let Some(Ok(mut msg)) = parts.next().map(Message::new) else {
        return;
    };
    for kv in parts {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        match msg.clone().with_meta(k, v) {
            Ok(m) => msg = m,
            Err(_) => return,
        }
    }
    let _ = crate::session::fuzz_classify(msg);
}
