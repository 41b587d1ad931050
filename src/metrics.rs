//! Counters and gauges through the [`metrics`](https://docs.rs/metrics) facade (feature
//! `metrics`).
//!
//! hyperframes records into the recorder the application installed: `metrics` is a facade,
//! and the Prometheus, OpenTelemetry and StatsD exporters all plug into it. Without a
//! recorder every update is a load of the global recorder and a no-op. Install the recorder
//! before the [`Context`](crate::Context)s and servers are built: the counters of a server
//! and of a channel are taken from the recorder when they are made. [`describe`] gives each
//! its help text and unit.
//!
//! | name | kind | labels | counts |
//! |---|---|---|---|
//! | `hyperframes_channels_opened_total` | counter | `transport` | channels connected or accepted (a session's channel, and each connection under it) |
//! | `hyperframes_channels_open` | gauge | `transport` | channels with a half still alive |
//! | `hyperframes_messages_sent_total` | counter | `transport` | messages a channel's `Sender` handed over, added when the channel ends ([`ChannelInfo::stats`](crate::ChannelInfo::stats) has a live channel's) |
//! | `hyperframes_message_bytes_sent_total` | counter | `transport` | their body bytes, likewise |
//! | `hyperframes_messages_received_total` | counter | `transport` | messages a channel's `Receiver` yielded, added when the channel ends |
//! | `hyperframes_message_bytes_received_total` | counter | `transport` | their body bytes, likewise |
//! | `hyperframes_unsent_messages_total` | counter | | messages a `Sender` accepted that never went out ([`ContextStats::unsent`](crate::ContextStats::unsent)) |
//! | `hyperframes_unread_messages_total` | counter | | messages that arrived for a dropped `Receiver` ([`ContextStats::unread`](crate::ContextStats::unread)) |
//! | `hyperframes_serve_channels_accepted_total` | counter | | channels `serve` accepted |
//! | `hyperframes_serve_channels_active` | gauge | | channels `serve` is handling now |
//! | `hyperframes_serve_channels_failed_total` | counter | | served channels that ended in an error |
//! | `hyperframes_serve_calls_total` | counter | | messages handed to a handler |
//! | `hyperframes_serve_responses_total` | counter | | replies sent (error replies too) |
//! | `hyperframes_serve_errors_total` | counter | | calls that failed, and replies that could not be sent |
//! | `hyperframes_serve_unanswered_total` | counter | | requests a handler gave no reply to (answered with an error) |
//! | `hyperframes_filter_unmatched_total` | counter | `filter` | messages a `TypeFilter` matched no pattern to |
//! | `hyperframes_filter_rejected_total` | counter | `filter` | … of them refused with an error |
//! | `hyperframes_filter_discarded_total` | counter | `filter` | … of them dropped (`discard()`) |
//! | `hyperframes_filter_to_fallback_total` | counter | `filter` | … of them sent to the fallback |
//! | `hyperframes_schema_refused_total` | counter | | messages a `MetaSchemaService` refused |
//! | `hyperframes_client_discarded_replies_total` | counter | | replies to requests that had been cancelled |
//! | `hyperframes_client_unsolicited_total` | counter | | messages a `Client` received that were not replies |
//!
//! The `filter` label is the name given with `TypeFilterLayer::named`, empty when it has
//! none. A [session](crate::session)'s messages count on its channel and again on each
//! connection under it (with the session's acknowledgements), as its channels do. `cargo run --example metrics --features metrics` prints them as Prometheus text.

#[cfg(feature = "metrics")]
use ::metrics::{Unit, describe_counter, describe_gauge};

/// Gives every metric above its help text and unit, in the installed recorder (exporters
/// print them as `# HELP` lines). Call it once, after installing the recorder.
#[cfg(feature = "metrics")]
pub fn describe() {
    use Unit::Count;
    describe_counter!(
        "hyperframes_channels_opened_total",
        Count,
        "Channels connected or accepted, by transport"
    );
    describe_gauge!(
        "hyperframes_channels_open",
        Count,
        "Channels with a half still alive, by transport"
    );
    describe_counter!(
        "hyperframes_messages_sent_total",
        Count,
        "Messages handed over by the Senders of channels that ended, by transport"
    );
    describe_counter!(
        "hyperframes_message_bytes_sent_total",
        Unit::Bytes,
        "Body bytes handed over by the Senders of channels that ended, by transport"
    );
    describe_counter!(
        "hyperframes_messages_received_total",
        Count,
        "Messages yielded by the Receivers of channels that ended, by transport"
    );
    describe_counter!(
        "hyperframes_message_bytes_received_total",
        Unit::Bytes,
        "Body bytes yielded by the Receivers of channels that ended, by transport"
    );
    describe_counter!(
        "hyperframes_unsent_messages_total",
        Count,
        "Messages a Sender accepted that were never handed over to the peer"
    );
    describe_counter!(
        "hyperframes_unread_messages_total",
        Count,
        "Messages that arrived for a dropped Receiver and were discarded"
    );
    describe_counter!(
        "hyperframes_serve_channels_accepted_total",
        Count,
        "Channels accepted by serve"
    );
    describe_gauge!(
        "hyperframes_serve_channels_active",
        Count,
        "Channels serve is handling now"
    );
    describe_counter!(
        "hyperframes_serve_channels_failed_total",
        Count,
        "Served channels that ended in an error"
    );
    describe_counter!(
        "hyperframes_serve_calls_total",
        Count,
        "Messages handed to a served handler"
    );
    describe_counter!(
        "hyperframes_serve_responses_total",
        Count,
        "Replies sent by serve, error replies included"
    );
    describe_counter!(
        "hyperframes_serve_errors_total",
        Count,
        "Served calls that failed, and replies that could not be sent"
    );
    describe_counter!(
        "hyperframes_serve_unanswered_total",
        Count,
        "Requests a handler gave no reply to (answered with an error reply)"
    );
    describe_counter!(
        "hyperframes_filter_unmatched_total",
        Count,
        "Messages a type filter matched no pattern to"
    );
    describe_counter!(
        "hyperframes_filter_rejected_total",
        Count,
        "Unmatched messages a type filter refused with an error"
    );
    describe_counter!(
        "hyperframes_filter_discarded_total",
        Count,
        "Unmatched messages a type filter dropped"
    );
    describe_counter!(
        "hyperframes_filter_to_fallback_total",
        Count,
        "Unmatched messages a type filter sent to its fallback"
    );
    describe_counter!(
        "hyperframes_schema_refused_total",
        Count,
        "Messages a metadata schema refused"
    );
    describe_counter!(
        "hyperframes_client_discarded_replies_total",
        Count,
        "Replies a Client discarded: their request had been cancelled"
    );
    describe_counter!(
        "hyperframes_client_unsolicited_total",
        Count,
        "Messages a Client received that were not replies"
    );
}

/// Adds `$n` to the counter `$name` (labels `$k => $v`) where feature `metrics` is on;
/// evaluates nothing where it is off.
macro_rules! count {
    ($name:literal, $n:expr $(, $k:literal => $v:expr)* $(,)?) => {{
        #[cfg(feature = "metrics")]
        ::metrics::counter!($name $(, $k => $v)*).increment($n);
        #[cfg(not(feature = "metrics"))]
        let _ = || {
            let _ = (&$n $(, &$v)*);
        };
    }};
}
pub(crate) use count;

/// A counter whose handle is taken once, where it is incremented per message; nothing where
/// feature `metrics` is off.
#[cfg_attr(not(feature = "tower"), allow(dead_code))]
#[derive(Clone)]
pub(crate) struct Counter {
    #[cfg(feature = "metrics")]
    handle: ::metrics::Counter,
}

#[cfg_attr(not(feature = "tower"), allow(dead_code))]
impl Counter {
    pub(crate) fn new(name: &'static str) -> Counter {
        #[cfg(not(feature = "metrics"))]
        let _ = name;
        Counter {
            #[cfg(feature = "metrics")]
            handle: ::metrics::counter!(name),
        }
    }

    #[inline]
    pub(crate) fn add(&self, n: u64) {
        #[cfg(feature = "metrics")]
        self.handle.increment(n);
        #[cfg(not(feature = "metrics"))]
        let _ = n;
    }
}

/// One more in a gauge (labelled by transport) while this lives.
pub(crate) struct Held {
    #[cfg(feature = "metrics")]
    handle: ::metrics::Gauge,
}

impl Held {
    /// A new channel of `transport`: counted as opened, and open until dropped.
    pub(crate) fn channel(transport: &'static str) -> Held {
        count!("hyperframes_channels_opened_total", 1, "transport" => transport);
        Held {
            #[cfg(feature = "metrics")]
            handle: {
                let g = ::metrics::gauge!("hyperframes_channels_open", "transport" => transport);
                g.increment(1.0);
                g
            },
        }
    }

    /// A gauge without labels, one more while this lives.
    #[cfg_attr(not(feature = "tower"), allow(dead_code))]
    pub(crate) fn gauge(name: &'static str) -> Held {
        #[cfg(not(feature = "metrics"))]
        let _ = name;
        Held {
            #[cfg(feature = "metrics")]
            handle: {
                let g = ::metrics::gauge!(name);
                g.increment(1.0);
                g
            },
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        #[cfg(feature = "metrics")]
        self.handle.decrement(1.0);
    }
}
