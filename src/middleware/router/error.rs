//! Error types.

use std::fmt;

use crate::message::{Message, MsgType};

/// A message whose type matched no route of a [`Router`](super::Router) that has no
/// fallback. It carries the message back ([`into_message`](NoRoute::into_message)).
pub struct NoRoute {
    pub(super) kind: MsgType,
    pub(super) routes: std::sync::Arc<str>,
    pub(super) message: Option<Message>,
}

impl NoRoute {
    /// The type of the message.
    pub fn message_type(&self) -> &MsgType {
        &self.kind
    }

    /// The router's patterns, as `[a.b, c.*]`.
    pub fn routes(&self) -> &str {
        &self.routes
    }

    /// The message.
    pub fn into_message(self) -> Option<Message> {
        self.message
    }
}

impl fmt::Display for NoRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "no route for messages of type `{}` (routes: {}; no fallback)",
            self.kind, self.routes
        )
    }
}

impl fmt::Debug for NoRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NoRoute")
            .field("kind", &self.kind)
            .field("routes", &self.routes)
            .finish()
    }
}

impl std::error::Error for NoRoute {}
