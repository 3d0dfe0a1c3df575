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
    /// Apply one committed entry's request at time `at` (never earlier than the previous);
    /// `index` is the entry's log index.
    fn apply(&self, at: u64, index: u64, request: QueueRequest) -> QueueResponse;
    /// The whole state, encoded.
    ///
    /// # Errors
    /// When it does not encode.
    fn snapshot(&self) -> Result<Vec<u8>, String>;
    /// The whole state, encoded as [`Applied::snapshot`] encodes it, written to `out` (a
    /// snapshot file): a large state should stream rather than be encoded in memory first.
    ///
    /// # Errors
    /// When it does not encode or `out` fails.
    fn snapshot_into(&self, out: &mut dyn std::io::Write) -> Result<(), String> {
        out.write_all(&self.snapshot()?).map_err(|e| e.to_string())
    }
    /// Replace the state by a snapshot's, which covers the log up to index `last` (0: none).
    ///
    /// # Errors
    /// When the bytes do not decode.
    fn install(&self, bytes: &[u8], last: u64) -> Result<(), String>;
    /// Whether [`Applied::snapshot`] leaves data out that a snapshot sent to another member
    /// must carry ([`Applied::expand`]): a stream's snapshot is where its log is, its files
    /// being the state.
    fn expands(&self) -> bool {
        false
    }
    /// The snapshot `state` with what a member that receives it needs (the stream's chunks).
    ///
    /// # Errors
    /// When the data cannot be read.
    fn expand(&self, state: &[u8]) -> Result<Vec<u8>, String> {
        Ok(state.to_vec())
    }
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

/// The current snapshot's meta and, unless it is on disk, its bytes.
type CurrentSnapshot = (SnapshotMeta<NodeId, BasicNode>, Option<Vec<u8>>);

struct Inner {
    tracked: Tracked,
    /// The current snapshot: its meta, and its bytes unless they are on disk (read back when
    /// asked for: a queue's snapshot holds every message's metadata, which memory holds once
    /// already, in the state).
    snapshot: Option<CurrentSnapshot>,
    snapshots_built: u64,
    /// Snapshots read from here now go to other members ([`Applied::expand`] applies):
    /// openraft also reads the current one while it starts, for its metadata only.
    sending: bool,
}

/// One replica's state machine. Clones share it (the snapshot builder is a clone).
pub struct GroupStateMachine<A> {
    inner: Arc<Mutex<Inner>>,
    applied: Arc<A>,
    /// Where the current snapshot is kept (None: in memory only, for tests). The state itself
    /// lives in memory: after a restart it comes back from this snapshot and the log entries
    /// after it (openraft purges the entries a snapshot covers).
    snapshot_path: Option<Arc<std::path::PathBuf>>,
}

impl<A> Clone for GroupStateMachine<A> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            applied: Arc::clone(&self.applied),
            snapshot_path: self.snapshot_path.clone(),
        }
    }
}

/// A snapshot as kept on disk (see [`crate::snapshot_file`]).
type StoredSnapshot = crate::snapshot_file::Stored<SnapshotMeta<NodeId, BasicNode>, Tracked>;

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
                sending: false,
            })),
            applied,
            snapshot_path: None,
        }
    }

    /// A state machine that keeps its snapshots at `path`, starting from the one there (if
    /// any): its state installed into `applied`, its last applied id and membership taken.
    ///
    /// # Errors
    /// The snapshot there cannot be read or does not decode.
    pub fn restored(applied: Arc<A>, path: std::path::PathBuf) -> Result<Self, String> {
        let mut sm = Self::over(applied);
        if let Some(stored) = crate::snapshot_file::read::<_, Tracked>(&path)? {
            let last = stored.tracked.last_applied.map_or(0, |l| l.index);
            sm.applied
                .install(stored.state(), last)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            let mut inner = sm.lock();
            inner.tracked = stored.tracked.clone();
            inner.snapshot = Some((stored.meta, None));
        }
        sm.snapshot_path = Some(Arc::new(path));
        Ok(sm)
    }

    /// Keep a snapshot whose bytes arrived whole on disk (an installed one), in the layout
    /// [`crate::snapshot_file`] gives, before openraft may purge the entries it covers.
    // openraft's own storage error type, returned through its traits.
    #[allow(clippy::result_large_err)]
    fn persist(
        &self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        data: &SnapshotData,
    ) -> Result<(), StorageError> {
        let Some(path) = &self.snapshot_path else {
            return Ok(());
        };
        crate::snapshot_file::write(path, meta, &data.tracked, |out| {
            out.write_all(&data.state).map_err(|e| e.to_string())
        })
        .map_err(|e| sm_error(ErrorVerb::Write, e))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What to keep in memory of a snapshot just persisted: nothing when it is on disk.
    fn kept(&self, bytes: Vec<u8>) -> Option<Vec<u8>> {
        self.snapshot_path.is_none().then_some(bytes)
    }

    /// The current snapshot's bytes (from memory, or read back from its file).
    #[allow(clippy::result_large_err)]
    fn snapshot_bytes(&self, kept: Option<&Vec<u8>>) -> Result<Vec<u8>, StorageError> {
        if let Some(bytes) = kept {
            return Ok(bytes.clone());
        }
        let Some(path) = &self.snapshot_path else {
            return Err(sm_error(
                ErrorVerb::Read,
                "a snapshot neither kept nor stored",
            ));
        };
        let stored: StoredSnapshot = crate::snapshot_file::read(path.as_path())
            .map_err(|e| sm_error(ErrorVerb::Read, e))?
            .ok_or_else(|| sm_error(ErrorVerb::Read, "the snapshot file is gone"))?;
        // What a snapshot sent to another member carries (the layout it always had).
        crate::codec::encode(&SnapshotData {
            tracked: stored.tracked.clone(),
            state: stored.state().to_vec(),
        })
        .map_err(|e| sm_error(ErrorVerb::Read, e))
    }

    /// The group's Raft instance has started: a current snapshot read from now on is one to
    /// send, and [`Applied::expand`] applies to it.
    pub fn started(&self) {
        self.lock().sending = true;
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
        if let Some(path) = &self.snapshot_path {
            // Streamed to the file as it is encoded. openraft takes only the meta of a built
            // snapshot (its state machine worker), and reads a snapshot to send through
            // `get_current_snapshot`: the one returned here carries no bytes.
            crate::snapshot_file::write(path, &meta, &inner.tracked, |out| {
                self.applied.snapshot_into(out)
            })
            .map_err(|e| sm_error(ErrorVerb::Write, e))?;
            inner.snapshot = Some((meta.clone(), None));
            return Ok(Snapshot {
                meta,
                snapshot: Box::new(Cursor::new(Vec::new())),
            });
        }
        let state = self
            .applied
            .snapshot()
            .map_err(|e| sm_error(ErrorVerb::Read, e))?;
        let bytes = crate::codec::encode(&SnapshotData {
            tracked: inner.tracked.clone(),
            state,
        })
        .map_err(|e| sm_error(ErrorVerb::Read, e))?;
        inner.snapshot = Some((meta.clone(), Some(bytes.clone())));
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
                    self.applied
                        .apply(inner.tracked.now, entry.log_id.index, req)
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
        let mut bytes = snapshot.into_inner();
        let mut data: SnapshotData =
            crate::codec::decode(&bytes).map_err(|e| sm_error(ErrorVerb::Write, e))?;
        let mut inner = self.lock();
        self.applied
            .install(&data.state, meta.last_log_id.map_or(0, |l| l.index))
            .map_err(|e| sm_error(ErrorVerb::Write, e))?;
        if self.applied.expands() {
            // What was sent carried the data, now in the state's own files: keep the short form.
            data.state = self
                .applied
                .snapshot()
                .map_err(|e| sm_error(ErrorVerb::Write, e))?;
            bytes = crate::codec::encode(&data).map_err(|e| sm_error(ErrorVerb::Write, e))?;
        }
        self.persist(meta, &data)?;
        inner.tracked = data.tracked;
        inner.snapshot = Some((meta.clone(), self.kept(bytes)));
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<QueueRaft>>, StorageError> {
        let inner = self.lock();
        let Some((meta, kept)) = inner.snapshot.as_ref() else {
            return Ok(None);
        };
        let bytes = &self.snapshot_bytes(kept.as_ref())?;
        let bytes = if self.applied.expands() && inner.sending {
            // Sent to a member behind the purged log: with the data it needs. If that
            // cannot be built, the short form goes (the member then starts its copy again
            // at the snapshot's end) rather than an error that would stop the group.
            let mut data: SnapshotData =
                crate::codec::decode(bytes).map_err(|e| sm_error(ErrorVerb::Read, e))?;
            match self.applied.expand(&data.state).and_then(|state| {
                data.state = state;
                crate::codec::encode(&data).map_err(|e| e.to_string())
            }) {
                Ok(full) => full,
                Err(e) => {
                    tracing::error!(error = %e, "a snapshot is sent without its data");
                    bytes.clone()
                }
            }
        } else {
            bytes.clone()
        };
        Ok(Some(Snapshot {
            meta: meta.clone(),
            snapshot: Box::new(Cursor::new(bytes)),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, Entry};

    /// A state that counts the entries applied into it and the times they carried.
    #[derive(Default)]
    struct Counted(Mutex<Vec<u64>>);

    impl Applied for Counted {
        fn apply(&self, at: u64, _index: u64, _request: QueueRequest) -> QueueResponse {
            self.0.lock().unwrap().push(at);
            QueueResponse::default()
        }
        fn snapshot(&self) -> Result<Vec<u8>, String> {
            crate::codec::encode(&*self.0.lock().unwrap()).map_err(|e| e.to_string())
        }
        fn install(&self, bytes: &[u8], _last: u64) -> Result<(), String> {
            *self.0.lock().unwrap() = crate::codec::decode(bytes).map_err(|e| e.to_string())?;
            Ok(())
        }
    }

    fn entry(index: u64) -> Entry<QueueRaft> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(QueueRequest {
                at: 1000 + index,
                commands: Vec::new(),
                meta: Vec::new(),
            }),
        }
    }

    /// openraft purges the entries a snapshot covers: a replica that restarts must find the
    /// snapshot on disk (its state, last applied id and membership), or it cannot start.
    #[tokio::test]
    async fn a_snapshot_survives_a_restart_and_restores_the_state() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("q.snapshot");
        let mut sm = GroupStateMachine::restored(Arc::new(Counted::default()), path.clone())
            .expect("no snapshot yet is fine");
        assert_eq!(sm.last_applied(), None);
        sm.apply((1..=5).map(entry)).await.unwrap();
        let built = sm.build_snapshot().await.unwrap();
        // Applied after the snapshot: not in it, replayed from the log after a restart.
        sm.apply([entry(6)]).await.unwrap();

        let mut again = GroupStateMachine::restored(Arc::new(Counted::default()), path.clone())
            .expect("the snapshot reads back");
        assert_eq!(again.last_applied().map(|l| l.index), Some(5));
        assert_eq!(
            *again.applied().0.lock().unwrap(),
            vec![1001, 1002, 1003, 1004, 1005]
        );
        let current = again.get_current_snapshot().await.unwrap().expect("kept");
        assert_eq!(current.meta, built.meta);
        // Entry times stay monotonic across the restart.
        again.apply([entry(6)]).await.unwrap();
        assert_eq!(again.applied().0.lock().unwrap().last(), Some(&1006));

        // A damaged file is an error, not an empty queue.
        std::fs::write(&path, b"not a snapshot").unwrap();
        assert!(GroupStateMachine::restored(Arc::new(Counted::default()), path).is_err());
    }
}
