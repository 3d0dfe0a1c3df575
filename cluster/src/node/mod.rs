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
//!   the broker's [`Queue`] (see [`warren_broker::node::replication`]).
//! - **Forwarding**: a node submits commands to its replica's [`Forwarder`], which proposes them
//!   here when this replica leads, or sends them to the leader over the cluster port.
//! - **Down nodes**: the leader of each queue returns what consumers on a node held once that
//!   node has been silent for [`DOWN_AFTER`]; a node that starts returns what its previous run
//!   held.
//!
//! The code, by concern (each an `impl ClusterNode` block, or free functions, of its own):
//!
//! - this file: the [`ClusterNode`] type, its shared state and its start;
//! - `config`: the configuration, node ids and the groups' Raft settings;
//! - `membership`: the cluster's nodes, joining, and the metadata group's voters;
//! - `metadata`: the metadata group's state machine and what a committed change does here;
//! - `replicas`: a quorum queue's replica on this node (the broker's `Replicator`);
//! - `placement`: which nodes a queue's group has, and keeping its voters as the metadata says;
//! - `forwarding`: submissions to a group's leader, here or over the cluster port, with retries;
//! - `leadership`: handing a queue's leadership to another voter;
//! - `hooks`: the broker's `ClusterHooks`;
//! - `liveness`: pings, down nodes, and the leaders' periodic reconciliation;
//! - `elections`: the queue groups' liveness, watched once per node (elections, retries).
//!
//! [`MetaChange`]: crate::types::MetaChange
//! [`Queue`]: warren_broker::queue::Queue

mod classic;
mod config;
mod elections;
mod forwarding;
mod hooks;
mod leadership;
mod liveness;
mod membership;
mod metadata;
mod placement;
mod replicas;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use openraft::{Config, Raft};
use warren_broker::Broker;
use warren_broker::node::replication::{ClusterHooks, ReplicationError, TopologyChange};
use warren_store::writer::Completion;

use crate::group::GroupStateMachine;
use crate::log::store::LogStore;
use crate::proposer::ProposeError;
use crate::transport::tcp;
use crate::transport::tcp::{Addresses, Forwarded, GroupId, Groups, Secret, TcpNetwork};
use crate::types::{NodeId, QueueRaft};

pub use config::{
    NodeConfig, NodeError, Peer, QUEUE_LOG_KEEP, QUEUE_LOG_PIN_MAX, SNAPSHOT_INSTALL_TIMEOUT_MS,
    STREAM_SNAPSHOT_EVERY, STREAM_SNAPSHOT_EVERY_ENV, node_id, queue_raft_config, raft_config,
    stream_raft_config,
};
pub use forwarding::{FORWARD_BATCH_MAX, FORWARD_QUEUE_MAX, RETRY_FOR};
pub use placement::GROUP_SIZE_DEFAULT;

pub use crate::log::queue_logs::QueueLogKind;

use forwarding::{Forwarder, Target, send_retrying};
use liveness::watch_peers;
use membership::stored_number;
use metadata::MetaState;
use replicas::QueueReplica;

/// A peer is down once it has been silent this long (several election timeouts).
pub const DOWN_AFTER: Duration = Duration::from_secs(5);
/// Founding nodes are numbered 1 and up from their sorted names, joined nodes from 63 down:
/// at most this many founding nodes, so the two never meet.
pub const FOUNDING_NODES_MAX: usize = 31;
/// How long a request may wait to be queued on a peer's link, and a handover's one-off
/// request for its answer; a peer behind a black hole must not hold a group's forwarder.
const PEER_REQUEST_MAX: Duration = Duration::from_secs(1);
/// How long a forwarded batch waits for the leader's answer before its outcome is unknown
/// (commits take milliseconds, p99 under the ten-queue benchmark about 1.6 s); the link itself
/// breaks on the peer's silence (`tcp::LINK_SILENCE_MAX`).
const FORWARD_REPLY_MAX: Duration = Duration::from_secs(5);
/// The metadata group's name.
const META_GROUP: &str = "$meta";

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
    /// A quorum queue group's ([`queue_raft_config`]).
    queue_raft_config: Arc<Config>,
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
    /// The Raft log every quorum queue group on this node writes to (`queues/raft-log.redb`
    /// or `queues/wal/`).
    queue_logs: Arc<crate::log::queue_logs::QueueLogs>,
    /// Declares made here, waiting for their commit: the queue to serve and the completion.
    declaring: Mutex<HashMap<u64, Completion>>,
    /// Deletes made here, waiting for their commit.
    deleting: Mutex<HashMap<u64, Completion>>,
    /// Declares made here that lost to another node's declare of the same queue.
    declared_after: Mutex<metadata::DeclaredAfter>,
    /// Each quorum queue's members as the metadata group last set them, by incarnation:
    /// what its leader makes the group's voters (see [`reconcile_members`]).
    ///
    /// [`reconcile_members`]: placement::reconcile_members
    members: Mutex<HashMap<u64, Vec<NodeId>>>,
    /// When this node started (a peer not heard from since is silent only after a while).
    started: std::time::Instant,
    /// Committed bindings whose ends this node does not serve yet (bounded by the bindings
    /// the cluster has).
    unbound: Mutex<Vec<TopologyChange>>,
    /// The metadata group's state machine (its records).
    meta_records: OnceLock<Arc<MetaState>>,
    /// The proxies of classic queues held on other nodes, by record key.
    proxies: Mutex<HashMap<Vec<u8>, Arc<classic::RemoteHome>>>,
    /// Per peer: deliveries from the classic queues held here to its consumers.
    pumps: Mutex<HashMap<NodeId, Arc<classic::Pump>>>,
    /// Deletes of classic queues held elsewhere made here, waiting for their commit (by home
    /// and id).
    classic_deleting: Mutex<HashMap<(NodeId, u64), Completion>>,
    /// The peers this node last saw down (their classic queues' consumers were dealt with).
    down_peers: Mutex<std::collections::HashSet<NodeId>>,
    /// Leaders chosen by `place` for queues not yet led (incarnation -> (node, when)): counted
    /// by the balanced locator so queues declared back to back spread (see `placement`).
    placed: Mutex<HashMap<u64, (NodeId, std::time::Instant)>>,
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
        let queue_raft_config = Arc::new(
            queue_raft_config()
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
        let queue_logs = Arc::new(
            crate::log::queue_logs::QueueLogs::open(
                config.queue_log,
                &config.data_dir.join("queues"),
            )
            .map_err(|(path, e)| NodeError::Log(path, e))?,
        );
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
            queue_raft_config,
            stream_raft_config,
            secret: Secret::new(&config.secret),
            broker,
            groups: Groups::default(),
            meta: OnceLock::new(),
            meta_forwarder: OnceLock::new(),
            queues: Mutex::new(HashMap::new()),
            queue_logs,
            declaring: Mutex::new(HashMap::new()),
            declared_after: Mutex::new(metadata::DeclaredAfter::default()),
            deleting: Mutex::new(HashMap::new()),
            members: Mutex::new(HashMap::new()),
            started: std::time::Instant::now(),
            unbound: Mutex::new(Vec::new()),
            meta_records: OnceLock::new(),
            proxies: Mutex::new(HashMap::new()),
            pumps: Mutex::new(HashMap::new()),
            classic_deleting: Mutex::new(HashMap::new()),
            down_peers: Mutex::new(std::collections::HashSet::new()),
            placed: Mutex::new(HashMap::new()),
            config,
        });
        node.groups
            .set_classic(Arc::new(classic::Service(Arc::downgrade(&node))));
        tokio::spawn(tcp::serve_tls(
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
        let _ = node.meta_records.set(Arc::clone(&state));
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
            Target::Group {
                raft: raft.clone(),
                proposer,
            },
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
        tokio::spawn(elections::watch_elections(Arc::downgrade(&node)));
        node.replay(&raft, committed.map(|l| l.index)).await;
        node.reconcile_classic(true);
        tokio::spawn(classic::poll_stats(Arc::downgrade(&node)));
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

    fn weak_self(&self) -> Weak<Self> {
        self.meta_forwarder
            .get()
            .map(|f| f.node.clone())
            .unwrap_or_default()
    }
}
