//! A stream on one node's disk: its [`StreamLog`] driven against its segment files
//! (`warren_store::stream_file`). The log decides; this carries out its effects (open a
//! file, write a chunk, delete dropped files) and reads chunks back by offset.
//!
//! Recovery scans the directory's files in offset order, truncates a torn tail of the newest
//! (a crash mid-append: those messages were never confirmed) and rebuilds the log from the
//! chunks' headers, so a restart reads no bodies.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use warren_store::StoreError;
use warren_store::stream_file::{self, StreamFile, StreamMessage};

use super::filter::ChunkFilter;
use super::log::{
    Chunk, Command, Effect, MessageMeta, Segment, StreamConfig, StreamError, StreamLog,
};

/// A stream's files and log. Not shared: its owner serialises appends.
#[derive(Debug)]
pub struct StreamDisk {
    dir: PathBuf,
    log: StreamLog,
    /// The open (newest) segment's file.
    open: Option<StreamFile>,
    /// Where each chunk starts in its file, by segment id, in chunk order.
    positions: BTreeMap<u64, Vec<u64>>,
}

impl StreamDisk {
    /// Open the stream kept in `dir` (created if missing), with `config`; retention is applied
    /// at `now_ms` once recovered.
    ///
    /// # Errors
    /// A file is damaged beyond its tail, of another version, or missing in the middle.
    pub fn open(dir: &Path, config: StreamConfig, now_ms: u64) -> Result<Self, StoreError> {
        std::fs::create_dir_all(dir).map_err(|e| StoreError::Io {
            context: "creating a stream directory",
            path: dir.to_path_buf(),
            source: e,
        })?;
        let mut ids: Vec<u64> = std::fs::read_dir(dir)
            .map_err(|e| StoreError::Io {
                context: "listing a stream directory",
                path: dir.to_path_buf(),
                source: e,
            })?
            .filter_map(Result::ok)
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                name.strip_suffix(".str")?.parse::<u64>().ok()
            })
            .collect();
        ids.sort_unstable();
        let mut scans = Vec::with_capacity(ids.len());
        for (k, id) in ids.iter().enumerate() {
            let path = stream_file::file_path(dir, *id);
            let scan = stream_file::scan(&path)?;
            let whole = std::fs::metadata(&path).map_or(0, |m| m.len());
            if k + 1 < ids.len() && (scan.valid_len != whole || scan.chunks.is_empty()) {
                // Only the newest file is appended to: damage elsewhere is not a torn tail.
                return Err(StoreError::Corrupt {
                    path,
                    offset: scan.valid_len,
                    detail: "a closed stream segment does not verify to its end".into(),
                });
            }
            scans.push(scan);
        }
        // A newest file without a whole chunk (a crash right after it was created, or its
        // only chunk torn) goes if an older one can be appended to again.
        if scans.len() > 1 && scans.last().is_some_and(|s| s.chunks.is_empty()) {
            let empty = scans.pop().map_or(0, |s| s.first_offset);
            let path = stream_file::file_path(dir, empty);
            std::fs::remove_file(&path).map_err(|e| StoreError::Io {
                context: "deleting an empty stream segment",
                path,
                source: e,
            })?;
        }
        let mut segments = Vec::new();
        let mut positions = BTreeMap::new();
        for scan in &scans {
            let chunks: Vec<Chunk> = scan
                .chunks
                .iter()
                .map(|c| Chunk {
                    first: c.first,
                    count: u64::from(c.count),
                    bytes: c.body_bytes,
                    timestamp_ms: c.timestamp_ms,
                    filter: ChunkFilter::from_bytes(&c.filter)
                        .unwrap_or_else(|| ChunkFilter::new(config.filter_bytes)),
                })
                .collect();
            positions.insert(
                scan.first_offset,
                scan.chunks.iter().map(|c| c.pos).collect(),
            );
            if !chunks.is_empty() {
                segments.push(Segment {
                    id: scan.first_offset,
                    bytes: chunks.iter().map(|c| c.bytes).sum(),
                    chunks,
                });
            }
        }
        let floor = scans.last().map_or(0, |s| s.first_offset);
        let offsets = read_offsets(dir)?;
        let log = StreamLog::restore(config, segments, floor, offsets).map_err(|detail| {
            StoreError::Corrupt {
                path: dir.to_path_buf(),
                offset: 0,
                detail,
            }
        })?;
        let open = match scans.last() {
            Some(scan) => Some(StreamFile::reopen(dir, scan)?),
            None => None,
        };
        let mut disk = Self {
            dir: dir.to_path_buf(),
            log,
            open,
            positions,
        };
        disk.apply(now_ms, Command::Retain, &[])?;
        Ok(disk)
    }

    /// The log (offsets, chunks, lag).
    #[must_use]
    pub fn log(&self) -> &StreamLog {
        &self.log
    }

    /// Append `messages` as one chunk at `now_ms` (durable once [`StreamDisk::sync`]
    /// returned); returns the offsets they got.
    ///
    /// # Errors
    /// A write failed: the stream must be reopened (recovery cuts what was not synced).
    pub fn append(
        &mut self,
        now_ms: u64,
        messages: &[StreamMessage],
    ) -> Result<std::ops::Range<u64>, StoreError> {
        let metas: Vec<MessageMeta> = messages
            .iter()
            .map(|m| MessageMeta {
                bytes: m.body.len() as u64,
                filter: m.filter_value.clone(),
            })
            .collect();
        let first = self.log.next_offset();
        self.apply(now_ms, Command::Append(metas), messages)?;
        Ok(first..self.log.next_offset())
    }

    /// New retention settings (a policy changed), applied at once at `now_ms`.
    ///
    /// # Errors
    /// A file could not be deleted.
    pub fn configure(&mut self, now_ms: u64, config: StreamConfig) -> Result<(), StoreError> {
        self.apply(now_ms, Command::Configure(config), &[])
    }

    /// Remember that consumer `name` has handled everything before `next` (in memory; made
    /// durable by [`StreamDisk::save_offsets`]).
    ///
    /// # Errors
    /// The name is refused (too long, or too many names).
    pub fn store_offset(&mut self, name: &str, next: u64) -> Result<(), StreamError> {
        if self.log.stored_offset(name) == Some(next) {
            return Ok(());
        }
        self.log
            .apply(
                0,
                Command::StoreOffset {
                    name: name.to_string(),
                    next,
                },
            )
            .map(|_| ())
    }

    /// Drop every segment and start again, empty, at offset `next` (a replica whose files end
    /// before the first chunk a snapshot brings). Tracked offsets are kept.
    ///
    /// # Errors
    /// A file could not be deleted, or the log refuses the restart.
    pub fn reset(&mut self, next: u64) -> Result<(), StoreError> {
        self.open = None;
        // Every segment file, also one the log never knew (an empty newest one).
        let entries =
            std::fs::read_dir(&self.dir).map_err(io("listing a stream directory", &self.dir))?;
        for e in entries.flatten() {
            if e.file_name().to_str().is_some_and(|n| n.ends_with(".str")) {
                std::fs::remove_file(e.path())
                    .map_err(io("deleting a stream segment", &e.path()))?;
            }
        }
        self.positions.clear();
        let offsets = self
            .log
            .stored_offsets()
            .map(|(n, o)| (n.to_string(), o))
            .collect();
        self.log = StreamLog::restore(self.log.config().clone(), Vec::new(), next, offsets)
            .map_err(|detail| StoreError::Corrupt {
                path: self.dir.clone(),
                offset: next,
                detail,
            })?;
        // An empty segment named `next`: a restart reopens the stream there, not at 0.
        self.open = Some(StreamFile::create(&self.dir, next)?);
        self.positions.insert(next, Vec::new());
        std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io("syncing a stream directory", &self.dir))
    }

    /// Its directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The tracked offsets encoded as the `offsets` file holds them.
    #[must_use]
    pub fn offsets_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(OFFSETS_MAGIC);
        let names: Vec<(&str, u64)> = self.log.stored_offsets().collect();
        out.extend_from_slice(&u32::try_from(names.len()).unwrap_or(u32::MAX).to_be_bytes());
        for (name, next) in names {
            // Names are at most TRACKED_NAME_MAX (255) bytes: the log refuses longer ones.
            let name = &name.as_bytes()[..name.len().min(255)];
            out.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
            out.extend_from_slice(name);
            out.extend_from_slice(&next.to_be_bytes());
        }
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_be_bytes());
        out
    }

    /// Write the tracked offsets durably now (see [`write_offsets`]).
    ///
    /// # Errors
    /// The file could not be written.
    pub fn save_offsets(&self) -> Result<(), StoreError> {
        write_offsets(&self.dir, &self.offsets_bytes())
    }

    /// Apply retention at `now_ms` (deleting the files it drops).
    ///
    /// # Errors
    /// A file could not be deleted.
    pub fn retain(&mut self, now_ms: u64) -> Result<(), StoreError> {
        self.apply(now_ms, Command::Retain, &[])
    }

    /// Make every appended chunk durable.
    ///
    /// # Errors
    /// The sync failed: nothing appended since the last sync may be confirmed.
    pub fn sync(&self) -> Result<(), StoreError> {
        self.open.as_ref().map_or(Ok(()), StreamFile::sync)
    }

    /// A handle that syncs the open segment without this stream being borrowed (closed
    /// segments are synced when the next one opens).
    ///
    /// # Errors
    /// The handle could not be made.
    pub fn sync_handle(&self) -> Result<Option<stream_file::SyncHandle>, StoreError> {
        self.open.as_ref().map(StreamFile::sync_handle).transpose()
    }

    fn apply(
        &mut self,
        now_ms: u64,
        command: Command,
        messages: &[StreamMessage],
    ) -> Result<(), StoreError> {
        let effects = self
            .log
            .apply(now_ms, command)
            .map_err(|e| StoreError::Replication(e.to_string()))?;
        for effect in effects {
            match effect {
                Effect::OpenSegment(id) => {
                    if let Some(old) = &self.open {
                        // The closed segment's bytes are final: durable before the next file.
                        old.sync()?;
                    }
                    // Recovery may have left this very segment's file, still empty.
                    let reuse = self
                        .open
                        .as_ref()
                        .is_some_and(|f| f.is_empty() && f.first_offset() == id);
                    if !reuse {
                        self.open = Some(StreamFile::create(&self.dir, id)?);
                    }
                    self.positions.insert(id, Vec::new());
                }
                Effect::Appended { segment, first, .. } => {
                    let filter = self
                        .log
                        .chunk_of(first)
                        .map(|(_, c)| c.filter.to_bytes())
                        .unwrap_or_default();
                    let timestamp = self
                        .log
                        .chunk_of(first)
                        .map_or(now_ms, |(_, c)| c.timestamp_ms);
                    let file = self.open.as_mut().ok_or_else(|| StoreError::Corrupt {
                        path: self.dir.clone(),
                        offset: first,
                        detail: "no open stream segment to append to".into(),
                    })?;
                    let pos = file.append(first, timestamp, &filter, messages)?;
                    self.positions.entry(segment).or_default().push(pos);
                }
                Effect::DropSegments(ids) => {
                    for id in ids {
                        let path = stream_file::file_path(&self.dir, id);
                        std::fs::remove_file(&path).map_err(|e| StoreError::Io {
                            context: "deleting a stream segment",
                            path,
                            source: e,
                        })?;
                        self.positions.remove(&id);
                    }
                }
            }
        }
        Ok(())
    }

    /// The messages of the chunk holding `offset`, with that chunk's first offset (None: the
    /// offset is not held, dropped or not yet written).
    ///
    /// # Errors
    /// The chunk could not be read or does not verify.
    pub fn read_chunk(&self, offset: u64) -> Result<Option<(u64, Vec<StreamMessage>)>, StoreError> {
        let Some((segment, index, chunk)) = self.log.chunk_at(offset) else {
            return Ok(None);
        };
        let Some(pos) = self
            .positions
            .get(&segment)
            .and_then(|p| p.get(index).copied())
        else {
            return Ok(None);
        };
        let (info, messages) =
            stream_file::read_chunk(&stream_file::file_path(&self.dir, segment), pos)?;
        if info.first != chunk.first {
            return Err(StoreError::Corrupt {
                path: stream_file::file_path(&self.dir, segment),
                offset: pos,
                detail: format!("chunk {} found where {} belongs", info.first, chunk.first),
            });
        }
        Ok(Some((chunk.first, messages)))
    }
}

/// The tracked offsets' file in a stream's directory.
const OFFSETS_FILE: &str = "offsets";
/// Its first bytes (and format version).
const OFFSETS_MAGIC: &[u8; 8] = b"WARROFF1";

/// `map_err` for an I/O failure of `context` on `path`.
fn io(context: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> StoreError {
    let path = path.to_path_buf();
    move |source| StoreError::Io {
        context,
        path,
        source,
    }
}

/// Write a stream's `offsets` file (from [`StreamDisk::offsets_bytes`]) durably: a temporary
/// file, fsync, rename, directory fsync, so a restart resumes named consumers where they were.
///
/// # Errors
/// The file could not be written.
pub fn write_offsets(dir: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let tmp = dir.join("offsets.tmp");
    let path = dir.join(OFFSETS_FILE);
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp).map_err(io("writing stream offsets", &tmp))?;
        f.write_all(bytes)
            .and_then(|()| f.sync_all())
            .map_err(io("writing stream offsets", &tmp))?;
    }
    std::fs::rename(&tmp, &path).map_err(io("renaming stream offsets", &path))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("syncing a stream directory", dir))
}

/// The tracked offsets saved in `dir` (none if the file is missing).
fn read_offsets(dir: &Path) -> Result<BTreeMap<String, u64>, StoreError> {
    let path = dir.join(OFFSETS_FILE);
    let data = match std::fs::read(&path) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(source) => {
            return Err(StoreError::Io {
                context: "reading stream offsets",
                path,
                source,
            });
        }
    };
    let corrupt = |detail: &str| StoreError::Corrupt {
        path: path.clone(),
        offset: 0,
        detail: detail.to_string(),
    };
    if data.len() < OFFSETS_MAGIC.len() + 8 || &data[..8] != OFFSETS_MAGIC {
        return Err(corrupt("not a stream offsets file of this version"));
    }
    let (body, crc) = data.split_at(data.len() - 4);
    if crc32c::crc32c(body) != u32::from_be_bytes([crc[0], crc[1], crc[2], crc[3]]) {
        return Err(corrupt("stream offsets fail their checksum"));
    }
    let mut at = 8;
    let mut take = |n: usize| -> Result<&[u8], StoreError> {
        let part = body
            .get(at..at + n)
            .ok_or_else(|| corrupt("stream offsets cut short"))?;
        at += n;
        Ok(part)
    };
    let count = u32::from_be_bytes(take(4)?.try_into().map_err(|_| corrupt("count"))?);
    let mut offsets = BTreeMap::new();
    for _ in 0..count {
        let len = usize::from(take(1)?[0]);
        let name = String::from_utf8(take(len)?.to_vec()).map_err(|_| corrupt("name"))?;
        let next = u64::from_be_bytes(take(8)?.try_into().map_err(|_| corrupt("offset"))?);
        offsets.insert(name, next);
    }
    Ok(offsets)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn batch(from: usize, n: usize, value: Option<&str>) -> Vec<StreamMessage> {
        (from..from + n)
            .map(|i| StreamMessage {
                filter_value: value.map(str::to_string),
                body: Bytes::from(format!("m{i:04}")),
            })
            .collect()
    }

    fn config(segment: u64, max_bytes: Option<u64>) -> StreamConfig {
        StreamConfig {
            segment_max_bytes: segment,
            max_bytes,
            ..StreamConfig::default()
        }
    }

    #[test]
    fn appends_read_back_across_segments_and_restarts() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut d = StreamDisk::open(dir.path(), config(50, None), 0).expect("open");
        assert_eq!(d.append(1, &batch(0, 5, None)).expect("append"), 0..5);
        assert_eq!(
            d.append(2, &batch(5, 5, Some("ca"))).expect("append"),
            5..10
        );
        assert_eq!(d.append(3, &batch(10, 5, None)).expect("append"), 10..15);
        d.sync().expect("sync");
        // 25 bytes a batch, 50 a segment: three batches make two files.
        assert_eq!(d.log().segments().count(), 2);
        let (first, m) = d.read_chunk(7).expect("read").expect("held");
        assert_eq!(first, 5);
        assert_eq!(m[2].body, Bytes::from("m0007"));
        assert_eq!(m[2].filter_value.as_deref(), Some("ca"));
        drop(d);
        let d = StreamDisk::open(dir.path(), config(50, None), 10).expect("reopen");
        assert_eq!((d.log().first_offset(), d.log().next_offset()), (0, 15));
        assert_eq!(d.log().bytes(), 75);
        assert_eq!(
            d.read_chunk(12).expect("read").expect("held").1[2].body,
            Bytes::from("m0012")
        );
        let (_, c) = d.log().chunk_of(6).expect("chunk");
        assert!(c.filter.may_match(&["ca".into()], false));
        assert_eq!(c.timestamp_ms, 2);
    }

    #[test]
    fn retention_deletes_files_and_a_torn_tail_is_cut() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut d = StreamDisk::open(dir.path(), config(25, Some(50)), 0).expect("open");
        for k in 0..4 {
            d.append(k, &batch(k as usize * 5, 5, None))
                .expect("append");
        }
        d.sync().expect("sync");
        // Four files of 25 bytes, at most 50 kept: the two oldest deleted.
        assert_eq!(d.log().first_offset(), 10);
        let files = std::fs::read_dir(dir.path()).expect("ls").count();
        assert_eq!(files, 2);
        assert_eq!(d.read_chunk(3).expect("read"), None);
        drop(d);
        // Tear the newest file's last chunk.
        let newest = stream_file::file_path(dir.path(), 15);
        let len = std::fs::metadata(&newest).expect("meta").len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&newest)
            .expect("open")
            .set_len(len - 2)
            .expect("truncate");
        let mut d = StreamDisk::open(dir.path(), config(25, Some(50)), 10).expect("reopen");
        assert_eq!((d.log().first_offset(), d.log().next_offset()), (10, 15));
        // Appending goes on from the cut, into the (now empty) newest file.
        assert_eq!(d.append(11, &batch(15, 5, None)).expect("append"), 15..20);
        d.sync().expect("sync");
        drop(d);
        let d = StreamDisk::open(dir.path(), config(25, Some(50)), 12).expect("reopen");
        assert_eq!(d.log().next_offset(), 20);
        assert_eq!(
            d.read_chunk(19).expect("read").expect("held").1[4].body,
            Bytes::from("m0019")
        );
    }

    #[test]
    fn tracked_offsets_survive_a_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut d = StreamDisk::open(dir.path(), config(1000, None), 0).expect("open");
        d.append(1, &batch(0, 10, None)).expect("append");
        d.sync().expect("sync");
        d.store_offset("billing", 7).expect("store");
        d.store_offset("audit", 3).expect("store");
        d.save_offsets().expect("save");
        d.store_offset("audit", 9).expect("store");
        drop(d);
        // What was saved comes back; what was not saved is the earlier offset (resumed
        // from there, a few messages again: never skipped).
        let d = StreamDisk::open(dir.path(), config(1000, None), 2).expect("reopen");
        assert_eq!(d.log().stored_offset("billing"), Some(7));
        assert_eq!(d.log().stored_offset("audit"), Some(3));
        drop(d);
        // A damaged file is refused, not read as "no offsets".
        let path = dir.path().join(OFFSETS_FILE);
        let mut bytes = std::fs::read(&path).expect("read");
        let k = bytes.len() - 6;
        bytes[k] ^= 1;
        std::fs::write(&path, bytes).expect("write");
        assert!(StreamDisk::open(dir.path(), config(1000, None), 3).is_err());
    }
}
