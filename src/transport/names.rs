//! Names bound inside one context (`inproc://name`, `rdma+sim://name`), as in ZeroMQ: each
//! bound name holds its listener's backlog of connections, and a connect hands one over.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll};

use tokio::sync::mpsc;

use super::{AcceptHalf, Parts};
use crate::error::{Error, ErrorKind, Result};

pub(crate) struct Names {
    scheme: &'static str,
    backlog: usize,
    /// Bound names: the bind's id (so a listener only unregisters itself) and its backlog.
    map: Mutex<HashMap<String, (u64, mpsc::Sender<Parts>)>>,
    next_id: AtomicU64,
}

impl Names {
    pub(crate) fn new(scheme: &'static str, backlog: usize) -> Arc<Names> {
        Arc::new(Names {
            scheme,
            backlog: backlog.max(1),
            map: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, (u64, mpsc::Sender<Parts>)>> {
        // The map stays consistent even if a holder panicked: every operation is one call.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A number unique within this context, for naming connections.
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn url(&self, name: &str) -> String {
        format!("{}://{name}", self.scheme)
    }

    /// Binds `name`: fails with `AddrInUse` while another listener holds it.
    pub(crate) fn bind(self: &Arc<Self>, name: &str) -> Result<(Box<dyn AcceptHalf>, String)> {
        let url = self.url(name);
        let mut map = self.lock();
        if let Some((_, tx)) = map.get(name)
            && !tx.is_closed()
        {
            return Err(Error::new(
                ErrorKind::AddrInUse,
                format!("{url} is already bound in this context"),
            ));
        }
        let (tx, rx) = mpsc::channel(self.backlog);
        let id = self.next_id();
        map.insert(name.to_owned(), (id, tx));
        let accept = NamedAccept {
            rx,
            id,
            name: name.to_owned(),
            names: Arc::downgrade(self),
        };
        Ok((Box::new(accept), url))
    }

    /// The backlog of the listener at `name`; `ConnectionRefused` when nothing is bound.
    pub(crate) fn lookup(&self, name: &str) -> Result<mpsc::Sender<Parts>> {
        match self.lock().get(name) {
            Some((_, tx)) => Ok(tx.clone()),
            None => Err(self.refused(name)),
        }
    }

    pub(crate) fn refused(&self, name: &str) -> Error {
        Error::new(
            ErrorKind::ConnectionRefused,
            format!("nothing is bound at {} in this context", self.url(name)),
        )
    }
}

struct NamedAccept {
    rx: mpsc::Receiver<Parts>,
    id: u64,
    name: String,
    names: Weak<Names>,
}

impl AcceptHalf for NamedAccept {
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Result<Parts>> {
        // The map holds the sender while the listener lives, so `None` cannot happen before
        // drop; report it as closed rather than assume.
        self.rx.poll_recv(cx).map(|p| {
            p.ok_or_else(|| {
                let scheme = self.names.upgrade().map_or("named", |n| n.scheme);
                Error::new(
                    ErrorKind::Closed,
                    format!("the {scheme} listener is closed"),
                )
            })
        })
    }

    fn rejected(&self) -> u64 {
        0
    }
}

impl Drop for NamedAccept {
    fn drop(&mut self) {
        if let Some(names) = self.names.upgrade() {
            let mut map = names.lock();
            if map.get(&self.name).is_some_and(|(id, _)| *id == self.id) {
                map.remove(&self.name);
            }
        }
    }
}
