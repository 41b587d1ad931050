//! A request/response server built from tower layers, and a client with a timeout.
//!
//! ```sh
//! cargo run --release --example service          # over inproc://
//! cargo run --release --example service -- tcp   # over tcp://127.0.0.1
//! ```
//!
//! The server is `serve(listener, ...)` with, per channel: a `TypeFilterLayer` (only the
//! request types it knows), a `MetaSchemaLayer` (metadata keys and values, type naming) and a
//! `Router` of async handlers — one of which awaits `recv` on another channel (a ticker) to
//! answer. The client is a `Client` under tower's `buffer`, `timeout` and
//! `concurrency_limit`, with the same schema checked before anything leaves.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hyperframes::middleware::{
    BoxError, Client, MetaSchema, MetaSchemaLayer, Router, TypeFilterLayer, Value, serve,
};
use hyperframes::{Context, Message, Receiver};
use tokio::sync::Mutex;
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};

fn schema() -> hyperframes::Result<MetaSchema> {
    MetaSchema::builder()
        .allow("a", Value::integer_in(-1_000_000..=1_000_000))
        .allow("b", Value::integer_in(-1_000_000..=1_000_000))
        .allow("text", Value::any().max_len(64))
        .allow("sum", Value::integer())
        .allow("n", Value::integer())
        .allow("request-type", Value::any())
        .require_type_naming()
        .build()
}

fn int(m: &Message, key: &str) -> Result<i64, BoxError> {
    Ok(m.meta()
        .get(key)
        .ok_or_else(|| format!("missing {key}"))?
        .parse()?)
}

/// The server's handler: layers around a router of async services.
fn handler(
    ticks: Arc<Mutex<Receiver>>,
) -> Result<
    impl Service<Message, Response = Option<Message>, Error = BoxError, Future: Send>
    + Clone
    + Send
    + 'static,
    BoxError,
> {
    let add = service_fn(|req: Message| async move {
        let sum = int(&req, "a")? + int(&req, "b")?;
        Ok::<_, BoxError>(Some(
            Message::new("calc.add.reply")?.with_meta("sum", sum.to_string())?,
        ))
    });
    let echo = service_fn(|req: Message| async move {
        let text = req.meta().get("text").unwrap_or_default().to_owned();
        Ok::<_, BoxError>(Some(
            Message::new("echo.text.reply")?.with_meta("text", &text)?,
        ))
    });
    // Awaits `recv` on another channel: the next tick of the ticker is the answer.
    let next_tick = service_fn(move |_req: Message| {
        let ticks = ticks.clone();
        async move {
            let tick = ticks
                .lock()
                .await
                .recv()
                .await
                .ok_or("the ticker has stopped")??;
            Ok::<_, BoxError>(Some(tick))
        }
    });
    let slow = service_fn(|_req: Message| async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok::<_, BoxError>(Some(Message::new("slow.op.reply")?))
    });
    let router = Router::new()
        .route("calc.add.request", add)?
        .route("echo.*.request", echo)?
        .route("feed.next.request", next_tick)?
        .route("slow.op.request", slow)?;
    Ok(ServiceBuilder::new()
        .layer(
            TypeFilterLayer::new([
                "calc.*.request",
                "echo.*.request",
                "feed.*.request",
                "slow.*.request",
            ])?
            .named("example-server"),
        )
        .layer(MetaSchemaLayer::new(schema()?))
        .service(router))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let transport = std::env::args().nth(1).unwrap_or_else(|| "inproc".into());
    let url = match transport.as_str() {
        "inproc" => "inproc://service-example",
        "tcp" => "tcp://127.0.0.1:0",
        other => return Err(format!("unknown transport {other:?}: use inproc or tcp").into()),
    };
    let started = Instant::now();
    let ctx = Context::new();

    // A ticker: a channel whose other end the `feed.next.request` handler reads from.
    let mut ticker_listener = ctx.bind("inproc://ticker").await?;
    let (mut ticker_tx, _) = ctx.connect("inproc://ticker").await?.split();
    let (_, ticks) = ticker_listener.accept().await?.split();
    tokio::spawn(async move {
        for n in 0.. {
            let tick = Message::new("feed.tick.event")?.with_meta("n", n.to_string())?;
            if ticker_tx.send(tick).await.is_err() {
                break; // the server is gone
            }
        }
        Ok::<_, hyperframes::Error>(())
    });

    let listener = ctx.bind(url).await?;
    let url = listener.local_url().to_owned();
    let server = serve(
        listener,
        tower::make::Shared::new(handler(Arc::new(Mutex::new(ticks)))?),
    )
    .max_in_flight(32);
    let (stop, stats) = (server.shutdown_handle(), server.stats());
    let server = tokio::spawn(server.into_future());
    println!("server listening on {url}");

    let client = Client::new(ctx.connect(&url).await?);
    let client_stats = client.stats();
    let svc = ServiceBuilder::new()
        .buffer(64)
        .timeout(Duration::from_millis(200))
        .concurrency_limit(8)
        .service(client);
    // The client checks the schema too, before anything leaves.
    let mut svc = ServiceBuilder::new()
        .layer(MetaSchemaLayer::new(schema()?))
        .service(svc);

    let req = |kind: &str, meta: &[(&str, &str)]| -> hyperframes::Result<Message> {
        let mut m = Message::new(kind)?;
        *m.meta_mut() = hyperframes::Meta::try_from(meta)?;
        Ok(m)
    };

    let r = svc
        .ready()
        .await?
        .call(req("calc.add.request", &[("a", "2"), ("b", "40")])?)
        .await?;
    println!(
        "calc.add.request a=2 b=40      -> {} sum={}",
        r.kind(),
        int(&r, "sum")?
    );
    assert_eq!(int(&r, "sum")?, 42);

    // Many in flight at once: the buffer makes the client shareable.
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..20i64 {
        let mut svc = svc.clone();
        let msg = req("calc.add.request", &[("a", &i.to_string()), ("b", "1")])?;
        calls.spawn(async move {
            let r = svc.ready().await?.call(msg).await?;
            Ok::<_, BoxError>((i, int(&r, "sum")?))
        });
    }
    let mut pairs = Vec::new();
    while let Some(done) = calls.join_next().await {
        pairs.push(done??);
    }
    assert!(pairs.iter().all(|(i, sum)| *sum == i + 1));
    println!("20 concurrent calc.add.request -> 20 replies, each matched to its request");

    for _ in 0..3 {
        let r = svc
            .ready()
            .await?
            .call(req("feed.next.request", &[])?)
            .await?;
        println!(
            "feed.next.request              -> {} n={} (awaited on the ticker channel)",
            r.kind(),
            int(&r, "n")?
        );
    }

    let r = svc
        .ready()
        .await?
        .call(req("echo.text.request", &[("text", "hello")])?)
        .await?;
    println!(
        "echo.text.request text=hello   -> {} text={}",
        r.kind(),
        r.meta().get("text").unwrap_or("?")
    );

    let err = svc
        .ready()
        .await?
        .call(req("calc.add.request", &[("a", "forty"), ("b", "2")])?)
        .await
        .unwrap_err();
    println!("calc.add.request a=forty       -> refused by the client's schema: {err}");

    // Bypass the client-side schema to show the server's answer to a bad request.
    let err = svc
        .get_mut()
        .ready()
        .await?
        .call(req("calc.add.request", &[("a", "1"), ("c", "2")])?)
        .await
        .unwrap_err();
    println!("calc.add.request c=2 (raw)     -> refused by the server: {err}");

    let err = svc
        .get_mut()
        .ready()
        .await?
        .call(req("video.frame.raw", &[])?)
        .await
        .unwrap_err();
    println!("video.frame.raw (raw)          -> refused by the server: {err}");

    let t = Instant::now();
    let err = svc
        .ready()
        .await?
        .call(req("slow.op.request", &[])?)
        .await
        .unwrap_err();
    assert!(err.is::<tower::timeout::error::Elapsed>());
    println!(
        "slow.op.request                -> {err} after {} ms",
        t.elapsed().as_millis()
    );
    while client_stats.in_flight() > 0 {
        tokio::task::yield_now().await;
    }
    println!(
        "the timed-out request freed its slot: {} in flight",
        client_stats.in_flight()
    );

    drop(svc);
    stop.shutdown();
    server.await??;
    println!(
        "server shut down gracefully: {} channels, {} calls, {} replies, {} failed calls",
        stats.accepted(),
        stats.calls(),
        stats.responses(),
        stats.errors()
    );
    println!(
        "late replies discarded by the client: {}; done in {} ms",
        client_stats.discarded_replies(),
        started.elapsed().as_millis()
    );
    Ok(())
}
