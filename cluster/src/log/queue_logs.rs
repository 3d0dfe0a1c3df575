//! Where a node keeps its quorum queues' Raft logs: the node-wide redb log
//! (`queues/raft-log.redb`, the default until the WAL's import lands) or the node's
//! write-ahead log (`queues/wal/`), chosen by `--quorum-log` ([`QueueLogKind`]). Both hold
//! every group of the node in one file set written by one thread (group commit).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use warren_store::wal::{Op, WAL_SEGMENT_BYTES_MAX, WAL_SEGMENT_BYTES_MIN, Wal, WalOptions};

use crate::log::backend::LogError;
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
    #[default]
    Redb,
    /// The node's segmented write-ahead log.
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
                let path = dir.join("raft-log.redb");
                NodeLog::open(&path, NODE_LOG_CACHE_BYTES)
                    .map(Self::Redb)
                    .map_err(|e| (path, e.into()))
            }
            QueueLogKind::Wal => {
                let path = dir.join("wal");
                let mut options = WalOptions::default();
                if let Some(bytes) = std::env::var(WAL_SEGMENT_BYTES_ENV)
                    .ok()
                    .and_then(|v| v.parse::<u64>().ok())
                {
                    options.segment_bytes =
                        bytes.clamp(WAL_SEGMENT_BYTES_MIN, WAL_SEGMENT_BYTES_MAX);
                }
                Wal::open(&path, options)
                    .map(|w| Self::Wal(Arc::new(w)))
                    .map_err(|e| (path, LogError::of(e)))
            }
        }
    }

    /// The log of group `incarnation`. In redb, a log of the layout before the node-wide log
    /// (a file of its own at `old`) is imported first.
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
            Self::Wal(wal) => LogStore::in_wal(wal, incarnation),
        }
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
