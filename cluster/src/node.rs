//! A cluster node: the cluster port, the metadata group, and one replica per quorum queue,
//! wired into the node's broker.
//!
//! - **Membership** is static, from `--peers` (every node, this one included). A node's Raft id
//!   is a hash of its name (stable across restarts and peer orderings); its *number* (1..=63,
//!   its place among the sorted names) is what consumer ids carry in their top bits.
//! - **Metadata group** (every node): quorum queue records and their placement
//!   ([`MetaChange`]). A declare is acknowledged once it committed and this node serves the
//!   queue. The node with the lowest id initialises the group on first start.
//! - **Queue groups**: one per quorum queue incarnation, members chosen by rendezvous hashing
//!   (`x-quorum-initial-group-size`, default 3). Each replica applies committed entries into
//!   the broker's [`Queue`] (see [`warren_broker::replication`]).
//! - **Forwarding**: a node submits commands to its replica's [`Forwarder`], which proposes them
//!   here when this replica leads, or sends them to the leader over the cluster port.
//! - **Down nodes**: the leader of each queue returns what consumers on a node held once that
//!   node has been silent for [`DOWN_AFTER`]; a node that starts returns what its previous run
//!   held.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::Duration;

use openraft::{BasicNode, Config, Raft};
use tokio::sync::mpsc;
use warren_broker::Broker;
use warren_broker::durable::QueueRecord;
use warren_broker::message::Entry;
use warren_broker::queue::Queue;
use warren_broker::queue::machine::{Command, MachineError, QueueMachine, Reply};
use warren_broker::replication::{
    ClusterHooks, MemberChange, MembershipError, NodeStatus, Placement, ReplicaDone, ReplicaState,
    ReplicationError, Replicator, Replies, TopologyChange, TransferDone, TransferError,
    decode_entry, encode_entry,
};
use warren_store::writer::Completion;

use crate::group::{Applied, GroupStateMachine};
use crate::log_store::LogStore;
use crate::proposer::{ProposeError, Proposer};
use crate::tcp::{
    Addresses, FORWARDS_IN_FLIGHT_MAX, ForwardLink, Forwarded, GroupId, Groups, Secret, TcpNetwork,
};
use crate::types::{MetaChange, NodeId, QueueRaft, QueueRequest, QueueResponse, ReplicatedMessage};

/// A peer is down once it has been silent this long (several election timeouts).
pub const DOWN_AFTER: Duration = Duration::from_secs(5);
/// Most commands forwarded in one request.
pub const FORWARD_BATCH_MAX: usize = 256;
/// Most submissions waiting to be forwarded, per queue (beyond it they fail at once).
pub const FORWARD_QUEUE_MAX: usize = 16 * 1024;
/// Replicas of a quorum queue unless `x-quorum-initial-group-size` says otherwise.
pub const GROUP_SIZE_DEFAULT: usize = 3;
/// Founding nodes are numbered 1 and up from their sorted names, joined nodes from 63 down:
/// at most this many founding nodes, so the two never meet.
pub const FOUNDING_NODES_MAX: usize = 31;
/// How often a peer that sent nothing lately is pinged (well within [`DOWN_AFTER`]).
const PING_EVERY: Duration = Duration::from_secs(1);
/// How long opening a forwarding link to a leader may take (a connect and a handshake); a
/// peer behind a black hole must not hold a group's forwarder.
const LINK_OPEN_MAX: Duration = Duration::from_secs(1);
/// How long a forwarded batch waits for the leader's answer before its outcome is unknown
/// and the link is dropped (commits take milliseconds, p99 under the ten-queue benchmark
/// about 1.6 s).
const FORWARD_REPLY_MAX: Duration = Duration::from_secs(5);
/// How long a starting node waits for its metadata to replay before serving anyway.
const REPLAY_MAX: Duration = Duration::from_secs(60);
/// How long a joining node waits between attempts to reach a seed.
const JOIN_RETRY: Duration = Duration::from_millis(500);
/// How long a leader handing over waits for its log to settle, and then for the target to
/// hold every entry.
const HOLD_MAX: Duration = Duration::from_secs(2);
/// How long a handover waits for the target's election.
const TRANSFER_MAX: Duration = Duration::from_secs(5);
/// Past the leader lease before a handover starts (clocks of one process, so small).
const TRANSFER_MARGIN: Duration = Duration::from_millis(50);
/// How long a forward waits for a group to have a leader.
const LEADER_WAIT: Duration = Duration::from_secs(10);
/// The metadata group's name.
const META_GROUP: &str = "$meta";

/// One member of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// Its node name (`--node-name`).
    pub name: String,
    /// Its cluster port address.
    pub addr: String,
}

/// How a node joins its cluster.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// This node's name (one of `peers`).
    pub name: String,
    /// The cluster port to listen on.
    pub listen: SocketAddr,
    /// Every node of the cluster, this one included.
    pub peers: Vec<Peer>,
    /// The cluster's shared secret.
    pub secret: Vec<u8>,
    /// Where the Raft logs go.
    pub data_dir: PathBuf,
    /// TLS on the cluster port (both ways), if configured.
    pub tls: Option<crate::tcp::ClusterTls>,
    /// Join the running cluster of `peers` (seeds: some of its nodes, and this one for its
    /// own address) rather than found it with them.
    pub join: bool,
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The configuration is inconsistent.
    #[error("cluster configuration: {0}")]
    Config(String),
    /// A log could not be opened.
    #[error("raft log {0}: {1}")]
    Log(PathBuf, redb::Error),
    /// The port or a Raft instance failed.
    #[error("cluster: {0}")]
    Io(String),
}

/// A node's Raft id: FNV-1a of its name (never 0).
#[must_use]
pub fn node_id(name: &str) -> NodeId {
    fnv1a(name.as_bytes()).max(1)
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Timings for real nodes: heartbeats every 300 ms, an election after 1.5 to 3 s of silence
/// (sooner when the leader's connection closes: `tcp::suspect_leader`). openraft also takes
/// the heartbeat interval as the AppendEntries timeout, so it must cover a full append and
/// its fsync under load; appends carry at most 8 entries (of up to 512 commands each), which
/// bounds that. Measured: with 200 ms and 300 entries an append of ten busy queues timed out
/// again and again and replication stalled.
#[must_use]
pub fn raft_config() -> Config {
    Config {
        heartbeat_interval: 300,
        election_timeout_min: 1500,
        election_timeout_max: 3000,
        max_payload_entries: 8,
        ..Config::default()
    }
}

/// Entries of a stream's group between two snapshots ([`STREAM_SNAPSHOT_EVERY_ENV`]
/// overrides it): a snapshot lets Raft purge what it covers, the stream's files holding it.
pub const STREAM_SNAPSHOT_EVERY: u64 = 5000;
/// Environment variable overriding [`STREAM_SNAPSHOT_EVERY`] (tests make it small to make a
/// member catch up from a snapshot).
pub const STREAM_SNAPSHOT_EVERY_ENV: &str = "WARREN_STREAM_SNAPSHOT_EVERY";

/// How long sending and installing a stream's snapshot (with its chunks) may take.
pub const STREAM_SNAPSHOT_TIMEOUT_MS: u64 = 30_000;

/// A stream group's Raft settings: the queue groups', with its own snapshot interval; as many
/// entries are kept after a snapshot (a member further behind gets the snapshot, with the
/// chunks it lacks).
#[must_use]
pub fn stream_raft_config() -> Config {
    let every = std::env::var(STREAM_SNAPSHOT_EVERY_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|n| *n > 0)
        .unwrap_or(STREAM_SNAPSHOT_EVERY);
    Config {
        snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(every),
        // A member briefly away catches up from the log, not from a whole-stream snapshot.
        max_in_snapshot_log_to_keep: every,
        // A snapshot with data takes longer to send and install than a queue's.
        install_snapshot_timeout: STREAM_SNAPSHOT_TIMEOUT_MS,
        ..raft_config()
    }
}

/// A node of the cluster as this node knows it.
#[derive(Debug, Clone)]
struct Member {
    name: String,
    addr: String,
    /// 0 until known (a joining node learns its own when its join commits).
    number: u64,
    forgotten: bool,
}

/// A running cluster node. Clones of the `Arc` share it.
pub struct ClusterNode {
    config: NodeConfig,
    me: NodeId,
    /// This node's number (0 while it joins).
    number: std::sync::atomic::AtomicU64,
    /// Every node: the founding ones from `--peers`, then as the metadata group says.
    registry: std::sync::RwLock<BTreeMap<NodeId, Member>>,
    /// Woken when this node's own number becomes known.
    numbered: tokio::sync::Notify,
    /// Set while this node, as the metadata leader, changes the group's voters.
    meta_changing: std::sync::atomic::AtomicBool,
    /// While the node starts: the replicas its replayed metadata starts (awaited before it
    /// serves clients).
    booting: Mutex<Option<Vec<tokio::task::JoinHandle<()>>>>,
    raft_config: Arc<Config>,
    /// A stream group's ([`stream_raft_config`]).
    stream_raft_config: Arc<Config>,
    secret: Secret,
    /// Where this node dials each peer (its `--peers`).
    addresses: Addresses,
    broker: Arc<Broker>,
    groups: Groups,
    meta: OnceLock<Raft<QueueRaft>>,
    meta_forwarder: OnceLock<Forwarder>,
    /// Queue groups served here, by incarnation.
    queues: Mutex<HashMap<u64, Arc<QueueReplica>>>,
    /// Declares made here, waiting for their commit: the queue to serve and the completion.
    declaring: Mutex<HashMap<u64, Completion>>,
    /// Deletes made here, waiting for their commit.
    deleting: Mutex<HashMap<u64, Completion>>,
    /// Each quorum queue's members as the metadata group last set them, by incarnation:
    /// what its leader makes the group's voters (see [`reconcile_members`]).
    members: Mutex<HashMap<u64, Vec<NodeId>>>,
    /// When this node started (a peer not heard from since is silent only after a while).
    started: std::time::Instant,
    /// Committed bindings whose ends this node does not serve yet (bounded by the bindings
    /// the cluster has).
    unbound: Mutex<Vec<TopologyChange>>,
}

impl std::fmt::Debug for ClusterNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNode")
            .field("name", &self.config.name)
            .field("id", &self.me)
            .finish_non_exhaustive()
    }
}

impl ClusterNode {
    /// Start this node: the cluster port, the metadata group (replaying its log), and the
    /// replicas of every quorum queue it hosts; then join `broker` to the cluster.
    ///
    /// # Errors
    /// See [`NodeError`].
    pub async fn start(config: NodeConfig, broker: Arc<Broker>) -> Result<Arc<Self>, NodeError> {
        let mut names: Vec<&str> = config.peers.iter().map(|p| p.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        if names.len() != config.peers.len() {
            return Err(NodeError::Config(
                "a node name appears twice in --peers".into(),
            ));
        }
        let Some(index) = names.iter().position(|n| *n == config.name) else {
            return Err(NodeError::Config(format!(
                "--peers does not name this node ({})",
                config.name
            )));
        };
        if !config.join && names.len() > FOUNDING_NODES_MAX {
            return Err(NodeError::Config(format!(
                "at most {FOUNDING_NODES_MAX} founding nodes (more can join)"
            )));
        }
        let raft_config = Arc::new(
            raft_config()
                .validate()
                .map_err(|e| NodeError::Config(e.to_string()))?,
        );
        let stream_raft_config = Arc::new(
            stream_raft_config()
                .validate()
                .map_err(|e| NodeError::Config(e.to_string()))?,
        );
        std::fs::create_dir_all(config.data_dir.join("queues"))
            .map_err(|e| NodeError::Io(e.to_string()))?;
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|e| NodeError::Io(format!("cluster port {}: {e}", config.listen)))?;
        let me = node_id(&config.name);
        let mut addresses = Addresses::default();
        if let Some(tls) = &config.tls {
            addresses = addresses.with_tls(tls.connector.clone());
        }
        for p in &config.peers {
            addresses.insert(node_id(&p.name), p.addr.clone());
        }
        let mut registry = BTreeMap::new();
        for (i, name) in names.iter().enumerate() {
            let Some(p) = config.peers.iter().find(|p| p.name == *name) else {
                continue;
            };
            // A joining node knows its seeds' addresses, not their numbers.
            let number = if config.join { 0 } else { i as u64 + 1 };
            registry.insert(
                node_id(name),
                Member {
                    name: p.name.clone(),
                    addr: p.addr.clone(),
                    number,
                    forgotten: false,
                },
            );
        }
        // A number once given stays this node's, whatever later flags say.
        let stored = stored_number(&config.data_dir);
        let number = stored.unwrap_or(if config.join { 0 } else { index as u64 + 1 });
        if let Some(m) = registry.get_mut(&me) {
            m.number = number;
        }
        let node = Arc::new(Self {
            me,
            addresses,
            number: std::sync::atomic::AtomicU64::new(number),
            registry: std::sync::RwLock::new(registry),
            numbered: tokio::sync::Notify::new(),
            meta_changing: std::sync::atomic::AtomicBool::new(false),
            booting: Mutex::new(Some(Vec::new())),
            raft_config,
            stream_raft_config,
            secret: Secret::new(&config.secret),
            broker,
            groups: Groups::default(),
            meta: OnceLock::new(),
            meta_forwarder: OnceLock::new(),
            queues: Mutex::new(HashMap::new()),
            declaring: Mutex::new(HashMap::new()),
            deleting: Mutex::new(HashMap::new()),
            members: Mutex::new(HashMap::new()),
            started: std::time::Instant::now(),
            unbound: Mutex::new(Vec::new()),
            config,
        });
        tokio::spawn(crate::tcp::serve_tls(
            listener,
            me,
            node.groups.clone(),
            node.secret.clone(),
            node.config.tls.as_ref().map(|t| t.acceptor.clone()),
        ));
        if number != 0 {
            node.remember_number(number);
            node.broker
                .set_cluster(Arc::clone(&node) as Arc<dyn ClusterHooks>);
        }
        let meta_id = GroupId {
            name: META_GROUP.into(),
            incarnation: 0,
        };
        let path = node.config.data_dir.join("meta.redb");
        let mut log = LogStore::open(&path).map_err(|e| NodeError::Log(path.clone(), e))?;
        // What this node's metadata had committed: replayed before it serves clients.
        let committed = openraft::storage::RaftLogStorage::read_committed(&mut log)
            .await
            .map_err(|e| NodeError::Io(e.to_string()))?;
        let state = Arc::new(MetaState {
            records: Mutex::new(BTreeMap::new()),
            node: Arc::downgrade(&node),
        });
        let raft = Raft::new(
            me,
            Arc::clone(&node.raft_config),
            TcpNetwork::new(me, meta_id.clone(), node.secret.clone())
                .resolving(node.addresses.clone()),
            log,
            GroupStateMachine::restored(state, node.config.data_dir.join("meta.snapshot"))
                .map_err(NodeError::Io)?,
        )
        .await
        .map_err(|e| NodeError::Io(e.to_string()))?;
        let proposer = node.groups.insert(meta_id.clone(), raft.clone());
        let _ = node.meta_forwarder.set(Forwarder::start(
            Arc::downgrade(&node),
            meta_id.clone(),
            raft.clone(),
            proposer,
        ));
        // Metadata changes peers forward here go on to the leader (a joining node's seed
        // may be a follower).
        let weak = Arc::downgrade(&node);
        node.groups.set_relay(
            &meta_id,
            Arc::new(move |f: Forwarded| {
                let (tx, rx) = tokio::sync::oneshot::channel();
                match weak.upgrade().and_then(|n| n.meta_forwarder.get().cloned()) {
                    Some(forwarder) => send_retrying(
                        forwarder,
                        f,
                        false,
                        std::time::Instant::now() + RETRY_FOR,
                        0,
                        Box::new(move |r| {
                            let _ = tx.send(r.map(|_| Vec::new()).map_err(|e| match e {
                                ReplicationError::Unavailable => ProposeError::NotLeader(None),
                                ReplicationError::Unknown(s) => ProposeError::Unknown(s),
                            }));
                        }),
                    ),
                    None => {
                        let _ = tx.send(Err(ProposeError::Stopped));
                    }
                }
                rx
            }),
        );
        let _ = node.meta.set(raft.clone());
        let lowest = node
            .config
            .peers
            .iter()
            .map(|p| node_id(&p.name))
            .min()
            .unwrap_or(me);
        if lowest == me && !node.config.join {
            // The first start of the cluster; afterwards the log says it is initialised.
            if let Err(e) = raft.initialize(node.all_members()).await {
                tracing::debug!(error = %e, "metadata group already initialised");
            }
            // Records of every founding node, for nodes that join while some never started.
            for (id, m) in node.current() {
                if id != me {
                    node.propose_node(&m);
                }
            }
        }
        tokio::spawn(watch_peers(Arc::downgrade(&node)));
        node.replay(&raft, committed.map(|l| l.index)).await;
        if node.config.join {
            node.join().await;
            node.broker
                .set_cluster(Arc::clone(&node) as Arc<dyn ClusterHooks>);
        } else {
            // The cluster's record of this node (its address and number), for nodes that
            // join later; the same every start.
            if let Some(m) = node.member(me) {
                node.propose_node(&m);
            }
        }
        tracing::info!(
            node = %node.config.name,
            listen = %node.config.listen,
            peers = node.config.peers.len(),
            "cluster node started"
        );
        Ok(node)
    }

    /// Wait until the metadata this node had committed is applied again and the quorum queues
    /// it names are served here (so a client of a node that restarted, even the whole
    /// cluster at once, finds its queues, exchanges and users as they were).
    async fn replay(&self, raft: &Raft<QueueRaft>, committed: Option<u64>) {
        if let Some(index) = committed {
            let mut metrics = raft.metrics();
            let applied = tokio::time::timeout(REPLAY_MAX, async {
                loop {
                    if metrics
                        .borrow()
                        .last_applied
                        .is_some_and(|l| l.index >= index)
                    {
                        return;
                    }
                    if metrics.changed().await.is_err() {
                        return;
                    }
                }
            })
            .await;
            if applied.is_err() {
                tracing::warn!(index, "metadata replay is slow; serving meanwhile");
            }
        }
        let serving = self
            .booting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .unwrap_or_default();
        for task in serving {
            let _ = tokio::time::timeout(REPLAY_MAX, task).await;
        }
    }

    /// The nodes of the cluster (not forgotten), by id.
    fn current(&self) -> Vec<(NodeId, Member)> {
        self.registry
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(_, m)| !m.forgotten)
            .map(|(id, m)| (*id, m.clone()))
            .collect()
    }

    fn member(&self, id: NodeId) -> Option<Member> {
        self.registry
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&id)
            .cloned()
    }

    fn is_forgotten(&self, id: NodeId) -> bool {
        self.member(id).is_some_and(|m| m.forgotten)
    }

    /// This node's number (0 while it joins).
    fn number(&self) -> u64 {
        self.number.load(std::sync::atomic::Ordering::Acquire)
    }

    fn remember_number(&self, number: u64) {
        let path = self.config.data_dir.join("node-number");
        if stored_number(&self.config.data_dir) != Some(number)
            && let Err(e) = std::fs::write(&path, number.to_string())
        {
            tracing::warn!(path = %path.display(), error = %e, "cannot store the node number");
        }
    }

    fn all_members(&self) -> BTreeMap<NodeId, BasicNode> {
        self.current()
            .into_iter()
            .map(|(id, m)| (id, BasicNode::new(m.addr)))
            .collect()
    }

    fn peer_name(&self, id: NodeId) -> Option<String> {
        self.member(id).map(|m| m.name)
    }

    /// Propose the cluster's record of node `m` (idempotent).
    fn propose_node(&self, m: &Member) {
        let change = MetaChange::Node {
            name: m.name.clone(),
            addr: m.addr.clone(),
            number: (m.number != 0).then_some(m.number),
            forgotten: false,
        };
        let _ = self.commit_meta(
            change,
            true,
            Box::new(|r| {
                if let Err(e) = r {
                    tracing::warn!(error = %e, "cannot record this node in the cluster");
                }
            }),
        );
    }

    /// Join the cluster through the seeds: ask the metadata leader (found through them) to
    /// record this node, then wait until this node's replica of the metadata knows its
    /// number. Retries until it succeeds: the node serves nothing before.
    async fn join(self: &Arc<Self>) {
        let seeds: Vec<(NodeId, String)> = self
            .config
            .peers
            .iter()
            .filter(|p| p.name != self.config.name)
            .map(|p| (node_id(&p.name), p.addr.clone()))
            .collect();
        let Some(own) = self.member(self.me) else {
            return;
        };
        let meta = GroupId {
            name: META_GROUP.into(),
            incarnation: 0,
        };
        let request = MetaChange::Node {
            name: own.name.clone(),
            addr: own.addr.clone(),
            number: None,
            forgotten: false,
        };
        let mut next = 0;
        while self.number() == 0 && !seeds.is_empty() {
            let (id, addr) = &seeds[next % seeds.len()];
            next += 1;
            let link = tokio::time::timeout(
                LINK_OPEN_MAX,
                ForwardLink::open(
                    self.me,
                    *id,
                    meta.clone(),
                    addr.clone(),
                    self.secret.clone(),
                    self.addresses.tls(),
                ),
            )
            .await
            .unwrap_or_else(|_| Err(crate::tcp::TransportError::Frame("no answer".into())));
            let outcome = match link {
                Ok(mut link) => {
                    let rx = link
                        .send(Forwarded {
                            commands: Vec::new(),
                            meta: vec![request.clone()],
                        })
                        .await;
                    let reply = tokio::time::timeout(FORWARD_REPLY_MAX, rx)
                        .await
                        .unwrap_or_else(|_| Ok(Err("no answer in time".into())));
                    match reply {
                        Ok(Ok(Ok(_))) => Ok(()),
                        Ok(Ok(Err(ProposeError::NotLeader(Some(leader))))) => {
                            // Ask the leader next, when it is one of the seeds.
                            if let Some(i) = seeds.iter().position(|(s, _)| *s == leader) {
                                next = i;
                            }
                            Err("not the metadata leader".to_string())
                        }
                        Ok(Ok(Err(e))) => Err(e.to_string()),
                        Ok(Err(e)) => Err(e),
                        Err(e) => Err(e.to_string()),
                    }
                }
                Err(e) => Err(e.to_string()),
            };
            match outcome {
                Ok(()) => {
                    tracing::info!(seed = %addr, "join recorded; catching up");
                    break;
                }
                Err(e) => {
                    tracing::info!(seed = %addr, error = %e, "join: trying again");
                    tokio::time::sleep(JOIN_RETRY).await;
                }
            }
        }
        // The metadata leader adds this node as a learner, then a voter; this node's number
        // arrives with the log.
        loop {
            let notified = self.numbered.notified();
            if self.number() != 0 {
                break;
            }
            notified.await;
        }
        tracing::info!(number = self.number(), "joined the cluster");
    }

    /// A committed node record: update the registry and the addresses; as the metadata
    /// leader, add a new node to the group or remove a forgotten one.
    fn on_node(&self, name: &str, addr: &str, number: u64, forgotten: bool) {
        let id = node_id(name);
        self.registry
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                id,
                Member {
                    name: name.to_string(),
                    addr: addr.to_string(),
                    number,
                    forgotten,
                },
            );
        if !forgotten && id != self.me {
            // This node's own --peers address for a peer wins over the record's.
            if self.config.peers.iter().all(|p| p.name != name) {
                self.addresses.insert(id, addr.to_string());
            }
        }
        if id == self.me && self.number() == 0 && !forgotten {
            self.number
                .store(number, std::sync::atomic::Ordering::Release);
            self.remember_number(number);
            self.numbered.notify_waiters();
        }
        reconcile_meta(self);
    }

    /// The incarnation of the replicated queue `queue` served here.
    fn incarnation_of(&self, queue: &Arc<Queue>) -> Option<u64> {
        self.queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .find(|(_, r)| Arc::ptr_eq(&r.queue, queue))
            .map(|(i, _)| *i)
    }

    /// A queue's members as the metadata group last set them.
    fn members_of(&self, incarnation: u64) -> Vec<NodeId> {
        let mut members = self
            .members
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&incarnation)
            .cloned()
            .unwrap_or_default();
        members.retain(|id| !self.is_forgotten(*id));
        members
    }

    fn peer_number(&self, id: NodeId) -> Option<u64> {
        self.member(id).map(|m| m.number).filter(|n| *n != 0)
    }

    /// The members of a new group of `size`: the nodes ranking highest for this incarnation
    /// (rendezvous hashing spreads groups, and so leaders, over the nodes).
    fn place(&self, incarnation: u64, size: usize, balanced: bool) -> Vec<NodeId> {
        let mut ranked: Vec<(u64, NodeId)> = self
            .current()
            .into_iter()
            .map(|(id, _)| (node_id(&format!("{incarnation}/{id}")), id))
            .collect();
        ranked.sort_unstable();
        let mut members: Vec<NodeId> = ranked
            .into_iter()
            .take(size.max(1))
            .map(|(_, id)| id)
            .collect();
        // The first member starts the group and so leads it first: RabbitMQ's leader
        // locator chooses which.
        let leader = if balanced {
            let led = self.leaders_per_node();
            members
                .iter()
                .copied()
                .min_by_key(|m| (led.get(m).copied().unwrap_or(0), *m))
        } else {
            // client-local: this node, the declaring client's, is a member and leads.
            if !members.contains(&self.me) {
                members.pop();
                members.push(self.me);
            }
            Some(self.me)
        };
        if let Some(leader) = leader
            && let Some(at) = members.iter().position(|m| *m == leader)
        {
            members.swap(0, at);
        }
        members
    }

    /// How many quorum queues each node leads, as this node's replicas see it.
    fn leaders_per_node(&self) -> HashMap<NodeId, usize> {
        let mut led = HashMap::new();
        for r in self.replicas() {
            if let Some(l) = r
                .raft
                .get()
                .and_then(|raft| raft.metrics().borrow().current_leader)
            {
                *led.entry(l).or_insert(0) += 1;
            }
        }
        led
    }

    /// A metadata change committed: serve or drop the queue here.
    fn on_meta(self: &Arc<Self>, change: &MetaChange) {
        match change {
            MetaChange::DeclareQueue {
                key,
                value,
                incarnation,
                members,
            } => {
                self.members
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .entry(*incarnation)
                    .or_insert_with(|| members.clone());
                let node = Arc::clone(self);
                let (key, value, incarnation, members) =
                    (key.clone(), value.clone(), *incarnation, members.clone());
                let task = tokio::spawn(async move {
                    let done = take_waiting(&node.declaring, incarnation);
                    let r = node.serve_queue(&key, &value, incarnation, &members).await;
                    if let Err(e) = &r {
                        tracing::error!(incarnation, error = %e, "cannot serve a quorum queue");
                    }
                    if let Some(done) = done {
                        done(r.map(|()| Vec::new()).map_err(|e| {
                            Arc::new(warren_store::StoreError::Replication(e.to_string()))
                        }));
                    }
                });
                if let Some(waiting) = self
                    .booting
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .as_mut()
                {
                    waiting.push(task);
                }
            }
            MetaChange::DeleteQueue { incarnation, .. } => {
                self.members
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(incarnation);
                let replica = self
                    .queues
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(incarnation);
                if let Some(replica) = replica {
                    if let Some(vh) = self.broker.vhost(&replica.queue.vhost) {
                        vh.drop_replicated(&replica.queue);
                    }
                    let gid = replica.group.clone();
                    self.groups.remove(&gid);
                    let raft = replica.raft.get().cloned();
                    let path = self.queue_log_path(*incarnation);
                    tokio::spawn(async move {
                        if let Some(raft) = raft {
                            let _ = raft.shutdown().await;
                        }
                        // The log of a deleted incarnation is never read again.
                        let _ = std::fs::remove_file(path.with_extension("snapshot"));
                        let _ = std::fs::remove_file(path);
                    });
                }
                let done = take_waiting(&self.deleting, *incarnation);
                if let Some(done) = done {
                    done(Ok(Vec::new()));
                }
            }
            MetaChange::Node {
                name,
                addr,
                number,
                forgotten,
            } => self.on_node(name, addr, number.unwrap_or(0), *forgotten),
            MetaChange::SetMembers {
                incarnation,
                members,
                ..
            } => {
                self.members
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(*incarnation, members.clone());
                if let Some(replica) = self.replica_of(*incarnation)
                    && replica.is_leader()
                {
                    reconcile_members(self, &replica);
                }
            }
            MetaChange::Topology(change) => {
                if warren_broker::replication::apply_topology(&self.broker, change).is_ok() {
                    if matches!(change, TopologyChange::DeclareExchange { .. }) {
                        self.retry_topology();
                    }
                } else if matches!(change, TopologyChange::Bind { .. }) {
                    // Its queue or source may not be served here yet (replicas start in tasks
                    // of their own): bound once it is.
                    self.unbound
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(change.clone());
                } else {
                    tracing::debug!(?change, "a topology change that does not apply here");
                }
            }
        }
    }

    /// Where this node keeps its copy of a replicated stream's files.
    fn stream_dir(&self, incarnation: u64) -> PathBuf {
        self.config
            .data_dir
            .join("streams")
            .join(format!("{incarnation:016x}"))
    }

    fn queue_log_path(&self, incarnation: u64) -> PathBuf {
        self.config
            .data_dir
            .join("queues")
            .join(format!("{incarnation:016x}.redb"))
    }

    /// Start this node's replica of a queue group and insert its queue in the vhost.
    async fn serve_queue(
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
        // The queue is a replica before its log replays into it (Raft::new applies what
        // was committed), so replayed deliveries to consumers of elsewhere are left alone.
        let machine = GroupStateMachine::restored(
            Arc::new(QueueApplied {
                queue: Arc::clone(&queue),
            }),
            self.queue_log_path(incarnation).with_extension("snapshot"),
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
        });
        queue.attach_replica(Arc::clone(&replica) as Arc<dyn Replicator>);
        let path = self.queue_log_path(incarnation);
        let log = LogStore::open(&path).map_err(|e| NodeError::Log(path.clone(), e))?;
        let config = if queue.is_stream {
            Arc::clone(&self.stream_raft_config)
        } else {
            Arc::clone(&self.raft_config)
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
        let forwarder =
            Forwarder::start(Arc::downgrade(self), group, raft.clone(), proposer.clone());
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
}

impl ClusterNode {
    /// Apply the bindings that waited for their ends; those still waiting stay.
    fn retry_topology(&self) {
        let waiting =
            std::mem::take(&mut *self.unbound.lock().unwrap_or_else(PoisonError::into_inner));
        let still: Vec<TopologyChange> = waiting
            .into_iter()
            .filter(|c| warren_broker::replication::apply_topology(&self.broker, c).is_err())
            .collect();
        self.unbound
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(still);
    }
}

impl ClusterHooks for ClusterNode {
    fn node_name(&self) -> &str {
        &self.config.name
    }

    fn node_number(&self) -> u64 {
        self.number()
    }

    fn declare_quorum(&self, queue: Arc<Queue>, done: Completion) {
        let incarnation = self.broker.next_id()
            ^ node_id(&format!(
                "{}/{}/{}",
                queue.vhost,
                queue.name,
                warren_broker::timers::wall_ms()
            ));
        // A stream's initial group size is `x-initial-cluster-size`, as in RabbitMQ.
        let size = queue
            .arguments
            .inner()
            .get("x-quorum-initial-group-size")
            .or_else(|| queue.arguments.inner().get("x-initial-cluster-size"))
            .and_then(warren_broker::args::int_value)
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(GROUP_SIZE_DEFAULT);
        let record = QueueRecord {
            vhost: queue.vhost.clone(),
            name: queue.name.clone(),
            id: 0,
            auto_delete: false,
            arguments: queue.arguments.clone(),
        };
        let warren_store::Op::Put { key, value, .. } = record.put() else {
            unreachable!("a record put is a put");
        };
        let balanced = warren_broker::args::string_arg(&queue.arguments, "x-queue-leader-locator")
            .is_some_and(|l| l != "client-local");
        let change = MetaChange::DeclareQueue {
            key,
            value,
            incarnation,
            members: self.place(incarnation, size, balanced),
        };
        self.declaring
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(incarnation, done);
        self.propose_meta(change, incarnation, true);
    }

    fn replicate_topology(
        &self,
        change: warren_broker::replication::TopologyChange,
        done: Completion,
    ) {
        if let Err(done) = self.commit_meta(MetaChange::Topology(change), false, done) {
            // Not part of a cluster yet: nothing to replicate to.
            done(Ok(Vec::new()));
        }
    }

    fn nodes(&self) -> Vec<NodeStatus> {
        self.current()
            .into_iter()
            .map(|(id, m)| NodeStatus {
                name: m.name,
                running: id == self.me
                    || crate::tcp::silent_for(id).is_some_and(|s| s < DOWN_AFTER),
            })
            .collect()
    }

    fn transfer_leader(&self, queue: &Arc<Queue>, to: &str, done: TransferDone) {
        let id = node_id(to);
        if self.peer_name(id).as_deref() != Some(to) || self.is_forgotten(id) {
            done(Err(TransferError::UnknownNode(to.to_string())));
            return;
        }
        let Some(replica) = self
            .incarnation_of(queue)
            .and_then(|inc| self.replica_of(inc))
        else {
            done(Err(TransferError::NotReplicated));
            return;
        };
        let Some(raft) = replica.raft.get() else {
            done(Err(TransferError::NotReplicated));
            return;
        };
        let (leader, voter) = {
            let m = raft.metrics();
            let m = m.borrow();
            (
                m.current_leader,
                m.membership_config
                    .membership()
                    .voter_ids()
                    .any(|v| v == id),
            )
        };
        if !voter {
            done(Err(TransferError::NotVoter(to.to_string())));
            return;
        }
        let Some(leader) = leader else {
            done(Err(TransferError::NoLeader));
            return;
        };
        if leader == id {
            done(Ok(to.to_string()));
            return;
        }
        let Some(node) = self.weak_self().upgrade() else {
            done(Err(TransferError::Failed("the node is stopping".into())));
            return;
        };
        tokio::spawn(async move {
            let outcome = if leader == node.me {
                node.lead_transfer(replica.group.incarnation, id).await
            } else if let Some(call) = node.peer_call(&replica, leader) {
                // The leader may wait out its lease, hold its log, wait out the others'
                // leases (groups of more than three) and the election.
                let lease = Duration::from_millis(node.raft_config.election_timeout_max);
                let answer_max =
                    2 * (lease + TRANSFER_MARGIN + HOLD_MAX) + TRANSFER_MAX + LINK_OPEN_MAX;
                match tokio::time::timeout(answer_max, crate::tcp::request_transfer(call, id)).await
                {
                    Ok(Ok(Ok(new))) => Ok(new),
                    Ok(Ok(Err(reason))) => Err(TransferError::Failed(reason)),
                    Ok(Err(e)) => Err(TransferError::Failed(format!(
                        "cannot reach the leader: {e}"
                    ))),
                    Err(_) => Err(TransferError::Failed(
                        "the leader did not answer in time".into(),
                    )),
                }
            } else {
                Err(TransferError::Failed(
                    "the leader's address is unknown".into(),
                ))
            };
            done(outcome.map(|new| node.name_of(new)));
        });
    }

    fn forget_node(&self, name: &str, done: Completion) -> Result<(), MembershipError> {
        let id = node_id(name);
        let known = self
            .member(id)
            .filter(|m| m.name == name && !m.forgotten)
            .ok_or_else(|| MembershipError::UnknownNode(name.to_string()))?;
        if id == self.me || crate::tcp::silent_for(id).is_some_and(|s| s < DOWN_AFTER) {
            return Err(MembershipError::Running(name.to_string()));
        }
        let change = MetaChange::Node {
            name: known.name,
            addr: known.addr,
            number: None,
            forgotten: true,
        };
        self.commit_meta(change, true, done)
            .map_err(|_| MembershipError::NotReplicated)
    }

    fn change_members(
        &self,
        queue: &Arc<Queue>,
        change: MemberChange,
        done: Completion,
    ) -> Result<(), MembershipError> {
        let incarnation = self
            .incarnation_of(queue)
            .ok_or(MembershipError::NotReplicated)?;
        let mut members = self.members_of(incarnation);
        let (MemberChange::Add(name) | MemberChange::Delete(name)) = &change;
        let id = node_id(name);
        if self.peer_name(id).as_deref() != Some(name.as_str()) || self.is_forgotten(id) {
            return Err(MembershipError::UnknownNode(name.clone()));
        }
        match change {
            MemberChange::Add(name) => {
                if members.contains(&id) {
                    return Err(MembershipError::AlreadyMember(name));
                }
                members.push(id);
            }
            MemberChange::Delete(name) => {
                if !members.contains(&id) {
                    return Err(MembershipError::NotMember(name));
                }
                if members.len() == 1 {
                    return Err(MembershipError::LastMember);
                }
                members.retain(|m| *m != id);
            }
        }
        let change = MetaChange::SetMembers {
            key: QueueRecord::key(&queue.vhost, &queue.name),
            incarnation,
            members,
        };
        // Setting the same list twice is setting it once.
        self.commit_meta(change, true, done)
            .map_err(|_| MembershipError::NotReplicated)
    }

    fn delete_quorum(&self, queue: &Arc<Queue>, done: Completion) {
        let found = self.incarnation_of(queue);
        let Some(incarnation) = found else {
            done(Ok(Vec::new()));
            return;
        };
        self.deleting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(incarnation, done);
        let change = MetaChange::DeleteQueue {
            key: QueueRecord::key(&queue.vhost, &queue.name),
            incarnation,
        };
        self.propose_meta(change, incarnation, false);
    }
}

impl ClusterNode {
    /// Propose a metadata change, retried across an election (also when its outcome is
    /// unknown if `idempotent`); `done` runs once it committed, or with why not. Gives `done`
    /// back when there is no metadata group to propose to.
    fn commit_meta(
        &self,
        change: MetaChange,
        idempotent: bool,
        done: Completion,
    ) -> Result<(), Completion> {
        let Some(forwarder) = self.meta_forwarder.get() else {
            return Err(done);
        };
        send_retrying(
            forwarder.clone(),
            Forwarded {
                commands: Vec::new(),
                meta: vec![change],
            },
            idempotent,
            std::time::Instant::now() + RETRY_FOR,
            0,
            Box::new(move |r| {
                done(
                    r.map(|_| Vec::new()).map_err(|e| {
                        Arc::new(warren_store::StoreError::Replication(e.to_string()))
                    }),
                );
            }),
        );
        Ok(())
    }

    /// Propose a metadata change; a failure fails the waiting declare or delete.
    fn propose_meta(&self, change: MetaChange, incarnation: u64, declare: bool) {
        // Completions wait until the change applies here; only a failed proposal takes one
        // out early. Retried across an election while nothing was appended, like topology
        // changes (a declare is not repeated when its outcome is unknown).
        let node = self.weak_self();
        let failed: Completion = Box::new(move |r| {
            if let Err(e) = r
                && let Some(node) = node.upgrade()
            {
                let map = if declare {
                    &node.declaring
                } else {
                    &node.deleting
                };
                if let Some(done) = take_waiting(map, incarnation) {
                    done(Err(e));
                }
            }
        });
        let _ = self.commit_meta(change, false, failed);
    }

    /// Where this node dials `peer` for a group run by `raft`: its own `--peers` address,
    /// else the one the group's membership recorded.
    fn peer_addr(&self, raft: &Raft<QueueRaft>, peer: NodeId) -> Option<String> {
        self.addresses.get(peer).or_else(|| {
            raft.metrics()
                .borrow()
                .membership_config
                .membership()
                .get_node(&peer)
                .map(|n| n.addr.clone())
        })
    }

    /// A single request to `peer`'s replica of `replica`'s group (None: no address known).
    fn peer_call(&self, replica: &QueueReplica, peer: NodeId) -> Option<crate::tcp::PeerCall> {
        let raft = replica.raft.get()?;
        Some(crate::tcp::PeerCall {
            from: self.me,
            to: peer,
            group: replica.group.clone(),
            addr: self.peer_addr(raft, peer)?,
            secret: self.secret.clone(),
            tls: self.addresses.tls(),
        })
    }

    /// A node's name for messages (its id if unknown).
    fn name_of(&self, id: NodeId) -> String {
        self.peer_name(id).unwrap_or_else(|| id.to_string())
    }

    /// Every queue replica this node serves (a snapshot: the table is not held).
    fn replicas(&self) -> Vec<Arc<QueueReplica>> {
        self.queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    /// This node's replica of a queue group, by incarnation.
    fn replica_of(&self, incarnation: u64) -> Option<Arc<QueueReplica>> {
        self.queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&incarnation)
            .cloned()
    }

    /// As the leader of a queue group, hand leadership to voter `to`: hold the proposer
    /// (the log stands still and all it proposed has committed), wait until `to` holds every
    /// entry, and ask it to stand for election. In a group of at most three voters this
    /// replica's vote and the target's are a majority: the handover takes milliseconds.
    /// Otherwise (more voters, or this replica no longer one) the other voters abstain and
    /// their leader lease runs out first (openraft's, the maximum election timeout).
    async fn lead_transfer(&self, incarnation: u64, to: NodeId) -> Result<NodeId, TransferError> {
        use std::sync::atomic::Ordering;
        let replica = self
            .replica_of(incarnation)
            .ok_or(TransferError::NotReplicated)?;
        let (Some(raft), Some(proposer)) = (replica.raft.get(), replica.proposer.get()) else {
            return Err(TransferError::NotReplicated);
        };
        {
            let m = raft.metrics();
            let m = m.borrow();
            if m.current_leader != Some(self.me) {
                return Err(TransferError::Failed(format!(
                    "{} does not lead the queue",
                    self.config.name
                )));
            }
            if !m
                .membership_config
                .membership()
                .voter_ids()
                .any(|v| v == to)
            {
                return Err(TransferError::NotVoter(self.name_of(to)));
            }
        }
        if to == self.me {
            return Ok(to);
        }
        // One change of the group at a time (membership changes take the same flag).
        if replica.changing.swap(true, Ordering::AcqRel) {
            return Err(TransferError::Failed(
                "the queue's members are changing".into(),
            ));
        }
        struct Clear<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Clear<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _clear = Clear(&replica.changing);
        // A leader refuses a candidate for a lease after its own election (openraft's leader
        // lease, the maximum election timeout): wait that out rather than have the target
        // campaign in vain (its higher term would then depose this leader anyway).
        let lease = Duration::from_millis(self.raft_config.election_timeout_max);
        let age = raft
            .with_raft_state(|st| st.vote_last_modified().map(|t| t.elapsed()))
            .await
            .map_err(|e| TransferError::Failed(e.to_string()))?;
        if let Some(age) = age
            && age < lease + TRANSFER_MARGIN
        {
            tokio::time::sleep(lease + TRANSFER_MARGIN - age).await;
        }
        let hold = tokio::time::timeout(HOLD_MAX, proposer.hold())
            .await
            .map_err(|_| TransferError::Failed("the log did not settle in time".into()))?
            .map_err(|e| TransferError::Failed(e.to_string()))?;
        let last = raft.metrics().borrow().last_log_index;
        raft.wait(Some(HOLD_MAX))
            .metrics(
                |m| {
                    m.replication
                        .as_ref()
                        .and_then(|r| r.get(&to))
                        .and_then(|l| l.map(|l| l.index))
                        >= last
                },
                "the target holds every entry",
            )
            .await
            .map_err(|_| {
                TransferError::Failed(format!("{} did not catch up in time", self.name_of(to)))
            })?;
        let call = |peer: NodeId| {
            self.peer_call(&replica, peer).ok_or_else(|| {
                TransferError::Failed(format!("no address for {}", self.name_of(peer)))
            })
        };
        // Beyond three voters (or when this replica no longer votes), this replica's vote and
        // the target's are no majority: the others must grant theirs too, which they do only
        // once their leader lease ran out.
        // So they (and the target) abstain, this replica stops its heartbeats, and the
        // target campaigns once every lease is over.
        let voters: Vec<NodeId> = raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .voter_ids()
            .collect();
        let others: Vec<NodeId> = voters.iter().copied().filter(|v| *v != self.me).collect();
        // The fast path needs this replica's vote to count and, with the target's, to be a
        // majority: a voter in a group of at most three.
        let slow = voters.len() > 3 || !voters.contains(&self.me);
        let _resume = if slow {
            let span = lease + TRANSFER_MAX;
            for peer in &others {
                let asked = tokio::time::timeout(
                    LINK_OPEN_MAX,
                    crate::tcp::request_abstain(
                        call(*peer)?,
                        u64::try_from(span.as_millis()).unwrap_or(u64::MAX),
                    ),
                )
                .await;
                if !matches!(asked, Ok(Ok(true))) {
                    resume_elections(call, &others).await;
                    return Err(TransferError::Failed(format!(
                        "{} would not abstain from elections",
                        self.name_of(*peer)
                    )));
                }
            }
            raft.runtime_config().heartbeat(false);
            let guard = Heartbeats(raft.clone());
            tokio::time::sleep(lease + TRANSFER_MARGIN).await;
            Some(guard)
        } else {
            None
        };
        let started = tokio::time::timeout(LINK_OPEN_MAX, crate::tcp::request_campaign(call(to)?))
            .await
            .map_err(|_| TransferError::Failed(format!("{} did not answer", self.name_of(to))))?
            .map_err(|e| {
                TransferError::Failed(format!("cannot reach {}: {e}", self.name_of(to)))
            })?;
        if !started {
            return Err(TransferError::Failed(format!(
                "{} did not stand for election",
                self.name_of(to)
            )));
        }
        let moved = raft
            .wait(Some(TRANSFER_MAX))
            .metrics(
                |m| m.current_leader.is_some_and(|l| l != self.me),
                "leadership moved",
            )
            .await;
        // Commands held meanwhile now go to the new leader (forwarded) or fail as not led.
        drop(hold);
        if slow {
            resume_elections(call, &others).await;
        }
        match moved {
            Ok(m) => {
                let new = m.current_leader.unwrap_or(to);
                tracing::info!(queue = %replica.queue.name, to = %self.name_of(new), "leadership handed over");
                Ok(new)
            }
            Err(_) => Err(TransferError::Failed(
                "no new leader was elected in time".into(),
            )),
        }
    }

    fn weak_self(&self) -> Weak<Self> {
        self.meta_forwarder
            .get()
            .map(|f| f.node.clone())
            .unwrap_or_default()
    }
}

/// Turns a replica's heartbeats back on when dropped (a leader handing over stops them).
struct Heartbeats(Raft<QueueRaft>);

impl Drop for Heartbeats {
    fn drop(&mut self) {
        self.0.runtime_config().heartbeat(true);
    }
}

/// Ask `peers` to take part in elections again (after a handover asked them to abstain);
/// those that do not answer resume by themselves when their abstention runs out.
async fn resume_elections(
    call: impl Fn(NodeId) -> Result<crate::tcp::PeerCall, TransferError>,
    peers: &[NodeId],
) {
    for peer in peers {
        if let Ok(c) = call(*peer) {
            let _ = tokio::time::timeout(LINK_OPEN_MAX, crate::tcp::request_abstain(c, 0)).await;
        }
    }
}

/// The completion of a declare or delete made here, once (None: not made here, or already
/// completed).
fn take_waiting(map: &Mutex<HashMap<u64, Completion>>, incarnation: u64) -> Option<Completion> {
    map.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&incarnation)
}

/// Where the metadata state keeps a node's record.
fn node_key(name: &str) -> Vec<u8> {
    [b"node:".as_slice(), name.as_bytes()].concat()
}

/// A node record as it commits: a join gets the next free number (from 63 down; numbers are
/// never reused, forgotten nodes keep theirs), a founding node keeps its own, a forget keeps
/// the record as a tombstone. None: nothing to record (a forgotten name rejoining, a forget
/// of an unknown node, no number left).
fn resolve_node(
    records: &BTreeMap<Vec<u8>, MetaChange>,
    name: String,
    addr: String,
    number: Option<u64>,
    forgotten: bool,
) -> Option<MetaChange> {
    let existing = match records.get(&node_key(&name)) {
        Some(MetaChange::Node {
            addr,
            number,
            forgotten,
            ..
        }) => Some((addr.clone(), *number, *forgotten)),
        _ => None,
    };
    let (addr, number, forgotten) = match (existing, forgotten) {
        (Some((old, n, _)), true) => (old, n, true),
        (Some((_, _, true)), false) => {
            tracing::warn!(node = %name, "a forgotten node cannot join again under its name");
            return None;
        }
        (Some((_, n, false)), false) => (addr, n.or(number), false),
        (None, true) => return None,
        (None, false) => {
            let n = number.or_else(|| {
                let lowest_joined = records
                    .values()
                    .filter_map(|c| match c {
                        MetaChange::Node {
                            number: Some(n), ..
                        } if *n > FOUNDING_NODES_MAX as u64 => Some(*n),
                        _ => None,
                    })
                    .min()
                    .unwrap_or(64);
                (lowest_joined > FOUNDING_NODES_MAX as u64 + 1).then(|| lowest_joined - 1)
            });
            if n.is_none() {
                tracing::error!(node = %name, "no node number left: the join is refused");
                return None;
            }
            (addr, n, false)
        }
    };
    Some(MetaChange::Node {
        name,
        addr,
        number,
        forgotten,
    })
}

/// The node number this data directory was given, if any.
fn stored_number(data_dir: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(data_dir.join("node-number"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .filter(|n| *n > 0 && *n < 64)
}

/// Where the metadata state keeps a queue's later member list (beside its record, which keeps
/// the members it was declared with: those initialise the group, once).
fn members_key(queue_key: &[u8]) -> Vec<u8> {
    [b"members:".as_slice(), queue_key].concat()
}

/// The metadata group's state: the quorum queue records.
struct MetaState {
    records: Mutex<BTreeMap<Vec<u8>, MetaChange>>,
    node: Weak<ClusterNode>,
}

impl Applied for MetaState {
    fn apply(&self, _at: u64, request: QueueRequest) -> QueueResponse {
        let node = self.node.upgrade();
        let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        for change in request.meta {
            let change = match change {
                MetaChange::Node {
                    name,
                    addr,
                    number,
                    forgotten,
                } => match resolve_node(&records, name, addr, number, forgotten) {
                    Some(resolved) => resolved,
                    None => continue,
                },
                other => other,
            };
            match &change {
                MetaChange::Node { name, .. } => {
                    records.insert(node_key(name), change.clone());
                }
                MetaChange::DeclareQueue { key, .. } => {
                    if records.contains_key(key) {
                        // Declared twice concurrently: the first commit wins, and the
                        // second declare waits for nothing.
                        continue;
                    }
                    records.insert(key.clone(), change.clone());
                }
                MetaChange::DeleteQueue { key, incarnation } => {
                    let current = matches!(
                        records.get(key),
                        Some(MetaChange::DeclareQueue { incarnation: i, .. }) if i == incarnation
                    );
                    if current {
                        records.remove(key);
                        records.remove(&members_key(key));
                    }
                }
                MetaChange::SetMembers {
                    key, incarnation, ..
                } => {
                    let current = matches!(
                        records.get(key),
                        Some(MetaChange::DeclareQueue { incarnation: i, .. }) if i == incarnation
                    );
                    if !current {
                        // The queue was deleted (or re-declared) meanwhile.
                        continue;
                    }
                    records.insert(members_key(key), change.clone());
                }
                MetaChange::Topology(t) => {
                    // What a snapshot must carry: the exchanges and bindings that stand.
                    if t.is_addition() {
                        records.insert(t.record_key(), change.clone());
                    } else {
                        // A deleted user's or vhost's permissions and policies go with it.
                        records.retain(|k, _| !t.supersedes(k));
                    }
                }
            }
            if let Some(node) = &node {
                node.on_meta(&change);
            }
        }
        QueueResponse::default()
    }

    fn snapshot(&self) -> Result<Vec<u8>, String> {
        let records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        let list: Vec<&MetaChange> = records.values().collect();
        crate::codec::encode(&list).map_err(|e| e.to_string())
    }

    fn install(&self, bytes: &[u8]) -> Result<(), String> {
        let mut list: Vec<MetaChange> = crate::codec::decode(bytes).map_err(|e| e.to_string())?;
        // Definitions (vhosts, users, then what refers to them), queues and exchanges,
        // queues' later members, then the bindings between them.
        list.sort_by_key(|c| match c {
            MetaChange::Node { .. } => 0,
            MetaChange::Topology(t) => 1 + t.rank(),
            MetaChange::SetMembers { .. } => 5,
            _ => 4,
        });
        let node = self.node.upgrade();
        let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        records.clear();
        for change in list {
            let key = match &change {
                MetaChange::DeclareQueue { key, .. } => key.clone(),
                MetaChange::SetMembers { key, .. } => members_key(key),
                MetaChange::Node { name, .. } => node_key(name),
                MetaChange::Topology(t) if t.is_addition() => t.record_key(),
                _ => continue,
            };
            records.insert(key, change.clone());
            if let Some(node) = &node {
                node.on_meta(&change);
            }
        }
        Ok(())
    }
}

/// A quorum queue's state on one replica: the broker's queue, driven by committed entries.
struct QueueApplied {
    queue: Arc<Queue>,
}

impl Applied for QueueApplied {
    fn apply(&self, at: u64, request: QueueRequest) -> QueueResponse {
        let commands: Vec<Command<Entry>> = request
            .commands
            .into_iter()
            .filter_map(|c| {
                c.try_map(|m| decode_entry(&m.body))
                    .map_err(|e| {
                        // Checksummed and identical on every replica: all skip it alike.
                        tracing::error!(queue = %self.queue.name, error = %e, "undecodable entry");
                    })
                    .ok()
            })
            .collect();
        let replies = self.queue.apply_committed(at, commands);
        QueueResponse {
            replies: replies
                .into_iter()
                .map(|r| r.map(|reply| reply.try_map(|e| wire(&e)).unwrap_or(Reply::Ok)))
                .collect(),
        }
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

    fn install(&self, bytes: &[u8]) -> Result<(), String> {
        if let Some(stream) = self.queue.stream() {
            let snapshot: warren_broker::queue::stream::StreamSnapshot =
                crate::codec::decode(bytes).map_err(|e| e.to_string())?;
            return stream.install(snapshot).map_err(|e| e.to_string());
        }
        let machine: QueueMachine<Entry> =
            crate::codec::decode(bytes).map_err(|e| e.to_string())?;
        self.queue.install_machine(machine);
        Ok(())
    }

    fn expands(&self) -> bool {
        self.queue.is_stream
    }

    fn expand(&self, state: &[u8]) -> Result<Vec<u8>, String> {
        let Some(stream) = self.queue.stream() else {
            return Ok(state.to_vec());
        };
        let snapshot: warren_broker::queue::stream::StreamSnapshot =
            crate::codec::decode(state).map_err(|e| e.to_string())?;
        let full = stream.expand(snapshot).map_err(|e| e.to_string())?;
        crate::codec::encode(&full).map_err(|e| e.to_string())
    }
}

/// An entry's message as the log carries it.
fn wire(entry: &Entry) -> Result<ReplicatedMessage, warren_broker::replication::DecodeError> {
    use warren_broker::queue::machine::MessageRef;
    Ok(ReplicatedMessage {
        body: encode_entry(entry)?,
        priority: entry.priority(),
        expiration_ms: entry.expiration_ms(),
    })
}

/// One quorum queue's replica on this node: the broker's [`Replicator`].
struct QueueReplica {
    node: Weak<ClusterNode>,
    group: GroupId,
    /// Set once the group's Raft instance is up (after its log replayed into the queue).
    raft: OnceLock<Raft<QueueRaft>>,
    /// Set with `raft`; submissions before it fail as unavailable.
    forwarder: OnceLock<Forwarder>,
    /// Set with `raft`: the leader-side batcher (held while leadership is handed over).
    proposer: OnceLock<Proposer>,
    queue: Arc<Queue>,
    /// The state machine the group applies into (a clone sharing it), read for
    /// [`Replicator::replica_state`].
    machine: GroupStateMachine<QueueApplied>,
    /// Set while this replica, as leader, is changing the group's voters.
    changing: std::sync::atomic::AtomicBool,
    /// Nodes whose consumers this replica (as leader) already returned, until heard again.
    downed: Mutex<Vec<NodeId>>,
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
        let Some(forwarder) = self.forwarder.get() else {
            done(Err(ReplicationError::Unavailable));
            return;
        };
        // Acks, returns, cancels and the like change nothing when applied twice, so they are
        // retried even when an attempt's outcome is unknown; anything is retried when
        // nothing was appended. A consumer whose ack was lost would otherwise hold the
        // message until its node goes down.
        let idempotent = wired.iter().all(|c| {
            !matches!(
                c,
                Command::Enqueue(_)
                    | Command::Get { .. }
                    | Command::Purge
                    | Command::Restore { .. }
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

    fn is_leader(&self) -> bool {
        let (Some(node), Some(raft)) = (self.node.upgrade(), self.raft.get()) else {
            return false;
        };
        raft.metrics().borrow().current_leader == Some(node.me)
    }

    fn local_node(&self) -> u64 {
        self.node.upgrade().map_or(0, |n| n.number())
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
            .filter(|id| {
                **id == node.me || crate::tcp::silent_for(**id).is_some_and(|s| s < DOWN_AFTER)
            })
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

/// A hash of a queue machine's canonical rendering (maps in key order): replicas at the same
/// applied index must have the same.
fn digest<M: serde::Serialize>(machine: &M) -> String {
    let text = serde_json::to_value(machine)
        .map(|v| v.to_string())
        .unwrap_or_default();
    format!("{:016x}", fnv1a(text.as_bytes()))
}

/// How long a submission is retried across an election before it fails.
pub const RETRY_FOR: Duration = Duration::from_secs(15);
/// The pause between attempts.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// Send `f`, again after a pause while it failed and may be retried (see
/// [`QueueReplica::submit`]), until `deadline`.
fn send_retrying(
    forwarder: Forwarder,
    f: Forwarded,
    idempotent: bool,
    deadline: std::time::Instant,
    attempt: u32,
    done: ForwardDone,
) {
    let again = f.clone();
    let next = forwarder.clone();
    forwarder.send(
        f,
        Box::new(move |r| {
            let retry = match &r {
                Err(ReplicationError::Unavailable) => true,
                Err(ReplicationError::Unknown(_)) => idempotent,
                Ok(_) => false,
            };
            if retry && std::time::Instant::now() < deadline {
                // On the node's runtime: a submission may come from the timer thread.
                let runtime = next.runtime.clone();
                runtime.spawn(async move {
                    tokio::time::sleep(RETRY_PAUSE).await;
                    send_retrying(next, again, idempotent, deadline, attempt + 1, done);
                });
                return;
            }
            let r = r.map(|replies| {
                if attempt == 0 {
                    return replies;
                }
                // A retried checkout that had in fact committed before finds itself there.
                replies
                    .into_iter()
                    .map(|reply| match reply {
                        Err(ProposeError::Refused(MachineError::DuplicateConsumer)) => {
                            Ok(Reply::Ok)
                        }
                        other => other,
                    })
                    .collect()
            });
            done(r);
        }),
    );
}

/// Called once with the leader's replies to a forwarded request.
type ForwardDone = Box<dyn FnOnce(Result<crate::tcp::ForwardReplies, ReplicationError>) + Send>;

/// Sends a group's submissions to its leader, in submission order: proposed here when this
/// replica leads, else batched into forward requests to the leader (one in flight).
#[derive(Clone)]
struct Forwarder {
    tx: mpsc::Sender<(Forwarded, ForwardDone)>,
    node: Weak<ClusterNode>,
    runtime: tokio::runtime::Handle,
}

impl Forwarder {
    fn start(
        node: Weak<ClusterNode>,
        group: GroupId,
        raft: Raft<QueueRaft>,
        proposer: Proposer,
    ) -> Self {
        let (tx, rx) = mpsc::channel(FORWARD_QUEUE_MAX);
        tokio::spawn(forward_loop(node.clone(), group, raft, proposer, rx));
        Self {
            tx,
            node,
            runtime: tokio::runtime::Handle::current(),
        }
    }

    /// Queue `f`; a full queue fails it at once (the caller nacks), never blocks.
    fn send(&self, f: Forwarded, done: ForwardDone) {
        if let Err(e) = self.tx.try_send((f, done)) {
            let (_, done) = e.into_inner();
            done(Err(ReplicationError::Unavailable));
        }
    }
}

async fn forward_loop(
    node: Weak<ClusterNode>,
    group: GroupId,
    raft: Raft<QueueRaft>,
    proposer: Proposer,
    mut rx: mpsc::Receiver<(Forwarded, ForwardDone)>,
) {
    let mut links: HashMap<NodeId, ForwardLink> = HashMap::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(FORWARDS_IN_FLIGHT_MAX));
    let mut held: Option<(Forwarded, ForwardDone)> = None;
    loop {
        let first = match held.take() {
            Some(item) => item,
            None => match rx.recv().await {
                Some(item) => item,
                None => return,
            },
        };
        let mut batch = vec![first];
        let mut count = batch[0].0.commands.len();
        // Metadata changes go one at a time; commands batch up to the limit.
        while batch[0].0.meta.is_empty() && count < FORWARD_BATCH_MAX {
            match rx.try_recv() {
                Ok(item) if item.0.meta.is_empty() => {
                    count += item.0.commands.len();
                    batch.push(item);
                }
                Ok(item) => {
                    held = Some(item);
                    break;
                }
                Err(_) => break,
            }
        }
        let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        send_batch(&node, &group, &raft, &proposer, &mut links, batch, permit).await;
    }
}

/// Send one batch to the leader (this replica, or a peer over a pipelined link) and hand the
/// replies out in a task of their own, so the next batch goes while this one commits.
/// Batches are staged in order, so their commands are applied in submission order.
async fn send_batch(
    node: &Weak<ClusterNode>,
    group: &GroupId,
    raft: &Raft<QueueRaft>,
    proposer: &Proposer,
    links: &mut HashMap<NodeId, ForwardLink>,
    batch: Vec<(Forwarded, ForwardDone)>,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    let Some(me) = node.upgrade().map(|n| n.me) else {
        return;
    };
    let mut lengths = Vec::with_capacity(batch.len());
    let mut request = Forwarded {
        commands: Vec::new(),
        meta: Vec::new(),
    };
    let mut dones = Vec::with_capacity(batch.len());
    for (f, done) in batch {
        lengths.push(f.commands.len());
        request.commands.extend(f.commands);
        request.meta.extend(f.meta);
        dones.push(done);
    }
    let meta = !request.meta.is_empty();
    let finish = move |outcome: Result<crate::tcp::ForwardReplies, ReplicationError>| {
        drop(permit);
        match outcome {
            Ok(replies) if !meta => {
                let mut replies = replies.into_iter();
                for (done, n) in dones.into_iter().zip(lengths) {
                    done(Ok(replies.by_ref().take(n).collect()));
                }
            }
            Ok(_) => {
                for done in dones {
                    done(Ok(Vec::new()));
                }
            }
            Err(e) => {
                for done in dones {
                    done(Err(e.clone()));
                }
            }
        }
    };
    let Some(mut leader) = wait_for_leader(raft).await else {
        finish(Err(ReplicationError::Unavailable));
        return;
    };
    if leader == me && proposer.is_held() {
        // This replica is handing its leadership over: wait, then send to whoever leads
        // (this batcher is sequential, so submission order holds across the move).
        proposer.unheld().await;
        let Some(now) = wait_for_leader(raft).await else {
            finish(Err(ReplicationError::Unavailable));
            return;
        };
        leader = now;
    }
    if leader == me {
        let staged = crate::tcp::stage_here(raft, proposer, request).await;
        tokio::spawn(async move {
            finish(staged.replies().await.map_err(unknown));
        });
        return;
    }
    if links.get(&leader).is_some_and(ForwardLink::is_broken) {
        links.remove(&leader);
    }
    let link = match links.entry(leader) {
        std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => {
            let addr = node.upgrade().and_then(|n| n.peer_addr(raft, leader));
            let Some(addr) = addr else {
                finish(Err(ReplicationError::Unavailable));
                return;
            };
            let tls = node.upgrade().and_then(|n| n.addresses.tls());
            let opened = tokio::time::timeout(
                LINK_OPEN_MAX,
                ForwardLink::open(me, leader, group.clone(), addr, node_secret(node), tls),
            )
            .await;
            match opened {
                Ok(Ok(link)) => v.insert(link),
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "cannot reach the leader");
                    // Nothing was sent.
                    finish(Err(ReplicationError::Unavailable));
                    return;
                }
                Err(_) => {
                    tracing::debug!("the leader does not answer");
                    finish(Err(ReplicationError::Unavailable));
                    return;
                }
            }
        }
    };
    let breaker = link.breaker();
    // A socket whose peer stopped reading (a black hole) fills up: the write must not hang.
    let Ok(rx) = tokio::time::timeout(LINK_OPEN_MAX, link.send(request)).await else {
        breaker.abort();
        finish(Err(ReplicationError::Unknown(
            "the leader does not take requests".into(),
        )));
        return;
    };
    tokio::spawn(async move {
        let outcome = match tokio::time::timeout(FORWARD_REPLY_MAX, rx).await {
            Ok(Ok(Ok(r))) => r.map_err(unknown),
            Ok(Ok(Err(e))) => Err(ReplicationError::Unknown(e)),
            Ok(Err(e)) => Err(ReplicationError::Unknown(e.to_string())),
            Err(_) => {
                breaker.abort();
                Err(ReplicationError::Unknown(
                    "the leader did not answer in time".into(),
                ))
            }
        };
        finish(outcome);
    });
}

/// A leader's refusal as the broker sees it: nothing appended (NotLeader) or unknown.
fn unknown(e: ProposeError) -> ReplicationError {
    match e {
        ProposeError::NotLeader(_) => ReplicationError::Unavailable,
        other => ReplicationError::Unknown(other.to_string()),
    }
}

fn node_secret(node: &Weak<ClusterNode>) -> Secret {
    node.upgrade()
        .map_or_else(|| Secret::new(b""), |n| n.secret.clone())
}

/// The group's leader, waiting up to [`LEADER_WAIT`] for one to be elected.
async fn wait_for_leader(raft: &Raft<QueueRaft>) -> Option<NodeId> {
    if let Some(l) = raft.metrics().borrow().current_leader {
        return Some(l);
    }
    let mut metrics = raft.metrics();
    tokio::time::timeout(LEADER_WAIT, async {
        loop {
            if let Some(l) = metrics.borrow().current_leader {
                return Some(l);
            }
            if metrics.changed().await.is_err() {
                return None;
            }
        }
    })
    .await
    .ok()
    .flatten()
}

/// As the metadata group's leader: make the group's voters the cluster's nodes, one change at
/// a time. A forgotten node is removed; a node that joined is added as a learner, caught up,
/// then made a voter (so it never stalls the majority). Founding nodes are voters from the
/// start.
fn reconcile_meta(node: &ClusterNode) {
    use std::sync::atomic::Ordering;
    let Some(raft) = node.meta.get().cloned() else {
        return;
    };
    let voters: std::collections::BTreeSet<NodeId> = {
        let m = raft.metrics();
        let m = m.borrow();
        if m.current_leader != Some(node.me) {
            return;
        }
        m.membership_config.membership().voter_ids().collect()
    };
    let gone: std::collections::BTreeSet<NodeId> = voters
        .iter()
        .copied()
        .filter(|id| node.is_forgotten(*id))
        .collect();
    let new: Vec<(NodeId, String)> = node
        .current()
        .into_iter()
        .filter(|(id, _)| !voters.contains(id))
        .map(|(id, m)| (id, m.addr))
        .collect();
    if (gone.is_empty() && new.is_empty()) || node.meta_changing.swap(true, Ordering::AcqRel) {
        return;
    }
    let changing = node.weak_self();
    tokio::spawn(async move {
        let r = if gone.is_empty() {
            let mut r = Ok(());
            for (id, addr) in new {
                let added = match raft.add_learner(id, BasicNode::new(addr), true).await {
                    Ok(_) => raft
                        .change_membership(
                            openraft::ChangeMembers::AddVoterIds([id].into_iter().collect()),
                            false,
                        )
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                if added.is_err() {
                    r = added;
                    break;
                }
                tracing::info!(node = id, "a node joined the metadata group");
            }
            r
        } else {
            raft.change_membership(openraft::ChangeMembers::RemoveVoters(gone.clone()), false)
                .await
                .map(|_| tracing::info!(nodes = ?gone, "forgotten nodes left the metadata group"))
                .map_err(|e| e.to_string())
        };
        if let Err(e) = r {
            tracing::warn!(error = %e, "changing the metadata group");
        }
        if let Some(node) = changing.upgrade() {
            node.meta_changing.store(false, Ordering::Release);
        }
    });
}

/// As a queue's leader: every node that is neither voter nor learner yet becomes a learner.
fn add_learners(node: &ClusterNode, replica: &QueueReplica) {
    let Some(raft) = replica.raft.get() else {
        return;
    };
    let known: Vec<NodeId> = raft
        .metrics()
        .borrow()
        .membership_config
        .nodes()
        .map(|(id, _)| *id)
        .collect();
    for (id, peer) in node.current() {
        if known.contains(&id) {
            continue;
        }
        let (raft, addr) = (raft.clone(), peer.addr.clone());
        tokio::spawn(async move {
            if let Err(e) = raft.add_learner(id, BasicNode::new(addr), false).await {
                tracing::debug!(error = %e, "adding a learner");
            }
        });
    }
}

/// As a queue's leader: make the group's voters the members the metadata group set, when
/// they differ (one change at a time). Nodes to add are made learners first, caught up
/// (`add_learner` blocks until they are), so a new voter never stalls the majority; removed
/// voters stay learners.
fn reconcile_members(node: &ClusterNode, replica: &Arc<QueueReplica>) {
    use std::sync::atomic::Ordering;
    let Some(raft) = replica.raft.get() else {
        return;
    };
    let desired: std::collections::BTreeSet<NodeId> = node
        .members_of(replica.group.incarnation)
        .into_iter()
        .collect();
    let (voters, known): (std::collections::BTreeSet<NodeId>, Vec<NodeId>) = {
        let m = raft.metrics();
        let m = m.borrow();
        let membership = m.membership_config.membership();
        (
            membership.voter_ids().collect(),
            membership.nodes().map(|(id, _)| *id).collect(),
        )
    };
    let forgotten: std::collections::BTreeSet<NodeId> = known
        .iter()
        .copied()
        .filter(|id| !voters.contains(id) && node.is_forgotten(*id))
        .collect();
    if desired.is_empty()
        || (desired == voters && forgotten.is_empty())
        || replica.changing.swap(true, Ordering::AcqRel)
    {
        return;
    }
    if desired == voters {
        // Only learners of forgotten nodes to drop.
        let (raft, replica) = (raft.clone(), Arc::clone(replica));
        tokio::spawn(async move {
            if let Err(e) = raft
                .change_membership(openraft::ChangeMembers::RemoveNodes(forgotten), false)
                .await
            {
                tracing::warn!(queue = %replica.queue.name, error = %e, "dropping forgotten learners");
            }
            replica.changing.store(false, Ordering::Release);
        });
        return;
    }
    let learners: Vec<(NodeId, String)> = desired
        .iter()
        .filter(|id| !known.contains(id))
        .filter_map(|id| node.addresses.get(*id).map(|a| (*id, a)))
        .collect();
    let (raft, replica, weak) = (raft.clone(), Arc::clone(replica), node.weak_self());
    tokio::spawn(async move {
        for (id, addr) in learners {
            if let Err(e) = raft.add_learner(id, BasicNode::new(addr), true).await {
                tracing::debug!(error = %e, "adding a learner before it votes");
            }
        }
        let changed = raft.change_membership(desired.clone(), true).await;
        replica.changing.store(false, Ordering::Release);
        match changed {
            Ok(_) => {
                tracing::info!(queue = %replica.queue.name, members = ?desired, "queue members changed");
            }
            Err(e) => {
                tracing::warn!(queue = %replica.queue.name, error = %e, "changing queue members");
                return;
            }
        }
        // A leader that is no member any more keeps leading as a learner (openraft cannot
        // remove a leader without it stepping down mid-change): hand over to a voter.
        let Some(node) = weak.upgrade() else {
            return;
        };
        if desired.contains(&node.me) || raft.metrics().borrow().current_leader != Some(node.me) {
            return;
        }
        let target = {
            let m = raft.metrics();
            let m = m.borrow();
            // The voter furthest along (it catches up fastest).
            desired.iter().copied().max_by_key(|v| {
                m.replication
                    .as_ref()
                    .and_then(|r| r.get(v).copied().flatten())
                    .map(|l| l.index)
            })
        };
        if let Some(target) = target {
            match node.lead_transfer(replica.group.incarnation, target).await {
                Ok(new) => {
                    tracing::info!(queue = %replica.queue.name, leader = new, "the removed leader handed over")
                }
                Err(e) => {
                    tracing::warn!(queue = %replica.queue.name, error = %e, "the removed leader could not hand over")
                }
            }
        }
    });
}

/// Every second: for each queue this node leads, return what consumers on silent peers held.
async fn watch_peers(weak: Weak<ClusterNode>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut pinged: std::collections::HashSet<NodeId> = std::collections::HashSet::new();
    loop {
        tick.tick().await;
        let Some(node) = weak.upgrade() else {
            return;
        };
        reconcile_meta(&node);
        for (id, _) in node.current() {
            if id == node.me || !pinged.insert(id) {
                continue;
            }
            let alive = weak.clone();
            tokio::spawn(crate::tcp::ping_loop(
                node.me,
                id,
                GroupId {
                    name: META_GROUP.into(),
                    incarnation: 0,
                },
                node.addresses.clone(),
                node.secret.clone(),
                PING_EVERY,
                move || alive.upgrade().is_none_or(|n| n.is_forgotten(id)),
            ));
        }
        for replica in node.replicas() {
            if !replica.is_leader() {
                continue;
            }
            add_learners(&node, &replica);
            reconcile_members(&node, &replica);
            for (id, peer) in node.current() {
                if id == node.me {
                    continue;
                }
                // A peer never heard from since this node started is silent after a while.
                let silent = crate::tcp::silent_for(id).unwrap_or_else(|| node.started.elapsed())
                    > DOWN_AFTER;
                let mut downed = replica
                    .downed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                match (silent, downed.contains(&id)) {
                    (true, false) => {
                        if let Some(number) = node.peer_number(id) {
                            downed.push(id);
                            tracing::info!(queue = %replica.queue.name, peer = %peer.name, "peer silent: returning what its consumers held");
                            replica.submit(
                                vec![Command::Down {
                                    node: number,
                                    before: u64::MAX,
                                }],
                                Box::new(|_| {}),
                            );
                        }
                    }
                    (false, true) => downed.retain(|d| *d != id),
                    _ => {}
                }
            }
        }
    }
}
