//! `/api/consumer-groups[/{vhost}[/{queue}]]` (Warren): the consumer groups of partitioned
//! queues: members (consumer tag, connection, channel, partitions), each partition's owner
//! and lag (a queue's ready messages; a stream's messages after the group's offset), the
//! total lag, and the
//! group's epoch (bumped on every assignment).

use axum::extract::{Path, State};
use serde_json::{Value, json};
use warren_broker::node::groups::GroupInfo;
use warren_broker::routing::partitions::partition_name;

use super::{ApiResult, ok_json, vhost_for, visible_vhosts};
use crate::AppState;
use crate::auth::Caller;

fn group_json(state: &AppState, g: &GroupInfo) -> Value {
    let set = state
        .broker
        .vhost(&g.key.vhost)
        .and_then(|vh| vh.partitioned(&g.key.queue));
    let mut total = 0u64;
    let partitions: Vec<Value> = g
        .owners
        .iter()
        .enumerate()
        .map(|(i, owner)| {
            let queue = set
                .as_ref()
                .and_then(|s| s.members.get(i).cloned().flatten());
            let lag = queue.as_ref().map_or(0, |q| {
                warren_broker::node::groups::partition_lag(q, &g.key.group)
            });
            total += lag;
            let index = u32::try_from(i).unwrap_or(u32::MAX);
            json!({
                "partition": index,
                "queue": partition_name(&g.key.queue, index),
                "owner": owner,
                "lag": lag,
            })
        })
        .collect();
    json!({
        "vhost": g.key.vhost,
        "queue": g.key.queue,
        "name": g.key.group,
        "epoch": g.epoch,
        "members": g.members.iter().map(|m| json!({
            "consumer_tag": m.tag,
            "node": m.node,
            "connection": m.connection,
            "channel": m.channel,
            "partitions": m.partitions,
        })).collect::<Vec<_>>(),
        "partitions": partitions,
        "lag": total,
    })
}

/// GET /api/consumer-groups: every group in the vhosts the caller may see.
pub(super) async fn list_all(State(state): State<AppState>, caller: Caller) -> ApiResult {
    let vhosts: Vec<String> = visible_vhosts(&state, &caller)
        .iter()
        .map(|v| v.name.clone())
        .collect();
    let groups: Vec<Value> = state
        .broker
        .groups()
        .list(None, None)
        .iter()
        .filter(|g| vhosts.contains(&g.key.vhost))
        .map(|g| group_json(&state, g))
        .collect();
    ok_json(Value::Array(groups))
}

/// GET /api/consumer-groups/{vhost}.
pub(super) async fn list_vhost(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    vhost_for(&state, &caller, &vhost)?;
    let groups: Vec<Value> = state
        .broker
        .groups()
        .list(Some(&vhost), None)
        .iter()
        .map(|g| group_json(&state, g))
        .collect();
    ok_json(Value::Array(groups))
}

/// GET /api/consumer-groups/{vhost}/{queue}: the groups of one partitioned queue.
pub(super) async fn list_queue(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, queue)): Path<(String, String)>,
) -> ApiResult {
    vhost_for(&state, &caller, &vhost)?;
    let groups: Vec<Value> = state
        .broker
        .groups()
        .list(Some(&vhost), Some(&queue))
        .iter()
        .map(|g| group_json(&state, g))
        .collect();
    ok_json(Value::Array(groups))
}
