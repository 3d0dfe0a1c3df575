//! The `/api` endpoints, with RabbitMQ's paths, JSON field names and status codes.
//!
//! One file per resource, as RabbitMQ's `rabbit_mgmt_wm_*` modules: this one holds the router
//! (which file serves each route), the request and reply helpers every resource uses, and the
//! lookups of the vhost, queue or user a request names. [`common`] and [`commit`] hold what
//! several resources share beyond that; neither imports a sibling.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use warren_broker::queue::Queue;
use warren_broker::routing::vhost::VHost;
use warren_broker::users::UserError;

use crate::auth::Caller;
use crate::direct::Direct;
use crate::{ApiError, AppState, REQUEST_BODY_MAX};

mod bindings;
mod commit;
mod common;
pub(crate) mod connections;
mod consumer_groups;
mod consumers;
mod definitions;
mod exchanges;
mod health;
mod leadership;
mod limits;
pub(crate) mod node_listings;
mod nodes;
mod overview;
mod permissions;
mod policies;
mod queues;
mod super_streams;
mod users;
mod v1_leases;
mod v1_messages;
mod v1_redrives;
mod vhosts;

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
        .route("/api/overview", get(overview::overview))
        .route("/api/whoami", get(users::whoami))
        .route("/api/cluster-name", get(overview::cluster_name))
        .route("/api/nodes", get(nodes::nodes))
        .route(
            "/api/nodes/{name}",
            get(nodes::one_node).delete(nodes::forget_node),
        )
        .route(
            "/api/vhosts/{vhost}/permissions",
            get(permissions::vhost_permissions::<false>),
        )
        .route(
            "/api/vhosts/{vhost}/topic-permissions",
            get(permissions::vhost_permissions::<true>),
        )
        .route(
            "/api/users/{user}/permissions",
            get(permissions::user_permissions::<false>),
        )
        .route(
            "/api/users/{user}/topic-permissions",
            get(permissions::user_permissions::<true>),
        )
        .route("/api/channels/{name}", get(connections::get_channel))
        .route("/api/vhosts", get(vhosts::list_vhosts))
        .route(
            "/api/vhosts/{vhost}",
            get(vhosts::get_vhost)
                .put(vhosts::put_vhost)
                .delete(vhosts::delete_vhost),
        )
        .route("/api/users", get(users::list_users))
        .route(
            "/api/users/{user}",
            get(users::get_user)
                .put(users::put_user)
                .delete(users::delete_user),
        )
        .route("/api/permissions", get(permissions::list_permissions))
        .route(
            "/api/permissions/{vhost}/{user}",
            get(permissions::get_permission)
                .put(permissions::put_permission)
                .delete(permissions::delete_permission),
        )
        .route("/api/queues", get(queues::list_all_queues))
        .route("/api/queues/{vhost}", get(queues::list_vhost_queues))
        .route(
            "/api/queues/{vhost}/{queue}",
            get(queues::get_queue)
                .put(queues::put_queue)
                .delete(queues::delete_queue),
        )
        .route(
            "/api/queues/{vhost}/{queue}/contents",
            axum::routing::delete(queues::purge_queue),
        )
        .route(
            "/api/queues/{vhost}/{queue}/get",
            axum::routing::post(queues::get_messages),
        )
        .route(
            "/api/queues/{vhost}/{queue}/members",
            axum::routing::post(queues::add_member),
        )
        .route(
            "/api/queues/{vhost}/{queue}/members/{node}",
            axum::routing::delete(queues::delete_member),
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
            axum::routing::post(exchanges::publish),
        )
        .route("/api/policies", get(policies::list_all_policies::<false>))
        .route(
            "/api/policies/{vhost}",
            get(policies::list_vhost_policies::<false>),
        )
        .route(
            "/api/policies/{vhost}/{name}",
            get(policies::get_policy::<false>)
                .put(policies::put_policy::<false>)
                .delete(policies::delete_policy::<false>),
        )
        .route(
            "/api/operator-policies",
            get(policies::list_all_policies::<true>),
        )
        .route(
            "/api/operator-policies/{vhost}",
            get(policies::list_vhost_policies::<true>),
        )
        .route(
            "/api/operator-policies/{vhost}/{name}",
            get(policies::get_policy::<true>)
                .put(policies::put_policy::<true>)
                .delete(policies::delete_policy::<true>),
        )
        .route("/api/vhost-limits", get(limits::list_vhost_limits))
        .route("/api/vhost-limits/{vhost}", get(limits::get_vhost_limits))
        .route(
            "/api/vhost-limits/{vhost}/{name}",
            axum::routing::put(limits::put_vhost_limit).delete(limits::delete_vhost_limit),
        )
        .route("/api/user-limits", get(limits::list_user_limits))
        .route("/api/user-limits/{user}", get(limits::get_user_limits))
        .route(
            "/api/user-limits/{user}/{name}",
            axum::routing::put(limits::put_user_limit).delete(limits::delete_user_limit),
        )
        .route(
            "/api/topic-permissions",
            get(permissions::list_topic_permissions),
        )
        .route(
            "/api/topic-permissions/{vhost}/{user}",
            get(permissions::get_topic_permissions)
                .put(permissions::put_topic_permission)
                .delete(permissions::delete_topic_permissions),
        )
        .route(
            "/api/definitions",
            get(definitions::export_definitions).post(definitions::import_definitions),
        )
        .route(
            "/api/definitions/{vhost}",
            get(definitions::export_vhost_definitions).post(definitions::import_vhost_definitions),
        )
        .route("/api/channels", get(connections::list_channels))
        .route(
            "/api/vhosts/{vhost}/channels",
            get(connections::list_vhost_channels),
        )
        .route(
            "/api/connections/{name}/channels",
            get(connections::list_connection_channels),
        )
        .route("/api/consumers", get(consumers::list_consumers))
        .route(
            "/api/consumers/{vhost}",
            get(consumers::list_vhost_consumers),
        )
        .route("/api/connections", get(connections::list_connections))
        .route(
            "/api/connections/{name}",
            get(connections::get_connection).delete(connections::close_connection),
        )
        .route(
            "/api/vhosts/{vhost}/connections",
            get(connections::list_vhost_connections),
        )
        .route(
            "/api/queues/{vhost}/{queue}/bindings",
            get(bindings::queue_bindings),
        )
        .route(
            "/api/exchanges/{vhost}/{exchange}/bindings/{side}",
            get(bindings::exchange_bindings),
        )
        .route("/api/exchanges", get(exchanges::list_all_exchanges))
        .route(
            "/api/exchanges/{vhost}",
            get(exchanges::list_vhost_exchanges),
        )
        .route(
            "/api/exchanges/{vhost}/{exchange}",
            get(exchanges::get_exchange)
                .put(exchanges::put_exchange)
                .delete(exchanges::delete_exchange),
        )
        .route("/api/bindings", get(bindings::list_all_bindings))
        .route("/api/bindings/{vhost}", get(bindings::list_vhost_bindings))
        .route(
            "/api/bindings/{vhost}/e/{source}/{kind}/{destination}",
            get(bindings::list_pair_bindings).post(bindings::post_binding),
        )
        .route(
            "/api/bindings/{vhost}/e/{source}/{kind}/{destination}/{props}",
            get(bindings::get_binding).delete(bindings::delete_binding),
        )
        .route("/api/health/checks/alarms", get(health::health_alarms))
        .route(
            "/api/health/checks/local-alarms",
            get(health::health_alarms),
        )
        .route(
            "/api/health/checks/virtual-hosts",
            get(health::health_vhosts),
        )
        .route(
            "/api/health/checks/port-listener/{port}",
            get(health::health_port_listener),
        )
        .route(
            "/api/health/checks/protocol-listener/{protocol}",
            get(health::health_protocol_listener),
        )
        .route(
            "/api/health/checks/ready-to-serve-clients",
            get(health::health_ready),
        )
        .route("/api/aliveness-test/{vhost}", get(health::aliveness_test))
        // The HTTP queue API (docs/http-queue-api.md).
        .route(
            "/v1/queues/{vhost}/{queue}/messages",
            axum::routing::post(v1_messages::publish).get(v1_messages::browse),
        )
        .route(
            "/v1/queues/{vhost}/{queue}/leases",
            axum::routing::post(v1_leases::claim),
        )
        .route("/v1/leases/ack", axum::routing::post(v1_leases::ack_batch))
        .route(
            "/v1/leases/{token}/ack",
            axum::routing::post(v1_leases::ack),
        )
        .route(
            "/v1/leases/{token}/extend",
            axum::routing::post(v1_leases::extend),
        )
        .route(
            "/v1/leases/{token}/release",
            axum::routing::post(v1_leases::release),
        )
        .route(
            "/v1/queues/{vhost}/{queue}/redrive",
            axum::routing::post(v1_redrives::start),
        )
        .route("/api/consumer-groups", get(consumer_groups::list_all))
        .route(
            "/api/consumer-groups/{vhost}",
            get(consumer_groups::list_vhost),
        )
        .route(
            "/api/consumer-groups/{vhost}/{queue}",
            get(consumer_groups::list_queue),
        )
        .route(
            "/api/stream/super-streams/{vhost}/{name}",
            get(super_streams::get_super_stream)
                .put(super_streams::put_super_stream)
                .delete(super_streams::delete_super_stream),
        )
        .route("/v1/redrives", get(v1_redrives::list))
        .route(
            "/v1/redrives/{id}",
            get(v1_redrives::show).delete(v1_redrives::cancel),
        )
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

/// A JSON body as `T` (an empty one as `{}`), or a 400 naming what did not fit.
fn typed_body<T: serde::de::DeserializeOwned>(raw: &[u8]) -> Result<T, ApiError> {
    serde_json::from_value(body(raw)?).map_err(|e| ApiError::bad_request(e.to_string()))
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

/// The queue a queue-API request names, 404 when its vhost or it is missing (what the user
/// may do with it is checked by permission afterwards).
fn queue_for_user(state: &AppState, vhost: &str, name: &str) -> Result<Arc<Queue>, ApiError> {
    let vh = state.broker.vhost(vhost).ok_or_else(ApiError::not_found)?;
    vh.queue(name).ok_or_else(ApiError::not_found)
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

fn find_user(state: &AppState, name: &str) -> Result<warren_broker::users::UserRecord, ApiError> {
    state
        .broker
        .list_users()
        .into_iter()
        .find(|u| u.name == name)
        .ok_or_else(ApiError::not_found)
}
