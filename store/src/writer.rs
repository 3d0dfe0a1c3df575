//! Group commit: one writer thread per node makes everything durable.
//!
//! Submitters (connection tasks, queues) hand [`Batch`]es to [`Writer::submit`] with a
//! completion. The thread takes everything queued, merges it into one batch, commits it with
//! one segment sync and one redb commit, runs the completions, and immediately starts on what
//! queued up meanwhile: batches grow with load and no timer is involved.
//!
//! Order: batches commit in submission order and ops keep their order inside the merged batch,
//! so an ack submitted after its enqueue can never be applied before it.
//!
//! Failure is fatal: after a failed commit nothing more is committed and every completion,
//! pending or future, receives the error. Confirming anything after a failed write could
//! confirm what is not on disk.
//!
//! Bound: what is queued is limited by bytes ([`Writer::pending_bytes`]); submitters pause their
//! producers (stop reading their sockets) while it is above their limit.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use parking_lot::Mutex;

use crate::{Batch, BodyRef, Location, Store, StoreError, StoredMessage};

/// Called once the batch is durable (with its bodies' locations) or failed.
pub type Completion = Box<dyn FnOnce(Result<Vec<Location>, Arc<StoreError>>) + Send>;

/// Most bytes of bodies merged into one commit (a group stays bounded in memory and latency).
pub const GROUP_BYTES_MAX: usize = 8 * 1024 * 1024;
/// Most ops merged into one commit.
pub const GROUP_OPS_MAX: usize = 20_000;

struct Request {
    /// Moved into the merged batch when the group is committed.
    batch: Batch,
    /// Bodies in `batch` (its locations are this many of the merged batch's).
    bodies: usize,
    /// Body bytes in `batch` (what the group limit counts).
    body_bytes: usize,
    /// What `pending_bytes` counts for it.
    bytes: u64,
    done: Completion,
}

/// What submitters send the writer thread. A channel rather than a locked queue: submitters
/// (connection tasks) never wait for the writer thread, nor it for them.
enum Msg {
    Request(Request),
    /// Commit what is queued, then exit.
    Close,
}

struct Shared {
    metrics: Arc<crate::StoreMetrics>,
    pending_bytes: AtomicU64,
    commits: AtomicU64,
    /// Set with `failed`; read on every submit without a lock.
    has_failed: AtomicBool,
    failed: Mutex<Option<Arc<StoreError>>>,
    on_commit: Mutex<Option<CommitHook>>,
    /// Set by the thread when it stops taking requests.
    stopped: AtomicBool,
    /// The channel's receiver once the thread stopped: whoever finds requests in it (the
    /// exiting thread, or a submitter that raced with it) completes them with an error, so
    /// that no completion is ever dropped uncalled.
    late: Mutex<Option<mpsc::Receiver<Msg>>>,
}

/// Complete everything left in a stopped writer's channel with an error.
fn fail_late(shared: &Shared) {
    let late = shared.late.lock();
    let Some(rx) = late.as_ref() else { return };
    while let Ok(msg) = rx.try_recv() {
        if let Msg::Request(r) = msg {
            shared.pending_bytes.fetch_sub(r.bytes, Ordering::Relaxed);
            (r.done)(Err(stopped()));
        }
    }
}

/// Called on the writer thread after every group commit with the bytes still pending.
pub type CommitHook = Box<dyn Fn(u64) + Send>;

/// Handle to the writer thread. Dropping the last handle (or [`Writer::shutdown`]) lets the
/// thread finish what is queued and exit.
pub struct Writer {
    tx: mpsc::Sender<Msg>,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("pending_bytes", &self.pending_bytes())
            .field("commits", &self.commits())
            .finish_non_exhaustive()
    }
}

fn stopped() -> Arc<StoreError> {
    Arc::new(StoreError::io(
        "submit",
        "",
        std::io::Error::other("store writer stopped"),
    ))
}

impl Writer {
    /// Start the writer thread over `store`.
    ///
    /// # Errors
    /// If the thread cannot be spawned.
    pub fn start(store: Store) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            metrics: store.metrics(),
            pending_bytes: AtomicU64::new(0),
            commits: AtomicU64::new(0),
            has_failed: AtomicBool::new(false),
            failed: Mutex::new(None),
            on_commit: Mutex::new(None),
            stopped: AtomicBool::new(false),
            late: Mutex::new(None),
        });
        let (tx, rx) = mpsc::channel();
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("warren-store-writer".into())
            .spawn(move || {
                run(store, &s, &rx);
                // Dekker with `submit`: stopped is set before the last look at the channel,
                // and a submitter looks at stopped after its send; one of them sees the other.
                s.stopped.store(true, Ordering::SeqCst);
                std::sync::atomic::fence(Ordering::SeqCst);
                *s.late.lock() = Some(rx);
                fail_late(&s);
            })?;
        Ok(Self {
            tx,
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queue a batch; `done` runs on the writer thread once it is durable (keep it short).
    pub fn submit(&self, batch: Batch, done: Completion) {
        if self.shared.has_failed.load(Ordering::Acquire)
            && let Some(e) = self.shared.failed.lock().clone()
        {
            done(Err(e));
            return;
        }
        let body_bytes: usize = batch.bodies.iter().map(StoredMessage::payload_len).sum();
        let bytes = body_bytes as u64 + 32 * batch.ops.len() as u64;
        self.shared
            .pending_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        let request = Request {
            bodies: batch.bodies.len(),
            batch,
            body_bytes,
            bytes,
            done,
        };
        if let Err(mpsc::SendError(Msg::Request(r))) = self.tx.send(Msg::Request(request)) {
            // The thread has exited (shutdown): nothing more is committed.
            self.shared
                .pending_bytes
                .fetch_sub(r.bytes, Ordering::Relaxed);
            (r.done)(Err(stopped()));
            return;
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.shared.stopped.load(Ordering::SeqCst) {
            // Sent while the thread was exiting: it may not have seen this request.
            fail_late(&self.shared);
        }
    }

    /// Run `hook` after every group commit (e.g. to resume producers paused on
    /// [`Writer::pending_bytes`]).
    pub fn set_on_commit(&self, hook: CommitHook) {
        *self.shared.on_commit.lock() = Some(hook);
    }

    /// Bytes submitted and not yet committed.
    #[must_use]
    pub fn pending_bytes(&self) -> u64 {
        self.shared.pending_bytes.load(Ordering::Relaxed)
    }

    /// The store's commit measurements.
    #[must_use]
    pub fn metrics(&self) -> &crate::StoreMetrics {
        &self.shared.metrics
    }

    /// Commits done so far (each may carry many batches).
    #[must_use]
    pub fn commits(&self) -> u64 {
        self.shared.commits.load(Ordering::Relaxed)
    }

    /// Commit what is queued, then stop the thread and wait for it. Batches submitted after
    /// the thread stopped taking requests complete with an error; every completion is called
    /// exactly once, whatever the race with shutdown.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Msg::Close);
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A checkpoint on the writer's own initiative; a failure stops the store as a failed commit
/// does (what redb holds can no longer be trusted to follow the segments).
fn checkpoint(store: &mut Store, shared: &Shared) {
    if shared.failed.lock().is_some() {
        return;
    }
    if let Err(e) = store.checkpoint() {
        tracing::error!(error = %e, "store checkpoint failed; no further writes will be confirmed");
        *shared.failed.lock() = Some(Arc::new(e));
        shared.has_failed.store(true, Ordering::Release);
    }
}

fn run(mut store: Store, shared: &Shared, rx: &mpsc::Receiver<Msg>) {
    let mut group: Vec<Request> = Vec::new();
    // A request that did not fit the previous group opens the next one.
    let mut carry: Option<Request> = None;
    let mut closing = false;
    loop {
        let first = match carry.take() {
            Some(r) => r,
            None => {
                let next = if closing {
                    rx.try_recv().ok()
                } else {
                    // A failed store makes no checkpoint: it waits for requests to refuse.
                    let due = if shared.has_failed.load(Ordering::Acquire) {
                        None
                    } else {
                        store.checkpoint_due()
                    };
                    match due {
                        None => rx.recv().ok(),
                        Some(wait) => match rx.recv_timeout(wait) {
                            Ok(msg) => Some(msg),
                            Err(mpsc::RecvTimeoutError::Timeout) => {
                                // Quiet: no commit came to make the checkpoint.
                                checkpoint(&mut store, shared);
                                continue;
                            }
                            Err(mpsc::RecvTimeoutError::Disconnected) => None,
                        },
                    }
                };
                match next {
                    Some(Msg::Request(r)) => r,
                    Some(Msg::Close) => {
                        closing = true;
                        continue;
                    }
                    // Closing and drained, or every sender gone.
                    None => return,
                }
            }
        };
        let (mut bytes, mut ops) = (first.body_bytes, first.batch.ops.len());
        group.push(first);
        while let Ok(msg) = rx.try_recv() {
            match msg {
                Msg::Request(r) => {
                    if bytes + r.body_bytes > GROUP_BYTES_MAX
                        || ops + r.batch.ops.len() > GROUP_OPS_MAX
                    {
                        carry = Some(r);
                        break;
                    }
                    bytes += r.body_bytes;
                    ops += r.batch.ops.len();
                    group.push(r);
                }
                Msg::Close => closing = true,
            }
        }
        shared
            .metrics
            .group_commit_batches
            .observe(group.len() as f64);
        let merged = merge(&mut group);
        let failed = shared.failed.lock().clone();
        let started = std::time::Instant::now();
        let result = match failed {
            Some(e) => Err(e),
            None => store.commit(&merged).map_err(Arc::new),
        };
        shared
            .metrics
            .commit_seconds
            .observe(started.elapsed().as_secs_f64());
        shared.commits.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = &result {
            tracing::error!(error = %e, "store commit failed; no further writes will be confirmed");
            *shared.failed.lock() = Some(Arc::clone(e));
            shared.has_failed.store(true, Ordering::Release);
        }
        let mut at = 0;
        for r in group.drain(..) {
            shared.pending_bytes.fetch_sub(r.bytes, Ordering::Relaxed);
            let n = r.bodies;
            let mine = match &result {
                Ok(locs) => Ok(locs[at..at + n].to_vec()),
                Err(e) => Err(Arc::clone(e)),
            };
            at += n;
            (r.done)(mine);
        }
        if let Some(hook) = shared.on_commit.lock().as_ref() {
            hook(shared.pending_bytes.load(Ordering::Relaxed));
        }
    }
}

/// One batch from many, moved out of the requests: bodies concatenated, body references
/// shifted accordingly.
fn merge(group: &mut [Request]) -> Batch {
    if let [only] = group {
        return std::mem::take(&mut only.batch);
    }
    let mut merged = Batch::default();
    for r in group {
        let base = merged.bodies.len();
        let batch = std::mem::take(&mut r.batch);
        merged.bodies.extend(batch.bodies);
        // Its bodies follow the earlier requests' in the merged batch.
        merged.ops.extend(batch.ops.into_iter().map(|op| {
            match op.map_new_body(|i| Ok::<_, std::convert::Infallible>(BodyRef::New(base + i))) {
                Ok(op) => op,
                Err(never) => match never {},
            }
        }));
    }
    merged
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use bytes::Bytes;

    use crate::Op;

    use super::*;
    use crate::{Options, StoredMessage};

    fn msg(n: u64) -> StoredMessage {
        StoredMessage {
            exchange: Bytes::new(),
            routing_key: Bytes::from(n.to_string()),
            properties: Bytes::from_static(&[0, 0]),
            body: Bytes::from(vec![n as u8; 100]),
        }
    }

    #[test]
    fn concurrent_submitters_are_grouped_and_all_complete_durably() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = Store::open(dir.path(), Options::default()).unwrap();
        let writer = Arc::new(Writer::start(store).unwrap());
        let (tx, rx) = mpsc::channel();
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let writer = Arc::clone(&writer);
                let tx = tx.clone();
                std::thread::spawn(move || {
                    for i in 0..250u64 {
                        let id = t * 1000 + i;
                        let tx = tx.clone();
                        writer.submit(
                            Batch {
                                bodies: vec![msg(id)],
                                ops: vec![Op::Enqueue {
                                    queue: t,
                                    id,
                                    body: BodyRef::New(0),
                                    flags: 0,
                                    expires_at: 0,
                                }],
                            },
                            Box::new(move |r| tx.send((id, r.map(|l| l.len()))).unwrap()),
                        );
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        drop(tx);
        let done: Vec<_> = rx.iter().collect();
        assert_eq!(done.len(), 1000);
        assert!(done.iter().all(|(_, r)| matches!(r, Ok(1))));
        // 1000 submissions took fewer commits: they were grouped.
        assert!(writer.commits() < 1000, "{} commits", writer.commits());
        assert_eq!(writer.pending_bytes(), 0);
        writer.shutdown();
        drop(writer);
        let (store, r) = Store::open(dir.path(), Options::default()).unwrap();
        assert_eq!(r.messages.len(), 1000);
        let m = r
            .messages
            .iter()
            .find(|m| m.queue == 2 && m.id == 2007)
            .unwrap();
        assert_eq!(
            store.segments().read(m.location).unwrap().routing_key,
            Bytes::from_static(b"2007")
        );
    }

    /// With nothing more submitted, the writer makes the checkpoint itself once it is due:
    /// the segments of settled messages are deleted while the broker is quiet.
    #[test]
    fn a_quiet_writer_checkpoints_and_settled_segments_go() {
        let dir = tempfile::tempdir().unwrap();
        let options = Options {
            segment_max: 4096,
            checkpoint_interval: std::time::Duration::from_millis(20),
            ..Options::default()
        };
        let (store, _) = Store::open(dir.path(), options).unwrap();
        let writer = Writer::start(store).unwrap();
        let commit = |batch: Batch| {
            let (tx, rx) = mpsc::channel();
            writer.submit(batch, Box::new(move |r| tx.send(r.is_ok()).unwrap()));
            assert!(rx.recv().unwrap(), "committed");
        };
        for id in 0..100u64 {
            commit(Batch {
                bodies: vec![msg(id)],
                ops: vec![Op::Enqueue {
                    queue: 1,
                    id,
                    body: BodyRef::New(0),
                    flags: 0,
                    expires_at: 0,
                }],
            });
        }
        commit(Batch {
            bodies: vec![],
            ops: (0..100).map(|id| Op::Settle { queue: 1, id }).collect(),
        });
        let segments = || {
            crate::segment::list(&dir.path().join("segments"))
                .unwrap()
                .len()
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while segments() > 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "{} segments left with every message settled",
                segments()
            );
            std::thread::yield_now();
        }
        writer.shutdown();
    }

    #[test]
    fn every_completion_runs_once_when_submits_race_shutdown() {
        // Submitters keep going while the writer shuts down: each completion must run
        // exactly once (Ok if committed, Err if refused), never be dropped. Repeated, because
        // the window is short.
        for round in 0..40u64 {
            let dir = tempfile::tempdir().unwrap();
            let (store, _) = Store::open(dir.path(), Options::default()).unwrap();
            let writer = Arc::new(Writer::start(store).unwrap());
            let completed = Arc::new(AtomicU64::new(0));
            let ok = Arc::new(AtomicU64::new(0));
            let submitters: Vec<_> = (0..2u64)
                .map(|t| {
                    let (writer, completed, ok) =
                        (Arc::clone(&writer), Arc::clone(&completed), Arc::clone(&ok));
                    std::thread::spawn(move || {
                        for i in 0..200u64 {
                            let (completed, ok) = (Arc::clone(&completed), Arc::clone(&ok));
                            writer.submit(
                                Batch {
                                    bodies: vec![msg(i)],
                                    ops: vec![Op::Enqueue {
                                        queue: t + 1,
                                        id: i,
                                        body: BodyRef::New(0),
                                        flags: 0,
                                        expires_at: 0,
                                    }],
                                },
                                Box::new(move |r| {
                                    if r.is_ok() {
                                        ok.fetch_add(1, Ordering::SeqCst);
                                    }
                                    completed.fetch_add(1, Ordering::SeqCst);
                                }),
                            );
                        }
                    })
                })
                .collect();
            if round % 2 == 0 {
                std::thread::yield_now();
            }
            writer.shutdown();
            for s in submitters {
                s.join().unwrap();
            }
            assert_eq!(completed.load(Ordering::SeqCst), 400, "round {round}");
            assert_eq!(writer.pending_bytes(), 0, "round {round}");
            drop(writer);
            let (_, r) = Store::open(dir.path(), Options::default()).unwrap();
            assert_eq!(
                r.messages.len() as u64,
                ok.load(Ordering::SeqCst),
                "exactly the confirmed ones are stored (round {round})"
            );
        }
    }

    #[test]
    fn merge_shifts_body_references() {
        let req = |n: u64| Request {
            body_bytes: 0,
            batch: Batch {
                bodies: vec![msg(n)],
                ops: vec![Op::Enqueue {
                    queue: 1,
                    id: n,
                    body: BodyRef::New(0),
                    flags: 0,
                    expires_at: 0,
                }],
            },
            bodies: 1,
            bytes: 0,
            done: Box::new(|_| {}),
        };
        let merged = merge(&mut [req(1), req(2)]);
        assert_eq!(merged.bodies.len(), 2);
        assert!(matches!(
            merged.ops[1],
            Op::Enqueue {
                body: BodyRef::New(1),
                ..
            }
        ));
    }
}
