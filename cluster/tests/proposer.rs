//! The leader's proposer: publishes from many callers are batched into few entries, each
//! caller gets its own confirm after commit, one publisher's messages keep their order across
//! entries, and a follower's proposer says who leads.

mod common;

use common::Cluster;
use warren_broker::queue::machine::{Command, Reply};
use warren_cluster::proposer::{ProposeError, Proposer};
use warren_cluster::types::ReplicatedMessage;

fn publish(n: u32) -> Command<ReplicatedMessage> {
    Command::Enqueue(ReplicatedMessage {
        body: n.to_be_bytes().to_vec(),
        priority: 0,
        expiration_ms: None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_publishes_share_entries_and_keep_their_order() {
    let all = [1, 2, 3];
    // Elections slower than the harness's: 2,000 publishes on three debug-build nodes sharing
    // two cores can hold a heartbeat past 200 ms, and a leader change mid-test makes a no-ack
    // get's outcome unknown (a message possibly taken unseen), which is not what this tests.
    let mut c = Cluster::start_with(
        &all,
        openraft::Config {
            election_timeout_min: 1_500,
            election_timeout_max: 3_000,
            ..Cluster::config()
        },
    )
    .await;
    let leader = c.leader(&all, None).await;
    let before = c.nodes[&leader].sm.last_applied().map_or(0, |l| l.index);
    let proposer = Proposer::start(c.nodes[&leader].raft.clone());

    // One publisher submits 2,000 messages without waiting, then collects the confirms.
    let mut pending = Vec::new();
    for n in 0..2_000 {
        pending.push(proposer.submit(publish(n)).await.expect("queued"));
    }
    for p in pending {
        assert_eq!(p.reply().await, Ok(Reply::Ok), "every publish is confirmed");
    }
    let entries = c.nodes[&leader].sm.last_applied().map_or(0, |l| l.index) - before;
    assert!(
        entries < 1_000,
        "2,000 publishes took {entries} entries: they are batched"
    );
    c.converged(leader, &all).await;

    // Drained in publish order, on every replica.
    let mut order = Vec::new();
    loop {
        match proposer
            .propose(Command::Get { no_ack: true })
            .await
            .expect("a get")
        {
            Reply::Got(Some((_, m, ..))) => {
                let b: [u8; 4] = m.body.as_slice().try_into().expect("4 bytes");
                order.push(u32::from_be_bytes(b));
            }
            Reply::Got(None) => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(order, (0..2_000).collect::<Vec<_>>());
    c.converged(leader, &all).await;

    // A follower's proposer appends nothing and names the leader.
    let follower = all.into_iter().find(|&i| i != leader).expect("a follower");
    let p = Proposer::start(c.nodes[&follower].raft.clone());
    assert_eq!(
        p.propose(publish(9)).await,
        Err(ProposeError::NotLeader(Some(leader)))
    );
    for id in all {
        c.stop(id).await;
    }
}
