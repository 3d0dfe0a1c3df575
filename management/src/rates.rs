//! Message rates from successive samples of the broker's counters: the rate is the change
//! over the last sample interval, as RabbitMQ's management statistics report it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use warren_broker::stats::MessageStats;

/// How often the counters are sampled.
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(5);

/// The last two samples.
#[derive(Debug, Default)]
pub struct Rates {
    last: Option<(Instant, MessageStats)>,
    per_second: MessageRates,
}

/// Messages per second over the last interval.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MessageRates {
    /// basic.publish.
    pub published: f64,
    /// basic.deliver.
    pub delivered: f64,
    /// basic.get.
    pub got: f64,
    /// Redelivered deliveries and gets.
    pub redelivered: f64,
    /// Client acks.
    pub acked: f64,
    /// Publisher confirms.
    pub confirmed: f64,
}

impl Rates {
    /// Record the counters at `at`.
    pub fn sample(&mut self, at: Instant, now: MessageStats) {
        if let Some((t0, before)) = self.last {
            let secs = at.saturating_duration_since(t0).as_secs_f64();
            if secs > 0.0 {
                let r = |a: u64, b: u64| a.saturating_sub(b) as f64 / secs;
                self.per_second = MessageRates {
                    published: r(now.published, before.published),
                    delivered: r(now.delivered, before.delivered),
                    got: r(now.got, before.got),
                    redelivered: r(now.redelivered, before.redelivered),
                    acked: r(now.acked, before.acked),
                    confirmed: r(now.confirmed, before.confirmed),
                };
            }
        }
        self.last = Some((at, now));
    }

    /// The rates over the last interval (zero until two samples exist).
    #[must_use]
    pub fn per_second(&self) -> MessageRates {
        self.per_second
    }
}

/// A queue's identity for [`QueueRates`]: (vhost, queue name).
pub type QueueKey = (String, String);

/// Rates of every queue, from samples of each queue's own counters.
#[derive(Debug, Default)]
pub struct QueueRates {
    by_queue: HashMap<QueueKey, Rates>,
}

impl QueueRates {
    /// Record every queue's counters at `at`. Queues absent from `samples` are forgotten (a
    /// queue declared again under the same name starts from zero, not from a negative rate).
    pub fn sample(
        &mut self,
        at: Instant,
        samples: impl IntoIterator<Item = (QueueKey, MessageStats)>,
    ) {
        let mut next = HashMap::with_capacity(self.by_queue.len());
        for (key, stats) in samples {
            let mut rates = self.by_queue.remove(&key).unwrap_or_default();
            rates.sample(at, stats);
            next.insert(key, rates);
        }
        self.by_queue = next;
    }

    /// The rates of `vhost`/`queue` over the last interval (zero when not sampled twice yet).
    #[must_use]
    pub fn per_second(&self, vhost: &str, queue: &str) -> MessageRates {
        self.by_queue
            .get(&(vhost.to_owned(), queue.to_owned()))
            .map(Rates::per_second)
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_is_the_change_over_the_interval() {
        let mut r = Rates::default();
        let t = Instant::now();
        r.sample(t, MessageStats::default());
        assert_eq!(r.per_second(), MessageRates::default());
        r.sample(
            t + Duration::from_secs(5),
            MessageStats {
                published: 50,
                acked: 10,
                ..MessageStats::default()
            },
        );
        assert_eq!(r.per_second().published, 10.0);
        assert_eq!(r.per_second().acked, 2.0);
    }

    #[test]
    fn queue_rates_forget_deleted_queues() {
        let mut r = QueueRates::default();
        let t = Instant::now();
        let key = ("/".to_owned(), "q".to_owned());
        let at = |n| MessageStats {
            published: n,
            ..MessageStats::default()
        };
        r.sample(t, [(key.clone(), at(100))]);
        r.sample(t + Duration::from_secs(5), [(key.clone(), at(150))]);
        assert_eq!(r.per_second("/", "q").published, 10.0);
        // Deleted, then declared again: its counters restart at zero.
        r.sample(t + Duration::from_secs(10), []);
        r.sample(t + Duration::from_secs(15), [(key.clone(), at(5))]);
        assert_eq!(r.per_second("/", "q").published, 0.0);
        r.sample(t + Duration::from_secs(20), [(key, at(10))]);
        assert_eq!(r.per_second("/", "q").published, 1.0);
    }
}
