//! `MsgType`: the validated dotted name on every message.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::str::FromStr;

use std::sync::Arc;

/// The type of a message: a dotted name such as `ml.splitter.output`.
///
/// Grammar: one or more *segments* separated by `.`; a segment is one or more of
/// `A-Z a-z 0-9 _ -`. At most [`MsgType::MAX_LEN`] bytes in all. The convention the receiving
/// side routes on is `module.sub.event`; patterns such as `ml.splitter.*` match on whole
/// segments.
///
/// A `MsgType` is cheap to clone and touches no shared counter: a name of up to
/// [`MsgType::INLINE_LEN`] bytes is stored inline, a `&'static str` is borrowed, and only a
/// longer name is a reference-counted allocation. (A per-message reference count shared by
/// the thread that sends and the I/O thread that drops costs a cache-line transfer per
/// message.)
pub struct MsgType(Repr);

/// An inline name, word-aligned: in the enum it starts at offset 8, so a `MsgType` (and
/// the results and options around it) moves as whole words. (With the bytes right after the
/// discriminant, moves copied them in pieces at odd offsets, and the next wider load of the
/// same bytes stalled on store forwarding: measured in the decoders, 10-25% of their time.)
#[derive(Clone, Copy)]
#[repr(C, align(8))]
struct InlineName {
    buf: [u8; MsgType::INLINE_LEN],
    len: u8,
}

// What `InlineName::words` reads: 24 bytes, no padding, aligned to 8. A change of
// `INLINE_LEN` must change `words` too.
const _: () =
    assert!(std::mem::size_of::<InlineName>() == 24 && std::mem::align_of::<InlineName>() == 8);

impl InlineName {
    /// The name and its length as a word and a double word. Equal words are equal names:
    /// `from_valid`, the one constructor, zeroes the buffer past the name.
    ///
    /// Read in these two pieces because they lie within the two halves of a `MsgType` (this
    /// name starts 8 bytes in) that a copy of one writes with two 16-byte stores: each load
    /// then takes its bytes from one store. One 16-byte load of the first 16 bytes of the name
    /// would straddle the two and stall on store forwarding (measured: half the cost of a
    /// filter's cached decision, on a type just cloned).
    #[inline(always)]
    fn words(&self) -> (u64, u128) {
        let at = (self as *const InlineName).cast::<u8>();
        // SAFETY: `InlineName` is `repr(C)`: 23 bytes and one, 24 in all with no padding
        // (alignment 8), every byte initialised; bytes 0..8 and 8..24 are in it, and any bytes
        // are a valid `u64`/`u128` (read unaligned: the struct is aligned to 8 only).
        unsafe {
            (
                at.cast::<u64>().read(),
                at.add(8).cast::<u128>().read_unaligned(),
            )
        }
    }
}

enum Repr {
    Static(&'static str),
    Inline(InlineName),
    Shared(Arc<str>),
}

impl Clone for MsgType {
    /// A copy of the 32 bytes, plus a reference count only for long names. (The derived clone
    /// copies an inline name field by field, at odd offsets, which the next move of the whole
    /// value then reads back with wider loads: a store-forwarding stall on every message.)
    #[inline]
    fn clone(&self) -> MsgType {
        match &self.0 {
            Repr::Shared(s) => MsgType(Repr::Shared(s.clone())),
            // SAFETY: `Static` and `Inline` own nothing (a borrowed `&'static str`, plain
            // bytes), so a bitwise copy of the value is a second, independent value, as
            // `Copy` would make it; dropping both drops nothing.
            Repr::Static(_) | Repr::Inline(_) => unsafe { std::ptr::read(self) },
        }
    }
}

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

    /// Names up to this long are stored inline.
    pub const INLINE_LEN: usize = 23;

    /// Validates `name` and makes a type of it.
    pub fn new(name: impl AsRef<str>) -> Result<MsgType, InvalidType> {
        let name = name.as_ref();
        validate(name.as_bytes())?;
        Ok(MsgType::from_valid(name.as_bytes()))
    }

    /// A type from bytes that passed `validate`.
    fn from_valid(name: &[u8]) -> MsgType {
        if name.len() <= MsgType::INLINE_LEN {
            let mut buf = [0u8; MsgType::INLINE_LEN];
            buf[..name.len()].copy_from_slice(name);
            MsgType(Repr::Inline(InlineName {
                buf,
                len: name.len() as u8,
            }))
        } else {
            // `validate` admits ASCII only.
            MsgType(Repr::Shared(Arc::from(
                String::from_utf8_lossy(name).as_ref(),
            )))
        }
    }

    /// A type from a string literal, without allocation.
    ///
    /// # Panics
    /// If `name` is not a valid type; in a `const` context this is a compile error.
    pub const fn from_static(name: &'static str) -> MsgType {
        match validate(name.as_bytes()) {
            Ok(()) => MsgType(Repr::Static(name)),
            Err(_) => panic!("invalid message type in MsgType::from_static"),
        }
    }

    /// A type from received bytes.
    pub(crate) fn from_wire(bytes: &[u8]) -> Result<MsgType, InvalidType> {
        validate(bytes)?;
        Ok(MsgType::from_valid(bytes))
    }

    /// The name.
    #[inline]
    pub fn as_str(&self) -> &str {
        match &self.0 {
            Repr::Static(s) => s,
            Repr::Shared(s) => s,
            Repr::Inline(InlineName { len, buf }) => {
                let bytes = &buf[..*len as usize];
                // SAFETY: `Inline` is built only by `from_valid` from bytes that passed
                // `validate`, which admits only the ASCII bytes `A-Z a-z 0-9 _ - .`; ASCII is
                // valid UTF-8, and the buffer is never written afterwards.
                unsafe { std::str::from_utf8_unchecked(bytes) }
            }
        }
    }

    /// The name as bytes (what goes on the wire).
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        self.as_str().as_bytes()
    }

    /// The segments between the dots: `ml.splitter.output` gives `ml`, `splitter`, `output`.
    pub fn segments(&self) -> std::str::Split<'_, char> {
        self.as_str().split('.')
    }

    /// The length of the name in bytes.
    #[allow(clippy::len_without_is_empty)] // never empty
    pub fn len(&self) -> usize {
        self.as_bytes().len()
    }
}

impl PartialEq for MsgType {
    /// Two inline names (every name of up to [`MsgType::INLINE_LEN`] bytes but a
    /// `from_static` one) compare as a word and a double word; the others by their bytes.
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (Repr::Inline(a), Repr::Inline(b)) => a.words() == b.words(),
            _ => self.as_bytes() == other.as_bytes(),
        }
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
        MsgType::new(s)
    }
}

/// Anything [`Message::new`](crate::Message::new) accepts as a type: `&str`, `String`,
/// `MsgType`. Sealed: the set of conversions is the crate's to extend (a new one is not a
/// breaking change for anyone).
pub trait IntoMsgType: sealed::Sealed {
    /// Validates and converts.
    fn into_msg_type(self) -> Result<MsgType, InvalidType>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::MsgType {}
    impl Sealed for &super::MsgType {}
    impl Sealed for &str {}
    impl Sealed for String {}
    impl Sealed for &String {}
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

/// Remembers the last type decoded, so a run of messages of one type is validated once.
#[derive(Default)]
pub(crate) struct TypeCache(Option<MsgType>);

impl TypeCache {
    /// The type named `bytes`, validated (once per run of one type). A reference, so that
    /// the caller clones it straight to where it goes: moving a `MsgType` through results and
    /// tuples costs more than the lookup.
    pub(crate) fn lookup(&mut self, bytes: &[u8]) -> Result<&MsgType, InvalidType> {
        let hit = matches!(&self.0, Some(t) if t.as_bytes() == bytes);
        if !hit {
            self.0 = Some(MsgType::from_wire(bytes)?);
        }
        Ok(self.0.as_ref().expect("just filled"))
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
    }

    #[test]
    fn equal_exactly_when_the_names_are_whatever_the_storage() {
        // Names that differ in one byte at each place the word compare reads (the first
        // word; the double word's first half, its second half up to byte 22, the length
        // byte), and the same names stored every way a type can be.
        let names: [&'static str; 11] = [
            "a",
            "b",
            "ab",
            "a.b.c",
            "bench.data.chunk",
            "bench.data.chunK",
            "cench.data.chunk",
            "ml.splitter.output.xyz",
            "ml.splitter.output.xya",
            "ml.splitter.outpuT.xyz",
            "ml.splitter.output.xyzw.long",
        ];
        let ways = |n: &'static str| {
            [
                MsgType::new(n).unwrap(),
                MsgType::from_static(n),
                MsgType::new(n).unwrap().clone(),
            ]
        };
        for a in names {
            for b in names {
                for x in ways(a) {
                    for y in ways(b) {
                        assert_eq!(x == y, a == b, "{a:?} ({x:?}) == {b:?} ({y:?})");
                    }
                }
            }
        }
        // A name that fills the inline buffer, and one a byte shorter that is its prefix.
        let full = "abcdefghij.klmnopqrstuv";
        assert_eq!(full.len(), MsgType::INLINE_LEN);
        let short = &full[..full.len() - 1];
        assert_ne!(MsgType::new(full).unwrap(), MsgType::new(short).unwrap());
        assert_eq!(MsgType::new(full).unwrap(), MsgType::from_static(full));
    }

    #[test]
    #[should_panic(expected = "invalid message type")]
    fn from_static_panics_on_invalid() {
        let _ = MsgType::from_static("not valid");
    }
}
