//! Stream segment files (issue 9): one append-only file per segment of a stream, holding its
//! chunks. The stream's log (`warren_broker::stream::log`) decides what goes where; this
//! module writes, reads and verifies the bytes.
//!
//! ```text
//! file   := header[32] chunk*
//! header := magic "WARRNSTR" version:u32 first_offset:u64 reserved[8] crc32c(bytes 0..28):u32
//! chunk  := chunk_header[40] data[data_len]
//! chunk_header := first:u64 count:u32 timestamp_ms:u64 data_len:u32 filter_len:u32
//!                 reserved:u32 crc32c(data):u32 crc32c(bytes 0..36):u32
//! data   := filter[filter_len] message*
//! message := body_len:u32 value_len:u16 value[value_len] body[body_len]
//! ```
//!
//! All integers little-endian. `value` is the message's `x-stream-filter-value` (empty: none);
//! `filter` is the chunk's filter as the broker encodes it. A chunk is appended whole and made
//! durable with `fdatasync` before its publishers are confirmed; after a crash the file's tail
//! may hold a torn chunk, which [`scan`] stops at (the caller truncates there).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use bytes::Bytes;

use crate::error::StoreError;
use crate::record::checksum;

/// First bytes of every stream segment file.
pub const STREAM_MAGIC: &[u8; 8] = b"WARRNSTR";
/// Stream segment format version this build reads and writes.
pub const STREAM_VERSION: u32 = 1;
/// Size of the file header.
pub const FILE_HEADER: u64 = 32;
/// Size of a chunk header.
pub const CHUNK_HEADER: usize = 40;
/// Largest chunk data (a batch of messages): bounded so a damaged length cannot make a reader
/// allocate without limit.
pub const CHUNK_DATA_MAX: usize = 256 * 1024 * 1024;
/// Longest filter value (bytes).
pub const FILTER_VALUE_MAX: usize = u16::MAX as usize;

/// The file of segment `first_offset` of the stream stored in `dir`.
#[must_use]
pub fn file_path(dir: &Path, first_offset: u64) -> PathBuf {
    dir.join(format!("{first_offset:020}.str"))
}

/// One message to append: its filter value and its body (properties and payload, encoded by
/// the broker).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamMessage {
    /// `x-stream-filter-value`, if any.
    pub filter_value: Option<String>,
    /// The stored body.
    pub body: Bytes,
}

/// A chunk as [`scan`] finds it: where it is and what its header says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkInfo {
    /// Offset of its first message.
    pub first: u64,
    /// Messages in it.
    pub count: u32,
    /// When it was appended.
    pub timestamp_ms: u64,
    /// Byte position of its header in the file.
    pub pos: u64,
    /// Bytes of its header and data.
    pub len: u64,
    /// Its filter, as written.
    pub filter: Vec<u8>,
    /// Bytes of its messages' bodies.
    pub body_bytes: u64,
}

/// What a file holds: its verified chunks, and where the valid bytes end (anything after is a
/// torn append to truncate).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scan {
    /// The segment's first offset (from the header).
    pub first_offset: u64,
    /// Chunks in file order.
    pub chunks: Vec<ChunkInfo>,
    /// One past the last valid byte.
    pub valid_len: u64,
}

/// An open segment file being appended to.
#[derive(Debug)]
pub struct StreamFile {
    path: PathBuf,
    file: File,
    len: u64,
    first_offset: u64,
}

fn io<'a>(context: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StoreError + 'a {
    move |e| StoreError::io(context, path, e)
}

fn corrupt(path: &Path, offset: u64, detail: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        path: path.to_path_buf(),
        offset,
        detail: detail.into(),
    }
}

fn header(first_offset: u64) -> [u8; FILE_HEADER as usize] {
    let mut h = [0u8; FILE_HEADER as usize];
    h[..8].copy_from_slice(STREAM_MAGIC);
    h[8..12].copy_from_slice(&STREAM_VERSION.to_le_bytes());
    h[12..20].copy_from_slice(&first_offset.to_le_bytes());
    let crc = checksum(&h[..28]);
    h[28..32].copy_from_slice(&crc.to_le_bytes());
    h
}

impl StreamFile {
    /// Create the file of segment `first_offset` in `dir` (made durable with its directory
    /// entry before it returns).
    ///
    /// # Errors
    /// The file exists or cannot be written.
    pub fn create(dir: &Path, first_offset: u64) -> Result<Self, StoreError> {
        let path = file_path(dir, first_offset);
        std::fs::create_dir_all(dir).map_err(io("creating the stream directory", dir))?;
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create_new(true)
            .open(&path)
            .map_err(io("creating a stream segment", &path))?;
        file.write_all(&header(first_offset))
            .map_err(io("writing a stream segment header", &path))?;
        file.sync_all()
            .map_err(io("syncing a stream segment", &path))?;
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io("syncing the stream directory", dir))?;
        Ok(Self {
            path,
            file,
            len: FILE_HEADER,
            first_offset,
        })
    }

    /// Reopen a segment [`scan`] verified, truncated to its valid bytes, to append to it.
    ///
    /// # Errors
    /// It cannot be opened or truncated.
    pub fn reopen(dir: &Path, scan: &Scan) -> Result<Self, StoreError> {
        let path = file_path(dir, scan.first_offset);
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .open(&path)
            .map_err(io("opening a stream segment", &path))?;
        file.set_len(scan.valid_len)
            .map_err(io("truncating a torn stream segment", &path))?;
        file.sync_all()
            .map_err(io("syncing a stream segment", &path))?;
        Ok(Self {
            path,
            file,
            len: scan.valid_len,
            first_offset: scan.first_offset,
        })
    }

    /// The segment's first offset (its name).
    #[must_use]
    pub fn first_offset(&self) -> u64 {
        self.first_offset
    }

    /// Its size in bytes.
    #[must_use]
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it holds only its header.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == FILE_HEADER
    }

    /// Append one chunk (not yet durable: call [`StreamFile::sync`]). Returns its position.
    ///
    /// # Errors
    /// A filter value or the chunk is over its limit, or the write failed (the file must then
    /// be scanned again before more is appended).
    pub fn append(
        &mut self,
        first: u64,
        timestamp_ms: u64,
        filter: &[u8],
        messages: &[StreamMessage],
    ) -> Result<u64, StoreError> {
        let mut data = Vec::with_capacity(
            filter.len()
                + messages
                    .iter()
                    .map(|m| 6 + m.body.len() + m.filter_value.as_ref().map_or(0, String::len))
                    .sum::<usize>(),
        );
        data.extend_from_slice(filter);
        for m in messages {
            let value = m.filter_value.as_deref().unwrap_or("").as_bytes();
            if value.len() > FILTER_VALUE_MAX {
                return Err(StoreError::RecordTooLarge(value.len()));
            }
            let body_len = u32::try_from(m.body.len())
                .map_err(|_| StoreError::RecordTooLarge(m.body.len()))?;
            data.extend_from_slice(&body_len.to_le_bytes());
            data.extend_from_slice(&(value.len() as u16).to_le_bytes());
            data.extend_from_slice(value);
            data.extend_from_slice(&m.body);
        }
        if data.len() > CHUNK_DATA_MAX {
            return Err(StoreError::RecordTooLarge(data.len()));
        }
        let count = u32::try_from(messages.len())
            .map_err(|_| StoreError::RecordTooLarge(messages.len()))?;
        let mut h = [0u8; CHUNK_HEADER];
        h[..8].copy_from_slice(&first.to_le_bytes());
        h[8..12].copy_from_slice(&count.to_le_bytes());
        h[12..20].copy_from_slice(&timestamp_ms.to_le_bytes());
        h[20..24].copy_from_slice(&(data.len() as u32).to_le_bytes());
        h[24..28].copy_from_slice(&(filter.len() as u32).to_le_bytes());
        h[32..36].copy_from_slice(&checksum(&data).to_le_bytes());
        let crc = checksum(&h[..36]);
        h[36..40].copy_from_slice(&crc.to_le_bytes());
        let pos = self.len;
        // One write of header and data: a crash tears at most this chunk.
        let mut all = Vec::with_capacity(CHUNK_HEADER + data.len());
        all.extend_from_slice(&h);
        all.extend_from_slice(&data);
        self.file
            .write_all(&all)
            .map_err(io("appending a stream chunk", &self.path))?;
        self.len += all.len() as u64;
        Ok(pos)
    }

    /// A second handle on the file, to sync it without holding whatever guards this one
    /// (appends through this handle are made durable by syncing either).
    ///
    /// # Errors
    /// The handle could not be duplicated.
    pub fn sync_handle(&self) -> Result<SyncHandle, StoreError> {
        Ok(SyncHandle {
            file: self
                .file
                .try_clone()
                .map_err(io("duplicating a stream segment handle", &self.path))?,
            path: self.path.clone(),
        })
    }

    /// Make every appended chunk durable.
    ///
    /// # Errors
    /// The sync failed: nothing appended since the last sync may be confirmed.
    pub fn sync(&self) -> Result<(), StoreError> {
        self.file
            .sync_data()
            .map_err(io("syncing a stream segment", &self.path))
    }
}

/// A handle that syncs a segment file (see [`StreamFile::sync_handle`]).
#[derive(Debug)]
pub struct SyncHandle {
    file: File,
    path: PathBuf,
}

impl SyncHandle {
    /// Make everything appended to the file so far durable.
    ///
    /// # Errors
    /// The sync failed: nothing appended since the last sync may be confirmed.
    pub fn sync(&self) -> Result<(), StoreError> {
        self.file
            .sync_data()
            .map_err(io("syncing a stream segment", &self.path))
    }
}

/// Read the chunk at `pos` of the file at `path`: its messages (filter value, body), in
/// offset order.
///
/// # Errors
/// The bytes there are not a whole, verified chunk.
pub fn read_chunk(path: &Path, pos: u64) -> Result<(ChunkInfo, Vec<StreamMessage>), StoreError> {
    let file = File::open(path).map_err(io("opening a stream segment", path))?;
    let (info, data) =
        read_at(&file, path, pos)?.ok_or_else(|| corrupt(path, pos, "no whole chunk here"))?;
    let messages = decode_messages(path, pos, &data[info.filter.len()..], info.count)?;
    Ok((info, messages))
}

/// Verify a file from its header on: the chunks that check out, and where the valid bytes
/// end (a torn or missing tail stops the scan; the caller truncates).
///
/// # Errors
/// The header is damaged or of another version (the file is not a stream segment this
/// build reads), or it cannot be read.
pub fn scan(path: &Path) -> Result<Scan, StoreError> {
    let file = File::open(path).map_err(io("opening a stream segment", path))?;
    let mut h = [0u8; FILE_HEADER as usize];
    file.read_exact_at(&mut h, 0)
        .map_err(|_| corrupt(path, 0, "short stream segment header"))?;
    if &h[..8] != STREAM_MAGIC
        || u32::from_le_bytes([h[28], h[29], h[30], h[31]]) != checksum(&h[..28])
    {
        return Err(corrupt(path, 0, "not a stream segment header"));
    }
    let version = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if version != STREAM_VERSION {
        return Err(StoreError::VersionMismatch {
            path: path.to_path_buf(),
            found: u64::from(version),
            expected: u64::from(STREAM_VERSION),
        });
    }
    let mut first_offset = [0u8; 8];
    first_offset.copy_from_slice(&h[12..20]);
    let first_offset = u64::from_le_bytes(first_offset);
    let mut chunks = Vec::new();
    let mut pos = FILE_HEADER;
    let mut expect = first_offset;
    while let Some((info, data)) = read_at(&file, path, pos)? {
        // A chunk that does not continue the offsets is not one this file's writer made.
        if info.first != expect
            || decode_messages(path, pos, &data[info.filter.len()..], info.count).is_err()
        {
            break;
        }
        expect = info.first + u64::from(info.count);
        pos += info.len;
        chunks.push(info);
    }
    Ok(Scan {
        first_offset,
        chunks,
        valid_len: pos,
    })
}

/// The chunk at `pos`, or None if the bytes there are not a whole chunk (end of file, a torn
/// or damaged chunk).
fn read_at(file: &File, path: &Path, pos: u64) -> Result<Option<(ChunkInfo, Vec<u8>)>, StoreError> {
    let mut h = [0u8; CHUNK_HEADER];
    match file.read_exact_at(&mut h, pos) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(StoreError::io("reading a stream chunk", path, e)),
    }
    let word = |at: usize| u32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]);
    let long = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[at..at + 8]);
        u64::from_le_bytes(b)
    };
    if word(36) != checksum(&h[..36]) {
        return Ok(None);
    }
    let (data_len, filter_len) = (word(20) as usize, word(24) as usize);
    if data_len > CHUNK_DATA_MAX || filter_len > data_len {
        return Ok(None);
    }
    let mut data = vec![0u8; data_len];
    match file.read_exact_at(&mut data, pos + CHUNK_HEADER as u64) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(StoreError::io("reading a stream chunk", path, e)),
    }
    if checksum(&data) != word(32) {
        return Ok(None);
    }
    let info = ChunkInfo {
        first: long(0),
        count: word(8),
        timestamp_ms: long(12),
        pos,
        len: (CHUNK_HEADER + data_len) as u64,
        filter: data[..filter_len].to_vec(),
        body_bytes: body_bytes(&data[filter_len..]),
    };
    Ok(Some((info, data)))
}

/// Sum of the body lengths in `messages` (as far as they parse; [`decode_messages`] checks).
fn body_bytes(mut messages: &[u8]) -> u64 {
    let mut total = 0u64;
    while messages.len() >= 6 {
        let body =
            u32::from_le_bytes([messages[0], messages[1], messages[2], messages[3]]) as usize;
        let value = u16::from_le_bytes([messages[4], messages[5]]) as usize;
        let Some(rest) = messages.get(6 + value + body..) else {
            break;
        };
        total += body as u64;
        messages = rest;
    }
    total
}

fn decode_messages(
    path: &Path,
    pos: u64,
    mut bytes: &[u8],
    count: u32,
) -> Result<Vec<StreamMessage>, StoreError> {
    let bad = |what: &str| corrupt(path, pos, format!("stream chunk: {what}"));
    let mut out = Vec::with_capacity(count.min(1 << 16) as usize);
    for _ in 0..count {
        if bytes.len() < 6 {
            return Err(bad("a message header runs past the chunk"));
        }
        let body = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
        let value = u16::from_le_bytes([bytes[4], bytes[5]]) as usize;
        let v = bytes
            .get(6..6 + value)
            .ok_or_else(|| bad("a filter value runs past the chunk"))?;
        let b = bytes
            .get(6 + value..6 + value + body)
            .ok_or_else(|| bad("a body runs past the chunk"))?;
        let filter_value = if v.is_empty() {
            None
        } else {
            Some(String::from_utf8(v.to_vec()).map_err(|_| bad("a filter value is not UTF-8"))?)
        };
        out.push(StreamMessage {
            filter_value,
            body: Bytes::copy_from_slice(b),
        });
        bytes = &bytes[6 + value + body..];
    }
    if !bytes.is_empty() {
        return Err(bad("bytes after its last message"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(body: &str, value: Option<&str>) -> StreamMessage {
        StreamMessage {
            filter_value: value.map(str::to_string),
            body: Bytes::copy_from_slice(body.as_bytes()),
        }
    }

    #[test]
    fn chunks_round_trip_and_scan_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut f = StreamFile::create(dir.path(), 100).expect("create");
        let a = f
            .append(
                100,
                5,
                b"FILTER",
                &[msg("one", Some("ca")), msg("two", None)],
            )
            .expect("append");
        let b = f
            .append(102, 7, b"", &[msg("three", None)])
            .expect("append");
        f.sync().expect("sync");
        let path = file_path(dir.path(), 100);
        let (info, messages) = read_chunk(&path, a).expect("read");
        assert_eq!((info.first, info.count, info.timestamp_ms), (100, 2, 5));
        assert_eq!(info.filter, b"FILTER");
        assert_eq!(messages, vec![msg("one", Some("ca")), msg("two", None)]);
        assert_eq!(
            read_chunk(&path, b).expect("read").1,
            vec![msg("three", None)]
        );
        let scan = scan(&path).expect("scan");
        assert_eq!(scan.first_offset, 100);
        assert_eq!(scan.chunks.len(), 2);
        assert_eq!(scan.chunks[0].body_bytes, 6);
        assert_eq!(scan.valid_len, f.len());
    }

    #[test]
    fn a_torn_tail_is_cut_and_appending_goes_on() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut f = StreamFile::create(dir.path(), 0).expect("create");
        f.append(0, 1, b"", &[msg("kept", None)]).expect("append");
        let good = f.len();
        f.append(1, 2, b"", &[msg("torn away", None)])
            .expect("append");
        f.sync().expect("sync");
        drop(f);
        let path = file_path(dir.path(), 0);
        // A crash mid-append: the last chunk lost its last bytes.
        let full = std::fs::metadata(&path).expect("meta").len();
        OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open")
            .set_len(full - 3)
            .expect("truncate");
        let s = scan(&path).expect("scan");
        assert_eq!((s.chunks.len(), s.valid_len), (1, good));
        let mut f = StreamFile::reopen(dir.path(), &s).expect("reopen");
        f.append(1, 3, b"", &[msg("again", None)]).expect("append");
        f.sync().expect("sync");
        let s = scan(&path).expect("scan");
        assert_eq!(s.chunks.len(), 2);
        assert_eq!(
            read_chunk(&path, s.chunks[1].pos).expect("read").1,
            vec![msg("again", None)]
        );
        // A flipped bit in a chunk's data: the scan stops before it.
        let mut bytes = std::fs::read(&path).expect("read");
        let at = usize::try_from(s.chunks[1].pos).expect("pos") + CHUNK_HEADER + 2;
        bytes[at] ^= 0x40;
        std::fs::write(&path, &bytes).expect("write");
        assert_eq!(scan(&path).expect("scan").chunks.len(), 1);
        assert!(read_chunk(&path, s.chunks[1].pos).is_err());
    }

    #[test]
    fn a_foreign_or_newer_file_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = file_path(dir.path(), 0);
        std::fs::write(&path, [0u8; 64]).expect("write");
        assert!(matches!(scan(&path), Err(StoreError::Corrupt { .. })));
        let mut h = header(0);
        h[8..12].copy_from_slice(&2u32.to_le_bytes());
        let crc = checksum(&h[..28]);
        h[28..32].copy_from_slice(&crc.to_le_bytes());
        std::fs::write(&path, h).expect("write");
        assert!(matches!(
            scan(&path),
            Err(StoreError::VersionMismatch { found: 2, .. })
        ));
    }
}
