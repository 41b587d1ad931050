//! hyperframes' counters in Prometheus' text format (feature `metrics`).
//!
//! ```sh
//! cargo run --example metrics --features metrics
//! ```
//!
//! Installs the Prometheus recorder of `metrics-exporter-prometheus` (here without its HTTP
//! listener: the text is printed; a service would serve `handle.render()` on `/metrics`, or
//! turn on the exporter's `http-listener`), serves a handler behind a type filter and a
//! metadata schema over `inproc://`, sends it requests of which one has a type the filter
//! does not know and one breaks the schema, and prints what the recorder holds.

use hyperframes::middleware::{
    BoxError, Client, MetaSchema, MetaSchemaLayer, TypeFilterLayer, Value, serve,
};
use hyperframes::{Context, Message};
use metrics_exporter_prometheus::PrometheusBuilder;
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    // First the recorder, then everything that counts.
    let prometheus = PrometheusBuilder::new().install_recorder()?;
    hyperframes::metrics::describe();

    let ctx = Context::new();
    let listener = ctx.bind("inproc://metrics-example").await?;
    let schema = MetaSchema::builder()
        .allow("n", Value::integer_in(0..=100))
        .build()?;
    let handler = ServiceBuilder::new()
        .layer(TypeFilterLayer::new(["calc.*"])?.named("api"))
        .layer(MetaSchemaLayer::new(schema))
        .service(service_fn(|req: Message| async move {
            let n: i64 = req.meta().get("n").unwrap_or("0").parse()?;
            Ok::<_, BoxError>(Some(
                Message::new("calc.square.reply")?.with_meta("n", (n * n).to_string())?,
            ))
        }));
    let server = serve(listener, tower::make::Shared::new(handler));
    let shutdown = server.shutdown_handle();
    let server = tokio::spawn(server.into_future());

    let mut client = Client::new(ctx.connect("inproc://metrics-example").await?);
    for (kind, n) in [
        ("calc.square", "3"),
        ("calc.square", "4"),
        ("calc.square", "5"),
        ("video.frame", "1"),    // no pattern matches: the filter refuses it
        ("calc.square", "1000"), // out of the schema's range
    ] {
        let req = Message::new(kind)?.with_meta("n", n)?;
        match client.ready().await?.call(req).await {
            Ok(reply) => println!(
                "# {kind} n={n} -> n={}",
                reply.meta().get("n").unwrap_or("?")
            ),
            Err(e) => println!("# {kind} n={n} -> refused ({:?})", e.remote_kind()),
        }
    }
    drop(client);
    shutdown.shutdown();
    server.await??;
    print!("{}", prometheus.render());
    Ok(())
}
