//! `shm://` between two processes: a full-duplex stress run with every body checked and
//! bodies released out of order, the rendezvous socket's edge cases, and bad segments. The
//! test binary re-executes itself as the peer (`child`, active only with `HF_SHM_CHILD`).

#![cfg(feature = "shm")]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use hyperframes::{Context, ErrorKind, Message};
use tokio::time::timeout;

const GUARD: Duration = Duration::from_secs(120);

/// Kills the child on drop.
struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn spawn_child(mode: &str, url: &str, uid: Option<u32>) -> Peer {
    let (mode, url) = (mode.to_owned(), url.to_owned());
    tokio::task::spawn_blocking(move || {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "child", "--nocapture", "--test-threads=1"])
            .env("HF_SHM_CHILD", format!("{mode} {url}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(uid) = uid {
            std::os::unix::process::CommandExt::uid(&mut cmd, uid);
        }
        let mut child = cmd.spawn().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        loop {
            match lines.next() {
                Some(Ok(l)) if l.contains("READY") => break,
                Some(_) => continue,
                None => break, // exited early: the test sees why
            }
        }
        // Keep draining its output so it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Peer(child)
    })
    .await
    .unwrap()
}

/// The size of message `i` of the stress run: mostly small (copied out on receive), every
/// tenth medium and every hundredth large (leased from the arena), now and then larger than
/// the arena (a memfd of its own).
fn size(i: u64) -> usize {
    if i.is_multiple_of(5000) {
        5 << 20 // > the 4 MiB test arena
    } else if i % 100 == 1 {
        100 << 10
    } else if i % 10 == 2 {
        1500 + (i % 7) as usize * 100
    } else {
        (i % 97) as usize
    }
}

/// A body whose every byte depends on `i`, so that any mix-up shows.
fn body(i: u64) -> Bytes {
    let n = size(i);
    let mut v = Vec::with_capacity(n + 8);
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(n);
    Bytes::from(v)
}

fn checksum(b: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ b.len() as u64;
    let mut words = b.chunks_exact(8);
    for w in &mut words {
        h = (h ^ u64::from_le_bytes(w.try_into().unwrap())).wrapping_mul(0x100_0000_01b3);
    }
    for &x in words.remainder() {
        h = (h ^ x as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn stress_messages() -> u64 {
    std::env::var("HF_SHM_STRESS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000)
}

fn ctx() -> Context {
    Context::builder()
        .shm_segment(1024, 4 << 20)
        .build()
        .unwrap()
}

/// Sends `n` messages (`size`/`body`, checksum in the metadata) and, concurrently, receives
/// and checks `n`, holding bodies in windows of 8 and dropping each window in a scrambled
/// order. (Arena blocks are reused in order, so a body held for long holds back the space
/// allocated after it: a receiver that keeps bodies while waiting for more messages would
/// stall the sender, which is backpressure, not a fault.)
async fn duplex(ch: hyperframes::Channel, n: u64) {
    let (mut tx, mut rx) = ch.split();
    let sender = tokio::spawn(async move {
        for i in 0..n {
            let b = body(i);
            let m = Message::new("stress.data")
                .unwrap()
                .with_meta("i", i.to_string())
                .unwrap()
                .with_meta("sum", checksum(&b).to_string())
                .unwrap()
                .with_body(b);
            tx.send(m).await.unwrap();
        }
        tx.close().await.unwrap();
    });
    let mut held: Vec<Bytes> = Vec::new();
    let mut next = 0u64;
    while let Some(m) = rx.recv().await {
        let m = m.unwrap();
        let i: u64 = m.meta().get("i").unwrap().parse().unwrap();
        assert_eq!(i, next, "in order");
        let b = m.body().as_bytes().unwrap().clone();
        assert_eq!(b.len(), size(i), "length of {i}");
        let sum: u64 = m.meta().get("sum").unwrap().parse().unwrap();
        assert_eq!(checksum(&b), sum, "contents of {i}");
        held.push(b);
        if held.len() == 8 {
            // Release the window in a scrambled order: the arena frees blocks out of order.
            for k in [5usize, 2, 7, 0, 3, 6, 1, 4] {
                held[k] = Bytes::new();
            }
            held.clear();
        }
        next += 1;
    }
    assert_eq!(next, n);
    drop(held);
    sender.await.unwrap();
}

/// The peer side. `duplex URL`: connect, run `duplex`. `idle URL`: connect, never read.
/// `corrupt-connect URL`: connect, print the error.
#[test]
fn child() {
    let Ok(spec) = std::env::var("HF_SHM_CHILD") else {
        return;
    };
    let (mode, url) = spec.split_once(' ').unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        match mode {
            "duplex" => {
                let ch = ctx().connect(url).await.unwrap();
                println!("READY");
                duplex(ch, stress_messages()).await;
            }
            "idle" => {
                let mut ch = ctx().connect(url).await.unwrap();
                // Fill the way back, then sleep until killed.
                println!("READY");
                let big = Bytes::from(vec![0u8; 64 << 10]);
                loop {
                    if timeout(
                        Duration::from_millis(200),
                        ch.send(Message::new("x").unwrap().with_body(big.clone())),
                    )
                    .await
                    .is_err()
                    {
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_secs(600)).await;
            }
            "connect" => {
                println!("READY");
                match ctx().connect(url).await {
                    Ok(_) => println!("CONNECTED"),
                    Err(e) => println!("ERROR {:?} {e}", e.kind()),
                }
            }
            _ => unreachable!(),
        }
    });
}

fn url(tag: &str) -> String {
    format!("shm://test-{tag}-{}", std::process::id())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_full_duplex_stress() {
    let url = url("stress");
    let mut l = ctx().bind(&url).await.unwrap();
    let _peer = spawn_child("duplex", &url, None).await;
    let ch = timeout(GUARD, l.accept()).await.unwrap().unwrap();
    timeout(GUARD, duplex(ch, stress_messages())).await.unwrap();
}

#[tokio::test]
async fn a_stale_socket_is_replaced_a_live_one_is_not() {
    let dir = std::env::temp_dir().join(format!("hf-shm-stale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("s.sock");
    // A socket file whose process is gone (std's listener does not unlink on drop).
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let url = format!("shm://{}", path.display());
    let l = ctx()
        .bind(&url)
        .await
        .expect("the stale socket is replaced");
    let e = ctx().bind(&url).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AddrInUse, "{e}");
    drop(l);
    assert!(!path.exists(), "the listener removes its socket");
    let e = ctx().connect(&url).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn socket_is_private() {
    use std::os::unix::fs::PermissionsExt;
    let url = url("mode");
    let _l = ctx().bind(&url).await.unwrap();
    let dir = match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if std::path::Path::new(&d).is_dir() => {
            std::path::Path::new(&d).join("hyperframes")
        }
        _ => std::path::PathBuf::from(format!("/tmp/hyperframes-{}", rustix_uid())),
    };
    let name = url.trim_start_matches("shm://");
    let mode = std::fs::metadata(dir.join(format!("{name}.sock")))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    assert_eq!(
        std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
        0o700
    );
}

fn rustix_uid() -> u32 {
    // SAFETY-free way to get the uid: the owner of a file we just created.
    use std::os::unix::fs::MetadataExt;
    let p = std::env::temp_dir().join(format!("hf-uid-{}", std::process::id()));
    std::fs::write(&p, b"").unwrap();
    let uid = std::fs::metadata(&p).unwrap().uid();
    let _ = std::fs::remove_file(&p);
    uid
}

/// A fake listener hands us a segment with a corrupted header, then an unsealed one, then
/// a memfd where a wake socket belongs: the connector refuses each with a clear error.
#[tokio::test]
async fn corrupted_or_unsealed_segments_are_rejected() {
    use std::io::Write;
    use std::os::fd::AsFd;
    for case in ["magic", "unsealed", "wake"] {
        let dir = std::env::temp_dir().join(format!("hf-shm-bad-{case}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.sock");
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let fake = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let memfd = memfd(case == "unsealed");
            let mut hello = [0u8; 64];
            hello[..8].copy_from_slice(b"HFSHMHEL");
            hello[8] = 2;
            hello[16..24].copy_from_slice(&(1u64 << 20).to_le_bytes());
            hello[24..28].copy_from_slice(&4096u32.to_le_bytes());
            hello[28..30].copy_from_slice(&32u16.to_le_bytes());
            let (wake, _theirs) = wake_pair();
            let space = if case == "wake" {
                memfd.as_fd()
            } else {
                wake.as_fd()
            };
            send_fds(&s, &hello, &[memfd.as_fd(), wake.as_fd(), space]);
            let _ = s.flush();
            std::thread::sleep(Duration::from_millis(500));
        });
        let url = format!("shm://{}", path.display());
        let e = timeout(GUARD, ctx().connect(&url))
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Protocol, "{case}: {e}");
        let want = match case {
            "magic" => "magic",
            "unsealed" => "sealed",
            _ => "wake descriptor is not a socket",
        };
        assert!(e.to_string().contains(want), "{case}: {e}");
        fake.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A connected pair of Unix `SOCK_SEQPACKET` sockets, as the listener passes for wake-ups.
fn wake_pair() -> (std::os::fd::OwnedFd, std::os::fd::OwnedFd) {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .unwrap()
}

/// A memfd that looks like a segment but has a wrong magic, or is not sealed.
fn memfd(unsealed: bool) -> std::os::fd::OwnedFd {
    use rustix::fs::{MemfdFlags, SealFlags};
    use std::io::Write;
    let flags = if unsealed {
        MemfdFlags::CLOEXEC
    } else {
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING
    };
    let fd = rustix::fs::memfd_create("fake", flags).unwrap();
    let mut f = std::fs::File::from(fd);
    f.set_len(1 << 20).unwrap();
    f.write_all(b"NOTASEGM").unwrap();
    if !unsealed {
        rustix::fs::fcntl_add_seals(&f, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .unwrap();
    }
    f.into()
}

/// `sendmsg` with `SCM_RIGHTS`.
fn send_fds(s: &std::os::unix::net::UnixStream, bytes: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]) {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(8))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    let n = rustix::net::sendmsg(
        s,
        &[std::io::IoSlice::new(bytes)],
        &mut control,
        SendFlags::empty(),
    )
    .unwrap();
    assert_eq!(n, bytes.len());
}

/// A peer running as another user is refused (SO_PEERCRED), when this test runs as root and
/// can start one.
#[tokio::test]
async fn another_user_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    if rustix_uid() != 0 {
        eprintln!("not root: cannot run a peer as another user; skipping");
        return;
    }
    let dir = std::env::temp_dir().join(format!("hf-shm-uid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let path = dir.join("u.sock");
    let url = format!("shm://{}", path.display());
    let l = ctx().bind(&url).await.unwrap();
    // Let the other user reach the socket, so that the credential check is what refuses it.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let _peer = spawn_child("connect", &url, Some(65534)).await;
    timeout(GUARD, async {
        while l.rejected() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the listener refuses the other user");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Regression (double release): a message whose type and metadata do not fit the descriptor
/// (their block goes in the arena) and whose body is larger than the arena (a memfd passed on
/// the socket). When the descriptor is seen before its memfd has come through the socket, the
/// receiver must not release the head block twice: that wrapped the block's count and the
/// sender waited for room forever (stuck at message 256 of 1500 with these sizes). The
/// receiver busy-polls on a single-threaded runtime, so it nearly always sees a descriptor
/// before the task that reads the socket has run.
#[test]
fn long_metadata_with_bodies_larger_than_the_arena() {
    const N: u64 = 1500;
    let url = url("longmeta");
    let ctx = || {
        Context::builder()
            .shm_segment(64, 64 << 10)
            .busy_poll(true)
            .build()
            .unwrap()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut l = rt.block_on(ctx().bind(&url)).unwrap();
    let sender = std::thread::spawn({
        let url = url.clone();
        move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let (mut tx, _rx) = ctx().connect(&url).await.unwrap().split();
                let long = "m".repeat(100);
                for i in 0..N {
                    let m = Message::new("regression.double.release")
                        .unwrap()
                        .with_meta("i", i.to_string())
                        .unwrap()
                        .with_meta("long", &long)
                        .unwrap()
                        .with_body(vec![(i % 251) as u8; 96 << 10]);
                    if timeout(Duration::from_secs(20), tx.send(m)).await.is_err() {
                        return Err(i);
                    }
                }
                tx.close().await.unwrap();
                Ok(N)
            })
        }
    });
    let received = rt.block_on(async {
        let (_tx, mut rx) = timeout(GUARD, l.accept()).await.unwrap().unwrap().split();
        timeout(Duration::from_secs(60), async {
            let mut n = 0u64;
            while let Some(m) = rx.recv().await {
                let m = m.unwrap();
                assert_eq!(m.meta().get("i"), Some(n.to_string().as_str()));
                let b = m.body().as_bytes().unwrap();
                assert_eq!(b.len(), 96 << 10);
                assert!(b.iter().all(|&x| x == (n % 251) as u8), "body of {n}");
                n += 1;
            }
            n
        })
        .await
    });
    assert_eq!(
        sender.join().unwrap(),
        Ok(N),
        "the sender never waits for room forever"
    );
    assert_eq!(received, Ok(N), "every message arrives");
}

/// One process, both ends: a listener context and the connected pair.
async fn pair(ctx: &Context, tag: &str) -> (hyperframes::Channel, hyperframes::Channel) {
    let url = url(tag);
    let mut l = ctx.bind(&url).await.unwrap();
    let (a, b) = tokio::join!(ctx.connect(&url), l.accept());
    (a.unwrap(), b.unwrap())
}

/// Fails with the first difference (not two long lists).
fn same_sequence(got: &[u64], want: &[u64], what: &str) {
    if let Some(k) = (0..got.len().min(want.len())).find(|&k| got[k] != want[k]) {
        panic!(
            "{what}: at position {k} got {} where {} was expected ({} received, {} expected)",
            got[k],
            want[k],
            got.len(),
            want.len()
        );
    }
    assert_eq!(got.len(), want.len(), "{what}: counts differ");
}

fn numbered(i: u64, size: usize) -> Message {
    Message::new("cancel.test")
        .unwrap()
        .with_meta("i", i.to_string())
        .unwrap()
        .with_body(vec![(i % 251) as u8; size])
}

/// Regression (cancelled send): a `send` cancelled while it waits for arena room sent
/// nothing — the message neither arrives later nor twice after a retry — and one that
/// completed arrived exactly once. Sends are cancelled at random points while the receiver
/// reads at random speeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_send_sent_nothing() {
    let ctx = Context::builder()
        .shm_segment(64, 64 << 10)
        .build()
        .unwrap();
    let (a, b) = pair(&ctx, "cancel").await;
    let (mut tx, _ra) = a.split();
    let (_tb, mut rx) = b.split();
    const N: u64 = 3000;
    let sender = tokio::spawn(async move {
        let mut completed = Vec::new();
        let mut cancelled = 0u64;
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for i in 0..N {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let size = 2000 + (x % 14_000) as usize;
            let wait = Duration::from_micros(x % 300);
            match timeout(wait, tx.send(numbered(i, size))).await {
                Ok(r) => {
                    r.unwrap();
                    completed.push(i);
                }
                Err(_) => cancelled += 1,
            }
        }
        tx.close().await.unwrap();
        (completed, cancelled)
    });
    let mut got = Vec::new();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    while let Some(m) = timeout(GUARD, rx.recv()).await.unwrap() {
        let m = m.unwrap();
        let i: u64 = m.meta().get("i").unwrap().parse().unwrap();
        assert!(
            m.body()
                .as_bytes()
                .unwrap()
                .iter()
                .all(|&b| b == (i % 251) as u8),
            "body of {i}"
        );
        got.push(i);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if x.is_multiple_of(7) {
            tokio::time::sleep(Duration::from_micros(x % 500)).await;
        }
    }
    let (completed, cancelled) = sender.await.unwrap();
    assert!(
        cancelled > 100,
        "the test cancels sends ({cancelled} of {N})"
    );
    same_sequence(
        &got,
        &completed,
        "exactly the completed sends arrive, once, in order",
    );
}

/// Regression (drop): a message accepted by `feed` when the arena had no room (staged in the
/// sender) is delivered after the `Sender` is dropped — drop is a close that finishes in the
/// background — and the stream then ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_sender_delivers_what_it_staged() {
    use futures_util::SinkExt;
    let ctx = Context::builder()
        .shm_segment(64, 64 << 10)
        .build()
        .unwrap();
    let (a, b) = pair(&ctx, "lingerdrop").await;
    let (mut tx, _ra) = a.split();
    let (_tb, mut rx) = b.split();
    // Feed (accept without flushing) until the arena is full: the last message accepted is
    // staged in the sender, and the next feed waits for room (and is cancelled: it took
    // nothing).
    let mut i = 0;
    while timeout(Duration::from_millis(200), tx.feed(numbered(i, 8000)))
        .await
        .is_ok()
    {
        i += 1;
    }
    drop(tx);
    let mut got = Vec::new();
    while let Some(m) = timeout(GUARD, rx.recv()).await.unwrap() {
        got.push(m.unwrap().meta().get("i").unwrap().parse::<u64>().unwrap());
    }
    assert!(i > 5, "the arena took a few before it filled ({i})");
    same_sequence(
        &got,
        &(0..i).collect::<Vec<_>>(),
        "every message accepted arrives",
    );
}

/// Regression (bind): binding `shm:///path` where a regular file lies refuses, and leaves the
/// file as it was (it used to be deleted); nothing of the temporary name is left behind.
#[tokio::test]
async fn binding_over_a_file_that_is_not_a_socket_refuses() {
    let dir = std::env::temp_dir().join(format!("hf-shm-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("data.sock");
    std::fs::write(&path, b"precious").unwrap();
    let e = ctx()
        .bind(&format!("shm://{}", path.display()))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AddrInUse, "{e}");
    assert!(e.to_string().contains("not a socket"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), b"precious");
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert_eq!(left.len(), 1, "only the file: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// With `shm_allow_any_user` the socket is connectable by other users (0666; the credential
/// check is what admits them); without, it is private (0600).
#[tokio::test]
async fn the_socket_mode_follows_who_may_connect() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("hf-shm-modes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (any, want) in [(false, 0o600), (true, 0o666)] {
        let path = dir.join(format!("m{any}.sock"));
        let ctx = Context::builder().shm_allow_any_user(any).build().unwrap();
        let _l = ctx
            .bind(&format!("shm://{}", path.display()))
            .await
            .unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, want, "any user: {any}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Regression (handshakes): connections that never answer the handshake are bounded — each
/// costs a segment and descriptors until it times out — and a real client gets in once
/// they are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_bounded() {
    let before = std::fs::read_dir("/proc/self/fd").unwrap().count();
    let ctx = Context::builder()
        .shm_segment(64, 64 << 10)
        .handshake_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let url = url("silent");
    let mut l = ctx.bind(&url).await.unwrap();
    let path = socket_path_of(&url);
    let silent: Vec<_> = (0..150)
        .map(|_| std::os::unix::net::UnixStream::connect(&path).unwrap())
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Ours: the 150 client ends, plus per handshake in progress the accepted socket, the
    // segment and four wake-socket ends.
    let held = std::fs::read_dir("/proc/self/fd").unwrap().count() - before - silent.len();
    assert!(
        held <= 32 * 6 + 16,
        "{held} descriptors for silent connections"
    );
    // Once they go (or time out), a real client gets in.
    drop(silent);
    let (ch, accepted) = tokio::join!(
        timeout(GUARD, ctx.connect(&url)),
        timeout(GUARD, l.accept())
    );
    ch.unwrap().unwrap();
    accepted.unwrap().unwrap();
    assert!(
        l.rejected() >= 32,
        "the silent ones are refused: {}",
        l.rejected()
    );
}

fn socket_path_of(url: &str) -> std::path::PathBuf {
    let name = url.trim_start_matches("shm://");
    let dir = match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if std::path::Path::new(&d).is_dir() => {
            std::path::Path::new(&d).join("hyperframes")
        }
        _ => std::path::PathBuf::from(format!("/tmp/hyperframes-{}", rustix_uid())),
    };
    dir.join(format!("{name}.sock"))
}
