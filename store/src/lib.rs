//! Warren's durable store: what a node keeps across restarts and crashes.
//!
//! - **redb** (`meta.redb`) holds the metadata (exchanges, queues, bindings: opaque bytes
//!   encoded by the broker) and the message index: one small record per (queue, message id)
//!   pointing at the message's record in a segment.
//! - **Segment files** (`segments/*.seg`) hold message records, appended by one writer,
//!   checksummed, shared by all queues: a message routed to N durable queues is written once
//!   and referenced N times. A segment is deleted when no index record references it.
//!
//! One [`Store`] is owned by one writer (the group-commit thread). [`Store::commit`] makes a
//! whole [`Batch`] durable with one segment `fdatasync` and one redb commit: bodies first,
//! then the index that references them, so a committed index record never points at bytes
//! that are not on disk. Readers use the shared [`Segments`] from any thread.
//!
//! The on-disk format is versioned and documented in `docs/storage-format.md`. Opening a
//! directory with another version, a damaged header, or an index that references missing or
//! damaged records refuses to start; uncommitted bytes at the end of a segment (a crash between
//! append and commit) are truncated.

pub mod error;
pub mod histogram;
pub mod index_log;
mod reclaim;
pub mod record;
pub mod segment;
pub mod stream_file;
pub mod wal;
pub mod writer;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use index_log::{
    CHECKPOINT_INTERVAL, CHECKPOINT_OPS_MAX, Checkpoint, replay_index_log, write_checkpoint,
};

pub use error::StoreError;
pub use record::StoredMessage;
pub use segment::{Location, Pinned, Segments};
pub use writer::Writer;

use record::{RECORD_HEADER, RECORD_MAX};
use segment::{ActiveSegment, SEGMENT_HEADER};

/// Version of the data directory layout (redb tables and index encoding). Version 3 logs the
/// index's changes in the segments ([`index_log`]); a version 2 directory is taken as is (its
/// redb commits were all durable) and marked 3.
pub const FORMAT_VERSION: u64 = 3;
/// The version before [`index_log`]: opened and upgraded in place.
const FORMAT_VERSION_UPGRADED: u64 = 2;
/// Default segment size before the writer rolls to a new file.
pub const SEGMENT_MAX_DEFAULT: u64 = 64 * 1024 * 1024;

pub(crate) const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const MESSAGES: TableDefinition<(u64, u64), &[u8]> = TableDefinition::new("messages");
const KEY_FORMAT_VERSION: &str = "format_version";
pub(crate) const KEY_CHECKPOINT_SEGMENT: &str = "checkpoint_segment";
pub(crate) const KEY_CHECKPOINT_OFFSET: &str = "checkpoint_offset";

/// Metadata tables (values are encoded by the broker; the store only keeps bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MetaTable {
    /// Durable exchanges.
    Exchanges,
    /// Durable queues.
    Queues,
    /// Bindings between durable objects.
    Bindings,
    /// Policies.
    Policies,
    /// Users (JSON in RabbitMQ's definitions fields).
    Users,
    /// Permissions per (vhost, user) (JSON).
    Permissions,
    /// Vhosts (key: name; an empty key marks the table as initialised).
    Vhosts,
    /// Topic permissions per (vhost, user, exchange) (JSON).
    TopicPermissions,
    /// Operator policies (JSON, as policies).
    OperatorPolicies,
    /// Keys a queue remembers beside its messages (publish deduplication, redrive moves):
    /// the broker encodes queue id, kind and key in the record's key.
    QueueKeys,
}

impl MetaTable {
    /// All tables, in recovery order.
    pub const ALL: [Self; 10] = [
        Self::Vhosts,
        Self::Users,
        Self::TopicPermissions,
        Self::Permissions,
        Self::Policies,
        Self::OperatorPolicies,
        Self::Exchanges,
        Self::Queues,
        Self::Bindings,
        Self::QueueKeys,
    ];

    /// The table's code in an index log record (never reused).
    pub(crate) fn code(self) -> u8 {
        match self {
            Self::Exchanges => 1,
            Self::Queues => 2,
            Self::Bindings => 3,
            Self::Policies => 4,
            Self::Users => 5,
            Self::Permissions => 6,
            Self::Vhosts => 7,
            Self::TopicPermissions => 8,
            Self::OperatorPolicies => 9,
            Self::QueueKeys => 10,
        }
    }

    /// The table of `code` ([`MetaTable::code`]).
    pub(crate) fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.code() == code)
    }

    fn definition(self) -> TableDefinition<'static, &'static [u8], &'static [u8]> {
        TableDefinition::new(match self {
            Self::Exchanges => "exchanges",
            Self::Queues => "queues",
            Self::Bindings => "bindings",
            Self::Policies => "policies",
            Self::Users => "users",
            Self::Permissions => "permissions",
            Self::Vhosts => "vhosts",
            Self::TopicPermissions => "topic_permissions",
            Self::OperatorPolicies => "operator_policies",
            Self::QueueKeys => "queue_keys",
        })
    }
}

/// The body of an enqueue: written in this batch, or already stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyRef {
    /// Index into [`Batch::bodies`].
    New(usize),
    /// A record already in a segment. The caller must hold another reference to it until this
    /// batch commits (a segment whose references reach zero is deleted).
    Stored(Location),
}

/// One durable change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Insert or replace a metadata record.
    Put {
        /// Table.
        table: MetaTable,
        /// Key.
        key: Vec<u8>,
        /// Value.
        value: Vec<u8>,
    },
    /// Remove a metadata record (absent is fine).
    Delete {
        /// Table.
        table: MetaTable,
        /// Key.
        key: Vec<u8>,
    },
    /// A message enters a queue.
    Enqueue {
        /// Queue id.
        queue: u64,
        /// Message id within the queue.
        id: u64,
        /// Its body.
        body: BodyRef,
        /// Per-message flags kept in the index (the broker keeps the priority here).
        flags: u32,
        /// When the message expires (machine time, ms; 0 = never), so TTLs survive restarts.
        expires_at: u64,
    },
    /// A message leaves a queue (ack, reject, drop). Absent is fine.
    Settle {
        /// Queue id.
        queue: u64,
        /// Message id.
        id: u64,
    },
    /// Remove every message of a queue (queue deleted).
    DropQueue {
        /// Queue id.
        queue: u64,
    },
    /// A message takes a new id in its queue (requeued to the back of the queue, which orders
    /// by id): its index record moves, its body stays where it is. Absent is fine.
    Renumber {
        /// Queue id.
        queue: u64,
        /// The id it had.
        from: u64,
        /// The id it has now.
        to: u64,
    },
}

impl Op {
    /// This op with a new body named by its location among `locations` (the batch's bodies,
    /// in order): what the index log records and what a checkpoint gives redb.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] for an enqueue naming a body the batch does not have.
    pub fn located(&self, locations: &[Location]) -> Result<Op, StoreError> {
        self.clone().map_new_body(|i| {
            locations
                .get(i)
                .map(|l| BodyRef::Stored(*l))
                .ok_or_else(|| StoreError::Corrupt {
                    path: "batch".into(),
                    offset: 0,
                    detail: format!("enqueue names body {i} of {}", locations.len()),
                })
        })
    }

    /// This op with its new body (an enqueue's [`BodyRef::New`], by index in its batch)
    /// named by `f` instead; every other op as it is.
    ///
    /// # Errors
    /// What `f` returns.
    pub fn map_new_body<E>(self, f: impl FnOnce(usize) -> Result<BodyRef, E>) -> Result<Op, E> {
        Ok(match self {
            Op::Enqueue {
                queue,
                id,
                body: BodyRef::New(i),
                flags,
                expires_at,
            } => Op::Enqueue {
                queue,
                id,
                body: f(i)?,
                flags,
                expires_at,
            },
            other => other,
        })
    }
}

/// Work made durable together: one segment sync and one redb commit.
#[derive(Debug, Default, Clone)]
pub struct Batch {
    /// Message bodies to append (referenced from `ops` by index).
    pub bodies: Vec<StoredMessage>,
    /// Changes, applied in order.
    pub ops: Vec<Op>,
}

impl Batch {
    /// Whether there is nothing to write.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.bodies.is_empty() && self.ops.is_empty()
    }
}

/// One indexed message found at recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexedMessage {
    /// Queue id.
    pub queue: u64,
    /// Message id.
    pub id: u64,
    /// Its record.
    pub location: Location,
    /// Flags stored with it.
    pub flags: u32,
    /// Expiry stored with it (0 = never).
    pub expires_at: u64,
}

/// Metadata rows of one table: (key, value) in key order.
pub type MetaRows = Vec<(Vec<u8>, Vec<u8>)>;

/// What a store held when it was opened.
#[derive(Debug, Default)]
pub struct Recovered {
    /// Metadata records per table, in key order.
    pub meta: BTreeMap<MetaTable, MetaRows>,
    /// Indexed messages in (queue, id) order.
    pub messages: Vec<IndexedMessage>,
    /// Bytes of uncommitted segment tails that were truncated.
    pub truncated_bytes: u64,
}

/// Default memory redb may use to cache pages (its own default, 1 GiB, is too much for a
/// broker that promises a small footprint; the index is small and read mostly at start-up).
pub const DB_CACHE_DEFAULT: usize = 32 * 1024 * 1024;

/// Store tuning.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Roll to a new segment beyond this size ([`SEGMENT_MAX_DEFAULT`]).
    pub segment_max: u64,
    /// redb page cache in bytes ([`DB_CACHE_DEFAULT`]).
    pub db_cache: usize,
    /// Longest redb goes without a checkpoint while commits come ([`CHECKPOINT_INTERVAL`]);
    /// zero makes every commit one (tests of prompt reclamation).
    pub checkpoint_interval: std::time::Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            segment_max: SEGMENT_MAX_DEFAULT,
            db_cache: DB_CACHE_DEFAULT,
            checkpoint_interval: CHECKPOINT_INTERVAL,
        }
    }
}

const ENTRY_LEN: usize = 32;

fn encode_entry(loc: Location, flags: u32, expires_at: u64) -> [u8; ENTRY_LEN] {
    let mut e = [0u8; ENTRY_LEN];
    e[0..8].copy_from_slice(&u64::from(loc.segment).to_be_bytes());
    e[8..16].copy_from_slice(&loc.offset.to_be_bytes());
    e[16..20].copy_from_slice(&loc.len.to_be_bytes());
    e[20..24].copy_from_slice(&flags.to_be_bytes());
    e[24..32].copy_from_slice(&expires_at.to_be_bytes());
    e
}

fn decode_entry(e: &[u8]) -> Option<(Location, u32, u64)> {
    if e.len() != ENTRY_LEN {
        return None;
    }
    let u64_at = |i: usize| u64::from_be_bytes(e[i..i + 8].try_into().unwrap_or_default());
    let u32_at = |i: usize| u32::from_be_bytes(e[i..i + 4].try_into().unwrap_or_default());
    Some((
        Location {
            // An id past 32 bits was never written by this store: damaged.
            segment: u32::try_from(u64_at(0)).ok()?,
            offset: u64_at(8),
            len: u32_at(16),
        },
        u32_at(20),
        u64_at(24),
    ))
}

/// The writer's handle on a data directory.
#[derive(Debug)]
pub struct Store {
    db: Database,
    db_path: PathBuf,
    seg_dir: PathBuf,
    segments: Arc<Segments>,
    active: ActiveSegment,
    options: Options,
    /// Index records per segment (committed state).
    refs: HashMap<u64, u64>,
    buf: Vec<u8>,
    reclaimer: reclaim::Reclaimer,
    metrics: Arc<StoreMetrics>,
    /// Where redb's last durable commit left the segments' log.
    checkpoint: Checkpoint,
    last_checkpoint: std::time::Instant,
    /// A commit failed: nothing more is checkpointed (what it appended may not be on disk).
    failed: bool,
    /// Ops made durable in the segments since the checkpoint, new bodies located, in order:
    /// redb's part of them waits for the next checkpoint.
    pending: Vec<Op>,
    /// A segment was sealed since the last checkpoint: the next commit is one.
    rolled: bool,
}

impl Drop for Store {
    fn drop(&mut self) {
        if !self.failed
            && let Err(e) = self.checkpoint()
        {
            tracing::warn!(error = %e, "no checkpoint at close: the next start replays the index log");
        }
    }
}

/// What the store measures about its own commits (exposed as Prometheus histograms).
#[derive(Debug)]
pub struct StoreMetrics {
    /// Duration of each segment `fdatasync` (the bodies' durability point), in seconds.
    pub fsync_seconds: histogram::Histogram,
    /// Duration of each whole commit (append, fdatasync, index transaction), in seconds.
    pub commit_seconds: histogram::Histogram,
    /// Submissions merged into each group commit.
    pub group_commit_batches: histogram::Histogram,
}

impl Default for StoreMetrics {
    fn default() -> Self {
        Self {
            fsync_seconds: histogram::Histogram::new(histogram::LATENCY_BOUNDS),
            commit_seconds: histogram::Histogram::new(histogram::LATENCY_BOUNDS),
            group_commit_batches: histogram::Histogram::new(histogram::COUNT_BOUNDS),
        }
    }
}

impl Store {
    /// Open (or create) the store in `dir` and recover what it holds.
    ///
    /// # Errors
    /// I/O and redb errors, [`StoreError::VersionMismatch`] for another format version, and
    /// [`StoreError::Corrupt`] when a header is damaged or the index references a record that
    /// is missing or fails its checksum.
    pub fn open(dir: &Path, options: Options) -> Result<(Self, Recovered), StoreError> {
        let seg_dir = dir.join("segments");
        std::fs::create_dir_all(&seg_dir)
            .map_err(|e| StoreError::io("create data directory", &seg_dir, e))?;
        let db_path = dir.join("meta.redb");
        let db = Database::builder()
            .set_cache_size(options.db_cache)
            .create(&db_path)
            .map_err(|e| StoreError::db(&db_path, e))?;
        check_version(&db, &db_path)?;

        // 1. Verify every segment (headers, record checksums) in one sequential pass each.
        let ids = segment::list(&seg_dir)?;
        let mut scanned = HashMap::new();
        // A damaged header matters only if the index references the segment: a crash while a
        // new segment's header was written leaves such a file, with nothing committed in it.
        let mut bad_headers: HashMap<u64, StoreError> = HashMap::new();
        for (n, id) in ids.iter().enumerate() {
            let s = match segment::scan(&seg_dir, *id) {
                Ok(s) => s,
                Err(e @ StoreError::Corrupt { .. }) => {
                    bad_headers.insert(*id, e);
                    continue;
                }
                Err(e) => return Err(e),
            };
            if ids.len() > 16 && n % 16 == 0 {
                tracing::info!(
                    segment = id,
                    done = n,
                    total = ids.len(),
                    "recovery: verifying segments"
                );
            }
            scanned.insert(*id, s);
        }

        // 1b. Bring redb to the end of the segments' log: the index log records written after
        // its last durable commit are applied again, then a checkpoint at the start of the
        // segment this open creates is committed.
        let next = ids.last().map_or(1, |id| id + 1);
        let start = Checkpoint {
            segment: next,
            offset: SEGMENT_HEADER,
        };
        let replayed =
            replay_index_log(&db, &db_path, &seg_dir, &ids, &scanned, &bad_headers, start)?;
        if replayed > 0 {
            tracing::info!(
                records = replayed,
                "recovery: index changes replayed from the segments"
            );
        }

        // 2. Read metadata and the index; every indexed record must lie in a verified prefix.
        let mut recovered = Recovered::default();
        let mut refs: HashMap<u64, u64> = HashMap::new();
        {
            let rtx = db.begin_read().map_err(|e| StoreError::db(&db_path, e))?;
            for table in MetaTable::ALL {
                let rows = recovered.meta.entry(table).or_default();
                match rtx.open_table(table.definition()) {
                    Ok(t) => {
                        for row in t.iter().map_err(|e| StoreError::db(&db_path, e))? {
                            let (k, v) = row.map_err(|e| StoreError::db(&db_path, e))?;
                            rows.push((k.value().to_vec(), v.value().to_vec()));
                        }
                    }
                    Err(redb::TableError::TableDoesNotExist(_)) => {}
                    Err(e) => return Err(StoreError::db(&db_path, e)),
                }
            }
            match rtx.open_table(MESSAGES) {
                Ok(t) => {
                    for row in t.iter().map_err(|e| StoreError::db(&db_path, e))? {
                        let (k, v) = row.map_err(|e| StoreError::db(&db_path, e))?;
                        let (queue, id) = k.value();
                        let Some((location, flags, expires_at)) = decode_entry(v.value()) else {
                            return Err(StoreError::Corrupt {
                                path: db_path.clone(),
                                offset: 0,
                                detail: format!(
                                    "malformed index record for queue {queue} message {id}"
                                ),
                            });
                        };
                        if let Some(e) = bad_headers.remove(&u64::from(location.segment)) {
                            return Err(e);
                        }
                        let intact = scanned
                            .get(&u64::from(location.segment))
                            .is_some_and(|s| location.end() <= s.valid_len);
                        if !intact {
                            return Err(StoreError::Corrupt {
                                path: segment::segment_path(&seg_dir, u64::from(location.segment)),
                                offset: location.offset,
                                detail: format!(
                                    "the index references a record that is missing or fails its \
                                     checksum (queue {queue}, message {id}): a committed message \
                                     would be lost"
                                ),
                            });
                        }
                        *refs.entry(u64::from(location.segment)).or_default() += 1;
                        recovered.messages.push(IndexedMessage {
                            queue,
                            id,
                            location,
                            flags,
                            expires_at,
                        });
                        if recovered.messages.len() % 250_000 == 0 {
                            tracing::info!(
                                messages = recovered.messages.len(),
                                "recovery: reading the message index"
                            );
                        }
                    }
                }
                Err(redb::TableError::TableDoesNotExist(_)) => {}
                Err(e) => return Err(StoreError::db(&db_path, e)),
            }
        }

        // 3. Drop what nothing committed references: uncommitted tails, unreferenced segments.
        for (id, e) in bad_headers {
            tracing::warn!(segment = id, error = %e, "deleting an unreferenced segment with a damaged header");
            remove_segment(&seg_dir, id)?;
        }
        for s in scanned.values() {
            if refs.get(&s.id).copied().unwrap_or(0) == 0 {
                remove_segment(&seg_dir, s.id)?;
                recovered.truncated_bytes += s.file_len.saturating_sub(SEGMENT_HEADER);
            } else if s.valid_len < s.file_len {
                let path = segment::segment_path(&seg_dir, s.id);
                tracing::warn!(
                    segment = s.id,
                    bytes = s.file_len - s.valid_len,
                    "truncating uncommitted segment tail"
                );
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(|e| StoreError::io("open segment", &path, e))?;
                f.set_len(s.valid_len)
                    .and_then(|()| f.sync_all())
                    .map_err(|e| StoreError::io("truncate segment", &path, e))?;
                recovered.truncated_bytes += s.file_len - s.valid_len;
            }
        }
        segment::sync_dir(&seg_dir)?;

        // 4. Never append to an old segment: start a fresh one.
        let active = ActiveSegment::create(&seg_dir, next)?;
        let reclaimer = reclaim::Reclaimer::start(seg_dir.clone())
            .map_err(|e| StoreError::io("start the segment reclaimer", &seg_dir, e))?;
        Ok((
            Self {
                db,
                db_path,
                segments: Arc::new(Segments::new(seg_dir.clone())),
                seg_dir,
                active,
                options,
                refs,
                reclaimer,
                buf: Vec::new(),
                metrics: Arc::default(),
                checkpoint: start,
                last_checkpoint: std::time::Instant::now(),
                failed: false,
                pending: Vec::new(),
                rolled: false,
            },
            recovered,
        ))
    }

    /// The store's commit measurements.
    #[must_use]
    pub fn metrics(&self) -> Arc<StoreMetrics> {
        Arc::clone(&self.metrics)
    }

    /// Shared readers for message records.
    #[must_use]
    pub fn segments(&self) -> Arc<Segments> {
        Arc::clone(&self.segments)
    }

    /// Segment files currently on disk (for tests and statistics).
    ///
    /// # Errors
    /// If the segment directory cannot be listed.
    pub fn segment_count(&self) -> Result<usize, StoreError> {
        self.reclaimer.flush();
        Ok(segment::list(&self.seg_dir)?.len())
    }

    /// Make a batch durable: append its bodies and its ops (as one index log record) with one
    /// write and one `fdatasync`. redb gets the ops at the next checkpoint ([`index_log`]),
    /// with every other commit's since the last one, in one durable transaction. Returns the
    /// bodies' locations.
    ///
    /// # Errors
    /// Any failure. The caller must treat it as fatal for the store: what was promised may not
    /// be on disk, so nothing may be confirmed.
    pub fn commit(&mut self, batch: &Batch) -> Result<Vec<Location>, StoreError> {
        let result = self.commit_batch(batch);
        self.failed |= result.is_err();
        result
    }

    fn commit_batch(&mut self, batch: &Batch) -> Result<Vec<Location>, StoreError> {
        let (locations, located) = self.append_batch(batch)?;
        let t = std::time::Instant::now();
        self.active.sync()?;
        if !batch.bodies.is_empty() {
            // Only batches with bodies sync a segment (the others would record no-ops).
            self.metrics
                .fsync_seconds
                .observe(t.elapsed().as_secs_f64());
        }
        // Durable now (the index log record): redb takes them at the checkpoint, new bodies
        // named by their locations as the record names them.
        self.pending.extend(located);
        // A segment sealed since the last checkpoint may already be dead (its messages
        // settled): a checkpoint now lets it go at once, as before the index log (one more
        // redb commit per segment written).
        if self.rolled
            || self.pending.len() >= CHECKPOINT_OPS_MAX
            || self.last_checkpoint.elapsed() >= self.options.checkpoint_interval
        {
            self.checkpoint()?;
        }
        Ok(locations)
    }

    /// How long until a checkpoint is due (None: redb holds everything committed). The writer
    /// calls [`Store::checkpoint`] then if no commit came to do it, so that settled segments
    /// are deleted and a restart replays little even when the broker goes quiet.
    #[must_use]
    pub fn checkpoint_due(&self) -> Option<std::time::Duration> {
        let at_end = self.checkpoint.segment == self.active.id
            && self.checkpoint.offset == self.active.len();
        if self.pending.is_empty() && at_end {
            return None;
        }
        Some(
            self.options
                .checkpoint_interval
                .saturating_sub(self.last_checkpoint.elapsed()),
        )
    }

    /// Apply every commit's ops since the last checkpoint to redb in one transaction, record
    /// the end of the segments' log with them and commit durably; then delete the segments
    /// nothing references any more that the checkpoint passed.
    ///
    /// # Errors
    /// When redb cannot commit.
    pub fn checkpoint(&mut self) -> Result<(), StoreError> {
        let wtx = self
            .db
            .begin_write()
            .map_err(|e| StoreError::db(&self.db_path, e))?;
        let delta = apply_ops(&wtx, &self.pending, &self.db_path)?;
        let at = Checkpoint {
            segment: self.active.id,
            offset: self.active.len(),
        };
        write_checkpoint(&wtx, at, &self.db_path)?;
        wtx.commit().map_err(|e| StoreError::db(&self.db_path, e))?;
        self.pending.clear();
        if self.pending.capacity() > CHECKPOINT_OPS_MAX {
            self.pending.shrink_to(CHECKPOINT_OPS_MAX);
        }
        self.checkpoint = at;
        self.last_checkpoint = std::time::Instant::now();
        self.rolled = false;
        self.apply_delta(delta)
    }

    /// Append the batch's bodies, then its ops as one index log record, with one write
    /// (one more per segment the batch rolls over). Returns the bodies' locations and the
    /// ops with every new body located ([`Op::located`]).
    fn append_batch(&mut self, batch: &Batch) -> Result<(Vec<Location>, Vec<Op>), StoreError> {
        let mut locations = Vec::with_capacity(batch.bodies.len());
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        let result = self.encode_batch(batch, &mut buf, &mut locations);
        buf.clear();
        self.buf = buf;
        result.map(|located| (locations, located))
    }

    fn encode_batch(
        &mut self,
        batch: &Batch,
        buf: &mut Vec<u8>,
        locations: &mut Vec<Location>,
    ) -> Result<Vec<Op>, StoreError> {
        for body in &batch.bodies {
            let payload = body.payload_len();
            if payload > RECORD_MAX {
                return Err(StoreError::RecordTooLarge(payload));
            }
            self.make_room(buf, RECORD_HEADER + payload)?;
            let offset = self.active.len() + buf.len() as u64;
            body.encode(buf);
            locations.push(Location {
                segment: u32::try_from(self.active.id)
                    .map_err(|_| StoreError::SegmentIdsExhausted)?,
                offset,
                len: u32::try_from(payload).map_err(|_| StoreError::RecordTooLarge(payload))?,
            });
        }
        let located = batch
            .ops
            .iter()
            .map(|op| op.located(locations))
            .collect::<Result<Vec<Op>, StoreError>>()?;
        if !located.is_empty() {
            self.make_room(buf, index_log::record_len(&located))?;
            index_log::encode(buf, &located)?;
        }
        if !buf.is_empty() {
            self.active.append(buf)?;
        }
        Ok(located)
    }

    /// Roll to the next segment first if a record of `record` bytes would take the active
    /// one past its size (a segment holds at least one record, however large).
    fn make_room(&mut self, buf: &mut Vec<u8>, record: usize) -> Result<(), StoreError> {
        let filled = self.active.len() + buf.len() as u64;
        if filled + record as u64 > self.options.segment_max && filled > SEGMENT_HEADER {
            self.active.append(buf)?;
            buf.clear();
            self.roll()?;
        }
        Ok(())
    }

    /// Seal the active segment (synced) and start the next one.
    fn roll(&mut self) -> Result<(), StoreError> {
        self.active.sync()?;
        self.rolled = true;
        let sealed = self.active.id;
        self.active = ActiveSegment::create(&self.seg_dir, sealed + 1)?;
        if self.refs.get(&sealed).copied().unwrap_or(0) == 0 {
            // Possibly referenced by the batch being written: the delta decides after commit.
            self.refs.entry(sealed).or_insert(0);
        }
        Ok(())
    }

    /// Apply committed reference changes; sealed segments nothing references are deleted in
    /// the background.
    fn apply_delta(&mut self, delta: HashMap<u64, i64>) -> Result<(), StoreError> {
        for (seg, d) in delta {
            let r = self.refs.entry(seg).or_insert(0);
            let v = i64::try_from(*r).unwrap_or(i64::MAX) + d;
            debug_assert!(v >= 0, "segment {seg} references went negative");
            *r = u64::try_from(v.max(0)).unwrap_or(0);
        }
        let dead: Vec<u64> = self
            .refs
            .iter()
            // A segment at or after the checkpoint holds index log records a crash would
            // replay: it goes once a checkpoint is past it.
            .filter(|(seg, n)| {
                **n == 0 && **seg != self.active.id && **seg < self.checkpoint.segment
            })
            .map(|(seg, _)| *seg)
            .collect();
        for seg in dead {
            self.refs.remove(&seg);
            let pinned = self.segments.forget(seg);
            self.reclaimer.delete(seg, !pinned);
        }
        Ok(())
    }
}

/// Apply located `ops` ([`Op::located`]: the index log's and the checkpoint's) to the
/// message index and the metadata tables in `wtx`; returns the change of each segment's
/// references. A body not yet located is corruption.
pub(crate) fn apply_ops(
    wtx: &redb::WriteTransaction,
    ops: &[Op],
    db_path: &Path,
) -> Result<HashMap<u64, i64>, StoreError> {
    let unlocated = |i: usize| StoreError::Corrupt {
        path: db_path.to_path_buf(),
        offset: 0,
        detail: format!("an op to apply names batch body {i}, not a location"),
    };
    let mut delta: HashMap<u64, i64> = HashMap::new();
    {
        let mut messages = wtx
            .open_table(MESSAGES)
            .map_err(|e| StoreError::db(db_path, e))?;
        let mut tables = HashMap::new();
        let skip = cancelled_pairs(ops);
        for (i, op) in ops.iter().enumerate() {
            if skip.get(i).copied().unwrap_or(false) {
                // Settled later in this same group (see `cancelled_pairs`). Its body's
                // segment is still accounted (net zero) so that a segment sealed in this
                // group can be found dead.
                if let Op::Enqueue { body, .. } = op {
                    let loc = match body {
                        BodyRef::New(i) => return Err(unlocated(*i)),
                        BodyRef::Stored(loc) => loc,
                    };
                    delta.entry(u64::from(loc.segment)).or_default();
                }
                continue;
            }
            match op {
                Op::Put { table, key, .. } | Op::Delete { table, key } => {
                    let t = match tables.entry(*table) {
                        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                        std::collections::hash_map::Entry::Vacant(e) => e.insert(
                            wtx.open_table(table.definition())
                                .map_err(|e| StoreError::db(db_path, e))?,
                        ),
                    };
                    let r = match op {
                        Op::Put { value, .. } => t.insert(key.as_slice(), value.as_slice()),
                        _ => t.remove(key.as_slice()),
                    };
                    r.map_err(|e| StoreError::db(db_path, e))?;
                }
                Op::Enqueue {
                    queue,
                    id,
                    body,
                    flags,
                    expires_at,
                } => {
                    let loc = match body {
                        BodyRef::New(i) => return Err(unlocated(*i)),
                        BodyRef::Stored(loc) => *loc,
                    };
                    let old = messages
                        .insert(
                            (*queue, *id),
                            encode_entry(loc, *flags, *expires_at).as_slice(),
                        )
                        .map_err(|e| StoreError::db(db_path, e))?
                        .and_then(|g| decode_entry(g.value()));
                    *delta.entry(u64::from(loc.segment)).or_default() += 1;
                    if let Some((old, _, _)) = old {
                        *delta.entry(u64::from(old.segment)).or_default() -= 1;
                    }
                }
                Op::Settle { queue, id } => {
                    let old = messages
                        .remove((*queue, *id))
                        .map_err(|e| StoreError::db(db_path, e))?
                        .and_then(|g| decode_entry(g.value()));
                    if let Some((old, _, _)) = old {
                        *delta.entry(u64::from(old.segment)).or_default() -= 1;
                    }
                }
                Op::Renumber { queue, from, to } => {
                    let record = messages
                        .remove((*queue, *from))
                        .map_err(|e| StoreError::db(db_path, e))?
                        .map(|g| g.value().to_vec());
                    if let Some(record) = record {
                        // The same body keeps the same number of references.
                        let old = messages
                            .insert((*queue, *to), record.as_slice())
                            .map_err(|e| StoreError::db(db_path, e))?
                            .and_then(|g| decode_entry(g.value()));
                        if let Some((old, _, _)) = old {
                            *delta.entry(u64::from(old.segment)).or_default() -= 1;
                        }
                    }
                }
                Op::DropQueue { queue } => {
                    let removed = messages
                        .extract_from_if((*queue, 0)..=(*queue, u64::MAX), |_, _| true)
                        .map_err(|e| StoreError::db(db_path, e))?;
                    for row in removed {
                        let (_, v) = row.map_err(|e| StoreError::db(db_path, e))?;
                        if let Some((old, _, _)) = decode_entry(v.value()) {
                            *delta.entry(u64::from(old.segment)).or_default() -= 1;
                        }
                    }
                }
            }
        }
    }
    Ok(delta)
}

/// Which `Enqueue`s of a group need not reach the index: those settled later in the same group
/// (a consumer acked the message before its group committed). The `Settle` is still applied: it
/// removes the key if an earlier group stored it (a re-enqueue of a stored message) and is a
/// read-only lookup otherwise. So the index ends exactly as if both were applied, and a message
/// acked within its group costs one B-tree lookup instead of an insert and a delete.
fn cancelled_pairs(ops: &[Op]) -> Vec<bool> {
    let mut skip = Vec::new();
    let mut open: HashMap<(u64, u64), usize> = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        match op {
            Op::Enqueue { queue, id, .. } => {
                open.insert((*queue, *id), i);
            }
            Op::Settle { queue, id } => {
                if let Some(at) = open.remove(&(*queue, *id)) {
                    if skip.is_empty() {
                        skip = vec![false; ops.len()];
                    }
                    skip[at] = true;
                }
            }
            Op::DropQueue { queue } => open.retain(|(q, _), _| q != queue),
            // An enqueue of this group renumbered later is settled under its new id.
            Op::Renumber { queue, from, to } => {
                if let Some(at) = open.remove(&(*queue, *from)) {
                    open.insert((*queue, *to), at);
                }
            }
            Op::Put { .. } | Op::Delete { .. } => {}
        }
    }
    skip
}

fn remove_segment(dir: &Path, id: u64) -> Result<(), StoreError> {
    let path = segment::segment_path(dir, id);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StoreError::io("delete segment", path, e)),
    }
}

/// A fresh database gets this build's version; an existing one must carry it.
fn check_version(db: &Database, path: &Path) -> Result<(), StoreError> {
    let found = {
        let rtx = db.begin_read().map_err(|e| StoreError::db(path, e))?;
        match rtx.open_table(META) {
            Ok(t) => t
                .get(KEY_FORMAT_VERSION)
                .map_err(|e| StoreError::db(path, e))?
                .map(|v| v.value()),
            Err(redb::TableError::TableDoesNotExist(_)) => None,
            Err(e) => return Err(StoreError::db(path, e)),
        }
    };
    match found {
        Some(v) if v == FORMAT_VERSION => Ok(()),
        // Its redb commits were all durable: nothing to replay (it has no checkpoint), and
        // its first open writes one.
        Some(v) if v == FORMAT_VERSION_UPGRADED => {
            let wtx = db.begin_write().map_err(|e| StoreError::db(path, e))?;
            {
                let mut t = wtx.open_table(META).map_err(|e| StoreError::db(path, e))?;
                t.insert(KEY_FORMAT_VERSION, FORMAT_VERSION)
                    .map_err(|e| StoreError::db(path, e))?;
            }
            wtx.commit().map_err(|e| StoreError::db(path, e))
        }
        Some(v) => Err(StoreError::VersionMismatch {
            path: path.to_path_buf(),
            found: v,
            expected: FORMAT_VERSION,
        }),
        None => {
            let wtx = db.begin_write().map_err(|e| StoreError::db(path, e))?;
            {
                let mut t = wtx.open_table(META).map_err(|e| StoreError::db(path, e))?;
                t.insert(KEY_FORMAT_VERSION, FORMAT_VERSION)
                    .map_err(|e| StoreError::db(path, e))?;
            }
            wtx.commit().map_err(|e| StoreError::db(path, e))
        }
    }
}

#[cfg(test)]
mod tests;
