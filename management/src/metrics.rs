//! Prometheus metrics under RabbitMQ's names (rabbitmq_prometheus), so that the official
//! Grafana dashboards, which join on `rabbitmq_identity_info`, work:
//!
//! - `/metrics`: node-wide totals, per-queue series summed (RabbitMQ's aggregated default);
//! - `/metrics/per-object`: one series per queue;
//! - `/metrics/detailed?family=..&vhost=..`: only the asked families, `rabbitmq_detailed_`
//!   prefix, filtered by vhost, as RabbitMQ's detailed endpoint.
//!
//! Warren's own series (`warren_*`): the oldest ready message's age per queue, and histograms of
//! publish-to-confirm latency, segment fsync and commit latency, and group-commit sizes.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::sync::Arc;

use axum::Router;
use axum::extract::{RawQuery, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus::{GaugeVec, IntCounterVec, Opts, Registry};
use warren_broker::queue::{Queue, QueueStats};
use warren_broker::stats::Lifecycle;
use warren_store::histogram::HistogramSnapshot;

use crate::{AppState, process};

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(aggregated))
        .route("/metrics/per-object", get(per_object))
        .route("/metrics/detailed", get(detailed))
        .with_state(state)
}

/// The protocol label RabbitMQ puts on its global counters.
const PROTOCOL: (&str, &str) = ("protocol", "amqp091");

/// A registry filled at scrape time: metrics are read from the broker when asked, so nothing
/// is counted twice and nothing is kept between scrapes.
struct Scrape {
    registry: Registry,
    /// Histograms, written in the text format directly (their buckets come ready-made from
    /// lock-free recorders, which the prometheus crate's types cannot take).
    histograms: String,
}

impl Scrape {
    fn new() -> Self {
        Self {
            registry: Registry::new(),
            histograms: String::new(),
        }
    }

    fn gauge(&self, name: &str, help: &str, labels: &[&str]) -> Option<GaugeVec> {
        let g = GaugeVec::new(Opts::new(name, help), labels).ok()?;
        self.registry.register(Box::new(g.clone())).ok()?;
        Some(g)
    }

    fn set(&self, name: &str, help: &str, value: f64) {
        if let Some(g) = self.gauge(name, help, &[]) {
            g.with_label_values::<&str>(&[]).set(value);
        }
    }

    fn counters(&self, name: &str, help: &str, labels: &[&str]) -> Option<IntCounterVec> {
        let c = IntCounterVec::new(Opts::new(name, help), labels).ok()?;
        self.registry.register(Box::new(c.clone())).ok()?;
        Some(c)
    }

    fn counter(&self, name: &str, help: &str, value: u64) {
        if let Some(c) = self.counters(name, help, &[]) {
            c.with_label_values::<&str>(&[]).inc_by(value);
        }
    }

    /// A counter with RabbitMQ's `protocol="amqp091"` label.
    fn protocol_counter(&self, name: &str, help: &str, value: u64) {
        if let Some(c) = self.counters(name, help, &[PROTOCOL.0]) {
            c.with_label_values(&[PROTOCOL.1]).inc_by(value);
        }
    }

    fn histogram(&mut self, name: &str, help: &str, h: &HistogramSnapshot) {
        let out = &mut self.histograms;
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bound, n) in &h.cumulative {
            if bound.is_infinite() {
                let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
            } else {
                let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {n}");
            }
        }
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", h.sum, h.count);
    }

    fn render(&self) -> Response {
        let mut buf = String::new();
        crate::prom_text::encode(&self.registry.gather(), &mut buf);
        buf.push_str(&self.histograms);
        (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            buf,
        )
            .into_response()
    }
}

/// Identity and build: on every endpoint (dashboards join on `rabbitmq_identity_info`).
fn identity(state: &AppState, s: &Scrape) {
    let node = state.node.node.as_str();
    if let Some(g) = s.gauge(
        "rabbitmq_identity_info",
        "RabbitMQ node & cluster identity info",
        &[
            "rabbitmq_node",
            "rabbitmq_cluster",
            "rabbitmq_cluster_permanent_id",
        ],
    ) {
        g.with_label_values(&[node, &state.node.cluster_name, &state.node.cluster_name])
            .set(1.0);
    }
    if let Some(g) = s.gauge(
        "rabbitmq_build_info",
        "RabbitMQ & Erlang/OTP version info",
        &[
            "rabbitmq_version",
            "prometheus_plugin_version",
            "prometheus_client_version",
            "erlang_version",
            "product_name",
            "product_version",
        ],
    ) {
        let v = warren_amqp::connection::WARREN_VERSION;
        let id = &state.node.identity;
        let erlang = format!("Warren {v}");
        g.with_label_values(&[
            crate::RABBITMQ_API_VERSION,
            v,
            v,
            &erlang,
            &id.product,
            &id.version,
        ])
        .set(1.0);
    }
}

/// Node-wide series of `/metrics` and `/metrics/per-object`: objects, resources, alarms,
/// message counters, lifecycle totals and Warren's histograms.
fn node(state: &AppState, s: &mut Scrape, queues: &[QueueRow]) {
    identity(state, s);
    let b = &state.broker;
    let consumers: u64 = queues.iter().map(|r| r.stats.consumers).sum();
    for (name, help, v) in [
        (
            "rabbitmq_connections",
            "Connections currently open",
            b.connection_count() as f64,
        ),
        (
            "rabbitmq_channels",
            "Channels currently open",
            b.channel_count() as f64,
        ),
        (
            "rabbitmq_consumers",
            "Consumers currently connected",
            consumers as f64,
        ),
        (
            "rabbitmq_channel_consumers",
            "Consumers on a channel",
            consumers as f64,
        ),
        (
            "rabbitmq_erlang_uptime_seconds",
            "Node uptime",
            state.started.elapsed().as_secs_f64(),
        ),
    ] {
        s.set(name, help, v);
    }
    resources(state, s);
    let st = b.alarms().state();
    for (name, help, on) in [
        (
            "rabbitmq_alarms_memory_used_watermark",
            "is 1 if VM memory watermark alarm is in effect",
            st.memory,
        ),
        (
            "rabbitmq_alarms_free_disk_space_watermark",
            "is 1 if free disk space watermark alarm is in effect",
            st.disk,
        ),
        // Warren has no file descriptor alarm: connections over the limit are refused by the
        // kernel's accept, never admitted half-way.
        (
            "rabbitmq_alarms_file_descriptor_limit",
            "is 1 if file descriptor limit alarm is in effect",
            false,
        ),
    ] {
        s.set(name, help, f64::from(u8::from(on)));
    }
    // rabbit_global_counters' gauges, labelled by protocol as RabbitMQ labels them.
    for (name, help, v) in [
        (
            "rabbitmq_global_publishers",
            "Current number of publishers",
            b.stats().publishers(),
        ),
        (
            "rabbitmq_global_consumers",
            "Current number of consumers",
            consumers,
        ),
    ] {
        if let Some(g) = s.gauge(name, help, &[PROTOCOL.0]) {
            g.with_label_values(&[PROTOCOL.1]).set(v as f64);
        }
    }
    message_counters(state, s);
    lifecycle(state, s);
    histograms(state, s);
}

/// Memory, disk, file descriptors and sockets.
fn resources(state: &AppState, s: &Scrape) {
    let alarms = state.broker.alarms();
    let w = alarms.watermarks();
    if let Some(sample) = alarms.last_sample() {
        for (name, help, v) in [
            (
                "rabbitmq_process_resident_memory_bytes",
                "Memory used in bytes",
                sample.memory_used,
            ),
            (
                "rabbitmq_resident_memory_limit_bytes",
                "Memory high watermark in bytes",
                w.memory_limit(sample.memory_total),
            ),
            (
                "rabbitmq_disk_space_available_bytes",
                "Disk space available in bytes",
                sample.disk_free,
            ),
            (
                "rabbitmq_disk_space_available_limit_bytes",
                "Free disk space low watermark in bytes",
                w.disk_limit(sample.memory_total),
            ),
        ] {
            s.set(name, help, v as f64);
        }
    }
    let max_fds = process::max_fds();
    if let Some(n) = process::open_fds() {
        s.set(
            "rabbitmq_process_open_fds",
            "Open file descriptors",
            n as f64,
        );
    }
    if let Some(n) = max_fds {
        s.set(
            "rabbitmq_process_max_fds",
            "Open file descriptors limit",
            n as f64,
        );
    }
    s.set(
        "rabbitmq_process_open_tcp_sockets",
        "Open TCP sockets",
        state.broker.connection_count() as f64,
    );
    let socket_limit = match (state.broker.config.connection_max, max_fds) {
        (Some(c), Some(f)) => Some(c.min(f)),
        (c, f) => c.or(f),
    };
    if let Some(n) = socket_limit {
        s.set(
            "rabbitmq_process_max_tcp_sockets",
            "Open TCP sockets limit",
            n as f64,
        );
    }
}

/// RabbitMQ's global counters (with `protocol`) and the channel counters its Overview
/// dashboard sums (one node-wide series each: Warren keeps no per-channel history).
fn message_counters(state: &AppState, s: &Scrape) {
    let t = state.broker.stats().snapshot();
    let delivered_ack = t.delivered - t.delivered_no_ack;
    let got_ack = t.got - t.got_no_ack;
    for (name, help, v) in [
        (
            "rabbitmq_global_messages_received_total",
            "Total number of messages received from publishers",
            t.published,
        ),
        (
            "rabbitmq_global_messages_routed_total",
            "Total number of messages routed to queues or streams",
            t.routed,
        ),
        (
            "rabbitmq_global_messages_unroutable_dropped_total",
            "Total number of messages published as non-mandatory into an exchange and dropped as unroutable",
            t.unroutable_dropped,
        ),
        (
            "rabbitmq_global_messages_unroutable_returned_total",
            "Total number of messages published as mandatory into an exchange and returned to the publisher as unroutable",
            t.unroutable_returned,
        ),
        (
            "rabbitmq_global_messages_confirmed_total",
            "Total number of messages confirmed to publishers",
            t.confirmed,
        ),
        (
            "rabbitmq_global_messages_delivered_total",
            "Total number of messages delivered to consumers",
            t.delivered + t.got,
        ),
        (
            "rabbitmq_global_messages_delivered_consume_manual_ack_total",
            "Total number of messages delivered to consumers using basic.consume with manual acknowledgment",
            delivered_ack,
        ),
        (
            "rabbitmq_global_messages_delivered_consume_auto_ack_total",
            "Total number of messages delivered to consumers using basic.consume with automatic acknowledgment",
            t.delivered_no_ack,
        ),
        (
            "rabbitmq_global_messages_delivered_get_manual_ack_total",
            "Total number of messages delivered to consumers using basic.get with manual acknowledgment",
            got_ack,
        ),
        (
            "rabbitmq_global_messages_delivered_get_auto_ack_total",
            "Total number of messages delivered to consumers using basic.get with automatic acknowledgment",
            t.got_no_ack,
        ),
        (
            "rabbitmq_global_messages_get_empty_total",
            "Total number of times basic.get operations fetched no message",
            t.get_empty,
        ),
        (
            "rabbitmq_global_messages_redelivered_total",
            "Total number of messages redelivered to consumers",
            t.redelivered,
        ),
        (
            "rabbitmq_global_messages_acknowledged_total",
            "Total number of messages acknowledged by consumers",
            t.acked,
        ),
    ] {
        s.protocol_counter(name, help, v);
    }
    for (name, help, v) in [
        (
            "rabbitmq_channel_messages_published_total",
            "Total number of messages published into an exchange on a channel",
            t.published,
        ),
        (
            "rabbitmq_channel_messages_confirmed_total",
            "Total number of messages published into an exchange and confirmed on the channel",
            t.confirmed,
        ),
        (
            "rabbitmq_channel_messages_unroutable_dropped_total",
            "Total number of messages published as non-mandatory into an exchange and dropped as unroutable",
            t.unroutable_dropped,
        ),
        (
            "rabbitmq_channel_messages_unroutable_returned_total",
            "Total number of messages published as mandatory into an exchange and returned to the publisher as unroutable",
            t.unroutable_returned,
        ),
        (
            "rabbitmq_channel_messages_delivered_ack_total",
            "Total number of messages delivered to consumers in manual acknowledgement mode",
            delivered_ack,
        ),
        (
            "rabbitmq_channel_messages_delivered_total",
            "Total number of messages delivered to consumers in automatic acknowledgement mode",
            t.delivered_no_ack,
        ),
        (
            "rabbitmq_channel_messages_redelivered_total",
            "Total number of messages redelivered to consumers",
            t.redelivered,
        ),
        (
            "rabbitmq_channel_messages_acked_total",
            "Total number of messages acknowledged by consumers",
            t.acked,
        ),
        (
            "rabbitmq_channel_get_ack_total",
            "Total number of messages fetched with basic.get in manual acknowledgement mode",
            got_ack,
        ),
        (
            "rabbitmq_channel_get_total",
            "Total number of messages fetched with basic.get in automatic acknowledgement mode",
            t.got_no_ack,
        ),
        (
            "rabbitmq_channel_get_empty_total",
            "Total number of times basic.get operations fetched no message",
            t.get_empty,
        ),
    ] {
        s.counter(name, help, v);
    }
    s.protocol_counter(
        "rabbitmq_global_messages_received_confirm_total",
        "Total number of messages received from publishers expecting confirmations",
        t.received_confirm,
    );
    s.set(
        "rabbitmq_channel_messages_unconfirmed",
        "Published but not yet confirmed messages",
        t.unconfirmed() as f64,
    );
}

fn lifecycle(state: &AppState, s: &Scrape) {
    let st = state.broker.stats();
    for (name, help, e) in [
        (
            "rabbitmq_connections_opened_total",
            "Total number of connections opened",
            Lifecycle::ConnectionOpened,
        ),
        (
            "rabbitmq_connections_closed_total",
            "Total number of connections closed or terminated",
            Lifecycle::ConnectionClosed,
        ),
        (
            "rabbitmq_channels_opened_total",
            "Total number of channels opened",
            Lifecycle::ChannelOpened,
        ),
        (
            "rabbitmq_channels_closed_total",
            "Total number of channels closed",
            Lifecycle::ChannelClosed,
        ),
        (
            "rabbitmq_queues_declared_total",
            "Total number of queues declared",
            Lifecycle::QueueDeclared,
        ),
        (
            "rabbitmq_queues_created_total",
            "Total number of queues created",
            Lifecycle::QueueCreated,
        ),
        (
            "rabbitmq_queues_deleted_total",
            "Total number of queues deleted",
            Lifecycle::QueueDeleted,
        ),
    ] {
        s.counter(name, help, st.events(e));
    }
}

/// `rabbitmq_message_size_bytes{protocol="amqp091"}` (rabbit_msg_size_metrics): the body
/// sizes of published messages.
fn message_sizes(state: &AppState, s: &mut Scrape) {
    let t = state.broker.stats().snapshot();
    let name = "rabbitmq_message_size_bytes";
    let out = &mut s.histograms;
    let _ = writeln!(
        out,
        "# HELP {name} Size of messages received from publishers\n# TYPE {name} histogram"
    );
    let mut cumulative = 0;
    for (i, n) in t.message_sizes.iter().enumerate() {
        cumulative += n;
        let le = warren_broker::stats::MESSAGE_SIZE_BOUNDS
            .get(i)
            .map_or_else(|| "+Inf".to_string(), u64::to_string);
        let _ = writeln!(
            out,
            "{name}_bucket{{protocol=\"{}\",le=\"{le}\"}} {cumulative}",
            PROTOCOL.1
        );
    }
    let _ = writeln!(
        out,
        "{name}_sum{{protocol=\"{p}\"}} {}\n{name}_count{{protocol=\"{p}\"}} {cumulative}",
        t.message_bytes,
        p = PROTOCOL.1
    );
}

fn histograms(state: &AppState, s: &mut Scrape) {
    message_sizes(state, s);
    let confirm = state.broker.stats().confirm_seconds.snapshot();
    s.histogram(
        "warren_publish_confirm_seconds",
        "Time from a confirm-mode publish to its basic.ack or basic.nack",
        &confirm,
    );
    if let Some(m) = state.broker.store_metrics() {
        s.histogram(
            "warren_store_fsync_seconds",
            "Duration of each message segment fdatasync",
            &m.fsync_seconds.snapshot(),
        );
        s.histogram(
            "warren_store_commit_seconds",
            "Duration of each group commit (segment append, fdatasync, index transaction)",
            &m.commit_seconds.snapshot(),
        );
        s.histogram(
            "warren_store_group_commit_batches",
            "Submissions merged into each group commit",
            &m.group_commit_batches.snapshot(),
        );
    }
}

/// One queue's numbers, read once per scrape.
struct QueueRow {
    vhost: String,
    queue: Arc<Queue>,
    stats: QueueStats,
}

/// Every queue (of `vhosts`, when given) with its stats.
fn queue_rows(state: &AppState, vhosts: Option<&BTreeSet<String>>) -> Vec<QueueRow> {
    let mut rows = Vec::new();
    for name in state.broker.list_vhosts() {
        if vhosts.is_some_and(|v| !v.contains(&name)) {
            continue;
        }
        let Some(vh) = state.broker.vhost(&name) else {
            continue;
        };
        for queue in vh.queues() {
            let stats = queue.stats();
            rows.push(QueueRow {
                vhost: vh.name.clone(),
                queue,
                stats,
            });
        }
    }
    rows
}

/// Which of RabbitMQ's metric families a per-queue series belongs to (for `/metrics/detailed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    QueueCoarse,
    QueueConsumerCount,
    Queue,
}

impl Family {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "queue_coarse_metrics" => Some(Self::QueueCoarse),
            "queue_consumer_count" => Some(Self::QueueConsumerCount),
            "queue_metrics" => Some(Self::Queue),
            _ => None,
        }
    }
}

/// A per-queue series: name without prefix, help, family, whether it is a counter, value.
type QueueSeries = (
    &'static str,
    &'static str,
    Family,
    bool,
    fn(&QueueStats) -> f64,
);

const QUEUE_SERIES: &[QueueSeries] = &[
    (
        "queue_messages_ready",
        "Messages ready to be delivered to consumers",
        Family::QueueCoarse,
        false,
        |s| s.ready as f64,
    ),
    (
        "queue_messages_unacked",
        "Messages delivered to consumers but not yet acknowledged",
        Family::QueueCoarse,
        false,
        |s| s.unacked as f64,
    ),
    (
        "queue_messages",
        "Sum of ready and unacknowledged messages - total queue depth",
        Family::QueueCoarse,
        false,
        |s| (s.ready + s.unacked) as f64,
    ),
    (
        "queue_consumers",
        "Consumers on a queue",
        Family::QueueConsumerCount,
        false,
        |s| s.consumers as f64,
    ),
    (
        "queue_messages_bytes",
        "Size in bytes of ready and unacknowledged messages",
        Family::Queue,
        false,
        |s| (s.ready_bytes + s.unacked_bytes) as f64,
    ),
    (
        "queue_messages_ready_bytes",
        "Size in bytes of ready messages",
        Family::Queue,
        false,
        |s| s.ready_bytes as f64,
    ),
    (
        "queue_messages_unacked_bytes",
        "Size in bytes of all unacknowledged messages",
        Family::Queue,
        false,
        |s| s.unacked_bytes as f64,
    ),
    (
        "queue_messages_published_total",
        "Total number of messages published to queues",
        Family::Queue,
        true,
        |s| s.counters.enqueued as f64,
    ),
];

/// Warren's oldest-ready-age series (seconds; queues with nothing ready report 0).
const OLDEST_READY: &str = "queue_oldest_ready_message_age_seconds";
const OLDEST_READY_HELP: &str = "How long the oldest ready message of a queue has waited";

fn oldest_ready_seconds(s: &QueueStats) -> f64 {
    s.oldest_ready_age_ms.unwrap_or(0) as f64 / 1000.0
}

/// Per-queue series: labelled (`vhost`, `queue`) when `per_object`, else summed into one
/// series each (the oldest age takes the maximum instead: a sum of ages means nothing).
fn queues(state: &AppState, s: &Scrape, rows: &[QueueRow], per_object: bool) {
    let labels: &[&str] = if per_object { &["vhost", "queue"] } else { &[] };
    for (name, help, _, counter, value) in QUEUE_SERIES {
        let name = format!("rabbitmq_{name}");
        if *counter {
            let Some(c) = s.counters(&name, help, labels) else {
                continue;
            };
            if per_object {
                for r in rows {
                    c.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                        .inc_by(value(&r.stats) as u64);
                }
            } else {
                c.with_label_values::<&str>(&[])
                    .inc_by(rows.iter().map(|r| value(&r.stats) as u64).sum());
            }
        } else {
            let Some(g) = s.gauge(&name, help, labels) else {
                continue;
            };
            if per_object {
                for r in rows {
                    g.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                        .set(value(&r.stats));
                }
            } else {
                g.with_label_values::<&str>(&[])
                    .set(rows.iter().map(|r| value(&r.stats)).sum());
            }
        }
    }
    let name = format!("warren_{OLDEST_READY}");
    if let Some(g) = s.gauge(&name, OLDEST_READY_HELP, labels) {
        if per_object {
            for r in rows {
                g.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                    .set(oldest_ready_seconds(&r.stats));
            }
        } else {
            let max = rows
                .iter()
                .map(|r| oldest_ready_seconds(&r.stats))
                .fold(0.0, f64::max);
            g.with_label_values::<&str>(&[]).set(max);
        }
    }
    s.set("rabbitmq_queues", "Queues available", rows.len() as f64);
    raft(state, s, rows, labels, per_object);
    streams(s, rows);
}

/// Warren's stream series, on both endpoints and always labelled: a stream's offsets and
/// segments (`vhost`, `queue`), and each tracked consumer's position and lag (`vhost`,
/// `queue`, `consumer`: at most `TRACKED_NAMES_MAX` per stream). A sum of lags over
/// consumers would mean nothing, so there is no aggregated form.
fn streams(s: &Scrape, rows: &[QueueRow]) {
    let now = warren_broker::timers::wall_ms();
    let stats: Vec<(&QueueRow, warren_broker::queue::stream::StreamStats)> = rows
        .iter()
        .filter_map(|r| r.queue.stream().map(|st| (r, st.stats(now))))
        .collect();
    if stats.is_empty() {
        return;
    }
    type PerStream = (
        &'static str,
        &'static str,
        fn(&warren_broker::queue::stream::StreamStats) -> f64,
    );
    const PER_STREAM: &[PerStream] = &[
        (
            "warren_stream_first_offset",
            "First offset a stream holds",
            |st| st.first_offset as f64,
        ),
        (
            "warren_stream_next_offset",
            "Offset the next message of a stream gets",
            |st| st.next_offset as f64,
        ),
        (
            "warren_stream_segments",
            "Segment files of a stream",
            |st| st.segments as f64,
        ),
        ("warren_stream_bytes", "Bytes a stream holds", |st| {
            st.bytes as f64
        }),
    ];
    for (name, help, value) in PER_STREAM {
        if let Some(g) = s.gauge(name, help, &["vhost", "queue"]) {
            for (r, st) in &stats {
                g.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                    .set(value(st));
            }
        }
    }
    type PerConsumer = (
        &'static str,
        &'static str,
        fn(&warren_broker::queue::stream::TrackedLag) -> f64,
    );
    const PER_CONSUMER: &[PerConsumer] = &[
        (
            "warren_stream_consumer_offset",
            "First offset a named stream consumer has not acknowledged",
            |t| t.offset as f64,
        ),
        (
            "warren_stream_consumer_lag_messages",
            "Messages between a named stream consumer and the end of the stream",
            |t| t.lag.messages as f64,
        ),
        (
            "warren_stream_consumer_lag_seconds",
            "Age of the oldest message a named stream consumer has not read",
            |t| t.lag.age_ms as f64 / 1000.0,
        ),
        (
            "warren_stream_consumer_lost_to_retention_messages",
            "Messages a named stream consumer never read that retention already dropped",
            |t| t.lag.lost_to_retention as f64,
        ),
    ];
    for (name, help, value) in PER_CONSUMER {
        if let Some(g) = s.gauge(name, help, &["vhost", "queue", "consumer"]) {
            for (r, st) in &stats {
                for t in &st.tracked {
                    g.with_label_values(&[
                        r.vhost.as_str(),
                        r.queue.name.as_str(),
                        t.name.as_str(),
                    ])
                    .set(value(t));
                }
            }
        }
    }
}

/// rabbitmq_prometheus' Raft series of quorum queues (this node's replica of each), under
/// RabbitMQ 3.x's names (`rabbitmq_raft_log_*_index`, `rabbitmq_raft_term_total`,
/// `rabbitmq_raft_entry_commit_latency_seconds`) and 4.x's (`rabbitmq_raft_*_index`,
/// `rabbitmq_raft_term`, `rabbitmq_raft_commit_latency_seconds`), so both generations of the
/// Quorum-Queues-Raft dashboard have data. (name, help, counter, value)
type RaftSeries = (&'static str, &'static str, bool, fn(&RaftView) -> f64);

/// What the Raft series report of one quorum queue on this node.
struct RaftView {
    term: u64,
    /// The last index applied here (Warren's replicas apply what commits, so this is also
    /// the commit index they report).
    applied: u64,
    last_written: u64,
    snapshot: u64,
    /// The node's mean publish-to-confirm time in seconds (quorum queues confirm once the
    /// entry committed): Warren keeps no commit latency per queue.
    commit_latency_s: f64,
}

const RAFT_SERIES: &[RaftSeries] = &[
    ("raft_term_total", "Current Raft term number", true, |r| {
        r.term as f64
    }),
    ("raft_term", "Current Raft term number", false, |r| {
        r.term as f64
    }),
    (
        "raft_log_last_applied_index",
        "Raft log last applied index",
        false,
        |r| r.applied as f64,
    ),
    ("raft_last_applied", "Last applied index", false, |r| {
        r.applied as f64
    }),
    (
        "raft_log_commit_index",
        "Raft log commit index",
        false,
        |r| r.applied as f64,
    ),
    ("raft_commit_index", "Commit index", false, |r| {
        r.applied as f64
    }),
    (
        "raft_log_last_written_index",
        "Raft log last written index",
        false,
        |r| r.last_written as f64,
    ),
    (
        "raft_last_written_index",
        "Last written index",
        false,
        |r| r.last_written as f64,
    ),
    (
        "raft_log_snapshot_index",
        "Raft log snapshot index",
        false,
        |r| r.snapshot as f64,
    ),
    ("raft_snapshot_index", "Snapshot index", false, |r| {
        r.snapshot as f64
    }),
    (
        "raft_entry_commit_latency_seconds",
        "Time taken for an entry to be committed",
        false,
        |r| r.commit_latency_s,
    ),
    (
        "raft_commit_latency_seconds",
        "Time taken for an entry to be committed",
        false,
        |r| r.commit_latency_s,
    ),
];

/// Per quorum queue when `per_object` (labelled `vhost`, `queue`), else summed, as
/// rabbitmq_prometheus aggregates them. A single node's quorum queue has no Raft log: it
/// reports term 1, the state changes its machine applied (enqueues and removals) as its
/// indices, and no snapshot.
fn raft(state: &AppState, s: &Scrape, rows: &[QueueRow], labels: &[&str], per_object: bool) {
    let confirm = state.broker.stats().confirm_seconds.snapshot();
    let commit_latency_s = if confirm.count == 0 {
        0.0
    } else {
        confirm.sum / confirm.count as f64
    };
    let states: Vec<(&QueueRow, RaftView)> = rows
        .iter()
        .filter_map(|r| {
            if let Some(x) = r.queue.replica() {
                let st = x.replica_state(false);
                return Some((
                    r,
                    RaftView {
                        term: st.term,
                        applied: st.applied_index,
                        last_written: st.last_written_index,
                        snapshot: st.snapshot_index,
                        commit_latency_s,
                    },
                ));
            }
            if !r.queue.is_quorum {
                return None;
            }
            let c = &r.stats.counters;
            let applied = c.enqueued + c.settled + c.discarded + c.purged + c.dropped + c.expired;
            Some((
                r,
                RaftView {
                    term: 1,
                    applied,
                    last_written: applied,
                    snapshot: 0,
                    commit_latency_s,
                },
            ))
        })
        .collect();
    if states.is_empty() {
        return;
    }
    for (name, help, counter, value) in RAFT_SERIES {
        let name = format!("rabbitmq_{name}");
        if *counter {
            let Some(c) = s.counters(&name, help, labels) else {
                continue;
            };
            if per_object {
                for (r, st) in &states {
                    c.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                        .inc_by(value(st) as u64);
                }
            } else {
                c.with_label_values::<&str>(&[])
                    .inc_by(states.iter().map(|(_, st)| value(st) as u64).sum());
            }
        } else {
            let Some(g) = s.gauge(&name, help, labels) else {
                continue;
            };
            if per_object {
                for (r, st) in &states {
                    g.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                        .set(value(st));
                }
            } else if name.ends_with("latency_seconds") {
                // Aggregated, a latency is the worst queue's (rabbitmq_prometheus' max_).
                g.with_label_values::<&str>(&[])
                    .set(states.iter().map(|(_, st)| value(st)).fold(0.0, f64::max));
            } else {
                g.with_label_values::<&str>(&[])
                    .set(states.iter().map(|(_, st)| value(st)).sum());
            }
        }
    }
}

async fn aggregated(State(state): State<AppState>) -> Response {
    let mut s = Scrape::new();
    let rows = queue_rows(&state, None);
    node(&state, &mut s, &rows);
    queues(&state, &s, &rows, false);
    s.render()
}

async fn per_object(State(state): State<AppState>) -> Response {
    let mut s = Scrape::new();
    let rows = queue_rows(&state, None);
    node(&state, &mut s, &rows);
    queues(&state, &s, &rows, true);
    s.render()
}

/// RabbitMQ's `/metrics/detailed`: only the families asked for (`family=`, repeatable), of
/// the vhosts asked for (`vhost=`, repeatable; all when absent), with the `rabbitmq_detailed_`
/// prefix; identity and build always. Families Warren does not have are ignored, as RabbitMQ
/// ignores unknown ones. Warren's oldest-ready age comes with `queue_metrics`.
async fn detailed(State(state): State<AppState>, RawQuery(query): RawQuery) -> Response {
    let mut families = Vec::new();
    let mut vhosts = BTreeSet::new();
    for (k, v) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match &*k {
            "family" => families.extend(Family::parse(&v)),
            "vhost" => {
                vhosts.insert(v.into_owned());
            }
            _ => {}
        }
    }
    let s = Scrape::new();
    identity(&state, &s);
    if !families.is_empty() {
        let rows = queue_rows(&state, (!vhosts.is_empty()).then_some(&vhosts));
        for (name, help, family, counter, value) in QUEUE_SERIES {
            if !families.contains(family) {
                continue;
            }
            let name = format!("rabbitmq_detailed_{name}");
            let labels = ["vhost", "queue"];
            if *counter {
                if let Some(c) = s.counters(&name, help, &labels) {
                    for r in &rows {
                        c.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                            .inc_by(value(&r.stats) as u64);
                    }
                }
            } else if let Some(g) = s.gauge(&name, help, &labels) {
                for r in &rows {
                    g.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                        .set(value(&r.stats));
                }
            }
        }
        if families.contains(&Family::Queue)
            && let Some(g) = s.gauge(
                &format!("warren_detailed_{OLDEST_READY}"),
                OLDEST_READY_HELP,
                &["vhost", "queue"],
            )
        {
            for r in &rows {
                g.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                    .set(oldest_ready_seconds(&r.stats));
            }
        }
    }
    s.render()
}
