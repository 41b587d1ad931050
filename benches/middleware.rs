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
//!
//! A second group, `middleware_alone`, runs the layers around a service that takes the
//! message and answers at once (no channel): `noop` alone, then `type_filter`, `meta_schema`
//! and both, so the summary shows each layer's own cost in nanoseconds.
//!
//! A third group, `request_reply_inproc_64B`, is one request and its reply at a time, the
//! round trip a `Client` pays against a server:
//!
//! * `by_hand` — a bare channel each way: the client sends a request with a correlation id
//!   and waits on its receiver; the server's loop receives and sends the reply;
//! * `serve_client` — a [`Client`](hyperframes::middleware::Client) calling a handler run by
//!   [`serve_channel`](hyperframes::middleware::serve_channel) (goal: at most 1.20).

use std::collections::BTreeMap;
use std::future::{Ready, ready};
use std::hint::black_box;
use std::sync::Mutex;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use hyperframes::middleware::{
    BoxError, Client, MetaSchema, MetaSchemaLayer, TypeFilterLayer, Value, serve_channel,
};
use hyperframes::{Context, Flags, Header, Message, Receiver, Sender};
use tokio::sync::mpsc;
use tower::{Layer, Service, ServiceBuilder, ServiceExt, service_fn};

const GROUP: &str = "middleware_inproc_64B";
const ALONE: &str = "middleware_alone";
const ROUND_TRIP: &str = "request_reply_inproc_64B";
const END: &str = "bench.data.end";

/// Seconds and items per (group, case), summed over criterion's samples.
type Totals = BTreeMap<(&'static str, String), (f64, u64)>;

static TOTALS: Mutex<Totals> = Mutex::new(BTreeMap::new());

fn record(group: &'static str, func: &str, elapsed: Duration, items: u64) {
    let mut t = TOTALS.lock().unwrap();
    let e = t.entry((group, func.into())).or_insert((0.0, 0));
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

/// Takes a message and answers at once: the inner service of the `middleware_alone` group.
#[derive(Clone, Copy)]
struct Take;

impl Service<Message> for Take {
    type Response = ();
    type Error = BoxError;
    type Future = Ready<Result<(), BoxError>>;

    fn poll_ready(&mut self, _cx: &mut TaskContext<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, msg: Message) -> Self::Future {
        black_box(&msg);
        ready(Ok(()))
    }
}

/// `n` messages through `svc`, each a clone of one (as the channel cases send).
async fn alone<S>(svc: &mut S, n: u64) -> Duration
where
    S: Service<Message, Response = ()>,
    S::Error: std::fmt::Debug,
{
    let msg = message();
    let start = Instant::now();
    for _ in 0..n {
        svc.ready().await.unwrap().call(msg.clone()).await.unwrap();
    }
    start.elapsed()
}

fn reply() -> Message {
    Message::new("bench.data.ack")
        .unwrap()
        .with_body(vec![0xa5u8; 64])
}

/// A connected inproc channel pair: (client's end, server's end).
async fn pair(ctx: &Context) -> (hyperframes::Channel, hyperframes::Channel) {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let url = format!(
        "inproc://bench-{}",
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let mut l = ctx.bind(&url).await.unwrap();
    let (c, s) = tokio::join!(ctx.connect(&url), l.accept());
    (c.unwrap(), s.unwrap())
}

/// The server by hand: every request answered with the reply, correlated.
async fn server_by_hand(channel: hyperframes::Channel) {
    let (mut tx, mut rx) = channel.split();
    let ack = reply();
    while let Some(Ok(req)) = rx.recv().await {
        let h = req.header();
        let answer = ack.clone().with_header(Header {
            flags: Flags::RESPONSE,
            correlation: h.correlation,
        });
        if tx.send(answer).await.is_err() {
            break;
        }
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
    let ctx = Context::new();
    let (c, s) = pair(&ctx).await;
    let (tx, _) = c.split();
    let (_, rx) = s.split();
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
    let start = Instant::now();
    alone(svc, n).await;
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
                record(GROUP, "bare_channel", d, n);
                d
            })
        });
    }
    {
        let (_ctx, mut tx, mut acks) = rt.block_on(channel(false));
        g.bench_function("sender_service", |b| {
            b.iter_custom(|n| {
                let d = rt.block_on(through_service(&mut tx, &mut acks, n));
                record(GROUP, "sender_service", d, n);
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
                record(GROUP, "layers_send", d, n);
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
                record(GROUP, "layers_both", d, n);
                d
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group(ALONE);
    g.throughput(Throughput::Elements(1))
        .sample_size(20)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_secs(1));
    let mut noop = Take;
    let mut type_filter = filter().layer(Take);
    let mut meta_schema = schema().layer(Take);
    let mut both = ServiceBuilder::new()
        .layer(filter())
        .layer(schema())
        .service(Take);
    let cases: [(&str, &mut dyn FnMut(u64) -> Duration); 4] = [
        ("noop", &mut |n| rt.block_on(alone(&mut noop, n))),
        ("type_filter", &mut |n| {
            rt.block_on(alone(&mut type_filter, n))
        }),
        ("meta_schema", &mut |n| {
            rt.block_on(alone(&mut meta_schema, n))
        }),
        ("both", &mut |n| rt.block_on(alone(&mut both, n))),
    ];
    for (name, svc) in cases {
        g.bench_function(name, |b| {
            b.iter_custom(|n| {
                let d = svc(n);
                record(ALONE, name, d, n);
                d
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group(ROUND_TRIP);
    g.throughput(Throughput::Elements(1))
        .sample_size(20)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    {
        let ctx = Context::new();
        let (client, server) = rt.block_on(pair(&ctx));
        rt.spawn(server_by_hand(server));
        let (mut tx, mut rx) = client.split();
        let msg = message();
        let mut id = 0u64;
        g.bench_function("by_hand", |b| {
            b.iter_custom(|n| {
                let d = rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..n {
                        id += 1;
                        let req = msg.clone().with_header(Header {
                            flags: Flags::REQUEST,
                            correlation: id,
                        });
                        tx.send(req).await.unwrap();
                        let answer = rx.recv().await.unwrap().unwrap();
                        assert_eq!(answer.header().correlation, id);
                        black_box(answer);
                    }
                    start.elapsed()
                });
                record(ROUND_TRIP, "by_hand", d, n);
                d
            })
        });
    }
    {
        let ctx = Context::new();
        let (client, server) = rt.block_on(pair(&ctx));
        let ack = reply();
        let handler = service_fn(move |req: Message| {
            black_box(&req);
            ready(Ok::<_, BoxError>(Some(ack.clone())))
        });
        rt.spawn(serve_channel(server, handler));
        let mut client = rt.block_on(async { Client::new(client) });
        let msg = message();
        g.bench_function("serve_client", |b| {
            b.iter_custom(|n| {
                let d = rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..n {
                        let answer = client.ready().await.unwrap().call(msg.clone()).await;
                        black_box(answer.unwrap());
                    }
                    start.elapsed()
                });
                record(ROUND_TRIP, "serve_client", d, n);
                d
            })
        });
    }
    g.finish();
    c.final_summary();

    let t = TOTALS.lock().unwrap();
    let ns = |(s, n): &(f64, u64)| s / *n as f64 * 1e9;
    let of = |group, case: &str| t.get(&(group, case.into())).map(ns).unwrap_or(f64::NAN);
    println!(
        "\nsummary (same run; ratio = time per message / the group's baseline; goals: layers_send \
         <= 1.10, layers_both <= 1.20, serve_client <= 1.20)"
    );
    for ((group, case), v) in t.iter() {
        let base = match *group {
            GROUP => of(GROUP, "bare_channel"),
            ALONE => of(ALONE, "noop"),
            _ => of(ROUND_TRIP, "by_hand"),
        };
        let extra = if *group == ALONE {
            format!("  +{:.1} ns", ns(v) - base)
        } else {
            String::new()
        };
        println!(
            "  {group:<24} {case:<16} {:>8.1} ns/msg  ratio {:.3}{extra}",
            ns(v),
            ns(v) / base
        );
    }
}
