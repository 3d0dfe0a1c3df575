//! The WAL's writer thread: takes every record staged since its last round, writes each
//! segment's bytes with one pwrite, syncs a segment before writing the next (so a segment
//! holding records always follows a sealed, durable one), then tells every write of the round
//! its outcome and recycles the files of the segments freed before the round took its
//! records (whatever freed them is in those records, so durable first).

use std::collections::HashMap;
use std::fs::File;
use std::sync::Arc;

use crate::wal::error::WalError;
use crate::wal::{Chunk, Shared, segment};

pub(super) fn run(shared: &Shared) {
    loop {
        let (chunks, mut files, dones, frees) = {
            let mut state = shared.state.lock();
            while !state.has_work() && !state.closing {
                shared.work.wait(&mut state);
            }
            if !state.has_work() {
                return;
            }
            if let Some(why) = state.stopped.clone() {
                // Nothing staged after a failure is written: its writes fail.
                state.tail.clear();
                state.closed.clear();
                let dones = std::mem::take(&mut state.waiting);
                let frees = std::mem::take(&mut state.to_free);
                drop(state);
                shared.room.notify_all();
                for done in dones {
                    done(Err(WalError::Stopped(Arc::clone(&why))));
                }
                drop(frees);
                continue;
            }
            let mut chunks = std::mem::take(&mut state.closed);
            if !state.tail.is_empty() {
                let bytes = Arc::new(std::mem::take(&mut state.tail));
                let start = state.tail_start;
                state.tail_start += bytes.len() as u64;
                chunks.push(Chunk {
                    segment: state.active,
                    start,
                    bytes,
                });
            }
            state.inflight.clone_from(&chunks);
            let files: HashMap<u32, Arc<File>> = chunks
                .iter()
                .filter_map(|c| {
                    let f = state.segments.get(&c.segment)?.file.clone()?;
                    Some((c.segment, f))
                })
                .collect();
            let dones = std::mem::take(&mut state.waiting);
            let frees = std::mem::take(&mut state.to_free);
            (chunks, files, dones, frees)
        };
        shared.room.notify_all();
        let result = write_chunks(shared, &chunks, &mut files);
        {
            let mut state = shared.state.lock();
            match &result {
                Ok(()) => {
                    for c in &chunks {
                        if let Some(s) = state.segments.get_mut(&c.segment) {
                            s.synced = s.synced.max(c.end());
                            if s.file.is_none() {
                                s.file = files.get(&c.segment).cloned();
                            }
                        }
                    }
                    state.inflight.clear();
                    state.stats.rounds += 1;
                    state.stats.writes += dones.len() as u64;
                    state.stats.bytes += chunks.iter().map(|c| c.bytes.len() as u64).sum::<u64>();
                    // Freed now, recycled by the next round: a segment may be free only
                    // because of a record staged during this round (a purge, a body
                    // appended again), which is durable only once that round is.
                    state.free_segments();
                }
                Err(e) => {
                    tracing::error!(error = %e, "the write-ahead log failed; it writes nothing more");
                    state.stopped = Some(e.to_string().into());
                }
            }
        }
        shared.room.notify_all();
        for done in dones {
            done(result.clone());
        }
        for seq in frees {
            if let Err(e) = segment::free(&shared.dir, u64::from(seq)) {
                // A freed segment left on disk is replayed harmlessly at the next start.
                tracing::warn!(error = %e, seq, "could not recycle a freed log segment");
            }
        }
    }
}

fn write_chunks(
    shared: &Shared,
    chunks: &[Chunk],
    files: &mut HashMap<u32, Arc<File>>,
) -> Result<(), WalError> {
    for (i, c) in chunks.iter().enumerate() {
        let seq = u64::from(c.segment);
        let path = segment::path(&shared.dir, seq);
        let file = match files.get(&c.segment) {
            Some(f) => Arc::clone(f),
            None => {
                let f = Arc::new(segment::make(
                    &shared.dir,
                    seq,
                    shared.options.segment_bytes,
                )?);
                files.insert(c.segment, Arc::clone(&f));
                f
            }
        };
        segment::write_at(&file, &path, c.start, &c.bytes)?;
        let ends_segment = chunks.get(i + 1).is_none_or(|n| n.segment != c.segment);
        if ends_segment {
            segment::sync(&file, &path)?;
        }
    }
    Ok(())
}
