//! A replicated (quorum or stream) queue's side of its Raft group: commands submitted through the
//! [`super::replica::Replicator`], applied in log order on every replica by `apply_committed`.

use super::*;

impl Queue {
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

    /// Submit to the group, fire and forget: the outcome shows in the applied state (a lost
    /// submission is like a client whose command never arrived).
    pub(super) fn submit_quietly(
        &self,
        replica: &Arc<dyn Replicator>,
        commands: Vec<Command<Entry>>,
    ) {
        replica.submit(commands, Box::new(|_| {}));
    }

    /// A replicated command whose caller waits for it (purge-ok, tx.commit-ok): `on_commit`'s
    /// completion runs once the group committed it.
    pub(super) fn submit_then(
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

    /// [`Queue::consume`] of a replicated queue: the checkout is proposed, and deliveries
    /// start when it commits. A refusal found at commit (another node's exclusive consumer
    /// got there first) cancels the consumer with basic.cancel.
    pub(super) fn consume_replicated(
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
                    Ok([Ok(Reply::Got(Some((id, entry, redelivered, left, count))))]) => Some((
                        *id,
                        crate::durable::pin(entry, None),
                        *redelivered,
                        *left,
                        *count,
                    )),
                    _ => None,
                };
                done(got);
            }),
        );
    }
}

/// A replicated submission's outcome as the store's completions see it: a refusal or a lost
/// leader is a failed write, so its publisher is nacked.
pub(super) fn replicated_outcome(
    r: Result<Replies, ReplicationError>,
) -> Result<Replies, Arc<warren_store::StoreError>> {
    r.map_err(|e| Arc::new(warren_store::StoreError::Replication(e.to_string())))
}
