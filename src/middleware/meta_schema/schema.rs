//! `MetaSchema`: what a message's metadata may and must hold.

use std::fmt;
use std::ops::RangeInclusive;
use std::sync::Arc;

use super::error::{Rule, SchemaViolation, Violation};
use crate::error::{Error, ErrorKind, Result};
use crate::message::{Message, Meta, MsgType};
use crate::middleware::pattern::same;

/// What a message's metadata may and must hold: the keys allowed (others are refused unless
/// [`allow_unknown_keys`](MetaSchemaBuilder::allow_unknown_keys)), the keys required, a
/// [`Value`] rule per key, and optionally the `module.sub.event` naming of types.
///
/// Cheap to clone (shared). Checking walks the entries once, comparing keys with the
/// schema's: no allocation unless the message is refused.
///
/// ```
/// use hyperframes::middleware::{MetaSchema, Value, meta_schema::Rule};
/// use hyperframes::Message;
///
/// let schema = MetaSchema::builder()
///     .require("frame", Value::integer_in(0..=i64::MAX))
///     .require("source", Value::any().max_len(32))
///     .allow("codec", Value::one_of(["h264", "av1"]))
///     .require_type_naming()
///     .build()?;
///
/// let good = Message::new("video.camera.frame")?.with_meta("frame", "7")?.with_meta("source", "cam0")?;
/// assert!(schema.check(&good).is_ok());
///
/// let bad = good.clone().with_meta("frame", "seven")?;
/// let v = schema.check(&bad).unwrap_err();
/// assert_eq!((v.key(), v.rule()), (Some("frame"), &Rule::Integer));
/// assert!(v.to_string().contains("video.camera.frame"));
///
/// let unknown = good.with_meta("colour", "red")?;
/// assert_eq!(schema.check(&unknown).unwrap_err().rule(), &Rule::UnknownKey);
/// # Ok::<(), hyperframes::Error>(())
/// ```
#[derive(Clone)]
pub struct MetaSchema {
    inner: Arc<Inner>,
}

struct Inner {
    keys: Box<[KeyRule]>,
    required: u64,
    allow_unknown: bool,
    type_naming: bool,
}

struct KeyRule {
    key: Box<str>,
    required: bool,
    value: Value,
}

/// The rule for one key's value: a kind ([`any`](Value::any), [`integer`](Value::integer),
/// [`one_of`](Value::one_of), a named check) and length bounds in bytes.
#[derive(Clone)]
pub struct Value {
    min_len: usize,
    max_len: usize,
    kind: Kind,
}

#[derive(Clone)]
enum Kind {
    Any,
    Integer {
        min: i64,
        max: i64,
        /// The most digits (0 to 18) for which every unsigned decimal of that many digits is
        /// in `min..=max`: a value of at most this many plain digits passes without being
        /// parsed.
        plain_digits: u8,
    },
    OneOf(Box<[Box<str>]>),
    Check {
        name: Box<str>,
        check: Arc<dyn Fn(&str) -> bool + Send + Sync>,
    },
}

impl Value {
    /// Any UTF-8 value (within the length bounds).
    pub fn any() -> Value {
        Value::of(Kind::Any)
    }

    /// A decimal integer that fits an `i64` (`-12`, `0`, `+7`).
    pub fn integer() -> Value {
        Value::integer_in(i64::MIN..=i64::MAX)
    }

    /// A decimal integer within `range`.
    pub fn integer_in(range: RangeInclusive<i64>) -> Value {
        let (min, max) = (*range.start(), *range.end());
        // Every unsigned decimal of `d` digits is in 0..=10^d - 1.
        let plain_digits = if min <= 0 {
            (1..=18u32)
                .take_while(|&d| max >= 10i64.pow(d) - 1)
                .last()
                .unwrap_or(0) as u8
        } else {
            0
        };
        Value::of(Kind::Integer {
            min,
            max,
            plain_digits,
        })
    }

    /// One of `values`, exactly.
    pub fn one_of<I>(values: I) -> Value
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        Value::of(Kind::OneOf(
            values
                .into_iter()
                .map(|v| v.into().into_boxed_str())
                .collect(),
        ))
    }

    /// A value for which `check` returns true; `name` says what it checks in errors (`"a
    /// hex digest"`). Use it for patterns: `Value::matching("a hex digest", move |v|
    /// re.is_match(v))`.
    pub fn matching<F>(name: impl Into<String>, check: F) -> Value
    where
        F: Fn(&str) -> bool + Send + Sync + 'static,
    {
        Value::of(Kind::Check {
            name: name.into().into_boxed_str(),
            check: Arc::new(check),
        })
    }

    fn of(kind: Kind) -> Value {
        Value {
            min_len: 0,
            max_len: Meta::MAX_VALUE_LEN,
            kind,
        }
    }

    /// At most `bytes` bytes.
    pub fn max_len(mut self, bytes: usize) -> Value {
        self.max_len = bytes;
        self
    }

    /// At least `bytes` bytes (`min_len(1)`: not empty).
    pub fn min_len(mut self, bytes: usize) -> Value {
        self.min_len = bytes;
        self
    }

    /// Why the rule is unusable, if it is.
    fn problem(&self) -> Option<String> {
        if self.min_len > self.max_len {
            return Some(format!(
                "min_len {} is more than max_len {}",
                self.min_len, self.max_len
            ));
        }
        match &self.kind {
            Kind::Integer { min, max, .. } if min > max => {
                Some(format!("the integer range {min}..={max} is empty"))
            }
            Kind::OneOf(v) if v.is_empty() => Some("one_of lists no value".into()),
            _ => None,
        }
    }

    /// The check without the explanation: the path every good message takes.
    #[inline]
    fn passes(&self, value: &str) -> bool {
        if value.len() > self.max_len || value.len() < self.min_len {
            return false;
        }
        match &self.kind {
            Kind::Any => true,
            Kind::Integer {
                min,
                max,
                plain_digits,
            } => {
                (value.len() <= usize::from(*plain_digits) && all_digits(value.as_bytes()))
                    || parse_i64(value).is_some_and(|n| *min <= n && n <= *max)
            }
            Kind::OneOf(values) => values.iter().any(|v| same(v.as_bytes(), value.as_bytes())),
            Kind::Check { check, .. } => check(value),
        }
    }

    fn check(&self, value: &str) -> std::result::Result<(), (Rule, String)> {
        if value.len() > self.max_len {
            return Err((
                Rule::MaxLen(self.max_len),
                format!("the value is {} bytes", value.len()),
            ));
        }
        if value.len() < self.min_len {
            return Err((
                Rule::MinLen(self.min_len),
                format!("the value is {} bytes", value.len()),
            ));
        }
        match &self.kind {
            Kind::Any => Ok(()),
            Kind::Integer { min, max, .. } => match value.parse::<i64>() {
                Err(_) => Err((
                    Rule::Integer,
                    format!("the value {} is not an integer", shown(value)),
                )),
                Ok(n) if n < *min || n > *max => Err((
                    Rule::IntegerRange {
                        min: *min,
                        max: *max,
                    },
                    format!("the value {n} is out of range"),
                )),
                Ok(_) => Ok(()),
            },
            Kind::OneOf(values) => {
                if values.iter().any(|v| **v == *value) {
                    Ok(())
                } else {
                    Err((
                        Rule::OneOf,
                        format!(
                            "the value {} is none of {}",
                            shown(value),
                            values.join(", ")
                        ),
                    ))
                }
            }
            Kind::Check { name, check } => {
                if check(value) {
                    Ok(())
                } else {
                    Err((
                        Rule::Check(name.to_string()),
                        format!("the value {} fails the check", shown(value)),
                    ))
                }
            }
        }
    }
}

/// `str::parse::<i64>`, with an inline loop for the short values metadata holds (the
/// library's parser is an out-of-line call that costs more than the digits).
#[inline]
fn parse_i64(value: &str) -> Option<i64> {
    let b = value.as_bytes();
    let (negative, digits) = match b.first()? {
        b'-' => (true, &b[1..]),
        b'+' => (false, &b[1..]),
        _ => (false, b),
    };
    if digits.is_empty() || digits.len() > 18 {
        // Empty, or long enough to overflow: let the library decide.
        return value.parse().ok();
    }
    let mut n: i64 = 0;
    for &c in digits {
        let d = c.wrapping_sub(b'0');
        if d > 9 {
            return None;
        }
        n = n * 10 + i64::from(d);
    }
    Some(if negative { -n } else { n })
}

/// True when `b` is one or more ASCII digits. Up to 16 bytes are checked a word at a time,
/// two overlapping loads and no loop, as [`same`] compares.
#[inline]
fn all_digits(b: &[u8]) -> bool {
    let n = b.len();
    let w4 = |at: usize| u32::from_ne_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    let w8 = |at: usize| u64::from_ne_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    match n {
        0 => false,
        4..=7 => digits_in_word(u64::from(w4(0)) << 32 | u64::from(w4(n - 4))),
        8..=16 => digits_in_word(w8(0)) && digits_in_word(w8(n - 8)),
        _ => b.iter().all(u8::is_ascii_digit),
    }
}

/// True when each of the 8 bytes of `x` is an ASCII digit. `t = byte ^ b'0'` is 0..=9 for a
/// digit; `t + 0x76` sets bit 7 exactly when `t` is 10..=0x89, and `t`'s own bit 7 is set
/// above that (a carry out of a byte happens only then, so it never hides a non-digit).
#[inline]
fn digits_in_word(x: u64) -> bool {
    const EACH: u64 = 0x0101_0101_0101_0101;
    let t = x ^ (EACH * 0x30);
    (t.wrapping_add(EACH * 0x76) | t) & (EACH * 0x80) == 0
}

/// A value for an error message: quoted, and cut at 64 characters.
fn shown(value: &str) -> String {
    match value.char_indices().nth(64) {
        Some((at, _)) => format!("{:?}…", &value[..at]),
        None => format!("{value:?}"),
    }
}

impl fmt::Debug for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Value");
        match &self.kind {
            Kind::Any => d.field("kind", &"any"),
            Kind::Integer { min, max, .. } => d.field("integer", &(min..=max)),
            Kind::OneOf(v) => d.field("one_of", v),
            Kind::Check { name, .. } => d.field("check", name),
        };
        d.field("min_len", &self.min_len)
            .field("max_len", &self.max_len)
            .finish()
    }
}

/// True for `module.sub.event`: three segments of lowercase ASCII letters, digits and `_`,
/// each starting with a letter.
fn follows_naming(kind: &str) -> bool {
    let mut segments = 1;
    let mut start = true;
    for &b in kind.as_bytes() {
        if b == b'.' {
            segments += 1;
            start = true;
        } else if start {
            if !b.is_ascii_lowercase() {
                return false;
            }
            start = false;
        } else if !(b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
            return false;
        }
    }
    // A valid type has no empty segment, so `start` is false here.
    segments == 3 && !start
}

impl MetaSchema {
    /// A builder; an empty schema allows no keys at all.
    pub fn builder() -> MetaSchemaBuilder {
        MetaSchemaBuilder {
            keys: Vec::new(),
            allow_unknown: false,
            type_naming: false,
            problems: Vec::new(),
        }
    }

    /// Checks `msg`; the violation found first names the type, the key and the rule.
    pub fn check(&self, msg: &Message) -> std::result::Result<(), SchemaViolation> {
        if self.passes(msg) {
            return Ok(());
        }
        Err(self.violation(msg, None))
    }

    /// True when `msg` follows the schema: the fast path, with no explanation.
    #[inline]
    pub(crate) fn passes(&self, msg: &Message) -> bool {
        self.passes_type(msg.kind()) && self.passes_meta(msg.meta())
    }

    /// The part of [`passes`](Self::passes) that depends on the type alone (the naming
    /// rule), for a service to remember per type.
    #[inline]
    pub(crate) fn passes_type(&self, kind: &MsgType) -> bool {
        !self.inner.type_naming || follows_naming(kind.as_str())
    }

    /// The part of [`passes`](Self::passes) that reads the metadata.
    #[inline]
    pub(crate) fn passes_meta(&self, meta: &Meta) -> bool {
        let s = &*self.inner;
        let mut seen = 0u64;
        for (key, value) in meta.iter() {
            match s
                .keys
                .iter()
                .position(|r| same(r.key.as_bytes(), key.as_bytes()))
            {
                Some(i) => {
                    seen |= 1 << i;
                    if !s.keys[i].value.passes(value) {
                        return false;
                    }
                }
                None if !s.allow_unknown => return false,
                None => {}
            }
        }
        seen & s.required == s.required
    }

    /// What `msg`, which failed [`passes`](Self::passes), breaks; carrying `keep` back.
    #[cold]
    pub(crate) fn violation(&self, msg: &Message, keep: Option<Message>) -> SchemaViolation {
        let (key, rule, detail) = match self.find(msg) {
            Err(found) => found,
            // `passes` and `find` apply the same rules; never reached.
            Ok(()) => (
                None,
                Rule::Check("schema".into()),
                "inconsistent check".into(),
            ),
        };
        SchemaViolation(Box::new(Violation {
            kind: msg.kind().clone(),
            key,
            rule,
            detail,
            message: keep,
        }))
    }

    #[allow(clippy::type_complexity)]
    fn find(&self, msg: &Message) -> std::result::Result<(), (Option<Box<str>>, Rule, String)> {
        let s = &*self.inner;
        if s.type_naming && !follows_naming(msg.kind().as_str()) {
            return Err((
                None,
                Rule::TypeNaming,
                "types must look like module.sub.event: three segments of lowercase letters, \
                 digits and _, each starting with a letter"
                    .into(),
            ));
        }
        let mut seen = 0u64;
        for (key, value) in msg.meta().iter() {
            match s.keys.iter().position(|r| *r.key == *key) {
                Some(i) => {
                    seen |= 1 << i;
                    s.keys[i]
                        .value
                        .check(value)
                        .map_err(|(rule, detail)| (Some(key.into()), rule, detail))?;
                }
                None if !s.allow_unknown => {
                    return Err((
                        Some(key.into()),
                        Rule::UnknownKey,
                        format!("the schema allows {}", self.allowed()),
                    ));
                }
                None => {}
            }
        }
        if seen & s.required != s.required {
            let missing = s
                .keys
                .iter()
                .enumerate()
                .find(|(i, r)| r.required && seen & (1 << i) == 0)
                .map(|(_, r)| r.key.clone());
            return Err((missing, Rule::MissingKey, "the key is missing".into()));
        }
        Ok(())
    }

    fn allowed(&self) -> String {
        if self.inner.keys.is_empty() {
            return "no keys".into();
        }
        self.inner
            .keys
            .iter()
            .map(|r| &*r.key)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The keys the schema names, in the order given.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.inner.keys.iter().map(|r| &*r.key)
    }

    /// True when `key` is required.
    pub fn is_required(&self, key: &str) -> bool {
        self.inner.keys.iter().any(|r| r.required && *r.key == *key)
    }
}

impl fmt::Debug for MetaSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut m = f.debug_map();
        for r in self.inner.keys.iter() {
            m.entry(
                &r.key,
                &(if r.required { "required" } else { "allowed" }, &r.value),
            );
        }
        m.finish()?;
        if self.inner.allow_unknown {
            f.write_str(" + unknown keys")?;
        }
        if self.inner.type_naming {
            f.write_str(" + type naming")?;
        }
        Ok(())
    }
}

/// Builds a [`MetaSchema`]; [`build`](Self::build) reports every mistake at once.
#[derive(Debug)]
#[must_use]
pub struct MetaSchemaBuilder {
    keys: Vec<KeyRule>,
    allow_unknown: bool,
    type_naming: bool,
    problems: Vec<String>,
}

impl fmt::Debug for KeyRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {:?}", self.key, self.value)
    }
}

impl MetaSchemaBuilder {
    /// A key every message must have, with the rule for its value.
    pub fn require(self, key: &str, value: Value) -> Self {
        self.key(key, true, value)
    }

    /// A key messages may have, with the rule for its value.
    pub fn allow(self, key: &str, value: Value) -> Self {
        self.key(key, false, value)
    }

    fn key(mut self, key: &str, required: bool, value: Value) -> Self {
        if let Err(e) = Meta::new().insert(key, "") {
            self.problems.push(format!("key {key:?}: {e:#}"));
        } else if self.keys.iter().any(|r| *r.key == *key) {
            self.problems.push(format!("key {key:?} is given twice"));
        }
        if let Some(p) = value.problem() {
            self.problems.push(format!("key {key:?}: {p}"));
        }
        self.keys.push(KeyRule {
            key: key.into(),
            required,
            value,
        });
        self
    }

    /// Let keys the schema does not name pass unchecked (by default they are refused).
    pub fn allow_unknown_keys(mut self) -> Self {
        self.allow_unknown = true;
        self
    }

    /// Refuse types that do not look like `module.sub.event`: three segments of lowercase
    /// letters, digits and `_`, each starting with a letter (`ml.splitter.output`).
    pub fn require_type_naming(mut self) -> Self {
        self.type_naming = true;
        self
    }

    /// The schema; fails with [`ErrorKind::Config`] listing every bad key or rule.
    pub fn build(self) -> Result<MetaSchema> {
        let mut problems = self.problems;
        if self.keys.len() > 64 {
            problems.push(format!(
                "{} keys; a schema names at most 64",
                self.keys.len()
            ));
        }
        if !problems.is_empty() {
            return Err(Error::new(
                ErrorKind::Config,
                format!("metadata schema: {}", problems.join("; ")),
            ));
        }
        let required = self
            .keys
            .iter()
            .enumerate()
            .filter(|(_, r)| r.required)
            .fold(0u64, |m, (i, _)| m | 1 << i);
        Ok(MetaSchema {
            inner: Arc::new(Inner {
                keys: self.keys.into_boxed_slice(),
                required,
                allow_unknown: self.allow_unknown,
                type_naming: self.type_naming,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(kind: &str, meta: &[(&str, &str)]) -> Message {
        let mut m = Message::new(kind).unwrap();
        for (k, v) in meta {
            m = m.with_meta(k, v).unwrap();
        }
        m
    }

    fn schema() -> MetaSchema {
        MetaSchema::builder()
            .require("frame", Value::integer_in(0..=1000))
            .allow("codec", Value::one_of(["h264", "av1"]))
            .allow("name", Value::any().min_len(1).max_len(8))
            .allow(
                "digest",
                Value::matching("a hex digest", |v| v.bytes().all(|b| b.is_ascii_hexdigit())),
            )
            .build()
            .unwrap()
    }

    #[test]
    fn all_digits_is_every_byte_a_digit() {
        let slow = |b: &[u8]| !b.is_empty() && b.iter().all(u8::is_ascii_digit);
        assert!(!all_digits(b""));
        for len in 1..=20 {
            let base: Vec<u8> = (0..len).map(|i| b'0' + (i % 10) as u8).collect();
            assert!(all_digits(&base));
            for at in 0..len {
                for byte in 0..=255u8 {
                    let mut v = base.clone();
                    v[at] = byte;
                    assert_eq!(all_digits(&v), slow(&v), "{v:?}");
                }
            }
        }
    }

    #[test]
    fn integer_rules_pass_what_parsing_passes() {
        let ranges = [
            0..=1000,
            0..=999,
            -5..=5,
            1..=10,
            0..=i64::MAX,
            i64::MIN..=i64::MAX,
            0..=999_999_999_999_999_999,
            0..=999_999_999_999_999_998,
        ];
        let values = [
            "0",
            "9",
            "10",
            "999",
            "1000",
            "0999",
            "0000",
            "-0",
            "+5",
            "-5",
            "-6",
            "12a",
            "",
            "123456789012345678",
            "999999999999999999",
            "1000000000000000000",
            "9223372036854775807",
            "9223372036854775808",
            "00000000000000000001",
        ];
        for range in ranges {
            let rule = Value::integer_in(range.clone());
            for v in values {
                let parsed = v.parse::<i64>().is_ok_and(|n| range.contains(&n));
                assert_eq!(rule.passes(v), parsed, "{v:?} in {range:?}");
                assert_eq!(rule.check(v).is_ok(), parsed, "{v:?} in {range:?}");
            }
        }
    }

    fn rule_of(m: &Message) -> (Option<String>, Rule) {
        let v = schema().check(m).unwrap_err();
        (v.key().map(str::to_owned), v.rule().clone())
    }

    #[test]
    fn accepts_what_it_allows() {
        let s = schema();
        assert!(s.check(&msg("a.b", &[("frame", "0")])).is_ok());
        assert!(
            s.check(&msg(
                "a.b",
                &[
                    ("codec", "av1"),
                    ("frame", "1000"),
                    ("name", "x"),
                    ("digest", "00ff")
                ]
            ))
            .is_ok()
        );
    }

    #[test]
    fn each_rule_is_named() {
        let k = |s: &str| Some(s.to_owned());
        assert_eq!(rule_of(&msg("a.b", &[])), (k("frame"), Rule::MissingKey));
        assert_eq!(
            rule_of(&msg("a.b", &[("frame", "x")])),
            (k("frame"), Rule::Integer)
        );
        assert_eq!(
            rule_of(&msg("a.b", &[("frame", "1001")])),
            (k("frame"), Rule::IntegerRange { min: 0, max: 1000 })
        );
        assert_eq!(
            rule_of(&msg("a.b", &[("frame", "1"), ("codec", "vp9")])),
            (k("codec"), Rule::OneOf)
        );
        assert_eq!(
            rule_of(&msg("a.b", &[("frame", "1"), ("name", "")])),
            (k("name"), Rule::MinLen(1))
        );
        assert_eq!(
            rule_of(&msg("a.b", &[("frame", "1"), ("name", "123456789")])),
            (k("name"), Rule::MaxLen(8))
        );
        assert_eq!(
            rule_of(&msg("a.b", &[("frame", "1"), ("digest", "xyz")])),
            (k("digest"), Rule::Check("a hex digest".into()))
        );
        assert_eq!(
            rule_of(&msg("a.b", &[("frame", "1"), ("extra", "")])),
            (k("extra"), Rule::UnknownKey)
        );
    }

    #[test]
    fn errors_name_type_key_and_rule() {
        let v = schema()
            .check(&msg("cam.frame", &[("frame", "abc")]))
            .unwrap_err();
        let text = v.to_string();
        for part in ["cam.frame", "frame", "an integer", "\"abc\""] {
            assert!(text.contains(part), "{part:?} not in {text}");
        }
        let v = schema()
            .check(&msg("cam.frame", &[("frame", "1"), ("colour", "red")]))
            .unwrap_err();
        assert!(v.to_string().contains("frame, codec, name, digest"), "{v}");
        let long = "x".repeat(200);
        let v = schema()
            .check(&msg("a.b", &[("frame", &long)]))
            .unwrap_err();
        assert!(v.to_string().len() < 200, "long values are cut: {v}");
    }

    #[test]
    fn unknown_keys_can_be_allowed() {
        let s = MetaSchema::builder()
            .require("k", Value::any())
            .allow_unknown_keys()
            .build()
            .unwrap();
        assert!(s.check(&msg("a", &[("k", ""), ("other", "x")])).is_ok());
        assert!(s.is_required("k"));
        assert_eq!(s.keys().collect::<Vec<_>>(), ["k"]);
    }

    #[test]
    fn integers_parse_as_the_library_does() {
        for v in [
            "0",
            "-0",
            "+7",
            "-12",
            "123456789012345678",
            "999999999999999999",
            "9223372036854775807",
            "-9223372036854775808",
            "9223372036854775808",
            "00000000000000000000001",
            "",
            "-",
            "+",
            "1a",
            " 1",
            "1 ",
            "١",
        ] {
            assert_eq!(parse_i64(v), v.parse::<i64>().ok(), "{v:?}");
        }
    }

    #[test]
    fn type_naming() {
        let s = MetaSchema::builder()
            .allow_unknown_keys()
            .require_type_naming()
            .build()
            .unwrap();
        for ok in ["ml.splitter.output", "video.cam2.frame_ready"] {
            assert!(s.check(&msg(ok, &[])).is_ok(), "{ok}");
        }
        for bad in [
            "video_frame",
            "ml.splitter",
            "ml.splitter.output.x",
            "ML.a.b",
            "a.2b.c",
            "a.b-c.d",
        ] {
            let v = s.check(&msg(bad, &[])).unwrap_err();
            assert_eq!(v.rule(), &Rule::TypeNaming, "{bad}");
            assert_eq!(v.key(), None);
        }
    }

    #[test]
    #[allow(clippy::reversed_empty_ranges)] // on purpose: the builder must refuse it
    fn builder_reports_every_mistake() {
        let e = MetaSchema::builder()
            .require("bad key", Value::any())
            .allow("k", Value::any())
            .allow("k", Value::any())
            .allow("r", Value::integer_in(5..=1))
            .allow("o", Value::one_of(Vec::<String>::new()))
            .allow("l", Value::any().min_len(3).max_len(2))
            .build()
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        let text = e.to_string();
        for part in [
            "\"bad key\"",
            "given twice",
            "5..=1",
            "no value",
            "min_len 3",
        ] {
            assert!(text.contains(part), "{part:?} not in {text}");
        }
        let mut b = MetaSchema::builder();
        for i in 0..65 {
            b = b.allow(&format!("k{i}"), Value::any());
        }
        assert!(b.build().unwrap_err().to_string().contains("at most 64"));
    }

    #[test]
    fn violation_hands_the_message_back() {
        let m = msg("a.b", &[]);
        assert!(!schema().passes(&m));
        let v = schema().violation(&m, Some(m.clone()));
        assert_eq!(v.into_message(), Some(m.clone()));
        assert!(schema().passes(&msg("a.b", &[("frame", "3")])));
    }
}
