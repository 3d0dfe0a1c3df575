//! Settling deliveries (ack, reject, requeue, channel-close returns, stream offsets), purge and
//! delete.

use super::*;

impl Queue {
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

    /// The client gave deliveries back as failed, ready again after `delay_ms` (None: the
    /// retry policy's delay): [`Command::Retry`], Warren's AMQP release extension.
    pub fn retry(
        self: &Arc<Self>,
        ids: Vec<MsgId>,
        delay_ms: Option<u64>,
        reason: String,
        worker: String,
    ) {
        self.put_back(Command::Retry {
            ids,
            delay_ms,
            reason,
            worker,
        });
    }

    /// Unacked or undelivered messages come back without the client asking (its channel
    /// closed, a delivery its consumer can no longer take): [`Command::Return`], in place.
    pub fn give_back(self: &Arc<Self>, ids: Vec<MsgId>) {
        self.put_back(Command::Return(ids));
    }

    pub(super) fn put_back(self: &Arc<Self>, command: Command<Entry>) {
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

    /// Remove all ready messages; returns how many.
    /// The removals of stored messages are submitted with `on_commit`'s completion, so the
    /// caller can hold purge-ok until they are durable.
    pub fn purge(self: &Arc<Self>, on_commit: OnCommit<'_>) -> u32 {
        if let Some(replica) = self.replica() {
            // purge-ok waits for the commit; its count is this replica's view just before (a
            // proxy's: its home's last report).
            let n = if self.is_remote() {
                self.counts().messages
            } else {
                u32::try_from(self.state.lock().machine.ready_len()).unwrap_or(u32::MAX)
            };
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
