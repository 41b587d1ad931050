//! The send side: frames gathered into a list of buffers for one vectored write.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::frame::{Control, FrameHead, FrameKind, MAX_ERROR_REASON};
use crate::message::Message;

/// Frames gathered for one vectored write (`writev`, or one io_uring submission).
///
/// Headers, types and metadata are encoded into one growing buffer; a body of at most
/// `coalesce_max` bytes is copied after its header in the same buffer (one iovec for a run
/// of small messages); a larger body is appended as a buffer of its own, the very `Bytes`
/// the user sent, so it is never copied in user space.
#[derive(Debug)]
pub struct Batch {
    chunks: Vec<Bytes>,
    head: BytesMut,
    coalesce_max: usize,
    messages: usize,
    bytes: usize,
}

impl Default for Batch {
    fn default() -> Batch {
        Batch::new(Batch::DEFAULT_COALESCE_MAX)
    }
}

impl Batch {
    /// Bodies up to this size are copied next to their header by default: below it, one
    /// memcpy is cheaper than one more iovec for the kernel to walk.
    pub const DEFAULT_COALESCE_MAX: usize = 512;

    /// An empty batch copying bodies of at most `coalesce_max` bytes.
    pub fn new(coalesce_max: usize) -> Batch {
        Batch {
            chunks: Vec::new(),
            head: BytesMut::new(),
            coalesce_max,
            messages: 0,
            bytes: 0,
        }
    }

    /// Appends `msg`'s frame. Limits are the caller's business (see
    /// [`Limits::check`](super::Limits::check)); the type and metadata lengths fit their
    /// fields by construction.
    // Inlined into the transports' `start_send`: called out of line, the message was copied
    // into the argument first, and that 16-byte copy of a header just written with narrower
    // stores stalled on store forwarding (a third of `start_send`'s samples in `perf`).
    #[inline]
    pub fn push_message(&mut self, msg: Message) {
        let head = FrameHead::for_message(&msg);
        let (kind, meta, body, _) = msg.into_parts();
        self.reserve(head.prefix_len());
        head.encode(&mut self.head);
        self.head.put_slice(kind.as_bytes());
        self.head.put_slice(meta.as_wire());
        self.bytes += head.prefix_len() + body.len();
        self.messages += 1;
        let body = match body.into_bytes() {
            Ok(b) => b,
            // No device bodies on byte streams: the transports stage them before this point.
            Err(_) => unreachable!("device bodies are staged by the transport"),
        };
        if body.is_empty() {
            return;
        }
        if body.len() <= self.coalesce_max {
            self.head.put_slice(&body);
        } else {
            self.seal_head();
            self.chunks.push(body);
        }
    }

    /// Appends a control frame.
    pub fn push_control(&mut self, control: &Control) {
        let (kind, reason): (FrameKind, &[u8]) = match control {
            Control::Close => (FrameKind::Close, &[]),
            Control::Stop => (FrameKind::Stop, &[]),
            Control::Heartbeat => (FrameKind::Heartbeat, &[]),
            Control::Error(r) => {
                let mut end = r.len().min(MAX_ERROR_REASON);
                while !r.is_char_boundary(end) {
                    end -= 1;
                }
                (FrameKind::Error, &r.as_bytes()[..end])
            }
        };
        let head = FrameHead::for_control(kind, reason.len());
        self.reserve(head.prefix_len() + reason.len());
        head.encode(&mut self.head);
        self.head.put_slice(reason);
        self.bytes += head.prefix_len() + reason.len();
    }

    fn reserve(&mut self, n: usize) {
        if self.head.capacity() - self.head.len() < n {
            // Grow in steps big enough for a run of small frames.
            self.head.reserve(n.max(16 << 10));
        }
    }

    fn seal_head(&mut self) {
        if !self.head.is_empty() {
            self.chunks.push(self.head.split().freeze());
        }
    }

    /// Messages pushed since the last [`take`](Self::take).
    pub fn messages(&self) -> usize {
        self.messages
    }

    /// Bytes pushed since the last [`take`](Self::take).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Buffers the batch would hand out now (sealed ones plus the open header buffer).
    pub fn chunk_count(&self) -> usize {
        self.chunks.len() + usize::from(!self.head.is_empty())
    }

    /// True when nothing was pushed since the last [`take`](Self::take).
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Appends the buffers to write to `out`, in order; resets the batch (like
    /// [`take`](Self::take), without a new `Vec`).
    pub fn take_into(&mut self, out: &mut Vec<Bytes>) {
        self.seal_head();
        self.messages = 0;
        self.bytes = 0;
        out.append(&mut self.chunks);
    }

    /// The buffers to write, in order; resets the batch. The header buffer's spare capacity
    /// is kept for the next batch.
    pub fn take(&mut self) -> Vec<Bytes> {
        self.seal_head();
        self.messages = 0;
        self.bytes = 0;
        std::mem::take(&mut self.chunks)
    }
}

/// Drops the first `n` bytes of `chunks` after a write that took `n` bytes: buffers written
/// entirely are removed, a buffer written in part is advanced (no copy).
///
/// # Panics
/// If `n` is larger than the total length (a write cannot take more than it was given).
pub fn advance(chunks: &mut Vec<Bytes>, mut n: usize) {
    let mut done = 0;
    for c in chunks.iter_mut() {
        if n < c.len() {
            c.advance(n);
            n = 0;
            break;
        }
        n -= c.len();
        done += 1;
    }
    assert!(n == 0, "advance past the end of the buffers");
    chunks.drain(..done);
}

/// Keeps the first `n` bytes of `chunks` and drops the rest (buffers past them are removed,
/// the buffer `n` ends in is cut, without a copy).
pub fn truncate(chunks: &mut Vec<Bytes>, mut n: usize) {
    let mut keep = 0;
    for c in chunks.iter_mut() {
        if n == 0 {
            break;
        }
        keep += 1;
        if n <= c.len() {
            c.truncate(n);
            n = 0;
        } else {
            n -= c.len();
        }
    }
    chunks.truncate(keep);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Message;

    #[test]
    fn small_bodies_coalesce_large_bodies_stay_separate() {
        let mut b = Batch::new(8);
        b.push_message(Message::new("a").unwrap().with_body(&b"small"[..]));
        b.push_message(Message::new("a").unwrap().with_body(&b"small"[..]));
        let big = Bytes::from(vec![1u8; 100]);
        b.push_message(Message::new("a").unwrap().with_body(big.clone()));
        b.push_control(&Control::Close);
        assert_eq!(b.messages(), 3);
        let chunks = b.take();
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks[0].len(), 2 * (24 + 1 + 5) + 24 + 1);
        // the big body is the caller's buffer, not a copy
        assert_eq!(chunks[1].as_ptr(), big.as_ptr());
        assert_eq!(chunks[2].len(), 24);
        assert!(b.is_empty());
    }

    #[test]
    fn truncate_keeps_a_prefix() {
        let chunks = || vec![Bytes::from_static(b"abc"), Bytes::from_static(b"defg")];
        for (n, want) in [
            (0, &[][..]),
            (2, &[&b"ab"[..]][..]),
            (3, &[&b"abc"[..]][..]),
            (5, &[&b"abc"[..], &b"de"[..]][..]),
            (7, &[&b"abc"[..], &b"defg"[..]][..]),
            (9, &[&b"abc"[..], &b"defg"[..]][..]),
        ] {
            let mut c = chunks();
            truncate(&mut c, n);
            assert_eq!(c, want, "first {n} bytes");
        }
    }

    #[test]
    fn advance_over_partial_writes() {
        let mut c = vec![Bytes::from_static(b"abc"), Bytes::from_static(b"defg")];
        advance(&mut c, 2);
        assert_eq!(c, [&b"c"[..], &b"defg"[..]]);
        advance(&mut c, 3);
        assert_eq!(c, [&b"fg"[..]]);
        advance(&mut c, 2);
        assert!(c.is_empty());
    }

    #[test]
    fn error_reason_is_cut_on_a_char_boundary() {
        let mut b = Batch::default();
        b.push_control(&Control::Error("é".repeat(600)));
        let c = b.take();
        assert_eq!(c[0].len(), 24 + 1024);
    }
}
