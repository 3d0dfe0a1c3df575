//! Node-wide series: identity and build info (on every endpoint), objects, memory, disk, file
//! descriptors and sockets, alarms, RabbitMQ's global and channel message counters, lifecycle
//! totals, and the histograms (message sizes, Warren's confirm and store latencies).

use std::fmt::Write as _;

use warren_broker::stats::Lifecycle;

use super::{PROTOCOL, QueueRow, Scrape};
use crate::{AppState, process};

/// Identity and build: on every endpoint (dashboards join on `rabbitmq_identity_info`).
pub(super) fn identity(state: &AppState, s: &Scrape) {
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
pub(super) fn node(state: &AppState, s: &mut Scrape, queues: &[QueueRow]) {
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
    redrives(state, s);
}

/// Redrive progress: tasks running, and what every task of the node did since it started
/// (`warren_redrive_messages_total{outcome}`; docs/http-queue-api.md).
fn redrives(state: &AppState, s: &Scrape) {
    let r = state.broker.redrives();
    s.set(
        "warren_redrives_running",
        "Redrive tasks moving messages now",
        r.running() as f64,
    );
    let t = r.totals();
    if let Some(c) = s.counters(
        "warren_redrive_messages_total",
        "Messages redrive tasks handled, by outcome: moved, duplicate (a destination had it already), skipped (left in the source), refused (by a destination's limit)",
        &["outcome"],
    ) {
        for (outcome, n) in [
            ("moved", &t.moved),
            ("duplicate", &t.duplicates),
            ("skipped", &t.skipped),
            ("refused", &t.refused),
        ] {
            c.with_label_values(&[outcome])
                .inc_by(n.load(std::sync::atomic::Ordering::Relaxed));
        }
    }
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
