//! Frames: the 24-byte header, and a decoder that turns a byte stream into frames.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::message::{Body, Flags, Header, InvalidMeta, InvalidType, Message, Meta, MsgType};
use crate::message::{Limits, TypeCache};

/// The length of the fixed frame header.
pub const FRAME_HEAD_LEN: usize = 24;
/// The longest reason an `ERROR` frame carries.
pub const MAX_ERROR_REASON: usize = 1024;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Carries a message.
    Message = 1,
    /// The sender's direction is finished.
    Close = 2,
    /// The sender no longer receives.
    Stop = 3,
    /// The sender reports a protocol violation and closes.
    Error = 4,
    /// The sender is alive; it has had nothing else to send for a while. Sent only to a peer
    /// whose handshake has [`Capabilities::HEARTBEAT`](super::Capabilities::HEARTBEAT).
    Heartbeat = 5,
}

/// The decoded 24-byte header, already checked against the decoder's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHead {
    /// Frame kind.
    pub kind: FrameKind,
    /// Message flags.
    pub flags: Flags,
    /// Type length.
    pub type_len: u8,
    /// Metadata length.
    pub meta_len: u32,
    /// Body length.
    pub body_len: u64,
    /// Correlation id.
    pub correlation: u64,
}

/// A violation of the frame format or of the receiver's limits. The connection cannot
/// continue after one (the stream position is lost).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Unknown frame kind.
    #[error("unknown frame kind {0:#04x}")]
    BadKind(u8),
    /// A reserved byte or flag bit is set.
    #[error("reserved header bits set: {0}")]
    Reserved(&'static str),
    /// A control frame carries fields it must not.
    #[error("malformed {0:?} frame: {1}")]
    BadControl(FrameKind, &'static str),
    /// A message frame with an empty type.
    #[error("message frame with an empty type")]
    EmptyType,
    /// The body is larger than this side accepts.
    #[error("frame body of {len} bytes exceeds max_body of {max}")]
    BodyTooLarge {
        /// Announced length.
        len: u64,
        /// Limit.
        max: u64,
    },
    /// The metadata section is larger than this side accepts.
    #[error("frame metadata of {len} bytes exceeds max_meta_bytes of {max}")]
    MetaTooLarge {
        /// Announced length.
        len: u32,
        /// Limit.
        max: u32,
    },
    /// The type does not follow the grammar.
    #[error("frame type is invalid: {0}")]
    Type(#[from] InvalidType),
    /// The metadata does not follow the grammar or the entry limit.
    #[error("frame metadata is invalid: {0}")]
    Meta(#[from] InvalidMeta),
    /// An `ERROR` frame's reason is not UTF-8.
    #[error("error frame reason is not UTF-8")]
    ReasonNotUtf8,
    /// The memory for a body within `max_body` could not be had: the connection fails, the
    /// process goes on.
    #[error(
        "no memory for a frame body of {len} bytes (within max_body, but the allocation failed; \
         lower max_body)"
    )]
    NoMemory {
        /// Announced length.
        len: u64,
    },
}

impl FrameHead {
    /// Parses and validates a header against `limits`. Nothing is allocated.
    pub fn parse(b: &[u8; FRAME_HEAD_LEN], limits: &Limits) -> Result<FrameHead, FrameError> {
        let kind = match b[0] {
            1 => FrameKind::Message,
            2 => FrameKind::Close,
            3 => FrameKind::Stop,
            4 => FrameKind::Error,
            5 => FrameKind::Heartbeat,
            k => return Err(FrameError::BadKind(k)),
        };
        if b[3] != 0 {
            return Err(FrameError::Reserved("byte 3"));
        }
        let flags = Flags::from_bits(b[1]).ok_or(FrameError::Reserved("flags"))?;
        let type_len = b[2];
        let meta_len = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let body_len = u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]);
        let correlation =
            u64::from_le_bytes([b[16], b[17], b[18], b[19], b[20], b[21], b[22], b[23]]);
        if kind == FrameKind::Message {
            if type_len == 0 {
                return Err(FrameError::EmptyType);
            }
            if meta_len > limits.max_meta_bytes {
                return Err(FrameError::MetaTooLarge {
                    len: meta_len,
                    max: limits.max_meta_bytes,
                });
            }
            if body_len > limits.max_body {
                return Err(FrameError::BodyTooLarge {
                    len: body_len,
                    max: limits.max_body,
                });
            }
        } else {
            if flags != Flags::NONE || type_len != 0 || meta_len != 0 || correlation != 0 {
                return Err(FrameError::BadControl(
                    kind,
                    "flags, type, metadata and correlation must be zero",
                ));
            }
            let max = if kind == FrameKind::Error {
                MAX_ERROR_REASON as u64
            } else {
                0
            };
            if body_len > max {
                return Err(FrameError::BadControl(kind, "body too long"));
            }
        }
        Ok(FrameHead {
            kind,
            flags,
            type_len,
            meta_len,
            body_len,
            correlation,
        })
    }

    /// The 24-byte encoding.
    pub fn to_bytes(&self) -> [u8; FRAME_HEAD_LEN] {
        let first = u64::from(self.kind as u8)
            | u64::from(self.flags.bits()) << 8
            | u64::from(self.type_len) << 16
            | u64::from(self.meta_len) << 32;
        let mut b = [0u8; FRAME_HEAD_LEN];
        b[..8].copy_from_slice(&first.to_le_bytes());
        b[8..16].copy_from_slice(&self.body_len.to_le_bytes());
        b[16..].copy_from_slice(&self.correlation.to_le_bytes());
        b
    }

    /// Appends the 24-byte encoding (one copy of three words, not seven small writes).
    pub fn encode(&self, dst: &mut impl BufMut) {
        dst.put_slice(&self.to_bytes());
    }

    /// Header, type and metadata: the bytes before the body.
    pub fn prefix_len(&self) -> usize {
        FRAME_HEAD_LEN + self.type_len as usize + self.meta_len as usize
    }

    /// The head of `msg`'s frame.
    pub fn for_message(msg: &Message) -> FrameHead {
        let header = msg.header();
        FrameHead {
            kind: FrameKind::Message,
            flags: header.flags,
            type_len: msg.kind().len() as u8,
            meta_len: msg.meta().encoded_len() as u32,
            body_len: msg.body().len() as u64,
            correlation: header.correlation,
        }
    }

    /// The head of a control frame.
    pub fn for_control(kind: FrameKind, body_len: usize) -> FrameHead {
        FrameHead {
            kind,
            flags: Flags::NONE,
            type_len: 0,
            meta_len: 0,
            body_len: body_len as u64,
            correlation: 0,
        }
    }
}

/// A control frame to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Control {
    /// See [`FrameKind::Close`].
    Close,
    /// See [`FrameKind::Stop`].
    Stop,
    /// See [`FrameKind::Error`]; the reason is cut to [`MAX_ERROR_REASON`] bytes.
    Error(String),
    /// See [`FrameKind::Heartbeat`].
    Heartbeat,
}

/// A decoded frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// A message.
    Message(Message),
    /// A control frame.
    Control(Control),
}

/// A large body being received into a buffer of its own.
struct Partial {
    kind: MsgType,
    meta: Meta,
    header: Header,
    body: BytesMut,
    len: usize,
}

/// Turns a byte stream into [`Frame`]s, in the manner of `tokio_util::codec::Decoder`, with
/// one addition for large bodies.
///
/// The transport appends what it reads to a `BytesMut` and calls [`decode`](Self::decode)
/// until it returns `Ok(None)`. Frames that fit are cut out of that buffer without copying:
/// type, metadata and body of a small message are views of it. A body of at least
/// `direct_threshold` bytes gets a buffer of its own, of exactly its size, once the header has
/// been checked: while it is incomplete, [`body_target`](Self::body_target) hands that buffer
/// to the transport, which reads the rest of the body straight into it. Either way each body
/// byte is read from the socket once and copied at most once (only the few bytes that
/// arrived in the shared buffer with the header).
///
/// After an error the decoder keeps returning it: the stream position is lost.
pub struct Decoder {
    limits: Limits,
    direct_threshold: usize,
    types: TypeCache,
    partial: Option<Partial>,
    failed: Option<FrameError>,
}

impl Decoder {
    /// The default body size from which bodies get their own buffer: 256 KiB.
    pub const DEFAULT_DIRECT_THRESHOLD: usize = 256 << 10;

    /// A decoder enforcing `limits` (this side's receive limits). A `max_body` above
    /// [`Limits::MAX_BODY_CEILING`] is lowered to it.
    pub fn new(mut limits: Limits) -> Decoder {
        limits.max_body = limits.max_body.min(Limits::MAX_BODY_CEILING);
        Decoder {
            limits,
            direct_threshold: Decoder::DEFAULT_DIRECT_THRESHOLD,
            types: TypeCache::default(),
            partial: None,
            failed: None,
        }
    }

    /// Sets the body size from which a body gets a buffer of its own.
    pub fn with_direct_threshold(mut self, bytes: usize) -> Decoder {
        self.direct_threshold = bytes.max(1);
        self
    }

    /// The limits this decoder enforces.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Decodes the next frame from the front of `src`.
    pub fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let r = self.decode_inner(src);
        if let Err(e) = &r {
            self.failed = Some(e.clone());
            self.partial = None;
        }
        r
    }

    fn decode_inner(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        if let Some(p) = &mut self.partial {
            let take = src.len().min(p.len - p.body.len());
            p.body.extend_from_slice(&src[..take]);
            src.advance(take);
            return Ok(self.finish_partial());
        }
        let Some(head) = src.first_chunk::<FRAME_HEAD_LEN>() else {
            return Ok(None);
        };
        let head = FrameHead::parse(head, &self.limits)?;
        let prefix = head.prefix_len();
        // Cannot overflow: body_len <= max_body <= 1 TiB (clamped in `new`), prefix < 4 GiB + 280.
        let body_len = head.body_len as usize;
        let total = prefix + body_len;
        if src.len() >= total {
            return self.take_frame(&head, src).map(Some);
        }
        if head.kind == FrameKind::Message
            && body_len >= self.direct_threshold
            && src.len() >= prefix
        {
            let (kind, meta) = self.take_type_and_meta(&head, src)?;
            // The length was checked against max_body in `FrameHead::parse`, but max_body may
            // be more than the host can give: ask, so that a peer's announcement fails this
            // connection instead of aborting the process. (The pages are touched only as the
            // body's bytes arrive.)
            let mut buf = Vec::new();
            buf.try_reserve_exact(body_len)
                .map_err(|_| FrameError::NoMemory { len: head.body_len })?;
            // `Bytes` from an empty `Vec` with capacity, then unique, into `BytesMut`: both
            // documented to keep the allocation (no copy; the capacity stays).
            let mut body = BytesMut::from(Bytes::from(buf));
            debug_assert!(body.capacity() >= body_len);
            let take = src.len().min(body_len);
            body.extend_from_slice(&src[..take]);
            src.advance(take);
            self.partial = Some(Partial {
                kind,
                meta,
                header: Header {
                    flags: head.flags,
                    correlation: head.correlation,
                },
                body,
                len: body_len,
            });
            return Ok(self.finish_partial());
        }
        Ok(None)
    }

    fn finish_partial(&mut self) -> Option<Frame> {
        if self.partial.as_ref()?.body.len() < self.partial.as_ref()?.len {
            return None;
        }
        let p = self.partial.take()?;
        Some(Frame::Message(Message::from_parts(
            p.kind,
            p.meta,
            Body::from(p.body.freeze()),
            p.header,
        )))
    }

    /// Validates type and metadata at the front of `src` (a whole prefix is there), then
    /// consumes them: the type is validated or taken from the cache, the metadata is cut out
    /// of `src` without copying (one reference count) when there is any.
    fn take_type_and_meta(
        &mut self,
        head: &FrameHead,
        src: &mut BytesMut,
    ) -> Result<(MsgType, Meta), FrameError> {
        let t_end = FRAME_HEAD_LEN + head.type_len as usize;
        let meta_len = head.meta_len as usize;
        // By reference, cloned where it goes (moving a `MsgType` through results costs more
        // than the lookup).
        let kind = self.types.lookup(&src[FRAME_HEAD_LEN..t_end])?.clone();
        src.advance(t_end);
        let meta = if meta_len == 0 {
            Meta::new()
        } else {
            // An error ends the stream: what was taken from `src` does not matter then.
            Meta::from_wire(
                src.split_to(meta_len).freeze(),
                self.limits.max_meta_entries as usize,
            )?
        };
        Ok((kind, meta))
    }

    /// Consumes a whole frame from the front of `src`. A message's body is cut out without
    /// copying: one reference count on the read buffer, none for an empty body.
    fn take_frame(&mut self, head: &FrameHead, src: &mut BytesMut) -> Result<Frame, FrameError> {
        let body_len = head.body_len as usize;
        match head.kind {
            FrameKind::Message => {
                let (kind, meta) = self.take_type_and_meta(head, src)?;
                let body = if body_len == 0 {
                    Bytes::new()
                } else {
                    src.split_to(body_len).freeze()
                };
                Ok(Frame::Message(Message::from_parts(
                    kind,
                    meta,
                    Body::from(body),
                    Header {
                        flags: head.flags,
                        correlation: head.correlation,
                    },
                )))
            }
            FrameKind::Close | FrameKind::Stop | FrameKind::Heartbeat => {
                src.advance(FRAME_HEAD_LEN);
                Ok(Frame::Control(match head.kind {
                    FrameKind::Close => Control::Close,
                    FrameKind::Stop => Control::Stop,
                    _ => Control::Heartbeat,
                }))
            }
            FrameKind::Error => {
                let reason = std::str::from_utf8(&src[FRAME_HEAD_LEN..FRAME_HEAD_LEN + body_len])
                    .map_err(|_| FrameError::ReasonNotUtf8)?
                    .to_owned();
                src.advance(FRAME_HEAD_LEN + body_len);
                Ok(Frame::Control(Control::Error(reason)))
            }
        }
    }

    /// While a large body is incomplete: the buffer to read into and how many bytes it still
    /// misses. Read at most that many bytes into its spare capacity, then call
    /// [`decode`](Self::decode) (with the shared buffer, which may be empty).
    pub fn body_target(&mut self) -> Option<(&mut BytesMut, usize)> {
        let p = self.partial.as_mut()?;
        let missing = p.len - p.body.len();
        Some((&mut p.body, missing))
    }

    /// How many more bytes `src` must receive before [`decode`](Self::decode) can make
    /// progress (0 while a large body is read through [`body_target`](Self::body_target)).
    /// A transport reserves at least this much before reading.
    pub fn wanted(&self, src: &BytesMut) -> usize {
        if self.partial.is_some() {
            return 0;
        }
        let Some(head) = src.first_chunk::<FRAME_HEAD_LEN>() else {
            return FRAME_HEAD_LEN - src.len();
        };
        let Ok(head) = FrameHead::parse(head, &self.limits) else {
            return 0;
        };
        let need =
            if head.kind == FrameKind::Message && head.body_len as usize >= self.direct_threshold {
                head.prefix_len()
            } else {
                head.prefix_len() + head.body_len as usize
            };
        need.saturating_sub(src.len())
    }

    /// True at a frame boundary: no partial frame in `src` nor in a body buffer. A stream
    /// that ends here ended cleanly (as far as framing goes).
    pub fn is_at_boundary(&self, src: &BytesMut) -> bool {
        self.partial.is_none() && src.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_body: 1 << 20,
            max_meta_bytes: 256,
            max_meta_entries: 4,
        }
    }

    fn head(kind: u8, flags: u8, type_len: u8, meta: u32, body: u64, corr: u64) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[0] = kind;
        b[1] = flags;
        b[2] = type_len;
        b[4..8].copy_from_slice(&meta.to_le_bytes());
        b[8..16].copy_from_slice(&body.to_le_bytes());
        b[16..24].copy_from_slice(&corr.to_le_bytes());
        b
    }

    #[test]
    fn header_checks_happen_before_allocation() {
        let l = limits();
        assert_eq!(
            FrameHead::parse(&head(1, 0, 1, 0, u64::MAX, 0), &l),
            Err(FrameError::BodyTooLarge {
                len: u64::MAX,
                max: 1 << 20
            })
        );
        assert_eq!(
            FrameHead::parse(&head(1, 0, 1, 257, 0, 0), &l),
            Err(FrameError::MetaTooLarge { len: 257, max: 256 })
        );
        assert_eq!(
            FrameHead::parse(&head(9, 0, 1, 0, 0, 0), &l),
            Err(FrameError::BadKind(9))
        );
        assert_eq!(
            FrameHead::parse(&head(1, 0x10, 1, 0, 0, 0), &l),
            Err(FrameError::Reserved("flags"))
        );
        assert_eq!(
            FrameHead::parse(&head(1, 0, 0, 0, 0, 0), &l),
            Err(FrameError::EmptyType)
        );
        assert!(matches!(
            FrameHead::parse(&head(2, 0, 0, 0, 1, 0), &l),
            Err(FrameError::BadControl(FrameKind::Close, _))
        ));
        assert!(matches!(
            FrameHead::parse(&head(4, 0, 0, 0, 1025, 0), &l),
            Err(FrameError::BadControl(FrameKind::Error, _))
        ));
        let mut h = head(1, 0, 1, 0, 0, 0);
        h[3] = 1;
        assert_eq!(
            FrameHead::parse(&h, &l),
            Err(FrameError::Reserved("byte 3"))
        );
    }

    /// 25 bytes announcing a body the host cannot give, under a `max_body` that allows it:
    /// an error for this connection, not an abort of the process. (Where the kernel
    /// overcommits without limit, the reservation succeeds and costs only address space; the
    /// decoder then waits for the body.)
    #[test]
    fn a_body_the_host_cannot_give_fails_the_connection_not_the_process() {
        let huge = Limits::MAX_BODY_CEILING;
        let mut d = Decoder::new(Limits {
            max_body: huge,
            ..limits()
        });
        let mut src = BytesMut::new();
        src.extend_from_slice(&head(1, 0, 1, 0, huge, 0));
        src.extend_from_slice(b"t");
        match d.decode(&mut src) {
            Err(e) => {
                assert_eq!(e, FrameError::NoMemory { len: huge });
                assert!(e.to_string().contains("lower max_body"), "{e:#}");
                assert_eq!(d.decode(&mut src), Err(e), "the error is sticky");
            }
            Ok(None) => {
                let overcommit = std::fs::read_to_string("/proc/sys/vm/overcommit_memory");
                assert_eq!(
                    overcommit.ok().as_deref().map(str::trim),
                    Some("1"),
                    "reserved 1 TiB"
                );
                assert_eq!(
                    d.body_target().map(|(_, missing)| missing as u64),
                    Some(huge)
                );
            }
            Ok(Some(f)) => panic!("a frame out of 25 bytes: {f:?}"),
        }
    }

    #[test]
    fn large_body_goes_to_its_own_buffer() {
        let mut d = Decoder::new(limits()).with_direct_threshold(1000);
        let mut src = BytesMut::new();
        src.extend_from_slice(&head(1, 1, 1, 0, 5000, 42));
        src.extend_from_slice(b"t");
        src.extend_from_slice(&[7u8; 100]);
        assert_eq!(d.wanted(&src), 0);
        assert_eq!(d.decode(&mut src), Ok(None));
        assert!(src.is_empty());
        assert!(!d.is_at_boundary(&src));
        let (buf, missing) = d.body_target().unwrap();
        assert_eq!(missing, 4900);
        assert_eq!(buf.capacity(), 5000);
        buf.extend_from_slice(&[7u8; 4900]);
        let Some(Frame::Message(m)) = d.decode(&mut src).unwrap() else {
            panic!("no message")
        };
        assert_eq!(m.body().len(), 5000);
        assert_eq!(m.header().correlation, 42);
        assert_eq!(m.header().flags, Flags::REQUEST);
        assert!(d.is_at_boundary(&src));
    }

    #[test]
    fn errors_are_sticky() {
        let mut d = Decoder::new(limits());
        let mut src = BytesMut::from(&head(7, 0, 0, 0, 0, 0)[..]);
        assert_eq!(d.decode(&mut src), Err(FrameError::BadKind(7)));
        let mut good = BytesMut::from(&head(2, 0, 0, 0, 0, 0)[..]);
        assert_eq!(d.decode(&mut good), Err(FrameError::BadKind(7)));
    }

    #[test]
    fn control_frames() {
        let mut d = Decoder::new(limits());
        let mut src = BytesMut::new();
        src.extend_from_slice(&head(3, 0, 0, 0, 0, 0));
        src.extend_from_slice(&head(4, 0, 0, 0, 3, 0));
        src.extend_from_slice(b"bad");
        src.extend_from_slice(&head(5, 0, 0, 0, 0, 0));
        src.extend_from_slice(&head(2, 0, 0, 0, 0, 0));
        assert_eq!(d.decode(&mut src), Ok(Some(Frame::Control(Control::Stop))));
        assert_eq!(
            d.decode(&mut src),
            Ok(Some(Frame::Control(Control::Error("bad".into()))))
        );
        assert_eq!(
            d.decode(&mut src),
            Ok(Some(Frame::Control(Control::Heartbeat)))
        );
        assert_eq!(d.decode(&mut src), Ok(Some(Frame::Control(Control::Close))));
        assert_eq!(d.decode(&mut src), Ok(None));
        // A heartbeat carries nothing.
        let mut src = BytesMut::from(&head(5, 0, 0, 0, 1, 0)[..]);
        assert_eq!(
            Decoder::new(limits()).decode(&mut src),
            Err(FrameError::BadControl(
                FrameKind::Heartbeat,
                "body too long"
            ))
        );
    }
}
