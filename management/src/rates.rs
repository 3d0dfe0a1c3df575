//! Message rates from successive samples of the broker's counters: the rate is the change
//! over the last sample interval, as RabbitMQ's management statistics report it.

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
}
