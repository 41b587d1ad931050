//! The handshake: magic, version, capabilities, receive limits.

use bytes::BufMut;

use super::Limits;

/// The first eight bytes of every connection.
pub const MAGIC: [u8; 8] = *b"HYPERFRM";
/// The protocol version this crate speaks.
pub const VERSION: u16 = 1;
/// The length of a version-1 handshake.
pub const HANDSHAKE_LEN: usize = 32;
/// The longest handshake a reader accepts (later versions may append fields).
const MAX_HANDSHAKE_LEN: usize = 1024;

/// Optional protocol features, as a bit set. None are defined in version 1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Capabilities(pub u32);

impl Capabilities {
    /// The features both sides offer.
    pub fn intersect(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 & other.0)
    }
}

/// One side's handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handshake {
    /// Protocol version.
    pub version: u16,
    /// Offered features.
    pub capabilities: Capabilities,
    /// What this side accepts.
    pub limits: Limits,
}

/// A handshake that cannot be accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The peer does not speak this protocol (first differing byte shown).
    #[error(
        "not a hyperframes peer: byte {at} of the handshake is {got:#04x}, expected {expected:#04x} (magic \"HYPERFRM\")"
    )]
    BadMagic {
        /// Offset of the first wrong byte.
        at: usize,
        /// What arrived.
        got: u8,
        /// What the magic has there.
        expected: u8,
    },
    /// The peer speaks another version.
    #[error("peer speaks protocol version {theirs}; this side speaks {ours}")]
    UnsupportedVersion {
        /// Peer's version.
        theirs: u16,
        /// Ours.
        ours: u16,
    },
    /// The length field is out of range.
    #[error("handshake length {0} is outside {HANDSHAKE_LEN}..={MAX_HANDSHAKE_LEN}")]
    BadLength(u16),
    /// A reserved field is not zero.
    #[error("reserved handshake field is {0:#06x}, not 0")]
    Reserved(u16),
    /// The peer advertises limits this implementation cannot honour.
    #[error("peer advertises an invalid limit: {0}")]
    BadLimit(&'static str),
}

impl Handshake {
    /// A version-1 handshake advertising `limits`.
    pub fn new(limits: Limits) -> Handshake {
        Handshake {
            version: VERSION,
            capabilities: Capabilities::default(),
            limits,
        }
    }

    /// Appends the encoding ([`HANDSHAKE_LEN`] bytes).
    pub fn encode(&self, dst: &mut impl BufMut) {
        dst.put_slice(&MAGIC);
        dst.put_u16_le(self.version);
        dst.put_u16_le(HANDSHAKE_LEN as u16);
        dst.put_u32_le(self.capabilities.0);
        dst.put_u64_le(self.limits.max_body);
        dst.put_u32_le(self.limits.max_meta_bytes);
        dst.put_u16_le(self.limits.max_meta_entries);
        dst.put_u16_le(0);
    }

    /// Decodes a handshake from the front of `src`.
    ///
    /// `Ok(None)`: more bytes are needed. `Ok(Some((hs, n)))`: the handshake took the first
    /// `n` bytes. A wrong magic is reported as soon as its first wrong byte is in `src`.
    pub fn decode(src: &[u8]) -> Result<Option<(Handshake, usize)>, HandshakeError> {
        for (at, (&got, &expected)) in src.iter().zip(MAGIC.iter()).enumerate() {
            if got != expected {
                return Err(HandshakeError::BadMagic { at, got, expected });
            }
        }
        if src.len() < 12 {
            return Ok(None);
        }
        let u16_at = |i: usize| u16::from_le_bytes([src[i], src[i + 1]]);
        let version = u16_at(8);
        if version != VERSION {
            return Err(HandshakeError::UnsupportedVersion {
                theirs: version,
                ours: VERSION,
            });
        }
        let len = u16_at(10);
        if !(HANDSHAKE_LEN..=MAX_HANDSHAKE_LEN).contains(&(len as usize)) {
            return Err(HandshakeError::BadLength(len));
        }
        if src.len() < len as usize {
            return Ok(None);
        }
        let u32_at = |i: usize| u32::from_le_bytes(src[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(src[i..i + 8].try_into().expect("8 bytes"));
        let reserved = u16_at(30);
        if reserved != 0 {
            return Err(HandshakeError::Reserved(reserved));
        }
        let limits = Limits {
            max_body: u64_at(16),
            max_meta_bytes: u32_at(24),
            max_meta_entries: u16_at(28),
        };
        if limits.max_body > Limits::MAX_BODY_CEILING {
            return Err(HandshakeError::BadLimit("max_body above 1 TiB"));
        }
        Ok(Some((
            Handshake {
                version,
                capabilities: Capabilities(u32_at(12)),
                limits,
            },
            len as usize,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded() -> Vec<u8> {
        let mut v = Vec::new();
        Handshake::new(Limits::default()).encode(&mut v);
        v
    }

    #[test]
    fn round_trip_and_partial() {
        let v = encoded();
        assert_eq!(v.len(), HANDSHAKE_LEN);
        for cut in 0..v.len() {
            assert_eq!(Handshake::decode(&v[..cut]), Ok(None), "cut at {cut}");
        }
        let (hs, n) = Handshake::decode(&v).unwrap().unwrap();
        assert_eq!(n, HANDSHAKE_LEN);
        assert_eq!(hs, Handshake::new(Limits::default()));
    }

    #[test]
    fn garbage_fails_at_the_first_wrong_byte() {
        assert_eq!(
            Handshake::decode(b"GET / HTTP/1.1\r\n"),
            Err(HandshakeError::BadMagic {
                at: 0,
                got: b'G',
                expected: b'H'
            })
        );
        assert!(matches!(
            Handshake::decode(b"HYPX"),
            Err(HandshakeError::BadMagic { at: 3, .. })
        ));
    }

    #[test]
    fn version_length_reserved_and_limits() {
        let mut v = encoded();
        v[8] = 2;
        assert_eq!(
            Handshake::decode(&v),
            Err(HandshakeError::UnsupportedVersion { theirs: 2, ours: 1 })
        );
        let mut v = encoded();
        v[10] = 8;
        assert_eq!(Handshake::decode(&v), Err(HandshakeError::BadLength(8)));
        let mut v = encoded();
        v[30] = 1;
        assert_eq!(Handshake::decode(&v), Err(HandshakeError::Reserved(1)));
        let mut v = encoded();
        v[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            Handshake::decode(&v),
            Err(HandshakeError::BadLimit(_))
        ));
    }

    #[test]
    fn longer_handshakes_are_skipped_over() {
        let mut v = encoded();
        v[10] = 40;
        v.extend_from_slice(&[9; 8]);
        v.extend_from_slice(b"next");
        let (_, n) = Handshake::decode(&v).unwrap().unwrap();
        assert_eq!(&v[n..], b"next");
    }
}
