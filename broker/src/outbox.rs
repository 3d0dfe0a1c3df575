//! A connection's inbox for work produced by other tasks (deliveries from queues, consumer
//! cancellations), drained by the connection task on its next wake-up.
//!
//! Bound: deliveries only enter while their consumer has window (see
//! [`crate::queue::machine::ConsumerSpec::window`]), so the outbox holds at most
//! `consumers x window` deliveries plus one cancel per consumer, plus one store completion per
//! submission still owed to this connection.

use std::collections::VecDeque;
use std::sync::Arc;

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
    /// A direct reply-to message for the requester consuming on `channel`.
    Reply {
        /// Channel of the reply consumer.
        channel: u16,
        /// That channel's incarnation.
        epoch: u64,
        /// The reply.
        message: Arc<crate::message::Message>,
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
    },
}

/// The outbox of one connection.
#[derive(Debug, Default)]
pub struct Outbox {
    items: Mutex<VecDeque<Outbound>>,
    notify: Notify,
}

impl Outbox {
    /// Queue work and wake the connection task. Lock order: queue state, then outbox.
    pub fn push(&self, item: Outbound) {
        let was_empty = {
            let mut items = self.items.lock();
            let was_empty = items.is_empty();
            items.push_back(item);
            was_empty
        };
        // One wake-up per batch is enough: the task drains everything it finds.
        if was_empty {
            self.notify.notify_one();
        }
    }

    /// Move everything queued into `into`.
    pub fn drain(&self, into: &mut Vec<Outbound>) {
        into.extend(self.items.lock().drain(..));
    }

    /// Resolves when something was pushed since the last drain.
    pub async fn notified(&self) {
        self.notify.notified().await;
    }
}
