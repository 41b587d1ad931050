//! Certificates made in the test (rcgen): a CA and the leaves it signs, as PEM.
#![allow(dead_code)] // each test crate uses part of it

use std::sync::OnceLock;

use hyperframes::TlsConfig;
use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair,
    KeyUsagePurpose,
};

/// A certificate authority.
pub(crate) struct Ca {
    pub(crate) pem: String,
    cert: Certificate,
    key: KeyPair,
}

/// A certificate and its key.
pub(crate) struct Leaf {
    pub(crate) cert: String,
    pub(crate) key: String,
}

impl Ca {
    pub(crate) fn new(name: &str) -> Ca {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        Ca {
            pem: cert.pem(),
            cert,
            key,
        }
    }

    /// A leaf for `cn` with these subject alternative names (IP addresses or DNS names).
    pub(crate) fn leaf(&self, cn: &str, sans: &[&str]) -> Leaf {
        self.leaf_with(cn, sans, |_| {})
    }

    /// The same, with `edit` applied to its parameters (validity, URIs, ...).
    pub(crate) fn leaf_with(
        &self,
        cn: &str,
        sans: &[&str],
        edit: impl FnOnce(&mut CertificateParams),
    ) -> Leaf {
        let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
        let mut p = CertificateParams::new(sans).unwrap();
        // In the conventional order, most general first: rendered `CN=…,O=…`.
        p.distinguished_name = DistinguishedName::new();
        p.distinguished_name
            .push(DnType::OrganizationName, "hyperframes tests");
        p.distinguished_name.push(DnType::CommonName, cn);
        edit(&mut p);
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

impl Leaf {
    /// This side proves `self`, and trusts `ca` (as a server: clients must present a
    /// certificate it signed).
    pub(crate) fn config(&self, ca: &Ca) -> TlsConfig {
        TlsConfig::from_pem(
            Some(self.cert.as_bytes()),
            Some(self.key.as_bytes()),
            Some(ca.pem.as_bytes()),
        )
        .unwrap()
    }
}

/// One CA and one node certificate for `127.0.0.1` and `localhost`, shared by a test binary
/// (key generation is the slow part).
pub(crate) fn shared() -> &'static (Ca, Leaf) {
    static PKI: OnceLock<(Ca, Leaf)> = OnceLock::new();
    PKI.get_or_init(|| {
        let ca = Ca::new("hyperframes test CA");
        let node = ca.leaf("node", &["127.0.0.1", "localhost"]);
        (ca, node)
    })
}

/// The shared node's configuration: it proves the node certificate and requires one signed
/// by the shared CA (mutual TLS when both ends use it).
pub(crate) fn mutual() -> TlsConfig {
    let (ca, node) = shared();
    node.config(ca)
}
