//! `/api/users`, `/api/users/{user}` (rabbit_mgmt_wm_users, rabbit_mgmt_wm_user) and
//! `/api/whoami` (rabbit_mgmt_wm_whoami): the broker's users.

use axum::extract::{Path, State};
use serde_json::{Value, json};

use super::commit::durably;
use super::{ApiResult, body, created, find_user, no_content, ok_json, user_error};
use crate::auth::Caller;
use crate::{ApiError, AppState};

pub(super) async fn whoami(caller: Caller) -> ApiResult {
    // rabbit_mgmt_format:user/1: every Warren user is an internal (database) user.
    ok_json(json!({"name": caller.name, "tags": caller.tags, "is_internal_user": true}))
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

pub(super) async fn list_users(State(state): State<AppState>, caller: Caller) -> ApiResult {
    caller.require_admin()?;
    ok_json(Value::Array(
        state.broker.list_users().iter().map(user_json).collect(),
    ))
}

pub(super) async fn get_user(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult {
    caller.require_admin()?;
    ok_json(user_json(&find_user(&state, &name)?))
}

/// `tags` as RabbitMQ takes them: a comma-separated string or a list.
pub(super) fn tags_of(b: &Value) -> Vec<String> {
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

pub(super) async fn put_user(
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

pub(super) async fn delete_user(
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
