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
