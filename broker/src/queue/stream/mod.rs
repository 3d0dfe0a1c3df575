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

mod consume;
mod offsets;
mod record;
mod replicated;

pub use record::{decode, encode, filter_value};

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

use crate::stream::disk::StreamDisk;
use crate::stream::log::{Lag, StreamConfig};
use crate::stream::reader::{ConsumeSpec, Cursor};
use crate::stream::writer::{SharedStream, StreamWriter};

use crate::message::{Message, Outgoing};
use crate::queue::machine::ConsumerId;
use crate::queue::outbox::{Delivery, Outbound};
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
pub struct SnapshotRecord(#[serde(with = "crate::message::codec::raw_bytes")] pub Vec<u8>);

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
}

fn below_release(messages: u64, bytes: u64) -> bool {
    messages < crate::limits::STREAM_PENDING_HIGH / 2
        && bytes < crate::limits::STREAM_PENDING_BYTES_HIGH / 2
}

#[cfg(test)]
mod tests;
