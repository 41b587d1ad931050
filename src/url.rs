//! Endpoint URLs: `tcp://host:port`, `tls://host:port`, `inproc://name`, `shm://name`,
//! `rdma://host:port`.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use crate::error::{Error, ErrorKind};

/// A parsed endpoint URL.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Endpoint {
    /// `tcp://host:port`: an IPv4 address, a bracketed IPv6 address (`[::1]`) or a host name,
    /// and a port (0 when binding picks one).
    Tcp {
        /// Address or name.
        host: String,
        /// Port.
        port: u16,
    },
    /// `tls://host:port` (feature `tls`): `tcp://` with TLS 1.3, both ends authenticated by
    /// certificates as the context's `TlsConfig` says. A client checks
    /// that the server's certificate names `host` (or the name the configuration gives).
    Tls {
        /// Address or name.
        host: String,
        /// Port.
        port: u16,
    },
    /// `inproc://name`: a channel inside this process, scoped to its [`Context`](crate::Context).
    Inproc {
        /// The name.
        name: String,
    },
    /// `shm://name` (a socket in the user's runtime directory) or `shm:///abs/path.sock`:
    /// shared memory between processes on this host.
    Shm {
        /// The name, or the absolute socket path (starting with `/`).
        name: String,
    },
    /// `rdma://host:port` (feature `rdma`): RDMA over InfiniBand or RoCE; `host:port` is the
    /// TCP address of the connection set-up, written as for `tcp://`.
    Rdma {
        /// Address or name.
        host: String,
        /// Port.
        port: u16,
    },
    /// `rdma+sim://name` (feature `rdma`): the RDMA transport over simulated verbs inside one
    /// process, for tests without hardware. Names are per context, as for `inproc://`.
    RdmaSim {
        /// The name.
        name: String,
    },
}

const SCHEMES: &str = "tcp://, tls://, shm://, inproc://, rdma://, rdma+sim://";

fn invalid(url: &str, why: impl fmt::Display) -> Error {
    Error::new(ErrorKind::InvalidUrl, format!("{url:?}: {why}"))
}

impl Endpoint {
    /// Parses a URL.
    pub fn parse(url: &str) -> Result<Endpoint, Error> {
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(invalid(
                url,
                format_args!("expected scheme://address, one of {SCHEMES}"),
            ));
        };
        match scheme.to_ascii_lowercase().as_str() {
            "tcp" => parse_tcp(url, rest),
            "inproc" => {
                if rest.is_empty() || rest.len() > 256 || rest.chars().any(char::is_whitespace) {
                    return Err(invalid(
                        url,
                        "an inproc name is 1 to 256 characters without spaces",
                    ));
                }
                Ok(Endpoint::Inproc {
                    name: rest.to_owned(),
                })
            }
            "shm" => {
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
                Ok(Endpoint::Shm {
                    name: rest.to_owned(),
                })
            }
            "tls" => match parse_tcp(url, rest)? {
                Endpoint::Tcp { host, port } => Ok(Endpoint::Tls { host, port }),
                _ => Err(invalid(url, "expected host:port")),
            },
            "rdma" => match parse_tcp(url, rest)? {
                Endpoint::Tcp { host, port } => Ok(Endpoint::Rdma { host, port }),
                _ => Err(invalid(url, "expected host:port")),
            },
            "rdma+sim" => {
                if rest.is_empty() || rest.len() > 256 || rest.chars().any(char::is_whitespace) {
                    return Err(invalid(
                        url,
                        "an rdma+sim name is 1 to 256 characters without spaces",
                    ));
                }
                Ok(Endpoint::RdmaSim {
                    name: rest.to_owned(),
                })
            }
            _ => Err(Error::new(
                ErrorKind::UnsupportedScheme,
                format!("{url:?}: unknown scheme {scheme:?} (supported: {SCHEMES})"),
            )),
        }
    }

    /// The scheme, without `://`.
    pub fn scheme(&self) -> &'static str {
        match self {
            Endpoint::Tcp { .. } => "tcp",
            Endpoint::Tls { .. } => "tls",
            Endpoint::Inproc { .. } => "inproc",
            Endpoint::Shm { .. } => "shm",
            Endpoint::Rdma { .. } => "rdma",
            Endpoint::RdmaSim { .. } => "rdma+sim",
        }
    }

    /// The cargo feature that compiles this endpoint's transport in.
    pub(crate) fn feature(&self) -> &'static str {
        match self {
            Endpoint::Rdma { .. } | Endpoint::RdmaSim { .. } => "rdma",
            other => other.scheme(),
        }
    }

    /// For `tcp://` with an IP address: the socket address, without a name lookup.
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        match self {
            Endpoint::Tcp { host, port } => host
                .parse::<IpAddr>()
                .ok()
                .map(|ip| SocketAddr::new(ip, *port)),
            Endpoint::Tls { .. }
            | Endpoint::Inproc { .. }
            | Endpoint::Shm { .. }
            | Endpoint::Rdma { .. }
            | Endpoint::RdmaSim { .. } => None,
        }
    }

    #[cfg(feature = "tcp")]
    pub(crate) fn from_socket_addr(addr: SocketAddr) -> Endpoint {
        Endpoint::Tcp {
            host: addr.ip().to_string(),
            port: addr.port(),
        }
    }
}

fn parse_tcp(url: &str, rest: &str) -> Result<Endpoint, Error> {
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
    Ok(Endpoint::Tcp {
        host: host.to_owned(),
        port,
    })
}

impl FromStr for Endpoint {
    type Err = Error;
    fn from_str(s: &str) -> Result<Endpoint, Error> {
        Endpoint::parse(s)
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp { host, port } if host.contains(':') => {
                write!(f, "tcp://[{host}]:{port}")
            }
            Endpoint::Tcp { host, port } => write!(f, "tcp://{host}:{port}"),
            Endpoint::Tls { host, port } if host.contains(':') => {
                write!(f, "tls://[{host}]:{port}")
            }
            Endpoint::Tls { host, port } => write!(f, "tls://{host}:{port}"),
            Endpoint::Inproc { name } => write!(f, "inproc://{name}"),
            Endpoint::Shm { name } => write!(f, "shm://{name}"),
            Endpoint::Rdma { host, port } if host.contains(':') => {
                write!(f, "rdma://[{host}]:{port}")
            }
            Endpoint::Rdma { host, port } => write!(f, "rdma://{host}:{port}"),
            Endpoint::RdmaSim { name } => write!(f, "rdma+sim://{name}"),
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
