//! What several resources of the API share beyond the request helpers of [`super`]: object
//! totals over vhosts (overview, vhosts), the `message_stats` object (overview, queues),
//! declare arguments and the conditional-delete query (queues, exchanges, bindings,
//! definitions) and the default exchange's name in URLs. Imports no sibling.

use amq_protocol::types::FieldTable;
use serde::Deserialize;
use serde_json::{Value, json};
use warren_broker::routing::vhost::VHost;
use warren_broker::stats::MessageStats;

use crate::ApiError;
use crate::json::json_to_table;
use crate::rates::MessageRates;

/// Message and object totals over some vhosts.
#[derive(Debug, Default)]
pub(super) struct Totals {
    pub(super) ready: u64,
    pub(super) unacked: u64,
    pub(super) queues: u64,
    pub(super) consumers: u64,
    pub(super) exchanges: u64,
}

pub(super) fn totals<'a>(vhosts: impl IntoIterator<Item = &'a VHost>) -> Totals {
    let mut t = Totals::default();
    for vh in vhosts {
        for q in vh.queues() {
            let s = q.stats();
            t.ready += s.ready;
            t.unacked += s.unacked;
            t.consumers += s.consumers;
            t.queues += 1;
        }
        t.exchanges += vh.exchanges().len() as u64;
    }
    t
}

/// RabbitMQ's `message_stats` object from counters and their rates (`confirm` only where
/// confirms happen: the node and exchanges, not queues).
pub(super) fn message_stats_json(t: &MessageStats, r: &MessageRates, with_confirm: bool) -> Value {
    let mut m = serde_json::Map::new();
    for (name, total, rate) in [
        ("publish", t.published, r.published),
        ("deliver", t.delivered, r.delivered),
        ("get", t.got, r.got),
        ("deliver_get", t.delivered + t.got, r.delivered + r.got),
        ("redeliver", t.redelivered, r.redelivered),
        ("ack", t.acked, r.acked),
        ("confirm", t.confirmed, r.confirmed),
    ] {
        if name == "confirm" && !with_confirm {
            continue;
        }
        m.insert(name.into(), json!(total));
        m.insert(format!("{name}_details"), json!({"rate": rate}));
    }
    Value::Object(m)
}

pub(super) fn direct_type() -> String {
    "direct".into()
}

pub(super) fn arguments(v: Option<&Value>) -> Result<FieldTable, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(FieldTable::default()),
        Some(v) => json_to_table(v).map_err(ApiError::bad_request),
    }
}

/// `?if-empty=true` / `?if-unused=true` on a DELETE: RabbitMQ's conditional deletes (400 when
/// the condition fails, from the AMQP 406).
#[derive(Debug, Default, Deserialize)]
pub(super) struct DeleteConditions {
    #[serde(rename = "if-empty")]
    if_empty: Option<String>,
    #[serde(rename = "if-unused")]
    if_unused: Option<String>,
}

impl DeleteConditions {
    fn flag(name: &str, v: Option<&String>) -> Result<bool, ApiError> {
        match v.map(String::as_str) {
            None | Some("false") => Ok(false),
            Some("true") => Ok(true),
            Some(other) => Err(ApiError::bad_request(format!(
                "{name} must be true or false, not {other:?}"
            ))),
        }
    }

    pub(super) fn if_empty(&self) -> Result<bool, ApiError> {
        Self::flag("if-empty", self.if_empty.as_ref())
    }

    pub(super) fn if_unused(&self) -> Result<bool, ApiError> {
        Self::flag("if-unused", self.if_unused.as_ref())
    }
}

/// `amq.default` names the default exchange in URLs.
pub(super) fn exchange_name(name: &str) -> &str {
    if name == "amq.default" { "" } else { name }
}
