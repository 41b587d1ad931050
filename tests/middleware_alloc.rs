//! The happy path of the type filter and the metadata schema allocates nothing per message:
//! a counting global allocator (its own test binary, so nothing else shares it) around
//! `poll_ready` + `call` + the response future, for messages that pass both layers, with
//! each layer alone and the two stacked, and for the router. The messages are built (and
//! their bodies made shared) before counting starts: what is counted is the middleware.

#![cfg(feature = "tower")]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::future::{Future, Ready, ready};
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use hyperframes::Message;
use hyperframes::middleware::{
    BoxError, MetaSchema, MetaSchemaLayer, Router, TypeFilterLayer, Value,
};
use tower::{Layer, Service};

struct Counting;

thread_local! {
    /// Allocations (and reallocations) made by this thread.
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn note() {
    let _ = ALLOCATIONS.try_with(|a| a.set(a.get() + 1));
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the
// counting touches only a `const`-initialised thread-local `Cell` (no allocation, no
// destructor), through `try_with`, so it is a no-op while a thread is torn down.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: forwarded contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: forwarded contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` (through us) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: forwarded contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

/// The inner service: takes the message and answers at once, allocating nothing.
#[derive(Clone, Copy)]
struct Take;

impl Service<Message> for Take {
    type Response = ();
    type Error = BoxError;
    type Future = Ready<Result<(), BoxError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, msg: Message) -> Self::Future {
        drop(msg);
        ready(Ok(()))
    }
}

fn filter() -> TypeFilterLayer {
    TypeFilterLayer::new(["video.frame", "ml.splitter.*", "bench.data.*"]).unwrap()
}

fn schema() -> MetaSchemaLayer {
    MetaSchemaLayer::new(
        MetaSchema::builder()
            .require("seq", Value::integer_in(0..=i64::MAX))
            .allow("source", Value::any().max_len(32))
            .allow("codec", Value::one_of(["h264", "av1"]))
            .require_type_naming()
            .build()
            .unwrap(),
    )
}

/// Messages of a few types (inline and long names) and values, all passing.
fn messages(n: usize) -> Vec<Message> {
    let kinds = [
        "bench.data.chunk",
        "ml.splitter.output",
        "ml.splitter.a_type_name_longer_than_inline",
    ];
    (0..n)
        .map(|i| {
            let m = Message::new(kinds[i % kinds.len()])
                .unwrap()
                .with_meta("seq", i.to_string())
                .unwrap()
                .with_meta("source", "cam0")
                .unwrap();
            let m = if i % 2 == 0 {
                m.with_meta("codec", "av1").unwrap()
            } else {
                m
            };
            let m = m.with_body(vec![0x5au8; 64]);
            drop(m.clone()); // a body made from a Vec allocates when first shared
            m
        })
        .collect()
}

/// Allocations made by ready + call + poll for each message, after one warm-up pass that
/// lets each service remember the types it saw.
fn allocations_per_message<S>(mut svc: S) -> u64
where
    S: Service<Message, Response = ()>,
    S::Error: std::fmt::Debug,
{
    let mut cx = Context::from_waker(Waker::noop());
    let mut run = |batch: Vec<Message>| {
        for msg in batch {
            assert!(svc.poll_ready(&mut cx).is_ready());
            let fut = pin!(svc.call(msg));
            match fut.poll(&mut cx) {
                Poll::Ready(r) => r.expect("the message passes"),
                Poll::Pending => panic!("answered at once"),
            }
        }
    };
    run(messages(16));
    let batch = messages(1000);
    let before = allocations();
    run(batch);
    allocations() - before
}

#[test]
fn type_filter_and_meta_schema_do_not_allocate_per_message() {
    assert_eq!(
        allocations_per_message(filter().layer(Take)),
        0,
        "type filter"
    );
    assert_eq!(allocations_per_message(schema().layer(Take)), 0, "schema");
    assert_eq!(
        allocations_per_message(filter().layer(schema().layer(Take))),
        0,
        "filter + schema"
    );
}

#[test]
fn the_counter_sees_an_allocation() {
    // The test above could not fail if the allocator counted nothing.
    let before = allocations();
    let v = std::hint::black_box(vec![1u8; 10]);
    assert!(allocations() > before);
    drop(v);
}

#[test]
fn a_router_allocates_only_its_boxed_future() {
    // Routes are boxed services: one allocation per call for the boxed future, none for
    // choosing the route.
    let router = Router::<()>::new()
        .route("ml.**", Take)
        .unwrap()
        .route("bench.data.*", Take)
        .unwrap();
    let n = allocations_per_message(router);
    assert_eq!(n, 1000, "allocations for 1000 messages");
}

#[test]
fn a_served_request_and_its_reply_allocate_nothing_per_request() {
    // `Client` and `serve_channel` over inproc, all on this thread: after a warm-up, a
    // request and its reply cost no allocation on either end (the messages are built
    // before counting).
    use hyperframes::Context as Hf;
    use hyperframes::middleware::{Client, serve_channel};
    use tower::{ServiceExt, service_fn};

    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let n = rt.block_on(async {
        let ctx = Hf::new();
        let mut listener = ctx.bind("inproc://alloc-round-trip").await.unwrap();
        let (client, server) =
            tokio::join!(ctx.connect("inproc://alloc-round-trip"), listener.accept());
        let ack = messages(1).pop().unwrap();
        let handler = service_fn(move |req: Message| {
            drop(req);
            ready(Ok::<_, BoxError>(Some(ack.clone())))
        });
        tokio::spawn(serve_channel(server.unwrap(), handler));
        let mut client = Client::new(client.unwrap());
        let mut round_trips = async |batch: Vec<Message>| {
            for msg in batch {
                client.ready().await.unwrap().call(msg).await.unwrap();
            }
        };
        round_trips(messages(64)).await;
        let batch = messages(1000);
        let before = allocations();
        round_trips(batch).await;
        allocations() - before
    });
    assert_eq!(n, 0, "allocations for 1000 round trips");
}
