//! Publishing into queues: one queue's enqueue (store first for persistent messages, then the
//! machine), flow control, and [`publish_routed`], which publishes one message to every queue a
//! route found and joins their store commits into one confirm.

use super::*;

impl Queue {
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

    /// Wake the publishers paused on this queue (a stream's writer caught up).
    pub fn flow_drained(&self) {
        self.flow_drained.notify_waiters();
    }

    /// Enqueue a routed message that needs no store write (transient, or this queue has no
    /// store).
    pub fn publish(self: &Arc<Self>, message: Arc<Message>) -> Enqueued {
        self.publish_keyed(message, &PublishOptions::default())
    }

    /// [`Queue::publish`] with [`PublishOptions`] (a redrive's move key, a delay).
    pub(super) fn publish_keyed(
        self: &Arc<Self>,
        message: Arc<Message>,
        options: &PublishOptions,
    ) -> Enqueued {
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
        let key = self.dedup_key(&message);
        if let Some(replica) = self.replica() {
            // Unconfirmed (a dead-lettered message, a publisher without confirms).
            self.submit_quietly(
                replica,
                enqueue_commands(Entry::Mem(message), key, options.clone()),
            );
            return Enqueued::Accepted;
        }
        let outcome = {
            let mut st = self.state.lock();
            if st.deleted {
                return Enqueued::Gone;
            }
            if let Some(key) = key {
                let _ = self.run(&mut st, Command::Dedup { key });
            }
            let now = self.now_ms();
            for c in options.commands(now) {
                let _ = self.apply_at(&mut st, c, now);
            }
            let r = self.run_at(&mut st, Command::Enqueue(Entry::Mem(message)), now);
            self.enqueued(&mut st, r)
        };
        self.dead_letter_pending();
        outcome
    }

    /// Publish one message into this queue alone and tell `done` what became of it once it
    /// is as durable as a publisher confirm would make it (the HTTP queue API's publish): for
    /// a replicated queue or a proxy, from the committed enqueue's reply, so a duplicate or a
    /// refusal found there is reported as such. `options` (ignored by a stream): a redrive's
    /// move key (a queue that took the move before answers [`Enqueued::Duplicate`]) and a
    /// delay.
    pub fn publish_one(
        self: &Arc<Self>,
        message: &Arc<Message>,
        options: PublishOptions,
        done: Box<dyn FnOnce(Result<Enqueued, String>) + Send>,
    ) {
        if let (Some(replica), false) = (self.replica(), self.is_stream) {
            let key = self.dedup_key(message);
            replica.submit(
                enqueue_commands(Entry::Mem(Arc::clone(message)), key, options),
                Box::new(move |r| {
                    done(
                        r.map_err(|e| e.to_string())
                            .map(|replies| match replies.last() {
                                Some(Ok(Reply::Rejected(_))) => Enqueued::Rejected,
                                Some(Ok(Reply::Duplicate(_))) => Enqueued::Duplicate,
                                _ => Enqueued::Accepted,
                            }),
                    );
                }),
            );
            return;
        }
        // The store's completion may run (on its writer thread) before or after the outcome
        // is known here: whichever comes second answers.
        let slot = Arc::new(parking_lot::Mutex::new(Rendezvous::new(done)));
        let from_store = Arc::clone(&slot);
        let options = if self.is_stream {
            PublishOptions::default()
        } else {
            options
        };
        let targets = std::slice::from_ref(self);
        let on_commit = || -> Completion {
            Box::new(move |r| {
                let ready = from_store
                    .lock()
                    .stored(r.map(drop).map_err(|e| e.to_string()));
                if let Some((done, r)) = ready {
                    done(r);
                }
            })
        };
        let (outcome, submitted) = if options.is_empty() {
            publish_routed(targets, message, on_commit)
        } else {
            publish_local(targets, message, &options, on_commit)
        };
        let ready = {
            let mut s = slot.lock();
            let ready = s.decided(outcome);
            if submitted { ready } else { s.stored(Ok(())) }
        };
        if let Some((done, r)) = ready {
            done(r);
        }
    }

    /// Whether the queue deduplicates publishes (read without the queue lock).
    #[must_use]
    pub fn deduplicates(&self) -> bool {
        self.dedup_enabled.load(Ordering::Relaxed)
    }

    /// The deduplication key `message` carries for this queue: its `x-deduplication-header`
    /// (a string, or an integer as its decimal digits) when the queue deduplicates, and the
    /// value is at most [`machine::DEDUP_KEY_MAX`] bytes.
    pub(super) fn dedup_key(&self, message: &Message) -> Option<Vec<u8>> {
        if !self.deduplicates() {
            return None;
        }
        let headers = message.properties.headers()?;
        let v = headers.inner().get("x-deduplication-header")?;
        let key = crate::args::string_like(v)
            .or_else(|| crate::args::int_value(v).map(|n| n.to_string().into_bytes()))?;
        (key.len() <= machine::DEDUP_KEY_MAX).then_some(key)
    }

    /// The outcome of an `Enqueue`; a refusal under reject-publish-dlx is dead-lettered.
    pub(super) fn enqueued(
        &self,
        st: &mut State,
        reply: Result<Reply<Entry>, MachineError>,
    ) -> Enqueued {
        match reply {
            Ok(Reply::Rejected(entry)) => {
                if st.dead_letter.is_some()
                    && st.machine.config().overflow == Overflow::RejectPublishDlx
                {
                    self.hold_dead_letter(st, &entry, Removal::MaxLen, None);
                }
                Enqueued::Rejected
            }
            Ok(Reply::Duplicate(_)) => Enqueued::Duplicate,
            _ => Enqueued::Accepted,
        }
    }

    /// A persistent message is durable at `location`: beyond the head of a long queue, keep
    /// only that (the body is read back on delivery), so a backlog costs little memory.
    pub(super) fn stored_at(
        self: &Arc<Self>,
        id: MsgId,
        location: Location,
        size: u32,
        priority: u8,
    ) {
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
}

/// What [`Queue::publish_one`]'s caller is told once, when both halves are in.
type Answer = Box<dyn FnOnce(Result<Enqueued, String>) + Send>;

/// Where the queue's decision and the store's completion of one publish meet, in either
/// order: the second to arrive gets the caller's callback back to run (outside the lock).
/// Guarantees the callback is handed out exactly once, and only with both halves.
struct Rendezvous {
    outcome: Option<Enqueued>,
    stored: Option<Result<(), String>>,
    done: Option<Answer>,
}

impl Rendezvous {
    fn new(done: Answer) -> Self {
        Self {
            outcome: None,
            stored: None,
            done: Some(done),
        }
    }

    /// The queue decided; the callback and its result if the store answered already.
    fn decided(&mut self, outcome: Enqueued) -> Option<(Answer, Result<Enqueued, String>)> {
        self.outcome = Some(outcome);
        self.ready()
    }

    /// The store answered; the callback and its result if the queue decided already.
    fn stored(&mut self, result: Result<(), String>) -> Option<(Answer, Result<Enqueued, String>)> {
        self.stored = Some(result);
        self.ready()
    }

    fn ready(&mut self) -> Option<(Answer, Result<Enqueued, String>)> {
        // Nothing is taken until both halves are in: a half consumed by the first look
        // would leave the second with nothing, and the callback would never run.
        let outcome = self.outcome?;
        self.stored.as_ref()?;
        let done = self.done.take()?;
        Some((done, self.stored.take()?.map(|()| outcome)))
    }
}

/// Whether a queue this short releases publishers paused on it.
pub(super) fn below_flow_release(len: u64, bytes: u64) -> bool {
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
        return publish_local(targets, message, &PublishOptions::default(), done);
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
        let key = q.dedup_key(message);
        replica.submit(
            enqueue_commands(
                Entry::Mem(Arc::clone(message)),
                key,
                PublishOptions::default(),
            ),
            Box::new(move |r| {
                // The enqueue's reply is the last (a deduplication key goes ahead of it).
                let r = replicated_outcome(r).and_then(|replies| match replies.last() {
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
    let (local_outcome, _) =
        publish_local(&local, message, &PublishOptions::default(), || join.part());
    join.seal();
    (outcome.and(local_outcome), true)
}

/// One completion for several writes (replicated queues and the store): it runs once all of
/// them finished, with the first failure if any.
pub(super) struct Join {
    /// The caller's completion, the parts still running (plus one until sealed), the first
    /// failure.
    inner: parking_lot::Mutex<(
        Option<Completion>,
        usize,
        Option<Arc<warren_store::StoreError>>,
    )>,
}

impl Join {
    pub(super) fn new(done: Completion) -> Arc<Self> {
        Arc::new(Self {
            inner: parking_lot::Mutex::new((Some(done), 1, None)),
        })
    }

    pub(super) fn part(self: &Arc<Self>) -> Completion {
        self.inner.lock().1 += 1;
        let me = Arc::clone(self);
        Box::new(move |r| me.finish(r.err()))
    }

    /// No more parts will be added.
    pub(super) fn seal(&self) {
        self.finish(None);
    }

    pub(super) fn finish(&self, err: Option<Arc<warren_store::StoreError>>) {
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

/// [`publish_routed`] into queues that are not replicated, with `options` (a redrive's move
/// key and a delay are kept in the store with the message, so a restart remembers them).
pub(super) fn publish_local(
    targets: &[Arc<Queue>],
    message: &Arc<Message>,
    options: &PublishOptions,
    done: impl FnOnce() -> Completion,
) -> (Enqueued, bool) {
    let move_key = options.move_key.as_deref();
    if !message.properties.persistent() {
        let outcome = targets.iter().fold(Enqueued::Gone, |outcome, q| {
            outcome.and(q.publish_keyed(Arc::clone(message), options))
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
            // Ahead of this publish's ops: a key forgotten here and remembered by the
            // Enqueue below must be deleted before it is written again, not after.
            batch.ops.append(&mut st.store_ops);
        }
        let mut stored_here = Vec::with_capacity(stored_targets.len());
        let keys: Vec<Option<Vec<u8>>> = stored_targets
            .iter()
            .map(|q| q.dedup_key(message))
            .collect();
        // Once durable, long queues drop the body and keep only its place in the store.
        let mut placed: Vec<(std::sync::Weak<Queue>, MsgId)> = Vec::new();
        for ((q, st), key) in stored_targets.iter().zip(&guards).zip(&keys) {
            let duplicate = key
                .as_deref()
                .is_some_and(|k| st.machine.would_deduplicate(k, now))
                || move_key.is_some_and(|k| st.machine.would_refuse_move(k));
            let store_it = !st.deleted && !duplicate && !st.machine.would_reject(&entry);
            stored_here.push(store_it);
            if store_it {
                // The keys the queue will remember go into the store with the message.
                if let Some(k) = key.as_deref().filter(|_| st.machine.deduplicates()) {
                    batch
                        .ops
                        .push(crate::durable::key_put(q.id, KeyKind::Dedup, k, now));
                }
                if let Some(k) = move_key.filter(|k| k.len() <= machine::MOVE_KEY_MAX) {
                    batch
                        .ops
                        .push(crate::durable::key_put(q.id, KeyKind::Move, k, now));
                }
                let id = st.machine.next_id();
                // A delayed publish's due time, durable with it (the machine says so again
                // when it holds the message: the same record).
                if let Some(until) = options.until(now) {
                    batch.ops.push(crate::durable::due_put(q.id, id, until));
                }
                batch.ops.push(Op::Enqueue {
                    queue: q.id,
                    id,
                    body: BodyRef::New(0),
                    flags: u32::from(priority),
                    // A delayed message's TTL counts from when it is ready.
                    expires_at: st.machine.expiry_at(&entry, now).map_or(0, |at| {
                        at.saturating_add(options.until(now).map_or(0, |u| u - now))
                    }),
                });
                placed.push((Arc::downgrade(q), id));
            }
        }
        if placed.is_empty() {
            // Only the expiries' ops: the body is written for no queue.
            batch.bodies.clear();
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
        for (((q, st), stored), key) in stored_targets
            .iter()
            .zip(guards.iter_mut())
            .zip(stored_here)
            .zip(keys)
        {
            if !st.deleted {
                if let Some(key) = key {
                    let _ = q.apply_at(st, Command::Dedup { key }, now);
                }
                for c in options.commands(now) {
                    let _ = q.apply_at(st, c, now);
                }
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
    /// Dropped as a duplicate of a message the queue took before (deduplication): routed,
    /// and confirmed like a taken one.
    Duplicate,
}

impl Enqueued {
    /// Combine outcomes: a rejection anywhere wins (RabbitMQ nacks the publish), then any
    /// acceptance, then a duplicate (it was routed).
    #[must_use]
    pub fn and(self, other: Self) -> Self {
        match (self, other) {
            (Self::Rejected, _) | (_, Self::Rejected) => Self::Rejected,
            (Self::Accepted, _) | (_, Self::Accepted) => Self::Accepted,
            (Self::Duplicate, _) | (_, Self::Duplicate) => Self::Duplicate,
            _ => Self::Gone,
        }
    }
}

/// The commands that enqueue `entry` into a replicated queue: its deduplication key and the
/// options' commands (if any) just ahead of it, a delay counted from now on this node's clock.
pub(super) fn enqueue_commands(
    entry: Entry,
    key: Option<Vec<u8>>,
    options: PublishOptions,
) -> Vec<Command<Entry>> {
    let mut commands = Vec::with_capacity(3);
    if let Some(key) = key {
        commands.push(Command::Dedup { key });
    }
    commands.extend(options.commands(crate::timers::wall_ms()));
    commands.push(Command::Enqueue(entry));
    commands
}

/// What a publish into one queue may carry beyond the message (the HTTP queue API's, a
/// redrive's).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublishOptions {
    /// A redrive's move key ([`machine::Command::MoveKey`]).
    pub move_key: Option<Vec<u8>>,
    /// Hold the message this long before it is ready ([`machine::Command::Delay`]), ms.
    pub delay_ms: Option<u64>,
}

impl PublishOptions {
    /// Whether there is nothing beyond the message.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.move_key.is_none() && self.until(0).is_none()
    }

    /// When a message published at `now` becomes ready, if it is delayed.
    #[must_use]
    pub fn until(&self, now: u64) -> Option<u64> {
        self.delay_ms
            .filter(|&d| d > 0)
            .map(|d| now.saturating_add(d))
    }

    /// The commands that go just ahead of the `Enqueue`, for a publish at `now`.
    #[must_use]
    pub fn commands(&self, now: u64) -> Vec<Command<Entry>> {
        let mut out = Vec::new();
        if let Some(key) = &self.move_key {
            out.push(Command::MoveKey { key: key.clone() });
        }
        if let Some(until) = self.until(now) {
            out.push(Command::Delay { until });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use parking_lot::Mutex;

    use super::{Enqueued, Rendezvous};

    /// What the callback was told, in order.
    type Told = Arc<Mutex<Vec<Result<Enqueued, String>>>>;

    fn rendezvous() -> (Rendezvous, Told) {
        let told = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&told);
        (
            Rendezvous::new(Box::new(move |r| sink.lock().push(r))),
            told,
        )
    }

    #[test]
    fn the_store_answering_before_the_queue_decides_still_answers_once() {
        let (mut r, told) = rendezvous();
        assert!(r.stored(Ok(())).is_none());
        let (done, result) = r.decided(Enqueued::Duplicate).expect("both halves are in");
        done(result);
        assert!(r.decided(Enqueued::Accepted).is_none());
        assert!(r.stored(Ok(())).is_none());
        assert_eq!(*told.lock(), vec![Ok(Enqueued::Duplicate)]);
    }

    #[test]
    fn the_queue_deciding_first_waits_for_the_store_and_its_error_wins() {
        let (mut r, told) = rendezvous();
        assert!(r.decided(Enqueued::Accepted).is_none());
        let (done, result) = r.stored(Err("disk".into())).expect("both halves are in");
        done(result);
        assert_eq!(*told.lock(), vec![Err("disk".to_string())]);
    }
}
