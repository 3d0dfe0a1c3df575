//! The `/api` endpoints, with RabbitMQ's paths, JSON field names and status codes.

use std::sync::Arc;

use amq_protocol::protocol::{AMQPClass, basic, confirm, exchange, queue};
use amq_protocol::types::FieldTable;
use axum::Json;
use axum::Router;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;
use serde_json::{Value, json};
use warren_amqp::assembler::Content;
use warren_amqp::properties::Properties;
use warren_broker::policy::PolicyKind;
use warren_broker::queue::Queue;
use warren_broker::users::{PermissionRecord, UserError};
use warren_broker::vhost::VHost;

use crate::auth::Caller;
use crate::direct::Direct;
use crate::json::{json_to_table, table_to_json};
use crate::rates::MessageRates;
use crate::{ApiError, AppState, REQUEST_BODY_MAX, queue_message_stats};
use warren_amqp::connection::WARREN_VERSION;
use warren_broker::stats::{Lifecycle, MessageStats};

mod leadership;

type ApiResult = Result<Response, ApiError>;

/// The version the API reports as `rabbitmq_version`: the RabbitMQ release whose API Warren
/// follows (clients such as rabbitmqadmin look at it).
pub(crate) const RABBITMQ_API_VERSION: &str = "4.2.0";

/// A 401 to a script's request (`X-Requested-With`, as the web UI sends) carries no
/// `WWW-Authenticate`: the browser would otherwise pop its own login dialog over the UI's form.
async fn no_login_prompt_for_scripts(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let scripted = req.headers().contains_key("x-requested-with");
    let mut resp = next.run(req).await;
    if scripted && resp.status() == StatusCode::UNAUTHORIZED {
        resp.headers_mut()
            .remove(axum::http::header::WWW_AUTHENTICATE);
    }
    resp
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/api/overview", get(overview))
        .route("/api/whoami", get(whoami))
        .route("/api/cluster-name", get(cluster_name))
        .route("/api/nodes", get(nodes))
        .route("/api/nodes/{name}", get(one_node).delete(forget_node))
        .route(
            "/api/vhosts/{vhost}/permissions",
            get(vhost_permissions::<false>),
        )
        .route(
            "/api/vhosts/{vhost}/topic-permissions",
            get(vhost_permissions::<true>),
        )
        .route(
            "/api/users/{user}/permissions",
            get(user_permissions::<false>),
        )
        .route(
            "/api/users/{user}/topic-permissions",
            get(user_permissions::<true>),
        )
        .route("/api/channels/{name}", get(get_channel))
        .route("/api/vhosts", get(list_vhosts))
        .route(
            "/api/vhosts/{vhost}",
            get(get_vhost).put(put_vhost).delete(delete_vhost),
        )
        .route("/api/users", get(list_users))
        .route(
            "/api/users/{user}",
            get(get_user).put(put_user).delete(delete_user),
        )
        .route("/api/permissions", get(list_permissions))
        .route(
            "/api/permissions/{vhost}/{user}",
            get(get_permission)
                .put(put_permission)
                .delete(delete_permission),
        )
        .route("/api/queues", get(list_all_queues))
        .route("/api/queues/{vhost}", get(list_vhost_queues))
        .route(
            "/api/queues/{vhost}/{queue}",
            get(get_queue).put(put_queue).delete(delete_queue),
        )
        .route(
            "/api/queues/{vhost}/{queue}/contents",
            axum::routing::delete(purge_queue),
        )
        .route(
            "/api/queues/{vhost}/{queue}/get",
            axum::routing::post(get_messages),
        )
        .route(
            "/api/queues/{vhost}/{queue}/members",
            axum::routing::post(add_member),
        )
        .route(
            "/api/queues/{vhost}/{queue}/members/{node}",
            axum::routing::delete(delete_member),
        )
        .route(
            "/api/queues/{vhost}/{queue}/leader",
            axum::routing::post(leadership::transfer_leader),
        )
        .route(
            "/api/rebalance/queues",
            axum::routing::post(leadership::rebalance),
        )
        .route(
            "/api/exchanges/{vhost}/{exchange}/publish",
            axum::routing::post(publish),
        )
        .route("/api/policies", get(list_all_policies::<false>))
        .route("/api/policies/{vhost}", get(list_vhost_policies::<false>))
        .route(
            "/api/policies/{vhost}/{name}",
            get(get_policy::<false>)
                .put(put_policy::<false>)
                .delete(delete_policy::<false>),
        )
        .route("/api/operator-policies", get(list_all_policies::<true>))
        .route(
            "/api/operator-policies/{vhost}",
            get(list_vhost_policies::<true>),
        )
        .route(
            "/api/operator-policies/{vhost}/{name}",
            get(get_policy::<true>)
                .put(put_policy::<true>)
                .delete(delete_policy::<true>),
        )
        .route("/api/vhost-limits", get(list_vhost_limits))
        .route("/api/vhost-limits/{vhost}", get(get_vhost_limits))
        .route(
            "/api/vhost-limits/{vhost}/{name}",
            axum::routing::put(put_vhost_limit).delete(delete_vhost_limit),
        )
        .route("/api/user-limits", get(list_user_limits))
        .route("/api/user-limits/{user}", get(get_user_limits))
        .route(
            "/api/user-limits/{user}/{name}",
            axum::routing::put(put_user_limit).delete(delete_user_limit),
        )
        .route("/api/topic-permissions", get(list_topic_permissions))
        .route(
            "/api/topic-permissions/{vhost}/{user}",
            get(get_topic_permissions)
                .put(put_topic_permission)
                .delete(delete_topic_permissions),
        )
        .route(
            "/api/definitions",
            get(export_definitions).post(import_definitions),
        )
        .route(
            "/api/definitions/{vhost}",
            get(export_vhost_definitions).post(import_vhost_definitions),
        )
        .route("/api/channels", get(list_channels))
        .route("/api/vhosts/{vhost}/channels", get(list_vhost_channels))
        .route(
            "/api/connections/{name}/channels",
            get(list_connection_channels),
        )
        .route("/api/consumers", get(list_consumers))
        .route("/api/consumers/{vhost}", get(list_vhost_consumers))
        .route("/api/connections", get(list_connections))
        .route(
            "/api/connections/{name}",
            get(get_connection).delete(close_connection),
        )
        .route(
            "/api/vhosts/{vhost}/connections",
            get(list_vhost_connections),
        )
        .route("/api/queues/{vhost}/{queue}/bindings", get(queue_bindings))
        .route(
            "/api/exchanges/{vhost}/{exchange}/bindings/{side}",
            get(exchange_bindings),
        )
        .route("/api/exchanges", get(list_all_exchanges))
        .route("/api/exchanges/{vhost}", get(list_vhost_exchanges))
        .route(
            "/api/exchanges/{vhost}/{exchange}",
            get(get_exchange).put(put_exchange).delete(delete_exchange),
        )
        .route("/api/bindings", get(list_all_bindings))
        .route("/api/bindings/{vhost}", get(list_vhost_bindings))
        .route(
            "/api/bindings/{vhost}/e/{source}/{kind}/{destination}",
            get(list_pair_bindings).post(post_binding),
        )
        .route(
            "/api/bindings/{vhost}/e/{source}/{kind}/{destination}/{props}",
            get(get_binding).delete(delete_binding),
        )
        .route("/api/health/checks/alarms", get(health_alarms))
        .route("/api/health/checks/local-alarms", get(health_alarms))
        .route("/api/health/checks/virtual-hosts", get(health_vhosts))
        .route(
            "/api/health/checks/port-listener/{port}",
            get(health_port_listener),
        )
        .route(
            "/api/health/checks/protocol-listener/{protocol}",
            get(health_protocol_listener),
        )
        .route(
            "/api/health/checks/ready-to-serve-clients",
            get(health_ready),
        )
        .route("/api/aliveness-test/{vhost}", get(aliveness_test))
        .layer(axum::middleware::from_fn(crate::listing::layer))
        .layer(DefaultBodyLimit::max(REQUEST_BODY_MAX))
        .layer(axum::middleware::from_fn(no_login_prompt_for_scripts))
        .with_state(state)
}

/// A short string from request data: 400 over 255 bytes (amq-protocol's `From<&str>` panics).
fn short(s: &str) -> Result<amq_protocol::types::ShortString, ApiError> {
    amq_protocol::types::ShortString::try_new(s.to_string())
        .map_err(|_| ApiError::bad_request(format!("name too long (over 255 bytes): {s:.40}...")))
}

/// The in-process session a request acts through: the caller's own, or the broker's for
/// `warren ctl`.
fn direct(state: &AppState, vhost: &str, caller: &Caller) -> Result<Direct, ApiError> {
    if caller.internal {
        Direct::internal(&state.broker, vhost)
    } else {
        Direct::open(&state.broker, vhost, &caller.name)
    }
}

fn ok_json(v: Value) -> ApiResult {
    Ok(Json(v).into_response())
}

/// 201 when created, 204 when it existed (RabbitMQ's PUT replies).
fn created(new: bool) -> ApiResult {
    Ok(if new {
        StatusCode::CREATED
    } else {
        StatusCode::NO_CONTENT
    }
    .into_response())
}

fn no_content() -> ApiResult {
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// A JSON body, or an empty one (RabbitMQ accepts PUT without a body for vhosts).
fn body(raw: &[u8]) -> Result<Value, ApiError> {
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    serde_json::from_slice(raw).map_err(|e| ApiError::bad_request(format!("bad JSON: {e}")))
}

/// A grant to a user or vhost that does not exist: RabbitMQ's 400 `vhost_or_user_not_found`.
fn grant_error(e: &UserError) -> ApiError {
    match e {
        UserError::NoSuchUser(_) | UserError::NoSuchVhost(_) => {
            ApiError::bad_request("vhost_or_user_not_found")
        }
        other => user_error(other),
    }
}

fn user_error(e: &UserError) -> ApiError {
    match e {
        UserError::NoSuchUser(_) | UserError::NoSuchVhost(_) => ApiError::not_found(),
        other => ApiError::bad_request(other.to_string()),
    }
}

/// The vhosts the caller may see.
fn visible_vhosts(state: &AppState, caller: &Caller) -> Vec<Arc<VHost>> {
    state
        .broker
        .list_vhosts()
        .iter()
        .filter(|v| caller.may_use_vhost(state, v))
        .filter_map(|v| state.broker.vhost(v))
        .collect()
}

/// The vhost and the queue a request names, 404 when either is missing.
fn queue_for(
    state: &AppState,
    caller: &Caller,
    vhost: &str,
    name: &str,
) -> Result<(Arc<VHost>, Arc<Queue>), ApiError> {
    let vh = vhost_for(state, caller, vhost)?;
    let q = vh.queue(name).ok_or_else(ApiError::not_found)?;
    Ok((vh, q))
}

fn vhost_for(state: &AppState, caller: &Caller, name: &str) -> Result<Arc<VHost>, ApiError> {
    let vh = state.broker.vhost(name).ok_or_else(ApiError::not_found)?;
    caller.require_vhost(state, name)?;
    Ok(vh)
}

/// [`vhost_for`] for a PUT or POST that creates something in the vhost: a missing vhost is
/// RabbitMQ's `404 {"error":"not_found","reason":"vhost_not_found"}`.
fn vhost_to_write(state: &AppState, caller: &Caller, name: &str) -> Result<Arc<VHost>, ApiError> {
    let vh = state
        .broker
        .vhost(name)
        .ok_or_else(ApiError::vhost_not_found)?;
    caller.require_vhost(state, name)?;
    Ok(vh)
}

// ---------------------------------------------------------------- overview, node

/// Message and object totals over some vhosts.
#[derive(Debug, Default)]
struct Totals {
    ready: u64,
    unacked: u64,
    queues: u64,
    consumers: u64,
    exchanges: u64,
}

fn totals<'a>(vhosts: impl IntoIterator<Item = &'a VHost>) -> Totals {
    let mut t = Totals::default();
    for vh in vhosts {
        for q in vh.queues() {
            let s = q.stats();
            t.ready += s.ready;
            t.unacked += s.unacked;
            t.consumers += s.consumers;
            t.queues += 1;
        }
        t.exchanges += vh.exchanges().len() as u64;
    }
    t
}

async fn overview(State(state): State<AppState>, caller: Caller) -> ApiResult {
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
            {"name": "x-delayed-message", "description": "Delayed Message Exchange", "enabled": true},
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
            "connections": state.broker.connection_count(),
            "channels": state.broker.channel_count(),
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

/// RabbitMQ's `message_stats` object from counters and their rates (`confirm` only where
/// confirms happen: the node and exchanges, not queues).
fn message_stats_json(t: &MessageStats, r: &MessageRates, with_confirm: bool) -> Value {
    let mut m = serde_json::Map::new();
    for (name, total, rate) in [
        ("publish", t.published, r.published),
        ("deliver", t.delivered, r.delivered),
        ("get", t.got, r.got),
        ("deliver_get", t.delivered + t.got, r.delivered + r.got),
        ("redeliver", t.redelivered, r.redelivered),
        ("ack", t.acked, r.acked),
        ("confirm", t.confirmed, r.confirmed),
    ] {
        if name == "confirm" && !with_confirm {
            continue;
        }
        m.insert(name.into(), json!(total));
        m.insert(format!("{name}_details"), json!({"rate": rate}));
    }
    Value::Object(m)
}

async fn whoami(caller: Caller) -> ApiResult {
    // rabbit_mgmt_format:user/1: every Warren user is an internal (database) user.
    ok_json(json!({"name": caller.name, "tags": caller.tags, "is_internal_user": true}))
}

async fn cluster_name(State(state): State<AppState>, _caller: Caller) -> ApiResult {
    ok_json(json!({"name": state.node.cluster_name}))
}

/// `GET /api/nodes`: this node's facts, and for a cluster each other node's name and whether
/// it is running (as this node last heard; its own facts are on its own API).
async fn nodes(State(state): State<AppState>, caller: Caller) -> ApiResult {
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
async fn one_node(
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
async fn forget_node(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult {
    use warren_broker::replication::MembershipError;
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

/// The reply to a cluster change once `rx` says whether it committed.
async fn committed(
    rx: tokio::sync::oneshot::Receiver<
        Result<Vec<warren_store::Location>, Arc<warren_store::StoreError>>,
    >,
) -> ApiResult {
    let unavailable = |reason: String| ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        error: "unavailable",
        reason,
    };
    match rx.await {
        Ok(Ok(_)) => no_content(),
        Ok(Err(e)) => Err(unavailable(e.to_string())),
        Err(_) => Err(unavailable("the cluster dropped the change".into())),
    }
}

/// The node's facts (RabbitMQ shows them to `monitoring` and `administrator` users only).
fn node_json(state: &AppState, caller: &Caller) -> Result<Value, ApiError> {
    if !caller.sees_all_vhosts() {
        return Err(ApiError::unauthorised("Not monitor user"));
    }
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
    }))
}

// ---------------------------------------------------------------- vhosts

fn vhost_json(vh: &VHost, node: &str) -> Value {
    let t = totals([vh]);
    let description = if vh.name == "/" {
        "Default virtual host"
    } else {
        ""
    };
    let mut metadata = json!({"description": description, "tags": []});
    let dqt = vh.default_queue_type.read().clone();
    if let Some(t) = &dqt {
        metadata["default_queue_type"] = json!(t);
    }
    json!({
        "name": vh.name,
        "description": description,
        "tags": [],
        // RabbitMQ 3.x reports "undefined" for a vhost without a default queue type.
        "default_queue_type": dqt.unwrap_or_else(|| "undefined".into()),
        "metadata": metadata,
        "tracing": false,
        "cluster_state": {node: "running"},
        "messages": t.ready + t.unacked,
        "messages_ready": t.ready,
        "messages_unacknowledged": t.unacked,
    })
}

async fn list_vhosts(State(state): State<AppState>, caller: Caller) -> ApiResult {
    let v: Vec<Value> = visible_vhosts(&state, &caller)
        .iter()
        .map(|vh| vhost_json(vh, &state.node.node))
        .collect();
    ok_json(Value::Array(v))
}

async fn get_vhost(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &name)?;
    ok_json(vhost_json(&vh, &state.node.node))
}

async fn put_vhost(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    raw: axum::body::Bytes,
) -> ApiResult {
    caller.require_admin()?;
    let b = body(&raw)?;
    let dqt = b
        .get("default_queue_type")
        .or_else(|| b.get("metadata").and_then(|m| m.get("default_queue_type")))
        .and_then(Value::as_str)
        .map(str::to_string);
    let new = durably(|done| {
        let new = state
            .broker
            .add_vhost(&name, dqt.as_deref(), done)
            .map_err(|e| user_error(&e))?;
        if !new && let Some(t) = dqt.as_deref() {
            state
                .broker
                .set_default_queue_type(&name, Some(t), done)
                .map_err(|e| user_error(&e))?;
        }
        if new {
            grant_creator(&state, &caller, &name, done)?;
        }
        Ok(new)
    })
    .await?;
    created(new)
}

/// The user who created a vhost may use it (rabbit_vhost:maybe_grant_full_permissions/2).
/// `warren ctl`, like rabbitmqctl and a definitions file loaded at boot, acts as no user.
fn grant_creator(
    state: &AppState,
    caller: &Caller,
    vhost: &str,
    done: &mut dyn FnMut() -> warren_store::writer::Completion,
) -> Result<(), ApiError> {
    if caller.internal || !state.broker.user_exists(&caller.name) {
        return Ok(());
    }
    let full = PermissionRecord {
        user: caller.name.clone(),
        vhost: vhost.to_string(),
        configure: ".*".into(),
        write: ".*".into(),
        read: ".*".into(),
    };
    state
        .broker
        .set_permissions(full, done)
        .map_err(|e| grant_error(&e))
}

async fn delete_vhost(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult {
    caller.require_admin()?;
    durably(|done| {
        state
            .broker
            .delete_vhost(&name, done)
            .map_err(|e| user_error(&e))
    })
    .await?;
    no_content()
}

// ---------------------------------------------------------------- users, permissions

type CommitRx = tokio::sync::oneshot::Receiver<bool>;
type CommitTx = tokio::sync::oneshot::Sender<bool>;

fn commit_waiter() -> (CommitTx, CommitRx) {
    tokio::sync::oneshot::channel()
}

/// A store completion that reports to `tx` (the first completion asked for; later ones, if
/// any, report nothing).
fn waiter(tx: Option<CommitTx>) -> warren_store::writer::Completion {
    Box::new(move |r| {
        if let Some(tx) = tx {
            let _ = tx.send(r.is_ok());
        }
    })
}

/// Run `f` with a completion for the store and wait until what it changed is durable.
async fn durably<T>(
    f: impl FnOnce(&mut dyn FnMut() -> warren_store::writer::Completion) -> Result<T, ApiError>,
) -> Result<T, ApiError> {
    let mut commits = Commits::default();
    let out = {
        let mut done = commits.next();
        f(&mut done)?
    };
    commits.wait().await?;
    Ok(out)
}

/// Wait until the change is durable. A broker without a store never calls the completion:
/// the sender is dropped and the change counts as done.
async fn wait(rx: CommitRx) -> Result<(), ApiError> {
    match rx.await {
        Ok(false) => Err(ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            error: "internal_error",
            reason: "the store did not commit the change".into(),
        }),
        _ => Ok(()),
    }
}

fn user_json(u: &warren_broker::users::UserRecord) -> Value {
    json!({
        "name": u.name,
        "password_hash": u.password_hash,
        "hashing_algorithm": u.hashing_algorithm,
        "tags": u.tags,
        "limits": serde_json::to_value(&u.limits).unwrap_or_else(|_| json!({})),
    })
}

async fn list_users(State(state): State<AppState>, caller: Caller) -> ApiResult {
    caller.require_admin()?;
    ok_json(Value::Array(
        state.broker.list_users().iter().map(user_json).collect(),
    ))
}

async fn get_user(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult {
    caller.require_admin()?;
    ok_json(user_json(&find_user(&state, &name)?))
}

/// `tags` as RabbitMQ takes them: a comma-separated string or a list.
fn tags_of(b: &Value) -> Vec<String> {
    match b.get("tags") {
        Some(Value::String(s)) => s
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_string)
            .collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect(),
        _ => Vec::new(),
    }
}

async fn put_user(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    raw: axum::body::Bytes,
) -> ApiResult {
    caller.require_admin()?;
    let b = body(&raw)?;
    if name.is_empty() {
        return Err(ApiError::bad_request("a user needs a name"));
    }
    // RabbitMQ 3.10 refuses a PUT without tags rather than clearing them.
    if b.get("tags").is_none() {
        return Err(ApiError::bad_request("tags_not_present"));
    }
    let tags = tags_of(&b);
    let existing = find_user(&state, &name).ok();
    let password = b.get("password").and_then(Value::as_str);
    let hash = b.get("password_hash").and_then(Value::as_str);
    // The password goes first; waiting for the tags' commit waits for it too (in order).
    let noop = &mut || -> warren_store::writer::Completion { Box::new(|_| {}) };
    durably(|done| match (password, hash) {
        (Some(p), _) => {
            if existing.is_some() {
                state.broker.change_password(&name, p, noop)
            } else {
                state.broker.add_user(&name, p, noop)
            }
            .map_err(|e| user_error(&e))?;
            state
                .broker
                .set_user_tags(&name, tags, done)
                .map_err(|e| user_error(&e))
        }
        (None, hash) if hash.is_some() || existing.is_none() => {
            // A given hash as it is, or a user without a password (it cannot log in with
            // one), as RabbitMQ creates it.
            let record = warren_broker::users::UserRecord {
                name: name.clone(),
                password_hash: hash.unwrap_or("").to_string(),
                hashing_algorithm: b
                    .get("hashing_algorithm")
                    .and_then(Value::as_str)
                    .unwrap_or(warren_broker::users::SHA256)
                    .to_string(),
                tags,
                limits: existing
                    .as_ref()
                    .map(|u| u.limits.clone())
                    .unwrap_or_default(),
            };
            state
                .broker
                .import_user(record, done)
                .map_err(|e| user_error(&e))
        }
        (None, _) => state
            .broker
            .set_user_tags(&name, tags, done)
            .map_err(|e| user_error(&e)),
    })
    .await?;
    created(existing.is_none())
}

async fn delete_user(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult {
    caller.require_admin()?;
    durably(|done| {
        state
            .broker
            .delete_user(&name, done)
            .map_err(|e| user_error(&e))
    })
    .await?;
    no_content()
}

fn permission_json(p: &PermissionRecord) -> Value {
    json!({"user": p.user, "vhost": p.vhost, "configure": p.configure,
           "write": p.write, "read": p.read})
}

/// `/api/vhosts/{vhost}/permissions` (TOPIC: `/topic-permissions`): the grants in one vhost.
async fn vhost_permissions<const TOPIC: bool>(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    caller.require_admin()?;
    state.broker.vhost(&vhost).ok_or_else(ApiError::not_found)?;
    ok_json(grants(&state, Some(&vhost), None, TOPIC))
}

/// `/api/users/{user}/permissions` (TOPIC: `/topic-permissions`): one user's grants.
async fn user_permissions<const TOPIC: bool>(
    State(state): State<AppState>,
    caller: Caller,
    Path(user): Path<String>,
) -> ApiResult {
    caller.require_admin()?;
    find_user(&state, &user)?;
    ok_json(grants(&state, None, Some(&user), TOPIC))
}

fn grants(state: &AppState, vhost: Option<&str>, user: Option<&str>, topic: bool) -> Value {
    let b = &state.broker;
    Value::Array(if topic {
        b.list_topic_permissions(vhost, user)
            .iter()
            .map(topic_json)
            .collect()
    } else {
        b.list_permissions(vhost, user)
            .iter()
            .map(permission_json)
            .collect()
    })
}

async fn list_permissions(State(state): State<AppState>, caller: Caller) -> ApiResult {
    caller.require_admin()?;
    ok_json(grants(&state, None, None, false))
}

async fn get_permission(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, user)): Path<(String, String)>,
) -> ApiResult {
    caller.require_admin()?;
    let p = state
        .broker
        .list_permissions(Some(&vhost), Some(&user))
        .into_iter()
        .next()
        .ok_or_else(ApiError::not_found)?;
    ok_json(permission_json(&p))
}

async fn put_permission(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, user)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    caller.require_admin()?;
    let b = body(&raw)?;
    let field = |k: &str| {
        b.get(k)
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| ApiError::bad_request(format!("{k} is required")))
    };
    let record = PermissionRecord {
        user: user.clone(),
        vhost: vhost.clone(),
        configure: field("configure")?,
        write: field("write")?,
        read: field("read")?,
    };
    let existed = !state
        .broker
        .list_permissions(Some(&vhost), Some(&user))
        .is_empty();
    durably(|done| {
        state
            .broker
            .set_permissions(record, done)
            .map_err(|e| grant_error(&e))
    })
    .await?;
    created(!existed)
}

async fn delete_permission(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, user)): Path<(String, String)>,
) -> ApiResult {
    caller.require_admin()?;
    // Nothing to clear is a 404, as RabbitMQ answers (the ctl verb stays idempotent).
    if state
        .broker
        .list_permissions(Some(&vhost), Some(&user))
        .is_empty()
    {
        return Err(ApiError::not_found());
    }
    durably(|done| {
        state
            .broker
            .clear_permissions(&vhost, &user, done)
            .map_err(|e| user_error(&e))
    })
    .await?;
    no_content()
}

// ---------------------------------------------------------------- queues

fn queue_json(vh: &VHost, node: &str, q: &Queue, rates: &MessageRates) -> Value {
    let s = q.stats();
    let policy = vh.policy_for(PolicyKind::User, &q.name, q.policy_kind());
    let operator = vh.policy_for(PolicyKind::Operator, &q.name, q.policy_kind());
    let mut v = json!({
        "name": q.name,
        "vhost": vh.name,
        "policy": policy.as_ref().map(|p| &p.def.name),
        "operator_policy": operator.as_ref().map(|p| &p.def.name),
        "effective_policy_definition": warren_broker::policy::effective_definition(
            policy.as_ref(),
            operator.as_ref(),
        ),
        "durable": q.durable,
        "auto_delete": q.auto_delete,
        "exclusive": q.exclusive_owner.is_some(),
        "arguments": table_to_json(&q.arguments),
        "type": queue_type_name(q),
        "state": "running",
        "node": node,
        "messages": s.ready + s.unacked,
        "messages_ready": s.ready,
        "messages_unacknowledged": s.unacked,
        "message_bytes": s.ready_bytes + s.unacked_bytes,
        "message_bytes_ready": s.ready_bytes,
        "message_bytes_unacknowledged": s.unacked_bytes,
        "consumers": s.consumers,
        "message_stats": message_stats_json(&queue_message_stats(&s.counters), rates, false),
        // Warren's own: how long the head of the queue has waited (null when nothing is ready).
        "oldest_ready_message_age_ms": s.oldest_ready_age_ms,
    });
    if let (Some(stream), Some(obj)) = (q.stream(), v.as_object_mut()) {
        // A stream holds its messages whether or not they were delivered: `messages` is
        // what it holds (RabbitMQ's figure too), and Warren adds the offsets, segments and
        // each tracked consumer's lag.
        let st = stream.stats(warren_broker::timers::wall_ms());
        obj.insert("messages".into(), json!(st.messages));
        obj.insert("messages_ready".into(), json!(st.messages));
        obj.insert("message_bytes".into(), json!(st.bytes));
        obj.insert("stream".into(), stream_json(&st));
    }
    if let Some(obj) = v.as_object_mut() {
        if let Some(replica) = q.replica() {
            // rabbit_quorum_queue's fields: the queue's node is its leader.
            let p = replica.placement();
            obj.insert("leader".into(), json!(p.leader));
            obj.insert("node".into(), json!(p.leader));
            obj.insert("online".into(), json!(p.online));
            obj.insert("members".into(), json!(p.members));
        } else if q.is_quorum || q.is_stream {
            // A single node's quorum queue or stream has one member, this node, as
            // RabbitMQ's does.
            obj.insert("leader".into(), json!(node));
            obj.insert("online".into(), json!([node]));
            obj.insert("members".into(), json!([node]));
        }
        // RabbitMQ 4 stores the effective x-queue-type among a queue's arguments
        // (rabbit_amqqueue:augment_declare_args/5).
        if let Some(Value::Object(args)) = obj.get_mut("arguments")
            && !args.contains_key("x-queue-type")
        {
            let kind = queue_type_name(q);
            args.insert("x-queue-type".into(), json!(kind));
        }
    }
    v
}

/// A queue's type as RabbitMQ names it.
fn queue_type_name(q: &Queue) -> &'static str {
    if q.is_stream {
        "stream"
    } else if q.is_quorum {
        "quorum"
    } else {
        "classic"
    }
}

/// Warren's `stream` object of a stream queue: offsets, segments and tracked consumers.
fn stream_json(st: &warren_broker::queue::stream::StreamStats) -> Value {
    json!({
        "first_offset": st.first_offset,
        "next_offset": st.next_offset,
        "segments": st.segments,
        "bytes": st.bytes,
        "consumers": st.tracked.iter().map(|t| json!({
            "name": t.name,
            "offset": t.offset,
            "lag_messages": t.lag.messages,
            "lag_seconds": t.lag.age_ms as f64 / 1000.0,
            "lost_to_retention": t.lag.lost_to_retention,
        })).collect::<Vec<_>>(),
    })
}

/// The per-queue rates, read once for a whole listing.
fn queue_rates(state: &AppState) -> std::sync::MutexGuard<'_, crate::rates::QueueRates> {
    state
        .queue_rates
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn queues_of(state: &AppState, vhosts: &[Arc<VHost>]) -> Value {
    Value::Array(
        vhosts
            .iter()
            .flat_map(|vh| {
                let rates = queue_rates(state);
                vh.queues()
                    .into_iter()
                    .map(|q| {
                        let r = rates.per_second(&vh.name, &q.name);
                        queue_json(vh, &state.node.node, &q, &r)
                    })
                    .collect::<Vec<_>>()
            })
            .collect(),
    )
}

async fn list_all_queues(State(state): State<AppState>, caller: Caller) -> ApiResult {
    let vhosts = visible_vhosts(&state, &caller);
    ok_json(queues_of(&state, &vhosts))
}

async fn list_vhost_queues(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    ok_json(queues_of(&state, &[vh]))
}

async fn get_queue(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult {
    let (vh, q) = queue_for(&state, &caller, &vhost, &name)?;
    let r = queue_rates(&state).per_second(&vhost, &name);
    let mut v = queue_json(&vh, &state.node.node, &q, &r);
    // As RabbitMQ, the one-queue view lists the queue's consumers (asking their connections,
    // so only when the queue has any).
    let details = if q.stats().consumers == 0 {
        Vec::new()
    } else {
        match consumers_filtered(&state, &caller, Some(&vhost)).await {
            Value::Array(all) => all
                .into_iter()
                .filter(|c| c["queue"]["name"] == name.as_str())
                .collect(),
            _ => Vec::new(),
        }
    };
    v["consumer_details"] = Value::Array(details);
    if let Some(replica) = q.replica() {
        // Warren's own: this node's replica, to compare replicas (same index, same digest).
        let r = replica.replica_state(true);
        v["raft"] = json!({
            "applied_index": r.applied_index,
            "term": r.term,
            "last_written_index": r.last_written_index,
            "snapshot_index": r.snapshot_index,
            "role": r.role,
            "digest": r.digest,
            "learners": r.learners,
        });
    }
    ok_json(v)
}

#[derive(Debug, Deserialize)]
struct MemberBody {
    node: String,
}

/// Warren's own (rabbitmq-queues add_member has no HTTP form): make `node` a member of a
/// quorum queue. Answers once the cluster committed the new member list; the queue's leader
/// then makes it a voter once it has caught up.
async fn add_member(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    Json(body): Json<MemberBody>,
) -> ApiResult {
    change_members(
        &state,
        &caller,
        &vhost,
        &name,
        warren_broker::replication::MemberChange::Add(body.node),
    )
    .await
}

/// Warren's own: `node` is no longer a member of a quorum queue (it stays a learner).
async fn delete_member(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name, node)): Path<(String, String, String)>,
) -> ApiResult {
    change_members(
        &state,
        &caller,
        &vhost,
        &name,
        warren_broker::replication::MemberChange::Delete(node),
    )
    .await
}

async fn change_members(
    state: &AppState,
    caller: &Caller,
    vhost: &str,
    name: &str,
    change: warren_broker::replication::MemberChange,
) -> ApiResult {
    use warren_broker::replication::MembershipError;
    caller.require_admin()?;
    let (_, q) = queue_for(state, caller, vhost, name)?;
    let Some(cluster) = state.broker.cluster() else {
        return Err(ApiError::bad_request("this node is not clustered"));
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    cluster
        .change_members(
            &q,
            change,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        )
        .map_err(|e| match e {
            MembershipError::UnknownNode(_) | MembershipError::NotReplicated => ApiError {
                reason: e.to_string(),
                ..ApiError::not_found()
            },
            other => ApiError::bad_request(other.to_string()),
        })?;
    committed(rx).await
}

#[derive(Debug, Deserialize)]
struct QueueBody {
    #[serde(default)]
    durable: bool,
    #[serde(default)]
    auto_delete: bool,
    #[serde(default)]
    arguments: Option<Value>,
}

fn direct_type() -> String {
    "direct".into()
}

fn arguments(v: Option<&Value>) -> Result<FieldTable, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(FieldTable::default()),
        Some(v) => json_to_table(v).map_err(ApiError::bad_request),
    }
}

async fn put_queue(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    vhost_to_write(&state, &caller, &vhost)?;
    let b: QueueBody =
        serde_json::from_value(body(&raw)?).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let existed = state
        .broker
        .vhost(&vhost)
        .and_then(|vh| vh.queue(&name))
        .is_some();
    let mut d = direct(&state, &vhost, &caller)?;
    d.call(
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: short(&name)?,
            passive: false,
            durable: b.durable,
            exclusive: false,
            auto_delete: b.auto_delete,
            nowait: false,
            arguments: arguments(b.arguments.as_ref())?,
        })),
        None,
    )
    .await?;
    created(!existed)
}

/// `?if-empty=true` / `?if-unused=true` on a DELETE: RabbitMQ's conditional deletes (400 when
/// the condition fails, from the AMQP 406).
#[derive(Debug, Default, Deserialize)]
struct DeleteConditions {
    #[serde(rename = "if-empty")]
    if_empty: Option<String>,
    #[serde(rename = "if-unused")]
    if_unused: Option<String>,
}

impl DeleteConditions {
    fn flag(name: &str, v: Option<&String>) -> Result<bool, ApiError> {
        match v.map(String::as_str) {
            None | Some("false") => Ok(false),
            Some("true") => Ok(true),
            Some(other) => Err(ApiError::bad_request(format!(
                "{name} must be true or false, not {other:?}"
            ))),
        }
    }

    fn if_empty(&self) -> Result<bool, ApiError> {
        Self::flag("if-empty", self.if_empty.as_ref())
    }

    fn if_unused(&self) -> Result<bool, ApiError> {
        Self::flag("if-unused", self.if_unused.as_ref())
    }
}

async fn delete_queue(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    axum::extract::Query(cond): axum::extract::Query<DeleteConditions>,
) -> ApiResult {
    queue_for(&state, &caller, &vhost, &name)?;
    let mut d = direct(&state, &vhost, &caller)?;
    d.call(
        AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
            queue: short(&name)?,
            if_unused: cond.if_unused()?,
            if_empty: cond.if_empty()?,
            nowait: false,
        })),
        None,
    )
    .await?;
    no_content()
}

async fn purge_queue(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult {
    queue_for(&state, &caller, &vhost, &name)?;
    let mut d = direct(&state, &vhost, &caller)?;
    d.call(
        AMQPClass::Queue(queue::AMQPMethod::Purge(queue::Purge {
            queue: short(&name)?,
            nowait: false,
        })),
        None,
    )
    .await?;
    no_content()
}

// ---------------------------------------------------------------- exchanges, bindings

fn exchange_json(vhost: &str, x: &warren_broker::vhost::ExchangeInfo) -> Value {
    json!({
        "incoming": [],
        "outgoing": [],
        "name": x.name,
        "vhost": vhost,
        "type": x.kind,
        "durable": x.durable,
        "auto_delete": x.auto_delete,
        "internal": x.internal,
        "arguments": table_to_json(&x.arguments),
        "user_who_performed_action": "",
    })
}

fn exchanges_of(vhosts: &[Arc<VHost>]) -> Value {
    Value::Array(
        vhosts
            .iter()
            .flat_map(|vh| {
                vh.exchanges()
                    .iter()
                    .map(|x| exchange_json(&vh.name, x))
                    .collect::<Vec<_>>()
            })
            .collect(),
    )
}

async fn list_all_exchanges(State(state): State<AppState>, caller: Caller) -> ApiResult {
    ok_json(exchanges_of(&visible_vhosts(&state, &caller)))
}

async fn list_vhost_exchanges(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    ok_json(exchanges_of(&[vh]))
}

/// `amq.default` names the default exchange in URLs.
fn exchange_name(name: &str) -> &str {
    if name == "amq.default" { "" } else { name }
}

async fn get_exchange(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    let name = exchange_name(&name);
    let x = vh
        .exchanges()
        .into_iter()
        .find(|x| x.name == name)
        .ok_or_else(ApiError::not_found)?;
    ok_json(exchange_json(&vhost, &x))
}

#[derive(Debug, Deserialize)]
struct ExchangeBody {
    #[serde(rename = "type", default = "direct_type")]
    kind: String,
    #[serde(default)]
    durable: bool,
    #[serde(default)]
    auto_delete: bool,
    #[serde(default)]
    internal: bool,
    #[serde(default)]
    arguments: Option<Value>,
}

async fn put_exchange(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    let vh = vhost_to_write(&state, &caller, &vhost)?;
    let b: ExchangeBody =
        serde_json::from_value(body(&raw)?).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let existed = vh.exchange_exists(&name);
    let mut d = direct(&state, &vhost, &caller)?;
    d.call(
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: short(&name)?,
            kind: short(&b.kind)?,
            passive: false,
            durable: b.durable,
            auto_delete: b.auto_delete,
            internal: b.internal,
            nowait: false,
            arguments: arguments(b.arguments.as_ref())?,
        })),
        None,
    )
    .await?;
    created(!existed)
}

async fn delete_exchange(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    axum::extract::Query(cond): axum::extract::Query<DeleteConditions>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    if !vh.exchange_exists(&name) {
        return Err(ApiError::not_found());
    }
    let mut d = direct(&state, &vhost, &caller)?;
    d.call(
        AMQPClass::Exchange(exchange::AMQPMethod::Delete(exchange::Delete {
            exchange: short(&name)?,
            if_unused: cond.if_unused()?,
            nowait: false,
        })),
        None,
    )
    .await?;
    no_content()
}

fn bindings_of(vhosts: &[Arc<VHost>]) -> Value {
    Value::Array(
        vhosts
            .iter()
            .flat_map(|vh| {
                vh.bindings()
                    .iter()
                    .map(|b| binding_json(&vh.name, b))
                    .collect::<Vec<_>>()
            })
            .collect(),
    )
}

/// RabbitMQ's `properties_key`, the binding's id in URLs: "~" for an empty key without
/// arguments, else the key percent-encoded (unreserved characters kept), followed by "~" and a
/// hash of the arguments when there are any (bindings that differ only in arguments get
/// different keys, as in RabbitMQ; the hash is Warren's own, clients only pass it back).
fn properties_key(routing_key: &str, arguments: &FieldTable) -> String {
    match args_hash(arguments) {
        None if routing_key.is_empty() => "~".into(),
        None => percent(routing_key),
        Some(h) => format!("{}~{h}", percent(routing_key)),
    }
}

/// `properties_key` as axum hands it to a handler (percent-decoded).
fn properties_key_decoded(routing_key: &str, arguments: &FieldTable) -> String {
    match args_hash(arguments) {
        None if routing_key.is_empty() => "~".into(),
        None => routing_key.to_string(),
        Some(h) => format!("{routing_key}~{h}"),
    }
}

/// 32-bit FNV-1a of the arguments' JSON (keys sorted), base64url without padding: stable
/// across restarts and nodes, and URL-safe. None without arguments.
fn args_hash(arguments: &FieldTable) -> Option<String> {
    use base64::Engine;
    if arguments.inner().is_empty() {
        return None;
    }
    let text = table_to_json(arguments).to_string();
    let mut h: u32 = 0x811c_9dc5;
    for b in text.bytes() {
        h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
    }
    Some(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(h.to_be_bytes()))
}

#[derive(Debug, Deserialize)]
struct BindingBody {
    #[serde(default)]
    routing_key: String,
    #[serde(default)]
    arguments: Option<Value>,
}

/// POST /api/bindings/{vhost}/e/{source}/q/{queue} (and .../e/{destination}): bind, 201.
async fn post_binding(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, source, kind, destination)): Path<(String, String, String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    vhost_to_write(&state, &caller, &vhost)?;
    let b: BindingBody =
        serde_json::from_value(body(&raw)?).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let args = arguments(b.arguments.as_ref())?;
    let args_table = args.clone();
    let source = exchange_name(&source).to_string();
    let method = match kind.as_str() {
        "q" => AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
            queue: short(&destination)?,
            exchange: short(&source)?,
            routing_key: short(&b.routing_key)?,
            nowait: false,
            arguments: args,
        })),
        "e" => AMQPClass::Exchange(exchange::AMQPMethod::Bind(exchange::Bind {
            destination: short(&destination)?,
            source: short(&source)?,
            routing_key: short(&b.routing_key)?,
            nowait: false,
            arguments: args,
        })),
        _ => return Err(ApiError::not_found()),
    };
    let mut d = direct(&state, &vhost, &caller)?;
    d.call(method, None).await?;
    // Relative to the request's URL, as RabbitMQ writes it: `<destination>/<properties_key>`.
    let location = format!(
        "{}/{}",
        percent(&destination),
        properties_key(&b.routing_key, &args_table)
    );
    Ok((
        StatusCode::CREATED,
        [(axum::http::header::LOCATION, location)],
    )
        .into_response())
}

/// Percent-encode a path segment.
fn percent(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

async fn list_all_bindings(State(state): State<AppState>, caller: Caller) -> ApiResult {
    ok_json(bindings_of(&visible_vhosts(&state, &caller)))
}

async fn list_vhost_bindings(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    ok_json(bindings_of(&[vh]))
}

// ---------------------------------------------------------------- health checks

async fn health_alarms(State(state): State<AppState>, _caller: Caller) -> ApiResult {
    let a = state.broker.alarms().state();
    if !a.any() {
        return ok_json(json!({"status": "ok"}));
    }
    let mut alarms = Vec::new();
    if a.memory {
        alarms.push(json!({"node": state.node.node, "resource": "memory"}));
    }
    if a.disk {
        alarms.push(json!({"node": state.node.node, "resource": "disk"}));
    }
    Ok((
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"status": "failed",
                    "reason": "resource alarm(s) in effect in the cluster",
                    "alarms": alarms})),
    )
        .into_response())
}

/// RabbitMQ's `port-listener/{port}`: is something of this node listening on that port?
async fn health_port_listener(
    State(state): State<AppState>,
    _caller: Caller,
    Path(port): Path<String>,
) -> ApiResult {
    let port: u16 = port
        .parse()
        .map_err(|_| ApiError::bad_request(format!("Invalid port: {port}")))?;
    let ports: Vec<u16> = state.node.listeners.iter().map(|(_, a)| a.port()).collect();
    if ports.contains(&port) {
        return ok_json(json!({"status": "ok", "port": port}));
    }
    Ok((
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"status": "failed", "reason": "No active listener",
                    "missing": port, "ports": ports})),
    )
        .into_response())
}

/// RabbitMQ's `protocol-listener/{protocol}`: is this node listening for that protocol?
/// RabbitMQ's aliases are accepted (`amqp091`, `amqp0-9-1`, `amqps`, `management`, ...).
async fn health_protocol_listener(
    State(state): State<AppState>,
    _caller: Caller,
    Path(protocol): Path<String>,
) -> ApiResult {
    let wanted = match protocol.to_ascii_lowercase().as_str() {
        "amqp" | "amqp091" | "amqp0-9-1" | "amqp0.9.1" | "amqp0_9_1" => "amqp",
        "amqps" | "amqp/ssl" | "amqp091/ssl" | "amqp+tls" => "amqp/ssl",
        "http" | "management" | "http/management" => "http",
        "prometheus" | "http/prometheus" => "http/prometheus",
        _ => "",
    };
    let protocols: Vec<&str> = state
        .node
        .listeners
        .iter()
        .map(|(p, _)| p.as_str())
        .collect();
    if !wanted.is_empty() && protocols.contains(&wanted) {
        return ok_json(json!({"status": "ok", "protocol": wanted}));
    }
    Ok((
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"status": "failed", "reason": "No active listener",
                    "missing": protocol, "protocols": protocols})),
    )
        .into_response())
}

/// RabbitMQ's `ready-to-serve-clients`: the node accepts client connections (its listeners
/// are up, which they are once the API answers, and the connection limit is not reached).
async fn health_ready(State(state): State<AppState>, _caller: Caller) -> ApiResult {
    let open = state.broker.connection_count();
    match state.broker.config.connection_max {
        Some(max) if open >= max => Ok((
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "failed",
                        "reason": format!("node connection limit ({max}) is reached")})),
        )
            .into_response()),
        _ => ok_json(json!({"status": "ok"})),
    }
}

async fn health_vhosts(_state: State<AppState>, _caller: Caller) -> ApiResult {
    // Every vhost that exists is running: Warren has no per-vhost process that can stop.
    ok_json(json!({"status": "ok"}))
}

/// RabbitMQ's aliveness test: declare `aliveness-test`, publish to it, get the message back.
async fn aliveness_test(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    vhost_for(&state, &caller, &vhost)?;
    let mut d = direct(&state, &vhost, &caller)?;
    d.call(
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "aliveness-test".into(),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
        None,
    )
    .await?;
    let properties = Properties::parse(bytes::Bytes::from_static(&[0, 0]), 1)
        .map_err(|_| ApiError::bad_request("properties"))?;
    d.call(
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: "aliveness-test".into(),
            mandatory: false,
            immediate: false,
        })),
        Some(Content {
            properties,
            body: bytes::Bytes::from_static(b"test_message"),
        }),
    )
    .await?;
    let replies = d
        .call(
            AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                queue: "aliveness-test".into(),
                no_ack: true,
            })),
            None,
        )
        .await?;
    let got = replies.iter().any(|r| {
        matches!(r.method, AMQPClass::Basic(basic::AMQPMethod::GetOk(_)))
            && r.content
                .as_ref()
                .is_some_and(|(_, b)| &b[..] == b"test_message")
    });
    if got {
        ok_json(json!({"status": "ok"}))
    } else {
        Ok((
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "failed", "reason": "the test message did not come back"})),
        )
            .into_response())
    }
}

// ---------------------------------------------------------------- get and publish

#[derive(Debug, Deserialize)]
struct GetBody {
    count: u32,
    ackmode: String,
    #[serde(default = "auto")]
    encoding: String,
    #[serde(default)]
    truncate: Option<usize>,
}

fn auto() -> String {
    "auto".into()
}

/// Most messages one get request returns (the UI asks for a handful).
const GET_COUNT_MAX: u32 = 1000;

/// POST /api/queues/{vhost}/{queue}/get: RabbitMQ's "get messages" with its four ack modes.
async fn get_messages(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    queue_for(&state, &caller, &vhost, &name)?;
    let b: GetBody =
        serde_json::from_value(body(&raw)?).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let (ack, requeue) = match b.ackmode.as_str() {
        "ack_requeue_true" => (false, true),
        "ack_requeue_false" => (true, false),
        "reject_requeue_true" => (false, true),
        "reject_requeue_false" => (false, false),
        other => return Err(ApiError::bad_request(format!("invalid ackmode {other}"))),
    };
    if !matches!(b.encoding.as_str(), "auto" | "base64") {
        return Err(ApiError::bad_request("encoding must be auto or base64"));
    }
    let mut d = direct(&state, &vhost, &caller)?;
    let mut out = Vec::new();
    let mut last_tag = 0;
    for _ in 0..b.count.min(GET_COUNT_MAX) {
        let replies = d
            .call(
                AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                    queue: short(&name)?,
                    no_ack: false,
                })),
                None,
            )
            .await?;
        let Some((ok, props, payload)) = replies.into_iter().find_map(|r| match r.method {
            AMQPClass::Basic(basic::AMQPMethod::GetOk(ok)) => {
                r.content.map(|(p, body)| (ok, p, body))
            }
            _ => None,
        }) else {
            break;
        };
        last_tag = ok.delivery_tag;
        let bytes_len = payload.len();
        let shown = &payload[..b.truncate.map_or(bytes_len, |t| t.min(bytes_len))];
        let (text, encoding) = match (b.encoding.as_str(), std::str::from_utf8(shown)) {
            ("auto", Ok(s)) => (s.to_string(), "string"),
            _ => (
                base64::Engine::encode(&base64::engine::general_purpose::STANDARD, shown),
                "base64",
            ),
        };
        out.push(json!({
            "payload_bytes": bytes_len,
            "redelivered": ok.redelivered,
            "exchange": ok.exchange.as_str(),
            "routing_key": ok.routing_key.as_str(),
            "message_count": ok.message_count,
            "properties": crate::properties::to_json(&props.raw),
            "payload": text,
            "payload_encoding": encoding,
        }));
    }
    if last_tag > 0 {
        let settle = if ack {
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: last_tag,
                multiple: true,
            }))
        } else {
            AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                delivery_tag: last_tag,
                multiple: true,
                requeue,
            }))
        };
        d.call(settle, None).await?;
    }
    ok_json(Value::Array(out))
}

#[derive(Debug, Deserialize)]
struct PublishBody {
    #[serde(default)]
    properties: Option<Value>,
    routing_key: String,
    payload: String,
    #[serde(default = "string")]
    payload_encoding: String,
}

fn string() -> String {
    "string".into()
}

/// POST /api/exchanges/{vhost}/{exchange}/publish: `{"routed": bool}`.
async fn publish(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    let exchange = exchange_name(&name).to_string();
    if !exchange.is_empty() && !vh.exchange_exists(&exchange) {
        return Err(ApiError::not_found());
    }
    let b: PublishBody =
        serde_json::from_value(body(&raw)?).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let payload = match b.payload_encoding.as_str() {
        "string" => bytes::Bytes::from(b.payload.into_bytes()),
        "base64" => bytes::Bytes::from(
            base64::Engine::decode(&base64::engine::general_purpose::STANDARD, &b.payload)
                .map_err(|_| ApiError::bad_request("payload is not base64"))?,
        ),
        other => {
            return Err(ApiError::bad_request(format!(
                "invalid payload_encoding {other}"
            )));
        }
    };
    if payload.len() as u64 > state.node.message_size_max {
        return Err(ApiError::bad_request(format!(
            "message size {} is larger than configured max size {}",
            payload.len(),
            state.node.message_size_max
        )));
    }
    let raw_props =
        crate::properties::from_json(b.properties.as_ref()).map_err(ApiError::bad_request)?;
    let properties = Properties::parse(
        bytes::Bytes::from(raw_props),
        warren_amqp::limits::TABLE_DEPTH_MAX,
    )
    .map_err(|_| ApiError::bad_request("invalid properties"))?;
    let mut d = direct(&state, &vhost, &caller)?;
    // Confirm mode, as RabbitMQ's publish endpoint: the reply waits until the message is
    // stored (persistent, durable queue) or refused.
    d.call(
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
        None,
    )
    .await?;
    let mut replies = d
        .call(
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: short(&exchange)?,
                routing_key: short(&b.routing_key)?,
                mandatory: true,
                immediate: false,
            })),
            Some(Content {
                properties,
                body: payload,
            }),
        )
        .await?;
    let settled = |rs: &[crate::direct::Reply]| {
        rs.iter().any(|r| {
            matches!(
                r.method,
                AMQPClass::Basic(basic::AMQPMethod::Ack(_) | basic::AMQPMethod::Nack(_))
            )
        })
    };
    while !settled(&replies) {
        replies.extend(d.later_replies().await?);
    }
    let returned = replies
        .iter()
        .any(|r| matches!(r.method, AMQPClass::Basic(basic::AMQPMethod::Return(_))));
    let nacked = replies
        .iter()
        .any(|r| matches!(r.method, AMQPClass::Basic(basic::AMQPMethod::Nack(_))));
    if nacked {
        // RabbitMQ's text for a publish a queue refused (reject-publish at its limit).
        return Err(ApiError::bad_request(
            "rejected Unable to publish message. Check queue limits.",
        ));
    }
    ok_json(json!({"routed": !returned}))
}

// ---------------------------------------------------------------- connections

fn connection_json(node: &str, h: &warren_broker::connections::ConnectionHandle) -> Value {
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
fn user_provided_name(i: &warren_broker::connections::ConnectionInfo) -> Option<String> {
    match i.client_properties.inner().get("connection_name") {
        Some(amq_protocol::types::AMQPValue::LongString(s)) => {
            Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        Some(amq_protocol::types::AMQPValue::ShortString(s)) => Some(s.as_str().to_string()),
        _ => None,
    }
}

/// Connections the caller may see: all for monitoring and administrator, else its own.
fn visible_connections(
    state: &AppState,
    caller: &Caller,
) -> Vec<Arc<warren_broker::connections::ConnectionHandle>> {
    state
        .broker
        .connections()
        .list()
        .into_iter()
        .filter(|h| caller.sees_all_vhosts() || h.info.user == caller.name)
        .collect()
}

async fn list_connections(State(state): State<AppState>, caller: Caller) -> ApiResult {
    ok_json(Value::Array(
        visible_connections(&state, &caller)
            .iter()
            .map(|h| connection_json(&state.node.node, h))
            .collect(),
    ))
}

async fn list_vhost_connections(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    vhost_for(&state, &caller, &vhost)?;
    ok_json(Value::Array(
        visible_connections(&state, &caller)
            .iter()
            .filter(|h| h.info.vhost == vhost)
            .map(|h| connection_json(&state.node.node, h))
            .collect(),
    ))
}

async fn get_connection(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult {
    let h = visible_connections(&state, &caller)
        .into_iter()
        .find(|h| h.info.name == name)
        .ok_or_else(ApiError::not_found)?;
    ok_json(connection_json(&state.node.node, &h))
}

/// DELETE /api/connections/{name}: 320 CONNECTION_FORCED with the `X-Reason` header's text
/// (RabbitMQ's default: "Closed via management plugin").
async fn close_connection(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    headers: axum::http::HeaderMap,
) -> ApiResult {
    let h = visible_connections(&state, &caller)
        .into_iter()
        .find(|h| h.info.name == name)
        .ok_or_else(ApiError::not_found)?;
    // Seeing every connection (monitoring) is not closing them: administrators or the owner.
    if !caller.is_admin() && h.info.user != caller.name {
        return Err(ApiError::unauthorised("Not administrator user"));
    }
    let reason = headers
        .get("x-reason")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("Closed via management plugin")
        .to_string();
    h.request_close(reason);
    no_content()
}

// ---------------------------------------------------------------- policies

/// The policy set a route serves: `/api/operator-policies` (OPERATOR) or `/api/policies`.
const fn kind<const OPERATOR: bool>() -> PolicyKind {
    if OPERATOR {
        PolicyKind::Operator
    } else {
        PolicyKind::User
    }
}

fn policies_of(vhosts: &[Arc<VHost>], kind: PolicyKind) -> Result<Value, ApiError> {
    let defs: Vec<_> = vhosts.iter().flat_map(|vh| vh.policies(kind)).collect();
    serde_json::to_value(defs).map_err(|e| ApiError::bad_request(e.to_string()))
}

/// Reading policies, operator policies included, needs `policymaker` (or `administrator`),
/// as in RabbitMQ.
fn require_policy_reader(caller: &Caller) -> Result<(), ApiError> {
    if caller.is_admin() || caller.has("policymaker") {
        Ok(())
    } else {
        Err(ApiError::unauthorised("Not policymaker user"))
    }
}

/// Setting policies needs `policymaker` with access to the vhost; operator policies need
/// `administrator` (RabbitMQ 3.10 answers a policymaker's PUT with 401).
fn require_policy_writer(
    state: &AppState,
    caller: &Caller,
    vhost: &str,
    kind: PolicyKind,
) -> Result<(), ApiError> {
    match kind {
        PolicyKind::User => caller.require_policymaker(state, vhost),
        PolicyKind::Operator if caller.is_admin() => Ok(()),
        PolicyKind::Operator => Err(ApiError::unauthorised("Not administrator user")),
    }
}

async fn list_all_policies<const OPERATOR: bool>(
    State(state): State<AppState>,
    caller: Caller,
) -> ApiResult {
    require_policy_reader(&caller)?;
    ok_json(policies_of(
        &visible_vhosts(&state, &caller),
        kind::<OPERATOR>(),
    )?)
}

async fn list_vhost_policies<const OPERATOR: bool>(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    require_policy_reader(&caller)?;
    let vh = vhost_for(&state, &caller, &vhost)?;
    ok_json(policies_of(&[vh], kind::<OPERATOR>())?)
}

async fn get_policy<const OPERATOR: bool>(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult {
    require_policy_reader(&caller)?;
    let vh = vhost_for(&state, &caller, &vhost)?;
    let def = vh
        .policies(kind::<OPERATOR>())
        .into_iter()
        .find(|p| p.name == name)
        .ok_or_else(ApiError::not_found)?;
    ok_json(serde_json::to_value(def).map_err(|e| ApiError::bad_request(e.to_string()))?)
}

#[derive(Debug, Deserialize)]
struct PolicyBody {
    pattern: String,
    definition: serde_json::Map<String, Value>,
    #[serde(default)]
    priority: i32,
    #[serde(rename = "apply-to", default = "apply_all")]
    apply_to: String,
}

fn apply_all() -> String {
    "all".into()
}

async fn put_policy<const OPERATOR: bool>(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    let kind = kind::<OPERATOR>();
    let vh = state
        .broker
        .vhost(&vhost)
        .ok_or_else(ApiError::vhost_not_found)?;
    require_policy_writer(&state, &caller, &vhost, kind)?;
    let b: PolicyBody =
        serde_json::from_value(body(&raw)?).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let existed = vh.policies(kind).iter().any(|p| p.name == name);
    let def = warren_broker::policy::PolicyDef {
        vhost: vhost.clone(),
        name,
        pattern: b.pattern,
        apply_to: b.apply_to,
        priority: b.priority,
        definition: b.definition,
    };
    durably(|done| {
        vh.set_policy(kind, def, done)
            .map_err(|e| ApiError::bad_request(e.to_string()))
    })
    .await?;
    created(!existed)
}

async fn delete_policy<const OPERATOR: bool>(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult {
    let kind = kind::<OPERATOR>();
    let vh = state.broker.vhost(&vhost).ok_or_else(ApiError::not_found)?;
    require_policy_writer(&state, &caller, &vhost, kind)?;
    durably(|done| {
        if vh.clear_policy(kind, &name, done) {
            Ok(())
        } else {
            Err(ApiError::not_found())
        }
    })
    .await?;
    no_content()
}

// ---------------------------------------------------------------- limits

const VHOST_LIMITS: &[&str] = &["max-connections", "max-queues"];
const USER_LIMITS: &[&str] = &["max-connections", "max-channels"];

/// Set or remove one limit of a limits struct through its JSON form (keys as RabbitMQ's).
fn with_limit<T: serde::Serialize + serde::de::DeserializeOwned>(
    limits: &T,
    known: &[&str],
    name: &str,
    value: Option<i64>,
) -> Result<T, ApiError> {
    if !known.contains(&name) {
        return Err(ApiError::bad_request(format!("unknown limit {name}")));
    }
    let mut v = serde_json::to_value(limits).map_err(|e| ApiError::bad_request(e.to_string()))?;
    if let Value::Object(m) = &mut v {
        match value {
            Some(n) => {
                m.insert(name.into(), json!(n));
            }
            None => {
                m.remove(name);
            }
        }
    }
    serde_json::from_value(v).map_err(|e| ApiError::bad_request(e.to_string()))
}

fn limit_value(raw: &[u8]) -> Result<i64, ApiError> {
    body(raw)?
        .get("value")
        .and_then(Value::as_i64)
        .ok_or_else(|| ApiError::bad_request("value must be an integer"))
}

/// RabbitMQ's `{"<owner_key>": name, "value": {...}}` entry, or none when no limit is set.
fn limits_entry(owner_key: &str, name: &str, limits: &impl serde::Serialize) -> Option<Value> {
    let v = serde_json::to_value(limits).ok()?;
    (v.as_object().is_some_and(|m| !m.is_empty())).then(|| json!({owner_key: name, "value": v}))
}

fn vhost_limits_json(vh: &VHost) -> Option<Value> {
    limits_entry("vhost", &vh.name, &*vh.limits.read())
}

async fn list_vhost_limits(State(state): State<AppState>, caller: Caller) -> ApiResult {
    ok_json(Value::Array(
        visible_vhosts(&state, &caller)
            .iter()
            .filter_map(|vh| vhost_limits_json(vh))
            .collect(),
    ))
}

async fn get_vhost_limits(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    ok_json(Value::Array(vhost_limits_json(&vh).into_iter().collect()))
}

async fn set_vhost_limit(
    state: &AppState,
    caller: &Caller,
    vhost: &str,
    name: &str,
    value: Option<i64>,
) -> ApiResult {
    caller.require_admin()?;
    let vh = vhost_for(state, caller, vhost)?;
    let limits = with_limit(&*vh.limits.read(), VHOST_LIMITS, name, value)?;
    durably(|done| {
        state
            .broker
            .set_vhost_limits(vhost, limits, done)
            .map_err(|e| user_error(&e))
    })
    .await?;
    no_content()
}

async fn put_vhost_limit(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    let value = limit_value(&raw)?;
    set_vhost_limit(&state, &caller, &vhost, &name, Some(value)).await
}

async fn delete_vhost_limit(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult {
    set_vhost_limit(&state, &caller, &vhost, &name, None).await
}

fn user_limits_json(u: &warren_broker::users::UserRecord) -> Option<Value> {
    limits_entry("user", &u.name, &u.limits)
}

async fn list_user_limits(State(state): State<AppState>, caller: Caller) -> ApiResult {
    caller.require_admin()?;
    ok_json(Value::Array(
        state
            .broker
            .list_users()
            .iter()
            .filter_map(user_limits_json)
            .collect(),
    ))
}

fn find_user(state: &AppState, name: &str) -> Result<warren_broker::users::UserRecord, ApiError> {
    state
        .broker
        .list_users()
        .into_iter()
        .find(|u| u.name == name)
        .ok_or_else(ApiError::not_found)
}

async fn get_user_limits(
    State(state): State<AppState>,
    caller: Caller,
    Path(user): Path<String>,
) -> ApiResult {
    caller.require_admin()?;
    let u = find_user(&state, &user)?;
    ok_json(Value::Array(user_limits_json(&u).into_iter().collect()))
}

async fn set_user_limit(
    state: &AppState,
    caller: &Caller,
    user: &str,
    name: &str,
    value: Option<i64>,
) -> ApiResult {
    caller.require_admin()?;
    let u = find_user(state, user)?;
    let limits = with_limit(&u.limits, USER_LIMITS, name, value)?;
    durably(|done| {
        state
            .broker
            .set_user_limits(user, limits, done)
            .map_err(|e| user_error(&e))
    })
    .await?;
    no_content()
}

async fn put_user_limit(
    State(state): State<AppState>,
    caller: Caller,
    Path((user, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    let value = limit_value(&raw)?;
    set_user_limit(&state, &caller, &user, &name, Some(value)).await
}

async fn delete_user_limit(
    State(state): State<AppState>,
    caller: Caller,
    Path((user, name)): Path<(String, String)>,
) -> ApiResult {
    set_user_limit(&state, &caller, &user, &name, None).await
}

// ---------------------------------------------------------------- topic permissions

fn topic_json(p: &warren_broker::users::TopicPermissionRecord) -> Value {
    json!({"user": p.user, "vhost": p.vhost, "exchange": p.exchange,
           "write": p.write, "read": p.read})
}

async fn list_topic_permissions(State(state): State<AppState>, caller: Caller) -> ApiResult {
    caller.require_admin()?;
    ok_json(grants(&state, None, None, true))
}

async fn get_topic_permissions(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, user)): Path<(String, String)>,
) -> ApiResult {
    caller.require_admin()?;
    let list = state
        .broker
        .list_topic_permissions(Some(&vhost), Some(&user));
    if list.is_empty() {
        return Err(ApiError::not_found());
    }
    ok_json(Value::Array(list.iter().map(topic_json).collect()))
}

async fn put_topic_permission(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, user)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    caller.require_admin()?;
    let b = body(&raw)?;
    let field = |k: &str| {
        b.get(k)
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| ApiError::bad_request(format!("{k} is required")))
    };
    let record = warren_broker::users::TopicPermissionRecord {
        user: user.clone(),
        vhost: vhost.clone(),
        exchange: field("exchange")?,
        write: field("write")?,
        read: field("read")?,
    };
    let existed = state
        .broker
        .list_topic_permissions(Some(&vhost), Some(&user))
        .iter()
        .any(|p| p.exchange == record.exchange);
    durably(|done| {
        state
            .broker
            .set_topic_permissions(record, done)
            .map_err(|e| grant_error(&e))
    })
    .await?;
    created(!existed)
}

#[derive(Debug, Default, Deserialize)]
struct TopicScope {
    exchange: Option<String>,
}

/// DELETE `/api/topic-permissions/{vhost}/{user}`: all the user's topic permissions in the
/// vhost, or (Warren's `?exchange=`, for `warren ctl clear_topic_permissions`) one exchange's.
async fn delete_topic_permissions(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, user)): Path<(String, String)>,
    axum::extract::Query(scope): axum::extract::Query<TopicScope>,
) -> ApiResult {
    caller.require_admin()?;
    let exchange = scope.exchange.as_deref();
    if !state
        .broker
        .list_topic_permissions(Some(&vhost), Some(&user))
        .iter()
        .any(|p| exchange.is_none_or(|x| p.exchange == x))
    {
        return Err(ApiError::not_found());
    }
    durably(|done| {
        state
            .broker
            .clear_topic_permissions(&vhost, &user, exchange, done)
            .map_err(|e| user_error(&e))
    })
    .await?;
    no_content()
}

// ---------------------------------------------------------------- definitions export

/// The objects of one vhost in RabbitMQ's definitions format; `with_vhost` adds the `vhost`
/// field (the node-wide export has it, the per-vhost export does not).
/// One vhost's part of a definitions export.
#[derive(Debug, Default)]
struct VhostDefs {
    queues: Vec<Value>,
    exchanges: Vec<Value>,
    bindings: Vec<Value>,
    policies: Vec<Value>,
    parameters: Vec<Value>,
}

fn vhost_definitions(vh: &VHost, with_vhost: bool) -> VhostDefs {
    let tag = |mut v: Value| {
        if with_vhost && let Value::Object(m) = &mut v {
            m.insert("vhost".into(), json!(vh.name));
        }
        v
    };
    let queues = vh
        .queues()
        .iter()
        .filter(|q| q.exclusive_owner.is_none())
        .map(|q| {
            tag(
                json!({"name": q.name, "durable": q.durable, "auto_delete": q.auto_delete,
                       "arguments": table_to_json(&q.arguments)}),
            )
        })
        .collect();
    let exchanges = vh
        .exchanges()
        .iter()
        .filter(|x| !x.name.is_empty() && !x.name.starts_with("amq."))
        .map(|x| {
            tag(json!({"name": x.name, "type": x.kind, "durable": x.durable,
                       "auto_delete": x.auto_delete, "internal": x.internal,
                       "arguments": table_to_json(&x.arguments)}))
        })
        .collect();
    let exclusive: std::collections::HashSet<String> = vh
        .queues()
        .iter()
        .filter(|q| q.exclusive_owner.is_some())
        .map(|q| q.name.clone())
        .collect();
    let bindings = vh
        .bindings()
        .iter()
        .filter(|b| !b.source.is_empty())
        .filter(|b| !(b.destination_is_queue && exclusive.contains(&b.destination)))
        .map(|b| {
            tag(json!({"source": b.source, "destination": b.destination,
                       "destination_type": if b.destination_is_queue { "queue" } else { "exchange" },
                       "routing_key": b.routing_key, "arguments": table_to_json(&b.arguments)}))
        })
        .collect();
    let policies = vh
        .policies(PolicyKind::User)
        .into_iter()
        .filter_map(|p| serde_json::to_value(p).ok())
        .map(|mut v| {
            if !with_vhost && let Value::Object(m) = &mut v {
                m.remove("vhost");
            }
            v
        })
        .collect();
    let parameters = serde_json::to_value(&*vh.limits.read())
        .ok()
        .filter(|v| v.as_object().is_some_and(|m| !m.is_empty()))
        .map(|value| tag(json!({"value": value, "component": "vhost-limits", "name": "limits"})))
        .into_iter()
        .collect();
    VhostDefs {
        queues,
        exchanges,
        bindings,
        policies,
        parameters,
    }
}

fn insert_defs(m: &mut serde_json::Map<String, Value>, d: VhostDefs) {
    m.insert("parameters".into(), Value::Array(d.parameters));
    m.insert("policies".into(), Value::Array(d.policies));
    m.insert("queues".into(), Value::Array(d.queues));
    m.insert("exchanges".into(), Value::Array(d.exchanges));
    m.insert("bindings".into(), Value::Array(d.bindings));
}

fn versions(state: &AppState) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert("rabbit_version".into(), json!(RABBITMQ_API_VERSION));
    m.insert("rabbitmq_version".into(), json!(RABBITMQ_API_VERSION));
    m.insert("product_name".into(), json!(state.node.identity.product));
    m.insert("product_version".into(), json!(state.node.identity.version));
    m
}

/// GET /api/definitions: everything needed to rebuild the node's topology and access rules,
/// in RabbitMQ's format (users with their password hashes).
async fn export_definitions(State(state): State<AppState>, caller: Caller) -> ApiResult {
    caller.require_admin()?;
    let b = &state.broker;
    let mut all = VhostDefs::default();
    let mut vhosts = Vec::new();
    for name in b.list_vhosts() {
        let Some(vh) = b.vhost(&name) else { continue };
        let mut metadata = json!({"description": "", "tags": []});
        if let Some(t) = vh.default_queue_type.read().clone() {
            metadata["default_queue_type"] = json!(t);
        }
        vhosts.push(json!({"name": vh.name, "limits": [], "metadata": metadata}));
        let d = vhost_definitions(&vh, true);
        all.queues.extend(d.queues);
        all.exchanges.extend(d.exchanges);
        all.bindings.extend(d.bindings);
        all.policies.extend(d.policies);
        all.parameters.extend(d.parameters);
    }
    let users: Vec<Value> = b
        .list_users()
        .iter()
        .map(|u| {
            json!({"name": u.name, "password_hash": u.password_hash,
                   "hashing_algorithm": u.hashing_algorithm, "tags": u.tags,
                   "limits": serde_json::to_value(&u.limits).unwrap_or_else(|_| json!({}))})
        })
        .collect();
    let mut m = versions(&state);
    m.insert("users".into(), Value::Array(users));
    m.insert("vhosts".into(), Value::Array(vhosts));
    m.insert(
        "permissions".into(),
        Value::Array(
            b.list_permissions(None, None)
                .iter()
                .map(permission_json)
                .collect(),
        ),
    );
    m.insert(
        "topic_permissions".into(),
        Value::Array(
            b.list_topic_permissions(None, None)
                .iter()
                .map(topic_json)
                .collect(),
        ),
    );
    m.insert(
        "global_parameters".into(),
        json!([{"name": "cluster_name", "value": state.node.cluster_name}]),
    );
    insert_defs(&mut m, all);
    ok_json(Value::Object(m))
}

/// GET /api/definitions/{vhost}: one vhost's topology and policies (no `vhost` fields).
async fn export_vhost_definitions(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    caller.require_admin()?;
    let vh = vhost_for(&state, &caller, &vhost)?;
    let mut m = versions(&state);
    insert_defs(&mut m, vhost_definitions(&vh, false));
    ok_json(Value::Object(m))
}

// ---------------------------------------------------------------- definitions import

fn str_field<'a>(v: &'a Value, k: &str) -> Result<&'a str, ApiError> {
    v.get(k)
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request(format!("definitions: missing {k} in {v}")))
}

fn list<'a>(d: &'a Value, k: &str) -> &'a [Value] {
    d.get(k)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// Commit waiters for a batch of changes: each change gets its completion, and the import
/// answers only once all are durable.
#[derive(Default)]
struct Commits(Vec<CommitRx>);

impl Commits {
    fn next(&mut self) -> impl FnMut() -> warren_store::writer::Completion + use<> {
        let (tx, rx) = commit_waiter();
        self.0.push(rx);
        let mut tx = Some(tx);
        move || waiter(tx.take())
    }

    async fn wait(self) -> Result<(), ApiError> {
        for rx in self.0 {
            wait(rx).await?;
        }
        Ok(())
    }
}

/// Declare the queues, exchanges and bindings of `defs` in `vhost` (each item's own `vhost`
/// field, when present, must name it) through an internal session, in RabbitMQ's order.
async fn import_topology(
    state: &AppState,
    vhost: &str,
    defs: &Value,
    node_wide: bool,
) -> Result<(), ApiError> {
    let mine = |v: &&Value| !node_wide || v.get("vhost").and_then(Value::as_str) == Some(vhost);
    let mut d = Direct::internal(&state.broker, vhost)?;
    for q in list(defs, "queues").iter().filter(mine) {
        d.call(
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: short(str_field(q, "name")?)?,
                passive: false,
                durable: q.get("durable").and_then(Value::as_bool).unwrap_or(true),
                exclusive: false,
                auto_delete: q
                    .get("auto_delete")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
                nowait: false,
                arguments: arguments(q.get("arguments"))?,
            })),
            None,
        )
        .await?;
    }
    for x in list(defs, "exchanges").iter().filter(mine) {
        d.call(
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
                exchange: short(str_field(x, "name")?)?,
                kind: short(str_field(x, "type")?)?,
                passive: false,
                durable: x.get("durable").and_then(Value::as_bool).unwrap_or(true),
                auto_delete: x
                    .get("auto_delete")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
                internal: x.get("internal").and_then(Value::as_bool).unwrap_or(false),
                nowait: false,
                arguments: arguments(x.get("arguments"))?,
            })),
            None,
        )
        .await?;
    }
    for b in list(defs, "bindings").iter().filter(mine) {
        let source = str_field(b, "source")?;
        let destination = str_field(b, "destination")?;
        let routing_key = b.get("routing_key").and_then(Value::as_str).unwrap_or("");
        let args = arguments(b.get("arguments"))?;
        let method = if str_field(b, "destination_type")? == "exchange" {
            AMQPClass::Exchange(exchange::AMQPMethod::Bind(exchange::Bind {
                destination: short(destination)?,
                source: short(source)?,
                routing_key: short(routing_key)?,
                nowait: false,
                arguments: args,
            }))
        } else {
            AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
                queue: short(destination)?,
                exchange: short(source)?,
                routing_key: short(routing_key)?,
                nowait: false,
                arguments: args,
            }))
        };
        d.call(method, None).await?;
    }
    Ok(())
}

/// Policies and vhost limits of `defs` for `vhost`.
fn import_policies_and_limits(
    state: &AppState,
    vhost: &str,
    defs: &Value,
    node_wide: bool,
    commits: &mut Commits,
) -> Result<(), ApiError> {
    let mine = |v: &&Value| !node_wide || v.get("vhost").and_then(Value::as_str) == Some(vhost);
    let vh = state.broker.vhost(vhost).ok_or_else(ApiError::not_found)?;
    for p in list(defs, "policies").iter().filter(mine) {
        let mut p = p.clone();
        let Value::Object(m) = &mut p else {
            return Err(ApiError::bad_request(
                "definitions: a policy must be an object",
            ));
        };
        m.insert("vhost".into(), json!(vhost));
        let def: warren_broker::policy::PolicyDef = serde_json::from_value(p)
            .map_err(|e| ApiError::bad_request(format!("definitions: policy: {e}")))?;
        vh.set_policy(PolicyKind::User, def, &mut commits.next())
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
    }
    for p in list(defs, "parameters").iter().filter(mine) {
        if p.get("component").and_then(Value::as_str) == Some("vhost-limits") {
            let limits: warren_broker::users::VhostLimits =
                serde_json::from_value(p.get("value").cloned().unwrap_or(Value::Null))
                    .map_err(|e| ApiError::bad_request(format!("definitions: limits: {e}")))?;
            state
                .broker
                .set_vhost_limits(vhost, limits, &mut commits.next())
                .map_err(|e| user_error(&e))?;
        }
    }
    Ok(())
}

/// POST /api/definitions: import a RabbitMQ (or Warren) export. Users keep their password
/// hashes; objects that exist are declared again (equivalent ones are left as they are).
async fn import_definitions(
    State(state): State<AppState>,
    caller: Caller,
    raw: axum::body::Bytes,
) -> ApiResult {
    caller.require_admin()?;
    let defs = body(&raw)?;
    let b = &state.broker;
    let mut commits = Commits::default();
    for u in list(&defs, "users") {
        let name = str_field(u, "name")?;
        if name.is_empty() {
            return Err(ApiError::bad_request("definitions: a user without a name"));
        }
        // RabbitMQ's import takes a plain `password` too (hashed here, never stored).
        let password_hash = match (
            u.get("password_hash").and_then(Value::as_str),
            u.get("password").and_then(Value::as_str),
        ) {
            (Some(h), _) => h.to_string(),
            (None, Some(p)) => warren_broker::users::hash_password(p),
            (None, None) => String::new(),
        };
        let record = warren_broker::users::UserRecord {
            name: name.to_string(),
            password_hash,
            hashing_algorithm: u
                .get("hashing_algorithm")
                .and_then(Value::as_str)
                .unwrap_or(warren_broker::users::SHA256)
                .to_string(),
            tags: tags_of(u),
            limits: u
                .get("limits")
                .cloned()
                .and_then(|l| serde_json::from_value(l).ok())
                .unwrap_or_default(),
        };
        b.import_user(record, &mut commits.next())
            .map_err(|e| user_error(&e))?;
    }
    let mut vhosts: Vec<String> = Vec::new();
    for v in list(&defs, "vhosts") {
        let name = str_field(v, "name")?.to_string();
        if name.is_empty() {
            return Err(ApiError::bad_request("definitions: a vhost without a name"));
        }
        let dqt = v
            .get("default_queue_type")
            .or_else(|| v.get("metadata").and_then(|m| m.get("default_queue_type")))
            .and_then(Value::as_str)
            .filter(|t| *t != "undefined");
        let new = b
            .add_vhost(&name, dqt, &mut commits.next())
            .map_err(|e| user_error(&e))?;
        // As rabbit_definitions (the importer is the acting user): the file's own
        // permissions, applied next, win over this grant.
        if new {
            grant_creator(&state, &caller, &name, &mut commits.next())?;
        }
        vhosts.push(name);
    }
    for p in list(&defs, "permissions") {
        let record = PermissionRecord {
            user: str_field(p, "user")?.into(),
            vhost: str_field(p, "vhost")?.into(),
            configure: str_field(p, "configure")?.into(),
            write: str_field(p, "write")?.into(),
            read: str_field(p, "read")?.into(),
        };
        b.set_permissions(record, &mut commits.next())
            .map_err(|e| user_error(&e))?;
    }
    for p in list(&defs, "topic_permissions") {
        let record = warren_broker::users::TopicPermissionRecord {
            user: str_field(p, "user")?.into(),
            vhost: str_field(p, "vhost")?.into(),
            exchange: str_field(p, "exchange")?.into(),
            write: str_field(p, "write")?.into(),
            read: str_field(p, "read")?.into(),
        };
        b.set_topic_permissions(record, &mut commits.next())
            .map_err(|e| user_error(&e))?;
    }
    // Every vhost an object names, whether or not the file lists it.
    for key in ["policies", "parameters", "queues", "exchanges", "bindings"] {
        for item in list(&defs, key) {
            if let Some(v) = item.get("vhost").and_then(Value::as_str)
                && !vhosts.iter().any(|x| x == v)
            {
                vhosts.push(v.to_string());
            }
        }
    }
    for v in &vhosts {
        import_policies_and_limits(&state, v, &defs, true, &mut commits)?;
    }
    commits.wait().await?;
    for v in &vhosts {
        import_topology(&state, v, &defs, true).await?;
    }
    no_content()
}

/// POST /api/definitions/{vhost}: import one vhost's export (items without `vhost` fields).
async fn import_vhost_definitions(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
    raw: axum::body::Bytes,
) -> ApiResult {
    caller.require_admin()?;
    vhost_for(&state, &caller, &vhost)?;
    let defs = body(&raw)?;
    let mut commits = Commits::default();
    import_policies_and_limits(&state, &vhost, &defs, false, &mut commits)?;
    commits.wait().await?;
    import_topology(&state, &vhost, &defs, false).await?;
    no_content()
}

// ---------------------------------------------------------------- channels and consumers

/// How long a connection task may take to describe its channels.
const SNAPSHOT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

type Handle = Arc<warren_broker::connections::ConnectionHandle>;

/// The channels of `conns`, asked of their connection tasks concurrently; a connection that
/// does not answer in time (or closed) is left out.
async fn channels_of(conns: Vec<Handle>) -> Vec<(Handle, warren_broker::connections::ChannelInfo)> {
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

fn channel_name(h: &Handle, number: u16) -> String {
    format!("{} ({number})", h.info.name)
}

fn channel_json(node: &str, h: &Handle, c: &warren_broker::connections::ChannelInfo) -> Value {
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

async fn channels_filtered(
    state: &AppState,
    caller: &Caller,
    keep: impl Fn(&Handle) -> bool,
) -> Value {
    let conns = visible_connections(state, caller)
        .into_iter()
        .filter(|h| keep(h))
        .collect();
    Value::Array(
        channels_of(conns)
            .await
            .iter()
            .map(|(h, c)| channel_json(&state.node.node, h, c))
            .collect(),
    )
}

async fn list_channels(State(state): State<AppState>, caller: Caller) -> ApiResult {
    ok_json(channels_filtered(&state, &caller, |_| true).await)
}

async fn list_vhost_channels(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    vhost_for(&state, &caller, &vhost)?;
    ok_json(channels_filtered(&state, &caller, |h| h.info.vhost == vhost).await)
}

async fn list_connection_channels(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult {
    if !visible_connections(&state, &caller)
        .iter()
        .any(|h| h.info.name == name)
    {
        return Err(ApiError::not_found());
    }
    ok_json(channels_filtered(&state, &caller, |h| h.info.name == name).await)
}

async fn consumers_filtered(state: &AppState, caller: &Caller, vhost: Option<&str>) -> Value {
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

/// `GET /api/channels/{name}`: one channel, named `<connection name> (<number>)`.
async fn get_channel(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult {
    let (conn, number) = name
        .strip_suffix(')')
        .and_then(|n| n.rsplit_once(" ("))
        .and_then(|(c, n)| Some((c, n.parse::<u16>().ok()?)))
        .ok_or_else(ApiError::not_found)?;
    let conns = visible_connections(&state, &caller)
        .into_iter()
        .filter(|h| h.info.name == conn)
        .collect();
    channels_of(conns)
        .await
        .iter()
        .find(|(_, c)| c.number == number)
        .map(|(h, c)| ok_json(channel_json(&state.node.node, h, c)))
        .unwrap_or_else(|| Err(ApiError::not_found()))
}

async fn list_consumers(State(state): State<AppState>, caller: Caller) -> ApiResult {
    ok_json(consumers_filtered(&state, &caller, None).await)
}

async fn list_vhost_consumers(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    vhost_for(&state, &caller, &vhost)?;
    ok_json(consumers_filtered(&state, &caller, Some(&vhost)).await)
}

// ---------------------------------------------------------------- one binding

/// The bindings from `source` to `destination` (`kind` "q" or "e") in `vh`.
fn pair_bindings(
    vh: &VHost,
    source: &str,
    kind: &str,
    destination: &str,
) -> Result<Vec<warren_broker::vhost::BindingInfo>, ApiError> {
    let to_queue = match kind {
        "q" => true,
        "e" => false,
        _ => return Err(ApiError::not_found()),
    };
    let source = exchange_name(source);
    Ok(vh
        .bindings()
        .into_iter()
        .filter(|b| {
            b.source == source && b.destination == destination && b.destination_is_queue == to_queue
        })
        .collect())
}

fn binding_json(vhost: &str, b: &warren_broker::vhost::BindingInfo) -> Value {
    json!({
        "source": b.source,
        "vhost": vhost,
        "destination": b.destination,
        "destination_type": if b.destination_is_queue { "queue" } else { "exchange" },
        "routing_key": b.routing_key,
        "arguments": table_to_json(&b.arguments),
        "properties_key": properties_key(&b.routing_key, &b.arguments),
    })
}

async fn list_pair_bindings(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, source, kind, destination)): Path<(String, String, String, String)>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    let list = pair_bindings(&vh, &source, &kind, &destination)?;
    ok_json(Value::Array(
        list.iter().map(|b| binding_json(&vhost, b)).collect(),
    ))
}

/// The binding whose `properties_key` is `props` (axum gives the segment percent-decoded,
/// so it is compared with the decoded routing key too).
fn find_binding(
    vh: &VHost,
    source: &str,
    kind: &str,
    destination: &str,
    props: &str,
) -> Result<warren_broker::vhost::BindingInfo, ApiError> {
    pair_bindings(vh, source, kind, destination)?
        .into_iter()
        .find(|b| {
            properties_key(&b.routing_key, &b.arguments) == props
                || properties_key_decoded(&b.routing_key, &b.arguments) == props
        })
        .ok_or_else(ApiError::not_found)
}

async fn get_binding(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, source, kind, destination, props)): Path<(String, String, String, String, String)>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    let b = find_binding(&vh, &source, &kind, &destination, &props)?;
    ok_json(binding_json(&vhost, &b))
}

async fn delete_binding(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, source, kind, destination, props)): Path<(String, String, String, String, String)>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    let b = find_binding(&vh, &source, &kind, &destination, &props)?;
    let method = if b.destination_is_queue {
        AMQPClass::Queue(queue::AMQPMethod::Unbind(queue::Unbind {
            queue: short(&b.destination)?,
            exchange: short(&b.source)?,
            routing_key: short(&b.routing_key)?,
            arguments: b.arguments.clone(),
        }))
    } else {
        AMQPClass::Exchange(exchange::AMQPMethod::Unbind(exchange::Unbind {
            destination: short(&b.destination)?,
            source: short(&b.source)?,
            routing_key: short(&b.routing_key)?,
            nowait: false,
            arguments: b.arguments.clone(),
        }))
    };
    let mut d = direct(&state, &vhost, &caller)?;
    d.call(method, None).await?;
    no_content()
}

/// GET /api/queues/{vhost}/{queue}/bindings: every binding to the queue (the default
/// exchange's first).
async fn queue_bindings(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult {
    let (vh, _) = queue_for(&state, &caller, &vhost, &name)?;
    ok_json(Value::Array(
        vh.bindings()
            .iter()
            .filter(|b| b.destination_is_queue && b.destination == name)
            .map(|b| binding_json(&vhost, b))
            .collect(),
    ))
}

/// GET /api/exchanges/{vhost}/{exchange}/bindings/source|destination.
async fn exchange_bindings(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name, side)): Path<(String, String, String)>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    let name = exchange_name(&name).to_string();
    if !name.is_empty() && !vh.exchange_exists(&name) {
        return Err(ApiError::not_found());
    }
    let keep = |b: &warren_broker::vhost::BindingInfo| match side.as_str() {
        "source" => b.source == name,
        "destination" => !b.destination_is_queue && b.destination == name,
        _ => false,
    };
    if !matches!(side.as_str(), "source" | "destination") {
        return Err(ApiError::not_found());
    }
    ok_json(Value::Array(
        vh.bindings()
            .iter()
            .filter(|b| keep(b))
            .map(|b| binding_json(&vhost, b))
            .collect(),
    ))
}
