//! A stream as a queue of a vhost: publishes append through the stream's writer (confirmed
//! once durable), consumers read with their own cursors, and an ack gives credit back.
//!
//! Work happens on the threads that cause it, never under a global lock:
//! - a publish submits to the stream's writer thread (its group commit);
//! - when the durable end moves, the writer wakes each *parked* reader (one with credit that
//!   had read everything) by pushing [`Outbound::StreamReady`] into its connection's outbox;
//! - the consumer's own connection task then reads and decodes chunks ([`StreamQueue::pump`])
//!   and writes the deliveries.
//!
//! Decoded chunks are shared by readers through a small cache, so consumers at the same
//! place decode each chunk once. Each delivery carries the message's offset in its
//! `x-stream-offset` header, as RabbitMQ's do.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use bytes::{BufMut, Bytes, BytesMut};
use parking_lot::Mutex;
use warren_amqp::properties::Properties;
use warren_amqp::{AmqpError, ReplyCode};
use warren_store::StoreError;
use warren_store::stream_file::StreamMessage;
use warren_store::writer::Completion;

use super::disk::StreamDisk;
use super::log::{Lag, StreamConfig};
use super::reader::{ConsumeSpec, Cursor};
use super::writer::{SharedStream, StreamWriter};

use crate::message::{Message, Outgoing};
use crate::outbox::{Delivery, Outbound};
use crate::queue::machine::ConsumerId;
use crate::queue::{ConsumerSink, Queue};

/// Decoded chunks a stream keeps for its readers.
pub const DECODED_CACHE_CHUNKS: usize = 8;
/// The header a publisher sets to give a message its filter value.
pub const FILTER_VALUE_HEADER: &str = "x-stream-filter-value";
/// Version of the message record a stream stores per message.
const RECORD_VERSION: u8 = 1;

/// A chunk read back and decoded, as deliveries need it.
#[derive(Debug)]
struct Decoded {
    first: u64,
    /// Each message with its `x-stream-offset` header already added.
    messages: Vec<Arc<Message>>,
    filters: Vec<Option<String>>,
}

impl Decoded {
    fn end(&self) -> u64 {
        self.first + self.messages.len() as u64
    }
}

#[derive(Debug)]
struct Reader {
    cursor: Cursor,
    prefetch: u16,
    name: Option<String>,
    /// The chunk it reads from now.
    chunk: Option<Arc<Decoded>>,
    /// Offsets delivered and not yet acked (at most `prefetch`).
    outstanding: BTreeSet<u64>,
    /// Its name could not be tracked (the stream tracks too many): warned once.
    untracked: bool,
    /// The lowest delivery released unacked: its tracked offset never passes it.
    released: Option<u64>,
}

impl Reader {
    /// The first offset this consumer has not acked.
    fn tracked_next(&self) -> u64 {
        let next = self
            .outstanding
            .first()
            .copied()
            .unwrap_or(self.cursor.next);
        self.released.map_or(next, |r| next.min(r))
    }
}

#[derive(Debug)]
struct ReaderSlot {
    sink: ConsumerSink,
    /// It has credit and had read everything durable: the writer wakes it.
    parked: AtomicBool,
    /// A wake-up is in its outbox already.
    woken: AtomicBool,
    reader: Mutex<Reader>,
}

/// A named consumer's tracked position, for the management API and metrics.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TrackedLag {
    /// The consumer's `x-stream-consumer-name`.
    pub name: String,
    /// The first offset it has not acknowledged.
    pub offset: u64,
    /// How far it is behind.
    pub lag: Lag,
}

/// What a stream reports.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct StreamStats {
    /// Messages it holds.
    pub messages: u64,
    /// Bytes of their records.
    pub bytes: u64,
    /// Its first offset.
    pub first_offset: u64,
    /// The offset the next message gets (durable ones only are readable).
    pub next_offset: u64,
    /// Segment files.
    pub segments: u64,
    /// Attached consumers.
    pub consumers: u64,
    /// Deliveries not yet acknowledged, over all consumers.
    pub unacked: u64,
    /// Messages ever appended since the broker started.
    pub published: u64,
    /// Deliveries since the broker started.
    pub delivered: u64,
    /// Every tracked consumer name with its lag.
    pub tracked: Vec<TrackedLag>,
}

/// A stream queue's state on this node. See the module documentation.
pub struct StreamQueue {
    owner: Weak<Queue>,
    /// RabbitMQ's `queue 'q' in vhost '/'`.
    what: String,
    dir: PathBuf,
    writer: Mutex<Option<StreamWriter>>,
    shared: Arc<SharedStream>,
    readers: Mutex<HashMap<ConsumerId, Arc<ReaderSlot>>>,
    cache: Mutex<VecDeque<Arc<Decoded>>>,
    table_depth_max: usize,
    published: AtomicU64,
    delivered: AtomicU64,
    deleted: AtomicBool,
    /// Messages and bytes submitted to the writer and not yet durable (flow control).
    pending: AtomicU64,
    pending_bytes: AtomicU64,
    /// Named consumers cancelled with deliveries outstanding: their later acks still move
    /// their tracked offsets (until every outstanding delivery is acked or released).
    departed: Mutex<HashMap<ConsumerId, Departed>>,
    /// A replica (of a cluster's stream): appends come from its group's committed entries,
    /// and this is the offset the next entry's first message gets, counted from the start of
    /// the log as entries are applied (an entry the files already hold, replayed after a
    /// restart, is skipped).
    replica: Option<Mutex<u64>>,
    /// A replica's named consumers: when each last proposed its offset to the group, and the
    /// newer offset waiting for the next proposal (proposals are at most one per
    /// [`TRACK_PROPOSE_EVERY`] per name; a cancel sends what waits).
    proposals: Mutex<HashMap<String, (std::time::Instant, Option<u64>)>>,
    /// A replica whose files failed to take an append: it applies nothing more.
    failed: AtomicBool,
}

/// A replicated stream's snapshot. Kept on disk it is only where the log was (the stream's
/// files are its state, synced before the snapshot is taken, so Raft may purge the entries
/// it covers); sent to a member that is behind the purged log, it carries the chunks too, and
/// that member appends the ones its files lack ("catches up from segments").
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StreamSnapshot {
    /// The offset the next entry's first message gets.
    pub next: u64,
    /// Tracked consumer offsets.
    pub offsets: Vec<(String, u64)>,
    /// The chunks from the stream's first offset to `next` (in a snapshot being sent).
    pub chunks: Option<Vec<SnapshotChunk>>,
}

/// One chunk of a [`StreamSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SnapshotChunk {
    /// Its first offset.
    pub first: u64,
    /// Its time (the entry's).
    pub timestamp_ms: u64,
    /// Its messages' filter values.
    pub filters: Vec<Option<String>>,
    /// Its messages' records.
    pub records: Vec<SnapshotRecord>,
}

/// A message record in a [`SnapshotChunk`], as one byte string.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SnapshotRecord(#[serde(with = "crate::replication::raw_bytes")] pub Vec<u8>);

/// How often a replicated stream's named consumer proposes its offset to the group at most
/// (each proposal is a log entry on every member).
pub const TRACK_PROPOSE_EVERY: std::time::Duration = std::time::Duration::from_millis(200);

/// A cancelled named consumer's deliveries still unacked.
#[derive(Debug)]
struct Departed {
    name: String,
    outstanding: BTreeSet<u64>,
    /// Where its cursor was: the tracked offset once nothing is outstanding.
    next: u64,
}

impl std::fmt::Debug for StreamQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamQueue")
            .field("what", &self.what)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl StreamQueue {
    /// Open (or create) the stream of `owner` kept in `dir`, and start its writer.
    ///
    /// # Errors
    /// The directory's files do not recover, or the writer thread cannot start.
    pub fn open(
        owner: &Arc<Queue>,
        dir: &Path,
        config: StreamConfig,
        table_depth_max: usize,
    ) -> Result<Arc<Self>, StoreError> {
        let disk = StreamDisk::open(dir, config, crate::timers::wall_ms())?;
        let (writer, shared) = StreamWriter::start(disk, Arc::new(crate::timers::wall_ms))
            .map_err(|e| StoreError::Io {
                context: "starting a stream writer",
                path: dir.to_path_buf(),
                source: e,
            })?;
        Ok(Self::over(
            owner,
            dir,
            shared,
            Some(writer),
            table_depth_max,
        ))
    }

    /// Open (or create) this node's replica of a cluster's stream in `dir`: no writer of its
    /// own, its group's committed entries append ([`StreamQueue::apply_replicated`]); a
    /// ticker thread applies age retention and saves tracked offsets once a [`TICK`] until
    /// the stream is deleted.
    ///
    /// # Errors
    /// The directory's files do not recover, or the ticker cannot start.
    ///
    /// [`TICK`]: super::writer::TICK
    pub fn open_replica(
        owner: &Arc<Queue>,
        dir: &Path,
        config: StreamConfig,
        table_depth_max: usize,
    ) -> Result<Arc<Self>, StoreError> {
        let disk = StreamDisk::open(dir, config, crate::timers::wall_ms())?;
        let stream = Self::over(owner, dir, SharedStream::new(disk), None, table_depth_max);
        let weak = Arc::downgrade(&stream);
        std::thread::Builder::new()
            .name("stream-ticker".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(super::writer::TICK);
                    let Some(s) = weak.upgrade() else { return };
                    if s.is_deleted() {
                        return;
                    }
                    super::writer::tick(&s.shared, crate::timers::wall_ms());
                    s.propose_due();
                }
            })
            .map_err(|e| StoreError::Io {
                context: "starting a stream ticker",
                path: dir.to_path_buf(),
                source: e,
            })?;
        Ok(stream)
    }

    fn over(
        owner: &Arc<Queue>,
        dir: &Path,
        shared: Arc<SharedStream>,
        writer: Option<StreamWriter>,
        table_depth_max: usize,
    ) -> Arc<Self> {
        let replica = writer.is_none().then(|| Mutex::new(0));
        let stream = Arc::new(Self {
            owner: Arc::downgrade(owner),
            what: crate::vhost::rs("queue", &owner.name, &owner.vhost),
            dir: dir.to_path_buf(),
            writer: Mutex::new(writer),
            shared,
            readers: Mutex::new(HashMap::new()),
            cache: Mutex::new(VecDeque::new()),
            table_depth_max,
            published: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
            deleted: AtomicBool::new(false),
            pending: AtomicU64::new(0),
            pending_bytes: AtomicU64::new(0),
            departed: Mutex::new(HashMap::new()),
            replica,
            proposals: Mutex::new(HashMap::new()),
            failed: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&stream);
        stream.shared.set_on_durable(Box::new(move || {
            if let Some(s) = weak.upgrade() {
                s.wake_parked();
            }
        }));
        stream
    }

    /// Apply what a replica's group committed, at the entry's time `at`: its messages
    /// (`Enqueue`s) become one chunk stamped `at`, so every member holds the same offsets and
    /// chunks. Other commands mean nothing to a stream. Replayed entries the files already
    /// hold are skipped.
    pub fn apply_replicated(
        &self,
        at: u64,
        commands: Vec<crate::queue::machine::Command<crate::message::Entry>>,
    ) -> crate::replication::Replies {
        use crate::queue::machine::{Command, Reply};
        let mut messages = Vec::new();
        let mut replies = Vec::with_capacity(commands.len());
        let mut tracked = Vec::new();
        for c in commands {
            match c {
                Command::Enqueue(crate::message::Entry::Mem(m)) => {
                    messages.push(StreamMessage {
                        filter_value: filter_value(&m.properties),
                        body: encode(&m),
                    });
                }
                Command::TrackOffset { name, next } => tracked.push((name, next)),
                _ => {}
            }
            replies.push(Ok(Reply::Ok));
        }
        let Some(replay) = &self.replica else {
            return replies;
        };
        if !tracked.is_empty() {
            let mut disk = self.shared.disk.lock();
            for (name, next) in &tracked {
                // A name the log cannot track is refused alike on every member.
                let _ = disk.store_offset(name, *next);
            }
            drop(disk);
            self.shared.offsets_changed();
        }
        if messages.is_empty() || self.is_deleted() || self.failed.load(Ordering::Acquire) {
            return replies;
        }
        let k = messages.len() as u64;
        let mut expected = replay.lock();
        let appended = {
            let mut disk = self.shared.disk.lock();
            let held = disk.log().next_offset();
            if *expected + k <= held {
                // Applied before a restart: the files hold it.
                *expected += k;
                return replies;
            }
            if *expected != held {
                tracing::error!(stream = %self.what, expected = *expected, held, "a stream replica's files do not match its log; appending where they end");
            }
            self.published.fetch_add(k, Ordering::Relaxed);
            disk.append(at, &messages)
        };
        match appended {
            Ok(range) => {
                *expected = range.end;
                drop(expected);
                self.shared.advance(range.end);
            }
            Err(e) => {
                // The files' tail is unknown now: this member stops applying until it is
                // restarted (its log replays into files reopened from disk). The entry is
                // committed in the group: the other members hold it.
                tracing::error!(stream = %self.what, error = %e, "a stream replica cannot append; it stops applying until restarted");
                self.failed.store(true, Ordering::Release);
            }
        }
        replies
    }

    /// A replica's snapshot: its files synced, where its log is, the tracked offsets.
    ///
    /// # Errors
    /// The files could not be synced (the snapshot must not let Raft purge what they lack).
    pub fn snapshot(&self) -> Result<StreamSnapshot, StoreError> {
        let expected = self.replica.as_ref().map_or(0, |r| *r.lock());
        let disk = self.shared.disk.lock();
        disk.sync()?;
        Ok(StreamSnapshot {
            next: expected,
            offsets: disk
                .log()
                .stored_offsets()
                .map(|(n, o)| (n.to_string(), o))
                .collect(),
            chunks: None,
        })
    }

    /// `snapshot` with the chunks it covers, read from the files (to send to a member behind
    /// the purged log).
    ///
    /// # Errors
    /// A chunk could not be read.
    pub fn expand(&self, mut snapshot: StreamSnapshot) -> Result<StreamSnapshot, StoreError> {
        let disk = self.shared.disk.lock();
        let firsts: Vec<(u64, u64)> = disk
            .log()
            .chunks()
            .filter(|(_, c)| c.first < snapshot.next)
            .map(|(_, c)| (c.first, c.timestamp_ms))
            .collect();
        let mut chunks = Vec::with_capacity(firsts.len());
        for (first, timestamp_ms) in firsts {
            let Some((_, messages)) = disk.read_chunk(first)? else {
                return Err(StoreError::Replication(format!(
                    "chunk {first} of a stream snapshot is gone"
                )));
            };
            chunks.push(SnapshotChunk {
                first,
                timestamp_ms,
                filters: messages.iter().map(|m| m.filter_value.clone()).collect(),
                records: messages
                    .into_iter()
                    .map(|m| SnapshotRecord(m.body.to_vec()))
                    .collect(),
            });
        }
        snapshot.chunks = Some(chunks);
        Ok(snapshot)
    }

    /// Take a snapshot's state: where the log is and the tracked offsets, and, from a sent
    /// snapshot, the chunks the files lack (the files are reset first if they end before the
    /// snapshot's first chunk).
    ///
    /// # Errors
    /// The files could not be written.
    pub fn install(&self, snapshot: StreamSnapshot) -> Result<(), StoreError> {
        let Some(replay) = &self.replica else {
            return Ok(());
        };
        let mut expected = replay.lock();
        let mut disk = self.shared.disk.lock();
        if let Some(chunks) = snapshot.chunks {
            let mut held = disk.log().next_offset();
            tracing::info!(stream = %self.what, held, next = snapshot.next, chunks = chunks.len(), "a stream replica catches up from a snapshot");
            for c in chunks {
                let count = c.records.len() as u64;
                if c.filters.len() != c.records.len() {
                    return Err(StoreError::Replication(
                        "a stream snapshot's chunk does not add up".into(),
                    ));
                }
                if count == 0 || c.first.checked_add(count).is_none_or(|end| end <= held) {
                    continue;
                }
                if c.first != held {
                    // Not a continuation of these files (they end before it, or elsewhere):
                    // start again where the sender's files start.
                    tracing::warn!(stream = %self.what, held, first = c.first, "a stream replica resets its files to a snapshot");
                    disk.reset(c.first)?;
                }
                let messages: Vec<StreamMessage> = c
                    .records
                    .into_iter()
                    .zip(c.filters)
                    .map(|(r, filter_value)| StreamMessage {
                        filter_value,
                        body: Bytes::from(r.0),
                    })
                    .collect();
                held = disk.append(c.timestamp_ms, &messages)?.end;
            }
            disk.sync()?;
        }
        if disk.log().next_offset() < snapshot.next {
            // What the snapshot covers is not here (the sender's retention dropped it, or it
            // came without its data): start again where it ends, so the offsets of what
            // follows agree with every other member's.
            tracing::warn!(stream = %self.what, held = disk.log().next_offset(), next = snapshot.next, "a stream replica resets its files to a snapshot's end");
            disk.reset(snapshot.next)?;
        }
        let held = disk.log().next_offset();
        for (name, next) in &snapshot.offsets {
            let _ = disk.store_offset(name, *next);
        }
        drop(disk);
        *expected = snapshot.next;
        drop(expected);
        self.cache.lock().clear();
        self.shared.advance(held);
        Ok(())
    }

    /// Remove the stream's directory (a deleted replica's ticker).
    fn remove_files(&self) {
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            tracing::warn!(stream = %self.what, error = %e, "a deleted stream's files were not removed");
        }
    }

    /// Append a routed message; `done` runs once it is durable (its confirm) or failed.
    pub fn append(&self, message: &Message, done: Completion) {
        let writer = self.writer.lock().clone().filter(|_| !self.is_deleted());
        let Some(writer) = writer else {
            done(Err(Arc::new(StoreError::Replication(
                "the stream was deleted".into(),
            ))));
            return;
        };
        self.published.fetch_add(1, Ordering::Relaxed);
        let body = encode(message);
        let size = body.len() as u64;
        self.pending.fetch_add(1, Ordering::Relaxed);
        self.pending_bytes.fetch_add(size, Ordering::Relaxed);
        let owner = self.owner.clone();
        writer.submit(
            vec![StreamMessage {
                filter_value: filter_value(&message.properties),
                body,
            }],
            Box::new(move |r| {
                if let Some(q) = owner.upgrade()
                    && let Some(s) = q.stream()
                {
                    let n = s.pending.fetch_sub(1, Ordering::Relaxed).saturating_sub(1);
                    let b = s
                        .pending_bytes
                        .fetch_sub(size, Ordering::Relaxed)
                        .saturating_sub(size);
                    if below_release(n, b) && !below_release(n + 1, b + size) {
                        q.flow_drained();
                    }
                }
                done(r.map(|_| Vec::new()));
            }),
        );
    }

    /// Whether publishers into this stream should pause: its writer is that far behind.
    #[must_use]
    pub fn flow_pressure(&self) -> bool {
        self.pending.load(Ordering::Relaxed) >= crate::limits::STREAM_PENDING_HIGH
            || self.pending_bytes.load(Ordering::Relaxed)
                >= crate::limits::STREAM_PENDING_BYTES_HIGH
    }

    /// Whether paused publishers may go on (below half of the flow limits).
    #[must_use]
    pub fn flow_released(&self) -> bool {
        below_release(
            self.pending.load(Ordering::Relaxed),
            self.pending_bytes.load(Ordering::Relaxed),
        )
    }

    /// Attach consumer `id` with what its basic.consume asked for, at `now_ms`.
    ///
    /// # Errors
    /// The stream was deleted meanwhile (404).
    pub fn consume(
        &self,
        id: ConsumerId,
        spec: &ConsumeSpec,
        prefetch: u16,
        sink: ConsumerSink,
        now_ms: u64,
    ) -> Result<(), AmqpError> {
        if self.deleted.load(Ordering::Acquire) {
            return Err(AmqpError::channel(
                ReplyCode::NotFound,
                format!("no {}", self.what),
            ));
        }
        let cursor = {
            let disk = self.shared.disk.lock();
            let log = disk.log();
            let stored = spec.name.as_deref().and_then(|n| log.stored_offset(n));
            Cursor::attach(log, spec, prefetch, stored, now_ms)
        };
        let slot = Arc::new(ReaderSlot {
            sink,
            parked: AtomicBool::new(false),
            woken: AtomicBool::new(false),
            reader: Mutex::new(Reader {
                cursor,
                prefetch,
                name: spec.name.clone(),
                chunk: None,
                outstanding: BTreeSet::new(),
                untracked: false,
                released: None,
            }),
        });
        {
            // Checked again under the readers' lock: a delete drains them under it.
            let mut readers = self.readers.lock();
            if self.deleted.load(Ordering::Acquire) {
                return Err(AmqpError::channel(
                    ReplyCode::NotFound,
                    format!("no {}", self.what),
                ));
            }
            readers.insert(id, Arc::clone(&slot));
        }
        self.wake(id, &slot);
        Ok(())
    }

    /// Detach consumer `id`. Nothing is removed from a stream; a named consumer's later acks
    /// of what it still holds move its tracked offset as before, and its position stays at
    /// its lowest unacked offset.
    pub fn cancel(&self, id: ConsumerId) {
        let Some(slot) = self.readers.lock().remove(&id) else {
            return;
        };
        let r = slot.reader.lock();
        if let Some(name) = r.name.as_deref().filter(|_| !r.untracked) {
            // What waited for its next proposal goes now.
            self.propose_pending(name);
        }
        if let Some(name) = r.name.clone().filter(|_| !r.untracked)
            && !r.outstanding.is_empty()
        {
            self.departed.lock().insert(
                id,
                Departed {
                    name,
                    outstanding: r.outstanding.clone(),
                    next: r.released.map_or(r.cursor.next, |x| x.min(r.cursor.next)),
                },
            );
        }
    }

    /// Consumer `id` acknowledged the deliveries at `offsets`: their credit comes back, and a
    /// named consumer's tracked offset moves to its lowest offset still unacked.
    pub fn settle(&self, id: ConsumerId, offsets: &[u64]) {
        self.settled(id, offsets, true);
    }

    /// The deliveries at `offsets` of consumer `id` will never be acked (its channel closed):
    /// credit back, and a named consumer's tracked offset stays where it is (they are read
    /// again when it resumes).
    pub fn release(&self, id: ConsumerId, offsets: &[u64]) {
        self.settled(id, offsets, false);
    }

    fn settled(&self, id: ConsumerId, offsets: &[u64], acked: bool) {
        let Some(slot) = self.readers.lock().get(&id).cloned() else {
            self.settle_departed(id, offsets, acked);
            return;
        };
        let starved = {
            let mut r = slot.reader.lock();
            let starved = r.cursor.credit == 0;
            let mut n = 0;
            for o in offsets {
                if r.outstanding.remove(o) {
                    n += 1;
                    if !acked {
                        r.released = Some(r.released.map_or(*o, |x| x.min(*o)));
                    }
                }
            }
            let prefetch = r.prefetch;
            r.cursor
                .settle(u32::try_from(n).unwrap_or(u32::MAX), prefetch);
            if acked && n > 0 {
                let next = r.tracked_next();
                if let Some(name) = r.name.clone().filter(|_| !r.untracked)
                    && !self.track(&name, next)
                {
                    r.untracked = true;
                }
            }
            starved && n > 0
        };
        if starved {
            self.wake(id, &slot);
        }
    }

    fn settle_departed(&self, id: ConsumerId, offsets: &[u64], acked: bool) {
        let mut departed = self.departed.lock();
        let Some(d) = departed.get_mut(&id) else {
            return;
        };
        let mut n = 0;
        for o in offsets {
            if d.outstanding.remove(o) {
                n += 1;
                if !acked {
                    d.next = d.next.min(*o);
                }
            }
        }
        let next = d.outstanding.first().map_or(d.next, |o| d.next.min(*o));
        let name = d.name.clone();
        let last = d.outstanding.is_empty();
        if last {
            departed.remove(&id);
        }
        drop(departed);
        if acked && n > 0 {
            self.track(&name, next);
        }
        if last {
            self.propose_pending(&name);
        }
    }

    /// Record `name`'s tracked offset (here at once; a replica also proposes it to its
    /// group, throttled, so the consumer resumes there on any member); false (warned) if the
    /// stream cannot track it.
    fn track(&self, name: &str, next: u64) -> bool {
        let stored = self.shared.disk.lock().store_offset(name, next);
        match stored {
            Ok(()) => {
                self.shared.offsets_changed();
                if self.replica.is_some() {
                    self.propose(name, next);
                }
                true
            }
            Err(e) => {
                tracing::warn!(stream = %self.what, consumer = %name, error = %e, "offset not tracked");
                false
            }
        }
    }

    /// Propose `name`'s offset to the group now, or keep it for later if the last proposal
    /// was less than [`TRACK_PROPOSE_EVERY`] ago.
    fn propose(&self, name: &str, next: u64) {
        let now = std::time::Instant::now();
        {
            let mut proposals = self.proposals.lock();
            match proposals.get_mut(name) {
                Some((at, pending)) if now.duration_since(*at) < TRACK_PROPOSE_EVERY => {
                    *pending = Some(next);
                    return;
                }
                Some(entry) => *entry = (now, None),
                None => {
                    proposals.insert(name.to_string(), (now, None));
                }
            }
        }
        self.submit_offset(name, next);
    }

    /// Propose what has waited at least [`TRACK_PROPOSE_EVERY`] (the ticker: a consumer
    /// that stopped acking still gets its last offset replicated).
    fn propose_due(&self) {
        let now = std::time::Instant::now();
        let due: Vec<(String, u64)> = self
            .proposals
            .lock()
            .iter_mut()
            .filter(|(_, (at, pending))| {
                pending.is_some() && now.duration_since(*at) >= TRACK_PROPOSE_EVERY
            })
            .filter_map(|(name, (at, pending))| {
                *at = now;
                pending.take().map(|next| (name.clone(), next))
            })
            .collect();
        for (name, next) in due {
            self.submit_offset(&name, next);
        }
    }

    /// Propose what waits for `name`, if anything.
    fn propose_pending(&self, name: &str) {
        let pending = self
            .proposals
            .lock()
            .get_mut(name)
            .and_then(|(at, pending)| {
                *at = std::time::Instant::now();
                pending.take()
            });
        if let Some(next) = pending {
            self.submit_offset(name, next);
        }
    }

    fn submit_offset(&self, name: &str, next: u64) {
        if let Some(q) = self.owner.upgrade()
            && let Some(replica) = q.replica()
        {
            replica.submit(
                vec![crate::queue::machine::Command::TrackOffset {
                    name: name.to_string(),
                    next,
                }],
                Box::new(|_| {}),
            );
        }
    }

    /// Read what consumer `id` may be given now (within its credit). Called by the consumer's
    /// connection task when its [`Outbound::StreamReady`] arrives.
    #[must_use]
    pub fn pump(&self, id: ConsumerId) -> Vec<Delivery> {
        let Some(slot) = self.readers.lock().get(&id).cloned() else {
            return Vec::new();
        };
        let Some(queue) = self.owner.upgrade() else {
            return Vec::new();
        };
        slot.woken.store(false, Ordering::SeqCst);
        let mut out = Vec::new();
        let mut r = slot.reader.lock();
        loop {
            if r.cursor.credit == 0 {
                break;
            }
            let durable = self.shared.durable_next();
            let current = r
                .chunk
                .clone()
                .filter(|c| c.first <= r.cursor.next && r.cursor.next < c.end());
            let chunk = match current {
                Some(c) => c,
                None => {
                    let first = {
                        let disk = self.shared.disk.lock();
                        r.cursor.next_chunk(disk.log(), durable)
                    };
                    let Some(first) = first else {
                        // At the end (or nothing left that can match): park, then look
                        // again, so an append between the two is not missed.
                        slot.parked.store(true, Ordering::SeqCst);
                        if self.shared.durable_next() != durable {
                            slot.parked.store(false, Ordering::SeqCst);
                            continue;
                        }
                        break;
                    };
                    match self.decoded(first) {
                        Ok(Some(c)) => {
                            r.chunk = Some(Arc::clone(&c));
                            c
                        }
                        // Dropped by retention between the two looks: look again.
                        Ok(None) => continue,
                        Err(e) => {
                            // Nothing would wake this reader again: it is cancelled (the
                            // client gets basic.cancel and may consume again).
                            tracing::error!(stream = %self.what, error = %e, "cannot read a stream chunk; its consumer is cancelled");
                            drop(r);
                            self.readers.lock().remove(&id);
                            slot.sink.outbox.push(Outbound::Cancel {
                                channel: slot.sink.channel,
                                consumer: id,
                            });
                            self.delivered
                                .fetch_add(out.len() as u64, Ordering::Relaxed);
                            return out;
                        }
                    }
                }
            };
            let values: Vec<Option<&str>> = chunk.filters.iter().map(Option::as_deref).collect();
            let picks = r.cursor.pick(chunk.first, &values);
            for p in picks {
                r.outstanding.insert(p.offset);
                out.push(Delivery {
                    channel: slot.sink.channel,
                    consumer: id,
                    queue: Arc::clone(&queue),
                    id: p.offset,
                    message: Outgoing::Mem(Arc::clone(&chunk.messages[p.index])),
                    redelivered: false,
                    counted: false,
                    delivery_count: 0,
                });
            }
        }
        drop(r);
        self.delivered
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        out
    }

    /// New retention settings (a policy changed), applied at once.
    pub fn configure(&self, config: StreamConfig) {
        let r = self
            .shared
            .disk
            .lock()
            .configure(crate::timers::wall_ms(), config);
        if let Err(e) = r {
            tracing::error!(stream = %self.what, error = %e, "stream retention failed");
        }
    }

    /// Its retention settings now.
    #[must_use]
    pub fn config(&self) -> StreamConfig {
        self.shared.disk.lock().log().config().clone()
    }

    /// What it holds, its consumers and its tracked consumers' lag at `now_ms`.
    #[must_use]
    pub fn stats(&self, now_ms: u64) -> StreamStats {
        let slots: Vec<Arc<ReaderSlot>> = self.readers.lock().values().cloned().collect();
        let consumers = slots.len() as u64;
        let unacked = slots
            .iter()
            .map(|s| s.reader.lock().outstanding.len() as u64)
            .sum();
        let disk = self.shared.disk.lock();
        let log = disk.log();
        StreamStats {
            messages: log.len(),
            bytes: log.bytes(),
            first_offset: log.first_offset(),
            next_offset: log.next_offset(),
            segments: log.segments().count() as u64,
            consumers,
            unacked,
            published: self.published.load(Ordering::Relaxed),
            delivered: self.delivered.load(Ordering::Relaxed),
            tracked: log
                .stored_offsets()
                .map(|(name, offset)| TrackedLag {
                    name: name.to_string(),
                    offset,
                    lag: log.lag(offset, now_ms),
                })
                .collect(),
        }
    }

    /// Messages it holds.
    #[must_use]
    pub fn stats_len(&self) -> u64 {
        self.shared.disk.lock().log().len()
    }

    /// Attached consumers.
    #[must_use]
    pub fn consumer_count(&self) -> usize {
        self.readers.lock().len()
    }

    /// Save tracked offsets that changed (at shutdown).
    pub fn save_offsets(&self) {
        if let Err(e) = self.shared.save_offsets() {
            tracing::error!(stream = %self.what, error = %e, "saving stream offsets failed");
        }
    }

    /// The stream is deleted: its consumers get basic.cancel, its writer stops and its files
    /// go. Returns how many messages it held.
    pub fn delete(&self) -> u64 {
        let readers: Vec<(ConsumerId, Arc<ReaderSlot>)> = {
            let mut readers = self.readers.lock();
            self.deleted.store(true, Ordering::Release);
            readers.drain().collect()
        };
        for (consumer, slot) in readers {
            slot.sink.outbox.push(Outbound::Cancel {
                channel: slot.sink.channel,
                consumer,
            });
        }
        self.cache.lock().clear();
        let held = self.shared.disk.lock().log().len();
        // The writer finishes what was submitted before (those publishers are answered),
        // then removes the directory as it exits: nothing it still writes can outlive it,
        // and the removal is off this thread (it may hold the vhost's lock).
        self.shared.remove_on_exit();
        let had_writer = self.writer.lock().take().is_some();
        if !had_writer {
            // A replica has no writer to remove them once done; nothing appends after this
            // (applies check `deleted`).
            self.remove_files();
        }
        held
    }

    /// Whether the stream was deleted.
    #[must_use]
    pub fn is_deleted(&self) -> bool {
        self.deleted.load(Ordering::Acquire)
    }

    fn wake(&self, id: ConsumerId, slot: &ReaderSlot) {
        if slot.woken.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(queue) = self.owner.upgrade() {
            slot.sink.outbox.push(Outbound::StreamReady {
                channel: slot.sink.channel,
                consumer: id,
                queue,
            });
        }
    }

    /// The durable end moved: wake every parked reader.
    fn wake_parked(&self) {
        let parked: Vec<(ConsumerId, Arc<ReaderSlot>)> = self
            .readers
            .lock()
            .iter()
            .filter(|(_, s)| s.parked.swap(false, Ordering::SeqCst))
            .map(|(id, s)| (*id, Arc::clone(s)))
            .collect();
        for (id, slot) in parked {
            self.wake(id, &slot);
        }
    }

    /// The chunk starting at `first`, decoded (from the cache, else read and decoded).
    fn decoded(&self, first: u64) -> Result<Option<Arc<Decoded>>, StoreError> {
        if let Some(c) = self.cache.lock().iter().find(|c| c.first == first) {
            return Ok(Some(Arc::clone(c)));
        }
        let read = self.shared.disk.lock().read_chunk(first)?;
        let Some((first, records)) = read else {
            return Ok(None);
        };
        let mut messages = Vec::with_capacity(records.len());
        let mut filters = Vec::with_capacity(records.len());
        for (k, record) in records.into_iter().enumerate() {
            let offset = first + k as u64;
            let message = decode(&record.body, offset, self.table_depth_max).ok_or_else(|| {
                StoreError::Corrupt {
                    path: self.dir.clone(),
                    offset,
                    detail: "a stream message record does not decode".into(),
                }
            })?;
            messages.push(Arc::new(message));
            filters.push(record.filter_value);
        }
        let decoded = Arc::new(Decoded {
            first,
            messages,
            filters,
        });
        let mut cache = self.cache.lock();
        if !cache.iter().any(|c| c.first == first) {
            if cache.len() >= DECODED_CACHE_CHUNKS {
                cache.pop_front();
            }
            cache.push_back(Arc::clone(&decoded));
        }
        Ok(Some(decoded))
    }
}

fn below_release(messages: u64, bytes: u64) -> bool {
    messages < crate::limits::STREAM_PENDING_HIGH / 2
        && bytes < crate::limits::STREAM_PENDING_BYTES_HIGH / 2
}

/// A message's `x-stream-filter-value` header, if it has one (a byte search first: most
/// messages have none, and skip the table parse).
#[must_use]
pub fn filter_value(props: &Properties) -> Option<String> {
    let raw = props.headers_raw()?;
    let key = FILTER_VALUE_HEADER.as_bytes();
    if !raw.windows(key.len()).any(|w| w == key) {
        return None;
    }
    props
        .headers()?
        .inner()
        .get(FILTER_VALUE_HEADER)
        .and_then(crate::args::text_value)
}

/// The record a stream stores for `message`: exchange, routing key, raw properties, body.
#[must_use]
pub fn encode(message: &Message) -> Bytes {
    let (exchange, key) = (message.exchange.as_bytes(), message.routing_key.as_bytes());
    let props = &message.properties.raw;
    let mut b =
        BytesMut::with_capacity(7 + exchange.len() + key.len() + props.len() + message.body.len());
    b.put_u8(RECORD_VERSION);
    // Both are AMQP short strings: at most 255 bytes.
    b.put_u8(u8::try_from(exchange.len()).unwrap_or(u8::MAX));
    b.put_slice(&exchange[..exchange.len().min(255)]);
    b.put_u8(u8::try_from(key.len()).unwrap_or(u8::MAX));
    b.put_slice(&key[..key.len().min(255)]);
    b.put_u32(u32::try_from(props.len()).unwrap_or(u32::MAX));
    b.put_slice(props);
    b.put_slice(&message.body);
    b.freeze()
}

/// The message stored as `record` at `offset`, its properties carrying `x-stream-offset`
/// (None: the record is damaged). The body is shared with the record (no copy).
#[must_use]
pub fn decode(record: &Bytes, offset: u64, table_depth_max: usize) -> Option<Message> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Option<std::ops::Range<usize>> {
        let r = at..at.checked_add(n)?;
        if r.end > record.len() {
            return None;
        }
        at = r.end;
        Some(r)
    };
    if record[take(1)?][0] != RECORD_VERSION {
        return None;
    }
    let n = usize::from(record[take(1)?][0]);
    // Lossy: a name cut at 255 bytes may end inside a character; it must still deliver.
    let exchange = String::from_utf8_lossy(&record[take(n)?]).into_owned();
    let n = usize::from(record[take(1)?][0]);
    let routing_key = String::from_utf8_lossy(&record[take(n)?]).into_owned();
    let len = record[take(4)?].try_into().ok().map(u32::from_be_bytes)?;
    let props = record.slice(take(usize::try_from(len).ok()?)?);
    let body = record.slice(at..);
    let parsed = Properties::parse(props, table_depth_max).ok()?;
    let raw = with_offset_header(&parsed, offset);
    Some(Message {
        exchange,
        routing_key,
        properties: Properties::parse(raw, table_depth_max).ok()?,
        body,
    })
}

/// `props` with an `x-stream-offset` (signed 64-bit, as RabbitMQ sends it) appended to its
/// headers table; a header of that name already there is shadowed (decoders keep the last).
fn with_offset_header(props: &Properties, offset: u64) -> Bytes {
    const KEY: &[u8] = b"x-stream-offset";
    let mut entry = Vec::with_capacity(1 + KEY.len() + 9);
    entry.push(u8::try_from(KEY.len()).unwrap_or(u8::MAX));
    entry.extend_from_slice(KEY);
    entry.push(b'l');
    entry.extend_from_slice(&i64::try_from(offset).unwrap_or(i64::MAX).to_be_bytes());
    let old = props
        .headers_raw()
        .map_or(&[][..], |h| &h[4.min(h.len())..]);
    let mut table = Vec::with_capacity(4 + old.len() + entry.len());
    table.extend_from_slice(
        &u32::try_from(old.len() + entry.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    table.extend_from_slice(old);
    table.extend_from_slice(&entry);
    props.rewrite(&table, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::types::AMQPValue;

    /// A stream queue with no broker around it, its files in `dir` (a replica: no writer).
    fn stream_queue(dir: &Path, replica: bool) -> Arc<Queue> {
        let args = crate::args::table(&[("x-queue-type", AMQPValue::LongString("stream".into()))]);
        let q = Queue::new(
            1,
            "s",
            "/",
            true,
            false,
            None,
            args,
            crate::queue::QueueEnv::default(),
        );
        if replica {
            q.open_stream_replica(dir).expect("open");
        } else {
            q.open_stream(dir, 16).expect("open");
        }
        q
    }

    /// A message with no properties and `body`.
    fn message(body: impl Into<Bytes>) -> Message {
        Message {
            exchange: String::new(),
            routing_key: "s".into(),
            properties: Properties::parse(Bytes::from_static(&[0, 0]), 16).expect("props"),
            body: body.into(),
        }
    }

    fn props(headers: Option<&[(&str, AMQPValue)]>) -> Properties {
        // flags: headers present (bit 13) or nothing; then the table.
        let mut raw = Vec::new();
        match headers {
            Some(h) => {
                raw.extend_from_slice(&(1u16 << 13).to_be_bytes());
                raw.extend_from_slice(&warren_amqp::table::encode_table(&crate::args::table(h)));
            }
            None => raw.extend_from_slice(&0u16.to_be_bytes()),
        }
        Properties::parse(Bytes::from(raw), 16).expect("parse")
    }

    #[test]
    fn a_record_decodes_to_the_message_with_its_offset_header() {
        for headers in [
            None,
            Some(&[("x-stream-filter-value", AMQPValue::LongString("ca".into()))][..]),
        ] {
            let m = Message {
                exchange: "ex".into(),
                routing_key: "rk".into(),
                properties: props(headers),
                body: Bytes::from_static(b"hello"),
            };
            assert_eq!(
                filter_value(&m.properties).as_deref(),
                headers.map(|_| "ca")
            );
            let record = encode(&m);
            let back = decode(&record, 42, 16).expect("decodes");
            assert_eq!(
                (back.exchange.as_str(), back.routing_key.as_str()),
                ("ex", "rk")
            );
            assert_eq!(&back.body[..], b"hello");
            let h = back.properties.headers().expect("headers");
            assert_eq!(
                h.inner().get("x-stream-offset"),
                Some(&AMQPValue::LongLongInt(42))
            );
            if headers.is_some() {
                assert!(h.inner().contains_key("x-stream-filter-value"));
            }
            // A damaged record is refused, never read past its end.
            for cut in [0, 1, 3, 7] {
                assert!(decode(&record.slice(..cut), 0, 16).is_none(), "cut {cut}");
            }
        }
    }

    /// Run `f` to completion on this thread (for the outbox's notification).
    fn block_on<F: std::future::Future>(f: F, deadline: std::time::Instant) -> F::Output {
        struct Unpark(std::thread::Thread);
        impl std::task::Wake for Unpark {
            fn wake(self: Arc<Self>) {
                self.0.unpark();
            }
        }
        let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = std::task::Context::from_waker(&waker);
        let mut f = std::pin::pin!(f);
        loop {
            if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
                return v;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            assert!(!left.is_zero(), "no wake-up in time: a reader stalled");
            std::thread::park_timeout(left);
        }
    }

    /// Publishers on three threads and consumers attached before and during the publishing:
    /// every consumer gets every offset once, in order, within its credit, each message
    /// carrying its own offset; none stalls (the park / wake hand-off loses no append).
    #[test]
    fn concurrent_publishers_and_consumers_see_every_offset_once_in_order() {
        const PER_PUBLISHER: u64 = 300;
        let dir = tempfile::tempdir().expect("tempdir");
        let q = stream_queue(dir.path(), false);
        let stream = Arc::clone(q.stream().expect("opened"));
        let outbox = Arc::new(crate::outbox::Outbox::default());
        let first =
            crate::args::table(&[("x-stream-offset", AMQPValue::LongString("first".into()))]);
        let attach = |id: ConsumerId, prefetch: u16| {
            let spec =
                super::super::reader::consume_spec(&first, prefetch, false, "s").expect("spec");
            let sink = ConsumerSink {
                outbox: Arc::clone(&outbox),
                channel: 1,
                limiter: None,
            };
            stream
                .consume(id, &spec, prefetch, sink, 0)
                .expect("consume");
        };
        attach(1, 5);
        attach(2, 50);
        let publishers: Vec<_> = (0..3)
            .map(|p| {
                let stream = Arc::clone(&stream);
                std::thread::spawn(move || {
                    for k in 0..PER_PUBLISHER {
                        let m = message(format!("p{p}-{k}"));
                        stream.append(&m, Box::new(|r| assert!(r.is_ok())));
                    }
                })
            })
            .collect();
        let total = 3 * PER_PUBLISHER;
        let mut got: HashMap<ConsumerId, Vec<u64>> = HashMap::new();
        let mut items = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let mut late_attached = false;
        while got.values().map(Vec::len).sum::<usize>() < 3 * total as usize || got.len() < 3 {
            if !late_attached && got.get(&1).is_some_and(|g| g.len() > 100) {
                attach(3, 1);
                late_attached = true;
            }
            outbox.drain(&mut items);
            if items.is_empty() {
                block_on(outbox.notified(), deadline);
                continue;
            }
            for item in items.drain(..) {
                let Outbound::StreamReady { consumer, .. } = item else {
                    panic!("only wake-ups are pushed");
                };
                for d in stream.pump(consumer) {
                    let Outgoing::Mem(m) = &d.message else {
                        panic!("stream deliveries are in memory");
                    };
                    let h = m.properties.headers().expect("headers");
                    assert_eq!(
                        h.inner().get("x-stream-offset"),
                        Some(&AMQPValue::LongLongInt(
                            i64::try_from(d.id).expect("offset")
                        ))
                    );
                    got.entry(consumer).or_default().push(d.id);
                    stream.settle(consumer, &[d.id]);
                }
            }
        }
        for p in publishers {
            p.join().expect("publisher");
        }
        for (consumer, offsets) in &got {
            assert_eq!(
                offsets,
                &(0..total).collect::<Vec<_>>(),
                "consumer {consumer}"
            );
        }
        assert_eq!(stream.stats(0).messages, total);
        assert_eq!(stream.stats(0).unacked, 0);
    }

    /// A named consumer's tracked offset is its lowest unacked offset: acks out of order do
    /// not skip, acks after its cancel still count, released deliveries never move it.
    #[test]
    fn tracked_offsets_never_pass_an_unacked_delivery() {
        let dir = tempfile::tempdir().expect("tempdir");
        let q = stream_queue(dir.path(), false);
        let stream = Arc::clone(q.stream().expect("opened"));
        let (tx, rx) = std::sync::mpsc::channel();
        for k in 0..10u8 {
            let m = message(vec![k]);
            let tx = tx.clone();
            stream.append(&m, Box::new(move |r| tx.send(r.is_ok()).expect("send")));
        }
        assert!(rx.iter().take(10).all(|ok| ok));
        let outbox = Arc::new(crate::outbox::Outbox::default());
        let args = crate::args::table(&[
            ("x-stream-offset", AMQPValue::LongString("first".into())),
            ("x-stream-consumer-name", AMQPValue::LongString("c".into())),
        ]);
        let spec = super::super::reader::consume_spec(&args, 5, false, "s").expect("spec");
        let sink = ConsumerSink {
            outbox: Arc::clone(&outbox),
            channel: 1,
            limiter: None,
        };
        stream.consume(7, &spec, 5, sink, 0).expect("consume");
        let got: Vec<u64> = stream.pump(7).iter().map(|d| d.id).collect();
        assert_eq!(got, vec![0, 1, 2, 3, 4]);
        let tracked = || stream.stats(0).tracked.first().map(|t| t.offset);
        stream.settle(7, &[1, 2]);
        assert_eq!(tracked(), Some(0), "0 is still unacked");
        stream.settle(7, &[0]);
        assert_eq!(tracked(), Some(3));
        stream.cancel(7);
        stream.release(7, &[4]);
        assert_eq!(tracked(), Some(3), "a released delivery moves nothing");
        stream.settle(7, &[3]);
        assert_eq!(
            tracked(),
            Some(4),
            "an ack after the cancel counts, up to the released 4"
        );
        stream.settle(7, &[3]);
        assert_eq!(tracked(), Some(4));
    }

    /// A replica appends each committed entry as one chunk at the entry's time; after a
    /// restart the log replays from its start and what the files already hold is skipped,
    /// so offsets stay as every member has them.
    #[test]
    fn a_replica_applies_entries_once_across_a_replay() {
        use crate::message::Entry;
        use crate::queue::machine::Command;
        let dir = tempfile::tempdir().expect("tempdir");
        let entry = |k: u64| {
            (0..3)
                .map(|i| Command::Enqueue(Entry::Mem(Arc::new(message(format!("e{k}-{i}"))))))
                .chain([Command::Cancel(9)])
                .collect::<Vec<_>>()
        };
        let open = || stream_queue(dir.path(), true);
        let q = open();
        for k in 0..4 {
            let replies = q.apply_committed(1000 + k, entry(k));
            assert_eq!(replies.len(), 4, "one reply per command");
        }
        let stream = Arc::clone(q.stream().expect("opened"));
        assert_eq!(stream.stats(0).next_offset, 12);
        // A replicated tracked offset lands in the log of every member.
        q.apply_committed(
            1004,
            vec![Command::TrackOffset {
                name: "c".into(),
                next: 5,
            }],
        );
        assert_eq!(
            stream
                .stats(0)
                .tracked
                .first()
                .map(|t| (t.name.as_str(), t.offset)),
            Some(("c", 5))
        );
        let chunks: Vec<(u64, u64)> = stream
            .shared
            .disk
            .lock()
            .log()
            .chunks()
            .map(|(_, c)| (c.first, c.timestamp_ms))
            .collect();
        assert_eq!(chunks, vec![(0, 1000), (3, 1001), (6, 1002), (9, 1003)]);
        drop(stream);
        drop(q);
        // Restart: the whole log replays, then one more entry.
        let q = open();
        for k in 0..5 {
            q.apply_committed(1000 + k, entry(k));
        }
        let stream = Arc::clone(q.stream().expect("opened"));
        assert_eq!(stream.stats(0).next_offset, 15);
        let (first, messages) = stream
            .shared
            .disk
            .lock()
            .read_chunk(12)
            .expect("read")
            .expect("held");
        assert_eq!(first, 12);
        let m = decode(&messages[1].body, 13, 16).expect("decodes");
        assert_eq!(&m.body[..], b"e4-1");
    }

    /// A member behind the leader's purged log installs the leader's snapshot with its
    /// chunks: it appends what its files lack (from empty, or continuing a prefix), keeps
    /// the chunks' times, and goes on applying entries after it at the same offsets.
    #[test]
    fn a_sent_snapshot_brings_a_member_to_the_same_chunks() {
        use crate::message::Entry;
        use crate::queue::machine::Command;
        let entry = |k: u64| {
            (0..3)
                .map(|i| Command::Enqueue(Entry::Mem(Arc::new(message(format!("e{k}-{i}"))))))
                .collect::<Vec<_>>()
        };
        let chunks = |q: &Arc<Queue>| -> Vec<(u64, u64)> {
            let s = q.stream().expect("opened");
            s.shared
                .disk
                .lock()
                .log()
                .chunks()
                .map(|(_, c)| (c.first, c.timestamp_ms))
                .collect()
        };
        let (da, db, dc) = (
            tempfile::tempdir().expect("tempdir"),
            tempfile::tempdir().expect("tempdir"),
            tempfile::tempdir().expect("tempdir"),
        );
        let (a, b, c) = (
            stream_queue(da.path(), true),
            stream_queue(db.path(), true),
            stream_queue(dc.path(), true),
        );
        for k in 0..5 {
            a.apply_committed(1000 + k, entry(k));
        }
        for k in 0..2 {
            c.apply_committed(1000 + k, entry(k));
        }
        let sa = a.stream().expect("opened");
        let kept = sa.snapshot().expect("snapshot");
        assert_eq!((kept.next, kept.chunks.is_none()), (15, true));
        let sent = sa.expand(kept).expect("expand");
        assert_eq!(sent.chunks.as_ref().map(Vec::len), Some(5));
        for q in [&b, &c] {
            q.stream()
                .expect("opened")
                .install(sent.clone())
                .expect("install");
            assert_eq!(chunks(q), chunks(&a));
            q.apply_committed(1005, entry(5));
        }
        a.apply_committed(1005, entry(5));
        assert_eq!(chunks(&b), chunks(&a));
        assert_eq!(chunks(&c), chunks(&a));
        assert_eq!(b.stream().expect("opened").stats(0).next_offset, 18);
    }

    /// A snapshot whose data is gone (the sender's retention dropped it) still leaves the
    /// member at the snapshot's end, also after a restart, so later offsets agree.
    #[test]
    fn a_snapshot_without_its_chunks_restarts_the_files_at_its_end() {
        use crate::message::Entry;
        use crate::queue::machine::Command;
        let dir = tempfile::tempdir().expect("tempdir");
        let q = stream_queue(dir.path(), true);
        q.apply_committed(
            1000,
            vec![Command::Enqueue(Entry::Mem(Arc::new(message("old"))))],
        );
        let snapshot = StreamSnapshot {
            next: 15,
            offsets: vec![("c".into(), 12)],
            chunks: Some(Vec::new()),
        };
        q.stream()
            .expect("opened")
            .install(snapshot)
            .expect("install");
        assert_eq!(q.stream().expect("opened").stats(0).next_offset, 15);
        drop(q);
        let q = stream_queue(dir.path(), true);
        let s = Arc::clone(q.stream().expect("opened"));
        assert_eq!((s.stats(0).first_offset, s.stats(0).next_offset), (15, 15));
        // After a restart the log replays from the snapshot: its end is where entries go.
        s.install(StreamSnapshot {
            next: 15,
            offsets: Vec::new(),
            chunks: None,
        })
        .expect("install");
        q.apply_committed(
            1001,
            vec![Command::Enqueue(Entry::Mem(Arc::new(message("new"))))],
        );
        assert_eq!(s.stats(0).next_offset, 16);
        let (first, m) = s
            .shared
            .disk
            .lock()
            .read_chunk(15)
            .expect("read")
            .expect("held");
        assert_eq!(first, 15);
        assert_eq!(
            &decode(&m[0].body, 15, 16).expect("decodes").body[..],
            b"new"
        );
    }
}
