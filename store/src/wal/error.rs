//! The WAL's errors. A write that fails stops the WAL for good (every later write and read
//! fails with [`WalError::Stopped`]): after a failed fdatasync the kernel may have dropped the
//! dirty pages, so retrying could acknowledge bytes that are not on disk.

use std::path::PathBuf;
use std::sync::Arc;

/// Why the WAL refused an operation or refused to open.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WalError {
    /// An I/O call failed.
    #[error("{context} ({path}): {source}")]
    Io {
        /// What the WAL was doing.
        context: &'static str,
        /// The file involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// A segment is damaged where it cannot be a torn tail: its header is not ours, or it
    /// ends without a seal while a later segment holds records.
    #[error("corrupt write-ahead log {path} at offset {offset}: {detail}")]
    Corrupt {
        /// The segment file.
        path: PathBuf,
        /// Byte offset of the damage.
        offset: u64,
        /// What is wrong.
        detail: String,
    },
    /// An append is not the group's next index (nothing of the write was done).
    #[error("group {group}: append of index {index}, the next index is {expected}")]
    OutOfOrder {
        /// The group.
        group: u64,
        /// The index appended.
        index: u64,
        /// The index expected.
        expected: u64,
    },
    /// A record is larger than [`RECORD_PAYLOAD_MAX`](crate::wal::record::RECORD_PAYLOAD_MAX).
    #[error("a write-ahead log record of {0} bytes exceeds the record size limit")]
    TooLarge(usize),
    /// Every segment sequence number a location can name (2^32) was used.
    #[error("write-ahead log segment numbers exhausted")]
    SegmentsExhausted,
    /// An earlier write failed, or the WAL is closing: nothing more is written.
    #[error("the write-ahead log stopped: {0}")]
    Stopped(Arc<str>),
}

impl WalError {
    pub(crate) fn io(
        context: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        Self::Io {
            context,
            path: path.into(),
            source: Arc::new(source),
        }
    }
}
