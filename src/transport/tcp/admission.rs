//! How many connections a listener holds: in all, per peer address, and in their handshake.
//!
//! The accept loop waits for a free place (and, with `max_handshakes` handshakes running, for
//! one of them to end) before it accepts, so a full listener leaves new connections in the
//! kernel's backlog, where they cost us nothing; and it refuses at once a
//! connection from an address that already holds its share, so that one host cannot take
//! every place. A place is a [`Ticket`]: taken before the handshake, carried by the channel
//! (its `ChannelInfo`), given back when the handshake fails or the channel's halves are gone.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

/// The places of one listener.
pub(super) struct Admission {
    max: usize,
    max_per_peer: usize,
    max_handshakes: usize,
    held: Mutex<Held>,
    freed: Notify,
}

#[derive(Default)]
struct Held {
    total: usize,
    handshaking: usize,
    per_peer: HashMap<IpAddr, usize>,
}

/// One connection's place; given back on drop.
pub(super) struct Ticket {
    admission: Arc<Admission>,
    peer: IpAddr,
    /// Its connection has not finished its handshake.
    handshaking: bool,
}

impl Admission {
    pub(super) fn new(max: usize, max_per_peer: usize, max_handshakes: usize) -> Arc<Admission> {
        Arc::new(Admission {
            max: max.max(1),
            max_per_peer: max_per_peer.max(1),
            max_handshakes: max_handshakes.max(1),
            held: Mutex::new(Held::default()),
            freed: Notify::new(),
        })
    }

    fn held(&self) -> MutexGuard<'_, Held> {
        // Every critical section is a counter update: consistent even after a panic.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until fewer than `max` connections are held, and fewer than `max_handshakes`
    /// of them are in their handshake.
    pub(super) async fn room(&self) {
        loop {
            let freed = self.freed.notified();
            let room = {
                let held = self.held();
                held.total < self.max && held.handshaking < self.max_handshakes
            };
            if room {
                return;
            }
            freed.await;
        }
    }

    /// A place for a connection from `peer`, or `Err` with why not.
    pub(super) fn admit(self: &Arc<Admission>, peer: IpAddr) -> Result<Ticket, String> {
        let mut held = self.held();
        if held.total >= self.max {
            return Err(format!(
                "the listener holds its maximum of {} connections",
                self.max
            ));
        }
        let n = held.per_peer.entry(peer).or_default();
        if *n >= self.max_per_peer {
            return Err(format!(
                "{peer} already holds the {} connections one address may hold \
                 (ContextBuilder::max_connections_per_peer)",
                self.max_per_peer
            ));
        }
        *n += 1;
        held.total += 1;
        held.handshaking += 1;
        Ok(Ticket {
            admission: self.clone(),
            peer,
            handshaking: true,
        })
    }

    #[cfg(test)]
    fn total(&self) -> usize {
        self.held().total
    }
}

impl Ticket {
    /// The connection finished its handshake: it no longer counts against `max_handshakes`.
    pub(super) fn handshake_done(&mut self) {
        if std::mem::take(&mut self.handshaking) {
            self.admission.held().handshaking -= 1;
            self.admission.freed.notify_waiters();
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut held = self.admission.held();
        held.total -= 1;
        if self.handshaking {
            held.handshaking -= 1;
        }
        if let Some(n) = held.per_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                held.per_peer.remove(&self.peer);
            }
        }
        drop(held);
        self.admission.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn places_in_all_and_per_address_come_back_on_drop() {
        let a = Admission::new(3, 2, 10);
        let (x, y): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let t1 = a.admit(x).unwrap();
        let t2 = a.admit(x).unwrap();
        let e = a.admit(x).err().unwrap();
        assert!(
            e.contains("10.0.0.1") && e.contains("max_connections_per_peer"),
            "{e:#}"
        );
        let t3 = a.admit(y).unwrap();
        assert_eq!(a.total(), 3);
        assert!(a.admit(y).err().unwrap().contains("maximum of 3"));
        // Full: `room` waits until a place comes back.
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.room().await })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(t1);
        waiter.await.unwrap();
        let _t4 = a.admit(x).unwrap();
        drop((t2, t3));
        assert_eq!(a.total(), 1);
    }

    #[tokio::test]
    async fn handshakes_in_progress_are_bounded_apart_from_connections() {
        let a = Admission::new(10, 10, 2);
        let x: IpAddr = "10.0.0.1".parse().unwrap();
        let mut t1 = a.admit(x).unwrap();
        let _t2 = a.admit(x).unwrap();
        // Two handshakes running: no room, though places are free.
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.room().await })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        // One finishes: room again; its place stays taken.
        t1.handshake_done();
        waiter.await.unwrap();
        t1.handshake_done(); // twice is once
        let _t3 = a.admit(x).unwrap();
        assert_eq!(a.total(), 3);
        drop(t1);
        assert_eq!(a.total(), 2);
        assert_eq!(a.held().handshaking, 2);
    }
}
