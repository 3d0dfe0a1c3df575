//! openraft's state machine over any [`Applied`] state: the broker's queue driver (a quorum
//! queue's replica on a node) or the cluster's metadata. Tracks what openraft needs (last
//! applied id, membership, the entry time) and leaves the state itself to `A`.
//!
//! Entry times are kept monotonic (`max(at, previous)`), so a new leader with a slower clock
//! cannot move a queue's time backwards; replicas never read their own clocks.

use std::io::Cursor;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use openraft::storage::RaftStateMachine;
use openraft::{
    BasicNode, EntryPayload, ErrorSubject, ErrorVerb, LogId, OptionalSend, RaftSnapshotBuilder,
    Snapshot, SnapshotMeta, StorageIOError, StoredMembership,
};
use serde::{Deserialize, Serialize};

use crate::types::{NodeId, QueueRaft, QueueRequest, QueueResponse, StorageError};

type Entry = openraft::Entry<QueueRaft>;

/// The state a group replicates.
pub trait Applied: Send + Sync + 'static {
    /// Apply one committed entry's request at time `at` (never earlier than the previous).
    fn apply(&self, at: u64, request: QueueRequest) -> QueueResponse;
    /// The whole state, encoded.
    ///
    /// # Errors
    /// When it does not encode.
    fn snapshot(&self) -> Result<Vec<u8>, String>;
    /// Replace the state by a snapshot's.
    ///
    /// # Errors
    /// When the bytes do not decode.
    fn install(&self, bytes: &[u8]) -> Result<(), String>;
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Tracked {
    last_applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
    now: u64,
}

/// A snapshot: what openraft tracks, and `A`'s state.
#[derive(Serialize, Deserialize)]
struct SnapshotData {
    tracked: Tracked,
    state: Vec<u8>,
}

struct Inner {
    tracked: Tracked,
    snapshot: Option<(SnapshotMeta<NodeId, BasicNode>, Vec<u8>)>,
    snapshots_built: u64,
}

/// One replica's state machine. Clones share it (the snapshot builder is a clone).
pub struct GroupStateMachine<A> {
    inner: Arc<Mutex<Inner>>,
    applied: Arc<A>,
}

impl<A> Clone for GroupStateMachine<A> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            applied: Arc::clone(&self.applied),
        }
    }
}

fn sm_error(verb: ErrorVerb, e: impl std::fmt::Display) -> StorageError {
    StorageIOError::new(
        ErrorSubject::StateMachine,
        verb,
        openraft::AnyError::error(e.to_string()),
    )
    .into()
}

impl<A: Applied> GroupStateMachine<A> {
    /// A state machine applying into `applied` (its state before the first entry).
    pub fn over(applied: Arc<A>) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                tracked: Tracked::default(),
                snapshot: None,
                snapshots_built: 0,
            })),
            applied,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The state entries are applied into.
    #[must_use]
    pub fn applied(&self) -> &A {
        &self.applied
    }

    /// The last applied log id.
    #[must_use]
    pub fn last_applied(&self) -> Option<LogId<NodeId>> {
        self.lock().tracked.last_applied
    }

    /// `f` of the state with the id of the last entry applied into it, read under the apply
    /// lock (no entry lands between the two).
    pub fn read_applied<T>(&self, f: impl FnOnce(&A) -> T) -> (Option<LogId<NodeId>>, T) {
        let inner = self.lock();
        (inner.tracked.last_applied, f(&self.applied))
    }
}

impl<A: Applied> RaftSnapshotBuilder<QueueRaft> for GroupStateMachine<A> {
    async fn build_snapshot(&mut self) -> Result<Snapshot<QueueRaft>, StorageError> {
        // Under the lock, so no entry is applied between the state and its last id.
        let mut inner = self.lock();
        let state = self
            .applied
            .snapshot()
            .map_err(|e| sm_error(ErrorVerb::Read, e))?;
        let bytes = crate::codec::encode(&SnapshotData {
            tracked: inner.tracked.clone(),
            state,
        })
        .map_err(|e| sm_error(ErrorVerb::Read, e))?;
        inner.snapshots_built += 1;
        let last = inner.tracked.last_applied;
        let meta = SnapshotMeta {
            last_log_id: last,
            last_membership: inner.tracked.membership.clone(),
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

impl<A: Applied> RaftStateMachine<QueueRaft> for GroupStateMachine<A> {
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>), StorageError> {
        let inner = self.lock();
        Ok((inner.tracked.last_applied, inner.tracked.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<QueueResponse>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut inner = self.lock();
        let mut out = Vec::new();
        for entry in entries {
            inner.tracked.last_applied = Some(entry.log_id);
            let response = match entry.payload {
                EntryPayload::Blank => QueueResponse::default(),
                EntryPayload::Normal(req) => {
                    inner.tracked.now = inner.tracked.now.max(req.at);
                    self.applied.apply(inner.tracked.now, req)
                }
                EntryPayload::Membership(m) => {
                    inner.tracked.membership = StoredMembership::new(Some(entry.log_id), m);
                    QueueResponse::default()
                }
            };
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
        let data: SnapshotData =
            crate::codec::decode(&bytes).map_err(|e| sm_error(ErrorVerb::Write, e))?;
        let mut inner = self.lock();
        self.applied
            .install(&data.state)
            .map_err(|e| sm_error(ErrorVerb::Write, e))?;
        inner.tracked = data.tracked;
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
