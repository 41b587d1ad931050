//! Error types.

use std::fmt;

use crate::message::{Message, MsgType};

/// A message that matched none of a [`TypeFilter`](super::TypeFilter)'s patterns, refused
/// under the [`Reject`](super::Reject) policy. It carries the message, so nothing is lost:
/// [`into_message`](Unmatched::into_message) hands it back.
///
/// Services in this module erase errors to [`BoxError`](crate::middleware::BoxError); find
/// this one with `err.downcast_ref::<Unmatched>()` (or `downcast` to take the message back).
pub struct Unmatched {
    pub(super) kind: MsgType,
    pub(super) patterns: Box<str>,
    pub(super) filter: Option<Box<str>>,
    pub(super) message: Option<Message>,
}

impl Unmatched {
    /// The type of the refused message.
    pub fn message_type(&self) -> &MsgType {
        &self.kind
    }

    /// The filter's patterns, as `[a.b, c.*]`.
    pub fn patterns(&self) -> &str {
        &self.patterns
    }

    /// The filter's name, if it was given one ([`TypeFilterLayer::named`](super::TypeFilterLayer::named)).
    pub fn filter_name(&self) -> Option<&str> {
        self.filter.as_deref()
    }

    /// The refused message (once; `None` after it was taken).
    pub fn take_message(&mut self) -> Option<Message> {
        self.message.take()
    }

    /// The refused message.
    pub fn into_message(self) -> Option<Message> {
        self.message
    }
}

impl fmt::Display for Unmatched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "message of type `{}` matches none of the patterns {} of type filter",
            self.kind, self.patterns
        )?;
        if let Some(name) = &self.filter {
            write!(f, " {name:?}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Unmatched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Unmatched")
            .field("kind", &self.kind)
            .field("patterns", &self.patterns)
            .field("filter", &self.filter)
            .field("has_message", &self.message.is_some())
            .finish()
    }
}

impl std::error::Error for Unmatched {}
