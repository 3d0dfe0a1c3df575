//! Claims under a lease, driven: what the HTTP queue API (and later AMQP's extension) calls.
//!
//! A local queue applies the command under its lock and answers at once; a replicated queue
//! (quorum) and a proxy of a classic queue held on another node submit it through their
//! [`Replicator`], and answer when it committed there. Either way the answer comes through a
//! callback, never by blocking. A claimed message comes back as an [`Outgoing`] readable after
//! the call (a stored body pinned, a quorum queue's body read from its log here).

use super::*;
use crate::queue::machine::{Claimed, LeaseError, LeaseState};

/// Why a lease call got no answer from the queue.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum LeaseCallError {
    /// Streams keep their messages for every reader: nothing is claimed from them.
    #[error("a stream has no claims")]
    Stream,
    /// The queue was deleted.
    #[error("the queue was deleted")]
    Deleted,
    /// The queue's group or home node did not answer.
    #[error(transparent)]
    Replication(#[from] ReplicationError),
}

/// What a claim hands to its caller: each message's claim with its body readable.
pub type ClaimOutcome = Result<Vec<Claimed<Outgoing>>, LeaseCallError>;
/// Called once with a claim's outcome.
pub type ClaimDone = Box<dyn FnOnce(ClaimOutcome) + Send>;
/// The outcome of an extend, ack or release: the claim's state, or why the token changed
/// nothing.
pub type LeaseOutcome = Result<Result<LeaseState, LeaseError>, LeaseCallError>;
/// Called once with an extend's, ack's or release's outcome.
pub type LeaseDone = Box<dyn FnOnce(LeaseOutcome) + Send>;
/// The outcomes of several lease commands, in order.
pub type LeasesOutcome = Result<Vec<Result<LeaseState, LeaseError>>, LeaseCallError>;
/// Called once with several lease commands' outcomes.
pub type LeasesDone = Box<dyn FnOnce(LeasesOutcome) + Send>;

impl Queue {
    /// Claim up to `max` ready messages for `worker` under a lease of `lease_ms` (the queue's
    /// default when None); `done` gets them in delivery order.
    pub fn claim(
        self: &Arc<Self>,
        max: u32,
        lease_ms: Option<u64>,
        worker: String,
        done: ClaimDone,
    ) {
        self.claim_by(
            Command::Claim {
                max,
                lease_ms,
                worker,
            },
            done,
        );
    }

    /// Claim the ready messages `ids` (wherever they wait) for `worker` under a lease, as
    /// [`Queue::claim`] does; those no longer ready are passed over. A redrive takes what its
    /// filter chose this way.
    pub fn take(
        self: &Arc<Self>,
        ids: Vec<MsgId>,
        lease_ms: Option<u64>,
        worker: String,
        done: ClaimDone,
    ) {
        self.claim_by(
            Command::Take {
                ids,
                lease_ms,
                worker,
            },
            done,
        );
    }

    /// Carry out a `Claim` or `Take`.
    fn claim_by(self: &Arc<Self>, command: Command<Entry>, done: ClaimDone) {
        if self.is_stream {
            done(Err(LeaseCallError::Stream));
            return;
        }
        if let Some(replica) = self.replica() {
            let reader = Arc::clone(replica);
            replica.submit(
                vec![command],
                Box::new(move |r| {
                    done(r.map_err(LeaseCallError::from).map(|replies| {
                        match replies.into_iter().next() {
                            Some(Ok(Reply::Claimed(claims))) => claims
                                .into_iter()
                                .map(|c| {
                                    c.map(|e| crate::durable::pin_from(&e, None, reader.bodies()))
                                })
                                .collect(),
                            _ => Vec::new(),
                        }
                    }));
                }),
            );
            return;
        }
        let claims = self.claim_here(command);
        done(claims);
    }

    /// [`Queue::claim`] of a queue held here.
    pub(super) fn claim_here(self: &Arc<Self>, command: Command<Entry>) -> ClaimOutcome {
        let claims = {
            let mut st = self.state.lock();
            if st.deleted {
                return Err(LeaseCallError::Deleted);
            }
            st.last_used = self.now_ms();
            // Pinned before any store op of this command is submitted.
            let claims = match self.apply(&mut st, command) {
                Ok(Reply::Claimed(claims)) => claims
                    .into_iter()
                    .map(|c| c.map(|e| crate::durable::pin(&e, self.store.as_deref())))
                    .collect(),
                _ => Vec::new(),
            };
            self.submit_store_ops(&mut st, None);
            claims
        };
        self.dead_letter_pending();
        Ok(claims)
    }

    /// Extend, acknowledge or release a claim ([`Command::Extend`], [`Command::AckLease`],
    /// [`Command::Release`]); `done` gets the claim's state or why the token changed nothing.
    pub fn settle_lease(self: &Arc<Self>, command: Command<Entry>, done: LeaseDone) {
        self.settle_leases(
            vec![command],
            Box::new(move |r| {
                done(r.map(|outcomes| {
                    outcomes
                        .into_iter()
                        .next()
                        .unwrap_or(Err(LeaseError::NotFound))
                }));
            }),
        );
    }

    /// [`Queue::settle_lease`] of several claims at once (in one submission of a replicated
    /// queue, under one lock of a local one); `done` gets one outcome per command, in order.
    ///
    /// # Panics
    /// In debug builds, for a command that is not a lease command (a caller's bug).
    pub fn settle_leases(self: &Arc<Self>, commands: Vec<Command<Entry>>, done: LeasesDone) {
        debug_assert!(commands.iter().all(|c| matches!(
            c,
            Command::Extend { .. } | Command::AckLease { .. } | Command::Release { .. }
        )));
        if self.is_stream {
            done(Err(LeaseCallError::Stream));
            return;
        }
        let n = commands.len();
        if let Some(replica) = self.replica() {
            replica.submit(
                commands,
                Box::new(move |r| {
                    done(r.map_err(LeaseCallError::from).map(|replies| {
                        let mut out: Vec<_> = replies
                            .into_iter()
                            .map(|reply| match reply {
                                Ok(Reply::Lease(outcome)) => outcome,
                                _ => Err(LeaseError::NotFound),
                            })
                            .collect();
                        out.resize(n, Err(LeaseError::NotFound));
                        out
                    }));
                }),
            );
            return;
        }
        done(self.settle_leases_here(commands));
    }

    /// [`Queue::settle_lease`] of a queue held here.
    pub(super) fn settle_lease_here(self: &Arc<Self>, command: Command<Entry>) -> LeaseOutcome {
        self.settle_leases_here(vec![command]).map(|outcomes| {
            outcomes
                .into_iter()
                .next()
                .unwrap_or(Err(LeaseError::NotFound))
        })
    }

    /// [`Queue::settle_leases`] of a queue held here: one lock, one store submission.
    fn settle_leases_here(self: &Arc<Self>, commands: Vec<Command<Entry>>) -> LeasesOutcome {
        let outcomes = {
            let mut st = self.state.lock();
            if st.deleted {
                return Err(LeaseCallError::Deleted);
            }
            st.last_used = self.now_ms();
            let outcomes = commands
                .into_iter()
                .map(|c| match self.apply(&mut st, c) {
                    Ok(Reply::Lease(outcome)) => outcome,
                    _ => Err(LeaseError::NotFound),
                })
                .collect();
            self.submit_store_ops(&mut st, None);
            outcomes
        };
        self.dead_letter_pending();
        Ok(outcomes)
    }

    /// Forget the keys of finished redrive moves into this queue (see
    /// [`Command::ForgetMoveKeys`]). Not waited for: a key left behind costs a little memory
    /// until the window pushes it out, nothing else.
    pub fn forget_move_keys(self: &Arc<Self>, keys: Vec<Vec<u8>>) {
        if keys.is_empty() || self.is_stream {
            return;
        }
        if let Some(replica) = self.replica() {
            self.submit_quietly(replica, vec![Command::ForgetMoveKeys { keys }]);
            return;
        }
        let mut st = self.state.lock();
        if !st.deleted {
            let _ = self.run(&mut st, Command::ForgetMoveKeys { keys });
        }
    }

    /// Put back the keys the store kept for this queue (recovery), see
    /// [`Command::RestoreKeys`].
    pub fn restore_keys(
        self: &Arc<Self>,
        dedup: Vec<(Vec<u8>, u64)>,
        moves: Vec<Vec<u8>>,
        due: Vec<(MsgId, u64)>,
    ) {
        let mut st = self.state.lock();
        let _ = self.run(&mut st, Command::RestoreKeys { dedup, moves, due });
    }

    /// The id the queue's next message will get (every message in it has a smaller one), as
    /// [`Queue::browse`] sees the queue; None where browse has nothing (a stream, a classic
    /// queue held on another node).
    #[must_use]
    pub fn next_message_id(&self) -> Option<u64> {
        if self.is_stream || self.replica().is_some_and(|r| r.home().is_some()) {
            return None;
        }
        Some(self.state.lock().machine.next_id())
    }

    /// Up to `limit` of the queue's messages in `state` from position `from`, without
    /// claiming them (a replicated queue's as this replica has applied them), bodies
    /// readable after the call. None for a stream, or a classic queue held on another node
    /// (browse it through that node). A message that left the queue since the look may come
    /// back [`Outgoing::Unreadable`].
    #[must_use]
    pub fn browse(
        &self,
        state: machine::BrowseState,
        from: usize,
        limit: usize,
    ) -> Option<Vec<machine::Browsed<Outgoing>>> {
        if self.is_stream || self.replica().is_some_and(|r| r.home().is_some()) {
            return None;
        }
        // References copied under the lock, bodies opened after it: a message settled in
        // between reads as unreadable, and the caller skips it.
        let found = self.state.lock().machine.browse(state, from, limit);
        Some(
            found
                .into_iter()
                .map(|b| machine::Browsed {
                    msg: self.pin(&b.msg),
                    position: b.position,
                    id: b.id,
                    delivery_count: b.delivery_count,
                    enqueued_at: b.enqueued_at,
                    ready_at: b.ready_at,
                    lease: b.lease,
                })
                .collect(),
        )
    }
}
