//! A thread that `fdatasync`s the active segment while the writer commits the index.
//!
//! A group commit needs both the segment bodies and the redb index durable before anything is
//! confirmed. Done one after the other they cost two device flushes in sequence; overlapped,
//! the commit waits for the slower one only. Crash safety: the index commit records where this
//! commit's unsynced bodies begin (`unsynced_tail` in the meta table), and recovery drops the
//! index entries found in that range but missing from the segment: they were never confirmed,
//! because confirms wait for both flushes. Anything else missing is still corruption.

use std::fs::File;
use std::path::PathBuf;
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use crate::StoreError;

type Job = (Arc<File>, PathBuf, mpsc::Sender<Result<(), StoreError>>);

/// The sync thread's handle.
#[derive(Debug)]
pub(crate) struct Syncer {
    tx: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// A sync in progress.
#[derive(Debug)]
pub(crate) struct PendingSync(mpsc::Receiver<Result<(), StoreError>>);

impl PendingSync {
    /// Wait for it.
    pub(crate) fn wait(self) -> Result<(), StoreError> {
        self.0.recv().unwrap_or_else(|_| {
            Err(StoreError::io(
                "sync segment",
                "",
                std::io::Error::other("segment sync thread stopped"),
            ))
        })
    }
}

fn sync(file: &File, path: PathBuf) -> Result<(), StoreError> {
    file.sync_data()
        .map_err(|e| StoreError::io("sync segment", path, e))
}

impl Syncer {
    pub(crate) fn start() -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("warren-store-sync".into())
            .spawn(move || {
                for (file, path, done) in rx {
                    let _ = done.send(sync(&file, path));
                }
            })?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Start `fdatasync` of `file`.
    pub(crate) fn begin(&self, file: Arc<File>, path: PathBuf) -> PendingSync {
        let (done, wait) = mpsc::channel();
        let job = (file, path, done);
        if let Some(tx) = &self.tx
            && let Err(mpsc::SendError((file, path, done))) = tx.send(job)
        {
            let _ = done.send(sync(&file, path));
        }
        PendingSync(wait)
    }
}

impl Drop for Syncer {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
