//! The `tls://` flags of `hf listen`, `hf send` and `hf bench`, and the throwaway
//! certificates `hf bench` makes for itself on loopback.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::Args;
use hyperframes::{ContextBuilder, Endpoint};

use crate::Failure;

/// Whether `url` is a `tls://` URL.
pub(crate) fn is_tls(url: &str) -> bool {
    Endpoint::parse(url).is_ok_and(|ep| ep.scheme() == "tls")
}

/// Certificates and trust for `tls://` URLs.
#[derive(Clone, Debug, Default, Args)]
pub(crate) struct TlsArgs {
    /// tls://: this side's certificate chain, PEM (with --key): what a listener proves, and
    /// what a client presents to a listener that asks
    #[arg(long, value_name = "FILE", requires = "key")]
    pub(crate) cert: Option<PathBuf>,

    /// tls://: the private key of --cert, PEM (PKCS#8, PKCS#1 or SEC1)
    #[arg(long, value_name = "FILE", requires = "cert")]
    pub(crate) key: Option<PathBuf>,

    /// tls://: CA certificates to trust, PEM: a client checks the server's certificate
    /// against them; a listener given --ca requires every client to present a certificate
    /// signed by them (mutual TLS)
    #[arg(long, value_name = "FILE")]
    pub(crate) ca: Option<PathBuf>,

    /// tls://: the name the server's certificate must carry, instead of the URL's host
    #[arg(long, value_name = "NAME")]
    pub(crate) server_name: Option<String>,
}

impl TlsArgs {
    /// Whether any of the flags was given.
    pub(crate) fn given(&self) -> bool {
        self.cert.is_some() || self.ca.is_some() || self.server_name.is_some()
    }

    /// Refuses, as a usage error, flags that `url` cannot use and a `tls://` URL without the
    /// flags it needs: a listener proves itself with --cert and --key; a client checks the
    /// server against --ca.
    pub(crate) fn check(&self, url: &str, listening: bool) -> Result<(), Failure> {
        if !is_tls(url) {
            if self.given() {
                return Err(Failure::usage(
                    "--cert, --key, --ca and --server-name are for tls:// URLs",
                ));
            }
            return Ok(());
        }
        if listening && self.cert.is_none() {
            return Err(Failure::usage(
                "listening on tls:// needs --cert and --key: the certificate this listener \
                 proves itself with (add --ca to require client certificates)",
            ));
        }
        if listening && self.server_name.is_some() {
            return Err(Failure::usage(
                "--server-name names the server a client expects; a listener has no use for it",
            ));
        }
        if !listening && self.ca.is_none() {
            return Err(Failure::usage(
                "connecting to tls:// needs --ca: the CA that signed the server's certificate",
            ));
        }
        Ok(())
    }

    /// `b` with these certificates, when any were given. An unreadable file fails at run
    /// time (status 1); a file that is not what its flag says is a usage error (status 2).
    pub(crate) fn apply(&self, b: ContextBuilder) -> Result<ContextBuilder, Failure> {
        if !self.given() {
            return Ok(b);
        }
        #[cfg(feature = "tls")]
        {
            use hyperframes::{ErrorKind, TlsConfig};
            let classify = |e: hyperframes::Error| match e.kind() {
                ErrorKind::Config => Failure::usage(e),
                _ => Failure::runtime(e),
            };
            let mut tls = TlsConfig::from_pem_files(
                self.cert.as_deref(),
                self.key.as_deref(),
                self.ca.as_deref(),
            )
            .map_err(classify)?;
            if let Some(name) = &self.server_name {
                tls = tls.server_name(name).map_err(classify)?;
            }
            Ok(b.tls(tls))
        }
        #[cfg(not(feature = "tls"))]
        Err(Failure::usage(
            "--cert, --key, --ca and --server-name are for tls://, which this hf was built \
             without (build it with --features tls)",
        ))
    }

    /// The same flags, for a process `hf` starts.
    pub(crate) fn to_args(&self) -> Vec<OsString> {
        let mut out = Vec::new();
        for (flag, path) in [
            ("--cert", &self.cert),
            ("--key", &self.key),
            ("--ca", &self.ca),
        ] {
            if let Some(p) = path {
                out.push(flag.into());
                out.push(p.clone().into_os_string());
            }
        }
        if let Some(name) = &self.server_name {
            out.push("--server-name".into());
            out.push(name.into());
        }
        out
    }
}

/// A CA and a certificate it signed for `127.0.0.1`, written to a directory of their own
/// (removed on drop): what `hf bench` uses on loopback when not given certificates, both
/// ends presenting the one certificate (mutual TLS, as a cluster would run it).
#[cfg(feature = "tls")]
pub(crate) struct Throwaway {
    dir: PathBuf,
    pub(crate) args: TlsArgs,
}

#[cfg(feature = "tls")]
impl Throwaway {
    pub(crate) fn new() -> Result<Throwaway, Failure> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
        let fail = |e: &dyn std::fmt::Display| {
            Failure::runtime(format!("cannot make the benchmark's certificates: {e}"))
        };
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(|e| fail(&e))?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "hf bench throwaway CA");
        let ca_key = KeyPair::generate().map_err(|e| fail(&e))?;
        let ca = ca.self_signed(&ca_key).map_err(|e| fail(&e))?;
        let mut leaf = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
            .map_err(|e| fail(&e))?;
        leaf.distinguished_name.push(DnType::CommonName, "hf bench");
        let key = KeyPair::generate().map_err(|e| fail(&e))?;
        let leaf = leaf.signed_by(&key, &ca, &ca_key).map_err(|e| fail(&e))?;

        let dir = std::env::temp_dir().join(format!("hf-bench-tls-{}", std::process::id()));
        // Only this user reads the key, even a throwaway one.
        std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
            .create(&dir)
            .map_err(|e| fail(&e))?;
        let write = |name: &str, pem: String| -> Result<PathBuf, Failure> {
            let path = dir.join(name);
            std::fs::write(&path, pem).map_err(|e| fail(&e))?;
            Ok(path)
        };
        let args = TlsArgs {
            cert: Some(write("node.crt", leaf.pem())?),
            key: Some(write("node.key", key.serialize_pem())?),
            ca: Some(write("ca.crt", ca.pem())?),
            server_name: None,
        };
        Ok(Throwaway { dir, args })
    }
}

#[cfg(feature = "tls")]
impl Drop for Throwaway {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
