//! The public error type.
//!
//! One opaque [`Error`] crosses the public API (in the manner of hyper's), carrying an
//! [`ErrorKind`] to match on, a human-readable detail, an optional source and — for a send
//! that was refused after the message was handed over — the [`Message`] itself, so nothing is
//! lost. The wording of [`Display`](std::fmt::Display) is meant for logs and people and may
//! change between releases: match on [`Error::kind`], not on text.

use std::borrow::Cow;
use std::fmt;
use std::io;

use crate::message::{InvalidMeta, InvalidType, Message};

/// A `Result` whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, coarsely: the thing to match on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A message type is not a valid dotted name (see [`MsgType`](crate::MsgType)).
    InvalidType,
    /// A metadata key or value is malformed (see [`Meta`](crate::Meta)).
    InvalidMeta,
    /// A URL could not be parsed.
    InvalidUrl,
    /// The URL's scheme is unknown, or its transport is not compiled in.
    UnsupportedScheme,
    /// A message exceeds a configured or negotiated limit. The message is returned by
    /// [`Error::take_message`] when it had been handed over.
    LimitExceeded,
    /// The peer broke the wire protocol (bad magic, unsupported version, malformed or
    /// oversized frame). The connection is closed.
    Protocol,
    /// An operating-system I/O error; [`Error::io_kind`] tells which.
    Io,
    /// The peer went away without closing the channel (process died, connection reset,
    /// connection lost). Both halves of the channel report it.
    ConnectionLost,
    /// The channel, or the direction used, is closed: locally, or because the peer stopped
    /// receiving.
    Closed,
    /// [`Sender::try_send`](crate::Sender::try_send) found the send queue full; the message is
    /// in [`Error::take_message`].
    Full,
    /// A deadline passed: connect, handshake, or a peer that stalled mid-frame.
    TimedOut,
    /// Nothing listens at that address: the connection was refused (tcp), or no listener is
    /// bound to the name (inproc).
    ConnectionRefused,
    /// A host name has no addresses.
    NotFound,
    /// The address is already bound.
    AddrInUse,
    /// The transport or engine is not available on this host (for example io_uring forced
    /// with `HYPERFRAMES_IO=uring` where the kernel refuses it).
    Unavailable,
    /// Things that must belong together do not: [`Sender::reunite`](crate::Sender::reunite)
    /// given halves of two different channels, a device body given to another device, a
    /// message whose header sets the flags the channel reserves ([`Flags::CHANNEL`](crate::Flags::CHANNEL)).
    Mismatch,
    /// A configuration value is out of range.
    Config,
    /// Authentication failed (`tls://`): the peer's certificate was refused (unknown CA,
    /// expired, not valid for the name connected to, missing where one is required), or the
    /// peer refused ours. The detail says which side refused what.
    Auth,
    /// The peer's handler failed the request: [`middleware::Client`](crate::middleware::Client)
    /// received the error reply that [`middleware::serve`](crate::middleware::serve()) sends for
    /// a failed request. The detail is the peer's error text.
    Remote,
    /// A tower service failed (a make-service that can no longer make services, a handler's
    /// `poll_ready`); the source is its error.
    Service,
}

/// Each kind's stable name, as error replies carry it (`error-kind`).
const CODES: [(ErrorKind, &str); 20] = [
    (ErrorKind::InvalidType, "invalid-type"),
    (ErrorKind::InvalidMeta, "invalid-meta"),
    (ErrorKind::InvalidUrl, "invalid-url"),
    (ErrorKind::UnsupportedScheme, "unsupported-scheme"),
    (ErrorKind::LimitExceeded, "limit-exceeded"),
    (ErrorKind::Protocol, "protocol"),
    (ErrorKind::Io, "io"),
    (ErrorKind::ConnectionLost, "connection-lost"),
    (ErrorKind::Closed, "closed"),
    (ErrorKind::Full, "full"),
    (ErrorKind::TimedOut, "timed-out"),
    (ErrorKind::ConnectionRefused, "connection-refused"),
    (ErrorKind::NotFound, "not-found"),
    (ErrorKind::AddrInUse, "addr-in-use"),
    (ErrorKind::Unavailable, "unavailable"),
    (ErrorKind::Mismatch, "mismatch"),
    (ErrorKind::Config, "config"),
    (ErrorKind::Auth, "auth"),
    (ErrorKind::Remote, "remote"),
    (ErrorKind::Service, "service"),
];

impl ErrorKind {
    /// The kind's stable name (`invalid-type`, `service`, ...): what an error reply of
    /// [`middleware::serve`](crate::middleware::serve()) carries, and what
    /// [`from_code`](Self::from_code) reads back. Unlike the `Display` wording, it does not
    /// change between releases.
    pub fn code(self) -> &'static str {
        CODES
            .iter()
            .find(|(k, _)| *k == self)
            .map_or("unknown", |(_, c)| c)
    }

    /// The kind named `code`; `None` for a name this release does not know (a newer
    /// peer's).
    pub fn from_code(code: &str) -> Option<ErrorKind> {
        CODES.iter().find(|(_, c)| *c == code).map(|(k, _)| *k)
    }

    fn describe(self) -> &'static str {
        match self {
            ErrorKind::InvalidType => "invalid message type",
            ErrorKind::InvalidMeta => "invalid metadata",
            ErrorKind::InvalidUrl => "invalid URL",
            ErrorKind::UnsupportedScheme => "unsupported URL scheme",
            ErrorKind::LimitExceeded => "limit exceeded",
            ErrorKind::Protocol => "protocol error",
            ErrorKind::Io => "I/O error",
            ErrorKind::ConnectionLost => "connection lost",
            ErrorKind::Closed => "channel closed",
            ErrorKind::Full => "send queue full",
            ErrorKind::TimedOut => "timed out",
            ErrorKind::ConnectionRefused => "connection refused",
            ErrorKind::NotFound => "not found",
            ErrorKind::AddrInUse => "address in use",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Mismatch => "mismatched halves",
            ErrorKind::Config => "invalid configuration",
            ErrorKind::Auth => "authentication failed",
            ErrorKind::Remote => "remote error",
            ErrorKind::Service => "service failed",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// The error of every fallible hyperframes operation.
pub struct Error {
    inner: Box<Inner>,
}

struct Inner {
    kind: ErrorKind,
    detail: Cow<'static, str>,
    io_kind: Option<io::ErrorKind>,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
    message: Option<Message>,
    /// [`ErrorKind::Remote`]: the kind the peer reported.
    remote: Option<ErrorKind>,
}

impl Error {
    pub(crate) fn new(kind: ErrorKind, detail: impl Into<Cow<'static, str>>) -> Error {
        Error {
            inner: Box::new(Inner {
                kind,
                detail: detail.into(),
                io_kind: None,
                source: None,
                message: None,
                remote: None,
            }),
        }
    }

    /// An I/O error, classified: refused/reset/aborted/broken pipe become their own kinds
    /// where they mean something to a channel user.
    #[cfg_attr(not(any(feature = "tcp", feature = "shm")), allow(dead_code))]
    pub(crate) fn io(context: impl Into<Cow<'static, str>>, err: io::Error) -> Error {
        let kind = match err.kind() {
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof => ErrorKind::ConnectionLost,
            io::ErrorKind::AddrInUse => ErrorKind::AddrInUse,
            io::ErrorKind::ConnectionRefused => ErrorKind::ConnectionRefused,
            io::ErrorKind::TimedOut => ErrorKind::TimedOut,
            _ => ErrorKind::Io,
        };
        let io_kind = err.kind();
        let mut e = Error::new(kind, context).with_source(err);
        e.inner.io_kind = Some(io_kind);
        e
    }

    #[cfg_attr(not(any(feature = "tcp", feature = "shm")), allow(dead_code))]
    pub(crate) fn with_source(
        mut self,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Error {
        self.inner.source = Some(source.into());
        self
    }

    pub(crate) fn with_message(mut self, msg: Message) -> Error {
        self.inner.message = Some(msg);
        self
    }

    /// A copy for a second observer (both halves of a channel report one failure): same kind,
    /// detail and I/O kind, the source flattened into the text, no message.
    #[cfg_attr(not(any(feature = "tcp", feature = "tower")), allow(dead_code))]
    pub(crate) fn duplicate(&self) -> Error {
        let detail = match &self.inner.source {
            Some(src) => Cow::Owned(format!("{}: {}", self.inner.detail, src)),
            None => self.inner.detail.clone(),
        };
        let mut e = Error::new(self.inner.kind, detail);
        e.inner.io_kind = self.inner.io_kind;
        e.inner.remote = self.inner.remote;
        e
    }

    /// An [`ErrorKind::Remote`] error that the peer classified as `kind`.
    #[cfg_attr(not(feature = "tower"), allow(dead_code))]
    pub(crate) fn with_remote_kind(mut self, kind: Option<ErrorKind>) -> Error {
        self.inner.remote = kind;
        self
    }

    /// What went wrong, to match on.
    pub fn kind(&self) -> ErrorKind {
        self.inner.kind
    }

    /// The operating-system error kind, for [`ErrorKind::Io`] and errors that came from one.
    pub fn io_kind(&self) -> Option<io::ErrorKind> {
        self.inner.io_kind
    }

    /// The message that could not be sent, when the failure happened after it was handed
    /// over (for example [`ErrorKind::LimitExceeded`] at `start_send`). Taking it leaves
    /// `None`.
    pub fn take_message(&mut self) -> Option<Message> {
        self.inner.message.take()
    }

    /// True for [`ErrorKind::ConnectionLost`]: the peer died or the connection broke.
    pub fn is_connection_lost(&self) -> bool {
        self.inner.kind == ErrorKind::ConnectionLost
    }

    /// True for [`ErrorKind::Closed`].
    pub fn is_closed(&self) -> bool {
        self.inner.kind == ErrorKind::Closed
    }

    /// True for [`ErrorKind::TimedOut`].
    pub fn is_timeout(&self) -> bool {
        self.inner.kind == ErrorKind::TimedOut
    }

    /// For [`ErrorKind::Remote`]: how the peer classified its failure, so a client can tell
    /// a request refused by the server's type filter ([`ErrorKind::InvalidType`]), its
    /// metadata schema ([`ErrorKind::InvalidMeta`]) or its router ([`ErrorKind::NotFound`])
    /// from one its handler failed or did not answer ([`ErrorKind::Service`]), without
    /// reading the text. `None` for other errors, and for a peer that sent no kind (or one
    /// this release does not know).
    pub fn remote_kind(&self) -> Option<ErrorKind> {
        self.inner.remote
    }

    /// True for [`ErrorKind::Remote`].
    pub fn is_remote(&self) -> bool {
        self.inner.kind == ErrorKind::Remote
    }

    /// True for [`ErrorKind::Protocol`].
    pub fn is_protocol(&self) -> bool {
        self.inner.kind == ErrorKind::Protocol
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Error");
        d.field("kind", &self.inner.kind)
            .field("detail", &self.inner.detail);
        if let Some(k) = self.inner.io_kind {
            d.field("io_kind", &k);
        }
        if let Some(k) = self.inner.remote {
            d.field("remote_kind", &k);
        }
        if let Some(s) = &self.inner.source {
            d.field("source", s);
        }
        if let Some(m) = &self.inner.message {
            d.field("message", &m.kind());
        }
        d.finish()
    }
}

/// `{}` prints this error alone (its kind and detail); its cause, if any, is
/// [`source`](std::error::Error::source), so that error reporters (anyhow, eyre, tracing's
/// error fields) print each cause once. `{:#}` prints the whole chain on one line, separated
/// by `: `, for a log line or a terminal.
impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.inner.kind)?;
        if !self.inner.detail.is_empty() {
            write!(f, ": {}", self.inner.detail)?;
        }
        if f.alternate() {
            let mut next = std::error::Error::source(self);
            while let Some(src) = next {
                write!(f, ": {src}")?;
                next = src.source();
            }
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.inner
            .source
            .as_deref()
            .map(|s| s as &(dyn std::error::Error + 'static))
    }
}

impl From<Error> for io::Error {
    fn from(e: Error) -> io::Error {
        let kind = match e.kind() {
            ErrorKind::ConnectionLost => io::ErrorKind::ConnectionReset,
            ErrorKind::Closed => io::ErrorKind::BrokenPipe,
            ErrorKind::Full => io::ErrorKind::WouldBlock,
            ErrorKind::TimedOut => io::ErrorKind::TimedOut,
            ErrorKind::NotFound => io::ErrorKind::NotFound,
            ErrorKind::ConnectionRefused => io::ErrorKind::ConnectionRefused,
            ErrorKind::AddrInUse => io::ErrorKind::AddrInUse,
            ErrorKind::Protocol => io::ErrorKind::InvalidData,
            ErrorKind::InvalidType
            | ErrorKind::InvalidMeta
            | ErrorKind::InvalidUrl
            | ErrorKind::LimitExceeded
            | ErrorKind::Config => io::ErrorKind::InvalidInput,
            ErrorKind::UnsupportedScheme | ErrorKind::Unavailable => io::ErrorKind::Unsupported,
            _ => e.io_kind().unwrap_or(io::ErrorKind::Other),
        };
        io::Error::new(kind, e)
    }
}

impl From<InvalidType> for Error {
    fn from(e: InvalidType) -> Error {
        Error::new(ErrorKind::InvalidType, e.to_string())
    }
}

impl From<InvalidMeta> for Error {
    fn from(e: InvalidMeta) -> Error {
        Error::new(ErrorKind::InvalidMeta, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_errors_convert_with_their_kind() {
        let e: Error = crate::message::MsgType::new("a..b").unwrap_err().into();
        assert_eq!(e.kind(), ErrorKind::InvalidType);
        assert!(
            e.to_string().contains("a..b") || e.to_string().contains("empty"),
            "{e}"
        );
        let e: Error = crate::message::Meta::new()
            .insert("", "x")
            .unwrap_err()
            .into();
        assert_eq!(e.kind(), ErrorKind::InvalidMeta);
    }

    #[test]
    fn every_kind_has_a_code_that_reads_back() {
        for (kind, code) in CODES {
            assert_eq!(kind.code(), code);
            assert_eq!(ErrorKind::from_code(code), Some(kind));
        }
        assert_eq!(ErrorKind::from_code("from-a-newer-peer"), None);
        let mut codes: Vec<_> = CODES.iter().map(|(_, c)| c).collect();
        codes.sort();
        codes.dedup();
        assert_eq!(codes.len(), CODES.len(), "codes are unique");
    }

    #[test]
    fn io_errors_are_classified() {
        let e = Error::io("connect", io::Error::from(io::ErrorKind::ConnectionReset));
        assert_eq!(e.kind(), ErrorKind::ConnectionLost);
        assert_eq!(e.io_kind(), Some(io::ErrorKind::ConnectionReset));
        let e = Error::io("connect", io::Error::from(io::ErrorKind::ConnectionRefused));
        assert_eq!(e.kind(), ErrorKind::ConnectionRefused);
        assert!(
            e.to_string().starts_with("connection refused: connect"),
            "{e:#}"
        );
        let e = Error::io("read", io::Error::from(io::ErrorKind::PermissionDenied));
        assert_eq!(e.kind(), ErrorKind::Io);
    }

    #[test]
    fn duplicate_keeps_kind_and_flattens_source() {
        let e = Error::io("read", io::Error::other("boom"));
        let d = e.duplicate();
        assert_eq!(d.kind(), e.kind());
        assert!(d.to_string().contains("boom"));
        assert!(std::error::Error::source(&d).is_none());
    }
}
