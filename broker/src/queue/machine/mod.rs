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
//!
//! Layout: this file holds the ids, [`MessageRef`], the machine's state ([`QueueMachine`],
//! [`Counters`]) and [`QueueMachine::apply`], which routes each command to its handler and then
//! runs the steps every command ends with (dispatch, expiry, drop-head). The handlers live in
//! `impl QueueMachine` blocks of the child modules:
//! - `command`: the driver's vocabulary ([`Command`], [`Effect`], [`Reply`], [`MachineError`],
//!   [`Removal`], [`ConsumerSpec`]);
//! - `config`: [`QueueConfig`], [`Overflow`] and the length limits;
//! - `ready`: the ready set (priority levels, order, byte and count totals), enqueue, restore,
//!   purge, swap;
//! - `settle`: unacked messages and how they leave (settle, discard, return, delivery limit);
//! - `consumers`: attached consumers, their credit and service rings, single active consumer,
//!   cancel and node down;
//! - `deliver`: handing ready messages out (to consumers with credit, and basic.get);
//! - `expiry`: message TTLs;
//! - `lease`: claims under a lease, generation-fenced ack, extend and release, lease expiry
//!   (the work-queue contract);
//! - `schedule`: messages waiting out a delayed retry;
//! - `dedup`: the publish deduplication window;
//! - `moves`: keys of redrive moves into the queue (a move taken once, however often sent);
//! - `browse`: reading messages by state and position without claiming them;
//! - `invariants`: [`QueueMachine::check_invariants`].
//!
//! The handlers call each other freely (one type's methods), but the files' imports run one
//! way: `config` imports no sibling; `command` imports `config`; `ready` and `consumers` import
//! `command`; `settle` and `expiry` import `command` and `ready`; `deliver` imports `command`
//! and `settle`; `schedule` imports `ready`; `lease` imports `command`, `config`, `ready` and `settle`; `moves` and `dedup` import
//! `command`;
//! `invariants` imports `config`.
//!
//! Work-queue state (leases, scheduled messages, their settings and counters) sits in one
//! field, `work`, last in the machine, so that a machine encoded before it existed still
//! decodes ([`QueueMachineV1`]). Its settings ([`WorkConfig`]) are apart from
//! [`QueueConfig`], whose replicated form (in `Configure` log entries) stays as it was.

mod browse;
mod command;
mod config;
mod consumers;
mod dedup;
mod deliver;
mod expiry;
mod invariants;
mod lease;
mod moves;
mod ready;
mod schedule;
mod settle;

use std::collections::{BTreeMap, HashMap, VecDeque};

pub use browse::{BrowseState, Browsed};
pub use command::{
    Claimed, Command, ConsumerSpec, Effect, KeyKind, LeaseError, LeaseState, MachineError, Removal,
    Reply,
};
pub use config::{
    DEDUP_CACHE_SIZE_DEFAULT, DEDUP_KEY_MAX, DEDUP_TTL_DEFAULT_MS, DELIVERY_LIMIT_NONE,
    DedupConfig, LeaseConfig, Overflow, QueueConfig, RetryOn, RetryPolicy, ReturnKind, WorkConfig,
};
use consumers::Consumer;
use lease::Leases;
pub use moves::{MOVE_KEY_MAX, MOVE_KEYS_MAX};
use ready::Level;
use schedule::Scheduled;
use settle::Unacked;

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

/// Counters of the work-queue contract (claims, leases, delayed retries).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WorkCounters {
    /// Messages claimed under a lease.
    pub claimed: u64,
    /// Leases extended.
    pub extended: u64,
    /// Claims released by their worker.
    pub released: u64,
    /// Leases that ran out.
    pub lease_expired: u64,
    /// Returns held for a delayed retry.
    pub retries_delayed: u64,
    /// Publishes dropped as duplicates.
    pub deduplicated: u64,
    /// Redrive moves dropped because the queue had taken them already (an interrupted
    /// redrive run again).
    pub moves_refused: u64,
    /// Publishes held for a delay before they were ready.
    pub delayed_publishes: u64,
    /// Acknowledged messages by the attempt that succeeded (the delivery count plus one):
    /// one bucket per bound of [`ATTEMPT_BOUNDS`], the last for the rest.
    pub acked_attempts: [u64; ATTEMPT_BUCKETS],
    /// The sum of those attempts.
    pub acked_attempts_sum: u64,
    /// Messages removed past the delivery limit (quarantined: dead-lettered with their
    /// failure context when the queue has a dead-letter target).
    pub quarantined: u64,
}

/// Upper bounds of the attempts histogram's buckets ([`WorkCounters::acked_attempts`]).
pub const ATTEMPT_BOUNDS: [u32; 5] = [1, 2, 3, 5, 10];
/// Buckets of the attempts histogram: one per bound, and one past the last.
pub const ATTEMPT_BUCKETS: usize = ATTEMPT_BOUNDS.len() + 1;

impl WorkCounters {
    /// Count an acknowledgement at attempt `attempt` (1 for the first delivery).
    pub(crate) fn count_ack(&mut self, attempt: u32) {
        let bucket = ATTEMPT_BOUNDS
            .iter()
            .position(|b| attempt <= *b)
            .unwrap_or(ATTEMPT_BOUNDS.len());
        self.acked_attempts[bucket] += 1;
        self.acked_attempts_sum += u64::from(attempt);
    }

    /// The smallest bound within which `quantile` (0..=1) of the acknowledged messages
    /// succeeded; None before any ack, `u32::MAX` when that is past the last bound.
    #[must_use]
    pub fn attempts_quantile(&self, quantile: f64) -> Option<u32> {
        let total: u64 = self.acked_attempts.iter().sum();
        if total == 0 {
            return None;
        }
        let want = (quantile * total as f64).ceil() as u64;
        let mut seen = 0;
        for (i, n) in self.acked_attempts.iter().enumerate() {
            seen += n;
            if seen >= want.max(1) {
                return Some(ATTEMPT_BOUNDS.get(i).copied().unwrap_or(u32::MAX));
            }
        }
        Some(u32::MAX)
    }
}

/// The machine's work-queue state: leases of claims and messages scheduled for a delayed
/// retry. Its own field, last, so that a machine encoded before it existed still decodes
/// ([`QueueMachineV1`]).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Work<M> {
    config: WorkConfig,
    leases: Leases,
    scheduled: Scheduled<M>,
    counters: WorkCounters,
    /// The last failure of each message a worker released or let expire, until it leaves:
    /// its dead letter carries it ([`Effect::Failed`]).
    failures: BTreeMap<MsgId, lease::Failure>,
    /// Deduplication keys remembered.
    dedup: dedup::DedupWindow,
    /// Keys of redrive moves into this queue not yet finished.
    moves: moves::MoveKeys,
    /// The delay of the next `Enqueue` (see [`Command::Delay`]).
    pending_delay: Option<u64>,
}

impl<M> Default for Work<M> {
    fn default() -> Self {
        Self {
            config: WorkConfig::default(),
            leases: Leases::default(),
            scheduled: Scheduled::default(),
            counters: WorkCounters::default(),
            failures: BTreeMap::new(),
            dedup: dedup::DedupWindow::default(),
            moves: moves::MoveKeys::default(),
            pending_delay: None,
        }
    }
}

impl Counters {
    /// Messages still in the queue according to the counters.
    #[must_use]
    pub fn live(&self) -> u64 {
        self.enqueued - self.settled - self.discarded - self.purged - self.dropped - self.expired
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
    /// Serialized in id order, so equal states serialize alike (replica digests).
    #[serde(serialize_with = "in_key_order")]
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
    /// Leases and delayed retries (last: see [`Work`]).
    work: Work<M>,
}

/// A [`QueueMachine`] as encoded before it had work-queue state: decode a stored or received
/// machine as a `QueueMachine` first and, when that fails, as this, then convert.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct QueueMachineV1<M> {
    config: QueueConfig,
    now: u64,
    arriving: Option<MsgId>,
    next_id: MsgId,
    levels: BTreeMap<u8, Level<M>>,
    ready_count: usize,
    unacked: HashMap<MsgId, Unacked<M>>,
    consumers: BTreeMap<ConsumerId, Consumer>,
    rings: BTreeMap<i32, VecDeque<ConsumerId>>,
    exclusive_consumer: Option<ConsumerId>,
    limited_consumers: usize,
    attach_seq: u64,
    ready_bytes: u64,
    unacked_bytes: u64,
    counters: Counters,
}

impl<M> From<QueueMachineV1<M>> for QueueMachine<M> {
    fn from(v: QueueMachineV1<M>) -> Self {
        Self {
            config: v.config,
            now: v.now,
            arriving: v.arriving,
            next_id: v.next_id,
            levels: v.levels,
            ready_count: v.ready_count,
            unacked: v.unacked,
            consumers: v.consumers,
            rings: v.rings,
            exclusive_consumer: v.exclusive_consumer,
            limited_consumers: v.limited_consumers,
            attach_seq: v.attach_seq,
            ready_bytes: v.ready_bytes,
            unacked_bytes: v.unacked_bytes,
            counters: v.counters,
            work: Work::default(),
        }
    }
}

/// A map serialized in key order (a `HashMap`'s own order differs between equal maps).
fn in_key_order<S: serde::Serializer, K: Ord + serde::Serialize, V: serde::Serialize>(
    map: &HashMap<K, V>,
    s: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut entries: Vec<(&K, &V)> = map.iter().collect();
    entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
    let mut out = s.serialize_map(Some(entries.len()))?;
    for (k, v) in entries {
        out.serialize_entry(k, v)?;
    }
    out.end()
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
            work: Work::default(),
        }
    }

    /// An empty queue with `config` and work-queue settings `work`.
    #[must_use]
    pub fn with_configs(config: QueueConfig, work: WorkConfig) -> Self {
        let mut m = Self::with_config(config);
        m.work.config = work;
        m
    }

    /// The queue's work-queue settings.
    #[must_use]
    pub fn work_config(&self) -> &WorkConfig {
        &self.work.config
    }

    /// Work-queue counters (claims, leases, delayed retries).
    #[must_use]
    pub fn work_counters(&self) -> WorkCounters {
        self.work.counters
    }

    /// Messages the queue holds: ready, unacked (claimed included) and scheduled.
    #[must_use]
    pub fn len(&self) -> usize {
        self.ready_len() + self.unacked.len() + self.work.scheduled.len()
    }

    /// Whether the queue holds no message.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The id the next `Enqueue` will get.
    #[must_use]
    pub fn next_id(&self) -> MsgId {
        self.next_id
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
        // New settings do not move the machine's clock: a replicated queue's replica takes
        // its policies locally when it is created, before it replays its log, and a clock
        // moved to that moment would make every replayed entry's times (enqueue times in
        // lease tokens, TTLs, lease deadlines) differ from its leader's.
        if !matches!(command, Command::Configure(_) | Command::ConfigureWork(_)) {
            self.now = self.now.max(now_ms);
        }
        self.arriving = None;
        let first_effect = effects.len();
        // Time passed: leases run out and delayed retries come due before the command sees
        // the queue (so a stale token finds its lease gone, and a claim finds what is due).
        self.expire_leases(effects);
        self.promote_due(effects);
        self.expire_heads(effects);
        let reply = match command {
            Command::Enqueue(msg) => {
                let (duplicate, key) = self.take_pending_key(effects);
                let (moved_before, move_key) = self.take_pending_move();
                let delay = self.work.pending_delay.take().filter(|&at| at > self.now);
                if duplicate || moved_before {
                    self.forget_failures(&effects[first_effect..]);
                    return Ok(Reply::Duplicate(msg));
                }
                if self.would_reject(&msg) {
                    self.forget_failures(&effects[first_effect..]);
                    return Ok(Reply::Rejected(msg));
                }
                match delay {
                    Some(until) => self.enqueue_delayed(msg, until, effects),
                    None => self.enqueue(msg),
                }
                if let Some(key) = key {
                    self.remember_key(key, effects);
                }
                if let Some(key) = move_key {
                    self.remember_move(key, effects);
                }
                Reply::Ok
            }
            Command::Dedup { key } => {
                self.set_pending_key(key);
                Reply::Ok
            }
            Command::MoveKey { key } => {
                self.set_pending_move(key);
                Reply::Ok
            }
            Command::ForgetMoveKeys { keys } => {
                self.forget_moves(keys, effects);
                Reply::Ok
            }
            Command::RestoreKeys { dedup, moves, due } => {
                self.restore_keys(dedup, effects);
                for key in moves {
                    self.remember_move(key, effects);
                }
                self.restore_due(due, effects);
                Reply::Ok
            }
            Command::Delay { until } => {
                self.work.pending_delay = Some(until);
                Reply::Ok
            }
            Command::Take {
                ids,
                lease_ms,
                worker,
            } => Reply::Claimed(self.take(&ids, lease_ms, &worker, effects)),
            Command::Restore {
                id,
                msg,
                redelivered,
                expires_at,
            } => {
                self.restore(id, msg, redelivered, expires_at);
                Reply::Ok
            }
            Command::Checkout(consumer, spec) => {
                self.checkout(consumer, spec)?;
                Reply::Ok
            }
            Command::Cancel(consumer) => {
                self.cancel(consumer);
                Reply::Ok
            }
            Command::Written(consumer, n, bytes) => {
                self.written(consumer, n, bytes);
                Reply::Ok
            }
            Command::Settle(ids) => {
                self.settle(ids, effects);
                Reply::Ok
            }
            Command::Discard(ids) => {
                self.discard(ids, effects);
                Reply::Ok
            }
            Command::TrackOffset { .. } => Reply::Ok,
            // Applies its own Cancel and Return commands, which end as every command does.
            Command::Down { node, before } => return self.down(now_ms, node, before, effects),
            Command::Return(ids) => {
                self.return_messages(ids, false, ReturnKind::Returned, effects);
                Reply::Ok
            }
            Command::Requeue(ids) => {
                let to_back = self.config.returns_to_back();
                self.return_messages(ids, to_back, ReturnKind::Failed, effects);
                Reply::Ok
            }
            Command::Claim {
                max,
                lease_ms,
                worker,
            } => Reply::Claimed(self.claim(max, lease_ms, worker, effects)),
            Command::Extend {
                id,
                generation,
                enqueued_at,
                lease_ms,
            } => Reply::Lease(self.extend((id, generation, enqueued_at), lease_ms)),
            Command::AckLease {
                id,
                generation,
                enqueued_at,
            } => Reply::Lease(self.ack_lease((id, generation, enqueued_at), effects)),
            // The reason stays with the message until it leaves (a dead letter carries it).
            Command::Release {
                id,
                generation,
                enqueued_at,
                delay_ms,
                reason,
            } => Reply::Lease(self.release_lease(
                (id, generation, enqueued_at),
                delay_ms,
                reason,
                effects,
            )),
            Command::ConfigureWork(config) => {
                self.work.config = config;
                Reply::Ok
            }
            Command::Retry {
                ids,
                delay_ms,
                reason,
                worker,
            } => {
                self.retry(ids, delay_ms, &reason, &worker, effects);
                Reply::Ok
            }
            Command::Get { no_ack } => Reply::Got(self.get(no_ack, effects)),
            Command::Swap { id, msg } => {
                self.swap(id, msg);
                Reply::Ok
            }
            Command::Grant(consumer) => {
                self.grant(consumer);
                Reply::Ok
            }
            Command::SetLimited(consumer, limited) => {
                self.set_limited(consumer, limited);
                Reply::Ok
            }
            Command::Expire => Reply::Ok,
            Command::Configure(config) => {
                self.configure(config);
                Reply::Ok
            }
            Command::Purge => Reply::Purged(self.purge(effects)),
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
        self.forget_failures(&effects[first_effect..]);
        debug_assert_eq!(
            self.len() as u64,
            self.counters.live(),
            "message conservation"
        );
        #[cfg(test)]
        self.check_invariants();
        Ok(reply)
    }
}

#[cfg(test)]
mod delay_tests;
#[cfg(test)]
mod lease_tests;
#[cfg(test)]
mod moves_tests;
#[cfg(test)]
mod tests;
