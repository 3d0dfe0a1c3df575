//! A stream's group commit: one thread per stream appends what publishers submitted while the
//! previous batch was syncing as one chunk, syncs it (outside the stream's lock, so readers
//! go on), then publishes the new durable end and runs the publishers' completions (their
//! confirms). No timer: batches grow with load, as the store's writer does.
//!
//! Readers see only what is durable ([`SharedStream::durable_next`]): an offset a consumer
//! was given never disappears in a crash and is never reused for another message.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;

use parking_lot::Mutex;
use warren_store::StoreError;
use warren_store::stream_file::StreamMessage;

use super::disk::StreamDisk;

/// Most messages in one chunk.
pub const CHUNK_MESSAGES_MAX: usize = 4096;
/// Most bytes in one chunk (a batch stops growing past it): a reader holds one chunk
/// decoded, so this bounds a consumer's memory.
pub const CHUNK_BYTES_MAX: usize = 1024 * 1024;
/// How often an idle writer applies age retention and saves tracked offsets that changed.
pub const TICK: std::time::Duration = std::time::Duration::from_secs(1);
/// Most submissions waiting for the writer (beyond it, submitting blocks: back-pressure).
pub const SUBMISSIONS_MAX: usize = 16 * 1024;

/// Receives a submission's outcome: the offsets its messages got once durable, or why not.
pub type AppendDone = Box<dyn FnOnce(Result<Range<u64>, Arc<StoreError>>) + Send>;

/// A stream as its writer and its readers share it.
pub struct SharedStream {
    /// The files and the log (appends by the writer; reads by consumers).
    pub disk: Mutex<StreamDisk>,
    /// One past the last durable offset: what readers may read.
    durable_next: AtomicU64,
    /// Called by the writer each time the durable end moves (wakes parked readers).
    on_durable: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Tracked offsets changed since they were last saved.
    offsets_dirty: std::sync::atomic::AtomicBool,
    /// The stream was deleted: the writer removes its directory when it exits.
    remove_on_exit: std::sync::atomic::AtomicBool,
    /// Serialises saves of the offsets file (the tick and a shutdown).
    saving: Mutex<()>,
}

impl std::fmt::Debug for SharedStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedStream")
            .field("durable_next", &self.durable_next())
            .finish_non_exhaustive()
    }
}

impl SharedStream {
    /// `disk` shared, readable up to what it holds (everything in it is durable or, for a
    /// replica, committed).
    #[must_use]
    pub fn new(disk: StreamDisk) -> Arc<Self> {
        let durable = disk.log().next_offset();
        Arc::new(Self {
            disk: Mutex::new(disk),
            durable_next: AtomicU64::new(durable),
            on_durable: std::sync::OnceLock::new(),
            offsets_dirty: std::sync::atomic::AtomicBool::new(false),
            remove_on_exit: std::sync::atomic::AtomicBool::new(false),
            saving: Mutex::new(()),
        })
    }

    /// Readers may read up to `next` now (a replica applied a committed append): wake them.
    pub fn advance(&self, next: u64) {
        self.durable_next.store(next, Ordering::SeqCst);
        if let Some(hook) = self.on_durable.get() {
            hook();
        }
    }

    /// Set (once) what the writer calls whenever the durable end moves.
    pub fn set_on_durable(&self, hook: Box<dyn Fn() + Send + Sync>) {
        let _ = self.on_durable.set(hook);
    }

    /// Tracked offsets changed: the writer saves them within a [`TICK`].
    pub fn offsets_changed(&self) {
        self.offsets_dirty.store(true, Ordering::Release);
    }

    /// Save the tracked offsets now if they changed (shutdown, deletion).
    ///
    /// # Errors
    /// The file could not be written (they stay marked as changed).
    pub fn save_offsets(&self) -> Result<(), StoreError> {
        let _saving = self.saving.lock();
        if self.remove_on_exit.load(Ordering::Acquire)
            || !self.offsets_dirty.swap(false, Ordering::AcqRel)
        {
            return Ok(());
        }
        // Encoded under the lock, written and fsynced outside it (appends and reads go on).
        let (dir, bytes) = {
            let disk = self.disk.lock();
            (disk.dir().to_path_buf(), disk.offsets_bytes())
        };
        if let Err(e) = super::disk::write_offsets(&dir, &bytes) {
            self.offsets_dirty.store(true, Ordering::Release);
            return Err(e);
        }
        Ok(())
    }

    /// The stream was deleted: its writer removes the directory once it has finished.
    pub fn remove_on_exit(&self) {
        self.remove_on_exit.store(true, Ordering::Release);
    }

    /// One past the last offset that is durable (readers stop there).
    #[must_use]
    pub fn durable_next(&self) -> u64 {
        self.durable_next.load(Ordering::SeqCst)
    }
}

struct Job {
    messages: Vec<StreamMessage>,
    done: AppendDone,
}

/// The handle publishers submit to. Dropping every clone stops the writer once it has
/// finished what was submitted.
#[derive(Clone)]
pub struct StreamWriter {
    tx: mpsc::SyncSender<Job>,
}

impl std::fmt::Debug for StreamWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamWriter").finish_non_exhaustive()
    }
}

impl StreamWriter {
    /// Start the writer of `disk`; `now_ms` stamps each chunk (the broker's clock).
    ///
    /// # Errors
    /// The thread could not be started.
    pub fn start(
        disk: StreamDisk,
        now_ms: Arc<dyn Fn() -> u64 + Send + Sync>,
    ) -> std::io::Result<(Self, Arc<SharedStream>)> {
        let shared = SharedStream::new(disk);
        let (tx, rx) = mpsc::sync_channel(SUBMISSIONS_MAX);
        let stream = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("stream-writer".into())
            .spawn(move || run(&stream, &rx, &*now_ms))?;
        Ok((Self { tx }, shared))
    }

    /// Append `messages` (in order, after everything submitted before through any handle);
    /// `done` runs once they are durable. A stopped writer fails `done` at once.
    pub fn submit(&self, messages: Vec<StreamMessage>, done: AppendDone) {
        if let Err(mpsc::SendError(job)) = self.tx.send(Job { messages, done }) {
            (job.done)(Err(Arc::new(StoreError::Replication(
                "the stream's writer stopped".into(),
            ))));
        }
    }
}

fn run(stream: &SharedStream, rx: &mpsc::Receiver<Job>, now_ms: &dyn Fn() -> u64) {
    let mut failed: Option<Arc<StoreError>> = None;
    let mut ticked = std::time::Instant::now();
    loop {
        if ticked.elapsed() >= TICK {
            ticked = std::time::Instant::now();
            tick(stream, now_ms());
        }
        let first = match rx.recv_timeout(TICK) {
            Ok(job) => job,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let mut bytes: usize = first.messages.iter().map(|m| m.body.len()).sum();
        let mut jobs = vec![first];
        let mut count = jobs[0].messages.len();
        while count < CHUNK_MESSAGES_MAX && bytes < CHUNK_BYTES_MAX {
            match rx.try_recv() {
                Ok(job) => {
                    count += job.messages.len();
                    bytes += job.messages.iter().map(|m| m.body.len()).sum::<usize>();
                    jobs.push(job);
                }
                Err(_) => break,
            }
        }
        if let Some(e) = &failed {
            // A failed write leaves the file's tail unknown: nothing more is confirmed until
            // the stream is reopened (recovery cuts what was not synced).
            for job in jobs {
                (job.done)(Err(Arc::clone(e)));
            }
            continue;
        }
        let (lengths, messages): (Vec<usize>, Vec<StreamMessage>) = {
            let mut lengths = Vec::with_capacity(jobs.len());
            let mut all = Vec::with_capacity(count);
            for job in &mut jobs {
                lengths.push(job.messages.len());
                all.append(&mut job.messages);
            }
            (lengths, all)
        };
        let written = {
            let mut disk = stream.disk.lock();
            disk.append(now_ms(), &messages)
                .and_then(|range| disk.sync_handle().map(|h| (range, h)))
        };
        let outcome = written.and_then(|(range, handle)| {
            // The fsync, without the lock: readers go on meanwhile.
            handle.map_or(Ok(()), |h| h.sync()).map(|()| range)
        });
        match outcome {
            Ok(range) => {
                // SeqCst: a reader parks, then reads this; the hook reads its parked flag.
                stream.durable_next.store(range.end, Ordering::SeqCst);
                if let Some(hook) = stream.on_durable.get() {
                    hook();
                }
                let mut at = range.start;
                for (job, n) in jobs.into_iter().zip(lengths) {
                    let n = n as u64;
                    (job.done)(Ok(at..at + n));
                    at += n;
                }
            }
            Err(e) => {
                let e = Arc::new(e);
                tracing::error!(error = %e, "stream write failed: the stream stops taking writes");
                failed = Some(Arc::clone(&e));
                for job in jobs {
                    (job.done)(Err(Arc::clone(&e)));
                }
            }
        }
    }
    // Every handle is gone (the stream was deleted or the broker stops).
    if stream.remove_on_exit.load(Ordering::Acquire) {
        let dir = stream.disk.lock().dir().to_path_buf();
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "a deleted stream's files were not removed");
        }
    } else if let Err(e) = stream.save_offsets() {
        tracing::error!(error = %e, "saving stream offsets failed");
    }
}

/// What an idle writer does once a [`TICK`]: age retention, tracked offsets saved (a
/// replica's ticker thread does the same).
pub fn tick(stream: &SharedStream, now_ms: u64) {
    if let Err(e) = stream.disk.lock().retain(now_ms) {
        tracing::error!(error = %e, "stream retention failed");
    }
    if let Err(e) = stream.save_offsets() {
        tracing::error!(error = %e, "saving stream offsets failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::log::StreamConfig;
    use bytes::Bytes;

    #[test]
    fn concurrent_publishers_get_contiguous_durable_offsets_in_their_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let disk = StreamDisk::open(dir.path(), StreamConfig::default(), 0).expect("open");
        let (writer, shared) = StreamWriter::start(disk, Arc::new(|| 1)).expect("start");
        let (tx, rx) = mpsc::channel();
        let mut threads = Vec::new();
        for p in 0..4 {
            let (writer, tx) = (writer.clone(), tx.clone());
            threads.push(std::thread::spawn(move || {
                for k in 0..50 {
                    let body = Bytes::from(format!("p{p}-{k}"));
                    let tx = tx.clone();
                    writer.submit(
                        vec![StreamMessage {
                            filter_value: None,
                            body: body.clone(),
                        }],
                        Box::new(move |r| {
                            let _ = tx.send((p, k, body, r.expect("durable")));
                        }),
                    );
                }
            }));
        }
        for t in threads {
            t.join().expect("publisher");
        }
        drop(tx);
        let mut got: Vec<(usize, usize, Bytes, Range<u64>)> = rx.iter().collect();
        assert_eq!(got.len(), 200);
        // Every offset once; each publisher's messages in its own order.
        got.sort_by_key(|g| g.3.start);
        for (i, g) in got.iter().enumerate() {
            assert_eq!(g.3, i as u64..i as u64 + 1);
        }
        for p in 0..4 {
            let ks: Vec<usize> = got.iter().filter(|g| g.0 == p).map(|g| g.1).collect();
            assert_eq!(ks, (0..50).collect::<Vec<_>>());
        }
        assert_eq!(shared.durable_next(), 200);
        // What each was told is what the stream holds there.
        let disk = shared.disk.lock();
        for g in got.iter().step_by(37) {
            let (first, messages) = disk.read_chunk(g.3.start).expect("read").expect("held");
            let body = &messages[usize::try_from(g.3.start - first).expect("index")].body;
            assert_eq!(body, &g.2);
        }
        drop(disk);
        drop(writer);
        // A restart finds every confirmed message.
        drop(shared);
        let disk = StreamDisk::open(dir.path(), StreamConfig::default(), 2).expect("reopen");
        assert_eq!(disk.log().next_offset(), 200);
    }
}
