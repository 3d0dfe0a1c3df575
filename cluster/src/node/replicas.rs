//! A quorum queue's replica on this node ([`QueueReplica`], the broker's `Replicator`):
//! starting it (its log, its Raft instance, its queue in the vhost), the state it applies
//! committed entries into ([`QueueApplied`]: the broker's queue), and its placement and state
//! as the broker reports them.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};

use openraft::{BasicNode, Raft};
use warren_broker::durable::QueueRecord;
use warren_broker::message::{BodySource, Entry, Message, NO_TTL};
use warren_broker::node::replication::{
    Placement, ReplicaDone, ReplicaState, ReplicationError, Replicator, Replies, TransferError,
    decode_entry, encode_entry,
};
use warren_broker::queue::Queue;
use warren_broker::queue::machine::{Command, MachineError, QueueMachine, Reply};

use crate::group::{Applied, GroupStateMachine};
use crate::log::store::{LogStore, SLOTS_PER_ENTRY, body_key, key_index, stub_size};
use crate::proposer::{ProposeError, Proposer};
use crate::transport::tcp;
use crate::transport::tcp::{Forwarded, GroupId, TcpNetwork};
use crate::types::{NodeId, QueueRaft, QueueRequest, QueueResponse, ReplicatedMessage};

use super::config::{NodeError, QUEUE_LOG_KEEP, QUEUE_LOG_PIN_MAX};
use super::forwarding::{Forwarder, RETRY_FOR, Target, send_retrying};
use super::{ClusterNode, DOWN_AFTER};

/// How long a snapshot asked for by WAL pressure may take to be built.
const SNAPSHOT_BUILD_MAX: std::time::Duration = std::time::Duration::from_secs(30);

impl ClusterNode {
    /// Where this node keeps its copy of a replicated stream's files.
    fn stream_dir(&self, incarnation: u64) -> PathBuf {
        self.config
            .data_dir
            .join("streams")
            .join(format!("{incarnation:016x}"))
    }

    /// Where a queue's current snapshot is.
    pub(super) fn queue_snapshot_path(&self, incarnation: u64) -> PathBuf {
        self.queue_log_path(incarnation).with_extension("snapshot")
    }

    /// A replicated stream's log; a quorum queue's before the node-wide log (imported then).
    pub(super) fn queue_log_path(&self, incarnation: u64) -> PathBuf {
        self.config
            .data_dir
            .join("queues")
            .join(format!("{incarnation:016x}.redb"))
    }

    /// Start this node's replica of a queue group and insert its queue in the vhost.
    pub(super) async fn serve_queue(
        self: &Arc<Self>,
        key: &[u8],
        value: &[u8],
        incarnation: u64,
        members: &[NodeId],
    ) -> Result<(), NodeError> {
        if self
            .queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(&incarnation)
        {
            return Ok(());
        }
        let record =
            QueueRecord::decode(key, value).map_err(|e| NodeError::Config(e.to_string()))?;
        let Some(vhost) = self.broker.vhost(&record.vhost) else {
            return Err(NodeError::Config(format!("no vhost {}", record.vhost)));
        };
        // A node that is not a member holds a learner: it applies the log (so it delivers
        // to its own consumers and routes to the queue) but does not vote or count towards
        // the majority. The leader adds it ([`add_learners`]).
        let queue = vhost.replicated_queue(self.broker.next_id(), &record.name, record.arguments);
        if queue.is_stream {
            // Its files are this node's copy, appended as entries apply (before the log
            // replays into it below).
            queue
                .open_stream_replica(&self.stream_dir(incarnation))
                .map_err(|e| NodeError::Io(e.to_string()))?;
        }
        let group = GroupId {
            name: format!("{}/{}", record.vhost, record.name),
            incarnation,
        };
        let path = self.queue_log_path(incarnation);
        // A quorum queue's bodies stay in its log ([`LogBodies`]), in the node-wide log (a
        // file of its own before: imported once); a stream's chunks are in its files, its
        // log beside the queues' on the WAL (a file of its own on redb).
        let log = if queue.is_stream {
            self.queue_logs.stream(incarnation, &path, &record.name)
        } else {
            self.queue_logs.group(incarnation, &path, &record.name)
        }
        .map_err(|e| NodeError::Log(path.clone(), e))?;
        let bodies = (!queue.is_stream).then(|| {
            Arc::new(LogBodies {
                log: log.clone(),
                applying: Mutex::new(Vec::new()),
            })
        });
        // The queue is a replica before its log replays into it (Raft::new applies what
        // was committed), so replayed deliveries to consumers of elsewhere are left alone.
        let machine = GroupStateMachine::restored(
            Arc::new(QueueApplied {
                queue: Arc::clone(&queue),
                bodies: bodies.clone(),
            }),
            self.queue_snapshot_path(incarnation),
        )
        .map_err(NodeError::Io)?;
        let replica = Arc::new(QueueReplica {
            node: Arc::downgrade(self),
            group: group.clone(),
            raft: OnceLock::new(),
            forwarder: OnceLock::new(),
            proposer: OnceLock::new(),
            queue: Arc::clone(&queue),
            machine: machine.clone(),
            changing: std::sync::atomic::AtomicBool::new(false),
            downed: Mutex::new(Vec::new()),
            bodies,
            compacted: Mutex::new(None),
        });
        queue.attach_replica(Arc::clone(&replica) as Arc<dyn Replicator>);
        let config = if queue.is_stream {
            Arc::clone(&self.stream_raft_config)
        } else {
            Arc::clone(&self.queue_raft_config)
        };
        let raft = Raft::new(
            self.me,
            config,
            TcpNetwork::new(self.me, group.clone(), self.secret.clone())
                .resolving(self.addresses.clone()),
            log,
            machine,
        )
        .await
        .map_err(|e| NodeError::Io(e.to_string()))?;
        replica.machine.started();
        // Bodies whose release a crash lost (the log replayed into the queue above).
        replica.sweep_bodies();
        let proposer = self.groups.insert(group.clone(), raft.clone());
        let weak = Arc::downgrade(self);
        self.groups.set_transfer(
            &group,
            Arc::new(move |to| {
                let weak = weak.clone();
                Box::pin(async move {
                    match weak.upgrade() {
                        Some(node) => {
                            node.lead_transfer(incarnation, to)
                                .await
                                .map_err(|e| match e {
                                    // The asking node wraps the reason again.
                                    TransferError::Failed(reason) => reason,
                                    other => other.to_string(),
                                })
                        }
                        None => Err("the node is stopping".into()),
                    }
                })
            }),
        );
        let forwarder = Forwarder::start(
            Arc::downgrade(self),
            group,
            Target::Group {
                raft: raft.clone(),
                proposer: proposer.clone(),
            },
        );
        let _ = replica.raft.set(raft.clone());
        let _ = replica.forwarder.set(forwarder);
        let _ = replica.proposer.set(proposer);
        self.queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(incarnation, Arc::clone(&replica));
        if !vhost.insert_replicated(Arc::clone(&queue)) {
            tracing::warn!(queue = %queue.name, "a queue of that name exists here already");
        }
        // Deleted while this replica started (a restarted node replays the declaration and
        // the deletion before this task runs, and the deletion found no replica to retire):
        // retired now, its log with it. Registered above first, so a deletion after this
        // check finds the replica itself.
        let deleted = !self
            .members
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(&incarnation);
        if deleted {
            tracing::info!(queue = %queue.name, incarnation, "the queue was deleted while its replica started: retired");
            self.retire_replica(incarnation);
            return Ok(());
        }
        self.retry_topology();
        // The top-ranked member starts the group and so usually leads it first: leaders
        // spread over the nodes as placement does.
        if members.first() == Some(&self.me) {
            let voters: BTreeMap<NodeId, BasicNode> = self
                .all_members()
                .into_iter()
                .filter(|(id, _)| members.contains(id))
                .collect();
            if let Err(e) = raft.initialize(voters).await {
                tracing::debug!(error = %e, "queue group already initialised");
            }
        }
        // What this node's previous run held goes back (its consumers are gone with it). A
        // node still joining has had no previous run.
        let before = self.broker.next_id();
        if self.number() != 0 {
            replica.submit(
                vec![Command::Down {
                    node: self.number(),
                    before,
                }],
                Box::new(|_| {}),
            );
        }
        Ok(())
    }

    /// Whether this node's quorum queue log of group `incarnation` belongs to no queue: the
    /// metadata replay is over, no replica of it is registered or starting, and the metadata
    /// holds no such queue (a queue deleted while this node was down, learnt from a metadata
    /// snapshot without the deletion). Incarnations are never reused, so such a log is
    /// never read again.
    pub(super) fn is_orphan_log(&self, incarnation: u64) -> bool {
        let booted = self
            .booting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none();
        booted
            && !self
                .members
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains_key(&incarnation)
            && !self
                .queues
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains_key(&incarnation)
    }

    /// The incarnation of the replicated queue `queue` served here.
    pub(super) fn incarnation_of(&self, queue: &Arc<Queue>) -> Option<u64> {
        self.queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .find(|(_, r)| Arc::ptr_eq(&r.queue, queue))
            .map(|(i, _)| *i)
    }

    /// Every queue replica this node serves (a snapshot: the table is not held).
    pub(super) fn replicas(&self) -> Vec<Arc<QueueReplica>> {
        self.queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    /// This node's replica of a queue group, by incarnation.
    pub(super) fn replica_of(&self, incarnation: u64) -> Option<Arc<QueueReplica>> {
        self.queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&incarnation)
            .cloned()
    }
}

/// A quorum queue's message bodies on this node: in its log ([`LogStore::open_queue`]).
#[derive(Debug)]
pub(super) struct LogBodies {
    log: LogStore,
    /// Released while an entry is applied: handed to the log once the entry's replies are
    /// built (a no-ack get's reply still reads its body).
    applying: Mutex<Vec<u64>>,
}

impl LogBodies {
    /// Pass what was released to the log, which deletes it with its next write.
    fn hand_over(&self) {
        let keys =
            std::mem::take(&mut *self.applying.lock().unwrap_or_else(PoisonError::into_inner));
        if !keys.is_empty() {
            self.log.release(keys);
        }
    }

    /// `f` of the stored record under `key`.
    fn with_record<T>(&self, key: u64, f: impl FnOnce(&[u8]) -> T) -> Result<T, String> {
        match self.log.with_body(key, f) {
            Ok(Some(t)) => Ok(t),
            Ok(None) => Err(format!("message {key:#x} is not in this node's log")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// The stored record under `key`, copied out (to send it).
    fn record(&self, key: u64) -> Result<Vec<u8>, String> {
        self.with_record(key, <[u8]>::to_vec)
    }

    /// Delete, in the background, the bodies of entries up to `upto` that no message in
    /// `live` (sorted keys) holds.
    fn sweep_in_background(&self, queue: String, live: Vec<u64>, upto: u64) {
        let log = self.log.clone();
        std::thread::spawn(move || match log.sweep(&live, upto) {
            Ok(0) => {}
            Ok(n) => {
                tracing::info!(%queue, bodies = n, upto, live = live.len(), "swept bodies no message holds")
            }
            Err(e) => tracing::warn!(%queue, error = %e, "bodies were not swept"),
        });
    }
}

impl BodySource for LogBodies {
    fn read(&self, key: u64) -> Result<Arc<Message>, String> {
        self.with_record(key, warren_broker::message::codec::decode_message)?
            .map(Arc::new)
            .map_err(|e| e.to_string())
    }

    fn release(&self, key: u64) {
        self.applying
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(key);
    }
}

/// A quorum queue's snapshot as members of the previous version sent it to a member behind
/// the purged log, built in memory: the machine (whose messages are keys) and the bodies of
/// its messages. Starts with [`FULL_SNAPSHOT_MAGIC`]; still installed from such a member.
#[derive(serde::Serialize, serde::Deserialize)]
struct FullSnapshot {
    #[serde(with = "crate::codec::raw_bytes")]
    machine: Vec<u8>,
    bodies: Vec<SnapshotBody>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct SnapshotBody {
    key: u64,
    #[serde(with = "crate::codec::raw_bytes")]
    record: Vec<u8>,
}

/// First bytes of a [`FullSnapshot`] (a machine's own encoding never starts so).
const FULL_SNAPSHOT_MAGIC: &[u8; 8] = b"WQFULL01";

/// First bytes of a quorum queue's snapshot as sent to a member behind the purged log, written
/// and read as a stream (little-endian lengths):
///
/// | bytes | field |
/// |---|---|
/// | 8 | magic `WQFULL02` |
/// | per body: 1, 8, 4, `n` | tag 1, key, `n`: length of the record, the record |
/// | 1 | tag 0: the end of the bodies |
/// | rest | the machine, encoded (its messages are keys), as the snapshot file holds it |
///
/// The sender copies the machine from its snapshot file and reads the bodies one at a time;
/// the receiver holds the machine and [`SNAPSHOT_BODY_BATCH`] bytes of bodies at most.
const STREAMED_SNAPSHOT_MAGIC: &[u8; 8] = b"WQFULL02";

/// Bytes of bodies from a received snapshot written to the log in one transaction. It bounds
/// the follower's memory while it installs: at 16 MiB a follower streaming 101 MB of bodies
/// peaked at 79 MB of RSS with mimalloc (which keeps freed memory a second), at 4 MiB at 67 MB
/// (`test_a_member_behind_the_purged_log_gets_the_bodies_streamed_in_a_snapshot`).
pub const SNAPSHOT_BODY_BATCH: usize = 4 * 1024 * 1024;

fn read_u64(input: &mut dyn std::io::Read) -> Result<u64, String> {
    let mut b = [0u8; 8];
    input.read_exact(&mut b).map_err(|e| e.to_string())?;
    Ok(u64::from_le_bytes(b))
}

/// A length read from a snapshot, refused past what any encoded value may take.
fn checked_len(len: u64) -> Result<usize, String> {
    if len > crate::codec::VALUE_MAX {
        return Err(format!("a snapshot claims a part of {len} bytes"));
    }
    usize::try_from(len).map_err(|e| e.to_string())
}

/// The keys of the logged messages `machine` holds, sorted.
fn logged_keys(machine: &QueueMachine<Entry>) -> Vec<u64> {
    let mut keys = Vec::new();
    machine.for_each_message(|e| {
        if let Entry::Logged { key, .. } = e {
            keys.push(*key);
        }
    });
    keys.sort_unstable();
    keys
}

/// A quorum queue's state on one replica: the broker's queue, driven by committed entries.
struct QueueApplied {
    queue: Arc<Queue>,
    /// Where its bodies are (None: a stream, whose entries are decoded whole).
    bodies: Option<Arc<LogBodies>>,
}

impl QueueApplied {
    /// The machine's command for command `slot` of the entry at `index`. A quorum queue's
    /// enqueue becomes its message's key: its log holds the body (in the entry, or a stub of
    /// a log written by the version that split bodies out). A stream's messages, and those of
    /// other commands, are decoded.
    fn command(
        &self,
        index: u64,
        slot: usize,
        c: Command<ReplicatedMessage>,
    ) -> Result<Command<Entry>, warren_broker::node::replication::DecodeError> {
        if let Command::Enqueue(m) = &c
            && self.bodies.is_some()
            && slot < SLOTS_PER_ENTRY
        {
            let size = match stub_size(&m.body) {
                Some(size) => size,
                None => warren_broker::message::codec::record_body_len(&m.body)?,
            };
            return Ok(Command::Enqueue(Entry::Logged {
                key: body_key(index, slot),
                size,
                priority: m.priority,
                ttl_ms: m.expiration_ms.map_or(NO_TTL, |t| {
                    u32::try_from(t).unwrap_or(NO_TTL).min(NO_TTL - 1)
                }),
            }));
        }
        c.try_map(|m| decode_entry(&m.body))
    }

    /// A reply's message as the log carries it (a logged one read back).
    fn wire_reply(&self, e: &Entry) -> Result<ReplicatedMessage, String> {
        if let Entry::Logged {
            key,
            priority,
            ttl_ms,
            ..
        } = e
        {
            let bodies = self
                .bodies
                .as_ref()
                .ok_or("a logged message without its log")?;
            return Ok(ReplicatedMessage {
                body: bodies.record(*key)?,
                priority: *priority,
                expiration_ms: (*ttl_ms != NO_TTL).then_some(u64::from(*ttl_ms)),
            });
        }
        wire(e).map_err(|e| e.to_string())
    }
}

impl Applied for QueueApplied {
    fn apply(&self, at: u64, index: u64, request: QueueRequest) -> QueueResponse {
        let commands: Vec<Command<Entry>> = request
            .commands
            .into_iter()
            .enumerate()
            .filter_map(|(slot, c)| {
                self.command(index, slot, c)
                    .map_err(|e| {
                        // Checksummed and identical on every replica: all skip it alike.
                        tracing::error!(queue = %self.queue.name, error = %e, "undecodable entry");
                    })
                    .ok()
            })
            .collect();
        let replies = self.queue.apply_committed(at, commands);
        let response = QueueResponse {
            replies: replies
                .into_iter()
                .map(|r| {
                    r.map(|reply| {
                        reply
                            .try_map(|e| self.wire_reply(&e))
                            .unwrap_or_else(|e| {
                                tracing::error!(queue = %self.queue.name, error = %e, "a reply's message is unreadable");
                                Reply::Ok
                            })
                    })
                })
                .collect(),
        };
        if let Some(bodies) = &self.bodies {
            bodies.hand_over();
        }
        response
    }

    fn snapshot(&self) -> Result<Vec<u8>, String> {
        if let Some(stream) = self.queue.stream() {
            let snapshot = stream.snapshot().map_err(|e| e.to_string())?;
            return crate::codec::encode(&snapshot).map_err(|e| e.to_string());
        }
        self.queue
            .with_machine(crate::codec::encode)
            .map_err(|e| e.to_string())
    }

    fn snapshot_into(&self, out: &mut dyn std::io::Write) -> Result<(), String> {
        if self.queue.stream().is_some() {
            let bytes = self.snapshot()?;
            return out.write_all(&bytes).map_err(|e| e.to_string());
        }
        // Streamed under the queue's lock: the encoded machine (tens of bytes a message) is
        // never in memory whole.
        self.queue
            .with_machine(|m| crate::codec::encode_into(out, m))
            .map_err(|e| e.to_string())
    }

    fn install(&self, bytes: &[u8], last: u64) -> Result<(), String> {
        if let Some(stream) = self.queue.stream() {
            let snapshot: warren_broker::queue::stream::StreamSnapshot =
                crate::codec::decode(bytes).map_err(|e| e.to_string())?;
            return stream.install(snapshot).map_err(|e| e.to_string());
        }
        let machine: QueueMachine<Entry> = match bytes.strip_prefix(FULL_SNAPSHOT_MAGIC) {
            Some(full) => {
                let full: FullSnapshot = crate::codec::decode(full).map_err(|e| e.to_string())?;
                let bodies: Vec<(u64, Vec<u8>)> =
                    full.bodies.into_iter().map(|b| (b.key, b.record)).collect();
                if let Some(log) = self.bodies.as_ref() {
                    log.log
                        .insert_bodies(bodies, last)
                        .map_err(|e| e.to_string())?;
                }
                crate::codec::decode_machine(&full.machine).map_err(|e| e.to_string())?
            }
            None if bytes.starts_with(STREAMED_SNAPSHOT_MAGIC) => {
                return self.install_from(&mut &bytes[..], last);
            }
            None => crate::codec::decode_machine(bytes).map_err(|e| e.to_string())?,
        };
        self.install_machine(machine, last);
        Ok(())
    }

    fn install_from(&self, input: &mut dyn std::io::Read, last: u64) -> Result<(), String> {
        let mut first = Vec::with_capacity(8);
        <&mut dyn Read as Read>::take(&mut *input, 8)
            .read_to_end(&mut first)
            .map_err(|e| e.to_string())?;
        if self.queue.stream().is_some() || first != STREAMED_SNAPSHOT_MAGIC {
            input.read_to_end(&mut first).map_err(|e| e.to_string())?;
            return self.install(&first, last);
        }
        let log = self.bodies.as_ref().ok_or("a queue without its log")?;
        // Bodies first, in batches: once the machine is installed, its messages read them.
        let mut batch: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut batch_bytes = 0;
        let mut received = 0u64;
        loop {
            let mut tag = [0u8; 1];
            input.read_exact(&mut tag).map_err(|e| e.to_string())?;
            match tag[0] {
                0 => break,
                1 => {}
                other => return Err(format!("a snapshot's body has tag {other}")),
            }
            let key = read_u64(input)?;
            let mut len = [0u8; 4];
            input.read_exact(&mut len).map_err(|e| e.to_string())?;
            let mut record = vec![0u8; checked_len(u64::from(u32::from_le_bytes(len)))?];
            input.read_exact(&mut record).map_err(|e| e.to_string())?;
            batch_bytes += record.len();
            batch.push((key, record));
            received += 1;
            if batch_bytes >= SNAPSHOT_BODY_BATCH {
                // Marked copied only with the last batch, once all are in.
                log.log
                    .insert_bodies(std::mem::take(&mut batch), 0)
                    .map_err(|e| e.to_string())?;
                batch_bytes = 0;
            }
        }
        log.log
            .insert_bodies(batch, last)
            .map_err(|e| e.to_string())?;
        let mut machine = Vec::new();
        input.read_to_end(&mut machine).map_err(|e| e.to_string())?;
        let machine: QueueMachine<Entry> =
            crate::codec::decode_machine(&machine).map_err(|e| e.to_string())?;
        tracing::info!(queue = %self.queue.name, bodies = received, last, "installed a snapshot with its bodies");
        self.install_machine(machine, last);
        Ok(())
    }

    fn expands(&self) -> bool {
        true
    }

    fn expand_into(
        &self,
        state: &mut dyn Read,
        last: u64,
        out: &mut dyn std::io::Write,
    ) -> Result<(), String> {
        let Some(stream) = self.queue.stream() else {
            // The bodies of the snapshot's messages: the member it goes to is behind the
            // purged log, so its entries will not bring them. Those the queue holds now from
            // entries up to `last` are the snapshot's still live; the others were settled
            // since, which the log brings to the member.
            let bodies = self.bodies.as_ref().ok_or("a queue without its log")?;
            let mut keys = self.queue.with_machine(logged_keys);
            keys.retain(|&k| key_index(k) <= last);
            let io = |e: std::io::Error| e.to_string();
            out.write_all(STREAMED_SNAPSHOT_MAGIC).map_err(io)?;
            for key in keys {
                let written = bodies
                    .log
                    .with_body(key, |record| -> std::io::Result<()> {
                        let len = u32::try_from(record.len()).map_err(std::io::Error::other)?;
                        out.write_all(&[1])?;
                        out.write_all(&key.to_le_bytes())?;
                        out.write_all(&len.to_le_bytes())?;
                        out.write_all(record)
                    })
                    .map_err(|e| e.to_string())?;
                // None: released since the keys were taken.
                written.transpose().map_err(io)?;
            }
            out.write_all(&[0]).map_err(io)?;
            return std::io::copy(state, out).map(drop).map_err(io);
        };
        let mut bytes = Vec::new();
        state.read_to_end(&mut bytes).map_err(|e| e.to_string())?;
        let snapshot: warren_broker::queue::stream::StreamSnapshot =
            crate::codec::decode(&bytes).map_err(|e| e.to_string())?;
        let full = stream.expand(snapshot).map_err(|e| e.to_string())?;
        crate::codec::encode_into(out, &full).map_err(|e| e.to_string())
    }
}

impl QueueApplied {
    /// Make `machine`, a snapshot's up to index `last`, the queue's state.
    fn install_machine(&self, machine: QueueMachine<Entry>, last: u64) {
        let live = logged_keys(&machine);
        self.queue.install_machine(machine);
        // The replaced state's bodies (those of entries the snapshot covers that it does not
        // hold) go; entries after it keep theirs.
        if let Some(bodies) = &self.bodies
            && last > 0
        {
            bodies.sweep_in_background(self.queue.name.clone(), live, last);
        }
    }
}

/// An entry's message as the log carries it.
pub(super) fn wire(
    entry: &Entry,
) -> Result<ReplicatedMessage, warren_broker::node::replication::DecodeError> {
    use warren_broker::queue::machine::MessageRef;
    Ok(ReplicatedMessage {
        body: encode_entry(entry)?,
        priority: entry.priority(),
        expiration_ms: entry.expiration_ms(),
    })
}

/// Send a queue's commands through `forwarder` (to its group's leader, or a proxy's home),
/// retried as [`send_retrying`] does; `done` gets the replies as the broker sees them.
pub(super) fn forward_commands(
    forwarder: &Forwarder,
    commands: Vec<Command<Entry>>,
    done: ReplicaDone,
) {
    let mut wired = Vec::with_capacity(commands.len());
    for c in commands {
        match c.try_map(|e| wire(&e)) {
            Ok(c) => wired.push(c),
            Err(e) => {
                done(Err(ReplicationError::Unknown(e.to_string())));
                return;
            }
        }
    }
    // Acks, returns, cancels and the like change nothing when applied twice, so they are
    // retried even when an attempt's outcome is unknown; anything is retried when nothing
    // was appended. A consumer whose ack was lost would otherwise hold the message until its
    // node goes down.
    let idempotent = wired.iter().all(|c| {
        !matches!(
            c,
            Command::Enqueue(_) | Command::Get { .. } | Command::Purge | Command::Restore { .. }
        )
    });
    send_retrying(
        forwarder.clone(),
        Forwarded {
            commands: wired,
            meta: Vec::new(),
        },
        idempotent,
        std::time::Instant::now() + RETRY_FOR,
        0,
        Box::new(move |r| {
            done(r.map(|replies| {
                replies
                    .into_iter()
                    .map(|r| match r {
                        Ok(reply) => Ok(reply
                            .try_map(|m| decode_entry(&m.body))
                            .unwrap_or(Reply::Ok)),
                        Err(ProposeError::Refused(e)) => Err(e),
                        // Another command of the batch failed: a refusal to the caller.
                        Err(_) => Err(MachineError::DuplicateConsumer),
                    })
                    .collect::<Replies>()
            }))
        }),
    );
}

/// One quorum queue's replica on this node: the broker's [`Replicator`].
pub(super) struct QueueReplica {
    node: Weak<ClusterNode>,
    pub(super) group: GroupId,
    /// Set once the group's Raft instance is up (after its log replayed into the queue).
    pub(super) raft: OnceLock<Raft<QueueRaft>>,
    /// Set with `raft`; submissions before it fail as unavailable.
    forwarder: OnceLock<Forwarder>,
    /// Set with `raft`: the leader-side batcher (held while leadership is handed over).
    pub(super) proposer: OnceLock<Proposer>,
    pub(super) queue: Arc<Queue>,
    /// The state machine the group applies into (a clone sharing it), read for
    /// [`Replicator::replica_state`].
    machine: GroupStateMachine<QueueApplied>,
    /// Set while this replica, as leader, is changing the group's voters.
    pub(super) changing: std::sync::atomic::AtomicBool,
    /// Nodes whose consumers this replica (as leader) already returned, until heard again.
    pub(super) downed: Mutex<Vec<NodeId>>,
    /// Where a quorum queue's bodies are (None: a stream).
    bodies: Option<Arc<LogBodies>>,
    /// The applied index, snapshot point and bounds of the last compaction that found
    /// nothing to purge: a compaction with none of them changed since is skipped.
    compacted: Mutex<Option<(u64, u64, u64, u64)>>,
}

impl QueueReplica {
    /// Delete the bodies in this node's log that no message of the queue holds (a crash
    /// lost their release), in the background.
    fn sweep_bodies(&self) {
        let Some(bodies) = &self.bodies else {
            return;
        };
        let (applied, live) = self
            .machine
            .read_applied(|a| a.queue.with_machine(logged_keys));
        let Some(applied) = applied else {
            return;
        };
        bodies.sweep_in_background(self.queue.name.clone(), live, applied.index);
    }

    /// Delete released copies no write took yet, and purge the log up to where this
    /// replica's snapshot and its oldest live message allow (see [`purge_point`]), the live
    /// messages' bodies in the purged entries copied out first.
    pub(super) async fn compact_log(&self) {
        let pin_max = self
            .node
            .upgrade()
            .map_or(QUEUE_LOG_PIN_MAX, |n| n.config.queue_log_pin_max);
        self.compact_log_keeping(QUEUE_LOG_KEEP, pin_max).await;
    }

    /// Snapshot now and purge the whole log up to the snapshot, a quorum queue's live
    /// messages' bodies copied out: asked of the groups (quorum queues and streams) pinning
    /// the oldest segment of a WAL that holds too many (`QueueLogs::pinning_groups`), so one
    /// idle queue with old entries does not keep every newer segment on disk.
    pub(super) async fn compact_log_now(&self) {
        let Some(raft) = self.raft.get() else {
            return;
        };
        let (applied, snapshot) = {
            let m = raft.metrics();
            let m = m.borrow();
            (m.last_applied.map(|l| l.index), m.snapshot.map(|l| l.index))
        };
        if applied > snapshot {
            if raft.trigger().snapshot().await.is_err() {
                return;
            }
            let built = raft
                .wait(Some(SNAPSHOT_BUILD_MAX))
                .metrics(
                    |m| m.snapshot.map(|l| l.index) >= applied,
                    "the snapshot is built",
                )
                .await;
            if built.is_err() {
                tracing::warn!(queue = %self.queue.name, "no snapshot in time: the log is not purged");
                return;
            }
        }
        if self.bodies.is_none() {
            // A stream: its chunks are in its files and its snapshot points into them, so
            // the whole log up to the snapshot goes (no body to copy out).
            let snapshot = raft.metrics().borrow().snapshot.map(|l| l.index);
            if let Some(upto) = snapshot {
                let _ = raft.trigger().purge_log(upto).await;
            }
            return;
        }
        self.compact_log_keeping(0, 0).await;
        // What the purge cannot free: bodies copied out by an earlier compaction, live as long
        // as their messages, in the segment that is now the oldest.
        let rewritten = match &self.bodies {
            Some(bodies) => {
                let log = bodies.log.clone();
                match tokio::task::spawn_blocking(move || log.rewrite_oldest_bodies()).await {
                    Ok(Ok(n)) => n,
                    Ok(Err(e)) => {
                        tracing::warn!(queue = %self.queue.name, error = %e, "old bodies not written again");
                        0
                    }
                    Err(_) => 0,
                }
            }
            None => 0,
        };
        let (applied, snapshot, purged) = {
            let m = raft.metrics();
            let m = m.borrow();
            (
                m.last_applied.map(|l| l.index),
                m.snapshot.map(|l| l.index),
                m.purged.map(|l| l.index),
            )
        };
        tracing::info!(
            queue = %self.queue.name,
            incarnation = self.group.incarnation,
            ?applied,
            ?snapshot,
            ?purged,
            rewritten,
            "compacted ahead of schedule"
        );
    }

    /// Purge the log up to [`purge_point`] with `keep` entries before the snapshot and the
    /// oldest live message pinning it within `pin_max` entries.
    async fn compact_log_keeping(&self, keep: u64, pin_max: u64) {
        let (Some(bodies), Some(raft)) = (&self.bodies, self.raft.get()) else {
            return;
        };
        bodies.hand_over();
        if bodies.log.has_released() {
            let log = bodies.log.clone();
            if let Ok(Err(e)) = tokio::task::spawn_blocking(move || log.flush_released()).await {
                tracing::warn!(queue = %self.queue.name, error = %e, "released bodies not deleted");
            }
        }
        let (snapshot, purged, applied) = {
            let m = raft.metrics();
            let m = m.borrow();
            (
                m.snapshot.map_or(0, |s| s.index),
                m.purged.map_or(0, |p| p.index),
                m.last_applied.map_or(0, |a| a.index),
            )
        };
        // Nothing applied or snapshotted since the last look (an idle queue): no scan of its
        // messages. Ten thousand idle queues otherwise cost a scan each every few seconds.
        let seen = Some((applied, snapshot, keep, pin_max));
        if *self
            .compacted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            == seen
        {
            return;
        }
        let oldest = self.queue.with_machine(|m| {
            let mut oldest: Option<u64> = None;
            m.for_each_message(|e| {
                if let Entry::Logged { key, .. } = e {
                    let i = key_index(*key);
                    oldest = Some(oldest.map_or(i, |o| o.min(i)));
                }
            });
            oldest
        });
        let upto = purge_point(snapshot, oldest, keep, pin_max);
        if upto <= purged {
            // Done for this state: skipped until something is applied or snapshotted. (Not
            // recorded when a purge is asked for: openraft may put it off while a replication
            // uses the entries, and the next look asks again.)
            *self
                .compacted
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = seen;
            return;
        }
        // The live messages of the entries to purge keep their bodies as copies. A message
        // added after this has a later entry; one removed after it is deleted again.
        let live: Vec<u64> = self.queue.with_machine(|m| {
            let mut keys = Vec::new();
            m.for_each_message(|e| {
                if let Entry::Logged { key, .. } = e
                    && key_index(*key) <= upto
                {
                    keys.push(*key);
                }
            });
            keys
        });
        let mut live = live;
        live.sort_unstable();
        let log = bodies.log.clone();
        let failed = match tokio::task::spawn_blocking(move || log.copy_out(&live, upto)).await {
            Ok(Ok(_)) => {
                let _ = raft.trigger().purge_log(upto).await;
                return;
            }
            Ok(Err(e)) => e.to_string(),
            Err(e) => format!("copy-out failed: {e}"),
        };
        tracing::warn!(queue = %self.queue.name, error = %failed, "bodies not copied out: the log is not purged");
    }
}

/// How far a quorum queue's log may be purged: up to `keep` entries ([`QUEUE_LOG_KEEP`] on
/// schedule) before its snapshot point `snapshot`, and not past its oldest live message (the
/// entry at index `oldest` enqueued it) unless that is `pin_max` entries back or more
/// ([`QUEUE_LOG_PIN_MAX`] by default, `--quorum-log-pin-max`; 0: never pinned). A
/// member away for a while then catches up from the log (whose entries carry the bodies)
/// rather than from a snapshot that must carry them.
fn purge_point(snapshot: u64, oldest: Option<u64>, keep: u64, pin_max: u64) -> u64 {
    let base = snapshot.saturating_sub(keep);
    match oldest {
        Some(o) if o <= base && snapshot - o < pin_max => o.saturating_sub(1),
        _ => base,
    }
}

impl std::fmt::Debug for QueueReplica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueReplica")
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

impl Replicator for QueueReplica {
    fn submit(&self, commands: Vec<Command<Entry>>, done: ReplicaDone) {
        let Some(forwarder) = self.forwarder.get() else {
            done(Err(ReplicationError::Unavailable));
            return;
        };
        forward_commands(forwarder, commands, done);
    }

    fn is_leader(&self) -> bool {
        let (Some(node), Some(raft)) = (self.node.upgrade(), self.raft.get()) else {
            return false;
        };
        raft.metrics().borrow().current_leader == Some(node.me)
    }

    fn local_node(&self) -> u64 {
        self.node.upgrade().map_or(0, |n| n.number())
    }

    fn bodies(&self) -> Option<&dyn BodySource> {
        self.bodies.as_deref().map(|b| b as &dyn BodySource)
    }

    fn placement(&self) -> Placement {
        let Some(node) = self.node.upgrade() else {
            return Placement::default();
        };
        let (leader, voters) = match self.raft.get() {
            Some(raft) => {
                let m = raft.metrics();
                let m = m.borrow();
                let voters: Vec<NodeId> = m.membership_config.membership().voter_ids().collect();
                if voters.is_empty() {
                    // A learner not added yet knows no membership: the committed members.
                    (m.current_leader, node.members_of(self.group.incarnation))
                } else {
                    (m.current_leader, voters)
                }
            }
            None => (None, node.members_of(self.group.incarnation)),
        };
        let online = voters
            .iter()
            .filter(|id| **id == node.me || tcp::silent_for(**id).is_some_and(|s| s < DOWN_AFTER))
            .filter_map(|id| node.peer_name(*id))
            .collect();
        Placement {
            leader: leader.and_then(|l| node.peer_name(l)),
            members: voters.iter().filter_map(|id| node.peer_name(*id)).collect(),
            online,
        }
    }

    fn replica_state(&self, with_digest: bool) -> ReplicaState {
        let Some(node) = self.node.upgrade() else {
            return ReplicaState::default();
        };
        let (applied, digest) = self.machine.read_applied(|a| {
            if with_digest {
                a.queue.with_machine(digest)
            } else {
                String::new()
            }
        });
        let Some(raft) = self.raft.get() else {
            return ReplicaState {
                applied_index: applied.map_or(0, |l| l.index),
                role: "starting",
                digest,
                ..ReplicaState::default()
            };
        };
        let m = raft.metrics();
        let m = m.borrow();
        let role = match m.state {
            openraft::ServerState::Leader => "leader",
            openraft::ServerState::Follower => "follower",
            openraft::ServerState::Candidate => "candidate",
            openraft::ServerState::Learner => "learner",
            openraft::ServerState::Shutdown => "shutdown",
        };
        ReplicaState {
            applied_index: applied.map_or(0, |l| l.index),
            term: m.current_term,
            last_written_index: m.last_log_index.unwrap_or(0),
            snapshot_index: m.snapshot.map_or(0, |s| s.index),
            purged_index: m.purged.map_or(0, |p| p.index),
            role,
            digest,
            learners: m
                .membership_config
                .membership()
                .learner_ids()
                .filter_map(|id| node.peer_name(id))
                .collect(),
        }
    }
}

/// A hash of a queue machine's serialization (its maps in key order): replicas at the same
/// applied index must have the same. Streamed into the hash: a backlog's rendering is never
/// held in memory.
fn digest<M: serde::Serialize>(machine: &M) -> String {
    struct Fnv(u64);
    impl std::io::Write for Fnv {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            for b in buf {
                self.0 ^= u64::from(*b);
                self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    if serde_json::to_writer(&mut h, machine).is_err() {
        return String::new();
    }
    format!("{:016x}", h.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The log keeps entries back to the oldest live message within the pin limit, and
    /// otherwise up to its keep distance before the snapshot.
    #[test]
    fn the_purge_point_follows_the_oldest_live_message_within_bounds() {
        // Nothing live: keep QUEUE_LOG_KEEP before the snapshot.
        assert_eq!(
            purge_point(10_000, None, QUEUE_LOG_KEEP, QUEUE_LOG_PIN_MAX),
            10_000 - QUEUE_LOG_KEEP
        );
        // Nothing snapshotted yet.
        assert_eq!(
            purge_point(0, Some(5), QUEUE_LOG_KEEP, QUEUE_LOG_PIN_MAX),
            0
        );
        // The oldest live message is recent: the keep distance is the bound.
        assert_eq!(
            purge_point(10_000, Some(9_800), QUEUE_LOG_KEEP, QUEUE_LOG_PIN_MAX),
            10_000 - QUEUE_LOG_KEEP
        );
        // Older, within the pin limit: the log stays from it on.
        assert_eq!(
            purge_point(10_000, Some(500), QUEUE_LOG_KEEP, QUEUE_LOG_PIN_MAX),
            499
        );
        // Beyond the pin limit: it no longer holds the log.
        let s = QUEUE_LOG_PIN_MAX + 10_000;
        assert_eq!(
            purge_point(s, Some(3), QUEUE_LOG_KEEP, QUEUE_LOG_PIN_MAX),
            s - QUEUE_LOG_KEEP
        );
        // Compacted now (the WAL asks): up to the snapshot, whatever is live, even a message
        // enqueued by the snapshot's own entry.
        assert_eq!(purge_point(10_000, Some(500), 0, 0), 10_000);
        assert_eq!(purge_point(10_000, Some(10_000), 0, 0), 10_000);
        assert_eq!(purge_point(10_000, None, 0, 0), 10_000);
    }
}
