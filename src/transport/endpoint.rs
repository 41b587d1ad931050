//! Endpoint URLs: `scheme://address`, the scheme naming the transport (see
//! [`SCHEMES`](super::SCHEMES), the table of them) and the address written in the shape that
//! transport takes: `host:port` (`tcp://`, `tls://`, `rdma://`) or a name (`inproc://`,
//! `shm://`, `rdma+sim://`).

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use crate::error::{Error, ErrorKind};

/// A parsed endpoint URL: a scheme and its address.
///
/// ```
/// use hyperframes::{Address, Endpoint};
/// let ep: Endpoint = "tcp://[::1]:5555".parse()?;
/// assert_eq!(ep.scheme(), "tcp");
/// assert_eq!(ep.address(), &Address::HostPort { host: "::1".into(), port: 5555 });
/// assert_eq!(ep.to_string(), "tcp://[::1]:5555");
/// assert_eq!(Endpoint::parse("shm://frames")?.name(), Some("frames"));
/// # Ok::<(), hyperframes::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    scheme: &'static str,
    address: Address,
}

/// The address part of an [`Endpoint`], in the shape its scheme takes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Address {
    /// `host:port`: an IPv4 address, an IPv6 address (written in brackets, kept without them)
    /// or a host name, and a port (0 when binding picks one). `tcp://`, `tls://` (the client
    /// checks that the server's certificate names `host`), `rdma://` (the TCP address of the
    /// connection set-up).
    HostPort {
        /// Address or name.
        host: String,
        /// Port.
        port: u16,
    },
    /// A name: `inproc://name` and `rdma+sim://name` (per [`Context`](crate::Context)),
    /// `shm://name` (a socket in the user's runtime directory) or `shm:///abs/path.sock`.
    Name(String),
}

fn invalid(url: &str, why: impl fmt::Display) -> Error {
    Error::new(ErrorKind::InvalidUrl, format!("{url:?}: {why}"))
}

impl Endpoint {
    /// Parses a URL. A scheme this build does not include is refused with
    /// [`ErrorKind::UnsupportedScheme`], naming the cargo feature that adds it.
    pub fn parse(url: &str) -> Result<Endpoint, Error> {
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(invalid(
                url,
                format_args!("expected scheme://address, one of {}", super::scheme_list()),
            ));
        };
        let scheme = scheme.to_ascii_lowercase();
        let Some(s) = super::SCHEMES.iter().find(|s| s.name == scheme) else {
            return Err(Error::new(
                ErrorKind::UnsupportedScheme,
                format!(
                    "{url:?}: unknown scheme {scheme:?} (supported: {})",
                    super::scheme_list()
                ),
            ));
        };
        Ok(Endpoint {
            scheme: s.name,
            address: (s.address)(url, rest)?,
        })
    }

    /// The scheme, without `://`: `"tcp"`, `"tls"`, `"inproc"`, `"shm"`, `"rdma"`,
    /// `"rdma+sim"`.
    pub fn scheme(&self) -> &'static str {
        self.scheme
    }

    /// The address.
    pub fn address(&self) -> &Address {
        &self.address
    }

    /// The host of a `host:port` address.
    pub fn host(&self) -> Option<&str> {
        match &self.address {
            Address::HostPort { host, .. } => Some(host),
            Address::Name(_) => None,
        }
    }

    /// The port of a `host:port` address.
    pub fn port(&self) -> Option<u16> {
        match &self.address {
            Address::HostPort { port, .. } => Some(*port),
            Address::Name(_) => None,
        }
    }

    /// The name of a named address.
    pub fn name(&self) -> Option<&str> {
        match &self.address {
            Address::Name(name) => Some(name),
            Address::HostPort { .. } => None,
        }
    }

    /// For a `host:port` address whose host is an IP address: the socket address, without a
    /// name lookup.
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        let ip = self.host()?.parse::<IpAddr>().ok()?;
        Some(SocketAddr::new(ip, self.port()?))
    }

    /// `tcp://addr`.
    #[cfg(feature = "tcp")]
    pub(crate) fn from_socket_addr(addr: SocketAddr) -> Endpoint {
        Endpoint::tcp(&addr.ip().to_string(), addr.port())
    }

    /// `tcp://host:port`.
    #[cfg(feature = "tcp")]
    pub(crate) fn tcp(host: &str, port: u16) -> Endpoint {
        Endpoint {
            scheme: "tcp",
            address: Address::HostPort {
                host: host.to_owned(),
                port,
            },
        }
    }

    /// The same address under another scheme of the same shape (`tls` for `tcp`).
    #[cfg(feature = "tls")]
    pub(crate) fn with_scheme(self, scheme: &'static str) -> Endpoint {
        Endpoint { scheme, ..self }
    }
}

impl Address {
    /// The pieces of a `host:port` address. The scheme table gives each transport the shape
    /// it takes, so a mismatch is a bug in the table, reported as an error.
    #[cfg_attr(not(any(feature = "tcp", feature = "rdma")), allow(dead_code))]
    pub(crate) fn as_host_port(&self) -> crate::error::Result<(&str, u16)> {
        match self {
            Address::HostPort { host, port } => Ok((host, *port)),
            Address::Name(name) => Err(shape(name)),
        }
    }

    /// A named address; see [`as_host_port`](Self::as_host_port).
    #[cfg_attr(
        not(any(feature = "inproc", feature = "shm", feature = "rdma")),
        allow(dead_code)
    )]
    pub(crate) fn as_name(&self) -> crate::error::Result<&str> {
        match self {
            Address::Name(name) => Ok(name),
            Address::HostPort { host, .. } => Err(shape(host)),
        }
    }
}

#[cfg_attr(
    not(any(feature = "tcp", feature = "inproc", feature = "shm", feature = "rdma")),
    allow(dead_code)
)]
fn shape(what: &str) -> Error {
    Error::new(
        ErrorKind::InvalidUrl,
        format!("{what:?}: not the address shape this transport takes"),
    )
}

/// `host:port` ([`Address::HostPort`]): `tcp://`, `tls://`, `rdma://`.
pub(crate) fn host_port(url: &str, rest: &str) -> Result<Address, Error> {
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
        let Some((host, after)) = v6.split_once(']') else {
            return Err(invalid(url, "missing ']' after the IPv6 address"));
        };
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(invalid(
                url,
                format_args!("{host:?} is not an IPv6 address"),
            ));
        }
        let Some(port) = after.strip_prefix(':') else {
            return Err(invalid(url, "expected :port after the address"));
        };
        (host, port)
    } else {
        let Some((host, port)) = rest.rsplit_once(':') else {
            return Err(invalid(url, "expected host:port"));
        };
        if host.contains(':') {
            return Err(invalid(
                url,
                "an IPv6 address goes in brackets, as in tcp://[::1]:5555",
            ));
        }
        (host, port)
    };
    if host.is_empty() {
        return Err(invalid(
            url,
            "empty host (use 0.0.0.0 or [::] to listen everywhere)",
        ));
    }
    if host.contains('/') || host.chars().any(char::is_whitespace) {
        return Err(invalid(url, format_args!("{host:?} is not a host")));
    }
    let port: u16 = port
        .parse()
        .map_err(|_| invalid(url, format_args!("{port:?} is not a port number (0-65535)")))?;
    Ok(Address::HostPort {
        host: host.to_owned(),
        port,
    })
}

/// A name of 1 to 256 characters without spaces ([`Address::Name`]): `inproc://`,
/// `rdma+sim://`.
pub(crate) fn name(url: &str, rest: &str) -> Result<Address, Error> {
    if rest.is_empty() || rest.len() > 256 || rest.chars().any(char::is_whitespace) {
        let scheme = url.split_once("://").map_or("", |(s, _)| s);
        return Err(invalid(
            url,
            format_args!(
                "an {} name is 1 to 256 characters without spaces",
                scheme.to_ascii_lowercase()
            ),
        ));
    }
    Ok(Address::Name(rest.to_owned()))
}

/// `shm://name` (1 to 64 of `A-Z a-z 0-9 . _ -`, not starting with `.`: a socket in the
/// user's runtime directory) or `shm:///abs/path.sock`.
pub(crate) fn shm_name(url: &str, rest: &str) -> Result<Address, Error> {
    let ok = if let Some(path) = rest.strip_prefix('/') {
        !path.is_empty() && !rest.contains('\0') && rest.len() <= 100
    } else {
        (1..=64).contains(&rest.len())
            && rest
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
            && !rest.starts_with('.')
    };
    if !ok {
        return Err(invalid(
            url,
            "a shm name is 1 to 64 of A-Z a-z 0-9 . _ - (not starting with .), \
             or an absolute socket path as in shm:///run/app.sock",
        ));
    }
    Ok(Address::Name(rest.to_owned()))
}

impl FromStr for Endpoint {
    type Err = Error;
    fn from_str(s: &str) -> Result<Endpoint, Error> {
        Endpoint::parse(s)
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.address {
            Address::HostPort { host, port } if host.contains(':') => {
                write!(f, "{}://[{host}]:{port}", self.scheme)
            }
            Address::HostPort { host, port } => write!(f, "{}://{host}:{port}", self.scheme),
            Address::Name(name) => write!(f, "{}://{name}", self.scheme),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for (url, canon) in [
            ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555"),
            ("TCP://[::1]:0", "tcp://[::1]:0"),
            ("tcp://example.org:80/", "tcp://example.org:80"),
            ("inproc://pipeline/stage-1", "inproc://pipeline/stage-1"),
            ("shm://frames", "shm://frames"),
            ("shm:///run/app.sock", "shm:///run/app.sock"),
            ("rdma://10.0.0.1:7000", "rdma://10.0.0.1:7000"),
            ("TLS://[::1]:9", "tls://[::1]:9"),
            ("tls://svc.cluster.local:443", "tls://svc.cluster.local:443"),
            ("RDMA://[fe80::1]:7", "rdma://[fe80::1]:7"),
            ("rdma+sim://a/b", "rdma+sim://a/b"),
        ] {
            assert_eq!(Endpoint::parse(url).unwrap().to_string(), canon);
        }
        assert_eq!(
            Endpoint::parse("tcp://[::1]:7").unwrap().socket_addr(),
            Some("[::1]:7".parse().unwrap())
        );
        assert_eq!(Endpoint::parse("tcp://h:7").unwrap().socket_addr(), None);
    }

    #[test]
    fn every_scheme_of_the_table_parses_its_shape() {
        let mut names: Vec<_> = crate::transport::SCHEMES.iter().map(|s| s.name).collect();
        for s in crate::transport::SCHEMES {
            let url = if (s.address)("", "h:1").is_ok() {
                format!("{}://h:1", s.name)
            } else {
                format!("{}://n", s.name)
            };
            let ep = Endpoint::parse(&url).unwrap();
            assert_eq!((ep.scheme(), ep.to_string()), (s.name, url.clone()));
            assert!(
                ep.host().is_some() != ep.name().is_some(),
                "{url}: one shape"
            );
        }
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), crate::transport::SCHEMES.len(), "unique names");
    }

    #[test]
    fn rejects_with_reasons() {
        for (url, kind, needle) in [
            ("127.0.0.1:5", ErrorKind::InvalidUrl, "scheme://"),
            ("tcp://127.0.0.1", ErrorKind::InvalidUrl, "host:port"),
            ("tcp://::1:5", ErrorKind::InvalidUrl, "brackets"),
            ("tcp://[::1:5", ErrorKind::InvalidUrl, "']'"),
            ("tcp://h:70000", ErrorKind::InvalidUrl, "port"),
            ("tcp://:5", ErrorKind::InvalidUrl, "empty host"),
            ("inproc://", ErrorKind::InvalidUrl, "inproc name"),
            ("udp://x:1", ErrorKind::UnsupportedScheme, "unknown scheme"),
            ("rdma://x", ErrorKind::InvalidUrl, "host:port"),
            ("tls://x", ErrorKind::InvalidUrl, "host:port"),
            ("rdma+sim://", ErrorKind::InvalidUrl, "rdma+sim name"),
            ("shm://a/b", ErrorKind::InvalidUrl, "shm name"),
            ("shm://", ErrorKind::InvalidUrl, "shm name"),
        ] {
            let e = Endpoint::parse(url).unwrap_err();
            assert_eq!(e.kind(), kind, "{url}");
            assert!(e.to_string().contains(needle), "{url}: {e:#}");
        }
    }
}
