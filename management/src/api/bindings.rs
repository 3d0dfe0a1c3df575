//! `/api/bindings/...`, `/api/queues/{vhost}/{queue}/bindings` and
//! `/api/exchanges/{vhost}/{exchange}/bindings/{side}` (rabbit_mgmt_wm_bindings,
//! rabbit_mgmt_wm_binding): list, create, show and delete bindings, named by RabbitMQ's
//! `properties_key`.

use std::sync::Arc;

use amq_protocol::protocol::{AMQPClass, exchange, queue};
use amq_protocol::types::FieldTable;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde::Deserialize;
use serde_json::{Value, json};
use warren_broker::routing::vhost::VHost;

use super::common::{arguments, exchange_name};
use super::{
    ApiResult, direct, no_content, ok_json, queue_for, short, typed_body, vhost_for,
    vhost_to_write, visible_vhosts,
};
use crate::auth::Caller;
use crate::json::table_to_json;
use crate::{ApiError, AppState};

fn bindings_of(vhosts: &[Arc<VHost>]) -> Value {
    Value::Array(
        vhosts
            .iter()
            .flat_map(|vh| {
                vh.bindings()
                    .iter()
                    .map(|b| binding_json(&vh.name, b))
                    .collect::<Vec<_>>()
            })
            .collect(),
    )
}

/// RabbitMQ's `properties_key`, the binding's id in URLs: "~" for an empty key without
/// arguments, else the key percent-encoded (unreserved characters kept), followed by "~" and a
/// hash of the arguments when there are any (bindings that differ only in arguments get
/// different keys, as in RabbitMQ; the hash is Warren's own, clients only pass it back).
fn properties_key(routing_key: &str, arguments: &FieldTable) -> String {
    match args_hash(arguments) {
        None if routing_key.is_empty() => "~".into(),
        None => percent(routing_key),
        Some(h) => format!("{}~{h}", percent(routing_key)),
    }
}

/// `properties_key` as axum hands it to a handler (percent-decoded).
fn properties_key_decoded(routing_key: &str, arguments: &FieldTable) -> String {
    match args_hash(arguments) {
        None if routing_key.is_empty() => "~".into(),
        None => routing_key.to_string(),
        Some(h) => format!("{routing_key}~{h}"),
    }
}

/// 32-bit FNV-1a of the arguments' JSON (keys sorted), base64url without padding: stable
/// across restarts and nodes, and URL-safe. None without arguments.
fn args_hash(arguments: &FieldTable) -> Option<String> {
    use base64::Engine;
    if arguments.inner().is_empty() {
        return None;
    }
    let text = table_to_json(arguments).to_string();
    let mut h: u32 = 0x811c_9dc5;
    for b in text.bytes() {
        h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
    }
    Some(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(h.to_be_bytes()))
}

#[derive(Debug, Deserialize)]
struct BindingBody {
    #[serde(default)]
    routing_key: String,
    #[serde(default)]
    arguments: Option<Value>,
}

/// POST /api/bindings/{vhost}/e/{source}/q/{queue} (and .../e/{destination}): bind, 201.
pub(super) async fn post_binding(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, source, kind, destination)): Path<(String, String, String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    vhost_to_write(&state, &caller, &vhost)?;
    let b: BindingBody = typed_body(&raw)?;
    let args = arguments(b.arguments.as_ref())?;
    let args_table = args.clone();
    let source = exchange_name(&source).to_string();
    let method = match kind.as_str() {
        "q" => AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
            queue: short(&destination)?,
            exchange: short(&source)?,
            routing_key: short(&b.routing_key)?,
            nowait: false,
            arguments: args,
        })),
        "e" => AMQPClass::Exchange(exchange::AMQPMethod::Bind(exchange::Bind {
            destination: short(&destination)?,
            source: short(&source)?,
            routing_key: short(&b.routing_key)?,
            nowait: false,
            arguments: args,
        })),
        _ => return Err(ApiError::not_found()),
    };
    let mut d = direct(&state, &vhost, &caller)?;
    d.call(method, None).await?;
    // Relative to the request's URL, as RabbitMQ writes it: `<destination>/<properties_key>`.
    let location = format!(
        "{}/{}",
        percent(&destination),
        properties_key(&b.routing_key, &args_table)
    );
    Ok((
        StatusCode::CREATED,
        [(axum::http::header::LOCATION, location)],
    )
        .into_response())
}

/// Percent-encode a path segment.
fn percent(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

pub(super) async fn list_all_bindings(State(state): State<AppState>, caller: Caller) -> ApiResult {
    ok_json(bindings_of(&visible_vhosts(&state, &caller)))
}

pub(super) async fn list_vhost_bindings(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    ok_json(bindings_of(&[vh]))
}

// ---------------------------------------------------------------- one binding

/// The bindings from `source` to `destination` (`kind` "q" or "e") in `vh`.
fn pair_bindings(
    vh: &VHost,
    source: &str,
    kind: &str,
    destination: &str,
) -> Result<Vec<warren_broker::routing::vhost::BindingInfo>, ApiError> {
    let to_queue = match kind {
        "q" => true,
        "e" => false,
        _ => return Err(ApiError::not_found()),
    };
    let source = exchange_name(source);
    Ok(vh
        .bindings()
        .into_iter()
        .filter(|b| {
            b.source == source && b.destination == destination && b.destination_is_queue == to_queue
        })
        .collect())
}

fn binding_json(vhost: &str, b: &warren_broker::routing::vhost::BindingInfo) -> Value {
    json!({
        "source": b.source,
        "vhost": vhost,
        "destination": b.destination,
        "destination_type": if b.destination_is_queue { "queue" } else { "exchange" },
        "routing_key": b.routing_key,
        "arguments": table_to_json(&b.arguments),
        "properties_key": properties_key(&b.routing_key, &b.arguments),
    })
}

pub(super) async fn list_pair_bindings(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, source, kind, destination)): Path<(String, String, String, String)>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    let list = pair_bindings(&vh, &source, &kind, &destination)?;
    ok_json(Value::Array(
        list.iter().map(|b| binding_json(&vhost, b)).collect(),
    ))
}

/// The binding whose `properties_key` is `props` (axum gives the segment percent-decoded,
/// so it is compared with the decoded routing key too).
fn find_binding(
    vh: &VHost,
    source: &str,
    kind: &str,
    destination: &str,
    props: &str,
) -> Result<warren_broker::routing::vhost::BindingInfo, ApiError> {
    pair_bindings(vh, source, kind, destination)?
        .into_iter()
        .find(|b| {
            properties_key(&b.routing_key, &b.arguments) == props
                || properties_key_decoded(&b.routing_key, &b.arguments) == props
        })
        .ok_or_else(ApiError::not_found)
}

pub(super) async fn get_binding(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, source, kind, destination, props)): Path<(String, String, String, String, String)>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    let b = find_binding(&vh, &source, &kind, &destination, &props)?;
    ok_json(binding_json(&vhost, &b))
}

pub(super) async fn delete_binding(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, source, kind, destination, props)): Path<(String, String, String, String, String)>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    let b = find_binding(&vh, &source, &kind, &destination, &props)?;
    let method = if b.destination_is_queue {
        AMQPClass::Queue(queue::AMQPMethod::Unbind(queue::Unbind {
            queue: short(&b.destination)?,
            exchange: short(&b.source)?,
            routing_key: short(&b.routing_key)?,
            arguments: b.arguments.clone(),
        }))
    } else {
        AMQPClass::Exchange(exchange::AMQPMethod::Unbind(exchange::Unbind {
            destination: short(&b.destination)?,
            source: short(&b.source)?,
            routing_key: short(&b.routing_key)?,
            nowait: false,
            arguments: b.arguments.clone(),
        }))
    };
    let mut d = direct(&state, &vhost, &caller)?;
    d.call(method, None).await?;
    no_content()
}

/// GET /api/queues/{vhost}/{queue}/bindings: every binding to the queue (the default
/// exchange's first).
pub(super) async fn queue_bindings(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult {
    let (vh, _) = queue_for(&state, &caller, &vhost, &name)?;
    ok_json(Value::Array(
        vh.bindings()
            .iter()
            .filter(|b| b.destination_is_queue && b.destination == name)
            .map(|b| binding_json(&vhost, b))
            .collect(),
    ))
}

/// GET /api/exchanges/{vhost}/{exchange}/bindings/source|destination.
pub(super) async fn exchange_bindings(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name, side)): Path<(String, String, String)>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    let name = exchange_name(&name).to_string();
    if !name.is_empty() && !vh.exchange_exists(&name) {
        return Err(ApiError::not_found());
    }
    let keep = |b: &warren_broker::routing::vhost::BindingInfo| match side.as_str() {
        "source" => b.source == name,
        "destination" => !b.destination_is_queue && b.destination == name,
        _ => false,
    };
    if !matches!(side.as_str(), "source" | "destination") {
        return Err(ApiError::not_found());
    }
    ok_json(Value::Array(
        vh.bindings()
            .iter()
            .filter(|b| keep(b))
            .map(|b| binding_json(&vhost, b))
            .collect(),
    ))
}
