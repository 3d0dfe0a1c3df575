//! `/api/overview` (rabbit_mgmt_wm_overview) and `/api/cluster-name`
//! (rabbit_mgmt_wm_cluster_name): the node-wide summary.

use axum::extract::State;
use serde_json::{Value, json};
use warren_amqp::connection::WARREN_VERSION;
use warren_broker::stats::Lifecycle;

use super::common::{message_stats_json, totals};
use super::{ApiResult, RABBITMQ_API_VERSION, ok_json, visible_vhosts};
use crate::AppState;
use crate::auth::Caller;

pub(super) async fn overview(State(state): State<AppState>, caller: Caller) -> ApiResult {
    let vhosts = visible_vhosts(&state, &caller);
    let t = totals(vhosts.iter().map(|v| &**v));
    let listeners: Vec<Value> = state
        .node
        .listeners
        .iter()
        .map(|(protocol, addr)| {
            json!({"node": state.node.node, "protocol": protocol,
                   "ip_address": addr.ip().to_string(), "port": addr.port()})
        })
        .collect();
    let contexts: Vec<Value> = state
        .node
        .listeners
        .iter()
        .filter(|(protocol, _)| protocol == "http")
        .map(|(_, addr)| {
            json!({"node": state.node.node, "description": "RabbitMQ Management",
                   "path": "/", "port": addr.port().to_string()})
        })
        .collect();
    // As RabbitMQ's, the totals cover the cluster (queues and their consumers are known to
    // every node; connections and channels are asked of the others).
    let (peer_connections, peer_channels) = if caller.sees_all_vhosts() {
        super::connections::peer_totals(&state).await
    } else {
        (0, 0)
    };
    let events = state.broker.stats();
    let count = |e| events.events(e);
    let zero_rate = json!({"rate": 0.0});
    ok_json(json!({
        "management_version": RABBITMQ_API_VERSION,
        "rates_mode": "basic",
        // RabbitMQ's defaults (max ages in seconds), sorted as rabbit_mgmt_wm_overview does.
        "sample_retention_policies": {
            "global": [600, 3600, 28800, 86400],
            "basic": [600, 3600],
            "detailed": [600],
        },
        "exchange_types": [
            {"name": "direct", "description": "AMQP direct exchange, as per the AMQP specification", "enabled": true},
            {"name": "fanout", "description": "AMQP fanout exchange, as per the AMQP specification", "enabled": true},
            {"name": "headers", "description": "AMQP headers exchange, as per the AMQP specification", "enabled": true},
            {"name": "topic", "description": "AMQP topic exchange, as per the AMQP specification", "enabled": true},
            {"name": "x-consistent-hash", "description": "Consistent Hashing Exchange", "enabled": true},
            {"name": "x-delayed-message", "description": "Delayed Message Exchange", "enabled": true},
            {"name": "x-modulus-hash", "description": "Modulus Hashing Exchange", "enabled": true},
        ],
        "product_version": state.node.identity.version,
        "product_name": state.node.identity.product,
        "rabbitmq_version": RABBITMQ_API_VERSION,
        "cluster_name": state.node.cluster_name,
        "cluster_tags": {},
        "node_tags": {},
        // There is no Erlang runtime: these name the broker and its platform instead, for
        // clients that require the keys (docs/compatibility.md).
        "erlang_version": format!("Warren {WARREN_VERSION}"),
        "erlang_full_version": format!(
            "Warren {WARREN_VERSION} (Rust, {} {}); no Erlang runtime",
            std::env::consts::OS,
            std::env::consts::ARCH
        ),
        "disable_stats": false,
        "default_queue_type": "classic",
        "is_op_policy_updating_enabled": true,
        "enable_queue_totals": false,
        "message_stats": message_stats(&state),
        "churn_rates": {
            "connection_created": count(Lifecycle::ConnectionOpened),
            "connection_created_details": zero_rate,
            "connection_closed": count(Lifecycle::ConnectionClosed),
            "connection_closed_details": zero_rate,
            "channel_created": count(Lifecycle::ChannelOpened),
            "channel_created_details": zero_rate,
            "channel_closed": count(Lifecycle::ChannelClosed),
            "channel_closed_details": zero_rate,
            "queue_declared": count(Lifecycle::QueueDeclared),
            "queue_declared_details": zero_rate,
            "queue_created": count(Lifecycle::QueueCreated),
            "queue_created_details": zero_rate,
            "queue_deleted": count(Lifecycle::QueueDeleted),
            "queue_deleted_details": zero_rate,
        },
        "queue_totals": {
            "messages": t.ready + t.unacked,
            "messages_details": zero_rate,
            "messages_ready": t.ready,
            "messages_ready_details": zero_rate,
            "messages_unacknowledged": t.unacked,
            "messages_unacknowledged_details": zero_rate,
        },
        "object_totals": {
            "connections": state.broker.connection_count() + peer_connections,
            "channels": state.broker.channel_count() + peer_channels,
            "exchanges": t.exchanges,
            "queues": t.queues,
            "consumers": t.consumers,
        },
        "statistics_db_event_queue": 0,
        "node": state.node.node,
        "listeners": listeners,
        "contexts": contexts,
    }))
}

/// The node's `message_stats`: totals since start with `*_details.rate` per second.
fn message_stats(state: &AppState) -> Value {
    let t = state.broker.stats().snapshot();
    let r = state
        .rates
        .lock()
        .map(|r| r.per_second())
        .unwrap_or_default();
    message_stats_json(&t, &r, true)
}

pub(super) async fn cluster_name(State(state): State<AppState>, _caller: Caller) -> ApiResult {
    ok_json(json!({"name": state.node.cluster_name}))
}
