//! A replicated stream's member: applying committed entries to its files, and the snapshots
//! that bring a new or lagging member to the same chunks.

use super::*;

impl StreamQueue {
    /// Open (or create) this node's replica of a cluster's stream in `dir`: no writer of its
    /// own, its group's committed entries append ([`StreamQueue::apply_replicated`]); a
    /// ticker thread applies age retention and saves tracked offsets once a [`TICK`] until
    /// the stream is deleted.
    ///
    /// # Errors
    /// The directory's files do not recover, or the ticker cannot start.
    ///
    /// [`TICK`]: crate::stream::writer::TICK
    pub fn open_replica(
        owner: &Arc<Queue>,
        dir: &Path,
        config: StreamConfig,
        table_depth_max: usize,
    ) -> Result<Arc<Self>, StoreError> {
        let disk = StreamDisk::open(dir, config, crate::timers::wall_ms())?;
        let stream = Self::over(owner, dir, SharedStream::new(disk), None, table_depth_max);
        let weak = Arc::downgrade(&stream);
        std::thread::Builder::new()
            .name("stream-ticker".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(crate::stream::writer::TICK);
                    let Some(s) = weak.upgrade() else { return };
                    if s.is_deleted() {
                        return;
                    }
                    crate::stream::writer::tick(&s.shared, crate::timers::wall_ms());
                    s.propose_due();
                }
            })
            .map_err(|e| StoreError::Io {
                context: "starting a stream ticker",
                path: dir.to_path_buf(),
                source: e,
            })?;
        Ok(stream)
    }

    pub(super) fn over(
        owner: &Arc<Queue>,
        dir: &Path,
        shared: Arc<SharedStream>,
        writer: Option<StreamWriter>,
        table_depth_max: usize,
    ) -> Arc<Self> {
        let replica = writer.is_none().then(|| Mutex::new(0));
        let stream = Arc::new(Self {
            owner: Arc::downgrade(owner),
            what: crate::args::rs("queue", &owner.name, &owner.vhost),
            dir: dir.to_path_buf(),
            writer: Mutex::new(writer),
            shared,
            readers: Mutex::new(HashMap::new()),
            cache: Mutex::new(VecDeque::new()),
            table_depth_max,
            published: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
            deleted: AtomicBool::new(false),
            pending: AtomicU64::new(0),
            pending_bytes: AtomicU64::new(0),
            departed: Mutex::new(HashMap::new()),
            replica,
            proposals: Mutex::new(HashMap::new()),
            failed: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&stream);
        stream.shared.set_on_durable(Box::new(move || {
            if let Some(s) = weak.upgrade() {
                s.wake_parked();
            }
        }));
        stream
    }

    /// Apply what a replica's group committed, at the entry's time `at`: its messages
    /// (`Enqueue`s) become one chunk stamped `at`, so every member holds the same offsets and
    /// chunks. Other commands mean nothing to a stream. Replayed entries the files already
    /// hold are skipped.
    pub fn apply_replicated(
        &self,
        at: u64,
        commands: Vec<crate::queue::machine::Command<crate::message::Entry>>,
    ) -> crate::queue::replica::Replies {
        use crate::queue::machine::{Command, Reply};
        let mut messages = Vec::new();
        let mut replies = Vec::with_capacity(commands.len());
        let mut tracked = Vec::new();
        for c in commands {
            match c {
                Command::Enqueue(crate::message::Entry::Mem(m)) => {
                    messages.push(StreamMessage {
                        filter_value: filter_value(&m.properties),
                        body: encode(&m),
                    });
                }
                Command::TrackOffset { name, next } => tracked.push((name, next)),
                _ => {}
            }
            replies.push(Ok(Reply::Ok));
        }
        let Some(replay) = &self.replica else {
            return replies;
        };
        if !tracked.is_empty() {
            let mut disk = self.shared.disk.lock();
            for (name, next) in &tracked {
                // A name the log cannot track is refused alike on every member.
                let _ = disk.store_offset(name, *next);
            }
            drop(disk);
            self.shared.offsets_changed();
        }
        if messages.is_empty() || self.is_deleted() || self.failed.load(Ordering::Acquire) {
            return replies;
        }
        let k = messages.len() as u64;
        let mut expected = replay.lock();
        let appended = {
            let mut disk = self.shared.disk.lock();
            let held = disk.log().next_offset();
            if *expected + k <= held {
                // Applied before a restart: the files hold it.
                *expected += k;
                return replies;
            }
            if *expected != held {
                tracing::error!(stream = %self.what, expected = *expected, held, "a stream replica's files do not match its log; appending where they end");
            }
            self.published.fetch_add(k, Ordering::Relaxed);
            disk.append(at, &messages)
        };
        match appended {
            Ok(range) => {
                *expected = range.end;
                drop(expected);
                self.shared.advance(range.end);
            }
            Err(e) => {
                // The files' tail is unknown now: this member stops applying until it is
                // restarted (its log replays into files reopened from disk). The entry is
                // committed in the group: the other members hold it.
                tracing::error!(stream = %self.what, error = %e, "a stream replica cannot append; it stops applying until restarted");
                self.failed.store(true, Ordering::Release);
            }
        }
        replies
    }

    /// A replica's snapshot: its files synced, where its log is, the tracked offsets.
    ///
    /// # Errors
    /// The files could not be synced (the snapshot must not let Raft purge what they lack).
    pub fn snapshot(&self) -> Result<StreamSnapshot, StoreError> {
        let expected = self.replica.as_ref().map_or(0, |r| *r.lock());
        let disk = self.shared.disk.lock();
        disk.sync()?;
        Ok(StreamSnapshot {
            next: expected,
            offsets: disk
                .log()
                .stored_offsets()
                .map(|(n, o)| (n.to_string(), o))
                .collect(),
            chunks: None,
        })
    }

    /// `snapshot` with the chunks it covers, read from the files (to send to a member behind
    /// the purged log).
    ///
    /// # Errors
    /// A chunk could not be read.
    pub fn expand(&self, mut snapshot: StreamSnapshot) -> Result<StreamSnapshot, StoreError> {
        let disk = self.shared.disk.lock();
        let firsts: Vec<(u64, u64)> = disk
            .log()
            .chunks()
            .filter(|(_, c)| c.first < snapshot.next)
            .map(|(_, c)| (c.first, c.timestamp_ms))
            .collect();
        let mut chunks = Vec::with_capacity(firsts.len());
        for (first, timestamp_ms) in firsts {
            let Some((_, messages)) = disk.read_chunk(first)? else {
                return Err(StoreError::Replication(format!(
                    "chunk {first} of a stream snapshot is gone"
                )));
            };
            chunks.push(SnapshotChunk {
                first,
                timestamp_ms,
                filters: messages.iter().map(|m| m.filter_value.clone()).collect(),
                records: messages
                    .into_iter()
                    .map(|m| SnapshotRecord(m.body.to_vec()))
                    .collect(),
            });
        }
        snapshot.chunks = Some(chunks);
        Ok(snapshot)
    }

    /// Take a snapshot's state: where the log is and the tracked offsets, and, from a sent
    /// snapshot, the chunks the files lack (the files are reset first if they end before the
    /// snapshot's first chunk).
    ///
    /// # Errors
    /// The files could not be written.
    pub fn install(&self, snapshot: StreamSnapshot) -> Result<(), StoreError> {
        let Some(replay) = &self.replica else {
            return Ok(());
        };
        let mut expected = replay.lock();
        let mut disk = self.shared.disk.lock();
        if let Some(chunks) = snapshot.chunks {
            let mut held = disk.log().next_offset();
            tracing::info!(stream = %self.what, held, next = snapshot.next, chunks = chunks.len(), "a stream replica catches up from a snapshot");
            for c in chunks {
                let count = c.records.len() as u64;
                if c.filters.len() != c.records.len() {
                    return Err(StoreError::Replication(
                        "a stream snapshot's chunk does not add up".into(),
                    ));
                }
                if count == 0 || c.first.checked_add(count).is_none_or(|end| end <= held) {
                    continue;
                }
                if c.first != held {
                    // Not a continuation of these files (they end before it, or elsewhere):
                    // start again where the sender's files start.
                    tracing::warn!(stream = %self.what, held, first = c.first, "a stream replica resets its files to a snapshot");
                    disk.reset(c.first)?;
                }
                let messages: Vec<StreamMessage> = c
                    .records
                    .into_iter()
                    .zip(c.filters)
                    .map(|(r, filter_value)| StreamMessage {
                        filter_value,
                        body: Bytes::from(r.0),
                    })
                    .collect();
                held = disk.append(c.timestamp_ms, &messages)?.end;
            }
            disk.sync()?;
        }
        if disk.log().next_offset() < snapshot.next {
            // What the snapshot covers is not here (the sender's retention dropped it, or it
            // came without its data): start again where it ends, so the offsets of what
            // follows agree with every other member's.
            tracing::warn!(stream = %self.what, held = disk.log().next_offset(), next = snapshot.next, "a stream replica resets its files to a snapshot's end");
            disk.reset(snapshot.next)?;
        }
        let held = disk.log().next_offset();
        for (name, next) in &snapshot.offsets {
            let _ = disk.store_offset(name, *next);
        }
        drop(disk);
        *expected = snapshot.next;
        drop(expected);
        self.cache.lock().clear();
        self.shared.advance(held);
        Ok(())
    }

    /// Remove the stream's directory (a deleted replica's ticker).
    pub(super) fn remove_files(&self) {
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            tracing::warn!(stream = %self.what, error = %e, "a deleted stream's files were not removed");
        }
    }
}
