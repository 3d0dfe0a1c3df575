//! The node-wide Raft log: one redb database holding the logs of every quorum queue group on
//! a node, written by one thread that commits for all of them at once (group commit).
//!
//! Every write of every group (an append, a vote, the commit index, a truncation, a purge, a
//! copy-out of live bodies) is a job sent to the writer. The writer takes every job waiting
//! when it is free (up to [`WRITE_BATCH_MAX`]), runs them in submission order inside one write
//! transaction and commits it with redb's `Durability::Immediate`: one write of the dirty pages
//! and one fsync for the whole batch, however many groups it holds. While a commit syncs, the
//! next batch gathers, so the number of fsyncs per second is bounded by the disk, not by the
//! number of busy queues (each queue with its own database paid one per round of its own).
//!
//! A job is called back only after its transaction is durable, so an entry acknowledged to
//! openraft is on disk; a batch commits atomically, so after a crash (kill -9 in the middle of
//! a batch) either every job of the batch is there or none is, and no half entry exists.
//!
//! Jobs only insert and remove rows (what they write was read and decoded before they were
//! sent): the errors a job can meet are the storage's own, and then the whole batch fails
//! together, each job told so. openraft stops a group whose log write fails.
//!
//! Reads do not go through the writer: redb's read transactions see the last commit and run
//! beside the writer.
//!
//! Resources: one database file, one page cache ([`NODE_LOG_CACHE_BYTES`]) and one thread per
//! node, whatever the number of groups; a group is three tables in it
//! ([`GroupTables`]), a few pages of the file and no file descriptor of its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, sync_channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use redb::{Database, WriteTransaction};

/// redb's page cache of the node-wide log, shared by all its groups: a fixed cost per node
/// (the old layout gave every queue's database 2 MiB). Small on purpose: the pages a busy
/// group's appends touch are few (the B-tree's right edge), the bodies just appended are in
/// each log's recent cache, and bodies read back later are in the OS page cache; a larger
/// cache (64 MiB measured) holds written bodies twice and made no queue faster.
pub const NODE_LOG_CACHE_BYTES: usize = 8 * 1024 * 1024;

/// Jobs one transaction takes at most: a bound on what a commit holds in memory (each job is
/// one group's append or a small write; copy-outs are bounded by their own byte budget).
pub const WRITE_BATCH_MAX: usize = 1024;

/// Jobs waiting for the writer at most; a submitter past it waits (back-pressure on the
/// groups, never unbounded memory).
pub const WRITE_QUEUE_MAX: usize = 4096;

/// A job: rows to insert or remove within the batch's transaction.
type Job = Box<dyn FnOnce(&WriteTransaction) -> Result<(), redb::Error> + Send>;
/// Told the batch's outcome once its transaction committed (or failed).
type Done = Box<dyn FnOnce(Result<(), Arc<str>>) + Send>;

struct Request {
    job: Job,
    done: Done,
}

/// Counters of the writer (for tests and metrics).
#[derive(Debug, Default)]
pub struct WriterStats {
    /// Transactions committed.
    pub commits: AtomicU64,
    /// Jobs run (in those and in failed ones).
    pub jobs: AtomicU64,
}

/// The names of one group's tables in a log database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupTables {
    /// Entries by index.
    pub log: String,
    /// Vote, commit index, last purged id.
    pub meta: String,
    /// Bodies of live messages copied out of purged entries, by key.
    pub bodies: String,
}

impl GroupTables {
    /// The tables of a database holding one log (a stream's, the metadata's, and a queue's
    /// own file of the layout before the node-wide log).
    #[must_use]
    pub fn single() -> Self {
        Self {
            log: "raft_log".into(),
            meta: "raft_meta".into(),
            bodies: "raft_bodies".into(),
        }
    }

    /// The tables of group `group` (a queue's incarnation) in the node-wide log.
    #[must_use]
    pub fn of_group(group: u64) -> Self {
        Self {
            log: format!("g{group:016x}.log"),
            meta: format!("g{group:016x}.meta"),
            bodies: format!("g{group:016x}.bodies"),
        }
    }
}

/// A log database and its writer. Dropping the last handle lets the writer finish the jobs
/// sent and waits for it, so the file can be opened again at once.
pub struct NodeLog {
    db: Arc<Database>,
    requests: Option<std::sync::mpsc::SyncSender<Request>>,
    writer: Option<JoinHandle<()>>,
    stats: Arc<WriterStats>,
}

impl std::fmt::Debug for NodeLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeLog")
            .field("commits", &self.stats.commits.load(Ordering::Relaxed))
            .field("jobs", &self.stats.jobs.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// An error of the writer that is not redb's own (it stopped; its batch failed).
fn writer_error(text: &str) -> redb::Error {
    redb::Error::Io(std::io::Error::other(text.to_owned()))
}

impl NodeLog {
    /// Open or create the database at `path` with a page cache of `cache_bytes`, and start
    /// its writer.
    ///
    /// # Errors
    /// When redb cannot open the file or the thread cannot start.
    pub fn open(path: &std::path::Path, cache_bytes: usize) -> Result<Arc<Self>, redb::Error> {
        let db = Arc::new(
            Database::builder()
                .set_cache_size(cache_bytes)
                .create(path)?,
        );
        let (requests, queue) = sync_channel(WRITE_QUEUE_MAX);
        let stats = Arc::new(WriterStats::default());
        let writer = {
            let db = Arc::clone(&db);
            let stats = Arc::clone(&stats);
            std::thread::Builder::new()
                .name("raft-log-writer".into())
                .spawn(move || write_batches(&db, &queue, &stats))
                .map_err(redb::Error::Io)?
        };
        Ok(Arc::new(Self {
            db,
            requests: Some(requests),
            writer: Some(writer),
            stats,
        }))
    }

    /// The database, to read from.
    #[must_use]
    pub fn db(&self) -> &Database {
        &self.db
    }

    /// The writer's counters.
    #[must_use]
    pub fn stats(&self) -> &WriterStats {
        &self.stats
    }

    /// Run `f` in the writer's next transaction and call `done` with its result once that
    /// transaction is durable (or failed), on the writer's thread.
    pub fn submit<T: Send + 'static>(
        &self,
        f: impl FnOnce(&WriteTransaction) -> Result<T, redb::Error> + Send + 'static,
        done: impl FnOnce(Result<T, redb::Error>) + Send + 'static,
    ) {
        let out: Arc<Mutex<Option<T>>> = Arc::new(Mutex::new(None));
        let job_out = Arc::clone(&out);
        let job: Job = Box::new(move |tx| {
            let t = f(tx)?;
            *job_out.lock().unwrap_or_else(PoisonError::into_inner) = Some(t);
            Ok(())
        });
        let done: Done = Box::new(move |result| {
            let result = match result {
                Ok(()) => out
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take()
                    .ok_or_else(|| writer_error("a committed job left no result")),
                Err(e) => Err(writer_error(&e)),
            };
            done(result);
        });
        let request = Request { job, done };
        let Some(requests) = &self.requests else {
            (request.done)(Err("the log's writer is stopping".into()));
            return;
        };
        if let Err(std::sync::mpsc::SendError(request)) = requests.send(request) {
            (request.done)(Err("the log's writer stopped".into()));
        }
    }

    /// Run `f` in the writer's next transaction and return its result once that transaction
    /// is durable. Blocks the calling thread (not for async tasks: see [`NodeLog::write_async`]).
    ///
    /// # Errors
    /// `f`'s error, or the transaction's: then nothing `f` wrote is there.
    pub fn write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&WriteTransaction) -> Result<T, redb::Error> + Send + 'static,
    ) -> Result<T, redb::Error> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.submit(f, move |r| {
            let _ = tx.send(r);
        });
        rx.recv()
            .unwrap_or_else(|_| Err(writer_error("the log's writer dropped a job")))
    }

    /// [`NodeLog::write`] for async callers: awaits the commit without blocking a worker.
    ///
    /// # Errors
    /// As [`NodeLog::write`].
    pub async fn write_async<T: Send + 'static>(
        &self,
        f: impl FnOnce(&WriteTransaction) -> Result<T, redb::Error> + Send + 'static,
    ) -> Result<T, redb::Error> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(f, move |r| {
            let _ = tx.send(r);
        });
        rx.await
            .unwrap_or_else(|_| Err(writer_error("the log's writer dropped a job")))
    }

    /// Create `tables` if they are not there yet.
    ///
    /// # Errors
    /// When redb cannot write.
    pub fn create(&self, tables: &GroupTables) -> Result<(), redb::Error> {
        let t = tables.clone();
        self.write(move |tx| {
            tx.open_table(log_table(&t))?;
            tx.open_table(meta_table(&t))?;
            tx.open_table(bodies_table(&t))?;
            Ok(())
        })
    }

    /// Delete `tables` and all they hold (a deleted queue's group).
    ///
    /// # Errors
    /// When redb cannot write.
    pub fn drop_group(&self, tables: &GroupTables) -> Result<(), redb::Error> {
        let t = tables.clone();
        self.write(move |tx| {
            tx.delete_table(log_table(&t))?;
            tx.delete_table(meta_table(&t))?;
            tx.delete_table(bodies_table(&t))?;
            Ok(())
        })
    }

    /// Copy the log of the layout before the node-wide log (a database of its own at `old`,
    /// [`GroupTables::single`]) into `tables`, in transactions of at most
    /// [`IMPORT_TXN_BYTES`], then delete the old file. Done before the group's Raft starts;
    /// a crash halfway leaves the old file, and the import runs again (rows are overwritten
    /// with the same values). Returns whether there was a file to import.
    ///
    /// # Errors
    /// When either database cannot be read or written; the old file is kept then.
    pub fn import(&self, old: &std::path::Path, tables: &GroupTables) -> Result<bool, redb::Error> {
        if !old.exists() {
            return Ok(false);
        }
        let source = Arc::new(Database::builder().set_cache_size(1 << 20).open(old)?);
        let single = GroupTables::single();
        for (from, to) in [
            (single.log.clone(), tables.log.clone()),
            (single.bodies.clone(), tables.bodies.clone()),
        ] {
            let mut after: Option<u64> = None;
            loop {
                let rows = read_u64_rows(&source, &from, after)?;
                let Some(&(last, _)) = rows.last() else { break };
                after = Some(last);
                let to = to.clone();
                self.write(move |tx| {
                    let mut table = tx.open_table(redb::TableDefinition::<u64, &[u8]>::new(&to))?;
                    for (k, v) in &rows {
                        table.insert(*k, v.as_slice())?;
                    }
                    Ok(())
                })?;
            }
        }
        let meta: Vec<(String, Vec<u8>)> = {
            use redb::{ReadableDatabase, ReadableTable};
            let tx = source.begin_read()?;
            match tx.open_table(redb::TableDefinition::<&str, &[u8]>::new(&single.meta)) {
                Ok(table) => table
                    .iter()?
                    .map(|r| r.map(|(k, v)| (k.value().to_owned(), v.value().to_vec())))
                    .collect::<Result<_, _>>()?,
                Err(redb::TableError::TableDoesNotExist(_)) => Vec::new(),
                Err(e) => return Err(e.into()),
            }
        };
        let t = tables.clone();
        self.write(move |tx| {
            let mut table = tx.open_table(meta_table(&t))?;
            for (k, v) in &meta {
                table.insert(k.as_str(), v.as_slice())?;
            }
            Ok(())
        })?;
        drop(source);
        std::fs::remove_file(old).map_err(redb::Error::Io)?;
        Ok(true)
    }
}

/// Bytes of rows one import transaction copies at most.
pub const IMPORT_TXN_BYTES: usize = 16 * 1024 * 1024;

/// Rows of table `name` after key `after`, [`IMPORT_TXN_BYTES`] of values at most.
pub(crate) fn read_u64_rows(
    db: &Database,
    name: &str,
    after: Option<u64>,
) -> Result<Vec<(u64, Vec<u8>)>, redb::Error> {
    use redb::ReadableDatabase;
    let tx = db.begin_read()?;
    let table = match tx.open_table(redb::TableDefinition::<u64, &[u8]>::new(name)) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let range = match after {
        Some(a) if a == u64::MAX => return Ok(Vec::new()),
        Some(a) => table.range(a + 1..)?,
        None => table.range(0..)?,
    };
    let mut rows = Vec::new();
    let mut bytes = 0;
    for row in range {
        let (k, v) = row?;
        bytes += v.value().len();
        rows.push((k.value(), v.value().to_vec()));
        if bytes >= IMPORT_TXN_BYTES {
            break;
        }
    }
    Ok(rows)
}

/// Table `tables.log`.
#[must_use]
pub fn log_table(tables: &GroupTables) -> redb::TableDefinition<'_, u64, &'static [u8]> {
    redb::TableDefinition::new(&tables.log)
}

/// Table `tables.meta`.
#[must_use]
pub fn meta_table(tables: &GroupTables) -> redb::TableDefinition<'_, &'static str, &'static [u8]> {
    redb::TableDefinition::new(&tables.meta)
}

/// Table `tables.bodies`.
#[must_use]
pub fn bodies_table(tables: &GroupTables) -> redb::TableDefinition<'_, u64, &'static [u8]> {
    redb::TableDefinition::new(&tables.bodies)
}

impl Drop for NodeLog {
    fn drop(&mut self) {
        // Closing the channel ends the writer once it has run what was sent.
        self.requests = None;
        if let Some(writer) = self.writer.take()
            && writer.thread().id() != std::thread::current().id()
        {
            let _ = writer.join();
        }
    }
}

/// The writer: every waiting job in one transaction, one commit, then every job told.
fn write_batches(db: &Database, queue: &Receiver<Request>, stats: &WriterStats) {
    while let Ok(first) = queue.recv() {
        let mut batch = vec![first];
        while batch.len() < WRITE_BATCH_MAX {
            match queue.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        let mut dones = Vec::with_capacity(batch.len());
        let result = (|| -> Result<(), redb::Error> {
            let tx = db.begin_write()?;
            let mut failed = None;
            for Request { job, done } in batch {
                dones.push(done);
                stats.jobs.fetch_add(1, Ordering::Relaxed);
                if failed.is_none()
                    && let Err(e) = job(&tx)
                {
                    failed = Some(e);
                }
            }
            if let Some(e) = failed {
                // Dropping the transaction aborts it: none of the batch is written.
                drop(tx);
                return Err(e);
            }
            tx.commit()?;
            stats.commits.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })();
        let result: Result<(), Arc<str>> = result.map_err(|e| Arc::from(e.to_string()));
        if let Err(e) = &result {
            tracing::error!(error = %e, jobs = dones.len(), "a Raft log batch failed");
        }
        for done in dones {
            done(result.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

    use redb::{ReadableDatabase, ReadableTableMetadata};

    use super::*;

    /// Jobs sent while the writer is busy commit together: one transaction (one fsync) for
    /// the writes of many groups, each told only after it is durable.
    #[test]
    fn waiting_jobs_of_many_groups_share_one_commit() {
        let dir = tempfile::tempdir().unwrap();
        let log = NodeLog::open(&dir.path().join("node.redb"), 1 << 20).unwrap();
        let groups: Vec<GroupTables> = (0..10).map(GroupTables::of_group).collect();
        for g in &groups {
            log.create(g).unwrap();
        }
        let before = log.stats().commits.load(Ordering::Relaxed);
        // Hold the writer inside a job until every group's append is queued behind it.
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let (held_tx, held) = std::sync::mpsc::channel::<()>();
        let (first_done, first) = std::sync::mpsc::channel();
        log.submit(
            move |_tx| {
                held_tx.send(()).unwrap();
                wait.recv().unwrap();
                Ok(())
            },
            move |r| first_done.send(r.is_ok()).unwrap(),
        );
        held.recv().unwrap();
        let (done_tx, done) = std::sync::mpsc::channel();
        for (i, g) in groups.iter().enumerate() {
            let t = g.clone();
            let done_tx = done_tx.clone();
            log.submit(
                move |tx| {
                    tx.open_table(log_table(&t))?.insert(1, &[i as u8][..])?;
                    Ok(i)
                },
                move |r| done_tx.send(r.unwrap()).unwrap(),
            );
        }
        release.send(()).unwrap();
        assert!(first.recv().unwrap());
        let mut told: Vec<usize> = (0..10).map(|_| done.recv().unwrap()).collect();
        told.sort_unstable();
        assert_eq!(told, (0..10).collect::<Vec<_>>());
        // The holding job's transaction, then one for all ten appends.
        assert_eq!(log.stats().commits.load(Ordering::Relaxed) - before, 2);
        let tx = log.db().begin_read().unwrap();
        for (i, g) in groups.iter().enumerate() {
            let t = tx.open_table(log_table(g)).unwrap();
            assert_eq!(t.get(1).unwrap().unwrap().value(), &[i as u8][..]);
        }
    }

    /// A failing job fails its whole batch, and nothing of the batch is written.
    #[test]
    fn a_failed_job_writes_nothing_of_its_batch() {
        let dir = tempfile::tempdir().unwrap();
        let log = NodeLog::open(&dir.path().join("node.redb"), 1 << 20).unwrap();
        let g = GroupTables::of_group(1);
        log.create(&g).unwrap();
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let (held_tx, held) = std::sync::mpsc::channel::<()>();
        log.submit(
            move |_tx| {
                held_tx.send(()).unwrap();
                wait.recv().unwrap();
                Ok(())
            },
            |_| {},
        );
        held.recv().unwrap();
        let (a_tx, a) = std::sync::mpsc::channel();
        let t = g.clone();
        log.submit(
            move |tx| {
                tx.open_table(log_table(&t))?.insert(1, &b"a"[..])?;
                Ok(())
            },
            move |r| a_tx.send(r.is_ok()).unwrap(),
        );
        let (b_tx, b) = std::sync::mpsc::channel();
        log.submit(
            |_tx| -> Result<(), redb::Error> { Err(writer_error("injected")) },
            move |r| b_tx.send(r.is_ok()).unwrap(),
        );
        release.send(()).unwrap();
        assert!(!a.recv().unwrap(), "the batch's other job fails too");
        assert!(!b.recv().unwrap());
        let tx = log.db().begin_read().unwrap();
        assert!(
            tx.open_table(log_table(&g))
                .unwrap()
                .get(1)
                .unwrap()
                .is_none()
        );
        // The writer goes on.
        log.write(|_| Ok(())).unwrap();
    }

    /// A log of the old layout (its own file) is imported whole into a group's tables and its
    /// file removed; a group's tables go with it.
    #[test]
    fn an_old_log_file_is_imported_then_removed() {
        let dir = tempfile::tempdir().unwrap();
        let old = dir.path().join("old.redb");
        {
            let db = Database::create(&old).unwrap();
            let s = GroupTables::single();
            let tx = db.begin_write().unwrap();
            {
                let mut log = tx.open_table(log_table(&s)).unwrap();
                for i in 1..=100u64 {
                    log.insert(i, vec![i as u8; 300_000].as_slice()).unwrap();
                }
                tx.open_table(meta_table(&s))
                    .unwrap()
                    .insert("vote", &b"v"[..])
                    .unwrap();
                tx.open_table(bodies_table(&s))
                    .unwrap()
                    .insert(7, &b"body"[..])
                    .unwrap();
            }
            tx.commit().unwrap();
        }
        let log = NodeLog::open(&dir.path().join("node.redb"), 1 << 20).unwrap();
        let g = GroupTables::of_group(3);
        log.create(&g).unwrap();
        assert!(log.import(&old, &g).unwrap());
        assert!(!old.exists());
        assert!(!log.import(&old, &g).unwrap(), "nothing left to import");
        {
            let tx = log.db().begin_read().unwrap();
            let t = tx.open_table(log_table(&g)).unwrap();
            assert_eq!(t.len().unwrap(), 100);
            assert_eq!(t.get(100).unwrap().unwrap().value()[0], 100);
            let m = tx.open_table(meta_table(&g)).unwrap();
            assert_eq!(m.get("vote").unwrap().unwrap().value(), b"v");
            let b = tx.open_table(bodies_table(&g)).unwrap();
            assert_eq!(b.get(7).unwrap().unwrap().value(), b"body");
        }
        log.drop_group(&g).unwrap();
        let tx = log.db().begin_read().unwrap();
        assert!(tx.open_table(log_table(&g)).is_err());
    }
}
