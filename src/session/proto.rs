//! The session protocol: control messages over an ordinary channel.
//!
//! Every data message carries its sequence number (from 1, per direction) as the last
//! metadata entry `hf.seq`. Control messages have types under `hf.session.`:
//!
//! | type | sent by | metadata | meaning |
//! |---|---|---|---|
//! | `hf.session.hello` | connecting side, first on each connection | `v`, `id` (32 hex digits), `resume` (`1` when the session existed), `delivered` | which session, and the last sequence number it delivered |
//! | `hf.session.welcome` | listening side, first on each connection | `v`, `known` (`1`: resumed, `0`: new), `delivered` | the same from the other side |
//! | `hf.session.ack` | either | `seq` | every message up to `seq` is delivered |
//! | `hf.session.fin` | either, numbered like data (`hf.seq`) | - | the sender closed its direction after the messages before |
//! | `hf.session.stop` | either | - | the receiving half was dropped: send nothing more |
//!
//! After hello and welcome each side drops what the other delivered and resends the rest.

use bytes::{BufMut, BytesMut};

use crate::error::{Error, ErrorKind, Result};
use crate::message::{Flags, Message, MetaValue, MsgType};

/// The type of the message a connecting side's [`Receiver`](crate::Receiver) yields when the
/// listening side lost the session (it restarted): the messages the old process had
/// acknowledged may or may not have been handled. Its body lists, as little-endian `u64`s,
/// the correlation ids of the requests being resent to the new process (they will be
/// answered); [`middleware::Client`](crate::middleware::Client) fails its other requests in
/// flight.
pub const RESET_TYPE: &str = "hf.session.reset";

pub(crate) const PREFIX: &str = "hf.session.";
pub(crate) const SEQ: &str = "hf.seq";
const HELLO: &str = "hf.session.hello";
const WELCOME: &str = "hf.session.welcome";
const ACK: &str = "hf.session.ack";
pub(crate) const FIN: &str = "hf.session.fin";
const STOP: &str = "hf.session.stop";
const VERSION: &str = "1";

/// Metadata bytes a session adds to a message at most: `hf.seq` with a 20-digit value, and
/// the count prefix of an empty map.
pub(crate) const SEQ_META_BYTES: u32 = 2 + 1 + SEQ.len() as u32 + 2 + 20;

/// What the connecting side says first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) id: u128,
    pub(crate) resume: bool,
    pub(crate) delivered: u64,
}

/// What a received message is to the session.
#[derive(Debug)]
pub(crate) enum Control {
    Data(u64, Message),
    Fin(u64),
    Ack(u64),
    Stop,
    Hello(Hello),
    Welcome { known: bool, delivered: u64 },
}

fn control(kind: &'static str) -> Message {
    Message::new(MsgType::from_static(kind)).expect("a valid static type")
}

fn protocol(what: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!(
            "session protocol: {what} (is the peer a session on both sides: connect_with and bind_sessions?)"
        ),
    )
}

pub(crate) fn hello(h: Hello) -> Message {
    build(|| {
        control(HELLO)
            .with_meta("v", VERSION)?
            .with_meta("id", format!("{:032x}", h.id))?
            .with_meta("resume", if h.resume { "1" } else { "0" })?
            .with_meta("delivered", h.delivered)
    })
}

pub(crate) fn welcome(known: bool, delivered: u64) -> Message {
    build(|| {
        control(WELCOME)
            .with_meta("v", VERSION)?
            .with_meta("known", if known { "1" } else { "0" })?
            .with_meta("delivered", delivered)
    })
}

pub(crate) fn ack(seq: u64) -> Message {
    build(|| control(ACK).with_meta("seq", seq))
}

pub(crate) fn stop() -> Message {
    control(STOP)
}

pub(crate) fn fin(seq: u64) -> Message {
    build(|| control(FIN).with_meta(SEQ, seq))
}

/// Builds a message whose keys and values are valid by construction.
fn build(f: impl FnOnce() -> Result<Message, crate::message::InvalidMeta>) -> Message {
    f().expect("session control messages are well formed")
}

/// The marker delivered to the application when the peer lost the session.
pub(crate) fn reset(peer: &str, resent_requests: &[u64]) -> Message {
    let mut body = BytesMut::with_capacity(resent_requests.len() * 8);
    for id in resent_requests {
        body.put_u64_le(*id);
    }
    let msg = control(RESET_TYPE)
        .with_body(body.freeze())
        .with_meta("peer", crate::text::escape_untrusted(peer).as_ref());
    msg.unwrap_or_else(|_| control(RESET_TYPE))
}

/// The correlation ids a [`RESET_TYPE`] message lists.
#[cfg(any(feature = "tower", test))]
pub(crate) fn reset_ids(msg: &Message) -> impl Iterator<Item = u64> + '_ {
    msg.body()
        .as_bytes()
        .into_iter()
        .flat_map(|b: &bytes::Bytes| b.chunks_exact(8))
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
}

/// Refuses what the application may not send on a session.
pub(crate) fn check_outgoing(msg: &Message) -> Result<()> {
    if msg.kind().as_str().starts_with(PREFIX) {
        return Err(Error::new(
            ErrorKind::InvalidType,
            format!(
                "message type {} is reserved for the session protocol (types under {PREFIX})",
                msg.kind()
            ),
        ));
    }
    if msg.meta().contains_key(SEQ) {
        return Err(Error::new(
            ErrorKind::InvalidMeta,
            format!("metadata key {SEQ} is reserved for the session protocol"),
        ));
    }
    Ok(())
}

/// Numbers an outgoing message (appends `hf.seq`).
pub(crate) fn stamp(mut msg: Message, seq: u64) -> Message {
    // Valid, and not in the map: `check_outgoing` refused it; entries below the limit.
    seq.with_text(|text| msg.meta_mut().push_trusted(SEQ, text));
    msg
}

/// Takes `hf.seq` off a resent message (for `take_unacknowledged`).
pub(crate) fn unstamp(mut msg: Message) -> Message {
    msg.meta_mut().remove(SEQ);
    msg
}

/// A `u64` in decimal digits only (`u64::from_str` would also take a leading `+`).
fn decimal(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 20 {
        return None;
    }
    v.iter().try_fold(0u64, |n, &b| {
        b.is_ascii_digit()
            .then(|| n.checked_mul(10)?.checked_add(u64::from(b - b'0')))
            .flatten()
    })
}

fn number(msg: &Message, key: &str) -> Result<u64> {
    let v = msg
        .meta()
        .get(key)
        .ok_or_else(|| protocol(format!("{} without {key}", msg.kind())))?;
    decimal(v.as_bytes()).ok_or_else(|| protocol(format!("{} with {key}={v:?}", msg.kind())))
}

fn flag(msg: &Message, key: &str) -> Result<bool> {
    match msg.meta().get(key) {
        Some("1") => Ok(true),
        Some("0") => Ok(false),
        other => Err(protocol(format!("{} with {key}={other:?}", msg.kind()))),
    }
}

/// Reads a received message. Peer bytes: every field is checked, nothing panics.
pub(crate) fn classify(mut msg: Message) -> Result<Control> {
    let kind = msg.kind().as_str();
    if !kind.starts_with(PREFIX) {
        // The number is the last entry, where the sender appended it.
        let seq = match msg.meta_mut().pop_last_if(SEQ) {
            Some(v) => decimal(&v),
            None => None,
        };
        return match seq {
            Some(0) => Err(protocol("a message numbered 0")),
            Some(seq) => Ok(Control::Data(seq, msg)),
            None => Err(protocol(format!(
                "a message of type {} without {SEQ} as its last metadata entry",
                msg.kind()
            ))),
        };
    }
    let out = match kind {
        FIN => Control::Fin(number(&msg, SEQ)?),
        ACK => Control::Ack(number(&msg, "seq")?),
        STOP => Control::Stop,
        HELLO | WELCOME => {
            if msg.meta().get("v") != Some(VERSION) {
                return Err(protocol(format!(
                    "{kind} of version {:?}; this side speaks {VERSION}",
                    msg.meta().get("v")
                )));
            }
            let delivered = number(&msg, "delivered")?;
            if kind == HELLO {
                let id = msg.meta().get("id").unwrap_or_default();
                let id = (id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()))
                    .then(|| u128::from_str_radix(id, 16).ok())
                    .flatten()
                    .ok_or_else(|| protocol(format!("{HELLO} with id={id:?}")))?;
                Control::Hello(Hello {
                    id,
                    resume: flag(&msg, "resume")?,
                    delivered,
                })
            } else {
                Control::Welcome {
                    known: flag(&msg, "known")?,
                    delivered,
                }
            }
        }
        _ => return Err(protocol(format!("unknown control message {kind}"))),
    };
    if msg.header().flags != Flags::NONE {
        return Err(protocol(format!("{kind} with flags set")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_messages_read_back() {
        let h = Hello {
            id: 0x0123_4567_89ab_cdef_0011_2233_4455_6677,
            resume: true,
            delivered: 42,
        };
        assert!(matches!(classify(hello(h)).unwrap(), Control::Hello(x) if x == h));
        assert!(matches!(
            classify(welcome(false, 7)).unwrap(),
            Control::Welcome {
                known: false,
                delivered: 7
            }
        ));
        assert!(matches!(
            classify(ack(u64::MAX)).unwrap(),
            Control::Ack(u64::MAX)
        ));
        assert!(matches!(classify(fin(3)).unwrap(), Control::Fin(3)));
        assert!(matches!(classify(stop()).unwrap(), Control::Stop));
        assert_eq!(decimal(b"18446744073709551615"), Some(u64::MAX));
        assert_eq!(decimal(b"007"), Some(7));
        let m = Message::new("a.b").unwrap().with_meta("k", "v").unwrap();
        let Control::Data(9, back) = classify(stamp(m.clone(), 9)).unwrap() else {
            panic!()
        };
        assert_eq!(back, m);
        assert_eq!(unstamp(stamp(m.clone(), 1)), m);
        let r = reset("tcp://x", &[1, u64::MAX]);
        assert_eq!(r.kind(), RESET_TYPE);
        assert_eq!(reset_ids(&r).collect::<Vec<_>>(), [1, u64::MAX]);
    }

    #[test]
    fn hostile_control_messages_are_protocol_errors() {
        let bad = [
            Message::new("a.b").unwrap(), // data without seq
            Message::new("a.b").unwrap().with_meta(SEQ, "0").unwrap(), // seq 0
            Message::new("a.b").unwrap().with_meta(SEQ, "+1").unwrap(),
            Message::new("a.b")
                .unwrap()
                .with_meta(SEQ, "99999999999999999999")
                .unwrap(),
            Message::new(ACK).unwrap(),
            Message::new("hf.session.nonsense").unwrap(),
            Message::new(HELLO).unwrap().with_meta("v", "1").unwrap(),
            hello(Hello {
                id: 1,
                resume: false,
                delivered: 0,
            })
            .with_meta("id", "xyz")
            .unwrap(),
            welcome(true, 1).with_meta("v", "2").unwrap(),
            welcome(true, 1).with_meta("known", "yes").unwrap(),
        ];
        for m in bad {
            let e = classify(m.clone()).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Protocol, "{m:?}");
        }
    }

    #[test]
    fn reserved_names_are_refused_on_send() {
        let e = check_outgoing(&Message::new("hf.session.ack").unwrap()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidType);
        let m = Message::new("a").unwrap().with_meta(SEQ, "1").unwrap();
        assert_eq!(
            check_outgoing(&m).unwrap_err().kind(),
            ErrorKind::InvalidMeta
        );
        assert!(check_outgoing(&Message::new("hf.sessions").unwrap()).is_ok());
    }

    #[test]
    fn the_seq_entry_fits_its_allowance() {
        let m = stamp(Message::new("a").unwrap(), u64::MAX);
        assert!(m.meta().encoded_len() as u32 <= SEQ_META_BYTES);
        let base = Message::new("a").unwrap().with_meta("k", "v").unwrap();
        let grown = stamp(base.clone(), u64::MAX).meta().encoded_len() - base.meta().encoded_len();
        assert!(grown as u32 <= SEQ_META_BYTES);
    }
}
