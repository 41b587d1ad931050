//! Feature `serde`: messages and their parts through serde_json, and what is refused on the
//! way in.
#![cfg(feature = "serde")]

use hyperframes::{Flags, Header, Message, Meta, MsgType};

fn message() -> Message {
    Message::new("ml.splitter.output")
        .unwrap()
        .with_meta("z-last-key-first", "1")
        .unwrap()
        .with_meta("a", "two words")
        .unwrap()
        .with_body(vec![0u8, 1, 255])
        .with_header(Header {
            flags: Flags::REQUEST,
            correlation: 42,
        })
}

#[test]
fn a_message_round_trips_through_json_in_its_own_order() {
    let msg = message();
    let json = serde_json::to_string(&msg).unwrap();
    assert_eq!(
        json,
        r#"{"type":"ml.splitter.output","meta":{"z-last-key-first":"1","a":"two words"},"header":{"flags":["REQUEST"],"correlation":42},"body":[0,1,255]}"#
    );
    let back: Message = serde_json::from_str(&json).unwrap();
    assert_eq!(back, msg);
    assert_eq!(
        back.meta().keys().collect::<Vec<_>>(),
        ["z-last-key-first", "a"]
    );

    // Only the type is required.
    let bare: Message = serde_json::from_str(r#"{"type":"a.b"}"#).unwrap();
    assert_eq!(bare, Message::new("a.b").unwrap());

    let both = Flags::REQUEST.union(Flags::RESPONSE);
    assert_eq!(
        serde_json::to_string(&both).unwrap(),
        r#"["REQUEST","RESPONSE"]"#
    );
    assert_eq!(serde_json::to_string(&Flags::NONE).unwrap(), "[]");
    let t: MsgType = serde_json::from_str(r#""video.frame""#).unwrap();
    assert_eq!(t, "video.frame");
    let m: Meta = serde_json::from_str(r#"{"k":"v"}"#).unwrap();
    assert_eq!(m.get("k"), Some("v"));
}

#[test]
fn what_the_constructors_refuse_does_not_deserialize() {
    for (json, says) in [
        (r#"{"type":"no spaces allowed"}"#, "type"),
        (r#"{"type":""}"#, "type"),
        (r#"{"meta":{}}"#, "missing field `type`"),
        (r#"{"type":"a.b","type":"a.c"}"#, "duplicate field `type`"),
        (r#"{"type":"a.b","extra":1}"#, "unknown field `extra`"),
        (r#"{"type":"a.b","meta":{"bad key":"v"}}"#, "metadata key"),
        (
            r#"{"type":"a.b","meta":{"k":"1","k":"2"}}"#,
            "appears twice",
        ),
        (r#"{"type":"a.b","meta":{"k":1}}"#, "invalid type"),
        (
            r#"{"type":"a.b","header":{"flags":["URGENT"]}}"#,
            "unknown flag",
        ),
        (r#"{"type":"a.b","header":{"flags":3}}"#, "invalid type"),
        (
            r#"{"type":"a.b","header":{"correlation":-1}}"#,
            "invalid value",
        ),
        (r#"{"type":"a.b","body":[256]}"#, "invalid value"),
    ] {
        let err = serde_json::from_str::<Message>(json)
            .unwrap_err()
            .to_string();
        assert!(err.contains(says), "{json}: {err}");
    }
    let many: String = (0..=Meta::MAX_ENTRIES)
        .map(|i| format!(r#""k{i}":"v""#))
        .collect::<Vec<_>>()
        .join(",");
    let err = serde_json::from_str::<Meta>(&format!("{{{many}}}")).unwrap_err();
    assert!(err.to_string().contains("entries"), "{err}");
}

#[cfg(feature = "cuda")]
#[test]
fn a_device_body_does_not_serialize() {
    use hyperframes::device::Gpu;
    let gpu = Gpu::stand_in();
    let msg = Message::new("a.b")
        .unwrap()
        .with_body(gpu.upload(&[1, 2, 3]).unwrap());
    let err = serde_json::to_string(&msg).unwrap_err().to_string();
    assert!(err.contains("device memory"), "{err}");
}
