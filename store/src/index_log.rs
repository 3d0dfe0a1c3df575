//! The index's log: every commit's changes to redb (metadata puts and deletes, enqueues,
//! settles, renumbers, dropped queues) written as one record in the segment beside the
//! commit's bodies, so that one `fdatasync` of the segment makes a whole commit durable.
//!
//! redb is not written per commit: every [`CHECKPOINT_INTERVAL`] (or [`CHECKPOINT_OPS_MAX`]
//! ops) the ops since the last checkpoint go to it in one durable transaction that also
//! records where the segments' log stands ([`Checkpoint`]). An enqueue settled within the
//! same interval never reaches redb at all. redb is read only when the store opens: after a
//! crash it is at its last checkpoint and [`replay`] reads the records written after it, in
//! order, into it again. Segments from the checkpoint's on are kept until a later checkpoint
//! passes them.
//!
//! ```text
//! payload := kind:u8 (=2) count:u32 op[count]                      (big-endian)
//! op      := 1 table:u8 key_len:u32 key value_len:u32 value        Put
//!          | 2 table:u8 key_len:u32 key                            Delete
//!          | 3 queue:u64 id:u64 segment:u32 offset:u64 len:u32 flags:u32 expires_at:u64
//!                                                                  Enqueue (body located)
//!          | 4 queue:u64 id:u64                                    Settle
//!          | 5 queue:u64                                           DropQueue
//!          | 6 queue:u64 from:u64 to:u64                           Renumber
//! ```

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;
use std::time::Duration;

use bytes::BufMut;

use std::collections::HashMap;

use redb::{Database, ReadableDatabase};

use crate::error::StoreError;
use crate::record::{RECORD_HEADER, RECORD_MAX, checksum};
use crate::segment::{self, Location, SEGMENT_HEADER, segment_path};
use crate::{
    BodyRef, KEY_CHECKPOINT_OFFSET, KEY_CHECKPOINT_SEGMENT, META, MetaTable, Op, apply_ops,
};

/// Payload kind of an index log record (a message record is 1).
pub const KIND_OPS: u8 = 2;

/// Longest redb goes without a checkpoint while commits come: what a restart after a crash
/// replays at most (about one second of commits), and how long a settled segment stays.
pub const CHECKPOINT_INTERVAL: Duration = Duration::from_secs(1);

/// Ops held for the next checkpoint at most (each a few dozen bytes; a metadata put holds its
/// key and value): past it the commit that adds them is a checkpoint. Bounds the memory and
/// the length of one checkpoint's transaction.
pub const CHECKPOINT_OPS_MAX: usize = 8_192;

/// Where the segments' log stood at redb's last durable commit: records at or after
/// `(segment, offset)` are not in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Checkpoint {
    /// Segment id.
    pub segment: u64,
    /// Byte offset in it.
    pub offset: u64,
}

const TAG_PUT: u8 = 1;
const TAG_DELETE: u8 = 2;
const TAG_ENQUEUE: u8 = 3;
const TAG_SETTLE: u8 = 4;
const TAG_DROP_QUEUE: u8 = 5;
const TAG_RENUMBER: u8 = 6;

/// Bytes of `ops` encoded as a record (header included).
#[must_use]
pub fn record_len(ops: &[Op]) -> usize {
    RECORD_HEADER + payload_len(ops)
}

fn payload_len(ops: &[Op]) -> usize {
    1 + 4
        + ops
            .iter()
            .map(|op| match op {
                Op::Put { key, value, .. } => 1 + 1 + 4 + key.len() + 4 + value.len(),
                Op::Delete { key, .. } => 1 + 1 + 4 + key.len(),
                Op::Enqueue { .. } => 1 + 8 + 8 + 4 + 8 + 4 + 4 + 8,
                Op::Settle { .. } => 1 + 16,
                Op::DropQueue { .. } => 1 + 8,
                Op::Renumber { .. } => 1 + 24,
            })
            .sum::<usize>()
}

/// Append located `ops` ([`Op::located`]) as one record to `out`.
///
/// # Errors
/// [`StoreError::RecordTooLarge`] past [`RECORD_MAX`], [`StoreError::Corrupt`] for an
/// enqueue whose body is not located.
pub fn encode(out: &mut Vec<u8>, ops: &[Op]) -> Result<(), StoreError> {
    let payload = payload_len(ops);
    if payload > RECORD_MAX {
        return Err(StoreError::RecordTooLarge(payload));
    }
    let count = u32::try_from(ops.len()).map_err(|_| StoreError::RecordTooLarge(payload))?;
    let start = out.len();
    out.reserve(RECORD_HEADER + payload);
    out.put_u32(u32::try_from(payload).map_err(|_| StoreError::RecordTooLarge(payload))?);
    out.put_u32(0);
    out.put_u8(KIND_OPS);
    out.put_u32(count);
    for op in ops {
        match op {
            Op::Put { table, key, value } => {
                out.put_u8(TAG_PUT);
                out.put_u8(table.code());
                put_bytes(out, key);
                put_bytes(out, value);
            }
            Op::Delete { table, key } => {
                out.put_u8(TAG_DELETE);
                out.put_u8(table.code());
                put_bytes(out, key);
            }
            Op::Enqueue {
                queue,
                id,
                body,
                flags,
                expires_at,
            } => {
                let loc = match body {
                    BodyRef::New(i) => {
                        return Err(StoreError::Corrupt {
                            path: "index log".into(),
                            offset: 0,
                            detail: format!("enqueue names batch body {i}, not a location"),
                        });
                    }
                    BodyRef::Stored(loc) => *loc,
                };
                out.put_u8(TAG_ENQUEUE);
                out.put_u64(*queue);
                out.put_u64(*id);
                out.put_u32(loc.segment);
                out.put_u64(loc.offset);
                out.put_u32(loc.len);
                out.put_u32(*flags);
                out.put_u64(*expires_at);
            }
            Op::Settle { queue, id } => {
                out.put_u8(TAG_SETTLE);
                out.put_u64(*queue);
                out.put_u64(*id);
            }
            Op::DropQueue { queue } => {
                out.put_u8(TAG_DROP_QUEUE);
                out.put_u64(*queue);
            }
            Op::Renumber { queue, from, to } => {
                out.put_u8(TAG_RENUMBER);
                out.put_u64(*queue);
                out.put_u64(*from);
                out.put_u64(*to);
            }
        }
    }
    debug_assert_eq!(out.len() - start, RECORD_HEADER + payload);
    let crc = checksum(&out[start + RECORD_HEADER..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_be_bytes());
    Ok(())
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    // Keys and values are metadata records: far below 4 GiB (RECORD_MAX checked first).
    out.put_u32(u32::try_from(b.len()).unwrap_or(u32::MAX));
    out.put_slice(b);
}

/// Why an index log payload does not decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed(pub &'static str);

struct Cursor<'a> {
    p: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], Malformed> {
        let s = self
            .p
            .get(self.at..self.at.saturating_add(n))
            .ok_or(Malformed("an op runs past the record"))?;
        self.at += n;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, Malformed> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, Malformed> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, Malformed> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }

    fn bytes(&mut self) -> Result<Vec<u8>, Malformed> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }

    fn table(&mut self) -> Result<MetaTable, Malformed> {
        MetaTable::from_code(self.u8()?).ok_or(Malformed("unknown table"))
    }
}

/// The ops of a payload whose checksum was verified (enqueues name stored bodies).
///
/// # Errors
/// [`Malformed`] for a payload that is not an index log record or is cut short.
pub fn decode(payload: &[u8]) -> Result<Vec<Op>, Malformed> {
    let mut c = Cursor { p: payload, at: 0 };
    if c.u8()? != KIND_OPS {
        return Err(Malformed("not an index log record"));
    }
    let count = c.u32()? as usize;
    // Each op is at least 9 bytes: a count past that is damage, not a reason to allocate.
    let mut ops = Vec::with_capacity(count.min(payload.len() / 9));
    for _ in 0..count {
        let op = match c.u8()? {
            TAG_PUT => Op::Put {
                table: c.table()?,
                key: c.bytes()?,
                value: c.bytes()?,
            },
            TAG_DELETE => Op::Delete {
                table: c.table()?,
                key: c.bytes()?,
            },
            TAG_ENQUEUE => {
                let queue = c.u64()?;
                let id = c.u64()?;
                let location = Location {
                    segment: c.u32()?,
                    offset: c.u64()?,
                    len: c.u32()?,
                };
                Op::Enqueue {
                    queue,
                    id,
                    body: BodyRef::Stored(location),
                    flags: c.u32()?,
                    expires_at: c.u64()?,
                }
            }
            TAG_SETTLE => Op::Settle {
                queue: c.u64()?,
                id: c.u64()?,
            },
            TAG_DROP_QUEUE => Op::DropQueue { queue: c.u64()? },
            TAG_RENUMBER => Op::Renumber {
                queue: c.u64()?,
                from: c.u64()?,
                to: c.u64()?,
            },
            _ => return Err(Malformed("unknown op")),
        };
        ops.push(op);
    }
    if c.at != payload.len() {
        return Err(Malformed("bytes after the last op"));
    }
    Ok(ops)
}

/// The index log records of segment `id` from `from` to `valid_len` (its verified prefix, as
/// [`crate::segment::scan`] found it), each record's ops in order. Message records are passed
/// over.
///
/// # Errors
/// I/O errors, and [`StoreError::Corrupt`] for a verified record that does not decode.
pub fn replay(dir: &Path, id: u64, from: u64, valid_len: u64) -> Result<Vec<Vec<Op>>, StoreError> {
    let path = segment_path(dir, id);
    let mut file = File::open(&path).map_err(|e| StoreError::io("open segment", &path, e))?;
    file.seek(SeekFrom::Start(from))
        .map_err(|e| StoreError::io("seek segment", &path, e))?;
    let mut r = BufReader::with_capacity(1 << 20, file);
    let mut out = Vec::new();
    let mut at = from;
    let mut payload = Vec::new();
    while at + RECORD_HEADER as u64 <= valid_len {
        let mut rh = [0u8; RECORD_HEADER];
        r.read_exact(&mut rh)
            .map_err(|e| StoreError::io("read segment", &path, e))?;
        let len = u32::from_be_bytes([rh[0], rh[1], rh[2], rh[3]]) as usize;
        let crc = u32::from_be_bytes([rh[4], rh[5], rh[6], rh[7]]);
        let corrupt = |detail: String| StoreError::Corrupt {
            path: path.clone(),
            offset: at,
            detail,
        };
        if len == 0 || at + (RECORD_HEADER + len) as u64 > valid_len {
            return Err(corrupt(format!(
                "a record of {len} bytes crosses the verified end {valid_len}"
            )));
        }
        payload.resize(len, 0);
        r.read_exact(&mut payload)
            .map_err(|e| StoreError::io("read segment", &path, e))?;
        if checksum(&payload) != crc {
            return Err(corrupt("a verified record no longer verifies".into()));
        }
        if payload.first() == Some(&KIND_OPS) {
            out.push(decode(&payload).map_err(|m| corrupt(format!("index log record: {}", m.0)))?);
        }
        at += (RECORD_HEADER + len) as u64;
    }
    Ok(out)
}

/// Apply the index log records after redb's checkpoint (segments `ids`, verified as `scanned`)
/// and commit `end` as the new checkpoint, durably. Returns how many records were applied.
pub(crate) fn replay_index_log(
    db: &Database,
    db_path: &Path,
    seg_dir: &Path,
    ids: &[u64],
    scanned: &HashMap<u64, segment::Scanned>,
    bad_headers: &HashMap<u64, StoreError>,
    end: Checkpoint,
) -> Result<usize, StoreError> {
    let checkpoint = read_checkpoint(db, db_path)?;
    let newest = ids.last().copied();
    let wtx = db.begin_write().map_err(|e| StoreError::db(db_path, e))?;
    let mut replayed = 0;
    if let Some(cp) = checkpoint {
        for &id in ids.iter().filter(|id| **id >= cp.segment) {
            let corrupt = |detail: String| StoreError::Corrupt {
                path: segment::segment_path(seg_dir, id),
                offset: 0,
                detail,
            };
            if bad_headers.contains_key(&id) {
                if Some(id) == newest {
                    // A crash while its header was written: nothing was appended to it.
                    continue;
                }
                return Err(corrupt(
                    "a segment after the index's checkpoint has a damaged header: committed \
                     changes would be lost"
                        .into(),
                ));
            }
            let Some(sc) = scanned.get(&id) else { continue };
            if sc.valid_len < sc.file_len && Some(id) != newest {
                return Err(corrupt(format!(
                    "a segment after the index's checkpoint ends early ({} of {} bytes verify) \
                     while a newer one exists: committed changes would be lost",
                    sc.valid_len, sc.file_len
                )));
            }
            let from = if id == cp.segment {
                cp.offset
            } else {
                SEGMENT_HEADER
            };
            if from > sc.valid_len {
                if Some(id) == newest {
                    continue;
                }
                return Err(corrupt(format!(
                    "the index's checkpoint ({from}) is past the segment's verified end ({})",
                    sc.valid_len
                )));
            }
            for ops in replay(seg_dir, id, from.max(SEGMENT_HEADER), sc.valid_len)? {
                apply_ops(&wtx, &ops, db_path)?;
                replayed += 1;
            }
        }
    }
    write_checkpoint(&wtx, end, db_path)?;
    wtx.commit().map_err(|e| StoreError::db(db_path, e))?;
    Ok(replayed)
}

/// Record in `wtx` where the segments' log stands, and make `wtx` durable.
pub(crate) fn write_checkpoint(
    wtx: &redb::WriteTransaction,
    at: Checkpoint,
    db_path: &Path,
) -> Result<(), StoreError> {
    let mut t = wtx
        .open_table(META)
        .map_err(|e| StoreError::db(db_path, e))?;
    t.insert(KEY_CHECKPOINT_SEGMENT, at.segment)
        .map_err(|e| StoreError::db(db_path, e))?;
    t.insert(KEY_CHECKPOINT_OFFSET, at.offset)
        .map_err(|e| StoreError::db(db_path, e))?;
    Ok(())
}

/// The checkpoint redb holds (None: a directory of the version before the index log, whose
/// redb is complete).
fn read_checkpoint(db: &Database, path: &Path) -> Result<Option<Checkpoint>, StoreError> {
    let rtx = db.begin_read().map_err(|e| StoreError::db(path, e))?;
    let t = match rtx.open_table(META) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
        Err(e) => return Err(StoreError::db(path, e)),
    };
    let get = |k| {
        t.get(k)
            .map(|v| v.map(|v| v.value()))
            .map_err(|e| StoreError::db(path, e))
    };
    Ok(
        match (get(KEY_CHECKPOINT_SEGMENT)?, get(KEY_CHECKPOINT_OFFSET)?) {
            (Some(segment), Some(offset)) => Some(Checkpoint { segment, offset }),
            _ => None,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_op() -> Vec<Op> {
        vec![
            Op::Put {
                table: MetaTable::Queues,
                key: b"q".to_vec(),
                value: b"declared".to_vec(),
            },
            Op::Delete {
                table: MetaTable::Bindings,
                key: b"b".to_vec(),
            },
            Op::Enqueue {
                queue: 7,
                id: 1,
                body: BodyRef::New(0),
                flags: 3,
                expires_at: 99,
            },
            Op::Enqueue {
                queue: 7,
                id: 2,
                body: BodyRef::Stored(Location {
                    segment: 4,
                    offset: 64,
                    len: 10,
                }),
                flags: 0,
                expires_at: 0,
            },
            Op::Settle { queue: 7, id: 1 },
            Op::DropQueue { queue: 8 },
            Op::Renumber {
                queue: 7,
                from: 2,
                to: 9,
            },
        ]
    }

    #[test]
    fn every_op_round_trips_with_new_bodies_located() {
        let new = Location {
            segment: 5,
            offset: 32,
            len: 100,
        };
        let ops = every_op()
            .iter()
            .map(|op| op.located(&[new]))
            .collect::<Result<Vec<Op>, StoreError>>()
            .unwrap();
        let mut out = Vec::new();
        encode(&mut out, &ops).unwrap();
        assert_eq!(out.len(), record_len(&ops));
        let payload = &out[RECORD_HEADER..];
        assert_eq!(
            u32::from_be_bytes(out[4..8].try_into().unwrap()),
            checksum(payload)
        );
        assert_eq!(
            ops[2],
            Op::Enqueue {
                queue: 7,
                id: 1,
                body: BodyRef::Stored(new),
                flags: 3,
                expires_at: 99,
            }
        );
        assert_eq!(decode(payload).unwrap(), ops);
    }

    #[test]
    fn an_enqueue_of_a_body_the_batch_lacks_is_refused() {
        let op = Op::Enqueue {
            queue: 1,
            id: 1,
            body: BodyRef::New(3),
            flags: 0,
            expires_at: 0,
        };
        assert!(op.located(&[]).is_err());
        // An op not located is never written to the log.
        assert!(encode(&mut Vec::new(), &[op]).is_err());
    }

    proptest::proptest! {
        #[test]
        fn decode_never_panics(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..128)) {
            let _ = decode(&data);
        }
    }
}
