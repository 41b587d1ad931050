//! The cost of the tower middleware on small messages: 64 B messages over `inproc://`
//! through a `TypeFilterLayer` + `MetaSchemaLayer` stack, against the bare channel in the
//! same group and run. Run with `cargo bench --bench middleware` (criterion's report, then the
//! summary) or `cargo bench --bench middleware -- --summary` (the summary alone).
//!
//! The summary runs every case in turn, 200,000 messages each, for `HF_BENCH_ROUNDS` rounds
//! (15): each round's ratio is to its group's baseline measured in that round, so a drift of
//! the machine's speed during the run falls on all cases alike (measured one after the
//! other, as criterion does, ratios on a 2-vCPU VM moved by ±20 % between runs). It prints
//! the median ratio and its range. Goals: `layers_send` ≤ 1.10, `layers_both` ≤ 1.20,
//! `serve_client` ≤ 1.20.
//!
//! Every case moves the same messages (type `bench.data.chunk`, two metadata entries, a 64 B
//! body) from a sender to a receiver task on one current-thread runtime; the clock stops
//! when the receiver has counted all N. The cases:
//!
//! * `bare_channel` — `Sender::send` / `Receiver::recv`;
//! * `sender_service` — the `Sender` as a `tower::Service` (`ready` + `call`), no layers;
//! * `layers_send` — `TypeFilterLayer` (three patterns) + `MetaSchemaLayer` (two keys with
//!   value rules, type naming) around the `Sender`;
//! * `services_both` — the `Sender` as a service, and the receiver handing each message to
//!   its handler (`ready` + `call`), no layers;
//! * `layers_both` — the same stack around the sender and around the receiver's handler.
//!
//! The goals are ratios to `bare_channel`, whose receiver only counts. The summary also
//! prints each stack's ratio to the same services without layers (`layers_send` to
//! `sender_service`, `layers_both` to `services_both`): the layers' own share, apart from
//! what handing each received message to a handler costs at all.
//!
//! Two floors, the same two-layer stacks with layers that check nothing, so that the stack's
//! cost splits into what any two layers cost and what the filter's and the schema's work adds:
//!
//! * `pass_send`, `pass_both` — two layers whose `call` hands the message to the inner
//!   service and returns its future as it is (the cost of tower's layering alone);
//! * `wrap_send`, `wrap_both` — two layers that do what every layer with a refusal must: test
//!   a flag (always false here) and wrap the inner future in their own (the inner future with
//!   its error boxed, or a refusal), the shape of `MetaSchema`'s response future.
//!
//! The floor layers are inlined as the library's are (`#[inline(always)]` on `call` and on
//! the response future's `poll`): left to the compiler, their `call` and `poll` stayed
//! functions of their own, and the message and the future were copied through each, which
//! put the both-sides floor at 1.33-1.37 where inlined it is 1.18-1.24.
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
//! * `serve_only` — the client by hand against a handler run by
//!   [`serve_channel`](hyperframes::middleware::serve_channel): the server's share;
//! * `client_only` — a [`Client`](hyperframes::middleware::Client) against the server by
//!   hand: the client's share;
//! * `serve_client` — a `Client` calling a handler run by `serve_channel` (goal: at most
//!   1.20);
//! * `tower_buffer` — for scale, tower's own request/response between two tasks in memory:
//!   the same handler behind `tower::buffer::Buffer` (a channel to its worker task, a
//!   oneshot back), no hyperframes channel at all.

use std::future::{Future, Ready, ready};
use std::hint::black_box;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use hyperframes::middleware::{
    BoxError, Client, MetaSchema, MetaSchemaLayer, TypeFilterLayer, Value, serve_channel,
};
use hyperframes::{Context, Flags, Header, Message, Receiver, Sender};
use pin_project_lite::pin_project;
use tokio::sync::mpsc;
use tower::layer::util::{Identity, Stack};
use tower::{Layer, Service, ServiceBuilder, ServiceExt, service_fn};

const GROUP: &str = "middleware_inproc_64B";
const ALONE: &str = "middleware_alone";
const ROUND_TRIP: &str = "request_reply_inproc_64B";
const END: &str = "bench.data.end";

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

/// A layer that checks nothing (`pass_*`, `wrap_*`): `W` says how its service answers.
struct Floor<W>(PhantomData<W>);

impl<W> Floor<W> {
    fn new() -> Self {
        Floor(PhantomData)
    }
}

impl<S, W> Layer<S> for Floor<W> {
    type Service = FloorService<S, W>;
    fn layer(&self, inner: S) -> Self::Service {
        FloorService {
            inner,
            refuse: false,
            answer: PhantomData,
        }
    }
}

struct FloorService<S, W> {
    inner: S,
    /// Always false; read at every call, as a filter reads its decision.
    refuse: bool,
    answer: PhantomData<W>,
}

/// Hands the message on and returns the inner service's future as it is.
struct Pass;
/// Wraps the inner service's future, as a layer that may refuse must.
struct Wrap;

impl<S: Service<Message>> Service<Message> for FloorService<S, Pass> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    #[inline]
    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    #[inline(always)]
    fn call(&mut self, msg: Message) -> S::Future {
        self.inner.call(msg)
    }
}

impl<S> Service<Message> for FloorService<S, Wrap>
where
    S: Service<Message>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Wrapped<S::Future>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    #[inline(always)]
    fn call(&mut self, msg: Message) -> Self::Future {
        if self.refuse {
            return Wrapped::Refused {
                error: Some("refused".into()),
            };
        }
        Wrapped::Inner {
            future: self.inner.call(msg),
        }
    }
}

pin_project! {
    /// The response future of a [`Wrap`] floor layer: the inner one, or a refusal.
    #[project = WrappedProj]
    enum Wrapped<F> {
        Inner { #[pin] future: F },
        Refused { error: Option<BoxError> },
    }
}

impl<F, T, E> Future for Wrapped<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    #[inline(always)]
    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        match self.project() {
            WrappedProj::Inner { future } => future.poll(cx).map_err(Into::into),
            WrappedProj::Refused { error } => {
                Poll::Ready(Err(error.take().expect("polled after completion")))
            }
        }
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

/// The served handler: answers every request with the reply.
fn acknowledge() -> impl Service<
    Message,
    Response = Option<Message>,
    Error = BoxError,
    Future = Ready<Result<Option<Message>, BoxError>>,
> {
    let ack = reply();
    service_fn(move |req: Message| {
        black_box(&req);
        ready(Ok(Some(ack.clone())))
    })
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

/// Hands every message but the end marker to `handler` (ready, call, await), counting them.
async fn handing_receiver<H>(mut rx: Receiver, acks: mpsc::UnboundedSender<u64>, mut handler: H)
where
    H: Service<Message, Response = Option<Message>, Error = BoxError>,
{
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

/// What the receiving end of a channel case does with each message.
#[derive(Clone, Copy)]
enum Rx {
    /// Counts it (`bare_receiver`).
    Bare,
    /// Hands it to the handler, no layers.
    Handler,
    /// Hands it to the handler through the stack.
    Layered,
    /// Hands it to the handler through two [`Pass`] floor layers.
    Passed,
    /// Hands it to the handler through two [`Wrap`] floor layers.
    Wrapped,
}

async fn channel(rx_kind: Rx) -> (Context, Sender, mpsc::UnboundedReceiver<u64>) {
    let ctx = Context::new();
    let (c, s) = pair(&ctx).await;
    let (tx, _) = c.split();
    let (_, rx) = s.split();
    let (ack_tx, ack_rx) = mpsc::unbounded_channel();
    match rx_kind {
        Rx::Bare => tokio::spawn(bare_receiver(rx, ack_tx)),
        Rx::Handler => tokio::spawn(handing_receiver(rx, ack_tx, Swallow)),
        Rx::Layered => tokio::spawn(handing_receiver(rx, ack_tx, guard().service(Swallow))),
        Rx::Passed => tokio::spawn(handing_receiver(rx, ack_tx, floors::<Pass, _>(Swallow))),
        Rx::Wrapped => tokio::spawn(handing_receiver(rx, ack_tx, floors::<Wrap, _>(Swallow))),
    };
    (ctx, tx, ack_rx)
}

/// The stack the goals are about: the filter outside, the schema inside.
fn guard() -> ServiceBuilder<Stack<MetaSchemaLayer, Stack<TypeFilterLayer, Identity>>> {
    ServiceBuilder::new().layer(filter()).layer(schema())
}

/// Two floor layers of kind `W` around `svc`, as the stack has two layers.
fn floors<W, S>(svc: S) -> FloorService<FloorService<S, W>, W> {
    ServiceBuilder::new()
        .layer(Floor::<W>::new())
        .layer(Floor::<W>::new())
        .service(svc)
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

/// A case: runs `n` messages (or round trips) and says how long they took.
type Case<'a> = Box<dyn FnMut(u64) -> Duration + 'a>;

/// A round-trip case: `n` requests through `svc` (ready, call, await the reply), one at a
/// time; `keep` lives as long as the case (the context of its channel).
fn calls_case<'a, S, K>(rt: &'a tokio::runtime::Runtime, mut svc: S, keep: K) -> Case<'a>
where
    S: Service<Message> + 'a,
    S::Error: std::fmt::Debug,
    K: 'a,
{
    let msg = message();
    Box::new(move |n| {
        let _keep = &keep;
        rt.block_on(async {
            let start = Instant::now();
            for _ in 0..n {
                let answer = svc.ready().await.unwrap().call(msg.clone()).await;
                black_box(answer.unwrap());
            }
            start.elapsed()
        })
    })
}

/// A `middleware_alone` case: `svc` alone on this thread.
fn alone_case<'a, S>(rt: &'a tokio::runtime::Runtime, mut svc: S) -> Case<'a>
where
    S: Service<Message, Response = ()> + 'a,
    S::Error: std::fmt::Debug,
{
    Box::new(move |n| rt.block_on(alone(&mut svc, n)))
}

/// A channel case: messages through `stack` around the `Sender`, to a receiver of `rx_kind`.
fn channel_case<S>(
    rt: &tokio::runtime::Runtime,
    rx_kind: Rx,
    stack: impl FnOnce(Sender) -> S,
) -> Case<'_>
where
    S: Service<Message, Response = ()> + 'static,
    S::Error: std::fmt::Debug,
{
    let (ctx, tx, mut acks) = rt.block_on(channel(rx_kind));
    let mut svc = stack(tx);
    Box::new(move |n| {
        let _keep = &ctx;
        rt.block_on(through_service(&mut svc, &mut acks, n))
    })
}

/// Messages per case and round in the summary: 10 to 300 ms each.
const ROUND_ITEMS: u64 = 200_000;

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let rt = &rt;
    let mut cases: Vec<(&'static str, &'static str, Case<'_>)> = Vec::new();

    {
        let (ctx, mut tx, mut acks) = rt.block_on(channel(Rx::Bare));
        let msg = message();
        cases.push((
            GROUP,
            "bare_channel",
            Box::new(move |n| {
                let _keep = &ctx;
                rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..n {
                        tx.send(msg.clone()).await.unwrap();
                    }
                    tx.send(end()).await.unwrap();
                    assert_eq!(acks.recv().await, Some(n));
                    start.elapsed()
                })
            }),
        ));
    }
    let stack = |tx: Sender| guard().service(tx);
    for (name, case) in [
        ("sender_service", channel_case(rt, Rx::Bare, |tx| tx)),
        ("services_both", channel_case(rt, Rx::Handler, |tx| tx)),
        ("layers_send", channel_case(rt, Rx::Bare, stack)),
        ("layers_both", channel_case(rt, Rx::Layered, stack)),
        // The floors: the same cases with layers that check nothing.
        ("pass_send", channel_case(rt, Rx::Bare, floors::<Pass, _>)),
        ("pass_both", channel_case(rt, Rx::Passed, floors::<Pass, _>)),
        ("wrap_send", channel_case(rt, Rx::Bare, floors::<Wrap, _>)),
        (
            "wrap_both",
            channel_case(rt, Rx::Wrapped, floors::<Wrap, _>),
        ),
    ] {
        cases.push((GROUP, name, case));
    }

    let stack = guard().service(Take);
    for (name, case) in [
        ("noop", alone_case(rt, Take)),
        ("type_filter", alone_case(rt, filter().layer(Take))),
        ("meta_schema", alone_case(rt, schema().layer(Take))),
        ("both", alone_case(rt, stack)),
    ] {
        cases.push((ALONE, name, case));
    }

    // The client by hand, against the server by hand and against `serve_channel`.
    for (name, served) in [("by_hand", false), ("serve_only", true)] {
        let ctx = Context::new();
        let (client, server) = rt.block_on(pair(&ctx));
        if served {
            rt.spawn(serve_channel(server, acknowledge()));
        } else {
            rt.spawn(server_by_hand(server));
        }
        let (mut tx, mut rx) = client.split();
        let msg = message();
        let mut id = 0u64;
        cases.push((
            ROUND_TRIP,
            name,
            Box::new(move |n| {
                let _keep = &ctx;
                rt.block_on(async {
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
                })
            }),
        ));
    }
    {
        // tower's own in-memory request/response across tasks, for scale: `Buffer` sends each
        // request to a worker task over a channel and the response back over a oneshot.
        let ack = reply();
        let handler = service_fn(move |req: Message| {
            black_box(&req);
            ready(Ok::<_, BoxError>(ack.clone()))
        });
        let svc = rt.block_on(async { tower::buffer::Buffer::new(handler, 1024) });
        cases.push((ROUND_TRIP, "tower_buffer", calls_case(rt, svc, ())));
    }
    for (name, by_hand_server) in [("client_only", true), ("serve_client", false)] {
        let ctx = Context::new();
        let (client, server) = rt.block_on(pair(&ctx));
        if by_hand_server {
            rt.spawn(server_by_hand(server));
        } else {
            rt.spawn(serve_channel(server, acknowledge()));
        }
        let client = rt.block_on(async { Client::new(client) });
        cases.push((ROUND_TRIP, name, calls_case(rt, client, ctx)));
    }

    // Criterion's own measurement and report, case by case (skipped with `--summary`).
    let args: Vec<String> = std::env::args().skip(1).collect();
    let summary_only = args.iter().any(|a| a == "--summary");
    let mut c = if summary_only {
        Criterion::default()
    } else {
        Criterion::default().configure_from_args()
    };
    for group in [GROUP, ALONE, ROUND_TRIP]
        .into_iter()
        .filter(|_| !summary_only)
    {
        let mut g = c.benchmark_group(group);
        g.throughput(Throughput::Elements(1))
            .sample_size(20)
            .measurement_time(Duration::from_secs(if group == ALONE { 2 } else { 3 }))
            .warm_up_time(Duration::from_secs(1));
        for (_, name, run) in cases.iter_mut().filter(|(g, ..)| *g == group) {
            g.bench_function(*name, |b| b.iter_custom(&mut **run));
        }
        g.finish();
    }
    c.final_summary();

    // The summary: every case in turn, round after round, so a drift in the machine's speed
    // (frequency, a neighbour) falls on all of them alike; each round's ratio is to its
    // group's baseline measured in the same round. Skipped when criterion was given a
    // filter (one case alone has no ratio) or with --list.
    if args.iter().any(|a| !a.starts_with('-')) || args.iter().any(|a| a == "--list") {
        return;
    }
    let rounds: usize = std::env::var("HF_BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(15);
    let mut per_case: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for _ in 0..rounds {
        for (i, (_, _, run)) in cases.iter_mut().enumerate() {
            per_case[i].push(run(ROUND_ITEMS).as_secs_f64() * 1e9 / ROUND_ITEMS as f64);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "\nsummary: {rounds} rounds of {ROUND_ITEMS} per case, the cases in turn; ns/msg and the \
         ratio to the group's baseline in the same round: median [min - max]. Goals: \
         layers_send <= 1.10, layers_both <= 1.20, serve_client <= 1.20"
    );
    for (i, (group, case, _)) in cases.iter().enumerate() {
        let base = match *group {
            GROUP => "bare_channel",
            ALONE => "noop",
            _ => "by_hand",
        };
        let b = cases
            .iter()
            .position(|(g, c, _)| g == group && *c == base)
            .expect("every group has its baseline");
        let ratios: Vec<f64> = per_case[i]
            .iter()
            .zip(&per_case[b])
            .map(|(x, y)| x / y)
            .collect();
        let (lo, hi) = ratios
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), r| (lo.min(*r), hi.max(*r)));
        // The layers' own share: each stack against the same services without layers.
        let without = match *case {
            "layers_send" | "pass_send" | "wrap_send" => Some("sender_service"),
            "layers_both" | "pass_both" | "wrap_both" => Some("services_both"),
            _ => None,
        };
        let extra = if *group == ALONE {
            let diffs = per_case[i]
                .iter()
                .zip(&per_case[b])
                .map(|(x, y)| x - y)
                .collect();
            format!("  +{:.1} ns", median(diffs))
        } else if let Some(w) = without {
            let w = cases
                .iter()
                .position(|(g, c, _)| g == group && *c == w)
                .expect("the case without layers");
            let ratios = per_case[i]
                .iter()
                .zip(&per_case[w])
                .map(|(x, y)| x / y)
                .collect();
            format!("  {:.3} to {}", median(ratios), cases[w].1)
        } else {
            String::new()
        };
        println!(
            "  {group:<24} {case:<16} {:>8.1} ns/msg  ratio {:.3} [{lo:.3} - {hi:.3}]{extra}",
            median(per_case[i].clone()),
            median(ratios),
        );
    }
}
