//! The queue as a pure, deterministic state machine.
//!
//! `apply(now_ms, command, effects) -> reply`: no I/O, no clock, no locks. The in-memory driver
//! ([`super::Queue`]) feeds it today; the durable store and openraft will feed the same commands
//! from their logs, so replay gives the same state.
//!
//! The machine holds each message's metadata and a reference `M` (for the in-memory driver an
//! `Arc<Message>`, for the store a body location), never a copy of the body.
//!
//! Message flow:
//!
//! ```text
//!  Enqueue ──► ready ──(consumer has credit)──► unacked ──Settle──► gone
//!                ▲                                 │ ──Discard─► gone (dead-letter later)
//!                └──────────── Return ─────────────┘
//! ```
//!
//! Ready order: one [`Level`] per message priority (one level unless `x-max-priority` is set),
//! served highest first. Within a level, never-delivered messages wait in `fresh` (FIFO);
//! returned messages wait in `returned`, ordered by id. Every returned id is smaller than every
//! fresh id of its level (a message only leaves `fresh` from its head), so "returned first, then
//! fresh" is exactly original order.
//!
//! Limits (`x-max-length`, `x-max-length-bytes`) count ready messages only, as RabbitMQ does;
//! `drop-head` removes from the head after delivery to waiting consumers, `reject-publish`
//! refuses the new message.

use std::collections::{BTreeMap, HashMap, VecDeque};

/// Message id within one queue, assigned at enqueue, increasing.
pub type MsgId = u64;
/// Consumer id, unique per broker. In a cluster its top bits name the node the consumer is
/// attached to (see [`consumer_node`]), so ids of different nodes never collide and a node's
/// consumers can be dropped together when it goes down ([`Command::Down`]).
pub type ConsumerId = u64;

/// Where a consumer id's node number starts: ids below `1 << CONSUMER_NODE_SHIFT` belong to
/// node 0 (a broker outside a cluster).
pub const CONSUMER_NODE_SHIFT: u32 = 56;

/// The node number a consumer id carries (0 outside a cluster).
#[must_use]
pub const fn consumer_node(id: ConsumerId) -> u64 {
    id >> CONSUMER_NODE_SHIFT
}

/// What the machine needs to know about a message reference.
pub trait MessageRef: Clone {
    /// Body size in bytes (for `message_bytes` and `x-max-length-bytes`).
    fn size(&self) -> u64;
    /// The message's `priority` property (0 when absent).
    fn priority(&self) -> u8 {
        0
    }
    /// The message's own TTL in milliseconds (the `expiration` property), if it has one.
    fn expiration_ms(&self) -> Option<u64> {
        None
    }
}

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
/// returned messages are requeued at the back ([`Effect::Requeued`]). A value of the
/// existing field, not a new one, so that replicas' snapshots keep their format.
pub const DELIVERY_LIMIT_NONE: u32 = u32::MAX;

impl QueueConfig {
    /// Whether returned messages go to the back of the queue (rabbit_fifo without a
    /// delivery limit) rather than back to their place.
    #[must_use]
    pub fn returns_to_back(&self) -> bool {
        self.delivery_limit == Some(DELIVERY_LIMIT_NONE)
    }
}

/// Why a message left the queue without being acknowledged or delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Removal {
    /// Acknowledged, or delivered to a no-ack `basic.get`.
    Settled,
    /// Rejected or nacked without requeue.
    Rejected,
    /// Purged.
    Purged,
    /// Dropped from the head by a length limit.
    MaxLen,
    /// Its TTL ran out before it was delivered.
    Expired,
    /// Returned more often than the delivery limit allows.
    DeliveryLimit,
}

/// How a consumer receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ConsumerSpec {
    /// Unacked deliveries allowed at once (0 = unlimited), basic.qos per-consumer prefetch.
    pub prefetch: u32,
    /// Deliveries not yet written to the socket allowed at once (transport backpressure).
    pub window: u32,
    /// Bytes of deliveries not yet written allowed at once; one delivery always fits.
    pub window_bytes: u64,
    /// Messages are settled when sent.
    pub no_ack: bool,
    /// basic.consume exclusive flag.
    pub exclusive: bool,
    /// `x-priority`: consumers of a higher priority receive first while they have credit.
    pub priority: i32,
    /// A limit shared with consumers elsewhere (basic.qos global=true) governs this consumer:
    /// it receives one message per [`Command::Grant`]. Ignored for `no_ack` consumers.
    pub limited: bool,
}

/// Commands (nouns, as in rabbit_fifo).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum Command<M> {
    /// Add a message to the tail.
    Enqueue(M),
    /// Put back a message recovered from durable storage, keeping its id. Ids must arrive in
    /// increasing order and before any `Enqueue` (the machine's next id continues after it).
    Restore {
        /// The id it had when it was stored.
        id: MsgId,
        /// The message.
        msg: M,
        /// Whether to mark it redelivered.
        redelivered: bool,
        /// Its stored expiry (None: computed from the queue's TTL now).
        expires_at: Option<u64>,
    },
    /// Attach a consumer.
    Checkout(ConsumerId, ConsumerSpec),
    /// Detach a consumer; its unacked messages stay checked out until settled or returned.
    Cancel(ConsumerId),
    /// `n` of the consumer's deliveries, `bytes` in all, have been written out; restore its
    /// window.
    Written(ConsumerId, u32, u64),
    /// Acknowledge unacked messages.
    Settle(Vec<MsgId>),
    /// Put unacked messages back, in original order, marked redelivered.
    Return(Vec<MsgId>),
    /// Drop unacked messages (reject/nack without requeue).
    Discard(Vec<MsgId>),
    /// basic.get: take the head message; with `no_ack` it is settled at once.
    Get {
        /// Settle on delivery.
        no_ack: bool,
    },
    /// Remove all ready messages.
    Purge,
    /// Time passed: drop messages whose TTL ran out (see [`QueueMachine::next_expiry`]).
    Expire,
    /// New settings (a policy changed). Limits apply at once; TTLs apply to messages enqueued
    /// from now on; priority levels and single-active are fixed at declaration.
    Configure(QueueConfig),
    /// A limited consumer may receive one more message.
    Grant(ConsumerId),
    /// Replace the reference held for message `id` (ready or unacked) by an equivalent one of
    /// the same size, e.g. the body's place in the store instead of the body. No effect on
    /// order or delivery state; absent ids are ignored.
    Swap {
        /// The message.
        id: MsgId,
        /// Its new reference.
        msg: M,
    },
    /// Put a consumer under a shared limit or release it; an unused grant is dropped.
    SetLimited(ConsumerId, bool),
    /// Node `node` (see [`consumer_node`]) is down or restarted: its consumers with ids below
    /// `before` (all of them, or those of its previous run) are detached and every message
    /// delivered to them and not settled is returned (redelivered), as rabbit_fifo does on a
    /// consumer's `down`.
    Down {
        /// The node number.
        node: u64,
        /// Only consumer ids below this.
        before: ConsumerId,
    },
    /// A replicated stream's named consumer has handled everything before `next` (its
    /// tracked offset, replicated so it resumes there on any member). Nothing to a queue.
    /// Last, so logs written before it existed still decode.
    TrackOffset {
        /// The consumer's `x-stream-consumer-name`.
        name: String,
        /// Its first offset not acked.
        next: u64,
    },
    /// The client asked for unacked messages back (basic.nack or basic.reject with requeue,
    /// basic.recover): as [`Command::Return`], except that a quorum queue without a delivery
    /// limit requeues them at the back, as rabbit_fifo's requeue does (returns after a
    /// channel close, cancel or node loss keep their place there too). After `TrackOffset`,
    /// so older logs still decode.
    Requeue(Vec<MsgId>),
}

impl<M> Command<M> {
    /// The same command over another message reference (a replicated queue's log carries
    /// messages encoded; its replicas hold them decoded).
    ///
    /// # Errors
    /// The first error of `f`.
    pub fn try_map<N, E>(self, mut f: impl FnMut(M) -> Result<N, E>) -> Result<Command<N>, E> {
        Ok(match self {
            Self::Enqueue(m) => Command::Enqueue(f(m)?),
            Self::Restore {
                id,
                msg,
                redelivered,
                expires_at,
            } => Command::Restore {
                id,
                msg: f(msg)?,
                redelivered,
                expires_at,
            },
            Self::Swap { id, msg } => Command::Swap { id, msg: f(msg)? },
            Self::Checkout(c, spec) => Command::Checkout(c, spec),
            Self::Cancel(c) => Command::Cancel(c),
            Self::Written(c, n, b) => Command::Written(c, n, b),
            Self::Settle(ids) => Command::Settle(ids),
            Self::Return(ids) => Command::Return(ids),
            Self::Discard(ids) => Command::Discard(ids),
            Self::Get { no_ack } => Command::Get { no_ack },
            Self::Purge => Command::Purge,
            Self::Expire => Command::Expire,
            Self::Configure(c) => Command::Configure(c),
            Self::Grant(c) => Command::Grant(c),
            Self::SetLimited(c, l) => Command::SetLimited(c, l),
            Self::Down { node, before } => Command::Down { node, before },
            Self::TrackOffset { name, next } => Command::TrackOffset { name, next },
            Self::Requeue(ids) => Command::Requeue(ids),
        })
    }
}

impl<M> Reply<M> {
    /// The same reply over another message reference (see [`Command::try_map`]).
    ///
    /// # Errors
    /// The first error of `f`.
    pub fn try_map<N, E>(self, mut f: impl FnMut(M) -> Result<N, E>) -> Result<Reply<N>, E> {
        Ok(match self {
            Self::Ok => Reply::Ok,
            Self::Rejected(m) => Reply::Rejected(f(m)?),
            Self::Got(None) => Reply::Got(None),
            Self::Got(Some((id, m, redelivered, left, count))) => {
                Reply::Got(Some((id, f(m)?, redelivered, left, count)))
            }
            Self::Purged(n) => Reply::Purged(n),
        })
    }
}

/// Effects for the driver to carry out.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Effect<M> {
    /// Send a message to a consumer.
    Deliver {
        /// Recipient.
        consumer: ConsumerId,
        /// Message id (the delivery tag maps to it).
        id: MsgId,
        /// The message.
        msg: M,
        /// Delivered before.
        redelivered: bool,
        /// The consumer does not ack: the message left the queue with this delivery.
        settled: bool,
        /// Times it was returned before (quorum queues report it in `x-delivery-count`).
        delivery_count: u32,
    },
    /// A returned message was requeued at the back of the queue under a new id (ready
    /// messages wait in id order), so the driver moves what it stored under the old id.
    Requeued {
        /// The id it had.
        old: MsgId,
        /// The id it has now.
        new: MsgId,
        /// The message.
        msg: M,
    },
    /// A message left the queue for good (acked, rejected without requeue, purged, dropped by
    /// a length limit, or taken by a no-ack `basic.get`), so the driver can release what it
    /// stored for it (and dead-letter it, depending on `reason`).
    Removed {
        /// Its id.
        id: MsgId,
        /// The message.
        msg: M,
        /// Why.
        reason: Removal,
    },
}

/// Replies to a command.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Reply<M> {
    /// Nothing to report.
    Ok,
    /// `Enqueue` refused by a length limit with `x-overflow` reject-publish(-dlx): the message
    /// is handed back.
    Rejected(M),
    /// basic.get result: the message, whether redelivered, the ready count after it, and how
    /// often it was returned before.
    Got(Option<(MsgId, M, bool, u32, u32)>),
    /// Messages removed by a purge.
    Purged(u32),
}

/// Why a command was refused.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize,
)]
pub enum MachineError {
    /// An exclusive consumer holds the queue, or an exclusive one asked while others exist.
    #[error("queue in exclusive use")]
    ExclusiveInUse,
    /// The consumer id is already attached.
    #[error("consumer already attached")]
    DuplicateConsumer,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Ready<M> {
    id: MsgId,
    msg: M,
    redelivered: bool,
    /// Machine time (ms) from which it must not be delivered.
    expires_at: Option<u64>,
    /// Times it was returned after a delivery.
    delivery_count: u32,
    /// Machine time (ms) it entered the queue (or was restored); kept across returns, so the
    /// oldest-ready age counts from the first enqueue.
    enqueued_at: u64,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Unacked<M> {
    msg: M,
    consumer: Option<ConsumerId>,
    /// The consumer it was delivered to, kept after that consumer is cancelled (its node
    /// still holds the delivery until it settles or returns it; [`Command::Down`]).
    owner: Option<ConsumerId>,
    /// Kept for a requeue: a returned message keeps its original expiry.
    expires_at: Option<u64>,
    /// Times it was returned before this delivery.
    delivery_count: u32,
    /// When it entered the queue (see [`Ready`]).
    enqueued_at: u64,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Consumer {
    spec: ConsumerSpec,
    unacked: u32,
    unwritten: u32,
    unwritten_bytes: u64,
    /// Holds an unused [`Command::Grant`] (limited consumers only).
    granted: bool,
    /// May receive (always, unless the queue has a single active consumer and this is not it).
    active: bool,
    /// Attach order (single active consumer fails over to the smallest).
    attached: u64,
    /// Present in the service ring.
    in_ring: bool,
}

impl Consumer {
    fn is_limited(&self) -> bool {
        self.spec.limited && !self.spec.no_ack
    }

    /// Credit apart from a shared limit: prefetch and window (and being the active consumer).
    fn own_credit(&self) -> bool {
        self.active
            && (self.spec.no_ack || self.spec.prefetch == 0 || self.unacked < self.spec.prefetch)
            && self.unwritten < self.spec.window
            && (self.unwritten == 0 || self.unwritten_bytes < self.spec.window_bytes)
    }

    fn has_credit(&self) -> bool {
        self.own_credit() && (!self.is_limited() || self.granted)
    }
}

/// Counters for invariants and statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Counters {
    /// Messages ever enqueued.
    pub enqueued: u64,
    /// Messages settled (acked, or delivered with no-ack).
    pub settled: u64,
    /// Messages discarded (rejected without requeue).
    pub discarded: u64,
    /// Messages purged.
    pub purged: u64,
    /// Messages dropped from the head by a length limit.
    pub dropped: u64,
    /// Messages whose TTL ran out.
    pub expired: u64,
    /// Deliveries to consumers (basic.deliver), redeliveries included.
    pub delivered: u64,
    /// Messages taken by basic.get, redeliveries included.
    pub got: u64,
    /// Deliveries and gets of messages returned before (the redelivered flag set).
    pub redelivered: u64,
    /// Messages acknowledged by a consumer (not counting no-ack deliveries).
    pub acked: u64,
}

impl Counters {
    /// Messages still in the queue according to the counters.
    #[must_use]
    pub fn live(&self) -> u64 {
        self.enqueued - self.settled - self.discarded - self.purged - self.dropped - self.expired
    }
}

/// Ready messages of one priority.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Level<M> {
    fresh: VecDeque<Ready<M>>,
    returned: BTreeMap<MsgId, Ready<M>>,
}

impl<M> Default for Level<M> {
    fn default() -> Self {
        Self {
            fresh: VecDeque::new(),
            returned: BTreeMap::new(),
        }
    }
}

impl<M> Level<M> {
    fn len(&self) -> usize {
        self.fresh.len() + self.returned.len()
    }

    fn pop(&mut self) -> Option<Ready<M>> {
        match self.returned.pop_first() {
            Some((_, r)) => Some(r),
            None => self.fresh.pop_front(),
        }
    }

    fn peek(&self) -> Option<&Ready<M>> {
        self.returned.values().next().or_else(|| self.fresh.front())
    }

    fn get_mut(&mut self, id: MsgId) -> Option<&mut Ready<M>> {
        if let Some(r) = self.returned.get_mut(&id) {
            return Some(r);
        }
        let i = self.fresh.binary_search_by_key(&id, |r| r.id).ok()?;
        self.fresh.get_mut(i)
    }
}

/// A classic queue's delivery state.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct QueueMachine<M> {
    config: QueueConfig,
    /// Time of the command being applied.
    now: u64,
    /// The message enqueued by the command being applied: it may go to a waiting consumer
    /// even with a TTL of 0 (RabbitMQ's immediate delivery).
    arriving: Option<MsgId>,
    next_id: MsgId,
    /// Ready messages per priority level, served from the highest.
    levels: BTreeMap<u8, Level<M>>,
    ready_count: usize,
    unacked: HashMap<MsgId, Unacked<M>>,
    consumers: BTreeMap<ConsumerId, Consumer>,
    /// Consumers with credit, round-robin within each priority (highest served first).
    rings: BTreeMap<i32, VecDeque<ConsumerId>>,
    exclusive_consumer: Option<ConsumerId>,
    /// Attached consumers under a shared limit.
    limited_consumers: usize,
    /// Consumers ever attached (their attach order).
    attach_seq: u64,
    ready_bytes: u64,
    unacked_bytes: u64,
    counters: Counters,
}

impl<M: MessageRef> Default for QueueMachine<M> {
    fn default() -> Self {
        Self::new()
    }
}

impl<M: MessageRef> QueueMachine<M> {
    /// An empty queue without limits or priorities.
    #[must_use]
    pub fn new() -> Self {
        Self::with_config(QueueConfig::default())
    }

    /// An empty queue with `config`.
    #[must_use]
    pub fn with_config(config: QueueConfig) -> Self {
        Self {
            config,
            now: 0,
            arriving: None,
            next_id: 1,
            levels: BTreeMap::new(),
            ready_count: 0,
            unacked: HashMap::new(),
            consumers: BTreeMap::new(),
            rings: BTreeMap::new(),
            exclusive_consumer: None,
            limited_consumers: 0,
            attach_seq: 0,
            ready_bytes: 0,
            unacked_bytes: 0,
            counters: Counters::default(),
        }
    }

    /// Messages ready for delivery.
    #[must_use]
    pub fn ready_len(&self) -> usize {
        self.ready_count
    }

    /// The priority level a message waits in: its priority capped at `x-max-priority`, or 0
    /// when the queue has no priorities.
    fn level_of(&self, msg: &M) -> u8 {
        self.config
            .max_priority
            .map_or(0, |max| msg.priority().min(max))
    }

    /// Put unacked messages back, marked redelivered, counting a delivery each: removed
    /// past the delivery limit; at the back under new ids when `to_back`, else in their
    /// original place.
    fn return_messages(&mut self, ids: Vec<MsgId>, to_back: bool, effects: &mut Vec<Effect<M>>) {
        for id in ids {
            if let Some(Unacked {
                msg,
                expires_at,
                delivery_count: count,
                enqueued_at,
                ..
            }) = self.take_unacked(id)
            {
                let delivery_count = count.saturating_add(1);
                if self
                    .config
                    .delivery_limit
                    .is_some_and(|limit| delivery_count > limit)
                {
                    self.counters.discarded += 1;
                    effects.push(Effect::Removed {
                        id,
                        msg,
                        reason: Removal::DeliveryLimit,
                    });
                    continue;
                }
                if to_back {
                    let new = self.next_id;
                    self.next_id += 1;
                    effects.push(Effect::Requeued {
                        old: id,
                        new,
                        msg: msg.clone(),
                    });
                    self.push_fresh(Ready {
                        id: new,
                        msg,
                        redelivered: true,
                        expires_at,
                        delivery_count,
                        enqueued_at,
                    });
                    continue;
                }
                self.push_returned(Ready {
                    id,
                    msg,
                    redelivered: true,
                    expires_at,
                    delivery_count,
                    enqueued_at,
                });
            }
        }
    }

    fn push_fresh(&mut self, r: Ready<M>) {
        let level = self.level_of(&r.msg);
        self.ready_bytes += r.msg.size();
        self.ready_count += 1;
        let l = self.levels.entry(level).or_default();
        debug_assert!(
            l.fresh.back().is_none_or(|b| b.id < r.id),
            "fresh ids increase"
        );
        l.fresh.push_back(r);
    }

    fn push_returned(&mut self, r: Ready<M>) {
        let level = self.level_of(&r.msg);
        self.ready_bytes += r.msg.size();
        self.ready_count += 1;
        let l = self.levels.entry(level).or_default();
        debug_assert!(l.fresh.front().is_none_or(|f| f.id > r.id));
        l.returned.insert(r.id, r);
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

    fn over_limits(&self) -> bool {
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

    /// The queue's configuration.
    #[must_use]
    pub fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// The id the next `Enqueue` will get.
    #[must_use]
    pub fn next_id(&self) -> MsgId {
        self.next_id
    }

    /// Messages delivered and not yet settled.
    #[must_use]
    pub fn unacked_len(&self) -> usize {
        self.unacked.len()
    }

    /// When the oldest ready message entered the queue (machine time, ms), if any is ready.
    /// A returned message counts from its first enqueue; a restored one from its restore.
    #[must_use]
    pub fn oldest_ready_at(&self) -> Option<u64> {
        self.levels
            .values()
            .flat_map(|l| [l.returned.values().next(), l.fresh.front()])
            .flatten()
            .map(|r| r.enqueued_at)
            .min()
    }

    /// Bytes of ready messages.
    #[must_use]
    pub fn ready_bytes(&self) -> u64 {
        self.ready_bytes
    }

    /// Bytes of unacked messages.
    #[must_use]
    pub fn unacked_bytes(&self) -> u64 {
        self.unacked_bytes
    }

    /// Attached consumers.
    #[must_use]
    pub fn consumer_count(&self) -> usize {
        self.consumers.len()
    }

    /// Whether `consumer` is attached.
    #[must_use]
    pub fn has_consumer(&self, consumer: ConsumerId) -> bool {
        self.consumers.contains_key(&consumer)
    }

    /// Whether an exclusive consumer holds the queue.
    #[must_use]
    pub fn has_exclusive_consumer(&self) -> bool {
        self.exclusive_consumer.is_some()
    }

    /// Consumers under a shared limit that would receive a message now if granted one (no
    /// unused grant, other credit left, messages ready): the driver obtains limiter slots for
    /// them and sends [`Command::Grant`]. Empty unless some consumer is limited.
    pub fn grant_candidates(&self, out: &mut Vec<ConsumerId>) {
        if self.limited_consumers == 0 || self.ready_len() == 0 {
            return;
        }
        out.extend(
            self.consumers
                .iter()
                .filter(|(_, c)| c.is_limited() && !c.granted && c.own_credit())
                .map(|(id, _)| *id),
        );
    }

    /// Whether `consumer` holds an unused grant (released to the limiter when it goes).
    #[must_use]
    pub fn holds_grant(&self, consumer: ConsumerId) -> bool {
        self.consumers.get(&consumer).is_some_and(|c| c.granted)
    }

    /// Whether `consumer` is attached and under a shared limit.
    #[must_use]
    pub fn is_limited(&self, consumer: ConsumerId) -> bool {
        self.consumers
            .get(&consumer)
            .is_some_and(Consumer::is_limited)
    }

    /// Lifetime counters.
    #[must_use]
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Apply one command at time `now_ms`; effects are appended to `effects`.
    pub fn apply(
        &mut self,
        now_ms: u64,
        command: Command<M>,
        effects: &mut Vec<Effect<M>>,
    ) -> Result<Reply<M>, MachineError> {
        self.now = self.now.max(now_ms);
        self.arriving = None;
        self.expire_heads(effects);
        let reply = match command {
            Command::Enqueue(msg) => {
                if self.would_reject(&msg) {
                    return Ok(Reply::Rejected(msg));
                }
                let id = self.next_id;
                self.next_id += 1;
                self.counters.enqueued += 1;
                let expires_at = self.expiry_of(&msg);
                self.arriving = Some(id);
                self.push_fresh(Ready {
                    id,
                    msg,
                    redelivered: false,
                    expires_at,
                    delivery_count: 0,
                    enqueued_at: self.now,
                });
                Reply::Ok
            }
            Command::Restore {
                id,
                msg,
                redelivered,
                expires_at: stored_expiry,
            } => {
                debug_assert!(
                    id >= self.next_id,
                    "restored ids arrive in increasing order"
                );
                self.next_id = self.next_id.max(id + 1);
                self.counters.enqueued += 1;
                let expires_at = stored_expiry.or_else(|| self.expiry_of(&msg));
                self.push_fresh(Ready {
                    id,
                    msg,
                    redelivered,
                    expires_at,
                    delivery_count: 0,
                    enqueued_at: self.now,
                });
                Reply::Ok
            }
            Command::Checkout(consumer, spec) => {
                if self.consumers.contains_key(&consumer) {
                    return Err(MachineError::DuplicateConsumer);
                }
                if self.exclusive_consumer.is_some()
                    || (spec.exclusive && !self.consumers.is_empty())
                {
                    return Err(MachineError::ExclusiveInUse);
                }
                if spec.exclusive {
                    self.exclusive_consumer = Some(consumer);
                }
                if spec.limited && !spec.no_ack {
                    self.limited_consumers += 1;
                }
                let active = !self.config.single_active || self.consumers.is_empty();
                self.attach_seq += 1;
                self.consumers.insert(
                    consumer,
                    Consumer {
                        spec,
                        unacked: 0,
                        unwritten: 0,
                        unwritten_bytes: 0,
                        granted: false,
                        active,
                        attached: self.attach_seq,
                        in_ring: false,
                    },
                );
                self.refresh_ring(consumer);
                Reply::Ok
            }
            Command::Cancel(consumer) => {
                if let Some(gone) = self.consumers.remove(&consumer) {
                    if gone.is_limited() {
                        self.limited_consumers -= 1;
                    }
                    if gone.in_ring {
                        self.ring_remove(gone.spec.priority, consumer);
                    }
                    if gone.unacked > 0 {
                        // Its messages stay checked out, owned by nobody's prefetch.
                        for u in self
                            .unacked
                            .values_mut()
                            .filter(|u| u.consumer == Some(consumer))
                        {
                            u.consumer = None;
                        }
                    }
                    if self.exclusive_consumer == Some(consumer) {
                        self.exclusive_consumer = None;
                    }
                    // Single active consumer: the longest-attached remaining one takes over.
                    if gone.active
                        && self.config.single_active
                        && let Some((&next, c)) =
                            self.consumers.iter_mut().min_by_key(|(_, c)| c.attached)
                    {
                        c.active = true;
                        self.refresh_ring(next);
                    }
                }
                Reply::Ok
            }
            Command::Written(consumer, n, bytes) => {
                if let Some(c) = self.consumers.get_mut(&consumer) {
                    c.unwritten = c.unwritten.saturating_sub(n);
                    c.unwritten_bytes = c.unwritten_bytes.saturating_sub(bytes);
                    self.refresh_ring(consumer);
                }
                Reply::Ok
            }
            Command::Settle(ids) => {
                for id in ids {
                    if let Some(Unacked { msg, .. }) = self.take_unacked(id) {
                        self.counters.settled += 1;
                        self.counters.acked += 1;
                        effects.push(Effect::Removed {
                            id,
                            msg,
                            reason: Removal::Settled,
                        });
                    }
                }
                Reply::Ok
            }
            Command::Discard(ids) => {
                for id in ids {
                    if let Some(Unacked { msg, .. }) = self.take_unacked(id) {
                        self.counters.discarded += 1;
                        effects.push(Effect::Removed {
                            id,
                            msg,
                            reason: Removal::Rejected,
                        });
                    }
                }
                Reply::Ok
            }
            Command::TrackOffset { .. } => Reply::Ok,
            Command::Down { node, before } => {
                let of_node = |c: ConsumerId| consumer_node(c) == node && c < before;
                let mut gone: Vec<ConsumerId> = self
                    .consumers
                    .keys()
                    .copied()
                    .filter(|c| of_node(*c))
                    .collect();
                gone.sort_unstable();
                for c in gone {
                    let _ = self.apply(now_ms, Command::Cancel(c), effects);
                }
                let mut held: Vec<MsgId> = self
                    .unacked
                    .iter()
                    .filter(|(_, u)| u.owner.is_some_and(of_node))
                    .map(|(id, _)| *id)
                    .collect();
                // Replicas must produce the same effects in the same order.
                held.sort_unstable();
                return self.apply(now_ms, Command::Return(held), effects);
            }
            Command::Return(ids) => {
                self.return_messages(ids, false, effects);
                Reply::Ok
            }
            Command::Requeue(ids) => {
                let to_back = self.config.returns_to_back();
                self.return_messages(ids, to_back, effects);
                Reply::Ok
            }
            Command::Get { no_ack } => match self.pop_live(effects) {
                None => Reply::Got(None),
                Some(r) => {
                    let size = r.msg.size();
                    self.counters.got += 1;
                    self.counters.redelivered += u64::from(r.redelivered);
                    if no_ack {
                        self.counters.settled += 1;
                        effects.push(Effect::Removed {
                            id: r.id,
                            msg: r.msg.clone(),
                            reason: Removal::Settled,
                        });
                    } else {
                        self.unacked_bytes += size;
                        self.unacked.insert(
                            r.id,
                            Unacked {
                                msg: r.msg.clone(),
                                consumer: None,
                                owner: None,
                                expires_at: r.expires_at,
                                delivery_count: r.delivery_count,
                                enqueued_at: r.enqueued_at,
                            },
                        );
                    }
                    let remaining = u32::try_from(self.ready_len()).unwrap_or(u32::MAX);
                    Reply::Got(Some((
                        r.id,
                        r.msg,
                        r.redelivered,
                        remaining,
                        r.delivery_count,
                    )))
                }
            },
            Command::Swap { id, msg } => {
                let level = self.level_of(&msg);
                let slot = match self.levels.get_mut(&level).and_then(|l| l.get_mut(id)) {
                    Some(r) => Some((&mut r.msg, true)),
                    None => self.unacked.get_mut(&id).map(|u| (&mut u.msg, false)),
                };
                if let Some((old, ready)) = slot {
                    let (before, after) = (old.size(), msg.size());
                    *old = msg;
                    let bytes = if ready {
                        &mut self.ready_bytes
                    } else {
                        &mut self.unacked_bytes
                    };
                    *bytes = *bytes - before + after;
                }
                Reply::Ok
            }
            Command::Grant(consumer) => {
                if let Some(c) = self.consumers.get_mut(&consumer)
                    && c.is_limited()
                {
                    c.granted = true;
                    self.refresh_ring(consumer);
                }
                Reply::Ok
            }
            Command::SetLimited(consumer, limited) => {
                if let Some(c) = self.consumers.get_mut(&consumer) {
                    let was = c.is_limited();
                    c.spec.limited = limited;
                    c.granted = false;
                    match (was, c.is_limited()) {
                        (false, true) => self.limited_consumers += 1,
                        (true, false) => self.limited_consumers -= 1,
                        _ => {}
                    }
                    let (in_ring, credit, priority) = (c.in_ring, c.has_credit(), c.spec.priority);
                    if in_ring && !credit {
                        c.in_ring = false;
                        self.ring_remove(priority, consumer);
                    }
                    self.refresh_ring(consumer);
                }
                Reply::Ok
            }
            Command::Expire => Reply::Ok,
            Command::Configure(config) => {
                // Priority levels and single-active are fixed at declaration (not policies).
                self.config = QueueConfig {
                    max_priority: self.config.max_priority,
                    single_active: self.config.single_active,
                    ..config
                };
                Reply::Ok
            }
            Command::Purge => {
                let n = self.ready_len();
                for (_, level) in std::mem::take(&mut self.levels).into_iter().rev() {
                    for r in level.returned.into_values().chain(level.fresh) {
                        effects.push(Effect::Removed {
                            id: r.id,
                            msg: r.msg,
                            reason: Removal::Purged,
                        });
                    }
                }
                self.ready_count = 0;
                self.ready_bytes = 0;
                self.counters.purged += n as u64;
                Reply::Purged(u32::try_from(n).unwrap_or(u32::MAX))
            }
        };
        self.dispatch(effects);
        // What waiting consumers did not take expires now if its time is up (a TTL of 0).
        self.arriving = None;
        self.expire_heads(effects);
        // Waiting consumers took what they could; a drop-head limit now trims the rest.
        while self.config.overflow == Overflow::DropHead && self.over_limits() {
            let Some(r) = self.pop_ready() else { break };
            self.counters.dropped += 1;
            effects.push(Effect::Removed {
                id: r.id,
                msg: r.msg,
                reason: Removal::MaxLen,
            });
        }
        // Dropping may have brought an expired message to a head.
        self.expire_heads(effects);
        debug_assert_eq!(
            (self.ready_len() + self.unacked.len()) as u64,
            self.counters.live(),
            "message conservation"
        );
        #[cfg(test)]
        self.check_invariants();
        Ok(reply)
    }

    fn take_unacked(&mut self, id: MsgId) -> Option<Unacked<M>> {
        let u = self.unacked.remove(&id)?;
        self.unacked_bytes -= u.msg.size();
        if let Some(cid) = u.consumer
            && let Some(c) = self.consumers.get_mut(&cid)
        {
            c.unacked -= 1;
            self.refresh_ring(cid);
        }
        Some(u)
    }

    /// When a message arriving now expires: the shorter of the queue's and its own TTL.
    fn expiry_of(&self, msg: &M) -> Option<u64> {
        self.expiry_at(msg, self.now)
    }

    /// When `msg` would expire if enqueued at `now` (drivers store it with the message).
    #[must_use]
    pub fn expiry_at(&self, msg: &M, now: u64) -> Option<u64> {
        let ttl = match (self.config.message_ttl, msg.expiration_ms()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        ttl.map(|t| now.saturating_add(t))
    }

    fn is_expired(&self, r: &Ready<M>) -> bool {
        r.expires_at.is_some_and(|at| at <= self.now) && self.arriving != Some(r.id)
    }

    /// Drop expired messages at the head of every level (RabbitMQ expires messages when they
    /// reach the head, so a long per-message TTL in front holds shorter ones behind it).
    fn expire_heads(&mut self, effects: &mut Vec<Effect<M>>) {
        // Runs on every command: the common case (no expired head) must not allocate.
        if !self
            .levels
            .values()
            .any(|l| l.peek().is_some_and(|r| self.is_expired(r)))
        {
            return;
        }
        let levels: Vec<u8> = self.levels.keys().copied().collect();
        for level in levels {
            loop {
                let head_expired = self
                    .levels
                    .get(&level)
                    .and_then(Level::peek)
                    .is_some_and(|r| self.is_expired(r));
                if !head_expired {
                    break;
                }
                let Some(r) = self.pop_level(level) else {
                    break;
                };
                self.counters.expired += 1;
                effects.push(Effect::Removed {
                    id: r.id,
                    msg: r.msg,
                    reason: Removal::Expired,
                });
            }
        }
    }

    /// The next ready message that has not expired (expired ones met on the way are removed).
    fn pop_live(&mut self, effects: &mut Vec<Effect<M>>) -> Option<Ready<M>> {
        loop {
            let r = self.pop_ready()?;
            if !self.is_expired(&r) {
                return Some(r);
            }
            self.counters.expired += 1;
            effects.push(Effect::Removed {
                id: r.id,
                msg: r.msg,
                reason: Removal::Expired,
            });
        }
    }

    /// The earliest time at which a message at the head of a level expires: the driver runs
    /// [`Command::Expire`] then.
    #[must_use]
    pub fn next_expiry(&self) -> Option<u64> {
        self.levels
            .values()
            .filter_map(|l| l.peek().and_then(|r| r.expires_at))
            .min()
    }

    /// Put the consumer in its priority's ring if it has credit and is not there yet.
    fn refresh_ring(&mut self, id: ConsumerId) {
        if let Some(c) = self.consumers.get_mut(&id)
            && !c.in_ring
            && c.has_credit()
        {
            c.in_ring = true;
            self.rings.entry(c.spec.priority).or_default().push_back(id);
        }
    }

    fn ring_remove(&mut self, priority: i32, id: ConsumerId) {
        if let Some(ring) = self.rings.get_mut(&priority) {
            ring.retain(|c| *c != id);
            if ring.is_empty() {
                self.rings.remove(&priority);
            }
        }
    }

    /// The next consumer in turn at the highest priority that has one.
    fn pop_ring(&mut self) -> Option<ConsumerId> {
        let mut entry = self.rings.last_entry()?;
        let id = entry.get_mut().pop_front();
        if entry.get().is_empty() {
            entry.remove();
        }
        id
    }

    /// Take the next message to deliver (highest priority, then original order), keeping the
    /// ready counters.
    fn pop_ready(&mut self) -> Option<Ready<M>> {
        let top = *self.levels.keys().next_back()?;
        self.pop_level(top)
    }

    fn pop_level(&mut self, level: u8) -> Option<Ready<M>> {
        let l = self.levels.get_mut(&level)?;
        let r = l.pop();
        if l.len() == 0 {
            self.levels.remove(&level);
        }
        let r = r?;
        self.ready_count -= 1;
        self.ready_bytes -= r.msg.size();
        Some(r)
    }

    /// Hand ready messages to consumers with credit, one each in turn.
    fn dispatch(&mut self, effects: &mut Vec<Effect<M>>) {
        while !self.rings.is_empty() && self.ready_len() > 0 {
            let Some(cid) = self.pop_ring() else {
                break;
            };
            let Some(c) = self.consumers.get_mut(&cid) else {
                continue;
            };
            c.in_ring = false;
            if !c.has_credit() {
                continue;
            }
            let Some(r) = self.pop_live(effects) else {
                // Only expired messages were left: the consumer keeps its turn.
                self.refresh_ring(cid);
                break;
            };
            let Some(c) = self.consumers.get_mut(&cid) else {
                break;
            };
            let size = r.msg.size();
            self.counters.delivered += 1;
            self.counters.redelivered += u64::from(r.redelivered);
            c.unwritten += 1;
            c.unwritten_bytes += size;
            if c.is_limited() {
                c.granted = false;
            }
            if c.spec.no_ack {
                self.counters.settled += 1;
            } else {
                c.unacked += 1;
                self.unacked_bytes += size;
                self.unacked.insert(
                    r.id,
                    Unacked {
                        msg: r.msg.clone(),
                        consumer: Some(cid),
                        owner: Some(cid),
                        expires_at: r.expires_at,
                        delivery_count: r.delivery_count,
                        enqueued_at: r.enqueued_at,
                    },
                );
            }
            effects.push(Effect::Deliver {
                consumer: cid,
                id: r.id,
                msg: r.msg,
                redelivered: r.redelivered,
                settled: c.spec.no_ack,
                delivery_count: r.delivery_count,
            });
            if c.has_credit() {
                c.in_ring = true;
                self.rings
                    .entry(c.spec.priority)
                    .or_default()
                    .push_back(cid);
            }
        }
    }

    /// Assert the machine's invariants (all of them after every apply in tests; the O(1)
    /// conservation check after every apply in debug builds). Costs O(messages).
    ///
    /// # Panics
    /// When an invariant is broken: that is a bug in the machine.
    pub fn check_invariants(&self) {
        let c = self.counters;
        let live = (self.ready_len() + self.unacked.len()) as u64;
        assert_eq!(live, c.live(), "message conservation");
        let mut ready_bytes = 0;
        let mut ready_count = 0;
        for (level, l) in &self.levels {
            assert!(l.len() > 0, "no empty levels");
            if let (Some((max_returned, _)), Some(first_fresh)) =
                (l.returned.last_key_value(), l.fresh.front())
            {
                assert!(
                    *max_returned < first_fresh.id,
                    "returned messages precede fresh ones"
                );
            }
            assert!(
                l.fresh
                    .iter()
                    .zip(l.fresh.iter().skip(1))
                    .all(|(a, b)| a.id < b.id),
                "fresh is FIFO"
            );
            for r in l.fresh.iter().chain(l.returned.values()) {
                assert_eq!(self.level_of(&r.msg), *level, "message in its level");
                ready_bytes += r.msg.size();
                ready_count += 1;
            }
        }
        assert_eq!(ready_count, self.ready_count, "ready count");
        assert_eq!(ready_bytes, self.ready_bytes, "ready bytes");
        if self.config.overflow == Overflow::DropHead {
            assert!(!self.over_limits(), "within length limits");
        }
        let unacked_bytes: u64 = self.unacked.values().map(|u| u.msg.size()).sum();
        assert_eq!(unacked_bytes, self.unacked_bytes, "unacked bytes");
        assert_eq!(
            self.limited_consumers,
            self.consumers.values().filter(|c| c.is_limited()).count(),
            "limited consumer count"
        );
        if self.config.single_active {
            let active: Vec<_> = self.consumers.iter().filter(|(_, c)| c.active).collect();
            let oldest = self.consumers.values().map(|c| c.attached).min();
            assert!(
                active.len() == usize::from(!self.consumers.is_empty())
                    && active
                        .first()
                        .is_none_or(|(_, c)| Some(c.attached) == oldest),
                "exactly the longest-attached consumer is active"
            );
        }
        for (id, consumer) in &self.consumers {
            let owned = self
                .unacked
                .values()
                .filter(|u| u.consumer == Some(*id))
                .count() as u32;
            assert_eq!(owned, consumer.unacked, "consumer unacked count");
            let in_ring = self
                .rings
                .get(&consumer.spec.priority)
                .is_some_and(|r| r.contains(id));
            assert_eq!(consumer.in_ring, in_ring, "ring membership flag");
            if !consumer.spec.no_ack && consumer.spec.prefetch > 0 {
                assert!(
                    consumer.unacked <= consumer.spec.prefetch,
                    "prefetch respected"
                );
            }
            assert!(
                consumer.unwritten <= consumer.spec.window,
                "window respected"
            );
            assert!(
                !consumer.granted || consumer.is_limited(),
                "only limited consumers hold grants"
            );
        }
        if self.ready_len() > 0 {
            assert!(
                self.rings.is_empty(),
                "no consumer with credit while messages are ready"
            );
        }
    }
}

#[cfg(test)]
mod tests;
