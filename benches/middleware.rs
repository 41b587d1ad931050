//! The cost of the tower middleware on small messages: 64 B messages over `inproc://`
//! through a `TypeFilterLayer` + `MetaSchemaLayer` stack, against the bare channel in the
//! same group and run. Run with `cargo bench --bench middleware`; a summary of ratios to the
//! bare channel is printed at the end (goal: at most 1.10).
//!
//! Every case moves the same messages (type `bench.data.chunk`, two metadata entries, a 64 B
//! body) from a sender to a receiver task on one current-thread runtime; the clock stops
//! when the receiver has counted all N. The cases:
//!
//! * `bare_channel` — `Sender::send` / `Receiver::recv`;
//! * `sender_service` — the `Sender` as a `tower::Service` (`ready` + `call`), no layers;
//! * `layers_send` — `TypeFilterLayer` (three patterns) + `MetaSchemaLayer` (two keys with
//!   value rules, type naming) around the `Sender`;
//! * `layers_both` — the same stack around the sender and around the receiver's handler.

use std::collections::BTreeMap;
use std::future::{Ready, ready};
use std::hint::black_box;
use std::sync::Mutex;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use hyperframes::middleware::{BoxError, MetaSchema, MetaSchemaLayer, TypeFilterLayer, Value};
use hyperframes::{Context, Message, Receiver, Sender};
use tokio::sync::mpsc;
use tower::{Service, ServiceBuilder, ServiceExt};

const GROUP: &str = "middleware_inproc_64B";
const END: &str = "bench.data.end";

static TOTALS: Mutex<BTreeMap<String, (f64, u64)>> = Mutex::new(BTreeMap::new());

fn record(func: &str, elapsed: Duration, items: u64) {
    let mut t = TOTALS.lock().unwrap();
    let e = t.entry(func.into()).or_insert((0.0, 0));
    e.0 += elapsed.as_secs_f64();
    e.1 += items;
}

fn message() -> Message {
    Message::new("bench.data.chunk")
        .unwrap()
        .with_meta("seq", "123456")
        .unwrap()
        .with_meta("source", "cam0")
        .unwrap()
        .with_body(vec![0x5au8; 64])
}

fn end() -> Message {
    Message::new(END).unwrap().with_meta("seq", "0").unwrap()
}

fn filter() -> TypeFilterLayer {
    TypeFilterLayer::new(["video.frame", "ml.splitter.*", "bench.data.*"]).unwrap()
}

fn schema() -> MetaSchemaLayer {
    MetaSchemaLayer::new(
        MetaSchema::builder()
            .require("seq", Value::integer_in(0..=i64::MAX))
            .allow("source", Value::any().max_len(32))
            .require_type_naming()
            .build()
            .unwrap(),
    )
}

/// The receiver's handler when it is layered: counts, like the bare loop.
#[derive(Clone, Copy)]
struct Swallow;

impl Service<Message> for Swallow {
    type Response = Option<Message>;
    type Error = BoxError;
    type Future = Ready<Result<Option<Message>, BoxError>>;

    fn poll_ready(&mut self, _cx: &mut TaskContext<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, msg: Message) -> Self::Future {
        black_box(&msg);
        ready(Ok(None))
    }
}

/// Counts messages until the end marker, then reports the count.
async fn bare_receiver(mut rx: Receiver, acks: mpsc::UnboundedSender<u64>) {
    let mut n = 0;
    while let Some(msg) = rx.recv().await {
        let msg = msg.unwrap();
        if msg.kind() == END {
            acks.send(n).unwrap();
            n = 0;
        } else {
            black_box(&msg);
            n += 1;
        }
    }
}

async fn layered_receiver(mut rx: Receiver, acks: mpsc::UnboundedSender<u64>) {
    let mut handler = ServiceBuilder::new()
        .layer(filter())
        .layer(schema())
        .service(Swallow);
    let mut n = 0;
    while let Some(msg) = rx.recv().await {
        let msg = msg.unwrap();
        if msg.kind() == END {
            acks.send(n).unwrap();
            n = 0;
        } else {
            handler.ready().await.unwrap().call(msg).await.unwrap();
            n += 1;
        }
    }
}

async fn channel(layered_rx: bool) -> (Context, Sender, mpsc::UnboundedReceiver<u64>) {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let url = format!(
        "inproc://bench-{}",
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let ctx = Context::new();
    let mut l = ctx.bind(&url).await.unwrap();
    let (c, s) = tokio::join!(ctx.connect(&url), l.accept());
    let (tx, _) = c.unwrap().split();
    let (_, rx) = s.unwrap().split();
    let (ack_tx, ack_rx) = mpsc::unbounded_channel();
    if layered_rx {
        tokio::spawn(layered_receiver(rx, ack_tx));
    } else {
        tokio::spawn(bare_receiver(rx, ack_tx));
    }
    (ctx, tx, ack_rx)
}

async fn through_service<S>(
    svc: &mut S,
    acks: &mut mpsc::UnboundedReceiver<u64>,
    n: u64,
) -> Duration
where
    S: Service<Message, Response = ()>,
    S::Error: std::fmt::Debug,
{
    let msg = message();
    let start = Instant::now();
    for _ in 0..n {
        svc.ready().await.unwrap().call(msg.clone()).await.unwrap();
    }
    svc.ready().await.unwrap().call(end()).await.unwrap();
    assert_eq!(acks.recv().await, Some(n));
    start.elapsed()
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group(GROUP);
    g.throughput(Throughput::Elements(1))
        .sample_size(20)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));

    {
        let (_ctx, mut tx, mut acks) = rt.block_on(channel(false));
        let msg = message();
        g.bench_function("bare_channel", |b| {
            b.iter_custom(|n| {
                let d = rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..n {
                        tx.send(msg.clone()).await.unwrap();
                    }
                    tx.send(end()).await.unwrap();
                    assert_eq!(acks.recv().await, Some(n));
                    start.elapsed()
                });
                record("bare_channel", d, n);
                d
            })
        });
    }
    {
        let (_ctx, mut tx, mut acks) = rt.block_on(channel(false));
        g.bench_function("sender_service", |b| {
            b.iter_custom(|n| {
                let d = rt.block_on(through_service(&mut tx, &mut acks, n));
                record("sender_service", d, n);
                d
            })
        });
    }
    {
        let (_ctx, tx, mut acks) = rt.block_on(channel(false));
        let mut svc = ServiceBuilder::new()
            .layer(filter())
            .layer(schema())
            .service(tx);
        g.bench_function("layers_send", |b| {
            b.iter_custom(|n| {
                let d = rt.block_on(through_service(&mut svc, &mut acks, n));
                record("layers_send", d, n);
                d
            })
        });
    }
    {
        let (_ctx, tx, mut acks) = rt.block_on(channel(true));
        let mut svc = ServiceBuilder::new()
            .layer(filter())
            .layer(schema())
            .service(tx);
        g.bench_function("layers_both", |b| {
            b.iter_custom(|n| {
                let d = rt.block_on(through_service(&mut svc, &mut acks, n));
                record("layers_both", d, n);
                d
            })
        });
    }
    g.finish();
    c.final_summary();

    let t = TOTALS.lock().unwrap();
    let ns = |(s, n): &(f64, u64)| s / *n as f64 * 1e9;
    let base = t.get("bare_channel").map(ns).unwrap_or(f64::NAN);
    println!("\nsummary (same run; ratio = time per message / bare channel's, goal <= 1.10)");
    for (f, v) in t.iter() {
        println!(
            "  {GROUP} {f:<16} {:>8.1} ns/msg  ratio {:.3}",
            ns(v),
            ns(v) / base
        );
    }
}
