//! The queue machine as openraft's state machine. Committed entries are applied in log order;
//! each entry's commands run at the entry's time (the leader's clock, kept monotonic here so a
//! new leader with a slower clock cannot move time backwards). Snapshots are the machine's
//! whole state with the last applied id and membership, in the binary codec.
//!
//! The effects the machine produces (deliveries, removals) are the same on every replica; the
//! driver on the leader acts on them ([`QueueStateMachine::take_effects`]), followers drop them.

use std::io::Cursor;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use openraft::storage::RaftStateMachine;
use openraft::{
    BasicNode, EntryPayload, ErrorSubject, ErrorVerb, LogId, OptionalSend, RaftSnapshotBuilder,
    Snapshot, SnapshotMeta, StorageIOError, StoredMembership,
};
use serde::{Deserialize, Serialize};
use warren_broker::queue::machine::{Effect, QueueConfig, QueueMachine};

use crate::types::{NodeId, QueueRaft, QueueResponse, ReplicatedMessage, StorageError};

type Entry = openraft::Entry<QueueRaft>;

/// What a snapshot holds (and what the state machine is).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct State {
    last_applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
    /// The machine's time: the largest entry time applied so far.
    now: u64,
    machine: QueueMachine<ReplicatedMessage>,
}

#[derive(Debug)]
struct Inner {
    state: State,
    /// Effects of applied entries not yet taken by the driver. Bounded by what the driver
    /// leaves: a follower's driver takes and drops them after every apply.
    effects: Vec<Effect<ReplicatedMessage>>,
    /// The latest snapshot built or installed.
    snapshot: Option<(SnapshotMeta<NodeId, BasicNode>, Vec<u8>)>,
    snapshots_built: u64,
}

/// One replica's queue state. Clones share it (the snapshot builder is a clone).
#[derive(Debug, Clone)]
pub struct QueueStateMachine {
    inner: Arc<Mutex<Inner>>,
}

fn sm_error(verb: ErrorVerb, e: impl std::fmt::Display) -> StorageError {
    StorageIOError::new(
        ErrorSubject::StateMachine,
        verb,
        openraft::AnyError::error(e.to_string()),
    )
    .into()
}

impl QueueStateMachine {
    /// An empty queue with `config`.
    #[must_use]
    pub fn new(config: QueueConfig) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                state: State {
                    last_applied: None,
                    membership: StoredMembership::default(),
                    now: 0,
                    machine: QueueMachine::with_config(config),
                },
                effects: Vec::new(),
                snapshot: None,
                snapshots_built: 0,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while applying would have stopped the replica; the state itself stays
        // consistent (each command is applied whole), so a poisoned lock is still readable.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The effects of the entries applied since the last call (deliveries, removals).
    pub fn take_effects(&self) -> Vec<Effect<ReplicatedMessage>> {
        std::mem::take(&mut self.lock().effects)
    }

    /// The last applied log id.
    #[must_use]
    pub fn last_applied(&self) -> Option<LogId<NodeId>> {
        self.lock().state.last_applied
    }

    /// A canonical rendering of the machine's state (maps in key order), to check that
    /// replicas at the same applied index hold the same state.
    #[must_use]
    pub fn state_digest(&self) -> String {
        let inner = self.lock();
        serde_json::to_value(&inner.state.machine)
            .map(|v| v.to_string())
            .unwrap_or_default()
    }

    /// Run `f` on the machine (reads for the driver and tests).
    pub fn with_machine<T>(&self, f: impl FnOnce(&QueueMachine<ReplicatedMessage>) -> T) -> T {
        f(&self.lock().state.machine)
    }
}

impl RaftSnapshotBuilder<QueueRaft> for QueueStateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<QueueRaft>, StorageError> {
        let mut inner = self.lock();
        let bytes = crate::codec::encode(&inner.state).map_err(|e| sm_error(ErrorVerb::Read, e))?;
        inner.snapshots_built += 1;
        let last = inner.state.last_applied;
        let meta = SnapshotMeta {
            last_log_id: last,
            last_membership: inner.state.membership.clone(),
            snapshot_id: format!(
                "{}-{}-{}",
                last.map_or(0, |l| l.leader_id.term),
                last.map_or(0, |l| l.index),
                inner.snapshots_built
            ),
        };
        inner.snapshot = Some((meta.clone(), bytes.clone()));
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        })
    }
}

impl RaftStateMachine<QueueRaft> for QueueStateMachine {
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>), StorageError> {
        let inner = self.lock();
        Ok((inner.state.last_applied, inner.state.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<QueueResponse>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut inner = self.lock();
        let Inner { state, effects, .. } = &mut *inner;
        let mut out = Vec::new();
        for entry in entries {
            state.last_applied = Some(entry.log_id);
            let mut response = QueueResponse::default();
            match entry.payload {
                EntryPayload::Blank => {}
                EntryPayload::Normal(req) => {
                    state.now = state.now.max(req.at);
                    for command in req.commands {
                        response
                            .replies
                            .push(state.machine.apply(state.now, command, effects));
                    }
                }
                EntryPayload::Membership(m) => {
                    state.membership = StoredMembership::new(Some(entry.log_id), m);
                }
            }
            out.push(response);
        }
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let bytes = snapshot.into_inner();
        let state: State =
            crate::codec::decode(&bytes).map_err(|e| sm_error(ErrorVerb::Write, e))?;
        let mut inner = self.lock();
        inner.state = state;
        // Effects of the replaced state no longer describe anything.
        inner.effects.clear();
        inner.snapshot = Some((meta.clone(), bytes));
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<QueueRaft>>, StorageError> {
        let inner = self.lock();
        Ok(inner.snapshot.as_ref().map(|(meta, bytes)| Snapshot {
            meta: meta.clone(),
            snapshot: Box::new(Cursor::new(bytes.clone())),
        }))
    }
}
