//! A classic queue of a cluster, used through a node that does not hold it.
//!
//! A classic queue lives on one node, its *home* (as in RabbitMQ 4: no mirroring). Every other
//! node holds a *proxy*: a [`Queue`] of the same name and declaration whose machine stays
//! empty and whose [`Replicator`] sends the channel's commands to the home (enqueue,
//! checkout, settle, get, purge...). The proxy reuses the replicated queue's paths unchanged:
//! a command is submitted, its reply comes back when the home carried it out (an enqueue
//! after the home's durable commit, so a confirm through any node means the message is on
//! the home's disk). The home runs them with [`Queue::serve_remote`]; deliveries to a
//! proxy's consumers leave the home through a per-peer [`Outbox`] (the consumer's sink
//! there) and arrive through [`Queue::deliver_from_home`].
//!
//! ```text
//!  client ── proxy (node B) ──commands──► home (node A): Queue::serve_remote
//!  client ◄─ proxy: deliver_from_home ◄──deliveries── A's outbox for B
//! ```
//!
//! Consumer ids carry their node's number ([`machine::consumer_node`]), so the home's
//! machine holds consumers of many nodes without collisions, and returns a node's
//! deliveries when that node goes away ([`Queue::detach_node`]).

use super::*;

/// Receives the home's replies to a proxy's commands, one per command, or why there are
/// none (a store write failed: the outcome of the enqueues in it is unknown).
pub type ServeDone = Box<dyn FnOnce(Result<Replies, String>) + Send>;

impl Queue {
    /// Whether this is a proxy of a classic queue homed on another node.
    #[must_use]
    pub fn is_remote(&self) -> bool {
        self.replica().is_some_and(|r| r.home().is_some())
    }

    /// A proxy's home node (None: the queue is held here, or replicated).
    #[must_use]
    pub fn home(&self) -> Option<String> {
        self.replica().and_then(|r| r.home())
    }

    /// Whether this is a proxy whose home node is down or unreachable from here.
    #[must_use]
    pub fn home_down(&self) -> bool {
        self.replica()
            .is_some_and(|r| r.home().is_some() && r.home_down())
    }

    /// A delivery from the home node to `consumer`, attached here. False when no such
    /// consumer is attached (cancelled meanwhile, or of this node's previous run): the home
    /// then takes the message back.
    #[must_use]
    pub fn deliver_from_home(
        self: &Arc<Self>,
        consumer: ConsumerId,
        id: MsgId,
        message: Arc<Message>,
        redelivered: bool,
        delivery_count: u32,
    ) -> bool {
        let st = self.state.lock();
        let Some(sink) = st.sinks.get(&consumer) else {
            return false;
        };
        sink.outbox.push(Outbound::Deliver(Delivery {
            channel: sink.channel,
            consumer,
            queue: Arc::clone(self),
            id,
            message: Outgoing::Mem(message),
            redelivered,
            counted: false,
            delivery_count,
        }));
        true
    }

    /// The home cancelled `consumer` (its queue was deleted there): its client hears it.
    pub fn cancel_from_home(&self, consumer: ConsumerId) {
        let sink = self.state.lock().sinks.remove(&consumer);
        if let Some(sink) = sink {
            sink.outbox.push(Outbound::Cancel {
                channel: sink.channel,
                consumer,
            });
        }
    }

    /// The home node is down or unreachable: every consumer attached here is cancelled
    /// (consumer cancel notify), as RabbitMQ does when a queue's node goes away. Clients may
    /// subscribe again once it is back.
    pub fn home_lost(&self) {
        let sinks: Vec<(ConsumerId, ConsumerSink)> = self.state.lock().sinks.drain().collect();
        for (consumer, sink) in sinks {
            sink.outbox.push(Outbound::Cancel {
                channel: sink.channel,
                consumer,
            });
        }
    }

    /// Carry out commands a proxy on another node sent (its node's consumers deliver into
    /// `peer`, that node's outbox here). `done` gets one reply per command once all of them
    /// are done: an enqueue's after its store commit, as a local publisher's confirm.
    pub fn serve_remote(
        self: &Arc<Self>,
        commands: Vec<Command<Entry>>,
        peer: &Arc<Outbox>,
        done: ServeDone,
    ) {
        debug_assert!(!self.is_replicated(), "a proxy or replica serves no proxy");
        let replies: Arc<Mutex<Replies>> = Arc::new(Mutex::new(Vec::with_capacity(commands.len())));
        let out = Arc::clone(&replies);
        let join = Join::new(Box::new(move |r| match r {
            Ok(_) => done(Ok(std::mem::take(&mut *out.lock()))),
            Err(e) => done(Err(e.to_string())),
        }));
        // A move key and a delay apply to the Enqueue after them (sent in one submission).
        let mut options = PublishOptions::default();
        for command in commands {
            let reply = match command {
                Command::MoveKey { key } => {
                    options.move_key = Some(key);
                    Ok(Reply::Ok)
                }
                Command::Delay { until } => {
                    options.delay_ms = Some(until.saturating_sub(crate::timers::wall_ms()));
                    Ok(Reply::Ok)
                }
                Command::Enqueue(entry) => {
                    self.serve_enqueue(entry, &std::mem::take(&mut options), &join)
                }
                command => self.serve_one(command, peer, &join),
            };
            replies.lock().push(reply);
        }
        join.seal();
    }

    fn serve_one(
        self: &Arc<Self>,
        command: Command<Entry>,
        peer: &Arc<Outbox>,
        join: &Arc<Join>,
    ) -> Result<Reply<Entry>, MachineError> {
        match command {
            Command::Enqueue(entry) => {
                self.serve_enqueue(entry, &PublishOptions::default(), join)
            }
            Command::ForgetMoveKeys { keys } => {
                self.forget_move_keys(keys);
                Ok(Reply::Ok)
            }
            Command::Take { .. } => Ok(Reply::Claimed(self.remote_claims(command))),
            Command::Checkout(id, spec) => {
                let sink = ConsumerSink {
                    outbox: Arc::clone(peer),
                    channel: 0,
                    limiter: None,
                };
                self.consume(id, spec, sink).map(|()| Reply::Ok)
            }
            Command::Cancel(id) => {
                if self.cancel(id)
                    && let Some(vhost) = self.vhost_ref.upgrade()
                {
                    // Its last consumer left an auto-delete queue.
                    vhost.delete_if(self, &|_| true, &mut || join.part());
                }
                Ok(Reply::Ok)
            }
            Command::Settle(ids) => {
                self.settle(ids, Some(&mut || join.part()));
                Ok(Reply::Ok)
            }
            Command::Discard(ids) => {
                self.discard(ids, Some(&mut || join.part()));
                Ok(Reply::Ok)
            }
            Command::Requeue(ids) => {
                self.requeue(ids);
                Ok(Reply::Ok)
            }
            Command::Retry { .. } => {
                self.put_back(command);
                Ok(Reply::Ok)
            }
            Command::Return(ids) => {
                self.give_back(ids);
                Ok(Reply::Ok)
            }
            Command::Get { no_ack } => Ok(Reply::Got(self.get(no_ack).and_then(
                |(id, message, redelivered, left, count)| match message.load() {
                    Ok(loaded) => match loaded_message(&loaded) {
                        Ok(m) => Some((id, Entry::Mem(m), redelivered, left, count)),
                        Err(e) => {
                            tracing::error!(queue = %self.name, error = %e, "unreadable message");
                            None
                        }
                    },
                    Err(e) => {
                        tracing::error!(queue = %self.name, error = %e, "unreadable message");
                        if !no_ack {
                            self.give_back(vec![id]);
                        }
                        None
                    }
                },
            ))),
            Command::Purge => Ok(Reply::Purged(self.purge(&mut || join.part()))),
            Command::Down { node, before } => {
                self.detach_consumers(node, before);
                Ok(Reply::Ok)
            }
            // Window and limits stay on the proxy's side (its consumers have none); the
            // rest is the home's own business (policies, expiry, recovery).
            Command::Written(..)
            | Command::Grant(_)
            | Command::SetLimited(..)
            | Command::Configure(_)
            | Command::Expire
            | Command::Restore { .. }
            | Command::Swap { .. }
            | Command::TrackOffset { .. }
            | Command::ConfigureWork(_)
            | Command::RestoreKeys { .. }
            // Taken by serve_remote with the Enqueue after it.
            | Command::MoveKey { .. }
            | Command::Delay { .. }
            // The home takes the key from the message's header itself.
            | Command::Dedup { .. } => Ok(Reply::Ok),
            // A proxy's claim: taken here, bodies sent along (as a get's).
            Command::Claim { .. } => Ok(Reply::Claimed(self.remote_claims(command))),
            Command::Extend { .. } | Command::AckLease { .. } | Command::Release { .. } => {
                Ok(Reply::Lease(
                    self.settle_lease_here(command)
                        .unwrap_or(Err(machine::LeaseError::NotFound)),
                ))
            }
        }
    }

    /// A proxy's enqueue, with the move key and delay sent ahead of it.
    fn serve_enqueue(
        self: &Arc<Self>,
        entry: Entry,
        options: &PublishOptions,
        join: &Arc<Join>,
    ) -> Result<Reply<Entry>, MachineError> {
        let Entry::Mem(message) = entry else {
            // Proxies send bodies; a stored reference means nothing here.
            return Ok(Reply::Ok);
        };
        let (outcome, _) = publish_local(&[Arc::clone(self)], &message, options, || join.part());
        Ok(match outcome {
            Enqueued::Rejected => Reply::Rejected(Entry::Mem(message)),
            Enqueued::Duplicate => Reply::Duplicate(Entry::Mem(message)),
            Enqueued::Accepted | Enqueued::Gone => Reply::Ok,
        })
    }

    /// A proxy's claim (`Claim` or `Take`), taken here, bodies sent along (as a get's).
    fn remote_claims(self: &Arc<Self>, command: Command<Entry>) -> Vec<machine::Claimed<Entry>> {
        let claims = self.claim_here(command).unwrap_or_default();
        claims
            .into_iter()
            .filter_map(|c| {
                let id = c.id;
                match c.msg.load().and_then(|l| loaded_message(&l)) {
                    Ok(m) => Some(c.map(|_| Entry::Mem(m))),
                    Err(e) => {
                        // Its lease runs out and it is claimed again.
                        tracing::error!(queue = %self.name, id, error = %e, "unreadable message");
                        None
                    }
                }
            })
            .collect()
    }

    /// Node `node` (a consumer id's node number) is down: its consumers attached here are
    /// detached and what they held is returned, redelivered.
    pub fn detach_node(self: &Arc<Self>, node: u64) {
        self.detach_consumers(node, ConsumerId::MAX);
    }

    /// [`Queue::detach_node`] of the consumers with ids below `before`.
    fn detach_consumers(self: &Arc<Self>, node: u64, before: ConsumerId) {
        if self.is_replicated() || self.is_stream {
            return;
        }
        {
            let mut st = self.state.lock();
            st.sinks
                .retain(|id, _| !(machine::consumer_node(*id) == node && *id < before));
            let _ = self.run(&mut st, Command::Down { node, before });
        }
        self.dead_letter_pending();
    }
}

/// A loaded message as a [`Message`] (its properties parsed), to send to another node.
///
/// # Errors
/// Its stored properties do not parse.
pub fn loaded_message(loaded: &crate::message::Loaded) -> Result<Arc<Message>, String> {
    match loaded {
        crate::message::Loaded::Mem(m) => Ok(Arc::clone(m)),
        crate::message::Loaded::Read(r) => Ok(Arc::new(Message {
            exchange: String::from_utf8_lossy(&r.exchange).into_owned(),
            routing_key: String::from_utf8_lossy(&r.routing_key).into_owned(),
            properties: warren_amqp::properties::Properties::parse(
                r.properties.clone(),
                warren_amqp::limits::TABLE_DEPTH_MAX,
            )
            .map_err(|e| e.to_string())?,
            body: r.body.clone(),
        })),
    }
}
