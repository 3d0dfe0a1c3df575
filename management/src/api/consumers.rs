//! `/api/consumers` and `/api/consumers/{vhost}` (rabbit_mgmt_wm_consumers): the consumers of
//! the connections the caller may see, read from their channels.

use axum::extract::{Path, State};
use serde_json::{Value, json};

use super::connections::{channel_name, channels_of, visible_connections};
use super::{ApiResult, ok_json, vhost_for};
use crate::AppState;
use crate::auth::Caller;
use crate::json::table_to_json;

pub(super) async fn consumers_filtered(
    state: &AppState,
    caller: &Caller,
    vhost: Option<&str>,
) -> Value {
    let conns = visible_connections(state, caller)
        .into_iter()
        .filter(|h| vhost.is_none_or(|v| h.info.vhost == v))
        .collect();
    let mut out = Vec::new();
    for (h, c) in channels_of(conns).await {
        for k in &c.consumers {
            out.push(json!({
                "consumer_tag": k.tag,
                "queue": {"name": k.queue, "vhost": h.info.vhost},
                "channel_details": {
                    "name": channel_name(&h, c.number),
                    "number": c.number,
                    "connection_name": h.info.name,
                    "peer_host": h.info.peer.ip().to_string(),
                    "peer_port": h.info.peer.port(),
                    "user": h.info.user,
                    "node": state.node.node,
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
    Value::Array(out)
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
