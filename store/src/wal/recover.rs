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
        let bytes =
            Bytes::from(std::fs::read(&p).map_err(|e| WalError::io("read the log", &p, e))?);
        let unsealed_before = last.and_then(|(_, cut)| cut).is_some();
        if !segment::header_is(&bytes, seq) {
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
        let (end, sealed, records) = replay(seq, &bytes, state, &p)?;
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
            s.file = Some(Arc::new(segment::open(dir, seq)?));
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

/// Replay the records of segment `seq`; return where its records end, whether it was sealed,
/// and how many records it held.
fn replay(
    seq: u64,
    bytes: &Bytes,
    state: &mut State,
    p: &Path,
) -> Result<(u64, bool, usize), WalError> {
    let seq32 = u32::try_from(seq).map_err(|_| WalError::SegmentsExhausted)?;
    let mut at = segment::HEADER_LEN;
    let mut records = 0;
    while let Ok(d) = record::decode(seq, &bytes.slice(at..)) {
        records += 1;
        let loc = Loc {
            segment: seq32,
            offset: u32::try_from(at).unwrap_or(u32::MAX),
            len: u32::try_from(d.len).unwrap_or(u32::MAX),
        };
        at += d.len;
        let State {
            groups, segments, ..
        } = &mut *state;
        match d.record {
            Record::Seal { .. } => return Ok((at as u64, true, records)),
            Record::State(s) => groups
                .entry(d.group)
                .or_insert_with(GroupLog::new)
                .restore(&s, segments),
            Record::Op(Op::Forget) => {
                if let Some(mut g) = groups.remove(&d.group) {
                    g.release_all(segments);
                }
            }
            Record::Op(op) => {
                let g = groups.entry(d.group).or_insert_with(GroupLog::new);
                g.apply(&op, loc, segments).map_err(|e| WalError::Corrupt {
                    path: p.to_path_buf(),
                    offset: u64::from(loc.offset),
                    detail: format!(
                        "group {}: entry {} where {} was next",
                        d.group, e.index, e.expected
                    ),
                })?;
            }
        }
    }
    Ok((at as u64, false, records))
}

fn remove(dir: &Path, seq: u64) -> Result<(), WalError> {
    let p = segment::path(dir, seq);
    std::fs::remove_file(&p).map_err(|e| WalError::io("remove a stale log segment", &p, e))
}
