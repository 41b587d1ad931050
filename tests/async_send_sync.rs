//! Compile-time checks of the auto traits of every public type and future, in the manner of
//! tokio's `tests/async_send_sync.rs`. A regression fails to compile.

#![allow(dead_code, clippy::diverging_sub_expression)]

use hyperframes::message::{InvalidMeta, InvalidType, Location, MetaIter};
use hyperframes::wire::{Batch, Decoder, FrameError, Handshake, HandshakeError};
use hyperframes::*;

fn send<T: Send>() {}
fn sync<T: Sync>() {}
fn unpin<T: Unpin>() {}
fn static_<T: 'static>() {}

macro_rules! assert_all {
    ($($t:ty),* $(,)?) => { $( let _ = send::<$t>; let _ = sync::<$t>; let _ = unpin::<$t>; )* };
}

fn require_send<T: Send>(_: &T) {}

#[test]
fn public_types_are_send_sync_unpin() {
    assert_all!(
        Context,
        ContextBuilder,
        Listener,
        Channel,
        Sender,
        Receiver,
        ChannelInfo,
        ReuniteError,
        Message,
        MsgType,
        Meta,
        MetaIter<'static>,
        Body,
        Location,
        Header,
        Flags,
        Error,
        ErrorKind,
        Endpoint,
        Address,
        Limits,
        IoEngine,
        InvalidType,
        InvalidMeta,
        Batch,
        Decoder,
        FrameError,
        Handshake,
        HandshakeError,
    );
    static_::<Sender>();
    static_::<Receiver>();
    static_::<Channel>();
}

/// The futures of every async method are `Send`, so they can be spawned on a multi-thread
/// runtime. Never run: only type-checked.
#[allow(unreachable_code, unused_variables, unused_mut)]
fn futures_are_send() {
    let ctx: Context = unimplemented!();
    let mut l: Listener = unimplemented!();
    let mut ch: Channel = unimplemented!();
    let mut tx: Sender = unimplemented!();
    let mut rx: Receiver = unimplemented!();
    let m: Message = unimplemented!();
    require_send(&ctx.bind("x"));
    require_send(&ctx.connect("x"));
    require_send(&l.accept());
    require_send(&ch.send(m.clone()));
    require_send(&ch.recv());
    require_send(&ch.flush());
    require_send(&ch.close());
    require_send(&tx.send(m));
    require_send(&tx.ready());
    require_send(&tx.flush());
    require_send(&tx.close());
    require_send(&rx.recv());
}

#[cfg(feature = "tower")]
#[test]
fn middleware_types_are_send_sync_unpin() {
    use hyperframes::middleware::*;
    type Handler = tower::util::BoxCloneSyncService<Message, Option<Message>, BoxError>;
    assert_all!(
        TypePattern,
        TypeFilterLayer,
        TypeFilterLayer<type_filter::Discard>,
        TypeFilter<Sender>,
        TypeFilter<Sender, type_filter::Discard>,
        TypeFilter<Handler, type_filter::Fallback<Handler>>,
        type_filter::Unmatched,
        FilterStats,
        MetaSchema,
        MetaSchemaLayer,
        MetaSchemaService<Sender>,
        meta_schema::SchemaViolation,
        meta_schema::Rule,
        Value,
        router::NoRoute,
        Client,
        ClientStats,
        client::future::ResponseFuture,
        ServeStats,
        ShutdownHandle,
        Incoming,
        FanOut,
        FanIn,
        FanIn<String>,
        type_filter::future::ResponseFuture<(), std::future::Ready<Result<(), Error>>, std::future::Ready<Result<(), Error>>>,
        meta_schema::future::ResponseFuture<std::future::Ready<Result<(), Error>>>,
    );
    // Not Sync (boxed routes are `BoxCloneService`), but Send, so a server can run on any
    // thread; `Serve` holds a boxed shutdown signal that is Send.
    let _ = send::<Router<Option<Message>>>;
    let _ = send::<Serve<tower::make::Shared<Handler>>>;
}

/// The middleware's futures are `Send`. Never run: only type-checked.
#[cfg(feature = "tower")]
#[allow(unreachable_code, unused_variables, unused_mut)]
fn middleware_futures_are_send() {
    use hyperframes::middleware::*;
    type Handler = tower::util::BoxCloneSyncService<Message, Option<Message>, BoxError>;
    let l: Listener = unimplemented!();
    let ch: Channel = unimplemented!();
    let h: Handler = unimplemented!();
    require_send(&serve(l, tower::make::Shared::new(h.clone())).into_future());
    require_send(&serve_channel(ch, h));
}

#[cfg(feature = "rdma")]
#[test]
fn rdma_types_are_send_sync_unpin() {
    use hyperframes::rdma::RdmaConfig;
    use hyperframes::rdma::pool::{Lease, Pool, PoolError, PoolStats};
    use hyperframes::rdma::proto::{Connection, Params, ProtoError, ReadRequest};
    use hyperframes::rdma::sim::{Faults, SimConfig, SimMr, SimStats, SimVerbs};
    use hyperframes::rdma::verbs::{Access, RemoteRegion, VerbsError};
    assert_all!(
        RdmaConfig,
        Connection,
        Params,
        ProtoError,
        ReadRequest,
        SimVerbs,
        SimMr,
        SimConfig,
        SimStats,
        Faults,
        Pool<SimVerbs>,
        Lease<SimVerbs>,
        PoolError,
        PoolStats,
        Access,
        RemoteRegion,
        VerbsError,
    );
    let (a, _b) = hyperframes::rdma::sim::pair(SimConfig::default());
    let f = hyperframes::rdma::channel_pair(a.clone(), a, RdmaConfig::default());
    require_send(&f);
}
