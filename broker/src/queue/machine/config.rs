//! A queue's declared behaviour ([`QueueConfig`], [`Overflow`], [`DELIVERY_LIMIT_NONE`]) and
//! the length limits it sets.
//!
//! Invariants: limits count ready messages only (unacked ones never), as RabbitMQ does; under
//! `drop-head` the queue is within its limits after every command, under `reject-publish(-dlx)`
//! an enqueue that would exceed them is refused. Priority levels and single-active consumer are
//! fixed at declaration: [`Command::Configure`](super::Command::Configure) keeps them.

use super::{MessageRef, QueueMachine};

/// What happens to a publish that would exceed a length limit (`x-overflow`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Overflow {
    /// Drop (dead-letter) messages from the head until within limits (RabbitMQ's default).
    #[default]
    DropHead,
    /// Refuse the new message (publisher nack).
    RejectPublish,
    /// Refuse the new message and dead-letter it.
    RejectPublishDlx,
}

/// A queue's declared behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct QueueConfig {
    /// `x-max-priority`: number of priority levels above 0 (None: priorities ignored).
    pub max_priority: Option<u8>,
    /// `x-max-length`: most ready messages.
    pub max_length: Option<u64>,
    /// `x-max-length-bytes`: most ready body bytes.
    pub max_length_bytes: Option<u64>,
    /// `x-overflow`.
    pub overflow: Overflow,
    /// `x-message-ttl` in milliseconds.
    pub message_ttl: Option<u64>,
    /// `x-single-active-consumer`: only the longest-attached consumer receives; the next one
    /// takes over when it leaves.
    pub single_active: bool,
    /// `x-delivery-limit` (quorum queues; 20 by default there): a message returned more than
    /// this many times is removed (dead-lettered with reason `delivery_limit`).
    /// [`DELIVERY_LIMIT_NONE`] is a quorum queue without a limit (a negative argument), whose
    /// returned messages go to the back of the queue as in rabbit_fifo; `None` (classic
    /// queues) keeps returned messages at the front, in their original order.
    pub delivery_limit: Option<u32>,
}

/// The `delivery_limit` of a quorum queue declared with a negative `x-delivery-limit`: no
/// message reaches it (delivery counts saturate at `u32::MAX` and must exceed it), and
/// returned messages are requeued at the back ([`Effect::Requeued`](super::Effect::Requeued)).
/// A value of the existing field, not a new one, so that replicas' snapshots keep their format.
pub const DELIVERY_LIMIT_NONE: u32 = u32::MAX;

impl QueueConfig {
    /// Whether returned messages go to the back of the queue (rabbit_fifo without a
    /// delivery limit) rather than back to their place.
    #[must_use]
    pub fn returns_to_back(&self) -> bool {
        self.delivery_limit == Some(DELIVERY_LIMIT_NONE)
    }
}

impl<M: MessageRef> QueueMachine<M> {
    /// The queue's configuration.
    #[must_use]
    pub fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// New settings (a policy changed): limits and TTLs change, priority levels and
    /// single-active are kept.
    pub(super) fn configure(&mut self, config: QueueConfig) {
        // Priority levels and single-active are fixed at declaration (not policies).
        self.config = QueueConfig {
            max_priority: self.config.max_priority,
            single_active: self.config.single_active,
            ..config
        };
    }

    /// Whether one more message of `size` bytes would exceed a length limit.
    fn would_overflow(&self, size: u64) -> bool {
        self.config
            .max_length
            .is_some_and(|max| self.ready_count as u64 + 1 > max)
            || self
                .config
                .max_length_bytes
                .is_some_and(|max| self.ready_bytes + size > max)
    }

    /// Whether the ready messages exceed a length limit (drop-head trims them at once).
    pub(super) fn over_limits(&self) -> bool {
        self.config
            .max_length
            .is_some_and(|max| self.ready_count as u64 > max)
            || self
                .config
                .max_length_bytes
                .is_some_and(|max| self.ready_bytes > max)
    }

    /// Whether `Enqueue(msg)` would be refused (reject-publish): lets a driver skip writing a
    /// message the queue will not take.
    #[must_use]
    pub fn would_reject(&self, msg: &M) -> bool {
        self.config.overflow != Overflow::DropHead && self.would_overflow(msg.size())
    }
}

/// Which returns wait before the message is ready again (RabbitMQ 4.3's
/// `x-delayed-retry-type`). A return is *failed* when the client said the delivery failed
/// (basic.nack or basic.reject with requeue, a lease released) and *returned* otherwise (its
/// channel closed, its consumer went, its node went down, its lease ran out).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum RetryOn {
    /// No return waits (RabbitMQ's default).
    #[default]
    Disabled,
    /// Every return waits.
    All,
    /// Failed returns wait.
    Failed,
    /// Returns that were not failures wait.
    Returned,
}

/// Why a delivery came back to the queue (see [`RetryOn`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ReturnKind {
    /// The client said the delivery failed.
    Failed,
    /// The delivery ended otherwise (channel, consumer, node or lease gone).
    Returned,
}

/// How long a returned message waits before it is ready again: `x-delayed-retry-*`.
///
/// With `multiplier_milli` at 0 the delay is linear in the message's delivery count `n`
/// (counting this return): `min(min_ms * n, max_ms)`, RabbitMQ 4.3's form. With a multiplier
/// `m = multiplier_milli / 1000` it is exponential: `min(min_ms * m^(n-1), max_ms)`, then
/// spread by up to `jitter_percent` either way (a deterministic function of the message id
/// and `n`, so every replica computes the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct RetryPolicy {
    /// Which returns wait.
    pub on: RetryOn,
    /// `x-delayed-retry-min`: the first delay, ms.
    pub min_ms: u64,
    /// `x-delayed-retry-max`: the longest delay, ms.
    pub max_ms: u64,
    /// `x-delayed-retry-multiplier` times 1000 (0: linear).
    pub multiplier_milli: u32,
    /// `x-delayed-retry-jitter`: percent of the delay added or taken at random (0..=100).
    pub jitter_percent: u8,
}

impl RetryPolicy {
    /// The delay before a message returned for `kind`, with `delivery_count` deliveries
    /// returned so far (this one included), is ready again; 0 when it does not wait.
    #[must_use]
    pub fn delay_ms(&self, kind: ReturnKind, delivery_count: u32, id: u64) -> u64 {
        let applies = match self.on {
            RetryOn::Disabled => false,
            RetryOn::All => true,
            RetryOn::Failed => kind == ReturnKind::Failed,
            RetryOn::Returned => kind == ReturnKind::Returned,
        };
        if !applies || self.min_ms == 0 {
            return 0;
        }
        let n = u64::from(delivery_count.max(1));
        let max = self.max_ms.max(self.min_ms);
        let base = if self.multiplier_milli == 0 {
            self.min_ms.saturating_mul(n).min(max)
        } else {
            let mut d = self.min_ms as f64;
            let m = f64::from(self.multiplier_milli) / 1000.0;
            for _ in 1..n.min(64) {
                d *= m;
                if d >= max as f64 {
                    break;
                }
            }
            (d.min(max as f64)) as u64
        };
        if self.jitter_percent == 0 {
            return base;
        }
        let spread = base / 100 * u64::from(self.jitter_percent.min(100));
        if spread == 0 {
            return base;
        }
        // A fixed mix of id and count (splitmix64): the same on every replica and replay.
        let mut z = id ^ (u64::from(delivery_count) << 32) ^ 0x9e37_79b9_7f4a_7c15;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (base - spread).saturating_add(z % (2 * spread + 1))
    }
}

/// Default lease of a claim that names none, ms (SQS's default visibility timeout).
pub const LEASE_DEFAULT_MS: u64 = 30_000;
/// Default cap on one extension, ms (SQS's longest visibility timeout, 12 hours).
pub const LEASE_EXTENSION_MAX_MS: u64 = 12 * 3_600_000;
/// Default cap on a claim's whole lifetime from its claim, ms (12 hours, as SQS's).
pub const LEASE_LIFETIME_MAX_MS: u64 = 12 * 3_600_000;

/// Leases of claims (`x-lease-*` arguments and policy keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LeaseConfig {
    /// The lease of a claim that names none, ms.
    pub default_ms: u64,
    /// The longest one claim or extension may ask for, ms (longer asks are cut to it).
    pub extension_max_ms: u64,
    /// The longest a claim may live from its claim, ms: no extension goes past it.
    pub lifetime_max_ms: u64,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            default_ms: LEASE_DEFAULT_MS,
            extension_max_ms: LEASE_EXTENSION_MAX_MS,
            lifetime_max_ms: LEASE_LIFETIME_MAX_MS,
        }
    }
}

/// Default number of deduplication keys a queue remembers (`x-cache-size`).
pub const DEDUP_CACHE_SIZE_DEFAULT: u32 = 100_000;
/// Default time a deduplication key is remembered, ms (`x-cache-ttl`; SQS FIFO's 5 minutes).
pub const DEDUP_TTL_DEFAULT_MS: u64 = 300_000;
/// Longest deduplication key, bytes (a longer `x-deduplication-header` is not deduplicated).
pub const DEDUP_KEY_MAX: usize = 255;

/// Publish deduplication (`x-message-deduplication`, `x-cache-size`, `x-cache-ttl`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DedupConfig {
    /// Drop a message whose `x-deduplication-header` the window remembers.
    pub enabled: bool,
    /// Most keys remembered (the oldest go first), at least 1.
    pub cache_size: u32,
    /// How long a key is remembered, ms (None: until the size pushes it out).
    pub ttl_ms: Option<u64>,
}

impl Default for DedupConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            cache_size: DEDUP_CACHE_SIZE_DEFAULT,
            ttl_ms: Some(DEDUP_TTL_DEFAULT_MS),
        }
    }
}

/// A queue's work-queue settings: leases and delayed retries. Apart from [`QueueConfig`]
/// (whose replicated form is fixed) and changed by
/// [`Command::ConfigureWork`](super::Command::ConfigureWork).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct WorkConfig {
    /// Claim leases.
    pub lease: LeaseConfig,
    /// Delayed retries of returned messages.
    pub retry: RetryPolicy,
    /// Publish deduplication.
    pub dedup: DedupConfig,
    /// `x-priority-aging-ms`: a ready message waiting longer than this is served before
    /// higher priorities (the oldest such first), so strict priority starves no level for
    /// longer than this. None: strict priority.
    pub priority_aging_ms: Option<u64>,
}
