//! A replicated queue of three openraft nodes in one process (in-process network, real redb
//! logs): entries commit on a majority, every replica applies the same commands at the same
//! times and reaches the same queue state; a leader cut off is replaced, the survivors go on,
//! and the old leader catches up when it returns; a node restarted from its log recovers the
//! same state.

mod common;

use common::{Cluster, WAIT, got_id, msg};
use openraft::{Config, SnapshotPolicy};
use warren_broker::queue::machine::{Command, Reply};
use warren_cluster::types::NodeId;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_behind_the_purged_log_catches_up_from_a_snapshot() {
    // Snapshot every 20 entries and keep no log behind a snapshot: the log stays bounded by
    // the live queue, and a replica that missed purged entries can only catch up by snapshot.
    let config = Config {
        snapshot_policy: SnapshotPolicy::LogsSinceLast(20),
        max_in_snapshot_log_to_keep: 0,
        purge_batch_size: 1,
        ..Cluster::config()
    };
    let all = [1, 2, 3];
    let mut c = Cluster::start_with(&all, config).await;
    let leader = c.leader(&all, None).await;
    let behind = all.into_iter().find(|&i| i != leader).expect("a follower");
    c.router.isolate(behind);
    for i in 0..60u8 {
        c.write(leader, 1_000 + u64::from(i), vec![msg(i)]).await;
    }
    c.nodes[&leader]
        .raft
        .wait(Some(WAIT))
        .metrics(
            |m| m.purged.is_some_and(|p| p.index >= 40),
            "the leader snapshots and purges its log",
        )
        .await
        .expect("the log is purged behind a snapshot");
    c.router.heal(behind);
    c.nodes[&behind]
        .raft
        .wait(Some(WAIT))
        .metrics(
            |m| m.snapshot.is_some(),
            "the lagging replica installs a snapshot",
        )
        .await
        .expect("the lagging replica catches up from a snapshot");
    c.converged(leader, &all).await;
    assert_eq!(c.nodes[&behind].sm.with_machine(|m| m.ready_len()), 60);
    for id in all {
        c.stop(id).await;
    }
}
