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
//! Bound: the queue is limited by bytes ([`Writer::pending_bytes`]); submitters pause their
//! producers (stop reading their sockets) while it is above their limit.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use crate::{Batch, BodyRef, Location, Op, Store, StoreError};

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
    bytes: u64,
    done: Completion,
}

#[derive(Default)]
struct Queue {
    requests: VecDeque<Request>,
    closed: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    pending_bytes: AtomicU64,
    commits: AtomicU64,
    failed: Mutex<Option<Arc<StoreError>>>,
    on_commit: Mutex<Option<CommitHook>>,
}

/// Called on the writer thread after every group commit with the bytes still pending.
pub type CommitHook = Box<dyn Fn(u64) + Send>;

/// Handle to the writer thread. Dropping the last handle (or [`Writer::shutdown`]) lets the
/// thread finish what is queued and exit.
pub struct Writer {
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

fn batch_bytes(b: &Batch) -> u64 {
    b.bodies.iter().map(|m| m.payload_len() as u64).sum::<u64>() + 32 * b.ops.len() as u64
}

impl Writer {
    /// Start the writer thread over `store`.
    ///
    /// # Errors
    /// If the thread cannot be spawned.
    pub fn start(store: Store) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            pending_bytes: AtomicU64::new(0),
            commits: AtomicU64::new(0),
            failed: Mutex::new(None),
            on_commit: Mutex::new(None),
        });
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("warren-store-writer".into())
            .spawn(move || run(store, &s))?;
        Ok(Self {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queue a batch; `done` runs on the writer thread once it is durable (keep it short).
    pub fn submit(&self, batch: Batch, done: Completion) {
        if let Some(e) = self.shared.failed.lock().clone() {
            done(Err(e));
            return;
        }
        let bytes = batch_bytes(&batch);
        self.shared
            .pending_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        let mut q = self.shared.queue.lock();
        if q.closed {
            drop(q);
            self.shared
                .pending_bytes
                .fetch_sub(bytes, Ordering::Relaxed);
            done(Err(Arc::new(StoreError::io(
                "submit",
                "",
                std::io::Error::other("store writer stopped"),
            ))));
            return;
        }
        let bodies = batch.bodies.len();
        q.requests.push_back(Request {
            batch,
            bodies,
            bytes,
            done,
        });
        drop(q);
        self.shared.wake.notify_one();
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

    /// Commits done so far (each may carry many batches).
    #[must_use]
    pub fn commits(&self) -> u64 {
        self.shared.commits.load(Ordering::Relaxed)
    }

    /// The error that stopped the writer, if any.
    #[must_use]
    pub fn failure(&self) -> Option<Arc<StoreError>> {
        self.shared.failed.lock().clone()
    }

    /// Commit what is queued, then stop the thread and wait for it.
    pub fn shutdown(&self) {
        self.shared.queue.lock().closed = true;
        self.shared.wake.notify_one();
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

fn run(mut store: Store, shared: &Shared) {
    let mut group: Vec<Request> = Vec::new();
    loop {
        {
            let mut q = shared.queue.lock();
            while q.requests.is_empty() && !q.closed {
                shared.wake.wait(&mut q);
            }
            if q.requests.is_empty() && q.closed {
                return;
            }
            let (mut bytes, mut ops) = (0usize, 0usize);
            while let Some(r) = q.requests.front() {
                let body_bytes: usize = r.batch.bodies.iter().map(|b| b.payload_len()).sum();
                if !group.is_empty()
                    && (bytes + body_bytes > GROUP_BYTES_MAX
                        || ops + r.batch.ops.len() > GROUP_OPS_MAX)
                {
                    break;
                }
                bytes += body_bytes;
                ops += r.batch.ops.len();
                if let Some(r) = q.requests.pop_front() {
                    group.push(r);
                }
            }
        }
        let merged = merge(&mut group);
        let result = match shared.failed.lock().clone() {
            Some(e) => Err(e),
            None => store.commit(&merged).map_err(Arc::new),
        };
        shared.commits.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = &result {
            tracing::error!(error = %e, "store commit failed; no further writes will be confirmed");
            *shared.failed.lock() = Some(Arc::clone(e));
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
        merged.ops.extend(batch.ops.into_iter().map(|op| match op {
            Op::Enqueue {
                queue,
                id,
                body: BodyRef::New(i),
                flags,
                expires_at,
            } => Op::Enqueue {
                queue,
                id,
                body: BodyRef::New(base + i),
                flags,
                expires_at,
            },
            other => other,
        }));
    }
    merged
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use bytes::Bytes;

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

    #[test]
    fn merge_shifts_body_references() {
        let req = |n: u64| Request {
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
