//! Would driving io_uring directly make `tcp://` faster than the tokio (epoll) reactor the
//! inline engine rides on? A 64 B ping-pong over loopback TCP, one thread per side, each
//! pinned to its own CPU (0 and 1; `HF_BENCH_NO_PIN=1` leaves them free), three ways:
//!
//! - `blocking`: `read`/`write` on blocking sockets: the kernel's own wake-up, no event loop
//!   (the floor for anything built on readiness or completions);
//! - `tokio_epoll`: a current-thread tokio runtime per side with a `TcpStream` (readiness from
//!   epoll, then `recv`/`send`: what `IoEngine::Inline` does per message);
//! - `uring`: one io_uring per side, driven directly (the `io-uring` crate): a `SEND` and the
//!   next `RECV` submitted together, one `io_uring_enter` per hop that also waits.
//!
//! Rounds are interleaved (every way once per round) so the machine's drift hits all of them;
//! the summary gives the median of the rounds' p50 half round trips and its ratio to
//! `tokio_epoll` in the same run. Run with `cargo bench --bench uring_vs_epoll`
//! (`HF_BENCH_ROUNDS`, default 7; `HF_BENCH_TRIPS`, default 20000).
//!
//! This is the evidence for the engine choice in `src/transport/tcp/mod.rs`, not a test of
//! hyperframes' own code.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Instant;

use io_uring::{IoUring, opcode, types};

const SIZE: usize = 64;

fn pin(cpu: usize) {
    if std::env::var_os("HF_BENCH_NO_PIN").is_some() {
        return;
    }
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    // Best effort: a host with one CPU still runs the bench.
    let _ = rustix::thread::sched_setaffinity(None, &set);
}

fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    for t in [&c, &s] {
        t.set_nodelay(true).unwrap();
    }
    (c, s)
}

/// Half round trips in nanoseconds, one per trip, measured by the client.
type Trips = Vec<u64>;

/// Runs `client` and `echo` on their own pinned threads over a fresh connection.
fn run(
    trips: usize,
    client: impl FnOnce(TcpStream, usize) -> Trips + Send + 'static,
    echo: impl FnOnce(TcpStream, usize) + Send + 'static,
) -> Trips {
    let (c, s) = pair();
    let e = std::thread::spawn(move || {
        pin(1);
        echo(s, trips)
    });
    let t = std::thread::spawn(move || {
        pin(0);
        client(c, trips)
    })
    .join()
    .unwrap();
    e.join().unwrap();
    t
}

// ------------------------------------------------------------------ blocking

fn blocking_client(mut c: TcpStream, trips: usize) -> Trips {
    let mut buf = [7u8; SIZE];
    let mut out = Vec::with_capacity(trips);
    for _ in 0..trips {
        let t = Instant::now();
        c.write_all(&buf).unwrap();
        c.read_exact(&mut buf).unwrap();
        out.push(t.elapsed().as_nanos() as u64 / 2);
    }
    out
}

fn blocking_echo(mut s: TcpStream, trips: usize) {
    let mut buf = [0u8; SIZE];
    for _ in 0..trips {
        s.read_exact(&mut buf).unwrap();
        s.write_all(&buf).unwrap();
    }
}

// ------------------------------------------------------------------ tokio (epoll)

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn tokio_client(c: TcpStream, trips: usize) -> Trips {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    current_thread().block_on(async move {
        c.set_nonblocking(true).unwrap();
        let mut c = tokio::net::TcpStream::from_std(c).unwrap();
        let mut buf = [7u8; SIZE];
        let mut out = Vec::with_capacity(trips);
        for _ in 0..trips {
            let t = Instant::now();
            c.write_all(&buf).await.unwrap();
            c.read_exact(&mut buf).await.unwrap();
            out.push(t.elapsed().as_nanos() as u64 / 2);
        }
        out
    })
}

fn tokio_echo(s: TcpStream, trips: usize) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    current_thread().block_on(async move {
        s.set_nonblocking(true).unwrap();
        let mut s = tokio::net::TcpStream::from_std(s).unwrap();
        let mut buf = [0u8; SIZE];
        for _ in 0..trips {
            s.read_exact(&mut buf).await.unwrap();
            s.write_all(&buf).await.unwrap();
        }
    })
}

// ------------------------------------------------------------------ io_uring, direct

const SEND: u64 = 1;
const RECV: u64 = 2;

/// Waits for `want` completions; returns the bytes the `RECV` among them read (0 if none).
/// A short send or receive is not expected for 64 B on loopback and fails the bench.
fn reap(ring: &mut IoUring, want: usize) -> usize {
    let mut got = 0;
    let mut read = 0;
    while got < want {
        ring.submit_and_wait(want - got).unwrap();
        for cqe in ring.completion() {
            assert!(
                cqe.result() >= 0,
                "io_uring: {}",
                std::io::Error::from_raw_os_error(-cqe.result())
            );
            if cqe.user_data() == RECV {
                read = cqe.result() as usize;
            } else {
                assert_eq!(cqe.result() as usize, SIZE, "short send");
            }
            got += 1;
        }
    }
    read
}

fn push(ring: &mut IoUring, e: &io_uring::squeue::Entry) {
    // SAFETY: every entry points into a buffer of the caller's that outlives its completion
    // (each hop reaps its entries before the buffer is touched again).
    unsafe { ring.submission().push(e).expect("submission queue full") };
}

fn uring_client(c: TcpStream, trips: usize) -> Trips {
    let mut ring = IoUring::new(8).unwrap();
    let fd = types::Fd(c.as_raw_fd());
    let mut sbuf = [7u8; SIZE];
    let mut rbuf = [0u8; SIZE];
    let mut out = Vec::with_capacity(trips);
    for _ in 0..trips {
        let t = Instant::now();
        let send = opcode::Send::new(fd, sbuf.as_ptr(), SIZE as u32)
            .build()
            .user_data(SEND);
        let recv = opcode::Recv::new(fd, rbuf.as_mut_ptr(), SIZE as u32)
            .build()
            .user_data(RECV);
        push(&mut ring, &send);
        push(&mut ring, &recv);
        let mut n = reap(&mut ring, 2);
        while n < SIZE {
            let more = opcode::Recv::new(fd, rbuf[n..].as_mut_ptr(), (SIZE - n) as u32)
                .build()
                .user_data(RECV);
            push(&mut ring, &more);
            n += reap(&mut ring, 1);
        }
        out.push(t.elapsed().as_nanos() as u64 / 2);
        sbuf.copy_from_slice(&rbuf);
    }
    out
}

fn uring_echo(s: TcpStream, trips: usize) {
    let mut ring = IoUring::new(8).unwrap();
    let fd = types::Fd(s.as_raw_fd());
    let mut buf = [0u8; SIZE];
    let mut out = [0u8; SIZE];
    let recv = |b: &mut [u8]| {
        opcode::Recv::new(fd, b.as_mut_ptr(), b.len() as u32)
            .build()
            .user_data(RECV)
    };
    push(&mut ring, &recv(&mut buf));
    let mut n = reap(&mut ring, 1);
    for i in 0..trips {
        while n < SIZE {
            push(&mut ring, &recv(&mut buf[n..]));
            n += reap(&mut ring, 1);
        }
        out.copy_from_slice(&buf);
        let send = opcode::Send::new(fd, out.as_ptr(), SIZE as u32)
            .build()
            .user_data(SEND);
        push(&mut ring, &send);
        if i + 1 == trips {
            reap(&mut ring, 1);
            break;
        }
        // The answer and the wait for the next ping in one system call.
        push(&mut ring, &recv(&mut buf));
        n = reap(&mut ring, 2);
    }
}

// ------------------------------------------------------------------ summary

fn p50(mut v: Trips) -> f64 {
    v.sort_unstable();
    v[v.len() / 2] as f64 / 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let rounds = env("HF_BENCH_ROUNDS", 7);
    let trips = env("HF_BENCH_TRIPS", 20_000);
    if IoUring::new(8).is_err() {
        println!(
            "io_uring is refused on this host (seccomp, or io_uring_disabled): nothing to compare"
        );
        return;
    }
    type Way = (&'static str, fn(usize) -> Trips);
    let ways: [Way; 3] = [
        ("blocking", |n| run(n, blocking_client, blocking_echo)),
        ("tokio_epoll", |n| run(n, tokio_client, tokio_echo)),
        ("uring", |n| run(n, uring_client, uring_echo)),
    ];
    // Warm-up: a short run of each.
    for (_, f) in &ways {
        f(1000);
    }
    let mut by_way: Vec<Vec<f64>> = vec![Vec::new(); ways.len()];
    for r in 0..rounds {
        let mut line = format!("round {}/{rounds}:", r + 1);
        for (i, (name, f)) in ways.iter().enumerate() {
            let v = p50(f(trips));
            line += &format!(" {name} {v:.2} us");
            by_way[i].push(v);
        }
        println!("{line}");
    }
    let base = median(by_way[1].clone());
    println!("\n64 B ping-pong over loopback TCP, p50 half round trip, median of {rounds} rounds:");
    for ((name, _), v) in ways.iter().zip(by_way) {
        let (lo, hi) = (
            v.iter().copied().fold(f64::MAX, f64::min),
            v.iter().copied().fold(0.0, f64::max),
        );
        let m = median(v);
        println!(
            "  {name:12} {m:7.2} us  ({lo:.2}-{hi:.2})  {:.2}x tokio_epoll",
            m / base
        );
    }
}
