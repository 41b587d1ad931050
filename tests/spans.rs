//! `tracing` spans: every channel has one (`hf.channel`), and `serve` runs each request's call
//! in its own (`hf.process`, a child of the channel's), with the fields of OpenTelemetry's
//! messaging conventions. A layer records, for every event, the spans it was in and their
//! fields.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyperframes::middleware::{BoxError, Client, serve_channel};
use hyperframes::{Context, Message};
use tokio::time::timeout;
use tower::{Service, ServiceExt, service_fn};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context as LayerContext, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{Layer, Registry};

const GUARD: Duration = Duration::from_secs(20);

/// `name=value` pairs, one after the other.
#[derive(Default)]
struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, "{}={:?} ", field.name(), value);
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        let _ = write!(self.0, "{}={} ", field.name(), value);
    }
}

/// An event's fields, then each span it was in, innermost first, as `name{fields}`.
type Logged = (String, Vec<String>);

/// Every event seen.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<Logged>>>);

impl Seen {
    /// The spans of the one event whose message contains `text`.
    fn spans_of(&self, text: &str) -> Vec<String> {
        let all = self.0.lock().unwrap();
        let found: Vec<_> = all.iter().filter(|(m, _)| m.contains(text)).collect();
        assert_eq!(found.len(), 1, "events with `{text}`: {:?}", *all);
        found[0].1.clone()
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Seen {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: LayerContext<'_, S>) {
        let mut f = Fields::default();
        attrs.record(&mut f);
        let span = ctx.span(id).expect("a new span is known");
        span.extensions_mut()
            .insert(format!("{}{{{}}}", span.name(), f.0.trim_end()));
    }

    fn on_event(&self, event: &Event<'_>, ctx: LayerContext<'_, S>) {
        let mut f = Fields::default();
        event.record(&mut f);
        let spans = ctx
            .event_scope(event)
            .map(|scope| {
                scope
                    .map(|s| s.extensions().get::<String>().cloned().unwrap_or_default())
                    .collect()
            })
            .unwrap_or_default();
        self.0.lock().unwrap().push((f.0, spans));
    }
}

/// Serves one channel of `url` with a handler that logs and answers (or fails requests of
/// type `t.fail`), sends `requests` through a `Client`, and returns what was logged.
async fn served(url: &str, requests: &[&str]) -> Seen {
    let seen = Seen::default();
    let _guard = tracing::subscriber::set_default(Registry::default().with(seen.clone()));
    let ctx = Context::new();
    let mut l = ctx.bind(url).await.unwrap();
    let url = l.local_url().to_owned();
    let (c, s) = tokio::join!(ctx.connect(&url), l.accept());
    let handler = service_fn(|req: Message| async move {
        tracing::info!("handling {}", req.kind());
        if req.kind() == "t.fail" {
            return Err::<Option<Message>, BoxError>("refused on purpose".into());
        }
        Ok(Some(Message::new("t.reply").unwrap()))
    });
    let server = tokio::spawn(serve_channel(s.unwrap(), handler));
    let mut client = Client::new(c.unwrap());
    for kind in requests {
        let req = Message::new(*kind).unwrap().with_body(vec![7u8; 5]);
        let answer = timeout(GUARD, client.ready().await.unwrap().call(req))
            .await
            .expect("a reply or an error reply");
        assert_eq!(answer.is_ok(), *kind != "t.fail", "{kind}: {answer:?}");
    }
    drop(client);
    timeout(GUARD, server).await.unwrap().unwrap().unwrap();
    seen
}

#[tokio::test]
async fn a_served_request_runs_in_its_span_inside_the_channels() {
    let seen = served("tcp://127.0.0.1:0", &["t.one", "t.two"]).await;
    for (kind, id) in [("t.one", 1), ("t.two", 2)] {
        let spans = seen.spans_of(&format!("handling {kind}"));
        assert_eq!(spans.len(), 2, "{spans:?}");
        assert_eq!(
            spans[0],
            format!(
                "hf.process{{messaging.operation.type=process messaging.destination.name={kind} \
                 messaging.message.conversation_id={id} messaging.message.body.size=5}}"
            )
        );
        let channel = &spans[1];
        assert!(channel.starts_with("hf.channel{"), "{channel}");
        for field in [
            "messaging.system=hyperframes",
            "network.transport=tcp",
            "network.protocol.name=tcp",
            "network.local.address=tcp://127.0.0.1:",
            "network.peer.address=tcp://127.0.0.1:",
            "hf.channel.id=",
        ] {
            assert!(channel.contains(field), "{field} in {channel}");
        }
    }
}

#[tokio::test]
async fn a_failed_call_is_reported_in_the_span_of_its_request() {
    let seen = served("inproc://spans-fail", &["t.ok", "t.fail"]).await;
    let spans = seen.spans_of("handler failed");
    assert!(
        spans[0].starts_with(
            "hf.process{messaging.operation.type=process messaging.destination.name=t.fail "
        ),
        "{spans:?}"
    );
    assert!(spans[1].contains("network.transport=inproc"), "{spans:?}");
    // Both halves of the same channel share one span: the handler's events and serve's own.
    let handling = seen.spans_of("handling t.fail");
    assert_eq!(handling[1], spans[1]);
}

#[test]
fn each_channel_has_its_own_span_and_both_halves_share_it() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let seen = Seen::default();
    let _guard = tracing::subscriber::set_default(Registry::default().with(seen.clone()));
    rt.block_on(async {
        let ctx = Context::new();
        let mut l = ctx.bind("inproc://spans-halves").await.unwrap();
        let (c, s) = tokio::join!(ctx.connect("inproc://spans-halves"), l.accept());
        let (c, s) = (c.unwrap(), s.unwrap());
        assert_ne!(c.info().span().id(), s.info().span().id());
        let (tx, rx) = c.split();
        assert_eq!(tx.info().span().id(), rx.info().span().id());
        tx.info()
            .span()
            .in_scope(|| tracing::info!("from the connecting side"));
    });
    let spans = seen.spans_of("from the connecting side");
    assert!(
        spans[0].contains("network.local.address=inproc://spans-halves")
            || spans[0].contains("network.peer.address=inproc://spans-halves"),
        "{spans:?}"
    );
}
