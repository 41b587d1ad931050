//! `MsgType`: the validated dotted name on every message.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::str::FromStr;

use bytes::Bytes;

use crate::error::{Error, ErrorKind};

/// The type of a message: a dotted name such as `ml.splitter.output`.
///
/// Grammar: one or more *segments* separated by `.`; a segment is one or more of
/// `A-Z a-z 0-9 _ -`. At most [`MsgType::MAX_LEN`] bytes in all. The convention the receiving
/// side routes on is `module.sub.event`; patterns such as `ml.splitter.*` match on whole
/// segments.
///
/// A `MsgType` is cheap to clone: it is a [`Bytes`], so a `&'static str` costs no allocation
/// and a type decoded off the wire is shared with the previous message of the same type.
#[derive(Clone)]
pub struct MsgType(Bytes);

/// Why a string is not a valid [`MsgType`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidType {
    /// The name is empty.
    #[error("message type is empty")]
    Empty,
    /// The name is longer than [`MsgType::MAX_LEN`].
    #[error("message type is {len} bytes, more than the {max} allowed")]
    TooLong {
        /// Its length.
        len: usize,
        /// The maximum.
        max: usize,
    },
    /// Two dots in a row, or a dot at either end.
    #[error("message type has an empty segment at byte {at} (types look like `module.sub.event`)")]
    EmptySegment {
        /// Byte offset of the empty segment.
        at: usize,
    },
    /// A byte outside `A-Z a-z 0-9 _ - .`.
    #[error("message type has {byte:?} at byte {at}; only A-Z a-z 0-9 _ - and . are allowed")]
    BadByte {
        /// The offending byte (shown escaped when not printable).
        byte: char,
        /// Its offset.
        at: usize,
    },
}

impl From<InvalidType> for Error {
    fn from(e: InvalidType) -> Error {
        Error::new(ErrorKind::InvalidType, e.to_string())
    }
}

const fn is_segment_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'-'
}

/// Checks the grammar; `Ok` means `bytes` is a valid type name (and therefore ASCII).
pub(crate) const fn validate(bytes: &[u8]) -> Result<(), InvalidType> {
    if bytes.is_empty() {
        return Err(InvalidType::Empty);
    }
    if bytes.len() > MsgType::MAX_LEN {
        return Err(InvalidType::TooLong {
            len: bytes.len(),
            max: MsgType::MAX_LEN,
        });
    }
    let mut i = 0;
    let mut seg_start = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'.' {
            if i == seg_start {
                return Err(InvalidType::EmptySegment { at: i });
            }
            seg_start = i + 1;
        } else if !is_segment_byte(b) {
            return Err(InvalidType::BadByte {
                byte: b as char,
                at: i,
            });
        }
        i += 1;
    }
    if seg_start == bytes.len() {
        return Err(InvalidType::EmptySegment { at: bytes.len() });
    }
    Ok(())
}

impl MsgType {
    /// The longest type name, in bytes. The wire format stores the length in one byte.
    pub const MAX_LEN: usize = 255;

    /// Validates `name` and makes a type of it.
    pub fn new(name: impl AsRef<str>) -> Result<MsgType, InvalidType> {
        let name = name.as_ref();
        validate(name.as_bytes())?;
        Ok(MsgType(Bytes::copy_from_slice(name.as_bytes())))
    }

    /// A type from a string literal, without allocation.
    ///
    /// # Panics
    /// If `name` is not a valid type; in a `const` context this is a compile error.
    pub const fn from_static(name: &'static str) -> MsgType {
        match validate(name.as_bytes()) {
            Ok(()) => MsgType(Bytes::from_static(name.as_bytes())),
            Err(_) => panic!("invalid message type in MsgType::from_static"),
        }
    }

    /// A type from bytes that may share a larger buffer (a received frame).
    pub(crate) fn from_bytes(bytes: Bytes) -> Result<MsgType, InvalidType> {
        validate(&bytes)?;
        Ok(MsgType(bytes))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        // SAFETY: every constructor runs `validate`, which admits only the ASCII bytes
        // `A-Z a-z 0-9 _ - .`; ASCII is valid UTF-8, and `Bytes` is immutable.
        unsafe { std::str::from_utf8_unchecked(&self.0) }
    }

    /// The name as bytes (what goes on the wire).
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The segments between the dots: `ml.splitter.output` gives `ml`, `splitter`, `output`.
    pub fn segments(&self) -> std::str::Split<'_, char> {
        self.as_str().split('.')
    }

    /// The length of the name in bytes.
    #[allow(clippy::len_without_is_empty)] // never empty
    pub fn len(&self) -> usize {
        self.0.len()
    }
}

impl PartialEq for MsgType {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}
impl Eq for MsgType {}

impl Hash for MsgType {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state)
    }
}

impl PartialOrd for MsgType {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for MsgType {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl PartialEq<str> for MsgType {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}
impl PartialEq<&str> for MsgType {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl AsRef<str> for MsgType {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Display for MsgType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for MsgType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl FromStr for MsgType {
    type Err = InvalidType;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        MsgType::new(s)
    }
}

impl TryFrom<&str> for MsgType {
    type Error = InvalidType;
    fn try_from(s: &str) -> Result<Self, Self::Error> {
        MsgType::new(s)
    }
}

impl TryFrom<String> for MsgType {
    type Error = InvalidType;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        validate(s.as_bytes())?;
        Ok(MsgType(Bytes::from(s)))
    }
}

/// Anything [`Message::new`](crate::Message::new) accepts as a type: `&str`, `String`,
/// `MsgType`.
pub trait IntoMsgType {
    /// Validates and converts.
    fn into_msg_type(self) -> Result<MsgType, InvalidType>;
}

impl IntoMsgType for MsgType {
    fn into_msg_type(self) -> Result<MsgType, InvalidType> {
        Ok(self)
    }
}
impl IntoMsgType for &MsgType {
    fn into_msg_type(self) -> Result<MsgType, InvalidType> {
        Ok(self.clone())
    }
}
impl IntoMsgType for &str {
    fn into_msg_type(self) -> Result<MsgType, InvalidType> {
        MsgType::new(self)
    }
}
impl IntoMsgType for String {
    fn into_msg_type(self) -> Result<MsgType, InvalidType> {
        MsgType::try_from(self)
    }
}
impl IntoMsgType for &String {
    fn into_msg_type(self) -> Result<MsgType, InvalidType> {
        MsgType::new(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_dotted_names() {
        for ok in [
            "a",
            "ml.splitter.output",
            "video_frame",
            "a-b.c_d.E9",
            &"x".repeat(255),
        ] {
            let t = MsgType::new(ok).unwrap();
            assert_eq!(t.as_str(), ok);
        }
        assert_eq!(
            MsgType::from_static("ml.splitter.output")
                .segments()
                .collect::<Vec<_>>(),
            ["ml", "splitter", "output"]
        );
    }

    #[test]
    fn rejects_with_a_reason() {
        assert_eq!(MsgType::new(""), Err(InvalidType::Empty));
        assert_eq!(MsgType::new(".a"), Err(InvalidType::EmptySegment { at: 0 }));
        assert_eq!(
            MsgType::new("a..b"),
            Err(InvalidType::EmptySegment { at: 2 })
        );
        assert_eq!(MsgType::new("a."), Err(InvalidType::EmptySegment { at: 2 }));
        assert_eq!(
            MsgType::new("a b"),
            Err(InvalidType::BadByte { byte: ' ', at: 1 })
        );
        assert_eq!(
            MsgType::new("é"),
            Err(InvalidType::BadByte {
                byte: 0xc3 as char,
                at: 0
            })
        );
        assert_eq!(
            MsgType::new("x".repeat(256)),
            Err(InvalidType::TooLong { len: 256, max: 255 })
        );
        let e: Error = MsgType::new("a..b").unwrap_err().into();
        assert_eq!(e.kind(), ErrorKind::InvalidType);
    }

    #[test]
    #[should_panic(expected = "invalid message type")]
    fn from_static_panics_on_invalid() {
        let _ = MsgType::from_static("not valid");
    }
}
