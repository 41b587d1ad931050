//! `Body`: the parcel.

use std::fmt;

use bytes::Bytes;

/// The body of a message: the large part, which travels without user-space copies.
///
/// Today a body lives in host memory as a [`Bytes`]. A `Bytes` can own any memory through
/// [`Bytes::from_owner`] — a shared-memory lease, a registered RDMA buffer, a pooled receive
/// buffer — which is how transports hand bodies out zero-copy. Device (GPU) memory joins as
/// another [`Location`] with the `cuda` feature; code that only handles host bodies uses
/// [`Body::as_bytes`] / [`Body::into_bytes`] and gets `None`/`Err` for the others.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Body {
    repr: Repr,
}

#[derive(Clone, PartialEq, Eq)]
enum Repr {
    Host(Bytes),
}

impl Default for Repr {
    fn default() -> Self {
        Repr::Host(Bytes::new())
    }
}

/// Where a body's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Location {
    /// Host memory, readable as a byte slice.
    Host,
}

impl Body {
    /// An empty body.
    pub const fn new() -> Body {
        Body {
            repr: Repr::Host(Bytes::new()),
        }
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        match &self.repr {
            Repr::Host(b) => b.len(),
        }
    }

    /// True when the body is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the bytes live.
    pub fn location(&self) -> Location {
        match &self.repr {
            Repr::Host(_) => Location::Host,
        }
    }

    /// The bytes, when the body is in host memory.
    pub fn as_bytes(&self) -> Option<&Bytes> {
        match &self.repr {
            Repr::Host(b) => Some(b),
        }
    }

    /// The bytes, when the body is in host memory; the body back otherwise.
    #[allow(clippy::result_large_err)]
    pub fn into_bytes(self) -> Result<Bytes, Body> {
        match self.repr {
            Repr::Host(b) => Ok(b),
        }
    }
}

impl From<Bytes> for Body {
    fn from(b: Bytes) -> Body {
        Body {
            repr: Repr::Host(b),
        }
    }
}

impl From<bytes::BytesMut> for Body {
    fn from(b: bytes::BytesMut) -> Body {
        Body::from(b.freeze())
    }
}

impl From<Vec<u8>> for Body {
    fn from(v: Vec<u8>) -> Body {
        Body::from(Bytes::from(v))
    }
}

impl From<String> for Body {
    fn from(s: String) -> Body {
        Body::from(Bytes::from(s))
    }
}

impl From<&'static [u8]> for Body {
    fn from(s: &'static [u8]) -> Body {
        Body::from(Bytes::from_static(s))
    }
}

impl From<&'static str> for Body {
    fn from(s: &'static str) -> Body {
        Body::from(Bytes::from_static(s.as_bytes()))
    }
}

impl fmt::Debug for Body {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.repr {
            Repr::Host(b) => write!(f, "Body::Host({} bytes)", b.len()),
        }
    }
}
