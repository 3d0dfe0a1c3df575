//! openraft's state machine over any [`Applied`] state: the broker's queue driver (a quorum
//! queue's replica on a node) or the cluster's metadata. Tracks what openraft needs (last
//! applied id, membership, the entry time) and leaves the state itself to `A`.
//!
//! Entry times are kept monotonic (`max(at, previous)`), so a new leader with a slower clock
//! cannot move a queue's time backwards; replicas never read their own clocks.

use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use openraft::storage::RaftStateMachine;
use openraft::{
    BasicNode, EntryPayload, ErrorSubject, ErrorVerb, LogId, OptionalSend, RaftSnapshotBuilder,
    Snapshot, SnapshotMeta, StorageIOError, StoredMembership,
};
use serde::{Deserialize, Serialize};

use crate::snapshot_data::{Built, SnapshotBuf};
use crate::types::{NodeId, QueueRaft, QueueRequest, QueueResponse, StorageError};

type Entry = openraft::Entry<QueueRaft>;

/// The state a group replicates.
pub trait Applied: Send + Sync + 'static {
    /// Apply one committed entry's request at time `at` (never earlier than the previous);
    /// `index` is the entry's log index.
    fn apply(&self, at: u64, index: u64, request: QueueRequest) -> QueueResponse;
    /// The whole state, encoded.
    ///
    /// # Errors
    /// When it does not encode.
    fn snapshot(&self) -> Result<Vec<u8>, String>;
    /// The whole state, encoded as [`Applied::snapshot`] encodes it, written to `out` (a
    /// snapshot file): a large state should stream rather than be encoded in memory first.
    ///
    /// # Errors
    /// When it does not encode or `out` fails.
    fn snapshot_into(&self, out: &mut dyn std::io::Write) -> Result<(), String> {
        out.write_all(&self.snapshot()?).map_err(|e| e.to_string())
    }
    /// Replace the state by a snapshot's, which covers the log up to index `last` (0: none).
    ///
    /// # Errors
    /// When the bytes do not decode.
    fn install(&self, bytes: &[u8], last: u64) -> Result<(), String>;
    /// Replace the state by a snapshot's read from `state`, as another member sent it (with
    /// what [`Applied::expand_into`] added, which may be far larger than memory: a quorum
    /// queue's bodies). The default reads it whole and installs that.
    ///
    /// # Errors
    /// When the bytes do not read or decode.
    fn install_from(&self, state: &mut dyn Read, last: u64) -> Result<(), String> {
        let mut bytes = Vec::new();
        state.read_to_end(&mut bytes).map_err(|e| e.to_string())?;
        self.install(&bytes, last)
    }
    /// Whether [`Applied::snapshot`] leaves data out that a snapshot sent to another member
    /// must carry ([`Applied::expand_into`]): a stream's snapshot is where its log is, its
    /// files being the state; a quorum queue's holds its messages' keys, the bodies being in
    /// the log.
    fn expands(&self) -> bool {
        false
    }
    /// Write the snapshot `state` (read from the snapshot file, up to index `last`) to `out`
    /// with what a member that receives it needs (the stream's chunks, the queue's bodies).
    /// Runs on a thread of its own while entries are applied, so it reads only what stays
    /// valid: data the snapshot's state refers to.
    ///
    /// # Errors
    /// When the data cannot be read or `out` fails.
    fn expand_into(
        &self,
        state: &mut dyn Read,
        last: u64,
        out: &mut dyn Write,
    ) -> Result<(), String> {
        let _ = last;
        std::io::copy(state, out)
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Tracked {
    last_applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
    now: u64,
}

/// A snapshot as openraft sent it before snapshots were streamed (bincode of this): what
/// openraft tracks, and `A`'s state. Still read from members of that version.
#[derive(Serialize, Deserialize)]
struct SnapshotData {
    tracked: Tracked,
    state: Vec<u8>,
}

/// The current snapshot's meta and, unless it is on disk, its bytes ([`crate::log::snapshot_file`]'s
/// layout).
type CurrentSnapshot = (SnapshotMeta<NodeId, BasicNode>, Option<Vec<u8>>);

struct Inner {
    tracked: Tracked,
    /// The current snapshot: its meta, and its bytes unless they are on disk (read back when
    /// asked for: a queue's snapshot holds every message's metadata, which memory holds once
    /// already, in the state).
    snapshot: Option<CurrentSnapshot>,
    snapshots_built: u64,
    /// Snapshots read from here now go to other members ([`Applied::expand_into`] applies):
    /// openraft also reads the current one while it starts, for its metadata only.
    sending: bool,
    /// Snapshots handed out to be sent, each with its own id (a retried send after a failed
    /// one is a new transfer to the member, never resumed into a file of other bytes).
    sends: u64,
    /// The id of the current snapshot whose expanded form is complete at [`sent_path`]: sent
    /// again as it is, not built again for every attempt to reach a member.
    sent_file: Option<String>,
    /// A snapshot from another member is being installed (its bodies written), without the
    /// lock: snapshots are not built meanwhile.
    installing: bool,
    /// Expanded forms being built, by snapshot id, with the sends waiting for each: one build
    /// a snapshot however many attempts or members ask meanwhile.
    building: std::collections::BTreeMap<String, Vec<tokio::sync::oneshot::Sender<Built>>>,
}

/// Tells this process's snapshot sends from a previous run's (whose counters started over):
/// a member resuming a transfer by id never resumes into another run's bytes.
fn process_nonce() -> u64 {
    static NONCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NONCE.get_or_init(|| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        now ^ u64::from(std::process::id()).rotate_left(32)
    })
}

/// The prefix of the files an expanded form of the snapshot at `snapshot` is built in.
fn building_prefix(snapshot: &Path) -> String {
    format!(
        "{}.sending-",
        snapshot
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
    )
}

/// Remove the files of snapshots in transit of the group whose snapshot is at `snapshot`: the
/// cached expanded form and any half-built one (a crash leaves them).
pub fn remove_transit_files(snapshot: &Path) {
    let _ = std::fs::remove_file(sent_path(snapshot));
    let prefix = building_prefix(snapshot);
    if let Ok(entries) = std::fs::read_dir(dir_of(snapshot)) {
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// Where the expanded form of a group's current snapshot, kept at `snapshot`, is cached
/// while members may still need it (until the next snapshot replaces it).
#[must_use]
pub fn sent_path(snapshot: &Path) -> PathBuf {
    snapshot.with_extension("snapshot-sent")
}

/// Run `f`, which blocks (reads or writes a whole snapshot), telling a multi-threaded runtime
/// so that its other tasks move to another thread meanwhile.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// The directory a snapshot file at `path` is in.
fn dir_of(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

/// One replica's state machine. Clones share it (the snapshot builder is a clone).
pub struct GroupStateMachine<A> {
    inner: Arc<Mutex<Inner>>,
    applied: Arc<A>,
    /// Where the current snapshot is kept (None: in memory only, for tests). The state itself
    /// lives in memory: after a restart it comes back from this snapshot and the log entries
    /// after it (openraft purges the entries a snapshot covers).
    snapshot_path: Option<Arc<PathBuf>>,
}

impl<A> Clone for GroupStateMachine<A> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            applied: Arc::clone(&self.applied),
            snapshot_path: self.snapshot_path.clone(),
        }
    }
}

/// A snapshot as kept on disk (see [`crate::log::snapshot_file`]).
type StoredSnapshot = crate::log::snapshot_file::Stored<SnapshotMeta<NodeId, BasicNode>, Tracked>;

fn sm_error(verb: ErrorVerb, e: impl std::fmt::Display) -> StorageError {
    StorageIOError::new(
        ErrorSubject::StateMachine,
        verb,
        openraft::AnyError::error(e.to_string()),
    )
    .into()
}

impl<A: Applied> GroupStateMachine<A> {
    /// A state machine applying into `applied` (its state before the first entry).
    pub fn over(applied: Arc<A>) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                tracked: Tracked::default(),
                snapshot: None,
                snapshots_built: 0,
                sending: false,
                sends: 0,
                sent_file: None,
                installing: false,
                building: std::collections::BTreeMap::new(),
            })),
            applied,
            snapshot_path: None,
        }
    }

    /// A state machine that keeps its snapshots at `path`, starting from the one there (if
    /// any): its state installed into `applied`, its last applied id and membership taken.
    ///
    /// # Errors
    /// The snapshot there cannot be read or does not decode.
    pub fn restored(applied: Arc<A>, path: PathBuf) -> Result<Self, String> {
        let mut sm = Self::over(applied);
        // An expanded snapshot of the previous run is not known to be complete.
        remove_transit_files(&path);
        if let Some(stored) = crate::log::snapshot_file::read::<_, Tracked>(&path)? {
            let last = stored.tracked.last_applied.map_or(0, |l| l.index);
            sm.applied
                .install(stored.state(), last)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            let mut inner = sm.lock();
            inner.tracked = stored.tracked.clone();
            inner.snapshot = Some((stored.meta, None));
        }
        sm.snapshot_path = Some(Arc::new(path));
        Ok(sm)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Make `meta` and `tracked` with the state `state` writes the current snapshot: written
    /// durably to the snapshot file (before openraft may purge the entries it covers), or
    /// kept in memory without one. Returns what to keep in memory.
    fn store(
        &self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        tracked: &Tracked,
        state: impl FnOnce(&mut dyn Write) -> Result<(), String>,
    ) -> Result<Option<Vec<u8>>, String> {
        let Some(path) = &self.snapshot_path else {
            let mut bytes = Vec::new();
            crate::log::snapshot_file::write_to(&mut bytes, meta, tracked, state)?;
            return Ok(Some(bytes));
        };
        crate::log::snapshot_file::write(path, meta, tracked, state)?;
        // The expanded form of the one replaced is of no use now.
        let _ = std::fs::remove_file(sent_path(path));
        Ok(None)
    }

    /// The current snapshot's bytes in [`crate::log::snapshot_file`]'s layout, as they go to
    /// another member: the file itself (opened now, so a snapshot that replaces it later does
    /// not change what is read), or the bytes kept in memory.
    #[allow(clippy::result_large_err)]
    fn current_bytes(&self, kept: Option<Vec<u8>>) -> Result<SnapshotBuf, StorageError> {
        if let Some(bytes) = kept {
            return Ok(SnapshotBuf::memory(bytes));
        }
        let Some(path) = &self.snapshot_path else {
            return Err(sm_error(
                ErrorVerb::Read,
                "a snapshot neither kept nor stored",
            ));
        };
        let read =
            |e: std::io::Error| sm_error(ErrorVerb::Read, format!("{}: {e}", path.display()));
        let mut file = std::fs::File::open(path.as_path()).map_err(read)?;
        let mut first = [0u8; 8];
        let n = file.read(&mut first).map_err(read)?;
        if crate::log::snapshot_file::is_layout(&first[..n]) {
            return Ok(SnapshotBuf::file(file));
        }
        // A file of version 1, from before an upgrade: sent in the current layout.
        let stored: StoredSnapshot = crate::log::snapshot_file::read(path.as_path())
            .map_err(|e| sm_error(ErrorVerb::Read, e))?
            .ok_or_else(|| sm_error(ErrorVerb::Read, "the snapshot file is gone"))?;
        let mut bytes = Vec::new();
        crate::log::snapshot_file::write_to(&mut bytes, &stored.meta, &stored.tracked, |out| {
            out.write_all(stored.state()).map_err(|e| e.to_string())
        })
        .map_err(|e| sm_error(ErrorVerb::Read, e))?;
        Ok(SnapshotBuf::memory(bytes))
    }

    /// Install into the state a snapshot another member sent, read from `input`; returns
    /// what openraft tracks and, unless the state expands (its short form is then stored),
    /// the state's bytes.
    fn install_state(
        &self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        mut input: Box<dyn Read + Send>,
    ) -> Result<(Tracked, Option<Vec<u8>>), String> {
        let last = meta.last_log_id.map_or(0, |l| l.index);
        let mut first = Vec::with_capacity(8);
        (&mut input)
            .take(8)
            .read_to_end(&mut first)
            .map_err(|e| e.to_string())?;
        let mut input = std::io::Cursor::new(first).chain(input);
        let (tracked, state) = if crate::log::snapshot_file::is_layout(input.get_ref().0.get_ref())
        {
            let (sent_meta, tracked): (SnapshotMeta<NodeId, BasicNode>, Tracked) =
                crate::log::snapshot_file::read_head(&mut input)?;
            if sent_meta.last_log_id != meta.last_log_id {
                return Err(format!(
                    "a snapshot up to {:?} sent as one up to {:?}",
                    sent_meta.last_log_id, meta.last_log_id
                ));
            }
            if self.applied.expands() {
                // Streamed into the state; what is stored is the state's own short form.
                self.applied.install_from(&mut input, last)?;
                (tracked, None)
            } else {
                let mut state = Vec::new();
                input.read_to_end(&mut state).map_err(|e| e.to_string())?;
                self.applied.install(&state, last)?;
                (tracked, Some(state))
            }
        } else {
            let mut bytes = Vec::new();
            input.read_to_end(&mut bytes).map_err(|e| e.to_string())?;
            let data: SnapshotData = crate::codec::decode(&bytes).map_err(|e| e.to_string())?;
            drop(bytes);
            self.applied.install(&data.state, last)?;
            (
                data.tracked,
                (!self.applied.expands()).then_some(data.state),
            )
        };
        Ok((tracked, state))
    }

    /// Store an installed snapshot (`state`: its bytes, or None to store the state's short
    /// form); returns what to keep in memory.
    fn store_installed(
        &self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        tracked: &Tracked,
        state: Option<Vec<u8>>,
    ) -> Result<Option<Vec<u8>>, String> {
        match state {
            Some(state) => self.store(meta, tracked, |out| {
                out.write_all(&state).map_err(|e| e.to_string())
            }),
            None => self.store(meta, tracked, |out| self.applied.snapshot_into(out)),
        }
    }

    /// The lock, unless a snapshot is being installed.
    fn lock_unless_installing(&self) -> Option<MutexGuard<'_, Inner>> {
        let inner = self.lock();
        (!inner.installing).then_some(inner)
    }

    /// The group's Raft instance has started: a current snapshot read from now on is one to
    /// send, and [`Applied::expand_into`] applies to it.
    pub fn started(&self) {
        self.lock().sending = true;
    }

    /// The state entries are applied into.
    #[must_use]
    pub fn applied(&self) -> &A {
        &self.applied
    }

    /// The last applied log id.
    #[must_use]
    pub fn last_applied(&self) -> Option<LogId<NodeId>> {
        self.lock().tracked.last_applied
    }

    /// `f` of the state with the id of the last entry applied into it, read under the apply
    /// lock (no entry lands between the two).
    pub fn read_applied<T>(&self, f: impl FnOnce(&A) -> T) -> (Option<LogId<NodeId>>, T) {
        let inner = self.lock();
        (inner.tracked.last_applied, f(&self.applied))
    }
}

impl<A: Applied> RaftSnapshotBuilder<QueueRaft> for GroupStateMachine<A> {
    async fn build_snapshot(&mut self) -> Result<Snapshot<QueueRaft>, StorageError> {
        // Under the lock, so no entry is applied between the state and its last id; not while
        // a snapshot from another member is being installed (the state may be replaced
        // before its applied id is).
        let mut inner = loop {
            if let Some(inner) = self.lock_unless_installing() {
                break inner;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        };
        inner.snapshots_built += 1;
        let last = inner.tracked.last_applied;
        let meta = SnapshotMeta {
            last_log_id: last,
            last_membership: inner.tracked.membership.clone(),
            snapshot_id: format!(
                "{}-{}-{}",
                last.map_or(0, |l| l.leader_id.term),
                last.map_or(0, |l| l.index),
                inner.snapshots_built
            ),
        };
        // Streamed to the file as it is encoded. openraft takes only the meta of a built
        // snapshot (its state machine worker), and reads a snapshot to send through
        // `get_current_snapshot`: the one returned here carries no bytes when it is on disk.
        let kept =
            blocking(|| self.store(&meta, &inner.tracked, |out| self.applied.snapshot_into(out)))
                .map_err(|e| sm_error(ErrorVerb::Write, e))?;
        inner.snapshot = Some((meta.clone(), kept.clone()));
        inner.sent_file = None;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(SnapshotBuf::memory(kept.unwrap_or_default())),
        })
    }
}

impl<A: Applied> GroupStateMachine<A> {
    /// The cached expanded form of the current snapshot `meta`, opened at its start, if it is
    /// complete and its head is that snapshot's.
    fn cached_expanded(
        &self,
        inner: &Inner,
        meta: &SnapshotMeta<NodeId, BasicNode>,
    ) -> Option<std::fs::File> {
        let path = sent_path(self.snapshot_path.as_deref()?);
        if inner.sent_file.as_deref() != Some(meta.snapshot_id.as_str()) {
            return None;
        }
        let mut file = std::fs::File::open(path).ok()?;
        let (head, _): (SnapshotMeta<NodeId, BasicNode>, Tracked) =
            crate::log::snapshot_file::read_head(&mut std::io::BufReader::new(&mut file)).ok()?;
        if head.snapshot_id != meta.snapshot_id {
            return None;
        }
        file.seek(std::io::SeekFrom::Start(0)).ok()?;
        Some(file)
    }

    /// Start building the expanded form of the current snapshot `meta` (read from `stored`) on
    /// a thread of its own; `inner` is this machine's, locked. The sends waiting for it get
    /// it when it is done ([`finish_expanded`]). Returns `stored` back if no thread starts.
    fn spawn_expanded(
        &self,
        inner: &mut Inner,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        stored: SnapshotBuf,
    ) -> Result<(), SnapshotBuf> {
        let applied = Arc::clone(&self.applied);
        let shared = Arc::clone(&self.inner);
        let path = self.snapshot_path.clone();
        let id = meta.snapshot_id.clone();
        let (tx, rx) = std::sync::mpsc::channel::<SnapshotBuf>();
        let spawned = std::thread::Builder::new()
            .name("snapshot-send".into())
            .spawn(move || {
                let Ok(stored) = rx.recv() else {
                    return;
                };
                let mut input = stored.into_blocking_reader();
                let built = match &mut input {
                    Ok(input) => {
                        build_expanded(&*applied, path.as_deref().map(PathBuf::as_path), input)
                    }
                    Err(e) => Err(e.to_string()),
                };
                finish_expanded(
                    &shared,
                    path.as_deref().map(PathBuf::as_path),
                    &id,
                    built,
                    input.ok(),
                );
            });
        match spawned {
            Ok(_) => {
                let _ = tx.send(stored);
                inner.building.insert(meta.snapshot_id.clone(), Vec::new());
                Ok(())
            }
            Err(e) => {
                tracing::error!(error = %e, "no thread to build a snapshot to send: its short form goes");
                Err(stored)
            }
        }
    }
}

/// The expanded form of the snapshot `input` holds (in the snapshot file's layout), written to
/// a new file next to the snapshot (or in the temporary directory without one).
fn build_expanded<A: Applied>(
    applied: &A,
    snapshot: Option<&Path>,
    input: &mut Box<dyn crate::snapshot_data::ReadSeek>,
) -> Result<tempfile::NamedTempFile, String> {
    let (meta, tracked): (SnapshotMeta<NodeId, BasicNode>, Tracked) =
        crate::log::snapshot_file::read_head(input)?;
    let last = meta.last_log_id.map_or(0, |l| l.index);
    let mut builder = tempfile::Builder::new();
    let prefix = snapshot.map(building_prefix).unwrap_or_default();
    builder.prefix(&prefix);
    let file = match snapshot {
        Some(p) => builder.tempfile_in(dir_of(p)),
        None => builder.tempfile(),
    }
    .map_err(|e| e.to_string())?;
    let mut out = std::io::BufWriter::with_capacity(crate::log::snapshot_file::WRITE_BUFFER, file);
    crate::log::snapshot_file::write_to(&mut out, &meta, &tracked, |out| {
        applied.expand_into(input, last, out)
    })?;
    out.into_inner().map_err(|e| e.error().to_string())
}

/// Hand the expanded form `built` of snapshot `id` to the sends waiting for it (each its own
/// file descriptor, read from its own offset), and cache it while `id` is still the current
/// snapshot. If it failed, each gets the short form read back from `stored` instead: a member
/// given it starts its copy again at the snapshot's end, where an error would stop the group.
fn finish_expanded(
    inner: &Mutex<Inner>,
    snapshot: Option<&Path>,
    id: &str,
    built: Result<tempfile::NamedTempFile, String>,
    mut stored: Option<Box<dyn crate::snapshot_data::ReadSeek>>,
) {
    let mut inner = inner.lock().unwrap_or_else(PoisonError::into_inner);
    let waiters = inner.building.remove(id).unwrap_or_default();
    let current = inner.snapshot.as_ref().map(|(m, _)| m.snapshot_id.as_str()) == Some(id);
    // Where each waiter opens the built bytes: the cache, or the temporary file's name.
    let (at, _temporary) = match (built, snapshot) {
        (Ok(file), Some(snapshot)) if current => match file.persist(sent_path(snapshot)) {
            Ok(_) => {
                inner.sent_file = Some(id.to_string());
                (Ok(sent_path(snapshot)), None)
            }
            Err(e) => (Ok(e.file.path().to_path_buf()), Some(e.file)),
        },
        (Ok(file), _) => (Ok(file.path().to_path_buf()), Some(file)),
        (Err(e), _) => (Err(e), None),
    };
    let mut short: Option<Result<Vec<u8>, String>> = None;
    for waiter in waiters {
        let opened = at
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|p| std::fs::File::open(p).map_err(|e| e.to_string()));
        let buf = match opened {
            Ok(file) => Ok(SnapshotBuf::file(file)),
            Err(e) => {
                let bytes = short.get_or_insert_with(|| {
                    tracing::error!(error = %e, "a snapshot is sent without its data");
                    let mut bytes = Vec::new();
                    match stored.as_mut() {
                        Some(input) => input
                            .seek(std::io::SeekFrom::Start(0))
                            .and_then(|_| input.read_to_end(&mut bytes))
                            .map(|_| bytes)
                            .map_err(|e| e.to_string()),
                        None => Err("the snapshot file is unreadable".into()),
                    }
                });
                bytes
                    .clone()
                    .map(SnapshotBuf::memory)
                    .map_err(|short| format!("{e}, and its short form: {short}"))
            }
        };
        let _ = waiter.send(buf);
    }
}
impl<A: Applied> RaftStateMachine<QueueRaft> for GroupStateMachine<A> {
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>), StorageError> {
        let inner = self.lock();
        Ok((inner.tracked.last_applied, inner.tracked.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<QueueResponse>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut inner = self.lock();
        let mut out = Vec::new();
        for entry in entries {
            inner.tracked.last_applied = Some(entry.log_id);
            let response = match entry.payload {
                EntryPayload::Blank => QueueResponse::default(),
                EntryPayload::Normal(req) => {
                    inner.tracked.now = inner.tracked.now.max(req.at);
                    self.applied
                        .apply(inner.tracked.now, entry.log_id.index, req)
                }
                EntryPayload::Membership(m) => {
                    inner.tracked.membership = StoredMembership::new(Some(entry.log_id), m);
                    QueueResponse::default()
                }
            };
            out.push(response);
        }
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<SnapshotBuf>, StorageError> {
        let dir = self.snapshot_path.as_deref().map(|p| dir_of(p));
        Ok(Box::new(SnapshotBuf::receiving(dir)))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<SnapshotBuf>,
    ) -> Result<(), StorageError> {
        let input = snapshot
            .into_reader()
            .await
            .map_err(|e| sm_error(ErrorVerb::Read, e))?;
        let write = |e: String| sm_error(ErrorVerb::Write, e);
        let (mut inner, tracked, state) = if self.applied.expands() {
            // A backlog's bodies go into the log first, which takes long: not under the lock,
            // which readers on the async workers take (a queue's figures for the management
            // API, its log's compaction), or they would stall the node's runtime and with it
            // its Raft heartbeats. The state itself is swapped at the end of the install, so
            // a reader may see the new state with the old applied id for that moment only; a
            // snapshot build waits (`installing`; taking the lock waits for one under way).
            self.lock().installing = true;
            let installed = blocking(|| self.install_state(meta, input));
            let mut inner = self.lock();
            inner.installing = false;
            let (tracked, state) = installed.map_err(write)?;
            (inner, tracked, state)
        } else {
            // Small: under the lock, so no reader sees the new state with the old applied id.
            let inner = self.lock();
            let (tracked, state) = blocking(|| self.install_state(meta, input)).map_err(write)?;
            (inner, tracked, state)
        };
        // Stored under the lock: a snapshot being built writes the same file.
        let kept = blocking(|| self.store_installed(meta, &tracked, state)).map_err(write)?;
        inner.tracked = tracked;
        inner.snapshot = Some((meta.clone(), kept));
        inner.sent_file = None;
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<QueueRaft>>, StorageError> {
        let (meta, data) = {
            let mut inner = self.lock();
            let Some((mut meta, kept)) = inner.snapshot.clone() else {
                return Ok(None);
            };
            // Opened under the lock: the bytes are those of `meta`.
            let stored = self.current_bytes(kept)?;
            if !(self.applied.expands() && inner.sending) {
                return Ok(Some(Snapshot {
                    meta,
                    snapshot: Box::new(stored),
                }));
            }
            inner.sends += 1;
            let sent_id = format!(
                "{}-sent-{:x}-{}",
                meta.snapshot_id,
                process_nonce(),
                inner.sends
            );
            let data = match self.cached_expanded(&inner, &meta) {
                Some(file) => SnapshotBuf::file(file),
                None => {
                    let (tx, rx) = tokio::sync::oneshot::channel::<Built>();
                    let waiting = if inner.building.contains_key(&meta.snapshot_id) {
                        Ok(())
                    } else {
                        self.spawn_expanded(&mut inner, &meta, stored)
                    };
                    match waiting {
                        Ok(()) => {
                            if let Some(waiters) = inner.building.get_mut(&meta.snapshot_id) {
                                waiters.push(tx);
                            }
                            SnapshotBuf::building(rx)
                        }
                        Err(stored) => stored,
                    }
                }
            };
            meta.snapshot_id = sent_id;
            (meta, data)
        };
        Ok(Some(Snapshot {
            meta,
            snapshot: Box::new(data),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, Entry};

    /// A state that counts the entries applied into it and the times they carried.
    #[derive(Default)]
    struct Counted(Mutex<Vec<u64>>);

    impl Applied for Counted {
        fn apply(&self, at: u64, _index: u64, _request: QueueRequest) -> QueueResponse {
            self.0.lock().unwrap().push(at);
            QueueResponse::default()
        }
        fn snapshot(&self) -> Result<Vec<u8>, String> {
            crate::codec::encode(&*self.0.lock().unwrap()).map_err(|e| e.to_string())
        }
        fn install(&self, bytes: &[u8], _last: u64) -> Result<(), String> {
            *self.0.lock().unwrap() = crate::codec::decode(bytes).map_err(|e| e.to_string())?;
            Ok(())
        }
    }

    fn entry(index: u64) -> Entry<QueueRaft> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(QueueRequest {
                at: 1000 + index,
                commands: Vec::new(),
                meta: Vec::new(),
            }),
        }
    }

    /// A state whose snapshot sent to another member carries data its stored one leaves out
    /// (as a quorum queue's carries the bodies): `EXTRA` bytes after the state.
    #[derive(Default)]
    struct Expanding {
        counted: Counted,
        /// Expanding fails (the short form must go instead).
        broken: std::sync::atomic::AtomicBool,
        /// What the last install read after the state.
        received_extra: Mutex<usize>,
        /// How many times the data was written for a send.
        expansions: std::sync::atomic::AtomicUsize,
    }

    const EXTRA: usize = 3 * 1024 * 1024 + 17;

    impl Applied for Expanding {
        fn apply(&self, at: u64, index: u64, request: QueueRequest) -> QueueResponse {
            self.counted.apply(at, index, request)
        }
        fn snapshot(&self) -> Result<Vec<u8>, String> {
            self.counted.snapshot()
        }
        fn install(&self, bytes: &[u8], last: u64) -> Result<(), String> {
            *self.received_extra.lock().unwrap() = 0;
            self.counted.install(bytes, last)
        }
        fn install_from(&self, input: &mut dyn Read, last: u64) -> Result<(), String> {
            // As a quorum queue's: the expanded form by its first bytes, else the short one.
            let mut all = Vec::new();
            input.read_to_end(&mut all).map_err(|e| e.to_string())?;
            let Some(mut input) = all.strip_prefix(b"EXPANDED") else {
                return self.install(&all, last);
            };
            let input = &mut input;
            let mut len = [0u8; 8];
            input.read_exact(&mut len).map_err(|e| e.to_string())?;
            let mut state = vec![0u8; u64::from_le_bytes(len) as usize];
            input.read_exact(&mut state).map_err(|e| e.to_string())?;
            let mut extra = Vec::new();
            input.read_to_end(&mut extra).map_err(|e| e.to_string())?;
            assert!(extra.iter().all(|b| *b == 7), "the data as sent");
            self.counted.install(&state, last)?;
            *self.received_extra.lock().unwrap() = extra.len();
            Ok(())
        }
        fn expands(&self) -> bool {
            true
        }
        fn expand_into(
            &self,
            input: &mut dyn Read,
            _last: u64,
            out: &mut dyn Write,
        ) -> Result<(), String> {
            if self.broken.load(std::sync::atomic::Ordering::Relaxed) {
                return Err("the data is unreadable".into());
            }
            self.expansions
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut state = Vec::new();
            input.read_to_end(&mut state).map_err(|e| e.to_string())?;
            let state = &state[..];
            let io = |e: std::io::Error| e.to_string();
            out.write_all(b"EXPANDED").map_err(io)?;
            out.write_all(&(state.len() as u64).to_le_bytes())
                .map_err(io)?;
            out.write_all(state).map_err(io)?;
            out.write_all(&vec![7u8; EXTRA]).map_err(io)
        }
    }

    async fn bytes_of(snapshot: Snapshot<QueueRaft>) -> Vec<u8> {
        let mut bytes = Vec::new();
        snapshot
            .snapshot
            .into_reader()
            .await
            .unwrap()
            .read_to_end(&mut bytes)
            .unwrap();
        bytes
    }

    /// Received as openraft receives it: chunks written into what `begin_receiving_snapshot`
    /// gave, then installed.
    async fn receive(
        to: &mut GroupStateMachine<Expanding>,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        bytes: &[u8],
    ) {
        use tokio::io::AsyncWriteExt;
        let mut buf = to.begin_receiving_snapshot().await.unwrap();
        for chunk in bytes.chunks(1024 * 1024) {
            buf.write_all(chunk).await.unwrap();
        }
        buf.shutdown().await.unwrap();
        to.install_snapshot(meta, buf).await.unwrap();
    }

    /// A snapshot for a member behind the purged log is written to a file with its data on a
    /// thread of its own, sent from there (again from the cached file for the next attempt,
    /// each attempt with its own id), received into an unnamed file, and kept by the member
    /// in its short form; a newer snapshot drops the cached one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_snapshot_is_sent_with_its_data_through_files() {
        let dir = tempfile::tempdir().unwrap();
        let sent_file = sent_path(&dir.path().join("a.snapshot"));
        let mut a = GroupStateMachine::restored(
            Arc::new(Expanding::default()),
            dir.path().join("a.snapshot"),
        )
        .unwrap();
        a.apply((1..=5).map(entry)).await.unwrap();
        let built = a.build_snapshot().await.unwrap();
        // Before the Raft instance starts, openraft reads only the short form.
        let short = a.get_current_snapshot().await.unwrap().unwrap();
        assert_eq!(short.meta, built.meta);
        let short = bytes_of(short).await;
        assert!(crate::log::snapshot_file::is_layout(&short));

        a.started();
        // Two members (or attempts) asking while it is built share one build.
        let first = a.get_current_snapshot().await.unwrap().unwrap();
        let second = a.get_current_snapshot().await.unwrap().unwrap();
        assert_eq!(first.meta.last_log_id, built.meta.last_log_id);
        let sent = format!("{}-sent-", built.meta.snapshot_id);
        assert!(
            first.meta.snapshot_id.starts_with(&sent),
            "{}",
            first.meta.snapshot_id
        );
        assert_ne!(
            first.meta.snapshot_id, second.meta.snapshot_id,
            "each send its own id"
        );
        let meta = first.meta.clone();
        let full = bytes_of(first).await;
        assert!(full.len() > EXTRA, "{} bytes sent", full.len());
        assert_eq!(bytes_of(second).await, full);
        assert!(sent_file.exists(), "the expanded form is cached");
        let again = a.get_current_snapshot().await.unwrap().unwrap();
        assert_eq!(bytes_of(again).await, full, "sent again from the cache");
        let builds = a
            .applied()
            .expansions
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(builds, 1, "one build for three sends");

        let mut b = GroupStateMachine::restored(
            Arc::new(Expanding::default()),
            dir.path().join("b.snapshot"),
        )
        .unwrap();
        receive(&mut b, &meta, &full).await;
        assert_eq!(*b.applied().received_extra.lock().unwrap(), EXTRA);
        assert_eq!(b.last_applied().map(|l| l.index), Some(5));
        let stored = std::fs::metadata(dir.path().join("b.snapshot"))
            .unwrap()
            .len();
        assert!(
            stored < 1024,
            "the member keeps the short form: {stored} bytes"
        );
        // After a restart the member has the state from its own file.
        let c = GroupStateMachine::restored(
            Arc::new(Expanding::default()),
            dir.path().join("b.snapshot"),
        )
        .unwrap();
        assert_eq!(
            *c.applied().counted.0.lock().unwrap(),
            vec![1001, 1002, 1003, 1004, 1005]
        );
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["a.snapshot", "a.snapshot-sent", "b.snapshot"],
            "no file in transit left"
        );

        // Bytes of one snapshot offered under another's meta are refused, not installed.
        {
            use tokio::io::AsyncWriteExt;
            let mut wrong = meta.clone();
            wrong.last_log_id = Some(LogId::new(CommittedLeaderId::new(1, 1), 4));
            let mut e = GroupStateMachine::restored(
                Arc::new(Expanding::default()),
                dir.path().join("e.snapshot"),
            )
            .unwrap();
            let mut buf = e.begin_receiving_snapshot().await.unwrap();
            buf.write_all(&full).await.unwrap();
            buf.shutdown().await.unwrap();
            assert!(e.install_snapshot(&wrong, buf).await.is_err());
            assert_eq!(e.last_applied(), None);
            assert!(e.applied().counted.0.lock().unwrap().is_empty());
        }

        a.apply([entry(6)]).await.unwrap();
        a.build_snapshot().await.unwrap();
        assert!(!sent_file.exists(), "a newer snapshot drops the cached one");

        // Data that cannot be read: the short form goes, and installs.
        a.applied()
            .broken
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let fallback = a.get_current_snapshot().await.unwrap().unwrap();
        let meta = fallback.meta.clone();
        let short = bytes_of(fallback).await;
        assert!(short.len() < 1024, "{} bytes", short.len());
        assert!(!sent_file.exists(), "a short form is not cached");
        let mut d = GroupStateMachine::restored(
            Arc::new(Expanding::default()),
            dir.path().join("d.snapshot"),
        )
        .unwrap();
        receive(&mut d, &meta, &short).await;
        assert_eq!(d.last_applied().map(|l| l.index), Some(6));
        assert_eq!(
            *d.applied().counted.0.lock().unwrap(),
            (1001..=1006).collect::<Vec<_>>()
        );
    }

    /// openraft purges the entries a snapshot covers: a replica that restarts must find the
    /// snapshot on disk (its state, last applied id and membership), or it cannot start.
    #[tokio::test]
    async fn a_snapshot_survives_a_restart_and_restores_the_state() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("q.snapshot");
        let mut sm = GroupStateMachine::restored(Arc::new(Counted::default()), path.clone())
            .expect("no snapshot yet is fine");
        assert_eq!(sm.last_applied(), None);
        sm.apply((1..=5).map(entry)).await.unwrap();
        let built = sm.build_snapshot().await.unwrap();
        // Applied after the snapshot: not in it, replayed from the log after a restart.
        sm.apply([entry(6)]).await.unwrap();

        let mut again = GroupStateMachine::restored(Arc::new(Counted::default()), path.clone())
            .expect("the snapshot reads back");
        assert_eq!(again.last_applied().map(|l| l.index), Some(5));
        assert_eq!(
            *again.applied().0.lock().unwrap(),
            vec![1001, 1002, 1003, 1004, 1005]
        );
        let current = again.get_current_snapshot().await.unwrap().expect("kept");
        assert_eq!(current.meta, built.meta);
        // Entry times stay monotonic across the restart.
        again.apply([entry(6)]).await.unwrap();
        assert_eq!(again.applied().0.lock().unwrap().last(), Some(&1006));

        // A damaged file is an error, not an empty queue.
        std::fs::write(&path, b"not a snapshot").unwrap();
        assert!(GroupStateMachine::restored(Arc::new(Counted::default()), path).is_err());
    }
}
