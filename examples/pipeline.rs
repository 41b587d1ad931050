//! A data pipeline: a splitter fans chunks out to N workers, the workers send results to an
//! aggregator, which merges them and knows which worker each came from.
//!
//! ```sh
//! cargo run --release --example pipeline            # over inproc://
//! cargo run --release --example pipeline -- tcp     # over tcp://127.0.0.1
//! cargo run --release --example pipeline -- tcp 8   # 8 workers
//! cargo run --release --example pipeline -- shm     # over shm:// (processes would use it;
//!                                                   # here the stages share one process)
//! ```
//!
//! ```text
//!              ┌─> worker 0 ─┐
//! splitter ────┼─> worker 1 ─┼──> aggregator
//!  (FanOut,    └─> worker 2 ─┘    (FanIn: results tagged by worker)
//!  round-robin)
//! ```
//!
//! Each worker is a handler driven by `serve_channel`: a `TypeFilterLayer` and a
//! `MetaSchemaLayer` guard it, and it sends its result through its `Sender` seen as a tower
//! service (behind a `Buffer`, so the handler's calls can share it). Backpressure runs end to
//! end: a slow aggregator slows the workers, which slow the splitter.

use std::time::Instant;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use hyperframes::middleware::{
    BoxError, FanIn, FanOut, MetaSchema, MetaSchemaLayer, TypeFilterLayer, Value, serve_channel,
};
use hyperframes::{Context, Message};
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};

const CHUNKS: usize = 256;
const CHUNK_SIZE: usize = 64 << 10;

/// 64-bit FNV-1a of a chunk: the "work".
fn checksum(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn chunk(i: usize) -> Bytes {
    (0..CHUNK_SIZE)
        .map(|j| (j.wrapping_mul(31) ^ i.wrapping_mul(7)) as u8)
        .collect::<Vec<u8>>()
        .into()
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let transport = args.next().unwrap_or_else(|| "inproc".into());
    let workers: usize = match args.next() {
        Some(n) => n.parse().map_err(|e| format!("workers {n:?}: {e}"))?,
        None => 4,
    };
    if workers == 0 {
        return Err("at least one worker".into());
    }
    let url = |name: &str| match transport.as_str() {
        "inproc" => Ok(format!("inproc://{name}")),
        "tcp" => Ok("tcp://127.0.0.1:0".to_owned()),
        "shm" => Ok(format!("shm://{name}-{}", std::process::id())),
        other => Err(format!(
            "unknown transport {other:?}: use inproc, tcp or shm"
        )),
    };
    let ctx = Context::new();
    let started = Instant::now();

    // The aggregator's listener; each worker connects to it.
    let mut agg_listener = ctx.bind(&url("aggregator")?).await?;
    let agg_url = agg_listener.local_url().to_owned();

    let schema = MetaSchema::builder()
        .require("chunk", Value::integer_in(0..=i64::MAX))
        .require_type_naming()
        .build()?;

    let mut to_workers = Vec::new();
    let mut worker_tasks = Vec::new();
    for w in 0..workers {
        let mut listener = ctx.bind(&url(&format!("worker-{w}"))?).await?;
        let worker_url = listener.local_url().to_owned();
        let (splitter_side, from_splitter) =
            tokio::join!(ctx.connect(&worker_url), listener.accept());
        to_workers.push(splitter_side?.split().0);

        // The worker's output: a Sender seen as a service, shared through a Buffer.
        let (to_aggregator, _) = ctx.connect(&agg_url).await?.split();
        let out = ServiceBuilder::new().buffer(16).service(to_aggregator);
        let handler = ServiceBuilder::new()
            .layer(TypeFilterLayer::new(["ml.splitter.*"])?.named(format!("worker-{w}")))
            .layer(MetaSchemaLayer::new(schema.clone()))
            .service(service_fn(move |msg: Message| {
                let mut out = out.clone();
                async move {
                    let data = msg.body().as_bytes().ok_or("a host body")?;
                    let result = Message::new("ml.worker.result")?
                        .with_meta("chunk", msg.meta().get("chunk").unwrap_or("?"))?
                        .with_meta("checksum", format!("{:016x}", checksum(data)))?;
                    out.ready().await?.call(result).await?;
                    Ok::<_, BoxError>(None) // no reply to the splitter
                }
            }));
        // Ends when the splitter closes this channel; then the worker's output closes too.
        worker_tasks.push(tokio::spawn(serve_channel(from_splitter?, handler)));
    }

    // The aggregator: one merged stream, tagged by source.
    let mut results: FanIn = FanIn::new();
    for source in 0..workers {
        let (_, rx) = agg_listener.accept().await?.split();
        results.push(source, rx);
    }
    let aggregator = tokio::spawn(async move {
        let mut per_source = vec![0usize; workers];
        let mut sums = vec![None; CHUNKS];
        while let Some((source, msg)) = results.next().await {
            let msg = msg?;
            let i: usize = msg.meta().get("chunk").ok_or("no chunk")?.parse()?;
            let sum = u64::from_str_radix(msg.meta().get("checksum").ok_or("no checksum")?, 16)?;
            per_source[source] += 1;
            sums[i] = Some(sum);
        }
        Ok::<_, BoxError>((per_source, sums))
    });

    // The splitter: round-robin over the workers that have room.
    let mut splitter = FanOut::round_robin(to_workers)?;
    let bodies: Vec<Bytes> = (0..CHUNKS).map(chunk).collect();
    for (i, body) in bodies.iter().enumerate() {
        let msg = Message::new("ml.splitter.chunk")?
            .with_meta("chunk", i.to_string())?
            .with_body(body.clone());
        splitter.feed(msg).await?;
    }
    splitter.close().await?;

    for t in worker_tasks {
        t.await??;
    }
    let (per_source, sums) = aggregator.await??;
    let elapsed = started.elapsed();
    for (i, body) in bodies.iter().enumerate() {
        match sums[i] {
            Some(s) if s == checksum(body) => {}
            Some(_) => return Err(format!("chunk {i}: wrong checksum").into()),
            None => return Err(format!("chunk {i}: no result").into()),
        }
    }
    println!(
        "pipeline over {transport}: splitter -> {workers} workers -> aggregator, {CHUNKS} chunks of {} KiB ({} MiB)",
        CHUNK_SIZE >> 10,
        (CHUNKS * CHUNK_SIZE) >> 20
    );
    for (w, n) in per_source.iter().enumerate() {
        println!("  worker {w}: {n} chunks");
    }
    println!(
        "all {CHUNKS} checksums verified in {} ms",
        elapsed.as_millis()
    );
    Ok(())
}
