//! `tls://`: mutual authentication, the peer's identity, and every refusal (an unknown CA,
//! an expired or wrong-name certificate, a missing client certificate, plaintext at either
//! end), each a one-line typed error on the side that can act on it, counted by the listener,
//! which keeps serving. Run with `--nocapture` to see the refusal table.
#![cfg(feature = "tls")]

#[path = "common/certs.rs"]
mod certs;

use std::time::Duration;

use hyperframes::{Context, ErrorKind, IoEngine, Listener, Message, TlsConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use certs::{Ca, Leaf};

const GUARD: Duration = Duration::from_secs(20);

fn ctx(engine: IoEngine, tls: TlsConfig) -> Context {
    Context::builder()
        .io_engine(engine)
        .tls(tls)
        .build()
        .expect("context")
}

/// A `tls://` listener on `engine` proving `server` and trusting `ca` for clients (or
/// asking none, without one).
async fn listen(engine: IoEngine, server: &Leaf, client_ca: Option<&Ca>) -> (Context, Listener) {
    let tls = TlsConfig::from_pem(
        Some(server.cert.as_bytes()),
        Some(server.key.as_bytes()),
        client_ca.map(|c| c.pem.as_bytes()),
    )
    .unwrap();
    let ctx = ctx(engine, tls);
    let l = ctx.bind("tls://127.0.0.1:0").await.expect("bind");
    (ctx, l)
}

/// A client context trusting `ca` and proving `cert`, if given.
fn client(engine: IoEngine, ca: &Ca, cert: Option<&Leaf>) -> Context {
    let tls = TlsConfig::from_pem(
        cert.map(|c| c.cert.as_bytes()),
        cert.map(|c| c.key.as_bytes()),
        Some(ca.pem.as_bytes()),
    )
    .unwrap();
    ctx(engine, tls)
}

/// A round trip that works, accepted on `l` (proof that it still serves).
async fn serves(l: &mut Listener, c: &Context) {
    let url = l.local_url().to_owned();
    let (ch, acc) = tokio::join!(
        tokio::time::timeout(GUARD, c.connect(&url)),
        tokio::time::timeout(GUARD, l.accept())
    );
    let (mut ch, mut acc) = (ch.unwrap().expect("connect"), acc.unwrap().expect("accept"));
    ch.send(Message::new("t.ping").unwrap().with_body("x"))
        .await
        .unwrap();
    let got = tokio::time::timeout(GUARD, acc.recv())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(&got.body().as_bytes().unwrap()[..], b"x");
}

async fn wait_rejected(l: &Listener, n: u64) {
    let deadline = tokio::time::Instant::now() + GUARD;
    while l.rejected() < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "listener counted {} rejections, expected {n}",
            l.rejected()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn row(case: &str, engine: IoEngine, e: &hyperframes::Error) {
    let text = e.to_string();
    assert!(!text.contains('\n'), "one line: {text}");
    println!("| {case} | {engine} | {:?} | {text} |", e.kind());
}

async fn mutual_tls_identities(engine: IoEngine) {
    let ca = Ca::new("identity CA");
    let server = ca.leaf("server-1", &["127.0.0.1"]);
    let node = ca.leaf_with("trainer-3", &["trainer-3.cluster"], |p| {
        p.subject_alt_names.push(rcgen::SanType::URI(
            "spiffe://cluster/ns/ml/trainer".try_into().unwrap(),
        ));
    });
    let (_s, mut l) = listen(engine, &server, Some(&ca)).await;
    assert!(
        l.local_url().starts_with("tls://127.0.0.1:"),
        "{}",
        l.local_url()
    );
    let c = client(engine, &ca, Some(&node));
    let url = l.local_url().to_owned();
    let (ch, acc) = tokio::join!(c.connect(&url), l.accept());
    let (ch, acc) = (ch.unwrap(), acc.unwrap());
    assert_eq!(ch.info().transport(), "tls");
    assert!(ch.info().peer_url().starts_with("tls://"));
    let theirs = ch.info().peer_identity().expect("the server's identity");
    assert_eq!(theirs.common_name(), Some("server-1"));
    assert_eq!(theirs.subject(), "CN=server-1,O=hyperframes tests");
    let client_id = acc.info().peer_identity().expect("the client's identity");
    assert_eq!(client_id.common_name(), Some("trainer-3"));
    assert_eq!(client_id.dns_names(), ["trainer-3.cluster"]);
    assert_eq!(client_id.uris(), ["spiffe://cluster/ns/ml/trainer"]);
    assert!(!client_id.certificate_der().is_empty());
    // Without a CA on the server, clients are not asked for certificates.
    let (_s, mut open) = listen(engine, &server, None).await;
    let anon = client(engine, &ca, None);
    let url = open.local_url().to_owned();
    let (ch, acc) = tokio::join!(anon.connect(&url), open.accept());
    assert!(acc.unwrap().info().peer_identity().is_none());
    assert!(ch.unwrap().info().peer_identity().is_some());
}

async fn refusals(engine: IoEngine) {
    let ca = Ca::new("refusals CA");
    let other = Ca::new("some other CA");
    let server = ca.leaf("server", &["127.0.0.1", "svc.cluster"]);
    let node = ca.leaf("node", &["node.cluster"]);
    let (_s, mut l) = listen(engine, &server, Some(&ca)).await;
    let url = l.local_url().to_owned();
    let good = client(engine, &ca, Some(&node));
    let mut rejected = 0;

    // Unknown CA: the client refuses a server whose certificate it cannot chain.
    let e = client(engine, &other, Some(&node))
        .connect(&url)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
    assert!(e.to_string().contains("UnknownIssuer"), "{e}");
    row("server certificate from an unknown CA", engine, &e);
    rejected += 1; // the server hears the client's alert
    wait_rejected(&l, rejected).await;

    // A client certificate from an unknown CA: the server refuses, the client is told.
    let stranger = other.leaf("stranger", &["stranger"]);
    let e = client(engine, &ca, Some(&stranger))
        .connect(&url)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
    assert!(e.to_string().contains("refused our certificate"), "{e}");
    row("client certificate from an unknown CA", engine, &e);
    rejected += 1;
    wait_rejected(&l, rejected).await;

    // No client certificate where one is required.
    let e = client(engine, &ca, None).connect(&url).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
    assert!(e.to_string().contains("CertificateRequired"), "{e}");
    row("no client certificate, listener requires one", engine, &e);
    rejected += 1;
    wait_rejected(&l, rejected).await;

    // A name the server's certificate does not carry; then the same server named by
    // TlsConfig::server_name.
    let port = url.rsplit(':').next().unwrap();
    let by_name = format!("tls://localhost:{port}");
    let e = good.connect(&by_name).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
    assert!(e.to_string().contains("not valid for name"), "{e}");
    row("server certificate for another name", engine, &e);
    rejected += 1;
    wait_rejected(&l, rejected).await;
    let named = ctx(engine, node.config(&ca).server_name("svc.cluster").unwrap());
    let ch = named.connect(&by_name).await.expect("named server");
    assert_eq!(
        ch.info().peer_identity().unwrap().dns_names(),
        ["svc.cluster"]
    );
    let _acc = l.accept().await.unwrap();

    // Expired.
    let old = ca.leaf_with("old", &["127.0.0.1"], |p| {
        p.not_before = rcgen::date_time_ymd(2001, 1, 1);
        p.not_after = rcgen::date_time_ymd(2002, 1, 1);
    });
    let (_o, old_l) = listen(engine, &old, Some(&ca)).await;
    let e = good.connect(old_l.local_url()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
    assert!(e.to_string().contains("certificate expired"), "{e}");
    row("expired server certificate", engine, &e);
    wait_rejected(&old_l, 1).await;

    // Plaintext at a TLS listener, and TLS at a plaintext listener.
    let plain = Context::builder().io_engine(engine).build().unwrap();
    let e = plain
        .connect(&url.replace("tls://", "tcp://"))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
    assert!(e.to_string().contains("speaks TLS"), "{e}");
    row("tcp:// client at a tls:// listener", engine, &e);
    rejected += 1;
    wait_rejected(&l, rejected).await;

    let plain_l = plain.bind("tcp://127.0.0.1:0").await.unwrap();
    let e = good
        .connect(&plain_l.local_url().replace("tcp://", "tls://"))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
    assert!(e.to_string().contains("does not speak TLS"), "{e}");
    row("tls:// client at a tcp:// listener", engine, &e);
    wait_rejected(&plain_l, 1).await;

    // No TlsConfig at all: a configuration error, before any connection.
    let e = plain.connect(&url).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    row("tls:// without a TlsConfig", engine, &e);
    let e = plain.bind("tls://127.0.0.1:0").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    // A listener needs a certificate.
    let e = client(engine, &ca, None)
        .bind("tls://127.0.0.1:0")
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");

    // After all that, it still serves, and counted each refusal.
    serves(&mut l, &good).await;
    assert_eq!(l.rejected(), rejected);
}

/// 1000 handshakes that fail (plaintext, garbage, a hang-up mid-ClientHello), 32 at a time:
/// each is counted, none disturbs the listener, which then serves a good client.
async fn a_thousand_failed_handshakes(engine: IoEngine) {
    let (ca, node) = certs::shared();
    let (_s, mut l) = listen(engine, node, Some(ca)).await;
    let addr = l.local_url().strip_prefix("tls://").unwrap().to_owned();
    let hello = b"\x16\x03\x01\x00\xc8\x01\x00\x00\xc4\x03\x03";
    let mut set = tokio::task::JoinSet::new();
    for i in 0..1000usize {
        if set.len() >= 32 {
            set.join_next().await.unwrap().unwrap();
        }
        let addr = addr.clone();
        set.spawn(async move {
            let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
            match i % 3 {
                0 => s.write_all(b"HYPERFRM plaintext, not TLS").await.unwrap(),
                1 => s.write_all(&[0xff; 64]).await.unwrap(),
                _ => s.write_all(hello).await.unwrap(), // then hang up
            }
            let _ = s.shutdown().await;
            let mut sink = Vec::new();
            let _ = tokio::time::timeout(GUARD, s.read_to_end(&mut sink)).await;
        });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
    wait_rejected(&l, 1000).await;
    serves(&mut l, &ctx(engine, node.config(ca))).await;
    assert_eq!(l.rejected(), 1000);
}

macro_rules! engines {
    ($($name:ident),* $(,)?) => {
        mod inline { $( #[tokio::test] async fn $name() { super::$name(hyperframes::IoEngine::Inline).await } )* }
        mod uring { $( #[tokio::test] async fn $name() { super::$name(hyperframes::IoEngine::Uring).await } )* }
        mod epoll { $( #[tokio::test] async fn $name() { super::$name(hyperframes::IoEngine::Epoll).await } )* }
    };
}

engines!(
    mutual_tls_identities,
    refusals,
    a_thousand_failed_handshakes
);

#[test]
fn configuration_errors_say_what_is_missing() {
    let (ca, node) = certs::shared();
    let e = TlsConfig::from_pem(Some(node.cert.as_bytes()), None, None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.to_string().contains("needs its private key"), "{e}");
    let e = TlsConfig::from_pem(None, None, Some(b"not a certificate")).unwrap_err();
    assert!(e.to_string().contains("no PEM certificate"), "{e}");
    // From files, a file that is not what its flag says is named by its path.
    let junk = std::env::temp_dir().join(format!("hf-tls-junk-{}.pem", std::process::id()));
    std::fs::write(&junk, "not a key").unwrap();
    let e = TlsConfig::from_pem_files(None, None, Some(&junk)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.to_string().contains(junk.to_str().unwrap()), "{e}");
    let _ = std::fs::remove_file(&junk);
    let e = TlsConfig::from_pem(None, None, None).unwrap_err();
    assert!(e.to_string().contains("give a certificate"), "{e}");
    let e =
        TlsConfig::from_pem_files(None, None, Some("/nonexistent/ca.pem".as_ref())).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/ca.pem"), "{e}");
    let e = node.config(ca).server_name("not a name!").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
}
