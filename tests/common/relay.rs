//! A TCP relay of the tests' own between two sides, which can cut every connection through it
//! at once (both sockets closed, bytes in flight inside it lost) and refuse new ones.

// Each test crate uses part of it.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

/// A TCP relay to a `tcp://` URL; stops on drop.
pub(crate) struct Relay {
    /// Where to connect to go through it.
    pub(crate) url: String,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    refuse: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Relay {
    pub(crate) async fn start(target: &str) -> Relay {
        let target = target.trim_start_matches("tcp://").to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("tcp://{}", listener.local_addr().unwrap());
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let refuse = Arc::new(AtomicBool::new(false));
        let (c, r) = (conns.clone(), refuse.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if r.load(Ordering::Relaxed) {
                    let _ = inbound.shutdown().await;
                    continue;
                }
                let target = target.clone();
                let h = tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(&target).await else {
                        let _ = inbound.shutdown().await;
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                });
                let mut conns = c.lock().await;
                conns.retain(|h| !h.is_finished());
                conns.push(h);
            }
        });
        Relay {
            url,
            conns,
            refuse,
            task,
        }
    }

    /// Drops every connection through the relay; how many were open.
    pub(crate) async fn cut(&self) -> usize {
        let mut conns = self.conns.lock().await;
        let n = conns.iter().filter(|h| !h.is_finished()).count();
        for h in conns.drain(..) {
            h.abort();
        }
        n
    }

    /// While on, new connections are closed at once.
    pub(crate) fn refuse(&self, on: bool) {
        self.refuse.store(on, Ordering::Relaxed);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}
