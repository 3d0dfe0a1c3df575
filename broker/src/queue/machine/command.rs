//! The driver's vocabulary: the [`Command`]s it applies, the [`Effect`]s and [`Reply`] it gets
//! back, [`MachineError`], why a message left ([`Removal`]) and how a consumer receives
//! ([`ConsumerSpec`]).
//!
//! These types are replicated (a clustered queue's log carries commands, its snapshots carry
//! consumer specs), so their serialized form is fixed: new `Command` variants go last, so that
//! logs written before them still decode.

use super::config::{QueueConfig, WorkConfig};
use super::{ConsumerId, MsgId};

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
    /// Time passed: drop messages whose TTL ran out (see
    /// [`QueueMachine::next_expiry`](super::QueueMachine::next_expiry)).
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
    /// Node `node` (see [`consumer_node`](super::consumer_node)) is down or restarted: its
    /// consumers with ids below `before` (all of them, or those of its previous run) are
    /// detached and every message delivered to them and not settled is returned
    /// (redelivered), as rabbit_fifo does on a consumer's `down`.
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
    /// Claim up to `max` ready messages under a lease (the work-queue contract; see
    /// the `lease` module). Replies [`Reply::Claimed`].
    Claim {
        /// Most messages to claim.
        max: u32,
        /// The lease, ms (None: the queue's default), cut to the queue's caps.
        lease_ms: Option<u64>,
        /// Who claims (kept with the lease).
        worker: String,
    },
    /// Extend the lease of claim `(id, generation)` to `lease_ms` from now, within the
    /// queue's caps. Replies [`Reply::Lease`].
    Extend {
        /// The message.
        id: MsgId,
        /// The claim's generation.
        generation: u32,
        /// When the message entered the queue (the claim's `enqueued_at`): a message of
        /// another queue incarnation or a restored one under the same id differs.
        enqueued_at: u64,
        /// The new lease from now, ms.
        lease_ms: u64,
    },
    /// Acknowledge claim `(id, generation)`: the message leaves. Replies [`Reply::Lease`].
    AckLease {
        /// The message.
        id: MsgId,
        /// The claim's generation.
        generation: u32,
        /// When the message entered the queue (the claim's `enqueued_at`).
        enqueued_at: u64,
    },
    /// Release claim `(id, generation)`: the message returns as a failed delivery, ready
    /// after `delay_ms` (None: the retry policy's delay). Replies [`Reply::Lease`].
    Release {
        /// The message.
        id: MsgId,
        /// The claim's generation.
        generation: u32,
        /// When the message entered the queue (the claim's `enqueued_at`).
        enqueued_at: u64,
        /// Wait this long before it is ready again, ms.
        delay_ms: Option<u64>,
        /// Why the worker gave it back.
        reason: String,
    },
    /// New work-queue settings (leases, delayed retries): a policy or declaration changed.
    ConfigureWork(WorkConfig),
    /// The client gave unacked deliveries back as failed, to be ready again after `delay_ms`
    /// (None: the retry policy's delay): Warren's AMQP release extension. Past the delivery
    /// limit they are dead-lettered with `reason` and `worker` as their failure context.
    Retry {
        /// The messages.
        ids: Vec<MsgId>,
        /// Wait this long before each is ready again, ms.
        delay_ms: Option<u64>,
        /// Why the client gave them back.
        reason: String,
        /// Who gave them back (the consumer tag).
        worker: String,
    },
    /// The next `Enqueue` carries this deduplication key (`x-deduplication-header`): sent
    /// just before it, in the same submission. See the `dedup` module.
    Dedup {
        /// The key.
        key: Vec<u8>,
    },
    /// The next `Enqueue` is a redrive's move carrying this key: dropped as a duplicate if
    /// the queue remembers the key, else taken and the key remembered until
    /// [`Command::ForgetMoveKeys`]. Sent just before it, in the same submission. See the
    /// `moves` module.
    MoveKey {
        /// The key (names the source message).
        key: Vec<u8>,
    },
    /// Moves finished (their source messages are acknowledged): forget their keys.
    ForgetMoveKeys {
        /// The keys.
        keys: Vec<Vec<u8>>,
    },
    /// Put back what a queue on the local store kept beside its messages (recovery):
    /// deduplication keys with the time each was remembered, oldest first, move keys, and
    /// the due times of scheduled messages (restored as ready, now held again until then).
    RestoreKeys {
        /// Deduplication keys and their times, ms.
        dedup: Vec<(Vec<u8>, u64)>,
        /// Move keys.
        moves: Vec<Vec<u8>>,
        /// Scheduled messages: id and due time, ms.
        due: Vec<(MsgId, u64)>,
    },
    /// The next `Enqueue` is a delayed publish: held (scheduled) until machine time `until`,
    /// then ready at the back of the queue. Sent just before it, in the same submission.
    Delay {
        /// When it becomes ready, ms.
        until: u64,
    },
    /// Claim the ready messages `ids`, wherever they wait, under a lease (a redrive takes what
    /// its filter chose). Replies [`Reply::Claimed`] with those it took.
    Take {
        /// The messages.
        ids: Vec<MsgId>,
        /// The lease, ms (None: the queue's default), cut to the queue's caps.
        lease_ms: Option<u64>,
        /// Who claims.
        worker: String,
    },
}

/// Which window a remembered key belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum KeyKind {
    /// Publish deduplication (`x-deduplication-header`).
    Dedup,
    /// A redrive's move.
    Move,
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
            Self::Claim {
                max,
                lease_ms,
                worker,
            } => Command::Claim {
                max,
                lease_ms,
                worker,
            },
            Self::Extend {
                id,
                generation,
                enqueued_at,
                lease_ms,
            } => Command::Extend {
                id,
                generation,
                enqueued_at,
                lease_ms,
            },
            Self::AckLease {
                id,
                generation,
                enqueued_at,
            } => Command::AckLease {
                id,
                generation,
                enqueued_at,
            },
            Self::Release {
                id,
                generation,
                enqueued_at,
                delay_ms,
                reason,
            } => Command::Release {
                id,
                generation,
                enqueued_at,
                delay_ms,
                reason,
            },
            Self::ConfigureWork(c) => Command::ConfigureWork(c),
            Self::Retry {
                ids,
                delay_ms,
                reason,
                worker,
            } => Command::Retry {
                ids,
                delay_ms,
                reason,
                worker,
            },
            Self::Dedup { key } => Command::Dedup { key },
            Self::MoveKey { key } => Command::MoveKey { key },
            Self::ForgetMoveKeys { keys } => Command::ForgetMoveKeys { keys },
            Self::RestoreKeys { dedup, moves, due } => Command::RestoreKeys { dedup, moves, due },
            Self::Delay { until } => Command::Delay { until },
            Self::Take {
                ids,
                lease_ms,
                worker,
            } => Command::Take {
                ids,
                lease_ms,
                worker,
            },
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
            Self::Claimed(claims) => Reply::Claimed(
                claims
                    .into_iter()
                    .map(|c| c.try_map(&mut f))
                    .collect::<Result<_, E>>()?,
            ),
            Self::Lease(r) => Reply::Lease(r),
            Self::Duplicate(m) => Reply::Duplicate(f(m)?),
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
    /// The failure context of a message about to be removed past its delivery limit (the
    /// [`Effect::Removed`] that follows, same id): what its last worker said when it gave it
    /// back, or that its lease ran out. The driver puts it in the dead letter's headers.
    Failed {
        /// The message.
        id: MsgId,
        /// The last release's reason (`lease expired` when its lease ran out).
        reason: String,
        /// The worker that held it last.
        worker: String,
        /// Deliveries returned, this one included.
        delivery_count: u32,
    },
    /// A message is held until `due` (a delayed publish or a delayed retry): a queue on the
    /// local store keeps the due time beside the message, so a restart holds it again.
    Scheduled {
        /// The message.
        id: MsgId,
        /// When it is ready, ms.
        due: u64,
    },
    /// A scheduled message is no longer held (it came due, was purged, or was restored after
    /// its due time): a queue on the local store deletes the due time it kept.
    Unscheduled {
        /// The message (its id while it was held).
        id: MsgId,
    },
    /// A remembered key left its window (aged out, pushed out, or its move finished): a
    /// queue on the local store deletes the record it kept for it.
    KeyForgotten {
        /// Its window.
        kind: KeyKind,
        /// The key.
        key: Vec<u8>,
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
    /// What a [`Command::Claim`] took, in delivery order.
    Claimed(Vec<Claimed<M>>),
    /// The outcome of [`Command::Extend`], [`Command::AckLease`] or [`Command::Release`]:
    /// the claim's state, or why the token changed nothing.
    Lease(Result<LeaseState, LeaseError>),
    /// `Enqueue` of a message whose deduplication key the queue remembers: dropped, handed
    /// back (its publisher is confirmed all the same).
    Duplicate(M),
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

/// A message handed out by [`Command::Claim`](super::Command::Claim).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Claimed<M> {
    /// Message id (with `generation`, the claim's token).
    pub id: MsgId,
    /// The message.
    pub msg: M,
    /// This claim's generation.
    pub generation: u32,
    /// Deliveries returned before this claim (`x-delivery-count`).
    pub delivery_count: u32,
    /// Delivered before.
    pub redelivered: bool,
    /// Machine time at which the lease runs out, ms.
    pub lease_expires_at: u64,
    /// Machine time the message entered the queue, ms.
    pub enqueued_at: u64,
}

/// What a claim is after a lease command that succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum LeaseState {
    /// Still claimed, its lease running until `lease_expires_at`.
    Claimed {
        /// Machine time at which the lease runs out, ms.
        lease_expires_at: u64,
    },
    /// Acknowledged: the message left the queue.
    Acked,
    /// Released: the message is ready again, or scheduled until `ready_at`.
    Released {
        /// Machine time from which it is ready again (None: ready now, or removed past the
        /// delivery limit).
        ready_at: Option<u64>,
    },
}

/// Why a lease command changed nothing.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize,
)]
pub enum LeaseError {
    /// The queue holds no message of that id and enqueue time (settled, removed, never one,
    /// or the queue was declared anew or restored since the claim).
    #[error("unknown delivery")]
    NotFound,
    /// Another claim or delivery of the message superseded this generation.
    #[error("stale generation (current {current})")]
    StaleGeneration {
        /// The message's current generation.
        current: u32,
    },
    /// This generation's lease ran out (or was released) and nothing claimed the message since.
    #[error("lease expired (generation {current})")]
    LeaseExpired {
        /// The message's current generation.
        current: u32,
    },
}

impl<M> Claimed<M> {
    /// The same claim over another message reference.
    ///
    /// # Errors
    /// The error of `f`.
    pub fn try_map<N, E>(self, f: impl FnOnce(M) -> Result<N, E>) -> Result<Claimed<N>, E> {
        Ok(Claimed {
            id: self.id,
            msg: f(self.msg)?,
            generation: self.generation,
            delivery_count: self.delivery_count,
            redelivered: self.redelivered,
            lease_expires_at: self.lease_expires_at,
            enqueued_at: self.enqueued_at,
        })
    }

    /// The same claim over another message reference.
    pub fn map<N>(self, f: impl FnOnce(M) -> N) -> Claimed<N> {
        let Ok(c) = self.try_map(|m| Ok::<N, std::convert::Infallible>(f(m)));
        c
    }
}
