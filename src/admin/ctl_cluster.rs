//! `warren ctl cluster_status` and `warren ctl queues ...` (rabbitmq-queues' membership and
//! rebalance verbs), over the node's management API like the other API-backed verbs.
//!
//! Membership changes answer once the cluster committed the new member list; these verbs
//! then wait until the queue's leader reports the new voters, so a script that runs
//! `add_member` and then relies on the new replica sees it in place.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::client::{api_request, percent_segment};

/// How long a membership verb waits for the leader to report the new voters.
const MEMBERS_WAIT: Duration = Duration::from_secs(30);
/// How long `join_cluster` waits for the node to restart as a member.
const JOIN_WAIT: Duration = Duration::from_secs(90);

/// rabbitmq-queues' membership verbs.
#[derive(Debug, clap::Subcommand)]
#[command(rename_all = "snake_case")]
pub enum QueuesCommand {
    /// Make NODE a member (a voting replica) of quorum queue QUEUE.
    AddMember {
        /// Queue.
        queue: String,
        /// Node name.
        node: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Make NODE no longer a member of quorum queue QUEUE (it keeps a non-voting copy).
    DeleteMember {
        /// Queue.
        queue: String,
        /// Node name.
        node: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Add NODE to every matching quorum queue (`all`), or to those with an even number of
    /// members (`even`).
    Grow {
        /// Node name.
        node: String,
        /// `all` or `even`.
        #[arg(value_parser = ["all", "even"])]
        selector: String,
        /// Only vhosts matching this regular expression.
        #[arg(long, default_value = ".*")]
        vhost_pattern: String,
        /// Only queues matching this regular expression.
        #[arg(long, default_value = ".*")]
        queue_pattern: String,
    },
    /// Remove NODE from every quorum queue it is a member of (never the last member).
    Shrink {
        /// Node name.
        node: String,
    },
    /// Move quorum queue leaders so every running node leads about as many.
    Rebalance {
        /// Queue type: `quorum` (or `all`, the same here: only quorum queues have leaders).
        #[arg(value_parser = ["quorum", "all"])]
        queue_type: String,
        /// Only vhosts matching this regular expression.
        #[arg(long, default_value = ".*")]
        vhost_pattern: String,
        /// Only queues matching this regular expression.
        #[arg(long, default_value = ".*")]
        queue_pattern: String,
    },
    /// Hand quorum queue QUEUE's leadership to its member NODE (Warren's own).
    TransferLeader {
        /// Queue.
        queue: String,
        /// Node name.
        node: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
}

/// `cluster_status`: the cluster's name, its nodes, and those running as this node sees it.
pub fn cluster_status(data_dir: &Path, json_output: bool) -> anyhow::Result<u8> {
    let (status, nodes) = api_request(data_dir, "GET", "/api/nodes", None, Vec::new())?;
    if status != 200 {
        return Ok(super::client::api_failure(status, &nodes));
    }
    let (_, name) = api_request(data_dir, "GET", "/api/cluster-name", None, Vec::new())?;
    let nodes = nodes.as_array().cloned().unwrap_or_default();
    let this = nodes
        .first()
        .and_then(|n| n["name"].as_str())
        .unwrap_or_default()
        .to_string();
    let mut all: Vec<String> = nodes
        .iter()
        .filter_map(|n| n["name"].as_str().map(str::to_string))
        .collect();
    all.sort();
    let mut running: Vec<String> = nodes
        .iter()
        .filter(|n| n["running"].as_bool() == Some(true))
        .filter_map(|n| n["name"].as_str().map(str::to_string))
        .collect();
    running.sort();
    let cluster_name = name["name"].as_str().unwrap_or_default();
    if json_output {
        println!(
            "{}",
            json!({
                "cluster_name": cluster_name,
                "disk_nodes": all,
                "running_nodes": running,
            })
        );
        return Ok(0);
    }
    println!("Cluster status of node {this} ...\nBasics\n\nCluster name: {cluster_name}\n");
    println!("Disk Nodes\n");
    for n in &all {
        println!("{n}");
    }
    println!("\nRunning Nodes\n");
    for n in &running {
        println!("{n}");
    }
    Ok(0)
}

/// `join_cluster`: the node records the seeds and restarts; wait until it answers again as a
/// member of a cluster of more than one node.
pub fn join_cluster(data_dir: &Path, seeds: &str, address: Option<&str>) -> anyhow::Result<u8> {
    let reply = super::client::request_join(data_dir, seeds, address)?;
    if reply["ok"] != true {
        eprintln!("Error: {}", reply["error"].as_str().unwrap_or("refused"));
        return Ok(reply["code"]
            .as_u64()
            .and_then(|c| u8::try_from(c).ok())
            .unwrap_or(70));
    }
    let node = reply["node"].as_str().unwrap_or_default();
    println!("Clustering node {node} with {seeds}");
    let deadline = Instant::now() + JOIN_WAIT;
    loop {
        // The node is down for a moment while it restarts: no answer is no failure yet.
        if let Ok((200, nodes)) = api_request(data_dir, "GET", "/api/nodes", None, Vec::new()) {
            let listed = nodes.as_array().cloned().unwrap_or_default();
            let me = listed.iter().any(|n| n["name"] == node);
            if me && listed.len() > 1 {
                return Ok(0);
            }
        }
        if Instant::now() >= deadline {
            eprintln!("Error: {node} did not come back as a cluster member within {JOIN_WAIT:?}");
            return Ok(75);
        }
        // Polling: the restart has no event a client can wait on.
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Run a `queues` verb.
pub fn queues(data_dir: &Path, command: &QueuesCommand) -> anyhow::Result<u8> {
    match command {
        QueuesCommand::AddMember { queue, node, vhost } => {
            println!("Adding a replica for queue {queue} on node {node}...");
            let r = change(data_dir, vhost, queue, node, true)?;
            Ok(report_one(&r))
        }
        QueuesCommand::DeleteMember { queue, node, vhost } => {
            println!("Removing a replica of queue {queue} on node {node}...");
            let r = change(data_dir, vhost, queue, node, false)?;
            Ok(report_one(&r))
        }
        QueuesCommand::Grow {
            node,
            selector,
            vhost_pattern,
            queue_pattern,
        } => {
            println!("Growing {selector} quorum queues on {node}...");
            let vhosts = regex_of(vhost_pattern)?;
            let names = regex_of(queue_pattern)?;
            let mut rows = Vec::new();
            for q in quorum_queues(data_dir)? {
                let size = q.members.len();
                if q.members.iter().any(|m| m == node)
                    || !vhosts.is_match(&q.vhost)
                    || !names.is_match(&q.name)
                    || (selector == "even" && size % 2 != 0)
                {
                    continue;
                }
                let r = change(data_dir, &q.vhost, &q.name, node, true)?;
                rows.push((q, size + usize::from(r.is_ok()), r));
            }
            Ok(report_many(&rows))
        }
        QueuesCommand::Rebalance {
            queue_type: _,
            vhost_pattern,
            queue_pattern,
        } => rebalance(data_dir, vhost_pattern, queue_pattern),
        QueuesCommand::TransferLeader { queue, node, vhost } => {
            println!("Handing the leadership of queue {queue} to node {node}...");
            let path = format!(
                "/api/queues/{}/{}/leader",
                percent_segment(vhost),
                percent_segment(queue)
            );
            let (status, body) = api_request(
                data_dir,
                "POST",
                &path,
                Some(json!({ "node": node })),
                Vec::new(),
            )?;
            if status >= 300 {
                return Ok(super::client::api_failure(status, &body));
            }
            println!("{} leads {queue}", body["leader"].as_str().unwrap_or("?"));
            Ok(0)
        }
        QueuesCommand::Shrink { node } => {
            println!("Shrinking quorum queues on {node}...");
            let mut rows = Vec::new();
            for q in quorum_queues(data_dir)? {
                if !q.members.iter().any(|m| m == node) {
                    continue;
                }
                let size = q.members.len();
                let r = change(data_dir, &q.vhost, &q.name, node, false)?;
                rows.push((q, size - usize::from(r.is_ok()), r));
            }
            Ok(report_many(&rows))
        }
    }
}

/// `rebalance`: the moves made, those that failed, and the leaders per node after them.
fn rebalance(data_dir: &Path, vhost_pattern: &str, queue_pattern: &str) -> anyhow::Result<u8> {
    println!("Re-balancing leaders of quorum queues...");
    let (status, body) = api_request(
        data_dir,
        "POST",
        "/api/rebalance/queues",
        Some(json!({ "vhost_pattern": vhost_pattern, "queue_pattern": queue_pattern })),
        Vec::new(),
    )?;
    if status >= 300 {
        return Ok(super::client::api_failure(status, &body));
    }
    let list = |key: &str| body[key].as_array().cloned().unwrap_or_default();
    for m in list("moved") {
        println!(
            "moved\t{}\t{}\t{} -> {}",
            m["vhost"].as_str().unwrap_or_default(),
            m["name"].as_str().unwrap_or_default(),
            m["from"].as_str().unwrap_or("-"),
            m["to"].as_str().unwrap_or_default()
        );
    }
    let failed = list("failed");
    for m in &failed {
        println!(
            "failed\t{}\t{}\t{}",
            m["vhost"].as_str().unwrap_or_default(),
            m["name"].as_str().unwrap_or_default(),
            m["reason"].as_str().unwrap_or_default()
        );
    }
    println!("Node name\tNumber of quorum queue leaders");
    if let Some(leaders) = body["leaders"].as_object() {
        for (node, n) in leaders {
            println!("{node}\t{n}");
        }
    }
    Ok(if failed.is_empty() { 0 } else { 70 })
}

/// A quorum queue and its members, from the queue listing.
struct QuorumQueue {
    vhost: String,
    name: String,
    members: Vec<String>,
}

fn quorum_queues(data_dir: &Path) -> anyhow::Result<Vec<QuorumQueue>> {
    let (status, body) = api_request(data_dir, "GET", "/api/queues", None, Vec::new())?;
    if status != 200 {
        anyhow::bail!(
            "listing queues: {}",
            body["reason"].as_str().unwrap_or("failed")
        );
    }
    Ok(body
        .as_array()
        .into_iter()
        .flatten()
        .filter(|q| q["type"] == "quorum")
        .map(|q| QuorumQueue {
            vhost: q["vhost"].as_str().unwrap_or_default().to_string(),
            name: q["name"].as_str().unwrap_or_default().to_string(),
            members: names(&q["members"]),
        })
        .collect())
}

fn names(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n.as_str().map(str::to_string))
        .collect()
}

fn regex_of(pattern: &str) -> anyhow::Result<regex::Regex> {
    regex::Regex::new(pattern).map_err(|e| anyhow::anyhow!("pattern {pattern}: {e}"))
}

/// Why one change failed: the API's status and reason.
type Failure = (u16, String);

/// Add (`add`) or remove `node` as a member, then wait for the leader to report it.
fn change(
    data_dir: &Path,
    vhost: &str,
    queue: &str,
    node: &str,
    add: bool,
) -> anyhow::Result<Result<(), Failure>> {
    let base = format!(
        "/api/queues/{}/{}",
        percent_segment(vhost),
        percent_segment(queue)
    );
    let (status, body) = if add {
        api_request(
            data_dir,
            "POST",
            &format!("{base}/members"),
            Some(json!({ "node": node })),
            Vec::new(),
        )?
    } else {
        api_request(
            data_dir,
            "DELETE",
            &format!("{base}/members/{}", percent_segment(node)),
            None,
            Vec::new(),
        )?
    };
    if status >= 300 {
        let reason = body["reason"].as_str().unwrap_or("failed").to_string();
        return Ok(Err((status, reason)));
    }
    let deadline = Instant::now() + MEMBERS_WAIT;
    loop {
        let (status, q) = api_request(data_dir, "GET", &base, None, Vec::new())?;
        if status == 200 && names(&q["members"]).iter().any(|m| m == node) == add {
            return Ok(Ok(()));
        }
        if Instant::now() >= deadline {
            return Ok(Err((
                504,
                "the change committed, but the queue's leader has not applied it yet".into(),
            )));
        }
        // Polling the leader's view: the API has no membership event to wait on.
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn report_one(r: &Result<(), Failure>) -> u8 {
    match r {
        Ok(()) => 0,
        Err((status, reason)) => super::client::api_failure(*status, &json!({ "reason": reason })),
    }
}

fn report_many(rows: &[(QuorumQueue, usize, Result<(), Failure>)]) -> u8 {
    if !rows.is_empty() {
        println!("vhost\tname\tsize\tresult");
    }
    let mut failed = false;
    for (q, size, r) in rows {
        let result = match r {
            Ok(()) => "ok".to_string(),
            Err((_, reason)) => {
                failed = true;
                format!("error: {reason}")
            }
        };
        println!("{}\t{}\t{size}\t{result}", q.vhost, q.name);
    }
    u8::from(failed) * 70
}
