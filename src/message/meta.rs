//! `Meta`: the small, ordered string map on the envelope.

use std::fmt;

use bytes::{BufMut, Bytes, BytesMut};

/// The metadata of a message: a small ordered map of short string keys to string values.
///
/// It is the address on the envelope (frame number, source, shape), not the parcel:
/// configuration and payload belong in the body. Keys are 1 to [`Meta::MAX_KEY_LEN`] bytes of
/// `A-Z a-z 0-9 _ - .`; values are UTF-8, at most [`Meta::MAX_VALUE_LEN`] bytes. Insertion
/// order is kept; inserting an existing key replaces its value in place.
///
/// How many entries and how many encoded bytes a channel accepts is a limit of the
/// [`Context`](crate::Context) (defaults: 32 entries, 4 KiB, see [`Limits`](crate::Limits)),
/// checked when the message is sent and again by the receiver.
///
/// `Meta` is kept in its wire encoding (see [`wire`](crate::wire)), so a received map is a
/// zero-copy view of the frame and sending one is a single copy into the frame header.
/// Lookups scan the entries, which is the fastest thing for the handful a map holds.
#[derive(Clone, Default)]
pub struct Meta {
    /// Canonical encoding: empty, or `count:u16` then `count` entries of
    /// `klen:u8 key vlen:u16 value` (little endian). Invariant: well formed, keys valid and
    /// unique, values UTF-8 — established by every constructor.
    raw: Bytes,
}

/// Why a key, a value or an encoded map is not acceptable.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidMeta {
    /// A key is empty.
    #[error("metadata key is empty")]
    EmptyKey,
    /// A key is longer than [`Meta::MAX_KEY_LEN`].
    #[error("metadata key {key:?} is {len} bytes, more than the {max} allowed")]
    KeyTooLong {
        /// The key (truncated to 64 characters).
        key: String,
        /// Its length.
        len: usize,
        /// The maximum.
        max: usize,
    },
    /// A key has a byte outside `A-Z a-z 0-9 _ - .`.
    #[error("metadata key {key:?} has {byte:?} at byte {at}; only A-Z a-z 0-9 _ - . are allowed")]
    BadKeyByte {
        /// The key (lossily decoded).
        key: String,
        /// The offending byte.
        byte: char,
        /// Its offset.
        at: usize,
    },
    /// A value is longer than [`Meta::MAX_VALUE_LEN`].
    #[error("metadata value of {key:?} is {len} bytes, more than the {max} allowed")]
    ValueTooLong {
        /// The key.
        key: String,
        /// The value's length.
        len: usize,
        /// The maximum.
        max: usize,
    },
    /// A value is not UTF-8 (only possible off the wire).
    #[error("metadata value of {key:?} is not UTF-8")]
    ValueNotUtf8 {
        /// The key.
        key: String,
    },
    /// More entries than allowed.
    #[error("metadata has more than {max} entries")]
    TooManyEntries {
        /// The maximum.
        max: usize,
    },
    /// The same key twice (only possible off the wire).
    #[error("metadata key {key:?} appears twice")]
    DuplicateKey {
        /// The key.
        key: String,
    },
    /// The encoding is cut short, has bytes left over, or declares zero entries.
    #[error("metadata encoding is malformed: {0}")]
    Malformed(&'static str),
}

fn key_for_error(key: &[u8]) -> String {
    String::from_utf8_lossy(&key[..key.len().min(64)]).into_owned()
}

fn validate_key(key: &[u8]) -> Result<(), InvalidMeta> {
    if key.is_empty() {
        return Err(InvalidMeta::EmptyKey);
    }
    if key.len() > Meta::MAX_KEY_LEN {
        return Err(InvalidMeta::KeyTooLong {
            key: key_for_error(key),
            len: key.len(),
            max: Meta::MAX_KEY_LEN,
        });
    }
    for (at, &b) in key.iter().enumerate() {
        if !(b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.') {
            return Err(InvalidMeta::BadKeyByte {
                key: key_for_error(key),
                byte: b as char,
                at,
            });
        }
    }
    Ok(())
}

fn validate_value(key: &[u8], value: &[u8]) -> Result<(), InvalidMeta> {
    if value.len() > Meta::MAX_VALUE_LEN {
        return Err(InvalidMeta::ValueTooLong {
            key: key_for_error(key),
            len: value.len(),
            max: Meta::MAX_VALUE_LEN,
        });
    }
    Ok(())
}

/// Splits one entry off the front of `rest`: `(key, value, remainder)`, or `None` when cut short.
/// Inline: it is the body of every walk over a map (a call per entry cost as much as the
/// entry's own work in a schema check).
#[inline]
fn split_entry(rest: &[u8]) -> Option<(&[u8], &[u8], &[u8])> {
    let (&klen, rest) = rest.split_first()?;
    let (key, rest) = rest.split_at_checked(klen as usize)?;
    let (vlen, rest) = rest.split_at_checked(2)?;
    let vlen = u16::from_le_bytes([vlen[0], vlen[1]]) as usize;
    let (value, rest) = rest.split_at_checked(vlen)?;
    Some((key, value, rest))
}

impl Meta {
    /// Longest key, in bytes.
    pub const MAX_KEY_LEN: usize = 64;
    /// Longest value, in bytes (the wire stores it in 16 bits).
    pub const MAX_VALUE_LEN: usize = u16::MAX as usize;
    /// Most entries the encoding can hold.
    pub const MAX_ENTRIES: usize = u16::MAX as usize;

    /// An empty map (no allocation).
    pub const fn new() -> Meta {
        Meta { raw: Bytes::new() }
    }

    /// Validates a received encoding and keeps it as is (zero-copy): the only way to make a
    /// `Meta` from received bytes, so that what is kept is what was checked (the iterator
    /// relies on it: keys and values are read as UTF-8 without checking again). Bytes that
    /// a peer can still write (shared memory) must be copied before they come here.
    ///
    /// `max_entries` is checked from the count field before the entries are walked.
    pub(crate) fn from_wire(raw: Bytes, max_entries: usize) -> Result<Meta, InvalidMeta> {
        Meta::validate_wire(&raw, max_entries)?;
        Ok(Meta { raw })
    }

    /// Checks an encoding without keeping it.
    fn validate_wire(raw: &[u8], max_entries: usize) -> Result<(), InvalidMeta> {
        if raw.is_empty() {
            return Ok(());
        }
        let (count, mut rest) = raw
            .split_at_checked(2)
            .ok_or(InvalidMeta::Malformed("no entry count"))?;
        let count = u16::from_le_bytes([count[0], count[1]]) as usize;
        if count == 0 {
            return Err(InvalidMeta::Malformed(
                "zero entries must be encoded as an empty section",
            ));
        }
        if count > max_entries {
            return Err(InvalidMeta::TooManyEntries { max: max_entries });
        }
        for i in 0..count {
            let (key, value, after) =
                split_entry(rest).ok_or(InvalidMeta::Malformed("entry cut short"))?;
            validate_key(key)?;
            if std::str::from_utf8(value).is_err() {
                return Err(InvalidMeta::ValueNotUtf8 {
                    key: key_for_error(key),
                });
            }
            // Quadratic in the entry count, which the limit keeps small (default 32).
            let mut seen = &raw[2..raw.len() - rest.len()];
            for _ in 0..i {
                let Some((k, _, r)) = split_entry(seen) else {
                    break;
                };
                if k == key {
                    return Err(InvalidMeta::DuplicateKey {
                        key: key_for_error(key),
                    });
                }
                seen = r;
            }
            rest = after;
        }
        if !rest.is_empty() {
            return Err(InvalidMeta::Malformed("bytes left after the last entry"));
        }
        Ok(())
    }

    /// The canonical encoding, as it goes on the wire.
    pub(crate) fn as_wire(&self) -> &[u8] {
        &self.raw
    }

    /// The number of entries.
    pub fn len(&self) -> usize {
        match self.raw.get(..2) {
            Some(c) => u16::from_le_bytes([c[0], c[1]]) as usize,
            None => 0,
        }
    }

    /// True when there are no entries.
    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }

    /// The size of the encoding in bytes: what [`Limits::max_meta_bytes`](crate::Limits) bounds.
    /// Each entry costs `3 + key + value` bytes, plus 2 for the count when not empty.
    pub fn encoded_len(&self) -> usize {
        self.raw.len()
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// True when `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// The entries in insertion order.
    pub fn iter(&self) -> Iter<'_> {
        Iter {
            rest: self.raw.get(2..).unwrap_or(&[]),
        }
    }

    /// The keys in insertion order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.iter().map(|(k, _)| k)
    }

    /// Sets `key` to `value`: replaces the value in place when the key exists, appends
    /// otherwise.
    pub fn insert(&mut self, key: &str, value: &str) -> Result<(), InvalidMeta> {
        validate_key(key.as_bytes())?;
        validate_value(key.as_bytes(), value.as_bytes())?;
        let exists = self.contains_key(key);
        let count = self.len() + usize::from(!exists);
        if count > Meta::MAX_ENTRIES {
            return Err(InvalidMeta::TooManyEntries {
                max: Meta::MAX_ENTRIES,
            });
        }
        if !exists {
            self.append(count, key, value);
            return Ok(());
        }
        let mut out = BytesMut::with_capacity(self.raw.len() + value.len());
        out.put_u16_le(count as u16);
        for (k, v) in self.iter() {
            put_entry(&mut out, k, if k == key { value } else { v });
        }
        self.raw = out.freeze();
        Ok(())
    }

    /// Appends `key`, which the caller knows is not in the map, validated: O(1) amortized,
    /// where `insert` looks for the key first.
    #[cfg(feature = "serde")]
    pub(crate) fn push_new(&mut self, key: &str, value: &str) -> Result<(), InvalidMeta> {
        validate_key(key.as_bytes())?;
        validate_value(key.as_bytes(), value.as_bytes())?;
        let count = self.len() + 1;
        if count > Meta::MAX_ENTRIES {
            return Err(InvalidMeta::TooManyEntries {
                max: Meta::MAX_ENTRIES,
            });
        }
        self.append(count, key, value);
        Ok(())
    }

    /// Appends an entry (a key not in the map; `count` the new number of entries): in place
    /// when this map holds the only reference to its encoding (a map being built), so that
    /// adding N entries costs O(N), not O(N²).
    fn append(&mut self, count: usize, key: &str, value: &str) {
        let raw = std::mem::take(&mut self.raw);
        let mut out = match raw.try_into_mut() {
            Ok(mut unique) if !unique.is_empty() => {
                unique[..2].copy_from_slice(&(count as u16).to_le_bytes());
                unique
            }
            other => {
                // Shared (a received map, a clone), or empty: copy once, with room to grow.
                let prev: &[u8] = match &other {
                    Ok(b) => b,
                    Err(b) => b,
                };
                let need = prev.len().max(2) + 3 + key.len() + value.len();
                let mut out = BytesMut::with_capacity(need.max(64));
                out.put_u16_le(count as u16);
                out.put_slice(prev.get(2..).unwrap_or_default());
                out
            }
        };
        put_entry(&mut out, key, value);
        self.raw = out.freeze();
    }

    /// Appends `key` (valid, and not in the map: the caller knows) with a `value` at most
    /// [`MAX_VALUE_LEN`](Self::MAX_VALUE_LEN) long, without the checks of
    /// [`insert`](Self::insert): the session's sequence number on every message.
    pub(crate) fn push_trusted(&mut self, key: &'static str, value: &str) {
        debug_assert!(validate_key(key.as_bytes()).is_ok() && !self.contains_key(key));
        debug_assert!(value.len() <= Meta::MAX_VALUE_LEN && self.len() < Meta::MAX_ENTRIES);
        self.append(self.len() + 1, key, value);
    }

    /// Removes the last entry if its key is `key`, and returns its value (a view of the old
    /// encoding, no copy); the map keeps its other entries, re-encoded only when it has any.
    pub(crate) fn pop_last_if(&mut self, key: &str) -> Option<Bytes> {
        let mut rest = self.raw.get(2..)?;
        let mut last = 2;
        loop {
            // Well formed (the invariant): every entry splits.
            let (k, _, after) = split_entry(rest)?;
            if after.is_empty() {
                if k != key.as_bytes() {
                    return None;
                }
                break;
            }
            last = self.raw.len() - after.len();
            rest = after;
        }
        let value_at = last + 1 + key.len() + 2;
        let value = self.raw.slice(value_at..);
        let count = self.len() - 1;
        self.raw = if count == 0 {
            Bytes::new()
        } else {
            let mut out = BytesMut::with_capacity(last);
            out.put_u16_le(count as u16);
            out.put_slice(&self.raw[2..last]);
            out.freeze()
        };
        Some(value)
    }

    /// Removes `key`; returns whether it was present.
    pub fn remove(&mut self, key: &str) -> bool {
        if !self.contains_key(key) {
            return false;
        }
        let count = self.len() - 1;
        if count == 0 {
            self.raw = Bytes::new();
            return true;
        }
        let mut out = BytesMut::with_capacity(self.raw.len());
        out.put_u16_le(count as u16);
        for (k, v) in self.iter().filter(|(k, _)| *k != key) {
            put_entry(&mut out, k, v);
        }
        self.raw = out.freeze();
        true
    }
}

/// A metadata value [`Message::with_meta`](crate::Message::with_meta) accepts: text (`&str`,
/// `String`, `Cow<str>`, or a reference to one) as it is, or an integer, written in decimal
/// without an allocation. Sealed: the list is complete.
///
/// ```
/// use hyperframes::Message;
///
/// let frame: u64 = 12;
/// let camera = String::from("cam0");
/// let msg = Message::new("video.frame")?
///     .with_meta("frame", frame)?
///     .with_meta("offset", -3i32)?
///     .with_meta("camera", camera)?
///     .with_meta("codec", "av1")?;
/// assert_eq!(msg.meta().get("frame"), Some("12"));
/// assert_eq!(msg.meta().get("offset"), Some("-3"));
/// # Ok::<(), hyperframes::Error>(())
/// ```
pub trait MetaValue: sealed::Sealed {
    /// Calls `f` with the value as text.
    #[doc(hidden)]
    fn with_text<R>(&self, f: impl FnOnce(&str) -> R) -> R;
}

mod sealed {
    pub trait Sealed {}
}

impl sealed::Sealed for str {}
impl MetaValue for str {
    fn with_text<R>(&self, f: impl FnOnce(&str) -> R) -> R {
        f(self)
    }
}

impl sealed::Sealed for String {}
impl MetaValue for String {
    fn with_text<R>(&self, f: impl FnOnce(&str) -> R) -> R {
        f(self)
    }
}

impl sealed::Sealed for std::borrow::Cow<'_, str> {}
impl MetaValue for std::borrow::Cow<'_, str> {
    fn with_text<R>(&self, f: impl FnOnce(&str) -> R) -> R {
        f(self)
    }
}

impl<T: MetaValue + ?Sized> sealed::Sealed for &T {}
impl<T: MetaValue + ?Sized> MetaValue for &T {
    fn with_text<R>(&self, f: impl FnOnce(&str) -> R) -> R {
        (**self).with_text(f)
    }
}

macro_rules! integer_values {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl MetaValue for $t {
            fn with_text<R>(&self, f: impl FnOnce(&str) -> R) -> R {
                // Decimal digits from the end of a stack buffer: 20 digits and a sign at most.
                let mut buf = [0u8; 21];
                let mut at = buf.len();
                let negative = (*self as i128) < 0;
                let mut n = (*self as i128).unsigned_abs();
                loop {
                    at -= 1;
                    buf[at] = b'0' + (n % 10) as u8;
                    n /= 10;
                    if n == 0 {
                        break;
                    }
                }
                if negative {
                    at -= 1;
                    buf[at] = b'-';
                }
                f(std::str::from_utf8(&buf[at..]).expect("ASCII digits"))
            }
        }
    )*};
}

integer_values!(u8, u16, u32, u64, usize, i8, i16, i32, i64, isize);

fn put_entry(out: &mut BytesMut, key: &str, value: &str) {
    out.put_u8(key.len() as u8);
    out.put_slice(key.as_bytes());
    out.put_u16_le(value.len() as u16);
    out.put_slice(value.as_bytes());
}

/// Iterator over the entries of a [`Meta`], in insertion order.
#[derive(Clone)]
pub struct Iter<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Iter<'a> {
    type Item = (&'a str, &'a str);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        let (key, value, rest) = split_entry(self.rest)?;
        self.rest = rest;
        // SAFETY: `Meta::raw` is only built by `insert`/`remove` from `&str`s with validated
        // ASCII keys, or by `from_wire`, which validates every key as ASCII and every value as
        // UTF-8 before keeping the buffer; `Bytes` is immutable afterwards.
        unsafe {
            Some((
                std::str::from_utf8_unchecked(key),
                std::str::from_utf8_unchecked(value),
            ))
        }
    }
}

impl<'a> IntoIterator for &'a Meta {
    type Item = (&'a str, &'a str);
    type IntoIter = Iter<'a>;
    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

impl PartialEq for Meta {
    fn eq(&self, other: &Self) -> bool {
        self.raw == other.raw
    }
}
impl Eq for Meta {}

impl fmt::Debug for Meta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<K: AsRef<str>, V: AsRef<str>> TryFrom<&[(K, V)]> for Meta {
    type Error = InvalidMeta;
    fn try_from(entries: &[(K, V)]) -> Result<Meta, InvalidMeta> {
        let mut m = Meta::new();
        for (k, v) in entries {
            m.insert(k.as_ref(), v.as_ref())?;
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pop_last_if_takes_only_the_last_entry() {
        let mut m = Meta::new();
        m.push_trusted("hf.seq", "12");
        assert_eq!(m.pop_last_if("hf.seq").as_deref(), Some(&b"12"[..]));
        assert!(m.is_empty() && m.as_wire().is_empty());
        let mut m = Meta::new();
        m.insert("a", "1").unwrap();
        m.insert("b", "22").unwrap();
        m.push_trusted("hf.seq", "333");
        let before = m.clone();
        assert_eq!(m.pop_last_if("b"), None);
        assert_eq!(m.as_wire(), before.as_wire());
        assert_eq!(m.pop_last_if("hf.seq").as_deref(), Some(&b"333"[..]));
        let mut want = Meta::new();
        want.insert("a", "1").unwrap();
        want.insert("b", "22").unwrap();
        assert_eq!(m.as_wire(), want.as_wire());
        assert_eq!(Meta::new().pop_last_if("a"), None);
    }

    #[test]
    fn integers_are_written_in_decimal() {
        fn text(v: impl MetaValue) -> String {
            v.with_text(str::to_owned)
        }
        assert_eq!(text(0u8), "0");
        assert_eq!(text(u64::MAX), u64::MAX.to_string());
        assert_eq!(text(i64::MIN), i64::MIN.to_string());
        assert_eq!(text(-7i8), "-7");
        assert_eq!(text(1_000usize), "1000");
        assert_eq!(text("x"), "x");
        assert_eq!(text(String::from("y")), "y");
    }

    /// Appending grows the map's own encoding in place (the allocation moves only when it
    /// doubles), and never writes into an encoding another map shares.
    #[test]
    fn appending_is_in_place_and_never_touches_a_shared_encoding() {
        let mut m = Meta::new();
        let mut moves = 0;
        let mut last = std::ptr::null();
        for i in 0..1000 {
            m.insert(&format!("k{i}"), &i.to_string()).unwrap();
            if m.as_wire().as_ptr() != last {
                moves += 1;
                last = m.as_wire().as_ptr();
            }
        }
        assert!(
            moves < 20,
            "the encoding moved {moves} times for 1000 appends"
        );
        assert_eq!(m.len(), 1000);
        assert_eq!(m.get("k999"), Some("999"));
        assert_eq!(m.iter().nth(500), Some(("k500", "500")));

        let snapshot = m.clone();
        let before = snapshot.as_wire().to_vec();
        m.insert("late", "1").unwrap();
        assert_eq!(snapshot.as_wire(), &before[..], "the clone saw the append");
        assert_eq!((snapshot.len(), m.len()), (1000, 1001));
        let mut from_clone = snapshot.clone();
        from_clone.insert("other", "2").unwrap();
        assert_eq!(m.get("other"), None);
        assert_eq!(from_clone.get("late"), None);
        assert_eq!(snapshot.as_wire(), &before[..]);
    }

    #[test]
    fn insert_get_replace_remove_keep_order() {
        let mut m = Meta::new();
        assert!(m.is_empty());
        m.insert("width", "1920").unwrap();
        m.insert("height", "1080").unwrap();
        m.insert("frame", "7").unwrap();
        assert_eq!(m.get("height"), Some("1080"));
        m.insert("height", "720").unwrap();
        assert_eq!(
            m.iter().collect::<Vec<_>>(),
            [("width", "1920"), ("height", "720"), ("frame", "7")]
        );
        assert_eq!(m.len(), 3);
        assert_eq!(m.encoded_len(), 2 + (3 + 5 + 4) + (3 + 6 + 3) + (3 + 5 + 1));
        assert!(m.remove("width"));
        assert!(!m.remove("width"));
        assert_eq!(m.keys().collect::<Vec<_>>(), ["height", "frame"]);
        assert!(m.remove("height") && m.remove("frame"));
        assert!(m.is_empty() && m.encoded_len() == 0);
    }

    #[test]
    fn rejects_bad_keys_and_values() {
        let mut m = Meta::new();
        assert_eq!(m.insert("", "x"), Err(InvalidMeta::EmptyKey));
        assert!(matches!(
            m.insert("a b", "x"),
            Err(InvalidMeta::BadKeyByte { at: 1, .. })
        ));
        assert!(matches!(
            m.insert(&"k".repeat(65), "x"),
            Err(InvalidMeta::KeyTooLong { len: 65, .. })
        ));
        assert!(matches!(
            m.insert("k", &"v".repeat(65536)),
            Err(InvalidMeta::ValueTooLong { .. })
        ));
        assert!(m.is_empty());
    }

    #[test]
    fn wire_round_trip_and_rejections() {
        let m = Meta::try_from(&[("a", "1"), ("b.c", "héllo")][..]).unwrap();
        let back = Meta::from_wire(Bytes::copy_from_slice(m.as_wire()), 32).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.get("b.c"), Some("héllo"));

        let raw = m.as_wire().to_vec();
        assert_eq!(
            Meta::from_wire(Bytes::from(raw.clone()), 1),
            Err(InvalidMeta::TooManyEntries { max: 1 })
        );
        assert!(matches!(
            Meta::from_wire(Bytes::copy_from_slice(&raw[..raw.len() - 1]), 32),
            Err(InvalidMeta::Malformed(_))
        ));
        let mut extra = raw.clone();
        extra.push(0);
        assert!(matches!(
            Meta::from_wire(Bytes::from(extra), 32),
            Err(InvalidMeta::Malformed(_))
        ));
        assert!(matches!(
            Meta::from_wire(Bytes::from_static(&[0, 0]), 32),
            Err(InvalidMeta::Malformed(_))
        ));
        // duplicate key
        let dup = [2u8, 0, 1, b'a', 0, 0, 1, b'a', 0, 0];
        assert!(matches!(
            Meta::from_wire(Bytes::copy_from_slice(&dup), 32),
            Err(InvalidMeta::DuplicateKey { .. })
        ));
        // value not UTF-8
        let bad = [1u8, 0, 1, b'a', 1, 0, 0xff];
        assert!(matches!(
            Meta::from_wire(Bytes::copy_from_slice(&bad), 32),
            Err(InvalidMeta::ValueNotUtf8 { .. })
        ));
    }
}
