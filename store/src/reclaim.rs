//! Deleting dead segments off the commit path.
//!
//! Unlinking a 64 MiB segment takes 15-20 ms on the project's VM; done on the writer thread it
//! stalled every publisher waiting for a confirm. A segment is dead once a committed index
//! references nothing in it, so deleting it later is safe: if the process dies first, recovery
//! deletes unreferenced segments (see [`crate::Store::open`]).

use std::path::PathBuf;
use std::sync::mpsc;
use std::thread::JoinHandle;

use crate::{remove_segment, segment};

#[derive(Debug)]
enum Job {
    Delete(u64),
    /// Answered once every job sent before it is done.
    Barrier(mpsc::Sender<()>),
}

/// A thread that deletes segment files (and syncs their directory) in the background.
#[derive(Debug)]
pub(crate) struct Reclaimer {
    tx: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    dir: PathBuf,
}

impl Reclaimer {
    /// Start the thread for segments in `dir`.
    pub(crate) fn start(dir: PathBuf) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel();
        let d = dir.clone();
        let thread = std::thread::Builder::new()
            .name("warren-store-reclaim".into())
            .spawn(move || run(&d, &rx))?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            dir,
        })
    }

    /// Delete segment `id` soon. Nothing may reference it any more.
    pub(crate) fn delete(&self, id: u64) {
        let sent = self
            .tx
            .as_ref()
            .is_some_and(|tx| tx.send(Job::Delete(id)).is_ok());
        if !sent {
            // The thread is gone: delete inline (recovery would otherwise do it).
            let _ = remove_segment(&self.dir, id);
        }
    }

    /// Wait until every deletion asked for so far is done.
    pub(crate) fn flush(&self) {
        let (done, wait) = mpsc::channel();
        if self
            .tx
            .as_ref()
            .is_some_and(|tx| tx.send(Job::Barrier(done)).is_ok())
        {
            let _ = wait.recv();
        }
    }
}

impl Drop for Reclaimer {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(dir: &std::path::Path, rx: &mpsc::Receiver<Job>) {
    while let Ok(first) = rx.recv() {
        let mut removed = false;
        let mut barriers = Vec::new();
        for job in std::iter::once(first).chain(rx.try_iter()) {
            match job {
                Job::Delete(id) => match remove_segment(dir, id) {
                    Ok(()) => removed = true,
                    Err(e) => {
                        tracing::warn!(segment = id, error = %e, "cannot delete a dead segment; the next start will");
                    }
                },
                Job::Barrier(done) => barriers.push(done),
            }
        }
        if removed && let Err(e) = segment::sync_dir(dir) {
            tracing::warn!(error = %e, "cannot sync the segment directory after deleting segments");
        }
        for done in barriers {
            let _ = done.send(());
        }
    }
}
