//! Messages: a type, a metadata map, a body, and a small fixed header.
//!
//! ```
//! use hyperframes::Message;
//!
//! let msg = Message::new("video.frame")?
//!     .with_meta("width", "1920")?
//!     .with_meta("height", "1080")?
//!     .with_body(vec![0u8; 1920 * 1080 * 3]);
//! assert_eq!(msg.kind(), "video.frame");
//! assert_eq!(msg.meta().get("width"), Some("1920"));
//! assert_eq!(msg.body().len(), 6_220_800);
//! # Ok::<(), hyperframes::Error>(())
//! ```

mod body;
mod kind;
mod limits;
mod meta;
#[cfg(feature = "serde")]
mod serde;

pub use body::{Body, BodyMut, Location};
#[cfg(feature = "shm")]
pub(crate) use body::{LeaseTag, LentMut};
pub(crate) use kind::TypeCache;
pub use kind::{IntoMsgType, InvalidType, MsgType};
pub use limits::{LimitError, Limits};
pub use meta::{InvalidMeta, Iter as MetaIter, Meta, MetaValue};

/// Bits of the fixed header that say what role a message plays.
///
/// Undefined bits are reserved: the wire decoder rejects them, so a peer of an older version
/// refuses a frame with a newer flag with a clear protocol error rather than misreading it.
///
/// [`DEVICE`](Flags::DEVICE) and [`MORE`](Flags::MORE) belong to the channel: they carry a
/// body sent from device memory in pieces (see the `device` module, feature `cuda`), the receiving channel
/// puts it back together, and `send` refuses a message that sets them itself.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Flags(u8);

impl Flags {
    /// No flags: a one-way message.
    pub const NONE: Flags = Flags(0);
    /// The message is a request; the peer is expected to answer with the same correlation id.
    pub const REQUEST: Flags = Flags(0b01);
    /// The message answers the request with the same correlation id.
    pub const RESPONSE: Flags = Flags(0b10);
    /// The body was sent from device (GPU) memory: this frame announces it, its 8-byte body
    /// the total length, and the frames that follow carry it in order. Set by the channel.
    pub const DEVICE: Flags = Flags(0b100);
    /// More frames of the body announced by a [`DEVICE`](Flags::DEVICE) frame follow this
    /// one. Set by the channel.
    pub const MORE: Flags = Flags(0b1000);
    /// The bits the channel sets and consumes; a message handed to `send` carries none.
    pub const CHANNEL: Flags = Flags(0b1100);
    /// Every bit defined in this version of the protocol.
    pub const ALL: Flags = Flags(0b1111);

    /// The raw bits.
    pub const fn bits(self) -> u8 {
        self.0
    }

    /// The flags for `bits`, or `None` when a reserved bit is set.
    pub const fn from_bits(bits: u8) -> Option<Flags> {
        if bits & !Flags::ALL.0 == 0 {
            Some(Flags(bits))
        } else {
            None
        }
    }

    /// True when every bit of `other` is set here.
    pub const fn contains(self, other: Flags) -> bool {
        self.0 & other.0 == other.0
    }

    /// Both sets of bits.
    pub const fn union(self, other: Flags) -> Flags {
        Flags(self.0 | other.0)
    }

    /// These bits without those of `other`.
    pub const fn without(self, other: Flags) -> Flags {
        Flags(self.0 & !other.0)
    }

    /// True when any bit of `other` is set here.
    pub const fn intersects(self, other: Flags) -> bool {
        self.0 & other.0 != 0
    }
}

impl std::fmt::Debug for Flags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names = Vec::new();
        if self.contains(Flags::REQUEST) {
            names.push("REQUEST");
        }
        if self.contains(Flags::RESPONSE) {
            names.push("RESPONSE");
        }
        if self.contains(Flags::DEVICE) {
            names.push("DEVICE");
        }
        if self.contains(Flags::MORE) {
            names.push("MORE");
        }
        if names.is_empty() {
            f.write_str("NONE")
        } else {
            f.write_str(&names.join("|"))
        }
    }
}

/// The small fixed part of every message: flags and a correlation id that pairs a response
/// with its request. Transports carry it unchanged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Header {
    /// What role the message plays.
    pub flags: Flags,
    /// Pairs a response with its request; 0 when unused.
    pub correlation: u64,
}

/// A message: a [`MsgType`], a [`Meta`] map, a [`Body`], and a [`Header`].
///
/// Cloning is cheap (reference counts, no copies of the body).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    kind: MsgType,
    meta: Meta,
    body: Body,
    header: Header,
}

impl Message {
    /// A message of type `kind` with no metadata and an empty body.
    ///
    /// Fails with [`InvalidType`] when `kind` is not a valid dotted name (`?` turns it into an
    /// [`Error`](crate::Error) of kind [`InvalidType`](crate::ErrorKind::InvalidType)).
    pub fn new(kind: impl IntoMsgType) -> Result<Message, InvalidType> {
        Ok(Message::from_parts(
            kind.into_msg_type()?,
            Meta::new(),
            Body::new(),
            Header::default(),
        ))
    }

    /// Assembles a message from its parts.
    pub fn from_parts(kind: MsgType, meta: Meta, body: Body, header: Header) -> Message {
        Message {
            kind,
            meta,
            body,
            header,
        }
    }

    /// Adds (or replaces) a metadata entry. The key is any string (`&str`, `String`, …); the
    /// value is text (`&str`, `String`) or an integer, written in decimal (see
    /// [`MetaValue`]). Adding entries one after another appends to the map's encoding in
    /// place: N entries cost O(N).
    ///
    /// Fails with [`InvalidMeta`] when the key or value is malformed (`?` turns it into an
    /// [`Error`](crate::Error) of kind [`InvalidMeta`](crate::ErrorKind::InvalidMeta)). The
    /// per-channel limits on entries and bytes are checked at send.
    pub fn with_meta(
        mut self,
        key: impl AsRef<str>,
        value: impl MetaValue,
    ) -> Result<Message, InvalidMeta> {
        value.with_text(|value| self.meta.insert(key.as_ref(), value))?;
        Ok(self)
    }

    /// Sets the body. Anything that converts to [`Bytes`](bytes::Bytes) (a `Vec<u8>`, a
    /// `String`, a `&'static [u8]`) converts without copying.
    pub fn with_body(mut self, body: impl Into<Body>) -> Message {
        self.body = body.into();
        self
    }

    /// Sets the header (flags and correlation id).
    pub fn with_header(mut self, header: Header) -> Message {
        self.header = header;
        self
    }

    /// The type.
    pub fn kind(&self) -> &MsgType {
        &self.kind
    }

    /// The metadata.
    pub fn meta(&self) -> &Meta {
        &self.meta
    }

    /// The metadata, to change.
    pub fn meta_mut(&mut self) -> &mut Meta {
        &mut self.meta
    }

    /// The body.
    pub fn body(&self) -> &Body {
        &self.body
    }

    /// The fixed header.
    pub fn header(&self) -> Header {
        self.header
    }

    /// The fixed header, to change.
    pub fn header_mut(&mut self) -> &mut Header {
        &mut self.header
    }

    /// Takes the body, dropping the rest.
    pub fn into_body(self) -> Body {
        self.body
    }

    /// Splits the message into its parts.
    pub fn into_parts(self) -> (MsgType, Meta, Body, Header) {
        (self.kind, self.meta, self.body, self.header)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builder_shapes() {
        let m = Message::new("ml.splitter.output")
            .unwrap()
            .with_meta("shard", "3")
            .unwrap()
            .with_body(&b"abc"[..]);
        assert_eq!(m.kind().as_str(), "ml.splitter.output");
        assert_eq!(m.meta().get("shard"), Some("3"));
        assert_eq!(m.body().as_bytes().unwrap().as_ref(), b"abc");
        assert_eq!(m.clone().into_body().len(), 3);
        assert!(matches!(
            Message::new("bad type").unwrap_err(),
            InvalidType::BadByte { byte: ' ', at: 3 }
        ));
        assert_eq!(
            Message::new("a").unwrap().with_meta("", "x").unwrap_err(),
            InvalidMeta::EmptyKey
        );
    }

    #[test]
    fn flags_reject_reserved_bits() {
        assert_eq!(Flags::from_bits(0b1111), Some(Flags::ALL));
        assert_eq!(Flags::from_bits(0b1_0000), None);
        assert!(
            Flags::REQUEST
                .union(Flags::RESPONSE)
                .contains(Flags::RESPONSE)
        );
        assert_eq!(format!("{:?}", Flags::REQUEST), "REQUEST");
    }
}
