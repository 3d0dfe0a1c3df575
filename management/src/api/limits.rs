//! `/api/vhost-limits/...` and `/api/user-limits/...` (rabbit_mgmt_wm_limits,
//! rabbit_mgmt_wm_limit, rabbit_mgmt_wm_user_limits): vhost and user limits.

use axum::extract::{Path, State};
use serde_json::{Value, json};
use warren_broker::routing::vhost::VHost;

use super::commit::durably;
use super::{
    ApiResult, body, find_user, no_content, ok_json, user_error, vhost_for, visible_vhosts,
};
use crate::auth::Caller;
use crate::{ApiError, AppState};

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

pub(super) async fn list_vhost_limits(State(state): State<AppState>, caller: Caller) -> ApiResult {
    ok_json(Value::Array(
        visible_vhosts(&state, &caller)
            .iter()
            .filter_map(|vh| vhost_limits_json(vh))
            .collect(),
    ))
}

pub(super) async fn get_vhost_limits(
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

pub(super) async fn put_vhost_limit(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    let value = limit_value(&raw)?;
    set_vhost_limit(&state, &caller, &vhost, &name, Some(value)).await
}

pub(super) async fn delete_vhost_limit(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult {
    set_vhost_limit(&state, &caller, &vhost, &name, None).await
}

fn user_limits_json(u: &warren_broker::users::UserRecord) -> Option<Value> {
    limits_entry("user", &u.name, &u.limits)
}

pub(super) async fn list_user_limits(State(state): State<AppState>, caller: Caller) -> ApiResult {
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

pub(super) async fn get_user_limits(
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

pub(super) async fn put_user_limit(
    State(state): State<AppState>,
    caller: Caller,
    Path((user, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    let value = limit_value(&raw)?;
    set_user_limit(&state, &caller, &user, &name, Some(value)).await
}

pub(super) async fn delete_user_limit(
    State(state): State<AppState>,
    caller: Caller,
    Path((user, name)): Path<(String, String)>,
) -> ApiResult {
    set_user_limit(&state, &caller, &user, &name, None).await
}
