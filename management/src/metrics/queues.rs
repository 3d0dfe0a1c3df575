//! Per-queue series (`rabbitmq_queue_*` and Warren's oldest ready message age): labelled per
//! queue on `/metrics/per-object`, summed on `/metrics`, and the families `/metrics/detailed`
//! can ask for.

use warren_broker::queue::QueueStats;

use super::raft::raft;
use super::streams::streams;
use super::work::work;
use super::{QueueRow, Scrape, per_queue};
use crate::AppState;

/// Which of RabbitMQ's metric families a per-queue series belongs to (for `/metrics/detailed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Family {
    QueueCoarse,
    QueueConsumerCount,
    Queue,
}

impl Family {
    pub(super) fn parse(s: &str) -> Option<Self> {
        match s {
            "queue_coarse_metrics" => Some(Self::QueueCoarse),
            "queue_consumer_count" => Some(Self::QueueConsumerCount),
            "queue_metrics" => Some(Self::Queue),
            _ => None,
        }
    }
}

/// A per-queue series: name without prefix, help, family, whether it is a counter, value.
pub(super) type QueueSeries = (
    &'static str,
    &'static str,
    Family,
    bool,
    fn(&QueueStats) -> f64,
);

pub(super) const QUEUE_SERIES: &[QueueSeries] = &[
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
pub(super) const OLDEST_READY: &str = "queue_oldest_ready_message_age_seconds";
pub(super) const OLDEST_READY_HELP: &str =
    "How long the oldest ready message of a queue has waited";

pub(super) fn oldest_ready_seconds(s: &QueueStats) -> f64 {
    s.oldest_ready_age_ms.unwrap_or(0) as f64 / 1000.0
}

/// Per-queue series: labelled (`vhost`, `queue`) when `per_object`, else summed into one
/// series each (the oldest age takes the maximum instead: a sum of ages means nothing).
pub(super) fn queues(state: &AppState, s: &mut Scrape, rows: &[QueueRow], per_object: bool) {
    let labels: &[&str] = if per_object { &["vhost", "queue"] } else { &[] };
    for (name, help, _, counter, value) in QUEUE_SERIES {
        let name = format!("rabbitmq_{name}");
        per_queue(
            s,
            rows,
            labels,
            per_object,
            (&name, help, *counter, false),
            *value,
        );
    }
    let name = format!("warren_{OLDEST_READY}");
    let series = (name.as_str(), OLDEST_READY_HELP, false, true);
    per_queue(s, rows, labels, per_object, series, oldest_ready_seconds);
    work(s, rows, labels, per_object);
    s.set("rabbitmq_queues", "Queues available", rows.len() as f64);
    raft(state, s, rows, labels, per_object);
    streams(s, rows);
    super::groups::groups(state, s);
}
