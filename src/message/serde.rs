//! serde for messages and their parts (feature `serde`).
//!
//! | type | form |
//! |---|---|
//! | [`MsgType`] | its name, a string |
//! | [`Meta`] | a map of strings, in the message's order |
//! | [`Flags`] | human-readable formats (JSON, YAML, TOML): a list of names, `["REQUEST"]`; others: the bits, a `u8` |
//! | [`Header`] | `{ "flags": …, "correlation": u64 }` |
//! | [`Body`] | bytes (in JSON an array of numbers); a body in device memory does not serialize |
//! | [`Message`] | `{ "type", "meta", "header", "body" }`; on the way in, all but `type` may be left out |
//!
//! What comes in is validated as the constructors validate it (type names, metadata keys and
//! values, reserved flag bits), and a map with a key twice is refused rather than resolved.

use std::collections::HashSet;
use std::fmt;

use ::serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use ::serde::ser::{self, Serialize, SerializeMap, SerializeSeq, SerializeStruct, Serializer};

use super::{Body, Flags, Header, Message, Meta, MsgType};

impl Serialize for MsgType {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for MsgType {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<MsgType, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = MsgType;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a message type, a dotted name such as \"video.frame\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<MsgType, E> {
                MsgType::new(v).map_err(E::custom)
            }
        }
        d.deserialize_str(V)
    }
}

impl Serialize for Meta {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.len()))?;
        for (k, v) in self.iter() {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Meta {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Meta, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Meta;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map of metadata keys to string values")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut entries: A) -> Result<Meta, A::Error> {
                let mut meta = Meta::new();
                let mut seen = HashSet::new();
                while let Some((k, v)) = entries.next_entry::<String, String>()? {
                    if seen.contains(k.as_str()) {
                        return Err(de::Error::custom(format_args!(
                            "metadata key {:?} appears twice",
                            crate::text::escape_untrusted(&k)
                        )));
                    }
                    meta.push_new(&k, &v).map_err(de::Error::custom)?;
                    seen.insert(k);
                }
                Ok(meta)
            }
        }
        d.deserialize_map(V)
    }
}

/// The flags with a name, in the order `Debug` shows them.
const NAMED: [(Flags, &str); 4] = [
    (Flags::REQUEST, "REQUEST"),
    (Flags::RESPONSE, "RESPONSE"),
    (Flags::DEVICE, "DEVICE"),
    (Flags::MORE, "MORE"),
];

impl Serialize for Flags {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if !s.is_human_readable() {
            return s.serialize_u8(self.bits());
        }
        let names: Vec<&str> = NAMED
            .iter()
            .filter(|(f, _)| self.contains(*f))
            .map(|(_, n)| *n)
            .collect();
        let mut seq = s.serialize_seq(Some(names.len()))?;
        for n in names {
            seq.serialize_element(n)?;
        }
        seq.end()
    }
}

impl<'de> Deserialize<'de> for Flags {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Flags, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Flags;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("message flags: a list of REQUEST, RESPONSE, DEVICE, MORE, or the bits")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Flags, E> {
                u8::try_from(v)
                    .ok()
                    .and_then(Flags::from_bits)
                    .ok_or_else(|| E::custom(format_args!("{v:#x} sets reserved flag bits")))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut names: A) -> Result<Flags, A::Error> {
                let mut flags = Flags::NONE;
                while let Some(name) = names.next_element::<String>()? {
                    let Some((f, _)) = NAMED.iter().find(|(_, n)| *n == name) else {
                        return Err(de::Error::custom(format_args!(
                            "unknown flag {:?}: the flags are REQUEST, RESPONSE, DEVICE, MORE",
                            crate::text::escape_untrusted(&name)
                        )));
                    };
                    flags = flags.union(*f);
                }
                Ok(flags)
            }
        }
        if d.is_human_readable() {
            d.deserialize_seq(V)
        } else {
            d.deserialize_u8(V)
        }
    }
}

impl Serialize for Header {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Header", 2)?;
        st.serialize_field("flags", &self.flags)?;
        st.serialize_field("correlation", &self.correlation)?;
        st.end()
    }
}

impl<'de> Deserialize<'de> for Header {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Header, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Header;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a message header: flags and correlation")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut fields: A) -> Result<Header, A::Error> {
                let mut h = Header::default();
                let (mut flags, mut correlation) = (false, false);
                while let Some(key) = fields.next_key::<String>()? {
                    match key.as_str() {
                        "flags" if !flags => {
                            h.flags = fields.next_value()?;
                            flags = true;
                        }
                        "correlation" if !correlation => {
                            h.correlation = fields.next_value()?;
                            correlation = true;
                        }
                        "flags" => return Err(de::Error::duplicate_field("flags")),
                        "correlation" => return Err(de::Error::duplicate_field("correlation")),
                        other => return Err(de::Error::unknown_field(other, HEADER_FIELDS)),
                    }
                }
                Ok(h)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Header, A::Error> {
                let flags = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(0, &self))?;
                let correlation = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(1, &self))?;
                Ok(Header { flags, correlation })
            }
        }
        d.deserialize_struct("Header", HEADER_FIELDS, V)
    }
}

const HEADER_FIELDS: &[&str] = &["flags", "correlation"];
const MESSAGE_FIELDS: &[&str] = &["type", "meta", "header", "body"];

impl Serialize for Body {
    /// The bytes; a body in device memory is an error (copy it to the host first).
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.as_bytes() {
            Some(b) => s.serialize_bytes(b),
            None => Err(ser::Error::custom(format_args!(
                "a body in device memory ({:?}, {} bytes) does not serialize: copy it to the host first",
                self.location(),
                self.len()
            ))),
        }
    }
}

impl<'de> Deserialize<'de> for Body {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Body, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Body;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a message body: bytes")
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Body, E> {
                Ok(Body::from(v.to_vec()))
            }
            fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Body, E> {
                Ok(Body::from(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Body, A::Error> {
                // The hint is the input's claim: bounded, so it cannot make us reserve more
                // than a page before the bytes are there.
                let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(b) = seq.next_element::<u8>()? {
                    v.push(b);
                }
                Ok(Body::from(v))
            }
        }
        d.deserialize_byte_buf(V)
    }
}

impl Serialize for Message {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Message", 4)?;
        st.serialize_field("type", self.kind())?;
        st.serialize_field("meta", self.meta())?;
        st.serialize_field("header", &self.header())?;
        st.serialize_field("body", self.body())?;
        st.end()
    }
}

impl<'de> Deserialize<'de> for Message {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Message, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Message;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a message: type, meta, header, body")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut fields: A) -> Result<Message, A::Error> {
                let mut kind: Option<MsgType> = None;
                let mut meta: Option<Meta> = None;
                let mut header: Option<Header> = None;
                let mut body: Option<Body> = None;
                while let Some(key) = fields.next_key::<String>()? {
                    match key.as_str() {
                        "type" => set(&mut kind, "type", fields.next_value()?)?,
                        "meta" => set(&mut meta, "meta", fields.next_value()?)?,
                        "header" => set(&mut header, "header", fields.next_value()?)?,
                        "body" => set(&mut body, "body", fields.next_value()?)?,
                        other => return Err(de::Error::unknown_field(other, MESSAGE_FIELDS)),
                    }
                }
                let kind = kind.ok_or_else(|| de::Error::missing_field("type"))?;
                Ok(Message::from_parts(
                    kind,
                    meta.unwrap_or_default(),
                    body.unwrap_or_default(),
                    header.unwrap_or_default(),
                ))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Message, A::Error> {
                let kind = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(0, &self))?;
                let meta = seq.next_element()?.unwrap_or_default();
                let header = seq.next_element()?.unwrap_or_default();
                let body = seq.next_element()?.unwrap_or_default();
                Ok(Message::from_parts(kind, meta, body, header))
            }
        }
        d.deserialize_struct("Message", MESSAGE_FIELDS, V)
    }
}

/// Sets a field seen for the first time.
fn set<T, E: de::Error>(slot: &mut Option<T>, name: &'static str, value: T) -> Result<(), E> {
    if slot.is_some() {
        return Err(E::duplicate_field(name));
    }
    *slot = Some(value);
    Ok(())
}
