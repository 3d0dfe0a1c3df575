//! `/api/exchanges/...` (rabbit_mgmt_wm_exchanges, rabbit_mgmt_wm_exchange,
//! rabbit_mgmt_wm_exchange_publish): list, show, declare and delete exchanges, and publish.

use std::sync::Arc;

use amq_protocol::protocol::{AMQPClass, basic, confirm, exchange};
use axum::extract::{Path, State};
use serde::Deserialize;
use serde_json::{Value, json};
use warren_amqp::assembler::Content;
use warren_amqp::properties::Properties;
use warren_broker::routing::vhost::VHost;

use super::common::{DeleteConditions, arguments, direct_type, exchange_name};
use super::{
    ApiResult, created, direct, no_content, ok_json, short, typed_body, vhost_for, vhost_to_write,
    visible_vhosts,
};
use crate::auth::Caller;
use crate::json::table_to_json;
use crate::{ApiError, AppState};

fn exchange_json(vhost: &str, x: &warren_broker::routing::vhost::ExchangeInfo) -> Value {
    json!({
        "incoming": [],
        "outgoing": [],
        "name": x.name,
        "vhost": vhost,
        "type": x.kind,
        "durable": x.durable,
        "auto_delete": x.auto_delete,
        "internal": x.internal,
        "arguments": table_to_json(&x.arguments),
        "user_who_performed_action": "",
    })
}

fn exchanges_of(vhosts: &[Arc<VHost>]) -> Value {
    Value::Array(
        vhosts
            .iter()
            .flat_map(|vh| {
                vh.exchanges()
                    .iter()
                    .map(|x| exchange_json(&vh.name, x))
                    .collect::<Vec<_>>()
            })
            .collect(),
    )
}

pub(super) async fn list_all_exchanges(State(state): State<AppState>, caller: Caller) -> ApiResult {
    ok_json(exchanges_of(&visible_vhosts(&state, &caller)))
}

pub(super) async fn list_vhost_exchanges(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    ok_json(exchanges_of(&[vh]))
}

pub(super) async fn get_exchange(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    let name = exchange_name(&name);
    let x = vh
        .exchanges()
        .into_iter()
        .find(|x| x.name == name)
        .ok_or_else(ApiError::not_found)?;
    ok_json(exchange_json(&vhost, &x))
}

#[derive(Debug, Deserialize)]
struct ExchangeBody {
    #[serde(rename = "type", default = "direct_type")]
    kind: String,
    #[serde(default)]
    durable: bool,
    #[serde(default)]
    auto_delete: bool,
    #[serde(default)]
    internal: bool,
    #[serde(default)]
    arguments: Option<Value>,
}

pub(super) async fn put_exchange(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    let vh = vhost_to_write(&state, &caller, &vhost)?;
    let b: ExchangeBody = typed_body(&raw)?;
    let existed = vh.exchange_exists(&name);
    let mut d = direct(&state, &vhost, &caller)?;
    d.call(
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: short(&name)?,
            kind: short(&b.kind)?,
            passive: false,
            durable: b.durable,
            auto_delete: b.auto_delete,
            internal: b.internal,
            nowait: false,
            arguments: arguments(b.arguments.as_ref())?,
        })),
        None,
    )
    .await?;
    created(!existed)
}

pub(super) async fn delete_exchange(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    axum::extract::Query(cond): axum::extract::Query<DeleteConditions>,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    if !vh.exchange_exists(&name) {
        return Err(ApiError::not_found());
    }
    let mut d = direct(&state, &vhost, &caller)?;
    d.call(
        AMQPClass::Exchange(exchange::AMQPMethod::Delete(exchange::Delete {
            exchange: short(&name)?,
            if_unused: cond.if_unused()?,
            nowait: false,
        })),
        None,
    )
    .await?;
    no_content()
}

// ---------------------------------------------------------------- publish

#[derive(Debug, Deserialize)]
struct PublishBody {
    #[serde(default)]
    properties: Option<Value>,
    routing_key: String,
    payload: String,
    #[serde(default = "string")]
    payload_encoding: String,
}

fn string() -> String {
    "string".into()
}

/// POST /api/exchanges/{vhost}/{exchange}/publish: `{"routed": bool}`.
pub(super) async fn publish(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    let vh = vhost_for(&state, &caller, &vhost)?;
    let exchange = exchange_name(&name).to_string();
    if !exchange.is_empty() && !vh.exchange_exists(&exchange) {
        return Err(ApiError::not_found());
    }
    let b: PublishBody = typed_body(&raw)?;
    let payload = match b.payload_encoding.as_str() {
        "string" => bytes::Bytes::from(b.payload.into_bytes()),
        "base64" => bytes::Bytes::from(
            base64::Engine::decode(&base64::engine::general_purpose::STANDARD, &b.payload)
                .map_err(|_| ApiError::bad_request("payload is not base64"))?,
        ),
        other => {
            return Err(ApiError::bad_request(format!(
                "invalid payload_encoding {other}"
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
    let raw_props =
        crate::properties::from_json(b.properties.as_ref()).map_err(ApiError::bad_request)?;
    let properties = Properties::parse(
        bytes::Bytes::from(raw_props),
        warren_amqp::limits::TABLE_DEPTH_MAX,
    )
    .map_err(|_| ApiError::bad_request("invalid properties"))?;
    let mut d = direct(&state, &vhost, &caller)?;
    // Confirm mode, as RabbitMQ's publish endpoint: the reply waits until the message is
    // stored (persistent, durable queue) or refused.
    d.call(
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
        None,
    )
    .await?;
    let mut replies = d
        .call(
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: short(&exchange)?,
                routing_key: short(&b.routing_key)?,
                mandatory: true,
                immediate: false,
            })),
            Some(Content {
                properties,
                body: payload,
            }),
        )
        .await?;
    let settled = |rs: &[crate::direct::Reply]| {
        rs.iter().any(|r| {
            matches!(
                r.method,
                AMQPClass::Basic(basic::AMQPMethod::Ack(_) | basic::AMQPMethod::Nack(_))
            )
        })
    };
    while !settled(&replies) {
        replies.extend(d.later_replies().await?);
    }
    let returned = replies
        .iter()
        .any(|r| matches!(r.method, AMQPClass::Basic(basic::AMQPMethod::Return(_))));
    let nacked = replies
        .iter()
        .any(|r| matches!(r.method, AMQPClass::Basic(basic::AMQPMethod::Nack(_))));
    if nacked {
        // RabbitMQ's text for a publish a queue refused (reject-publish at its limit).
        return Err(ApiError::bad_request(
            "rejected Unable to publish message. Check queue limits.",
        ));
    }
    ok_json(json!({"routed": !returned}))
}
