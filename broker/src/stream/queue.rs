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
        let stream = Arc::new(Self {
            owner: Arc::downgrade(owner),
            what: crate::vhost::rs("queue", &owner.name, &owner.vhost),
            dir: dir.to_path_buf(),
            writer: Mutex::new(Some(writer)),
            shared,
            readers: Mutex::new(HashMap::new()),
            cache: Mutex::new(VecDeque::new()),
            table_depth_max,
            published: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
            deleted: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&stream);
        stream.shared.set_on_durable(Box::new(move || {
            if let Some(s) = weak.upgrade() {
                s.wake_parked();
            }
        }));
        Ok(stream)
    }

    /// Append a routed message; `done` runs once it is durable (its confirm) or failed.
    pub fn append(&self, message: &Message, done: Completion) {
        let writer = self.writer.lock().clone();
        let Some(writer) = writer else {
            done(Err(Arc::new(StoreError::Replication(
                "the stream was deleted".into(),
            ))));
            return;
        };
        self.published.fetch_add(1, Ordering::Relaxed);
        writer.submit(
            vec![StreamMessage {
                filter_value: filter_value(&message.properties),
                body: encode(message),
            }],
            Box::new(move |r| done(r.map(|_| Vec::new()))),
        );
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
            }),
        });
        self.readers.lock().insert(id, Arc::clone(&slot));
        self.wake(id, &slot);
        Ok(())
    }

    /// Detach consumer `id` (its unacked deliveries are simply forgotten: nothing is removed
    /// from a stream). A named consumer's position is kept as of its last ack.
    pub fn cancel(&self, id: ConsumerId) {
        self.readers.lock().remove(&id);
    }

    /// Consumer `id` acknowledged (or nacked, or rejected) deliveries at `offsets`: their
    /// credit comes back, and a named consumer's tracked offset moves.
    pub fn settle(&self, id: ConsumerId, offsets: &[u64]) {
        let Some(slot) = self.readers.lock().get(&id).cloned() else {
            return;
        };
        let starved = {
            let mut r = slot.reader.lock();
            let starved = r.cursor.credit == 0;
            let n = offsets.iter().filter(|o| r.outstanding.remove(o)).count();
            let prefetch = r.prefetch;
            r.cursor
                .settle(u32::try_from(n).unwrap_or(u32::MAX), prefetch);
            let next = r.outstanding.first().copied().unwrap_or(r.cursor.next);
            let tracked = r
                .name
                .clone()
                .filter(|_| !r.untracked)
                .map(|name| (name, next));
            if let Some((name, next)) = tracked {
                let stored = self.shared.disk.lock().store_offset(&name, next);
                match stored {
                    Ok(()) => self.shared.offsets_changed(),
                    Err(e) => {
                        r.untracked = true;
                        tracing::warn!(stream = %self.what, consumer = %name, error = %e, "offset not tracked");
                    }
                }
            }
            starved && n > 0
        };
        if starved {
            self.wake(id, &slot);
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
                            tracing::error!(stream = %self.what, error = %e, "cannot read a stream chunk");
                            break;
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
        let (consumers, unacked) = {
            let readers = self.readers.lock();
            let unacked = readers
                .values()
                .map(|s| s.reader.lock().outstanding.len() as u64)
                .sum();
            (readers.len() as u64, unacked)
        };
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
        self.deleted.store(true, Ordering::Release);
        let readers: Vec<(ConsumerId, Arc<ReaderSlot>)> = self.readers.lock().drain().collect();
        for (consumer, slot) in readers {
            slot.sink.outbox.push(Outbound::Cancel {
                channel: slot.sink.channel,
                consumer,
            });
        }
        // Publishes submitted before this still complete (their writer drains them).
        drop(self.writer.lock().take());
        let held = self.shared.disk.lock().log().len();
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            tracing::warn!(stream = %self.what, error = %e, "stream files not removed");
        }
        held
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
    let exchange = String::from_utf8(record[take(n)?].to_vec()).ok()?;
    let n = usize::from(record[take(1)?][0]);
    let routing_key = String::from_utf8(record[take(n)?].to_vec()).ok()?;
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
}
