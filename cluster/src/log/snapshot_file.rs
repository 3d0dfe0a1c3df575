//! A replica's current snapshot on disk (`queues/<incarnation>.snapshot`, `meta.snapshot`).
//!
//! Layout (version 2; lengths little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `WSNAP002` |
//! | 8 | `m`: length of the meta |
//! | `m` | openraft's snapshot meta (bincode) |
//! | 8 | `t`: length of the tracked state |
//! | `t` | what the state machine tracks for openraft: last applied id, membership, entry time (bincode) |
//! | rest of the file | the group's state, as [`crate::group::Applied::snapshot_into`] wrote it |
//!
//! The state is streamed into the file as it is encoded: building the snapshot of a queue of a
//! million messages holds a write buffer ([`WRITE_BUFFER`]), not the encoded state (about 45
//! bytes a message) two or three times, as version 1 did. Version 1 files (no magic: bincode of
//! the meta and of the tracked state and state together) are still read.
//!
//! A file is written to a temporary name, fsynced, renamed over the old one and its directory
//! fsynced: a crash leaves the old snapshot or the new one, never half of one.

use std::io::Write;
use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;

/// The first bytes of a version 2 file. A version 1 file starts with an encoded
/// `Option<LogId>` (0 or 1), never with `W`.
const MAGIC: &[u8; 8] = b"WSNAP002";

/// The write buffer of a snapshot being written (the only memory it takes beyond the state).
pub const WRITE_BUFFER: usize = 1024 * 1024;

/// A snapshot file read back: the meta, the tracked state, and the group's state.
#[derive(Debug)]
pub struct Stored<M, T> {
    /// openraft's meta.
    pub meta: M,
    /// What the state machine tracks for openraft.
    pub tracked: T,
    bytes: Vec<u8>,
    state_at: usize,
}

impl<M, T> Stored<M, T> {
    /// The group's state, encoded.
    #[must_use]
    pub fn state(&self) -> &[u8] {
        &self.bytes[self.state_at..]
    }
}

/// Version 1's inner value: the tracked state and the encoded state.
#[derive(Serialize, serde::Deserialize)]
struct V1Data<T> {
    tracked: T,
    state: Vec<u8>,
}

/// Write a snapshot in this layout to `out`: `meta`, `tracked`, then what `state` writes
/// (what is kept on disk, and what is sent to another member).
///
/// # Errors
/// `out` fails, or `state` does.
pub fn write_to<M: Serialize, T: Serialize>(
    out: &mut dyn Write,
    meta: &M,
    tracked: &T,
    state: impl FnOnce(&mut dyn Write) -> Result<(), String>,
) -> Result<(), String> {
    let io = |e: std::io::Error| e.to_string();
    out.write_all(MAGIC).map_err(io)?;
    for part in [
        crate::codec::encode(meta).map_err(|e| e.to_string())?,
        crate::codec::encode(tracked).map_err(|e| e.to_string())?,
    ] {
        out.write_all(&(part.len() as u64).to_le_bytes())
            .map_err(io)?;
        out.write_all(&part).map_err(io)?;
    }
    state(out)
}

/// Write a snapshot to `path` durably: `meta`, `tracked`, then what `state` writes.
///
/// # Errors
/// The file cannot be written, or `state` fails.
pub fn write<M: Serialize, T: Serialize>(
    path: &Path,
    meta: &M,
    tracked: &T,
    state: impl FnOnce(&mut dyn Write) -> Result<(), String>,
) -> Result<(), String> {
    let tmp = path.with_extension("snapshot-tmp");
    let file = std::fs::File::create(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    let mut out = std::io::BufWriter::with_capacity(WRITE_BUFFER, file);
    let io = |e: std::io::Error| format!("{}: {e}", tmp.display());
    write_to(&mut out, meta, tracked, state).map_err(|e| format!("{}: {e}", tmp.display()))?;
    let file = out.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(io)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    Ok(())
}

/// Whether `first` (a snapshot's first bytes) starts this layout (version 2).
#[must_use]
pub fn is_layout(first: &[u8]) -> bool {
    first.starts_with(MAGIC)
}

/// Read the meta and tracked state of a snapshot in this layout (version 2) from `input`,
/// leaving it at the first byte of the group's state.
///
/// # Errors
/// `input` fails, or it is not such a snapshot (no magic, truncated, damaged).
pub fn read_head<M: DeserializeOwned, T: DeserializeOwned>(
    input: &mut dyn std::io::Read,
) -> Result<(M, T), String> {
    let io = |e: std::io::Error| format!("a snapshot's head: {e}");
    let mut magic = [0u8; 8];
    input.read_exact(&mut magic).map_err(io)?;
    if &magic != MAGIC {
        return Err("not a snapshot in the version 2 layout".into());
    }
    let mut part = || -> Result<Vec<u8>, String> {
        let mut len = [0u8; 8];
        input.read_exact(&mut len).map_err(io)?;
        let len = u64::from_le_bytes(len);
        if len > crate::codec::VALUE_MAX {
            return Err(format!("a snapshot part of {len} bytes"));
        }
        let mut bytes = vec![0u8; usize::try_from(len).map_err(|e| e.to_string())?];
        input.read_exact(&mut bytes).map_err(io)?;
        Ok(bytes)
    };
    let meta = part()?;
    let tracked = part()?;
    Ok((
        crate::codec::decode(&meta).map_err(|e| e.to_string())?,
        crate::codec::decode(&tracked).map_err(|e| e.to_string())?,
    ))
}

/// Split `bytes` at a little-endian u64 length and that many bytes after it.
fn part(bytes: &[u8], at: usize) -> Result<(&[u8], usize), String> {
    let len = bytes
        .get(at..at + 8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .and_then(|l| usize::try_from(l).ok())
        .ok_or("a truncated snapshot file")?;
    let start = at + 8;
    let end = start.checked_add(len).ok_or("a damaged snapshot length")?;
    let body = bytes.get(start..end).ok_or("a truncated snapshot file")?;
    Ok((body, end))
}

/// Decode a snapshot file's bytes (either version).
///
/// # Errors
/// They are not a snapshot file (truncated, damaged, or another kind of file).
pub fn decode<M: DeserializeOwned, T: DeserializeOwned>(
    bytes: Vec<u8>,
) -> Result<Stored<M, T>, String> {
    if bytes.starts_with(MAGIC) {
        let at = MAGIC.len();
        let (meta, at) = part(&bytes, at).map(|(b, end)| (crate::codec::decode(b), end))?;
        let (tracked, at) = part(&bytes, at).map(|(b, end)| (crate::codec::decode(b), end))?;
        return Ok(Stored {
            meta: meta.map_err(|e| e.to_string())?,
            tracked: tracked.map_err(|e| e.to_string())?,
            bytes,
            state_at: at,
        });
    }
    let (meta, inner): (M, Vec<u8>) = crate::codec::decode(&bytes).map_err(|e| e.to_string())?;
    let data: V1Data<T> = crate::codec::decode(&inner).map_err(|e| e.to_string())?;
    Ok(Stored {
        meta,
        tracked: data.tracked,
        bytes: data.state,
        state_at: 0,
    })
}

/// Read and decode the snapshot file at `path`; None if there is none.
///
/// # Errors
/// It cannot be read or does not decode.
pub fn read<M: DeserializeOwned, T: DeserializeOwned>(
    path: &Path,
) -> Result<Option<Stored<M, T>>, String> {
    match std::fs::read(path) {
        Ok(bytes) => decode(bytes)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streamed_snapshot_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("q.snapshot");
        let state: Vec<u8> = (0..3 * WRITE_BUFFER).map(|i| (i % 251) as u8).collect();
        write(&path, &("meta", 7u64), &vec![1u64, 2, 3], |out| {
            out.write_all(&state).map_err(|e| e.to_string())
        })
        .unwrap();
        let back: Stored<(String, u64), Vec<u64>> = read(&path).unwrap().expect("there");
        assert_eq!(back.meta, ("meta".to_string(), 7));
        assert_eq!(back.tracked, vec![1, 2, 3]);
        assert_eq!(back.state(), &state[..]);
        assert!(!path.with_extension("snapshot-tmp").exists());
    }

    #[test]
    fn a_head_reads_from_a_stream_and_leaves_it_at_the_state() {
        let mut bytes = Vec::new();
        write_to(&mut bytes, &"meta", &9u64, |out| {
            out.write_all(b"state").map_err(|e| e.to_string())
        })
        .unwrap();
        assert!(is_layout(&bytes));
        let mut input = &bytes[..];
        let (meta, tracked): (String, u64) = read_head(&mut input).unwrap();
        assert_eq!((meta.as_str(), tracked), ("meta", 9));
        assert_eq!(input, b"state");
        let mut short = &bytes[..12];
        assert!(read_head::<String, u64>(&mut short).is_err(), "truncated");
        let mut other = &b"not a snapshot at all"[..];
        assert!(read_head::<String, u64>(&mut other).is_err());
    }

    #[test]
    fn a_version_1_file_still_reads() {
        let state = vec![9u8; 1000];
        let inner = crate::codec::encode(&V1Data {
            tracked: 5u64,
            state: state.clone(),
        })
        .unwrap();
        let file = crate::codec::encode(&("m".to_string(), inner)).unwrap();
        let back: Stored<String, u64> = decode(file).unwrap();
        assert_eq!((back.meta.as_str(), back.tracked), ("m", 5));
        assert_eq!(back.state(), &state[..]);
    }

    #[test]
    fn damage_is_an_error_and_no_file_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("q.snapshot");
        assert!(read::<String, u64>(&path).unwrap().is_none());
        let mut good = MAGIC.to_vec();
        good.extend_from_slice(&100u64.to_le_bytes());
        good.extend_from_slice(b"short");
        assert!(decode::<String, u64>(good).is_err());
        assert!(decode::<String, u64>(b"not a snapshot".to_vec()).is_err());
    }
}
