//! SIGKILL of a `shm://` peer in the middle of a stream: both halves of the survivor report
//! `ConnectionLost` promptly (the sender while blocked on a full ring), and once the channel
//! is dropped no descriptor is left behind and nothing appears in /dev/shm. Alone in its test
//! binary so that the descriptor count is not disturbed by other tests.

#![cfg(feature = "shm")]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyperframes::{Context, ErrorKind, Message};
use tokio::time::timeout;

fn ctx() -> Context {
    Context::builder().shm_segment(64, 1 << 20).build().unwrap()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn dev_shm() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The peer: connect, fill the way back until blocked, then sleep until killed.
#[test]
fn child() {
    let Ok(url) = std::env::var("HF_SHM_CRASH_CHILD") else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut ch = ctx().connect(&url).await.unwrap();
        let big = Bytes::from(vec![3u8; 64 << 10]);
        let mut sent = 0;
        while timeout(
            Duration::from_millis(300),
            ch.send(Message::new("x").unwrap().with_body(big.clone())),
        )
        .await
        .is_ok()
        {
            sent += 1;
        }
        println!("READY {sent}");
        tokio::time::sleep(Duration::from_secs(600)).await;
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_the_peer_is_reported_and_leaves_nothing_behind() {
    let fds_before = open_fds();
    let shm_before = dev_shm();
    let url = format!("shm://crash-{}", std::process::id());
    let mut l = ctx().bind(&url).await.unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env("HF_SHM_CRASH_CHILD", &url)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let ch = timeout(Duration::from_secs(30), l.accept())
        .await
        .unwrap()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let sent: u64 = tokio::task::spawn_blocking(move || {
        let line = BufReader::new(stdout)
            .lines()
            .map(|l| l.unwrap())
            .find(|l| l.contains("READY"))
            .unwrap();
        line.rsplit(' ').next().unwrap().parse().unwrap()
    })
    .await
    .unwrap();
    assert!(sent > 0);
    let (mut tx, mut rx) = ch.split();
    // Our sender blocks too: the peer never reads.
    let big = Bytes::from(vec![1u8; 64 << 10]);
    while timeout(
        Duration::from_millis(300),
        tx.send(Message::new("y").unwrap().with_body(big.clone())),
    )
    .await
    .is_ok_and(|r| r.is_ok())
    {}
    let blocked = tokio::spawn(async move {
        let r = tx
            .send(Message::new("y").unwrap().with_body(big.clone()))
            .await;
        (r, tx)
    });

    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();

    let (r, tx) = timeout(Duration::from_secs(10), blocked)
        .await
        .unwrap()
        .unwrap();
    let e = r.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e}");
    // The receiver hands out what arrived, then the same failure.
    let mut got = 0;
    let e = loop {
        match timeout(Duration::from_secs(10), rx.recv()).await.unwrap() {
            Some(Ok(_)) => got += 1,
            Some(Err(e)) => break e,
            None => panic!("a clean end after a SIGKILL"),
        }
    };
    assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e}");
    assert_eq!(got, sent, "every message published before the kill arrives");
    assert!(
        killed.elapsed() < Duration::from_secs(5),
        "reported promptly"
    );

    drop((tx, rx, l));
    // The connection's watcher task and descriptors go away shortly after.
    let deadline = Instant::now() + Duration::from_secs(10);
    while open_fds() > fds_before && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(open_fds(), fds_before, "descriptors left behind");
    assert_eq!(dev_shm(), shm_before, "files left in /dev/shm");
}
