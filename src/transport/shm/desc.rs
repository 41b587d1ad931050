//! The descriptor of one message in the `shm://` ring, and the two pure functions around it:
//! where a message's parts go on send ([`plan`]) and what a received descriptor may point at
//! ([`check_words`]), plus the parsing of a received head ([`head`]). No I/O, no unsafe, no shared
//! memory here: the ring moves descriptors as sixteen words, `conn` owns the arena and the
//! sockets. Everything a peer wrote is checked by these functions before anything is read
//! through it, so they are property-tested against arbitrary words and bytes.
//!
//! # Layout
//!
//! A descriptor is 128 bytes, sixteen native-endian `u64` words (both ends run on one host);
//! the first is the ring's sequence number (see `ring`), the rest the message's:
//!
//! ```text
//! word 0       sequence number (i + 1 for message i): written last, publishes the slot
//! word 1       kind: u8 | flags: u8 | type_len: u8 | place: u8 | meta_len: u32   (low byte first)
//! word 2       correlation id
//! word 3       body length in bytes
//! word 4       body: arena offset of its block (BODY_IN_ARENA), the sequence number of an
//!              external body (BODY_EXTERNAL), or the slot of a device body (BODY_DEVICE)
//! word 5       head: arena offset of its block (HEAD_IN_ARENA)
//! words 6..16  80 inline bytes: the type, then the metadata (unless HEAD_IN_ARENA), then a
//!              small body (BODY_INLINE); inline byte i is byte i % 8 of word 6 + i / 8,
//!              counting from the least significant
//! ```
//!
//! The head is the type followed by the encoded metadata (`Meta`'s wire form). An arena block
//! is a 64-byte header (its reference count) followed by the payload; offsets are the block's.
//!
//! # Placement on send
//!
//! | part | where |
//! |---|---|
//! | head ≤ 80 bytes | inline |
//! | longer head | an arena block of its own |
//! | empty body | nowhere |
//! | head inline, head + body ≤ 80 bytes | inline, after the head |
//! | body allocated in this arena (`Sender::alloc`) | where it is: the receiver takes a reference |
//! | body larger than the arena | a sealed memfd of its own, passed on the rendezvous socket |
//! | body in device memory, the receiver maps it | a slot of the device table (see `device`) |
//! | any other body | copied into an arena block |

#![deny(unsafe_code)]

use bytes::Bytes;

use crate::message::TypeCache;
use crate::message::{Flags, Meta, MsgType};

use super::arena::{self, BLOCK_ALIGN};
pub(crate) use super::device::DEVICE_SLOTS;

/// Words in a descriptor.
pub(crate) const WORDS: usize = 16;

/// A descriptor, decoded from its words (which a peer may have written: see [`check`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Desc {
    /// [`Desc::MESSAGE`].
    pub(crate) kind: u8,
    /// Message flags (REQUEST, RESPONSE).
    pub(crate) flags: u8,
    /// Length of the type.
    pub(crate) type_len: u8,
    /// Where the head and the body are: the `HEAD_*` / `BODY_*` bits.
    pub(crate) place: u8,
    /// Length of the encoded metadata.
    pub(crate) meta_len: u32,
    /// Correlation id.
    pub(crate) correlation: u64,
    /// Body length.
    pub(crate) body_len: u64,
    /// Arena offset of the body's block, or the sequence number of an external body.
    pub(crate) body_at: u64,
    /// Arena offset of the head's block.
    pub(crate) head_at: u64,
    /// Type, metadata and a small body, when they fit.
    pub(crate) inline: [u8; Desc::INLINE],
}

impl Desc {
    pub(crate) const MESSAGE: u8 = 1;
    pub(crate) const INLINE: usize = 80;
    /// The head is in the arena block at `head_at` (else inline).
    pub(crate) const HEAD_IN_ARENA: u8 = 0b0001;
    /// The body is in the arena block at `body_at`.
    pub(crate) const BODY_IN_ARENA: u8 = 0b0010;
    /// The body is an external memfd, number `body_at` in the order passed on the socket.
    pub(crate) const BODY_EXTERNAL: u8 = 0b0100;
    /// The body follows the head in `inline`.
    pub(crate) const BODY_INLINE: u8 = 0b1000;
    /// The body is device memory lent in slot `body_at` of the device table.
    pub(crate) const BODY_DEVICE: u8 = 0b1_0000;
    const BODY_BITS: u8 =
        Desc::BODY_IN_ARENA | Desc::BODY_EXTERNAL | Desc::BODY_INLINE | Desc::BODY_DEVICE;
    const ALL_BITS: u8 = Desc::HEAD_IN_ARENA | Desc::BODY_BITS;

    pub(crate) const fn zeroed() -> Desc {
        Desc {
            kind: 0,
            flags: 0,
            type_len: 0,
            place: 0,
            meta_len: 0,
            correlation: 0,
            body_len: 0,
            body_at: 0,
            head_at: 0,
            inline: [0; Desc::INLINE],
        }
    }

    /// The descriptor's words (word 0, the ring's sequence number, left zero).
    pub(crate) fn encode(&self) -> [u64; WORDS] {
        let mut b = Builder::new(
            self.kind,
            self.flags,
            self.type_len,
            self.meta_len,
            self.correlation,
            self.body_len,
        );
        b.place(self.place);
        b.body_at(self.body_at);
        b.head_at(self.head_at);
        b.inline(&self.inline);
        *b.words()
    }

    /// A descriptor from its words (word 0 ignored).
    pub(crate) fn decode(w: &[u64; WORDS]) -> Desc {
        Desc {
            kind: w[1] as u8,
            flags: (w[1] >> 8) as u8,
            type_len: (w[1] >> 16) as u8,
            place: (w[1] >> 24) as u8,
            meta_len: (w[1] >> 32) as u32,
            correlation: w[2],
            body_len: w[3],
            body_at: w[4],
            head_at: w[5],
            inline: inline_bytes(w),
        }
    }
}

/// Builds a descriptor's words the way the sender does: fields by shifts, inline bytes into a
/// buffer turned into words at the end (no [`Desc`] with its byte fields in between).
pub(crate) struct Builder {
    w: [u64; WORDS],
    inline: [u8; Desc::INLINE],
    /// Next inline byte.
    at: usize,
}

impl Builder {
    pub(crate) fn new(
        kind: u8,
        flags: u8,
        type_len: u8,
        meta_len: u32,
        correlation: u64,
        body_len: u64,
    ) -> Builder {
        let mut w = [0u64; WORDS];
        w[1] = u64::from(kind)
            | u64::from(flags) << 8
            | u64::from(type_len) << 16
            | u64::from(meta_len) << 32;
        w[2] = correlation;
        w[3] = body_len;
        Builder {
            w,
            inline: [0; Desc::INLINE],
            at: 0,
        }
    }

    /// Adds placement bits.
    pub(crate) fn place(&mut self, bits: u8) {
        self.w[1] |= u64::from(bits) << 24;
    }

    pub(crate) fn body_at(&mut self, at: u64) {
        self.w[4] = at;
    }

    pub(crate) fn head_at(&mut self, at: u64) {
        self.w[5] = at;
    }

    /// Appends `src` to the inline bytes. The caller keeps the total within
    /// [`Desc::INLINE`] (what `plan` decided); more is cut off, never written elsewhere.
    pub(crate) fn inline(&mut self, src: &[u8]) {
        let end = (self.at + src.len()).min(Desc::INLINE);
        let n = end - self.at;
        self.inline[self.at..end].copy_from_slice(&src[..n]);
        self.at = end;
    }

    /// The descriptor's words (word 0, the ring's, zero).
    pub(crate) fn words(&mut self) -> &[u64; WORDS] {
        for (word, bytes) in self.w[6..].iter_mut().zip(self.inline.chunks_exact(8)) {
            *word = u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
        }
        &self.w
    }
}

const _: () = assert!(Desc::INLINE == (WORDS - 6) * 8);

// ------------------------------------------------------------------------------ send side

/// Where the head goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeadPlace {
    Inline,
    Block,
}

/// Where the body goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BodyPlace {
    Empty,
    /// After the head, in the descriptor.
    Inline,
    /// Already in this direction's arena (allocated in place): referenced, not copied.
    InPlace,
    /// Copied into an arena block.
    Copy,
    /// Larger than the arena: a memfd of its own.
    External,
}

/// Where a message's parts go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) head: HeadPlace,
    pub(crate) body: BodyPlace,
}

/// The placement of a message with a head (type + metadata) of `head_len` bytes and a body of
/// `body_len` bytes, `in_place` when the body was allocated in this arena, in an arena of
/// `arena_len` bytes.
pub(crate) fn plan(head_len: usize, body_len: u64, in_place: bool, arena_len: u64) -> Plan {
    let head = if head_len <= Desc::INLINE {
        HeadPlace::Inline
    } else {
        HeadPlace::Block
    };
    let body = if body_len == 0 {
        BodyPlace::Empty
    } else if head == HeadPlace::Inline && head_len as u64 + body_len <= Desc::INLINE as u64 {
        BodyPlace::Inline
    } else if in_place {
        BodyPlace::InPlace
    } else if arena::block_len(body_len) > arena_len {
        BodyPlace::External
    } else {
        BodyPlace::Copy
    };
    Plan { head, body }
}

// --------------------------------------------------------------------------- receive side

/// What a descriptor was found to break.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Invalid(pub(crate) String);

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn invalid(what: impl Into<String>) -> Invalid {
    Invalid(what.into())
}

/// The receiver's limits a descriptor is checked against.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bounds {
    pub(crate) max_meta_bytes: u32,
    pub(crate) max_body: u64,
    /// Size of the arena the offsets point into.
    pub(crate) arena_len: u64,
}

/// Where one part of a received message is, bounds-checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    Empty,
    /// `len` bytes from `at` in the descriptor's inline bytes (`at + len <= INLINE`).
    Inline {
        at: usize,
        len: usize,
    },
    /// The payload of the arena block at `block`: `len` bytes from `block + BLOCK_ALIGN`, all
    /// inside the arena, `block` aligned to [`BLOCK_ALIGN`].
    Block {
        block: u64,
        len: u64,
    },
    /// External body number `seq`, of `len` bytes.
    External {
        seq: u64,
        len: u64,
    },
    /// Device memory lent in slot `slot` (below [`DEVICE_SLOTS`]) of the device table.
    Device {
        slot: usize,
        len: u64,
    },
}

/// A received descriptor, checked: every offset and length lies within what it points into
/// and within the receiver's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) flags: Flags,
    pub(crate) correlation: u64,
    pub(crate) type_len: usize,
    /// Type + metadata: `Inline` or `Block`.
    pub(crate) head: Part,
    pub(crate) body: Part,
}

fn block(arena_len: u64, offset: u64, len: u64, what: &str) -> Result<Part, Invalid> {
    arena::validate(arena_len, offset, len)
        .map(|_| Part::Block { block: offset, len })
        .ok_or_else(|| {
            invalid(format!(
                "{what} block at {offset} ({len} bytes) is not an aligned block inside the \
                 {arena_len}-byte arena"
            ))
        })
}

/// Checks a descriptor a peer wrote, as its words were loaded from the slot. Nothing is read
/// through it before this returns `Ok`. (No [`Desc`] is built on the receive path: its byte
/// fields, stored one by one and then moved as a whole, cost store-forwarding stalls.)
pub(crate) fn check_words(w: &[u64; WORDS], b: &Bounds) -> Result<Layout, Invalid> {
    let kind = w[1] as u8;
    let flags = (w[1] >> 8) as u8;
    let type_len = usize::from((w[1] >> 16) as u8);
    let place = (w[1] >> 24) as u8;
    let meta_len = (w[1] >> 32) as u32;
    let (correlation, body_len, body_at, head_at) = (w[2], w[3], w[4], w[5]);
    if kind != Desc::MESSAGE {
        return Err(invalid(format!("descriptor kind {kind}")));
    }
    let flags = Flags::from_bits(flags).ok_or_else(|| invalid("reserved flag bits"))?;
    if place & !Desc::ALL_BITS != 0 {
        return Err(invalid(format!("unknown placement bits {place:#x}")));
    }
    if type_len == 0 || meta_len > b.max_meta_bytes {
        return Err(invalid(format!(
            "type of {type_len} bytes, metadata of {meta_len} bytes (max {})",
            b.max_meta_bytes
        )));
    }
    if body_len > b.max_body {
        return Err(invalid(format!(
            "body of {body_len} bytes exceeds max_body of {}",
            b.max_body
        )));
    }
    let head_len = type_len + meta_len as usize;
    let head = if place & Desc::HEAD_IN_ARENA != 0 {
        block(b.arena_len, head_at, head_len as u64, "head")?
    } else if head_len <= Desc::INLINE {
        Part::Inline {
            at: 0,
            len: head_len,
        }
    } else {
        return Err(invalid("inline head longer than the descriptor"));
    };
    let body = match (place & Desc::BODY_BITS, body_len) {
        (0, 0) => Part::Empty,
        (0, _) => return Err(invalid("a body with no placement")),
        (_, 0) => return Err(invalid("a placement for an empty body")),
        (Desc::BODY_INLINE, len) => match head {
            Part::Inline { len: h, .. } if h as u64 + len <= Desc::INLINE as u64 => Part::Inline {
                at: h,
                len: len as usize,
            },
            _ => return Err(invalid("inline body does not fit the descriptor")),
        },
        (Desc::BODY_IN_ARENA, len) => block(b.arena_len, body_at, len, "body")?,
        (Desc::BODY_EXTERNAL, len) => Part::External { seq: body_at, len },
        (Desc::BODY_DEVICE, len) => match usize::try_from(body_at) {
            Ok(slot) if slot < DEVICE_SLOTS => Part::Device { slot, len },
            _ => return Err(invalid(format!("device body in slot {body_at}"))),
        },
        _ => return Err(invalid("inconsistent body placement")),
    };
    Ok(Layout {
        flags,
        correlation,
        type_len,
        head,
        body,
    })
}

/// The inline bytes of a descriptor's words.
pub(crate) fn inline_bytes(w: &[u64; WORDS]) -> [u8; Desc::INLINE] {
    let mut out = [0u8; Desc::INLINE];
    for (bytes, word) in out.chunks_exact_mut(8).zip(&w[6..]) {
        bytes.copy_from_slice(&word.to_le_bytes());
    }
    out
}

/// Parses a received head (type then encoded metadata, `type_len` bytes of type), validating
/// both: the type (from `types`, to be cloned where it goes) and the metadata, copied out with
/// `copy`.
pub(crate) fn head<'t>(
    bytes: &[u8],
    type_len: usize,
    types: &'t mut TypeCache,
    max_meta_entries: u16,
    copy: impl FnOnce(&[u8]) -> Bytes,
) -> Result<(&'t MsgType, Meta), Invalid> {
    let (kind, meta) = bytes
        .split_at_checked(type_len)
        .ok_or_else(|| invalid("head shorter than its type"))?;
    let kind = match types.lookup(kind) {
        Ok(k) => k,
        Err(e) => return Err(invalid(format!("type: {e:#}"))),
    };
    if meta.is_empty() {
        return Ok((kind, Meta::new()));
    }
    // Checked after the copy: the peer can still write the shared bytes, not our copy.
    let meta = Meta::from_wire(copy(meta), usize::from(max_meta_entries))
        .map_err(|e| invalid(format!("metadata: {e:#}")))?;
    Ok((kind, meta))
}

/// The payload offset of a block.
pub(crate) fn payload(block: u64) -> u64 {
    block + BLOCK_ALIGN
}

#[cfg(all(test, not(hyperframes_loom)))]
mod tests {
    use super::*;
    use crate::transport::shm::arena::block_len as block_bytes;
    use proptest::prelude::*;

    const BOUNDS: Bounds = Bounds {
        max_meta_bytes: 4096,
        max_body: 1 << 30,
        arena_len: 1 << 20,
    };

    fn arb_desc() -> impl Strategy<Value = Desc> {
        (
            prop::array::uniform16(any::<u64>()),
            // Bias some fields towards plausible values so that deep branches are reached.
            (0u8..3, 0u8..5, 0u8..20, 0u8..32, 0u32..300),
            prop_oneof![any::<u64>(), 0u64..4096, Just(0u64)],
            prop_oneof![any::<u64>(), (0u64..(1 << 14)).prop_map(|x| x * 64)],
            prop_oneof![any::<u64>(), (0u64..(1 << 14)).prop_map(|x| x * 64)],
        )
            .prop_map(
                |(w, (kind, flags, type_len, place, meta_len), body_len, body_at, head_at)| {
                    let mut d = Desc::decode(&w);
                    d.kind = kind;
                    d.flags = flags;
                    d.type_len = type_len;
                    d.place = place;
                    d.meta_len = meta_len;
                    d.body_len = body_len;
                    d.body_at = body_at;
                    d.head_at = head_at;
                    d
                },
            )
    }

    fn within(p: Part, b: &Bounds) -> bool {
        match p {
            Part::Empty | Part::External { .. } => true,
            Part::Device { slot, .. } => slot < DEVICE_SLOTS,
            Part::Inline { at, len } => at + len <= Desc::INLINE,
            Part::Block { block, len } => {
                block.is_multiple_of(BLOCK_ALIGN)
                    && block
                        .checked_add(BLOCK_ALIGN + len)
                        .is_some_and(|end| end <= b.arena_len)
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn words_round_trip(w in prop::array::uniform16(any::<u64>())) {
            let back = Desc::decode(&w).encode();
            prop_assert_eq!(&back[1..], &w[1..]);
            prop_assert_eq!(back[0], 0);
        }

        /// The builder packs any split of the inline bytes as `Desc` lays them out.
        #[test]
        fn builder_packs_inline_bytes(
            bytes in prop::collection::vec(any::<u8>(), 0..=Desc::INLINE),
            cuts in prop::collection::vec(0usize..=Desc::INLINE, 0..4),
        ) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
            cuts.sort_unstable();
            let mut b = Builder::new(1, 0, 1, 0, 0, 0);
            let mut from = 0;
            for c in cuts.into_iter().chain([bytes.len()]) {
                b.inline(&bytes[from..c]);
                from = c;
            }
            let got = inline_bytes(b.words());
            prop_assert_eq!(&got[..bytes.len()], &bytes[..]);
            prop_assert!(got[bytes.len()..].iter().all(|&x| x == 0));
        }

        /// Whatever the peer wrote, `check` returns, and what it accepts lies in bounds and
        /// within the limits.
        #[test]
        fn check_accepts_only_what_is_in_bounds(d in arb_desc(), arena_kib in 4u64..2048) {
            let b = Bounds { arena_len: arena_kib * 1024, ..BOUNDS };
            if let Ok(l) = check_words(&d.encode(), &b) {
                prop_assert!(within(l.head, &b));
                prop_assert!(within(l.body, &b));
                let head_ok = matches!(l.head, Part::Inline { at: 0, .. } | Part::Block { .. });
                prop_assert!(head_ok, "head {:?}", l.head);
                prop_assert!(l.type_len >= 1);
                prop_assert!(d.meta_len <= b.max_meta_bytes && d.body_len <= b.max_body);
                let head_len = match l.head {
                    Part::Inline { len, .. } => len as u64,
                    Part::Block { len, .. } => len,
                    _ => unreachable!(),
                };
                prop_assert_eq!(head_len, l.type_len as u64 + u64::from(d.meta_len));
                let body_len = match l.body {
                    Part::Empty => 0,
                    Part::Inline { len, .. } => len as u64,
                    Part::Block { len, .. } | Part::External { len, .. } | Part::Device { len, .. } => len,
                };
                prop_assert_eq!(body_len, d.body_len);
                if let Part::Inline { at, .. } = l.body {
                    prop_assert_eq!(at as u64, head_len, "an inline body follows the head");
                }
            }
        }

        /// Whatever the head bytes, parsing returns; what it accepts re-encodes to them.
        #[test]
        fn head_parses_arbitrary_bytes(
            bytes in prop::collection::vec(any::<u8>(), 0..200),
            type_len in 0usize..40,
        ) {
            let mut types = TypeCache::default();
            if let Ok((kind, meta)) = head(&bytes, type_len, &mut types, 32, Bytes::copy_from_slice) {
                prop_assert_eq!(kind.as_bytes(), &bytes[..type_len]);
                prop_assert_eq!(meta.as_wire(), &bytes[type_len..]);
            }
        }

        /// What the sender plans and writes, the receiver accepts as the same layout.
        #[test]
        fn plan_then_check_agree(
            type_len in 1usize..=255,
            meta_len in 0u32..4096,
            body_len in prop_oneof![0u64..200, 0u64..(3 << 20)],
            in_place in any::<bool>(),
            arena_kib in 4u64..2048,
            at in 0u64..(1 << 14),
        ) {
            let arena_len = arena_kib * 1024;
            let b = Bounds { arena_len, ..BOUNDS };
            let head_len = type_len + meta_len as usize;
            // An in-place body is in the arena, so it fits there.
            let in_place = in_place && block_bytes(body_len) <= arena_len;
            let p = plan(head_len, body_len, in_place, arena_len);
            let mut d = Desc {
                kind: Desc::MESSAGE,
                type_len: type_len as u8,
                meta_len,
                body_len,
                ..Desc::zeroed()
            };
            // Blocks at an aligned offset where they fit, as the allocator would place them.
            let fit = |len: u64| {
                let span = block_bytes(len);
                (span <= arena_len).then(|| (at * 64) % (arena_len - span + 64) / 64 * 64)
            };
            if p.head == HeadPlace::Block {
                let Some(off) = fit(head_len as u64) else { return Ok(()) };
                d.place |= Desc::HEAD_IN_ARENA;
                d.head_at = off;
            }
            match p.body {
                BodyPlace::Empty => {}
                BodyPlace::Inline => d.place |= Desc::BODY_INLINE,
                BodyPlace::InPlace | BodyPlace::Copy => {
                    d.place |= Desc::BODY_IN_ARENA;
                    d.body_at = fit(body_len).expect("planned into the arena");
                }
                BodyPlace::External => {
                    prop_assert!(block_bytes(body_len) > arena_len);
                    d.place |= Desc::BODY_EXTERNAL;
                    d.body_at = 7;
                }
            }
            let l = check_words(&d.encode(), &b).expect("accepted");
            let head_block = matches!(l.head, Part::Block { .. });
            prop_assert_eq!(head_block, p.head == HeadPlace::Block);
            let expect_body = match p.body {
                BodyPlace::Empty => Part::Empty,
                BodyPlace::Inline => Part::Inline { at: head_len, len: body_len as usize },
                BodyPlace::InPlace | BodyPlace::Copy => Part::Block { block: d.body_at, len: body_len },
                BodyPlace::External => Part::External { seq: 7, len: body_len },
            };
            prop_assert_eq!(l.body, expect_body);
        }
    }

    #[test]
    fn rejections_name_the_problem() {
        let ok = Desc {
            kind: Desc::MESSAGE,
            type_len: 3,
            ..Desc::zeroed()
        };
        assert!(check_words(&ok.encode(), &BOUNDS).is_ok());
        let cases = [
            (Desc { kind: 9, ..ok }, "kind"),
            (Desc { flags: 0x80, ..ok }, "flag"),
            (Desc { place: 0x40, ..ok }, "placement bits"),
            (Desc { type_len: 0, ..ok }, "type of 0"),
            (
                Desc {
                    meta_len: 5000,
                    ..ok
                },
                "metadata of 5000",
            ),
            (
                Desc {
                    body_len: 2 << 30,
                    ..ok
                },
                "max_body",
            ),
            (Desc { body_len: 5, ..ok }, "no placement"),
            (
                Desc {
                    place: Desc::BODY_IN_ARENA,
                    ..ok
                },
                "empty body",
            ),
            (
                Desc {
                    place: Desc::BODY_IN_ARENA,
                    body_len: 10,
                    body_at: 1 << 20,
                    ..ok
                },
                "inside the",
            ),
            (
                Desc {
                    place: Desc::BODY_IN_ARENA,
                    body_len: 10,
                    body_at: 32,
                    ..ok
                },
                "aligned",
            ),
            (
                Desc {
                    place: Desc::BODY_INLINE,
                    body_len: 78,
                    ..ok
                },
                "does not fit",
            ),
            (
                Desc {
                    place: Desc::BODY_INLINE | Desc::BODY_EXTERNAL,
                    body_len: 8,
                    ..ok
                },
                "inconsistent",
            ),
            (Desc { meta_len: 86, ..ok }, "inline head longer"),
        ];
        for (d, want) in cases {
            let e = check_words(&d.encode(), &BOUNDS).unwrap_err();
            assert!(e.0.contains(want), "{d:?}: {e:#} (want {want:?})");
        }
    }
}
