//! Reads: planned under the WAL's lock (where each record is: the writer's buffers or a
//! segment file), done outside it. Records near each other in one segment are read with one
//! pread; every record read from a file is checked against its checksum, so a segment freed
//! and reused under a reader is noticed rather than returned.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;

use crate::wal::error::WalError;
use crate::wal::index::Loc;
use crate::wal::record::{self, Record};
use crate::wal::{State, segment};

/// Two records in one segment closer than this are read with one pread.
const READ_GAP_MAX: u64 = 64 * 1024;
/// One pread covers at most this much.
const READ_SPAN_MAX: u64 = 4 * 1024 * 1024;

/// A read planned under the lock.
pub(super) enum Planned {
    /// A record from the writer's buffers, of the segment named.
    Ready(Bytes, u32),
    /// A record in a segment's file (synced).
    File(Arc<File>, Loc),
}

/// Plan the read of the record at `loc`: from the buffers if it is not synced, else from its
/// segment's file.
pub(super) fn plan(state: &State, loc: Loc) -> Result<Planned, WalError> {
    if let Some(s) = state.segments.get(&loc.segment)
        && let Some(file) = &s.file
        && s.synced >= loc.end()
    {
        return Ok(Planned::File(Arc::clone(file), loc));
    }
    state
        .buffered(loc)
        .map(|b| Planned::Ready(b, loc.segment))
        .ok_or_else(|| {
            WalError::Stopped(format!("record {loc:?} is neither buffered nor written").into())
        })
}

/// Records of one segment read with one pread.
struct Span {
    file: Arc<File>,
    segment: u32,
    start: u64,
    end: u64,
    locs: Vec<Loc>,
}

impl Span {
    fn takes(&self, loc: Loc) -> bool {
        self.segment == loc.segment
            && u64::from(loc.offset) >= self.end
            && u64::from(loc.offset) - self.end <= READ_GAP_MAX
            && loc.end() - self.start <= READ_SPAN_MAX
    }

    fn read(self, dir: &Path, out: &mut Vec<Record>) -> Result<(), WalError> {
        let path = segment::path(dir, u64::from(self.segment));
        let len = usize::try_from(self.end - self.start).unwrap_or(usize::MAX);
        let bytes = Bytes::from(segment::read_at(&self.file, &path, self.start, len)?);
        for loc in self.locs {
            let at = (u64::from(loc.offset) - self.start) as usize;
            let rec = bytes.slice(at..at + loc.len as usize);
            let d = record::decode(u64::from(self.segment), &rec).map_err(|stop| {
                WalError::Corrupt {
                    path: path.clone(),
                    offset: u64::from(loc.offset),
                    detail: format!("an indexed record does not verify ({stop:?})"),
                }
            })?;
            out.push(d.record);
        }
        Ok(())
    }
}

/// Do planned reads, in order.
pub(super) fn read(dir: &Path, planned: Vec<Planned>) -> Result<Vec<Record>, WalError> {
    let mut out = Vec::with_capacity(planned.len());
    let mut span: Option<Span> = None;
    for p in planned {
        match p {
            Planned::Ready(bytes, seg) => {
                if let Some(s) = span.take() {
                    s.read(dir, &mut out)?;
                }
                let d =
                    record::decode(u64::from(seg), &bytes).map_err(|stop| WalError::Corrupt {
                        path: segment::path(dir, u64::from(seg)),
                        offset: 0,
                        detail: format!("a buffered record does not verify ({stop:?})"),
                    })?;
                out.push(d.record);
            }
            Planned::File(file, loc) => match &mut span {
                Some(s) if s.takes(loc) => {
                    s.end = loc.end();
                    s.locs.push(loc);
                }
                _ => {
                    if let Some(s) = span.take() {
                        s.read(dir, &mut out)?;
                    }
                    span = Some(Span {
                        file,
                        segment: loc.segment,
                        start: u64::from(loc.offset),
                        end: loc.end(),
                        locs: vec![loc],
                    });
                }
            },
        }
    }
    if let Some(s) = span {
        s.read(dir, &mut out)?;
    }
    Ok(out)
}
