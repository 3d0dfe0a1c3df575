//! `/api/policies/...` and `/api/operator-policies/...` (rabbit_mgmt_wm_policies,
//! rabbit_mgmt_wm_policy, rabbit_mgmt_wm_operator_policies): one set of handlers for both,
//! chosen by a const parameter.

use std::sync::Arc;

use axum::extract::{Path, State};
use serde::Deserialize;
use serde_json::Value;
use warren_broker::policy::PolicyKind;
use warren_broker::routing::vhost::VHost;

use super::commit::durably;
use super::{ApiResult, created, no_content, ok_json, typed_body, vhost_for, visible_vhosts};
use crate::auth::Caller;
use crate::{ApiError, AppState};

/// The policy set a route serves: `/api/operator-policies` (OPERATOR) or `/api/policies`.
const fn kind<const OPERATOR: bool>() -> PolicyKind {
    if OPERATOR {
        PolicyKind::Operator
    } else {
        PolicyKind::User
    }
}

fn policies_of(vhosts: &[Arc<VHost>], kind: PolicyKind) -> Result<Value, ApiError> {
    let defs: Vec<_> = vhosts.iter().flat_map(|vh| vh.policies(kind)).collect();
    serde_json::to_value(defs).map_err(|e| ApiError::bad_request(e.to_string()))
}

/// Reading policies, operator policies included, needs `policymaker` (or `administrator`),
/// as in RabbitMQ.
fn require_policy_reader(caller: &Caller) -> Result<(), ApiError> {
    if caller.is_admin() || caller.has("policymaker") {
        Ok(())
    } else {
        Err(ApiError::unauthorised("Not policymaker user"))
    }
}

/// Setting policies needs `policymaker` with access to the vhost; operator policies need
/// `administrator` (RabbitMQ 3.10 answers a policymaker's PUT with 401).
fn require_policy_writer(
    state: &AppState,
    caller: &Caller,
    vhost: &str,
    kind: PolicyKind,
) -> Result<(), ApiError> {
    match kind {
        PolicyKind::User => caller.require_policymaker(state, vhost),
        PolicyKind::Operator if caller.is_admin() => Ok(()),
        PolicyKind::Operator => Err(ApiError::unauthorised("Not administrator user")),
    }
}

pub(super) async fn list_all_policies<const OPERATOR: bool>(
    State(state): State<AppState>,
    caller: Caller,
) -> ApiResult {
    require_policy_reader(&caller)?;
    ok_json(policies_of(
        &visible_vhosts(&state, &caller),
        kind::<OPERATOR>(),
    )?)
}

pub(super) async fn list_vhost_policies<const OPERATOR: bool>(
    State(state): State<AppState>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> ApiResult {
    require_policy_reader(&caller)?;
    let vh = vhost_for(&state, &caller, &vhost)?;
    ok_json(policies_of(&[vh], kind::<OPERATOR>())?)
}

pub(super) async fn get_policy<const OPERATOR: bool>(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult {
    require_policy_reader(&caller)?;
    let vh = vhost_for(&state, &caller, &vhost)?;
    let def = vh
        .policies(kind::<OPERATOR>())
        .into_iter()
        .find(|p| p.name == name)
        .ok_or_else(ApiError::not_found)?;
    ok_json(serde_json::to_value(def).map_err(|e| ApiError::bad_request(e.to_string()))?)
}

#[derive(Debug, Deserialize)]
struct PolicyBody {
    pattern: String,
    definition: serde_json::Map<String, Value>,
    #[serde(default)]
    priority: i32,
    #[serde(rename = "apply-to", default = "apply_all")]
    apply_to: String,
}

fn apply_all() -> String {
    "all".into()
}

pub(super) async fn put_policy<const OPERATOR: bool>(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> ApiResult {
    let kind = kind::<OPERATOR>();
    let vh = state
        .broker
        .vhost(&vhost)
        .ok_or_else(ApiError::vhost_not_found)?;
    require_policy_writer(&state, &caller, &vhost, kind)?;
    let b: PolicyBody = typed_body(&raw)?;
    let existed = vh.policies(kind).iter().any(|p| p.name == name);
    let def = warren_broker::policy::PolicyDef {
        vhost: vhost.clone(),
        name,
        pattern: b.pattern,
        apply_to: b.apply_to,
        priority: b.priority,
        definition: b.definition,
    };
    durably(|done| {
        vh.set_policy(kind, def, done)
            .map_err(|e| ApiError::bad_request(e.to_string()))
    })
    .await?;
    created(!existed)
}

pub(super) async fn delete_policy<const OPERATOR: bool>(
    State(state): State<AppState>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult {
    let kind = kind::<OPERATOR>();
    let vh = state.broker.vhost(&vhost).ok_or_else(ApiError::not_found)?;
    require_policy_writer(&state, &caller, &vhost, kind)?;
    durably(|done| {
        if vh.clear_policy(kind, &name, done) {
            Ok(())
        } else {
            Err(ApiError::not_found())
        }
    })
    .await?;
    no_content()
}
