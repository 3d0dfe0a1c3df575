//! A fixed-bucket histogram that many threads record into without locks, read by the metrics
//! endpoint in Prometheus' cumulative form. Recording is a few relaxed atomic adds, so it can sit
//! on the commit path and the confirm path.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bucket upper bounds for latencies, in seconds: 50 µs to 10 s, roughly ×2.5 per step.
pub const LATENCY_BOUNDS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
];

/// Bucket upper bounds for counts (batch sizes): 1 to 4096, powers of two.
pub const COUNT_BOUNDS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
];

/// Observations in fixed buckets, plus their count and sum.
///
/// Invariant: `count` equals the sum of `buckets` (the last bucket is `+Inf`), once every
/// concurrent `observe_n` has returned.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// One per bound, then `+Inf`; not cumulative.
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
    /// Sum of observations in millionths of the unit (integer adds stay lock-free).
    sum_micros: AtomicU64,
}

/// A histogram read at one moment, cumulative as Prometheus exposes it.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// `(upper bound, observations <= bound)`, ascending; the last bound is `f64::INFINITY`.
    pub cumulative: Vec<(f64, u64)>,
    /// All observations.
    pub count: u64,
    /// Sum of all observations.
    pub sum: f64,
}

impl Histogram {
    /// An empty histogram over `bounds` (ascending).
    #[must_use]
    pub fn new(bounds: &'static [f64]) -> Self {
        debug_assert!(bounds.windows(2).all(|w| w[0] < w[1]), "bounds ascend");
        Self {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }

    /// Record one observation of `value`.
    pub fn observe(&self, value: f64) {
        self.observe_n(value, 1);
    }

    /// Record `n` observations of the same `value` (a batch confirmed together).
    pub fn observe_n(&self, value: f64, n: u64) {
        if n == 0 {
            return;
        }
        let v = if value.is_finite() {
            value.max(0.0)
        } else {
            0.0
        };
        let i = self.bounds.partition_point(|b| *b < v);
        self.buckets[i].fetch_add(n, Ordering::Relaxed);
        self.count.fetch_add(n, Ordering::Relaxed);
        // Saturating float-to-int cast: a huge value cannot wrap the sum.
        let micros = (v * 1e6) as u64;
        self.sum_micros
            .fetch_add(micros.saturating_mul(n), Ordering::Relaxed);
    }

    /// The buckets now, cumulative.
    #[must_use]
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut cumulative = Vec::with_capacity(self.buckets.len());
        let mut running = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            running += b.load(Ordering::Relaxed);
            let bound = self.bounds.get(i).copied().unwrap_or(f64::INFINITY);
            cumulative.push((bound, running));
        }
        HistogramSnapshot {
            // The buckets' total, not `count`: with concurrent writers the two may differ by
            // an observation in flight, and Prometheus requires `+Inf` == `_count`.
            count: running,
            cumulative,
            sum: self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_bounds_inclusive() {
        let h = Histogram::new(COUNT_BOUNDS);
        h.observe(1.0);
        h.observe_n(3.0, 2);
        h.observe(4.0);
        h.observe(1e9);
        let s = h.snapshot();
        assert_eq!(s.count, 5);
        assert_eq!(s.cumulative[0], (1.0, 1)); // le=1 holds the 1
        assert_eq!(s.cumulative[1], (2.0, 1));
        assert_eq!(s.cumulative[2], (4.0, 4)); // the two 3s and the 4
        assert_eq!(s.cumulative.last(), Some(&(f64::INFINITY, 5)));
        assert!((s.sum - (1.0 + 6.0 + 4.0 + 1e9)).abs() < 1e-3);
    }

    #[test]
    fn nonsense_values_land_in_the_first_bucket() {
        let h = Histogram::new(LATENCY_BOUNDS);
        h.observe(f64::NAN);
        h.observe(-1.0);
        h.observe_n(0.5, 0);
        let s = h.snapshot();
        assert_eq!((s.count, s.cumulative[0].1), (2, 2));
        assert_eq!(s.sum, 0.0);
    }
}
