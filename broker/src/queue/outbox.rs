//! A connection's inbox for work produced by other tasks (deliveries from queues, consumer
//! cancellations), drained by the connection task on its next wake-up.
//!
//! Bound: deliveries only enter while their consumer has window (see
//! [`crate::queue::machine::ConsumerSpec::window`]), so the outbox holds at most
//! `consumers x window` deliveries plus one cancel per consumer, plus one store completion per
//! submission still owed to this connection.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::message::Outgoing;
use crate::queue::Queue;
use crate::queue::machine::{ConsumerId, MsgId};

/// A message for a consumer.
#[derive(Debug)]
pub struct Delivery {
    /// Channel the consumer is on.
    pub channel: u16,
    /// The consumer.
    pub consumer: ConsumerId,
    /// Queue it comes from (acks go back there).
    pub queue: Arc<Queue>,
    /// Message id in that queue.
    pub id: MsgId,
    /// The message (read from the store when written out, if it is not in memory).
    pub message: Outgoing,
    /// Delivered before.
    pub redelivered: bool,
    /// Holds a slot of the channel's shared limit until settled.
    pub counted: bool,
    /// Times it was returned before (reported as `x-delivery-count` by quorum queues).
    pub delivery_count: u32,
}

/// Work for a connection task.
#[derive(Debug)]
pub enum Outbound {
    /// Send basic.deliver.
    Deliver(Delivery),
    /// The queue went away: send basic.cancel to the consumer (if the client supports it).
    Cancel {
        /// Channel of the consumer.
        channel: u16,
        /// The consumer.
        consumer: ConsumerId,
    },
    /// A stream consumer may have something to read: the connection task calls
    /// [`crate::queue::stream::StreamQueue::pump`] and writes what it gives.
    StreamReady {
        /// Channel of the consumer.
        channel: u16,
        /// The consumer.
        consumer: ConsumerId,
        /// The stream queue.
        queue: Arc<Queue>,
    },
    /// A direct reply-to message for the requester consuming on `channel`.
    Reply {
        /// Channel of the reply consumer.
        channel: u16,
        /// That channel's incarnation.
        epoch: u64,
        /// The reply.
        message: Arc<crate::message::Message>,
    },
    /// A direct reply-to message for a requester on another node (only in the outbox of a
    /// cluster's link to that node, never a connection's).
    PeerReply {
        /// The vhost it was published in.
        vhost: String,
        /// The reply (its routing key is the requester's reply name).
        message: Arc<crate::message::Message>,
    },
    /// The reply to a basic.get on a replicated queue (it commits before it is known).
    Got {
        /// Channel of the get.
        channel: u16,
        /// That channel's incarnation.
        epoch: u64,
        /// The queue.
        queue: Arc<crate::queue::Queue>,
        /// basic.get no-ack.
        no_ack: bool,
        /// The message, its redelivered flag, the ready count after it and its delivery
        /// count; None: the queue was empty.
        got: Option<crate::queue::Got>,
    },
    /// A consumer-group assignment or revocation for a member on this connection.
    Group {
        /// Channel of the member.
        channel: u16,
        /// That channel's incarnation.
        epoch: u64,
        /// The member's consumer id.
        consumer: ConsumerId,
        /// What to do.
        effect: crate::groups::GroupEffect,
    },
    /// A metadata change (or tx commit) this connection waits for is durable (`ok`) or failed.
    Committed {
        /// Whether the store committed it.
        ok: bool,
    },
    /// A persistent publish is durable: its publisher confirm may go out.
    Confirmed {
        /// Channel it was published on.
        channel: u16,
        /// That channel's incarnation (a reopened channel number is a different channel).
        epoch: u64,
        /// The publish sequence number.
        seq: u64,
        /// Whether the store committed it.
        ok: bool,
        /// Not committed, and safe to say so (a replicated write that failed or whose leader
        /// was lost): the publisher gets basic.nack instead of waiting.
        nack: bool,
    },
}

/// The outbox of one connection.
///
/// Pushes come from other threads (queues on other connections' tasks, the store writer's
/// completions) and must not contend with the owning task's drain: the items travel through a
/// lock-free channel, and `armed` makes one wake-up cover a whole burst.
#[derive(Debug)]
pub struct Outbox {
    tx: mpsc::Sender<Outbound>,
    /// Only the owning connection task drains; the lock is never contended.
    rx: Mutex<mpsc::Receiver<Outbound>>,
    /// Set by the first push after a drain, which also notifies.
    armed: AtomicBool,
    notify: Notify,
}

impl Default for Outbox {
    fn default() -> Self {
        let (tx, rx) = mpsc::channel();
        Self {
            tx,
            rx: Mutex::new(rx),
            armed: AtomicBool::new(false),
            notify: Notify::new(),
        }
    }
}

impl Outbox {
    /// Queue work and wake the connection task.
    pub fn push(&self, item: Outbound) {
        // The receiver lives as long as `self`: sending cannot fail.
        let _ = self.tx.send(item);
        // Send, then arm: a drain that disarmed before this swap drains the item or is
        // followed by this notify.
        if !self.armed.swap(true, Ordering::AcqRel) {
            self.notify.notify_one();
        }
    }

    /// Move everything queued into `into`.
    pub fn drain(&self, into: &mut Vec<Outbound>) {
        self.armed.swap(false, Ordering::AcqRel);
        let rx = self.rx.lock();
        into.extend(rx.try_iter());
    }

    /// Resolves when something was pushed since the last drain.
    pub async fn notified(&self) {
        self.notify.notified().await;
    }
}
