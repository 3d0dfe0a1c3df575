//! The Raft log of one group in redb: entries by index, and the vote, the commit index and the
//! last purged id as metadata. Every write is a job of the database's writer
//! ([`NodeLog`]), committed with redb's `Durability::Immediate` (fsync) before openraft is
//! told it is done, so an entry counted towards a majority is on disk, and a vote given is
//! never forgotten across a crash.
//!
//! The quorum queues of a node share one database ([`LogStore::in_node_log`]): a group is
//! three tables in it, and the writer commits the writes of every group that has some ready in
//! one transaction (one fsync). The metadata's log has a database of its own
//! ([`LogStore::open`]), as a stream's has when the node's queue logs are in redb; on the
//! write-ahead log (the default) a stream's log is a group of it too
//! ([`LogStore::stream_in_wal`]).
//!
//! Entries are stored in the binary [`codec`](crate::codec), one redb value each; the small
//! metadata values are JSON.
//!
//! A quorum queue's log ([`LogStore::open_queue`]) is also where its message bodies are:
//! replicas hold messages by key, not by body
//! ([`warren_broker::message::Entry::Logged`]): the entry's index and the command's place in
//! it ([`body_key`]). A body is read from its entry when it is delivered, so:
//! - memory holds per-message metadata only, whatever the backlog;
//! - an append is one redb value per entry, bodies inside (no write per message), and a
//!   message settled before its entry is purged costs no write at all;
//! - before entries are purged (after a snapshot), the bodies of the live messages they hold
//!   are copied into the `raft_bodies` table ([`LogStore::copy_out`]), each under its key; a
//!   copied body is deleted once its message leaves the queue (with the log's next write), so
//!   a few old unacked messages keep their own bodies and nothing else.
//!
//! Logs written by the version that split every body out when appended (a 5-byte stub in the
//! entry: tag 0xFE, body size u32) are still read: a stub's body is in `raft_bodies`, and the
//! reader openraft replicates from ([`LogStore::get_log_reader`]) puts it back.
//!
//! Byte layout of a `raft_bodies` key: `index << 16 | slot` (u64, big-endian order is index
//! order); value: the message record ([`warren_broker::message::codec::encode_message`]).

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
use serde::Serialize;
use serde::de::DeserializeOwned;

use warren_broker::queue::machine::Command;

use warren_store::wal::Wal;

use crate::log::backend::{LogBackend, LogError, LogOp, MetaKey, RedbGroup, WalGroup};
use crate::log::node_log::{GroupTables, NodeLog};
use crate::log::recent_entries::RecentEntries;
use crate::types::{NodeId, QueueRaft, StorageError};

type Entry = openraft::Entry<QueueRaft>;

/// redb's page cache of a quorum queue's log in a file of its own ([`LogStore::open_queue`]:
/// tests, tools). The queues of a node share the node-wide log's cache instead
/// ([`crate::log::node_log::NODE_LOG_CACHE_BYTES`]).
pub const LOG_CACHE_BYTES: usize = 2 * 1024 * 1024;

/// redb's page cache for the other logs (a replicated stream's, the metadata's): redb's own
/// default, as before issue 22. A stream's consumers read its entries back from the log, and
/// with smaller caches those reads go to the file: three consumers from `first` fell from
/// 49.6k to 30.8k msg/s (2 MiB) and 32.8k (64 MiB), CPU per message from 23 to 34-43 µs
/// (docs/benchmarks.md). So a busy stream may hold up to this much of its log in RAM, until
/// streams serve reads from their own segments (issue 23).
pub const STREAM_LOG_CACHE_BYTES: usize = 1024 * 1024 * 1024;

/// Bytes of the most recently appended bodies a queue's log keeps in memory as well, so a
/// consumer that keeps up is served without reading them back (oldest dropped first).
pub const RECENT_BODY_BYTES: usize = 2 * 1024 * 1024;

/// Bytes of bodies one copy-out transaction writes at most ([`LogStore::copy_out`] commits as
/// many as it needs): redb keeps a transaction's dirty pages in memory until it commits.
pub const COPY_OUT_TXN_BYTES: usize = 4 * 1024 * 1024;

/// The most recently appended bodies ([`RECENT_BODY_BYTES`] at most), by key.
#[derive(Debug, Default)]
struct Recent {
    bodies: std::collections::BTreeMap<u64, bytes::Bytes>,
    bytes: usize,
}

impl Recent {
    fn insert(&mut self, key: u64, body: bytes::Bytes) {
        self.bytes += body.len();
        if let Some(old) = self.bodies.insert(key, body) {
            self.bytes -= old.len();
        }
        while self.bytes > RECENT_BODY_BYTES {
            let Some((_, b)) = self.bodies.pop_first() else {
                break;
            };
            self.bytes -= b.len();
        }
    }

    fn remove(&mut self, key: u64) {
        if let Some(b) = self.bodies.remove(&key) {
            self.bytes -= b.len();
        }
    }

    fn remove_from(&mut self, key: u64) {
        for (_, b) in self.bodies.split_off(&key) {
            self.bytes -= b.len();
        }
    }
}

/// Commands of one entry whose messages can be held by key (a key has 16 bits for the slot);
/// the proposer's entries are far smaller. Messages of commands beyond are decoded whole.
pub const SLOTS_PER_ENTRY: usize = 1 << 16;

/// First byte of a split-out body's stub in an entry (logs of the previous version). A message
/// record starts with its length, big-endian: its first byte would be 0xFE only for a record
/// of almost 4 GiB.
const STUB_TAG: u8 = 0xFE;
/// Bytes of a stub: the tag and the body size (u32, big-endian).
const STUB_LEN: usize = 5;

/// The key of the body of command `slot` of the entry at `index`.
#[must_use]
pub fn body_key(index: u64, slot: usize) -> u64 {
    (index << 16) | (slot as u64 & 0xFFFF)
}

/// The log index a [`body_key`] belongs to.
#[must_use]
pub fn key_index(key: u64) -> u64 {
    key >> 16
}

/// The body size a stub gives, or None for a full message record.
#[must_use]
pub fn stub_size(body: &[u8]) -> Option<u32> {
    if body.len() != STUB_LEN || body[0] != STUB_TAG {
        return None;
    }
    Some(u32::from_be_bytes([body[1], body[2], body[3], body[4]]))
}

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

/// One group's log. Cheap to clone: clones share the storage (the reader openraft asks for is
/// a clone).
#[derive(Debug, Clone)]
pub struct LogStore {
    backend: Arc<dyn LogBackend>,
    /// A quorum queue's log: bodies are read by key and copied out before a purge.
    queue: bool,
    /// Reads put split-out bodies back (the reader openraft replicates from).
    inflate: bool,
    /// Released bodies and how far bodies were copied out.
    copies: Arc<std::sync::Mutex<Copies>>,
    /// The last bodies appended, also in memory.
    recent: Arc<std::sync::Mutex<Recent>>,
    /// The entry a body was last read from, decoded (a drain reads an entry's messages in turn).
    last_read: Arc<std::sync::Mutex<Option<Arc<Entry>>>>,
    /// The entries appended last, encoded, until applied: what replication and the apply
    /// read right after an append.
    entries: Arc<std::sync::Mutex<RecentEntries>>,
}

/// What [`LogStore::release`] and [`LogStore::copy_out`] share.
///
/// Invariant: every live message's body is in its entry (index above `copied_upto`, entry
/// not purged) or kept as a body (copied, or brought by a snapshot).
#[derive(Debug, Default)]
struct Copies {
    /// Entries up to here had their live bodies copied out (or were purged).
    copied_upto: u64,
    /// Released keys up to `copied_upto`: their copies are deleted with the next write.
    pending: Vec<u64>,
    /// Released keys above `copied_upto`: in their entries only, unless a copy-out running
    /// now copies them (it then moves them to `pending`).
    above: Vec<u64>,
}

impl LogStore {
    /// Open or create the log at `path`, entries kept whole.
    ///
    /// # Errors
    /// When redb cannot open or initialise the file.
    pub fn open(path: &Path) -> Result<Self, LogError> {
        let log = NodeLog::open(path, STREAM_LOG_CACHE_BYTES)?;
        Self::over(Arc::new(RedbGroup::new(log, GroupTables::single())?), false)
    }

    /// Open or create a quorum queue's log at `path`: its bodies read by key and copied out
    /// before a purge (see the module's documentation).
    ///
    /// # Errors
    /// When redb cannot open or initialise the file.
    pub fn open_queue(path: &Path) -> Result<Self, LogError> {
        let log = NodeLog::open(path, LOG_CACHE_BYTES)?;
        Self::over(Arc::new(RedbGroup::new(log, GroupTables::single())?), true)
    }

    /// Open or create the log of quorum queue group `group` in the node-wide log `log`, its
    /// bodies read by key and copied out before a purge.
    ///
    /// # Errors
    /// When redb cannot create its tables or read its metadata.
    pub fn in_node_log(log: &Arc<NodeLog>, group: u64) -> Result<Self, LogError> {
        let backend = RedbGroup::new(Arc::clone(log), GroupTables::of_group(group))?;
        Self::over(Arc::new(backend), true)
    }

    /// The log of quorum queue group `group` in the node's write-ahead log `wal`, its bodies
    /// read by key and copied out before a purge.
    ///
    /// # Errors
    /// When its metadata does not decode.
    pub fn in_wal(wal: &Arc<Wal>, group: u64) -> Result<Self, LogError> {
        Self::over(Arc::new(WalGroup::new(Arc::clone(wal), group)), true)
    }

    /// The log of stream group `group` in the node's write-ahead log `wal`, entries kept
    /// whole (a stream's messages are read from its own files, not from its log).
    ///
    /// # Errors
    /// When its metadata does not decode.
    pub fn stream_in_wal(wal: &Arc<Wal>, group: u64) -> Result<Self, LogError> {
        Self::over(Arc::new(WalGroup::new(Arc::clone(wal), group)), false)
    }

    /// A log over `backend`: a quorum queue's (`queue`) or another.
    ///
    /// # Errors
    /// When the backend cannot read the purge point or it does not decode.
    pub fn over(backend: Arc<dyn LogBackend>, queue: bool) -> Result<Self, LogError> {
        let purged: Option<LogId<NodeId>> = match backend.meta(MetaKey::Purged)? {
            Some(v) => serde_json::from_slice(&v).map_err(|e| LogError::Storage(e.to_string()))?,
            None => None,
        };
        Ok(Self {
            backend,
            queue,
            inflate: false,
            copies: Arc::new(std::sync::Mutex::new(Copies {
                copied_upto: purged.map_or(0, |p| p.index),
                ..Copies::default()
            })),
            recent: Arc::default(),
            last_read: Arc::default(),
            entries: Arc::default(),
        })
    }

    fn copies(&self) -> std::sync::MutexGuard<'_, Copies> {
        self.copies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Make `ops` durable, blocking this thread until they are.
    fn write_now(&self, ops: Vec<LogOp>) -> Result<(), LogError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.backend.write(
            ops,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx.recv()
            .unwrap_or_else(|_| Err(LogError::Storage("the log's writer dropped a write".into())))
    }

    /// Make `ops` durable, awaiting it without blocking a worker.
    async fn write_async(&self, ops: Vec<LogOp>) -> Result<(), LogError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.backend.write(
            ops,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx.await
            .unwrap_or_else(|_| Err(LogError::Storage("the log's writer dropped a write".into())))
    }

    /// The body stored under `key` (None: released, or never here).
    ///
    /// # Errors
    /// When the storage cannot read it.
    pub fn read_body(&self, key: u64) -> Result<Option<Vec<u8>>, LogError> {
        self.with_body(key, <[u8]>::to_vec)
    }

    /// `f` of the body stored under `key` (None: released, or never here), without copying
    /// it out first: from memory (recently appended), its entry, or its copy.
    ///
    /// # Errors
    /// When the storage cannot read it or its entry does not decode.
    pub fn with_body<T>(
        &self,
        key: u64,
        f: impl FnOnce(&[u8]) -> T,
    ) -> Result<Option<T>, LogError> {
        if let Some(b) = self.recent().bodies.get(&key).cloned() {
            return Ok(Some(f(&b)));
        }
        let index = key_index(key);
        if index > self.copies().copied_upto
            && let Some(entry) = self.entry_at(index)?
            && let Some(record) = record_in(&entry, key)
        {
            return Ok(Some(f(record)));
        }
        // Copied out (or a stub's, or a snapshot's).
        Ok(self.backend.body(key)?.map(|b| f(&b)))
    }

    /// The entry at `index`, decoded (the last one read is kept).
    fn entry_at(&self, index: u64) -> Result<Option<Arc<Entry>>, LogError> {
        let mut last = self
            .last_read
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(e) = last.as_ref()
            && e.log_id.index == index
        {
            return Ok(Some(Arc::clone(e)));
        }
        let Some(v) = self.backend.entry(index)? else {
            return Ok(None);
        };
        let entry: Entry = crate::codec::decode(&v)
            .map_err(|e| LogError::Storage(format!("log entry {index}: {e}")))?;
        let entry = Arc::new(entry);
        *last = Some(Arc::clone(&entry));
        Ok(Some(entry))
    }

    /// Forget the decoded entry if it is at `from` or after (truncated) or up to `upto`
    /// (purged).
    fn forget_read(&self, gone: impl Fn(u64) -> bool) {
        let mut last = self
            .last_read
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.as_ref().is_some_and(|e| gone(e.log_id.index)) {
            *last = None;
        }
    }

    /// The messages under `keys` left the queue on this replica: bodies copied out are
    /// deleted with the next write (an append, or [`LogStore::flush_released`]); the others
    /// go with their entries.
    pub fn release(&self, keys: impl IntoIterator<Item = u64>) {
        let mut copies = self.copies();
        let mut recent = self.recent();
        for k in keys {
            recent.remove(k);
            if key_index(k) <= copies.copied_upto {
                copies.pending.push(k);
            } else {
                copies.above.push(k);
            }
        }
    }

    fn recent_entries(&self) -> std::sync::MutexGuard<'_, RecentEntries> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn recent(&self) -> std::sync::MutexGuard<'_, Recent> {
        self.recent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether released bodies wait to be deleted ([`Self::flush_released`] would write).
    #[must_use]
    pub fn has_released(&self) -> bool {
        !self.copies().pending.is_empty()
    }

    fn take_released(&self) -> Vec<u64> {
        std::mem::take(&mut self.copies().pending)
    }

    /// Entries up to `upto` now have their live bodies elsewhere (copied, or brought by a
    /// snapshot): releases of keys up to there are deletions from now on, and those released
    /// from `from` on in `above` (during a copy) may have been copied, so they are too.
    fn copied(&self, upto: u64, from: usize) {
        let mut copies = self.copies();
        if upto <= copies.copied_upto {
            return;
        }
        let Copies { pending, above, .. } = &mut *copies;
        let late = above.get(from..).unwrap_or_default();
        pending.extend(late.iter().copied().filter(|&k| key_index(k) <= upto));
        above.retain(|&k| key_index(k) > upto);
        copies.copied_upto = upto;
    }

    /// Copy the bodies of `live` (sorted keys of the messages the queue holds) whose entries
    /// are at `upto` or before out of those entries, so the entries can be purged. Run before
    /// every purge of a queue's log; returns how many were copied.
    ///
    /// # Errors
    /// When the storage cannot read or write; nothing is marked copied then.
    pub fn copy_out(&self, live: &[u64], upto: u64) -> Result<usize, LogError> {
        let (released, from) = {
            let copies = self.copies();
            if upto <= copies.copied_upto {
                return Ok(0);
            }
            let mut released: Vec<u64> = copies.above.clone();
            released.sort_unstable();
            (released, copies.above.len())
        };
        let mut copied = 0;
        let mut keys = live
            .iter()
            .copied()
            .filter(|&k| key_index(k) <= upto)
            .peekable();
        while keys.peek().is_some() {
            // Batches of at most COPY_OUT_TXN_BYTES: a write is held in memory until it is
            // durable, and a backlog can be gigabytes. Entries up to `upto` are committed, so
            // nothing truncates them meanwhile.
            let mut batch: Vec<LogOp> = Vec::new();
            let mut bytes = 0;
            let mut current: Option<(u64, Entry)> = None;
            while bytes < COPY_OUT_TXN_BYTES {
                let Some(key) = keys.next() else { break };
                if released.binary_search(&key).is_ok() || self.backend.has_body(key)? {
                    continue;
                }
                let index = key_index(key);
                if current.as_ref().is_none_or(|(i, _)| *i != index) {
                    let Some(v) = self.backend.entry(index)? else {
                        tracing::warn!(key, "a live message's entry and copy are both gone");
                        continue;
                    };
                    let entry = crate::codec::decode(&v)
                        .map_err(|e| LogError::Storage(format!("log entry {index}: {e}")))?;
                    current = Some((index, entry));
                }
                let Some((_, entry)) = &current else { continue };
                if let Some(record) = record_in(entry, key) {
                    bytes += record.len();
                    batch.push(LogOp::PutBody {
                        key,
                        body: bytes::Bytes::copy_from_slice(record),
                    });
                }
            }
            copied += batch.len();
            if !batch.is_empty() {
                self.write_now(batch)?;
            }
        }
        self.copied(upto, from);
        Ok(copied)
    }

    /// Delete the bodies released since the last write (when no append came to do it).
    ///
    /// # Errors
    /// When the storage cannot write.
    pub fn flush_released(&self) -> Result<(), LogError> {
        let keys = self.take_released();
        if keys.is_empty() {
            return Ok(());
        }
        self.write_now(vec![LogOp::DropBodies(keys)])
    }

    /// Write again the copied-out bodies that hold the oldest segment of the node's WAL (a
    /// message kept long after its entry was purged pins the segment its copy went to, and
    /// every newer one with it). Blocks until durable; returns how many.
    ///
    /// # Errors
    /// When the storage cannot read or write.
    pub fn rewrite_oldest_bodies(&self) -> Result<usize, LogError> {
        self.backend.rewrite_oldest_bodies()
    }

    /// Store bodies a snapshot whose last entry is `upto` brought (a member that was behind
    /// the purged log; its entries up to `upto` are purged after it is installed).
    ///
    /// # Errors
    /// When the storage cannot write.
    pub fn insert_bodies(&self, bodies: Vec<(u64, Vec<u8>)>, upto: u64) -> Result<(), LogError> {
        // Every key released before: a snapshot's messages are live after its releases, so
        // none of them is among the bodies; deleting them is harmless and keeps none behind.
        let from = 0;
        // Writes of COPY_OUT_TXN_BYTES at most: a write is held whole in memory (the WAL's
        // buffer, redb's dirty pages) until it is durable.
        let mut ops = Vec::new();
        let mut bytes = 0;
        for (key, body) in bodies {
            bytes += body.len();
            ops.push(LogOp::PutBody {
                key,
                body: body.into(),
            });
            if bytes >= COPY_OUT_TXN_BYTES {
                self.write_now(std::mem::take(&mut ops))?;
                bytes = 0;
            }
        }
        if !ops.is_empty() {
            self.write_now(ops)?;
        }
        self.copied(upto, from);
        Ok(())
    }

    /// Delete the bodies of entries up to `upto_index` whose keys are not in `live` (sorted):
    /// bodies whose release a crash lost, or that a snapshot installed over. Returns how many
    /// went.
    ///
    /// # Errors
    /// When the storage cannot read or write.
    pub fn sweep(&self, live: &[u64], upto_index: u64) -> Result<usize, LogError> {
        let end = (upto_index.saturating_add(1)).min(u64::MAX >> 16) << 16;
        let dead: Vec<u64> = self
            .backend
            .body_keys(0..end)?
            .into_iter()
            .filter(|k| live.binary_search(k).is_err())
            .collect();
        let n = dead.len();
        if !dead.is_empty() {
            self.write_now(vec![LogOp::DropBodies(dead)])?;
        }
        Ok(n)
    }

    /// An append's write, encoded: the entries and the deletions of released copies it
    /// carries, and the bodies for the recent cache (a queue's log).
    fn prepare(
        &self,
        entries: impl IntoIterator<Item = Entry>,
    ) -> Result<(Vec<LogOp>, AfterWrite), bincode::Error> {
        let mut bodies = Vec::new();
        let mut cached = self.recent_entries();
        let mut ops: Vec<LogOp> = entries
            .into_iter()
            .map(|mut e| {
                let bytes = bytes::Bytes::from(crate::codec::encode(&e)?);
                if self.queue {
                    take_bodies(&mut e, &mut bodies);
                }
                cached.appended(e.log_id.index, bytes.clone());
                Ok(LogOp::Append {
                    index: e.log_id.index,
                    bytes,
                })
            })
            .collect::<Result<_, bincode::Error>>()
            .inspect_err(|_| cached.clear())?;
        drop(cached);
        let released = self.take_released();
        if !released.is_empty() {
            ops.push(LogOp::DropBodies(released));
        }
        Ok((
            ops,
            AfterWrite {
                bodies,
                recent: Arc::clone(&self.recent),
            },
        ))
    }

    /// Append `entries` durably, on this thread (tests; openraft's append runs the same
    /// write off its workers).
    ///
    /// # Errors
    /// When they do not encode or the storage cannot write.
    pub fn append_now(&self, entries: Vec<Entry>) -> Result<(), String> {
        let (ops, after) = self.prepare(entries).map_err(|e| e.to_string())?;
        self.write_now(ops).map_err(|e| e.to_string())?;
        after.done();
        Ok(())
    }

    /// Put the split-out bodies back into `entry` (those still stored).
    fn inflate_bodies(&self, entry: &mut Entry) -> Result<(), StorageError> {
        let openraft::EntryPayload::Normal(req) = &mut entry.payload else {
            return Ok(());
        };
        let index = entry.log_id.index;
        for (slot, c) in req.commands.iter_mut().enumerate() {
            let warren_broker::queue::machine::Command::Enqueue(m) = c else {
                continue;
            };
            if stub_size(&m.body).is_none() {
                continue;
            }
            if let Some(v) = self
                .backend
                .body(body_key(index, slot))
                .map_err(read_logs_error)?
            {
                m.body = v.to_vec();
            }
        }
        Ok(())
    }

    fn meta<T: DeserializeOwned>(&self, key: MetaKey) -> Result<Option<T>, StorageError> {
        let Some(v) = self.backend.meta(key).map_err(read_logs_error)? else {
            return Ok(None);
        };
        serde_json::from_slice(&v)
            .map(Some)
            .map_err(read_logs_error)
    }

    async fn set_meta<T: Serialize>(
        &self,
        key: MetaKey,
        value: &T,
        subject: ErrorSubject<NodeId>,
    ) -> Result<(), StorageError> {
        let op = meta_op(key, value, &subject)?;
        self.write_async(vec![op])
            .await
            .map_err(|e| io_error(subject, ErrorVerb::Write, &e))
    }

    fn last_entry_id(&self) -> Result<Option<LogId<NodeId>>, StorageError> {
        let Some(v) = self.backend.last_entry().map_err(read_logs_error)? else {
            return Ok(None);
        };
        let entry: Entry = crate::codec::decode(&v).map_err(read_logs_error)?;
        Ok(Some(entry.log_id))
    }
}

/// The write of metadata `key` holding `value` (JSON), or the error openraft is told.
fn meta_op<T: Serialize>(
    key: MetaKey,
    value: &T,
    subject: &ErrorSubject<NodeId>,
) -> Result<LogOp, StorageError> {
    let bytes =
        serde_json::to_vec(value).map_err(|e| io_error(subject.clone(), ErrorVerb::Write, &e))?;
    Ok(LogOp::Meta {
        key,
        value: bytes.into(),
    })
}

/// The whole record `key` names in `entry` (None: not an enqueue there, or a stub).
fn record_in(entry: &Entry, key: u64) -> Option<&[u8]> {
    let slot = usize::try_from(key & 0xFFFF).ok()?;
    let openraft::EntryPayload::Normal(req) = &entry.payload else {
        return None;
    };
    match req.commands.get(slot) {
        Some(Command::Enqueue(m)) if stub_size(&m.body).is_none() => Some(&m.body),
        _ => None,
    }
}

/// Move the bodies of `entry`'s enqueues (already encoded) into `bodies`, by key.
fn take_bodies(entry: &mut Entry, bodies: &mut Vec<(u64, Vec<u8>)>) {
    let openraft::EntryPayload::Normal(req) = &mut entry.payload else {
        return;
    };
    let index = entry.log_id.index;
    for (slot, c) in req.commands.iter_mut().enumerate().take(SLOTS_PER_ENTRY) {
        if let Command::Enqueue(m) = c
            && stub_size(&m.body).is_none()
        {
            bodies.push((body_key(index, slot), std::mem::take(&mut m.body)));
        }
    }
}

/// What an append does once it is durable: its bodies go to the recent cache.
struct AfterWrite {
    bodies: Vec<(u64, Vec<u8>)>,
    recent: Arc<std::sync::Mutex<Recent>>,
}

impl AfterWrite {
    fn done(self) {
        if self.bodies.is_empty() {
            return;
        }
        let mut recent = self
            .recent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (key, body) in self.bodies {
            // Moved, not copied.
            recent.insert(key, bytes::Bytes::from(body));
        }
    }
}

impl RaftLogReader<QueueRaft> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        let bounds: (Bound<u64>, Bound<u64>) =
            (range.start_bound().cloned(), range.end_bound().cloned());
        let inflate = self.queue && self.inflate;
        let span = match bounds {
            (Bound::Included(s), Bound::Excluded(e)) if e > s => Some((s, e - 1)),
            (Bound::Included(s), Bound::Included(e)) => Some((s, e)),
            _ => None,
        };
        let cached = span.and_then(|(start, end)| {
            let mut recent = self.recent_entries();
            let entries = recent.get(start, end);
            // openraft's own store (not the replication reader) reads to apply: those
            // entries are not read again soon.
            if !self.inflate {
                recent.applied(end);
            }
            entries
        });
        let encoded = match cached {
            Some(v) => v,
            None => self.backend.entries(bounds).map_err(read_logs_error)?,
        };
        let mut out = Vec::with_capacity(encoded.len());
        for v in encoded {
            let mut entry: Entry = crate::codec::decode(&v).map_err(read_logs_error)?;
            if inflate {
                self.inflate_bodies(&mut entry)?;
            }
            out.push(entry);
        }
        Ok(out)
    }
}

impl RaftLogStorage<QueueRaft> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<QueueRaft>, StorageError> {
        let last_purged_log_id: Option<LogId<NodeId>> = self.meta(MetaKey::Purged)?;
        let last_log_id = self.last_entry_id()?.or(last_purged_log_id);
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        // Replication reads through this one: it sends whole entries.
        Self {
            inflate: true,
            ..self.clone()
        }
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        self.set_meta(MetaKey::Vote, vote, ErrorSubject::Vote).await
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        self.meta(MetaKey::Vote)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError> {
        // openraft awaits this before applying each commit. Raft needs no durable commit
        // index (a restarted node learns it again from a leader; until then it applies less),
        // so the record rides with the next write instead of a round of its own: on thinly
        // loaded groups about half the fdatasyncs, and one wait fewer on every commit's path
        // (docs/storage-format.md).
        let op = meta_op(MetaKey::Committed, &committed, &ErrorSubject::Store)?;
        self.backend
            .write_lazy(vec![op])
            .map_err(|e| io_error(ErrorSubject::Store, ErrorVerb::Write, &e))
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError> {
        Ok(self
            .meta::<Option<LogId<NodeId>>>(MetaKey::Committed)?
            .flatten())
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
        let (ops, after) = self.prepare(entries).map_err(write_logs_error)?;
        let cached = Arc::clone(&self.entries);
        let done = move |r: Result<(), LogError>| match r {
            Ok(()) => {
                after.done();
                callback.log_io_completed(Ok(()));
            }
            Err(e) => {
                // The log does not hold them: neither may the cache.
                cached
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .clear();
                callback.log_io_completed(Err(std::io::Error::other(e.to_string())));
            }
        };
        if self.backend.readable_at_once() {
            // Readable now, durable when `done` is told: openraft replicates the entries
            // while they are synced.
            self.backend.write(ops, Box::new(done));
            return Ok(());
        }
        // The writer commits it with the other groups' writes ready now, and fsyncs off the
        // async workers, which must keep serving heartbeats.
        let r = self.write_async(ops).await;
        let failed = r.as_ref().err().cloned();
        done(r);
        match failed {
            None => Ok(()),
            Some(e) => Err(write_logs_error(e)),
        }
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        self.recent_entries().truncate(log_id.index);
        self.recent()
            .remove_from(log_id.index.min(u64::MAX >> 16) << 16);
        self.forget_read(|i| i >= log_id.index);
        self.write_async(vec![LogOp::Truncate { from: log_id.index }])
            .await
            .map_err(write_logs_error)
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        // The purge point first, then the deletion: in redb they commit together; in the
        // WAL a crash between them leaves entries below the recorded purge point, which the
        // next purge removes (never a gap above it).
        let purged = serde_json::to_vec(&log_id).map_err(write_logs_error)?;
        self.write_async(vec![
            LogOp::Meta {
                key: MetaKey::Purged,
                value: purged.into(),
            },
            LogOp::Purge { upto: log_id.index },
        ])
        .await
        .map_err(write_logs_error)?;
        self.forget_read(|i| i <= log_id.index);
        self.recent_entries().applied(log_id.index);
        // Copied out before (compaction), or brought by a snapshot (an install): either way
        // the live bodies of these entries are copies now.
        self.copied(log_id.index, 0);
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

    use openraft::{CommittedLeaderId, EntryPayload};
    use warren_broker::queue::machine::Command;

    use super::*;
    use crate::types::{QueueRequest, ReplicatedMessage};

    pub(crate) fn record(text: &str) -> Vec<u8> {
        let m = warren_broker::message::Message {
            exchange: String::new(),
            routing_key: "q".into(),
            properties: warren_amqp::properties::Properties::parse(
                bytes::Bytes::from_static(&[0, 0]),
                4,
            )
            .unwrap(),
            body: bytes::Bytes::copy_from_slice(text.as_bytes()),
        };
        warren_broker::message::codec::encode_message(&m)
    }

    pub(crate) fn enqueue(text: &str) -> Command<ReplicatedMessage> {
        Command::Enqueue(ReplicatedMessage {
            body: record(text),
            priority: 0,
            expiration_ms: None,
        })
    }

    pub(crate) fn entry(index: u64, commands: Vec<Command<ReplicatedMessage>>) -> Entry {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(QueueRequest {
                at: 0,
                commands,
                meta: Vec::new(),
            }),
        }
    }

    /// The bodies of an entry's enqueues, in command order (None: not an enqueue).
    pub(crate) fn bodies_of(e: &Entry) -> Vec<Option<Vec<u8>>> {
        let EntryPayload::Normal(req) = &e.payload else {
            return Vec::new();
        };
        req.commands
            .iter()
            .map(|c| match c {
                Command::Enqueue(m) => Some(m.body.clone()),
                _ => None,
            })
            .collect()
    }

    /// Reads after the recent cache: from the entry, or from the copy.
    fn cold(store: &LogStore, key: u64) -> Option<Vec<u8>> {
        store.recent().bodies.clear();
        store.read_body(key).unwrap()
    }

    /// A queue's log keeps bodies in its entries (applied and replicated whole), reads them
    /// by key, copies the live ones out before a purge and deletes a copy once released;
    /// truncation and sweeps take what no message holds.
    #[tokio::test]
    async fn bodies_are_read_from_entries_and_copied_out_before_a_purge() {
        let dir = tempfile::tempdir().unwrap();
        bodies_in(LogStore::open_queue(&dir.path().join("q.redb")).unwrap()).await;
    }

    /// The same over the node's write-ahead log, with another group beside.
    #[tokio::test]
    async fn bodies_in_the_wal_are_read_from_entries_and_copied_out_before_a_purge() {
        let dir = tempfile::tempdir().unwrap();
        let wal =
            Arc::new(Wal::open(dir.path(), warren_store::wal::WalOptions::default()).unwrap());
        let other = LogStore::in_wal(&wal, 7).unwrap();
        other
            .append_now(vec![entry(1, vec![enqueue("other")])])
            .unwrap();
        bodies_in(LogStore::in_wal(&wal, 8).unwrap()).await;
        assert_eq!(cold(&other, body_key(1, 0)), Some(record("other")));
    }

    /// A body copied out of a purged entry holds the WAL's oldest segment once the other
    /// groups moved on; written again, the segment is freed and the body reads the same.
    #[tokio::test]
    async fn a_copied_body_pinning_the_oldest_segment_is_written_again() {
        let dir = tempfile::tempdir().unwrap();
        let options = warren_store::wal::WalOptions {
            segment_bytes: 64 * 1024,
        };
        let wal = Arc::new(Wal::open(dir.path(), options).unwrap());
        let mut queue = LogStore::in_wal(&wal, 8).unwrap();
        queue
            .append_now(vec![entry(1, vec![enqueue("kept")])])
            .unwrap();
        let live = [body_key(1, 0)];
        assert_eq!(queue.copy_out(&live, 1).unwrap(), 1);
        queue
            .purge(LogId::new(CommittedLeaderId::new(1, 1), 1))
            .await
            .unwrap();
        assert_eq!(
            queue.rewrite_oldest_bodies().unwrap(),
            0,
            "one segment so far"
        );
        let mut busy = LogStore::in_wal(&wal, 9).unwrap();
        let filler = "x".repeat(4096);
        for i in 1..=64 {
            busy.append_now(vec![entry(i, vec![enqueue(&filler)])])
                .unwrap();
        }
        busy.purge(LogId::new(CommittedLeaderId::new(1, 1), 64))
            .await
            .unwrap();
        let (oldest, pinning) = wal.pinning().unwrap();
        assert_eq!(pinning, vec![8], "the copy alone holds segment {oldest}");
        assert_eq!(queue.rewrite_oldest_bodies().unwrap(), 1);
        assert!(
            wal.pinning()
                .is_none_or(|(seq, g)| seq > oldest || !g.contains(&8))
        );
        assert_eq!(cold(&queue, body_key(1, 0)), Some(record("kept")));
    }

    async fn bodies_in(mut store: LogStore) {
        store
            .append_now(vec![
                entry(
                    1,
                    vec![enqueue("one"), Command::Settle(vec![1]), enqueue("three")],
                ),
                entry(2, vec![enqueue("four")]),
            ])
            .unwrap();
        let applied = store.try_get_log_entries(1..3).await.unwrap();
        assert_eq!(
            bodies_of(&applied[0]),
            vec![Some(record("one")), None, Some(record("three"))]
        );
        // From memory, then from the entry.
        assert_eq!(
            store.read_body(body_key(1, 2)).unwrap(),
            Some(record("three"))
        );
        assert_eq!(cold(&store, body_key(1, 2)), Some(record("three")));
        assert_eq!(cold(&store, body_key(2, 0)), Some(record("four")));
        assert_eq!(cold(&store, body_key(1, 1)), None);

        // "one" left the queue; "three" and "four" are live: purging entry 1 copies "three".
        store.release([body_key(1, 0)]);
        let live = [body_key(1, 2), body_key(2, 0)];
        assert_eq!(store.copy_out(&live, 1).unwrap(), 1);
        assert_eq!(store.copy_out(&live, 1).unwrap(), 0, "done once");
        store
            .purge(LogId::new(CommittedLeaderId::new(1, 1), 1))
            .await
            .unwrap();
        assert_eq!(cold(&store, body_key(1, 2)), Some(record("three")));
        assert_eq!(cold(&store, body_key(1, 0)), None);
        assert_eq!(cold(&store, body_key(2, 0)), Some(record("four")));

        // The copy goes with the next write once its message leaves.
        store.release([body_key(1, 2)]);
        assert_eq!(cold(&store, body_key(1, 2)), Some(record("three")));
        store
            .append_now(vec![entry(3, vec![enqueue("five")])])
            .unwrap();
        assert_eq!(cold(&store, body_key(1, 2)), None);

        // Truncating from 2 takes entries 2 and 3 with their bodies.
        store
            .truncate(LogId::new(CommittedLeaderId::new(1, 1), 2))
            .await
            .unwrap();
        assert_eq!(cold(&store, body_key(2, 0)), None);
        assert_eq!(cold(&store, body_key(3, 0)), None);

        // A sweep keeps what the live set names and takes the rest.
        store
            .insert_bodies(vec![(body_key(1, 0), record("one"))], 1)
            .unwrap();
        assert_eq!(store.sweep(&[body_key(1, 0)], 1).unwrap(), 0);
        assert_eq!(store.sweep(&[], 1).unwrap(), 1);
        assert_eq!(cold(&store, body_key(1, 0)), None);
    }

    /// A message released while a copy-out runs is not left behind as a copy: released
    /// before, it is not copied; released during, its possible copy is deleted.
    #[test]
    fn a_release_racing_a_copy_out_leaves_no_copy() {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::open_queue(&dir.path().join("q.redb")).unwrap();
        store
            .append_now(vec![entry(1, vec![enqueue("a"), enqueue("b")])])
            .unwrap();
        let (a, b) = (body_key(1, 0), body_key(1, 1));
        // `a` released after the live set was taken, before the copy: not copied.
        store.release([a]);
        assert_eq!(store.copy_out(&[a, b], 1).unwrap(), 1);
        assert_eq!(store.copies().pending, Vec::<u64>::new());
        // `b` released by someone during a copy (after it read `above`): a deletion.
        let from = store.copies().above.len();
        store.copies().copied_upto = 0;
        store.release([b]);
        store.copied(1, from);
        assert_eq!(store.copies().pending, vec![b]);
        store.flush_released().unwrap();
        assert!(!store.backend.has_body(b).unwrap());
        assert!(!store.backend.has_body(a).unwrap());
    }

    /// A copy-out larger than one transaction's bound commits several and copies everything.
    #[test]
    fn a_large_copy_out_takes_several_transactions_and_copies_all() {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::open_queue(&dir.path().join("q.redb")).unwrap();
        let big = "x".repeat(COPY_OUT_TXN_BYTES / 2 + 1);
        let entries: Vec<Entry> = (1..=5).map(|i| entry(i, vec![enqueue(&big)])).collect();
        store.append_now(entries).unwrap();
        let live: Vec<u64> = (1..=5).map(|i| body_key(i, 0)).collect();
        assert_eq!(store.copy_out(&live, 5).unwrap(), 5);
        for k in live {
            assert_eq!(
                store.backend.body(k).unwrap().as_deref(),
                Some(record(&big).as_slice())
            );
        }
    }

    /// Logs of the version that split bodies out when appended (stubs in the entries, bodies
    /// in the table) are read alike, and replicate whole.
    #[tokio::test]
    async fn a_log_with_split_out_bodies_is_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = LogStore::open_queue(&dir.path().join("old.redb")).unwrap();
        let stub = {
            let mut s = vec![STUB_TAG];
            s.extend_from_slice(&3u32.to_be_bytes());
            s
        };
        assert_eq!(stub_size(&stub), Some(3));
        store
            .append_now(vec![entry(
                1,
                vec![Command::Enqueue(ReplicatedMessage {
                    body: stub,
                    priority: 0,
                    expiration_ms: None,
                })],
            )])
            .unwrap();
        store
            .insert_bodies(vec![(body_key(1, 0), record("old"))], 0)
            .unwrap();
        assert_eq!(cold(&store, body_key(1, 0)), Some(record("old")));
        let mut reader = store.get_log_reader().await;
        let sent = reader.try_get_log_entries(1..2).await.unwrap();
        assert_eq!(bodies_of(&sent[0]), vec![Some(record("old"))]);
    }

    /// Other logs (metadata, streams, the replication tests) keep entries whole for every
    /// reader.
    #[tokio::test]
    async fn other_logs_keep_entries_whole() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = LogStore::open(&dir.path().join("m.redb")).unwrap();
        store
            .append_now(vec![entry(1, vec![enqueue("one")])])
            .unwrap();
        let got = store.try_get_log_entries(1..2).await.unwrap();
        assert_eq!(bodies_of(&got[0]), vec![Some(record("one"))]);
    }
}
