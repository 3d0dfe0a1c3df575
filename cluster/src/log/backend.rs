//! Where one group's log is kept, below [`LogStore`](crate::log::store::LogStore): a group's
//! tables in a redb database ([`RedbGroup`]: the node-wide log, or a file of its own), or the
//! group's records in the node's write-ahead log ([`WalGroup`]). The log store above keeps
//! the Raft and body logic (encoding entries, copy-out, the caches) once for both.
//!
//! Both keep the same things: entries by index (encoded), three metadata values (vote,
//! commit index, last purged id: JSON), and bodies copied out of entries by key. A write is a
//! list of [`LogOp`]s made durable together before its callback is told.

use std::fmt::Debug;
use std::ops::{Bound, Range};
use std::sync::Arc;

use bytes::Bytes;
use redb::{ReadableDatabase, ReadableTable};
use warren_store::wal::{MetaSlot, Op, Wal};

use crate::log::node_log::{GroupTables, NodeLog, bodies_table, log_table, meta_table};

/// Why a log could not be opened, read or written.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LogError {
    /// Another handle has the database open (a restarted node's previous instance is still
    /// closing it).
    #[error("the log's database is already open")]
    AlreadyOpen,
    /// The storage failed (its own message).
    #[error("{0}")]
    Storage(String),
}

impl From<redb::Error> for LogError {
    fn from(e: redb::Error) -> Self {
        match e {
            redb::Error::DatabaseAlreadyOpen => Self::AlreadyOpen,
            e => Self::Storage(e.to_string()),
        }
    }
}

impl LogError {
    pub(crate) fn of(e: impl std::fmt::Display) -> Self {
        Self::Storage(e.to_string())
    }
}

/// A metadata value of a group's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetaKey {
    /// The last vote given.
    Vote,
    /// The commit index.
    Committed,
    /// The last purged log id.
    Purged,
}

impl MetaKey {
    /// Its key in a redb meta table.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Vote => "vote",
            Self::Committed => "committed",
            Self::Purged => "last_purged",
        }
    }

    fn slot(self) -> MetaSlot {
        match self {
            Self::Vote => MetaSlot::Vote,
            Self::Committed => MetaSlot::Committed,
            Self::Purged => MetaSlot::Purged,
        }
    }
}

/// One change of a group's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogOp {
    /// Put the encoded entry at `index`.
    Append {
        /// Its index.
        index: u64,
        /// The encoded entry.
        bytes: Bytes,
    },
    /// Set a metadata value.
    Meta {
        /// Which.
        key: MetaKey,
        /// Its new value.
        value: Bytes,
    },
    /// Remove the entries at `from` and after, and the bodies whose key's index is `from` or
    /// after (they were never applied).
    Truncate {
        /// First index removed.
        from: u64,
    },
    /// Remove the entries up to `upto` (inclusive). Bodies stay: they are the copies of live
    /// messages.
    Purge {
        /// Last index removed.
        upto: u64,
    },
    /// Keep a body under `key`.
    PutBody {
        /// Its key (`index << 16 | slot`).
        key: u64,
        /// The message record.
        body: Bytes,
    },
    /// Forget the bodies under these keys.
    DropBodies(Vec<u64>),
}

/// Told whether a write is durable.
pub type WriteDone = Box<dyn FnOnce(Result<(), LogError>) + Send>;

/// The first body key of the entry at `index`.
fn first_key(index: u64) -> u64 {
    index.min(u64::MAX >> 16) << 16
}

/// Where one group's log is kept.
pub trait LogBackend: Send + Sync + Debug {
    /// The encoded entries in `range`, in order.
    ///
    /// # Errors
    /// When the storage cannot read.
    fn entries(&self, range: (Bound<u64>, Bound<u64>)) -> Result<Vec<Bytes>, LogError>;

    /// The encoded entry at `index`.
    ///
    /// # Errors
    /// When the storage cannot read.
    fn entry(&self, index: u64) -> Result<Option<Bytes>, LogError>;

    /// The last encoded entry.
    ///
    /// # Errors
    /// When the storage cannot read.
    fn last_entry(&self) -> Result<Option<Bytes>, LogError>;

    /// A metadata value.
    ///
    /// # Errors
    /// When the storage cannot read.
    fn meta(&self, key: MetaKey) -> Result<Option<Bytes>, LogError>;

    /// The body under `key`.
    ///
    /// # Errors
    /// When the storage cannot read.
    fn body(&self, key: u64) -> Result<Option<Bytes>, LogError>;

    /// Whether a body is kept under `key`.
    ///
    /// # Errors
    /// When the storage cannot read.
    fn has_body(&self, key: u64) -> Result<bool, LogError>;

    /// The keys of the bodies in `range`, ascending.
    ///
    /// # Errors
    /// When the storage cannot read.
    fn body_keys(&self, range: Range<u64>) -> Result<Vec<u64>, LogError>;

    /// Make `ops` durable, in order, then call `done`. With [`LogBackend::readable_at_once`]
    /// their effects are visible to reads when this returns; otherwise once `done` is told.
    fn write(&self, ops: Vec<LogOp>, done: WriteDone);

    /// Make `ops` durable with a later write (or at close) without waiting, nor asking for a
    /// sync of their own where the backend can: for records whose loss in a crash costs only
    /// redone work (the committed index). Visible to reads when this returns with
    /// [`LogBackend::readable_at_once`], otherwise once written.
    ///
    /// # Errors
    /// When the backend refuses them (it has stopped after a failed write).
    fn write_lazy(&self, ops: Vec<LogOp>) -> Result<(), LogError>;

    /// Whether a write is visible to reads as soon as [`LogBackend::write`] returns (so an
    /// append can return before it is durable, as openraft allows).
    fn readable_at_once(&self) -> bool;

    /// Write again the bodies that keep the oldest part of a shared log from being reused
    /// (the WAL's oldest segment), durably; returns how many. A backend whose space is reused
    /// as records go (redb's pages) has none.
    ///
    /// # Errors
    /// When the storage cannot read or write.
    fn rewrite_oldest_bodies(&self) -> Result<usize, LogError> {
        Ok(0)
    }
}

/// A group's three tables in a redb database written by a [`NodeLog`].
#[derive(Debug)]
pub struct RedbGroup {
    log: Arc<NodeLog>,
    tables: Arc<GroupTables>,
}

impl RedbGroup {
    /// The group whose tables are `tables` in `log` (created if missing).
    ///
    /// # Errors
    /// When redb cannot create them.
    pub fn new(log: Arc<NodeLog>, tables: GroupTables) -> Result<Self, redb::Error> {
        log.create(&tables)?;
        Ok(Self {
            log,
            tables: Arc::new(tables),
        })
    }

    fn read<T>(
        &self,
        f: impl FnOnce(&redb::ReadTransaction, &GroupTables) -> Result<T, redb::Error>,
    ) -> Result<T, LogError> {
        let tx = self.log.db().begin_read().map_err(LogError::of)?;
        f(&tx, &self.tables).map_err(LogError::of)
    }
}

fn bytes_of(v: &redb::AccessGuard<'_, &'static [u8]>) -> Bytes {
    Bytes::copy_from_slice(v.value())
}

impl LogBackend for RedbGroup {
    fn entries(&self, range: (Bound<u64>, Bound<u64>)) -> Result<Vec<Bytes>, LogError> {
        self.read(|tx, t| {
            let log = tx.open_table(log_table(t))?;
            log.range(range)?
                .map(|row| row.map(|(_, v)| bytes_of(&v)).map_err(redb::Error::from))
                .collect()
        })
    }

    fn entry(&self, index: u64) -> Result<Option<Bytes>, LogError> {
        self.read(|tx, t| {
            Ok(tx
                .open_table(log_table(t))?
                .get(index)?
                .map(|v| bytes_of(&v)))
        })
    }

    fn last_entry(&self) -> Result<Option<Bytes>, LogError> {
        self.read(|tx, t| {
            Ok(tx
                .open_table(log_table(t))?
                .last()?
                .map(|(_, v)| bytes_of(&v)))
        })
    }

    fn meta(&self, key: MetaKey) -> Result<Option<Bytes>, LogError> {
        self.read(|tx, t| {
            Ok(tx
                .open_table(meta_table(t))?
                .get(key.name())?
                .map(|v| bytes_of(&v)))
        })
    }

    fn body(&self, key: u64) -> Result<Option<Bytes>, LogError> {
        self.read(|tx, t| {
            Ok(tx
                .open_table(bodies_table(t))?
                .get(key)?
                .map(|v| bytes_of(&v)))
        })
    }

    fn has_body(&self, key: u64) -> Result<bool, LogError> {
        self.read(|tx, t| Ok(tx.open_table(bodies_table(t))?.get(key)?.is_some()))
    }

    fn body_keys(&self, range: Range<u64>) -> Result<Vec<u64>, LogError> {
        self.read(|tx, t| {
            tx.open_table(bodies_table(t))?
                .range(range)?
                .map(|row| row.map(|(k, _)| k.value()).map_err(redb::Error::from))
                .collect()
        })
    }

    fn write(&self, ops: Vec<LogOp>, done: WriteDone) {
        let tables = Arc::clone(&self.tables);
        self.log.submit(
            move |tx| {
                let t = &tables;
                for op in ops {
                    match op {
                        LogOp::Append { index, bytes } => {
                            tx.open_table(log_table(t))?.insert(index, &bytes[..])?;
                        }
                        LogOp::Meta { key, value } => {
                            tx.open_table(meta_table(t))?
                                .insert(key.name(), &value[..])?;
                        }
                        LogOp::Truncate { from } => {
                            remove_range(&mut tx.open_table(log_table(t))?, from..)?;
                            remove_range(&mut tx.open_table(bodies_table(t))?, first_key(from)..)?;
                        }
                        LogOp::Purge { upto } => {
                            remove_range(&mut tx.open_table(log_table(t))?, ..=upto)?;
                        }
                        LogOp::PutBody { key, body } => {
                            tx.open_table(bodies_table(t))?.insert(key, &body[..])?;
                        }
                        LogOp::DropBodies(keys) => {
                            let mut table = tx.open_table(bodies_table(t))?;
                            for k in keys {
                                table.remove(k)?;
                            }
                        }
                    }
                }
                Ok(())
            },
            move |r| done(r.map_err(LogError::of)),
        );
    }

    fn write_lazy(&self, ops: Vec<LogOp>) -> Result<(), LogError> {
        // redb commits each batch it is given: the write is not awaited, that is all. Its
        // batch's awaited writes report a failure (a batch fails whole); this one is only
        // logged: a commit index lost costs redone work, not data.
        self.write(
            ops,
            Box::new(|r| {
                if let Err(e) = r {
                    tracing::warn!(error = %e, "a lazy log write failed");
                }
            }),
        );
        Ok(())
    }

    fn readable_at_once(&self) -> bool {
        false
    }
}

/// Remove the rows of `table` whose keys are in `range`.
fn remove_range(
    table: &mut redb::Table<'_, u64, &[u8]>,
    range: impl std::ops::RangeBounds<u64>,
) -> Result<(), redb::Error> {
    // `retain_in` would scan the same range; collecting keys keeps the borrow simple.
    let keys: Vec<u64> = table
        .range(range)?
        .map(|r| r.map(|(k, _)| k.value()))
        .collect::<Result<_, _>>()?;
    for k in keys {
        table.remove(k)?;
    }
    Ok(())
}

/// A group's records in the node's write-ahead log.
#[derive(Debug)]
pub struct WalGroup {
    wal: Arc<Wal>,
    group: u64,
}

impl WalGroup {
    /// Group `group` of `wal`.
    #[must_use]
    pub fn new(wal: Arc<Wal>, group: u64) -> Self {
        Self { wal, group }
    }

    /// `ops` as the WAL's records.
    fn wal_ops(&self, ops: Vec<LogOp>) -> Vec<Op> {
        let mut wal_ops = Vec::with_capacity(ops.len());
        // An append over existing entries replaces them and what follows (as redb's insert
        // does): the WAL takes only the next index, so the rest is truncated first.
        let mut next = self.wal.next_index(self.group);
        for op in ops {
            match op {
                LogOp::Append { index, bytes } => {
                    if next.is_some_and(|n| index < n) {
                        wal_ops.push(Op::Truncate { from: index });
                    }
                    next = Some(index + 1);
                    wal_ops.push(Op::Append { index, data: bytes });
                }
                LogOp::Meta { key, value } => wal_ops.push(Op::Meta {
                    slot: key.slot(),
                    value,
                }),
                LogOp::Truncate { from } => {
                    next = next.map(|n| n.min(from));
                    wal_ops.push(Op::Truncate { from });
                    let keys = self.wal.body_keys(self.group, first_key(from)..);
                    if !keys.is_empty() {
                        wal_ops.push(Op::DropBodies { keys });
                    }
                }
                LogOp::Purge { upto } => {
                    next = next.map(|n| n.max(upto + 1));
                    wal_ops.push(Op::Purge { upto });
                }
                LogOp::PutBody { key, body } => wal_ops.push(Op::Body { key, data: body }),
                LogOp::DropBodies(keys) => wal_ops.push(Op::DropBodies { keys }),
            }
        }
        wal_ops
    }
}

impl LogBackend for WalGroup {
    fn entries(&self, range: (Bound<u64>, Bound<u64>)) -> Result<Vec<Bytes>, LogError> {
        Ok(self
            .wal
            .entries(self.group, range)
            .map_err(LogError::of)?
            .into_iter()
            .map(|(_, data)| data)
            .collect())
    }

    fn entry(&self, index: u64) -> Result<Option<Bytes>, LogError> {
        self.wal.entry(self.group, index).map_err(LogError::of)
    }

    fn last_entry(&self) -> Result<Option<Bytes>, LogError> {
        match self.wal.last_index(self.group) {
            Some(last) => self.entry(last),
            None => Ok(None),
        }
    }

    fn meta(&self, key: MetaKey) -> Result<Option<Bytes>, LogError> {
        Ok(self.wal.meta(self.group, key.slot()))
    }

    fn body(&self, key: u64) -> Result<Option<Bytes>, LogError> {
        self.wal.body(self.group, key).map_err(LogError::of)
    }

    fn has_body(&self, key: u64) -> Result<bool, LogError> {
        Ok(self.wal.has_body(self.group, key))
    }

    fn body_keys(&self, range: Range<u64>) -> Result<Vec<u64>, LogError> {
        Ok(self.wal.body_keys(self.group, range))
    }

    fn write(&self, ops: Vec<LogOp>, done: WriteDone) {
        let wal_ops = self.wal_ops(ops);
        self.wal.write(
            self.group,
            &wal_ops,
            Box::new(move |r| done(r.map_err(LogError::of))),
        );
    }

    fn write_lazy(&self, ops: Vec<LogOp>) -> Result<(), LogError> {
        let wal_ops = self.wal_ops(ops);
        self.wal
            .write_lazy(self.group, &wal_ops)
            .map_err(LogError::of)
    }

    fn readable_at_once(&self) -> bool {
        true
    }

    fn rewrite_oldest_bodies(&self) -> Result<usize, LogError> {
        match self.wal.oldest_segment() {
            Some(oldest) => self
                .wal
                .rewrite_bodies(self.group, oldest)
                .map_err(LogError::of),
            None => Ok(0),
        }
    }
}
