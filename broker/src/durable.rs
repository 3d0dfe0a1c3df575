//! What the broker keeps in the store: the encodings of durable exchanges, queues and bindings,
//! the conversion of messages to and from stored records, and the handle to the writer.
//!
//! Ordering rule (why submissions happen under locks): a change is submitted to the writer
//! while the lock that makes it visible is held (topology write lock for declarations and
//! bindings, the queue lock for enqueues, settles and deletion). The writer commits in
//! submission order, so the store can never hold a settle before its enqueue, an enqueue for a
//! queue whose deletion it already committed, or a binding before its queue.

use std::sync::Arc;

use amq_protocol::types::FieldTable;
use warren_amqp::table::{decode_table, encode_table};
use warren_store::writer::Completion;
use warren_store::{Batch, Location, MetaTable, Op, Segments, StoreError, Writer};

use crate::exchange::ExchangeDecl;
use crate::exchange::{Destination, ExchangeKind};
use crate::message::{Entry, Outgoing};
use crate::queue::machine::KeyKind;

/// Produces the completion for a submitted change (called only when something was submitted).
pub type OnCommit<'a> = &'a mut dyn FnMut() -> Completion;

/// Field-table nesting accepted when decoding stored records (the wire limit).
const TABLE_DEPTH: usize = warren_amqp::limits::TABLE_DEPTH_MAX;
/// Version byte that starts every metadata value.
const RECORD_VERSION: u8 = 1;

/// The broker's handle on its store.
#[derive(Debug)]
pub struct Durable {
    writer: Writer,
    segments: Arc<Segments>,
    /// Where streams keep their segment files (`<data-dir>/streams`), one directory each.
    streams_dir: std::sync::OnceLock<std::path::PathBuf>,
}

impl Durable {
    /// Wrap a started writer and the readers of its segments.
    #[must_use]
    pub fn new(writer: Writer, segments: Arc<Segments>) -> Self {
        Self {
            writer,
            segments,
            streams_dir: std::sync::OnceLock::new(),
        }
    }

    /// Set (once) the directory streams keep their files in.
    pub fn set_streams_dir(&self, dir: std::path::PathBuf) {
        let _ = self.streams_dir.set(dir);
    }

    /// The directory streams keep their files in, if set.
    #[must_use]
    pub fn streams_dir(&self) -> Option<&std::path::Path> {
        self.streams_dir.get().map(std::path::PathBuf::as_path)
    }

    /// The store's commit measurements (fsync and commit latency, group sizes).
    #[must_use]
    pub fn metrics(&self) -> &warren_store::StoreMetrics {
        self.writer.metrics()
    }

    /// Queue a batch for the next group commit; `done` runs on the writer thread.
    pub fn submit(&self, batch: Batch, done: Completion) {
        self.writer.submit(batch, done);
    }

    /// Queue metadata ops (no bodies) whose durability a reply waits for: `on_commit` is asked
    /// for the completion only when there is something to write.
    pub fn submit_meta(&self, ops: Vec<Op>, on_commit: OnCommit<'_>) {
        if !ops.is_empty() {
            self.writer.submit(
                Batch {
                    bodies: Vec::new(),
                    ops,
                },
                on_commit(),
            );
        }
    }

    /// Queue ops whose completion nobody waits for (settles): ordering is all they need.
    pub fn submit_ops(&self, ops: Vec<Op>) {
        if !ops.is_empty() {
            self.writer.submit(
                Batch {
                    bodies: Vec::new(),
                    ops,
                },
                Box::new(|_| {}),
            );
        }
    }

    /// Hold a record's segment open (see [`warren_store::Segments::pin`]).
    ///
    /// # Errors
    /// The segment cannot be opened.
    pub fn pin(&self, location: Location) -> Result<warren_store::Pinned, StoreError> {
        self.segments.pin(location)
    }

    /// Bytes submitted and not yet committed.
    #[must_use]
    pub fn pending_bytes(&self) -> u64 {
        self.writer.pending_bytes()
    }

    /// Run `hook` after every group commit with the bytes still pending.
    pub fn set_on_commit(&self, hook: warren_store::writer::CommitHook) {
        self.writer.set_on_commit(hook);
    }

    /// Commit what is queued and stop the writer.
    pub fn shutdown(&self) {
        self.writer.shutdown();
    }
}

/// A stored record that does not decode: the data directory is damaged or from elsewhere.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {what} record: {why}")]
pub struct DecodeError {
    what: &'static str,
    why: &'static str,
}

impl DecodeError {
    /// A record of kind `what` that failed for `why`.
    #[must_use]
    pub fn new(what: &'static str, why: &'static str) -> Self {
        Self { what, why }
    }
}

struct Reader<'a> {
    data: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn err(&self, why: &'static str) -> DecodeError {
        DecodeError {
            what: self.what,
            why,
        }
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        let (&b, rest) = self
            .data
            .split_first()
            .ok_or_else(|| self.err("truncated"))?;
        self.data = rest;
        Ok(b)
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        if self.data.len() < 8 {
            return Err(self.err("truncated"));
        }
        let (v, rest) = self.data.split_at(8);
        self.data = rest;
        Ok(u64::from_be_bytes(
            v.try_into().map_err(|_| self.err("truncated"))?,
        ))
    }

    fn str(&mut self) -> Result<&'a str, DecodeError> {
        let n = self.u8()? as usize;
        if self.data.len() < n {
            return Err(self.err("truncated name"));
        }
        let (s, rest) = self.data.split_at(n);
        self.data = rest;
        std::str::from_utf8(s).map_err(|_| self.err("name is not UTF-8"))
    }

    fn table(&mut self) -> Result<FieldTable, DecodeError> {
        let (t, used) =
            decode_table(self.data, TABLE_DEPTH).map_err(|_| self.err("bad arguments table"))?;
        self.data = &self.data[used..];
        Ok(t)
    }

    fn end(&self) -> Result<(), DecodeError> {
        if self.data.is_empty() {
            Ok(())
        } else {
            Err(self.err("trailing bytes"))
        }
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    // Names and routing keys are AMQP short strings (at most 255 bytes), checked on input.
    let b = &s.as_bytes()[..s.len().min(255)];
    out.push(u8::try_from(b.len()).unwrap_or(u8::MAX));
    out.extend_from_slice(b);
}

fn name_key(vhost: &str, name: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(2 + vhost.len() + name.len());
    put_str(&mut k, vhost);
    put_str(&mut k, name);
    k
}

/// A durable exchange.
#[derive(Debug, Clone)]
pub struct ExchangeRecord {
    /// Vhost.
    pub vhost: String,
    /// Name.
    pub name: String,
    /// Declaration.
    pub decl: ExchangeDecl,
}

impl ExchangeRecord {
    /// Store key of exchange `name` in `vhost`.
    #[must_use]
    pub fn key(vhost: &str, name: &str) -> Vec<u8> {
        name_key(vhost, name)
    }

    /// The op that stores it.
    #[must_use]
    pub fn put(vhost: &str, name: &str, decl: &ExchangeDecl) -> Op {
        let mut v = vec![RECORD_VERSION];
        put_str(&mut v, decl.kind.as_str());
        v.push(
            u8::from(decl.durable)
                | u8::from(decl.auto_delete) << 1
                | u8::from(decl.internal) << 2
                | u8::from(decl.delayed) << 3,
        );
        v.extend_from_slice(&encode_table(&decl.arguments));
        Op::Put {
            table: MetaTable::Exchanges,
            key: Self::key(vhost, name),
            value: v,
        }
    }

    /// Decode a stored row.
    ///
    /// # Errors
    /// A row that does not decode.
    pub fn decode(key: &[u8], value: &[u8]) -> Result<Self, DecodeError> {
        let mut k = Reader {
            data: key,
            what: "exchange",
        };
        let (vhost, name) = (k.str()?.to_string(), k.str()?.to_string());
        k.end()?;
        let mut r = Reader {
            data: value,
            what: "exchange",
        };
        if r.u8()? != RECORD_VERSION {
            return Err(r.err("unknown record version"));
        }
        let kind = ExchangeKind::parse(r.str()?).ok_or_else(|| r.err("unknown exchange type"))?;
        let flags = r.u8()?;
        let arguments = r.table()?;
        r.end()?;
        Ok(Self {
            vhost,
            name,
            decl: ExchangeDecl {
                kind,
                durable: flags & 1 != 0,
                auto_delete: flags & 2 != 0,
                internal: flags & 4 != 0,
                delayed: flags & 8 != 0,
                arguments,
            },
        })
    }
}

/// A durable queue.
#[derive(Debug, Clone)]
pub struct QueueRecord {
    /// Vhost.
    pub vhost: String,
    /// Name.
    pub name: String,
    /// Store id (its messages are indexed under it).
    pub id: u64,
    /// Auto-delete flag.
    pub auto_delete: bool,
    /// Declare arguments.
    pub arguments: FieldTable,
}

impl QueueRecord {
    /// Store key of queue `name` in `vhost`.
    #[must_use]
    pub fn key(vhost: &str, name: &str) -> Vec<u8> {
        name_key(vhost, name)
    }

    /// The op that stores it.
    #[must_use]
    pub fn put(&self) -> Op {
        let mut v = vec![RECORD_VERSION];
        v.extend_from_slice(&self.id.to_be_bytes());
        v.push(u8::from(self.auto_delete));
        v.extend_from_slice(&encode_table(&self.arguments));
        Op::Put {
            table: MetaTable::Queues,
            key: Self::key(&self.vhost, &self.name),
            value: v,
        }
    }

    /// The vhost and name a [`QueueRecord::key`] names.
    ///
    /// # Errors
    /// A key that does not decode.
    pub fn decode_key(key: &[u8]) -> Result<(String, String), DecodeError> {
        let mut k = Reader {
            data: key,
            what: "queue",
        };
        let (vhost, name) = (k.str()?.to_string(), k.str()?.to_string());
        k.end()?;
        Ok((vhost, name))
    }

    /// Decode a stored row.
    ///
    /// # Errors
    /// A row that does not decode.
    pub fn decode(key: &[u8], value: &[u8]) -> Result<Self, DecodeError> {
        let mut k = Reader {
            data: key,
            what: "queue",
        };
        let (vhost, name) = (k.str()?.to_string(), k.str()?.to_string());
        k.end()?;
        let mut r = Reader {
            data: value,
            what: "queue",
        };
        if r.u8()? != RECORD_VERSION {
            return Err(r.err("unknown record version"));
        }
        let id = r.u64()?;
        let auto_delete = r.u8()? & 1 != 0;
        let arguments = r.table()?;
        r.end()?;
        Ok(Self {
            vhost,
            name,
            id,
            auto_delete,
            arguments,
        })
    }
}

/// A binding between durable ends.
#[derive(Debug, Clone, PartialEq)]
pub struct BindingRecord {
    /// Vhost.
    pub vhost: String,
    /// Source exchange.
    pub source: String,
    /// Destination.
    pub destination: Destination,
    /// Routing key.
    pub routing_key: String,
    /// Arguments (part of the binding's identity).
    pub arguments: FieldTable,
}

impl BindingRecord {
    /// Its store key (the whole binding: bindings have no value).
    #[must_use]
    pub fn key(&self) -> Vec<u8> {
        let mut k = name_key(&self.vhost, &self.source);
        match &self.destination {
            Destination::Queue(q) => {
                k.push(0);
                put_str(&mut k, q);
            }
            Destination::Exchange(e) => {
                k.push(1);
                put_str(&mut k, e);
            }
        }
        put_str(&mut k, &self.routing_key);
        k.extend_from_slice(&encode_table(&self.arguments));
        k
    }

    /// The op that stores it.
    #[must_use]
    pub fn put(&self) -> Op {
        Op::Put {
            table: MetaTable::Bindings,
            key: self.key(),
            value: vec![RECORD_VERSION],
        }
    }

    /// The op that removes it.
    #[must_use]
    pub fn delete(&self) -> Op {
        Op::Delete {
            table: MetaTable::Bindings,
            key: self.key(),
        }
    }

    /// Decode a stored row.
    ///
    /// # Errors
    /// A row that does not decode.
    pub fn decode(key: &[u8], value: &[u8]) -> Result<Self, DecodeError> {
        let mut k = Reader {
            data: key,
            what: "binding",
        };
        let vhost = k.str()?.to_string();
        let source = k.str()?.to_string();
        let destination = match k.u8()? {
            0 => Destination::Queue(k.str()?.to_string()),
            1 => Destination::Exchange(k.str()?.to_string()),
            _ => return Err(k.err("unknown destination kind")),
        };
        let routing_key = k.str()?.to_string();
        let arguments = k.table()?;
        k.end()?;
        if value != [RECORD_VERSION] {
            return Err(k.err("unknown record version"));
        }
        Ok(Self {
            vhost,
            source,
            destination,
            routing_key,
            arguments,
        })
    }
}

/// Make a queued message deliverable: in memory already, or its record pinned (its segment held
/// open) so that it can still be read after its settle is committed and the segment deleted.
/// Call while the message is still referenced (under the queue lock, before its removal is
/// submitted).
#[must_use]
pub fn pin(entry: &Entry, store: Option<&Durable>) -> Outgoing {
    pin_from(entry, store, None)
}

/// [`pin`] of an entry of a queue whose [`Entry::Logged`] bodies are in `bodies` (a quorum
/// queue's log here). Such a body is read at once: once its message leaves the queue, the
/// body may go before the delivery is written out.
#[must_use]
pub fn pin_from(
    entry: &Entry,
    store: Option<&Durable>,
    bodies: Option<&dyn crate::message::BodySource>,
) -> Outgoing {
    match entry {
        Entry::Logged { key, .. } => match bodies.map(|b| b.read(*key)) {
            Some(Ok(m)) => Outgoing::Mem(m),
            Some(Err(e)) => Outgoing::Unreadable(e),
            None => Outgoing::Unreadable("a logged message without its log".into()),
        },
        Entry::Mem(m) => Outgoing::Mem(Arc::clone(m)),
        Entry::Stored { location, size, .. } => match store.map(|s| s.pin(*location)) {
            Some(Ok(pinned)) => Outgoing::Stored {
                pinned,
                size: *size,
            },
            Some(Err(e)) => Outgoing::Unreadable(e.to_string()),
            None => Outgoing::Unreadable("stored message without a store".into()),
        },
    }
}

#[cfg(test)]
mod tests {
    use amq_protocol::types::{AMQPValue, LongString};

    use super::*;

    fn args() -> FieldTable {
        let mut t = FieldTable::default();
        t.insert("x-max-length".into(), AMQPValue::LongInt(10));
        t.insert(
            "alternate-exchange".into(),
            AMQPValue::LongString(LongString::from("ae")),
        );
        t
    }

    #[test]
    fn exchange_round_trip() {
        let decl = ExchangeDecl {
            kind: ExchangeKind::Topic,
            durable: true,
            auto_delete: true,
            internal: false,
            delayed: true,
            arguments: args(),
        };
        let Op::Put { key, value, .. } = ExchangeRecord::put("/", "ex", &decl) else {
            panic!("put")
        };
        let r = ExchangeRecord::decode(&key, &value).unwrap();
        assert_eq!((r.vhost.as_str(), r.name.as_str()), ("/", "ex"));
        assert_eq!(r.decl.kind, ExchangeKind::Topic);
        assert!(r.decl.durable && r.decl.auto_delete && !r.decl.internal && r.decl.delayed);
        assert_eq!(r.decl.arguments, args());
        assert!(ExchangeRecord::decode(&key, &value[..value.len() - 1]).is_err());
    }

    #[test]
    fn queue_round_trip() {
        let q = QueueRecord {
            vhost: "v".into(),
            name: "q".into(),
            id: 42,
            auto_delete: true,
            arguments: args(),
        };
        let Op::Put { key, value, .. } = q.put() else {
            panic!("put")
        };
        let r = QueueRecord::decode(&key, &value).unwrap();
        assert_eq!((r.id, r.auto_delete, r.arguments), (42, true, args()));
        let mut bad = value.clone();
        bad[0] = 9;
        assert!(QueueRecord::decode(&key, &bad).is_err());
    }

    #[test]
    fn binding_keys_are_identities() {
        let b = BindingRecord {
            vhost: "/".into(),
            source: "amq.topic".into(),
            destination: Destination::Exchange("e2".into()),
            routing_key: "a.#".into(),
            arguments: args(),
        };
        let Op::Put { key, value, .. } = b.put() else {
            panic!("put")
        };
        assert_eq!(BindingRecord::decode(&key, &value).unwrap(), b);
        let Op::Delete { key: del, .. } = b.delete() else {
            panic!("delete")
        };
        assert_eq!(del, key);
        let other = BindingRecord {
            destination: Destination::Queue("e2".into()),
            ..b
        };
        assert_ne!(other.key(), key, "queue and exchange destinations differ");
    }
}

/// What a queue keeps beside its messages in the store's `queue_keys` table: record key
/// `queue id (8, big-endian) | kind (1) | key`, value a time (8, big-endian, machine ms).
/// Kind 0: a publish deduplication key, 1: a redrive move key (each with the time it was
/// remembered); 2: a scheduled message's due time (key: its id, 8 bytes big-endian).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueKeyRecord {
    /// The queue's store id.
    pub queue: u64,
    /// What it is.
    pub kind: StoredKey,
    /// The key (a message id's 8 bytes for [`StoredKey::Due`]).
    pub key: Vec<u8>,
    /// When it was remembered, or when the message is due, machine ms.
    pub at: u64,
}

/// The kinds of [`QueueKeyRecord`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredKey {
    /// A key of one of the queue's windows.
    Window(KeyKind),
    /// A scheduled message's due time.
    Due,
}

impl StoredKey {
    fn byte(self) -> u8 {
        match self {
            Self::Window(KeyKind::Dedup) => 0,
            Self::Window(KeyKind::Move) => 1,
            Self::Due => 2,
        }
    }
}

fn queue_key(queue: u64, kind: StoredKey, key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(9 + key.len());
    k.extend_from_slice(&queue.to_be_bytes());
    k.push(kind.byte());
    k.extend_from_slice(key);
    k
}

/// The op that keeps key `key` of queue `queue`, remembered at `at`.
#[must_use]
pub fn key_put(queue: u64, kind: KeyKind, key: &[u8], at: u64) -> Op {
    Op::Put {
        table: MetaTable::QueueKeys,
        key: queue_key(queue, StoredKey::Window(kind), key),
        value: at.to_be_bytes().to_vec(),
    }
}

/// The op that drops key `key` of queue `queue`.
#[must_use]
pub fn key_delete(queue: u64, kind: KeyKind, key: &[u8]) -> Op {
    Op::Delete {
        table: MetaTable::QueueKeys,
        key: queue_key(queue, StoredKey::Window(kind), key),
    }
}

/// The op that keeps message `id` of queue `queue` held until `due`.
#[must_use]
pub fn due_put(queue: u64, id: u64, due: u64) -> Op {
    Op::Put {
        table: MetaTable::QueueKeys,
        key: queue_key(queue, StoredKey::Due, &id.to_be_bytes()),
        value: due.to_be_bytes().to_vec(),
    }
}

/// The op that drops the due time of message `id` of queue `queue`.
#[must_use]
pub fn due_delete(queue: u64, id: u64) -> Op {
    Op::Delete {
        table: MetaTable::QueueKeys,
        key: queue_key(queue, StoredKey::Due, &id.to_be_bytes()),
    }
}

impl QueueKeyRecord {
    /// Decode a stored row.
    ///
    /// # Errors
    /// A row that does not decode.
    pub fn decode(key: &[u8], value: &[u8]) -> Result<Self, DecodeError> {
        let bad = || DecodeError::new("queue key", "bad layout");
        let (queue, rest) = key.split_first_chunk::<8>().ok_or_else(bad)?;
        let (kind, key) = rest.split_first().ok_or_else(bad)?;
        let kind = match kind {
            0 => StoredKey::Window(KeyKind::Dedup),
            1 => StoredKey::Window(KeyKind::Move),
            2 if key.len() == 8 => StoredKey::Due,
            _ => return Err(bad()),
        };
        let at = value
            .try_into()
            .map(u64::from_be_bytes)
            .map_err(|_| bad())?;
        Ok(Self {
            queue: u64::from_be_bytes(*queue),
            kind,
            key: key.to_vec(),
            at,
        })
    }

    /// The message id of a [`StoredKey::Due`] record.
    #[must_use]
    pub fn message_id(&self) -> Option<u64> {
        (self.kind == StoredKey::Due)
            .then(|| self.key.as_slice().try_into().ok().map(u64::from_be_bytes))
            .flatten()
    }

    /// The op that drops it.
    #[must_use]
    pub fn delete(&self) -> Op {
        Op::Delete {
            table: MetaTable::QueueKeys,
            key: queue_key(self.queue, self.kind, &self.key),
        }
    }
}

#[cfg(test)]
mod queue_key_tests {
    use super::*;

    #[test]
    fn queue_keys_round_trip_and_refuse_damage() {
        for kind in [KeyKind::Dedup, KeyKind::Move] {
            let Op::Put { key, value, .. } = key_put(42, kind, b"order-7", 1_234) else {
                panic!("a put");
            };
            let r = QueueKeyRecord::decode(&key, &value).expect("decodes");
            assert_eq!(
                (r.queue, r.kind, r.key.as_slice(), r.at),
                (42, StoredKey::Window(kind), &b"order-7"[..], 1_234)
            );
            assert_eq!(r.delete(), key_delete(42, kind, b"order-7"));
        }
        let Op::Put { key, value, .. } = due_put(42, 9, 5_000) else {
            panic!("a put");
        };
        let r = QueueKeyRecord::decode(&key, &value).expect("decodes");
        assert_eq!(
            (r.kind, r.message_id(), r.at),
            (StoredKey::Due, Some(9), 5_000)
        );
        assert_eq!(r.delete(), due_delete(42, 9));
        let mut short = key.clone();
        short.pop();
        assert!(
            QueueKeyRecord::decode(&short, &value).is_err(),
            "a due key is 8 bytes"
        );
        assert!(QueueKeyRecord::decode(&[0; 8], &[0; 8]).is_err(), "no kind");
        assert!(
            QueueKeyRecord::decode(&[0; 9], &[0; 7]).is_err(),
            "short time"
        );
        let mut k = vec![0; 8];
        k.push(9);
        assert!(QueueKeyRecord::decode(&k, &[0; 8]).is_err(), "unknown kind");
    }
}
