//! The node's write-ahead log: every group's records (Raft entries, votes, commit indexes,
//! truncations, purges, copied-out bodies) appended to one active segment file, made durable
//! by one write and one fdatasync per round for every group that has records ready (group
//! commit). It knows nothing of Raft: a group is a `u64`, an entry an index and bytes, the
//! metadata three opaque slots ([`MetaSlot`]).
//!
//! In memory per group: its metadata and purge point, and the location (segment, offset,
//! length: 12 bytes) of each live entry and body ([`index::GroupLog`]). Records written but
//! not yet synced are read from the writer's buffers, so an entry is readable as soon as
//! [`Wal::write`] returns, as openraft requires; the write's callback runs once it is on disk.
//!
//! Segments ([`segment`]) are [`WalOptions::segment_bytes`] long (a write that does not fit
//! starts the next one; a record larger than a segment gets one of its own). Every segment
//! starts with every group's state, so no older segment is needed for metadata, and ends with a
//! seal naming the next. The oldest segments are freed, in order, once no group has a live
//! entry or body in them ([`Wal::pinning`] names the groups that hold the oldest); their files
//! are reused for new segments.
//!
//! Recovery ([`Wal::open`]) replays the segments in order, checking every record's checksum.
//! The first record that does not verify ends a segment; only the newest segment may end so
//! (a torn tail, cut by writing a seal over it); a segment that ends early while a later one
//! holds records is corruption and refuses to open. The segments are written in order and
//! a segment is synced before the next is written, which is what makes that rule hold.
//!
//! Invariants (asserted in tests and the property test against a model):
//! - a write's callback is told `Ok` only after every record of it is synced;
//! - the state rebuilt by replay equals the state before the crash, for every synced write;
//! - a segment is freed only when it and every older one hold no live record, and the
//!   segment after it (whose head carries every group's state) is synced.

pub mod error;
pub mod index;
mod read;
pub mod record;
mod recover;
pub mod segment;
mod writer;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::{Bound, RangeBounds};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use bytes::Bytes;
use parking_lot::{Condvar, Mutex};

pub use error::WalError;
pub use index::Loc;
pub use record::{GroupState, MetaSlot, Op};

use index::{GroupLog, Liveness};
use record::{RECORD_PAYLOAD_MAX, Record};

/// Default size of a segment.
pub const WAL_SEGMENT_BYTES: u64 = 64 * 1024 * 1024;
/// Largest segment size accepted (locations hold 32-bit offsets).
pub const WAL_SEGMENT_BYTES_MAX: u64 = 1024 * 1024 * 1024;
/// Smallest segment size accepted (tests use small segments to roll often).
pub const WAL_SEGMENT_BYTES_MIN: u64 = 4096;
/// Bytes waiting for the writer at most; a write past it waits for the writer to take them
/// (back-pressure, never unbounded memory).
pub const WAL_PENDING_BYTES_MAX: usize = 8 * 1024 * 1024;

/// Bytes of lazy records ([`Wal::write_lazy`]) staged at most before they ask for a round of
/// their own (so they never fill [`WAL_PENDING_BYTES_MAX`] and hold writes back).
pub const LAZY_PENDING_BYTES_MAX: usize = WAL_PENDING_BYTES_MAX / 2;

/// Bytes of bodies one round of [`Wal::rewrite_bodies`] reads and appends again at most (a
/// group's copied bodies in one segment can be the whole segment).
pub const REWRITE_BATCH_BYTES: usize = WAL_PENDING_BYTES_MAX / 4;

/// How a WAL is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WalOptions {
    /// Bytes of a segment, between [`WAL_SEGMENT_BYTES_MIN`] and [`WAL_SEGMENT_BYTES_MAX`].
    pub segment_bytes: u64,
}

impl Default for WalOptions {
    fn default() -> Self {
        Self {
            segment_bytes: WAL_SEGMENT_BYTES,
        }
    }
}

/// Told whether a write is durable. It runs on the writer's thread: it must not write to the
/// WAL itself (a write waiting for room would wait for the writer it is running on).
pub type Done = Box<dyn FnOnce(Result<(), WalError>) + Send>;

/// Counters of the WAL (for tests, metrics and the capacity figures).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WalStats {
    /// Rounds the writer synced (one fdatasync each, or one per segment it spanned).
    pub rounds: u64,
    /// Writes made durable.
    pub writes: u64,
    /// Bytes written.
    pub bytes: u64,
    /// Segments freed.
    pub freed: u64,
    /// Segments present (the active one included).
    pub segments: usize,
    /// Groups present.
    pub groups: usize,
}

/// A group as the WAL holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupView {
    /// First live entry's index.
    pub first: Option<u64>,
    /// Last live entry's index.
    pub last: Option<u64>,
    /// Metadata and purge point.
    pub state: GroupState,
    /// Live copied-out bodies.
    pub bodies: usize,
}

/// One segment as the WAL tracks it.
#[derive(Debug)]
struct Segment {
    /// Its file, once the writer made it.
    file: Option<Arc<File>>,
    /// Live entries and bodies in it.
    live: u64,
    /// Bytes of it that are durable (and readable from the file).
    synced: u64,
    /// Its length once sealed.
    sealed_len: Option<u64>,
}

impl Liveness for BTreeMap<u32, Segment> {
    fn hold(&mut self, segment: u32) {
        if let Some(s) = self.get_mut(&segment) {
            s.live += 1;
        }
    }

    fn release(&mut self, segment: u32) {
        if let Some(s) = self.get_mut(&segment) {
            debug_assert!(s.live > 0, "segment {segment} released more than it held");
            s.live = s.live.saturating_sub(1);
        }
    }
}

/// Bytes of one segment waiting for (or in) a write.
#[derive(Debug, Clone)]
struct Chunk {
    segment: u32,
    start: u64,
    bytes: Arc<Vec<u8>>,
}

impl Chunk {
    fn end(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }

    /// The record at `loc`, if this chunk holds it whole.
    fn record(&self, loc: Loc) -> Option<Bytes> {
        if loc.segment != self.segment
            || u64::from(loc.offset) < self.start
            || loc.end() > self.end()
        {
            return None;
        }
        let at = (u64::from(loc.offset) - self.start) as usize;
        Some(Bytes::copy_from_slice(
            &self.bytes[at..at + loc.len as usize],
        ))
    }
}

struct State {
    groups: HashMap<u64, GroupLog>,
    segments: BTreeMap<u32, Segment>,
    /// The segment written to.
    active: u32,
    /// Offset of `tail[0]` in the active segment.
    tail_start: u64,
    /// Where the active segment's head (header and groups' states) ends.
    active_head: u64,
    /// Records not yet taken by the writer.
    tail: Vec<u8>,
    /// Chunks of sealed segments not yet taken by the writer.
    closed: Vec<Chunk>,
    /// Chunks the writer is writing: read from here until synced.
    inflight: Vec<Chunk>,
    /// Callbacks of the writes in `tail` and `closed`.
    waiting: Vec<Done>,
    /// Segments freed whose files the writer has yet to recycle.
    to_free: Vec<u32>,
    /// Why nothing more is written.
    stopped: Option<Arc<str>>,
    closing: bool,
    stats: WalStats,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("groups", &self.groups.len())
            .field("segments", &self.segments)
            .field("active", &self.active)
            .field("tail_start", &self.tail_start)
            .field("tail", &self.tail.len())
            .field("waiting", &self.waiting.len())
            .field("stopped", &self.stopped)
            .finish_non_exhaustive()
    }
}

impl State {
    fn tail_end(&self) -> u64 {
        self.tail_start + self.tail.len() as u64
    }

    fn pending_bytes(&self) -> usize {
        self.tail.len() + self.closed.iter().map(|c| c.bytes.len()).sum::<usize>()
    }

    /// Whether the writer has a round to make: a write waits for one, a sealed segment or a
    /// freed one waits, or staged bytes pile up. Lazy records alone ask for none (they ride
    /// with the next write) unless the WAL is closing or they grow past half the bound.
    fn has_work(&self) -> bool {
        !self.waiting.is_empty()
            || !self.closed.is_empty()
            || !self.to_free.is_empty()
            || (!self.tail.is_empty()
                && (self.closing || self.pending_bytes() >= LAZY_PENDING_BYTES_MAX))
    }

    /// Seal the active segment and start the next, its head carrying every group's state.
    fn roll(&mut self) -> Result<(), WalError> {
        let next = self
            .active
            .checked_add(1)
            .ok_or(WalError::SegmentsExhausted)?;
        let seq = u64::from(self.active);
        record::encode_seal(&mut self.tail, seq, u64::from(next));
        let sealed_len = self.tail_end();
        if let Some(s) = self.segments.get_mut(&self.active) {
            s.sealed_len = Some(sealed_len);
        }
        let bytes = Arc::new(std::mem::take(&mut self.tail));
        self.closed.push(Chunk {
            segment: self.active,
            start: self.tail_start,
            bytes,
        });
        self.start_segment(next);
        Ok(())
    }

    /// Make `seq` the active segment (its file is made by the writer) and write its head.
    fn start_segment(&mut self, seq: u32) {
        self.segments.insert(
            seq,
            Segment {
                file: None,
                live: 0,
                synced: 0,
                sealed_len: None,
            },
        );
        self.active = seq;
        self.tail_start = 0;
        self.tail = segment::header(u64::from(seq)).to_vec();
        let mut groups: Vec<_> = self.groups.iter().collect();
        groups.sort_unstable_by_key(|(id, _)| **id);
        for (id, g) in groups {
            record::encode_state(&mut self.tail, u64::from(seq), *id, &g.state());
        }
        self.active_head = self.tail.len() as u64;
    }

    /// Free the oldest segments that nothing needs any more (see the module's invariants).
    fn free_segments(&mut self) {
        loop {
            let mut oldest = self.segments.iter();
            let (Some((&seq, s)), Some((_, after))) = (oldest.next(), oldest.next()) else {
                return;
            };
            let written = s.sealed_len.is_some_and(|len| s.synced >= len);
            if seq == self.active || s.live > 0 || !written || after.synced == 0 {
                return;
            }
            self.segments.remove(&seq);
            self.to_free.push(seq);
            self.stats.freed += 1;
        }
    }

    /// The record at `loc` from the writer's buffers, if it is not yet synced.
    fn buffered(&self, loc: Loc) -> Option<Bytes> {
        if u64::from(loc.offset) >= self.tail_start && loc.segment == self.active {
            let at = (u64::from(loc.offset) - self.tail_start) as usize;
            return self
                .tail
                .get(at..at + loc.len as usize)
                .map(Bytes::copy_from_slice);
        }
        self.closed
            .iter()
            .chain(self.inflight.iter())
            .find_map(|c| c.record(loc))
    }
}

struct Shared {
    dir: PathBuf,
    options: WalOptions,
    state: Mutex<State>,
    /// The writer waits here for work.
    work: Condvar,
    /// Writers past [`WAL_PENDING_BYTES_MAX`] wait here for room.
    room: Condvar,
}

/// The write-ahead log of a node. Dropping it writes what was submitted and stops the writer.
pub struct Wal {
    shared: Arc<Shared>,
    writer: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Wal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wal")
            .field("dir", &self.shared.dir)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Wal {
    /// Open the WAL in `dir` (created if missing), replaying its segments, and start its
    /// writer.
    ///
    /// # Errors
    /// When a file call fails, or a segment is damaged where it cannot be a torn tail.
    pub fn open(dir: &Path, options: WalOptions) -> Result<Self, WalError> {
        let options = WalOptions {
            segment_bytes: options
                .segment_bytes
                .clamp(WAL_SEGMENT_BYTES_MIN, WAL_SEGMENT_BYTES_MAX),
        };
        std::fs::create_dir_all(dir)
            .map_err(|e| WalError::io("create the log directory", dir, e))?;
        let mut state = State {
            groups: HashMap::new(),
            segments: BTreeMap::new(),
            active: 0,
            tail_start: 0,
            active_head: 0,
            tail: Vec::new(),
            closed: Vec::new(),
            inflight: Vec::new(),
            waiting: Vec::new(),
            to_free: Vec::new(),
            stopped: None,
            closing: false,
            stats: WalStats::default(),
        };
        let last = recover::recover(dir, &mut state)?;
        let next = last.map_or(Ok(1), |l| {
            l.checked_add(1).ok_or(WalError::SegmentsExhausted)
        })?;
        state.start_segment(next);
        state.free_segments();
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            options,
            state: Mutex::new(state),
            work: Condvar::new(),
            room: Condvar::new(),
        });
        let writer = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("wal-writer".into())
                .spawn(move || writer::run(&shared))
                .map_err(|e| WalError::io("start the log writer", dir, e))?
        };
        shared.work.notify_one();
        Ok(Self {
            shared,
            writer: Some(writer),
        })
    }

    /// Write `ops` of `group` in order, then call `done` once they are durable (on the
    /// writer's thread). They are visible to reads when this returns. A refused write
    /// (an append out of order, a record too large) writes nothing and calls `done` with the
    /// error before returning.
    pub fn write(&self, group: u64, ops: &[Op], done: Done) {
        match self.stage(group, ops) {
            Ok(mut state) => {
                state.waiting.push(done);
                drop(state);
                self.shared.work.notify_one();
            }
            Err(e) => done(Err(e)),
        }
    }

    /// Stage `ops` of `group` without asking for a round of their own: they are visible to
    /// reads when this returns and become durable with the next round another write asks
    /// for (or when the WAL closes). For records whose loss in a crash costs only work to
    /// redo, such as a group's committed index: a round (a pwrite and an fdatasync) for each
    /// of them would double the rounds of a lightly loaded group. Records staged later are
    /// never durable before these (the tail is written in order).
    ///
    /// # Errors
    /// As [`Wal::write`]: a refused write stages nothing.
    pub fn write_lazy(&self, group: u64, ops: &[Op]) -> Result<(), WalError> {
        let state = self.stage(group, ops)?;
        let asks = state.has_work();
        drop(state);
        if asks {
            self.shared.work.notify_one();
        }
        Ok(())
    }

    /// Write `ops` of `group` and wait until they are durable.
    ///
    /// # Errors
    /// As [`Wal::write`]'s callback.
    pub fn write_and_wait(&self, group: u64, ops: &[Op]) -> Result<(), WalError> {
        check_sizes(ops)?;
        self.stage_and_wait(|state| stage_locked(state, self.shared.options, group, ops))
    }

    /// Run `stage` under the lock once there is room for a write, then wait until what it
    /// staged is durable. Returns what `stage` returned.
    fn stage_and_wait<R>(
        &self,
        stage: impl FnOnce(&mut State) -> Result<R, WalError>,
    ) -> Result<R, WalError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let staged = {
            let mut state = self.lock_for_write()?;
            let staged = stage(&mut state)?;
            state.waiting.push(Box::new(move |r| {
                // The receiver waits below; a send fails only if it is gone.
                let _ = tx.send(r);
            }));
            staged
        };
        self.shared.work.notify_one();
        rx.recv()
            .unwrap_or_else(|_| Err(WalError::Stopped("the log's writer stopped".into())))?;
        Ok(staged)
    }

    /// Encode and index `ops`; the lock is returned so the caller queues its callback with
    /// the records.
    fn stage(
        &self,
        group: u64,
        ops: &[Op],
    ) -> Result<parking_lot::MutexGuard<'_, State>, WalError> {
        check_sizes(ops)?;
        let mut state = self.lock_for_write()?;
        stage_locked(&mut state, self.shared.options, group, ops)?;
        Ok(state)
    }

    /// The lock, once there is room for a write (or the error that stopped the WAL).
    fn lock_for_write(&self) -> Result<parking_lot::MutexGuard<'_, State>, WalError> {
        let mut state = self.shared.state.lock();
        while state.stopped.is_none() && state.pending_bytes() > WAL_PENDING_BYTES_MAX {
            self.shared.room.wait(&mut state);
        }
        if let Some(why) = &state.stopped {
            return Err(WalError::Stopped(Arc::clone(why)));
        }
        Ok(state)
    }

    /// The oldest segment other than the active one (None: the active one is all there is).
    #[must_use]
    pub fn oldest_segment(&self) -> Option<u32> {
        let state = self.shared.state.lock();
        let (&oldest, _) = state.segments.first_key_value()?;
        (oldest != state.active).then_some(oldest)
    }

    /// Append `group`'s live bodies that are in `segment` again, so that they stop pinning it
    /// (a body copied out of purged entries stays live until its message goes, however old its
    /// segment grows). Batches of at most [`REWRITE_BATCH_BYTES`], each durable before the next
    /// is read. A body dropped or replaced between the read and the write is left as it is.
    /// Returns how many were appended again.
    ///
    /// # Errors
    /// When a read fails or a record does not verify, or the write fails.
    pub fn rewrite_bodies(&self, group: u64, segment: u32) -> Result<usize, WalError> {
        let mut moved = 0;
        loop {
            let (batch, planned) = {
                let state = self.shared.state.lock();
                if segment == state.active {
                    return Ok(moved);
                }
                let Some(g) = state.groups.get(&group) else {
                    return Ok(moved);
                };
                let mut locs: Vec<(u64, Loc)> =
                    g.bodies().filter(|(_, l)| l.segment == segment).collect();
                if locs.is_empty() {
                    return Ok(moved);
                }
                locs.sort_unstable_by_key(|(_, l)| l.offset);
                let mut bytes = 0;
                let take = locs
                    .iter()
                    .take_while(|(_, l)| {
                        let first = bytes == 0;
                        bytes += l.len as usize;
                        first || bytes <= REWRITE_BATCH_BYTES
                    })
                    .count();
                locs.truncate(take);
                let planned = locs
                    .iter()
                    .map(|(_, l)| read::plan(&state, *l))
                    .collect::<Result<Vec<_>, _>>()?;
                (locs, planned)
            };
            let records = read::read(&self.shared.dir, planned)?;
            let mut ops = Vec::with_capacity(batch.len());
            for (&(key, loc), record) in batch.iter().zip(records) {
                match record {
                    Record::Op(Op::Body { key: k, data }) if k == key => {
                        ops.push((loc, Op::Body { key, data }));
                    }
                    other => {
                        return Err(self.corrupt(format!("a body's location holds {other:?}")));
                    }
                }
            }
            moved += self.stage_and_wait(|state| {
                // Under the lock a drop or a newer copy cannot come between the check and the
                // append: only bodies still where they were read go again.
                let still: Vec<Op> = ops
                    .into_iter()
                    .filter(|(loc, op)| match op {
                        Op::Body { key, .. } => state
                            .groups
                            .get(&group)
                            .and_then(|g| g.body(*key))
                            .is_some_and(|now| now == *loc),
                        _ => false,
                    })
                    .map(|(_, op)| op)
                    .collect();
                stage_locked(state, self.shared.options, group, &still)?;
                Ok(still.len())
            })?;
        }
    }

    /// The group, if the WAL holds anything of it.
    #[must_use]
    pub fn group(&self, group: u64) -> Option<GroupView> {
        let state = self.shared.state.lock();
        state.groups.get(&group).map(|g| GroupView {
            first: g.first_index(),
            last: g.last_index(),
            state: g.state(),
            bodies: g.bodies().count(),
        })
    }

    /// The index `group`'s next append takes (None: the WAL holds nothing of it).
    #[must_use]
    pub fn next_index(&self, group: u64) -> Option<u64> {
        self.shared
            .state
            .lock()
            .groups
            .get(&group)
            .map(GroupLog::next_index)
    }

    /// `group`'s last live entry's index.
    #[must_use]
    pub fn last_index(&self, group: u64) -> Option<u64> {
        let state = self.shared.state.lock();
        state.groups.get(&group).and_then(GroupLog::last_index)
    }

    /// `group`'s metadata slot.
    #[must_use]
    pub fn meta(&self, group: u64, slot: MetaSlot) -> Option<Bytes> {
        let state = self.shared.state.lock();
        state.groups.get(&group).and_then(|g| g.meta(slot))
    }

    /// Every group the WAL holds.
    #[must_use]
    pub fn groups(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.shared.state.lock().groups.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// The entries of `group` in `range` (those that are live), in order.
    ///
    /// # Errors
    /// When a read fails or a record does not verify.
    pub fn entries(
        &self,
        group: u64,
        range: impl RangeBounds<u64>,
    ) -> Result<Vec<(u64, Bytes)>, WalError> {
        let planned = {
            let state = self.shared.state.lock();
            let Some(g) = state.groups.get(&group) else {
                return Ok(Vec::new());
            };
            let (Some(first), Some(last)) = (g.first_index(), g.last_index()) else {
                return Ok(Vec::new());
            };
            let start = match range.start_bound() {
                Bound::Included(i) => (*i).max(first),
                Bound::Excluded(i) => i.saturating_add(1).max(first),
                Bound::Unbounded => first,
            };
            let end = match range.end_bound() {
                Bound::Included(i) => (*i).min(last),
                Bound::Excluded(i) => i.saturating_sub(1).min(last),
                Bound::Unbounded => last,
            };
            if start > end {
                return Ok(Vec::new());
            }
            (start..=end)
                .filter_map(|i| g.entry(i))
                .map(|loc| read::plan(&state, loc))
                .collect::<Result<Vec<_>, _>>()?
        };
        let records = read::read(&self.shared.dir, planned)?;
        records
            .into_iter()
            .map(|r| match r {
                Record::Op(Op::Append { index, data }) => Ok((index, data)),
                other => Err(self.corrupt(format!("an entry's location holds {other:?}"))),
            })
            .collect()
    }

    /// The entry of `group` at `index`, if live.
    ///
    /// # Errors
    /// As [`Wal::entries`].
    pub fn entry(&self, group: u64, index: u64) -> Result<Option<Bytes>, WalError> {
        Ok(self.entries(group, index..=index)?.pop().map(|(_, d)| d))
    }

    /// The body of `group` under `key`, if live.
    ///
    /// # Errors
    /// As [`Wal::entries`].
    pub fn body(&self, group: u64, key: u64) -> Result<Option<Bytes>, WalError> {
        let planned = {
            let state = self.shared.state.lock();
            let Some(loc) = state.groups.get(&group).and_then(|g| g.body(key)) else {
                return Ok(None);
            };
            vec![read::plan(&state, loc)?]
        };
        match read::read(&self.shared.dir, planned)?.pop() {
            Some(Record::Op(Op::Body { data, .. })) => Ok(Some(data)),
            other => Err(self.corrupt(format!("a body's location holds {other:?}"))),
        }
    }

    /// Whether `group` keeps a body under `key`.
    #[must_use]
    pub fn has_body(&self, group: u64, key: u64) -> bool {
        let state = self.shared.state.lock();
        state.groups.get(&group).and_then(|g| g.body(key)).is_some()
    }

    /// The keys of `group`'s bodies in `range`, ascending.
    #[must_use]
    pub fn body_keys(&self, group: u64, range: impl RangeBounds<u64>) -> Vec<u64> {
        let state = self.shared.state.lock();
        let mut keys: Vec<u64> = state.groups.get(&group).map_or_else(Vec::new, |g| {
            g.bodies()
                .map(|(k, _)| k)
                .filter(|k| range.contains(k))
                .collect()
        });
        keys.sort_unstable();
        keys
    }

    /// The oldest segment other than the active one and the groups with live entries or bodies
    /// in it: what keeps it (and every newer one) from being freed.
    #[must_use]
    pub fn pinning(&self) -> Option<(u32, Vec<u64>)> {
        let state = self.shared.state.lock();
        let (&oldest, _) = state.segments.first_key_value()?;
        if oldest == state.active {
            return None;
        }
        let mut groups: Vec<u64> = state
            .groups
            .iter()
            .filter(|(_, g)| g.pins(oldest))
            .map(|(id, _)| *id)
            .collect();
        groups.sort_unstable();
        Some((oldest, groups))
    }

    /// The counters.
    #[must_use]
    pub fn stats(&self) -> WalStats {
        let state = self.shared.state.lock();
        WalStats {
            segments: state.segments.len(),
            groups: state.groups.len(),
            ..state.stats
        }
    }

    fn corrupt(&self, detail: String) -> WalError {
        WalError::Corrupt {
            path: self.shared.dir.clone(),
            offset: 0,
            detail,
        }
    }
}

/// Refuse a write holding a record larger than a record may be.
fn check_sizes(ops: &[Op]) -> Result<(), WalError> {
    for op in ops {
        let l = record::op_len(op);
        if l - record::RECORD_HEADER > RECORD_PAYLOAD_MAX {
            return Err(WalError::TooLarge(l));
        }
    }
    Ok(())
}

/// Encode and index `ops` of `group` (their sizes checked) into the tail.
fn stage_locked(
    state: &mut State,
    options: WalOptions,
    group: u64,
    ops: &[Op],
) -> Result<(), WalError> {
    let len: usize = ops.iter().map(record::op_len).sum();
    let mut expect = state
        .groups
        .get(&group)
        .map(GroupLog::expect)
        .unwrap_or_default();
    for op in ops {
        expect.follow(op).map_err(|e| WalError::OutOfOrder {
            group,
            index: e.index,
            expected: e.expected,
        })?;
    }
    // A segment holds at least one write after its head, however large.
    let seal = record::RECORD_HEADER + 8;
    if state.tail_end() > state.active_head
        && state.tail_end() + (len + seal) as u64 > options.segment_bytes
    {
        state.roll()?;
    }
    let seq = u64::from(state.active);
    // Exactly what the write needs: growing by doubling would hold up to twice a large
    // write (a snapshot's batch of bodies) until the writer takes it.
    state.tail.reserve_exact(len);
    let State {
        groups,
        segments,
        tail,
        tail_start,
        active,
        ..
    } = state;
    let g = groups.entry(group).or_insert_with(GroupLog::new);
    for op in ops {
        let offset = *tail_start + tail.len() as u64;
        record::encode_op(tail, seq, group, op);
        let loc = Loc {
            segment: *active,
            // Offsets stay below WAL_SEGMENT_BYTES_MAX plus one record (checked above).
            offset: u32::try_from(offset).unwrap_or(u32::MAX),
            len: u32::try_from(record::op_len(op)).unwrap_or(u32::MAX),
        };
        // Checked above against the same state: an append in order cannot fail here.
        let applied = g.apply(op, loc, segments);
        debug_assert!(applied.is_ok(), "{applied:?}");
    }
    if ops.iter().any(|op| matches!(op, Op::Forget)) {
        groups.remove(&group);
    }
    state.free_segments();
    Ok(())
}

impl Drop for Wal {
    fn drop(&mut self) {
        self.shared.state.lock().closing = true;
        self.shared.work.notify_one();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}
