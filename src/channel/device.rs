//! Bodies sent from device memory in pieces, and put back together.
//!
//! On the wire (every byte-stream transport alike): one frame with [`Flags::DEVICE`], the
//! message's type, metadata and header, and an 8-byte body, the total length (little
//! endian); then the body in frames of at most the sender's chunk size, each with the same
//! type, no metadata, correlation 0, and [`Flags::MORE`] on every one but the last. A body
//! of 0 bytes is the announcing frame alone, without `MORE`. One `Sender` sends one body at
//! a time, so its frames are never interleaved with other messages.
//!
//! The receiving half ([`Assembler`]) is in every build, so that a peer without the `cuda`
//! feature still receives such a body (into host memory); the sending half
//! (`Stage`) needs a device and comes with the feature.

use bytes::Bytes;

use crate::error::{Error, ErrorKind, Result};
use crate::message::{Body, Flags, Header, Message, Meta, MsgType};

/// Puts bodies sent in pieces back together on the receiving side.
pub(super) struct Assembler {
    max_body: u64,
    /// Boxed: the receiver stays small for the common case.
    open: Option<Box<Assembly>>,
    #[cfg(feature = "cuda")]
    pub(super) landing: Option<crate::device::Gpu>,
}

struct Assembly {
    kind: MsgType,
    meta: Meta,
    header: Header,
    total: usize,
    got: usize,
    into: Target,
}

enum Target {
    Host(Vec<u8>),
    #[cfg(feature = "cuda")]
    Device(crate::device::DeviceBody),
}

fn violation(what: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!("a body sent in pieces from device memory is malformed: {what}"),
    )
}

impl Assembler {
    pub(super) fn new(setup: &crate::transport::ChannelSetup) -> Assembler {
        Assembler {
            max_body: setup.max_body,
            open: None,
            #[cfg(feature = "cuda")]
            landing: setup.landing.clone(),
        }
    }

    /// True when `msg` goes to the user as it is: the common case, one branch.
    #[inline]
    pub(super) fn passes(&self, msg: &Message) -> bool {
        self.open.is_none() && !msg.header().flags.intersects(Flags::CHANNEL)
    }

    /// Takes `msg` as a piece of a body: `Some` once the message is whole. An error is the
    /// end of the connection (the stream position is lost).
    pub(super) fn take(&mut self, msg: Message) -> Result<Option<Message>> {
        match self.open.take() {
            None => self.announce(msg),
            Some(asm) => self.piece(asm, msg),
        }
    }

    fn announce(&mut self, msg: Message) -> Result<Option<Message>> {
        let (kind, meta, body, header) = msg.into_parts();
        let flags = header.flags;
        if !flags.contains(Flags::DEVICE) {
            return Err(violation(format!(
                "a frame of type {kind} continues a body that was never announced"
            )));
        }
        let total = body
            .as_bytes()
            .and_then(|b| <[u8; 8]>::try_from(b.as_ref()).ok())
            .map(u64::from_le_bytes)
            .ok_or_else(|| violation(format!("the announcement of {kind} is not 8 bytes")))?;
        if total > self.max_body {
            return Err(Error::new(
                ErrorKind::LimitExceeded,
                format!(
                    "a body of {total} bytes sent from device memory exceeds max_body of {}",
                    self.max_body
                ),
            ));
        }
        if flags.contains(Flags::MORE) != (total > 0) {
            return Err(violation(format!(
                "the announcement of {total} bytes of {kind} has MORE {}",
                if total > 0 { "clear" } else { "set" }
            )));
        }
        let header = Header {
            flags: flags.without(Flags::CHANNEL),
            ..header
        };
        let total = total as usize; // within max_body, within memory
        if total == 0 {
            return Ok(Some(Message::from_parts(kind, meta, Body::new(), header)));
        }
        let into = self.target(total, &kind)?;
        self.open = Some(Box::new(Assembly {
            kind,
            meta,
            header,
            total,
            got: 0,
            into,
        }));
        Ok(None)
    }

    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn target(&self, total: usize, kind: &MsgType) -> Result<Target> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.landing {
            match gpu.alloc(total) {
                Ok(d) => return Ok(Target::Device(d)),
                Err(e) => tracing::warn!(
                    %kind, bytes = total, error = %e,
                    "no device memory for a body sent from device memory: it lands in host memory"
                ),
            }
        }
        // Reserved with the first piece, unless that is the whole body (`rdma://` sends it
        // in one piece: it is kept as it came, without a copy).
        Ok(Target::Host(Vec::new()))
    }

    fn piece(&mut self, mut asm: Box<Assembly>, msg: Message) -> Result<Option<Message>> {
        let header = msg.header();
        if header.flags.without(Flags::MORE) != Flags::NONE
            || header.correlation != 0
            || !msg.meta().is_empty()
            || msg.kind() != &asm.kind
        {
            return Err(violation(format!(
                "a piece of {} has type {}, flags {:?}, correlation {} and {} metadata entries",
                asm.kind,
                msg.kind(),
                header.flags,
                header.correlation,
                msg.meta().len()
            )));
        }
        let bytes: Bytes = msg
            .into_body()
            .into_bytes()
            .map_err(|_| violation("a piece is not in host memory"))?;
        let end = asm.got + bytes.len();
        if bytes.is_empty() || end > asm.total {
            return Err(violation(format!(
                "a piece of {} bytes at {} of {}",
                bytes.len(),
                asm.got,
                asm.total
            )));
        }
        if header.flags.contains(Flags::MORE) != (end < asm.total) {
            return Err(violation(format!(
                "MORE is {} at {end} of {} bytes",
                if end < asm.total { "clear" } else { "set" },
                asm.total
            )));
        }
        match &mut asm.into {
            Target::Host(v) if end == asm.total && v.is_empty() => {
                let asm = *asm;
                return Ok(Some(Message::from_parts(
                    asm.kind,
                    asm.meta,
                    Body::from(bytes),
                    asm.header,
                )));
            }
            Target::Host(v) => {
                if v.is_empty() {
                    v.try_reserve_exact(asm.total).map_err(|_| {
                        Error::new(
                            ErrorKind::LimitExceeded,
                            format!(
                                "no memory for a body of {} bytes (within max_body, but the \
                                 allocation failed; lower max_body)",
                                asm.total
                            ),
                        )
                    })?;
                }
                v.extend_from_slice(&bytes)
            }
            #[cfg(feature = "cuda")]
            Target::Device(d) => d.gpu().backend().copy_in(&**d.mem(), asm.got, &bytes)?,
        }
        asm.got = end;
        if end < asm.total {
            self.open = Some(asm);
            return Ok(None);
        }
        let asm = *asm;
        let body = match asm.into {
            Target::Host(v) => Body::from(v),
            #[cfg(feature = "cuda")]
            Target::Device(d) => {
                d.gpu().backend().finish_copy_in(&**d.mem())?;
                Body::from(d)
            }
        };
        Ok(Some(Message::from_parts(
            asm.kind, asm.meta, body, asm.header,
        )))
    }

    /// The stream ended: an error when it ended in the middle of a body.
    pub(super) fn end(&mut self) -> Option<Error> {
        self.open.take().map(|asm| {
            Error::new(
                ErrorKind::ConnectionLost,
                format!(
                    "the connection ended {} bytes into a body of {} bytes of type {} sent from \
                     device memory",
                    asm.got, asm.total, asm.kind
                ),
            )
        })
    }
}

#[cfg(feature = "cuda")]
pub(crate) use stage::{Stage, drain};

#[cfg(feature = "cuda")]
mod stage {
    use std::collections::VecDeque;
    use std::task::{Context, Poll, ready};

    use bytes::Bytes;

    use crate::device::{DeviceBody, Ticket};
    use crate::error::{Error, ErrorKind, Result};
    use crate::message::{Body, Flags, Header, Message, Meta, MsgType};
    use crate::transport::SendHalf;

    /// Copies in flight per body: enough that the copy of the next chunk overlaps the
    /// transfer of this one; the pool bounds the rest.
    const DEPTH: usize = 3;

    /// Sends device bodies in pieces on the sending side.
    pub(crate) struct Stage {
        moves_objects: bool,
        /// Boxed: the sender stays small for the common case.
        out: Option<Box<Outgoing>>,
        failed: Option<String>,
        told: bool,
    }

    struct Outgoing {
        kind: MsgType,
        body: DeviceBody,
        /// Bytes whose copy has started, and bytes handed to the transport.
        next: usize,
        sent: usize,
        copies: VecDeque<Ticket>,
        /// The last frame handed over still needs `poll_submit`.
        submit: bool,
    }

    impl Stage {
        pub(crate) fn new(setup: &crate::transport::ChannelSetup) -> Stage {
            Stage {
                moves_objects: setup.moves_objects,
                out: None,
                failed: None,
                told: false,
            }
        }

        /// True when `msg` must go through here.
        #[inline]
        pub(crate) fn wants(&self, msg: &Message) -> bool {
            !self.moves_objects && msg.body().as_device().is_some()
        }

        /// True while a body is being sent.
        pub(crate) fn busy(&self) -> bool {
            self.out.is_some()
        }

        /// Bytes of the body in progress not yet handed to the transport.
        pub(crate) fn pending_bytes(&self) -> Option<(usize, usize)> {
            self.out.as_ref().map(|o| (o.sent, o.body.len()))
        }

        fn check(&self) -> Result<()> {
            match &self.failed {
                Some(why) => Err(Error::new(
                    ErrorKind::ConnectionLost,
                    format!(
                        "the channel failed in the middle of a body sent from device memory: {why}"
                    ),
                )),
                None => Ok(()),
            }
        }

        /// Announces `msg`'s body (the caller saw `poll_ready` ready); the pieces follow in
        /// [`poll_drive`](Self::poll_drive).
        pub(crate) fn start(
            &mut self,
            half: &mut dyn SendHalf,
            msg: Message,
            peer: &str,
        ) -> Result<()> {
            self.check()?;
            debug_assert!(
                self.out.is_none(),
                "poll_ready drives the last body to its end"
            );
            let (kind, meta, body, header) = msg.into_parts();
            let device = body.as_device().expect("wants() checked").clone();
            if !self.told {
                self.told = true;
                let staging = device.gpu().staging();
                tracing::info!(
                    peer,
                    path = "staged",
                    chunk = staging.chunk,
                    buffers = staging.buffers,
                    "device bodies to this peer are staged through host buffers of the device"
                );
            }
            let len = device.len();
            let mut flags = header.flags.union(Flags::DEVICE);
            if len > 0 {
                flags = flags.union(Flags::MORE);
            }
            let fallback = (meta.clone(), header);
            let announce = Message::from_parts(
                kind.clone(),
                meta,
                Body::from(Bytes::copy_from_slice(&(len as u64).to_le_bytes())),
                Header { flags, ..header },
            );
            if let Err(mut e) = half.start_send(announce) {
                // Not handed over: give the caller its message back.
                let (meta, header) = match e.take_message() {
                    Some(m) => {
                        let (_, meta, _, h) = m.into_parts();
                        (meta, h)
                    }
                    None => fallback,
                };
                let header = Header {
                    flags: header.flags.without(Flags::CHANNEL),
                    ..header
                };
                return Err(e.with_message(Message::from_parts(
                    kind,
                    meta,
                    Body::from(device),
                    header,
                )));
            }
            if len > 0 {
                self.out = Some(Box::new(Outgoing {
                    kind,
                    body: device,
                    next: 0,
                    sent: 0,
                    copies: VecDeque::with_capacity(DEPTH),
                    submit: true,
                }));
            }
            Ok(())
        }

        /// Sends the rest of the body in progress; ready when all of it is handed over.
        pub(crate) fn poll_drive(
            &mut self,
            half: &mut dyn SendHalf,
            cx: &mut Context<'_>,
        ) -> Poll<Result<()>> {
            self.check()?;
            let Some(out) = self.out.as_mut() else {
                return Poll::Ready(Ok(()));
            };
            let r = ready!(out.poll(half, cx));
            self.out = None;
            if let Err(e) = &r {
                // The peer has part of a body: nothing else can follow on this channel.
                self.failed = Some(e.to_string());
            }
            Poll::Ready(r)
        }
    }

    /// Stages `body` as a channel would and hands each piece to `each` (for the benchmark
    /// of the pipeline against a plain copy, and for tests).
    pub(crate) async fn drain(
        body: DeviceBody,
        each: impl FnMut(Bytes) + Send + Sync + 'static,
    ) -> Result<()> {
        struct Collect<F>(F);
        impl<F: FnMut(Bytes) + Send + Sync + 'static> SendHalf for Collect<F> {
            fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<()>> {
                Poll::Ready(Ok(()))
            }
            fn start_send(&mut self, msg: Message) -> Result<()> {
                let (_, _, body, header) = msg.into_parts();
                if !header.flags.contains(Flags::DEVICE) {
                    (self.0)(body.into_bytes().expect("pieces are host bytes"));
                }
                Ok(())
            }
            fn poll_submit(&mut self, _: &mut Context<'_>) -> Poll<Result<()>> {
                Poll::Ready(Ok(()))
            }
            fn poll_flush(&mut self, _: &mut Context<'_>) -> Poll<Result<()>> {
                Poll::Ready(Ok(()))
            }
            fn poll_close(&mut self, _: &mut Context<'_>) -> Poll<Result<()>> {
                Poll::Ready(Ok(()))
            }
        }
        let mut half = Collect(each);
        let mut stage = Stage {
            moves_objects: false,
            out: None,
            failed: None,
            told: true,
        };
        let msg = Message::new("hf.bench")?.with_body(body);
        stage.start(&mut half, msg, "bench")?;
        std::future::poll_fn(|cx| stage.poll_drive(&mut half, cx)).await
    }

    impl Outgoing {
        fn poll(&mut self, half: &mut dyn SendHalf, cx: &mut Context<'_>) -> Poll<Result<()>> {
            let gpu = self.body.gpu().clone();
            let (len, chunk) = (self.body.len(), gpu.staging().chunk);
            loop {
                if self.submit {
                    ready!(half.poll_submit(cx))?;
                    self.submit = false;
                }
                if self.sent == len {
                    return Poll::Ready(Ok(()));
                }
                while self.copies.len() < DEPTH && self.next < len {
                    match gpu.pool().poll_take(gpu.backend(), cx) {
                        Poll::Ready(buf) => {
                            let n = chunk.min(len - self.next);
                            self.copies
                                .push_back(Ticket::start(&self.body, self.next, buf?, n)?);
                            self.next += n;
                        }
                        // Woken when the transport gives a buffer back.
                        Poll::Pending => break,
                    }
                }
                let Some(front) = self.copies.front_mut() else {
                    return Poll::Pending;
                };
                ready!(half.poll_ready(cx))?;
                let buf = ready!(front.poll(cx))?;
                self.copies.pop_front();
                self.sent += buf.as_ref().len();
                let flags = if self.sent < len {
                    Flags::MORE
                } else {
                    Flags::NONE
                };
                let piece = Message::from_parts(
                    self.kind.clone(),
                    Meta::new(),
                    Body::from(Bytes::from_owner(buf)),
                    Header {
                        flags,
                        correlation: 0,
                    },
                );
                half.start_send(piece)?;
                self.submit = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::ChannelSetup;

    fn asm(max_body: u64) -> Assembler {
        Assembler::new(&ChannelSetup::with_max_body(max_body))
    }

    fn frame(kind: &str, flags: Flags, body: &[u8]) -> Message {
        Message::new(kind)
            .unwrap()
            .with_header(Header {
                flags,
                correlation: 0,
            })
            .with_body(Bytes::copy_from_slice(body))
    }

    fn announce(total: u64) -> Message {
        let more = if total > 0 { Flags::MORE } else { Flags::NONE };
        frame("t", Flags::DEVICE.union(more), &total.to_le_bytes())
    }

    fn kind_of(r: Result<Option<Message>>) -> ErrorKind {
        r.map(drop).unwrap_err().kind()
    }

    #[test]
    fn whole_body_from_pieces() {
        let mut a = asm(100);
        assert!(a.take(announce(5)).unwrap().is_none());
        assert!(a.take(frame("t", Flags::MORE, b"ab")).unwrap().is_none());
        let m = a.take(frame("t", Flags::NONE, b"cde")).unwrap().unwrap();
        assert_eq!(m.body().as_bytes().unwrap(), "abcde");
        assert_eq!(m.header().flags, Flags::NONE);
        assert!(a.end().is_none());
        let m = a.take(announce(0)).unwrap().unwrap();
        assert!(m.body().is_empty());
    }

    #[test]
    fn violations_are_errors() {
        assert_eq!(kind_of(asm(4).take(announce(5))), ErrorKind::LimitExceeded);
        assert_eq!(
            kind_of(asm(9).take(frame("t", Flags::MORE, b"x"))),
            ErrorKind::Protocol
        );
        assert_eq!(
            kind_of(asm(9).take(frame("t", Flags::DEVICE, b"short"))),
            ErrorKind::Protocol
        );
        // MORE clear on a non-empty announcement.
        assert_eq!(
            kind_of(asm(9).take(frame("t", Flags::DEVICE, &5u64.to_le_bytes()))),
            ErrorKind::Protocol
        );
        let started = || {
            let mut a = asm(9);
            a.take(announce(4)).unwrap();
            a
        };
        // Too long, MORE on the last piece, MORE missing early, another type, empty.
        assert_eq!(
            kind_of(started().take(frame("t", Flags::NONE, b"abcde"))),
            ErrorKind::Protocol
        );
        assert_eq!(
            kind_of(started().take(frame("t", Flags::MORE, b"abcd"))),
            ErrorKind::Protocol
        );
        assert_eq!(
            kind_of(started().take(frame("t", Flags::NONE, b"ab"))),
            ErrorKind::Protocol
        );
        assert_eq!(
            kind_of(started().take(frame("u", Flags::MORE, b"ab"))),
            ErrorKind::Protocol
        );
        assert_eq!(
            kind_of(started().take(frame("t", Flags::MORE, b""))),
            ErrorKind::Protocol
        );
        assert_eq!(kind_of(started().take(announce(2))), ErrorKind::Protocol);
        // Cut off.
        let mut a = started();
        a.take(frame("t", Flags::MORE, b"ab")).unwrap();
        assert_eq!(a.end().unwrap().kind(), ErrorKind::ConnectionLost);
    }
}
