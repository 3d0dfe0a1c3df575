//! A stream's log as a pure, deterministic state machine: `apply(now, command) -> effects`,
//! no I/O and no clock. It knows the offsets, chunks and segments of what the stream holds,
//! and the offsets named consumers stored; the bodies live in segment files its driver
//! writes and reads (an [`Effect`] says which segment to open or drop).
//!
//! - **Offsets** are contiguous: the log holds `first_offset()..next_offset()`.
//! - **Chunks**: each append is one chunk (the messages of one batch), stamped with the
//!   command's time (kept monotonic) and a filter of its messages' filter values.
//! - **Segments**: chunks go into the open (last) segment until it would pass
//!   `segment_max_bytes`; then a new one opens (named by its first offset).
//! - **Retention** (`x-max-length-bytes`, `x-max-age`) drops whole segments from the front,
//!   never the open one, as RabbitMQ does: a stream can exceed its limits by up to a segment.
//! - **Tracked offsets** (Warren's own, for AMQP 0-9-1 consumers with a name): bounded by
//!   [`TRACKED_NAMES_MAX`].

use std::collections::{BTreeMap, VecDeque};

use super::filter::ChunkFilter;
use super::spec::OffsetSpec;

/// RabbitMQ's default `x-stream-max-segment-size-bytes` (500 MB).
pub const SEGMENT_BYTES_DEFAULT: u64 = 500_000_000;
/// Most consumer names whose offsets one stream tracks.
pub const TRACKED_NAMES_MAX: usize = 4096;
/// Longest consumer name tracked (bytes), as a short string.
pub const TRACKED_NAME_MAX: usize = 255;

/// How a stream keeps its messages.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StreamConfig {
    /// `x-max-age`: segments whose newest message is older go (None: kept).
    pub max_age_ms: Option<u64>,
    /// `x-max-length-bytes`: the oldest segments go while the stream holds more.
    pub max_bytes: Option<u64>,
    /// `x-stream-max-segment-size-bytes`.
    pub segment_max_bytes: u64,
    /// `x-stream-filter-size-bytes`: each chunk's filter.
    pub filter_bytes: usize,
}

impl Default for StreamConfig {
    fn default() -> Self {
        Self {
            max_age_ms: None,
            max_bytes: None,
            segment_max_bytes: SEGMENT_BYTES_DEFAULT,
            filter_bytes: super::filter::FILTER_BYTES_MIN,
        }
    }
}

/// One message as the log records it (its body is the driver's).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MessageMeta {
    /// Its size in the segment file.
    pub bytes: u64,
    /// Its `x-stream-filter-value`, if any.
    pub filter: Option<String>,
}

/// The messages of one append.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Chunk {
    /// Offset of its first message.
    pub first: u64,
    /// Its message count (at least 1).
    pub count: u64,
    /// Bytes of its messages.
    pub bytes: u64,
    /// When it was appended (milliseconds, monotonic over the log).
    pub timestamp_ms: u64,
    /// Its messages' filter values.
    pub filter: ChunkFilter,
}

impl Chunk {
    /// One past its last offset.
    #[must_use]
    pub fn end(&self) -> u64 {
        self.first + self.count
    }
}

/// A run of chunks stored in one file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Segment {
    /// Its name: the offset of its first message.
    pub id: u64,
    /// Its chunks, in offset order.
    pub chunks: Vec<Chunk>,
    /// Bytes of its messages.
    pub bytes: u64,
}

/// What changes a stream's log.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Command {
    /// Append these messages as one chunk (an empty list does nothing).
    Append(Vec<MessageMeta>),
    /// Apply retention as of the command's time.
    Retain,
    /// Remember that consumer `name` has handled everything before `next`.
    StoreOffset {
        /// The consumer's name.
        name: String,
        /// The first offset it has not handled.
        next: u64,
    },
    /// New retention settings (a policy changed); retention is applied at once.
    Configure(StreamConfig),
}

/// What the driver does for a command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Open a new segment file named `id` (before writing the chunk that follows).
    OpenSegment(u64),
    /// The messages of this append have these offsets, in segment `segment`.
    Appended {
        /// The segment written to.
        segment: u64,
        /// The first offset.
        first: u64,
        /// How many.
        count: u64,
    },
    /// Delete these segment files (retention): their offsets are gone.
    DropSegments(Vec<u64>),
}

/// Why a command was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// More consumer names than [`TRACKED_NAMES_MAX`].
    #[error("a stream tracks at most {TRACKED_NAMES_MAX} consumer names")]
    TooManyNames,
    /// A name longer than [`TRACKED_NAME_MAX`] or empty.
    #[error("a consumer name is 1 to {TRACKED_NAME_MAX} bytes")]
    BadName,
}

/// How far a reader is behind the end of the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct Lag {
    /// Messages between the reader and the end.
    pub messages: u64,
    /// Age of the oldest message it has not read (0 when caught up), milliseconds.
    pub age_ms: u64,
    /// Messages it never read that retention already dropped.
    pub lost_to_retention: u64,
}

/// A stream's log. See the module documentation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StreamLog {
    config: StreamConfig,
    segments: VecDeque<Segment>,
    /// The offset the next message gets.
    next: u64,
    /// Bytes of every segment.
    bytes: u64,
    /// The last chunk's time (later chunks are never stamped earlier).
    last_ms: u64,
    /// Tracked consumers' next offsets.
    offsets: BTreeMap<String, u64>,
}

impl StreamLog {
    /// An empty stream.
    #[must_use]
    pub fn new(config: StreamConfig) -> Self {
        Self {
            config,
            segments: VecDeque::new(),
            next: 0,
            bytes: 0,
            last_ms: 0,
            offsets: BTreeMap::new(),
        }
    }

    /// A stream as its segment files hold it (recovery): `segments` in offset order, each
    /// non-empty and continuing the offsets of the one before, and the tracked offsets.
    /// `next_floor` is the first offset of the newest file, which may hold no whole chunk
    /// (a crash right after it was created): the next offset is at least that.
    ///
    /// # Errors
    /// The segments do not continue each other (a file is missing in the middle).
    pub fn restore(
        config: StreamConfig,
        segments: Vec<Segment>,
        next_floor: u64,
        offsets: BTreeMap<String, u64>,
    ) -> Result<Self, String> {
        let mut next = segments.first().map_or(next_floor, |s| s.id);
        let mut last_ms = 0;
        let mut bytes = 0;
        for s in &segments {
            if s.id != next || s.chunks.is_empty() {
                return Err(format!(
                    "stream segment {} does not follow offset {next}",
                    s.id
                ));
            }
            for c in &s.chunks {
                if c.first != next || c.count == 0 {
                    return Err(format!(
                        "chunk at {} does not follow offset {next}",
                        c.first
                    ));
                }
                next = c.end();
                last_ms = last_ms.max(c.timestamp_ms);
            }
            if s.bytes != s.chunks.iter().map(|c| c.bytes).sum::<u64>() {
                return Err(format!("segment {} miscounts its bytes", s.id));
            }
            bytes += s.bytes;
        }
        if !segments.is_empty() && next_floor > next {
            return Err(format!(
                "the newest segment file starts at {next_floor}, after {next}"
            ));
        }
        let next = next_floor.max(next);
        let offsets = offsets.into_iter().map(|(n, o)| (n, o.min(next))).collect();
        let log = Self {
            config,
            segments: segments.into(),
            next,
            bytes,
            last_ms,
            offsets,
        };
        log.check();
        Ok(log)
    }

    /// Apply `command` at time `now_ms` (the entry's time, never a clock read here).
    ///
    /// # Errors
    /// [`StreamError`] for a refused [`Command::StoreOffset`]; nothing changed then.
    pub fn apply(&mut self, now_ms: u64, command: Command) -> Result<Vec<Effect>, StreamError> {
        let mut effects = Vec::new();
        match command {
            Command::Append(messages) => {
                self.append(now_ms, &messages, &mut effects);
                self.retain(now_ms, &mut effects);
            }
            Command::Retain => self.retain(now_ms, &mut effects),
            Command::StoreOffset { name, next } => {
                if name.is_empty() || name.len() > TRACKED_NAME_MAX {
                    return Err(StreamError::BadName);
                }
                if !self.offsets.contains_key(&name) && self.offsets.len() >= TRACKED_NAMES_MAX {
                    return Err(StreamError::TooManyNames);
                }
                self.offsets.insert(name, next.min(self.next));
            }
            Command::Configure(config) => {
                self.config = config;
                self.retain(now_ms, &mut effects);
            }
        }
        self.check();
        Ok(effects)
    }

    fn append(&mut self, now_ms: u64, messages: &[MessageMeta], effects: &mut Vec<Effect>) {
        if messages.is_empty() {
            return;
        }
        let bytes: u64 = messages.iter().map(|m| m.bytes).sum();
        let roll = self.segments.back().is_none_or(|s| {
            !s.chunks.is_empty() && s.bytes.saturating_add(bytes) > self.config.segment_max_bytes
        });
        if roll {
            self.segments.push_back(Segment {
                id: self.next,
                chunks: Vec::new(),
                bytes: 0,
            });
            effects.push(Effect::OpenSegment(self.next));
        }
        let mut filter = ChunkFilter::new(self.config.filter_bytes);
        for m in messages {
            filter.add(m.filter.as_deref());
        }
        self.last_ms = self.last_ms.max(now_ms);
        let count = messages.len() as u64;
        let chunk = Chunk {
            first: self.next,
            count,
            bytes,
            timestamp_ms: self.last_ms,
            filter,
        };
        let Some(segment) = self.segments.back_mut() else {
            return;
        };
        segment.bytes += bytes;
        segment.chunks.push(chunk);
        effects.push(Effect::Appended {
            segment: segment.id,
            first: self.next,
            count,
        });
        self.next += count;
        self.bytes += bytes;
    }

    fn retain(&mut self, now_ms: u64, effects: &mut Vec<Effect>) {
        let mut dropped = Vec::new();
        while self.segments.len() > 1 {
            let Some(front) = self.segments.front() else {
                break;
            };
            let newest = front.chunks.last().map_or(0, |c| c.timestamp_ms);
            let too_big = self.config.max_bytes.is_some_and(|max| self.bytes > max);
            let too_old = self
                .config
                .max_age_ms
                .is_some_and(|age| now_ms.saturating_sub(newest) > age);
            if !(too_big || too_old) {
                break;
            }
            self.bytes -= front.bytes;
            dropped.push(front.id);
            self.segments.pop_front();
        }
        if !dropped.is_empty() {
            effects.push(Effect::DropSegments(dropped));
        }
    }

    /// The invariants every command keeps.
    fn check(&self) {
        debug_assert_eq!(
            self.bytes,
            self.segments.iter().map(|s| s.bytes).sum::<u64>(),
            "stream bytes"
        );
        let mut expect = self.segments.front().map_or(self.next, |s| s.id);
        for s in &self.segments {
            debug_assert_eq!(s.id, s.chunks.first().map_or(s.id, |c| c.first));
            for c in &s.chunks {
                debug_assert_eq!(c.first, expect, "offsets are contiguous");
                debug_assert!(c.count > 0);
                expect = c.end();
            }
        }
        debug_assert_eq!(expect, self.next);
    }

    /// Its retention settings.
    #[must_use]
    pub fn config(&self) -> &StreamConfig {
        &self.config
    }

    /// The first offset it holds (`next_offset()` when empty).
    #[must_use]
    pub fn first_offset(&self) -> u64 {
        self.chunks().next().map_or(self.next, |(_, c)| c.first)
    }

    /// The offset the next message gets.
    #[must_use]
    pub fn next_offset(&self) -> u64 {
        self.next
    }

    /// Messages it holds.
    #[must_use]
    pub fn len(&self) -> u64 {
        self.next - self.first_offset()
    }

    /// Whether it holds no message.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes it holds.
    #[must_use]
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Its segments, oldest first.
    pub fn segments(&self) -> impl Iterator<Item = &Segment> {
        self.segments.iter()
    }

    /// Every chunk with its segment's id, oldest first.
    pub fn chunks(&self) -> impl Iterator<Item = (u64, &Chunk)> {
        self.segments
            .iter()
            .flat_map(|s| s.chunks.iter().map(move |c| (s.id, c)))
    }

    /// (segment index, chunk index) of the first chunk that ends after `offset`, by binary
    /// search (a stream of single-message chunks has millions; readers look up every one).
    fn locate(&self, offset: u64) -> Option<(usize, usize)> {
        // Segments are named by their first offset, in order.
        let si = self
            .segments
            .partition_point(|s| s.id <= offset)
            .saturating_sub(1);
        let segment = self.segments.get(si)?;
        let ci = segment.chunks.partition_point(|c| c.end() <= offset);
        if ci < segment.chunks.len() {
            Some((si, ci))
        } else {
            (si + 1 < self.segments.len()).then_some((si + 1, 0))
        }
    }

    /// The chunks from the one holding `offset` on (all of them if `offset` was dropped).
    pub fn chunks_from(&self, offset: u64) -> impl Iterator<Item = (u64, &Chunk)> {
        let (si, ci) = self.locate(offset).unwrap_or((self.segments.len(), 0));
        self.segments
            .range(si..)
            .enumerate()
            .flat_map(move |(k, s)| {
                let skip = if k == 0 { ci.min(s.chunks.len()) } else { 0 };
                s.chunks[skip..].iter().map(move |c| (s.id, c))
            })
    }

    /// The chunk holding `offset`, with its segment's id.
    #[must_use]
    pub fn chunk_of(&self, offset: u64) -> Option<(u64, &Chunk)> {
        self.chunk_at(offset).map(|(segment, _, c)| (segment, c))
    }

    /// The chunk holding `offset`: its segment's id, its index in that segment, the chunk.
    #[must_use]
    pub fn chunk_at(&self, offset: u64) -> Option<(u64, usize, &Chunk)> {
        let (si, ci) = self.locate(offset)?;
        let segment = self.segments.get(si)?;
        segment
            .chunks
            .get(ci)
            .filter(|c| c.first <= offset)
            .map(|c| (segment.id, ci, c))
    }

    /// Where a consumer attaching at `now_ms` with `spec` starts reading.
    #[must_use]
    pub fn resolve(&self, spec: OffsetSpec, now_ms: u64) -> u64 {
        let first = self.first_offset();
        match spec {
            OffsetSpec::First => first,
            OffsetSpec::Next => self.next,
            OffsetSpec::Last => self.chunks().last().map_or(self.next, |(_, c)| c.first),
            OffsetSpec::Offset(n) => n.clamp(first, self.next),
            OffsetSpec::FromEnd(n) => self.next.saturating_sub(n).max(first),
            OffsetSpec::Ago(ms) => {
                self.resolve(OffsetSpec::Timestamp(now_ms.saturating_sub(ms)), now_ms)
            }
            OffsetSpec::Timestamp(ts) => {
                // A chunk is stamped when it is written, after its messages arrived: the
                // first chunk stamped at or after `ts` holds the first messages published
                // at `ts` or later (and perhaps a few from just before); none: the end.
                self.chunks()
                    .find(|(_, c)| c.timestamp_ms >= ts)
                    .map_or(self.next, |(_, c)| c.first)
            }
        }
    }

    /// The next offset consumer `name` stored, if it did.
    #[must_use]
    pub fn stored_offset(&self, name: &str) -> Option<u64> {
        self.offsets.get(name).copied()
    }

    /// Every tracked consumer and its next offset.
    pub fn stored_offsets(&self) -> impl Iterator<Item = (&str, u64)> {
        self.offsets.iter().map(|(n, o)| (n.as_str(), *o))
    }

    /// How far a reader whose next offset is `next` lags at `now_ms`.
    #[must_use]
    pub fn lag(&self, next: u64, now_ms: u64) -> Lag {
        let first = self.first_offset();
        let from = next.max(first);
        Lag {
            messages: self.next.saturating_sub(from),
            age_ms: self
                .chunk_of(from)
                .map_or(0, |(_, c)| now_ms.saturating_sub(c.timestamp_ms)),
            lost_to_retention: first.saturating_sub(next),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn msgs(n: usize, bytes: u64) -> Command {
        Command::Append(
            (0..n)
                .map(|_| MessageMeta {
                    bytes,
                    filter: None,
                })
                .collect(),
        )
    }

    fn log(max_bytes: Option<u64>, max_age_ms: Option<u64>, segment: u64) -> StreamLog {
        StreamLog::new(StreamConfig {
            max_age_ms,
            max_bytes,
            segment_max_bytes: segment,
            ..StreamConfig::default()
        })
    }

    #[test]
    fn appends_fill_segments_and_roll_over() {
        let mut l = log(None, None, 1000);
        assert_eq!(
            l.apply(10, msgs(3, 100)).unwrap(),
            vec![
                Effect::OpenSegment(0),
                Effect::Appended {
                    segment: 0,
                    first: 0,
                    count: 3
                }
            ]
        );
        l.apply(20, msgs(5, 100)).unwrap();
        // 800 + 300 > 1000: a new segment named by its first offset.
        let e = l.apply(30, msgs(3, 100)).unwrap();
        assert_eq!(e[0], Effect::OpenSegment(8));
        assert_eq!(
            (l.first_offset(), l.next_offset(), l.bytes()),
            (0, 11, 1100)
        );
        assert_eq!(l.segments().count(), 2);
        // A chunk bigger than a segment still goes somewhere (a segment of its own).
        let e = l.apply(40, msgs(1, 5000)).unwrap();
        assert_eq!(e[0], Effect::OpenSegment(11));
    }

    #[test]
    fn retention_drops_whole_segments_never_the_open_one() {
        let mut l = log(Some(1000), None, 500);
        for t in 0..6 {
            l.apply(t, msgs(5, 100)).unwrap();
        }
        // Six segments of 500 bytes, at most 1000 kept: the two newest stay.
        assert_eq!(l.bytes(), 1000);
        assert_eq!(l.first_offset(), 20);
        // Age: segments whose newest chunk is older than 100 ms go, except the open one.
        let mut l = log(None, Some(100), 500);
        l.apply(0, msgs(5, 100)).unwrap();
        l.apply(50, msgs(5, 100)).unwrap();
        assert!(l.apply(100, Command::Retain).unwrap().is_empty());
        assert_eq!(
            l.apply(101, Command::Retain).unwrap(),
            vec![Effect::DropSegments(vec![0])]
        );
        assert_eq!(l.apply(10_000, Command::Retain).unwrap(), vec![]);
        assert_eq!(l.first_offset(), 5);
    }

    #[test]
    fn offsets_resolve_as_rabbitmq_and_from_the_end() {
        let mut l = log(None, None, 1_000_000);
        assert_eq!(l.resolve(OffsetSpec::First, 0), 0);
        assert_eq!(l.resolve(OffsetSpec::Last, 0), 0);
        l.apply(1000, msgs(10, 1)).unwrap(); // 0..10 at 1000
        l.apply(2000, msgs(10, 1)).unwrap(); // 10..20 at 2000
        l.apply(3000, msgs(5, 1)).unwrap(); // 20..25 at 3000
        assert_eq!(l.resolve(OffsetSpec::First, 0), 0);
        assert_eq!(l.resolve(OffsetSpec::Last, 0), 20);
        assert_eq!(l.resolve(OffsetSpec::Next, 0), 25);
        assert_eq!(l.resolve(OffsetSpec::Offset(7), 0), 7);
        assert_eq!(l.resolve(OffsetSpec::Offset(700), 0), 25);
        assert_eq!(l.resolve(OffsetSpec::FromEnd(3), 0), 22);
        assert_eq!(l.resolve(OffsetSpec::FromEnd(300), 0), 0);
        assert_eq!(l.resolve(OffsetSpec::Timestamp(500), 0), 0);
        assert_eq!(l.resolve(OffsetSpec::Timestamp(1000), 0), 0);
        assert_eq!(l.resolve(OffsetSpec::Timestamp(1500), 0), 10);
        assert_eq!(l.resolve(OffsetSpec::Timestamp(2500), 0), 20);
        assert_eq!(l.resolve(OffsetSpec::Timestamp(3000), 0), 20);
        assert_eq!(l.resolve(OffsetSpec::Timestamp(3001), 0), 25);
        assert_eq!(l.resolve(OffsetSpec::Ago(1000), 3000), 10);
        assert_eq!(l.resolve(OffsetSpec::Ago(1001), 3000), 10);
        assert_eq!(l.resolve(OffsetSpec::Ago(999), 3000), 20);
    }

    #[test]
    fn named_offsets_are_bounded_and_lag_is_measured() {
        let mut l = log(Some(10), None, 5);
        for t in 0..4 {
            l.apply(t * 100, msgs(5, 1)).unwrap();
        }
        l.apply(
            400,
            Command::StoreOffset {
                name: "billing".into(),
                next: 2,
            },
        )
        .unwrap();
        assert_eq!(l.stored_offset("billing"), Some(2));
        // Offsets 0..10 were dropped (10 bytes kept of 20).
        let lag = l.lag(2, 500);
        assert_eq!(lag.lost_to_retention, 8);
        assert_eq!(lag.messages, 10);
        assert_eq!(lag.age_ms, 300);
        assert_eq!(l.lag(20, 500), Lag::default());
        assert_eq!(
            l.apply(
                0,
                Command::StoreOffset {
                    name: String::new(),
                    next: 1
                }
            ),
            Err(StreamError::BadName)
        );
        for i in 1..TRACKED_NAMES_MAX {
            l.apply(
                0,
                Command::StoreOffset {
                    name: format!("c{i}"),
                    next: 0,
                },
            )
            .unwrap();
        }
        assert_eq!(
            l.apply(
                0,
                Command::StoreOffset {
                    name: "one-too-many".into(),
                    next: 0
                }
            ),
            Err(StreamError::TooManyNames)
        );
        // A stored offset past the end is clamped to it.
        l.apply(
            0,
            Command::StoreOffset {
                name: "billing".into(),
                next: 10_000,
            },
        )
        .unwrap();
        assert_eq!(l.stored_offset("billing"), Some(20));
    }

    #[test]
    fn a_restored_log_continues_and_gaps_are_refused() {
        let mut l = log(None, None, 10);
        for t in 0..3 {
            l.apply(t, msgs(2, 5)).unwrap();
        }
        let segments: Vec<Segment> = l.segments().cloned().collect();
        assert_eq!(segments.len(), 3);
        let back =
            StreamLog::restore(l.config().clone(), segments.clone(), 4, BTreeMap::new()).unwrap();
        assert_eq!(back, l);
        // The middle file missing: offsets 2..4 would vanish.
        let gap = vec![segments[0].clone(), segments[2].clone()];
        assert!(StreamLog::restore(l.config().clone(), gap, 4, BTreeMap::new()).is_err());
        // Only an empty newest file (everything older dropped): the offsets go on from it.
        let empty = StreamLog::restore(l.config().clone(), Vec::new(), 6, BTreeMap::new()).unwrap();
        assert_eq!((empty.first_offset(), empty.next_offset()), (6, 6));
    }

    /// A command for the model test: appends of 1..8 messages of 1..300 bytes with filter
    /// values from a small set, time steps, retention.
    fn command() -> impl Strategy<Value = (u64, Command)> {
        let meta = (1u64..300, proptest::option::of("[ab]"))
            .prop_map(|(bytes, filter)| MessageMeta { bytes, filter });
        prop_oneof![
            4 => (0u64..50, proptest::collection::vec(meta, 1..8))
                .prop_map(|(dt, m)| (dt, Command::Append(m))),
            1 => (0u64..200).prop_map(|dt| (dt, Command::Retain)),
        ]
    }

    proptest! {
        /// Against a model that keeps every message (offset, time, bytes, filter value) and
        /// drops the oldest by whole segments: offsets stay contiguous, bytes add up, the
        /// limits hold but for the open segment, and resolution and filters agree.
        #[test]
        fn the_log_agrees_with_a_model(
            cmds in proptest::collection::vec(command(), 1..80),
            max_bytes in proptest::option::of(500u64..3000),
            max_age in proptest::option::of(50u64..400),
            segment in 200u64..1500,
        ) {
            let mut l = log(max_bytes, max_age, segment);
            let mut model: Vec<(u64, u64, u64, Option<String>)> = Vec::new(); // offset, ms, bytes, filter
            let mut now = 0;
            for (dt, cmd) in cmds {
                now += dt;
                if let Command::Append(m) = &cmd {
                    let first = model.last().map_or(0, |x| x.0 + 1);
                    for (k, meta) in m.iter().enumerate() {
                        model.push((first + k as u64, now, meta.bytes, meta.filter.clone()));
                    }
                }
                let effects = l.apply(now, cmd).unwrap();
                for e in &effects {
                    if let Effect::DropSegments(_) = e {
                        let first = l.first_offset();
                        model.retain(|x| x.0 >= first);
                    }
                }
                prop_assert_eq!(l.first_offset(), model.first().map_or(l.next_offset(), |x| x.0));
                prop_assert_eq!(l.next_offset(), model.last().map_or(l.next_offset(), |x| x.0 + 1));
                prop_assert_eq!(l.bytes(), model.iter().map(|x| x.2).sum::<u64>());
                // Limits hold unless only the open segment is left.
                if let Some(max) = max_bytes {
                    prop_assert!(l.segments().count() == 1 || l.bytes() <= max,
                        "over max_bytes with a closed segment to drop");
                }
                if let Some(age) = max_age && l.segments().count() > 1 {
                    let oldest = l.segments().next().and_then(|s| s.chunks.last()).map_or(0, |c| c.timestamp_ms);
                    prop_assert!(now.saturating_sub(oldest) <= age, "an expired closed segment kept");
                }
                // Every message's chunk admits its filter value.
                for (offset, _, _, filter) in &model {
                    let (_, chunk) = l.chunk_of(*offset).expect("a held offset has a chunk");
                    if let Some(v) = filter {
                        prop_assert!(chunk.filter.may_match(std::slice::from_ref(v), false));
                    } else {
                        prop_assert!(chunk.filter.may_match(&["zzz".into()], true));
                    }
                }
                // The binary searches agree with a scan of every chunk, for every offset
                // (dropped, held, at the end and beyond).
                for o in 0..=l.next_offset() + 1 {
                    let scan: Vec<u64> = l.chunks().filter(|(_, c)| c.end() > o).map(|(_, c)| c.first).collect();
                    let found: Vec<u64> = l.chunks_from(o).map(|(_, c)| c.first).collect();
                    prop_assert_eq!(&found, &scan, "chunks_from({})", o);
                    let held = l.chunks().find(|(_, c)| c.first <= o && o < c.end()).map(|(s, c)| (s, c.first));
                    prop_assert_eq!(l.chunk_of(o).map(|(s, c)| (s, c.first)), held, "chunk_of({})", o);
                }
                // Resolution stays within what is held.
                for spec in [OffsetSpec::First, OffsetSpec::Last, OffsetSpec::Next,
                             OffsetSpec::FromEnd(3), OffsetSpec::Offset(5), OffsetSpec::Ago(100)] {
                    let at = l.resolve(spec, now);
                    prop_assert!(at >= l.first_offset() && at <= l.next_offset(), "{:?} -> {}", spec, at);
                }
                prop_assert_eq!(l.resolve(OffsetSpec::FromEnd(3), now),
                                l.next_offset().saturating_sub(3).max(l.first_offset()));
            }
        }
    }
}
