//! `/api/connections/...` and `/api/channels/...` (rabbit_mgmt_wm_connections,
//! rabbit_mgmt_wm_connection, rabbit_mgmt_wm_channels, rabbit_mgmt_wm_channel), with their
//! per-vhost and per-connection views: list, show and close connections, list and show
//! channels (asked of their connection tasks).

use std::sync::Arc;

use axum::extract::{Path, State};
use serde_json::{Value, json};
use warren_broker::node::replication::Listing;

use super::{ApiResult, no_content, ok_json, vhost_for};
use crate::auth::Caller;
use crate::json::table_to_json;
use crate::{ApiError, AppState};

pub(super) fn connection_json(
    node: &str,
    h: &warren_broker::node::connections::ConnectionHandle,
) -> Value {
    let i = &h.info;
    let mut v = json!({
        "name": i.name,
        "node": node,
        "vhost": i.vhost,
        "user": i.user,
        "state": "running",
        "type": "network",
        "protocol": "AMQP 0-9-1",
        "channels": h.channels(),
        "peer_host": i.peer.ip().to_string(),
        "peer_port": i.peer.port(),
        "host": i.local.ip().to_string(),
        "port": i.local.port(),
        "ssl": i.tls,
        "frame_max": i.frame_max,
        "channel_max": i.channel_max,
        "timeout": i.heartbeat_s,
        "connected_at": i.connected_at_ms,
        "client_properties": table_to_json(&i.client_properties),
    });
    if let Some(name) = user_provided_name(i) {
        v["user_provided_name"] = json!(name);
    }
    v
}

/// The client's `connection_name` property (a long string), which RabbitMQ reports as
/// `user_provided_name` (rabbit_reader's augment_infos_with_user_provided_connection_name).
fn user_provided_name(i: &warren_broker::node::connections::ConnectionInfo) -> Option<String> {
    match i.client_properties.inner().get("connection_name") {
        Some(amq_protocol::types::AMQPValue::LongString(s)) => {
            Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        Some(amq_protocol::types::AMQPValue::ShortString(s)) => Some(s.as_str().to_string()),
        _ => None,
    }
}

/// Connections the caller may see: all for monitoring and administrator, else its own.
pub(super) fn visible_connections(
    state: &AppState,
    caller: &Caller,
) -> Vec<Arc<warren_broker::node::connections::ConnectionHandle>> {
    state
        .broker
        .connections()
        .list()
        .into_iter()
        .filter(|h| caller.sees_all_vhosts() || h.info.user == caller.name)
        .collect()
}

/// Every entry of `kind` the other running nodes list (each node's JSON array, concatenated).
async fn peer_lists(state: &AppState, kind: Listing) -> Vec<Value> {
    let Some(cluster) = state.broker.cluster() else {
        return Vec::new();
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    cluster.peer_listings(
        kind,
        Box::new(move |lists| {
            let _ = tx.send(lists);
        }),
    );
    rx.await
        .unwrap_or_default()
        .iter()
        .filter_map(|json| serde_json::from_slice::<Vec<Value>>(json).ok())
        .flatten()
        .collect()
}

/// The other nodes' connection and channel counts summed (for `/api/overview`, to a caller
/// who sees every vhost).
pub(super) async fn peer_totals(state: &AppState) -> (u64, u64) {
    peer_lists(state, Listing::Totals)
        .await
        .iter()
        .fold((0, 0), |(c, h), v| {
            (
                c + v["connections"].as_u64().unwrap_or(0),
                h + v["channels"].as_u64().unwrap_or(0),
            )
        })
}

/// The other nodes' entries of `kind` that `caller` may see (monitoring and administrator
/// users see all, others their own), as RabbitMQ's API lists the whole cluster.
pub(super) async fn peer_entries(state: &AppState, caller: &Caller, kind: Listing) -> Vec<Value> {
    peer_lists(state, kind)
        .await
        .into_iter()
        .filter(|v| {
            // A connection or channel names its user; a consumer, its channel's.
            let user = v["user"]
                .as_str()
                .or_else(|| v["channel_details"]["user"].as_str());
            caller.sees_all_vhosts() || user == Some(caller.name.as_str())
        })
        .collect()
}

/// Every connection of the cluster `caller` may see that `keep` keeps, sorted by name.
async fn cluster_connections(
    state: &AppState,
    caller: &Caller,
    keep: impl Fn(&Value) -> bool,
) -> Vec<Value> {
    let mut all: Vec<Value> = visible_connections(state, caller)
        .iter()
        .map(|h| connection_json(&state.node.node, h))
        .chain(peer_entries(state, caller, Listing::Connections).await)
        .filter(|v| keep(v))
        .collect();
    all.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    all
}

pub(super) async fn list_connections(State(state): State<AppState>, caller: Caller) -> ApiResult {
    ok_json(Value::Array(
        cluster_connections(&state, &caller, |_| true).await,
    ))
}

pub(super) async fn list_vhost_connections(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    vhost_for(&state, &caller, &vhost)?;
    ok_json(Value::Array(
        cluster_connections(&state, &caller, |v| v["vhost"].as_str() == Some(&vhost)).await,
    ))
}

/// Connection `name` wherever in the cluster it is, if `caller` may see it.
async fn find_connection(state: &AppState, caller: &Caller, name: &str) -> Option<Value> {
    if let Some(h) = visible_connections(state, caller)
        .into_iter()
        .find(|h| h.info.name == name)
    {
        return Some(connection_json(&state.node.node, &h));
    }
    peer_entries(state, caller, Listing::Connections)
        .await
        .into_iter()
        .find(|v| v["name"].as_str() == Some(name))
}

pub(super) async fn get_connection(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult {
    ok_json(
        find_connection(&state, &caller, &name)
            .await
            .ok_or_else(ApiError::not_found)?,
    )
}

/// DELETE /api/connections/{name}: 320 CONNECTION_FORCED with the `X-Reason` header's text
/// (RabbitMQ's default: "Closed via management plugin").
pub(super) async fn close_connection(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    headers: axum::http::HeaderMap,
) -> ApiResult {
    let found = find_connection(&state, &caller, &name)
        .await
        .ok_or_else(ApiError::not_found)?;
    // Seeing every connection (monitoring) is not closing them: administrators or the owner.
    if !caller.is_admin() && found["user"].as_str() != Some(caller.name.as_str()) {
        return Err(ApiError::unauthorised("Not administrator user"));
    }
    let reason = headers
        .get("x-reason")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("Closed via management plugin")
        .to_string();
    if let Some(h) = state.broker.connections().find(&name) {
        h.request_close(reason);
        return no_content();
    }
    let Some(cluster) = state.broker.cluster() else {
        return Err(ApiError::not_found());
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    cluster.close_peer_connection(
        name,
        reason,
        Box::new(move |closed| {
            let _ = tx.send(closed);
        }),
    );
    if rx.await.unwrap_or(false) {
        no_content()
    } else {
        Err(ApiError::not_found())
    }
}

// ---------------------------------------------------------------- channels

/// How long a connection task may take to describe its channels.
const SNAPSHOT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

pub(super) type Handle = Arc<warren_broker::node::connections::ConnectionHandle>;

/// The channels of `conns`, asked of their connection tasks concurrently; a connection that
/// does not answer in time (or closed) is left out.
pub(super) async fn channels_of(
    conns: Vec<Handle>,
) -> Vec<(Handle, warren_broker::node::connections::ChannelInfo)> {
    let mut tasks = Vec::new();
    for h in conns {
        tasks.push(tokio::spawn(async move {
            let chans = tokio::time::timeout(SNAPSHOT_WAIT, h.channels_snapshot())
                .await
                .ok()
                .flatten()
                .unwrap_or_default();
            (h, chans)
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        if let Ok((h, chans)) = t.await {
            out.extend(chans.into_iter().map(|c| (Arc::clone(&h), c)));
        }
    }
    out
}

pub(super) fn channel_name(h: &Handle, number: u16) -> String {
    format!("{} ({number})", h.info.name)
}

pub(super) fn channel_json(
    node: &str,
    h: &Handle,
    c: &warren_broker::node::connections::ChannelInfo,
) -> Value {
    let mut details = json!({"name": h.info.name, "peer_host": h.info.peer.ip().to_string(),
                             "peer_port": h.info.peer.port()});
    if let Some(name) = user_provided_name(&h.info) {
        details["user_provided_name"] = json!(name);
    }
    json!({
        "name": channel_name(h, c.number),
        "number": c.number,
        "node": node,
        "user": h.info.user,
        "vhost": h.info.vhost,
        "state": "running",
        "connection_details": details,
        "consumer_count": c.consumers.len(),
        "prefetch_count": c.prefetch_count,
        "global_prefetch_count": c.global_prefetch_count,
        "messages_unacknowledged": c.unacked,
        "confirm": c.confirm,
        "transactional": c.transactional,
    })
}

/// Every channel of the cluster `caller` may see whose JSON `keep` keeps: this node's
/// (asked of their connection tasks) then the other nodes', sorted by name.
async fn channels_filtered(
    state: &AppState,
    caller: &Caller,
    keep: impl Fn(&Value) -> bool,
) -> Vec<Value> {
    let conns = visible_connections(state, caller);
    let (here, there) = tokio::join!(
        channels_of(conns),
        peer_entries(state, caller, Listing::Channels)
    );
    let mut all: Vec<Value> = here
        .iter()
        .map(|(h, c)| channel_json(&state.node.node, h, c))
        .chain(there)
        .filter(|v| keep(v))
        .collect();
    all.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    all
}

pub(super) async fn list_channels(State(state): State<AppState>, caller: Caller) -> ApiResult {
    ok_json(Value::Array(
        channels_filtered(&state, &caller, |_| true).await,
    ))
}

pub(super) async fn list_vhost_channels(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    vhost_for(&state, &caller, &vhost)?;
    ok_json(Value::Array(
        channels_filtered(&state, &caller, |v| v["vhost"].as_str() == Some(&vhost)).await,
    ))
}

pub(super) async fn list_connection_channels(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult {
    if find_connection(&state, &caller, &name).await.is_none() {
        return Err(ApiError::not_found());
    }
    let of = |v: &Value| v["connection_details"]["name"].as_str() == Some(&name);
    ok_json(Value::Array(channels_filtered(&state, &caller, of).await))
}

/// `GET /api/channels/{name}`: one channel, named `<connection name> (<number>)`.
pub(super) async fn get_channel(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult {
    let (conn, number) = name
        .strip_suffix(')')
        .and_then(|n| n.rsplit_once(" ("))
        .and_then(|(c, n)| Some((c, n.parse::<u16>().ok()?)))
        .ok_or_else(ApiError::not_found)?;
    let conns: Vec<Handle> = visible_connections(&state, &caller)
        .into_iter()
        .filter(|h| h.info.name == conn)
        .collect();
    if conns.is_empty() {
        // Not a connection of this node: another node's, if any has it.
        return peer_entries(&state, &caller, Listing::Channels)
            .await
            .into_iter()
            .find(|v| v["name"].as_str() == Some(name.as_str()))
            .map_or_else(|| Err(ApiError::not_found()), ok_json);
    }
    channels_of(conns)
        .await
        .iter()
        .find(|(_, c)| c.number == number)
        .map(|(h, c)| ok_json(channel_json(&state.node.node, h, c)))
        .unwrap_or_else(|| Err(ApiError::not_found()))
}
