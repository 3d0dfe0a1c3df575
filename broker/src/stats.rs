//! Node-wide message counters (publish, deliver, get, ack, redeliver, confirm) for the
//! management API's rates and Prometheus' `rabbitmq_global_messages_*_total`.
//!
//! Connections count in plain per-session counters and add them here once per wake-up
//! ([`GlobalStats::add`]), so the hot path touches no shared cache line per message.

use std::sync::atomic::{AtomicU64, Ordering};

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
}

impl MessageStats {
    /// Whether every count is zero (nothing to add).
    #[must_use]
    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}

/// The node's totals since start.
#[derive(Debug, Default)]
pub struct GlobalStats {
    published: AtomicU64,
    delivered: AtomicU64,
    got: AtomicU64,
    redelivered: AtomicU64,
    acked: AtomicU64,
    confirmed: AtomicU64,
}

impl GlobalStats {
    /// Add a session's counts.
    pub fn add(&self, d: &MessageStats) {
        for (total, n) in [
            (&self.published, d.published),
            (&self.delivered, d.delivered),
            (&self.got, d.got),
            (&self.redelivered, d.redelivered),
            (&self.acked, d.acked),
            (&self.confirmed, d.confirmed),
        ] {
            if n > 0 {
                total.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    /// The totals now.
    #[must_use]
    pub fn snapshot(&self) -> MessageStats {
        MessageStats {
            published: self.published.load(Ordering::Relaxed),
            delivered: self.delivered.load(Ordering::Relaxed),
            got: self.got.load(Ordering::Relaxed),
            redelivered: self.redelivered.load(Ordering::Relaxed),
            acked: self.acked.load(Ordering::Relaxed),
            confirmed: self.confirmed.load(Ordering::Relaxed),
        }
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
        let s = g.snapshot();
        assert_eq!((s.published, s.delivered, s.acked, s.got), (5, 4, 1, 0));
        assert!(MessageStats::default().is_zero());
    }
}
