//! `/api/queues/...` (rabbit_mgmt_wm_queues, rabbit_mgmt_wm_queue, rabbit_mgmt_wm_queue_purge,
//! rabbit_mgmt_wm_queue_get): list, show, declare, delete and purge queues, get messages,
//! and Warren's quorum queue membership changes.

use std::sync::Arc;

use amq_protocol::protocol::{AMQPClass, basic, queue};
use axum::Json;
use axum::extract::{Path, State};
use serde::Deserialize;
use serde_json::{Value, json};
use warren_broker::policy::PolicyKind;
use warren_broker::queue::Queue;
use warren_broker::routing::vhost::VHost;

use super::commit::committed;
use super::common::{DeleteConditions, arguments, message_stats_json};
use super::consumers::consumers_filtered;
use super::{
    ApiResult, created, direct, no_content, ok_json, queue_for, short, typed_body, vhost_for,
    vhost_to_write, visible_vhosts,
};
use crate::auth::Caller;
use crate::json::table_to_json;
use crate::rates::MessageRates;
use crate::{ApiError, AppState, queue_message_stats};

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
        "messages": s.ready + s.unacked + s.work.scheduled,
        "messages_ready": s.ready,
        "messages_unacknowledged": s.unacked,
        "message_bytes": s.ready_bytes + s.unacked_bytes,
        "message_bytes_ready": s.ready_bytes,
        "message_bytes_unacknowledged": s.unacked_bytes,
        "consumers": s.consumers,
        "message_stats": message_stats_json(&queue_message_stats(&s.counters), rates, false),
        // Warren's own: how long the head of the queue has waited (null when nothing is ready).
        "oldest_ready_message_age_ms": s.oldest_ready_age_ms,
        // Warren's own: messages waiting out a delayed retry (in `messages`, not ready), and
        // the claims of the HTTP queue API (docs/http-queue-api.md).
        "messages_scheduled": s.work.scheduled,
        "message_bytes_scheduled": s.work.scheduled_bytes,
        "leases": {
            "leased": s.work.leased,
            "oldest_lease_age_ms": s.work.oldest_claim_age_ms,
            "claimed": s.work.counters.claimed,
            "extended": s.work.counters.extended,
            "released": s.work.counters.released,
            "expired": s.work.counters.lease_expired,
            "retries_delayed": s.work.counters.retries_delayed,
            "deduplicated": s.work.counters.deduplicated,
            "delayed_publishes": s.work.counters.delayed_publishes,
            "redrive_duplicates": s.work.counters.moves_refused,
            "quarantined": s.work.counters.quarantined,
            // Acknowledged messages by the attempt that succeeded (cumulative, as a
            // Prometheus histogram's buckets), and the bound holding 99% of them.
            "acked_attempts": attempts_json(&s.work.counters),
            "acked_attempts_p99": s.work.counters.attempts_quantile(0.99).map(|b| {
                if b == u32::MAX { json!("+Inf") } else { json!(b) }
            }),
        },
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
        if let Some(home) = q.home() {
            // A classic queue of the cluster held on another node: its node is its home.
            obj.insert("node".into(), json!(home));
        } else if let Some(replica) = q.replica() {
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

pub(super) async fn list_all_queues(State(state): State<AppState>, caller: Caller) -> ApiResult {
    let vhosts = visible_vhosts(&state, &caller);
    ok_json(queues_of(&state, &vhosts))
}

pub(super) async fn list_vhost_queues(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    ok_json(queues_of(&state, &[vh]))
}

pub(super) async fn get_queue(
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
            "purged_index": r.purged_index,
            "role": r.role,
            "digest": r.digest,
            "learners": r.learners,
        });
    }
    ok_json(v)
}

#[derive(Debug, Deserialize)]
pub(super) struct MemberBody {
    node: String,
}

/// Warren's own (rabbitmq-queues add_member has no HTTP form): make `node` a member of a
/// quorum queue. Answers once the cluster committed the new member list; the queue's leader
/// then makes it a voter once it has caught up.
pub(super) async fn add_member(
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
        warren_broker::node::replication::MemberChange::Add(body.node),
    )
    .await
}

/// Warren's own: `node` is no longer a member of a quorum queue (it stays a learner).
pub(super) async fn delete_member(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name, node)): Path<(String, String, String)>,
) -> ApiResult {
    change_members(
        &state,
        &caller,
        &vhost,
        &name,
        warren_broker::node::replication::MemberChange::Delete(node),
    )
    .await
}

async fn change_members(
    state: &AppState,
    caller: &Caller,
    vhost: &str,
    name: &str,
    change: warren_broker::node::replication::MemberChange,
) -> ApiResult {
    use warren_broker::node::replication::MembershipError;
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

pub(super) async fn put_queue(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    vhost_to_write(&state, &caller, &vhost)?;
    let b: QueueBody = typed_body(&raw)?;
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

pub(super) async fn delete_queue(
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

pub(super) async fn purge_queue(
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

// ---------------------------------------------------------------- get messages

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
pub(super) async fn get_messages(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    queue_for(&state, &caller, &vhost, &name)?;
    let b: GetBody = typed_body(&raw)?;
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

/// The attempts histogram as `[{"le": 1, "count": n}, ..., {"le": "+Inf", "count": n}]`,
/// cumulative.
fn attempts_json(c: &warren_broker::queue::machine::WorkCounters) -> Value {
    let bounds = warren_broker::queue::machine::ATTEMPT_BOUNDS;
    let mut cumulative = 0;
    Value::Array(
        c.acked_attempts
            .iter()
            .enumerate()
            .map(|(i, n)| {
                cumulative += n;
                let le = bounds.get(i).map_or(json!("+Inf"), |b| json!(b));
                json!({"le": le, "count": cumulative})
            })
            .collect(),
    )
}
