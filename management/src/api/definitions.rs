//! `/api/definitions` and `/api/definitions/{vhost}` (rabbit_mgmt_wm_definitions): export
//! and import of users, vhosts, permissions, policies, limits and topology in RabbitMQ's
//! definitions format.

use amq_protocol::protocol::{AMQPClass, exchange, queue};
use axum::extract::{Path, State};
use serde_json::{Value, json};
use warren_broker::policy::PolicyKind;
use warren_broker::routing::vhost::VHost;
use warren_broker::users::PermissionRecord;

use super::commit::Commits;
use super::common::arguments;
use super::permissions::{permission_json, topic_json};
use super::users::tags_of;
use super::vhosts::grant_creator;
use super::{
    ApiResult, RABBITMQ_API_VERSION, body, no_content, ok_json, short, user_error, vhost_for,
};
use crate::auth::Caller;
use crate::direct::Direct;
use crate::json::table_to_json;
use crate::{ApiError, AppState};

/// The objects of one vhost in RabbitMQ's definitions format; `with_vhost` adds the `vhost`
/// field (the node-wide export has it, the per-vhost export does not).
/// One vhost's part of a definitions export.
#[derive(Debug, Default)]
struct VhostDefs {
    queues: Vec<Value>,
    exchanges: Vec<Value>,
    bindings: Vec<Value>,
    policies: Vec<Value>,
    parameters: Vec<Value>,
}

fn vhost_definitions(vh: &VHost, with_vhost: bool) -> VhostDefs {
    let tag = |mut v: Value| {
        if with_vhost && let Value::Object(m) = &mut v {
            m.insert("vhost".into(), json!(vh.name));
        }
        v
    };
    let queues = vh
        .queues()
        .iter()
        .filter(|q| q.exclusive_owner.is_none())
        .map(|q| {
            tag(
                json!({"name": q.name, "durable": q.durable, "auto_delete": q.auto_delete,
                       "arguments": table_to_json(&q.arguments)}),
            )
        })
        .collect();
    let exchanges = vh
        .exchanges()
        .iter()
        .filter(|x| !x.name.is_empty() && !x.name.starts_with("amq."))
        .map(|x| {
            tag(json!({"name": x.name, "type": x.kind, "durable": x.durable,
                       "auto_delete": x.auto_delete, "internal": x.internal,
                       "arguments": table_to_json(&x.arguments)}))
        })
        .collect();
    let exclusive: std::collections::HashSet<String> = vh
        .queues()
        .iter()
        .filter(|q| q.exclusive_owner.is_some())
        .map(|q| q.name.clone())
        .collect();
    let bindings = vh
        .bindings()
        .iter()
        .filter(|b| !b.source.is_empty())
        .filter(|b| !(b.destination_is_queue && exclusive.contains(&b.destination)))
        .map(|b| {
            tag(json!({"source": b.source, "destination": b.destination,
                       "destination_type": if b.destination_is_queue { "queue" } else { "exchange" },
                       "routing_key": b.routing_key, "arguments": table_to_json(&b.arguments)}))
        })
        .collect();
    let policies = vh
        .policies(PolicyKind::User)
        .into_iter()
        .filter_map(|p| serde_json::to_value(p).ok())
        .map(|mut v| {
            if !with_vhost && let Value::Object(m) = &mut v {
                m.remove("vhost");
            }
            v
        })
        .collect();
    let parameters = serde_json::to_value(&*vh.limits.read())
        .ok()
        .filter(|v| v.as_object().is_some_and(|m| !m.is_empty()))
        .map(|value| tag(json!({"value": value, "component": "vhost-limits", "name": "limits"})))
        .into_iter()
        .collect();
    VhostDefs {
        queues,
        exchanges,
        bindings,
        policies,
        parameters,
    }
}

fn insert_defs(m: &mut serde_json::Map<String, Value>, d: VhostDefs) {
    m.insert("parameters".into(), Value::Array(d.parameters));
    m.insert("policies".into(), Value::Array(d.policies));
    m.insert("queues".into(), Value::Array(d.queues));
    m.insert("exchanges".into(), Value::Array(d.exchanges));
    m.insert("bindings".into(), Value::Array(d.bindings));
}

fn versions(state: &AppState) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert("rabbit_version".into(), json!(RABBITMQ_API_VERSION));
    m.insert("rabbitmq_version".into(), json!(RABBITMQ_API_VERSION));
    m.insert("product_name".into(), json!(state.node.identity.product));
    m.insert("product_version".into(), json!(state.node.identity.version));
    m
}

/// GET /api/definitions: everything needed to rebuild the node's topology and access rules,
/// in RabbitMQ's format (users with their password hashes).
pub(super) async fn export_definitions(State(state): State<AppState>, caller: Caller) -> ApiResult {
    caller.require_admin()?;
    let b = &state.broker;
    let mut all = VhostDefs::default();
    let mut vhosts = Vec::new();
    for name in b.list_vhosts() {
        let Some(vh) = b.vhost(&name) else { continue };
        let mut metadata = json!({"description": "", "tags": []});
        if let Some(t) = vh.default_queue_type.read().clone() {
            metadata["default_queue_type"] = json!(t);
        }
        vhosts.push(json!({"name": vh.name, "limits": [], "metadata": metadata}));
        let d = vhost_definitions(&vh, true);
        all.queues.extend(d.queues);
        all.exchanges.extend(d.exchanges);
        all.bindings.extend(d.bindings);
        all.policies.extend(d.policies);
        all.parameters.extend(d.parameters);
    }
    let users: Vec<Value> = b
        .list_users()
        .iter()
        .map(|u| {
            json!({"name": u.name, "password_hash": u.password_hash,
                   "hashing_algorithm": u.hashing_algorithm, "tags": u.tags,
                   "limits": serde_json::to_value(&u.limits).unwrap_or_else(|_| json!({}))})
        })
        .collect();
    let mut m = versions(&state);
    m.insert("users".into(), Value::Array(users));
    m.insert("vhosts".into(), Value::Array(vhosts));
    m.insert(
        "permissions".into(),
        Value::Array(
            b.list_permissions(None, None)
                .iter()
                .map(permission_json)
                .collect(),
        ),
    );
    m.insert(
        "topic_permissions".into(),
        Value::Array(
            b.list_topic_permissions(None, None)
                .iter()
                .map(topic_json)
                .collect(),
        ),
    );
    m.insert(
        "global_parameters".into(),
        json!([{"name": "cluster_name", "value": state.node.cluster_name}]),
    );
    insert_defs(&mut m, all);
    ok_json(Value::Object(m))
}

/// GET /api/definitions/{vhost}: one vhost's topology and policies (no `vhost` fields).
pub(super) async fn export_vhost_definitions(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    caller.require_admin()?;
    let vh = vhost_for(&state, &caller, &vhost)?;
    let mut m = versions(&state);
    insert_defs(&mut m, vhost_definitions(&vh, false));
    ok_json(Value::Object(m))
}

// ---------------------------------------------------------------- definitions import

fn str_field<'a>(v: &'a Value, k: &str) -> Result<&'a str, ApiError> {
    v.get(k)
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request(format!("definitions: missing {k} in {v}")))
}

fn list<'a>(d: &'a Value, k: &str) -> &'a [Value] {
    d.get(k)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// Declare the queues, exchanges and bindings of `defs` in `vhost` (each item's own `vhost`
/// field, when present, must name it) through an internal session, in RabbitMQ's order.
async fn import_topology(
    state: &AppState,
    vhost: &str,
    defs: &Value,
    node_wide: bool,
) -> Result<(), ApiError> {
    let mine = |v: &&Value| !node_wide || v.get("vhost").and_then(Value::as_str) == Some(vhost);
    let mut d = Direct::internal(&state.broker, vhost)?;
    for q in list(defs, "queues").iter().filter(mine) {
        d.call(
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: short(str_field(q, "name")?)?,
                passive: false,
                durable: q.get("durable").and_then(Value::as_bool).unwrap_or(true),
                exclusive: false,
                auto_delete: q
                    .get("auto_delete")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
                nowait: false,
                arguments: arguments(q.get("arguments"))?,
            })),
            None,
        )
        .await?;
    }
    for x in list(defs, "exchanges").iter().filter(mine) {
        d.call(
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
                exchange: short(str_field(x, "name")?)?,
                kind: short(str_field(x, "type")?)?,
                passive: false,
                durable: x.get("durable").and_then(Value::as_bool).unwrap_or(true),
                auto_delete: x
                    .get("auto_delete")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
                internal: x.get("internal").and_then(Value::as_bool).unwrap_or(false),
                nowait: false,
                arguments: arguments(x.get("arguments"))?,
            })),
            None,
        )
        .await?;
    }
    for b in list(defs, "bindings").iter().filter(mine) {
        let source = str_field(b, "source")?;
        let destination = str_field(b, "destination")?;
        let routing_key = b.get("routing_key").and_then(Value::as_str).unwrap_or("");
        let args = arguments(b.get("arguments"))?;
        let method = if str_field(b, "destination_type")? == "exchange" {
            AMQPClass::Exchange(exchange::AMQPMethod::Bind(exchange::Bind {
                destination: short(destination)?,
                source: short(source)?,
                routing_key: short(routing_key)?,
                nowait: false,
                arguments: args,
            }))
        } else {
            AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
                queue: short(destination)?,
                exchange: short(source)?,
                routing_key: short(routing_key)?,
                nowait: false,
                arguments: args,
            }))
        };
        d.call(method, None).await?;
    }
    Ok(())
}

/// Policies and vhost limits of `defs` for `vhost`.
fn import_policies_and_limits(
    state: &AppState,
    vhost: &str,
    defs: &Value,
    node_wide: bool,
    commits: &mut Commits,
) -> Result<(), ApiError> {
    let mine = |v: &&Value| !node_wide || v.get("vhost").and_then(Value::as_str) == Some(vhost);
    let vh = state.broker.vhost(vhost).ok_or_else(ApiError::not_found)?;
    for p in list(defs, "policies").iter().filter(mine) {
        let mut p = p.clone();
        let Value::Object(m) = &mut p else {
            return Err(ApiError::bad_request(
                "definitions: a policy must be an object",
            ));
        };
        m.insert("vhost".into(), json!(vhost));
        let def: warren_broker::policy::PolicyDef = serde_json::from_value(p)
            .map_err(|e| ApiError::bad_request(format!("definitions: policy: {e}")))?;
        vh.set_policy(PolicyKind::User, def, &mut commits.next())
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
    }
    for p in list(defs, "parameters").iter().filter(mine) {
        if p.get("component").and_then(Value::as_str) == Some("vhost-limits") {
            let limits: warren_broker::users::VhostLimits =
                serde_json::from_value(p.get("value").cloned().unwrap_or(Value::Null))
                    .map_err(|e| ApiError::bad_request(format!("definitions: limits: {e}")))?;
            state
                .broker
                .set_vhost_limits(vhost, limits, &mut commits.next())
                .map_err(|e| user_error(&e))?;
        }
    }
    Ok(())
}

/// POST /api/definitions: import a RabbitMQ (or Warren) export. Users keep their password
/// hashes; objects that exist are declared again (equivalent ones are left as they are).
pub(super) async fn import_definitions(
    State(state): State<AppState>,
    caller: Caller,
    raw: axum::body::Bytes,
) -> ApiResult {
    caller.require_admin()?;
    let defs = body(&raw)?;
    let b = &state.broker;
    let mut commits = Commits::default();
    for u in list(&defs, "users") {
        let name = str_field(u, "name")?;
        if name.is_empty() {
            return Err(ApiError::bad_request("definitions: a user without a name"));
        }
        // RabbitMQ's import takes a plain `password` too (hashed here, never stored).
        let password_hash = match (
            u.get("password_hash").and_then(Value::as_str),
            u.get("password").and_then(Value::as_str),
        ) {
            (Some(h), _) => h.to_string(),
            (None, Some(p)) => warren_broker::users::hash_password(p),
            (None, None) => String::new(),
        };
        let record = warren_broker::users::UserRecord {
            name: name.to_string(),
            password_hash,
            hashing_algorithm: u
                .get("hashing_algorithm")
                .and_then(Value::as_str)
                .unwrap_or(warren_broker::users::SHA256)
                .to_string(),
            tags: tags_of(u),
            limits: u
                .get("limits")
                .cloned()
                .and_then(|l| serde_json::from_value(l).ok())
                .unwrap_or_default(),
        };
        b.import_user(record, &mut commits.next())
            .map_err(|e| user_error(&e))?;
    }
    let mut vhosts: Vec<String> = Vec::new();
    for v in list(&defs, "vhosts") {
        let name = str_field(v, "name")?.to_string();
        if name.is_empty() {
            return Err(ApiError::bad_request("definitions: a vhost without a name"));
        }
        let dqt = v
            .get("default_queue_type")
            .or_else(|| v.get("metadata").and_then(|m| m.get("default_queue_type")))
            .and_then(Value::as_str)
            .filter(|t| *t != "undefined");
        let new = b
            .add_vhost(&name, dqt, &mut commits.next())
            .map_err(|e| user_error(&e))?;
        // As rabbit_definitions (the importer is the acting user): the file's own
        // permissions, applied next, win over this grant.
        if new {
            grant_creator(&state, &caller, &name, &mut commits.next())?;
        }
        vhosts.push(name);
    }
    for p in list(&defs, "permissions") {
        let record = PermissionRecord {
            user: str_field(p, "user")?.into(),
            vhost: str_field(p, "vhost")?.into(),
            configure: str_field(p, "configure")?.into(),
            write: str_field(p, "write")?.into(),
            read: str_field(p, "read")?.into(),
        };
        b.set_permissions(record, &mut commits.next())
            .map_err(|e| user_error(&e))?;
    }
    for p in list(&defs, "topic_permissions") {
        let record = warren_broker::users::TopicPermissionRecord {
            user: str_field(p, "user")?.into(),
            vhost: str_field(p, "vhost")?.into(),
            exchange: str_field(p, "exchange")?.into(),
            write: str_field(p, "write")?.into(),
            read: str_field(p, "read")?.into(),
        };
        b.set_topic_permissions(record, &mut commits.next())
            .map_err(|e| user_error(&e))?;
    }
    // Every vhost an object names, whether or not the file lists it.
    for key in ["policies", "parameters", "queues", "exchanges", "bindings"] {
        for item in list(&defs, key) {
            if let Some(v) = item.get("vhost").and_then(Value::as_str)
                && !vhosts.iter().any(|x| x == v)
            {
                vhosts.push(v.to_string());
            }
        }
    }
    for v in &vhosts {
        import_policies_and_limits(&state, v, &defs, true, &mut commits)?;
    }
    commits.wait().await?;
    for v in &vhosts {
        import_topology(&state, v, &defs, true).await?;
    }
    no_content()
}

/// POST /api/definitions/{vhost}: import one vhost's export (items without `vhost` fields).
pub(super) async fn import_vhost_definitions(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
    raw: axum::body::Bytes,
) -> ApiResult {
    caller.require_admin()?;
    vhost_for(&state, &caller, &vhost)?;
    let defs = body(&raw)?;
    let mut commits = Commits::default();
    import_policies_and_limits(&state, &vhost, &defs, false, &mut commits)?;
    commits.wait().await?;
    import_topology(&state, &vhost, &defs, false).await?;
    no_content()
}
