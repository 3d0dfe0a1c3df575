//! The WAL's records: how one write of one group is laid out in a segment.
//!
//! ```text
//! record  := len:u32 crc:u32 kind:u8 group:u64 payload[len]
//! crc     := crc32c(segment_seq:u64 | kind | group | payload)      (integers little-endian)
//! ```
//!
//! | kind | name       | payload                                                     |
//! |------|------------|-------------------------------------------------------------|
//! | 1    | Entry      | index:u64, data                                             |
//! | 2    | Meta       | slot:u8 (0 vote, 1 committed, 2 purged), value              |
//! | 3    | Truncate   | from:u64 (entries at `from` and after are gone)             |
//! | 4    | Purge      | upto:u64 (entries up to `upto` are gone)                    |
//! | 5    | Body       | key:u64, data (a body copied out of a purged entry)         |
//! | 6    | DropBodies | key:u64 * n                                                 |
//! | 7    | Forget     | (empty: the group and everything it wrote are gone)         |
//! | 8    | State      | purged:u64 (u64::MAX none), next:u64, per slot: len:u32     |
//! |      |            | (u32::MAX none), value                                      |
//! | 9    | Seal       | next_seq:u64 (group 0: the segment ends here)               |
//!
//! The checksum covers the segment's sequence number, so a record left in a recycled segment
//! file by its earlier life fails it and ends the scan like a torn write.

use bytes::{BufMut, Bytes};

/// Bytes before a record's payload: len, crc, kind, group.
pub const RECORD_HEADER: usize = 4 + 4 + 1 + 8;

/// Payload bytes a record carries at most (an entry of a quorum queue is far smaller: the
/// proposer bounds its batches). A length past it in a scan is a torn or foreign record.
pub const RECORD_PAYLOAD_MAX: usize = 256 * 1024 * 1024;

/// Metadata slots a group keeps (opaque values: the Raft adapter encodes them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MetaSlot {
    /// The last vote given.
    Vote = 0,
    /// The commit index.
    Committed = 1,
    /// The id of the last purged entry.
    Purged = 2,
}

impl MetaSlot {
    /// Every slot, in the order a State record holds them.
    pub const ALL: [Self; 3] = [Self::Vote, Self::Committed, Self::Purged];

    fn from_u8(b: u8) -> Option<Self> {
        match b {
            0 => Some(Self::Vote),
            1 => Some(Self::Committed),
            2 => Some(Self::Purged),
            _ => None,
        }
    }
}

/// One write of one group, as a caller asks for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Put the entry at `index`: the next one after the group's last (or its first after a
    /// purge).
    Append {
        /// The entry's log index.
        index: u64,
        /// The entry's bytes.
        data: Bytes,
    },
    /// Set a metadata slot.
    Meta {
        /// Which slot.
        slot: MetaSlot,
        /// Its new value.
        value: Bytes,
    },
    /// Remove the entries at `from` and after.
    Truncate {
        /// First index removed.
        from: u64,
    },
    /// Remove the entries up to `upto` (inclusive); the next entry appended is `upto + 1` or
    /// later.
    Purge {
        /// Last index removed.
        upto: u64,
    },
    /// Keep a body under `key`, outside any entry (copied out of an entry about to be purged).
    Body {
        /// The caller's key.
        key: u64,
        /// The body's bytes.
        data: Bytes,
    },
    /// Forget the bodies under these keys.
    DropBodies {
        /// Their keys.
        keys: Vec<u64>,
    },
    /// Forget the group: its entries, bodies and metadata.
    Forget,
}

/// A group's metadata and purge point, written whole at the head of every segment so that
/// older segments are never needed for them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupState {
    /// Entries up to here are purged (None: none ever was).
    pub purged: Option<u64>,
    /// The index the next append takes. Replay that starts at this segment starts the group
    /// here: the entries before it are in older segments, freed because they are gone since.
    pub next: u64,
    /// The metadata slots, indexed by [`MetaSlot`].
    pub meta: [Option<Bytes>; 3],
}

/// A record decoded from a segment (its data slices of the segment's bytes, not copies).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// One of a group's writes.
    Op(Op),
    /// A group's whole state (at a segment's head).
    State(GroupState),
    /// The segment ends here; the next one is `next`.
    Seal {
        /// The next segment's sequence number.
        next: u64,
    },
}

const KIND_ENTRY: u8 = 1;
const KIND_META: u8 = 2;
const KIND_TRUNCATE: u8 = 3;
const KIND_PURGE: u8 = 4;
const KIND_BODY: u8 = 5;
const KIND_DROP_BODIES: u8 = 6;
const KIND_FORGET: u8 = 7;
const KIND_STATE: u8 = 8;
const KIND_SEAL: u8 = 9;

/// Length of slot values in a State record meaning "none".
const SLOT_NONE: u32 = u32::MAX;

/// Encoded length of `op`'s record, header included.
#[must_use]
pub fn op_len(op: &Op) -> usize {
    RECORD_HEADER
        + match op {
            Op::Append { data, .. } | Op::Body { data, .. } => 8 + data.len(),
            Op::Meta { value, .. } => 1 + value.len(),
            Op::Truncate { .. } | Op::Purge { .. } => 8,
            Op::DropBodies { keys } => 8 * keys.len(),
            Op::Forget => 0,
        }
}

/// Append `op` of `group` to `out` as a record of segment `seq`.
pub fn encode_op(out: &mut Vec<u8>, seq: u64, group: u64, op: &Op) {
    let start = begin(out, group);
    let kind = match op {
        Op::Append { index, data } => {
            out.put_u64_le(*index);
            out.extend_from_slice(data);
            KIND_ENTRY
        }
        Op::Meta { slot, value } => {
            out.put_u8(*slot as u8);
            out.extend_from_slice(value);
            KIND_META
        }
        Op::Truncate { from } => {
            out.put_u64_le(*from);
            KIND_TRUNCATE
        }
        Op::Purge { upto } => {
            out.put_u64_le(*upto);
            KIND_PURGE
        }
        Op::Body { key, data } => {
            out.put_u64_le(*key);
            out.extend_from_slice(data);
            KIND_BODY
        }
        Op::DropBodies { keys } => {
            for k in keys {
                out.put_u64_le(*k);
            }
            KIND_DROP_BODIES
        }
        Op::Forget => KIND_FORGET,
    };
    finish(out, start, seq, kind);
}

/// Append `group`'s whole state to `out` as a record of segment `seq`.
pub fn encode_state(out: &mut Vec<u8>, seq: u64, group: u64, state: &GroupState) {
    let start = begin(out, group);
    out.put_u64_le(state.purged.unwrap_or(u64::MAX));
    out.put_u64_le(state.next);
    for value in &state.meta {
        match value {
            Some(v) => {
                // A slot value is a small encoded vote or log id; the bound keeps the length
                // below SLOT_NONE.
                let len = u32::try_from(v.len())
                    .unwrap_or(SLOT_NONE - 1)
                    .min(SLOT_NONE - 1);
                out.put_u32_le(len);
                out.extend_from_slice(&v[..len as usize]);
            }
            None => out.put_u32_le(SLOT_NONE),
        }
    }
    finish(out, start, seq, KIND_STATE);
}

/// Append the seal of segment `seq` (the next being `next`) to `out`.
pub fn encode_seal(out: &mut Vec<u8>, seq: u64, next: u64) {
    let start = begin(out, 0);
    out.put_u64_le(next);
    finish(out, start, seq, KIND_SEAL);
}

fn begin(out: &mut Vec<u8>, group: u64) -> usize {
    let start = out.len();
    out.extend_from_slice(&[0u8; 9]);
    out.put_u64_le(group);
    start
}

fn finish(out: &mut [u8], start: usize, seq: u64, kind: u8) {
    let payload_len = out.len() - start - RECORD_HEADER;
    // Callers bound payloads far below 4 GiB (RECORD_PAYLOAD_MAX is checked before encoding).
    let len = u32::try_from(payload_len).unwrap_or(u32::MAX);
    out[start + 8] = kind;
    let crc = checksum(seq, &out[start + 8..]);
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

fn checksum(seq: u64, kind_group_payload: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&seq.to_le_bytes());
    crc32c::crc32c_append(crc, kind_group_payload)
}

/// Why a scan stopped at a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Fewer bytes than a header, or than the length says: the end of what was written.
    Short,
    /// The length is impossible or the checksum fails: a torn write, stale bytes of a recycled
    /// file, or damage.
    Invalid,
}

/// A record read from a segment: the group, the record, and its length in the segment.
#[derive(Debug)]
pub struct Decoded {
    /// The group it belongs to (0 for a seal).
    pub group: u64,
    /// The record.
    pub record: Record,
    /// Bytes it takes in the segment, header included.
    pub len: usize,
}

/// Decode the record of segment `seq` at the start of `buf`.
///
/// # Errors
/// [`Stop`] when `buf` does not start with a whole valid record.
pub fn decode(seq: u64, buf: &Bytes) -> Result<Decoded, Stop> {
    if buf.len() < RECORD_HEADER {
        return Err(Stop::Short);
    }
    let len = u32_at(buf, 0) as usize;
    if len > RECORD_PAYLOAD_MAX {
        return Err(Stop::Invalid);
    }
    let total = RECORD_HEADER + len;
    if buf.len() < total {
        return Err(Stop::Short);
    }
    if checksum(seq, &buf[8..total]) != u32_at(buf, 4) {
        return Err(Stop::Invalid);
    }
    let kind = buf[8];
    let group = u64_at(buf, 9);
    let payload = buf.slice(RECORD_HEADER..total);
    let record = decode_payload(kind, &payload).ok_or(Stop::Invalid)?;
    Ok(Decoded {
        group,
        record,
        len: total,
    })
}

fn decode_payload(kind: u8, p: &Bytes) -> Option<Record> {
    let op = match kind {
        KIND_ENTRY if p.len() >= 8 => Op::Append {
            index: u64_at(p, 0),
            data: p.slice(8..),
        },
        KIND_META if !p.is_empty() => Op::Meta {
            slot: MetaSlot::from_u8(p[0])?,
            value: p.slice(1..),
        },
        KIND_TRUNCATE if p.len() == 8 => Op::Truncate { from: u64_at(p, 0) },
        KIND_PURGE if p.len() == 8 => Op::Purge { upto: u64_at(p, 0) },
        KIND_BODY if p.len() >= 8 => Op::Body {
            key: u64_at(p, 0),
            data: p.slice(8..),
        },
        KIND_DROP_BODIES if p.len().is_multiple_of(8) => Op::DropBodies {
            keys: p.chunks_exact(8).map(|c| u64_at(c, 0)).collect(),
        },
        KIND_FORGET if p.is_empty() => Op::Forget,
        KIND_STATE => return decode_state(p).map(Record::State),
        KIND_SEAL if p.len() == 8 => {
            return Some(Record::Seal { next: u64_at(p, 0) });
        }
        _ => return None,
    };
    Some(Record::Op(op))
}

fn decode_state(p: &Bytes) -> Option<GroupState> {
    let mut state = GroupState {
        purged: Some(u64::from_le_bytes(p.get(0..8)?.try_into().ok()?)).filter(|p| *p != u64::MAX),
        next: u64::from_le_bytes(p.get(8..16)?.try_into().ok()?),
        meta: [None, None, None],
    };
    let mut at = 16;
    for slot in &mut state.meta {
        let len = u32::from_le_bytes(p.get(at..at + 4)?.try_into().ok()?);
        at += 4;
        if len != SLOT_NONE {
            let end = at + len as usize;
            if end > p.len() {
                return None;
            }
            *slot = Some(p.slice(at..end));
            at = end;
        }
    }
    (at == p.len()).then_some(state)
}

/// The little-endian u32 at `at` (0 past the end: callers check lengths first).
fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u32::from_le_bytes)
}

/// The little-endian u64 at `at` (0 past the end: callers check lengths first).
fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ops() -> Vec<Op> {
        vec![
            Op::Append {
                index: 7,
                data: Bytes::from_static(b"entry"),
            },
            Op::Append {
                index: 8,
                data: Bytes::new(),
            },
            Op::Meta {
                slot: MetaSlot::Committed,
                value: Bytes::from_static(b"{\"c\":1}"),
            },
            Op::Truncate { from: 3 },
            Op::Purge { upto: 9 },
            Op::Body {
                key: 1 << 20,
                data: Bytes::from_static(b"body"),
            },
            Op::DropBodies {
                keys: vec![1, 2, 3],
            },
            Op::Forget,
        ]
    }

    #[test]
    fn every_record_round_trips_and_its_length_is_known_before_encoding() {
        for op in ops() {
            let mut buf = Vec::new();
            encode_op(&mut buf, 5, 42, &op);
            assert_eq!(buf.len(), op_len(&op), "{op:?}");
            let d = decode(5, &Bytes::from(buf.clone())).expect("valid record");
            assert_eq!((d.group, d.len), (42, buf.len()));
            assert_eq!(d.record, Record::Op(op));
        }
        let state = GroupState {
            purged: Some(12),
            next: 20,
            meta: [Some(Bytes::from_static(b"v")), None, Some(Bytes::new())],
        };
        let mut buf = Vec::new();
        encode_state(&mut buf, 5, 9, &state);
        encode_seal(&mut buf, 5, 6);
        let buf = Bytes::from(buf);
        let d = decode(5, &buf).expect("state");
        assert_eq!(d.record, Record::State(state));
        let seal = decode(5, &buf.slice(d.len..)).expect("seal");
        assert_eq!(seal.record, Record::Seal { next: 6 });
    }

    #[test]
    fn a_record_of_another_segment_or_cut_short_or_damaged_stops_a_scan() {
        let mut buf = Vec::new();
        encode_op(
            &mut buf,
            5,
            1,
            &Op::Append {
                index: 1,
                data: Bytes::from_static(b"payload"),
            },
        );
        let whole = Bytes::from(buf.clone());
        assert!(decode(5, &whole).is_ok());
        // A recycled file's earlier life: the same bytes under another sequence number.
        assert_eq!(decode(6, &whole).err(), Some(Stop::Invalid));
        for cut in 0..buf.len() {
            assert_eq!(
                decode(5, &whole.slice(..cut)).err(),
                Some(Stop::Short),
                "cut at {cut}"
            );
        }
        for at in 0..buf.len() {
            let mut bad = buf.clone();
            bad[at] ^= 0x40;
            assert!(
                decode(5, &Bytes::from(bad)).is_err(),
                "flipped byte {at} went unnoticed"
            );
        }
        assert!(decode(5, &Bytes::from(vec![0u8; 64])).is_err());
    }
}
