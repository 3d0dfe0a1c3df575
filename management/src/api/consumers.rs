//! `/api/consumers` and `/api/consumers/{vhost}` (rabbit_mgmt_wm_consumers): the consumers of
//! the connections the caller may see, on every node of the cluster, read from their
//! channels (other nodes' over the cluster port, as for `/api/channels`).

use axum::extract::{Path, State};
use serde_json::{Value, json};
use warren_broker::node::connections::ChannelInfo;
use warren_broker::node::replication::Listing;

use super::connections::{Handle, channel_name, channels_of, peer_entries, visible_connections};
use super::{ApiResult, ok_json, vhost_for};
use crate::AppState;
use crate::auth::Caller;
use crate::json::table_to_json;

/// The consumers of `chans` (channels of connections on node `node`), as RabbitMQ lists them.
pub(super) fn consumer_entries(node: &str, chans: &[(Handle, ChannelInfo)]) -> Vec<Value> {
    let mut out = Vec::new();
    for (h, c) in chans {
        for k in &c.consumers {
            out.push(json!({
                "consumer_tag": k.tag,
                "queue": {"name": k.queue, "vhost": h.info.vhost},
                "channel_details": {
                    "name": channel_name(h, c.number),
                    "number": c.number,
                    "connection_name": h.info.name,
                    "peer_host": h.info.peer.ip().to_string(),
                    "peer_port": h.info.peer.port(),
                    "user": h.info.user,
                    "node": node,
                },
                "ack_required": k.ack_required,
                "exclusive": k.exclusive,
                "prefetch_count": k.prefetch_count,
                "arguments": table_to_json(&k.arguments),
                "active": true,
                "activity_status": "up",
            }));
        }
    }
    out
}

/// Every consumer of the cluster `caller` may see, of `vhost` if given.
pub(super) async fn consumers_filtered(
    state: &AppState,
    caller: &Caller,
    vhost: Option<&str>,
) -> Value {
    let local = channels_of(visible_connections(state, caller)).await;
    let all = consumer_entries(&state.node.node, &local)
        .into_iter()
        .chain(peer_entries(state, caller, Listing::Consumers).await)
        .filter(|v| vhost.is_none_or(|want| v["queue"]["vhost"].as_str() == Some(want)))
        .collect();
    Value::Array(all)
}

pub(super) async fn list_consumers(State(state): State<AppState>, caller: Caller) -> ApiResult {
    ok_json(consumers_filtered(&state, &caller, None).await)
}

pub(super) async fn list_vhost_consumers(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    vhost_for(&state, &caller, &vhost)?;
    ok_json(consumers_filtered(&state, &caller, Some(&vhost)).await)
}
