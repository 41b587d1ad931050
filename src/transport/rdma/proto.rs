//! The RDMA protocol, sans-IO: control messages, credits, rendezvous bookkeeping.
//!
//! [`Connection`] is a deterministic state machine in the manner of quinn-proto: it performs
//! no I/O, knows no runtime and no verbs backend. The driver feeds it what happened
//! (`handle_*`) and asks it what to do (`poll_*`); the simulation tests drive it the same
//! way. Memory (registered buffers) stays with the driver: the core names remote regions
//! and rendezvous ids, never pointers it would dereference.
//!
//! # Connection
//!
//! Each side posts [`Params::recv_slots`] receive buffers of [`Params::slot_size`] bytes,
//! then sends `HELLO` as its first message. Nothing else is sent before the peer's `HELLO`
//! arrived (it says how many buffers the peer posted, and how large). A `HELLO` with another
//! magic or version ends the connection with an error naming both versions.
//!
//! # Control messages
//!
//! Every message is one send into one posted receive buffer. Little endian. Common header:
//!
//! ```text
//! offset size field
//!      0    1 kind          1 HELLO, 2 EAGER, 3 RTS, 4 FIN, 5 CREDIT, 6 CLOSE, 7 STOP
//!      1    1 flags         EAGER/RTS: message flags (bit 0 REQUEST, bit 1 RESPONSE); else 0
//!      2    1 type_len      EAGER/RTS: 1..=255; else 0
//!      3    1 reserved      0
//!      4    4 meta_len      EAGER/RTS: <= receiver's max_meta_bytes; else 0
//!      8    8 seq           this message's number in its direction (HELLO is 0)
//!     16    8 acked         how many of the peer's messages this side has released (see
//!                           Credits); every receive buffer is posted again before it counts
//! ```
//!
//! then, by kind:
//!
//! ```text
//! HELLO   24  8 magic "HFRDMA\0\0"   32 2 version (1)   34 2 reserved
//!         36  4 recv_slots           40 4 slot_size      44 4 max_meta_bytes
//!         48  8 max_body             56 2 max_meta_entries  58 2 reserved  60 4 keepalive rkey
//!         64  8 keepalive addr       72 4 beat_ms        76 4 reserved
//!         (80 bytes; a reader ignores bytes past those it knows, and takes beat_ms as 0 from a
//!         72-byte HELLO)
//! EAGER   24  8 correlation          32 8 body_len, then type, meta, body (all in this message)
//! RTS     24  8 correlation          32 8 body_len      40 8 rendezvous id
//!         48  8 body addr            56 4 body rkey     60 1 body memory (0 host, 1 device)
//!         61  3 reserved, then type, meta
//! FIN     24  8 rendezvous id
//! CREDIT, CLOSE, STOP: the header alone.
//! ```
//!
//! * `EAGER` carries a whole message; used when header, type, meta and body fit a slot.
//! * `RTS` (ready to send) announces a body the receiver fetches with an RDMA read of
//!   `body_len` bytes at `addr`/`rkey`: the receiver learns type, meta, length and memory
//!   first, checks them against its limits, chooses where the body lands (a buffer of its
//!   pool, or, for a body in the sender's device memory, device memory of its own where it
//!   lands bodies on a device: GPUDirect RDMA both ways),
//!   reads, then answers `FIN` with the id, on which the sender deregisters the body (its
//!   `rkey` covers that body alone and dies with the `FIN`). Ids are unique among the
//!   sender's outstanding rendezvous.
//! * `CREDIT` only carries `acked`.
//! * `CLOSE`: the sender's last message; the receiver's stream ends after what came before.
//! * `STOP`: the sender's receiving half is gone; the peer's sending half fails with
//!   `Closed`. Rendezvous announced after it are answered with `FIN` without a read.
//!
//! Messages may be *processed* out of order by the driver (completions of different
//! operations are reported in any order); the receiver orders them by `seq` again, and
//! acknowledges (`acked`) only what it processed in order, which bounds how far ahead a
//! sender can be (`seq < next expected + recv_slots`, checked) and so the copies it keeps.
//!
//! # Credits
//!
//! A side may have at most `recv_slots` (the peer's) of its messages unacknowledged:
//! `credits = peer_slots - (sent - peer_acked)`. Every message carries `acked`, the number of
//! the peer's messages released: a control message (`HELLO`, `CREDIT`, `FIN`, `CLOSE`,
//! `STOP`) when processed, a message (`EAGER`, `RTS`) when handed to the application's
//! queue (so a receiver that is not read stops acknowledging, which stops its peer: the
//! backpressure, and the bound on what waits). The receive buffer itself is posted again
//! at once in every case. Spending rules:
//!
//! * `EAGER`, `RTS` and `CLOSE` need `2 + reserve` credits (`reserve` = the peer's slots / 8,
//!   at least 1);
//! * `FIN` and `STOP` need 2, and go before queued messages: they use the reserve, so a
//!   side whose messages are not read can still free the peer's rendezvous buffers;
//! * `CREDIT` needs 1, the last: it is sent, when nothing else carries `acked`, once half of
//!   this side's receive buffers' worth of released messages is unreported, or once a
//!   `FIN`/`CLOSE`/`STOP` is unreported while half of them hold messages not yet released.
//!   `recv_slots` is at least 4, so a lone `CREDIT` never makes another due (credits are not
//!   bounced back and forth).
//!
//! Hence a sender never overruns the receiver's posted buffers (no RNR), and two sides that
//! both run low cannot deadlock: each one's last message reports what it released.
//!
//! The receiver enforces this rather than trusting it: message `seq` is a protocol error
//! (`NoCredit`) unless `seq < acked + recv_slots`, with the `acked` it last transmitted. So
//! a peer that ignores credits cannot make it hold more than `recv_slots` messages, nor,
//! after `STOP`, queue more `FIN`s than that. The size of what a side sends is the smaller
//! of the two sides' `slot_size`: a peer announcing 16 MiB buffers does not make us pin
//! 16 MiB send buffers (metadata that would not fit an `RTS` of that size is refused at
//! `send`, as beyond the peer's limits).

//! # Limits
//!
//! Lengths are checked against this side's [`Limits`] before anything is allocated for them;
//! a rendezvous body larger than `max_body` is a protocol error, never an allocation.
//! Nothing a peer sends makes this module panic (the decoder is property-tested).

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashSet, VecDeque};

use bytes::Bytes;

use super::verbs::RemoteRegion;
use crate::message::Limits;
use crate::message::{Body, Flags, Header, Message, Meta, MsgType};

/// `HELLO` magic.
pub const MAGIC: [u8; 8] = *b"HFRDMA\0\0";
/// Protocol version.
pub const VERSION: u16 = 1;
/// Length of the common header.
pub const HEADER_LEN: usize = 24;
/// Length of a `HELLO`.
pub const HELLO_LEN: usize = 80;
/// Length of the fixed part of an `EAGER`.
pub const EAGER_FIXED: usize = 40;
/// Length of the fixed part of an `RTS`.
pub const RTS_FIXED: usize = 64;
/// The smallest slot: an `RTS` with a 255-byte type and some metadata.
pub const MIN_SLOT: u32 = 1024;
/// The fewest receive buffers a side may post: a `CREDIT` is due once half of them are
/// unreported, and that half must be at least 2, or each `CREDIT` would answer the last.
pub const MIN_SLOTS: u32 = 4;

/// Message kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Set-up.
    Hello = 1,
    /// A whole message.
    Eager = 2,
    /// A rendezvous announcement.
    Rts = 3,
    /// A rendezvous completed.
    Fin = 4,
    /// Credits only.
    Credit = 5,
    /// End of this direction.
    Close = 6,
    /// The receiving half is gone.
    Stop = 7,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Hello,
            2 => Kind::Eager,
            3 => Kind::Rts,
            4 => Kind::Fin,
            5 => Kind::Credit,
            6 => Kind::Close,
            7 => Kind::Stop,
            _ => return None,
        })
    }
}

/// What one side offers, sent in `HELLO`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Receive buffers posted.
    pub recv_slots: u32,
    /// Bytes per receive buffer (the largest message).
    pub slot_size: u32,
    /// What this side accepts.
    pub limits: Limits,
    /// An 8-byte region the peer may read to check that this side is alive: a counter this
    /// side's driver advances every `beat_ms` while it runs (its heartbeat).
    pub keepalive: RemoteRegion,
    /// How often the counter advances, in milliseconds; 0: it does not (the peer may probe
    /// the region, but must not read a still counter as a frozen side).
    pub beat_ms: u32,
}

/// A protocol violation by the peer, or a limit it broke.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// A message too short for its kind, or with inconsistent lengths.
    #[error("malformed {0} message")]
    Malformed(&'static str),
    /// An unknown kind byte.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// `HELLO` with another magic.
    #[error("the peer is not a hyperframes RDMA endpoint (bad HELLO magic)")]
    BadMagic,
    /// `HELLO` with another version.
    #[error("the peer speaks RDMA protocol version {theirs}; this side speaks {ours}")]
    Version {
        /// Theirs.
        theirs: u16,
        /// Ours.
        ours: u16,
    },
    /// Parameters that cannot work (no slots, slots too small).
    #[error("unusable parameters in HELLO: {0}")]
    BadParams(String),
    /// A message before `HELLO`, or a second `HELLO`.
    #[error("{0} out of sequence")]
    OutOfSequence(&'static str),
    /// A sequence number outside the window the credits allow.
    #[error("message number {seq} outside the window (expected {expected}, {slots} slots)")]
    BadSeq {
        /// Received.
        seq: u64,
        /// Next in order.
        expected: u64,
        /// Our slots.
        slots: u32,
    },
    /// The peer acknowledged messages we never sent.
    #[error("the peer acknowledged {acked} messages; {sent} were sent")]
    BadAck {
        /// Its count.
        acked: u64,
        /// Ours.
        sent: u64,
    },
    /// A body or metadata beyond our limits.
    #[error("{what} of {len} bytes exceeds the limit of {max}")]
    Limit {
        /// Which.
        what: &'static str,
        /// Announced.
        len: u64,
        /// Ours.
        max: u64,
    },
    /// A type or metadata that does not validate.
    #[error("invalid {0}")]
    Invalid(String),
    /// `FIN` for a rendezvous we have not announced, or `RTS` reusing an open id.
    #[error("rendezvous id {0} is not outstanding")]
    UnknownRendezvous(u64),
    /// A message the peer had no credit for: it sent past the receive buffers we told it
    /// were free.
    #[error(
        "message number {seq} sent without credit: {acked} released and {slots} receive \
         buffers allow up to {limit}",
        limit = acked + u64::from(*slots)
    )]
    NoCredit {
        /// Received.
        seq: u64,
        /// The `acked` we last sent it.
        acked: u64,
        /// Our slots.
        slots: u32,
    },
    /// A message after `CLOSE`.
    #[error("a message after CLOSE")]
    AfterClose,
}

impl ProtoError {
    /// True for a peer exceeding our limits (rather than breaking the format).
    pub fn is_limit(&self) -> bool {
        matches!(self, ProtoError::Limit { .. })
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or([0; 4]))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]))
}

/// A decoded control message, borrowing the receive buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded<'a> {
    /// `HELLO`.
    Hello(Params),
    /// `EAGER`.
    Eager {
        /// Flags.
        flags: Flags,
        /// Correlation id.
        correlation: u64,
        /// Type bytes (not yet validated).
        kind: &'a [u8],
        /// Metadata bytes (not yet validated).
        meta: &'a [u8],
        /// Body.
        body: &'a [u8],
    },
    /// `RTS`.
    Rts {
        /// Flags.
        flags: Flags,
        /// Correlation id.
        correlation: u64,
        /// Type bytes.
        kind: &'a [u8],
        /// Metadata bytes.
        meta: &'a [u8],
        /// Rendezvous id.
        rid: u64,
        /// Where the body is.
        body: RemoteRegion,
        /// The body is in the sender's device memory.
        device: bool,
    },
    /// `FIN`.
    Fin(u64),
    /// `CREDIT`.
    Credit,
    /// `CLOSE`.
    Close,
    /// `STOP`.
    Stop,
}

/// The common header of a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Head {
    /// Kind.
    pub kind: Kind,
    /// Sequence number.
    pub seq: u64,
    /// Cumulative acknowledgement.
    pub acked: u64,
}

/// Decodes one message. Checks lengths against `limits` (metadata, body) and the
/// message's own size; never panics, never allocates.
pub fn decode<'a>(b: &'a [u8], limits: &Limits) -> Result<(Head, Decoded<'a>), ProtoError> {
    if b.len() < HEADER_LEN {
        return Err(ProtoError::Malformed("short"));
    }
    let kind = Kind::from_u8(b[0]).ok_or(ProtoError::UnknownKind(b[0]))?;
    let head = Head {
        kind,
        seq: u64_at(b, 8),
        acked: u64_at(b, 16),
    };
    let flags_b = b[1];
    let type_len = b[2] as usize;
    let meta_len = u32_at(b, 4);
    let is_msg = matches!(kind, Kind::Eager | Kind::Rts);
    if !is_msg && (flags_b != 0 || type_len != 0 || meta_len != 0) {
        return Err(ProtoError::Malformed("control"));
    }
    let d = match kind {
        Kind::Hello => {
            if b.len() < 72 {
                return Err(ProtoError::Malformed("HELLO"));
            }
            if b[24..32] != MAGIC {
                return Err(ProtoError::BadMagic);
            }
            let version = u16_at(b, 32);
            if version != VERSION {
                return Err(ProtoError::Version {
                    theirs: version,
                    ours: VERSION,
                });
            }
            let limits = Limits {
                max_meta_bytes: u32_at(b, 44),
                max_body: u64_at(b, 48),
                max_meta_entries: u16_at(b, 56),
            };
            let p = Params {
                recv_slots: u32_at(b, 36),
                slot_size: u32_at(b, 40),
                limits,
                keepalive: RemoteRegion {
                    addr: u64_at(b, 64),
                    len: 8,
                    rkey: u32_at(b, 60),
                },
                beat_ms: if b.len() >= 76 { u32_at(b, 72) } else { 0 },
            };
            if p.recv_slots < MIN_SLOTS || p.recv_slots > 1 << 16 {
                return Err(ProtoError::BadParams(format!(
                    "{} receive slots (4 to 65536 work)",
                    p.recv_slots
                )));
            }
            if p.slot_size < MIN_SLOT || p.slot_size > 1 << 24 {
                return Err(ProtoError::BadParams(format!(
                    "{}-byte slots ({MIN_SLOT} B to 16 MiB work)",
                    p.slot_size
                )));
            }
            let need = RTS_FIXED as u64 + 255 + u64::from(p.limits.max_meta_bytes);
            if u64::from(p.slot_size) < need {
                return Err(ProtoError::BadParams(format!(
                    "{}-byte slots cannot hold an RTS with {} bytes of metadata ({need} needed)",
                    p.slot_size, p.limits.max_meta_bytes
                )));
            }
            Decoded::Hello(p)
        }
        Kind::Eager | Kind::Rts => {
            let flags = Flags::from_bits(flags_b).ok_or(ProtoError::Malformed("flags"))?;
            if type_len == 0 {
                return Err(ProtoError::Malformed("type length"));
            }
            if meta_len > limits.max_meta_bytes {
                return Err(ProtoError::Limit {
                    what: "metadata",
                    len: u64::from(meta_len),
                    max: u64::from(limits.max_meta_bytes),
                });
            }
            let fixed = if kind == Kind::Eager {
                EAGER_FIXED
            } else {
                RTS_FIXED
            };
            let meta_len = meta_len as usize;
            if b.len() < fixed {
                return Err(ProtoError::Malformed("message header"));
            }
            let correlation = u64_at(b, 24);
            let body_len = u64_at(b, 32);
            if body_len > limits.max_body {
                return Err(ProtoError::Limit {
                    what: "body",
                    len: body_len,
                    max: limits.max_body,
                });
            }
            let head_end = fixed + type_len + meta_len;
            if b.len() < head_end {
                return Err(ProtoError::Malformed("type and metadata"));
            }
            let kind_b = &b[fixed..fixed + type_len];
            let meta = &b[fixed + type_len..head_end];
            if kind == Kind::Eager {
                if (b.len() - head_end) as u64 != body_len {
                    return Err(ProtoError::Malformed("EAGER body length"));
                }
                Decoded::Eager {
                    flags,
                    correlation,
                    kind: kind_b,
                    meta,
                    body: &b[head_end..],
                }
            } else {
                if b.len() != head_end {
                    return Err(ProtoError::Malformed("RTS length"));
                }
                let device = match b[60] {
                    0 => false,
                    1 => true,
                    _ => return Err(ProtoError::Malformed("RTS body memory")),
                };
                Decoded::Rts {
                    flags,
                    correlation,
                    kind: kind_b,
                    meta,
                    rid: u64_at(b, 40),
                    body: RemoteRegion {
                        addr: u64_at(b, 48),
                        len: body_len,
                        rkey: u32_at(b, 56),
                    },
                    device,
                }
            }
        }
        Kind::Fin => {
            if b.len() != HEADER_LEN + 8 {
                return Err(ProtoError::Malformed("FIN"));
            }
            Decoded::Fin(u64_at(b, 24))
        }
        Kind::Credit | Kind::Close | Kind::Stop => {
            if b.len() != HEADER_LEN {
                return Err(ProtoError::Malformed("control"));
            }
            match kind {
                Kind::Credit => Decoded::Credit,
                Kind::Close => Decoded::Close,
                _ => Decoded::Stop,
            }
        }
    };
    Ok((head, d))
}

fn put_head(
    out: &mut [u8],
    kind: Kind,
    flags: u8,
    type_len: u8,
    meta_len: u32,
    seq: u64,
    acked: u64,
) {
    out[0] = kind as u8;
    out[1] = flags;
    out[2] = type_len;
    out[3] = 0;
    out[4..8].copy_from_slice(&meta_len.to_le_bytes());
    out[8..16].copy_from_slice(&seq.to_le_bytes());
    out[16..24].copy_from_slice(&acked.to_le_bytes());
}

/// Encodes a `HELLO` into `out` (at least [`HELLO_LEN`] bytes); returns its length.
pub fn encode_hello(out: &mut [u8], p: &Params) -> usize {
    put_head(out, Kind::Hello, 0, 0, 0, 0, 0);
    out[24..32].copy_from_slice(&MAGIC);
    out[32..34].copy_from_slice(&VERSION.to_le_bytes());
    out[34..36].fill(0);
    out[36..40].copy_from_slice(&p.recv_slots.to_le_bytes());
    out[40..44].copy_from_slice(&p.slot_size.to_le_bytes());
    out[44..48].copy_from_slice(&p.limits.max_meta_bytes.to_le_bytes());
    out[48..56].copy_from_slice(&p.limits.max_body.to_le_bytes());
    out[56..58].copy_from_slice(&p.limits.max_meta_entries.to_le_bytes());
    out[58..60].fill(0);
    out[60..64].copy_from_slice(&p.keepalive.rkey.to_le_bytes());
    out[64..72].copy_from_slice(&p.keepalive.addr.to_le_bytes());
    out[72..76].copy_from_slice(&p.beat_ms.to_le_bytes());
    out[76..80].fill(0);
    HELLO_LEN
}

/// The length of the message at the start of `b`, from its header alone; `None` when the
/// header is incomplete or names no kind. For backends that report a whole buffer rather
/// than the received length.
pub fn frame_len(b: &[u8]) -> Option<usize> {
    if b.len() < HEADER_LEN {
        return None;
    }
    let type_len = b[2] as usize;
    let meta_len = u32_at(b, 4) as usize;
    Some(match Kind::from_u8(b[0])? {
        Kind::Hello => HELLO_LEN,
        Kind::Eager => {
            if b.len() < EAGER_FIXED {
                return None;
            }
            let body = usize::try_from(u64_at(b, 32)).ok()?;
            EAGER_FIXED
                .checked_add(type_len)?
                .checked_add(meta_len)?
                .checked_add(body)?
        }
        Kind::Rts => RTS_FIXED.checked_add(type_len)?.checked_add(meta_len)?,
        Kind::Fin => HEADER_LEN + 8,
        Kind::Credit | Kind::Close | Kind::Stop => HEADER_LEN,
    })
}

/// The bytes an `EAGER` of `msg` takes.
pub fn eager_len(msg: &Message) -> usize {
    EAGER_FIXED + msg.kind().len() + msg.meta().encoded_len() + msg.body().len()
}

/// The bytes an `RTS` of `msg` takes.
pub fn rts_len(msg: &Message) -> usize {
    RTS_FIXED + msg.kind().len() + msg.meta().encoded_len()
}

// ---------------------------------------------------------------------------------------
// The state machine
// ---------------------------------------------------------------------------------------

enum Out {
    Eager(Message),
    Rts {
        msg: Message,
        rid: u64,
        body: RemoteRegion,
    },
    Fin(u64),
    Close,
    Stop,
}

enum In {
    /// A message, and whether its body was in the sender's device memory.
    Ready(Message, bool),
    /// Waiting for its body (rendezvous id; the body is in the sender's device memory).
    Reading(u64, Option<Message>, bool),
}

/// A body to fetch: the driver reads `body` into a buffer of its own, then calls
/// [`Connection::handle_read_done`] with `rid`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadRequest {
    /// Rendezvous id.
    pub rid: u64,
    /// Where the body is at the peer.
    pub body: RemoteRegion,
    /// The body is in the peer's device memory (it may land in device memory here).
    pub device: bool,
}

/// The state of one connection (both directions), sans-IO.
///
/// Call order, for a driver:
/// 1. post [`Params::recv_slots`] receives of [`Params::slot_size`] bytes, then transmit
///    what [`poll_transmit`](Connection::poll_transmit) gives (the `HELLO` first);
/// 2. for each receive completion, in any order: [`handle_recv`](Connection::handle_recv),
///    then post the buffer again at once;
/// 3. drain [`poll_read`](Connection::poll_read) (bodies to fetch; report each with
///    [`handle_read_done`](Connection::handle_read_done)), [`poll_release`](Connection::poll_release)
///    (rendezvous buffers the peer is done with), [`poll_message`](Connection::poll_message)
///    (messages, in order);
/// 4. queue messages with [`send_eager`](Connection::send_eager) /
///    [`send_rendezvous`](Connection::send_rendezvous) while [`can_queue`](Connection::can_queue);
/// 5. transmit while [`poll_transmit`](Connection::poll_transmit) gives something.
pub struct Connection {
    local: Params,
    peer: Option<Params>,
    hello_sent: bool,
    // Credits.
    sent: u64,
    peer_acked: u64,
    /// Peer messages released: control messages once processed, messages (`EAGER`, `RTS`)
    /// once handed out by `poll_message` (or dropped). This is `acked`.
    consumed: u64,
    /// `FIN`s, `CLOSE`s and `STOP`s released and not yet reported.
    signals: u64,
    /// Our `FIN`s and `STOP`: sent before queued messages, within the reserve.
    ctrl: VecDeque<Out>,
    reported: u64,
    // Receive order.
    next_seq: u64,
    stash: BTreeMap<u64, Vec<u8>>,
    // Outgoing.
    out: VecDeque<Out>,
    out_limit: usize,
    next_rid: u64,
    rndv_out: HashSet<u64>,
    released: VecDeque<u64>,
    close_queued: bool,
    close_sent: bool,
    stop_queued: bool,
    // Incoming.
    inbox: VecDeque<In>,
    reads: VecDeque<ReadRequest>,
    rndv_in: HashSet<u64>,
    peer_closed: bool,
    peer_stopped: bool,
    discarding: bool,
    discarded: u64,
}

impl Connection {
    /// A connection offering `local`.
    pub fn new(local: Params) -> Connection {
        Connection {
            local,
            peer: None,
            hello_sent: false,
            sent: 0,
            peer_acked: 0,
            consumed: 0,
            signals: 0,
            ctrl: VecDeque::new(),
            reported: 0,
            next_seq: 0,
            stash: BTreeMap::new(),
            out: VecDeque::new(),
            out_limit: (local.recv_slots as usize).max(4),
            next_rid: 1,
            rndv_out: HashSet::new(),
            released: VecDeque::new(),
            close_queued: false,
            close_sent: false,
            stop_queued: false,
            inbox: VecDeque::new(),
            reads: VecDeque::new(),
            rndv_in: HashSet::new(),
            peer_closed: false,
            peer_stopped: false,
            discarding: false,
            discarded: 0,
        }
    }

    /// Our parameters.
    pub fn local(&self) -> &Params {
        &self.local
    }

    /// The peer's parameters, once its `HELLO` arrived.
    pub fn peer(&self) -> Option<&Params> {
        self.peer.as_ref()
    }

    /// Sendable messages left before the peer's buffers are full (0 before its `HELLO`).
    pub fn credits(&self) -> u64 {
        match &self.peer {
            Some(p) => u64::from(p.recv_slots).saturating_sub(self.sent - self.peer_acked),
            None => 0,
        }
    }

    /// The size of the messages we send: the peer's receive buffers, but never more than
    /// ours, so that a peer announcing huge buffers cannot make us pin huge send buffers
    /// (bodies that do not fit go by rendezvous anyway).
    pub fn send_slot(&self) -> usize {
        let ours = self.local.slot_size;
        self.peer.map_or(ours, |p| p.slot_size.min(ours)) as usize
    }

    /// The peer's limits as they apply to what we send it: its own, with metadata capped
    /// at what fits an `RTS` in [`send_slot`](Self::send_slot) bytes.
    pub fn peer_limits_for_sending(&self) -> Option<Limits> {
        let mut l = self.peer?.limits;
        let room = self.send_slot().saturating_sub(RTS_FIXED + 255);
        l.max_meta_bytes = l.max_meta_bytes.min(room as u32);
        Some(l)
    }

    /// True when a message fits in one send (an `EAGER`), false when its body goes by
    /// rendezvous.
    pub fn is_eager(&self, msg: &Message) -> bool {
        eager_len(msg) <= self.send_slot()
    }

    /// True when another message may be queued (the queue is bounded by the peer's slots,
    /// so queued messages wait for credits, not for memory).
    pub fn can_queue(&self) -> bool {
        !self.close_queued && self.out.len() < self.out_limit
    }

    /// Queues a message that [`is_eager`](Connection::is_eager).
    pub fn send_eager(&mut self, msg: Message) {
        debug_assert!(!self.close_queued);
        self.out.push_back(Out::Eager(msg));
    }

    /// Queues a message whose body the peer will read from `body` (registered memory the
    /// driver keeps untouched until [`poll_release`](Connection::poll_release) returns the id
    /// returned here).
    pub fn send_rendezvous(&mut self, msg: Message, body: RemoteRegion) -> u64 {
        debug_assert!(!self.close_queued);
        let rid = self.next_rid;
        self.next_rid += 1;
        self.rndv_out.insert(rid);
        self.out.push_back(Out::Rts { msg, rid, body });
        rid
    }

    /// Queues `CLOSE` after what is queued: this direction ends.
    pub fn close(&mut self) {
        if !self.close_queued {
            self.close_queued = true;
            self.out.push_back(Out::Close);
        }
    }

    /// Our receiving half is gone: tell the peer (`STOP`), drop what arrives from now on
    /// (answering rendezvous without reading them).
    pub fn stop(&mut self) {
        self.discarding = true;
        self.discarded += self.inbox.len() as u64;
        self.consumed += self.inbox.len() as u64;
        self.inbox.clear();
        for r in self.reads.drain(..) {
            self.ctrl.push_back(Out::Fin(r.rid));
        }
        if !self.stop_queued {
            self.stop_queued = true;
            self.ctrl.push_front(Out::Stop);
        }
    }

    /// Messages queued and not yet transmitted (including `FIN`s and `CLOSE`).
    pub fn queued(&self) -> usize {
        self.out.len() + self.ctrl.len()
    }

    /// True once `CLOSE` was transmitted.
    pub fn close_sent(&self) -> bool {
        self.close_sent
    }

    /// True once the peer's `CLOSE` arrived and every message before it was taken.
    pub fn peer_finished(&self) -> bool {
        self.peer_closed && self.inbox.is_empty()
    }

    /// True once the peer's `CLOSE` arrived (messages before it may still be in the inbox).
    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// True once the peer said its receiving half is gone.
    pub fn peer_stopped(&self) -> bool {
        self.peer_stopped
    }

    /// Our rendezvous bodies the peer has not released yet.
    pub fn outstanding(&self) -> usize {
        self.rndv_out.len()
    }

    /// Messages dropped because our receiving half was gone.
    pub fn discarded(&self) -> u64 {
        self.discarded
    }

    /// Handles one received message (the contents of a receive buffer). The buffer may be
    /// posted again as soon as this returns.
    pub fn handle_recv(&mut self, buf: &[u8]) -> Result<(), ProtoError> {
        let (head, _) = decode(buf, &self.local.limits)?;
        // Credits are enforced here, not trusted: the peer may send message `seq` only once
        // we have told it (`acked`, as last transmitted) that a buffer is free for it. The
        // driver reposts each buffer at once, so without this a peer ignoring credits would
        // make us hold (and answer) any number of messages.
        let window = u64::from(self.local.recv_slots);
        if head.seq >= self.reported + window {
            return Err(ProtoError::NoCredit {
                seq: head.seq,
                acked: self.reported,
                slots: self.local.recv_slots,
            });
        }
        if head.seq != self.next_seq {
            let window = u64::from(self.local.recv_slots);
            if head.seq < self.next_seq
                || head.seq >= self.next_seq + window
                || self.stash.contains_key(&head.seq)
            {
                return Err(ProtoError::BadSeq {
                    seq: head.seq,
                    expected: self.next_seq,
                    slots: self.local.recv_slots,
                });
            }
            // Reported out of order: keep a copy until its turn. It is acknowledged only when
            // processed in order, so the peer never has more than `recv_slots` messages past
            // the first one missing, and the stash holds fewer than `recv_slots` copies.
            self.stash.insert(head.seq, buf.to_vec());
            return Ok(());
        }
        self.process(buf)?;
        while let Some(next) = self.stash.remove(&self.next_seq) {
            self.process(&next)?;
        }
        Ok(())
    }

    fn process(&mut self, buf: &[u8]) -> Result<(), ProtoError> {
        let (head, d) = decode(buf, &self.local.limits)?;
        self.next_seq += 1;
        // Control messages are released at once; messages when handed out.
        match d {
            Decoded::Eager { .. } | Decoded::Rts { .. } => {}
            Decoded::Hello(_) | Decoded::Credit => self.consumed += 1,
            Decoded::Fin(_) | Decoded::Close | Decoded::Stop => {
                self.consumed += 1;
                self.signals += 1;
            }
        }
        if let Decoded::Hello(p) = d {
            if self.peer.is_some() || head.seq != 0 {
                return Err(ProtoError::OutOfSequence("HELLO"));
            }
            self.peer = Some(p);
            return Ok(());
        }
        if self.peer.is_none() {
            return Err(ProtoError::OutOfSequence("a message before HELLO"));
        }
        if head.acked > self.sent || head.acked < self.peer_acked {
            return Err(ProtoError::BadAck {
                acked: head.acked,
                sent: self.sent,
            });
        }
        self.peer_acked = head.acked;
        if self.peer_closed && !matches!(d, Decoded::Fin(_) | Decoded::Credit | Decoded::Stop) {
            return Err(ProtoError::AfterClose);
        }
        match d {
            Decoded::Hello(_) => unreachable!("handled above"),
            Decoded::Eager {
                flags,
                correlation,
                kind,
                meta,
                body,
            } => {
                let (kind, meta) = self.head(kind, meta)?;
                if self.discarding {
                    self.discarded += 1;
                    self.consumed += 1;
                    return Ok(());
                }
                let msg = Message::from_parts(
                    kind,
                    meta,
                    Body::from(Bytes::copy_from_slice(body)),
                    Header { flags, correlation },
                );
                self.inbox.push_back(In::Ready(msg, false));
            }
            Decoded::Rts {
                flags,
                correlation,
                kind,
                meta,
                rid,
                body,
                device,
            } => {
                let (kind, meta) = self.head(kind, meta)?;
                if !self.rndv_in.insert(rid) {
                    return Err(ProtoError::UnknownRendezvous(rid));
                }
                if self.discarding {
                    self.discarded += 1;
                    self.consumed += 1;
                    self.rndv_in.remove(&rid);
                    self.ctrl.push_back(Out::Fin(rid));
                    return Ok(());
                }
                let msg =
                    Message::from_parts(kind, meta, Body::new(), Header { flags, correlation });
                if body.len == 0 {
                    self.rndv_in.remove(&rid);
                    self.ctrl.push_back(Out::Fin(rid));
                    self.inbox.push_back(In::Ready(msg, device));
                } else {
                    self.inbox.push_back(In::Reading(rid, Some(msg), device));
                    self.reads.push_back(ReadRequest { rid, body, device });
                }
            }
            Decoded::Fin(rid) => {
                if !self.rndv_out.remove(&rid) {
                    return Err(ProtoError::UnknownRendezvous(rid));
                }
                self.released.push_back(rid);
            }
            Decoded::Credit => {}
            Decoded::Close => self.peer_closed = true,
            Decoded::Stop => self.peer_stopped = true,
        }
        Ok(())
    }

    fn head(&self, kind: &[u8], meta: &[u8]) -> Result<(MsgType, Meta), ProtoError> {
        let kind =
            MsgType::from_wire(kind).map_err(|e| ProtoError::Invalid(format!("type: {e:#}")))?;
        let meta = if meta.is_empty() {
            Meta::new()
        } else {
            // Checked after the copy, which is what is kept.
            Meta::from_wire(
                Bytes::copy_from_slice(meta),
                self.local.limits.max_meta_entries as usize,
            )
            .map_err(|e| ProtoError::Invalid(format!("metadata: {e:#}")))?
        };
        Ok((kind, meta))
    }

    /// The next body to fetch.
    pub fn poll_read(&mut self) -> Option<ReadRequest> {
        self.reads.pop_front()
    }

    /// A body fetched: `body` is the message's body (in the driver's buffer, or device
    /// memory), delivered in order; the `FIN` that frees the peer's buffer is queued.
    pub fn handle_read_done(&mut self, rid: u64, body: impl Into<Body>) -> Result<(), ProtoError> {
        let body = body.into();
        if !self.rndv_in.remove(&rid) {
            return Err(ProtoError::UnknownRendezvous(rid));
        }
        self.ctrl.push_back(Out::Fin(rid));
        for item in self.inbox.iter_mut() {
            if let In::Reading(r, m, device) = item
                && *r == rid
            {
                let device = *device;
                let m = m.take().map(|m| m.with_body(body));
                if let Some(m) = m {
                    *item = In::Ready(m, device);
                }
                return Ok(());
            }
        }
        // Discarded meanwhile (our receiving half went): nothing to deliver.
        Ok(())
    }

    /// The next message, in order.
    pub fn poll_message(&mut self) -> Option<Message> {
        self.poll_delivery().map(|(m, _)| m)
    }

    /// The next message, in order, and whether its body was in the sender's device memory
    /// (wherever the driver read it to).
    pub fn poll_delivery(&mut self) -> Option<(Message, bool)> {
        match self.inbox.front() {
            Some(In::Ready(..)) => match self.inbox.pop_front() {
                Some(In::Ready(m, device)) => {
                    // Released: the peer may send another in its place.
                    self.consumed += 1;
                    Some((m, device))
                }
                _ => None,
            },
            _ => None,
        }
    }

    /// Messages waiting in the inbox (ready or still reading).
    pub fn inbox_len(&self) -> usize {
        self.inbox.len()
    }

    /// A rendezvous body of ours the peer is done with: its buffer may be reused.
    pub fn poll_release(&mut self) -> Option<u64> {
        self.released.pop_front()
    }

    /// Writes the next message to send into `out` (a send buffer of the peer's slot size)
    /// and returns its length, or `None` when nothing can be sent now (nothing queued, or no
    /// credits).
    pub fn poll_transmit(&mut self, out: &mut [u8]) -> Option<usize> {
        if !self.hello_sent {
            self.hello_sent = true;
            self.sent += 1;
            return Some(encode_hello(out, &self.local));
        }
        let peer = self.peer?;
        let credits = self.credits();
        let unreported = self.consumed - self.reported;
        let seq = self.sent;
        let acked = self.consumed;
        // FINs and STOP go first and may use the reserve; messages (and CLOSE, which must
        // follow them) leave it free.
        let item = if credits >= 2 && !self.ctrl.is_empty() {
            self.ctrl.pop_front()
        } else if credits >= 2 + self.reserve() {
            self.out.pop_front()
        } else {
            None
        };
        if let Some(item) = item {
            let n = match item {
                Out::Eager(msg) => {
                    let kind = msg.kind();
                    let meta = msg.meta().as_wire();
                    let body = msg.body().as_bytes().map(|b| b.as_ref()).unwrap_or(&[]);
                    put_head(
                        out,
                        Kind::Eager,
                        msg.header().flags.bits(),
                        kind.len() as u8,
                        meta.len() as u32,
                        seq,
                        acked,
                    );
                    out[24..32].copy_from_slice(&msg.header().correlation.to_le_bytes());
                    out[32..40].copy_from_slice(&(body.len() as u64).to_le_bytes());
                    let mut at = EAGER_FIXED;
                    for part in [kind.as_bytes(), meta, body] {
                        out[at..at + part.len()].copy_from_slice(part);
                        at += part.len();
                    }
                    at
                }
                Out::Rts { msg, rid, body } => {
                    let kind = msg.kind();
                    let meta = msg.meta().as_wire();
                    put_head(
                        out,
                        Kind::Rts,
                        msg.header().flags.bits(),
                        kind.len() as u8,
                        meta.len() as u32,
                        seq,
                        acked,
                    );
                    out[24..32].copy_from_slice(&msg.header().correlation.to_le_bytes());
                    out[32..40].copy_from_slice(&body.len.to_le_bytes());
                    out[40..48].copy_from_slice(&rid.to_le_bytes());
                    out[48..56].copy_from_slice(&body.addr.to_le_bytes());
                    out[56..60].copy_from_slice(&body.rkey.to_le_bytes());
                    out[60] = u8::from(msg.body().location() != crate::message::Location::Host);
                    out[61..64].fill(0);
                    let mut at = RTS_FIXED;
                    for part in [kind.as_bytes(), meta] {
                        out[at..at + part.len()].copy_from_slice(part);
                        at += part.len();
                    }
                    at
                }
                Out::Fin(rid) => {
                    put_head(out, Kind::Fin, 0, 0, 0, seq, acked);
                    out[24..32].copy_from_slice(&rid.to_le_bytes());
                    HEADER_LEN + 8
                }
                Out::Close => {
                    self.close_sent = true;
                    put_head(out, Kind::Close, 0, 0, 0, seq, acked);
                    HEADER_LEN
                }
                Out::Stop => {
                    put_head(out, Kind::Stop, 0, 0, 0, seq, acked);
                    HEADER_LEN
                }
            };
            debug_assert!(n <= self.send_slot().min(peer.slot_size as usize));
            self.sent += 1;
            self.reported = acked;
            self.signals = 0;
            return Some(n);
        }
        if credits >= 1 && self.credit_due(unreported) {
            put_head(out, Kind::Credit, 0, 0, 0, seq, acked);
            self.sent += 1;
            self.reported = acked;
            self.signals = 0;
            return Some(HEADER_LEN);
        }
        None
    }

    /// Credits kept free of messages, for `FIN`s and `STOP` (so that a receiver that is not
    /// read never holds up the other direction's `FIN`s).
    fn reserve(&self) -> u64 {
        self.peer.map_or(1, |p| u64::from(p.recv_slots / 8).max(1))
    }

    /// Whether a `CREDIT` must go now (we have nothing else to carry `acked`): half our
    /// window is released and unreported; or a `FIN`/`CLOSE`/`STOP` is unreported while the
    /// peer may be short of credits (half our window holds its unreleased messages). A lone
    /// `CREDIT` never makes another due, so credits are not bounced back and forth.
    fn credit_due(&self, unreported: u64) -> bool {
        let half = u64::from(self.local.recv_slots / 2);
        unreported >= half || (self.signals > 0 && self.next_seq - self.reported >= half)
    }

    /// True when [`poll_transmit`](Connection::poll_transmit) would give something now.
    pub fn wants_transmit(&self) -> bool {
        if !self.hello_sent {
            return true;
        }
        if self.peer.is_none() {
            return false;
        }
        let credits = self.credits();
        (credits >= 2 && !self.ctrl.is_empty())
            || (credits >= 2 + self.reserve() && !self.out.is_empty())
            || (credits >= 1 && self.credit_due(self.consumed - self.reported))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(slots: u32) -> Params {
        Params {
            recv_slots: slots,
            slot_size: 8192,
            limits: Limits::default(),
            keepalive: RemoteRegion {
                addr: 0x1000,
                len: 8,
                rkey: 7,
            },
            beat_ms: 1000,
        }
    }

    /// Moves every transmit of `from` into `to`, in order. Returns how many moved.
    fn pump(from: &mut Connection, to: &mut Connection) -> usize {
        let mut buf = vec![0u8; 8192];
        let mut n = 0;
        while let Some(len) = from.poll_transmit(&mut buf) {
            to.handle_recv(&buf[..len]).unwrap();
            n += 1;
        }
        n
    }

    #[test]
    fn hello_then_eager_in_order() {
        let (mut a, mut b) = (Connection::new(params(8)), Connection::new(params(8)));
        pump(&mut a, &mut b);
        pump(&mut b, &mut a);
        // 8 slots, the HELLO unacknowledged: 7; messages keep 1 + a reserve of 1 free.
        assert_eq!(a.credits(), 7);
        for i in 0..6 {
            a.send_eager(Message::new("t.x").unwrap().with_body(format!("m{i}")));
        }
        assert_eq!(
            pump(&mut a, &mut b),
            5,
            "stops at 2 credits: 1 reserve, 1 for CREDIT"
        );
        assert_eq!(a.credits(), 2);
        // Not read: b acknowledges nothing, however long; a stays blocked.
        assert_eq!(pump(&mut b, &mut a), 0);
        let body = |m: Message| m.body().as_bytes().unwrap().clone();
        for i in 0..4 {
            assert_eq!(body(b.poll_message().unwrap()), format!("m{i}").as_bytes());
        }
        // 4 released (and the HELLO): a CREDIT is due (half of 8).
        assert_eq!(pump(&mut b, &mut a), 1);
        assert_eq!(a.credits(), 7, "8 - (6 sent - 5 acknowledged)");
        assert_eq!(pump(&mut a, &mut b), 1);
        assert_eq!(body(b.poll_message().unwrap()), &b"m4"[..]);
        assert_eq!(body(b.poll_message().unwrap()), &b"m5"[..]);
    }

    #[test]
    fn fins_use_the_reserve_while_messages_wait() {
        let (mut a, mut b) = (Connection::new(params(8)), Connection::new(params(8)));
        pump(&mut a, &mut b);
        pump(&mut b, &mut a);
        // b announces a body to a; a's messages to b are never read, filling b's window.
        let region = RemoteRegion {
            addr: 0x1000,
            len: 100_000,
            rkey: 3,
        };
        let rid = b.send_rendezvous(Message::new("big").unwrap(), region);
        pump(&mut b, &mut a);
        for _ in 0..10 {
            a.send_eager(Message::new("t.x").unwrap());
        }
        pump(&mut a, &mut b);
        assert!(a.credits() < 2 + 1, "a's messages are blocked");
        // a reads the body and answers FIN from its reserve, though its messages wait.
        let r = a.poll_read().unwrap();
        a.handle_read_done(r.rid, Bytes::from(vec![0u8; 100_000]))
            .unwrap();
        assert!(a.poll_message().is_some());
        assert_eq!(pump(&mut a, &mut b), 1);
        assert_eq!(b.poll_release(), Some(rid));
    }

    #[test]
    fn out_of_order_completions_are_reordered() {
        let (mut a, mut b) = (Connection::new(params(8)), Connection::new(params(8)));
        pump(&mut a, &mut b);
        pump(&mut b, &mut a);
        let mut bufs = Vec::new();
        for i in 0..4 {
            a.send_eager(Message::new("t.x").unwrap().with_body(format!("m{i}")));
            let mut buf = vec![0u8; 8192];
            let n = a.poll_transmit(&mut buf).unwrap();
            buf.truncate(n);
            bufs.push(buf);
        }
        for i in [2, 0, 3, 1] {
            b.handle_recv(&bufs[i]).unwrap();
        }
        for i in 0..4 {
            let m = b.poll_message().unwrap();
            assert_eq!(
                m.body().as_bytes().unwrap().as_ref(),
                format!("m{i}").as_bytes()
            );
        }
        assert!(matches!(
            b.handle_recv(&bufs[0]),
            Err(ProtoError::BadSeq { .. })
        ));
    }

    #[test]
    fn rendezvous_delivers_in_order_and_releases() {
        let (mut a, mut b) = (Connection::new(params(8)), Connection::new(params(8)));
        pump(&mut a, &mut b);
        pump(&mut b, &mut a);
        let region = RemoteRegion {
            addr: 0x10_0000,
            len: 100_000,
            rkey: 9,
        };
        let rid = a.send_rendezvous(Message::new("big.one").unwrap(), region);
        a.send_eager(Message::new("small.after").unwrap());
        pump(&mut a, &mut b);
        let req = b.poll_read().unwrap();
        assert_eq!(
            req,
            ReadRequest {
                rid,
                body: region,
                device: false
            }
        );
        assert!(
            b.poll_message().is_none(),
            "the small one waits behind the big one"
        );
        b.handle_read_done(rid, Bytes::from(vec![1u8; 100_000]))
            .unwrap();
        assert_eq!(b.poll_message().unwrap().body().len(), 100_000);
        assert_eq!(b.poll_message().unwrap().kind(), "small.after");
        pump(&mut b, &mut a);
        assert_eq!(a.poll_release(), Some(rid));
        assert_eq!(a.outstanding(), 0);
    }

    /// Byte 60 of an `RTS` says where the body is: the receiver learns it with the read it
    /// is asked for; any other value is malformed.
    #[test]
    fn rendezvous_says_where_the_body_is() {
        let region = RemoteRegion {
            addr: 0x2000,
            len: 50_000,
            rkey: 3,
        };
        for (memory, want) in [(0u8, Some(false)), (1, Some(true)), (2, None)] {
            let (mut a, mut b) = (Connection::new(params(4)), Connection::new(params(4)));
            pump(&mut a, &mut b);
            pump(&mut b, &mut a);
            a.send_rendezvous(Message::new("dev.body").unwrap(), region);
            let mut buf = vec![0u8; 8192];
            let n = a.poll_transmit(&mut buf).unwrap();
            assert_eq!(buf[60], 0, "a host body");
            buf[60] = memory;
            match want {
                Some(device) => {
                    b.handle_recv(&buf[..n]).unwrap();
                    assert_eq!(b.poll_read().unwrap().device, device);
                }
                None => assert!(matches!(
                    b.handle_recv(&buf[..n]),
                    Err(ProtoError::Malformed("RTS body memory"))
                )),
            }
        }
    }

    #[test]
    fn oversized_rendezvous_is_refused_before_allocation() {
        let mut small = params(4);
        small.limits.max_body = 1000;
        let (mut a, mut b) = (Connection::new(params(4)), Connection::new(small));
        pump(&mut a, &mut b);
        pump(&mut b, &mut a);
        a.send_rendezvous(
            Message::new("big").unwrap(),
            RemoteRegion {
                addr: 0,
                len: 1001,
                rkey: 1,
            },
        );
        let mut buf = vec![0u8; 8192];
        let n = a.poll_transmit(&mut buf).unwrap();
        let e = b.handle_recv(&buf[..n]).unwrap_err();
        assert!(e.is_limit(), "{e:#}");
    }

    /// `a` believes (from a forged `HELLO`) that its peer has 1000 buffers; the real peer,
    /// `b`, has 4 and reads nothing. Before credits were enforced, `b` took all 200 messages.
    fn credit_ignoring_sender() -> (Connection, Connection) {
        let (mut a, mut b) = (Connection::new(params(1000)), Connection::new(params(4)));
        pump(&mut a, &mut b); // a's HELLO
        let mut forged = vec![0u8; 8192];
        let n = encode_hello(&mut forged, &params(1000));
        a.handle_recv(&forged[..n]).unwrap();
        let mut ours = vec![0u8; 8192];
        b.poll_transmit(&mut ours).unwrap(); // b's HELLO, lost
        (a, b)
    }

    #[test]
    fn a_peer_that_ignores_credits_is_refused() {
        let (mut a, mut b) = credit_ignoring_sender();
        for _ in 0..200 {
            a.send_eager(Message::new("t.x").unwrap().with_body(vec![7u8; 4000]));
        }
        let mut buf = vec![0u8; 8192];
        let mut taken = 0;
        let err = loop {
            let n = a
                .poll_transmit(&mut buf)
                .expect("a has credits it was never given");
            match b.handle_recv(&buf[..n]) {
                Ok(()) => taken += 1,
                Err(e) => break e,
            }
        };
        assert!(matches!(err, ProtoError::NoCredit { .. }), "{err:#}");
        assert!(
            taken < 4,
            "took {taken} messages into 4 buffers (its HELLO uses one)"
        );
        assert!(b.inbox_len() <= 4);
    }

    #[test]
    fn after_stop_rendezvous_without_credit_cannot_pile_up_fins() {
        let (mut a, mut b) = credit_ignoring_sender();
        b.stop();
        let region = RemoteRegion {
            addr: 0x1000,
            len: 100_000,
            rkey: 3,
        };
        for _ in 0..200 {
            a.send_rendezvous(Message::new("big").unwrap(), region);
        }
        let mut buf = vec![0u8; 8192];
        let err = loop {
            let n = a.poll_transmit(&mut buf).unwrap();
            if let Err(e) = b.handle_recv(&buf[..n]) {
                break e;
            }
        };
        assert!(matches!(err, ProtoError::NoCredit { .. }), "{err:#}");
        assert!(b.queued() <= 4 + 1, "{} FINs queued", b.queued());
    }

    #[test]
    fn send_buffers_never_exceed_ours() {
        let mut huge = params(4);
        huge.slot_size = 1 << 24;
        huge.limits.max_meta_bytes = 1 << 23;
        let (mut a, mut b) = (Connection::new(params(4)), Connection::new(huge));
        pump(&mut a, &mut b);
        pump(&mut b, &mut a);
        assert_eq!(a.send_slot(), 8192, "capped at ours, not the peer's 16 MiB");
        assert_eq!(b.send_slot(), 8192, "the peer's own, smaller");
        assert!(!a.is_eager(&Message::new("t.x").unwrap().with_body(vec![0u8; 9000])));
        let l = a.peer_limits_for_sending().unwrap();
        assert_eq!(l.max_meta_bytes as usize, 8192 - RTS_FIXED - 255);
        assert_eq!(l.max_body, huge.limits.max_body);
    }

    #[test]
    fn version_mismatch_names_both() {
        let mut buf = vec![0u8; 8192];
        let n = encode_hello(&mut buf, &params(4));
        buf[32] = 9;
        let e = decode(&buf[..n], &Limits::default()).unwrap_err();
        assert_eq!(e, ProtoError::Version { theirs: 9, ours: 1 });
    }
}
