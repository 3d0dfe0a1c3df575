//! `/api/health/checks/...` (rabbit_mgmt_wm_health_check_*) and `/api/aliveness-test/{vhost}`
//! (rabbit_mgmt_wm_aliveness_test): the node's health checks.

use amq_protocol::protocol::{AMQPClass, basic, queue};
use amq_protocol::types::FieldTable;
use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde_json::json;
use warren_amqp::assembler::Content;
use warren_amqp::properties::Properties;

use super::{ApiResult, direct, ok_json, vhost_for};
use crate::auth::Caller;
use crate::{ApiError, AppState};

pub(super) async fn health_alarms(State(state): State<AppState>, _caller: Caller) -> ApiResult {
    let a = state.broker.alarms().state();
    if !a.any() {
        return ok_json(json!({"status": "ok"}));
    }
    let mut alarms = Vec::new();
    if a.memory {
        alarms.push(json!({"node": state.node.node, "resource": "memory"}));
    }
    if a.disk {
        alarms.push(json!({"node": state.node.node, "resource": "disk"}));
    }
    Ok((
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"status": "failed",
                    "reason": "resource alarm(s) in effect in the cluster",
                    "alarms": alarms})),
    )
        .into_response())
}

/// RabbitMQ's `port-listener/{port}`: is something of this node listening on that port?
pub(super) async fn health_port_listener(
    State(state): State<AppState>,
    _caller: Caller,
    Path(port): Path<String>,
) -> ApiResult {
    let port: u16 = port
        .parse()
        .map_err(|_| ApiError::bad_request(format!("Invalid port: {port}")))?;
    let ports: Vec<u16> = state.node.listeners.iter().map(|(_, a)| a.port()).collect();
    if ports.contains(&port) {
        return ok_json(json!({"status": "ok", "port": port}));
    }
    Ok((
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"status": "failed", "reason": "No active listener",
                    "missing": port, "ports": ports})),
    )
        .into_response())
}

/// RabbitMQ's `protocol-listener/{protocol}`: is this node listening for that protocol?
/// RabbitMQ's aliases are accepted (`amqp091`, `amqp0-9-1`, `amqps`, `management`, ...).
pub(super) async fn health_protocol_listener(
    State(state): State<AppState>,
    _caller: Caller,
    Path(protocol): Path<String>,
) -> ApiResult {
    let wanted = match protocol.to_ascii_lowercase().as_str() {
        "amqp" | "amqp091" | "amqp0-9-1" | "amqp0.9.1" | "amqp0_9_1" => "amqp",
        "amqps" | "amqp/ssl" | "amqp091/ssl" | "amqp+tls" => "amqp/ssl",
        "http" | "management" | "http/management" => "http",
        "prometheus" | "http/prometheus" => "http/prometheus",
        _ => "",
    };
    let protocols: Vec<&str> = state
        .node
        .listeners
        .iter()
        .map(|(p, _)| p.as_str())
        .collect();
    if !wanted.is_empty() && protocols.contains(&wanted) {
        return ok_json(json!({"status": "ok", "protocol": wanted}));
    }
    Ok((
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"status": "failed", "reason": "No active listener",
                    "missing": protocol, "protocols": protocols})),
    )
        .into_response())
}

/// RabbitMQ's `ready-to-serve-clients`: the node accepts client connections (its listeners
/// are up, which they are once the API answers, and the connection limit is not reached).
pub(super) async fn health_ready(State(state): State<AppState>, _caller: Caller) -> ApiResult {
    let open = state.broker.connection_count();
    match state.broker.config.connection_max {
        Some(max) if open >= max => Ok((
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "failed",
                        "reason": format!("node connection limit ({max}) is reached")})),
        )
            .into_response()),
        _ => ok_json(json!({"status": "ok"})),
    }
}

pub(super) async fn health_vhosts(_state: State<AppState>, _caller: Caller) -> ApiResult {
    // Every vhost that exists is running: Warren has no per-vhost process that can stop.
    ok_json(json!({"status": "ok"}))
}

/// RabbitMQ's aliveness test: declare `aliveness-test`, publish to it, get the message back.
pub(super) async fn aliveness_test(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    vhost_for(&state, &caller, &vhost)?;
    let mut d = direct(&state, &vhost, &caller)?;
    d.call(
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "aliveness-test".into(),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
        None,
    )
    .await?;
    let properties = Properties::parse(bytes::Bytes::from_static(&[0, 0]), 1)
        .map_err(|_| ApiError::bad_request("properties"))?;
    d.call(
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: "aliveness-test".into(),
            mandatory: false,
            immediate: false,
        })),
        Some(Content {
            properties,
            body: bytes::Bytes::from_static(b"test_message"),
        }),
    )
    .await?;
    let replies = d
        .call(
            AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                queue: "aliveness-test".into(),
                no_ack: true,
            })),
            None,
        )
        .await?;
    let got = replies.iter().any(|r| {
        matches!(r.method, AMQPClass::Basic(basic::AMQPMethod::GetOk(_)))
            && r.content
                .as_ref()
                .is_some_and(|(_, b)| &b[..] == b"test_message")
    });
    if got {
        ok_json(json!({"status": "ok"}))
    } else {
        Ok((
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "failed", "reason": "the test message did not come back"})),
        )
            .into_response())
    }
}
