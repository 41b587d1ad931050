//! The last few decisions a service took on message types, so a stream of messages of a few
//! types pays one short comparison per message instead of the pattern matcher.
//!
//! Every service here that decides by type alone (a [`TypeFilter`](super::TypeFilter)'s match,
//! a [`MetaSchema`](super::MetaSchema)'s naming rule, a [`Router`](super::Router)'s route)
//! keeps one of these: `call` takes `&mut self`, so the cache is private to the service, needs
//! no atomics, and is rebuilt by each clone. A miss costs the comparisons (a word and a
//! double word for two inline names, else the bytes) and then the same matcher as without a
//! cache.

use crate::message::MsgType;

/// How many types are remembered: a handler usually sees one to a handful.
const WAYS: usize = 4;

/// The decisions (`T`, e.g. "matches" or "route 2") taken on the last [`WAYS`] distinct
/// types, replaced round-robin.
#[derive(Debug)]
pub(crate) struct Decisions<T> {
    entries: [Option<(MsgType, T)>; WAYS],
    next: usize,
}

impl<T: Copy> Decisions<T> {
    pub(crate) fn new() -> Decisions<T> {
        Decisions {
            entries: [const { None }; WAYS],
            next: 0,
        }
    }

    /// The decision on `kind`: remembered, or `decide(kind)` remembered now. `decide` must
    /// depend on the type only, and always answer the same for it.
    #[inline]
    pub(crate) fn get(&mut self, kind: &MsgType, decide: impl FnOnce(&MsgType) -> T) -> T {
        for (known, decision) in self.entries.iter().flatten() {
            if known == kind {
                return *decision;
            }
        }
        self.remember(kind, decide)
    }

    #[cold]
    #[inline(never)]
    fn remember(&mut self, kind: &MsgType, decide: impl FnOnce(&MsgType) -> T) -> T {
        let decision = decide(kind);
        self.entries[self.next] = Some((kind.clone(), decision));
        self.next = (self.next + 1) % WAYS;
        decision
    }
}

/// A clone starts empty: it is a new service, and the decisions cost nothing to take again.
impl<T: Copy> Clone for Decisions<T> {
    fn clone(&self) -> Decisions<T> {
        Decisions::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_the_last_types_and_decides_each_once_while_remembered() {
        let mut d = Decisions::new();
        let mut calls = 0;
        let types: Vec<MsgType> = ["a.b.c", "a.b.d", "x", "a.very.long.type.name.past.inline"]
            .iter()
            .map(|t| MsgType::new(t).unwrap())
            .collect();
        for _ in 0..3 {
            for (i, t) in types.iter().enumerate() {
                let got = d.get(t, |_| {
                    calls += 1;
                    i
                });
                assert_eq!(got, i);
            }
        }
        assert_eq!(calls, types.len(), "each of four types decided once");
        // A fifth type evicts the oldest, which is decided again when it comes back.
        let fifth = MsgType::new("e.f.g").unwrap();
        assert_eq!(d.get(&fifth, |_| 9), 9);
        assert_eq!(d.get(&types[0], |_| 7), 7);
        // The same name built another way (static, inline, shared) is the same type.
        let again = MsgType::new(String::from("e.f.g")).unwrap();
        assert_eq!(d.get(&again, |_| unreachable!("remembered")), 9);
    }
}
