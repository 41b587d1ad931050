//! Who the peer proved to be: the certificate it presented on `tls://`, as its verifier
//! accepted it, with the names a service authorizes by.

use std::fmt;

/// The identity the peer proved with its certificate (`tls://`): read it from
/// [`ChannelInfo::peer_identity`](crate::ChannelInfo::peer_identity) to authorize by it.
///
/// It is set on a channel only when the peer presented a certificate that this side's
/// verifier accepted during the TLS handshake: a client always sees the server's; a server
/// sees the client's when its `TlsConfig` has a CA (mutual TLS). The names
/// are the peer's own text: match them exactly, and print them escaped
/// ([`escape_untrusted`](crate::escape_untrusted); `Display` does).
#[derive(Clone, PartialEq, Eq)]
pub struct PeerIdentity {
    der: Vec<u8>,
    subject: String,
    dns_names: Vec<String>,
    uris: Vec<String>,
}

impl PeerIdentity {
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    pub(crate) fn new(
        der: Vec<u8>,
        subject: String,
        dns_names: Vec<String>,
        uris: Vec<String>,
    ) -> PeerIdentity {
        PeerIdentity {
            der,
            subject,
            dns_names,
            uris,
        }
    }

    /// The certificate, DER-encoded (for a parser of your choice, or pinning its hash).
    pub fn certificate_der(&self) -> &[u8] {
        &self.der
    }

    /// The certificate's subject, as `CN=node-7,O=cluster` (RFC 4514 order and escaping;
    /// attributes without a short name as their dotted OID). Empty when the subject is.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The subject's common name (`CN`), if it has one.
    pub fn common_name(&self) -> Option<&str> {
        // Rendered by `subject_text`, most specific attribute first: the first CN= is the one.
        let mut rest = self.subject.as_str();
        loop {
            if let Some(v) = rest.strip_prefix("CN=") {
                return Some(&v[..unescaped_end(v)]);
            }
            let cut = unescaped_end(rest);
            if cut == rest.len() {
                return None;
            }
            rest = &rest[cut + 1..];
        }
    }

    /// The DNS names of its subject alternative names.
    pub fn dns_names(&self) -> &[String] {
        &self.dns_names
    }

    /// The URIs of its subject alternative names (a SPIFFE ID, `spiffe://cluster/ns/job`).
    pub fn uris(&self) -> &[String] {
        &self.uris
    }
}

/// The end of one `key=value` of a subject: the first comma not escaped by a backslash.
fn unescaped_end(s: &str) -> usize {
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b',' => return i,
            _ => i += 1,
        }
    }
    b.len()
}

impl fmt::Debug for PeerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerIdentity")
            .field("subject", &crate::text::escape_untrusted(&self.subject))
            .field("dns_names", &self.dns_names)
            .field("uris", &self.uris)
            .finish_non_exhaustive()
    }
}

impl fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&crate::text::escape_untrusted(&self.subject))?;
        for n in self.dns_names.iter().chain(&self.uris) {
            write!(f, " {}", crate::text::escape_untrusted(n))?;
        }
        Ok(())
    }
}

/// The RFC 4514 text of a DER-encoded X.501 `Name` given without its outer `SEQUENCE`
/// (what webpki's `subject()` returns): `None` if it is not well-formed DER.
///
/// RFC 4514 writes the relative distinguished names last to first (`CN=…,O=…,C=…`).
#[cfg_attr(not(feature = "tls"), allow(dead_code))]
pub(crate) fn subject_text(mut rdns: &[u8]) -> Option<String> {
    let mut parts = Vec::new();
    while !rdns.is_empty() {
        let (tag, mut set, rest) = tlv(rdns)?;
        rdns = rest;
        if tag != 0x31 {
            return None; // SET OF AttributeTypeAndValue
        }
        let mut rdn = Vec::new();
        while !set.is_empty() {
            let (tag, atv, rest) = tlv(set)?;
            set = rest;
            if tag != 0x30 {
                return None;
            }
            let (tag, oid, value) = tlv(atv)?;
            if tag != 0x06 {
                return None;
            }
            let (vtag, value, _) = tlv(value)?;
            rdn.push(format!(
                "{}={}",
                attribute_name(oid)?,
                attribute_value(vtag, value)?
            ));
        }
        parts.push(rdn.join("+"));
    }
    parts.reverse();
    Some(parts.join(","))
}

/// One DER tag-length-value (short tags only): the tag, the value and what follows.
fn tlv(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, b) = b.split_first()?;
    let (&first, mut b) = b.split_first()?;
    let len = if first < 0x80 {
        first as usize
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || b.len() < n {
            return None;
        }
        let len = b[..n].iter().fold(0usize, |a, &x| (a << 8) | x as usize);
        b = &b[n..];
        len
    };
    (b.len() >= len).then(|| (tag, &b[..len], &b[len..]))
}

fn attribute_name(oid: &[u8]) -> Option<String> {
    // id-at (2.5.4.x) short names of RFC 4514, and the domain component.
    let short = match oid {
        [0x55, 0x04, 0x03] => "CN",
        [0x55, 0x04, 0x06] => "C",
        [0x55, 0x04, 0x07] => "L",
        [0x55, 0x04, 0x08] => "ST",
        [0x55, 0x04, 0x09] => "STREET",
        [0x55, 0x04, 0x0a] => "O",
        [0x55, 0x04, 0x0b] => "OU",
        [0x09, 0x92, 0x26, 0x89, 0x93, 0xf2, 0x2c, 0x64, 0x01, 0x19] => "DC",
        [0x09, 0x92, 0x26, 0x89, 0x93, 0xf2, 0x2c, 0x64, 0x01, 0x01] => "UID",
        _ => return dotted(oid),
    };
    Some(short.to_owned())
}

/// An OID in dotted form (`1.2.840.113549.1.9.1`).
fn dotted(oid: &[u8]) -> Option<String> {
    let mut arcs: Vec<u64> = Vec::new();
    let mut v: u64 = 0;
    for (i, &b) in oid.iter().enumerate() {
        if v > u64::MAX >> 7 {
            return None;
        }
        v = (v << 7) | (b & 0x7f) as u64;
        if b & 0x80 == 0 {
            if arcs.is_empty() {
                let first = (v / 40).min(2);
                arcs.push(first);
                arcs.push(v - first * 40);
            } else {
                arcs.push(v);
            }
            v = 0;
        } else if i + 1 == oid.len() {
            return None;
        }
    }
    if arcs.is_empty() {
        return None;
    }
    Some(
        arcs.iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join("."),
    )
}

/// A string value with RFC 4514's escapes; any other value as `#` and its DER in hex.
fn attribute_value(tag: u8, value: &[u8]) -> Option<String> {
    let text = match tag {
        // UTF8String, PrintableString, T61String (taken as Latin-1 would be wrong; as UTF-8
        // it is right for the ASCII that real certificates put there), IA5String.
        0x0c | 0x13 | 0x14 | 0x16 => std::str::from_utf8(value).ok(),
        _ => None,
    };
    let Some(text) = text else {
        // `#` and the value's whole DER encoding (tag, length, contents) in hex.
        let mut der = vec![tag];
        let len = value.len().to_be_bytes();
        let skip = len.iter().take_while(|&&b| b == 0).count();
        if value.len() < 0x80 {
            der.push(value.len() as u8);
        } else {
            der.push(0x80 | (len.len() - skip) as u8);
            der.extend_from_slice(&len[skip..]);
        }
        der.extend_from_slice(value);
        return Some(format!("#{}", hex_of(&der)));
    };
    let mut out = String::with_capacity(text.len());
    let last = text.chars().count().saturating_sub(1);
    for (i, c) in text.chars().enumerate() {
        let special = matches!(c, '"' | '+' | ',' | ';' | '<' | '>' | '\\')
            || (i == 0 && (c == '#' || c == ' '))
            || (i == last && c == ' ');
        if special {
            out.push('\\');
        }
        out.push(c);
    }
    Some(out)
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `SET { SEQUENCE { OID, UTF8String } }` for one attribute.
    fn rdn(oid: &[u8], value: &str) -> Vec<u8> {
        let mut atv = vec![0x06, oid.len() as u8];
        atv.extend_from_slice(oid);
        atv.extend_from_slice(&[0x0c, value.len() as u8]);
        atv.extend_from_slice(value.as_bytes());
        let mut seq = vec![0x30, atv.len() as u8];
        seq.extend(atv);
        let mut set = vec![0x31, seq.len() as u8];
        set.extend(seq);
        set
    }

    #[test]
    fn subjects_render_as_rfc_4514() {
        let mut name = rdn(&[0x55, 0x04, 0x06], "DE");
        name.extend(rdn(&[0x55, 0x04, 0x0a], "Frames, Inc."));
        name.extend(rdn(&[0x55, 0x04, 0x03], "node-7"));
        name.extend(rdn(
            &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x09, 0x01],
            "a@b",
        ));
        let text = subject_text(&name).unwrap();
        assert_eq!(
            text,
            r"1.2.840.113549.1.9.1=a@b,CN=node-7,O=Frames\, Inc.,C=DE"
        );
        let id = PeerIdentity::new(vec![], text, vec![], vec![]);
        assert_eq!(id.common_name(), Some("node-7"));
        assert_eq!(subject_text(&[]).as_deref(), Some(""));
        let none = PeerIdentity::new(vec![], "O=x\\,CN=y".into(), vec![], vec![]);
        assert_eq!(
            none.common_name(),
            None,
            "an escaped comma is not a separator"
        );
    }

    #[test]
    fn malformed_subjects_are_refused_not_trusted() {
        let good = rdn(&[0x55, 0x04, 0x03], "x");
        for cut in 0..good.len() {
            assert_eq!(
                subject_text(&good[..cut]).is_none(),
                cut != 0,
                "cut at {cut}"
            );
        }
        assert!(subject_text(&[0x30, 0x00]).is_none(), "not a SET");
        assert!(subject_text(&[0x31, 0x84, 0xff, 0xff, 0xff, 0xff]).is_none());
    }

    #[test]
    fn control_characters_are_shown_escaped() {
        let id = PeerIdentity::new(
            vec![],
            "CN=\u{1b}[2J".into(),
            vec!["a\u{202e}b".into()],
            vec![],
        );
        let shown = id.to_string();
        assert!(
            !shown.contains('\u{1b}') && !shown.contains('\u{202e}'),
            "{shown}"
        );
    }
}
