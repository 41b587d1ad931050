//! A TCP relay of the tests' own between two sides, which can cut every connection through it
//! at once (both sockets closed, bytes in flight inside it lost), refuse new ones, stall
//! (hold every byte, sockets open: a frozen path), delay, and forward in tiny segments.

// Each test crate uses part of it.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

/// A TCP relay to a `tcp://` URL; stops on drop.
pub(crate) struct Relay {
    /// Where to connect to go through it.
    pub(crate) url: String,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    refuse: Arc<AtomicBool>,
    faults: Arc<Faults>,
    task: JoinHandle<()>,
}

/// What the relay does to the bytes it forwards.
#[derive(Default)]
struct Faults {
    stalled: AtomicBool,
    /// Largest piece forwarded at once; 0: as read (64 KiB).
    segment: AtomicU64,
    /// Before each piece, in microseconds.
    delay_us: AtomicU64,
}

/// Forwards `from` to `to` piece by piece, as `faults` say, until either side ends.
async fn pump(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    faults: Arc<Faults>,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let Ok(n) = from.read(&mut buf).await else {
            return;
        };
        if n == 0 {
            let _ = to.shutdown().await;
            return;
        }
        let mut rest = &buf[..n];
        while !rest.is_empty() {
            while faults.stalled.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let delay = faults.delay_us.load(Ordering::Relaxed);
            if delay > 0 {
                tokio::time::sleep(Duration::from_micros(delay)).await;
            }
            let seg = match faults.segment.load(Ordering::Relaxed) as usize {
                0 => rest.len(),
                s => s.min(rest.len()),
            };
            if to.write_all(&rest[..seg]).await.is_err() {
                return;
            }
            rest = &rest[seg..];
        }
    }
}

impl Relay {
    pub(crate) async fn start(target: &str) -> Relay {
        let target = target.trim_start_matches("tcp://").to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("tcp://{}", listener.local_addr().unwrap());
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let refuse = Arc::new(AtomicBool::new(false));
        let faults = Arc::new(Faults::default());
        let (c, r, f) = (conns.clone(), refuse.clone(), faults.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if r.load(Ordering::Relaxed) {
                    let _ = inbound.shutdown().await;
                    continue;
                }
                let (target, faults) = (target.clone(), f.clone());
                let h = tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(&target).await else {
                        let _ = inbound.shutdown().await;
                        return;
                    };
                    let _ = inbound.set_nodelay(true);
                    let _ = outbound.set_nodelay(true);
                    let (ir, iw) = inbound.into_split();
                    let (or, ow) = outbound.into_split();
                    // Each direction until it ends (a half-close is passed on as one).
                    tokio::join!(pump(ir, ow, faults.clone()), pump(or, iw, faults));
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
            faults,
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

    /// While on, every byte is held, both ways, and the sockets stay open (a frozen path).
    pub(crate) fn stall(&self, on: bool) {
        self.faults.stalled.store(on, Ordering::Relaxed);
    }

    /// Forwards at most `bytes` at a time (0: as read), waiting `delay` before each piece.
    pub(crate) fn shape(&self, bytes: usize, delay: Duration) {
        self.faults.segment.store(bytes as u64, Ordering::Relaxed);
        self.faults
            .delay_us
            .store(delay.as_micros() as u64, Ordering::Relaxed);
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
