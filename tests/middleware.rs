//! The tower middleware: with `tower-test` mocks, and over real channels on `inproc://` and
//! `tcp://` (one suite, instantiated per transport at the bottom).

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::FuturesUnordered;
use futures_util::{SinkExt, StreamExt};
use hyperframes::middleware::meta_schema::{Rule, SchemaViolation};
use hyperframes::middleware::router::NoRoute;
use hyperframes::middleware::type_filter::Unmatched;
use hyperframes::middleware::{
    BoxError, Client, FanIn, FanOut, Incoming, MetaSchema, MetaSchemaLayer, Router,
    TypeFilterLayer, Value, serve, serve_channel,
};
use hyperframes::{Channel, Context, ContextBuilder, ErrorKind, Flags, Header, Listener, Message};
use tokio::sync::{Notify, oneshot};
use tokio::time::timeout;
use tower::{Layer, Service, ServiceBuilder, ServiceExt, service_fn};
use tower_test::{assert_request_eq, mock};

const GUARD: Duration = Duration::from_secs(20);

static NAME: AtomicUsize = AtomicUsize::new(0);

#[derive(Clone, Copy, Debug)]
enum T {
    Inproc,
    Tcp,
}

impl T {
    fn url(self) -> String {
        match self {
            T::Inproc => format!("inproc://mw-{}", NAME.fetch_add(1, Ordering::Relaxed)),
            T::Tcp => "tcp://127.0.0.1:0".into(),
        }
    }
}

async fn listen(t: T, b: ContextBuilder) -> (Context, Listener, String) {
    let ctx = b.build().unwrap();
    let l = ctx.bind(&t.url()).await.unwrap();
    let url = l.local_url().to_owned();
    (ctx, l, url)
}

/// A connected pair (client, server).
async fn pair_with(t: T, b: ContextBuilder) -> (Context, Channel, Channel) {
    let (ctx, mut l, url) = listen(t, b).await;
    let (c, s) = tokio::join!(ctx.connect(&url), l.accept());
    (ctx, c.unwrap(), s.unwrap())
}

async fn pair(t: T) -> (Context, Channel, Channel) {
    pair_with(t, Context::builder()).await
}

fn m(kind: &str) -> Message {
    Message::new(kind).unwrap()
}

fn with(kind: &str, meta: &[(&str, &str)]) -> Message {
    let mut msg = m(kind);
    for (k, v) in meta {
        msg = msg.with_meta(k, v).unwrap();
    }
    msg
}

fn reply_to(req: &Message, kind: &str) -> Message {
    m(kind).with_body(req.body().clone()).with_header(Header {
        flags: Flags::RESPONSE,
        correlation: req.header().correlation,
    })
}

async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + GUARD;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Log lines, captured for this thread (tests run on a current-thread runtime).
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    fn capture() -> (Logs, tracing::subscriber::DefaultGuard) {
        let logs = Logs::default();
        let sub = tracing_subscriber::fmt()
            .with_writer(logs.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish();
        (logs, tracing::subscriber::set_default(sub))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl Write for Logs {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

type Handler = mock::Mock<Message, Option<Message>>;
type HandlerHandle = mock::Handle<Message, Option<Message>>;

// ---------------------------------------------------------------------------------------
// With mocks

#[tokio::test]
async fn filter_rejects_unmatched_and_hands_the_message_back() {
    let layer = TypeFilterLayer::new(["video.*", "ml.splitter.**"]).unwrap();
    let stats = layer.stats();
    let (mut svc, mut handle) = mock::spawn_layer::<Message, Option<Message>, _>(layer);

    assert!(svc.poll_ready().is_ready());
    let fut = svc.call(m("video.frame"));
    assert_request_eq!(handle, m("video.frame")).send_response(None);
    assert_eq!(fut.await.unwrap(), None);

    assert!(svc.poll_ready().is_ready());
    let err = svc
        .call(m("audio.frame").with_body("pcm"))
        .await
        .unwrap_err();
    let unmatched = err.downcast::<Unmatched>().unwrap();
    assert_eq!(unmatched.message_type(), "audio.frame");
    assert_eq!(unmatched.patterns(), "[video.*, ml.splitter.**]");
    assert!(unmatched.to_string().contains("audio.frame"), "{unmatched}");
    assert_eq!(
        unmatched.into_message().unwrap(),
        m("audio.frame").with_body("pcm")
    );
    assert!(
        handle.poll_request().is_pending(),
        "the inner service never saw it"
    );
    assert_eq!((stats.unmatched(), stats.rejected()), (1, 1));
}

#[tokio::test]
async fn filter_discards_counts_and_logs_rate_limited() {
    let (logs, _guard) = Logs::capture();
    let layer = TypeFilterLayer::new(["video_frame"])
        .unwrap()
        .named("video-rx")
        .warn_interval(Duration::from_secs(3600))
        .discard();
    let stats = layer.stats();
    let (mut svc, mut handle) = mock::spawn_layer::<Message, Option<Message>, _>(layer);
    for _ in 0..3 {
        assert!(svc.poll_ready().is_ready());
        assert_eq!(svc.call(m("audio_frame")).await.unwrap(), None);
    }
    assert!(svc.poll_ready().is_ready());
    let fut = svc.call(m("video_frame"));
    assert_request_eq!(handle, m("video_frame")).send_response(Some(m("ok")));
    assert_eq!(fut.await.unwrap(), Some(m("ok")));

    assert_eq!((stats.unmatched(), stats.dropped()), (3, 3));
    let text = logs.text();
    let warnings: Vec<&str> = text.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "one warning per interval:\n{text}");
    for part in [
        "\"video-rx\"",
        "[video_frame]",
        "`audio_frame`",
        "1 dropped so far",
    ] {
        assert!(
            warnings[0].contains(part),
            "{part:?} not in {}",
            warnings[0]
        );
    }
}

#[tokio::test]
async fn filter_fallback_gets_the_unmatched_and_both_must_be_ready() {
    let (fallback, mut fb_handle) = mock::pair::<Message, Option<Message>>();
    let layer = TypeFilterLayer::new(["a.*"]).unwrap().fallback(fallback);
    let stats = layer.stats();
    let (mut svc, mut handle) = mock::spawn_layer::<Message, Option<Message>, _>(layer);

    handle.allow(0);
    assert!(
        svc.poll_ready().is_pending(),
        "the inner service is not ready"
    );
    handle.allow(u64::MAX);
    assert!(svc.is_woken());
    assert!(svc.poll_ready().is_ready());
    let fut = svc.call(m("b.x"));
    assert_request_eq!(fb_handle, m("b.x")).send_response(Some(m("from.fallback")));
    assert_eq!(fut.await.unwrap(), Some(m("from.fallback")));

    fb_handle.allow(0);
    assert!(svc.poll_ready().is_pending(), "the fallback is not ready");
    fb_handle.allow(1);
    assert!(svc.poll_ready().is_ready());
    let fut = svc.call(m("a.x"));
    assert_request_eq!(handle, m("a.x")).send_response(None);
    assert_eq!(fut.await.unwrap(), None);
    assert_eq!((stats.unmatched(), stats.to_fallback()), (1, 1));
}

#[tokio::test]
async fn filter_errors_of_the_inner_service_pass_through() {
    let (mut svc, mut handle) =
        mock::spawn_layer::<Message, Option<Message>, _>(TypeFilterLayer::new(["**"]).unwrap());
    handle.send_error("broken");
    let err = match svc.poll_ready() {
        Poll::Ready(Err(e)) => e,
        other => panic!("expected the inner error, got {other:?}"),
    };
    assert_eq!(err.to_string(), "broken");
}

/// A filter without a fallback (reject, discard) and a schema answer with futures no larger
/// than the handler's own: the cases they add take the handler future's spare values for
/// their tag instead of a word in front of it (which would copy every answer out shifted).
/// A check of layout, for speed, not of behaviour: rustc does not promise how it packs enums,
/// and a new compiler may fail it with every behaviour intact.
#[test]
#[cfg_attr(miri, ignore = "layout, not behaviour")]
fn filter_and_schema_futures_are_the_size_of_the_handlers() {
    type Answer = std::future::Ready<Result<Option<Message>, BoxError>>;
    fn handler()
    -> impl Service<Message, Response = Option<Message>, Error = BoxError, Future = Answer> {
        service_fn(|m: Message| std::future::ready(Ok::<_, BoxError>(Some(m))))
    }
    fn future_size<S: Service<Message>>(mut svc: S) -> usize {
        std::mem::size_of_val(&svc.call(m("a.b.c")))
    }
    let schema = || MetaSchemaLayer::new(MetaSchema::builder().build().unwrap());
    let filter = || TypeFilterLayer::new(["a.*.*"]).unwrap();
    let answer = std::mem::size_of::<Answer>();
    let why = "a layer's future is larger than its handler's: a tag word in front of it?";
    assert_eq!(future_size(filter().layer(handler())), answer, "{why}");
    assert_eq!(
        future_size(filter().discard().layer(handler())),
        answer,
        "{why}"
    );
    assert_eq!(future_size(schema().layer(handler())), answer, "{why}");
    let stack = ServiceBuilder::new()
        .layer(filter())
        .layer(schema())
        .service(handler());
    assert_eq!(future_size(stack), answer, "{why}");
}

#[tokio::test]
async fn router_dispatches_first_match_then_fallback() {
    let (video, mut video_h) = mock::pair::<Message, Option<Message>>();
    let (any_ml, mut ml_h) = mock::pair::<Message, Option<Message>>();
    let (fallback, mut fb_h) = mock::pair::<Message, Option<Message>>();
    let router = Router::new()
        .route("video.*", video)
        .unwrap()
        .route("ml.**", any_ml)
        .unwrap()
        .fallback(fallback);
    let mut svc = mock::Spawn::new(router);

    ml_h.allow(0);
    assert!(svc.poll_ready().is_pending(), "every route must be ready");
    ml_h.allow(u64::MAX);

    for (kind, which) in [
        ("video.frame", 0),
        ("ml.splitter.out", 1),
        ("audio.frame", 2),
        ("video.frame.extra", 2),
    ] {
        assert!(svc.poll_ready().is_ready());
        let fut = svc.call(m(kind));
        let h = match which {
            0 => &mut video_h,
            1 => &mut ml_h,
            _ => &mut fb_h,
        };
        assert_request_eq!(h, m(kind)).send_response(Some(m("ok")));
        assert_eq!(fut.await.unwrap(), Some(m("ok")), "{kind}");
    }

    let mut bare = Router::<Option<Message>>::new()
        .route(
            "video.*",
            service_fn(|_m: Message| async { Ok::<_, BoxError>(None) }),
        )
        .unwrap();
    let err = bare
        .ready()
        .await
        .unwrap()
        .call(m("audio.frame"))
        .await
        .unwrap_err();
    let no_route = err.downcast::<NoRoute>().unwrap();
    assert_eq!(no_route.routes(), "[video.*]");
    assert_eq!(no_route.into_message(), Some(m("audio.frame")));
    assert!(
        Router::<()>::new()
            .route(
                "a..b",
                service_fn(|_m: Message| async { Ok::<_, BoxError>(()) })
            )
            .is_err()
    );
}

#[tokio::test]
async fn serve_reads_nothing_while_the_handler_is_not_ready() {
    let b = Context::builder()
        .send_queue(4, 1 << 20)
        .recv_queue(4, 1 << 20);
    let (_ctx, c, s) = pair_with(T::Inproc, b).await;
    let (handler, mut handle): (Handler, HandlerHandle) = mock::pair();
    handle.allow(0);
    let server = tokio::spawn(serve_channel(s, handler));
    let (mut tx, mut rx) = c.split();
    let mut sent = 0;
    let full = loop {
        match tx.try_send(m("req.x").with_meta("i", sent.to_string()).unwrap()) {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        assert!(sent < 100, "the sender was never backpressured");
        tokio::task::yield_now().await;
    };
    assert_eq!(full.kind(), ErrorKind::Full);
    assert!(handle.poll_request().is_pending(), "nothing was called");

    handle.allow(u64::MAX);
    for i in 0..sent {
        let (req, resp) = timeout(GUARD, handle.next_request())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(req.meta().get("i"), Some(&*i.to_string()));
        resp.send_response(Some(m("req.done")));
    }
    for _ in 0..sent {
        let r = timeout(GUARD, rx.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(r.kind(), "req.done");
        assert!(r.header().flags.contains(Flags::RESPONSE));
    }
    tx.close().await.unwrap();
    timeout(GUARD, server).await.unwrap().unwrap().unwrap();
    assert!(
        rx.recv().await.is_none(),
        "the server closed after the peer did"
    );
}

#[tokio::test]
async fn serve_bounds_calls_in_flight_per_channel() {
    let (ctx, l, url) = listen(T::Inproc, Context::builder()).await;
    let (handler, mut handle): (Handler, HandlerHandle) = mock::pair();
    let server = serve(l, tower::make::Shared::new(handler)).max_in_flight(2);
    let stop = server.shutdown_handle();
    let task = tokio::spawn(server.into_future());
    let mut ch = ctx.connect(&url).await.unwrap();
    for i in 0..5 {
        ch.send(m("req.x").with_meta("i", i.to_string()).unwrap())
            .await
            .unwrap();
    }
    let (_, r0) = handle.next_request().await.unwrap();
    let (_, r1) = handle.next_request().await.unwrap();
    tokio::task::yield_now().await;
    assert!(
        handle.poll_request().is_pending(),
        "a third call while two are in flight"
    );
    r0.send_response(None);
    let (third, r2) = timeout(GUARD, handle.next_request())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(third.meta().get("i"), Some("2"));
    for r in [r1, r2] {
        r.send_response(None);
    }
    for _ in 3..5 {
        handle.next_request().await.unwrap().1.send_response(None);
    }
    stop.shutdown();
    timeout(GUARD, task).await.unwrap().unwrap().unwrap();
}

#[tokio::test]
async fn serve_shuts_down_while_the_make_service_is_not_ready() {
    let (ctx, l, url) = listen(T::Inproc, Context::builder()).await;
    let (make, mut make_handle) = mock::pair::<Incoming, Handler>();
    make_handle.allow(0);
    let server = serve(l, make);
    let (stop, stats) = (server.shutdown_handle(), server.stats());
    let task = tokio::spawn(server.into_future());
    let _ch = ctx.connect(&url).await.unwrap();
    eventually("the channel is accepted", || stats.accepted() == 1).await;
    stop.shutdown();
    timeout(GUARD, task)
        .await
        .expect("shutdown waited for the make-service")
        .unwrap()
        .unwrap();
    // The make-service was dropped with the server without being asked for a service.
    assert!(
        matches!(make_handle.poll_request(), Poll::Ready(None)),
        "no service was made"
    );
}

// ---------------------------------------------------------------------------------------
// Over real channels, per transport

fn schema() -> MetaSchema {
    MetaSchema::builder()
        .require("frame", Value::integer_in(0..=1_000_000))
        .allow("codec", Value::one_of(["h264", "av1"]))
        .build()
        .unwrap()
}

async fn sender_is_a_service(t: T) {
    let (_ctx, c, mut s) = pair(t).await;
    let (tx, _crx) = c.split();
    let mut svc = ServiceBuilder::new()
        .layer(TypeFilterLayer::new(["video.*"]).unwrap())
        .layer(MetaSchemaLayer::new(schema()))
        .service(tx);
    for i in 0..10 {
        let msg = with("video.frame", &[("frame", &i.to_string())]);
        svc.ready().await.unwrap().call(msg).await.unwrap();
    }
    for i in 0..10 {
        let got = timeout(GUARD, s.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(got.meta().get("frame"), Some(&*i.to_string()));
    }
    svc.get_mut().get_mut().flush().await.unwrap();
}

async fn schema_refuses_on_the_send_side(t: T) {
    let (_ctx, c, mut s) = pair(t).await;
    let (tx, _crx) = c.split();
    let mut svc = MetaSchemaLayer::new(schema()).layer(tx);
    let cases = [
        (with("video.frame", &[]), Some("frame"), Rule::MissingKey),
        (
            with("video.frame", &[("frame", "x")]),
            Some("frame"),
            Rule::Integer,
        ),
        (
            with("video.frame", &[("frame", "1"), ("codec", "vp9")]),
            Some("codec"),
            Rule::OneOf,
        ),
        (
            with("video.frame", &[("frame", "1"), ("colour", "red")]),
            Some("colour"),
            Rule::UnknownKey,
        ),
    ];
    for (i, (bad, key, rule)) in cases.into_iter().enumerate() {
        let good = with("video.frame", &[("frame", &i.to_string())]);
        svc.ready().await.unwrap().call(good).await.unwrap();
        let err = svc
            .ready()
            .await
            .unwrap()
            .call(bad.clone())
            .await
            .unwrap_err();
        let v = err.downcast::<SchemaViolation>().unwrap();
        assert_eq!((v.key(), v.rule()), (key, &rule), "{v}");
        assert!(v.to_string().contains("video.frame"), "{v}");
        assert_eq!(v.into_message(), Some(bad));
    }
    svc.into_inner().close().await.unwrap();
    for i in 0..4 {
        let got = timeout(GUARD, s.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(
            got.meta().get("frame"),
            Some(&*i.to_string()),
            "only good ones arrive"
        );
    }
    assert!(timeout(GUARD, s.recv()).await.unwrap().is_none());
}

async fn schema_refuses_on_the_receive_side(t: T) {
    let (ctx, l, url) = listen(t, Context::builder()).await;
    let seen = Arc::new(AtomicUsize::new(0));
    let seen2 = seen.clone();
    let handler = ServiceBuilder::new()
        .layer(MetaSchemaLayer::new(schema()))
        .service(service_fn(move |req: Message| {
            seen2.fetch_add(1, Ordering::Relaxed);
            async move { Ok::<_, BoxError>(Some(reply_to(&req, "video.ack"))) }
        }));
    let server = serve(l, tower::make::Shared::new(handler));
    let (stop, stats) = (server.shutdown_handle(), server.stats());
    let task = tokio::spawn(server.into_future());

    let mut client = Client::new(ctx.connect(&url).await.unwrap());
    let ok = client
        .ready()
        .await
        .unwrap()
        .call(with("video.frame", &[("frame", "12")]))
        .await
        .unwrap();
    assert_eq!(ok.kind(), "video.ack");
    let err = client
        .ready()
        .await
        .unwrap()
        .call(with("video.frame", &[("frame", "twelve")]))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Remote, "{err}");
    assert_eq!(err.remote_kind(), Some(ErrorKind::InvalidMeta), "{err:?}");
    let text = err.to_string();
    for part in ["video.frame", "`frame`", "an integer", "\"twelve\""] {
        assert!(text.contains(part), "{part:?} not in {text}");
    }
    assert_eq!(
        seen.load(Ordering::Relaxed),
        1,
        "the handler never saw the bad one"
    );
    eventually("both replies counted", || stats.responses() == 2).await;
    assert_eq!((stats.calls(), stats.errors()), (2, 1));
    stop.shutdown();
    timeout(GUARD, task).await.unwrap().unwrap().unwrap();
}

/// A client tells apart, without reading the text, a request refused by the server's type
/// filter, by its router (no route), and one its handler failed: the error reply carries the
/// kind.
async fn client_tells_refusals_apart_by_remote_kind(t: T) {
    let (ctx, l, url) = listen(t, Context::builder()).await;
    let handler = service_fn(|req: Message| async move {
        if req.kind() == "video.broken" {
            return Err::<Option<Message>, BoxError>("the decoder crashed".into());
        }
        Ok(Some(reply_to(&req, "video.ack")))
    });
    let routes = Router::new().route("video.*", handler).unwrap();
    let svc = TypeFilterLayer::new(["video.**"]).unwrap().layer(routes);
    let server = serve(l, tower::make::Shared::new(svc));
    let stop = server.shutdown_handle();
    let task = tokio::spawn(server.into_future());
    let mut client = Client::new(ctx.connect(&url).await.unwrap());
    for (kind, expected) in [
        ("audio.frame", ErrorKind::InvalidType),
        ("video.frame.extra", ErrorKind::NotFound),
        ("video.broken", ErrorKind::Service),
    ] {
        let err = timeout(GUARD, client.ready().await.unwrap().call(m(kind)))
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Remote, "{err}");
        assert_eq!(err.remote_kind(), Some(expected), "{kind}: {err:?}");
    }
    let ok = client.ready().await.unwrap().call(m("video.frame")).await;
    assert_eq!(ok.unwrap().kind(), "video.ack");
    stop.shutdown();
    timeout(GUARD, task).await.unwrap().unwrap().unwrap();
}

/// A request that the server's handler does not answer — dropped by the README's own
/// `TypeFilterLayer::discard()`, or answered `Ok(None)` — gets an error reply, counted, so the
/// client's call fails at once instead of waiting for its own timeout; a plain message (not a
/// request) answered `Ok(None)` still gets nothing.
async fn serve_answers_every_request_it_does_not_answer_otherwise(t: T) {
    let (ctx, l, url) = listen(t, Context::builder()).await;
    let filter = TypeFilterLayer::new(["video.frame", "video.quiet"])
        .unwrap()
        .discard();
    let dropped = filter.stats();
    let handler = filter.layer(service_fn(|req: Message| async move {
        if req.kind() == "video.quiet" {
            return Ok::<_, BoxError>(None);
        }
        Ok(Some(reply_to(&req, "video.ack")))
    }));
    let server = serve(l, tower::make::Shared::new(handler));
    let (stop, stats) = (server.shutdown_handle(), server.stats());
    let task = tokio::spawn(server.into_future());

    let mut client = Client::new(ctx.connect(&url).await.unwrap());
    for (kind, why) in [
        ("audio.frame", "a filter may have dropped it"),
        ("video.quiet", "no reply"),
    ] {
        let err = timeout(GUARD, client.ready().await.unwrap().call(m(kind)))
            .await
            .expect("an answer, not a wait for the caller's timeout")
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Remote, "{err}");
        assert_eq!(err.remote_kind(), Some(ErrorKind::Service), "{err:?}");
        let text = err.to_string();
        assert!(text.contains(kind) && text.contains(why), "{text}");
    }
    let ok = client
        .ready()
        .await
        .unwrap()
        .call(m("video.frame"))
        .await
        .unwrap();
    assert_eq!(ok.kind(), "video.ack");
    assert_eq!((dropped.dropped(), stats.unanswered()), (1, 2));

    // Not requests: nothing comes back for the dropped or unanswered ones.
    let mut raw = ctx.connect(&url).await.unwrap();
    raw.send(m("audio.frame")).await.unwrap();
    raw.send(m("video.quiet")).await.unwrap();
    let probe = m("video.frame").with_header(Header {
        flags: Flags::REQUEST,
        correlation: 7,
    });
    raw.send(probe).await.unwrap();
    let first = timeout(GUARD, raw.recv()).await.unwrap().unwrap().unwrap();
    assert_eq!(
        (first.kind().as_str(), first.header().correlation),
        ("video.ack", 7)
    );
    assert_eq!(stats.unanswered(), 2);
    stop.shutdown();
    timeout(GUARD, task).await.unwrap().unwrap().unwrap();
}

/// The seed's pitfall: a receiver filtered on `video_frame` while the sender sends
/// `audio_frame` must be diagnosable from the log alone.
async fn filtered_receiver_is_diagnosable_from_the_log(t: T) {
    let (logs, _guard) = Logs::capture();
    let (_ctx, c, s) = pair(t).await;
    let handled = Arc::new(AtomicUsize::new(0));
    let h = handled.clone();
    let filter = TypeFilterLayer::new(["video_frame"])
        .unwrap()
        .named("video-rx")
        .discard();
    let stats = filter.stats();
    let handler = filter.layer(service_fn(move |_m: Message| {
        h.fetch_add(1, Ordering::Relaxed);
        async { Ok::<_, BoxError>(None) }
    }));
    let (mut tx, _rx) = c.split();
    for _ in 0..5 {
        tx.send(m("audio_frame").with_body(vec![0u8; 64]))
            .await
            .unwrap();
    }
    tx.close().await.unwrap();
    timeout(GUARD, serve_channel(s, handler))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(handled.load(Ordering::Relaxed), 0);
    assert_eq!(stats.dropped(), 5);
    let text = logs.text();
    assert!(
        text.lines().any(|l| l.contains("WARN")
            && l.contains("`audio_frame`")
            && l.contains("[video_frame]")
            && l.contains("video-rx")),
        "the log does not explain the silence:\n{text}"
    );
}

async fn client_pairs_reordered_replies(t: T) {
    let (_ctx, c, mut s) = pair(t).await;
    const N: usize = 32;
    let peer = tokio::spawn(async move {
        let mut reqs = Vec::new();
        for _ in 0..N {
            let r = timeout(GUARD, s.recv()).await.unwrap().unwrap().unwrap();
            assert!(r.header().flags.contains(Flags::REQUEST));
            reqs.push(r);
        }
        let ids: std::collections::HashSet<u64> =
            reqs.iter().map(|r| r.header().correlation).collect();
        assert_eq!(ids.len(), N, "distinct correlation ids");
        assert!(!ids.contains(&0));
        for r in reqs.iter().rev() {
            s.send(reply_to(r, "test.reply")).await.unwrap();
        }
        s
    });
    let mut client = Client::new(c);
    let stats = client.stats();
    let mut calls = FuturesUnordered::new();
    for i in 0..N {
        client.ready().await.unwrap();
        let body = format!("request {i}");
        let fut = client.call(m("test.req").with_body(body.clone()));
        calls.push(async move { (body, fut.await) });
    }
    assert_eq!(stats.in_flight(), N);
    while let Some((body, reply)) = timeout(GUARD, calls.next()).await.unwrap() {
        let reply = reply.unwrap();
        assert_eq!(reply.body().as_bytes().unwrap(), body.as_bytes());
        assert!(reply.header().flags.contains(Flags::RESPONSE));
    }
    assert_eq!((stats.in_flight(), stats.discarded_replies()), (0, 0));
    drop(peer.await.unwrap());
}

async fn client_cancellation_frees_the_slot_and_counts_the_late_reply(t: T) {
    let (_ctx, c, mut s) = pair(t).await;
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let peer = tokio::spawn(async move {
        let first = timeout(GUARD, s.recv()).await.unwrap().unwrap().unwrap();
        go_rx.await.unwrap();
        s.send(reply_to(&first, "late.reply")).await.unwrap();
        let second = timeout(GUARD, s.recv()).await.unwrap().unwrap().unwrap();
        s.send(reply_to(&second, "on.time")).await.unwrap();
        s
    });
    let mut client = Client::new(c).max_in_flight(1);
    let stats = client.stats();
    client.ready().await.unwrap();
    let first = client.call(m("test.req").with_body("first"));
    assert_eq!(stats.in_flight(), 1);
    // With the only slot taken, the client is not ready.
    let mut polled = tokio_test_ready(&mut client);
    assert!(polled.is_pending());
    drop(first); // cancel
    assert_eq!(
        stats.in_flight(),
        0,
        "a dropped request frees its slot at once"
    );
    polled = tokio_test_ready(&mut client);
    assert!(matches!(polled, Poll::Ready(Ok(()))));
    go_tx.send(()).unwrap();
    let reply = timeout(GUARD, client.call(m("test.req").with_body("second")))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reply.kind(), "on.time");
    assert_eq!(reply.body().as_bytes().unwrap(), "second");
    // The late reply came first on the channel, so it has been handled.
    assert_eq!(stats.discarded_replies(), 1);
    assert_eq!(stats.in_flight(), 0);
    drop(peer.await.unwrap());
}

/// One poll of the client's readiness with a no-op waker.
fn tokio_test_ready(client: &mut Client) -> Poll<hyperframes::Result<()>> {
    let waker = futures_util::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    client.poll_ready(&mut cx)
}

async fn client_fails_every_request_when_the_channel_goes(t: T) {
    let (_ctx, c, mut s) = pair(t).await;
    let peer = tokio::spawn(async move {
        for _ in 0..3 {
            timeout(GUARD, s.recv()).await.unwrap().unwrap().unwrap();
        }
        drop(s); // without replying
    });
    let mut client = Client::new(c);
    let stats = client.stats();
    let mut calls = Vec::new();
    for _ in 0..3 {
        client.ready().await.unwrap();
        calls.push(client.call(m("test.req")));
    }
    peer.await.unwrap();
    for call in calls {
        let err = timeout(GUARD, call).await.expect("no hang").unwrap_err();
        assert!(
            matches!(err.kind(), ErrorKind::Closed | ErrorKind::ConnectionLost),
            "{err}"
        );
    }
    assert!(stats.is_failed());
    let err = timeout(GUARD, client.ready()).await.unwrap().unwrap_err();
    assert!(matches!(
        err.kind(),
        ErrorKind::Closed | ErrorKind::ConnectionLost
    ));
    assert_eq!(stats.in_flight(), 0);
}

async fn client_composes_with_buffer_concurrency_limit_and_timeout(t: T) {
    let (ctx, l, url) = listen(t, Context::builder()).await;
    let now = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let (n2, m2) = (now.clone(), most.clone());
    let handler = service_fn(move |req: Message| {
        let (now, most) = (n2.clone(), m2.clone());
        async move {
            if req.kind() == "slow.never" {
                std::future::pending::<()>().await;
            }
            let cur = now.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(cur, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(2)).await;
            now.fetch_sub(1, Ordering::SeqCst);
            // No header: serve marks it a response and copies the request's correlation id.
            Ok::<_, BoxError>(Some(m("echo.reply").with_body(req.body().clone())))
        }
    });
    let server = serve(l, tower::make::Shared::new(handler));
    let stop = server.shutdown_handle();
    let task = tokio::spawn(
        server
            .drain_timeout(Duration::from_millis(200))
            .into_future(),
    );

    let client = Client::new(ctx.connect(&url).await.unwrap());
    let stats = client.stats();
    let svc = ServiceBuilder::new()
        .buffer(32)
        .timeout(Duration::from_secs(10))
        .concurrency_limit(2)
        .service(client);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..16 {
        let mut svc = svc.clone();
        tasks.spawn(async move {
            let body = format!("{i}");
            let r = svc
                .ready()
                .await?
                .call(m("echo.req").with_body(body.clone()))
                .await?;
            assert_eq!(r.body().as_bytes().unwrap(), body.as_bytes());
            Ok::<_, BoxError>(())
        });
    }
    while let Some(r) = timeout(GUARD, tasks.join_next()).await.unwrap() {
        r.unwrap().unwrap();
    }
    let most = most.load(Ordering::SeqCst);
    assert!((1..=2).contains(&most), "concurrency limit 2, saw {most}");

    let mut short = ServiceBuilder::new()
        .timeout(Duration::from_millis(100))
        .service(svc.clone());
    let err = short
        .ready()
        .await
        .unwrap()
        .call(m("slow.never"))
        .await
        .unwrap_err();
    assert!(err.is::<tower::timeout::error::Elapsed>(), "{err}");
    eventually("the timed-out request frees its slot", || {
        stats.in_flight() == 0
    })
    .await;
    stop.shutdown();
    // The never-ending handler is cut off at the drain timeout.
    timeout(GUARD, task).await.unwrap().unwrap().unwrap();
}

async fn client_composes_with_retry_and_balance(t: T) {
    use tower::balance::p2c::Balance;
    use tower::discover::ServiceList;
    use tower::load::Constant;

    #[derive(Clone)]
    struct RetryRemote(usize);
    impl tower::retry::Policy<Message, Message, BoxError> for RetryRemote {
        type Future = std::future::Ready<()>;
        fn retry(
            &mut self,
            _req: &mut Message,
            result: &mut Result<Message, BoxError>,
        ) -> Option<Self::Future> {
            (result.is_err() && self.0 > 0).then(|| {
                self.0 -= 1;
                std::future::ready(())
            })
        }
        fn clone_request(&mut self, req: &Message) -> Option<Message> {
            Some(req.clone())
        }
    }

    // Two servers; every first request on a channel fails (a remote error).
    let mut clients = Vec::new();
    let mut stops = Vec::new();
    let mut contexts = Vec::new();
    for _ in 0..2 {
        let (ctx, l, url) = listen(t, Context::builder()).await;
        let make = service_fn(|_inc: Incoming| async {
            let first = Arc::new(AtomicUsize::new(0));
            Ok::<_, BoxError>(service_fn(move |req: Message| {
                let n = first.fetch_add(1, Ordering::Relaxed);
                async move {
                    if n == 0 {
                        return Err::<Option<Message>, BoxError>("first request fails".into());
                    }
                    Ok(Some(reply_to(&req, "ok.reply")))
                }
            }))
        });
        let server = serve(l, make);
        stops.push(server.shutdown_handle());
        tokio::spawn(server.into_future());
        let client = Client::new(ctx.connect(&url).await.unwrap());
        contexts.push(ctx); // an inproc listener ends with the last clone of its context
        clients.push(Constant::new(
            ServiceBuilder::new().buffer(8).service(client),
            0,
        ));
    }
    let balanced = Balance::new(ServiceList::new(clients));
    let mut svc = ServiceBuilder::new()
        .retry(RetryRemote(2))
        .buffer(8)
        .service(balanced);
    for i in 0..8 {
        let r = timeout(GUARD, async {
            svc.ready()
                .await?
                .call(m("work.req").with_body(format!("{i}")))
                .await
        })
        .await
        .unwrap()
        .unwrap();
        assert_eq!(r.body().as_bytes().unwrap(), format!("{i}").as_bytes());
    }
    for s in stops {
        s.shutdown();
    }
}

async fn serve_shutdown_drains_then_closes(t: T) {
    let (ctx, l, url) = listen(t, Context::builder()).await;
    let release = Arc::new(Notify::new());
    let r2 = release.clone();
    let handler = service_fn(move |req: Message| {
        let release = r2.clone();
        async move {
            if req.kind() == "slow.req" {
                release.notified().await;
            }
            Ok::<_, BoxError>(Some(reply_to(&req, "done.reply")))
        }
    });
    let server = serve(l, tower::make::Shared::new(handler));
    let (stop, stats) = (server.shutdown_handle(), server.stats());
    let mut task = tokio::spawn(server.into_future());
    let mut ch = ctx.connect(&url).await.unwrap();
    ch.send(m("slow.req").with_header(Header {
        flags: Flags::REQUEST,
        correlation: 7,
    }))
    .await
    .unwrap();
    eventually("the slow call started", || stats.calls() == 1).await;

    stop.shutdown();
    assert!(stop.is_shutdown());
    // Stops accepting.
    let deadline = tokio::time::Instant::now() + GUARD;
    loop {
        match timeout(Duration::from_secs(2), ctx.connect(&url)).await {
            Ok(Err(_)) => break,
            Ok(Ok(_)) | Err(_) => {
                assert!(tokio::time::Instant::now() < deadline, "still accepting");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    assert!(
        timeout(Duration::from_millis(50), &mut task).await.is_err(),
        "serve returned with a call in flight"
    );
    release.notify_one();
    let reply = timeout(GUARD, ch.recv()).await.unwrap().unwrap().unwrap();
    assert_eq!(reply.kind(), "done.reply");
    assert_eq!(reply.header().correlation, 7);
    assert!(reply.header().flags.contains(Flags::RESPONSE));
    assert!(
        timeout(GUARD, ch.recv()).await.unwrap().is_none(),
        "then closed"
    );
    timeout(GUARD, task).await.unwrap().unwrap().unwrap();
    assert_eq!((stats.active(), stats.failed()), (0, 0));
}

async fn serve_isolates_a_failing_channel(t: T) {
    let (ctx, l, url) = listen(t, Context::builder()).await;
    let make = service_fn(|inc: Incoming| async move {
        assert!(!inc.peer_url().is_empty());
        Ok::<_, BoxError>(service_fn(|req: Message| async move {
            if req.kind() == "boom.now" {
                panic!("handler bug");
            }
            Ok::<_, BoxError>(Some(reply_to(&req, "echo.reply")))
        }))
    });
    let server = serve(l, make);
    let (stop, stats) = (server.shutdown_handle(), server.stats());
    let task = tokio::spawn(server.into_future());

    let mut a = ctx.connect(&url).await.unwrap();
    let mut b = ctx.connect(&url).await.unwrap();
    b.send(m("echo.req")).await.unwrap();
    assert_eq!(
        timeout(GUARD, b.recv())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
            .kind(),
        "echo.reply"
    );
    a.send(m("boom.now")).await.unwrap();
    // `a` ends (its server half is dropped with the panicking task)...
    if let Some(Ok(unexpected)) = timeout(GUARD, a.recv()).await.unwrap() {
        panic!("reply from a panicked handler: {unexpected:?}");
    }
    eventually("the failure is counted", || stats.failed() == 1).await;
    // ...and `b` is still served, as are new channels.
    b.send(m("echo.req")).await.unwrap();
    assert_eq!(
        timeout(GUARD, b.recv())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
            .kind(),
        "echo.reply"
    );
    let mut c = ctx.connect(&url).await.unwrap();
    c.send(m("echo.req")).await.unwrap();
    assert_eq!(
        timeout(GUARD, c.recv())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
            .kind(),
        "echo.reply"
    );
    stop.shutdown();
    timeout(GUARD, task).await.unwrap().unwrap().unwrap();
    assert_eq!(stats.accepted(), 3);
}

/// `n` channels: senders on one side, receivers on the other.
async fn channels(
    t: T,
    b: ContextBuilder,
    n: usize,
) -> (
    Context,
    Vec<hyperframes::Sender>,
    Vec<hyperframes::Receiver>,
) {
    let (ctx, mut l, url) = listen(t, b).await;
    let (mut txs, mut rxs) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let (c, s) = tokio::join!(ctx.connect(&url), l.accept());
        txs.push(c.unwrap().split().0);
        rxs.push(s.unwrap().split().1);
    }
    (ctx, txs, rxs)
}

fn small_queues() -> ContextBuilder {
    Context::builder()
        .send_queue(4, 1 << 20)
        .recv_queue(4, 1 << 20)
}

fn numbered(i: usize, body: &Bytes) -> Message {
    m("data.chunk")
        .with_meta("i", i.to_string())
        .unwrap()
        .with_body(body.clone())
}

fn index(msg: &Message) -> usize {
    msg.meta().get("i").unwrap().parse().unwrap()
}

async fn fan_out_broadcast_waits_for_the_slow_consumer(t: T) {
    let (_ctx, txs, mut rxs) = channels(t, small_queues(), 3).await;
    let body = Bytes::from(vec![7u8; 256 << 10]);
    let mut out = FanOut::broadcast(txs).unwrap();
    let mut slow = rxs.pop().unwrap();
    let fast: Vec<_> = rxs
        .into_iter()
        .map(|mut rx| {
            tokio::spawn(async move {
                let mut n = 0;
                while let Some(msg) = timeout(GUARD, rx.recv()).await.unwrap() {
                    assert_eq!(index(&msg.unwrap()), n);
                    n += 1;
                }
                n
            })
        })
        .collect();
    const N: usize = 200;
    let mut sent = 0;
    while sent < N {
        match timeout(Duration::from_millis(300), out.feed(numbered(sent, &body))).await {
            Ok(r) => {
                r.unwrap();
                sent += 1;
            }
            Err(_) => break, // blocked by the slow consumer, as it should be
        }
    }
    assert!(
        sent < N,
        "broadcast never waited for the consumer that reads nothing"
    );
    // The slow consumer now reads: everything arrives everywhere, in order.
    let slow_reader = tokio::spawn(async move {
        let mut n = 0;
        while let Some(msg) = timeout(GUARD, slow.recv()).await.unwrap() {
            assert_eq!(index(&msg.unwrap()), n);
            n += 1;
        }
        n
    });
    for i in sent..N {
        timeout(GUARD, out.feed(numbered(i, &body)))
            .await
            .unwrap()
            .unwrap();
    }
    timeout(GUARD, out.close()).await.unwrap().unwrap();
    assert_eq!(timeout(GUARD, slow_reader).await.unwrap().unwrap(), N);
    for f in fast {
        assert_eq!(timeout(GUARD, f).await.unwrap().unwrap(), N);
    }
}

async fn fan_out_round_robin_skips_the_slow_consumer(t: T) {
    let (_ctx, txs, mut rxs) = channels(t, small_queues(), 3).await;
    let body = Bytes::from(vec![1u8; 256 << 10]);
    let mut out = FanOut::round_robin(txs).unwrap();
    let mut slow = rxs.pop().unwrap();
    let fast: Vec<_> = rxs
        .into_iter()
        .map(|mut rx| {
            tokio::spawn(async move {
                let mut got = Vec::new();
                while let Some(msg) = timeout(GUARD, rx.recv()).await.unwrap() {
                    got.push(index(&msg.unwrap()));
                }
                got
            })
        })
        .collect();
    const N: usize = 300;
    for i in 0..N {
        timeout(GUARD, out.feed(numbered(i, &body)))
            .await
            .expect("round-robin blocked on a full consumer")
            .unwrap();
    }
    // No flush: the stalled consumer's data cannot all reach its kernel buffers before it
    // reads. Dropping the senders closes them after what was handed over.
    let (senders, parked) = out.into_senders();
    assert!(parked.is_empty(), "round-robin never parks");
    drop(senders);
    let mut all = Vec::new();
    let mut slow_got = 0;
    while let Some(msg) = timeout(GUARD, slow.recv()).await.unwrap() {
        all.push(index(&msg.unwrap()));
        slow_got += 1;
    }
    for f in fast {
        all.extend(timeout(GUARD, f).await.unwrap().unwrap());
    }
    assert!(
        slow_got < N / 3,
        "the stalled consumer got its full share ({slow_got})"
    );
    all.sort_unstable();
    assert_eq!(all, (0..N).collect::<Vec<_>>(), "each message exactly once");
}

async fn fan_out_key_hash_keeps_keys_together(t: T) {
    let (_ctx, txs, rxs) = channels(t, small_queues(), 3).await;
    let mut out = FanOut::key_hash(txs, "stream").unwrap();
    let mut merged: FanIn = rxs.into_iter().collect();
    let keys = ["cam0", "cam1", "cam2", "cam3", "cam4", "cam5"];
    let expected: Vec<usize> = keys.iter().map(|k| out.destination_of(k)).collect();
    assert!(
        expected.iter().any(|&d| d != expected[0]),
        "the keys spread"
    );
    for i in 0..60 {
        let k = keys[i % keys.len()];
        out.feed(with("data.chunk", &[("stream", k), ("i", &i.to_string())]))
            .await
            .unwrap();
    }
    let mut err = out.send(m("data.chunk")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidMeta);
    assert!(err.to_string().contains("`stream`"), "{err}");
    assert_eq!(err.take_message(), Some(m("data.chunk")), "handed back");
    out.close().await.unwrap();
    let mut last = std::collections::HashMap::new();
    let mut n = 0;
    while let Some((src, msg)) = timeout(GUARD, merged.next()).await.unwrap() {
        let msg = msg.unwrap();
        let k = msg.meta().get("stream").unwrap();
        let ki = keys.iter().position(|x| x == &k).unwrap();
        assert_eq!(src, expected[ki], "key {k} landed on {src}");
        let i = index(&msg);
        if let Some(prev) = last.insert(k.to_owned(), i) {
            assert!(prev < i, "in order per key");
        }
        n += 1;
    }
    assert_eq!(n, 60);
}

async fn fan_in_tags_sources_and_outlives_one(t: T) {
    let (_ctx, mut txs, rxs) = channels(t, Context::builder(), 3).await;
    let mut merged = FanIn::new();
    for (i, rx) in rxs.into_iter().enumerate() {
        merged.push(format!("source-{i}"), rx);
    }
    for (i, tx) in txs.iter_mut().enumerate() {
        for j in 0..20 {
            tx.send(with(
                "data.chunk",
                &[("from", &format!("source-{i}")), ("i", &j.to_string())],
            ))
            .await
            .unwrap();
        }
    }
    // Source 1 ends early; the others go on.
    txs.remove(1).close().await.unwrap();
    let mut counts = std::collections::HashMap::new();
    let mut seen = 0;
    while seen < 60 {
        let (src, msg) = timeout(GUARD, merged.next()).await.unwrap().unwrap();
        let msg = msg.unwrap();
        assert_eq!(msg.meta().get("from"), Some(src.as_str()));
        *counts.entry(src).or_insert(0) += 1;
        seen += 1;
    }
    assert_eq!(counts.len(), 3);
    assert!(counts.values().all(|&c| c == 20));
    eventually_stream_len(&mut merged, 2).await;
    for tx in &mut txs {
        tx.send(with("data.chunk", &[("from", "late"), ("i", "0")]))
            .await
            .unwrap();
    }
    drop(txs);
    let mut late = 0;
    while let Some((_src, msg)) = timeout(GUARD, merged.next()).await.unwrap() {
        assert_eq!(msg.unwrap().meta().get("from"), Some("late"));
        late += 1;
    }
    assert_eq!(late, 2);
    assert!(merged.is_empty());
}

/// Polls the merged stream until it has noticed that sources ended, without taking items.
async fn eventually_stream_len(merged: &mut FanIn<String>, n: usize) {
    let waker = futures_util::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    let deadline = tokio::time::Instant::now() + GUARD;
    while merged.len() > n {
        assert!(tokio::time::Instant::now() < deadline);
        if let Poll::Ready(item) = merged.poll_next_unpin(&mut cx) {
            panic!("unexpected item {:?}", item.map(|(s, _)| s));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        mod inproc { $( #[tokio::test] async fn $name() { super::$name(super::T::Inproc).await } )* }
        mod tcp { $( #[tokio::test] async fn $name() { super::$name(super::T::Tcp).await } )* }
    };
}

suite!(
    sender_is_a_service,
    schema_refuses_on_the_send_side,
    schema_refuses_on_the_receive_side,
    filtered_receiver_is_diagnosable_from_the_log,
    serve_answers_every_request_it_does_not_answer_otherwise,
    client_tells_refusals_apart_by_remote_kind,
    client_pairs_reordered_replies,
    client_cancellation_frees_the_slot_and_counts_the_late_reply,
    client_fails_every_request_when_the_channel_goes,
    client_composes_with_buffer_concurrency_limit_and_timeout,
    client_composes_with_retry_and_balance,
    serve_shutdown_drains_then_closes,
    serve_isolates_a_failing_channel,
    fan_out_broadcast_waits_for_the_slow_consumer,
    fan_out_round_robin_skips_the_slow_consumer,
    fan_out_key_hash_keeps_keys_together,
    fan_in_tags_sources_and_outlives_one,
);

#[tokio::test]
async fn broadcast_shares_the_body_zero_copy() {
    let (_ctx, txs, rxs) = channels(T::Inproc, Context::builder(), 4).await;
    let body = Bytes::from(vec![42u8; 1 << 20]);
    let mut out = FanOut::broadcast(txs).unwrap();
    out.send(m("frame.raw").with_body(body.clone()))
        .await
        .unwrap();
    let mut merged: FanIn = rxs.into_iter().collect();
    let mut sources = Vec::new();
    for _ in 0..4 {
        let (src, msg) = timeout(GUARD, merged.next()).await.unwrap().unwrap();
        let got = msg.unwrap();
        let bytes = got.body().as_bytes().unwrap();
        assert_eq!(
            bytes.as_ptr(),
            body.as_ptr(),
            "the body was copied for {src}"
        );
        assert_eq!(bytes.len(), body.len());
        sources.push(src);
    }
    sources.sort_unstable();
    assert_eq!(sources, [0, 1, 2, 3]);
}

#[tokio::test]
async fn sender_call_without_poll_ready_hands_the_message_back() {
    let (_ctx, c, _s) = pair_with(T::Inproc, small_queues()).await;
    let (mut tx, _rx) = c.split();
    let mut n = 0;
    let mut err = loop {
        // Deliberately no poll_ready: the queue fills and `call` must say so.
        match tx
            .call(m("x.y").with_meta("i", n.to_string()).unwrap())
            .await
        {
            Ok(()) => n += 1,
            Err(e) => break e,
        }
        assert!(n < 100);
    };
    assert_eq!(err.kind(), ErrorKind::Full);
    assert_eq!(
        err.take_message().unwrap().meta().get("i"),
        Some(&*n.to_string())
    );
    // `poll_ready` is the way: Pending while full.
    assert!(tokio_test_sender_ready(&mut tx).is_pending());
}

/// The room a ready `poll_ready` found is the next `call`'s, unless another send takes it
/// first: then `call` asks the transport again and, the queue being full, hands the message
/// back instead of overfilling it.
#[tokio::test]
async fn sender_reservation_taken_by_another_send_is_not_used_twice() {
    let (_ctx, c, _s) = pair_with(T::Inproc, small_queues()).await;
    let (mut tx, _rx) = c.split();
    // How many messages the queues hold (nobody reads), found on a first pair.
    let mut n = 0;
    while tx.try_send(m("x.fill")).is_ok() {
        n += 1;
        assert!(n < 100);
    }
    // On a second pair, all but one place filled through poll_ready and call.
    let (_ctx, c, _s) = pair_with(T::Inproc, small_queues()).await;
    let (mut tx, _rx) = c.split();
    for _ in 0..n - 1 {
        assert!(tokio_test_sender_ready(&mut tx).is_ready());
        tx.call(m("x.fill")).await.unwrap();
    }
    // One place left: reserved by poll_ready, then taken by try_send.
    assert!(matches!(
        tokio_test_sender_ready(&mut tx),
        Poll::Ready(Ok(()))
    ));
    tx.try_send(m("x.other")).unwrap();
    let mut err = tx.call(m("x.late")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Full);
    assert_eq!(err.take_message().unwrap().kind(), "x.late");
    assert!(tokio_test_sender_ready(&mut tx).is_pending());

    // Nor does a reservation outlive closing the direction.
    let (_ctx, c, _s) = pair_with(T::Inproc, small_queues()).await;
    let (mut tx, _rx) = c.split();
    assert!(matches!(
        tokio_test_sender_ready(&mut tx),
        Poll::Ready(Ok(()))
    ));
    tx.close().await.unwrap();
    let mut err = tx.call(m("x.after")).await.unwrap_err();
    assert_eq!(err.take_message().unwrap().kind(), "x.after");
}

fn tokio_test_sender_ready(tx: &mut hyperframes::Sender) -> Poll<hyperframes::Result<()>> {
    let waker = futures_util::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    Service::<Message>::poll_ready(tx, &mut cx)
}

/// The response futures read the channel themselves, taking turns: many tasks on a
/// multi-threaded runtime, each request answered after a random delay (so replies come out
/// of order) and some requests cancelled by a short timeout, must all finish: every request
/// not cancelled gets its own reply, and no reader is lost when the one reading is cancelled
/// or answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_requests_on_many_threads_with_cancellations_all_finish() {
    let (ctx, l, url) = listen(T::Inproc, Context::builder()).await;
    let handler = service_fn(|req: Message| async move {
        let n: u64 = req.meta().get("n").unwrap().parse().unwrap();
        tokio::time::sleep(Duration::from_micros(n * 7919 % 3000)).await;
        Ok::<_, BoxError>(Some(m("echo.reply").with_body(req.body().clone())))
    });
    let server = serve(l, tower::make::Shared::new(handler));
    let stop = server.shutdown_handle();
    let task = tokio::spawn(server.into_future());
    let client = Client::new(ctx.connect(&url).await.unwrap());
    let stats = client.stats();
    let svc = ServiceBuilder::new().buffer(256).service(client);
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..16u64 {
        let mut svc = svc.clone();
        tasks.spawn(async move {
            let (mut answered, mut cancelled) = (0, 0);
            for i in 0..100u64 {
                let n = t * 1000 + i;
                let req = with("echo.req", &[("n", &n.to_string())]).with_body(n.to_string());
                let call = svc.ready().await.unwrap().call(req);
                // One request in five gets far less time than its reply may take.
                let limit = if n % 5 == 0 {
                    Duration::from_micros(300)
                } else {
                    GUARD
                };
                match timeout(limit, call).await {
                    Ok(reply) => {
                        let reply = reply.unwrap();
                        assert_eq!(reply.body().as_bytes().unwrap(), n.to_string().as_bytes());
                        answered += 1;
                    }
                    Err(_) => cancelled += 1,
                }
            }
            (answered, cancelled)
        });
    }
    let (mut answered, mut cancelled) = (0, 0);
    while let Some(r) = timeout(GUARD, tasks.join_next()).await.expect("no hang") {
        let (a, c) = r.unwrap();
        answered += a;
        cancelled += c;
    }
    assert_eq!(answered + cancelled, 1600);
    assert!(answered >= 1280, "only {answered} answered");
    eventually("every slot is free", || stats.in_flight() == 0).await;
    stop.shutdown();
    timeout(GUARD, task).await.unwrap().unwrap().unwrap();
}

/// An error reply's text and request type are the peer's words: the client's error carries
/// them escaped, so printing it cannot drive a terminal or forge a log line.
#[tokio::test]
async fn client_escapes_the_text_of_an_error_reply() {
    let (_ctx, c, s) = pair(T::Inproc).await;
    let peer = tokio::spawn(async move {
        let (mut tx, mut rx) = s.split();
        let req = timeout(GUARD, rx.recv()).await.unwrap().unwrap().unwrap();
        let reply = m(hyperframes::middleware::serve::ERROR_TYPE)
            .with_meta("request-type", "x.y\u{1b}[2J")
            .unwrap()
            .with_body("denied\r\n2026-12-03 INFO all good\u{202e}")
            .with_header(Header {
                flags: Flags::RESPONSE,
                correlation: req.header().correlation,
            });
        tx.send(reply).await.unwrap();
        (tx, rx)
    });
    let mut client = Client::new(c);
    let err = client
        .ready()
        .await
        .unwrap()
        .call(m("x.y"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Remote);
    assert_eq!(err.remote_kind(), None, "the reply named no kind");
    let text = err.to_string();
    assert!(
        text.contains(r"`x.y\u{1b}[2J`: denied\r\n2026-12-03 INFO all good\u{202e}"),
        "{text}"
    );
    assert!(!text.chars().any(char::is_control), "{text:?}");
    drop(peer.await.unwrap());
}
