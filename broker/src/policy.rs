//! Policies (RabbitMQ's `rabbitmqctl set_policy`): settings applied to queues and exchanges
//! whose names match a pattern, without redeclaring them.
//!
//! One policy applies to an object: the highest `priority` among those whose `pattern`
//! (a regular expression, as in RabbitMQ) matches its name and whose `apply-to` covers it; ties
//! go to the policy whose name sorts last. When a policy and a declare argument set the same
//! thing, RabbitMQ's precedence holds: the smaller value for `max-length`, `max-length-bytes`,
//! `message-ttl`, `expires` and `delivery-limit`; the argument for `overflow`,
//! `dead-letter-exchange`, `dead-letter-routing-key` and `alternate-exchange`.

use amq_protocol::types::FieldTable;
use regex::Regex;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::deadletter::DeadLetterTarget;
use crate::queue::machine::{Overflow, QueueConfig};

/// A policy as set by an operator (and as stored: JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyDef {
    /// Vhost.
    pub vhost: String,
    /// Name.
    pub name: String,
    /// Regular expression matched against object names.
    pub pattern: String,
    /// `all`, `queues`, `classic_queues`, `quorum_queues` or `exchanges`.
    #[serde(rename = "apply-to", default = "default_apply_to")]
    pub apply_to: String,
    /// Higher wins.
    #[serde(default)]
    pub priority: i32,
    /// Settings (RabbitMQ's keys).
    pub definition: Map<String, Value>,
}

fn default_apply_to() -> String {
    "all".into()
}

/// Keys a policy definition may set (and the work-queue keys of
/// [`crate::args::work::WORK_POLICY_KEYS`]).
const KNOWN_KEYS: &[&str] = &[
    "message-ttl",
    "expires",
    "max-length",
    "max-length-bytes",
    "overflow",
    "dead-letter-exchange",
    "dead-letter-routing-key",
    "delivery-limit",
    "alternate-exchange",
    "max-age",
    "stream-max-segment-size-bytes",
    "stream-filter-size-bytes",
];

/// Keys an operator policy may set: limits, which combine with the queue's own (the lower
/// value wins), as RabbitMQ's operator policies.
const OPERATOR_KEYS: &[&str] = &[
    "message-ttl",
    "expires",
    "max-length",
    "max-length-bytes",
    "delivery-limit",
];

/// Which of a vhost's two policy sets: users' policies, or operator policies that cap them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// `set_policy`: at most one applies to an object, the highest priority.
    User,
    /// `set_operator_policy`: limits that override users' policies and queue arguments when
    /// lower.
    Operator,
}

impl PolicyKind {
    /// The store table its policies are kept in.
    #[must_use]
    pub fn table(self) -> warren_store::MetaTable {
        match self {
            Self::User => warren_store::MetaTable::Policies,
            Self::Operator => warren_store::MetaTable::OperatorPolicies,
        }
    }
}

/// A validated policy.
#[derive(Debug, Clone)]
pub struct Policy {
    /// As set.
    pub def: PolicyDef,
    pattern: Regex,
}

/// Why a policy was refused (the text is shown to the operator).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PolicyError(pub String);

fn int(def: &Map<String, Value>, key: &str) -> Option<u64> {
    def.get(key).and_then(Value::as_u64)
}

fn text(def: &Map<String, Value>, key: &str) -> Option<String> {
    def.get(key).and_then(Value::as_str).map(str::to_string)
}

impl Policy {
    /// Validate a definition as `rabbitmqctl set_policy` does.
    ///
    /// # Errors
    /// A bad pattern, apply-to value, unknown key or value of the wrong type.
    pub fn new(def: PolicyDef) -> Result<Self, PolicyError> {
        Self::new_of(PolicyKind::User, def)
    }

    /// Validate a definition of `kind` (operator policies accept only [`OPERATOR_KEYS`]).
    ///
    /// # Errors
    /// As [`Policy::new`].
    pub fn new_of(kind: PolicyKind, def: PolicyDef) -> Result<Self, PolicyError> {
        let known = |k: &str| match kind {
            PolicyKind::User => {
                KNOWN_KEYS.contains(&k) || crate::args::work::WORK_POLICY_KEYS.contains(&k)
            }
            PolicyKind::Operator => OPERATOR_KEYS.contains(&k),
        };
        let pattern = Regex::new(&def.pattern)
            .map_err(|e| PolicyError(format!("invalid pattern '{}': {e}", def.pattern)))?;
        if ![
            "all",
            "queues",
            "classic_queues",
            "quorum_queues",
            "streams",
            "exchanges",
        ]
        .contains(&def.apply_to.as_str())
        {
            return Err(PolicyError(format!(
                "'{}' is not a valid apply-to value",
                def.apply_to
            )));
        }
        let unknown: Vec<&String> = def
            .definition
            .keys()
            .filter(|k| !known(k.as_str()))
            .collect();
        if !unknown.is_empty() {
            return Err(PolicyError(format!(
                "Validation failed\n\n{unknown:?} are not recognised policy settings"
            )));
        }
        if def.definition.is_empty() {
            return Err(PolicyError(
                "Validation failed\n\nno policy provided".into(),
            ));
        }
        for key in [
            "message-ttl",
            "max-length",
            "max-length-bytes",
            "stream-max-segment-size-bytes",
            "stream-filter-size-bytes",
        ] {
            if def.definition.contains_key(key) && int(&def.definition, key).is_none() {
                return Err(PolicyError(format!("{key} must be a non-negative integer")));
            }
        }
        // Any integer, as rabbit_policies takes it: a negative one turns the limit off.
        if def
            .definition
            .get("delivery-limit")
            .is_some_and(|v| v.as_i64().is_none())
        {
            return Err(PolicyError("delivery-limit must be an integer".into()));
        }
        if def.definition.contains_key("expires")
            && int(&def.definition, "expires").is_none_or(|v| v == 0)
        {
            return Err(PolicyError("expires must be a positive integer".into()));
        }
        for key in [
            "overflow",
            "dead-letter-exchange",
            "dead-letter-routing-key",
            "alternate-exchange",
        ] {
            if def.definition.contains_key(key) && text(&def.definition, key).is_none() {
                return Err(PolicyError(format!("{key} must be a string")));
            }
        }
        if def.definition.contains_key("max-age")
            && text(&def.definition, "max-age")
                .is_none_or(|a| crate::stream::spec::parse_interval(&a).is_err())
        {
            return Err(PolicyError(
                "max-age must be an interval such as 7D, 12h or 30m".into(),
            ));
        }
        crate::args::work::check_policy(&def.definition).map_err(PolicyError)?;
        if let Some(o) = text(&def.definition, "overflow")
            && !["drop-head", "reject-publish", "reject-publish-dlx"].contains(&o.as_str())
        {
            return Err(PolicyError(format!("overflow value '{o}' is not valid")));
        }
        Ok(Self { def, pattern })
    }

    fn applies(&self, name: &str, kind: Applies) -> bool {
        let to = self.def.apply_to.as_str();
        let covers = match kind {
            Applies::Exchange => matches!(to, "all" | "exchanges"),
            Applies::ClassicQueue => matches!(to, "all" | "queues" | "classic_queues"),
            Applies::QuorumQueue => matches!(to, "all" | "queues" | "quorum_queues"),
            Applies::Stream => matches!(to, "all" | "queues" | "streams"),
        };
        covers && self.pattern.is_match(name)
    }
}

/// What kind of object a policy is looked up for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applies {
    /// An exchange.
    Exchange,
    /// A classic queue.
    ClassicQueue,
    /// A quorum queue.
    QuorumQueue,
    /// A stream.
    Stream,
}

/// The policy that applies to `name`, if any.
#[must_use]
pub fn choose<'a>(policies: &'a [Policy], name: &str, kind: Applies) -> Option<&'a Policy> {
    policies
        .iter()
        .filter(|p| p.applies(name, kind))
        .max_by(|a, b| (a.def.priority, &a.def.name).cmp(&(b.def.priority, &b.def.name)))
}

fn min_opt(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A queue's effective settings: its declare arguments combined with its policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueSettings {
    /// For the machine.
    pub config: QueueConfig,
    /// Dead-letter target.
    pub dead_letter: Option<DeadLetterTarget>,
    /// `expires` in milliseconds.
    pub expires: Option<u64>,
    /// Leases and delayed retries (`x-lease-*`, `x-delayed-retry-*` and their policy keys).
    pub work: crate::queue::machine::WorkConfig,
}

/// Combine declare arguments, a policy and an operator policy with RabbitMQ's precedence.
#[must_use]
pub fn queue_settings(
    args: &FieldTable,
    policy: Option<&Policy>,
    operator: Option<&Policy>,
) -> QueueSettings {
    let mut config = crate::args::queue_config(args);
    let arg_int = |k: &str| {
        args.inner()
            .get(k)
            .and_then(crate::args::int_value)
            .and_then(|n| u64::try_from(n).ok())
    };
    let mut dead_letter = DeadLetterTarget::from_args(args);
    let mut expires = arg_int("x-expires");
    let quorum = crate::args::is_quorum(args);
    if let Some(p) = policy {
        let d = &p.def.definition;
        cap_limits(&mut config, &mut expires, d, None);
        if quorum && let Some(policy_limit) = d.get("delivery-limit").and_then(Value::as_i64) {
            let arg = args
                .inner()
                .get("x-delivery-limit")
                .and_then(crate::args::int_value);
            config.delivery_limit = resolve_delivery_limit(i128::from(policy_limit), arg);
        }
        if !args.inner().contains_key("x-overflow") {
            config.overflow = match text(d, "overflow").as_deref() {
                Some("reject-publish") => Overflow::RejectPublish,
                Some("reject-publish-dlx") => Overflow::RejectPublishDlx,
                _ => config.overflow,
            };
        }
        if dead_letter.is_none()
            && let Some(exchange) = text(d, "dead-letter-exchange")
        {
            dead_letter = Some(DeadLetterTarget {
                exchange,
                routing_key: text(d, "dead-letter-routing-key"),
            });
        } else if let Some(dl) = dead_letter.as_mut()
            && dl.routing_key.is_none()
            && !args.inner().contains_key("x-dead-letter-routing-key")
        {
            dl.routing_key = text(d, "dead-letter-routing-key");
        }
    }
    if let Some(op) = operator {
        // Operator limits cap whatever the arguments and the user's policy chose.
        let delivery = config.delivery_limit;
        cap_limits(
            &mut config,
            &mut expires,
            &op.def.definition,
            quorum.then_some(delivery),
        );
    }
    QueueSettings {
        config,
        dead_letter,
        expires,
        work: crate::args::work::work_config(args, policy.map(|p| &p.def.definition)),
    }
}

/// A quorum queue's delivery limit from a policy's value and its argument, as
/// rabbit_quorum_queue's `resolve_delivery_limit/2`: the larger when either is negative (a
/// negative one is "none", so a policy can lift an argument's limit and the other way
/// round), else the smaller; without an argument, the policy's.
fn resolve_delivery_limit(policy: i128, arg: Option<i128>) -> Option<u32> {
    let v = match arg {
        Some(a) if a < 0 || policy < 0 => a.max(policy),
        Some(a) => a.min(policy),
        None => policy,
    };
    Some(crate::args::delivery_limit_of(v))
}

/// Lower the numeric limits of `config` (and `expires`) to those `d` sets: a policy's limits
/// combine with the queue's own as RabbitMQ does, the smaller wins. `delivery` is None for a
/// classic queue (no delivery limit), else the limit `d`'s `delivery-limit` combines with
/// (`Some(None)`: none, so `d`'s applies as it is).
fn cap_limits(
    config: &mut QueueConfig,
    expires: &mut Option<u64>,
    d: &Map<String, Value>,
    delivery: Option<Option<u32>>,
) {
    config.max_length = min_opt(config.max_length, int(d, "max-length"));
    config.max_length_bytes = min_opt(config.max_length_bytes, int(d, "max-length-bytes"));
    config.message_ttl = min_opt(config.message_ttl, int(d, "message-ttl"));
    *expires = min_opt(*expires, int(d, "expires"));
    if let Some(base) = delivery
        && let Some(limit) = int(d, "delivery-limit")
    {
        let limit = u32::try_from(limit).unwrap_or(u32::MAX);
        config.delivery_limit = Some(base.map_or(limit, |b| b.min(limit)));
    }
}

/// The definition in effect when `policy` and `operator` both apply (the management API's
/// `effective_policy_definition`): the policy's keys, with each operator limit taking the lower
/// value where both set one.
#[must_use]
pub fn effective_definition(
    policy: Option<&Policy>,
    operator: Option<&Policy>,
) -> Map<String, Value> {
    let mut out = policy.map(|p| p.def.definition.clone()).unwrap_or_default();
    if let Some(op) = operator {
        for (k, v) in &op.def.definition {
            let lower = match (out.get(k).and_then(Value::as_u64), v.as_u64()) {
                (Some(mine), Some(cap)) => Value::from(mine.min(cap)),
                _ => v.clone(),
            };
            out.insert(k.clone(), lower);
        }
    }
    out
}

/// The alternate exchange a policy gives an exchange (its argument wins).
#[must_use]
pub fn alternate_exchange(policy: Option<&Policy>) -> Option<String> {
    policy.and_then(|p| text(&p.def.definition, "alternate-exchange"))
}

#[cfg(test)]
mod tests {
    use amq_protocol::types::AMQPValue;

    use super::*;

    fn policy(name: &str, pattern: &str, priority: i32, def: Value) -> Policy {
        Policy::new(PolicyDef {
            vhost: "/".into(),
            name: name.into(),
            pattern: pattern.into(),
            apply_to: "queues".into(),
            priority,
            definition: def.as_object().cloned().unwrap_or_default(),
        })
        .unwrap()
    }

    #[test]
    fn the_highest_priority_matching_policy_applies() {
        let ps = vec![
            policy("a", "^orders\\.", 1, serde_json::json!({"max-length": 10})),
            policy(
                "b",
                "^orders\\.eu",
                5,
                serde_json::json!({"max-length": 20}),
            ),
        ];
        assert_eq!(
            choose(&ps, "orders.eu.1", Applies::ClassicQueue)
                .unwrap()
                .def
                .name,
            "b"
        );
        assert_eq!(
            choose(&ps, "orders.us", Applies::ClassicQueue)
                .unwrap()
                .def
                .name,
            "a"
        );
        assert!(choose(&ps, "orders.us", Applies::Exchange).is_none());
        assert!(choose(&ps, "other", Applies::ClassicQueue).is_none());
    }

    #[test]
    fn numeric_limits_take_the_smaller_and_arguments_win_the_rest() {
        let p = policy(
            "p",
            ".*",
            0,
            serde_json::json!({"max-length": 5, "message-ttl": 1000, "overflow": "reject-publish",
                               "dead-letter-exchange": "dlx-policy"}),
        );
        let mut args = FieldTable::default();
        args.insert("x-max-length".into(), AMQPValue::LongInt(3));
        args.insert("x-message-ttl".into(), AMQPValue::LongInt(5000));
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("dlx-arg".into()),
        );
        let s = queue_settings(&args, Some(&p), None);
        assert_eq!(s.config.max_length, Some(3));
        assert_eq!(s.config.message_ttl, Some(1000));
        assert_eq!(s.config.overflow, Overflow::RejectPublish);
        assert_eq!(s.dead_letter.unwrap().exchange, "dlx-arg");
        let s = queue_settings(&FieldTable::default(), Some(&p), None);
        assert_eq!(s.dead_letter.unwrap().exchange, "dlx-policy");
    }

    #[test]
    fn operator_policies_cap_arguments_and_policies() {
        let user = policy("p", ".*", 0, serde_json::json!({"max-length": 50}));
        let op = Policy::new_of(
            PolicyKind::Operator,
            PolicyDef {
                vhost: "/".into(),
                name: "cap".into(),
                pattern: ".*".into(),
                apply_to: "queues".into(),
                priority: 0,
                definition: serde_json::json!({"max-length": 10, "message-ttl": 60000})
                    .as_object()
                    .cloned()
                    .unwrap_or_default(),
            },
        )
        .unwrap();
        let mut args = FieldTable::default();
        args.insert("x-message-ttl".into(), AMQPValue::LongInt(1000));
        let s = queue_settings(&args, Some(&user), Some(&op));
        // The operator's 10 beats the policy's 50; the argument's 1000 ms beats the cap.
        assert_eq!(s.config.max_length, Some(10));
        assert_eq!(s.config.message_ttl, Some(1000));
        let s = queue_settings(&FieldTable::default(), None, Some(&op));
        assert_eq!(s.config.message_ttl, Some(60000));
        // Quorum queues: a policy's delivery-limit replaces the default 20 even when higher;
        // an operator's caps what results.
        let mut quorum = FieldTable::default();
        quorum.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        let lenient = policy("d", ".*", 0, serde_json::json!({"delivery-limit": 50}));
        let s = queue_settings(&quorum, Some(&lenient), None);
        assert_eq!(s.config.delivery_limit, Some(50));
        let mut strict = op.clone();
        strict.def.definition = serde_json::json!({"delivery-limit": 30})
            .as_object()
            .cloned()
            .unwrap_or_default();
        let s = queue_settings(&quorum, Some(&lenient), Some(&strict));
        assert_eq!(s.config.delivery_limit, Some(30));
        // resolve_delivery_limit: a negative value on either side lifts the limit (the
        // larger wins), else the smaller does.
        let off = policy("off", ".*", 0, serde_json::json!({"delivery-limit": -1}));
        let mut limited = quorum.clone();
        limited.insert("x-delivery-limit".into(), AMQPValue::LongInt(5));
        let s = queue_settings(&limited, Some(&off), None);
        assert_eq!(s.config.delivery_limit, Some(5), "max(-1, 5)");
        let mut unlimited = quorum.clone();
        unlimited.insert("x-delivery-limit".into(), AMQPValue::LongInt(-1));
        let s = queue_settings(&unlimited, Some(&lenient), None);
        assert_eq!(s.config.delivery_limit, Some(50), "max(50, -1)");
        let s = queue_settings(&quorum, Some(&off), None);
        assert_eq!(
            s.config.delivery_limit,
            Some(crate::queue::machine::DELIVERY_LIMIT_NONE),
            "a policy alone turns the default limit off"
        );
        let s = queue_settings(&FieldTable::default(), None, Some(&strict));
        assert_eq!(
            s.config.delivery_limit, None,
            "classic queues count no deliveries"
        );
        let eff = effective_definition(Some(&user), Some(&op));
        assert_eq!(
            Value::Object(eff),
            serde_json::json!({"max-length": 10, "message-ttl": 60000})
        );
        // Operator policies take limits only.
        let mut def = op.def.clone();
        def.definition
            .insert("dead-letter-exchange".into(), "x".into());
        assert!(Policy::new_of(PolicyKind::Operator, def.clone()).is_err());
        assert!(Policy::new_of(PolicyKind::User, def).is_ok());
    }

    #[test]
    fn bad_definitions_are_refused() {
        let bad = |def: Value| {
            Policy::new(PolicyDef {
                vhost: "/".into(),
                name: "x".into(),
                pattern: ".*".into(),
                apply_to: "queues".into(),
                priority: 0,
                definition: def.as_object().cloned().unwrap_or_default(),
            })
            .is_err()
        };
        assert!(bad(serde_json::json!({"max-lenght": 1})));
        assert!(bad(serde_json::json!({"max-length": "ten"})));
        assert!(bad(serde_json::json!({"overflow": "drop-tail"})));
        assert!(bad(serde_json::json!({})));
        assert!(!bad(serde_json::json!({"max-length": 1})));
    }
}
