//! Queues: the pure [`machine::QueueMachine`] and its in-memory driver [`Queue`].
//!
//! The driver owns the machine behind a per-queue mutex (never a global lock, never held across
//! an `.await`), turns channel calls into machine commands, and carries out the effects:
//! deliveries go into the consumer's connection [`Outbox`]. Pushing into an outbox takes no lock.
//!
//! A durable queue (with a store) also writes: persistent messages are submitted to the store
//! under the queue lock *before* the machine may deliver them, and their removals (ack, reject,
//! purge, no-ack delivery) are submitted under the same lock, so the store sees every message's
//! enqueue before its settle.

mod consume;
mod dead_letter;
mod expiry;
pub mod host;
mod lease;
pub mod limiter;
pub mod machine;
pub mod outbox;
mod publish;
mod remote;
pub mod replica;
mod replicated;
mod settle;
pub mod stream;

pub use host::{NoHost, QueueHost};
pub use lease::{
    ClaimDone, ClaimOutcome, LeaseCallError, LeaseDone, LeaseOutcome, LeasesDone, LeasesOutcome,
};
use publish::below_flow_release;
pub use publish::{Enqueued, PublishOptions, publish_routed};
use publish::{Join, publish_local};
pub use remote::{ServeDone, loaded_message};
use replicated::replicated_outcome;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use amq_protocol::types::FieldTable;
use parking_lot::Mutex;

use warren_store::writer::Completion;
use warren_store::{Batch, BodyRef, Location, Op};

use crate::deadletter::{self, DeadLetterTarget};
use crate::durable::Durable;
use crate::durable::OnCommit;
use crate::exchange::RoutingHeaders;
use crate::message::codec::stored;
use crate::message::{Entry, Message, Outgoing};
use crate::queue::limiter::{Limiter, Wake};
use crate::queue::outbox::{Delivery, Outbound, Outbox};
use crate::queue::replica::{ReplicationError, Replicator, Replies};
use machine::{
    Command, ConsumerId, ConsumerSpec, Effect, KeyKind, MachineError, MsgId, Overflow,
    QueueMachine, Removal, Reply,
};

/// The owner of a proxy's exclusive queue (see [`Queue::is_remote`]): no connection of this
/// node, so every client here is refused it, as RabbitMQ refuses another connection's
/// exclusive queue.
pub const REMOTE_OWNER: u64 = u64::MAX;

/// What basic.get took: the message id, the message, its redelivered flag, the ready count
/// after it and its delivery count.
pub type Got = (MsgId, Outgoing, bool, u32, u32);

/// Where a consumer's deliveries go.
#[derive(Debug, Clone)]
pub struct ConsumerSink {
    /// The consumer's connection.
    pub outbox: Arc<Outbox>,
    /// Its channel.
    pub channel: u16,
    /// The channel's shared limit (basic.qos global), for consumers that ack.
    pub limiter: Option<Arc<Limiter>>,
}

/// Counts reported by queue.declare-ok and friends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueCounts {
    /// Ready messages.
    pub messages: u32,
    /// Attached consumers.
    pub consumers: u32,
}

/// What [`Queue::stats`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueueStats {
    /// Messages ready for delivery.
    pub ready: u64,
    /// Messages delivered and not yet acked.
    pub unacked: u64,
    /// Body bytes of ready messages.
    pub ready_bytes: u64,
    /// Body bytes of unacked messages.
    pub unacked_bytes: u64,
    /// Attached consumers.
    pub consumers: u64,
    /// Lifetime counters (enqueued, settled, ...).
    pub counters: machine::Counters,
    /// How long the oldest ready message has waited, in milliseconds (None: nothing ready).
    pub oldest_ready_age_ms: Option<u64>,
    /// Claims, leases and delayed retries (the work-queue contract).
    #[serde(default)]
    pub work: WorkStats,
}

/// A queue's work-queue figures: what waits out a delayed retry, what is claimed, and how
/// long the oldest claim has been out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WorkStats {
    /// Messages scheduled for a delayed retry (neither ready nor unacked).
    pub scheduled: u64,
    /// Body bytes of scheduled messages.
    pub scheduled_bytes: u64,
    /// Messages claimed under a lease (counted in `unacked` too).
    pub leased: u64,
    /// How long the oldest claim still leased has been out, ms.
    pub oldest_claim_age_ms: Option<u64>,
    /// Lifetime counters: claims, extensions, releases, expired leases, delayed retries.
    pub counters: machine::WorkCounters,
}

#[derive(Debug)]
struct State {
    machine: QueueMachine<Entry>,
    sinks: HashMap<ConsumerId, ConsumerSink>,
    deleted: bool,
    effects: Vec<Effect<Entry>>,
    /// Whether any consumer ever attached (auto-delete needs one to have left).
    had_consumer: bool,
    /// Store ops produced while carrying out effects, submitted before the lock is released.
    store_ops: Vec<Op>,
    /// When the timer thread will call [`Queue::on_timer`] (None: not armed).
    timer_at: Option<u64>,
    /// Last use for `x-expires` (declare, consume, get, last consumer gone).
    last_used: u64,
    /// Dead-letter target (declare arguments and policy).
    dead_letter: Option<DeadLetterTarget>,
    /// Queue expiry in milliseconds (declare arguments and policy).
    expires: Option<u64>,
    /// Messages to dead-letter once the lock is released (pinned: their store records stay
    /// readable after the settles submitted under the lock commit).
    dead_letters: Vec<(Outgoing, Removal, Option<dead_letter::FailureContext>)>,
    /// Whether this node dead-letters what the machine removes: always, but for a replicated
    /// queue's followers (its leader does, once).
    dead_letters_here: bool,
}

/// What a queue is connected to in its broker.
#[derive(Debug, Clone)]
pub struct QueueEnv {
    /// The node's store (used only by durable, non-exclusive queues).
    pub store: Option<Arc<Durable>>,
    /// The node's timer thread (message expiry).
    pub timers: Option<Arc<crate::timers::Timers>>,
    /// The vhost, for dead-lettering and `x-expires`.
    pub vhost: std::sync::Weak<dyn QueueHost>,
}

impl Default for QueueEnv {
    fn default() -> Self {
        Self {
            store: None,
            timers: None,
            vhost: std::sync::Weak::<NoHost>::new(),
        }
    }
}

/// A stream queue's settings and, once opened, its log and readers.
#[derive(Debug)]
struct StreamSlot {
    config: Mutex<crate::stream::log::StreamConfig>,
    open: std::sync::OnceLock<Arc<crate::queue::stream::StreamQueue>>,
}

/// A queue with its declaration and delivery state.
#[derive(Debug)]
pub struct Queue {
    /// Broker-unique id; for durable queues also the key of their messages in the store.
    pub id: u64,
    /// Name.
    pub name: String,
    /// Vhost name.
    pub vhost: String,
    /// Durable flag as declared.
    pub durable: bool,
    /// Deleted when its last consumer goes.
    pub auto_delete: bool,
    /// The connection that owns it, for exclusive queues.
    pub exclusive_owner: Option<u64>,
    /// Declare arguments.
    pub arguments: FieldTable,
    /// Where persistent messages go (durable, non-exclusive queues of a broker with a store).
    store: Option<Arc<Durable>>,
    timers: Option<Arc<crate::timers::Timers>>,
    vhost_ref: std::sync::Weak<dyn QueueHost>,
    /// Set when `State::dead_letters` has work (checked without the lock).
    dead_letters_pending: AtomicBool,
    /// The machine's ready bytes as of its last command, read without the lock by the store
    /// writer's completions: most queues are short and need no lock there at all.
    ready_bytes_hint: AtomicU64,
    /// Ready messages as of the last command (flow control reads it without the lock).
    ready_len_hint: AtomicU64,
    /// Machine time of the last delivery (flow control: are consumers receiving?).
    last_delivery_ms: AtomicU64,
    /// Notified when the queue drains below half of the flow limits.
    flow_drained: tokio::sync::Notify,
    /// Whether the queue deduplicates publishes (its work config, read without the lock on
    /// every publish).
    dedup_enabled: AtomicBool,
    /// Notified when the queue goes from no ready message to some (long-polling claims wait
    /// on it; only that transition notifies, so a busy queue pays nothing for it).
    ready_arrived: tokio::sync::Notify,
    /// Declared with `x-queue-type: quorum` (delivery limit, `x-delivery-count`).
    pub is_quorum: bool,
    /// `x-consumer-timeout` in milliseconds (overrides the broker's default).
    pub consumer_timeout: Option<u64>,
    /// Declared with `x-queue-type: stream`: what it holds lives in [`Queue::stream`], and
    /// the machine stays empty.
    pub is_stream: bool,
    /// A stream's retention (declare arguments and policy) and, once opened, the stream.
    stream: Option<StreamSlot>,
    /// A quorum queue of a cluster: its Raft group, set once when the cluster starts this
    /// node's replica. From then on channel commands go to the group and the machine changes
    /// only by [`Queue::apply_committed`].
    replica: std::sync::OnceLock<Arc<dyn Replicator>>,
    state: Mutex<State>,
}

impl Queue {
    /// A new empty queue. The store is used only if the queue is durable and not exclusive.
    #[must_use]
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: u64,
        name: &str,
        vhost: &str,
        durable: bool,
        auto_delete: bool,
        exclusive_owner: Option<u64>,
        arguments: FieldTable,
        env: QueueEnv,
    ) -> Arc<Self> {
        let store = env.store.filter(|_| durable && exclusive_owner.is_none());
        let settings = crate::policy::queue_settings(&arguments, None, None);
        let is_stream = crate::stream::is_stream(&arguments);
        let stream = is_stream.then(|| StreamSlot {
            config: Mutex::new(crate::stream::config_with_policy(&arguments, None, name)),
            open: std::sync::OnceLock::new(),
        });
        Arc::new(Self {
            id,
            store,
            name: name.to_string(),
            vhost: vhost.to_string(),
            durable,
            auto_delete,
            exclusive_owner,
            is_quorum: crate::args::is_quorum(&arguments),
            is_stream,
            stream,
            consumer_timeout: arguments
                .inner()
                .get("x-consumer-timeout")
                .and_then(crate::args::int_value)
                .and_then(|n| u64::try_from(n).ok()),
            arguments,
            timers: env.timers,
            vhost_ref: env.vhost,
            dead_letters_pending: AtomicBool::new(false),
            ready_bytes_hint: AtomicU64::new(0),
            ready_len_hint: AtomicU64::new(0),
            last_delivery_ms: AtomicU64::new(0),
            flow_drained: tokio::sync::Notify::new(),
            ready_arrived: tokio::sync::Notify::new(),
            dedup_enabled: AtomicBool::new(settings.work.dedup.enabled),
            replica: std::sync::OnceLock::new(),
            state: Mutex::new(State {
                machine: QueueMachine::with_configs(settings.config, settings.work),
                dead_letter: settings.dead_letter,
                expires: settings.expires,
                sinks: HashMap::new(),
                deleted: false,
                effects: Vec::new(),
                had_consumer: false,
                last_used: crate::timers::wall_ms(),
                store_ops: Vec::new(),
                timer_at: None,
                dead_letters: Vec::new(),
                dead_letters_here: true,
            }),
        })
    }

    /// The stream of a stream queue, once opened ([`Queue::open_stream`]).
    #[must_use]
    pub fn stream(&self) -> Option<&Arc<crate::queue::stream::StreamQueue>> {
        self.stream.as_ref().and_then(|s| s.open.get())
    }

    /// Open a stream queue's stream in `dir` (its files, its writer); once.
    ///
    /// # Errors
    /// Its files do not recover, or its writer cannot start.
    pub fn open_stream(
        self: &Arc<Self>,
        dir: &std::path::Path,
        table_depth_max: usize,
    ) -> Result<(), warren_store::StoreError> {
        let Some(slot) = &self.stream else {
            return Ok(());
        };
        if slot.open.get().is_some() {
            return Ok(());
        }
        let config = slot.config.lock().clone();
        let stream = crate::queue::stream::StreamQueue::open(self, dir, config, table_depth_max)?;
        let _ = slot.open.set(stream);
        Ok(())
    }

    /// Open this node's replica of a cluster's stream in `dir` (appended to by its group's
    /// committed entries, [`Queue::apply_committed`]); once.
    ///
    /// # Errors
    /// Its files do not recover.
    pub fn open_stream_replica(
        self: &Arc<Self>,
        dir: &std::path::Path,
    ) -> Result<(), warren_store::StoreError> {
        let table_depth_max = warren_amqp::limits::TABLE_DEPTH_MAX;
        let Some(slot) = &self.stream else {
            return Ok(());
        };
        if slot.open.get().is_some() {
            return Ok(());
        }
        let config = slot.config.lock().clone();
        let stream =
            crate::queue::stream::StreamQueue::open_replica(self, dir, config, table_depth_max)?;
        let _ = slot.open.set(stream);
        Ok(())
    }

    /// Make this queue a replica of its Raft group (once; false if it already is one).
    pub fn attach_replica(&self, replica: Arc<dyn Replicator>) -> bool {
        self.replica.set(replica).is_ok()
    }

    /// The queue's Raft group, when it is a replicated queue of a cluster.
    #[must_use]
    pub fn replica(&self) -> Option<&Arc<dyn Replicator>> {
        self.replica.get()
    }

    /// Whether channel commands go through a Raft group.
    #[must_use]
    pub fn is_replicated(&self) -> bool {
        self.replica.get().is_some()
    }

    /// A message of this queue on its way to a client: from memory, its store record, or
    /// (a quorum queue's replica) its log here.
    pub(crate) fn pin(&self, entry: &Entry) -> crate::message::Outgoing {
        crate::durable::pin_from(
            entry,
            self.store.as_deref(),
            self.replica().and_then(|r| r.bodies()),
        )
    }

    /// A message left this replica's machine: a logged body may go.
    fn release(&self, entry: &Entry) {
        if let Entry::Logged { key, .. } = entry
            && let Some(bodies) = self.replica().and_then(|r| r.bodies())
        {
            bodies.release(*key);
        }
    }

    /// Read the machine (a replicated queue's snapshot).
    pub fn with_machine<T>(&self, f: impl FnOnce(&QueueMachine<Entry>) -> T) -> T {
        f(&self.state.lock().machine)
    }

    /// Replace the machine by a snapshot's (a replica that fell behind the group's log). The
    /// consumers attached here keep their sinks; those the snapshot no longer knows receive
    /// nothing more.
    pub fn install_machine(&self, machine: QueueMachine<Entry>) {
        let mut st = self.state.lock();
        st.machine = machine;
        self.update_hints(&st);
    }

    /// The machine's time: wall-clock milliseconds (absolute, so expiry times can be stored).
    fn now_ms(&self) -> u64 {
        crate::timers::wall_ms()
    }

    /// Apply the queue's policy and operator policy (None: none matches any more): its
    /// effective settings are recomputed from the declare arguments and both, and take effect
    /// at once.
    pub fn apply_policy(
        self: &Arc<Self>,
        policy: Option<&crate::policy::Policy>,
        operator: Option<&crate::policy::Policy>,
    ) {
        if self.is_remote() {
            // The home node applies its own copy of the policies to the queue.
            return;
        }
        if let Some(slot) = &self.stream {
            let what = crate::args::rs("queue", &self.name, &self.vhost);
            let config = crate::stream::config_with_policy(&self.arguments, policy, &what);
            *slot.config.lock() = config.clone();
            if let Some(stream) = slot.open.get() {
                stream.configure(config);
            }
            return;
        }
        let settings = crate::policy::queue_settings(&self.arguments, policy, operator);
        self.dedup_enabled
            .store(settings.work.dedup.enabled, Ordering::Relaxed);
        {
            let mut st = self.state.lock();
            st.dead_letter = settings.dead_letter;
            st.expires = settings.expires;
            match self.replica() {
                Some(replica) => {
                    let mut commands = vec![Command::Configure(settings.config)];
                    if *st.machine.work_config() != settings.work {
                        commands.push(Command::ConfigureWork(settings.work));
                    }
                    self.submit_quietly(replica, commands);
                }
                None => {
                    let _ = self.run(&mut st, Command::Configure(settings.config));
                    if *st.machine.work_config() != settings.work {
                        let _ = self.run(&mut st, Command::ConfigureWork(settings.work));
                    }
                }
            }
        }
        self.dead_letter_pending();
    }

    /// The kind of queue policies see it as.
    #[must_use]
    pub fn policy_kind(&self) -> crate::policy::Applies {
        if self.is_stream {
            crate::policy::Applies::Stream
        } else if self.is_quorum {
            crate::policy::Applies::QuorumQueue
        } else {
            crate::policy::Applies::ClassicQueue
        }
    }

    /// Apply a command and carry out its effects, under the queue lock. Then consumers under a
    /// shared limit that could take a ready message are offered limiter slots, one delivery per
    /// slot, so one command may deliver up to the limit.
    fn run(
        self: &Arc<Self>,
        st: &mut State,
        command: Command<Entry>,
    ) -> Result<Reply<Entry>, MachineError> {
        self.run_at(st, command, self.now_ms())
    }

    /// [`Queue::run`] at a given machine time: a caller that predicted the outcome of a
    /// command at `now` (the persistent publish) gets exactly that outcome.
    fn run_at(
        self: &Arc<Self>,
        st: &mut State,
        command: Command<Entry>,
        now: u64,
    ) -> Result<Reply<Entry>, MachineError> {
        let reply = self.apply_at(st, command, now);
        self.submit_store_ops(st, None);
        reply
    }

    /// [`Queue::run`] without submitting the store ops it produced (the caller does, after
    /// pinning what it must read, or with its own completion).
    fn apply(
        self: &Arc<Self>,
        st: &mut State,
        command: Command<Entry>,
    ) -> Result<Reply<Entry>, MachineError> {
        self.apply_at(st, command, self.now_ms())
    }

    /// [`Queue::apply`] at a given machine time.
    fn apply_at(
        self: &Arc<Self>,
        st: &mut State,
        command: Command<Entry>,
        now: u64,
    ) -> Result<Reply<Entry>, MachineError> {
        let mut effects = std::mem::take(&mut st.effects);
        let reply = st.machine.apply(now, command, &mut effects);
        if effects.iter().any(|e| matches!(e, Effect::Deliver { .. })) {
            self.last_delivery_ms.store(now, Ordering::Relaxed);
        }
        self.carry_out(st, &mut effects);
        self.offer_grants(st, &mut effects);
        st.effects = effects;
        self.arm_timer(st);
        self.update_hints(st);
        reply
    }

    /// Publish the lock-free hints, and wake publishers paused on this queue once it drained.
    fn update_hints(&self, st: &State) {
        let (len, bytes) = (st.machine.ready_len() as u64, st.machine.ready_bytes());
        let was_bytes = self.ready_bytes_hint.swap(bytes, Ordering::Relaxed);
        let was_len = self.ready_len_hint.swap(len, Ordering::Relaxed);
        if !below_flow_release(was_len, was_bytes) && below_flow_release(len, bytes) {
            self.flow_drained.notify_waiters();
        }
        if was_len == 0 && len > 0 {
            self.ready_arrived.notify_waiters();
        }
    }

    /// A future that resolves once the queue has a ready message after having none. Enable
    /// it (`Notified::enable`) before looking at the queue, so that an arrival between the
    /// look and the wait is not missed. A proxy's machine is empty and never notifies.
    pub fn ready_arrived(&self) -> tokio::sync::futures::Notified<'_> {
        self.ready_arrived.notified()
    }

    /// Resolves once the queue is below half of the flow limits (at once if it already is).
    pub async fn flow_released(&self) {
        let notified = self.flow_drained.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if let Some(stream) = self.stream() {
            if stream.flow_released() {
                return;
            }
        } else if below_flow_release(
            self.ready_len_hint.load(Ordering::Relaxed),
            self.ready_bytes_hint.load(Ordering::Relaxed),
        ) {
            return;
        }
        notified.await;
    }

    /// Whether `entry` is kept in the store while in this queue.
    #[must_use]
    pub fn persists(&self, entry: &Entry) -> bool {
        self.store.is_some() && entry.is_persistent()
    }

    /// Whether this queue writes persistent messages to a store.
    #[must_use]
    pub fn is_stored(&self) -> bool {
        self.store.is_some()
    }

    /// Submit the store ops produced under this lock; `on_commit` provides a completion when
    /// the caller waits for them (e.g. purge-ok, tx.commit-ok).
    fn submit_store_ops(&self, st: &mut State, on_commit: Option<OnCommit<'_>>) {
        if let Some(store) = &self.store
            && !st.store_ops.is_empty()
        {
            let ops = std::mem::take(&mut st.store_ops);
            match on_commit {
                Some(done) => store.submit(
                    Batch {
                        bodies: Vec::new(),
                        ops,
                    },
                    done(),
                ),
                None => store.submit_ops(ops),
            }
        }
    }

    fn offer_grants(self: &Arc<Self>, st: &mut State, effects: &mut Vec<Effect<Entry>>) {
        let mut candidates = Vec::new();
        loop {
            candidates.clear();
            st.machine.grant_candidates(&mut candidates);
            let Some(consumer) = candidates.iter().copied().find(|c| {
                st.sinks
                    .get(c)
                    .and_then(|s| s.limiter.as_ref())
                    .is_some_and(|l| l.try_reserve(self, *c))
            }) else {
                return;
            };
            let _ = st
                .machine
                .apply(self.now_ms(), Command::Grant(consumer), effects);
            self.carry_out(st, effects);
        }
    }

    fn carry_out(self: &Arc<Self>, st: &mut State, effects: &mut Vec<Effect<Entry>>) {
        // An `Effect::Failed` comes just ahead of the removal it describes.
        let mut failure: Option<(MsgId, dead_letter::FailureContext)> = None;
        for effect in effects.drain(..) {
            match effect {
                Effect::Failed {
                    id,
                    reason,
                    worker,
                    delivery_count,
                } => {
                    failure = Some((
                        id,
                        dead_letter::FailureContext {
                            reason,
                            worker,
                            delivery_count,
                        },
                    ));
                }
                Effect::Removed { id, msg, reason } => {
                    let context = failure.take().filter(|(of, _)| *of == id).map(|(_, c)| c);
                    // A deleted queue's messages are gone with it (its store records too).
                    if st.deleted {
                        continue;
                    }
                    if st.dead_letter.is_some() && deadletter::reason_name(reason).is_some() {
                        self.hold_dead_letter(st, &msg, reason, context);
                    }
                    if self.persists(&msg) {
                        st.store_ops.push(Op::Settle { queue: self.id, id });
                    }
                    // After the dead letter was read (a logged body is read when pinned).
                    self.release(&msg);
                }
                Effect::Scheduled { id, due } => {
                    if !st.deleted && self.store.is_some() {
                        st.store_ops.push(crate::durable::due_put(self.id, id, due));
                    }
                }
                Effect::Unscheduled { id } => {
                    if !st.deleted && self.store.is_some() {
                        st.store_ops.push(crate::durable::due_delete(self.id, id));
                    }
                }
                Effect::KeyForgotten { kind, key } => {
                    // A key forgotten and remembered again within one command (a dedup key
                    // whose window ran out, published again) stays: its record was written
                    // with the message.
                    let remembered = match kind {
                        KeyKind::Dedup => st.machine.remembers_dedup_key(&key),
                        KeyKind::Move => st.machine.would_refuse_move(&key),
                    };
                    if !st.deleted && self.store.is_some() && !remembered {
                        st.store_ops
                            .push(crate::durable::key_delete(self.id, kind, &key));
                    }
                }
                Effect::Requeued { old, new, msg } => {
                    if !st.deleted && self.persists(&msg) {
                        st.store_ops.push(Op::Renumber {
                            queue: self.id,
                            from: old,
                            to: new,
                        });
                    }
                }
                Effect::Deliver {
                    consumer,
                    id,
                    msg,
                    redelivered,
                    settled,
                    delivery_count,
                } => {
                    if settled && self.persists(&msg) {
                        st.store_ops.push(Op::Settle { queue: self.id, id });
                    }
                    let Some(sink) = st.sinks.get(&consumer) else {
                        if settled {
                            self.release(&msg);
                        }
                        if let Some(replica) = self.replica() {
                            // Another node's consumer (its node delivers), or one of ours
                            // whose client is gone (cancelled before its checkout committed):
                            // detach that one, then give the message back, so the machine
                            // does not deliver to it again and again (each return counts
                            // towards the delivery limit).
                            if machine::consumer_node(consumer) == replica.local_node() {
                                self.submit_quietly(
                                    replica,
                                    vec![Command::Cancel(consumer), Command::Return(vec![id])],
                                );
                            }
                        } else {
                            debug_assert!(false, "delivery to a consumer without a sink");
                        }
                        continue;
                    };
                    sink.outbox.push(Outbound::Deliver(Delivery {
                        channel: sink.channel,
                        consumer,
                        queue: Arc::clone(self),
                        id,
                        message: self.pin(&msg),
                        redelivered,
                        counted: st.machine.is_limited(consumer),
                        delivery_count,
                    }));
                    if settled {
                        self.release(&msg);
                    }
                }
            }
        }
    }

    /// A consistent snapshot of the queue's depth for the management API and metrics.
    #[must_use]
    pub fn stats(&self) -> QueueStats {
        if let Some(stats) = self.replica().and_then(|r| r.remote_stats()) {
            return stats;
        }
        if let Some(stream) = self.stream() {
            let s = stream.stats(self.now_ms());
            return QueueStats {
                ready: s.messages,
                unacked: s.unacked,
                ready_bytes: s.bytes,
                unacked_bytes: 0,
                consumers: s.consumers,
                counters: machine::Counters {
                    enqueued: s.published,
                    delivered: s.delivered,
                    ..machine::Counters::default()
                },
                oldest_ready_age_ms: None,
                work: WorkStats::default(),
            };
        }
        let st = self.state.lock();
        QueueStats {
            ready: st.machine.ready_len() as u64,
            unacked: st.machine.unacked_len() as u64,
            ready_bytes: st.machine.ready_bytes(),
            unacked_bytes: st.machine.unacked_bytes(),
            consumers: st.machine.consumer_count() as u64,
            counters: st.machine.counters(),
            oldest_ready_age_ms: st
                .machine
                .oldest_ready_at()
                .map(|at| self.now_ms().saturating_sub(at)),
            work: WorkStats {
                scheduled: st.machine.scheduled_len() as u64,
                scheduled_bytes: st.machine.scheduled_bytes(),
                leased: st.machine.leased_len() as u64,
                oldest_claim_age_ms: st
                    .machine
                    .oldest_claim_at()
                    .map(|at| self.now_ms().saturating_sub(at)),
                counters: st.machine.work_counters(),
            },
        }
    }

    /// The queue's work-queue settings (leases, delayed retries).
    #[must_use]
    pub fn work_config(&self) -> machine::WorkConfig {
        *self.state.lock().machine.work_config()
    }

    /// Ready messages and consumers.
    #[must_use]
    pub fn counts(&self) -> QueueCounts {
        if let Some(s) = self.replica().and_then(|r| r.remote_stats()) {
            return QueueCounts {
                messages: u32::try_from(s.ready).unwrap_or(u32::MAX),
                consumers: u32::try_from(s.consumers).unwrap_or(u32::MAX),
            };
        }
        if let Some(stream) = self.stream() {
            // As RabbitMQ (rabbit_stream_queue:stat): the messages the stream holds.
            return QueueCounts {
                messages: u32::try_from(stream.stats_len()).unwrap_or(u32::MAX),
                consumers: u32::try_from(stream.consumer_count()).unwrap_or(u32::MAX),
            };
        }
        let st = self.state.lock();
        QueueCounts {
            messages: u32::try_from(st.machine.ready_len()).unwrap_or(u32::MAX),
            consumers: u32::try_from(st.machine.consumer_count()).unwrap_or(u32::MAX),
        }
    }
}

impl crate::timers::TimerTarget for Queue {
    fn fire(self: Arc<Self>) {
        self.on_timer();
    }
}

#[cfg(test)]
mod flow_tests {
    #![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

    use std::future::Future;
    use std::task::{Context, Waker};

    use super::*;
    use crate::limits::FLOW_READY_HIGH;

    fn queue() -> Arc<Queue> {
        Queue::new(
            1,
            "q",
            "/",
            false,
            false,
            None,
            FieldTable::default(),
            QueueEnv {
                store: None,
                timers: None,
                vhost: std::sync::Weak::<NoHost>::new(),
            },
        )
    }

    fn message() -> Arc<Message> {
        Arc::new(Message {
            exchange: String::new(),
            routing_key: "q".into(),
            properties: warren_amqp::properties::Properties::default(),
            body: bytes::Bytes::from_static(b"x"),
        })
    }

    fn consumer(q: &Arc<Queue>, prefetch: u32) -> Arc<Outbox> {
        let outbox = Arc::new(Outbox::default());
        let spec = ConsumerSpec {
            prefetch,
            window: 1000,
            window_bytes: u64::MAX,
            no_ack: false,
            exclusive: false,
            priority: 0,
            limited: false,
        };
        let sink = ConsumerSink {
            outbox: Arc::clone(&outbox),
            channel: 1,
            limiter: None,
        };
        q.consume(1, spec, sink).unwrap();
        outbox
    }

    #[test]
    fn a_backlog_without_receiving_consumers_does_not_push_back() {
        let q = queue();
        for _ in 0..FLOW_READY_HIGH + 10 {
            q.publish(message());
        }
        assert!(!q.flow_pressure(), "no consumer has received anything");
    }

    #[test]
    fn a_long_queue_whose_consumers_receive_pushes_back_until_it_drains() {
        let q = queue();
        for _ in 0..=FLOW_READY_HIGH {
            q.publish(message());
        }
        assert!(!q.flow_pressure());
        // The consumer receives one message (prefetch 1): the queue's consumers are receiving.
        let _outbox = consumer(&q, 1);
        assert!(q.flow_pressure());
        let released = q.flow_released();
        let mut released = std::pin::pin!(released);
        let mut cx = Context::from_waker(Waker::noop());
        assert!(released.as_mut().poll(&mut cx).is_pending());
        // A queue without a store never calls the completion factory.
        q.purge(&mut || -> Completion { Box::new(|_| {}) });
        assert!(
            released.as_mut().poll(&mut cx).is_ready(),
            "draining wakes the publisher"
        );
        assert!(!q.flow_pressure());
    }

    #[test]
    fn deleting_a_long_queue_releases_its_paused_publishers() {
        let q = queue();
        for _ in 0..=FLOW_READY_HIGH {
            q.publish(message());
        }
        let released = q.flow_released();
        let mut released = std::pin::pin!(released);
        let mut cx = Context::from_waker(Waker::noop());
        assert!(released.as_mut().poll(&mut cx).is_pending());
        q.delete(Vec::new(), &mut || -> Completion { Box::new(|_| {}) });
        assert!(released.as_mut().poll(&mut cx).is_ready());
    }
}
