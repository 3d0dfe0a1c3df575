//! Store errors. Every variant names what failed and where, because a store error stops the
//! broker (or the replica) rather than being retried: silently continuing after a failed
//! write or a failed checksum is how confirmed messages get lost.

use std::path::PathBuf;

/// Why the store refused an operation or refused to open.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// An I/O call failed.
    #[error("{context} ({path}): {source}")]
    Io {
        /// What the store was doing.
        context: &'static str,
        /// The file involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// redb reported an error.
    #[error("metadata database {path}: {detail}")]
    Db {
        /// The database file.
        path: PathBuf,
        /// redb's message.
        detail: String,
    },
    /// Data on disk is damaged: a checksum failed in the middle of a file, a header is not
    /// ours, or the index references bytes that are not there.
    #[error("corrupt data in {path} at offset {offset}: {detail}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Byte offset of the damaged record or header.
        offset: u64,
        /// What is wrong.
        detail: String,
    },
    /// The data directory was written by a format this build does not read.
    #[error(
        "{path} has on-disk format version {found}, this build reads version {expected}; \
         refusing to start (use a matching Warren version or move the data directory away)"
    )]
    VersionMismatch {
        /// The file carrying the version.
        path: PathBuf,
        /// Version found.
        found: u64,
        /// Version this build reads and writes.
        expected: u64,
    },
    /// A message record is larger than a record can be.
    #[error("message record of {0} bytes exceeds the record size limit")]
    RecordTooLarge(usize),
    /// Every segment id a [`Location`](crate::Location) can name is used (2^32 segments
    /// written: never in practice, but a bound all the same).
    #[error("segment ids exhausted (the store wrote {} segments)", u32::MAX)]
    SegmentIdsExhausted,
    /// A replicated write was not committed, or its outcome is unknown (the queue's leader was
    /// lost or unreachable): the publisher is nacked and may retry.
    #[error("replicated write failed: {0}")]
    Replication(String),
}

impl StoreError {
    pub(crate) fn io(
        context: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        Self::Io {
            context,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn db(path: impl Into<PathBuf>, e: impl std::fmt::Display) -> Self {
        Self::Db {
            path: path.into(),
            detail: e.to_string(),
        }
    }
}
