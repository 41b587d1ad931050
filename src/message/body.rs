//! `Body`: the parcel.

use std::fmt;

use bytes::Bytes;

/// The body of a message: the large part, which travels without user-space copies.
///
/// A host body is a [`Bytes`]. A `Bytes` can own any memory through [`Bytes::from_owner`] —
/// a shared-memory lease, a registered RDMA buffer, a pooled receive buffer — which is how
/// transports hand bodies out zero-copy. With the `cuda` feature a body can also live in
/// device memory (`Body::from(DeviceBody)`, see `hyperframes::device`); code that only
/// handles host bodies uses [`Body::as_bytes`] / [`Body::into_bytes`] and gets `None`/`Err`
/// for the others.
#[derive(Clone, PartialEq, Eq)]
pub struct Body {
    repr: Repr,
}

#[derive(Clone)]
enum Repr {
    Host(Bytes),
    /// Host memory a transport lent (a shared-memory arena block), tagged so that the same
    /// transport recognises it and sends it without a copy.
    #[cfg_attr(not(feature = "shm"), allow(dead_code))]
    // lent memory comes from shm
    Leased(Bytes, LeaseTag),
    /// Device memory.
    #[cfg(feature = "cuda")]
    Device(crate::device::DeviceBody),
}

/// Host bodies are equal when their bytes are; device bodies when they are the same memory
/// (comparing contents would need a copy from the device).
impl PartialEq for Repr {
    fn eq(&self, other: &Repr) -> bool {
        match (self.host(), other.host()) {
            (Some(a), Some(b)) => a == b,
            #[cfg(feature = "cuda")]
            (None, None) => match (self, other) {
                (Repr::Device(a), Repr::Device(b)) => a.same_memory(b),
                _ => false,
            },
            _ => false,
        }
    }
}
impl Eq for Repr {}

impl Repr {
    fn host(&self) -> Option<&Bytes> {
        match self {
            Repr::Host(b) | Repr::Leased(b, _) => Some(b),
            #[cfg(feature = "cuda")]
            Repr::Device(_) => None,
        }
    }
}

/// Which lent region a leased body lives in, and where (transport-defined numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LeaseTag {
    pub(crate) region: u64,
    pub(crate) offset: u64,
}

impl Default for Body {
    fn default() -> Body {
        Body::new()
    }
}

/// Where a body's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Location {
    /// Host memory, readable as a byte slice.
    Host,
    /// Memory of the CUDA device with this ordinal.
    #[cfg(feature = "cuda")]
    Cuda {
        /// The device ordinal.
        ordinal: u32,
    },
    /// Host memory standing in for a device ([`Gpu::stand_in`](crate::device::Gpu::stand_in)):
    /// handled as device memory everywhere, for tests of device code on hosts without a GPU.
    #[cfg(feature = "cuda")]
    StandIn,
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
            Repr::Host(b) | Repr::Leased(b, _) => b.len(),
            #[cfg(feature = "cuda")]
            Repr::Device(d) => d.len(),
        }
    }

    /// True when the body is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the bytes live.
    pub fn location(&self) -> Location {
        match &self.repr {
            Repr::Host(_) | Repr::Leased(..) => Location::Host,
            #[cfg(feature = "cuda")]
            Repr::Device(d) => d.location(),
        }
    }

    /// The bytes, when the body is in host memory.
    pub fn as_bytes(&self) -> Option<&Bytes> {
        self.repr.host()
    }

    /// The bytes, when the body is in host memory; the body back otherwise.
    #[allow(clippy::result_large_err)]
    pub fn into_bytes(self) -> Result<Bytes, Body> {
        match self.repr {
            Repr::Host(b) | Repr::Leased(b, _) => Ok(b),
            #[cfg(feature = "cuda")]
            Repr::Device(_) => Err(self),
        }
    }

    /// The device memory, when the body is in device memory.
    #[cfg(feature = "cuda")]
    pub fn as_device(&self) -> Option<&crate::device::DeviceBody> {
        match &self.repr {
            Repr::Device(d) => Some(d),
            _ => None,
        }
    }

    /// A body in memory a transport lent (see [`BodyMut`]).
    #[cfg_attr(not(feature = "shm"), allow(dead_code))] // lent memory comes from shm
    pub(crate) fn leased(bytes: Bytes, tag: LeaseTag) -> Body {
        Body {
            repr: Repr::Leased(bytes, tag),
        }
    }

    /// Where the body lives, when a transport lent its memory.
    #[cfg_attr(not(feature = "shm"), allow(dead_code))] // lent memory comes from shm
    pub(crate) fn lease_tag(&self) -> Option<LeaseTag> {
        match &self.repr {
            Repr::Leased(_, tag) => Some(*tag),
            _ => None,
        }
    }
}

/// The bytes of a body in host memory, without a copy; a body in device memory fails and
/// comes back in the error (stage it with `DeviceBody::to_host` first).
impl TryFrom<Body> for Bytes {
    type Error = Body;
    fn try_from(body: Body) -> Result<Bytes, Body> {
        body.into_bytes()
    }
}

impl From<Bytes> for Body {
    fn from(b: Bytes) -> Body {
        Body {
            repr: Repr::Host(b),
        }
    }
}

#[cfg(feature = "cuda")]
impl From<crate::device::DeviceBody> for Body {
    fn from(d: crate::device::DeviceBody) -> Body {
        Body {
            repr: Repr::Device(d),
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
            Repr::Leased(b, _) => write!(f, "Body::Leased({} bytes)", b.len()),
            #[cfg(feature = "cuda")]
            Repr::Device(d) => write!(f, "Body::Device({} bytes, {:?})", d.len(), d.location()),
        }
    }
}

/// A body being written in place, from [`Sender::alloc`](crate::Sender::alloc): fill it,
/// [`freeze`](BodyMut::freeze) it, send it.
///
/// On `shm://` it is a block of the shared-memory arena, so the body is written where the
/// receiver will read it and sending it copies nothing; elsewhere it is ordinary heap memory.
/// Its initial contents are unspecified (zeroes on the heap, earlier bodies in an arena).
pub struct BodyMut {
    repr: MutRepr,
}

enum MutRepr {
    Heap(bytes::BytesMut),
    #[cfg_attr(not(feature = "shm"), allow(dead_code))]
    // lent memory comes from shm
    Lent(Box<dyn LentMut>),
}

/// Writable memory a transport lends for a body (implemented by the shm arena).
pub(crate) trait LentMut: Send + Sync + 'static {
    fn as_slice(&self) -> &[u8];
    fn as_mut_slice(&mut self) -> &mut [u8];
    fn freeze(self: Box<Self>) -> Body;
}

impl BodyMut {
    /// `len` zeroed bytes on the heap.
    pub fn zeroed(len: usize) -> BodyMut {
        BodyMut {
            repr: MutRepr::Heap(bytes::BytesMut::zeroed(len)),
        }
    }

    #[cfg_attr(not(feature = "shm"), allow(dead_code))] // lent memory comes from shm
    pub(crate) fn lent(lent: Box<dyn LentMut>) -> BodyMut {
        BodyMut {
            repr: MutRepr::Lent(lent),
        }
    }

    /// Makes it an immutable [`Body`], ready to send.
    pub fn freeze(self) -> Body {
        match self.repr {
            MutRepr::Heap(b) => Body::from(b.freeze()),
            MutRepr::Lent(l) => l.freeze(),
        }
    }
}

impl std::ops::Deref for BodyMut {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.repr {
            MutRepr::Heap(b) => b,
            MutRepr::Lent(l) => l.as_slice(),
        }
    }
}

impl std::ops::DerefMut for BodyMut {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.repr {
            MutRepr::Heap(b) => b,
            MutRepr::Lent(l) => l.as_mut_slice(),
        }
    }
}

impl From<BodyMut> for Body {
    fn from(b: BodyMut) -> Body {
        b.freeze()
    }
}

impl fmt::Debug for BodyMut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.repr {
            MutRepr::Heap(b) => write!(f, "BodyMut::Heap({} bytes)", b.len()),
            MutRepr::Lent(l) => write!(f, "BodyMut::Lent({} bytes)", l.as_slice().len()),
        }
    }
}
