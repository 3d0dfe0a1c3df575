//! First measurement of a replicated queue: three replicas in one process over TCP on
//! loopback (the authenticated transport), each with its redb log on disk.
//!
//! - `entries` mode: `WRITERS` clients each keep one entry in flight; an entry carries `BATCH`
//!   1 KB publishes; latency is per entry.
//! - `proposer` mode: `WRITERS` publishers each keep `BATCH` messages in flight through the
//!   leader's [`Proposer`], which batches whatever is waiting into entries (what the broker's
//!   publish path will do); latency is publish to confirm, per message.
//!
//! `cargo run --release -p warren-cluster --example replicated_bench -- [seconds] [writers] [batch] [entries|proposer]`

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use openraft::{BasicNode, Config, Raft};
use tokio::net::TcpListener;
use warren_broker::queue::machine::{Command, QueueConfig};
use warren_cluster::log::store::LogStore;
use warren_cluster::proposer::Proposer;
use warren_cluster::state_machine::QueueStateMachine;
use warren_cluster::transport::tcp::{GroupId, Groups, Secret, TcpNetwork, serve};
use warren_cluster::types::{QueueRequest, ReplicatedMessage};

/// Every task's latencies, sorted, and a percentile function over them (milliseconds).
async fn latencies(
    tasks: Vec<tokio::task::JoinHandle<Vec<Duration>>>,
) -> anyhow::Result<(Vec<Duration>, impl Fn(f64) -> f64)> {
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await?);
    }
    all.sort();
    let sorted = all.clone();
    let pct = move |p: f64| {
        sorted
            .get(((sorted.len() as f64 - 1.0) * p) as usize)
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    Ok((all, pct))
}

fn arg(i: usize, default: u64) -> u64 {
    std::env::args()
        .nth(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let seconds = arg(1, 10);
    let writers = arg(2, 8);
    let batch = arg(3, 64);
    let proposer_mode = std::env::args().nth(4).as_deref() == Some("proposer");
    let dir = tempfile::tempdir()?;
    let config = Arc::new(Config::default().validate()?);
    let secret = Secret::new(b"bench");
    let group = GroupId {
        name: "bench".into(),
        incarnation: 1,
    };
    let mut members = BTreeMap::new();
    let mut listeners = Vec::new();
    for id in 1..=3u64 {
        let l = TcpListener::bind("127.0.0.1:0").await?;
        members.insert(id, BasicNode::new(l.local_addr()?.to_string()));
        listeners.push((id, l));
    }
    let mut rafts = BTreeMap::new();
    for (id, l) in listeners {
        let log = LogStore::open(&dir.path().join(format!("n{id}.redb")))?;
        let sm = QueueStateMachine::new(QueueConfig::default());
        let raft = Raft::new(
            id,
            Arc::clone(&config),
            TcpNetwork::new(id, group.clone(), secret.clone()),
            log,
            sm,
        )
        .await?;
        let groups = Groups::default();
        groups.insert(group.clone(), raft.clone());
        tokio::spawn(serve(l, id, groups, secret.clone()));
        rafts.insert(id, raft);
    }
    rafts[&1].initialize(members).await?;
    let m = rafts[&1]
        .wait(Some(Duration::from_secs(10)))
        .metrics(|m| m.current_leader.is_some(), "leader")
        .await?;
    let leader = rafts[&m.current_leader.unwrap_or(1)].clone();
    let body = vec![b'x'; 1024];
    let deadline = Instant::now() + Duration::from_secs(seconds);
    if proposer_mode {
        let proposer = Proposer::start(leader.clone());
        let mut tasks = Vec::new();
        for _ in 0..writers {
            let proposer = proposer.clone();
            let body = body.clone();
            tasks.push(tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut window = std::collections::VecDeque::new();
                while Instant::now() < deadline {
                    while window.len() < usize::try_from(batch).unwrap_or(1) {
                        let msg = Command::Enqueue(ReplicatedMessage {
                            body: body.clone(),
                            priority: 0,
                            expiration_ms: None,
                        });
                        let Ok(p) = proposer.submit(msg).await else {
                            return latencies;
                        };
                        window.push_back((Instant::now(), p));
                    }
                    if let Some((t, p)) = window.pop_front() {
                        if p.reply().await.is_err() {
                            return latencies;
                        }
                        latencies.push(t.elapsed());
                    }
                }
                latencies
            }));
        }
        let (all, pct) = latencies(tasks).await?;
        let entries = leader
            .metrics()
            .borrow()
            .last_applied
            .map_or(0, |l| l.index);
        println!(
            "replicated queue via the proposer, 3 replicas over TCP loopback, 1 KB messages: {} msg/s ({writers} publishers x {batch} in flight, {seconds} s, {entries} entries); publish-to-confirm p50 {:.2} ms, p99 {:.2} ms",
            all.len() as u64 / seconds.max(1),
            pct(0.5),
            pct(0.99)
        );
        for r in rafts.values() {
            r.shutdown().await?;
        }
        return Ok(());
    }
    let mut tasks = Vec::new();
    for _ in 0..writers {
        let leader = leader.clone();
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut at = 0;
            while Instant::now() < deadline {
                at += 1;
                let commands = (0..batch)
                    .map(|_| {
                        Command::Enqueue(ReplicatedMessage {
                            body: body.clone(),
                            priority: 0,
                            expiration_ms: None,
                        })
                    })
                    .collect();
                let t = Instant::now();
                if leader
                    .client_write(QueueRequest {
                        at,
                        commands,
                        meta: Vec::new(),
                    })
                    .await
                    .is_err()
                {
                    break;
                }
                latencies.push(t.elapsed());
            }
            latencies
        }));
    }
    let (all, pct) = latencies(tasks).await?;
    let entries = all.len() as u64;
    println!(
        "replicated queue, 3 replicas over TCP loopback, 1 KB messages: {} msg/s ({} entries of {batch}, {writers} writers, {seconds} s); entry commit p50 {:.2} ms, p99 {:.2} ms",
        entries * batch / seconds.max(1),
        entries,
        pct(0.5),
        pct(0.99)
    );
    for r in rafts.values() {
        r.shutdown().await?;
    }
    Ok(())
}
