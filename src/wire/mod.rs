//! The wire format of byte-stream transports (`tcp://`), sans-IO.
//!
//! This module is pure encoding and decoding over byte buffers: no sockets, no runtime, no
//! `unsafe`. The transports drive it; the tests and fuzzers drive it alone. Everything below
//! is little endian. This page is the specification: a peer in another language can be
//! written from it.
//!
//! # Connection
//!
//! Each side sends a [handshake](#handshake) as soon as the connection is up, without waiting
//! for the other's, then reads the peer's. When both are valid, each side sends
//! [frames](#frames) until it sends `CLOSE`. A side that detects a violation may send an
//! `ERROR` frame naming it, and closes the connection.
//!
//! # Handshake
//!
//! ```text
//! offset size field
//!      0    8 magic             "HYPERFRM" (48 59 50 45 52 46 52 4D)
//!      8    2 version           1
//!     10    2 length            total handshake length in bytes, >= 32 (40 with the
//!                               heartbeat field); a reader skips the bytes past the fields it
//!                               knows (<= 1024)
//!     12    4 capabilities      bit set, unknown bits ignored; bit 0 HEARTBEAT: this side
//!                               understands HEARTBEAT frames
//!     16    8 max_body          largest body this side accepts, in bytes
//!     24    4 max_meta_bytes    largest encoded metadata section this side accepts
//!     28    2 max_meta_entries  most metadata entries this side accepts
//!     30    2 reserved          0
//!     32    4 heartbeat_ms      present when length >= 36: this side sends a frame at least
//!                               this often (a HEARTBEAT when it has nothing else) while it
//!                               can write; 0 = it promises nothing
//!     36    4 reserved          0 (ignored)
//! ```
//!
//! A side sends `HEARTBEAT` frames only to a peer with the HEARTBEAT capability. A side whose
//! peer promised an interval may declare it lost after a number of intervals with nothing
//! heard, counted only while it is reading (a side that stops reading, to backpressure the
//! peer, cannot hear it and does not count).
//!
//! The limits are *receive* limits: a sender must not send what the peer says it will not
//! take (hyperframes refuses such a message at `send`, handing it back). A different
//! `version` ends the connection with a clear error on both sides; so does a wrong magic,
//! detected from the first byte that differs.
//!
//! # Frames
//!
//! ```text
//! offset size field
//!      0    1 kind              1 MESSAGE, 2 CLOSE, 3 STOP, 4 ERROR, 5 HEARTBEAT
//!      1    1 flags             MESSAGE only: bit 0 REQUEST, bit 1 RESPONSE; others reserved (0)
//!      2    1 type_len          MESSAGE: 1..=255; control frames: 0
//!      3    1 reserved          0
//!      4    4 meta_len          <= peer's max_meta_bytes; control frames: 0
//!      8    8 body_len          <= peer's max_body; CLOSE/STOP/HEARTBEAT: 0; ERROR: <= 1024
//!     16    8 correlation       MESSAGE: pairs a response with its request (0 = none);
//!                               control frames: 0
//!     24      type              type_len bytes: the dotted name, see MsgType
//!             meta              meta_len bytes, see below
//!             body              body_len bytes
//! ```
//!
//! * `MESSAGE` carries one [`Message`].
//! * `CLOSE`: the sender will send no more messages (half close). The receiver's stream ends
//!   after the frames before it. A connection that ends *without* `CLOSE` is reported as lost:
//!   this is how a crashed peer is told apart from a finished one. Only `STOP`, `ERROR` or
//!   `HEARTBEAT` may follow a `CLOSE`; a `MESSAGE` after it is a protocol error.
//! * `STOP`: the sender's receiving half is gone; what it receives from now on is discarded
//!   (and counted). The other side's sending half fails with `Closed`.
//!
//! A side shuts down its write direction (TCP FIN) once it will send nothing at all: after its
//! `CLOSE`, when its receiving half is gone (having sent `STOP` if the stream had not ended) or
//! the peer has finished. Before closing the socket it reads what the peer still sends until
//! the peer's FIN (for a bounded time), so that closing never resets a connection whose last
//! bytes the peer has not read yet.
//! * `ERROR`: the body is a UTF-8 reason (at most 1024 bytes); the sender closes next.
//! * `HEARTBEAT`: nothing but "still here", sent by a side that has written nothing for its
//!   announced `heartbeat_ms`, until it shuts down its write direction (also after its
//!   `CLOSE`: the peer may still be sending to it).
//!
//! The type is 1 to 255 bytes of `A-Z a-z 0-9 _ - .` forming non-empty dot-separated segments.
//!
//! The metadata section is empty (`meta_len` 0) or:
//!
//! ```text
//! count:u16                    1..=peer's max_meta_entries
//! count times:
//!   key_len:u8  key            1..=64 bytes of A-Z a-z 0-9 _ - .; keys are unique
//!   value_len:u16  value       UTF-8
//! ```
//!
//! # Limits before allocation
//!
//! A decoder checks every length in the 24-byte header against its own limits before it
//! reserves a byte for the frame, so a peer can make it allocate at most `max_body` (one body
//! being received) plus the transport's read buffer.

#![forbid(unsafe_code)]

mod batch;
mod frame;
mod handshake;

pub use batch::{Batch, advance, truncate};
pub use frame::{
    Control, Decoder, FRAME_HEAD_LEN, Frame, FrameError, FrameHead, FrameKind, MAX_ERROR_REASON,
};
pub use handshake::{
    Capabilities, HANDSHAKE_LEN, Handshake, HandshakeError, MAGIC, MIN_HANDSHAKE_LEN, VERSION,
};

use crate::message::Message;

/// The limits are message-level (shm and rdma check them too); the wire sends them in its
/// handshake.
pub use crate::message::{LimitError, Limits};

/// The encoded size of `msg`'s frame minus its body: header, type and metadata.
pub fn head_len(msg: &Message) -> usize {
    FRAME_HEAD_LEN + msg.kind().len() + msg.meta().encoded_len()
}
