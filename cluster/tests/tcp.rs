//! Three replicas talking over real TCP on loopback through the authenticated transport: they
//! elect a leader, replicate, fail over when the leader stops; a peer without the secret is
//! refused, and so is a replica of an earlier incarnation of the queue. Many groups on the
//! same three nodes share one link per pair of nodes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::VoteRequest;
use openraft::{BasicNode, Config, Raft, Vote};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use warren_broker::queue::machine::{Command, QueueConfig};
use warren_cluster::log::store::LogStore;
use warren_cluster::state_machine::QueueStateMachine;
use warren_cluster::transport::tcp::{
    Addresses, ForwardLink, Forwarded, GroupId, Groups, Secret, TcpNetwork, serve,
};
use warren_cluster::types::{NodeId, QueueRaft, QueueRequest, ReplicatedMessage};

const WAIT: Duration = Duration::from_secs(10);
const SECRET: &[u8] = b"the cluster secret";

struct Node {
    raft: Raft<QueueRaft>,
    sm: QueueStateMachine,
    server: JoinHandle<std::io::Result<()>>,
}

fn enqueue(n: u8) -> Command<ReplicatedMessage> {
    Command::Enqueue(ReplicatedMessage {
        body: vec![n; 32],
        priority: 0,
        expiration_ms: None,
    })
}

async fn leader_among(nodes: &BTreeMap<NodeId, Node>, not: Option<NodeId>) -> NodeId {
    let any = nodes.values().next().expect("a node");
    let m = any
        .raft
        .wait(Some(WAIT))
        .metrics(
            |m| m.current_leader.is_some() && m.current_leader != not,
            "a leader",
        )
        .await
        .expect("a leader is elected");
    let leader = m.current_leader.expect("checked");
    // The leader itself must know (the others follow once it heartbeats).
    nodes[&leader]
        .raft
        .wait(Some(WAIT))
        .current_leader(leader, "the leader knows it leads")
        .await
        .expect("the leader settles");
    leader
}

async fn converge(nodes: &BTreeMap<NodeId, Node>, leader: NodeId) {
    let index = nodes[&leader].sm.last_applied().map(|l| l.index);
    for n in nodes.values() {
        n.raft
            .wait(Some(WAIT))
            .applied_index_at_least(index, "replicated")
            .await
            .expect("every replica applies the entries");
    }
    let digest = nodes[&leader].sm.state_digest();
    for (id, n) in nodes {
        assert_eq!(
            n.sm.state_digest(),
            digest,
            "node {id} holds the same state"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_over_tcp_replicate_fail_over_and_refuse_strangers() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let config = Arc::new(
        Config {
            heartbeat_interval: 50,
            election_timeout_min: 200,
            election_timeout_max: 400,
            ..Config::default()
        }
        .validate()
        .expect("a valid config"),
    );
    let secret = Secret::new(SECRET);
    let group = GroupId {
        name: "/orders".into(),
        incarnation: 7,
    };
    let mut listeners = BTreeMap::new();
    let mut members = BTreeMap::new();
    for id in 1..=3u64 {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        members.insert(
            id,
            BasicNode::new(l.local_addr().expect("bound").to_string()),
        );
        listeners.insert(id, l);
    }
    let mut nodes = BTreeMap::new();
    for (id, listener) in listeners {
        let log = LogStore::open(&dir.path().join(format!("n{id}.redb"))).expect("a log");
        let sm = QueueStateMachine::new(QueueConfig::default());
        let raft = Raft::new(
            id,
            Arc::clone(&config),
            TcpNetwork::new(id, group.clone(), secret.clone()),
            log,
            sm.clone(),
        )
        .await
        .expect("the node starts");
        let groups = Groups::default();
        groups.insert(group.clone(), raft.clone());
        let server = tokio::spawn(serve(listener, id, groups, secret.clone()));
        nodes.insert(id, Node { raft, sm, server });
    }
    nodes[&1]
        .raft
        .initialize(members.clone())
        .await
        .expect("the group initialises");

    let leader = leader_among(&nodes, None).await;
    nodes[&leader]
        .raft
        .client_write(QueueRequest {
            at: 1_000,
            commands: (0..20).map(enqueue).collect(),
            meta: Vec::new(),
        })
        .await
        .expect("committed over TCP");
    converge(&nodes, leader).await;

    // A peer with another secret is refused before any RPC is served, and so is a replica of
    // an earlier incarnation of the queue (it must not vote, nor send entries, into this one).
    let follower = *members.keys().find(|&&i| i != leader).expect("a follower");
    let old_incarnation = GroupId {
        incarnation: 6,
        ..group.clone()
    };
    for (mut peer, what) in [
        (
            TcpNetwork::new(99, group.clone(), Secret::new(b"not the secret")),
            "a wrong secret",
        ),
        (
            TcpNetwork::new(99, old_incarnation, secret.clone()),
            "an old incarnation",
        ),
    ] {
        let mut conn = peer.new_client(follower, &members[&follower]).await;
        let refused = conn
            .vote(
                VoteRequest::new(Vote::new(1_000, 99), None),
                RPCOption::new(Duration::from_secs(1)),
            )
            .await;
        assert!(refused.is_err(), "{what} is refused: {refused:?}");
    }
    // The refused vote of term 1000 did not reach the group: its term did not move.
    let term = nodes[&follower].raft.metrics().borrow().current_term;
    assert!(term < 1_000, "term {term}");

    // The leader stops: the other two elect a new one over TCP and go on.
    let old = nodes.remove(&leader).expect("the leader");
    old.server.abort();
    old.raft.shutdown().await.expect("the leader stops");
    let new_leader = leader_among(&nodes, Some(leader)).await;
    nodes[&new_leader]
        .raft
        .client_write(QueueRequest {
            at: 2_000,
            commands: vec![enqueue(20)],
            meta: Vec::new(),
        })
        .await
        .expect("a majority of two commits");
    converge(&nodes, new_leader).await;
    assert_eq!(nodes[&new_leader].sm.with_machine(|m| m.ready_len()), 21);
    for n in nodes.values() {
        n.server.abort();
        n.raft.shutdown().await.expect("stops");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_groups_share_one_link_per_peer() {
    const GROUPS: u64 = 12;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let config = Arc::new(
        Config {
            heartbeat_interval: 50,
            election_timeout_min: 300,
            election_timeout_max: 600,
            ..Config::default()
        }
        .validate()
        .expect("a valid config"),
    );
    let secret = Secret::new(SECRET);
    let mut listeners = BTreeMap::new();
    let mut members = BTreeMap::new();
    for id in 1..=3u64 {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        members.insert(
            id,
            BasicNode::new(l.local_addr().expect("bound").to_string()),
        );
        listeners.insert(id, l);
    }
    // One table of links per node, shared by all its groups, as a cluster node keeps it.
    let addresses: BTreeMap<NodeId, Addresses> =
        (1..=3).map(|id| (id, Addresses::default())).collect();
    let served: BTreeMap<NodeId, Groups> = (1..=3).map(|id| (id, Groups::default())).collect();
    let mut servers = Vec::new();
    for (id, listener) in listeners {
        servers.push(tokio::spawn(serve(
            listener,
            id,
            served[&id].clone(),
            secret.clone(),
        )));
    }
    let mut groups: Vec<BTreeMap<NodeId, Node>> = Vec::new();
    for g in 0..GROUPS {
        let group = GroupId {
            name: format!("/q{g}"),
            incarnation: 1,
        };
        let mut nodes = BTreeMap::new();
        for id in 1..=3u64 {
            let log = LogStore::open(&dir.path().join(format!("g{g}n{id}.redb"))).expect("a log");
            let sm = QueueStateMachine::new(QueueConfig::default());
            let raft = Raft::new(
                id,
                Arc::clone(&config),
                TcpNetwork::new(id, group.clone(), secret.clone())
                    .resolving(addresses[&id].clone()),
                log,
                sm.clone(),
            )
            .await
            .expect("the node starts");
            served[&id].insert(group.clone(), raft.clone());
            let server = tokio::spawn(async { Ok(()) });
            nodes.insert(id, Node { raft, sm, server });
        }
        nodes[&1]
            .raft
            .initialize(members.clone())
            .await
            .expect("the group initialises");
        groups.push(nodes);
    }
    for (g, nodes) in groups.iter().enumerate() {
        let leader = leader_among(nodes, None).await;
        nodes[&leader]
            .raft
            .client_write(QueueRequest {
                at: 1_000,
                commands: (0..5)
                    .map(|i| enqueue(u8::try_from(g).unwrap_or(0) + i))
                    .collect(),
                meta: Vec::new(),
            })
            .await
            .expect("committed over the shared links");
        converge(nodes, leader).await;
    }
    // A node dials each peer it has something to say to once, whatever the number of groups
    // (a connection per group and stream would be a dozen per follower here): at most two
    // links into each node, and the leaders' links reach every follower.
    for (id, g) in &served {
        assert!(
            g.open_links() <= 2,
            "{} links open to node {id}",
            g.open_links()
        );
    }
    let total: usize = served.values().map(Groups::open_links).sum();
    assert!(total >= 2, "{total} links in all");
    for nodes in groups {
        for n in nodes.values() {
            n.raft.shutdown().await.expect("stops");
        }
    }
    for s in servers {
        s.abort();
    }
}

/// A single-voter replica of `group` on node 1 at `addr`, leading once it returns.
async fn lone_leader(
    log: &std::path::Path,
    config: &Arc<Config>,
    group: &GroupId,
    secret: &Secret,
    addr: &str,
) -> (Raft<QueueRaft>, QueueStateMachine) {
    let sm = QueueStateMachine::new(QueueConfig::default());
    let raft = Raft::new(
        1,
        Arc::clone(config),
        TcpNetwork::new(1, group.clone(), secret.clone()),
        LogStore::open(log).expect("a log"),
        sm.clone(),
    )
    .await
    .expect("the node starts");
    raft.initialize(BTreeMap::from([(1, BasicNode::new(addr))]))
        .await
        .expect("the group initialises");
    raft.wait(Some(WAIT))
        .current_leader(1, "the lone voter leads")
        .await
        .expect("a leader");
    (raft, sm)
}

/// A group a node stops serving and then serves again (a replica that moved away and came
/// back) takes the batches forwarded to it into its new Raft instance, over the link that
/// carried batches into the old one: the link's lane into the old serving is not reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_served_again_takes_forwarded_batches_over_the_same_link() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let config = Arc::new(Config::default().validate().expect("a valid config"));
    let secret = Secret::new(SECRET);
    let group = GroupId {
        name: "/moved".into(),
        incarnation: 3,
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
    let addr = listener.local_addr().expect("bound").to_string();
    let groups = Groups::default();
    let start =
        async |log: &str| lone_leader(&dir.path().join(log), &config, &group, &secret, &addr).await;
    let (first, first_sm) = start("first.redb").await;
    groups.insert(group.clone(), first.clone());
    let server = tokio::spawn(serve(listener, 1, groups.clone(), secret.clone()));

    let forward = ForwardLink::new(
        &Addresses::default(),
        2,
        1,
        group.clone(),
        addr.clone(),
        &secret,
    );
    let send = |n: u8| {
        let forward = forward.clone();
        async move {
            forward
                .send(Forwarded {
                    commands: vec![enqueue(n)],
                    meta: Vec::new(),
                })
                .await
                .expect("queued on the link")
                .replies()
                .await
                .expect("answered")
        }
    };
    let replies = send(1).await.expect("staged");
    assert!(replies.iter().all(Result::is_ok), "{replies:?}");
    assert_eq!(first_sm.with_machine(|m| m.ready_len()), 1);

    // The replica goes, then comes back with a log of its own.
    groups.remove(&group).expect("it was served");
    first.shutdown().await.expect("stops");
    let (second, second_sm) = start("second.redb").await;
    groups.insert(group.clone(), second.clone());

    let replies = send(2).await.expect("staged into the group served now");
    assert!(replies.iter().all(Result::is_ok), "{replies:?}");
    assert_eq!(second_sm.with_machine(|m| m.ready_len()), 1);
    server.abort();
    second.shutdown().await.expect("stops");
}
