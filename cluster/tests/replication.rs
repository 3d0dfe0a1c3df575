//! A replicated queue of three openraft nodes in one process (in-process network, real redb
//! logs): entries commit on a majority, every replica applies the same commands at the same
//! times and reaches the same queue state; a leader cut off is replaced, the survivors go on,
//! and the old leader catches up when it returns; a node restarted from its log recovers the
//! same state.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use openraft::{BasicNode, Config, Raft};
use tempfile::TempDir;
use warren_broker::queue::machine::{Command, QueueConfig, Reply};
use warren_cluster::log_store::LogStore;
use warren_cluster::network::Router;
use warren_cluster::state_machine::QueueStateMachine;
use warren_cluster::types::{NodeId, QueueRaft, QueueRequest, ReplicatedMessage};

const WAIT: Duration = Duration::from_secs(10);

struct Node {
    raft: Raft<QueueRaft>,
    sm: QueueStateMachine,
}

struct Cluster {
    dir: TempDir,
    router: Router,
    config: Arc<Config>,
    nodes: BTreeMap<NodeId, Node>,
}

impl Cluster {
    async fn start(ids: &[NodeId]) -> Self {
        let config = Config {
            heartbeat_interval: 50,
            election_timeout_min: 200,
            election_timeout_max: 400,
            ..Config::default()
        };
        let mut c = Self {
            dir: tempfile::tempdir().expect("a temporary directory"),
            router: Router::default(),
            config: Arc::new(config.validate().expect("a valid config")),
            nodes: BTreeMap::new(),
        };
        for &id in ids {
            c.boot(id).await;
        }
        let members: BTreeMap<NodeId, BasicNode> = ids
            .iter()
            .map(|&id| (id, BasicNode::new(format!("node-{id}"))))
            .collect();
        c.nodes[&ids[0]]
            .raft
            .initialize(members)
            .await
            .expect("the group initialises");
        c
    }

    /// Start node `id` on its log (new or kept from an earlier run) with an empty state
    /// machine: it recovers by replaying its log and from the leader.
    async fn boot(&mut self, id: NodeId) {
        let log = LogStore::open(&self.dir.path().join(format!("node-{id}.redb")))
            .expect("the node's log opens");
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

    async fn stop(&mut self, id: NodeId) {
        self.router.remove(id);
        if let Some(n) = self.nodes.remove(&id) {
            n.raft.shutdown().await.expect("the node stops");
        }
    }

    /// The leader `among` agree on (other than `not`), once they do: woken by every change of
    /// their metrics, bounded by [`WAIT`].
    async fn leader(&self, among: &[NodeId], not: Option<NodeId>) -> NodeId {
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

    async fn write(
        &self,
        leader: NodeId,
        at: u64,
        commands: Vec<Command<ReplicatedMessage>>,
    ) -> Vec<Reply<ReplicatedMessage>> {
        let resp = self.nodes[&leader]
            .raft
            .client_write(QueueRequest { at, commands })
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
    async fn converged(&self, leader: NodeId, ids: &[NodeId]) -> String {
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

fn msg(n: u8) -> Command<ReplicatedMessage> {
    Command::Enqueue(ReplicatedMessage {
        body: vec![n; 16],
        priority: 0,
        expiration_ms: None,
    })
}

fn got_id(r: &Reply<ReplicatedMessage>) -> u64 {
    match r {
        Reply::Got(Some((id, ..))) => *id,
        other => panic!("expected a message, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_agree_and_survive_the_loss_of_the_leader() {
    let mut c = Cluster::start(&[1, 2, 3]).await;
    let leader = c.leader(&[1, 2, 3], None).await;
    // Ten publishes in one entry, then a get that leaves its message unacked.
    c.write(leader, 1_000, (0..10).map(msg).collect()).await;
    let got = c
        .write(leader, 1_001, vec![Command::Get { no_ack: false }])
        .await;
    let first = got_id(&got[0]);
    c.converged(leader, &[1, 2, 3]).await;
    assert_eq!(
        c.nodes[&leader]
            .sm
            .with_machine(|m| (m.ready_len(), m.unacked_len())),
        (9, 1)
    );

    // The leader is cut off: the other two elect a new one and go on without it.
    c.router.isolate(leader);
    let rest: Vec<NodeId> = [1, 2, 3].into_iter().filter(|&i| i != leader).collect();
    let new_leader = c.leader(&rest, Some(leader)).await;
    assert_ne!(new_leader, leader);
    // The unacked message is returned (its consumer was on the lost node) and more arrive.
    c.write(
        new_leader,
        2_000,
        vec![Command::Return(vec![first]), msg(10), msg(11)],
    )
    .await;
    c.converged(new_leader, &rest).await;
    assert_eq!(
        c.nodes[&new_leader]
            .sm
            .with_machine(|m| (m.ready_len(), m.unacked_len())),
        (12, 0)
    );
    // The returned message is delivered first again, with its first enqueue time.
    let again = c
        .write(new_leader, 2_001, vec![Command::Get { no_ack: true }])
        .await;
    assert_eq!(got_id(&again[0]), first);
    assert!(
        matches!(&again[0], Reply::Got(Some((_, _, true, _, _)))),
        "redelivered"
    );

    // The old leader returns and catches up to the same state.
    c.router.heal(leader);
    let all = [1, 2, 3];
    let settled_leader = c.leader(&all, None).await;
    let digest = c.converged(settled_leader, &all).await;

    // A node restarted from its log (empty state machine) replays to the same state.
    let restarted = rest[0];
    c.stop(restarted).await;
    c.boot(restarted).await;
    let leader = c.leader(&all, None).await;
    c.write(leader, 3_000, vec![msg(12)]).await;
    let after = c.converged(leader, &all).await;
    assert_ne!(after, digest, "the new message is in every replica");
    for id in all {
        c.stop(id).await;
    }
}
