//! Segment files of the WAL: a header, then records, then a seal where the segment ended.
//!
//! ```text
//! segment := header[32] record* seal? (bytes of an earlier life or zeros)
//! header  := magic "WARRNWAL" version:u32 seq:u64 reserved[8] crc32c(bytes 0..28):u32
//! ```
//!
//! Files are named by sequence number (`{seq:016}.wal`). A freed segment's file is kept as a
//! spare (`{n}.spare`, up to [`SPARE_SEGMENTS_MAX`]) and renamed to the next sequence number
//! when one is needed: its blocks are allocated and written already, so writing over them
//! changes no file metadata and an fdatasync writes data only. New files are allocated at
//! their full size ([`allocate`]) rather than grown by every write.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::wal::error::WalError;

/// First bytes of every WAL segment.
pub const WAL_MAGIC: &[u8; 8] = b"WARRNWAL";
/// Size of the segment header.
pub const HEADER_LEN: usize = 32;
/// Segment format version this build reads and writes.
pub const WAL_VERSION: u32 = 1;
/// Freed segment files kept for reuse at most; more are deleted.
pub const SPARE_SEGMENTS_MAX: usize = 4;

/// The header of segment `seq`.
#[must_use]
pub fn header(seq: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..8].copy_from_slice(WAL_MAGIC);
    h[8..12].copy_from_slice(&WAL_VERSION.to_le_bytes());
    h[12..20].copy_from_slice(&seq.to_le_bytes());
    let crc = crc32c::crc32c(&h[0..28]);
    h[28..32].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Whether `bytes` start with the header of segment `seq`.
#[must_use]
pub fn header_is(bytes: &[u8], seq: u64) -> bool {
    bytes.len() >= HEADER_LEN && bytes[..HEADER_LEN] == header(seq)
}

/// The file of segment `seq`.
#[must_use]
pub fn path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("{seq:016}.wal"))
}

fn spare_path(dir: &Path, n: usize) -> PathBuf {
    dir.join(format!("{n}.spare"))
}

/// Segment sequence numbers and spare files present in `dir`.
///
/// # Errors
/// When the directory cannot be read.
pub fn list(dir: &Path) -> Result<(Vec<u64>, Vec<PathBuf>), WalError> {
    let mut seqs = Vec::new();
    let mut spares = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| WalError::io("list the log", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| WalError::io("list the log", dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(seq) = name
            .strip_suffix(".wal")
            .and_then(|s| s.parse::<u64>().ok())
        {
            seqs.push(seq);
        } else if name.ends_with(".spare") {
            spares.push(entry.path());
        }
    }
    seqs.sort_unstable();
    spares.sort();
    Ok((seqs, spares))
}

/// Open segment `seq` for reading and writing.
///
/// # Errors
/// When the file cannot be opened.
pub fn open(dir: &Path, seq: u64) -> Result<File, WalError> {
    let p = path(dir, seq);
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .map_err(|e| WalError::io("open a log segment", p, e))
}

/// Make the file of segment `seq`: a spare renamed if there is one, else a new file allocated
/// at `bytes`. The directory is synced, so the name survives a crash.
///
/// # Errors
/// When a file call fails.
pub fn make(dir: &Path, seq: u64, bytes: u64) -> Result<File, WalError> {
    let target = path(dir, seq);
    let (_, spares) = list(dir)?;
    if let Some(spare) = spares.first() {
        std::fs::rename(spare, &target)
            .map_err(|e| WalError::io("reuse a spare log segment", &target, e))?;
    } else {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&target)
            .map_err(|e| WalError::io("create a log segment", &target, e))?;
        allocate(&file, bytes).map_err(|e| WalError::io("allocate a log segment", &target, e))?;
    }
    sync_dir(dir)?;
    open(dir, seq)
}

/// Give `file` its blocks up front (fallocate; a file system without it gets a sized sparse
/// file).
fn allocate(file: &File, bytes: u64) -> std::io::Result<()> {
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, bytes) {
        Ok(()) => Ok(()),
        Err(_) => file.set_len(bytes),
    }
}

/// Keep the file of a freed segment as a spare, or delete it when there are enough.
///
/// # Errors
/// When a file call fails.
pub fn free(dir: &Path, seq: u64) -> Result<(), WalError> {
    let p = path(dir, seq);
    let (_, spares) = list(dir)?;
    let free_slot = (0..SPARE_SEGMENTS_MAX).find(|n| !spares.contains(&spare_path(dir, *n)));
    match free_slot {
        Some(n) => std::fs::rename(&p, spare_path(dir, n))
            .map_err(|e| WalError::io("keep a freed log segment", &p, e)),
        None => std::fs::remove_file(&p).map_err(|e| WalError::io("delete a log segment", &p, e)),
    }
}

/// Write `bytes` at `offset` of `file`.
///
/// # Errors
/// When the write fails.
pub fn write_at(file: &File, p: &Path, offset: u64, bytes: &[u8]) -> Result<(), WalError> {
    file.write_all_at(bytes, offset)
        .map_err(|e| WalError::io("write the log", p, e))
}

/// fdatasync `file`.
///
/// # Errors
/// When the sync fails.
pub fn sync(file: &File, p: &Path) -> Result<(), WalError> {
    file.sync_data()
        .map_err(|e| WalError::io("sync the log", p, e))
}

/// Sync the directory, so created, renamed and deleted names are durable.
///
/// # Errors
/// When the directory cannot be opened or synced.
pub fn sync_dir(dir: &Path) -> Result<(), WalError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| WalError::io("sync the log directory", dir, e))
}

/// Read `len` bytes at `offset` of `file`.
///
/// # Errors
/// When the read fails or comes up short.
pub fn read_at(file: &File, p: &Path, offset: u64, len: usize) -> Result<Vec<u8>, WalError> {
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, offset)
        .map_err(|e| WalError::io("read the log", p, e))?;
    Ok(buf)
}
