//! Error types.

use std::fmt;

use crate::message::{Message, MsgType};

/// The rule a message broke; see [`SchemaViolation::rule`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rule {
    /// The key is not in the schema, which does not allow unknown keys.
    UnknownKey,
    /// A required key is missing.
    MissingKey,
    /// The value is shorter than this many bytes.
    MinLen(usize),
    /// The value is longer than this many bytes.
    MaxLen(usize),
    /// The value is not a decimal integer that fits an `i64`.
    Integer,
    /// The value is an integer outside `min..=max`.
    IntegerRange {
        /// The least value allowed.
        min: i64,
        /// The greatest value allowed.
        max: i64,
    },
    /// The value is not one of the values the schema lists.
    OneOf,
    /// The value fails a named check ([`Value::matching`](super::Value::matching)).
    Check(String),
    /// The type does not follow `module.sub.event`
    /// ([`MetaSchemaBuilder::require_type_naming`](super::MetaSchemaBuilder::require_type_naming)).
    TypeNaming,
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rule::UnknownKey => f.write_str("no unknown keys"),
            Rule::MissingKey => f.write_str("required"),
            Rule::MinLen(n) => write!(f, "at least {n} bytes"),
            Rule::MaxLen(n) => write!(f, "at most {n} bytes"),
            Rule::Integer => f.write_str("an integer"),
            Rule::IntegerRange { min, max } => write!(f, "an integer in {min}..={max}"),
            Rule::OneOf => f.write_str("one of the listed values"),
            Rule::Check(name) => write!(f, "{name}"),
            Rule::TypeNaming => f.write_str("types named module.sub.event"),
        }
    }
}

/// A message that breaks a [`MetaSchema`](super::MetaSchema): names the message type, the
/// key (none for [`Rule::TypeNaming`]) and the rule. Refused by
/// [`MetaSchemaService`](super::MetaSchemaService), it carries the message back
/// ([`into_message`](SchemaViolation::into_message)); returned by
/// [`MetaSchema::check`](super::MetaSchema::check), it carries none.
pub struct SchemaViolation(pub(super) Box<Violation>);

pub(super) struct Violation {
    pub(super) kind: MsgType,
    pub(super) key: Option<Box<str>>,
    pub(super) rule: Rule,
    pub(super) detail: String,
    pub(super) message: Option<Message>,
}

impl SchemaViolation {
    /// The type of the message.
    pub fn message_type(&self) -> &MsgType {
        &self.0.kind
    }

    /// The metadata key, when the rule is about one.
    pub fn key(&self) -> Option<&str> {
        self.0.key.as_deref()
    }

    /// The rule broken.
    pub fn rule(&self) -> &Rule {
        &self.0.rule
    }

    /// The refused message (once; `None` after it was taken).
    pub fn take_message(&mut self) -> Option<Message> {
        self.0.message.take()
    }

    /// The refused message.
    pub fn into_message(self) -> Option<Message> {
        self.0.message
    }
}

impl fmt::Display for SchemaViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = &self.0;
        write!(f, "message of type `{}`", v.kind)?;
        if let Some(key) = &v.key {
            write!(f, ", metadata key `{key}`")?;
        }
        write!(f, ", rule \"{}\": {}", v.rule, v.detail)
    }
}

impl fmt::Debug for SchemaViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = &self.0;
        f.debug_struct("SchemaViolation")
            .field("kind", &v.kind)
            .field("key", &v.key)
            .field("rule", &v.rule)
            .field("detail", &v.detail)
            .field("has_message", &v.message.is_some())
            .finish()
    }
}

impl std::error::Error for SchemaViolation {}
