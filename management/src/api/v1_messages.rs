//! `/v1/queues/{vhost}/{queue}/messages` (the HTTP queue API, docs/http-queue-api.md):
//! `POST` publishes a batch of messages into one queue, `GET` browses what it holds without
//! claiming anything.
//!
//! Each message goes into the named queue as a publish through the default exchange would
//! put it there, persistent unless it says otherwise, and the reply comes once every message
//! is as durable as a publisher confirm would make it (on disk for a durable queue, committed
//! by a majority for a quorum queue). The caller needs write permission on the queue.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use warren_amqp::properties::Properties;
use warren_broker::message::Message;
use warren_broker::message::Outgoing;
use warren_broker::node::access::{Access, Perm, Resource};
use warren_broker::queue::machine::{BrowseState, Browsed};
use warren_broker::queue::{Enqueued, PublishOptions, Queue};

use super::{ApiResult, ok_json, queue_for_user, typed_body};
use crate::auth::QueueUser;
use crate::{ApiError, AppState};

/// Most messages one browse returns.
pub const BROWSE_LIMIT_MAX: usize = 1_000;

/// Longest delay a publish may ask (`delay_ms`): a day. Held messages keep their metadata in
/// memory (their bodies on disk for a durable queue), as delayed retries do.
pub const PUBLISH_DELAY_MAX_MS: u64 = 86_400_000;

/// Most messages one request publishes.
pub const PUBLISH_BATCH_MAX: usize = 1_000;
/// How long a publish waits for its messages to be durable before answering 503.
const DURABLE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PublishBody {
    messages: Vec<OneMessage>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OneMessage {
    payload: String,
    #[serde(default = "string")]
    payload_encoding: String,
    /// The routing key consumers see (default: the queue's name).
    #[serde(default)]
    routing_key: Option<String>,
    #[serde(default)]
    headers: Option<Map<String, Value>>,
    #[serde(default)]
    priority: Option<u8>,
    #[serde(default)]
    expiration_ms: Option<u64>,
    /// Persistent (delivery mode 2) unless false.
    #[serde(default = "yes")]
    persistent: bool,
    #[serde(default)]
    message_id: Option<String>,
    #[serde(default)]
    content_type: Option<String>,
    #[serde(default)]
    correlation_id: Option<String>,
    #[serde(default)]
    delay_ms: Option<u64>,
    #[serde(default)]
    dedup_token: Option<String>,
}

fn string() -> String {
    "string".into()
}

fn yes() -> bool {
    true
}

/// A message id nobody else has: the node's clock and a process-wide counter.
fn new_message_id() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{nanos:x}-{n:x}")
}

/// The message as the queue will hold it, its id and its delay.
fn build(
    state: &AppState,
    queue: &Queue,
    m: OneMessage,
) -> Result<(Arc<Message>, String, Option<u64>), ApiError> {
    if queue.is_stream && m.delay_ms.is_some_and(|d| d > 0) {
        return Err(ApiError::bad_request(
            "delay_ms: a stream keeps messages in arrival order; it holds none back",
        ));
    }
    if m.delay_ms.is_some_and(|d| d > PUBLISH_DELAY_MAX_MS) {
        return Err(ApiError::bad_request(format!(
            "delay_ms: at most {PUBLISH_DELAY_MAX_MS}"
        )));
    }
    if let Some(t) = &m.dedup_token {
        if !queue.deduplicates() {
            return Err(ApiError::bad_request(
                "dedup_token: the queue does not deduplicate (declare it with x-message-deduplication)",
            ));
        }
        if t.is_empty() || t.len() > warren_broker::queue::machine::DEDUP_KEY_MAX {
            return Err(ApiError::bad_request(format!(
                "dedup_token: 1 to {} bytes",
                warren_broker::queue::machine::DEDUP_KEY_MAX
            )));
        }
    }
    let payload = match m.payload_encoding.as_str() {
        "string" => bytes::Bytes::from(m.payload.into_bytes()),
        "base64" => bytes::Bytes::from(
            base64::Engine::decode(&base64::engine::general_purpose::STANDARD, &m.payload)
                .map_err(|_| ApiError::bad_request("payload is not base64"))?,
        ),
        other => {
            return Err(ApiError::bad_request(format!(
                "invalid payload_encoding {other} (string or base64)"
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
    let delay_ms = m.delay_ms.filter(|&d| d > 0);
    let message_id = m.message_id.unwrap_or_else(new_message_id);
    let mut props = Map::new();
    let mut headers = m.headers.unwrap_or_default();
    if let Some(t) = m.dedup_token {
        headers.insert("x-deduplication-header".into(), json!(t));
    }
    props.insert("message_id".into(), json!(message_id));
    props.insert(
        "delivery_mode".into(),
        json!(if m.persistent { 2 } else { 1 }),
    );
    if !headers.is_empty() {
        props.insert("headers".into(), Value::Object(headers));
    }
    if let Some(p) = m.priority {
        props.insert("priority".into(), json!(p));
    }
    if let Some(e) = m.expiration_ms {
        props.insert("expiration".into(), json!(e.to_string()));
    }
    if let Some(c) = m.content_type {
        props.insert("content_type".into(), json!(c));
    }
    if let Some(c) = m.correlation_id {
        props.insert("correlation_id".into(), json!(c));
    }
    let raw =
        crate::properties::from_json(Some(&Value::Object(props))).map_err(ApiError::bad_request)?;
    let properties = Properties::parse(
        bytes::Bytes::from(raw),
        warren_amqp::limits::TABLE_DEPTH_MAX,
    )
    .map_err(|_| ApiError::bad_request("invalid properties"))?;
    let routing_key = m.routing_key.unwrap_or_else(|| queue.name.clone());
    if routing_key.len() > 255 {
        return Err(ApiError::bad_request(
            "routing_key is longer than 255 bytes",
        ));
    }
    Ok((
        Arc::new(Message {
            exchange: String::new(),
            routing_key,
            properties,
            body: payload,
        }),
        message_id,
        delay_ms,
    ))
}

/// The 403 of a user without `perm` on the queue (RabbitMQ's text).
pub(super) fn require(
    state: &AppState,
    user: &QueueUser,
    vhost: &str,
    queue: &str,
    perm: Perm,
) -> Result<(), ApiError> {
    if user.local_admin {
        return Ok(());
    }
    let mut access = Access::new(Arc::clone(&state.broker), vhost, &user.name);
    access
        .check(perm, Resource::Queue, queue)
        .map_err(|e| ApiError {
            status: axum::http::StatusCode::FORBIDDEN,
            error: "access_refused",
            reason: e.text,
        })
}

/// POST /v1/queues/{vhost}/{queue}/messages.
pub(super) async fn publish(
    State(state): State<AppState>,
    user: QueueUser,
    Path((vhost, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    let queue = queue_for_user(&state, &vhost, &name)?;
    require(&state, &user, &vhost, &name, Perm::Write)?;
    let b: PublishBody = typed_body(&raw)?;
    if b.messages.is_empty() || b.messages.len() > PUBLISH_BATCH_MAX {
        return Err(ApiError::bad_request(format!(
            "messages: 1 to {PUBLISH_BATCH_MAX} a request"
        )));
    }
    // Every message checked before any is published: a bad one publishes none.
    let built = b
        .messages
        .into_iter()
        .map(|m| build(&state, &queue, m))
        .collect::<Result<Vec<_>, _>>()?;
    // All submitted at once (one group commit for the batch), then awaited in order.
    let waits: Vec<_> = built
        .into_iter()
        .map(|(message, message_id, delay_ms)| {
            let (tx, rx) = tokio::sync::oneshot::channel();
            queue.publish_one(
                &message,
                PublishOptions {
                    move_key: None,
                    delay_ms,
                },
                Box::new(move |r| {
                    let _ = tx.send(r);
                }),
            );
            (message_id, rx)
        })
        .collect();
    let mut out = Vec::with_capacity(waits.len());
    for (message_id, rx) in waits {
        let outcome = match tokio::time::timeout(DURABLE_WAIT, rx).await {
            Ok(Ok(Ok(outcome))) => outcome,
            _ => {
                return Err(ApiError {
                    status: axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    error: "not_durable",
                    reason: format!(
                        "message {message_id} was not confirmed; publish it and those after it again ({} before it were)",
                        out.len()
                    ),
                });
            }
        };
        match outcome {
            Enqueued::Rejected => {
                return Err(ApiError {
                    status: axum::http::StatusCode::TOO_MANY_REQUESTS,
                    error: "queue_full",
                    reason: format!(
                        "the queue refused message {message_id} (x-overflow reject-publish at its limit); {} before it were published",
                        out.len()
                    ),
                });
            }
            Enqueued::Gone => return Err(ApiError::not_found()),
            Enqueued::Accepted | Enqueued::Duplicate => {}
        }
        out.push(json!({
            "message_id": message_id,
            "duplicate": outcome == Enqueued::Duplicate,
        }));
    }
    ok_json(json!({"messages": out}))
}

/// A loaded message's body and properties as the queue API shows them: `payload` as text
/// when it is UTF-8, else base64 (`payload_encoding` says which).
pub(super) fn body_json(loaded: &warren_broker::message::Loaded) -> Map<String, Value> {
    let body = loaded.body();
    let (payload, encoding) = match std::str::from_utf8(body) {
        Ok(s) => (s.to_string(), "string"),
        Err(_) => (
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, body),
            "base64",
        ),
    };
    let properties = crate::properties::to_json(loaded.properties());
    let mut m = Map::new();
    m.insert(
        "message_id".into(),
        properties.get("message_id").cloned().unwrap_or(Value::Null),
    );
    m.insert("payload".into(), json!(payload));
    m.insert("payload_encoding".into(), json!(encoding));
    m.insert("payload_bytes".into(), json!(body.len()));
    m.insert(
        "routing_key".into(),
        json!(String::from_utf8_lossy(loaded.routing_key())),
    );
    m.insert(
        "exchange".into(),
        json!(String::from_utf8_lossy(loaded.exchange())),
    );
    m.insert(
        "headers".into(),
        properties
            .get("headers")
            .cloned()
            .unwrap_or_else(|| json!({})),
    );
    m.insert("properties".into(), properties);
    m
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct BrowseQuery {
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    from: usize,
    #[serde(default = "twenty")]
    limit: usize,
}

fn twenty() -> usize {
    20
}

fn browsed_json(state: &str, b: Browsed<Outgoing>) -> Option<Value> {
    // A message that left the queue since the look is skipped.
    let loaded = b.msg.load().ok()?;
    let mut m = body_json(&loaded);
    m.insert("position".into(), json!(b.position));
    m.insert("id".into(), json!(b.id));
    m.insert("state".into(), json!(state));
    m.insert("delivery_count".into(), json!(b.delivery_count));
    m.insert("enqueued_at".into(), json!(b.enqueued_at));
    if let Some(at) = b.ready_at {
        m.insert("ready_at".into(), json!(at));
    }
    if let Some((generation, expires_at, worker)) = b.lease {
        m.insert("state".into(), json!("claimed"));
        m.insert("generation".into(), json!(generation));
        m.insert("lease_expires_at".into(), json!(expires_at));
        m.insert("worker".into(), json!(worker));
    }
    Some(Value::Object(m))
}

/// GET /v1/queues/{vhost}/{queue}/messages?state=ready|scheduled|unacked&from=N&limit=N:
/// the queue's messages in that state from position `from`, without claiming them.
pub(super) async fn browse(
    State(state): State<AppState>,
    user: QueueUser,
    Path((vhost, name)): Path<(String, String)>,
    Query(query): Query<BrowseQuery>,
) -> ApiResult {
    let queue = queue_for_user(&state, &vhost, &name)?;
    require(&state, &user, &vhost, &name, Perm::Read)?;
    let (which, label) = match query.state.as_deref().unwrap_or("ready") {
        "ready" => (BrowseState::Ready, "ready"),
        "scheduled" => (BrowseState::Scheduled, "scheduled"),
        "unacked" => (BrowseState::Unacked, "delivered"),
        other => {
            return Err(ApiError::bad_request(format!(
                "state {other}: ready, scheduled or unacked"
            )));
        }
    };
    if query.limit == 0 || query.limit > BROWSE_LIMIT_MAX {
        return Err(ApiError::bad_request(format!(
            "limit: 1 to {BROWSE_LIMIT_MAX}"
        )));
    }
    let found = queue.browse(which, query.from, query.limit).ok_or_else(|| {
        ApiError::bad_request(
            "this queue cannot be browsed here: a stream, or a classic queue held on another node (browse it there)",
        )
    })?;
    let full = found.len() == query.limit;
    let next = found.last().map(|b| b.position + 1);
    let messages: Vec<Value> = found
        .into_iter()
        .filter_map(|b| browsed_json(label, b))
        .collect();
    ok_json(json!({
        "messages": messages,
        "next_from": if full { next } else { None },
    }))
}
