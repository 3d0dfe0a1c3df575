//! Recovery: replaying the segments at start, cutting a torn tail, refusing damage.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;

use crate::wal::error::WalError;
use crate::wal::index::{GroupLog, Loc};
use crate::wal::record::{self, Op, Record};
use crate::wal::{Segment, State, segment};

/// Replay the segments in `dir` into `state`; return the newest segment's sequence number.
pub(super) fn recover(dir: &Path, state: &mut State) -> Result<Option<u32>, WalError> {
    let (mut seqs, _) = segment::list(dir)?;
    // Only a contiguous run of the newest segments is the log: older ones before a gap were
    // freed (in order) and their removal did not reach the disk.
    if let Some(gap) = seqs.windows(2).rposition(|w| w[1] != w[0] + 1) {
        for stale in seqs.drain(..=gap) {
            remove(dir, stale)?;
        }
    }
    let mut last: Option<(u32, Option<u64>)> = None; // (seq, cut offset if unsealed)
    let newest = seqs.last().copied();
    for seq in seqs {
        let seq32 = u32::try_from(seq).map_err(|_| WalError::SegmentsExhausted)?;
        let p = segment::path(dir, seq);
        let file = segment::open(dir, seq)?;
        let file_len = file
            .metadata()
            .map_err(|e| WalError::io("read the log", &p, e))?
            .len();
        let head = if file_len >= segment::HEADER_LEN as u64 {
            segment::read_at(&file, &p, 0, segment::HEADER_LEN)?
        } else {
            Vec::new()
        };
        let unsealed_before = last.and_then(|(_, cut)| cut).is_some();
        if !segment::header_is(&head, seq) {
            if unsealed_before || Some(seq) == newest {
                // Made but its head never reached the disk: nothing in it was acknowledged.
                remove(dir, seq)?;
                continue;
            }
            return Err(WalError::Corrupt {
                path: p,
                offset: 0,
                detail: "the segment's header is not a write-ahead log header".into(),
            });
        }
        state.segments.insert(
            seq32,
            Segment {
                file: None,
                live: 0,
                synced: 0,
                sealed_len: None,
            },
        );
        let (end, sealed, records) = replay(seq, &file, file_len, state, &p)?;
        if unsealed_before {
            if records > 0 {
                let (prev, _) = last.unwrap_or((0, None));
                return Err(WalError::Corrupt {
                    path: segment::path(dir, u64::from(prev)),
                    offset: 0,
                    detail: format!(
                        "the segment ends without a seal but segment {seq} holds records"
                    ),
                });
            }
            state.segments.remove(&seq32);
            remove(dir, seq)?;
            continue;
        }
        if let Some(s) = state.segments.get_mut(&seq32) {
            s.file = Some(Arc::new(file));
            if sealed {
                s.sealed_len = Some(end);
                s.synced = end;
            }
        }
        last = Some((seq32, (!sealed).then_some(end)));
    }
    // Cut a torn tail: a seal where the valid records end, so later scans stop there.
    if let Some((seq, Some(cut))) = last {
        let next = u64::from(seq) + 1;
        let mut seal = Vec::new();
        record::encode_seal(&mut seal, u64::from(seq), next);
        let p = segment::path(dir, u64::from(seq));
        if let Some(s) = state.segments.get_mut(&seq) {
            if let Some(file) = &s.file {
                segment::write_at(file, &p, cut, &seal)?;
                segment::sync(file, &p)?;
            }
            let end = cut + seal.len() as u64;
            s.sealed_len = Some(end);
            s.synced = end;
        }
    }
    Ok(last.map(|(seq, _)| seq))
}

/// Bytes of a segment read at a time in a replay: memory at start is bounded by this (and by
/// the largest record), not by the segment's size.
const SCAN_WINDOW: usize = 4 * 1024 * 1024;

/// Replay the records of segment `seq` (its file `file`, `file_len` bytes), a window at a
/// time; return where its records end, whether it was sealed, and how many records it held.
fn replay(
    seq: u64,
    file: &std::fs::File,
    file_len: u64,
    state: &mut State,
    p: &Path,
) -> Result<(u64, bool, usize), WalError> {
    let mut at = segment::HEADER_LEN as u64;
    let mut records = 0;
    while at < file_len {
        let remaining = file_len - at;
        let mut window = usize::try_from(remaining)
            .unwrap_or(SCAN_WINDOW)
            .min(SCAN_WINDOW);
        if window >= record::RECORD_HEADER {
            // A record longer than the window is read whole (its length bounded by
            // RECORD_PAYLOAD_MAX; a longer or torn one ends the scan below).
            let head = segment::read_at(file, p, at, record::RECORD_HEADER)?;
            let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
            let whole = record::RECORD_HEADER.saturating_add(len);
            if len <= record::RECORD_PAYLOAD_MAX && whole as u64 <= remaining {
                window = window.max(whole);
            }
        }
        let buf = Bytes::from(segment::read_at(file, p, at, window)?);
        let mut off = 0;
        loop {
            let d = match record::decode(seq, &buf.slice(off..)) {
                Ok(d) => d,
                Err(record::Stop::Short) if off > 0 => break,
                Err(_) => return Ok((at + off as u64, false, records)),
            };
            let loc = Loc {
                segment: u32::try_from(seq).map_err(|_| WalError::SegmentsExhausted)?,
                offset: u32::try_from(at + off as u64).unwrap_or(u32::MAX),
                len: u32::try_from(d.len).unwrap_or(u32::MAX),
            };
            off += d.len;
            records += 1;
            if apply(d.group, d.record, loc, state, p)? {
                return Ok((at + off as u64, true, records));
            }
        }
        at += off as u64;
    }
    Ok((at, false, records))
}

/// Apply one replayed record; true for a seal (the segment ends).
fn apply(
    group: u64,
    record: Record,
    loc: Loc,
    state: &mut State,
    p: &Path,
) -> Result<bool, WalError> {
    let State {
        groups, segments, ..
    } = state;
    match record {
        Record::Seal { .. } => return Ok(true),
        Record::State(s) => groups
            .entry(group)
            .or_insert_with(GroupLog::new)
            .restore(&s, segments),
        Record::Op(Op::Forget) => {
            if let Some(mut g) = groups.remove(&group) {
                g.release_all(segments);
            }
        }
        Record::Op(op) => {
            let g = groups.entry(group).or_insert_with(GroupLog::new);
            g.apply(&op, loc, segments).map_err(|e| WalError::Corrupt {
                path: p.to_path_buf(),
                offset: u64::from(loc.offset),
                detail: format!(
                    "group {group}: entry {} where {} was next",
                    e.index, e.expected
                ),
            })?;
        }
    }
    Ok(false)
}

fn remove(dir: &Path, seq: u64) -> Result<(), WalError> {
    let p = segment::path(dir, seq);
    std::fs::remove_file(&p).map_err(|e| WalError::io("remove a stale log segment", &p, e))
}
