//! Node-wide message counters (publish, deliver, get, ack, redeliver, confirm) for the
//! management API's rates and Prometheus' `rabbitmq_global_messages_*_total`.
//!
//! Connections count in plain per-session counters and add them here once per wake-up
//! ([`GlobalStats::add`]), so the hot path touches no shared cache line per message.

use std::sync::atomic::{AtomicU64, Ordering};
use warren_store::histogram::{Histogram, LATENCY_BOUNDS};

/// A set of counts (a delta from one session, or a snapshot of the totals).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MessageStats {
    /// Messages published (basic.publish received).
    pub published: u64,
    /// Messages delivered to consumers (basic.deliver).
    pub delivered: u64,
    /// Messages fetched with basic.get.
    pub got: u64,
    /// Deliveries and gets with the redelivered flag.
    pub redelivered: u64,
    /// Messages acknowledged by clients.
    pub acked: u64,
    /// Publishes confirmed to publishers.
    pub confirmed: u64,
    /// Of `delivered`, those to no-ack consumers.
    pub delivered_no_ack: u64,
    /// Of `got`, those with no-ack.
    pub got_no_ack: u64,
    /// basic.get answered get-empty.
    pub get_empty: u64,
    /// Publishes that reached at least one queue.
    pub routed: u64,
    /// Publishes that reached no queue and were dropped (not mandatory).
    pub unroutable_dropped: u64,
    /// Publishes that reached no queue and were returned (mandatory).
    pub unroutable_returned: u64,
    /// Publishes on channels in confirm mode.
    pub received_confirm: u64,
    /// Publishes nacked to publishers.
    pub nacked: u64,
    /// Confirm-mode publishes whose channel closed before they were confirmed.
    pub confirm_abandoned: u64,
    /// Published messages by body size: `message_sizes[i]` counts those of at most
    /// [`MESSAGE_SIZE_BOUNDS`]`[i]` bytes and more than the bound before (not cumulative).
    pub message_sizes: [u64; MESSAGE_SIZE_BUCKETS],
    /// Body bytes of all published messages.
    pub message_bytes: u64,
}

/// Upper bounds of `rabbitmq_message_size_bytes` in bytes (rabbit_msg_size_metrics; the last
/// bucket, +Inf, is RabbitMQ's `infinity`, at most the 512 MiB a message can have).
pub const MESSAGE_SIZE_BOUNDS: [u64; MESSAGE_SIZE_BUCKETS - 1] = [
    100,
    1_000,
    10_000,
    100_000,
    1_000_000,
    10_000_000,
    50_000_000,
    100_000_000,
];

/// Buckets of the message size histogram, +Inf included.
pub const MESSAGE_SIZE_BUCKETS: usize = 9;

impl MessageStats {
    /// Count one published message of `size` body bytes in the size histogram.
    pub fn observe_message_size(&mut self, size: u64) {
        let i = MESSAGE_SIZE_BOUNDS.partition_point(|&b| b < size);
        self.message_sizes[i] += 1;
        self.message_bytes += size;
    }

    /// Confirm-mode publishes not yet acked or nacked (RabbitMQ's `messages_unconfirmed`).
    #[must_use]
    pub fn unconfirmed(&self) -> u64 {
        self.received_confirm
            .saturating_sub(self.confirmed + self.nacked + self.confirm_abandoned)
    }
}

impl MessageStats {
    /// How many counts there are.
    pub const FIELDS: usize = 16 + MESSAGE_SIZE_BUCKETS;

    /// The counts in field order (what [`GlobalStats`] keeps as atomics).
    #[must_use]
    pub fn to_array(&self) -> [u64; Self::FIELDS] {
        let s = &self.message_sizes;
        [
            self.published,
            self.delivered,
            self.got,
            self.redelivered,
            self.acked,
            self.confirmed,
            self.delivered_no_ack,
            self.got_no_ack,
            self.get_empty,
            self.routed,
            self.unroutable_dropped,
            self.unroutable_returned,
            self.received_confirm,
            self.nacked,
            self.confirm_abandoned,
            self.message_bytes,
            s[0],
            s[1],
            s[2],
            s[3],
            s[4],
            s[5],
            s[6],
            s[7],
            s[8],
        ]
    }

    /// The inverse of [`MessageStats::to_array`].
    #[must_use]
    pub fn from_array(c: [u64; Self::FIELDS]) -> Self {
        Self {
            published: c[0],
            delivered: c[1],
            got: c[2],
            redelivered: c[3],
            acked: c[4],
            confirmed: c[5],
            delivered_no_ack: c[6],
            got_no_ack: c[7],
            get_empty: c[8],
            routed: c[9],
            unroutable_dropped: c[10],
            unroutable_returned: c[11],
            received_confirm: c[12],
            nacked: c[13],
            confirm_abandoned: c[14],
            message_bytes: c[15],
            message_sizes: [
                c[16], c[17], c[18], c[19], c[20], c[21], c[22], c[23], c[24],
            ],
        }
    }

    /// Whether every count is zero (nothing to add).
    #[must_use]
    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}

/// The node's totals since start.
#[derive(Debug)]
pub struct GlobalStats {
    /// [`MessageStats`] as an array (see [`MessageStats::to_array`]).
    counts: [AtomicU64; MessageStats::FIELDS],
    /// Connection, channel and queue lifecycle totals (counted where they happen: rare
    /// compared with messages, so one atomic add each).
    lifecycle: [AtomicU64; Lifecycle::COUNT],
    /// Channels that have published at least once and are open (RabbitMQ's
    /// `rabbitmq_global_publishers`): counted at a channel's first publish and when it closes.
    publishers: AtomicU64,
    /// Publish-to-confirm latency of confirm-mode publishes, in seconds. A publish's time is
    /// the end of the read that brought it, its confirm's the flush that writes basic.ack
    /// (or nack).
    pub confirm_seconds: Histogram,
}

impl Default for GlobalStats {
    fn default() -> Self {
        Self {
            counts: Default::default(),
            lifecycle: Default::default(),
            publishers: AtomicU64::new(0),
            confirm_seconds: Histogram::new(LATENCY_BOUNDS),
        }
    }
}

/// Lifecycle events counted since start (RabbitMQ's `*_opened_total`, `*_closed_total`,
/// `queues_declared_total`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    /// A client connection was opened (reached connection.open-ok).
    ConnectionOpened,
    /// A client connection closed.
    ConnectionClosed,
    /// A channel was opened.
    ChannelOpened,
    /// A channel closed.
    ChannelClosed,
    /// queue.declare succeeded (new or existing queue).
    QueueDeclared,
    /// A queue was created.
    QueueCreated,
    /// A queue was deleted.
    QueueDeleted,
}

impl Lifecycle {
    /// How many kinds there are.
    pub const COUNT: usize = 7;
}

impl GlobalStats {
    /// Add a session's counts.
    pub fn add(&self, d: &MessageStats) {
        for (total, n) in self.counts.iter().zip(d.to_array()) {
            if n > 0 {
                total.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    /// The totals now.
    #[must_use]
    pub fn snapshot(&self) -> MessageStats {
        MessageStats::from_array(self.counts.each_ref().map(|a| a.load(Ordering::Relaxed)))
    }

    /// Count one lifecycle event.
    pub fn event(&self, e: Lifecycle) {
        self.lifecycle[e as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// A channel published for the first time (`up`) or such a channel closed.
    pub fn publisher(&self, up: bool) {
        if up {
            self.publishers.fetch_add(1, Ordering::Relaxed);
        } else {
            // Never below zero, whatever the order of a close and a count.
            let _ = self
                .publishers
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        }
    }

    /// Open channels that have published.
    #[must_use]
    pub fn publishers(&self) -> u64 {
        self.publishers.load(Ordering::Relaxed)
    }

    /// How many `e` events happened since start.
    #[must_use]
    pub fn events(&self, e: Lifecycle) -> u64 {
        self.lifecycle[e as usize].load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_add_up() {
        let g = GlobalStats::default();
        g.add(&MessageStats {
            published: 2,
            acked: 1,
            ..MessageStats::default()
        });
        g.add(&MessageStats {
            published: 3,
            delivered: 4,
            ..MessageStats::default()
        });
        g.add(&MessageStats {
            unroutable_returned: 2,
            get_empty: 1,
            ..MessageStats::default()
        });
        let s = g.snapshot();
        assert_eq!((s.published, s.delivered, s.acked, s.got), (5, 4, 1, 0));
        assert_eq!((s.unroutable_returned, s.get_empty, s.routed), (2, 1, 0));
        let all = MessageStats::from_array(std::array::from_fn(|i| i as u64 + 1));
        assert_eq!(all.to_array(), std::array::from_fn(|i| i as u64 + 1));
        g.event(Lifecycle::QueueDeleted);
        assert_eq!(g.events(Lifecycle::QueueDeleted), 1);
        assert_eq!(g.events(Lifecycle::QueueCreated), 0);
        assert!(MessageStats::default().is_zero());
    }
}
