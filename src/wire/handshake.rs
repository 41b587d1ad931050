//! The handshake: magic, version, capabilities, receive limits, heartbeat interval.

use bytes::BufMut;

use crate::message::Limits;

/// The first eight bytes of every connection.
pub const MAGIC: [u8; 8] = *b"HYPERFRM";
/// The protocol version this crate speaks.
pub const VERSION: u16 = 1;
/// The length of the handshake this crate writes (the version-1 fields and the heartbeat
/// interval).
pub const HANDSHAKE_LEN: usize = 40;
/// The shortest handshake a reader accepts: the version-1 fields alone (a peer that predates
/// the heartbeat interval).
pub const MIN_HANDSHAKE_LEN: usize = 32;
/// The longest handshake a reader accepts (later versions may append fields).
const MAX_HANDSHAKE_LEN: usize = 1024;

/// Optional protocol features, as a bit set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Capabilities(pub u32);

impl Capabilities {
    /// Bit 0: this side understands `HEARTBEAT` frames, so the peer may send them.
    pub const HEARTBEAT: Capabilities = Capabilities(1);

    /// The features both sides offer.
    pub fn intersect(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 & other.0)
    }

    /// Whether every feature of `other` is offered.
    pub fn contains(self, other: Capabilities) -> bool {
        self.0 & other.0 == other.0
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
    /// The longest this side stays silent, in milliseconds, while it can write: when it has
    /// had nothing else to send for this long it sends a `HEARTBEAT` (if the peer
    /// understands them). 0: it sends none, and the peer must not expect any.
    pub heartbeat_ms: u32,
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
    #[error("handshake length {0} is outside {MIN_HANDSHAKE_LEN}..={MAX_HANDSHAKE_LEN}")]
    BadLength(u16),
    /// A reserved field is not zero.
    #[error("reserved handshake field is {0:#06x}, not 0")]
    Reserved(u16),
    /// The peer advertises limits this implementation cannot honour.
    #[error("peer advertises an invalid limit: {0}")]
    BadLimit(&'static str),
}

impl Handshake {
    /// A version-1 handshake advertising `limits`, understanding heartbeats and sending none
    /// (see [`with_heartbeat`](Self::with_heartbeat)).
    pub fn new(limits: Limits) -> Handshake {
        Handshake {
            version: VERSION,
            capabilities: Capabilities::HEARTBEAT,
            limits,
            heartbeat_ms: 0,
        }
    }

    /// Announces that this side sends a heartbeat whenever it has been silent for
    /// `interval` (rounded up to a millisecond; `None`: it sends none).
    pub fn with_heartbeat(mut self, interval: Option<std::time::Duration>) -> Handshake {
        self.heartbeat_ms = interval.map_or(0, |d| {
            u32::try_from(d.as_micros().div_ceil(1000))
                .unwrap_or(u32::MAX)
                .max(1)
        });
        self
    }

    /// How often the peer that sent this handshake promised to be heard from, if at all:
    /// only when it announced an interval and understands heartbeats.
    pub fn heartbeat(&self) -> Option<std::time::Duration> {
        (self.heartbeat_ms > 0 && self.capabilities.contains(Capabilities::HEARTBEAT))
            .then(|| std::time::Duration::from_millis(self.heartbeat_ms.into()))
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
        dst.put_u32_le(self.heartbeat_ms);
        dst.put_u32_le(0);
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
        if !(MIN_HANDSHAKE_LEN..=MAX_HANDSHAKE_LEN).contains(&(len as usize)) {
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
                // A peer that predates the field sends no heartbeats.
                heartbeat_ms: if len >= 36 { u32_at(32) } else { 0 },
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
        v[10] = 48;
        v.extend_from_slice(&[9; 8]);
        v.extend_from_slice(b"next");
        let (_, n) = Handshake::decode(&v).unwrap().unwrap();
        assert_eq!(&v[n..], b"next");
    }

    #[test]
    fn heartbeat_interval_and_older_peers() {
        let mut v = Vec::new();
        let ours = Handshake::new(Limits::default())
            .with_heartbeat(Some(std::time::Duration::from_micros(1500)));
        ours.encode(&mut v);
        let (hs, _) = Handshake::decode(&v).unwrap().unwrap();
        assert_eq!(hs.heartbeat_ms, 2, "rounded up");
        assert_eq!(hs.heartbeat(), Some(std::time::Duration::from_millis(2)));
        // A version-1 handshake of 32 bytes (before the field): no heartbeats expected.
        let mut old = v[..MIN_HANDSHAKE_LEN].to_vec();
        old[10] = MIN_HANDSHAKE_LEN as u8;
        old[12] = 0; // and no capabilities
        let (hs, n) = Handshake::decode(&old).unwrap().unwrap();
        assert_eq!(
            (n, hs.heartbeat_ms, hs.heartbeat()),
            (MIN_HANDSHAKE_LEN, 0, None)
        );
        assert!(!hs.capabilities.contains(Capabilities::HEARTBEAT));
        // An interval without the capability is not a promise.
        let mut odd = v.clone();
        odd[12] = 0;
        assert_eq!(
            Handshake::decode(&odd).unwrap().unwrap().0.heartbeat(),
            None
        );
    }
}
