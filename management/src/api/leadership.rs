//! Moving quorum queue leaders: one queue's leadership to a named member (Warren's own), and
//! RabbitMQ's `POST /api/rebalance/queues` (what `rabbitmq-queues rebalance quorum` does),
//! which evens out leaders over the running nodes.
//!
//! Both answer once the moves are done (RabbitMQ's rebalance answers at once and logs): the
//! body says what moved, what did not and why, and the leaders per node afterwards.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use serde::Deserialize;
use serde_json::json;
use warren_broker::node::rebalance::{Leadership, leader_counts, plan};
use warren_broker::node::replication::{ClusterHooks, TransferError};
use warren_broker::queue::Queue;

use super::{ApiResult, ok_json, queue_for, visible_vhosts};
use crate::auth::Caller;
use crate::{ApiError, AppState};

#[derive(Debug, Deserialize)]
pub(super) struct LeaderBody {
    node: String,
}

/// `POST /api/queues/{vhost}/{queue}/leader {"node": N}`: hand the queue's leadership to its
/// member N. Answers `{"leader": ...}` once it moved.
pub(super) async fn transfer_leader(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    Json(body): Json<LeaderBody>,
) -> ApiResult {
    caller.require_admin()?;
    let (_, q) = queue_for(&state, &caller, &vhost, &name)?;
    let cluster = clustered(&state)?;
    match transfer(cluster.as_ref(), &q, &body.node).await {
        Ok(leader) => ok_json(json!({ "leader": leader })),
        Err(e @ (TransferError::UnknownNode(_) | TransferError::NotReplicated)) => Err(ApiError {
            reason: e.to_string(),
            ..ApiError::not_found()
        }),
        Err(e @ TransferError::NotVoter(_)) => Err(ApiError::bad_request(e.to_string())),
        Err(e) => Err(unavailable(e.to_string())),
    }
}

/// Which queues a rebalance considers (regular expressions; all when absent).
#[derive(Debug, Default, Deserialize)]
pub(super) struct RebalanceBody {
    #[serde(default)]
    vhost_pattern: Option<String>,
    #[serde(default)]
    queue_pattern: Option<String>,
}

/// `POST /api/rebalance/queues`: move quorum queue leaders so every running node leads about
/// as many (see [`warren_broker::node::rebalance`]). Moves are made one after another.
pub(super) async fn rebalance(
    State(state): State<AppState>,
    caller: Caller,
    body: axum::body::Bytes,
) -> ApiResult {
    caller.require_admin()?;
    let body: RebalanceBody = if body.iter().all(u8::is_ascii_whitespace) {
        RebalanceBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(e.to_string()))?
    };
    let pattern = |p: &Option<String>| {
        regex::Regex::new(p.as_deref().unwrap_or(".*"))
            .map_err(|e| ApiError::bad_request(format!("pattern: {e}")))
    };
    let (vhosts, names) = (pattern(&body.vhost_pattern)?, pattern(&body.queue_pattern)?);
    let cluster = clustered(&state)?;
    let queues: Vec<Arc<Queue>> = visible_vhosts(&state, &caller)
        .iter()
        .filter(|vh| vhosts.is_match(&vh.name))
        .flat_map(|vh| vh.queues())
        .filter(|q| q.replica().is_some() && names.is_match(&q.name))
        .collect();
    let running: Vec<String> = cluster
        .nodes()
        .into_iter()
        .filter(|n| n.running)
        .map(|n| n.name)
        .collect();
    let mut now = leaderships(&queues);
    let moves = plan(&now, &running);
    let mut moved = Vec::new();
    let mut failed = Vec::new();
    for m in moves {
        let q = &queues[m.queue];
        let from = now[m.queue].leader.clone();
        match transfer(cluster.as_ref(), q, &m.to).await {
            Ok(leader) => {
                moved.push(json!({
                    "vhost": q.vhost, "name": q.name, "from": from, "to": leader,
                }));
                // This node may hear of the new leader a moment later: count the answer.
                now[m.queue].leader = Some(leader);
            }
            Err(e) => failed.push(json!({
                "vhost": q.vhost, "name": q.name, "from": from, "to": m.to,
                "reason": e.to_string(),
            })),
        }
    }
    let leaders = leader_counts(&now, &running);
    ok_json(json!({ "moved": moved, "failed": failed, "leaders": leaders }))
}

fn leaderships(queues: &[Arc<Queue>]) -> Vec<Leadership> {
    queues
        .iter()
        .map(|q| {
            let p = q.replica().map(|r| r.placement()).unwrap_or_default();
            Leadership {
                leader: p.leader,
                members: p.members,
            }
        })
        .collect()
}

async fn transfer(
    cluster: &dyn ClusterHooks,
    queue: &Arc<Queue>,
    to: &str,
) -> Result<String, TransferError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    cluster.transfer_leader(
        queue,
        to,
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
    rx.await.unwrap_or_else(|_| {
        Err(TransferError::Failed(
            "the cluster dropped the request".into(),
        ))
    })
}

fn clustered(state: &AppState) -> Result<Arc<dyn ClusterHooks>, ApiError> {
    state
        .broker
        .cluster()
        .cloned()
        .ok_or_else(|| ApiError::bad_request("this node is not clustered"))
}

fn unavailable(reason: String) -> ApiError {
    ApiError {
        status: axum::http::StatusCode::SERVICE_UNAVAILABLE,
        error: "unavailable",
        reason,
    }
}
