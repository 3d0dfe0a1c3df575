//! `/api/nodes` and `/api/nodes/{name}` (rabbit_mgmt_wm_nodes, rabbit_mgmt_wm_node): the
//! node's facts, the cluster's members, and Warren's DELETE to forget a stopped node.

use axum::extract::{Path, State};
use serde_json::{Value, json};

use super::commit::committed;
use super::{ApiResult, ok_json};
use crate::auth::Caller;
use crate::{ApiError, AppState};

/// `GET /api/nodes`: this node's facts, and for a cluster each other node's name and whether
/// it is running (as this node last heard; its own facts are on its own API).
pub(super) async fn nodes(State(state): State<AppState>, caller: Caller) -> ApiResult {
    let mut all = vec![node_json(&state, &caller)?];
    if let Some(cluster) = state.broker.cluster() {
        for n in cluster.nodes() {
            if n.name != state.node.node {
                all.push(json!({"name": n.name, "type": "disc", "running": n.running}));
            }
        }
    }
    ok_json(Value::Array(all))
}

/// `GET /api/nodes/{name}`: this node, or 404 for any other name.
pub(super) async fn one_node(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult {
    let node = node_json(&state, &caller)?;
    if name != state.node.node {
        return Err(ApiError::not_found());
    }
    ok_json(node)
}

/// Warren's own (`rabbitmqctl forget_cluster_node` has no HTTP form): remove a stopped node
/// from the cluster for good. Answers once that committed.
pub(super) async fn forget_node(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult {
    use warren_broker::node::replication::MembershipError;
    caller.require_admin()?;
    let Some(cluster) = state.broker.cluster() else {
        return Err(ApiError::bad_request("this node is not clustered"));
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    cluster
        .forget_node(
            &name,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        )
        .map_err(|e| match e {
            MembershipError::UnknownNode(_) => ApiError {
                reason: e.to_string(),
                ..ApiError::not_found()
            },
            other => ApiError::bad_request(other.to_string()),
        })?;
    committed(rx).await
}

/// The node's facts (RabbitMQ shows them to `monitoring` and `administrator` users only).
fn node_json(state: &AppState, caller: &Caller) -> Result<Value, ApiError> {
    if !caller.sees_all_vhosts() {
        return Err(ApiError::unauthorised("Not monitor user"));
    }
    // RabbitMQ lists its distribution links here; Warren's cluster port has one link each
    // way per peer, counted together.
    let cluster_links: Vec<Value> = state
        .broker
        .cluster()
        .map(|c| c.nodes())
        .unwrap_or_default()
        .into_iter()
        .filter(|n| n.name != state.node.node)
        .map(|n| {
            json!({
                "name": n.name,
                "stats": {"send_bytes": n.send_bytes, "recv_bytes": n.recv_bytes},
            })
        })
        .collect();
    let alarms = state.broker.alarms();
    let w = alarms.watermarks();
    let sample = alarms.last_sample();
    let total = sample.map_or(0, |s| s.memory_total);
    Ok(json!({
        "name": state.node.node,
        "type": "disc",
        "running": true,
        "mem_used": sample.map_or(0, |s| s.memory_used),
        "mem_limit": w.memory_limit(total),
        "mem_alarm": alarms.state().memory,
        "disk_free": sample.map_or(0, |s| s.disk_free),
        "disk_free_limit": w.disk_limit(total),
        "disk_free_alarm": alarms.state().disk,
        "fd_used": crate::process::open_fds(),
        "fd_total": crate::process::max_fds(),
        "sockets_used": state.broker.connection_count(),
        "sockets_total": state.broker.config.connection_max.or(crate::process::max_fds()),
        "uptime": u64::try_from(state.started.elapsed().as_millis()).unwrap_or(u64::MAX),
        "os_pid": std::process::id().to_string(),
        "cluster_links": cluster_links,
    }))
}
