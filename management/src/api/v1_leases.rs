//! Leases of the HTTP queue API (docs/http-queue-api.md):
//! - `POST /v1/queues/{vhost}/{queue}/leases` claims up to `max_items` ready messages for
//!   `lease_ms`, waiting up to `wait_ms` for one to arrive (long poll);
//! - `POST /v1/leases/{token}/ack`, `/extend` and `/release` settle or extend one claim.
//!
//! A token names the queue, the message, the claim's generation and the message's enqueue
//! time. Only the claim that token names, while its lease runs, may act: a superseded
//! generation gets 409 `stale_generation`, a lease that ran out 409 `lease_expired`, both with
//! the current generation and with nothing changed; a token of no message 404. Claiming and
//! settling need read permission on the queue.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use base64::Engine;
use serde::Deserialize;
use serde_json::{Value, json};
use warren_broker::message::Outgoing;
use warren_broker::node::access::Perm;
use warren_broker::queue::machine::{Claimed, Command, LeaseError, LeaseState};
use warren_broker::queue::{LeaseCallError, Queue};

use super::v1_messages::{body_json, require};
use super::{ApiResult, body, ok_json, queue_for_user, typed_body};
use crate::auth::QueueUser;
use crate::{ApiError, AppState};

/// Most messages one claim takes.
pub const LEASE_BATCH_MAX: u32 = 1_000;
/// Longest a claim waits for a message (SQS's long poll is 20 s at most).
pub const LEASE_WAIT_MAX_MS: u64 = 20_000;
/// Longest encoded token accepted (a longer one names nothing).
pub const TOKEN_LEN_MAX: usize = 2_048;
/// How often a claim on a classic queue held by another node looks again while it waits
/// (that node's arrivals do not reach this one's notifications).
const REMOTE_POLL: std::time::Duration = std::time::Duration::from_millis(100);
/// How long a call waits for a replicated queue's group to answer.
const GROUP_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// What a token carries.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Token {
    vhost: String,
    queue: String,
    id: u64,
    generation: u32,
    enqueued_at: u64,
}

impl Token {
    /// URL-safe base64 of `vhost NUL queue NUL id.generation.enqueued_at`.
    fn encode(&self) -> String {
        let text = format!(
            "{}\0{}\0{}.{}.{}",
            self.vhost, self.queue, self.id, self.generation, self.enqueued_at
        );
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(text)
    }

    /// The token `s` encodes, if it is one.
    fn decode(s: &str) -> Option<Self> {
        if s.len() > TOKEN_LEN_MAX {
            return None;
        }
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(s)
            .ok()?;
        let text = String::from_utf8(bytes).ok()?;
        let mut parts = text.splitn(3, '\0');
        let (vhost, queue, numbers) = (parts.next()?, parts.next()?, parts.next()?);
        let mut n = numbers.split('.');
        let token = Self {
            vhost: vhost.to_string(),
            queue: queue.to_string(),
            id: n.next()?.parse().ok()?,
            generation: n.next()?.parse().ok()?,
            enqueued_at: n.next()?.parse().ok()?,
        };
        n.next().is_none().then_some(token)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClaimBody {
    #[serde(default = "one")]
    max_items: u32,
    #[serde(default)]
    lease_ms: Option<u64>,
    #[serde(default)]
    wait_ms: u64,
    /// Who claims (kept with the lease; default: the user's name).
    #[serde(default)]
    worker: Option<String>,
}

fn one() -> u32 {
    1
}

/// Longest worker name kept with a lease.
pub const WORKER_LEN_MAX: usize = 255;

fn unavailable(e: &LeaseCallError) -> ApiError {
    match e {
        LeaseCallError::Deleted => ApiError::not_found(),
        LeaseCallError::Stream => ApiError::bad_request("a stream has no claims: consume it"),
        LeaseCallError::Replication(e) => ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            error: "unavailable",
            reason: e.to_string(),
        },
    }
}

fn group_timeout() -> ApiError {
    ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        error: "unavailable",
        reason: "the queue's group did not answer in time".into(),
    }
}

async fn claim_once(
    queue: &Arc<Queue>,
    max: u32,
    lease_ms: Option<u64>,
    worker: &str,
) -> Result<Vec<Claimed<Outgoing>>, ApiError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    queue.claim(
        max,
        lease_ms,
        worker.to_string(),
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
    match tokio::time::timeout(GROUP_WAIT, rx).await {
        Ok(Ok(Ok(claims))) => Ok(claims),
        Ok(Ok(Err(e))) => Err(unavailable(&e)),
        _ => Err(group_timeout()),
    }
}

/// One claimed message as JSON (its body read now).
fn delivery(vhost: &str, queue: &Queue, c: Claimed<Outgoing>) -> Result<Value, ApiError> {
    let loaded = c.msg.load().map_err(|e| ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        error: "internal_error",
        reason: format!("message {} is unreadable: {e}", c.id),
    })?;
    let token = Token {
        vhost: vhost.to_string(),
        queue: queue.name.clone(),
        id: c.id,
        generation: c.generation,
        enqueued_at: c.enqueued_at,
    };
    let mut m = body_json(&loaded);
    if m.get("message_id").is_none_or(Value::is_null) {
        m.insert("message_id".into(), json!(c.id.to_string()));
    }
    m.insert("token".into(), json!(token.encode()));
    m.insert("generation".into(), json!(c.generation));
    m.insert("attempt".into(), json!(c.generation));
    m.insert("delivery_count".into(), json!(c.delivery_count));
    m.insert("redelivered".into(), json!(c.redelivered));
    m.insert("lease_expires_at".into(), json!(c.lease_expires_at));
    m.insert("enqueued_at".into(), json!(c.enqueued_at));
    Ok(Value::Object(m))
}

/// POST /v1/queues/{vhost}/{queue}/leases.
pub(super) async fn claim(
    State(state): State<AppState>,
    user: QueueUser,
    Path((vhost, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    let queue = queue_for_user(&state, &vhost, &name)?;
    require(&state, &user, &vhost, &name, Perm::Read)?;
    let b: ClaimBody = typed_body(&raw)?;
    if b.max_items == 0 || b.max_items > LEASE_BATCH_MAX {
        return Err(ApiError::bad_request(format!(
            "max_items: 1 to {LEASE_BATCH_MAX}"
        )));
    }
    if b.lease_ms == Some(0) {
        return Err(ApiError::bad_request("lease_ms: at least 1"));
    }
    if b.wait_ms > LEASE_WAIT_MAX_MS {
        return Err(ApiError::bad_request(format!(
            "wait_ms: at most {LEASE_WAIT_MAX_MS}"
        )));
    }
    let worker = b.worker.unwrap_or_else(|| user.name.clone());
    if worker.len() > WORKER_LEN_MAX {
        return Err(ApiError::bad_request(format!(
            "worker: at most {WORKER_LEN_MAX} bytes"
        )));
    }
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(b.wait_ms);
    let remote = queue.replica().is_some_and(|r| r.home().is_some());
    let claims = loop {
        let arrived = queue.ready_arrived();
        tokio::pin!(arrived);
        arrived.as_mut().enable();
        let claims = claim_once(&queue, b.max_items, b.lease_ms, &worker).await?;
        let now = tokio::time::Instant::now();
        if !claims.is_empty() || now >= deadline {
            break claims;
        }
        let wake = if remote {
            deadline.min(now + REMOTE_POLL)
        } else {
            deadline
        };
        let _ = tokio::time::timeout_at(wake, arrived).await;
    };
    let deliveries = claims
        .into_iter()
        .map(|c| delivery(&vhost, &queue, c))
        .collect::<Result<Vec<_>, _>>()?;
    ok_json(json!({"deliveries": deliveries}))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExtendBody {
    lease_ms: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseBody {
    #[serde(default)]
    reason: String,
    #[serde(default)]
    delay_ms: Option<u64>,
}

/// Longest release reason kept.
pub const REASON_LEN_MAX: usize = 1_024;

/// What a settled or extended claim answers.
fn lease_state(token: &Token, state: LeaseState) -> Value {
    let mut v = json!({
        "id": token.id,
        "generation": token.generation,
    });
    match state {
        LeaseState::Claimed { lease_expires_at } => {
            v["state"] = json!("claimed");
            v["lease_expires_at"] = json!(lease_expires_at);
        }
        LeaseState::Acked => v["state"] = json!("acked"),
        LeaseState::Released { ready_at } => {
            v["state"] = json!(if ready_at.is_some() {
                "scheduled"
            } else {
                "released"
            });
            v["ready_at"] = json!(ready_at);
        }
    }
    v
}

fn conflict(error: &'static str, current: u32) -> axum::response::Response {
    (
        StatusCode::CONFLICT,
        axum::Json(json!({
            "error": error,
            "reason": match error {
                "stale_generation" => "a later claim of the message superseded this token",
                _ => "this token's lease ran out; claim the message again",
            },
            "current_generation": current,
        })),
    )
        .into_response()
}

/// One settle or extend: the token's queue, the permission check, the command, the answer.
async fn settle(
    state: &AppState,
    user: &QueueUser,
    token: &str,
    command: impl FnOnce(&Token) -> Command<warren_broker::message::Entry>,
) -> ApiResult {
    let token = Token::decode(token).ok_or_else(ApiError::not_found)?;
    let queue = queue_for_user(state, &token.vhost, &token.queue)?;
    require(state, user, &token.vhost, &token.queue, Perm::Read)?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    queue.settle_lease(
        command(&token),
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
    let outcome = match tokio::time::timeout(GROUP_WAIT, rx).await {
        Ok(Ok(r)) => r.map_err(|e| unavailable(&e))?,
        _ => return Err(group_timeout()),
    };
    match outcome {
        Ok(s) => ok_json(lease_state(&token, s)),
        Err(LeaseError::NotFound) => Err(ApiError::not_found()),
        Err(LeaseError::StaleGeneration { current }) => Ok(conflict("stale_generation", current)),
        Err(LeaseError::LeaseExpired { current }) => Ok(conflict("lease_expired", current)),
    }
}

/// POST /v1/leases/{token}/ack (an empty body or `{}`).
pub(super) async fn ack(
    State(state): State<AppState>,
    user: QueueUser,
    Path(token): Path<String>,
    raw: axum::body::Bytes,
) -> ApiResult {
    // Read whole, so the connection stays usable for the client's next request.
    if !body(&raw)?
        .as_object()
        .is_some_and(serde_json::Map::is_empty)
    {
        return Err(ApiError::bad_request("an ack takes no fields"));
    }
    settle(&state, &user, &token, |t| Command::AckLease {
        id: t.id,
        generation: t.generation,
        enqueued_at: t.enqueued_at,
    })
    .await
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AckBatchBody {
    tokens: Vec<String>,
}

/// A queue (vhost, name) and the batch's tokens for it with their places.
type QueueTokens = ((String, String), Vec<(usize, Token)>);

/// One token's result in a batch: its status and what a single call would have answered.
fn batch_result(token: &str, r: Result<Value, (StatusCode, Value)>) -> Value {
    match r {
        Ok(mut v) => {
            v["token"] = json!(token);
            v["status"] = json!(200);
            v
        }
        Err((status, mut v)) => {
            v["token"] = json!(token);
            v["status"] = json!(status.as_u16());
            v
        }
    }
}

/// POST /v1/leases/ack with `{"tokens": [...]}`: acknowledge up to [`LEASE_BATCH_MAX`]
/// claims in one request (SQS's DeleteMessageBatch). Each token gets the status its own
/// `/v1/leases/{token}/ack` would have (200, 403, 404, 409) in `results`, in order; the
/// tokens of one queue go in one submission.
pub(super) async fn ack_batch(
    State(state): State<AppState>,
    user: QueueUser,
    raw: axum::body::Bytes,
) -> ApiResult {
    let b: AckBatchBody = typed_body(&raw)?;
    if b.tokens.is_empty() || b.tokens.len() > LEASE_BATCH_MAX as usize {
        return Err(ApiError::bad_request(format!(
            "tokens: 1 to {LEASE_BATCH_MAX} a request"
        )));
    }
    let not_found = || (StatusCode::NOT_FOUND, json!({"error": "not_found"}));
    let mut results: Vec<Option<Result<Value, (StatusCode, Value)>>> =
        (0..b.tokens.len()).map(|_| None).collect();
    // Tokens by queue, keeping their places.
    let mut groups: Vec<QueueTokens> = Vec::new();
    for (i, t) in b.tokens.iter().enumerate() {
        let Some(token) = Token::decode(t) else {
            results[i] = Some(Err(not_found()));
            continue;
        };
        let key = (token.vhost.clone(), token.queue.clone());
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push((i, token)),
            None => groups.push((key, vec![(i, token)])),
        }
    }
    let mut waits = Vec::new();
    for ((vhost, name), tokens) in groups {
        let Ok(queue) = queue_for_user(&state, &vhost, &name) else {
            for (i, _) in tokens {
                results[i] = Some(Err(not_found()));
            }
            continue;
        };
        if let Err(e) = require(&state, &user, &vhost, &name, Perm::Read) {
            for (i, _) in tokens {
                results[i] = Some(Err((
                    StatusCode::FORBIDDEN,
                    json!({"error": e.error, "reason": e.reason}),
                )));
            }
            continue;
        }
        let commands = tokens
            .iter()
            .map(|(_, t)| Command::AckLease {
                id: t.id,
                generation: t.generation,
                enqueued_at: t.enqueued_at,
            })
            .collect();
        let (tx, rx) = tokio::sync::oneshot::channel();
        queue.settle_leases(
            commands,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        waits.push((tokens, rx));
    }
    for (tokens, rx) in waits {
        let outcomes = match tokio::time::timeout(GROUP_WAIT, rx).await {
            Ok(Ok(r)) => r.map_err(|e| unavailable(&e))?,
            _ => return Err(group_timeout()),
        };
        for ((i, token), outcome) in tokens.into_iter().zip(outcomes) {
            results[i] = Some(match outcome {
                Ok(s) => Ok(lease_state(&token, s)),
                Err(LeaseError::NotFound) => Err(not_found()),
                Err(LeaseError::StaleGeneration { current }) => Err((
                    StatusCode::CONFLICT,
                    json!({"error": "stale_generation", "current_generation": current}),
                )),
                Err(LeaseError::LeaseExpired { current }) => Err((
                    StatusCode::CONFLICT,
                    json!({"error": "lease_expired", "current_generation": current}),
                )),
            });
        }
    }
    let results: Vec<Value> = b
        .tokens
        .iter()
        .zip(results)
        .map(|(t, r)| batch_result(t, r.unwrap_or_else(|| Err(not_found()))))
        .collect();
    ok_json(json!({"results": results}))
}

/// POST /v1/leases/{token}/extend with `{"lease_ms": N}`.
pub(super) async fn extend(
    State(state): State<AppState>,
    user: QueueUser,
    Path(token): Path<String>,
    raw: axum::body::Bytes,
) -> ApiResult {
    let b: ExtendBody = typed_body(&raw)?;
    if b.lease_ms == 0 {
        return Err(ApiError::bad_request("lease_ms: at least 1"));
    }
    settle(&state, &user, &token, |t| Command::Extend {
        id: t.id,
        generation: t.generation,
        enqueued_at: t.enqueued_at,
        lease_ms: b.lease_ms,
    })
    .await
}

/// POST /v1/leases/{token}/release with `{"reason": "...", "delay_ms": N}`.
pub(super) async fn release(
    State(state): State<AppState>,
    user: QueueUser,
    Path(token): Path<String>,
    raw: axum::body::Bytes,
) -> ApiResult {
    let b: ReleaseBody = typed_body(&raw)?;
    if b.reason.len() > REASON_LEN_MAX {
        return Err(ApiError::bad_request(format!(
            "reason: at most {REASON_LEN_MAX} bytes"
        )));
    }
    if b.delay_ms
        .is_some_and(|d| i128::from(d) > warren_broker::args::work::WORK_MS_MAX)
    {
        return Err(ApiError::bad_request(format!(
            "delay_ms: at most {}",
            warren_broker::args::work::WORK_MS_MAX
        )));
    }
    settle(&state, &user, &token, |t| Command::Release {
        id: t.id,
        generation: t.generation,
        enqueued_at: t.enqueued_at,
        delay_ms: b.delay_ms,
        reason: b.reason,
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::Token;

    /// A token decodes to what was encoded, and anything else decodes to nothing.
    #[test]
    fn tokens_round_trip_and_garbage_names_nothing() {
        let t = Token {
            vhost: "/".into(),
            queue: "jobs.a\u{e9}".into(),
            id: 42,
            generation: 3,
            enqueued_at: 1_765_000_000_123,
        };
        assert_eq!(Token::decode(&t.encode()), Some(t.clone()));
        assert!(
            t.encode()
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        );
        for bad in ["", "!!", "AAAA", &"A".repeat(5_000)] {
            assert_eq!(Token::decode(bad), None);
        }
        let extra = base64::Engine::encode(
            &base64::engine::general_purpose::URL_SAFE_NO_PAD,
            "/\u{0}q\u{0}1.2.3.4",
        );
        assert_eq!(Token::decode(&extra), None);
    }
}
