//! `/api/permissions` and `/api/topic-permissions` (rabbit_mgmt_wm_permissions,
//! rabbit_mgmt_wm_permission, rabbit_mgmt_wm_topic_permissions), and the per-vhost and
//! per-user views of both: who may configure, write and read what.

use axum::extract::{Path, State};
use serde::Deserialize;
use serde_json::{Value, json};
use warren_broker::users::PermissionRecord;

use super::commit::durably;
use super::{ApiResult, body, created, find_user, grant_error, no_content, ok_json, user_error};
use crate::auth::Caller;
use crate::{ApiError, AppState};

pub(super) fn permission_json(p: &PermissionRecord) -> Value {
    json!({"user": p.user, "vhost": p.vhost, "configure": p.configure,
           "write": p.write, "read": p.read})
}

/// `/api/vhosts/{vhost}/permissions` (TOPIC: `/topic-permissions`): the grants in one vhost.
pub(super) async fn vhost_permissions<const TOPIC: bool>(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    caller.require_admin()?;
    state.broker.vhost(&vhost).ok_or_else(ApiError::not_found)?;
    ok_json(grants(&state, Some(&vhost), None, TOPIC))
}

/// `/api/users/{user}/permissions` (TOPIC: `/topic-permissions`): one user's grants.
pub(super) async fn user_permissions<const TOPIC: bool>(
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

pub(super) async fn list_permissions(State(state): State<AppState>, caller: Caller) -> ApiResult {
    caller.require_admin()?;
    ok_json(grants(&state, None, None, false))
}

pub(super) async fn get_permission(
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

pub(super) async fn put_permission(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, user)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    caller.require_admin()?;
    let b = body(&raw)?;
    let field = |k: &str| required_string(&b, k);
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

pub(super) async fn delete_permission(
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

// ---------------------------------------------------------------- topic permissions

pub(super) fn topic_json(p: &warren_broker::users::TopicPermissionRecord) -> Value {
    json!({"user": p.user, "vhost": p.vhost, "exchange": p.exchange,
           "write": p.write, "read": p.read})
}

pub(super) async fn list_topic_permissions(
    State(state): State<AppState>,
    caller: Caller,
) -> ApiResult {
    caller.require_admin()?;
    ok_json(grants(&state, None, None, true))
}

pub(super) async fn get_topic_permissions(
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

pub(super) async fn put_topic_permission(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, user)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    caller.require_admin()?;
    let b = body(&raw)?;
    let field = |k: &str| required_string(&b, k);
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
pub(super) struct TopicScope {
    exchange: Option<String>,
}

/// DELETE `/api/topic-permissions/{vhost}/{user}`: all the user's topic permissions in the
/// vhost, or (Warren's `?exchange=`, for `warren ctl clear_topic_permissions`) one exchange's.
pub(super) async fn delete_topic_permissions(
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

/// A string field of a permission body, which RabbitMQ requires: 400 `<field> is required`.
fn required_string(b: &Value, k: &str) -> Result<String, ApiError> {
    b.get(k)
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| ApiError::bad_request(format!("{k} is required")))
}
