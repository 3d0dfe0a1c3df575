//! Segment files: append-only, checksummed message records shared by every queue of the node.
//!
//! ```text
//! segment := header[32] record*
//! header  := magic "WARRNSEG" version:u32 segment_id:u64 reserved[8] crc32c(bytes 0..28):u32
//! ```
//!
//! Records are appended by the single writer and made durable with `fdatasync` before the
//! index that references them is committed, so a record the index references is always
//! complete. After a crash the tail of a segment may hold records that were never committed
//! (possibly torn or with pages missing); [`scan`] finds the first record that does not verify
//! and the store truncates there, after checking that the index references nothing beyond it.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufReader, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::RwLock;

use crate::error::StoreError;
use crate::record::{RECORD_HEADER, RECORD_MAX, StoredMessage, checksum};

/// First bytes of every segment file.
pub const SEGMENT_MAGIC: &[u8; 8] = b"WARRNSEG";
/// Size of the segment header.
pub const SEGMENT_HEADER: u64 = 32;
/// Segment format version this build reads and writes.
pub const SEGMENT_VERSION: u32 = 1;

/// Where a message record lives: segment id, byte offset of the record, payload length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Location {
    /// Segment id (the file name). 32 bits, so a queue's reference to a stored message stays
    /// small (the store refuses to start segment 2^32: [`crate::StoreError::SegmentIdsExhausted`]).
    pub segment: u32,
    /// Offset of the record header within the segment.
    pub offset: u64,
    /// Payload length (the record is `RECORD_HEADER + len` bytes).
    pub len: u32,
}

impl Location {
    /// Offset one past the record's last byte.
    #[must_use]
    pub fn end(&self) -> u64 {
        self.offset + RECORD_HEADER as u64 + u64::from(self.len)
    }
}

/// The file name of segment `id` under `dir`.
#[must_use]
pub fn segment_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:016}.seg"))
}

/// Segment ids present in `dir`, ascending.
pub fn list(dir: &Path) -> Result<Vec<u64>, StoreError> {
    let mut ids = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| StoreError::io("list segments", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| StoreError::io("list segments", dir, e))?;
        let name = entry.file_name();
        let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".seg")) else {
            continue;
        };
        if let Ok(id) = stem.parse::<u64>() {
            ids.push(id);
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

fn header(id: u64) -> [u8; SEGMENT_HEADER as usize] {
    let mut h = [0u8; SEGMENT_HEADER as usize];
    h[0..8].copy_from_slice(SEGMENT_MAGIC);
    h[8..12].copy_from_slice(&SEGMENT_VERSION.to_be_bytes());
    h[12..20].copy_from_slice(&id.to_be_bytes());
    let crc = checksum(&h[0..28]);
    h[28..32].copy_from_slice(&crc.to_be_bytes());
    h
}

/// The segment the writer appends to.
#[derive(Debug)]
pub struct ActiveSegment {
    /// Its id.
    pub id: u64,
    file: File,
    path: PathBuf,
    len: u64,
    dirty: bool,
}

impl ActiveSegment {
    /// Create segment `id` (its header is written and synced, and so is the directory entry).
    pub fn create(dir: &Path, id: u64) -> Result<Self, StoreError> {
        let path = segment_path(dir, id);
        let mut file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .read(true)
            .open(&path)
            .map_err(|e| StoreError::io("create segment", &path, e))?;
        file.write_all(&header(id))
            .map_err(|e| StoreError::io("write segment header", &path, e))?;
        file.sync_all()
            .map_err(|e| StoreError::io("sync segment", &path, e))?;
        sync_dir(dir)?;
        Ok(Self {
            id,
            file,
            path,
            len: SEGMENT_HEADER,
            dirty: false,
        })
    }

    /// Bytes in the file.
    #[must_use]
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether only the header is present.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == SEGMENT_HEADER
    }

    /// Append encoded records (one `write`); returns the offset of the first byte.
    pub fn append(&mut self, records: &[u8]) -> Result<u64, StoreError> {
        let at = self.len;
        self.file
            .write_all(records)
            .map_err(|e| StoreError::io("append to segment", &self.path, e))?;
        self.len += records.len() as u64;
        self.dirty = true;
        Ok(at)
    }

    /// Make everything appended so far durable (`fdatasync`).
    pub fn sync(&mut self) -> Result<(), StoreError> {
        if self.dirty {
            self.file
                .sync_data()
                .map_err(|e| StoreError::io("sync segment", &self.path, e))?;
            self.dirty = false;
        }
        Ok(())
    }
}

/// `fsync` a directory so that file creations and deletions in it are durable.
pub fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io("sync directory", dir, e))
}

/// What [`scan`] found in one segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scanned {
    /// Segment id.
    pub id: u64,
    /// Bytes up to the end of the last record that verifies (records after a bad one are not
    /// trusted).
    pub valid_len: u64,
    /// File length.
    pub file_len: u64,
    /// Records that verified.
    pub records: u64,
}

/// Verify a segment's header and every record's checksum, in one sequential pass.
///
/// A bad header is an error (the file is not a segment of this format). A bad record is not:
/// it ends the valid prefix, and the caller decides whether anything committed lies beyond.
pub fn scan(dir: &Path, id: u64) -> Result<Scanned, StoreError> {
    let path = segment_path(dir, id);
    let file = File::open(&path).map_err(|e| StoreError::io("open segment", &path, e))?;
    let file_len = file
        .metadata()
        .map_err(|e| StoreError::io("stat segment", &path, e))?
        .len();
    let mut r = BufReader::with_capacity(1 << 20, file);
    let mut h = [0u8; SEGMENT_HEADER as usize];
    if file_len < SEGMENT_HEADER {
        // A crash while the header was written: nothing was ever committed here.
        return Ok(Scanned {
            id,
            valid_len: 0,
            file_len,
            records: 0,
        });
    }
    r.read_exact(&mut h)
        .map_err(|e| StoreError::io("read segment header", &path, e))?;
    let corrupt = |detail: String| StoreError::Corrupt {
        path: path.clone(),
        offset: 0,
        detail,
    };
    if &h[0..8] != SEGMENT_MAGIC {
        return Err(corrupt("not a Warren segment file (bad magic)".into()));
    }
    let crc = u32::from_be_bytes([h[28], h[29], h[30], h[31]]);
    if checksum(&h[0..28]) != crc {
        return Err(corrupt("segment header checksum mismatch".into()));
    }
    let version = u32::from_be_bytes([h[8], h[9], h[10], h[11]]);
    if version != SEGMENT_VERSION {
        return Err(StoreError::VersionMismatch {
            path,
            found: u64::from(version),
            expected: u64::from(SEGMENT_VERSION),
        });
    }
    let header_id = u64::from_be_bytes(h[12..20].try_into().unwrap_or_default());
    if header_id != id {
        return Err(corrupt(format!("header names segment {header_id}")));
    }
    let mut at = SEGMENT_HEADER;
    let mut records = 0;
    let mut payload = Vec::new();
    loop {
        if file_len - at < RECORD_HEADER as u64 {
            break;
        }
        let mut rh = [0u8; RECORD_HEADER];
        if r.read_exact(&mut rh).is_err() {
            break;
        }
        let len = u32::from_be_bytes([rh[0], rh[1], rh[2], rh[3]]) as usize;
        let crc = u32::from_be_bytes([rh[4], rh[5], rh[6], rh[7]]);
        if len == 0 || len > RECORD_MAX || (file_len - at - RECORD_HEADER as u64) < len as u64 {
            break;
        }
        payload.resize(len, 0);
        if r.read_exact(&mut payload).is_err() || checksum(&payload) != crc {
            break;
        }
        at += (RECORD_HEADER + len) as u64;
        records += 1;
    }
    Ok(Scanned {
        id,
        valid_len: at,
        file_len,
        records,
    })
}

/// Shared read access to segment files (any thread, concurrently with the writer).
#[derive(Debug)]
pub struct Segments {
    dir: PathBuf,
    files: RwLock<HashMap<u64, Arc<OpenSegment>>>,
}

/// An open segment file and its path (kept for error messages, so a read allocates nothing).
#[derive(Debug)]
struct OpenSegment {
    file: File,
    path: PathBuf,
}

impl Segments {
    /// Readers for segments under `dir`.
    #[must_use]
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            files: RwLock::new(HashMap::new()),
        }
    }

    fn file(&self, id: u64) -> Result<Arc<OpenSegment>, StoreError> {
        if let Some(f) = self.files.read().get(&id) {
            return Ok(Arc::clone(f));
        }
        let path = segment_path(&self.dir, id);
        let file = File::open(&path).map_err(|e| StoreError::io("open segment", &path, e))?;
        let f = Arc::new(OpenSegment { file, path });
        self.files.write().insert(id, Arc::clone(&f));
        Ok(f)
    }

    /// Read and verify one record.
    pub fn read(&self, loc: Location) -> Result<StoredMessage, StoreError> {
        self.pin(loc)?.read()
    }

    /// An open handle on the record's segment. Reading through it works even after the
    /// segment is deleted (the data lives while the handle does), so a caller that pins a
    /// record while it is still referenced can read it after settling it.
    pub fn pin(&self, loc: Location) -> Result<Pinned, StoreError> {
        Ok(Pinned {
            segment: self.file(u64::from(loc.segment))?,
            location: loc,
        })
    }

    /// Forget a dead segment's handle. Returns whether a [`Pinned`] record (or a read in
    /// progress) still holds the file open: then the file must not be shrunk, only unlinked,
    /// so that the pinned record stays readable.
    pub fn forget(&self, id: u64) -> bool {
        self.files
            .write()
            .remove(&id)
            .is_some_and(|f| Arc::strong_count(&f) > 1)
    }
}

/// A record whose segment is held open: see [`Segments::pin`].
#[derive(Debug, Clone)]
pub struct Pinned {
    segment: Arc<OpenSegment>,
    location: Location,
}

impl Pinned {
    /// Where the record is.
    #[must_use]
    pub fn location(&self) -> Location {
        self.location
    }

    /// Read and verify the record.
    pub fn read(&self) -> Result<StoredMessage, StoreError> {
        let (file, loc) = (&self.segment.file, self.location);
        let path = || self.segment.path.clone();
        let mut buf = vec![0u8; RECORD_HEADER + loc.len as usize];
        file.read_exact_at(&mut buf, loc.offset)
            .map_err(|e| StoreError::io("read message", path(), e))?;
        let corrupt = |detail: &str| StoreError::Corrupt {
            path: path(),
            offset: loc.offset,
            detail: detail.to_string(),
        };
        let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
        let crc = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]);
        if len != loc.len {
            return Err(corrupt("record length differs from the index"));
        }
        let payload = Bytes::from(buf).slice(RECORD_HEADER..);
        if checksum(&payload) != crc {
            return Err(corrupt("record checksum mismatch"));
        }
        StoredMessage::decode(&payload).map_err(|m| corrupt(m.0))
    }
}
