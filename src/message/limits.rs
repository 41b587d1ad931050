//! What a receiver accepts of a message: body size and metadata, whichever transport
//! carries it (tcp sends them in its handshake, shm and rdma in their set-up).

use super::Message;

/// What a receiver accepts. Sent to the peer at set-up; the sender respects the peer's.
///
/// Defaults: 64 MiB bodies, 4 KiB of encoded metadata, 32 metadata entries. Set them on the
/// [`ContextBuilder`](crate::ContextBuilder).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// Largest body, in bytes.
    pub max_body: u64,
    /// Largest encoded metadata section, in bytes (see [`Meta::encoded_len`](crate::Meta::encoded_len)).
    pub max_meta_bytes: u32,
    /// Most metadata entries.
    pub max_meta_entries: u16,
}

impl Limits {
    /// The largest `max_body` a context may configure: 1 TiB.
    pub const MAX_BODY_CEILING: u64 = 1 << 40;

    /// Checks `msg` against these limits.
    pub fn check(&self, msg: &Message) -> Result<(), LimitError> {
        let body = msg.body().len() as u64;
        if body > self.max_body {
            return Err(LimitError::Body {
                len: body,
                max: self.max_body,
            });
        }
        let meta = msg.meta();
        if meta.len() > self.max_meta_entries as usize {
            return Err(LimitError::MetaEntries {
                count: meta.len(),
                max: self.max_meta_entries,
            });
        }
        if meta.encoded_len() > self.max_meta_bytes as usize {
            return Err(LimitError::MetaBytes {
                len: meta.encoded_len(),
                max: self.max_meta_bytes,
            });
        }
        Ok(())
    }
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_body: 64 << 20,
            max_meta_bytes: 4096,
            max_meta_entries: 32,
        }
    }
}

/// A message that does not fit a set of [`Limits`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LimitError {
    /// The body is too large.
    #[error("body of {len} bytes exceeds max_body of {max}")]
    Body {
        /// Body length.
        len: u64,
        /// Limit.
        max: u64,
    },
    /// Too many metadata entries.
    #[error("{count} metadata entries exceed max_meta_entries of {max}")]
    MetaEntries {
        /// Entry count.
        count: usize,
        /// Limit.
        max: u16,
    },
    /// The metadata encoding is too large.
    #[error("metadata of {len} encoded bytes exceeds max_meta_bytes of {max}")]
    MetaBytes {
        /// Encoded length.
        len: usize,
        /// Limit.
        max: u32,
    },
}
