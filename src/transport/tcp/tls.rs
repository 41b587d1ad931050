//! `tls://`: TLS 1.3 (rustls, on ring's primitives) under the tcp wire protocol.
//!
//! rustls is sans-IO: a [`Session`] takes ciphertext in and gives plaintext out, and the
//! other way round; the engines move the bytes. Two ways of moving them:
//!
//! - [`TlsIo`] wraps an engine's completion-style stream (io_uring, or epoll on the I/O
//!   threads) and is itself one, so the I/O-thread driver runs over it unchanged; both
//!   engines also run the TLS handshake and the hyperframes handshake over it.
//! - The inline engine (`direct`) seals and opens records itself, from the tasks that use the
//!   channel, with the same non-blocking socket calls as plain tcp: no thread or task hop.
//!
//! Copies, against plain tcp: sending, the plaintext is copied once into the record being
//! sealed (AES-GCM then runs in place there), and the records go to the socket as they are
//! (the I/O threads copy them once more into one buffer, which io_uring owns while it
//! writes). Receiving, ciphertext is read in large reads into a buffer of ours, handed to
//! rustls a record at a time (a copy into its record buffer), opened in place, and copied once
//! into the receive buffer or a large body's own buffer. The kernel has no TLS offload on the
//! measured host (CONFIG_TLS is off); [`Session`] is the seam where kTLS would take the keys.
//!
//! Only TLS 1.3, without session resumption or early data: every connection proves its
//! certificates, and there is no replayable 0-RTT data. AES-128-GCM is preferred: with
//! AES-NI it is the fastest suite ring has (AES-256-GCM and ChaCha20-Poly1305 are offered
//! after it).

use std::io::{self, IoSlice, Write};
use std::net::{Shutdown, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use super::sys::Io;
use crate::error::{Error, ErrorKind, Result};
use crate::transport::Endpoint;
use crate::transport::identity::{self, PeerIdentity};
use crate::transport::{Config, Parts};

/// Plaintext encrypted per write: large enough to amortise the system call, small enough to
/// bound the ciphertext held at once.
const WRITE_CHUNK: usize = 256 << 10;
/// Ciphertext read at a time.
const READ_CHUNK: usize = 64 << 10;
/// ... and during the TLS handshake (a silent peer holds this until the handshake timeout;
/// the buffer grows if a flight is larger).
const HANDSHAKE_READ: usize = 4 << 10;

/// TLS settings of a [`Context`](crate::Context), for `tls://` URLs: what this side proves
/// (its certificate and key) and whom it trusts (a CA).
///
/// - Listening on `tls://` needs a certificate and key. With a CA as well, every client must
///   present a certificate signed by it (mutual TLS); without one, clients are not asked.
/// - Connecting to `tls://host:port` needs a CA: the server's certificate must be signed by it
///   and name `host` (or the name given to [`server_name`](TlsConfig::server_name)). With a
///   certificate and key as well, they are presented to servers that ask.
///
/// Only TLS 1.3 is spoken; there is no session resumption and no early data.
///
/// ```no_run
/// # fn main() -> hyperframes::Result<()> {
/// use hyperframes::{Context, TlsConfig};
/// let tls = TlsConfig::from_pem_files(
///     Some("node.crt".as_ref()),
///     Some("node.key".as_ref()),
///     Some("cluster-ca.crt".as_ref()),
/// )?;
/// let ctx = Context::builder().tls(tls).build()?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct TlsConfig {
    client: Option<Arc<ClientConfig>>,
    server: Option<Arc<ServerConfig>>,
    server_name: Option<ServerName<'static>>,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConfig")
            .field("can_connect", &self.client.is_some())
            .field("can_listen", &self.server.is_some())
            .field("server_name", &self.server_name)
            .finish()
    }
}

fn config_error(what: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Config, format!("TLS configuration: {what}"))
}

fn read_file(path: &Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::io(format!("reading the {what} {}", path.display()), e))
}

fn certificates(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| config_error(format_args!("the {what} is not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(config_error(format_args!(
            "the {what} holds no PEM certificate (expected -----BEGIN CERTIFICATE-----)"
        )));
    }
    Ok(certs)
}

/// ring's provider, AES-128-GCM first (see the module docs).
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    use rustls::crypto::ring::cipher_suite as suite;
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites = vec![
        suite::TLS13_AES_128_GCM_SHA256,
        suite::TLS13_AES_256_GCM_SHA384,
        suite::TLS13_CHACHA20_POLY1305_SHA256,
    ];
    Arc::new(p)
}

impl TlsConfig {
    /// From PEM files (see [`from_pem`](TlsConfig::from_pem)).
    pub fn from_pem_files(
        cert: Option<&Path>,
        key: Option<&Path>,
        ca: Option<&Path>,
    ) -> Result<TlsConfig> {
        // Each file is parsed on its own first, so that a bad one is named by its path.
        let certs = |p: &Path, what: &str| -> Result<Vec<u8>> {
            let pem = read_file(p, what)?;
            certificates(&pem, &format!("{what} file {}", p.display()))?;
            Ok(pem)
        };
        let cert = cert.map(|p| certs(p, "certificate")).transpose()?;
        let ca = ca.map(|p| certs(p, "CA certificate")).transpose()?;
        let key = key
            .map(|p| {
                let pem = read_file(p, "private key")?;
                PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
                    config_error(format_args!("the private key file {}: {e}", p.display()))
                })?;
                Ok::<_, Error>(pem)
            })
            .transpose()?;
        TlsConfig::from_pem(cert.as_deref(), key.as_deref(), ca.as_deref())
    }

    /// From PEM text: `cert`, this side's certificate chain (its own certificate first), with
    /// `key`, its private key (PKCS#8, PKCS#1 or SEC1); `ca`, the certificates to trust.
    /// Certificate and key come together or not at all; at least one of them or `ca` is needed.
    pub fn from_pem(
        cert: Option<&[u8]>,
        key: Option<&[u8]>,
        ca: Option<&[u8]>,
    ) -> Result<TlsConfig> {
        let identity = match (cert, key) {
            (Some(cert), Some(key)) => {
                let chain = certificates(cert, "certificate")?;
                let key = PrivateKeyDer::from_pem_slice(key)
                    .map_err(|e| config_error(format_args!("the private key: {e}")))?;
                Some((chain, key))
            }
            (None, None) => None,
            _ => {
                return Err(config_error(
                    "a certificate needs its private key, and a key its certificate",
                ));
            }
        };
        let roots = match ca {
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for c in certificates(ca, "CA certificate")? {
                    roots
                        .add(c)
                        .map_err(|e| config_error(format_args!("the CA certificate: {e}")))?;
                }
                Some(Arc::new(roots))
            }
            None => None,
        };
        if identity.is_none() && roots.is_none() {
            return Err(config_error(
                "give a certificate and key (to listen), a CA (to connect), or both",
            ));
        }
        let server = match &identity {
            Some((chain, key)) => {
                let verifier = match &roots {
                    Some(roots) => {
                        WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
                            .build()
                            .map_err(|e| config_error(format_args!("the client verifier: {e}")))?
                    }
                    None => WebPkiClientVerifier::no_client_auth(),
                };
                let mut server = ServerConfig::builder_with_provider(provider())
                    .with_protocol_versions(&[&rustls::version::TLS13])
                    .map_err(config_error)?
                    .with_client_cert_verifier(verifier)
                    .with_single_cert(chain.clone(), key.clone_key())
                    .map_err(|e| config_error(format_args!("the certificate and key: {e}")))?;
                server.send_tls13_tickets = 0;
                Some(Arc::new(server))
            }
            None => None,
        };
        let client = match &roots {
            Some(roots) => {
                let builder = ClientConfig::builder_with_provider(provider())
                    .with_protocol_versions(&[&rustls::version::TLS13])
                    .map_err(config_error)?
                    .with_root_certificates(roots.clone());
                let mut client = match identity {
                    Some((chain, key)) => builder
                        .with_client_auth_cert(chain, key)
                        .map_err(|e| config_error(format_args!("the certificate and key: {e}")))?,
                    None => builder.with_no_client_auth(),
                };
                client.resumption = rustls::client::Resumption::disabled();
                Some(Arc::new(client))
            }
            None => None,
        };
        Ok(TlsConfig {
            client,
            server,
            server_name: None,
        })
    }

    /// From rustls configurations the application already has: `client` for connecting,
    /// `server` for listening. They are used as given (protocol versions, verifiers, ALPN).
    pub fn from_rustls(
        client: Option<Arc<ClientConfig>>,
        server: Option<Arc<ServerConfig>>,
    ) -> TlsConfig {
        TlsConfig {
            client,
            server,
            server_name: None,
        }
    }

    /// The name a server's certificate must carry, instead of the host of the `tls://` URL
    /// (for a server reached by address, or through a name its certificate does not list).
    pub fn server_name(mut self, name: &str) -> Result<TlsConfig> {
        let name = ServerName::try_from(name.to_owned())
            .map_err(|_| config_error(format_args!("{name:?} is not a DNS name or IP address")))?;
        self.server_name = Some(name);
        Ok(self)
    }

    /// A client session for `host`.
    pub(crate) fn connector(&self, host: &str) -> Result<Session> {
        let config = self.client.clone().ok_or_else(|| {
            config_error(
                "connecting to tls:// needs a CA to check the server's certificate \
                 (TlsConfig with a CA; hf: --ca FILE)",
            )
        })?;
        let name = match &self.server_name {
            Some(n) => n.clone(),
            None => ServerName::try_from(host.to_owned()).map_err(|_| {
                config_error(format_args!(
                    "{host:?} cannot be checked against a certificate; name the server with \
                     TlsConfig::server_name"
                ))
            })?,
        };
        let conn = rustls::ClientConnection::new(config, name).map_err(config_error)?;
        Ok(Session::new(conn.into()))
    }

    /// A server session for an accepted connection.
    pub(crate) fn acceptor(&self) -> Result<Session> {
        let config = self.server.clone().ok_or_else(|| {
            config_error(
                "listening on tls:// needs a certificate and its key \
                 (TlsConfig with cert and key; hf: --cert FILE --key FILE)",
            )
        })?;
        let conn = rustls::ServerConnection::new(config).map_err(config_error)?;
        Ok(Session::new(conn.into()))
    }

    /// Checks, at bind time, that accepted connections can be served.
    pub(crate) fn check_listen(&self) -> Result<()> {
        self.acceptor().map(drop)
    }
}

fn unconfigured() -> Error {
    config_error(
        "tls:// needs certificates: give the context a TlsConfig (ContextBuilder::tls; hf: \
         --cert, --key, --ca)",
    )
}

/// A client session for `host` (`tls://host:port`), from the context's settings.
pub(crate) fn client(cfg: &Config, host: &str) -> Result<Session> {
    cfg.tls.as_ref().ok_or_else(unconfigured)?.connector(host)
}

/// The settings a `tls://` listener makes its sessions from, checked at bind time.
pub(crate) fn server(cfg: &Config) -> Result<TlsConfig> {
    let tls = cfg.tls.clone().ok_or_else(unconfigured)?;
    tls.check_listen()?;
    Ok(tls)
}

/// The `ErrorKind::Auth` (or `Protocol`) error for a failed TLS exchange with `peer`.
fn refused(e: &rustls::Error, peer: &str) -> Error {
    use rustls::{AlertDescription as A, Error as E};
    let (kind, why) = match e {
        E::InvalidMessage(_) | E::InappropriateMessage { .. } => (
            ErrorKind::Protocol,
            format!("{e}: the peer does not speak TLS (a tcp:// peer at a tls:// address?)"),
        ),
        E::NoCertificatesPresented => (
            ErrorKind::Auth,
            "the client presented no certificate, and this listener requires one".to_owned(),
        ),
        E::InvalidCertificate(_) => (
            ErrorKind::Auth,
            format!("the peer's certificate was refused: {e}"),
        ),
        E::AlertReceived(A::CertificateRequired) => (
            ErrorKind::Auth,
            "the peer requires a client certificate, and we have none to present (TLS alert \
             CertificateRequired)"
                .to_owned(),
        ),
        E::AlertReceived(
            a @ (A::UnknownCA
            | A::BadCertificate
            | A::CertificateExpired
            | A::CertificateUnknown
            | A::AccessDenied
            | A::DecryptError
            | A::CertificateRevoked
            | A::UnsupportedCertificate),
        ) => (
            ErrorKind::Auth,
            format!("the peer refused our certificate (TLS alert {a:?})"),
        ),
        _ => (ErrorKind::Auth, format!("TLS failed: {e}")),
    };
    Error::new(kind, format!("tls with {peer}: {why}"))
}

/// One TLS connection's state, shared by the halves of a connection (each holds the lock
/// only while moving bytes in or out of rustls, never across a wait).
pub(crate) struct Session {
    conn: Mutex<rustls::Connection>,
    /// The TLS failure that ended the session, kept to name it (the stream only reports an
    /// I/O error).
    failure: Mutex<Option<rustls::Error>>,
}

impl Session {
    fn new(mut conn: rustls::Connection) -> Session {
        // Bounded by the callers instead: they seal at most WRITE_CHUNK at a time, and only
        // once what was sealed before has been written.
        conn.set_buffer_limit(None);
        Session {
            conn: Mutex::new(conn),
            failure: Mutex::new(None),
        }
    }

    fn lock(&self) -> MutexGuard<'_, rustls::Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn failed(&self, e: rustls::Error) -> io::Error {
        let mut f = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        f.get_or_insert(e.clone());
        io::Error::new(io::ErrorKind::InvalidData, e)
    }

    /// The TLS failure behind `e`, if there was one, as the error to report (else `e`).
    pub(crate) fn explain(&self, e: Error, peer: &str) -> Error {
        match &*self.failure.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(tls) => refused(tls, peer),
            None => e,
        }
    }

    /// The peer's certificate, once the handshake is done, if it presented one.
    pub(crate) fn identity(&self) -> Option<PeerIdentity> {
        let c = self.lock();
        let der = c.peer_certificates()?.first()?;
        let (subject, dns, uris) = match webpki::EndEntityCert::try_from(der) {
            Ok(cert) => (
                identity::subject_text(cert.subject()).unwrap_or_default(),
                cert.valid_dns_names().map(str::to_owned).collect(),
                cert.valid_uri_names().map(str::to_owned).collect(),
            ),
            Err(_) => Default::default(),
        };
        Some(PeerIdentity::new(der.to_vec(), subject, dns, uris))
    }

    // -- receiving ---------------------------------------------------------------------------

    /// Copies decrypted bytes into `buf` (at most `most`, and no more than its spare
    /// capacity). `Some(0)`: the peer's stream has ended; `None`: none are decrypted.
    fn read_plain(
        c: &mut rustls::Connection,
        buf: &mut BytesMut,
        most: usize,
    ) -> io::Result<Option<usize>> {
        let mut reader = c.reader();
        let room = most.min(buf.capacity() - buf.len());
        let mut copied = 0;
        while copied < room {
            match io::BufRead::fill_buf(&mut reader) {
                Ok([]) => break,
                Ok(chunk) => {
                    let n = chunk.len().min(room - copied);
                    buf.extend_from_slice(&chunk[..n]);
                    io::BufRead::consume(&mut reader, n);
                    copied += n;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Ok((copied > 0).then_some(copied));
                }
                // The peer closed the socket without close_notify: an end of stream all the
                // same (the channel's own CLOSE frame, authenticated, tells a clean end
                // from a cut).
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
                Err(e) => return Err(e),
            }
        }
        Ok(Some(copied))
    }

    /// Decrypted bytes into `buf` (at most `most`), taking ciphertext from the front of
    /// `cipher` as needed: `Some(0)` at the end of the peer's stream, `None` when `cipher`
    /// holds no whole record more (read more from the socket into it).
    pub(crate) fn take(
        &self,
        cipher: &mut BytesMut,
        buf: &mut BytesMut,
        most: usize,
    ) -> io::Result<Option<usize>> {
        let mut c = self.lock();
        loop {
            if let Some(n) = Self::read_plain(&mut c, buf, most)? {
                return Ok(Some(n));
            }
            if cipher.is_empty() {
                return Ok(None);
            }
            let before = cipher.len();
            self.feed(&mut c, cipher)?;
            if cipher.len() == before {
                // Neither decrypted bytes to give nor room to take more: cannot happen with
                // rustls' rules (see `feed`), and must not spin if it does.
                return Err(io::Error::other("the TLS session takes no more data"));
            }
        }
    }

    /// Hands rustls ciphertext from the front of `cipher` and decrypts it: a record at a
    /// time, while it wants more (it stops while decrypted bytes wait to be read, and while
    /// handshake records of its own wait to be sent).
    fn feed(&self, c: &mut rustls::Connection, cipher: &mut BytesMut) -> io::Result<()> {
        while !cipher.is_empty() && c.wants_read() {
            let n = c.read_tls(&mut &cipher[..])?;
            cipher.advance(n);
            if let Err(e) = c.process_new_packets() {
                return Err(self.failed(e));
            }
        }
        Ok(())
    }

    /// The socket reached its end: what rustls makes of it (an error if it cuts a record).
    pub(crate) fn end_of_stream(&self) -> io::Result<()> {
        let mut c = self.lock();
        c.read_tls(&mut io::empty())?;
        if let Err(e) = c.process_new_packets() {
            drop(c);
            return Err(self.failed(e));
        }
        Ok(())
    }

    // -- sending -----------------------------------------------------------------------------

    /// Encrypts up to [`WRITE_CHUNK`] bytes from the front of `bufs` into records waiting in
    /// the session (see [`write_to`](Session::write_to)); returns how many it took.
    pub(crate) fn seal(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut total = 0;
        let mut cut = None;
        for (i, b) in bufs.iter().enumerate() {
            if total + b.len() > WRITE_CHUNK {
                cut = Some((i, WRITE_CHUNK - total));
                break;
            }
            total += b.len();
        }
        let mut c = self.lock();
        match cut {
            None => c.writer().write_vectored(bufs),
            Some((i, part)) => {
                let mut first: Vec<IoSlice<'_>> = bufs[..i].to_vec();
                first.push(IoSlice::new(&bufs[i][..part]));
                c.writer().write_vectored(&first)
            }
        }
    }

    /// Writes the records waiting in the session to `sock` without blocking; `Ok(true)`
    /// when none is left.
    pub(crate) fn write_to(&self, sock: &tokio::net::TcpStream) -> io::Result<bool> {
        let mut c = self.lock();
        while c.wants_write() {
            match c.write_tls(&mut SockIo(sock)) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// The records waiting in the session, as one buffer (empty if none).
    fn take_output(&self) -> io::Result<Bytes> {
        let mut c = self.lock();
        let mut out = Vec::new();
        while c.wants_write() {
            c.write_tls(&mut out)?;
        }
        Ok(out.into())
    }

    /// Queues the `close_notify` alert (written with the next records): this side sends no
    /// more.
    pub(crate) fn close_notify(&self) {
        self.lock().send_close_notify();
    }
}

/// A tokio socket as a non-blocking `Write` for rustls' records.
struct SockIo<'a>(&'a tokio::net::TcpStream);

impl Write for SockIo<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.try_write(buf)
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.0.try_write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Over a completion-style stream (the I/O threads, and every handshake)
// ---------------------------------------------------------------------------------------

/// An engine's stream with TLS over it; an [`Io`] itself.
pub(crate) struct TlsIo<S> {
    inner: S,
    session: Arc<Session>,
    /// Ciphertext read and not yet taken by rustls (only the reading side uses it).
    cipher: Mutex<BytesMut>,
}

impl<S: Io> TlsIo<S> {
    /// Runs the TLS handshake over `inner`, within `timeout`. A failure is the typed error
    /// of [`refused`], and the peer is sent the alert that says why, when there is one.
    pub(crate) async fn handshake(
        inner: S,
        session: Session,
        peer: &str,
        timeout: Duration,
    ) -> Result<TlsIo<S>> {
        let io = TlsIo {
            inner,
            session: Arc::new(session),
            cipher: Mutex::new(BytesMut::new()),
        };
        let res = match tokio::time::timeout(timeout, io.run_handshake()).await {
            Ok(r) => r,
            Err(_) => Err(Error::new(
                ErrorKind::TimedOut,
                format!("tls with {peer}: no TLS handshake within {timeout:?}"),
            )),
        };
        match res {
            Ok(()) => Ok(io),
            Err(e) => {
                let e = io.session.explain(e, peer);
                io.abandon().await;
                Err(e)
            }
        }
    }

    /// After a failure: the alert rustls queued for the peer (best effort, briefly), then
    /// shut the socket down.
    pub(crate) async fn abandon(&self) {
        if let Ok(alert) = self.session.take_output()
            && !alert.is_empty()
        {
            let _ = tokio::time::timeout(
                Duration::from_millis(200),
                self.inner.write_all(vec![alert]),
            )
            .await;
        }
        let _ = self.inner.shutdown(Shutdown::Both);
    }

    async fn run_handshake(&self) -> Result<()> {
        let mut cipher = BytesMut::new();
        loop {
            let out = self
                .session
                .take_output()
                .map_err(|e| Error::io("tls handshake", e))?;
            if !out.is_empty() {
                self.inner
                    .write_all(vec![out])
                    .await
                    .map_err(|e| Error::io("tls handshake: writing", e))?;
            }
            if !self.session.lock().is_handshaking() {
                // Records that came with the last flight are read as data.
                *self.cipher.lock().unwrap_or_else(|p| p.into_inner()) = cipher;
                return Ok(());
            }
            if !cipher.is_empty() {
                let before = cipher.len();
                let fed = self.session.feed(&mut self.session.lock(), &mut cipher);
                fed.map_err(|e| Error::io("tls handshake", e))?;
                if cipher.len() == before {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        "tls handshake: the session takes no more data",
                    ));
                }
                // Round again: rustls may have an answer to send, or want more.
                continue;
            }
            cipher.reserve(HANDSHAKE_READ);
            let spare = cipher.capacity() - cipher.len();
            let (res, b) = self.inner.read(cipher, spare).await;
            cipher = b;
            match res {
                Ok(0) => {
                    let _ = self.session.end_of_stream();
                    return Err(Error::new(
                        ErrorKind::ConnectionLost,
                        "the peer closed the connection during the TLS handshake",
                    ));
                }
                Ok(_) => {}
                Err(e) => return Err(Error::io("tls handshake: reading", e)),
            }
        }
    }

    pub(crate) fn session(&self) -> &Arc<Session> {
        &self.session
    }

    /// Back to the plain stream, the session and the ciphertext read but not yet decrypted
    /// (for the inline engine, which drives the session itself).
    pub(crate) fn into_parts(self) -> (S, Arc<Session>, BytesMut) {
        let cipher = self.cipher.into_inner().unwrap_or_else(|p| p.into_inner());
        (self.inner, self.session, cipher)
    }
}

impl<S: Io> Io for TlsIo<S> {
    async fn read(&self, mut buf: BytesMut, max: usize) -> (io::Result<usize>, BytesMut) {
        let mut cipher =
            std::mem::take(&mut *self.cipher.lock().unwrap_or_else(|p| p.into_inner()));
        let res = loop {
            match self.session.take(&mut cipher, &mut buf, max) {
                Ok(Some(n)) => break Ok(n),
                Ok(None) => {}
                Err(e) => break Err(e),
            }
            cipher.reserve(READ_CHUNK);
            let (res, b) = self.inner.read(cipher, READ_CHUNK).await;
            cipher = b;
            match res {
                Ok(0) => {
                    break self
                        .session
                        .end_of_stream()
                        .and_then(|()| self.session.take(&mut cipher, &mut buf, max))
                        .map(|n| n.unwrap_or(0));
                }
                Ok(_) => {}
                Err(e) => break Err(e),
            }
        };
        *self.cipher.lock().unwrap_or_else(|p| p.into_inner()) = cipher;
        (res, buf)
    }

    async fn writev(&self, bufs: Vec<Bytes>) -> (io::Result<usize>, Vec<Bytes>) {
        let sealed = {
            let slices: Vec<IoSlice<'_>> = bufs.iter().map(|b| IoSlice::new(b)).collect();
            self.session
                .seal(&slices)
                .and_then(|n| Ok((n, self.session.take_output()?)))
        };
        let (n, records) = match sealed {
            Ok(r) => r,
            Err(e) => return (Err(e), bufs),
        };
        // All of it: a record cannot wait half-written for the next call.
        if let Err(e) = self.inner.write_all(vec![records]).await {
            return (Err(e), bufs);
        }
        (Ok(n), bufs)
    }

    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        // A FIN without close_notify: the peer takes it as the end of the stream all the
        // same (see `Session::read_plain`); the channel's CLOSE frame is what says it was
        // a clean one.
        self.inner.shutdown(how)
    }
}

/// Marks `parts` as a TLS channel: its URLs say `tls://`, and it carries the peer's identity.
pub(crate) fn label(parts: &mut Parts, session: &Session, local: SocketAddr, peer: SocketAddr) {
    parts.transport = "tls";
    parts.local = url(local);
    parts.peer = url(peer);
    parts.peer_identity = session.identity().map(Arc::new);
}

/// `tls://addr`.
pub(crate) fn url(addr: SocketAddr) -> String {
    Endpoint::from_socket_addr(addr)
        .with_scheme("tls")
        .to_string()
}
