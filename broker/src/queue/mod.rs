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

pub mod machine;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use amq_protocol::types::FieldTable;
use parking_lot::Mutex;

use warren_store::writer::Completion;
use warren_store::{Batch, BodyRef, Location, Op};

use crate::deadletter::{self, DeadLetterTarget};
use crate::durable::{Durable, stored};
use crate::exchange::RoutingHeaders;
use crate::limiter::{Limiter, Wake};
use crate::message::{Entry, Message, Outgoing};
use crate::outbox::{Delivery, Outbound, Outbox};
use crate::replication::{ReplicationError, Replicator, Replies};
use crate::vhost::OnCommit;
use machine::{
    Command, ConsumerId, ConsumerSpec, Effect, MachineError, MsgId, Overflow, QueueMachine,
    Removal, Reply,
};

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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    dead_letters: Vec<(Outgoing, Removal)>,
    /// Whether this node dead-letters what the machine removes: always, but for a replicated
    /// queue's followers (its leader does, once).
    dead_letters_here: bool,
}

/// What a queue is connected to in its broker.
#[derive(Debug, Clone, Default)]
pub struct QueueEnv {
    /// The node's store (used only by durable, non-exclusive queues).
    pub store: Option<Arc<Durable>>,
    /// The node's timer thread (message expiry).
    pub timers: Option<Arc<crate::timers::Timers>>,
    /// The vhost, for dead-lettering.
    pub vhost: std::sync::Weak<crate::vhost::VHost>,
}

/// A stream queue's settings and, once opened, its log and readers.
#[derive(Debug)]
struct StreamSlot {
    config: Mutex<crate::stream::log::StreamConfig>,
    open: std::sync::OnceLock<Arc<crate::stream::queue::StreamQueue>>,
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
    vhost_ref: std::sync::Weak<crate::vhost::VHost>,
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
            replica: std::sync::OnceLock::new(),
            state: Mutex::new(State {
                machine: QueueMachine::with_config(settings.config),
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
    pub fn stream(&self) -> Option<&Arc<crate::stream::queue::StreamQueue>> {
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
        let stream = crate::stream::queue::StreamQueue::open(self, dir, config, table_depth_max)?;
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
            crate::stream::queue::StreamQueue::open_replica(self, dir, config, table_depth_max)?;
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

    /// Apply commands the queue's Raft group committed, at the entry's time `at` (a replica
    /// never reads its own clock for them, so every replica reaches the same state). This
    /// node delivers to the consumers attached here; the others' deliveries are theirs.
    pub fn apply_committed(self: &Arc<Self>, at: u64, commands: Vec<Command<Entry>>) -> Replies {
        if let Some(stream) = self.stream() {
            return stream.apply_replicated(at, commands);
        }
        let leader = self.replica().is_some_and(|r| r.is_leader());
        let here = self.replica().map_or(0, |r| r.local_node());
        let replies = {
            let mut st = self.state.lock();
            st.dead_letters_here = leader;
            commands
                .into_iter()
                .map(|c| {
                    if let Command::Down { node, before } = c
                        && node == here
                    {
                        // The cluster took this node's consumers for gone (it was silent):
                        // their clients hear it, as when a queue goes away. Only those the
                        // Down detaches, as the machine stands at this entry: a consumer
                        // whose checkout commits later (one that subscribed after the node
                        // came back) keeps its sink.
                        let gone: Vec<ConsumerId> = st
                            .sinks
                            .keys()
                            .copied()
                            .filter(|id| *id < before && st.machine.has_consumer(*id))
                            .collect();
                        for id in gone {
                            if let Some(sink) = st.sinks.remove(&id) {
                                sink.outbox.push(Outbound::Cancel {
                                    channel: sink.channel,
                                    consumer: id,
                                });
                            }
                        }
                    }
                    self.apply_at(&mut st, c, at)
                })
                .collect()
        };
        self.dead_letter_pending();
        replies
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

    /// Submit to the group, fire and forget: the outcome shows in the applied state (a lost
    /// submission is like a client whose command never arrived).
    fn submit_quietly(&self, replica: &Arc<dyn Replicator>, commands: Vec<Command<Entry>>) {
        replica.submit(commands, Box::new(|_| {}));
    }

    /// A replicated command whose caller waits for it (purge-ok, tx.commit-ok): `on_commit`'s
    /// completion runs once the group committed it.
    fn submit_then(
        replica: &Arc<dyn Replicator>,
        commands: Vec<Command<Entry>>,
        on_commit: Option<OnCommit<'_>>,
    ) {
        let done = on_commit.map(|f| f());
        replica.submit(
            commands,
            Box::new(move |r| {
                if let Some(done) = done {
                    done(replicated_outcome(r).map(|_| Vec::new()));
                }
            }),
        );
    }

    /// The machine's time: wall-clock milliseconds (absolute, so expiry times can be stored).
    fn now_ms(&self) -> u64 {
        crate::timers::wall_ms()
    }

    /// Make sure the timer thread wakes this queue when its next message expires.
    fn arm_timer(self: &Arc<Self>, st: &mut State) {
        if st.deleted {
            return;
        }
        let next = match (st.machine.next_expiry(), self.unused_until(st)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if let (Some(timers), Some(next)) = (&self.timers, next)
            && st.timer_at.is_none_or(|armed| next < armed)
        {
            st.timer_at = Some(next);
            let weak: std::sync::Weak<Self> = Arc::downgrade(self);
            let target: std::sync::Weak<dyn crate::timers::TimerTarget> = weak;
            timers.schedule(next, target);
        }
    }

    /// `x-expires`: when the queue is deleted if nobody uses it until then (None while it has
    /// consumers or no such argument).
    fn unused_until(&self, st: &State) -> Option<u64> {
        st.expires
            .filter(|_| st.machine.consumer_count() == 0 && !st.deleted)
            .map(|ms| st.last_used.saturating_add(ms))
    }

    /// Apply the queue's policy and operator policy (None: none matches any more): its
    /// effective settings are recomputed from the declare arguments and both, and take effect
    /// at once.
    pub fn apply_policy(
        self: &Arc<Self>,
        policy: Option<&crate::policy::Policy>,
        operator: Option<&crate::policy::Policy>,
    ) {
        if let Some(slot) = &self.stream {
            let what = crate::vhost::rs("queue", &self.name, &self.vhost);
            let config = crate::stream::config_with_policy(&self.arguments, policy, &what);
            *slot.config.lock() = config.clone();
            if let Some(stream) = slot.open.get() {
                stream.configure(config);
            }
            return;
        }
        let settings = crate::policy::queue_settings(&self.arguments, policy, operator);
        {
            let mut st = self.state.lock();
            st.dead_letter = settings.dead_letter;
            st.expires = settings.expires;
            match self.replica() {
                Some(replica) => {
                    self.submit_quietly(replica, vec![Command::Configure(settings.config)])
                }
                None => {
                    let _ = self.run(&mut st, Command::Configure(settings.config));
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

    /// The queue was used (declared, consumed from, read with basic.get): `x-expires` starts
    /// again.
    pub fn touch(self: &Arc<Self>) {
        let mut st = self.state.lock();
        st.last_used = self.now_ms();
        self.arm_timer(&mut st);
    }

    /// Called by the timer thread: expire messages that are due, delete the queue if it has
    /// been unused for its `x-expires`, then re-arm.
    pub fn on_timer(self: &Arc<Self>) {
        if let Some(replica) = self.replica() {
            // Expiry is a command like any other: the leader proposes it, at its time.
            self.state.lock().timer_at = None;
            if replica.is_leader() {
                self.submit_quietly(replica, vec![Command::Expire]);
            }
            return;
        }
        let unused = {
            let mut st = self.state.lock();
            st.timer_at = None;
            let _ = self.run(&mut st, Command::Expire);
            self.unused_until(&st).is_some_and(|at| at <= self.now_ms())
        };
        self.dead_letter_pending();
        if unused && let Some(vhost) = self.vhost_ref.upgrade() {
            // Checked again under the vhost lock: a consumer or declare may have come since.
            vhost.delete_queue_if(self, Self::is_unused_now, &mut || Box::new(|_| {}));
        }
    }

    /// Whether `x-expires` has run out right now.
    fn is_unused_now(&self) -> bool {
        let st = self.state.lock();
        self.unused_until(&st).is_some_and(|at| at <= self.now_ms())
    }

    fn hold_dead_letter(&self, st: &mut State, msg: &Entry, reason: Removal) {
        if !st.dead_letters_here {
            return;
        }
        st.dead_letters
            .push((msg.pin(self.store.as_deref()), reason));
        self.dead_letters_pending.store(true, Ordering::Release);
    }

    /// Republish what this queue dead-lettered to its dead-letter exchange. Call with no
    /// queue lock held (routing takes the vhost lock, publishing takes other queues' locks).
    ///
    /// Dead-lettering into a queue can make that queue dead-letter in turn (a full drop-head
    /// queue): such nested work is queued on this thread and drained by the outermost call, so
    /// the stack does not grow with the length of the chain.
    pub fn dead_letter_pending(self: &Arc<Self>) {
        if !self.dead_letters_pending.load(Ordering::Acquire) {
            return;
        }
        let nested = DEAD_LETTER_WORK.with(|w| {
            let mut w = w.borrow_mut();
            match w.as_mut() {
                Some(queue) => {
                    queue.push_back(Arc::clone(self));
                    true
                }
                None => {
                    *w = Some(std::collections::VecDeque::new());
                    false
                }
            }
        });
        if nested {
            return;
        }
        let mut next = Some(Arc::clone(self));
        while let Some(q) = next {
            q.dead_letter_now();
            next = DEAD_LETTER_WORK.with(|w| w.borrow_mut().as_mut().and_then(|v| v.pop_front()));
        }
        DEAD_LETTER_WORK.with(|w| *w.borrow_mut() = None);
    }

    fn dead_letter_now(self: &Arc<Self>) {
        if !self.dead_letters_pending.swap(false, Ordering::AcqRel) {
            return;
        }
        let (items, target) = {
            let mut st = self.state.lock();
            (std::mem::take(&mut st.dead_letters), st.dead_letter.clone())
        };
        let (Some(target), Some(vhost)) = (target.as_ref(), self.vhost_ref.upgrade()) else {
            return;
        };
        let now_s = crate::timers::wall_ms() / 1000;
        let mut targets = Vec::new();
        for (out, reason) in items {
            let Some(reason) = deadletter::reason_name(reason) else {
                continue;
            };
            let loaded = match out.load() {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(queue = %self.name, error = %e, "cannot read a message to dead-letter");
                    continue;
                }
            };
            let depth = warren_amqp::limits::TABLE_DEPTH_MAX;
            let Some(msg) =
                deadletter::dead_lettered(&loaded, &self.name, reason, now_s, target, depth)
            else {
                continue;
            };
            let headers = RoutingHeaders::new(&msg.properties);
            targets.clear();
            // A missing dead-letter exchange drops the message, as in RabbitMQ.
            if vhost
                .route_internal(&msg.exchange, &msg.routing_key, &headers, &mut targets)
                .is_err()
            {
                continue;
            }
            // Without x-dead-letter-routing-key the message keeps all its keys, CC included.
            if target.routing_key.is_none() {
                for cc in deadletter::sender_selected(&msg.properties).0 {
                    let _ = vhost.route_internal(&msg.exchange, &cc, &headers, &mut targets);
                }
                let mut seen = std::collections::HashSet::new();
                targets.retain(|q| seen.insert(Arc::as_ptr(q)));
            }
            let deaths = deadletter::deaths(headers.get());
            targets.retain(|q| !deadletter::is_cycle(&deaths, &q.name));
            let msg = Arc::new(msg);
            let _ = publish_routed(&targets, &msg, || Box::new(|_| {}));
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
    }

    /// Whether publishers into this queue should pause: it is over the flow limits while its
    /// consumers are receiving (see [`crate::limits::FLOW_READY_HIGH`]).
    #[must_use]
    pub fn flow_pressure(&self) -> bool {
        if let Some(stream) = self.stream() {
            return stream.flow_pressure();
        }
        let over = self.ready_len_hint.load(Ordering::Relaxed) >= crate::limits::FLOW_READY_HIGH
            || self.ready_bytes_hint.load(Ordering::Relaxed)
                >= crate::limits::FLOW_READY_BYTES_HIGH;
        over && crate::timers::wall_ms()
            .saturating_sub(self.last_delivery_ms.load(Ordering::Relaxed))
            < crate::limits::FLOW_CONSUMER_IDLE_MS
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

    /// Wake the publishers paused on this queue (a stream's writer caught up).
    pub fn flow_drained(&self) {
        self.flow_drained.notify_waiters();
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
        for effect in effects.drain(..) {
            match effect {
                Effect::Removed { id, msg, reason } => {
                    // A deleted queue's messages are gone with it (its store records too).
                    if st.deleted {
                        continue;
                    }
                    if st.dead_letter.is_some() && deadletter::reason_name(reason).is_some() {
                        self.hold_dead_letter(st, &msg, reason);
                    }
                    if self.persists(&msg) {
                        st.store_ops.push(Op::Settle { queue: self.id, id });
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
                        message: msg.pin(self.store.as_deref()),
                        redelivered,
                        counted: st.machine.is_limited(consumer),
                        delivery_count,
                    }));
                }
            }
        }
    }

    /// A limiter has room again: offer its waiting consumers here a slot.
    pub fn regrant(self: &Arc<Self>) {
        if self.is_replicated() {
            return;
        }
        {
            let mut st = self.state.lock();
            let mut effects = std::mem::take(&mut st.effects);
            self.offer_grants(&mut st, &mut effects);
            st.effects = effects;
            self.submit_store_ops(&mut st, None);
        }
        self.dead_letter_pending();
    }

    /// Put a consumer under its channel's shared limit or release it from it.
    pub fn set_limited(self: &Arc<Self>, consumer: ConsumerId, limited: bool) {
        if self.is_replicated() {
            // Quorum queues take no consumers under a channel-wide limit.
            return;
        }
        let wake = {
            let mut st = self.state.lock();
            let wake = Self::release_grant(&st, consumer);
            let _ = self.run(&mut st, Command::SetLimited(consumer, limited));
            wake
        };
        wake.run();
        self.dead_letter_pending();
    }

    /// An unused grant goes back to the limiter (the consumer is leaving or changing mode).
    fn release_grant(st: &State, consumer: ConsumerId) -> Wake {
        if st.machine.holds_grant(consumer)
            && let Some(l) = st.sinks.get(&consumer).and_then(|s| s.limiter.as_ref())
        {
            l.release(1)
        } else {
            Wake::default()
        }
    }

    /// Enqueue a routed message that needs no store write (transient, or this queue has no
    /// store).
    pub fn publish(self: &Arc<Self>, message: Arc<Message>) -> Enqueued {
        if self.is_stream && !self.is_replicated() {
            return match self.stream() {
                Some(stream) if stream.is_deleted() => Enqueued::Gone,
                Some(stream) => {
                    stream.append(&message, Box::new(|_| {}));
                    Enqueued::Accepted
                }
                None => Enqueued::Rejected,
            };
        }
        if let Some(replica) = self.replica() {
            // Unconfirmed (a dead-lettered message, a publisher without confirms).
            self.submit_quietly(replica, vec![Command::Enqueue(Entry::Mem(message))]);
            return Enqueued::Accepted;
        }
        let outcome = {
            let mut st = self.state.lock();
            if st.deleted {
                return Enqueued::Gone;
            }
            let r = self.run(&mut st, Command::Enqueue(Entry::Mem(message)));
            self.enqueued(&mut st, r)
        };
        self.dead_letter_pending();
        outcome
    }

    /// The outcome of an `Enqueue`; a refusal under reject-publish-dlx is dead-lettered.
    fn enqueued(&self, st: &mut State, reply: Result<Reply<Entry>, MachineError>) -> Enqueued {
        match reply {
            Ok(Reply::Rejected(entry)) => {
                if st.dead_letter.is_some()
                    && st.machine.config().overflow == Overflow::RejectPublishDlx
                {
                    self.hold_dead_letter(st, &entry, Removal::MaxLen);
                }
                Enqueued::Rejected
            }
            _ => Enqueued::Accepted,
        }
    }

    /// A persistent message is durable at `location`: beyond the head of a long queue, keep
    /// only that (the body is read back on delivery), so a backlog costs little memory.
    fn stored_at(self: &Arc<Self>, id: MsgId, location: Location, size: u32, priority: u8) {
        // A stale hint only keeps a body in memory a little longer (or takes the lock for
        // nothing); it cannot lose a message.
        if self.ready_bytes_hint.load(Ordering::Relaxed) <= crate::limits::QUEUE_HEAD_CACHE_BYTES {
            return;
        }
        {
            let mut st = self.state.lock();
            if st.machine.ready_bytes() <= crate::limits::QUEUE_HEAD_CACHE_BYTES {
                return;
            }
            // Through apply: the command also expires heads, whose effects must be carried out.
            let _ = self.run(
                &mut st,
                Command::Swap {
                    id,
                    msg: Entry::Stored {
                        location,
                        size,
                        priority,
                    },
                },
            );
        }
        self.dead_letter_pending();
    }

    /// Put a message recovered from the store back, with its stored id, marked redelivered
    /// (it may have been delivered before the restart: the conservative reading, as AMQP
    /// allows).
    pub fn restore(
        self: &Arc<Self>,
        id: MsgId,
        location: Location,
        priority: u8,
        expires_at: Option<u64>,
    ) {
        let mut st = self.state.lock();
        let _ = self.run(
            &mut st,
            Command::Restore {
                id,
                msg: Entry::Stored {
                    location,
                    size: location.len,
                    priority,
                },
                redelivered: true,
                expires_at,
            },
        );
    }

    /// Attach a consumer.
    pub fn consume(
        self: &Arc<Self>,
        id: ConsumerId,
        spec: ConsumerSpec,
        sink: ConsumerSink,
    ) -> Result<(), MachineError> {
        if let Some(replica) = self.replica() {
            return self.consume_replicated(replica, id, spec, sink);
        }
        {
            let mut st = self.state.lock();
            st.sinks.insert(id, sink);
            if let Err(e) = self.run(&mut st, Command::Checkout(id, spec)) {
                st.sinks.remove(&id);
                return Err(e);
            }
            st.had_consumer = true;
            st.last_used = self.now_ms();
        }
        self.dead_letter_pending();
        Ok(())
    }

    /// [`Queue::consume`] of a replicated queue: the checkout is proposed, and deliveries
    /// start when it commits. A refusal found at commit (another node's exclusive consumer
    /// got there first) cancels the consumer with basic.cancel.
    fn consume_replicated(
        self: &Arc<Self>,
        replica: &Arc<dyn Replicator>,
        id: ConsumerId,
        spec: ConsumerSpec,
        sink: ConsumerSink,
    ) -> Result<(), MachineError> {
        {
            let mut st = self.state.lock();
            // The local replica may lag by an entry or two; a conflict it already sees is
            // certain, the commit decides the rest.
            if st.machine.has_exclusive_consumer()
                || (spec.exclusive && st.machine.consumer_count() > 0)
            {
                return Err(MachineError::ExclusiveInUse);
            }
            st.sinks.insert(id, sink.clone());
            st.had_consumer = true;
        }
        // Prefetch bounds what a consumer holds; a socket window would cost a log entry per
        // write, so replicated consumers have none.
        let spec = ConsumerSpec {
            window: u32::MAX,
            window_bytes: u64::MAX,
            limited: false,
            ..spec
        };
        let weak = Arc::downgrade(self);
        replica.submit(
            vec![Command::Checkout(id, spec)],
            Box::new(move |r| {
                let refused = !matches!(r.as_deref(), Ok([Ok(_)]));
                if refused && let Some(q) = weak.upgrade() {
                    q.state.lock().sinks.remove(&id);
                    sink.outbox.push(Outbound::Cancel {
                        channel: sink.channel,
                        consumer: id,
                    });
                }
            }),
        );
        Ok(())
    }

    /// Detach a consumer. Returns true when the queue is auto-delete and this was its last
    /// consumer (the caller deletes it).
    pub fn cancel(self: &Arc<Self>, id: ConsumerId) -> bool {
        if let Some(stream) = self.stream() {
            stream.cancel(id);
            return false;
        }
        if let Some(replica) = self.replica() {
            if self.state.lock().sinks.remove(&id).is_some() {
                self.submit_quietly(replica, vec![Command::Cancel(id)]);
            }
            return false;
        }
        let (last, wake) = {
            let mut st = self.state.lock();
            let wake = Self::release_grant(&st, id);
            if st.sinks.remove(&id).is_none() {
                return false;
            }
            st.last_used = self.now_ms();
            let _ = self.run(&mut st, Command::Cancel(id));
            let last = self.auto_delete
                && st.had_consumer
                && st.machine.consumer_count() == 0
                && !st.deleted;
            (last, wake)
        };
        wake.run();
        self.dead_letter_pending();
        last
    }

    /// Deliveries to `consumer` were written to its socket: restore its window.
    pub fn written(self: &Arc<Self>, consumer: ConsumerId, n: u32, bytes: u64) {
        if self.is_replicated() || self.is_stream {
            // Replicated consumers have no socket window (see `consume_replicated`).
            return;
        }
        {
            let mut st = self.state.lock();
            let _ = self.run(&mut st, Command::Written(consumer, n, bytes));
        }
        self.dead_letter_pending();
    }

    /// Acknowledge.
    pub fn settle(self: &Arc<Self>, ids: Vec<MsgId>, on_commit: Option<OnCommit<'_>>) {
        if self.is_stream {
            // A stream removes nothing; credit comes back by consumer (`settle_stream`).
            return;
        }
        if let Some(replica) = self.replica() {
            Self::submit_then(replica, vec![Command::Settle(ids)], on_commit);
            return;
        }
        {
            let mut st = self.state.lock();
            let _ = self.apply(&mut st, Command::Settle(ids));
            self.submit_store_ops(&mut st, on_commit);
        }
        self.dead_letter_pending();
    }

    /// The client asked for these back (nack/reject with requeue, recover):
    /// [`Command::Requeue`].
    pub fn requeue(self: &Arc<Self>, ids: Vec<MsgId>) {
        self.put_back(Command::Requeue(ids));
    }

    /// Unacked or undelivered messages come back without the client asking (its channel
    /// closed, a delivery its consumer can no longer take): [`Command::Return`], in place.
    pub fn give_back(self: &Arc<Self>, ids: Vec<MsgId>) {
        self.put_back(Command::Return(ids));
    }

    fn put_back(self: &Arc<Self>, command: Command<Entry>) {
        if self.is_stream {
            return;
        }
        if let Some(replica) = self.replica() {
            self.submit_quietly(replica, vec![command]);
            return;
        }
        {
            let mut st = self.state.lock();
            let _ = self.run(&mut st, command);
        }
        self.dead_letter_pending();
    }

    /// Drop (nack/reject without requeue).
    pub fn discard(self: &Arc<Self>, ids: Vec<MsgId>, on_commit: Option<OnCommit<'_>>) {
        if self.is_stream {
            return;
        }
        if let Some(replica) = self.replica() {
            Self::submit_then(replica, vec![Command::Discard(ids)], on_commit);
            return;
        }
        {
            let mut st = self.state.lock();
            let _ = self.apply(&mut st, Command::Discard(ids));
            self.submit_store_ops(&mut st, on_commit);
        }
        self.dead_letter_pending();
    }

    /// Consumer `consumer` of a stream settled (acked, nacked or rejected) the deliveries at
    /// `offsets`: their credit comes back, and a named consumer's offset moves.
    pub fn settle_stream(&self, consumer: ConsumerId, offsets: &[u64]) {
        if let Some(stream) = self.stream() {
            stream.settle(consumer, offsets);
        }
    }

    /// Deliveries of a stream's consumer that will never be acked (their channel closed):
    /// credit back, a named consumer's offset unmoved.
    pub fn release_stream(&self, consumer: ConsumerId, offsets: &[u64]) {
        if let Some(stream) = self.stream() {
            stream.release(consumer, offsets);
        }
    }

    /// basic.get on a replicated queue: proposed like any command, `done` gets what the
    /// committed get took (None: empty, or no leader could be reached).
    pub fn get_replicated(&self, no_ack: bool, done: Box<dyn FnOnce(Option<Got>) + Send>) {
        let Some(replica) = self.replica() else {
            done(None);
            return;
        };
        replica.submit(
            vec![Command::Get { no_ack }],
            Box::new(move |r| {
                let got = match r.as_deref() {
                    Ok([Ok(Reply::Got(Some((id, entry, redelivered, left, count))))]) => {
                        Some((*id, entry.pin(None), *redelivered, *left, *count))
                    }
                    _ => None,
                };
                done(got);
            }),
        );
    }

    /// basic.get: the head message, its redelivered flag, the ready count after it and its
    /// delivery count.
    pub fn get(self: &Arc<Self>, no_ack: bool) -> Option<Got> {
        if self.is_replicated() {
            // A replicated get is a log entry whose reply comes later: not served yet
            // (documented), and never taken from this replica alone.
            return None;
        }
        let got = {
            let mut st = self.state.lock();
            st.last_used = self.now_ms();
            // Pinned before the settle of a no-ack get is submitted.
            let got = match self.apply(&mut st, Command::Get { no_ack }) {
                Ok(Reply::Got(Some((id, entry, redelivered, left, count)))) => Some((
                    id,
                    entry.pin(self.store.as_deref()),
                    redelivered,
                    left,
                    count,
                )),
                _ => None,
            };
            self.submit_store_ops(&mut st, None);
            got
        };
        self.dead_letter_pending();
        got
    }

    /// Remove all ready messages; returns how many.
    /// The removals of stored messages are submitted with `on_commit`'s completion, so the
    /// caller can hold purge-ok until they are durable.
    pub fn purge(self: &Arc<Self>, on_commit: OnCommit<'_>) -> u32 {
        if let Some(replica) = self.replica() {
            // purge-ok waits for the commit; its count is this replica's view just before.
            let n = u32::try_from(self.state.lock().machine.ready_len()).unwrap_or(u32::MAX);
            Self::submit_then(replica, vec![Command::Purge], Some(on_commit));
            return n;
        }
        let mut st = self.state.lock();
        let reply = self.apply(&mut st, Command::Purge);
        self.submit_store_ops(&mut st, Some(on_commit));
        match reply {
            Ok(Reply::Purged(n)) => n,
            _ => 0,
        }
    }

    /// A consistent snapshot of the queue's depth for the management API and metrics.
    #[must_use]
    pub fn stats(&self) -> QueueStats {
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
        }
    }

    /// Ready messages and consumers.
    #[must_use]
    pub fn counts(&self) -> QueueCounts {
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

    /// Mark deleted and tell every consumer's connection to cancel it. Returns the ready count.
    /// A stored queue's messages are dropped from the store (`more_ops`, e.g. its record and
    /// bindings, go in the same submission; `done` runs when it is durable).
    pub fn delete(self: &Arc<Self>, more_ops: Vec<Op>, on_commit: OnCommit<'_>) -> u32 {
        let mut st = self.state.lock();
        st.deleted = true;
        if let Some(stream) = self.stream() {
            drop(st);
            let held = stream.delete();
            if let Some(store) = &self.store {
                store.submit_meta(more_ops, on_commit);
            }
            return u32::try_from(held).unwrap_or(u32::MAX);
        }
        // Its ready messages go with it (unacked ones are settled by their channels, to no
        // effect): nothing expires or is dead-lettered from a deleted queue.
        let ready = u32::try_from(st.machine.ready_len()).unwrap_or(u32::MAX);
        let _ = st
            .machine
            .apply(self.now_ms(), Command::Purge, &mut Vec::new());
        // Publishers paused on this queue's flow limits are released now, not at their bound.
        self.update_hints(&st);
        if let Some(store) = &self.store {
            let mut ops = more_ops;
            ops.push(Op::DropQueue { queue: self.id });
            store.submit_meta(ops, on_commit);
        }
        let sinks: Vec<(ConsumerId, ConsumerSink)> = st.sinks.drain().collect();
        let mut wakes = Vec::new();
        for (consumer, sink) in sinks {
            if st.machine.holds_grant(consumer)
                && let Some(l) = &sink.limiter
            {
                wakes.push(l.release(1));
            }
            let _ = self.run(&mut st, Command::Cancel(consumer));
            sink.outbox.push(Outbound::Cancel {
                channel: sink.channel,
                consumer,
            });
        }
        drop(st);
        for wake in wakes {
            wake.run();
        }
        ready
    }

    /// Whether the queue was deleted.
    #[must_use]
    pub fn is_deleted(&self) -> bool {
        self.state.lock().deleted
    }
}

/// A replicated submission's outcome as the store's completions see it: a refusal or a lost
/// leader is a failed write, so its publisher is nacked.
fn replicated_outcome(
    r: Result<Replies, ReplicationError>,
) -> Result<Replies, Arc<warren_store::StoreError>> {
    r.map_err(|e| Arc::new(warren_store::StoreError::Replication(e.to_string())))
}

/// Whether a queue this short releases publishers paused on it.
fn below_flow_release(len: u64, bytes: u64) -> bool {
    len < crate::limits::FLOW_READY_HIGH / 2 && bytes < crate::limits::FLOW_READY_BYTES_HIGH / 2
}

/// Enqueue a routed message into every queue of `targets`. A persistent message goes into the
/// stored queues among them with one store write for all of them, and into the others in
/// memory. The store submission happens while every stored target is locked (in id order, so
/// concurrent publishers cannot deadlock) and before any of them can deliver the message;
/// queues that will refuse it (reject-publish) are not written. Returns the combined outcome
/// and whether `done` was submitted (when nothing was written, `done` is not called).
pub fn publish_routed(
    targets: &[Arc<Queue>],
    message: &Arc<Message>,
    done: impl FnOnce() -> Completion,
) -> (Enqueued, bool) {
    if !targets.iter().any(|q| q.is_replicated() || q.is_stream) {
        // (A replicated stream is replicated: its messages go through its group's log.)
        return publish_local(targets, message, done);
    }
    // Replicated queues take every message through their log (persistent or not, as
    // RabbitMQ's quorum queues do), and streams store every message: the completion waits
    // for all of them and the store.
    let join = Join::new(done());
    let mut outcome = Enqueued::Gone;
    for q in targets {
        if q.is_stream && !q.is_replicated() {
            outcome = outcome.and(match q.stream() {
                // Deleted meanwhile: as a classic queue deleted meanwhile, not routed.
                Some(stream) if stream.is_deleted() => Enqueued::Gone,
                Some(stream) => {
                    stream.append(message, join.part());
                    Enqueued::Accepted
                }
                // Its files did not open at start: never confirm what it cannot keep.
                None => Enqueued::Rejected,
            });
            continue;
        }
        let Some(replica) = q.replica() else {
            continue;
        };
        let part = join.part();
        replica.submit(
            vec![Command::Enqueue(Entry::Mem(Arc::clone(message)))],
            Box::new(move |r| {
                let r = replicated_outcome(r).and_then(|replies| match replies.first() {
                    Some(Ok(Reply::Rejected(_))) => Err(Arc::new(
                        warren_store::StoreError::Replication("rejected: queue full".into()),
                    )),
                    _ => Ok(Vec::new()),
                });
                part(r);
            }),
        );
        outcome = outcome.and(Enqueued::Accepted);
    }
    let local: Vec<Arc<Queue>> = targets
        .iter()
        .filter(|q| !q.is_replicated() && !q.is_stream)
        .cloned()
        .collect();
    let (local_outcome, _) = publish_local(&local, message, || join.part());
    join.seal();
    (outcome.and(local_outcome), true)
}

/// One completion for several writes (replicated queues and the store): it runs once all of
/// them finished, with the first failure if any.
struct Join {
    /// The caller's completion, the parts still running (plus one until sealed), the first
    /// failure.
    inner: parking_lot::Mutex<(
        Option<Completion>,
        usize,
        Option<Arc<warren_store::StoreError>>,
    )>,
}

impl Join {
    fn new(done: Completion) -> Arc<Self> {
        Arc::new(Self {
            inner: parking_lot::Mutex::new((Some(done), 1, None)),
        })
    }

    fn part(self: &Arc<Self>) -> Completion {
        self.inner.lock().1 += 1;
        let me = Arc::clone(self);
        Box::new(move |r| me.finish(r.err()))
    }

    /// No more parts will be added.
    fn seal(&self) {
        self.finish(None);
    }

    fn finish(&self, err: Option<Arc<warren_store::StoreError>>) {
        let ready = {
            let mut g = self.inner.lock();
            if g.2.is_none() {
                g.2 = err;
            }
            g.1 -= 1;
            if g.1 == 0 {
                g.0.take().map(|done| (done, g.2.take()))
            } else {
                None
            }
        };
        if let Some((done, err)) = ready {
            done(err.map_or(Ok(Vec::new()), Err));
        }
    }
}

/// [`publish_routed`] into queues that are not replicated.
fn publish_local(
    targets: &[Arc<Queue>],
    message: &Arc<Message>,
    done: impl FnOnce() -> Completion,
) -> (Enqueued, bool) {
    if !message.properties.persistent() {
        let outcome = targets.iter().fold(Enqueued::Gone, |outcome, q| {
            outcome.and(q.publish(Arc::clone(message)))
        });
        return (outcome, false);
    }
    let mut stored_targets: Vec<&Arc<Queue>> =
        targets.iter().filter(|q| q.store.is_some()).collect();
    stored_targets.sort_unstable_by_key(|q| q.id);
    let mut outcome = Enqueued::Gone;
    let mut submitted = false;
    let entry = Entry::Mem(Arc::clone(message));
    if let Some(store) = stored_targets.first().and_then(|q| q.store.clone()) {
        let mut guards: Vec<_> = stored_targets.iter().map(|q| q.state.lock()).collect();
        let mut batch = Batch {
            bodies: vec![stored(message)],
            ops: Vec::with_capacity(stored_targets.len()),
        };
        let priority = message.properties.priority.unwrap_or(0);
        // One machine time for the whole publish: the store ops below predict what the
        // Enqueue will do, and the machine is deterministic only for a given `now`.
        let now = crate::timers::wall_ms();
        // Expire first, as the Enqueue below will: a limit check on a queue still holding
        // expired messages would leave out a message the queue then accepts.
        for (q, st) in stored_targets.iter().zip(guards.iter_mut()) {
            if !st.deleted {
                let _ = q.apply_at(st, Command::Expire, now);
            }
        }
        let mut stored_here = Vec::with_capacity(stored_targets.len());
        // Once durable, long queues drop the body and keep only its place in the store.
        let mut placed: Vec<(std::sync::Weak<Queue>, MsgId)> = Vec::new();
        for (q, st) in stored_targets.iter().zip(&guards) {
            let store_it = !st.deleted && !st.machine.would_reject(&entry);
            stored_here.push(store_it);
            if store_it {
                let id = st.machine.next_id();
                batch.ops.push(Op::Enqueue {
                    queue: q.id,
                    id,
                    body: BodyRef::New(0),
                    flags: u32::from(priority),
                    expires_at: st.machine.expiry_at(&entry, now).unwrap_or(0),
                });
                placed.push((Arc::downgrade(q), id));
            }
        }
        if !batch.ops.is_empty() {
            let size = u32::try_from(message.body.len()).unwrap_or(u32::MAX);
            let then = done();
            store.submit(
                batch,
                Box::new(move |result| {
                    if let Ok(locations) = &result
                        && let Some(location) = locations.first()
                    {
                        for (q, id) in &placed {
                            if let Some(q) = q.upgrade() {
                                q.stored_at(*id, *location, size, priority);
                            }
                        }
                    }
                    then(result);
                }),
            );
            submitted = true;
        }
        for ((q, st), stored) in stored_targets
            .iter()
            .zip(guards.iter_mut())
            .zip(stored_here)
        {
            if !st.deleted {
                let r = q.run_at(st, Command::Enqueue(entry.clone()), now);
                let taken = q.enqueued(st, r);
                // A message in a queue without its store record would be lost on a crash
                // after its confirm; one in the store but not the queue would resurrect.
                debug_assert_eq!(
                    stored,
                    taken == Enqueued::Accepted,
                    "the store op must match the queue's decision"
                );
                outcome = outcome.and(taken);
            }
        }
        drop(guards);
        for q in &stored_targets {
            q.dead_letter_pending();
        }
    }
    for q in targets.iter().filter(|q| q.store.is_none()) {
        outcome = outcome.and(q.publish(Arc::clone(message)));
    }
    (outcome, submitted)
}

/// What became of a publish to one queue, or (combined with [`Enqueued::and`]) to all the
/// queues it was routed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// No queue (or the queue was deleted meanwhile).
    Gone,
    /// Taken.
    Accepted,
    /// Refused by a length limit (reject-publish): the publisher gets a nack.
    Rejected,
}

impl Enqueued {
    /// Combine outcomes: a rejection anywhere wins (RabbitMQ nacks the publish), then any
    /// acceptance.
    #[must_use]
    pub fn and(self, other: Self) -> Self {
        match (self, other) {
            (Self::Rejected, _) | (_, Self::Rejected) => Self::Rejected,
            (Self::Accepted, _) | (_, Self::Accepted) => Self::Accepted,
            _ => Self::Gone,
        }
    }
}

thread_local! {
    /// Queues with dead letters waiting while this thread is already dead-lettering.
    static DEAD_LETTER_WORK: std::cell::RefCell<Option<std::collections::VecDeque<Arc<Queue>>>> =
        const { std::cell::RefCell::new(None) };
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
                vhost: std::sync::Weak::new(),
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
