//! Where a node keeps its quorum queues' and streams' Raft logs: the node's write-ahead log
//! (`queues/wal/`, the default) or the node-wide redb log (`queues/raft-log.redb`), chosen
//! by `--quorum-log` ([`QueueLogKind`]). Both hold every quorum queue group of the node in
//! one file set written by one thread (group commit); the WAL holds the streams' groups too,
//! where redb leaves each stream a file of its own.
//!
//! A node starting on the WAL with logs in redb imports them first ([`crate::log::import`]):
//! the node-wide file at open, a queue's or a stream's own file when its group opens.
//! The other way is refused: a node whose WAL holds groups does not start on redb, which
//! would start those queues with empty logs (their votes forgotten).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use warren_store::wal::{Op, WAL_SEGMENT_BYTES_MAX, WAL_SEGMENT_BYTES_MIN, Wal, WalOptions};

use crate::log::backend::LogError;
use crate::log::import;
use crate::log::node_log::{GroupTables, NODE_LOG_CACHE_BYTES, NodeLog};
use crate::log::store::LogStore;

/// Segments the WAL may hold before the groups pinning its oldest are compacted ahead of
/// their schedule ([`QueueLogs::pinning_groups`]): with 64 MiB segments, 256 MiB of log
/// before one idle queue's old entries are copied out of the way.
pub const WAL_SEGMENTS_SOFT_MAX: usize = 4;

/// Environment variable overriding the WAL's segment size (`WAL_SEGMENT_BYTES`, within its
/// bounds): tests make it small so that segments roll and are freed after a few writes.
pub const WAL_SEGMENT_BYTES_ENV: &str = "WARREN_WAL_SEGMENT_BYTES";

/// Which log a node's quorum queues use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueLogKind {
    /// The node-wide redb database.
    Redb,
    /// The node's segmented write-ahead log.
    #[default]
    Wal,
}

impl std::str::FromStr for QueueLogKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "redb" => Ok(Self::Redb),
            "wal" => Ok(Self::Wal),
            other => Err(format!(
                "quorum log {other:?}: expected \"redb\" or \"wal\""
            )),
        }
    }
}

/// The node-wide redb log's file in the node's `queues/` directory.
pub const NODE_LOG_FILE: &str = "raft-log.redb";

/// Open the WAL at `path`, its segment size from [`WAL_SEGMENT_BYTES_ENV`] if set.
fn open_wal(path: &Path) -> Result<Arc<Wal>, LogError> {
    let mut options = WalOptions::default();
    if let Some(bytes) = std::env::var(WAL_SEGMENT_BYTES_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        options.segment_bytes = bytes.clamp(WAL_SEGMENT_BYTES_MIN, WAL_SEGMENT_BYTES_MAX);
    }
    Wal::open(path, options).map(Arc::new).map_err(LogError::of)
}

/// Whether a WAL at `path` holds any group (opened only if the directory has files).
fn wal_has_groups(path: &Path) -> Result<bool, LogError> {
    let has_files = match std::fs::read_dir(path) {
        Ok(mut files) => files.next().is_some(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => return Err(LogError::of(e)),
    };
    if !has_files {
        return Ok(false);
    }
    Ok(!open_wal(path)?.groups().is_empty())
}

/// The open log of a node's quorum queues.
#[derive(Debug)]
pub enum QueueLogs {
    /// Every group's tables in one redb database.
    Redb(Arc<NodeLog>),
    /// Every group's records in one write-ahead log.
    Wal(Arc<Wal>),
}

impl QueueLogs {
    /// Open the log of `kind` under `dir` (the node's `queues/` directory).
    ///
    /// # Errors
    /// When the database or the WAL cannot be opened.
    pub fn open(kind: QueueLogKind, dir: &Path) -> Result<Self, (PathBuf, LogError)> {
        match kind {
            QueueLogKind::Redb => {
                let wal = dir.join("wal");
                if wal_has_groups(&wal).map_err(|e| (wal.clone(), e))? {
                    return Err((
                        wal,
                        LogError::Storage(
                            "this node's quorum queue logs are in the write-ahead log; \
                             --quorum-log redb cannot read them (start with --quorum-log wal)"
                                .into(),
                        ),
                    ));
                }
                let path = dir.join(NODE_LOG_FILE);
                NodeLog::open(&path, NODE_LOG_CACHE_BYTES)
                    .map(Self::Redb)
                    .map_err(|e| (path, e.into()))
            }
            QueueLogKind::Wal => {
                let path = dir.join("wal");
                let wal = open_wal(&path).map_err(|e| (path, e))?;
                let old = dir.join(NODE_LOG_FILE);
                let started = std::time::Instant::now();
                match import::node_log_into_wal(&old, &wal) {
                    Ok(None) => {}
                    Ok(Some(i)) => tracing::info!(
                        groups = i.groups,
                        entries = i.entries,
                        bodies = i.bodies,
                        bytes = i.bytes,
                        ms = started.elapsed().as_millis() as u64,
                        "imported the quorum queues' redb log into the write-ahead log"
                    ),
                    Err(e) => return Err((old, e)),
                }
                Ok(Self::Wal(wal))
            }
        }
    }

    /// The log of group `incarnation`. A log of the layout before the node-wide log (a file
    /// of its own at `old`) is imported first, into either log.
    ///
    /// # Errors
    /// When the import or the opening fails.
    pub fn group(&self, incarnation: u64, old: &Path, queue: &str) -> Result<LogStore, LogError> {
        match self {
            Self::Redb(log) => {
                let tables = GroupTables::of_group(incarnation);
                if log.import(old, &tables)? {
                    tracing::info!(%queue, "imported the queue's log into the node's");
                }
                LogStore::in_node_log(log, incarnation)
            }
            Self::Wal(wal) => {
                if import::queue_file_into_wal(old, wal, incarnation)? {
                    tracing::info!(%queue, "imported the queue's log into the write-ahead log");
                }
                LogStore::in_wal(wal, incarnation)
            }
        }
    }

    /// The log of stream group `incarnation`: a group of the WAL, its entries kept whole
    /// (a stream's own file at `old`, the layout before, imported first); on redb the
    /// stream's own file at `old`, as before the WAL (a stream's entries are large and read
    /// back by replication: a file of its own keeps them out of the node-wide log's cache).
    ///
    /// # Errors
    /// When the import or the opening fails.
    pub fn stream(&self, incarnation: u64, old: &Path, stream: &str) -> Result<LogStore, LogError> {
        match self {
            Self::Redb(_) => LogStore::open(old),
            Self::Wal(wal) => {
                if import::queue_file_into_wal(old, wal, incarnation)? {
                    tracing::info!(%stream, "imported the stream's log into the write-ahead log");
                }
                LogStore::stream_in_wal(wal, incarnation)
            }
        }
    }

    /// Whether streams' logs are groups of this log ([`QueueLogs::stream`]), dropped with
    /// [`QueueLogs::drop_group`] rather than removed as files.
    #[must_use]
    pub fn holds_streams(&self) -> bool {
        matches!(self, Self::Wal(_))
    }

    /// The groups (by incarnation) to compact now: those pinning the oldest segment of a WAL
    /// that holds more than [`WAL_SEGMENTS_SOFT_MAX`] (none for redb, whose pages are reused
    /// as groups purge).
    #[must_use]
    pub fn pinning_groups(&self) -> Vec<u64> {
        match self {
            Self::Redb(_) => Vec::new(),
            Self::Wal(wal) => {
                if wal.stats().segments <= WAL_SEGMENTS_SOFT_MAX {
                    return Vec::new();
                }
                wal.pinning().map(|(_, groups)| groups).unwrap_or_default()
            }
        }
    }

    /// The WAL's segments now (None: the log is redb).
    #[must_use]
    pub fn wal_segments(&self) -> Option<usize> {
        match self {
            Self::Redb(_) => None,
            Self::Wal(wal) => Some(wal.stats().segments),
        }
    }

    /// Forget group `incarnation`'s log (a deleted queue's). Blocks until durable.
    ///
    /// # Errors
    /// When the storage cannot write.
    pub fn drop_group(&self, incarnation: u64) -> Result<(), LogError> {
        match self {
            Self::Redb(log) => Ok(log.drop_group(&GroupTables::of_group(incarnation))?),
            Self::Wal(wal) => wal
                .write_and_wait(incarnation, &[Op::Forget])
                .map_err(LogError::of),
        }
    }
}

#[cfg(test)]
mod tests {
    use openraft::RaftLogReader;
    use openraft::Vote;
    use openraft::storage::RaftLogStorage;

    use super::*;
    use crate::log::store::tests::{bodies_of, enqueue, entry, record};

    /// A node moving from redb to the WAL keeps its groups; moving back is refused rather
    /// than starting its queues on empty logs.
    #[test]
    fn redb_logs_move_to_the_wal_and_not_back() {
        let dir = tempfile::tempdir().unwrap();
        {
            let QueueLogs::Redb(log) = QueueLogs::open(QueueLogKind::Redb, dir.path()).unwrap()
            else {
                panic!("asked for redb");
            };
            let store = LogStore::in_node_log(&log, 9).unwrap();
            drop(store);
            let tables = GroupTables::of_group(9);
            let t = tables.clone();
            log.write(move |tx| {
                tx.open_table(crate::log::node_log::meta_table(&t))?
                    .insert("vote", &b"v"[..])?;
                Ok(())
            })
            .unwrap();
        }
        assert_eq!(QueueLogKind::default(), QueueLogKind::Wal);
        let logs = QueueLogs::open(QueueLogKind::Wal, dir.path()).unwrap();
        assert!(!dir.path().join(NODE_LOG_FILE).exists());
        let QueueLogs::Wal(wal) = &logs else {
            panic!("asked for the WAL");
        };
        assert_eq!(wal.groups(), vec![9]);
        assert_eq!(
            wal.meta(9, warren_store::wal::MetaSlot::Vote).as_deref(),
            Some(&b"v"[..])
        );
        drop(logs);
        let (path, e) = QueueLogs::open(QueueLogKind::Redb, dir.path()).unwrap_err();
        assert_eq!(path, dir.path().join("wal"));
        assert!(
            e.to_string().contains("--quorum-log redb cannot read them"),
            "{e}"
        );
    }

    /// A stream's own log file (the layout before streams joined the write-ahead log) comes
    /// over as its group once, vote and entries whole, and the file is gone; on redb a
    /// stream keeps its own file.
    #[tokio::test]
    async fn a_streams_own_file_comes_over_into_the_wal_whole() {
        let dir = tempfile::tempdir().unwrap();
        let old = dir.path().join("0000000000000007.redb");
        let vote = Vote::new(3, 2);
        {
            let logs = QueueLogs::open(QueueLogKind::Redb, dir.path()).unwrap();
            assert!(!logs.holds_streams());
            let mut store = logs.stream(7, &old, "s").unwrap();
            store
                .append_now(vec![
                    entry(1, vec![enqueue("one")]),
                    entry(2, vec![enqueue("two"), enqueue("three")]),
                ])
                .unwrap();
            store.save_vote(&vote).await.unwrap();
        }
        assert!(old.exists(), "on redb a stream's log is a file of its own");
        let logs = QueueLogs::open(QueueLogKind::Wal, dir.path()).unwrap();
        assert!(logs.holds_streams());
        let mut store = logs.stream(7, &old, "s").unwrap();
        assert!(!old.exists(), "the imported file is removed");
        assert_eq!(store.read_vote().await.unwrap(), Some(vote));
        let got = store.try_get_log_entries(1..3).await.unwrap();
        assert_eq!(bodies_of(&got[0]), vec![Some(record("one"))]);
        assert_eq!(
            bodies_of(&got[1]),
            vec![Some(record("two")), Some(record("three"))]
        );
        store
            .append_now(vec![entry(3, vec![enqueue("four")])])
            .unwrap();
        drop(store);
        drop(logs);
        // Read back from the WAL's files alone (no file to import any more).
        let logs = QueueLogs::open(QueueLogKind::Wal, dir.path()).unwrap();
        let mut store = logs.stream(7, &old, "s").unwrap();
        let got = store.try_get_log_entries(1..4).await.unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(bodies_of(&got[2]), vec![Some(record("four"))]);
        logs.drop_group(7).unwrap();
        let QueueLogs::Wal(wal) = &logs else {
            panic!("asked for the WAL");
        };
        assert!(
            wal.groups().is_empty(),
            "a deleted stream's group is dropped"
        );
    }
}
