//! `IoEngine::Inline`: tcp without I/O threads. Each connection's driver is a task on the
//! caller's tokio runtime, over epoll; a user half and its driver then hand messages over
//! within one runtime (on a current-thread runtime, within one thread), which saves the
//! cross-thread wake-up of the I/O-thread model. Needs a tokio runtime with I/O and time
//! enabled in the caller.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use tokio::runtime::Handle;
use tokio::sync::mpsc;

use super::setup::{self, TcpAccept};
use super::sys::EpollStream;
use crate::error::Result;
use crate::transport::{AcceptHalf, Config, Parts};
use crate::url::Endpoint;
use crate::{Error, ErrorKind};

fn runtime() -> Result<Handle> {
    Handle::try_current().map_err(|_| {
        Error::new(
            ErrorKind::Unavailable,
            "the inline I/O engine runs on the caller's tokio runtime, and there is none here \
             (use the default engine, which has its own I/O threads)",
        )
    })
}

pub(super) async fn connect(host: &str, port: u16, cfg: &Config) -> Result<Parts> {
    let rt = runtime()?;
    let stream = setup::connect_tcp(host, port, cfg).await?;
    let (local, peer) = setup::addrs(&stream)?;
    let (parts, driver) = setup::establish(EpollStream::new(stream), local, peer, cfg).await?;
    rt.spawn(driver);
    Ok(parts)
}

pub(super) async fn bind(
    host: &str,
    port: u16,
    cfg: &Config,
) -> Result<(Box<dyn AcceptHalf>, String)> {
    let rt = runtime()?;
    let listener = setup::bind_listener(host, port, cfg).await?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::io("bound socket address", e))?;
    let (tx, rx) = mpsc::channel(cfg.accept_backlog);
    let rejected = Arc::new(AtomicU64::new(0));
    let cfg = cfg.clone();
    let counter = rejected.clone();
    let spawner = rt.clone();
    rt.spawn(async move {
        let to = tx.clone();
        setup::accept_loop(listener, tx, &cfg, |stream, peer| {
            let (to, cfg, counter) = (to.clone(), cfg.clone(), counter.clone());
            spawner.spawn(async move {
                let Ok((local, _)) = setup::addrs(&stream) else {
                    return;
                };
                match setup::establish(EpollStream::new(stream), local, peer, &cfg).await {
                    Ok((parts, driver)) => {
                        // Waits while the backlog is full; if the listener is gone, dropping
                        // the parts closes the connection.
                        let _ = to.send(parts).await;
                        driver.await;
                    }
                    Err(e) => setup::reject(&counter, peer, &e),
                }
            });
            std::future::ready(true)
        })
        .await;
    });
    let half = TcpAccept {
        rx,
        rejected,
        keepalive: None,
    };
    Ok((
        Box::new(half),
        Endpoint::from_socket_addr(local).to_string(),
    ))
}
