//! Redrives of the HTTP queue API (docs/http-queue-api.md): moving messages out of a
//! dead-letter queue, back to the queue each died in or into a named one.
//! - `POST /v1/queues/{vhost}/{queue}/redrive` starts a task (202 with the task);
//! - `GET /v1/redrives` lists the node's tasks, `GET /v1/redrives/{id}` shows one;
//! - `DELETE /v1/redrives/{id}` cancels one (the round under way completes).
//!
//! Starting needs read permission on the source (its messages are taken, as a consumer takes
//! them) and write permission on a named destination; without one, each message goes back to
//! the queue it died in if the caller may write there, and stays otherwise. Listing and
//! cancelling need read permission on the task's source.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde::Deserialize;
use serde_json::{Value, json};
use warren_broker::node::access::{Access, Perm, Resource};
use warren_broker::node::redrive::{
    REDRIVE_RATE_DEFAULT, RedriveError, RedriveFilter, RedriveSpec, RedriveStatus, RedriveTask,
};

use super::v1_messages::require;
use super::{ApiResult, ok_json, typed_body};
use crate::auth::QueueUser;
use crate::{ApiError, AppState};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StartBody {
    /// A queue of the same vhost; absent or null: each message's `x-death` origin.
    #[serde(default)]
    destination: Option<String>,
    #[serde(default)]
    max_messages: Option<u64>,
    #[serde(default)]
    rate: Option<u32>,
    #[serde(default)]
    filter: FilterBody,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FilterBody {
    #[serde(default)]
    origin: Option<String>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    routing_key: Option<String>,
    #[serde(default)]
    headers: serde_json::Map<String, Value>,
}

/// A task as the API shows it.
pub(crate) fn task_json(t: &RedriveTask) -> Value {
    let p = t.progress();
    let f = &t.spec.filter;
    let headers: serde_json::Map<String, Value> = f
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
        .collect();
    json!({
        "id": t.id,
        "vhost": t.spec.vhost,
        "source": t.spec.source,
        "destination": t.spec.destination,
        "max_messages": t.spec.max_messages,
        "rate": t.spec.rate,
        "filter": {
            "origin": f.origin,
            "reason": f.reason,
            "routing_key": f.routing_key,
            "headers": headers,
        },
        "status": p.status.name(),
        "moved": p.moved,
        "duplicates": p.duplicates,
        "skipped": p.skipped,
        "refused": p.refused,
        "source_ready_at_start": p.source_ready_at_start,
        "started_at": p.started_at_ms,
        "finished_at": p.finished_at_ms,
        "error": p.error,
    })
}

fn refused(e: &RedriveError) -> ApiError {
    let (status, error) = match e {
        RedriveError::NoVhost(_) | RedriveError::NoQueue(..) | RedriveError::NoTask(_) => {
            (StatusCode::NOT_FOUND, "not_found")
        }
        RedriveError::Busy => (StatusCode::TOO_MANY_REQUESTS, "too_many_redrives"),
        RedriveError::Elsewhere(_) => (StatusCode::CONFLICT, "queue_elsewhere"),
        RedriveError::Stream(_)
        | RedriveError::Rate
        | RedriveError::TooLong
        | RedriveError::SameQueue => (StatusCode::BAD_REQUEST, "bad_request"),
    };
    ApiError {
        status,
        error,
        reason: e.to_string(),
    }
}

/// POST /v1/queues/{vhost}/{queue}/redrive.
pub(super) async fn start(
    user: QueueUser,
    State(state): State<AppState>,
    Path((vhost, queue)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> ApiResult {
    let body: StartBody = if body.is_empty() {
        StartBody::default()
    } else {
        typed_body(&body)?
    };
    if state.broker.vhost(&vhost).is_none() {
        return Err(refused(&RedriveError::NoVhost(vhost)));
    }
    require(&state, &user, &vhost, &queue, Perm::Read)?;
    if let Some(d) = &body.destination {
        require(&state, &user, &vhost, d, Perm::Write)?;
    }
    let headers = body
        .filter
        .headers
        .into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k, s)),
            Value::Number(n) => Ok((k, n.to_string())),
            _ => Err(ApiError::bad_request(format!(
                "filter header '{k}': a string or a number"
            ))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let spec = RedriveSpec {
        vhost: vhost.clone(),
        source: queue,
        destination: body.destination,
        max_messages: body.max_messages,
        rate: body.rate.unwrap_or(REDRIVE_RATE_DEFAULT),
        filter: RedriveFilter {
            origin: body.filter.origin,
            reason: body.filter.reason,
            routing_key: body.filter.routing_key,
            headers,
        },
    };
    let access = std::sync::Mutex::new(Access::new(Arc::clone(&state.broker), &vhost, &user.name));
    let admin = user.local_admin;
    let may_write = Arc::new(move |queue: &str| {
        admin
            || access
                .lock()
                .is_ok_and(|mut a| a.check(Perm::Write, Resource::Queue, queue).is_ok())
    });
    let task = state
        .broker
        .start_redrive(spec, may_write)
        .map_err(|e| refused(&e))?;
    Ok((StatusCode::ACCEPTED, axum::Json(task_json(&task))).into_response())
}

/// The task `id` if the caller may read its source.
fn visible(state: &AppState, user: &QueueUser, id: &str) -> Result<Arc<RedriveTask>, ApiError> {
    let id: u64 = id
        .parse()
        .map_err(|_| ApiError::bad_request("a redrive id is a number"))?;
    let task = state
        .broker
        .redrives()
        .get(id)
        .ok_or_else(|| refused(&RedriveError::NoTask(id)))?;
    require(state, user, &task.spec.vhost, &task.spec.source, Perm::Read)?;
    Ok(task)
}

/// GET /v1/redrives: the tasks whose source the caller may read, oldest first.
pub(super) async fn list(user: QueueUser, State(state): State<AppState>) -> ApiResult {
    let tasks: Vec<Value> = state
        .broker
        .redrives()
        .list()
        .iter()
        .filter(|t| require(&state, &user, &t.spec.vhost, &t.spec.source, Perm::Read).is_ok())
        .map(|t| task_json(t))
        .collect();
    ok_json(Value::Array(tasks))
}

/// GET /v1/redrives/{id}.
pub(super) async fn show(
    user: QueueUser,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult {
    let task = visible(&state, &user, &id)?;
    ok_json(task_json(&task))
}

/// DELETE /v1/redrives/{id}: cancel (a finished task stays as it was).
pub(super) async fn cancel(
    user: QueueUser,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult {
    let task = visible(&state, &user, &id)?;
    if task.progress().status == RedriveStatus::Running {
        task.cancel();
    }
    ok_json(task_json(&task))
}
