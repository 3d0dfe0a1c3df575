//! The test cluster shared by the replication tests: nodes of one group in one process on
//! real redb logs, joined by the in-process router.
#![allow(dead_code)] // Each test file uses a part.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use openraft::storage::RaftLogStorage;
use openraft::{BasicNode, Config, Raft};
use tempfile::TempDir;
use warren_broker::queue::machine::{Command, QueueConfig, Reply};
use warren_cluster::log::backend::LogError;
use warren_cluster::log::store::LogStore;
use warren_cluster::state_machine::QueueStateMachine;
use warren_cluster::transport::in_process::Router;
use warren_cluster::types::{NodeId, QueueRaft, QueueRequest, ReplicatedMessage};

pub const WAIT: Duration = Duration::from_secs(10);

pub struct Node {
    pub raft: Raft<QueueRaft>,
    pub sm: QueueStateMachine,
}

pub struct Cluster {
    pub dir: TempDir,
    pub router: Router,
    pub config: Arc<Config>,
    pub nodes: BTreeMap<NodeId, Node>,
}

impl Cluster {
    /// Timings for tests: elections within a few hundred milliseconds.
    pub fn config() -> Config {
        Config {
            heartbeat_interval: 50,
            election_timeout_min: 200,
            election_timeout_max: 400,
            ..Config::default()
        }
    }

    pub async fn start(ids: &[NodeId]) -> Self {
        Self::start_with(ids, Self::config()).await
    }

    pub async fn start_with(ids: &[NodeId], config: Config) -> Self {
        let mut c = Self::empty(config);
        for &id in ids {
            c.boot(id).await;
        }
        c.initialize(ids).await;
        c
    }

    /// A cluster with no node yet.
    pub fn empty(config: Config) -> Self {
        Self {
            dir: tempfile::tempdir().expect("a temporary directory"),
            router: Router::default(),
            config: Arc::new(config.validate().expect("a valid config")),
            nodes: BTreeMap::new(),
        }
    }

    /// Make `ids` (booted) the group's members.
    pub async fn initialize(&self, ids: &[NodeId]) {
        let members: BTreeMap<NodeId, BasicNode> = ids
            .iter()
            .map(|&id| (id, BasicNode::new(format!("node-{id}"))))
            .collect();
        self.nodes[&ids[0]]
            .raft
            .initialize(members)
            .await
            .expect("the group initialises");
    }

    /// The path of node `id`'s log.
    pub fn log_path(&self, id: NodeId) -> std::path::PathBuf {
        self.dir.path().join(format!("node-{id}.redb"))
    }

    /// Start node `id` on its log (new or kept from an earlier run) with an empty state
    /// machine: it recovers by replaying its log and from the leader.
    pub async fn boot(&mut self, id: NodeId) {
        let path = self.log_path(id);
        // A restarted node's file may still be held for a moment by the stopped instance's
        // replication tasks, which end on their own after shutdown; nothing signals it.
        let mut tries = 0;
        let log = loop {
            match LogStore::open(&path) {
                Ok(log) => break log,
                Err(LogError::AlreadyOpen) if tries < 500 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(e) => panic!("the node's log opens: {e}"),
            }
        };
        self.boot_with(id, log).await;
    }

    /// Start node `id` on `log` (any log storage, e.g. one that fails on demand).
    pub async fn boot_with<LS: RaftLogStorage<QueueRaft>>(&mut self, id: NodeId, log: LS) {
        let sm = QueueStateMachine::new(QueueConfig::default());
        let raft = Raft::new(
            id,
            Arc::clone(&self.config),
            self.router.network(id),
            log,
            sm.clone(),
        )
        .await
        .expect("the node starts");
        self.router.add(id, raft.clone());
        self.nodes.insert(id, Node { raft, sm });
    }

    pub async fn stop(&mut self, id: NodeId) {
        self.router.remove(id);
        if let Some(n) = self.nodes.remove(&id) {
            n.raft.shutdown().await.expect("the node stops");
        }
    }

    /// The leader `among` agree on (other than `not`), once they do: woken by every change of
    /// their metrics, bounded by [`WAIT`].
    pub async fn leader(&self, among: &[NodeId], not: Option<NodeId>) -> NodeId {
        let (tx, mut changed) = tokio::sync::mpsc::unbounded_channel();
        let mut watchers = Vec::new();
        for id in among {
            let mut rx = self.nodes[id].raft.metrics();
            let tx = tx.clone();
            watchers.push(tokio::spawn(async move {
                while rx.changed().await.is_ok() {
                    if tx.send(()).is_err() {
                        break;
                    }
                }
            }));
        }
        let agreed = tokio::time::timeout(WAIT, async {
            loop {
                let seen: Vec<Option<NodeId>> = among
                    .iter()
                    .map(|id| self.nodes[id].raft.metrics().borrow().current_leader)
                    .collect();
                if let Some(Some(l)) = seen.first()
                    && seen.iter().all(|s| *s == Some(*l))
                    && Some(*l) != not
                {
                    return *l;
                }
                changed.recv().await;
            }
        })
        .await;
        for w in watchers {
            w.abort();
        }
        agreed.expect("the nodes agree on a leader within the timeout")
    }

    pub async fn write(
        &self,
        leader: NodeId,
        at: u64,
        commands: Vec<Command<ReplicatedMessage>>,
    ) -> Vec<Reply<ReplicatedMessage>> {
        let resp = self.nodes[&leader]
            .raft
            .client_write(QueueRequest {
                at,
                commands,
                meta: Vec::new(),
            })
            .await
            .expect("the write commits on a majority");
        resp.data
            .replies
            .into_iter()
            .map(|r| r.expect("the machine accepts the command"))
            .collect()
    }

    /// Wait until `ids` have applied the leader's last applied entry; then their queue states
    /// must be identical.
    pub async fn converged(&self, leader: NodeId, ids: &[NodeId]) -> String {
        let index = self.nodes[&leader].sm.last_applied().map(|l| l.index);
        for id in ids {
            self.nodes[id]
                .raft
                .wait(Some(WAIT))
                .applied_index_at_least(index, "the replica catches up")
                .await
                .expect("every replica applies the leader's entries");
        }
        let digest = self.nodes[&leader].sm.state_digest();
        for id in ids {
            assert_eq!(
                self.nodes[id].sm.state_digest(),
                digest,
                "replica {id} holds the same queue state at index {index:?}"
            );
        }
        digest
    }
}

pub fn msg(n: u8) -> Command<ReplicatedMessage> {
    Command::Enqueue(ReplicatedMessage {
        body: vec![n; 16],
        priority: 0,
        expiration_ms: None,
    })
}

pub fn got_id(r: &Reply<ReplicatedMessage>) -> u64 {
    match r {
        Reply::Got(Some((id, ..))) => *id,
        other => panic!("expected a message, got {other:?}"),
    }
}
