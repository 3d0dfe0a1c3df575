//! A total-queue check in the spirit of Jepsen's, on one replicated queue in one process:
//! a publisher enqueues unique ids through whichever node leads, while the network drops RPCs,
//! loses replies, delays (and so reorders) messages, and cuts nodes off for a while. After the
//! faults heal, everything is drained and checked:
//! - lost: acknowledged (committed) ids never drained — must be none;
//! - unexpected: drained ids never published — must be none;
//! - duplicates: only of ids whose write was retried after an unknown outcome;
//! - every replica holds the same state at the same applied index.
//!
//! `WARREN_CLUSTER_SEEDS` sets how many seeds run (default 3); `WARREN_CLUSTER_MESSAGES` how
//! many ids each publishes (default 80). Longer runs: `WARREN_CLUSTER_SEEDS=50 cargo test -p
//! warren-cluster --test total_queue -- --nocapture` (one line of counts per seed).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::Cluster;
use openraft::error::{ClientWriteError, RaftError};
use warren_broker::queue::machine::{Command, Reply};
use warren_cluster::transport::in_process::Faults;
use warren_cluster::types::{NodeId, QueueRequest, ReplicatedMessage};

/// How long one write may take before its outcome counts as unknown (an isolated leader waits
/// for a majority that will not answer).
const WRITE_TIMEOUT: Duration = Duration::from_millis(600);
/// How many attempts an id gets before the run gives up on it.
const ATTEMPTS: usize = 20;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn enqueue(id: u64) -> Command<ReplicatedMessage> {
    Command::Enqueue(ReplicatedMessage {
        body: id.to_be_bytes().to_vec(),
        priority: 0,
        expiration_ms: None,
    })
}

/// The outcome of one attempt to write.
enum Outcome {
    Committed,
    /// Not appended: the node was not the leader (it may name the one that is).
    Refused(Option<NodeId>),
    /// It may or may not have committed.
    Unknown,
}

async fn try_write(
    c: &Cluster,
    node: NodeId,
    at: u64,
    commands: Vec<Command<ReplicatedMessage>>,
) -> (Outcome, Vec<Reply<ReplicatedMessage>>) {
    let Some(n) = c.nodes.get(&node) else {
        return (Outcome::Refused(None), Vec::new());
    };
    match tokio::time::timeout(
        WRITE_TIMEOUT,
        n.raft.client_write(QueueRequest {
            at,
            commands,
            meta: Vec::new(),
        }),
    )
    .await
    {
        Ok(Ok(resp)) => (
            Outcome::Committed,
            resp.data
                .replies
                .into_iter()
                .filter_map(Result::ok)
                .collect(),
        ),
        Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => {
            (Outcome::Refused(f.leader_id), Vec::new())
        }
        Ok(Err(_)) | Err(_) => (Outcome::Unknown, Vec::new()),
    }
}

/// The leader as `asked` knows it, other than `not`: waits (bounded) for `asked` to learn of
/// one, as after an election; falls back to the next node.
async fn find_leader(c: &Cluster, asked: NodeId, not: Option<NodeId>) -> NodeId {
    let learned = match c.nodes.get(&asked) {
        Some(n) => n
            .raft
            .wait(Some(WRITE_TIMEOUT))
            .metrics(
                |m| m.current_leader.is_some() && m.current_leader != not,
                "a leader is known",
            )
            .await
            .ok()
            .and_then(|m| m.current_leader),
        None => None,
    };
    learned.unwrap_or(asked % 3 + 1)
}

async fn run(seed: u64, messages: u64) {
    let ids = [1, 2, 3];
    let c = Cluster::start(&ids).await;
    c.router.set_faults(Some(Faults::new(seed, 50, 50, 10)));
    // The partition schedule draws from its own seeded sequence.
    let mut chaos = Faults::new(seed ^ 0xC4A0_5EED, 0, 0, 0);
    let mut confirmed = BTreeSet::new();
    let mut retried = BTreeSet::new();
    let mut at = 1_000;
    let mut isolated: Option<NodeId> = None;
    for id in 0..messages {
        // A node is cut off for a stretch of every 40 ids.
        match id % 40 {
            10 => {
                let victim = ids[usize::try_from(chaos.pick() % 3).unwrap_or(0)];
                c.router.isolate(victim);
                isolated = Some(victim);
            }
            30 => {
                if let Some(v) = isolated.take() {
                    c.router.heal(v);
                }
            }
            _ => {}
        }
        let mut target = find_leader(&c, 1, None).await;
        let mut done = false;
        for attempt in 0..ATTEMPTS {
            at += 1;
            let outcome = try_write(&c, target, at, vec![enqueue(id)]).await.0;
            if attempt >= 15 {
                let what = match &outcome {
                    Outcome::Committed => "committed".to_string(),
                    Outcome::Refused(l) => format!("refused, leader {l:?}"),
                    Outcome::Unknown => "unknown".to_string(),
                };
                eprintln!("seed {seed} id {id} attempt {attempt} at node {target}: {what}");
            }
            match outcome {
                Outcome::Committed => {
                    confirmed.insert(id);
                    done = true;
                    break;
                }
                Outcome::Refused(Some(leader)) if leader != target => target = leader,
                Outcome::Refused(_) => target = find_leader(&c, target, Some(target)).await,
                Outcome::Unknown => {
                    retried.insert(id);
                    // The node tried may be cut off, or no longer lead: ask the next one.
                    let next = ids[(attempt + 1) % ids.len()];
                    target = find_leader(&c, next, None).await;
                }
            }
        }
        if !done {
            for (nid, n) in &c.nodes {
                eprintln!("node {nid}: {}", *n.raft.metrics().borrow());
            }
            panic!("seed {seed}: id {id} never committed in {ATTEMPTS} attempts");
        }
    }
    // Heal everything and let the group settle.
    if let Some(v) = isolated.take() {
        c.router.heal(v);
    }
    c.router.set_faults(None);
    let leader = c.leader(&ids, None).await;
    c.converged(leader, &ids).await;

    // Drain: gets without ack, many per entry, until the queue answers empty.
    let mut drained: BTreeMap<u64, u32> = BTreeMap::new();
    'drain: loop {
        at += 1;
        let replies = c
            .write(
                leader,
                at,
                (0..50).map(|_| Command::Get { no_ack: true }).collect(),
            )
            .await;
        for r in replies {
            match r {
                Reply::Got(Some((_, m, ..))) => {
                    let bytes: [u8; 8] = m.body.as_slice().try_into().expect("an 8-byte id");
                    *drained.entry(u64::from_be_bytes(bytes)).or_default() += 1;
                }
                Reply::Got(None) => break 'drain,
                other => panic!("seed {seed}: unexpected reply {other:?}"),
            }
        }
    }
    c.converged(leader, &ids).await;

    let lost: Vec<u64> = confirmed
        .iter()
        .filter(|id| !drained.contains_key(id))
        .copied()
        .collect();
    let unexpected: Vec<u64> = drained
        .keys()
        .filter(|id| **id >= messages)
        .copied()
        .collect();
    let bad_duplicates: Vec<u64> = drained
        .iter()
        .filter(|(id, n)| **n > 1 && !retried.contains(*id))
        .map(|(id, _)| *id)
        .collect();
    eprintln!(
        "seed {seed}: {} confirmed, {} drained, {} retried after an unknown outcome, {} duplicates",
        confirmed.len(),
        drained.len(),
        retried.len(),
        drained.values().filter(|n| **n > 1).count()
    );
    assert!(lost.is_empty(), "seed {seed}: lost {lost:?}");
    assert!(
        unexpected.is_empty(),
        "seed {seed}: unexpected {unexpected:?}"
    );
    assert!(
        bad_duplicates.is_empty(),
        "seed {seed}: duplicated without a retry {bad_duplicates:?}"
    );
    assert_eq!(
        confirmed.len() as u64,
        messages,
        "seed {seed}: every id committed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_confirmed_message_is_lost_under_message_faults_and_partitions() {
    let seeds = env("WARREN_CLUSTER_SEEDS", 3);
    let messages = env("WARREN_CLUSTER_MESSAGES", 80);
    for seed in 0..seeds {
        run(seed, messages).await;
    }
}
