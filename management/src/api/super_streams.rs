//! `/api/stream/super-streams/{vhost}/{name}` (rabbit_stream_super_stream_mgmt): create a super
//! stream as RabbitMQ lays it out, and (Warren's additions) show and delete one.
//!
//! A super stream is a durable direct exchange `name` with the argument `x-super-stream: true`
//! and one stream per partition, `name-<key>`, bound with the routing key `<key>` and the binding
//! argument `x-stream-partition-order: <index>`. The keys are `0 .. N-1` for `partitions: N`,
//! or the comma-separated `binding-keys`. Every piece is an ordinary exchange, queue and binding,
//! declared through the caller's own session (its permissions apply); a failure part way
//! removes what this request created, as RabbitMQ's stream manager rolls back.

use amq_protocol::protocol::{AMQPClass, exchange, queue};
use amq_protocol::types::{AMQPValue, FieldTable};
use axum::extract::{Path, State};
use serde::Deserialize;
use serde_json::{Value, json};
use warren_broker::limits::SUPER_STREAM_PARTITIONS_MAX;

use super::{
    ApiResult, created, direct, no_content, ok_json, short, typed_body, vhost_for, vhost_to_write,
};
use crate::auth::Caller;
use crate::direct::Direct;
use crate::{ApiError, AppState};

/// The exchange argument that marks a super stream.
pub(crate) const SUPER_STREAM_ARG: &str = "x-super-stream";
/// The binding argument that orders partitions.
pub(crate) const PARTITION_ORDER_ARG: &str = "x-stream-partition-order";

#[derive(Debug, Deserialize)]
struct SuperStreamBody {
    #[serde(default)]
    partitions: Option<Value>,
    #[serde(default, rename = "binding-keys")]
    binding_keys: Option<Value>,
    #[serde(default)]
    arguments: Option<serde_json::Map<String, Value>>,
}

/// The routing keys of the partitions the body asks for, checked as RabbitMQ checks them.
fn routing_keys(b: &SuperStreamBody) -> Result<Vec<String>, ApiError> {
    let max = SUPER_STREAM_PARTITIONS_MAX;
    match (&b.partitions, &b.binding_keys) {
        (None, None) => Err(ApiError::bad_request(
            "Must specify partitions or binding keys",
        )),
        (Some(_), Some(_)) => Err(ApiError::bad_request(
            "Specify partitions or binding keys, not both",
        )),
        (Some(p), None) => {
            let n = match p {
                Value::Number(n) => n.as_i64(),
                Value::String(s) => s.trim().parse::<i64>().ok(),
                _ => None,
            }
            .ok_or_else(|| ApiError::bad_request("The partitions must be a number"))?;
            if n < 1 {
                return Err(ApiError::bad_request(
                    "The partition number must be greater than 0",
                ));
            }
            if n > i64::from(max) {
                return Err(ApiError::bad_request(format!(
                    "The partition number must not exceed {max}"
                )));
            }
            Ok((0..n).map(|i| i.to_string()).collect())
        }
        (None, Some(keys)) => {
            let text = match keys {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            let keys: Vec<String> = text
                .split(',')
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .map(str::to_string)
                .collect();
            if keys.is_empty() {
                return Err(ApiError::bad_request(
                    "The number of binding keys must be greater than 0",
                ));
            }
            if keys.len() > max as usize {
                return Err(ApiError::bad_request(format!(
                    "The number of binding keys must not exceed {max}"
                )));
            }
            Ok(keys)
        }
    }
}

/// The partitions' queue arguments: `x-queue-type: stream` and the stream settings the body
/// names without their `x-` (`max-length-bytes`, `max-age`, `stream-max-segment-size-bytes`,
/// `initial-cluster-size`, `queue-leader-locator`, `stream-filter-size-bytes`), as RabbitMQ's
/// stream manager maps them; the leader locator is `balanced` unless given, so partitions
/// spread over the cluster.
fn stream_arguments(
    given: Option<&serde_json::Map<String, Value>>,
) -> Result<FieldTable, ApiError> {
    let mut t = FieldTable::default();
    t.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("stream".into()),
    );
    t.insert(
        "x-queue-leader-locator".into(),
        AMQPValue::LongString("balanced".into()),
    );
    for (key, value) in given.into_iter().flatten() {
        let text = match value {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            _ => {
                return Err(ApiError::bad_request(format!(
                    "argument {key}: a string or a number"
                )));
            }
        };
        let integer = |text: &str| {
            text.parse::<i64>()
                .map(AMQPValue::LongLongInt)
                .map_err(|_| ApiError::bad_request(format!("argument {key}: not an integer")))
        };
        let (name, v) = match key.as_str() {
            "max-age" => ("x-max-age", AMQPValue::LongString(text.into())),
            "queue-leader-locator" => {
                ("x-queue-leader-locator", AMQPValue::LongString(text.into()))
            }
            "max-length-bytes" => ("x-max-length-bytes", integer(&text)?),
            "stream-max-segment-size-bytes" => ("x-stream-max-segment-size-bytes", integer(&text)?),
            "initial-cluster-size" => ("x-initial-cluster-size", integer(&text)?),
            "stream-filter-size-bytes" => ("x-stream-filter-size-bytes", integer(&text)?),
            // RabbitMQ ignores names it does not map.
            _ => continue,
        };
        t.insert(name.into(), v);
    }
    Ok(t)
}

/// exchange.delete of `name`.
fn exchange_delete(name: &str) -> Result<AMQPClass, ApiError> {
    Ok(AMQPClass::Exchange(exchange::AMQPMethod::Delete(
        exchange::Delete {
            exchange: short(name)?,
            if_unused: false,
            nowait: false,
        },
    )))
}

/// queue.delete of `name` (whatever it holds).
fn queue_delete(name: &str) -> Result<AMQPClass, ApiError> {
    Ok(AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
        queue: short(name)?,
        if_unused: false,
        if_empty: false,
        nowait: false,
    })))
}

/// What a failed creation has to undo.
enum Created {
    Exchange(String),
    Queue(String),
}

async fn undo(d: &mut Direct, created: Vec<Created>) {
    for c in created.into_iter().rev() {
        let method = match c {
            Created::Exchange(name) => exchange_delete(&name),
            Created::Queue(name) => queue_delete(&name),
        };
        // Best effort, as RabbitMQ's rollback: what stays is visible and deletable.
        if let Ok(method) = method {
            let _ = d.call(method, None).await;
        }
    }
}

/// PUT /api/stream/super-streams/{vhost}/{name}: `{"partitions": N}` or
/// `{"binding-keys": "a,b"}`, with optional `arguments`. 201 when created; 400 if the exchange
/// or a partition already exists, or the body is not valid.
pub(super) async fn put_super_stream(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    let vh = vhost_to_write(&state, &caller, &vhost)?;
    let b: SuperStreamBody = typed_body(&raw)?;
    let keys = routing_keys(&b)?;
    let args = stream_arguments(b.arguments.as_ref())?;
    if name.is_empty() {
        return Err(ApiError::bad_request("a super stream needs a name"));
    }
    if vh.exchange_exists(&name) {
        // RabbitMQ's stream manager: {reference_already_exists, "there is already an
        // exchange named ..."}.
        return Err(ApiError::bad_request(format!(
            "there is already an exchange named {name}"
        )));
    }
    let partitions: Vec<String> = keys.iter().map(|k| format!("{name}-{k}")).collect();
    for p in &partitions {
        short(p)?;
        if vh.queue(p).is_some() {
            return Err(ApiError::bad_request(format!(
                "there is already a queue named {p}"
            )));
        }
    }
    let mut d = direct(&state, &vhost, &caller)?;
    let mut done = Vec::new();
    let result = create(&mut d, &name, &keys, &partitions, &args, &mut done).await;
    if let Err(e) = result {
        undo(&mut d, done).await;
        return Err(e);
    }
    created(true)
}

async fn create(
    d: &mut Direct,
    name: &str,
    keys: &[String],
    partitions: &[String],
    args: &FieldTable,
    done: &mut Vec<Created>,
) -> Result<(), ApiError> {
    let mut xargs = FieldTable::default();
    xargs.insert(SUPER_STREAM_ARG.into(), AMQPValue::Boolean(true));
    d.call(
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: short(name)?,
            kind: short("direct")?,
            passive: false,
            durable: true,
            auto_delete: false,
            internal: false,
            nowait: false,
            arguments: xargs,
        })),
        None,
    )
    .await?;
    done.push(Created::Exchange(name.to_string()));
    for (index, (key, partition)) in keys.iter().zip(partitions).enumerate() {
        d.call(
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: short(partition)?,
                passive: false,
                durable: true,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: args.clone(),
            })),
            None,
        )
        .await?;
        done.push(Created::Queue(partition.clone()));
        let mut bargs = FieldTable::default();
        bargs.insert(
            PARTITION_ORDER_ARG.into(),
            AMQPValue::LongInt(i32::try_from(index).unwrap_or(i32::MAX)),
        );
        d.call(
            AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
                queue: short(partition)?,
                exchange: short(name)?,
                routing_key: short(key)?,
                nowait: false,
                arguments: bargs,
            })),
            None,
        )
        .await?;
    }
    Ok(())
}

/// The partitions of super stream `name` in order: the streams bound from its exchange, by
/// their `x-stream-partition-order` (those without one last), as RabbitMQ's
/// `rabbit_stream_utils:sort_partitions`. None if the exchange does not exist.
fn partitions(
    vh: &warren_broker::routing::vhost::VHost,
    name: &str,
) -> Option<Vec<(String, String, Option<i64>)>> {
    if !vh.exchange_exists(name) {
        return None;
    }
    let mut out: Vec<(String, String, Option<i64>)> = vh
        .bindings()
        .into_iter()
        .filter(|b| b.source == name && b.destination_is_queue)
        .filter(|b| {
            vh.queue(&b.destination)
                .is_some_and(|q| q.stream().is_some())
        })
        .map(|b| {
            let order = b
                .arguments
                .inner()
                .get(PARTITION_ORDER_ARG)
                .and_then(warren_broker::args::int_value)
                .and_then(|v| i64::try_from(v).ok());
            (b.destination, b.routing_key, order)
        })
        .collect();
    out.sort_by_key(|(_, _, order)| order.unwrap_or(i64::MAX));
    Some(out)
}

/// GET /api/stream/super-streams/{vhost}/{name} (Warren): the partitions in order with their
/// routing keys.
pub(super) async fn get_super_stream(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    let parts = partitions(&vh, &name).ok_or_else(ApiError::not_found)?;
    ok_json(json!({
        "name": name,
        "vhost": vhost,
        "partitions": parts.iter().map(|(q, _, _)| q).collect::<Vec<_>>(),
        "routing_keys": parts.iter().map(|(_, k, _)| k).collect::<Vec<_>>(),
    }))
}

/// DELETE /api/stream/super-streams/{vhost}/{name} (Warren; `rabbitmq-streams
/// delete_super_stream` over the API): the exchange, then every partition stream.
pub(super) async fn delete_super_stream(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    let parts = partitions(&vh, &name).ok_or_else(ApiError::not_found)?;
    let mut d = direct(&state, &vhost, &caller)?;
    d.call(exchange_delete(&name)?, None).await?;
    for (q, _, _) in parts {
        d.call(queue_delete(&q)?, None).await?;
    }
    no_content()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> SuperStreamBody {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn keys_follow_rabbitmqs_checks() {
        assert_eq!(
            routing_keys(&body(json!({"partitions": 3}))).unwrap(),
            ["0", "1", "2"]
        );
        assert_eq!(
            routing_keys(&body(json!({"partitions": "2"}))).unwrap(),
            ["0", "1"]
        );
        assert_eq!(
            routing_keys(&body(json!({"binding-keys": "amer, emea,,apac"}))).unwrap(),
            ["amer", "emea", "apac"]
        );
        let reason = |v: Value| routing_keys(&body(v)).unwrap_err().reason;
        assert_eq!(reason(json!({})), "Must specify partitions or binding keys");
        assert_eq!(
            reason(json!({"partitions": 3, "binding-keys": "a"})),
            "Specify partitions or binding keys, not both"
        );
        assert_eq!(
            reason(json!({"partitions": "x"})),
            "The partitions must be a number"
        );
        assert_eq!(
            reason(json!({"partitions": 0})),
            "The partition number must be greater than 0"
        );
        assert!(reason(json!({"partitions": SUPER_STREAM_PARTITIONS_MAX + 1})).contains("exceed"));
        assert_eq!(
            reason(json!({"binding-keys": " , "})),
            "The number of binding keys must be greater than 0"
        );
    }

    #[test]
    fn stream_arguments_map_rabbitmqs_names() {
        let given = json!({"max-length-bytes": 1000, "max-age": "1h", "unknown": 1});
        let t = stream_arguments(given.as_object()).unwrap();
        let t = t.inner();
        assert_eq!(
            t.get("x-queue-type"),
            Some(&AMQPValue::LongString("stream".into()))
        );
        assert_eq!(
            t.get("x-max-length-bytes"),
            Some(&AMQPValue::LongLongInt(1000))
        );
        assert_eq!(
            t.get("x-max-age"),
            Some(&AMQPValue::LongString("1h".into()))
        );
        assert_eq!(
            t.get("x-queue-leader-locator"),
            Some(&AMQPValue::LongString("balanced".into()))
        );
        assert!(!t.contains_key("unknown"));
    }
}
