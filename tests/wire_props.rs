//! Property tests of the sans-IO wire codec (`hyperframes::wire`): no sockets.
//!
//! * every field of arbitrary messages and control frames survives `Batch` → partial writes
//!   (`advance`) → `Decoder` fed in random chunks (shared buffer and direct body buffers);
//! * handshakes round-trip and every truncation asks for more;
//! * arbitrary, half-valid and mutated input never panics, and errors are sticky;
//! * a counting global allocator shows that no single `decode` call allocates more than the
//!   limits allow, whatever the header announces.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use bytes::{Bytes, BytesMut};
use hyperframes::wire::{
    self, Batch, Capabilities, Control, Decoder, FRAME_HEAD_LEN, Frame, FrameError, HANDSHAKE_LEN,
    Handshake, HandshakeError, MAGIC, MAX_ERROR_REASON, VERSION,
};
use hyperframes::{Flags, Header, Limits, Message};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------
// A counting allocator. Counters are per thread, so the test harness's other threads (and
// proptest's own bookkeeping outside `measure`) do not pollute a measurement.
// ---------------------------------------------------------------------------------------

struct Counting;

thread_local! {
    /// Bytes allocated minus bytes freed on this thread (may go negative when a buffer
    /// allocated elsewhere is freed here).
    static CURRENT: Cell<isize> = const { Cell::new(0) };
    /// Highest `CURRENT` since the last reset.
    static PEAK: Cell<isize> = const { Cell::new(0) };
    /// Largest single allocation (or reallocation target) since the last reset.
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note_alloc(size: usize) {
    let _ = CURRENT.try_with(|c| {
        let now = c.get() + size as isize;
        c.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
}

fn note_free(size: usize) {
    let _ = CURRENT.try_with(|c| c.set(c.get() - size as isize));
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the
// bookkeeping only touches `const`-initialised thread-local `Cell`s (no allocation, no
// destructor), through `try_with` so it is a no-op while a thread is torn down.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded contract (layout has non-zero size, per GlobalAlloc).
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note_alloc(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            note_alloc(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note_free(layout.size());
        // SAFETY: `ptr` was allocated by `System` (through us) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // Counted as a new block before the old one goes: the worst case of a move.
            note_alloc(new_size);
            note_free(layout.size());
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

#[derive(Clone, Copy, Debug)]
struct Usage {
    /// Highest bytes-in-use during the call, above what was in use before it.
    peak_delta: usize,
    /// Largest single allocation during the call.
    largest: usize,
}

/// Runs `f` and reports what it allocated on this thread.
fn measure<R>(f: impl FnOnce() -> R) -> (R, Usage) {
    let base = CURRENT.with(Cell::get);
    PEAK.with(|p| p.set(base));
    LARGEST.with(|l| l.set(0));
    let r = f();
    let peak = PEAK.with(Cell::get);
    let largest = LARGEST.with(Cell::get);
    (
        r,
        Usage {
            peak_delta: (peak - base).max(0) as usize,
            largest,
        },
    )
}

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// SplitMix64: random sizes inside one proptest case, reproducible from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `1..=max` (`max` >= 1).
    fn size(&mut self, max: usize) -> usize {
        1 + (self.next() % max.max(1) as u64) as usize
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(len + 8);
        while v.len() < len {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(len);
        v
    }
}

/// How large the pieces are in which bytes are written or read: a mix of tiny pieces (to
/// cross every field boundary) and larger ones, or tiny only.
#[derive(Clone, Copy, Debug)]
enum Pieces {
    Tiny,
    Mixed(usize),
}

impl Pieces {
    fn next(self, rng: &mut Rng) -> usize {
        match self {
            Pieces::Tiny => rng.size(3),
            Pieces::Mixed(max) => {
                if rng.next().is_multiple_of(2) {
                    rng.size(8)
                } else {
                    rng.size(max)
                }
            }
        }
    }
}

fn pieces() -> impl Strategy<Value = Pieces> {
    prop_oneof![
        1 => Just(Pieces::Tiny),
        1 => Just(Pieces::Mixed(64)),
        2 => Just(Pieces::Mixed(4096)),
        2 => Just(Pieces::Mixed(64 << 10)),
        1 => Just(Pieces::Mixed(1 << 20)),
    ]
}

/// The limits of the allocation tests.
fn alloc_limits() -> Limits {
    let mut l = Limits::default();
    l.max_body = 1 << 20;
    l.max_meta_bytes = 4096;
    l.max_meta_entries = 32;
    l
}

/// What a single decode call may allocate under [`alloc_limits`].
fn alloc_bound(l: &Limits) -> usize {
    l.max_body as usize + l.max_meta_bytes as usize + (64 << 10)
}

/// A frame header, by hand from the specification.
fn head(kind: u8, flags: u8, type_len: u8, meta_len: u32, body_len: u64, corr: u64) -> [u8; 24] {
    let mut b = [0u8; FRAME_HEAD_LEN];
    b[0] = kind;
    b[1] = flags;
    b[2] = type_len;
    b[4..8].copy_from_slice(&meta_len.to_le_bytes());
    b[8..16].copy_from_slice(&body_len.to_le_bytes());
    b[16..24].copy_from_slice(&corr.to_le_bytes());
    b
}

/// The reason an `ERROR` frame carries for `r`: cut to 1024 bytes on a char boundary.
fn cut_reason(r: &str) -> String {
    let mut end = r.len().min(MAX_ERROR_REASON);
    while !r.is_char_boundary(end) {
        end -= 1;
    }
    r[..end].to_owned()
}

// ---------------------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------------------

/// Valid dotted types, 1..=255 bytes.
fn msg_type() -> impl Strategy<Value = String> {
    let fit = |mut s: String| {
        s.truncate(255);
        if s.ends_with('.') {
            s.pop();
            s.push('z');
        }
        s
    };
    prop_oneof![
        4 => "[A-Za-z0-9_-]{1,12}(\\.[A-Za-z0-9_-]{1,12}){0,4}",
        1 => "[A-Za-z0-9_-]{1,64}(\\.[A-Za-z0-9_-]{1,64}){0,5}".prop_map(fit),
        1 => "[A-Za-z0-9_-]{255}",
        1 => "[a-z](\\.[a-z]){127}",
    ]
}

/// Metadata values: arbitrary UTF-8 (newlines and multi-byte characters included).
fn meta_value(long: bool) -> BoxedStrategy<String> {
    if long {
        prop_oneof![
            6 => "(?s).{0,24}",
            2 => any::<String>(),
            1 => "(?s).{200,600}",
        ]
        .boxed()
    } else {
        prop_oneof![4 => "(?s).{0,24}", 1 => any::<String>()].boxed()
    }
}

#[derive(Clone, Debug)]
struct MsgSpec {
    type_ix: usize,
    meta: Vec<(String, String)>,
    body_len: usize,
    body_seed: u64,
    flags: u8,
    correlation: u64,
}

#[derive(Clone, Debug)]
enum ItemSpec {
    Msg(MsgSpec),
    Control(Control),
}

fn body_len() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 0usize..64,
        3 => 0usize..4096,
        1 => 0usize..300 << 10,
    ]
}

fn item(long_values: bool) -> impl Strategy<Value = ItemSpec> {
    let msg = (
        any::<usize>(),
        prop::collection::vec(("[A-Za-z0-9_.-]{1,64}", meta_value(long_values)), 0..=6),
        body_len(),
        any::<u64>(),
        0u8..4,
        prop_oneof![Just(0u64), any::<u64>()],
    )
        .prop_map(|(type_ix, meta, body_len, body_seed, flags, correlation)| {
            // Unique keys, first occurrence wins.
            let mut seen = std::collections::HashSet::new();
            let meta = meta
                .into_iter()
                .filter(|(k, _)| seen.insert(k.clone()))
                .collect();
            ItemSpec::Msg(MsgSpec {
                type_ix,
                meta,
                body_len,
                body_seed,
                flags,
                correlation,
            })
        });
    let reason = prop_oneof![
        3 => "(?s).{0,40}",
        1 => "[aé€😀]{200,700}",
    ];
    prop_oneof![
        8 => msg,
        1 => Just(ItemSpec::Control(Control::Close)),
        1 => Just(ItemSpec::Control(Control::Stop)),
        1 => reason.prop_map(|r| ItemSpec::Control(Control::Error(r))),
    ]
}

/// A stream of frames: a pool of types (so runs of one type hit the decoder's type cache)
/// and the items.
fn stream(long_values: bool, max_items: usize) -> impl Strategy<Value = Vec<Expected>> {
    (
        prop::collection::vec(msg_type(), 1..4),
        prop::collection::vec(item(long_values), 0..max_items),
    )
        .prop_map(|(types, items)| {
            items
                .into_iter()
                .map(|it| match it {
                    ItemSpec::Control(c) => Expected::Control(c),
                    ItemSpec::Msg(m) => {
                        let body = Rng(m.body_seed).bytes(m.body_len);
                        let mut msg = Message::new(types[m.type_ix % types.len()].as_str())
                            .expect("valid type")
                            .with_body(body)
                            .with_header(Header {
                                flags: Flags::from_bits(m.flags).expect("defined flags"),
                                correlation: m.correlation,
                            });
                        for (k, v) in &m.meta {
                            msg.meta_mut().insert(k, v).expect("valid meta");
                        }
                        Expected::Message(msg)
                    }
                })
                .collect()
        })
}

#[derive(Clone, Debug)]
enum Expected {
    Message(Message),
    Control(Control),
}

impl Expected {
    fn frame(&self) -> Frame {
        match self {
            Expected::Message(m) => Frame::Message(m.clone()),
            Expected::Control(Control::Error(r)) => Frame::Control(Control::Error(cut_reason(r))),
            Expected::Control(c) => Frame::Control(c.clone()),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Encoding and decoding drivers
// ---------------------------------------------------------------------------------------

/// "Writes" `chunks` as a vectored writer would, `n` bytes at a time, advancing with
/// `wire::advance`.
fn write_out(mut chunks: Vec<Bytes>, rng: &mut Rng, pieces: Pieces, out: &mut Vec<u8>) {
    while !chunks.is_empty() {
        let total: usize = chunks.iter().map(Bytes::len).sum();
        let n = pieces.next(rng).min(total);
        let mut left = n;
        for c in &chunks {
            let k = left.min(c.len());
            out.extend_from_slice(&c[..k]);
            left -= k;
            if left == 0 {
                break;
            }
        }
        let before = out.len();
        wire::advance(&mut chunks, n);
        assert_eq!(out.len(), before);
        assert_eq!(chunks.iter().map(Bytes::len).sum::<usize>(), total - n);
    }
}

/// Encodes `items` with batches cut at random points and written out in random pieces.
fn encode(items: &[Expected], coalesce: usize, rng: &mut Rng, pieces: Pieces) -> Vec<u8> {
    let mut out = Vec::new();
    let mut batch = Batch::new(coalesce);
    let mut want_bytes = 0;
    let mut want_msgs = 0;
    for it in items {
        match it {
            Expected::Message(m) => {
                want_bytes += wire::head_len(m) + m.body().len();
                want_msgs += 1;
                batch.push_message(m.clone());
            }
            Expected::Control(c) => {
                let reason = match c {
                    Control::Error(r) => cut_reason(r).len(),
                    _ => 0,
                };
                want_bytes += FRAME_HEAD_LEN + reason;
                batch.push_control(c);
            }
        }
        assert_eq!(batch.bytes(), want_bytes);
        assert_eq!(batch.messages(), want_msgs);
        if rng.next().is_multiple_of(4) {
            let start = out.len();
            write_out(batch.take(), rng, pieces, &mut out);
            assert_eq!(out.len() - start, want_bytes);
            assert!(batch.is_empty());
            want_bytes = 0;
            want_msgs = 0;
        }
    }
    let start = out.len();
    write_out(batch.take(), rng, pieces, &mut out);
    assert_eq!(out.len() - start, want_bytes);
    out
}

/// Feeds `input` to `dec` as a transport would; returns the frames. Panics on an error.
fn decode_all(dec: &mut Decoder, input: &[u8], rng: &mut Rng, pieces: Pieces) -> Vec<Frame> {
    let mut src = BytesMut::new();
    let mut pos = 0;
    let mut frames = Vec::new();
    loop {
        while let Some(f) = dec.decode(&mut src).expect("valid stream decodes") {
            frames.push(f);
        }
        if pos == input.len() {
            break;
        }
        let n = pieces.next(rng).min(input.len() - pos);
        if let Some((ptr, cap, missing)) = dec
            .body_target()
            .map(|(b, missing)| (b.as_ptr(), b.capacity(), missing))
        {
            assert_eq!(dec.wanted(&src), 0);
            let (body, _) = dec.body_target().expect("still partial");
            assert!(missing > 0, "body_target with nothing missing");
            assert!(
                body.capacity() - body.len() >= missing,
                "body buffer lacks room for the missing bytes"
            );
            let n = n.min(missing);
            // Into the spare capacity, as a read(2) into it would: no reallocation.
            body.extend_from_slice(&input[pos..pos + n]);
            assert_eq!((body.as_ptr(), body.capacity()), (ptr, cap));
            pos += n;
        } else {
            let wanted = dec.wanted(&src);
            assert!(wanted > 0, "decode made no progress but wanted() is 0");
            src.extend_from_slice(&input[pos..pos + n]);
            pos += n;
            if n < wanted {
                assert_eq!(
                    dec.decode(&mut src),
                    Ok(None),
                    "progress with fewer bytes than wanted() ({n} < {wanted})"
                );
            }
        }
    }
    assert!(dec.is_at_boundary(&src), "stream did not end at a boundary");
    assert_eq!(dec.decode(&mut src), Ok(None));
    frames
}

fn compare(got: &[Frame], want: &[Expected]) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len(), "frame count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let w = w.frame();
        if let (Frame::Message(g), Frame::Message(w)) = (g, &w) {
            prop_assert_eq!(g.kind(), w.kind(), "type of frame {}", i);
            prop_assert_eq!(g.meta(), w.meta(), "meta of frame {}", i);
            prop_assert_eq!(g.header(), w.header(), "header of frame {}", i);
            prop_assert!(
                g.body().as_bytes() == w.body().as_bytes(),
                "body of frame {} differs ({} vs {} bytes)",
                i,
                g.body().len(),
                w.body().len()
            );
        }
        prop_assert_eq!(g, &w, "frame {}", i);
    }
    Ok(())
}

/// What happened when feeding arbitrary input.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// Ran out of input (possibly mid-frame).
    Exhausted,
    /// Failed, and kept failing the same way.
    Failed(FrameError),
}

/// Feeds `input` to `dec` in random pieces; checks that no decode call panics or
/// allocates more than `bound`, and that an error sticks.
fn feed_arbitrary(
    dec: &mut Decoder,
    input: &[u8],
    rng: &mut Rng,
    pieces: Pieces,
    bound: usize,
) -> Result<Outcome, TestCaseError> {
    let mut src = BytesMut::new();
    let mut pos = 0;
    loop {
        loop {
            let (r, usage) = measure(|| dec.decode(&mut src));
            prop_assert!(
                usage.largest <= bound && usage.peak_delta <= bound,
                "one decode call allocated {:?} (bound {})",
                usage,
                bound
            );
            match r {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => {
                    prop_assert!(dec.body_target().is_none());
                    // Sticky, with or without more input.
                    let mut more = BytesMut::from(&input[pos..]);
                    more.extend_from_slice(&head(2, 0, 0, 0, 0, 0));
                    prop_assert_eq!(dec.decode(&mut more), Err(e.clone()));
                    prop_assert_eq!(dec.decode(&mut BytesMut::new()), Err(e.clone()));
                    return Ok(Outcome::Failed(e));
                }
            }
        }
        if pos == input.len() {
            return Ok(Outcome::Exhausted);
        }
        let n = pieces.next(rng).min(input.len() - pos);
        if let Some((body, missing)) = dec.body_target() {
            prop_assert!(missing > 0 && body.capacity() - body.len() >= missing);
            let n = n.min(missing);
            body.extend_from_slice(&input[pos..pos + n]);
        } else {
            src.extend_from_slice(&input[pos..pos + n]);
        }
        pos += n;
    }
}

/// `default` cases, or `PROPTEST_CASES` when set (for a longer hunt).
fn cases(default: u32) -> ProptestConfig {
    let n = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    ProptestConfig::with_cases(n)
}

fn direct_threshold() -> impl Strategy<Value = usize> {
    prop_oneof![
        1 => Just(1usize),
        2 => 1usize..512,
        2 => 512usize..64 << 10,
        1 => Just(Decoder::DEFAULT_DIRECT_THRESHOLD),
    ]
}

// ---------------------------------------------------------------------------------------
// Round trips
// ---------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(cases(160))]

    #[test]
    fn frames_round_trip(
        items in stream(true, 14),
        coalesce in prop_oneof![Just(0usize), 0usize..2048, Just(usize::MAX)],
        threshold in direct_threshold(),
        exact_limits in any::<bool>(),
        write_pieces in pieces(),
        read_pieces in pieces(),
        seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        let bytes = encode(&items, coalesce, &mut rng, write_pieces);
        // Either limits with room to spare, or exactly the largest of what was sent: a
        // decoder accepts what is at its limits.
        let mut limits = Limits::default();
        limits.max_body = Limits::MAX_BODY_CEILING;
        limits.max_meta_bytes = u32::MAX;
        limits.max_meta_entries = u16::MAX;
        if exact_limits {
            let msgs = items.iter().filter_map(|i| match i {
                Expected::Message(m) => Some(m),
                Expected::Control(_) => None,
            });
            limits.max_body = 0;
            limits.max_meta_bytes = 0;
            limits.max_meta_entries = 0;
            for m in msgs {
                limits.max_body = limits.max_body.max(m.body().len() as u64);
                limits.max_meta_bytes = limits.max_meta_bytes.max(m.meta().encoded_len() as u32);
                limits.max_meta_entries = limits.max_meta_entries.max(m.meta().len() as u16);
            }
        }
        let mut dec = Decoder::new(limits).with_direct_threshold(threshold);
        let frames = decode_all(&mut dec, &bytes, &mut rng, read_pieces);
        compare(&frames, &items)?;
    }

    #[test]
    fn handshake_round_trips_and_truncations_ask_for_more(
        max_body in prop_oneof![0..=Limits::MAX_BODY_CEILING, Just(Limits::MAX_BODY_CEILING), Just(0)],
        max_meta_bytes in any::<u32>(),
        max_meta_entries in any::<u16>(),
        caps in any::<u32>(),
        heartbeat_ms in any::<u32>(),
        extra in prop::collection::vec(any::<u8>(), 0..=(1024 - HANDSHAKE_LEN)),
        trailing in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut limits = Limits::default();
        limits.max_body = max_body;
        limits.max_meta_bytes = max_meta_bytes;
        limits.max_meta_entries = max_meta_entries;
        let hs = Handshake {
            version: VERSION,
            capabilities: Capabilities(caps),
            limits,
            heartbeat_ms,
        };
        let mut v = Vec::new();
        hs.encode(&mut v);
        prop_assert_eq!(v.len(), HANDSHAKE_LEN);
        prop_assert_eq!(&v[..8], &MAGIC[..]);
        for cut in 0..v.len() {
            prop_assert_eq!(Handshake::decode(&v[..cut]), Ok(None), "cut at {}", cut);
        }
        prop_assert_eq!(Handshake::decode(&v), Ok(Some((hs, HANDSHAKE_LEN))));

        // A later version's longer handshake: the extra bytes are skipped, what follows is
        // left alone, and every truncation still asks for more.
        let len = HANDSHAKE_LEN + extra.len();
        v[10..12].copy_from_slice(&(len as u16).to_le_bytes());
        v.extend_from_slice(&extra);
        for cut in 0..len {
            prop_assert_eq!(Handshake::decode(&v[..cut]), Ok(None), "cut at {}", cut);
        }
        v.extend_from_slice(&trailing);
        prop_assert_eq!(Handshake::decode(&v), Ok(Some((hs, len))));
    }
}

#[test]
fn handshake_layout_matches_the_specification() {
    let mut l = Limits::default();
    l.max_body = 0x0102_0304_0506_0708;
    l.max_body &= Limits::MAX_BODY_CEILING - 1;
    l.max_meta_bytes = 0x1122_3344;
    l.max_meta_entries = 0x5566;
    let hs = Handshake {
        version: VERSION,
        capabilities: Capabilities(0xAABB_CCDD),
        limits: l,
        heartbeat_ms: 0x7788_99AA,
    };
    let mut v = Vec::new();
    hs.encode(&mut v);
    let mut want = Vec::new();
    want.extend_from_slice(b"HYPERFRM");
    want.extend_from_slice(&1u16.to_le_bytes());
    want.extend_from_slice(&40u16.to_le_bytes());
    want.extend_from_slice(&0xAABB_CCDDu32.to_le_bytes());
    want.extend_from_slice(&l.max_body.to_le_bytes());
    want.extend_from_slice(&0x1122_3344u32.to_le_bytes());
    want.extend_from_slice(&0x5566u16.to_le_bytes());
    want.extend_from_slice(&[0, 0]);
    want.extend_from_slice(&0x7788_99AAu32.to_le_bytes());
    want.extend_from_slice(&[0, 0, 0, 0]);
    assert_eq!(v, want);
}

#[test]
fn handshake_rejects_limits_above_the_ceiling() {
    let mut v = Vec::new();
    Handshake::new(Limits::default()).encode(&mut v);
    v[16..24].copy_from_slice(&(Limits::MAX_BODY_CEILING + 1).to_le_bytes());
    assert!(matches!(
        Handshake::decode(&v),
        Err(HandshakeError::BadLimit(_))
    ));
    v[16..24].copy_from_slice(&Limits::MAX_BODY_CEILING.to_le_bytes());
    assert!(matches!(Handshake::decode(&v), Ok(Some(_))));
}

#[test]
fn message_frame_layout_matches_the_specification() {
    let msg = Message::new("a.b")
        .unwrap()
        .with_meta("k", "vé")
        .unwrap()
        .with_body(&b"hello"[..])
        .with_header(Header {
            flags: Flags::REQUEST,
            correlation: 7,
        });
    let mut batch = Batch::default();
    batch.push_message(msg.clone());
    batch.push_control(&Control::Error("why".into()));
    let bytes: Vec<u8> = batch.take().concat();
    let meta = [1, 0, 1, b'k', 3, 0, b'v', 0xC3, 0xA9];
    let mut want = Vec::new();
    want.extend_from_slice(&head(1, 1, 3, meta.len() as u32, 5, 7));
    want.extend_from_slice(b"a.b");
    want.extend_from_slice(&meta);
    want.extend_from_slice(b"hello");
    want.extend_from_slice(&head(4, 0, 0, 0, 3, 0));
    want.extend_from_slice(b"why");
    assert_eq!(bytes, want);
    let mut dec = Decoder::new(Limits::default());
    let mut src = BytesMut::from(&want[..]);
    assert_eq!(dec.decode(&mut src), Ok(Some(Frame::Message(msg))));
    assert_eq!(
        dec.decode(&mut src),
        Ok(Some(Frame::Control(Control::Error("why".into()))))
    );
    assert!(dec.is_at_boundary(&src));
}

// ---------------------------------------------------------------------------------------
// Hostile input
// ---------------------------------------------------------------------------------------

/// Headers a hostile peer might send: every kind (and some unknown), any flags, any
/// lengths, with emphasis on lengths near and far beyond the limits.
fn hostile_head() -> impl Strategy<Value = [u8; 24]> {
    let max = alloc_limits().max_body;
    (
        prop_oneof![4 => 1u8..=4, 1 => any::<u8>()],
        prop_oneof![4 => 0u8..4, 1 => any::<u8>()],
        prop_oneof![4 => 0u8..8, 1 => any::<u8>()],
        prop_oneof![8 => Just(0u8), 1 => any::<u8>()],
        prop_oneof![3 => 0u32..64, 1 => 4090u32..4100, 1 => any::<u32>()],
        prop_oneof![
            3 => 0u64..2048,
            2 => (max - 2)..=(max + 2),
            1 => 0..=(2 * max),
            1 => any::<u64>(),
            1 => Just(u64::MAX),
            1 => Just(1u64 << 40),
        ],
        prop_oneof![Just(0u64), any::<u64>()],
    )
        .prop_map(|(kind, flags, type_len, reserved, meta, body, corr)| {
            let mut h = head(kind, flags, type_len, meta, body, corr);
            h[3] = reserved;
            h
        })
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn arbitrary_bytes_never_panic(
        input in prop::collection::vec(any::<u8>(), 0..2048),
        threshold in direct_threshold(),
        read_pieces in pieces(),
        seed in any::<u64>(),
    ) {
        let limits = alloc_limits();
        let mut dec = Decoder::new(limits).with_direct_threshold(threshold);
        feed_arbitrary(&mut dec, &input, &mut Rng(seed), read_pieces, alloc_bound(&limits))?;

        // Handshake::decode over the growing input: `None`s, then one answer that longer
        // input does not change.
        let mut settled: Option<Result<Option<(Handshake, usize)>, HandshakeError>> = None;
        for cut in 0..=input.len() {
            let r = Handshake::decode(&input[..cut]);
            if let Ok(Some((_, n))) = &r {
                prop_assert!(*n >= HANDSHAKE_LEN && *n <= cut);
            }
            match &settled {
                Some(s) => prop_assert_eq!(&r, s, "answer changed at {}", cut),
                None if r != Ok(None) => settled = Some(r),
                None => {}
            }
        }
    }

    #[test]
    fn arbitrary_bytes_after_a_valid_handshake_prefix_never_panic(
        prefix_len in 0usize..=HANDSHAKE_LEN,
        tail in prop::collection::vec(any::<u8>(), 0..256),
        version in prop_oneof![3 => Just(VERSION), 1 => any::<u16>()],
    ) {
        let mut v = Vec::new();
        Handshake::new(Limits::default()).encode(&mut v);
        v[8..10].copy_from_slice(&version.to_le_bytes());
        v.truncate(prefix_len);
        v.extend_from_slice(&tail);
        let mut settled = None;
        for cut in 0..=v.len() {
            let r = Handshake::decode(&v[..cut]);
            if cut < prefix_len.min(12) {
                prop_assert_eq!(&r, &Ok(None));
            }
            if version != VERSION && cut >= 12 && prefix_len >= 10 {
                prop_assert_eq!(
                    &r,
                    &Err(HandshakeError::UnsupportedVersion { theirs: version, ours: VERSION })
                );
            }
            match &settled {
                Some(s) => prop_assert_eq!(&r, s, "answer changed at {}", cut),
                None if r != Ok(None) => settled = Some(r),
                None => {}
            }
        }
    }

    #[test]
    fn arbitrary_bytes_after_a_valid_header_never_panic_nor_overallocate(
        header in hostile_head(),
        tail in prop::collection::vec(any::<u8>(), 0..4096),
        threshold in direct_threshold(),
        read_pieces in pieces(),
        seed in any::<u64>(),
        fill_body in any::<bool>(),
    ) {
        let limits = alloc_limits();
        let mut input = header.to_vec();
        input.extend_from_slice(&tail);
        // Sometimes deliver the whole announced body (when it is a sane size), so the large
        // body path runs to the end.
        let body_len = u64::from_le_bytes(header[8..16].try_into().unwrap());
        if fill_body && body_len <= limits.max_body {
            let mut rng = Rng(seed ^ 1);
            input.extend_from_slice(&rng.bytes(body_len as usize));
        }
        let mut dec = Decoder::new(limits).with_direct_threshold(threshold);
        let outcome =
            feed_arbitrary(&mut dec, &input, &mut Rng(seed), read_pieces, alloc_bound(&limits))?;
        let meta_len = u32::from_le_bytes(header[4..8].try_into().unwrap());
        if header[0] == 1 && header[3] == 0 && header[1] < 4 && header[2] > 0
            && meta_len <= limits.max_meta_bytes && body_len > limits.max_body
        {
            prop_assert_eq!(
                outcome,
                Outcome::Failed(FrameError::BodyTooLarge { len: body_len, max: limits.max_body })
            );
        }
    }

    #[test]
    fn mutated_frames_never_panic_nor_overallocate(
        items in stream(false, 6),
        coalesce in 0usize..1024,
        threshold in direct_threshold(),
        read_pieces in pieces(),
        at in any::<prop::sample::Index>(),
        xor in 1u8..=255,
        seed in any::<u64>(),
    ) {
        let limits = alloc_limits();
        let mut rng = Rng(seed);
        let mut bytes = encode(&items, coalesce, &mut rng, Pieces::Mixed(1 << 20));
        if !bytes.is_empty() {
            let i = at.index(bytes.len());
            bytes[i] ^= xor;
        }
        let mut dec = Decoder::new(limits).with_direct_threshold(threshold);
        feed_arbitrary(&mut dec, &bytes, &mut rng, read_pieces, alloc_bound(&limits))?;
    }
}

// ---------------------------------------------------------------------------------------
// Allocation, deterministic
// ---------------------------------------------------------------------------------------

#[test]
fn one_tib_body_is_refused_before_any_allocation_of_that_size() {
    let limits = alloc_limits();
    for threshold in [1, 4096, Decoder::DEFAULT_DIRECT_THRESHOLD] {
        let mut dec = Decoder::new(limits).with_direct_threshold(threshold);
        let mut src = BytesMut::from(&head(1, 0, 1, 0, 1 << 40, 0)[..]);
        src.extend_from_slice(b"a");
        assert_eq!(dec.wanted(&src), 0, "a transport must not reserve for it");
        let (r, usage) = measure(|| dec.decode(&mut src));
        assert_eq!(
            r,
            Err(FrameError::BodyTooLarge {
                len: 1 << 40,
                max: 1 << 20
            })
        );
        assert!(usage.largest < 64 << 10, "{usage:?}");
        assert!(usage.peak_delta < 64 << 10, "{usage:?}");
        // And it stays refused, still without allocating.
        let (r, usage) = measure(|| dec.decode(&mut src));
        assert!(matches!(r, Err(FrameError::BodyTooLarge { .. })));
        assert!(usage.largest < 64 << 10, "{usage:?}");
    }
}

/// The allocator does see what the decoder allocates: a body announced at exactly
/// `max_body` gets its buffer, of exactly that size, when the header arrives (so the property
/// tests above are not vacuous).
#[test]
fn counting_allocator_sees_a_direct_body_buffer() {
    let limits = alloc_limits();
    let mut dec = Decoder::new(limits);
    let mut src = BytesMut::from(&head(1, 0, 1, 0, limits.max_body, 0)[..]);
    src.extend_from_slice(b"a");
    let (r, usage) = measure(|| dec.decode(&mut src));
    assert_eq!(r, Ok(None));
    assert!(usage.largest >= limits.max_body as usize, "{usage:?}");
    assert!(usage.largest <= alloc_bound(&limits), "{usage:?}");
    let (_, missing) = dec.body_target().expect("direct body");
    assert_eq!(missing, limits.max_body as usize);
}

/// BUG: the large-body ("direct") path of `Decoder::decode` does not check the frame kind.
/// An `ERROR` frame whose reason is at least `direct_threshold` bytes long and is not yet
/// complete in the shared buffer is parsed as a message: its empty type fails with
/// `FrameError::Type(InvalidType::Empty)` (and were it not for that, it would come out as a
/// `Frame::Message`). The transports use the default threshold (256 KiB, far above the
/// 1024-byte reason limit), so only users of `with_direct_threshold(<= 1024)` hit it.
#[test]
fn error_frame_longer_than_the_direct_threshold_decodes_in_pieces() {
    let mut frame = head(4, 0, 0, 0, 10, 0).to_vec();
    frame.extend_from_slice(b"0123456789");
    let mut dec = Decoder::new(Limits::default()).with_direct_threshold(8);
    let mut src = BytesMut::from(&frame[..FRAME_HEAD_LEN + 4]);
    let mut got = dec.decode(&mut src);
    if got == Ok(None) {
        match dec.body_target() {
            Some((body, _)) => body.extend_from_slice(&frame[FRAME_HEAD_LEN + 4..]),
            None => src.extend_from_slice(&frame[FRAME_HEAD_LEN + 4..]),
        }
        got = dec.decode(&mut src);
    }
    assert_eq!(
        got,
        Ok(Some(Frame::Control(Control::Error("0123456789".into()))))
    );
    assert!(dec.is_at_boundary(&src));
}

/// BUG: `Decoder::new` takes any `Limits`, but `decode` relies on `max_body` being at most
/// `Limits::MAX_BODY_CEILING` ("cannot overflow" in `decode_inner`): with `max_body:
/// u64::MAX` (a caller's way of saying "no limit"), a header announcing a body near
/// `u64::MAX` overflows `prefix + body_len` at `src/wire/frame.rs` (a panic in debug builds;
/// in release the sum would wrap to a small `total` and the frame be sliced out of bounds,
/// a panic too, by reading of the code).
#[test]
fn decoder_with_a_limit_above_the_ceiling_does_not_panic() {
    let mut limits = Limits::default();
    limits.max_body = u64::MAX;
    let mut dec = Decoder::new(limits);
    let mut src = BytesMut::from(&head(1, 0, 1, 0, u64::MAX - 10, 0)[..]);
    src.extend_from_slice(b"a");
    let (r, usage) =
        measure(|| std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| dec.decode(&mut src))));
    let r = r.expect("decode panicked");
    assert!(r.is_err(), "{r:?}");
    assert!(usage.largest < 64 << 10, "{usage:?}");
}
