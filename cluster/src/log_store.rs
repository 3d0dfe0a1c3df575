//! The Raft log of one group in redb: entries by index, and the vote, the commit index and the
//! last purged id as metadata. Every write is a redb transaction committed with its default
//! `Durability::Immediate` (fsync) before openraft is told it is done, so an entry counted
//! towards a majority is on disk, and a vote given is never forgotten across a crash.
//!
//! Entries are stored in the binary [`codec`](crate::codec), one redb value each; the small
//! metadata values are JSON.
//!
//! A quorum queue's log ([`LogStore::open_split`]) keeps message bodies apart from the
//! entries: each enqueue's body is its own value in the `raft_bodies` table under its
//! [`body_key`] (the entry's index and the command's place in it), and the entry keeps a
//! 5-byte stub (tag, body size). Replicas hold messages by key, not by body
//! ([`warren_broker::message::Entry::Logged`]), read a body when they deliver it and release
//! it when the message leaves the queue, so:
//! - memory holds per-message metadata only, whatever the backlog;
//! - purging the log (after a snapshot) deletes no body a live message still needs, and a
//!   settled message's body goes at once (in the next write), so a few old unacked messages
//!   pin their own bodies and nothing else;
//! - openraft reads entries to apply through the store itself, which gives the stubs (applying
//!   needs no body), and to replicate through its reader ([`LogStore::get_log_reader`]), which
//!   puts the bodies back. A body already released (its message settled) stays a stub: a
//!   member that applies it also applies the settle that follows.
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
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::types::{NodeId, QueueRaft, StorageError};

type Entry = openraft::Entry<QueueRaft>;

const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("raft_log");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_meta");
const BODIES: TableDefinition<u64, &[u8]> = TableDefinition::new("raft_bodies");

/// redb's page cache per log (its default is 1 GiB per database, which a node with a log per
/// queue cannot afford; bodies read back are usually in the OS page cache anyway).
pub const LOG_CACHE_BYTES: usize = 8 * 1024 * 1024;

/// Bytes of the most recently appended bodies a split log keeps in memory as well, so a
/// consumer that keeps up is served without reading them back (oldest dropped first).
pub const RECENT_BODY_BYTES: usize = 2 * 1024 * 1024;

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

/// Commands of one entry whose bodies can be split out (a key has 16 bits for the slot);
/// the proposer's entries are far smaller. Bodies of commands beyond stay in the entry.
pub const SLOTS_PER_ENTRY: usize = 1 << 16;

/// First byte of a split-out body's stub in an entry. A message record starts with its
/// length, big-endian: its first byte would be 0xFE only for a record of almost 4 GiB.
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

fn stub(size: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(STUB_LEN);
    out.push(STUB_TAG);
    out.extend_from_slice(&size.to_be_bytes());
    out
}

const KEY_VOTE: &str = "vote";
const KEY_COMMITTED: &str = "committed";
const KEY_PURGED: &str = "last_purged";
/// Set once every entry of a split log has its bodies split out (logs written before
/// bodies were split are converted when first opened so).
const KEY_SPLIT: &str = "bodies_split";

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
    /// Bodies are split out of entries (a quorum queue's log).
    split: bool,
    /// Reads put split-out bodies back (the reader openraft replicates from).
    inflate: bool,
    /// Keys of bodies released since the last write, deleted with the next one.
    released: Arc<std::sync::Mutex<Vec<u64>>>,
    /// The last bodies appended, also in memory.
    recent: Arc<std::sync::Mutex<Recent>>,
}

impl LogStore {
    /// Open or create the log at `path`, entries kept whole.
    ///
    /// # Errors
    /// When redb cannot open or initialise the file.
    pub fn open(path: &Path) -> Result<Self, redb::Error> {
        Self::open_with(path, false)
    }

    /// Open or create a quorum queue's log at `path`: bodies split out of the entries (see
    /// the module's documentation).
    ///
    /// # Errors
    /// When redb cannot open or initialise the file.
    pub fn open_split(path: &Path) -> Result<Self, redb::Error> {
        Self::open_with(path, true)
    }

    fn open_with(path: &Path, split: bool) -> Result<Self, redb::Error> {
        let db = Database::builder()
            .set_cache_size(LOG_CACHE_BYTES)
            .create(path)?;
        let tx = db.begin_write()?;
        tx.open_table(LOG)?;
        tx.open_table(META)?;
        tx.open_table(BODIES)?;
        tx.commit()?;
        let store = Self {
            db: Arc::new(db),
            split,
            inflate: false,
            released: Arc::default(),
            recent: Arc::default(),
        };
        if split {
            store.split_existing()?;
        }
        Ok(store)
    }

    /// Split the bodies out of entries written whole (by an earlier version), once: apply
    /// then takes every enqueue of a split log for a key whose body is stored.
    fn split_existing(&self) -> Result<(), redb::Error> {
        let tx = self.db.begin_write()?;
        if tx.open_table(META)?.get(KEY_SPLIT)?.is_some() {
            return Ok(());
        }
        {
            let mut log = tx.open_table(LOG)?;
            let mut table = tx.open_table(BODIES)?;
            let mut rewritten = Vec::new();
            for row in log.iter()? {
                let (k, v) = row?;
                let Ok(mut entry) = crate::codec::decode::<Entry>(v.value()) else {
                    continue;
                };
                let mut bodies = Vec::new();
                self.split_bodies(&mut entry, &mut bodies);
                if bodies.is_empty() {
                    continue;
                }
                for (key, body) in &bodies {
                    table.insert(*key, body.as_slice())?;
                }
                if let Ok(bytes) = crate::codec::encode(&entry) {
                    rewritten.push((k.value(), bytes));
                }
            }
            for (k, bytes) in rewritten {
                log.insert(k, bytes.as_slice())?;
            }
            tx.open_table(META)?.insert(KEY_SPLIT, b"1".as_slice())?;
        }
        tx.commit()?;
        Ok(())
    }

    /// The body stored under `key` (None: released, or never here).
    ///
    /// # Errors
    /// When redb cannot read it.
    pub fn read_body(&self, key: u64) -> Result<Option<Vec<u8>>, redb::Error> {
        self.with_body(key, <[u8]>::to_vec)
    }

    /// `f` of the body stored under `key` (None: released, or never here), without copying
    /// it out first.
    ///
    /// # Errors
    /// When redb cannot read it.
    pub fn with_body<T>(
        &self,
        key: u64,
        f: impl FnOnce(&[u8]) -> T,
    ) -> Result<Option<T>, redb::Error> {
        if let Some(b) = self.recent().bodies.get(&key).cloned() {
            return Ok(Some(f(&b)));
        }
        let tx = self.db.begin_read()?;
        let bodies = tx.open_table(BODIES)?;
        Ok(bodies.get(key)?.map(|v| f(v.value())))
    }

    /// The message under `key` left the queue on this replica: its body is deleted with the
    /// next write (an append, or [`LogStore::flush_released`]).
    pub fn release(&self, keys: impl IntoIterator<Item = u64>) {
        let mut released = self
            .released
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut recent = self.recent();
        for k in keys {
            recent.remove(k);
            released.push(k);
        }
    }

    fn recent(&self) -> std::sync::MutexGuard<'_, Recent> {
        self.recent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn take_released(&self) -> Vec<u64> {
        std::mem::take(
            &mut *self
                .released
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Delete the bodies released since the last write (when no append came to do it).
    ///
    /// # Errors
    /// When redb cannot write.
    pub fn flush_released(&self) -> Result<(), redb::Error> {
        let keys = self.take_released();
        if keys.is_empty() {
            return Ok(());
        }
        let tx = self.db.begin_write()?;
        {
            let mut bodies = tx.open_table(BODIES)?;
            for k in keys {
                bodies.remove(k)?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    /// Store bodies a snapshot brought (a member that was behind the purged log).
    ///
    /// # Errors
    /// When redb cannot write.
    pub fn insert_bodies(&self, bodies: &[(u64, Vec<u8>)]) -> Result<(), redb::Error> {
        let tx = self.db.begin_write()?;
        {
            let mut table = tx.open_table(BODIES)?;
            for (k, body) in bodies {
                table.insert(*k, body.as_slice())?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    /// Delete the bodies of entries up to `upto_index` whose keys are not in `live` (sorted):
    /// bodies whose release a crash lost, or that a snapshot installed over. Returns how many
    /// went.
    ///
    /// # Errors
    /// When redb cannot read or write.
    pub fn sweep(&self, live: &[u64], upto_index: u64) -> Result<usize, redb::Error> {
        let end = (upto_index.saturating_add(1)).min(u64::MAX >> 16) << 16;
        let dead: Vec<u64> = {
            let tx = self.db.begin_read()?;
            let bodies = tx.open_table(BODIES)?;
            let mut dead = Vec::new();
            for row in bodies.range(..end)? {
                let k = row?.0.value();
                if live.binary_search(&k).is_err() {
                    dead.push(k);
                }
            }
            dead
        };
        if !dead.is_empty() {
            self.release(dead.iter().copied());
            self.flush_released()?;
        }
        Ok(dead.len())
    }

    /// An append's write, encoded: the entries (bodies split out), the bodies, and the
    /// releases it carries.
    fn prepare(&self, entries: impl IntoIterator<Item = Entry>) -> Result<Write, bincode::Error> {
        let mut bodies = Vec::new();
        let encoded: Vec<(u64, Vec<u8>)> = entries
            .into_iter()
            .map(|mut e| {
                self.split_bodies(&mut e, &mut bodies);
                crate::codec::encode(&e).map(|b| (e.log_id.index, b))
            })
            .collect::<Result<_, _>>()?;
        Ok(Write {
            db: Arc::clone(&self.db),
            encoded,
            bodies,
            released: self.take_released(),
            recent: Arc::clone(&self.recent),
        })
    }

    /// Append `entries` durably, on this thread (tests; openraft's append runs the same
    /// write off its workers).
    ///
    /// # Errors
    /// When they do not encode or redb cannot write.
    pub fn append_now(&self, entries: Vec<Entry>) -> Result<(), String> {
        self.prepare(entries)
            .map_err(|e| e.to_string())?
            .commit()
            .map_err(|e| e.to_string())
    }

    /// Split the bodies out of `entry`'s enqueues (a split log), leaving stubs.
    fn split_bodies(&self, entry: &mut Entry, bodies: &mut Vec<(u64, Vec<u8>)>) {
        if !self.split {
            return;
        }
        let openraft::EntryPayload::Normal(req) = &mut entry.payload else {
            return;
        };
        let index = entry.log_id.index;
        for (slot, c) in req.commands.iter_mut().enumerate().take(SLOTS_PER_ENTRY) {
            let warren_broker::queue::machine::Command::Enqueue(m) = c else {
                continue;
            };
            if stub_size(&m.body).is_some() {
                continue;
            }
            // A record that does not parse stays whole (apply refuses it alike everywhere).
            let Ok(size) = warren_broker::message::codec::record_body_len(&m.body) else {
                continue;
            };
            let body = std::mem::replace(&mut m.body, stub(size));
            bodies.push((body_key(index, slot), body));
        }
    }

    /// Put the split-out bodies back into `entry` (those still stored).
    fn inflate_bodies(
        &self,
        entry: &mut Entry,
        bodies: &redb::ReadOnlyTable<u64, &[u8]>,
    ) -> Result<(), StorageError> {
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
            if let Some(v) = bodies.get(body_key(index, slot)).map_err(read_logs_error)? {
                m.body = v.value().to_vec();
            }
        }
        Ok(())
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

    /// Delete the entries whose index is in `range`, in one durable transaction, with
    /// `then` written to the metadata; with `bodies`, the bodies of those entries too (a
    /// truncation: they were never applied; a purge keeps them, live messages still needing
    /// theirs and the others being released).
    fn delete(
        &self,
        range: impl RangeBounds<u64>,
        then: Option<(&str, &[u8])>,
        bodies: bool,
    ) -> Result<(), StorageError> {
        let tx = self.db.begin_write().map_err(write_logs_error)?;
        {
            let start = range.start_bound().cloned();
            let mut log = tx.open_table(LOG).map_err(write_logs_error)?;
            remove_range(&mut log, (start, range.end_bound().cloned()))?;
            if bodies {
                let key = |i: u64| i.min(u64::MAX >> 16) << 16;
                let from = match start {
                    Bound::Included(i) => Bound::Included(key(i)),
                    Bound::Excluded(i) => Bound::Included(key(i.saturating_add(1))),
                    Bound::Unbounded => Bound::Unbounded,
                };
                let mut table = tx.open_table(BODIES).map_err(write_logs_error)?;
                remove_range(&mut table, (from, Bound::Unbounded))?;
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

/// Remove the rows of `table` whose keys are in `range`.
fn remove_range(
    table: &mut redb::Table<'_, u64, &[u8]>,
    range: (Bound<u64>, Bound<u64>),
) -> Result<(), StorageError> {
    // `retain_in` would scan the same range; collecting keys keeps the borrow simple.
    let keys: Vec<u64> = table
        .range(range)
        .map_err(write_logs_error)?
        .map(|r| r.map(|(k, _)| k.value()))
        .collect::<Result<_, _>>()
        .map_err(write_logs_error)?;
    for k in keys {
        table.remove(k).map_err(write_logs_error)?;
    }
    Ok(())
}

/// See [`LogStore::prepare`].
struct Write {
    db: Arc<Database>,
    encoded: Vec<(u64, Vec<u8>)>,
    bodies: Vec<(u64, Vec<u8>)>,
    released: Vec<u64>,
    recent: Arc<std::sync::Mutex<Recent>>,
}

impl Write {
    /// One durable transaction: entries, bodies, and the deletion of released bodies.
    fn commit(self) -> Result<(), redb::Error> {
        let tx = self.db.begin_write()?;
        {
            let mut log = tx.open_table(LOG)?;
            for (index, bytes) in &self.encoded {
                log.insert(*index, bytes.as_slice())?;
            }
            if !self.bodies.is_empty() || !self.released.is_empty() {
                let mut table = tx.open_table(BODIES)?;
                for (key, body) in &self.bodies {
                    table.insert(*key, body.as_slice())?;
                }
                for key in self.released {
                    table.remove(key)?;
                }
            }
        }
        tx.commit()?;
        if !self.bodies.is_empty() {
            let mut recent = self
                .recent
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for (key, body) in self.bodies {
                // Moved, not copied.
                recent.insert(key, bytes::Bytes::from(body));
            }
        }
        Ok(())
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
        let bodies = if self.split && self.inflate {
            Some(tx.open_table(BODIES).map_err(read_logs_error)?)
        } else {
            None
        };
        let mut out = Vec::new();
        for row in log.range(bounds).map_err(read_logs_error)? {
            let (_, v) = row.map_err(read_logs_error)?;
            let mut entry: Entry = crate::codec::decode(v.value()).map_err(read_logs_error)?;
            if let Some(bodies) = &bodies {
                self.inflate_bodies(&mut entry, bodies)?;
            }
            out.push(entry);
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
        // Replication reads through this one: it sends whole entries.
        Self {
            inflate: true,
            ..self.clone()
        }
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
        let write = self.prepare(entries).map_err(write_logs_error)?;
        // The commit fsyncs: off the async workers, which must keep serving heartbeats.
        let result = tokio::task::spawn_blocking(move || write.commit())
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
        self.recent()
            .remove_from(log_id.index.min(u64::MAX >> 16) << 16);
        self.delete(log_id.index.., None, true)
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        // The purge point and the deletion commit together: a crash in between cannot leave
        // entries below the recorded purge point, nor a gap above it.
        let purged = serde_json::to_vec(&log_id).map_err(write_logs_error)?;
        self.delete(..=log_id.index, Some((KEY_PURGED, &purged)), false)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

    use openraft::{CommittedLeaderId, EntryPayload};
    use warren_broker::queue::machine::Command;

    use super::*;
    use crate::types::{QueueRequest, ReplicatedMessage};

    fn record(text: &str) -> Vec<u8> {
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

    fn enqueue(text: &str) -> Command<ReplicatedMessage> {
        Command::Enqueue(ReplicatedMessage {
            body: record(text),
            priority: 0,
            expiration_ms: None,
        })
    }

    fn entry(index: u64, commands: Vec<Command<ReplicatedMessage>>) -> Entry {
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
    fn bodies_of(e: &Entry) -> Vec<Option<Vec<u8>>> {
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

    /// A split log applies from stubs and replicates whole entries; a released body goes
    /// with the next write (its entry then replicates a stub); truncation takes the removed
    /// entries' bodies, purging keeps live ones, a sweep takes what no message holds.
    #[tokio::test]
    async fn bodies_are_split_out_put_back_released_and_swept() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = LogStore::open_split(&dir.path().join("q.redb")).unwrap();
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
        let stubs = bodies_of(&applied[0]);
        assert_eq!(stub_size(stubs[0].as_ref().unwrap()), Some(3));
        assert_eq!(stubs[1], None);
        assert_eq!(stub_size(stubs[2].as_ref().unwrap()), Some(5));

        let mut reader = store.get_log_reader().await;
        let sent = reader.try_get_log_entries(1..3).await.unwrap();
        assert_eq!(
            bodies_of(&sent[0]),
            vec![Some(record("one")), None, Some(record("three"))]
        );
        assert_eq!(bodies_of(&sent[1]), vec![Some(record("four"))]);
        assert_eq!(
            store.read_body(body_key(1, 2)).unwrap(),
            Some(record("three"))
        );

        // Released: gone with the next append; the entry now replicates its stub.
        store.release([body_key(1, 0)]);
        assert!(store.read_body(body_key(1, 0)).unwrap().is_some());
        store
            .append_now(vec![entry(3, vec![enqueue("five")])])
            .unwrap();
        assert_eq!(store.read_body(body_key(1, 0)).unwrap(), None);
        let sent = reader.try_get_log_entries(1..2).await.unwrap();
        let b = bodies_of(&sent[0]);
        assert_eq!(stub_size(b[0].as_ref().unwrap()), Some(3));
        assert_eq!(b[2], Some(record("three")));

        // Truncating from 2 takes the bodies of entries 2 and 3.
        store
            .truncate(LogId::new(CommittedLeaderId::new(1, 1), 2))
            .await
            .unwrap();
        assert_eq!(store.read_body(body_key(2, 0)).unwrap(), None);
        assert_eq!(store.read_body(body_key(3, 0)).unwrap(), None);
        // Purging entry 1 keeps the body of its message still live.
        store
            .purge(LogId::new(CommittedLeaderId::new(1, 1), 1))
            .await
            .unwrap();
        assert_eq!(
            store.read_body(body_key(1, 2)).unwrap(),
            Some(record("three"))
        );
        // A sweep keeps what the live set names and takes the rest.
        assert_eq!(store.sweep(&[body_key(1, 2)], 1).unwrap(), 0);
        assert_eq!(store.sweep(&[], 1).unwrap(), 1);
        assert_eq!(store.read_body(body_key(1, 2)).unwrap(), None);
    }

    /// A log written whole (an earlier version) has its bodies split out when first opened
    /// as a quorum queue's log, once.
    #[tokio::test]
    async fn a_log_written_whole_is_split_when_opened_split() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.redb");
        LogStore::open(&path)
            .unwrap()
            .append_now(vec![entry(1, vec![enqueue("old")])])
            .unwrap();
        let mut store = LogStore::open_split(&path).unwrap();
        let got = store.try_get_log_entries(1..2).await.unwrap();
        assert_eq!(stub_size(bodies_of(&got[0])[0].as_ref().unwrap()), Some(3));
        assert_eq!(
            store.read_body(body_key(1, 0)).unwrap(),
            Some(record("old"))
        );
        let mut reader = store.get_log_reader().await;
        let sent = reader.try_get_log_entries(1..2).await.unwrap();
        assert_eq!(bodies_of(&sent[0]), vec![Some(record("old"))]);
        drop((store, reader));
        // Opened again: nothing to convert, the body still there.
        let store = LogStore::open_split(&path).unwrap();
        assert_eq!(
            store.read_body(body_key(1, 0)).unwrap(),
            Some(record("old"))
        );
    }

    /// A log that does not split (metadata, streams, the replication tests) keeps entries
    /// whole for every reader.
    #[tokio::test]
    async fn an_unsplit_log_keeps_entries_whole() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = LogStore::open(&dir.path().join("m.redb")).unwrap();
        store
            .append_now(vec![entry(1, vec![enqueue("one")])])
            .unwrap();
        let got = store.try_get_log_entries(1..2).await.unwrap();
        assert_eq!(bodies_of(&got[0]), vec![Some(record("one"))]);
        assert_eq!(store.read_body(body_key(1, 0)).unwrap(), None);
    }
}
