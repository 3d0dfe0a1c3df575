//! `/api/vhosts` and `/api/vhosts/{vhost}` (rabbit_mgmt_wm_vhosts, rabbit_mgmt_wm_vhost):
//! list, show, create and delete virtual hosts.

use axum::extract::{Path, State};
use serde_json::{Value, json};
use warren_broker::routing::vhost::VHost;
use warren_broker::users::PermissionRecord;

use super::commit::durably;
use super::common::totals;
use super::{
    ApiResult, body, created, grant_error, no_content, ok_json, user_error, vhost_for,
    visible_vhosts,
};
use crate::auth::Caller;
use crate::{ApiError, AppState};

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

pub(super) async fn list_vhosts(State(state): State<AppState>, caller: Caller) -> ApiResult {
    let v: Vec<Value> = visible_vhosts(&state, &caller)
        .iter()
        .map(|vh| vhost_json(vh, &state.node.node))
        .collect();
    ok_json(Value::Array(v))
}

pub(super) async fn get_vhost(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &name)?;
    ok_json(vhost_json(&vh, &state.node.node))
}

pub(super) async fn put_vhost(
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
pub(super) fn grant_creator(
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

pub(super) async fn delete_vhost(
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
