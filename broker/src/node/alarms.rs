//! Resource alarms: the memory high watermark and the disk free limit, as RabbitMQ's.
//!
//! The decision is pure ([`Watermarks::evaluate`] on a [`Sample`]); the binary samples the
//! process and the disk and feeds [`ResourceAlarms::update`]. Connections watch the state
//! ([`ResourceAlarms::subscribe`]): while an alarm is on, a connection that publishes is sent
//! `connection.blocked` and is no longer read; connections that only consume are untouched.

use parking_lot::Mutex;
use tokio::sync::{Notify, watch};

/// RabbitMQ's default `vm_memory_high_watermark.relative` in 3.11 and later.
pub const MEMORY_HIGH_WATERMARK_DEFAULT: f64 = 0.6;
/// RabbitMQ's default `disk_free_limit.absolute` ("50MB").
pub const DISK_FREE_LIMIT_DEFAULT: u64 = 50_000_000;
/// How often the binary samples memory and disk when nothing asks for an earlier check.
pub const MONITOR_INTERVAL_MS: u64 = 1_000;

/// The memory limit: a fraction of the memory available to the node, or bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MemoryWatermark {
    /// Fraction of total memory (RabbitMQ's `vm_memory_high_watermark.relative`).
    Relative(f64),
    /// Bytes (RabbitMQ's `vm_memory_high_watermark.absolute`).
    Absolute(u64),
}

/// The disk limit: free bytes, or a multiple of total memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DiskFreeLimit {
    /// Free bytes below which the alarm fires (`disk_free_limit.absolute`).
    Absolute(u64),
    /// Multiple of total memory (`disk_free_limit.relative`).
    MemRelative(f64),
}

/// Both limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Watermarks {
    /// Memory high watermark.
    pub memory: MemoryWatermark,
    /// Disk free limit.
    pub disk_free: DiskFreeLimit,
}

impl Default for Watermarks {
    fn default() -> Self {
        Self {
            memory: MemoryWatermark::Relative(MEMORY_HIGH_WATERMARK_DEFAULT),
            disk_free: DiskFreeLimit::Absolute(DISK_FREE_LIMIT_DEFAULT),
        }
    }
}

/// One reading of the resources the alarms watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// Resident memory of the broker process.
    pub memory_used: u64,
    /// Memory available to the node (RAM, or the cgroup limit when lower).
    pub memory_total: u64,
    /// Free bytes on the data directory's file system, for unprivileged users.
    pub disk_free: u64,
}

/// Which alarms are on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AlarmState {
    /// Memory use is at or above the high watermark.
    pub memory: bool,
    /// Free disk space is below the limit.
    pub disk: bool,
}

impl AlarmState {
    /// Whether publishers must be blocked.
    #[must_use]
    pub fn any(self) -> bool {
        self.memory || self.disk
    }

    /// The reason RabbitMQ gives in `connection.blocked` ("low on memory" first).
    #[must_use]
    pub fn reason(self) -> Option<&'static str> {
        if self.memory {
            Some("low on memory")
        } else if self.disk {
            Some("low on disk")
        } else {
            None
        }
    }
}

impl Watermarks {
    /// The memory limit in bytes for a node with `memory_total` bytes.
    #[must_use]
    pub fn memory_limit(&self, memory_total: u64) -> u64 {
        match self.memory {
            MemoryWatermark::Relative(f) => (memory_total as f64 * f) as u64,
            MemoryWatermark::Absolute(b) => b,
        }
    }

    /// The disk free limit in bytes for a node with `memory_total` bytes.
    #[must_use]
    pub fn disk_limit(&self, memory_total: u64) -> u64 {
        match self.disk_free {
            DiskFreeLimit::Absolute(b) => b,
            DiskFreeLimit::MemRelative(f) => (memory_total as f64 * f) as u64,
        }
    }

    /// The alarms a sample raises.
    #[must_use]
    pub fn evaluate(&self, s: Sample) -> AlarmState {
        AlarmState {
            // vm_memory_monitor: the alarm is on once use is above the limit.
            memory: s.memory_used > self.memory_limit(s.memory_total),
            disk: s.disk_free < self.disk_limit(s.memory_total),
        }
    }
}

/// The node's alarms: limits (changeable at run time, as `rabbitmqctl
/// set_vm_memory_high_watermark`), the last sample and the state connections watch.
#[derive(Debug)]
pub struct ResourceAlarms {
    watermarks: Mutex<Watermarks>,
    last: Mutex<Option<Sample>>,
    state: watch::Sender<AlarmState>,
    recheck: Notify,
}

impl Default for ResourceAlarms {
    fn default() -> Self {
        Self::new(Watermarks::default())
    }
}

impl ResourceAlarms {
    /// Alarms with these limits, all clear until the first sample.
    #[must_use]
    pub fn new(watermarks: Watermarks) -> Self {
        Self {
            watermarks: Mutex::new(watermarks),
            last: Mutex::new(None),
            state: watch::Sender::new(AlarmState::default()),
            recheck: Notify::new(),
        }
    }

    /// The current limits.
    #[must_use]
    pub fn watermarks(&self) -> Watermarks {
        *self.watermarks.lock()
    }

    /// Change the memory watermark; the monitor re-samples at once.
    pub fn set_memory_watermark(&self, w: MemoryWatermark) {
        self.watermarks.lock().memory = w;
        self.recheck.notify_one();
    }

    /// Change the disk free limit; the monitor re-samples at once.
    pub fn set_disk_free_limit(&self, l: DiskFreeLimit) {
        self.watermarks.lock().disk_free = l;
        self.recheck.notify_one();
    }

    /// Resolves when a limit changed and the resources should be sampled again.
    pub async fn recheck_requested(&self) {
        self.recheck.notified().await;
    }

    /// Record a sample; connections are told when the state changes. Returns the new state.
    pub fn update(&self, sample: Sample) -> AlarmState {
        let w = self.watermarks();
        let new = w.evaluate(sample);
        *self.last.lock() = Some(sample);
        let old = *self.state.borrow();
        if new != old {
            if new.memory != old.memory {
                tracing::warn!(
                    used = sample.memory_used,
                    limit = w.memory_limit(sample.memory_total),
                    "memory resource limit alarm {}",
                    if new.memory { "set" } else { "cleared" }
                );
            }
            if new.disk != old.disk {
                tracing::warn!(
                    free = sample.disk_free,
                    limit = w.disk_limit(sample.memory_total),
                    "disk resource limit alarm {}",
                    if new.disk { "set" } else { "cleared" }
                );
            }
            self.state.send_replace(new);
        }
        new
    }

    /// The current state.
    #[must_use]
    pub fn state(&self) -> AlarmState {
        *self.state.borrow()
    }

    /// The last sample, if any was taken.
    #[must_use]
    pub fn last_sample(&self) -> Option<Sample> {
        *self.last.lock()
    }

    /// A receiver that wakes on every state change.
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<AlarmState> {
        self.state.subscribe()
    }
}

/// Parse a size as RabbitMQ's configuration does: a number of bytes, optionally with a unit
/// (`k`/`kiB`, `M`/`MiB`, `G`/`GiB` are powers of 2; `kB`, `MB`, `GB` powers of 10; any case).
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().ok()?;
    // Case does not matter, as in RabbitMQ's parser: "mb" is "MB".
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        _ => return None,
    };
    n.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(used: u64, total: u64, free: u64) -> Sample {
        Sample {
            memory_used: used,
            memory_total: total,
            disk_free: free,
        }
    }

    #[test]
    fn defaults_are_rabbitmqs() {
        let w = Watermarks::default();
        assert_eq!(w.memory_limit(1000), 600);
        assert_eq!(w.disk_limit(1000), 50_000_000);
        assert_eq!(
            w.evaluate(sample(600, 1000, 50_000_000)),
            AlarmState::default()
        );
        assert_eq!(
            w.evaluate(sample(601, 1000, 49_999_999)),
            AlarmState {
                memory: true,
                disk: true
            }
        );
    }

    #[test]
    fn absolute_and_relative_forms() {
        let w = Watermarks {
            memory: MemoryWatermark::Absolute(100),
            disk_free: DiskFreeLimit::MemRelative(1.5),
        };
        assert!(w.evaluate(sample(101, 1000, 2000)).memory);
        assert!(!w.evaluate(sample(100, 1000, 2000)).memory);
        assert!(w.evaluate(sample(0, 1000, 1499)).disk);
        assert!(!w.evaluate(sample(0, 1000, 1500)).disk);
    }

    #[test]
    fn update_publishes_changes_and_reasons() {
        let a = ResourceAlarms::default();
        let mut rx = a.subscribe();
        assert_eq!(a.update(sample(10, 1000, u64::MAX)).reason(), None);
        assert!(!rx.has_changed().unwrap_or(true), "no change, no wake-up");
        a.set_memory_watermark(MemoryWatermark::Absolute(5));
        assert_eq!(
            a.update(sample(10, 1000, u64::MAX)).reason(),
            Some("low on memory")
        );
        assert!(a.update(sample(6, 1000, u64::MAX)).memory, "6 > 5");
        assert!(rx.has_changed().unwrap_or(false));
        assert!(rx.borrow_and_update().any());
        a.set_memory_watermark(MemoryWatermark::Relative(0.6));
        a.set_disk_free_limit(DiskFreeLimit::Absolute(u64::MAX));
        assert_eq!(a.update(sample(10, 1000, 1)).reason(), Some("low on disk"));
    }

    #[test]
    fn sizes_parse_with_rabbitmq_units() {
        assert_eq!(parse_size("50MB"), Some(50_000_000));
        assert_eq!(parse_size("1GiB"), Some(1 << 30));
        assert_eq!(parse_size("2G"), Some(2 << 30));
        assert_eq!(parse_size("512kB"), Some(512_000));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("12 MiB"), Some(12 << 20));
        assert_eq!(parse_size("50mb"), Some(50_000_000));
        assert_eq!(parse_size("1gib"), Some(1 << 30));
        assert_eq!(parse_size("5XB"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("99999999999999999999"), None);
    }
}
