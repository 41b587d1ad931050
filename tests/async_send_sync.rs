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
