//! Feature `metrics`: what hyperframes counts reaches the installed recorder, here
//! Prometheus' (rendered as text and read back). One test: the recorder is global.
#![cfg(all(
    feature = "metrics",
    feature = "tower",
    feature = "inproc",
    feature = "tcp"
))]

use std::time::Duration;

use bytes::Bytes;
use hyperframes::middleware::{BoxError, Client, TypeFilterLayer, serve};
use hyperframes::{Context, ErrorKind, Message};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::time::timeout;
use tower::{Layer, Service, ServiceExt, service_fn};

const GUARD: Duration = Duration::from_secs(20);

/// The value of the sample `series` (name and labels as rendered), 0 when absent.
fn value(prometheus: &PrometheusHandle, series: &str) -> f64 {
    let text = prometheus.render();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

async fn eventually(prometheus: &PrometheusHandle, series: &str, want: f64) {
    let deadline = tokio::time::Instant::now() + GUARD;
    while value(prometheus, series) != want {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{series} is {}, want {want}:\n{}",
            value(prometheus, series),
            prometheus.render()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_reach_the_installed_recorder() {
    let prometheus = PrometheusBuilder::new().install_recorder().unwrap();
    hyperframes::metrics::describe();
    // Channels: opened and open, by transport; closed when both halves are gone.
    let ctx = Context::new();
    let mut l = ctx.bind("tcp://127.0.0.1:0").await.unwrap();
    let url = l.local_url().to_owned();
    let (c, s) = tokio::join!(ctx.connect(&url), l.accept());
    let (c, s) = (c.unwrap(), s.unwrap());
    assert_eq!(
        value(
            &prometheus,
            r#"hyperframes_channels_opened_total{transport="tcp"}"#
        ),
        2.0
    );
    assert_eq!(
        value(&prometheus, r#"hyperframes_channels_open{transport="tcp"}"#),
        2.0
    );
    let (mut tx, rx) = c.split();
    let mut s = s;
    for n in [3usize, 5] {
        tx.send(Message::new("t.count").unwrap().with_body(vec![1u8; n]))
            .await
            .unwrap();
        s.recv().await.unwrap().unwrap();
    }
    drop(tx);
    assert_eq!(
        value(&prometheus, r#"hyperframes_channels_open{transport="tcp"}"#),
        2.0,
        "one half still alive"
    );
    drop(rx);
    drop(s);
    assert_eq!(
        value(&prometheus, r#"hyperframes_channels_open{transport="tcp"}"#),
        0.0
    );
    // What the channels carried, added when each ended.
    for (series, want) in [
        (r#"hyperframes_messages_sent_total{transport="tcp"}"#, 2.0),
        (
            r#"hyperframes_message_bytes_sent_total{transport="tcp"}"#,
            8.0,
        ),
        (
            r#"hyperframes_messages_received_total{transport="tcp"}"#,
            2.0,
        ),
        (
            r#"hyperframes_message_bytes_received_total{transport="tcp"}"#,
            8.0,
        ),
    ] {
        assert_eq!(value(&prometheus, series), want, "{series}");
    }

    // A context's losses: messages that arrived for a dropped receiver.
    let (mut a, b) = {
        let mut l = ctx.bind("inproc://metrics-unread").await.unwrap();
        let (a, b) = tokio::join!(ctx.connect("inproc://metrics-unread"), l.accept());
        (a.unwrap(), b.unwrap())
    };
    for _ in 0..3 {
        a.send(
            Message::new("t.lost")
                .unwrap()
                .with_body(Bytes::from_static(b"x")),
        )
        .await
        .unwrap();
    }
    drop(b);
    eventually(&prometheus, "hyperframes_unread_messages_total", 3.0).await;
    assert_eq!(ctx.stats().unread, 3);

    // serve and a named filter: calls, replies, refusals.
    let mut l = ctx.bind("inproc://metrics-serve").await.unwrap();
    let filter = TypeFilterLayer::new(["calc.*"]).unwrap().named("api");
    let handler = filter.layer(service_fn(|_: Message| async {
        Ok::<_, BoxError>(Some(Message::new("calc.reply").unwrap()))
    }));
    let connecting = tokio::spawn({
        let ctx = ctx.clone();
        async move { ctx.connect("inproc://metrics-serve").await.unwrap() }
    });
    let first = l.accept().await.unwrap();
    let server = tokio::spawn(hyperframes::middleware::serve_channel(
        first,
        handler.clone(),
    ));
    let mut client = Client::new(connecting.await.unwrap());
    for kind in ["calc.add", "calc.mul", "video.frame"] {
        let got = timeout(
            GUARD,
            client
                .ready()
                .await
                .unwrap()
                .call(Message::new(kind).unwrap()),
        )
        .await
        .unwrap();
        match kind {
            "video.frame" => {
                assert_eq!(got.unwrap_err().remote_kind(), Some(ErrorKind::InvalidType))
            }
            _ => assert!(got.is_ok(), "{got:?}"),
        }
    }
    drop(client);
    timeout(GUARD, server).await.unwrap().unwrap().unwrap();
    assert_eq!(value(&prometheus, "hyperframes_serve_calls_total"), 3.0);
    assert_eq!(value(&prometheus, "hyperframes_serve_responses_total"), 3.0);
    assert_eq!(value(&prometheus, "hyperframes_serve_errors_total"), 1.0);
    assert_eq!(
        value(
            &prometheus,
            r#"hyperframes_filter_unmatched_total{filter="api"}"#
        ),
        1.0
    );
    assert_eq!(
        value(
            &prometheus,
            r#"hyperframes_filter_rejected_total{filter="api"}"#
        ),
        1.0
    );

    // serve on a listener: channels accepted, active while served.
    let server = serve(l, tower::make::Shared::new(handler));
    let stop = server.shutdown_handle();
    let server = tokio::spawn(server.into_future());
    let ch = ctx.connect("inproc://metrics-serve").await.unwrap();
    eventually(&prometheus, "hyperframes_serve_channels_active", 1.0).await;
    assert_eq!(
        value(&prometheus, "hyperframes_serve_channels_accepted_total"),
        1.0
    );
    drop(ch);
    eventually(&prometheus, "hyperframes_serve_channels_active", 0.0).await;
    stop.shutdown();
    timeout(GUARD, server).await.unwrap().unwrap().unwrap();
    // `describe` gave them their help text.
    let text = prometheus.render();
    assert!(
        text.contains("# HELP hyperframes_channels_open Channels with a half still alive"),
        "{text}"
    );
}
