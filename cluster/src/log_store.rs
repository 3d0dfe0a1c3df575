//! The Raft log of one group in redb: entries by index, and the vote, the commit index and the
//! last purged id as metadata. Every write is a redb transaction committed with its default
//! `Durability::Immediate` (fsync) before openraft is told it is done, so an entry counted
//! towards a majority is on disk, and a vote given is never forgotten across a crash.
//!
//! Entries are stored in the binary [`codec`](crate::codec), one redb value each; the small
//! metadata values are JSON.

// The error type is openraft's `StorageError`, which its storage traits return; the helpers
// here return it too rather than boxing and unboxing it at every trait method.
#![allow(clippy::result_large_err)]

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::Arc;

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{
    ErrorSubject, ErrorVerb, LogId, LogState, OptionalSend, RaftLogReader, StorageIOError, Vote,
};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::types::{NodeId, QueueRaft, StorageError};

type Entry = openraft::Entry<QueueRaft>;

const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("raft_log");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_meta");

const KEY_VOTE: &str = "vote";
const KEY_COMMITTED: &str = "committed";
const KEY_PURGED: &str = "last_purged";

fn io_error(
    subject: ErrorSubject<NodeId>,
    verb: ErrorVerb,
    e: impl std::fmt::Display,
) -> StorageError {
    StorageIOError::new(subject, verb, openraft::AnyError::error(e.to_string())).into()
}

fn read_logs_error(e: impl std::fmt::Display) -> StorageError {
    io_error(ErrorSubject::Logs, ErrorVerb::Read, e)
}

fn write_logs_error(e: impl std::fmt::Display) -> StorageError {
    io_error(ErrorSubject::Logs, ErrorVerb::Write, e)
}

/// One group's log. Cheap to clone: clones share the database (the reader openraft asks for is
/// a clone).
#[derive(Debug, Clone)]
pub struct LogStore {
    db: Arc<Database>,
}

impl LogStore {
    /// Open or create the log at `path`.
    ///
    /// # Errors
    /// When redb cannot open or initialise the file.
    pub fn open(path: &Path) -> Result<Self, redb::Error> {
        let db = Database::create(path)?;
        let tx = db.begin_write()?;
        tx.open_table(LOG)?;
        tx.open_table(META)?;
        tx.commit()?;
        Ok(Self { db: Arc::new(db) })
    }

    fn meta<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, StorageError> {
        let tx = self.db.begin_read().map_err(read_logs_error)?;
        let table = tx.open_table(META).map_err(read_logs_error)?;
        let Some(v) = table.get(key).map_err(read_logs_error)? else {
            return Ok(None);
        };
        serde_json::from_slice(v.value())
            .map(Some)
            .map_err(read_logs_error)
    }

    fn set_meta<T: Serialize>(
        &self,
        key: &str,
        value: &T,
        subject: ErrorSubject<NodeId>,
    ) -> Result<(), StorageError> {
        let err = |e: &dyn std::fmt::Display| io_error(subject.clone(), ErrorVerb::Write, e);
        let bytes = serde_json::to_vec(value).map_err(|e| err(&e))?;
        let tx = self.db.begin_write().map_err(|e| err(&e))?;
        {
            let mut table = tx.open_table(META).map_err(|e| err(&e))?;
            table.insert(key, bytes.as_slice()).map_err(|e| err(&e))?;
        }
        tx.commit().map_err(|e| err(&e))
    }

    /// Delete the entries whose index is in `range`, in one durable transaction.
    fn delete(
        &self,
        range: impl RangeBounds<u64>,
        then: Option<(&str, &[u8])>,
    ) -> Result<(), StorageError> {
        let tx = self.db.begin_write().map_err(write_logs_error)?;
        {
            let mut log = tx.open_table(LOG).map_err(write_logs_error)?;
            // `retain_in` would scan the same range; collecting keys keeps the borrow simple.
            let keys: Vec<u64> = log
                .range((range.start_bound().cloned(), range.end_bound().cloned()))
                .map_err(write_logs_error)?
                .map(|r| r.map(|(k, _)| k.value()))
                .collect::<Result<_, _>>()
                .map_err(write_logs_error)?;
            for k in keys {
                log.remove(k).map_err(write_logs_error)?;
            }
            if let Some((key, value)) = then {
                let mut meta = tx.open_table(META).map_err(write_logs_error)?;
                meta.insert(key, value).map_err(write_logs_error)?;
            }
        }
        tx.commit().map_err(write_logs_error)
    }

    fn last_entry_id(&self) -> Result<Option<LogId<NodeId>>, StorageError> {
        let tx = self.db.begin_read().map_err(read_logs_error)?;
        let log = tx.open_table(LOG).map_err(read_logs_error)?;
        let Some((_, v)) = log.last().map_err(read_logs_error)? else {
            return Ok(None);
        };
        let entry: Entry = crate::codec::decode(v.value()).map_err(read_logs_error)?;
        Ok(Some(entry.log_id))
    }
}

impl RaftLogReader<QueueRaft> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        let tx = self.db.begin_read().map_err(read_logs_error)?;
        let log = tx.open_table(LOG).map_err(read_logs_error)?;
        let bounds: (Bound<u64>, Bound<u64>) =
            (range.start_bound().cloned(), range.end_bound().cloned());
        let mut out = Vec::new();
        for row in log.range(bounds).map_err(read_logs_error)? {
            let (_, v) = row.map_err(read_logs_error)?;
            out.push(crate::codec::decode(v.value()).map_err(read_logs_error)?);
        }
        Ok(out)
    }
}

impl RaftLogStorage<QueueRaft> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<QueueRaft>, StorageError> {
        let last_purged_log_id: Option<LogId<NodeId>> = self.meta(KEY_PURGED)?;
        let last_log_id = self.last_entry_id()?.or(last_purged_log_id);
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        self.set_meta(KEY_VOTE, vote, ErrorSubject::Vote)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        self.meta(KEY_VOTE)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError> {
        self.set_meta(KEY_COMMITTED, &committed, ErrorSubject::Store)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError> {
        Ok(self.meta::<Option<LogId<NodeId>>>(KEY_COMMITTED)?.flatten())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<QueueRaft>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let encoded: Vec<(u64, Vec<u8>)> = entries
            .into_iter()
            .map(|e| crate::codec::encode(&e).map(|b| (e.log_id.index, b)))
            .collect::<Result<_, _>>()
            .map_err(write_logs_error)?;
        // The commit fsyncs: off the async workers, which must keep serving heartbeats.
        let db = Arc::clone(&self.db);
        let result = tokio::task::spawn_blocking(move || -> Result<(), redb::Error> {
            let tx = db.begin_write()?;
            {
                let mut log = tx.open_table(LOG)?;
                for (index, bytes) in &encoded {
                    log.insert(*index, bytes.as_slice())?;
                }
            }
            tx.commit()?;
            Ok(())
        })
        .await
        .map_err(write_logs_error)?;
        match result {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(std::io::Error::other(e.to_string())));
                Err(write_logs_error(e))
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        self.delete(log_id.index.., None)
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        // The purge point and the deletion commit together: a crash in between cannot leave
        // entries below the recorded purge point, nor a gap above it.
        let purged = serde_json::to_vec(&log_id).map_err(write_logs_error)?;
        self.delete(..=log_id.index, Some((KEY_PURGED, &purged)))
    }
}
