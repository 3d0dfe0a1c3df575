//! Dead-lettering: a message rejected, expired or dropped by a length limit in a queue with
//! `x-dead-letter-exchange` is republished there with RabbitMQ's `x-death` bookkeeping.
//!
//! Header format (as RabbitMQ 3.13+/4.x writes it): `x-death` is an array of tables, newest
//! first, one per (queue, reason) with `count`, `reason`, `queue`, `time` (first time, seconds),
//! `exchange` and `routing-keys` of the first time, and `original-expiration` when the message
//! had one (the property itself is removed, so the message does not expire again); plus
//! `x-first-death-{queue,reason,exchange}` (set once) and `x-last-death-{queue,reason,exchange}`.
//! The array has at most one entry per (queue, reason), so its size is bounded by the topology,
//! not by how often a message cycles.

use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use bytes::Bytes;
use warren_amqp::properties::Properties;
use warren_amqp::table::encode_table;

use crate::message::{Loaded, Message};
use crate::queue::machine::Removal;

/// Where a queue dead-letters to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterTarget {
    /// `x-dead-letter-exchange` ("" is the default exchange).
    pub exchange: String,
    /// `x-dead-letter-routing-key`; None keeps the message's routing key.
    pub routing_key: Option<String>,
}

impl DeadLetterTarget {
    /// From a queue's declare arguments.
    #[must_use]
    pub fn from_args(args: &FieldTable) -> Option<Self> {
        let exchange = crate::args::string_arg(args, "x-dead-letter-exchange")?;
        Some(Self {
            exchange,
            routing_key: crate::args::string_arg(args, "x-dead-letter-routing-key"),
        })
    }
}

/// RabbitMQ's name for a reason.
#[must_use]
pub fn reason_name(reason: Removal) -> Option<&'static str> {
    match reason {
        Removal::Rejected => Some("rejected"),
        Removal::Expired => Some("expired"),
        Removal::MaxLen => Some("maxlen"),
        Removal::DeliveryLimit => Some("delivery_limit"),
        Removal::Settled | Removal::Purged => None,
    }
}

fn long_str(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

fn text(v: Option<&AMQPValue>) -> Option<String> {
    match v? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

/// The queues a message already died in, with the reasons (newest first), from its `x-death`.
#[must_use]
pub fn deaths(headers: Option<&FieldTable>) -> Vec<(String, String)> {
    let Some(AMQPValue::FieldArray(entries)) = headers.and_then(|h| h.inner().get("x-death"))
    else {
        return Vec::new();
    };
    entries
        .as_slice()
        .iter()
        .filter_map(|e| match e {
            AMQPValue::FieldTable(t) => Some((
                text(t.inner().get("queue")).unwrap_or_default(),
                text(t.inner().get("reason")).unwrap_or_default(),
            )),
            _ => None,
        })
        .collect()
}

/// Whether dead-lettering into `queue` would close a cycle that RabbitMQ drops
/// (`mc:is_cycle_v2`): the message already died in that queue and none of the deaths since
/// then (newest first, up to and including the last one in that queue) was a rejection. A
/// client decision breaks a cycle; automatic ones would loop forever.
#[must_use]
pub fn is_cycle(deaths: &[(String, String)], queue: &str) -> bool {
    let Some(last_here) = deaths.iter().position(|(q, _)| q == queue) else {
        return false;
    };
    deaths[..=last_here].iter().all(|(_, r)| r != "rejected")
}

/// The message to republish: `x-death` and friends updated, expiration moved into the entry,
/// exchange and routing key set as RabbitMQ does.
#[must_use]
pub fn dead_lettered(
    loaded: &Loaded,
    queue: &str,
    reason: &str,
    now_s: u64,
    target: &DeadLetterTarget,
    table_depth_max: usize,
) -> Option<Message> {
    let props =
        Properties::parse(Bytes::copy_from_slice(loaded.properties()), table_depth_max).ok()?;
    let mut headers = props.headers().unwrap_or_default();
    let exchange = String::from_utf8_lossy(loaded.exchange()).into_owned();
    let routing_key = String::from_utf8_lossy(loaded.routing_key()).into_owned();
    let expiration = props
        .expiration()
        .map(|e| String::from_utf8_lossy(e).into_owned());

    let mut entries: Vec<AMQPValue> = match headers.inner().get("x-death") {
        Some(AMQPValue::FieldArray(a)) => a.as_slice().to_vec(),
        _ => Vec::new(),
    };
    let same = |v: &AMQPValue| match v {
        AMQPValue::FieldTable(t) => {
            text(t.inner().get("queue")).as_deref() == Some(queue)
                && text(t.inner().get("reason")).as_deref() == Some(reason)
        }
        _ => false,
    };
    let entry = match entries.iter().position(same) {
        Some(i) => {
            let mut e = match entries.remove(i) {
                AMQPValue::FieldTable(t) => t,
                _ => FieldTable::default(),
            };
            let count = e
                .inner()
                .get("count")
                .and_then(crate::args::int_value)
                .unwrap_or(0);
            let count = i64::try_from(count)
                .unwrap_or(i64::MAX - 1)
                .saturating_add(1);
            e.insert("count".into(), AMQPValue::LongLongInt(count));
            e
        }
        None => {
            let mut e = FieldTable::default();
            e.insert("count".into(), AMQPValue::LongLongInt(1));
            e.insert("reason".into(), long_str(reason));
            e.insert("queue".into(), long_str(queue));
            e.insert("time".into(), AMQPValue::Timestamp(now_s));
            e.insert("exchange".into(), long_str(&exchange));
            let mut keys = FieldArray::default();
            keys.push(long_str(&routing_key));
            for cc in sender_selected(&props).0 {
                keys.push(long_str(&cc));
            }
            e.insert("routing-keys".into(), AMQPValue::FieldArray(keys));
            if let Some(x) = &expiration {
                e.insert("original-expiration".into(), long_str(x));
            }
            e
        }
    };
    entries.insert(0, AMQPValue::FieldTable(entry));
    headers.insert(
        "x-death".into(),
        AMQPValue::FieldArray(FieldArray::from(entries)),
    );
    for (k, v) in [
        ("queue", queue),
        ("reason", reason),
        ("exchange", exchange.as_str()),
    ] {
        let first: ShortString = format!("x-first-death-{k}").into();
        if !headers.inner().contains_key(&first) {
            headers.insert(first, long_str(v));
        }
        headers.insert(format!("x-last-death-{k}").into(), long_str(v));
    }
    let raw = props.rewrite(&encode_table(&headers), expiration.is_some());
    let properties = Properties::parse(raw, table_depth_max).ok()?;
    Some(Message {
        exchange: target.exchange.clone(),
        routing_key: target.routing_key.clone().unwrap_or(routing_key),
        properties,
        body: loaded.body_bytes(),
    })
}

/// The `CC` and `BCC` routing keys of a message (sender-selected distribution), if any. A
/// cheap byte search skips the table parse for the common message without them.
#[must_use]
pub fn sender_selected(props: &Properties) -> (Vec<String>, Vec<String>) {
    let Some(raw) = props.headers_raw() else {
        return (Vec::new(), Vec::new());
    };
    let has = |key: &[u8]| raw.windows(key.len()).any(|w| w == key);
    if !has(b"\x02CC") && !has(b"\x03BCC") {
        return (Vec::new(), Vec::new());
    }
    let Some(headers) = props.headers() else {
        return (Vec::new(), Vec::new());
    };
    let keys = |name: &str| -> Vec<String> {
        match headers.inner().get(name) {
            Some(AMQPValue::FieldArray(a)) => {
                a.as_slice().iter().filter_map(|v| text(Some(v))).collect()
            }
            _ => Vec::new(),
        }
    };
    (keys("CC"), keys("BCC"))
}

/// A property list with `x-delivery-count` and RabbitMQ 4.3's `x-acquired-count` set (quorum
/// queues report how often a message was returned when they deliver it again; every return
/// counts here, so the two agree). Unparseable input is returned unchanged.
#[must_use]
pub fn with_delivery_count(raw: &[u8], count: u32) -> Bytes {
    let raw = Bytes::copy_from_slice(raw);
    let Ok(props) = Properties::parse(raw.clone(), warren_amqp::limits::TABLE_DEPTH_MAX) else {
        return raw;
    };
    let mut headers = props.headers().unwrap_or_default();
    headers.insert(
        "x-delivery-count".into(),
        AMQPValue::LongLongInt(i64::from(count)),
    );
    headers.insert(
        "x-acquired-count".into(),
        AMQPValue::LongLongInt(i64::from(count)),
    );
    props.rewrite(&encode_table(&headers), false)
}

/// Most bytes of a failure reason or worker name a dead letter carries.
pub const FAILURE_TEXT_MAX: usize = 1_024;

/// A dead letter's properties with its failure context: `x-failure-reason` (what its last
/// worker said when it released it, or `lease expired`), `x-failure-worker` and
/// `x-failure-attempts` (its delivery count). Unparseable input is returned unchanged.
#[must_use]
pub fn with_failure(props: &Properties, reason: &str, worker: &str, attempts: u32) -> Properties {
    let cut = |s: &str| {
        let mut end = s.len().min(FAILURE_TEXT_MAX);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s[..end].to_string()
    };
    let mut headers = props.headers().unwrap_or_default();
    headers.insert(
        "x-failure-reason".into(),
        AMQPValue::LongString(cut(reason).into()),
    );
    headers.insert(
        "x-failure-worker".into(),
        AMQPValue::LongString(cut(worker).into()),
    );
    headers.insert(
        "x-failure-attempts".into(),
        AMQPValue::LongLongInt(i64::from(attempts)),
    );
    let raw = props.rewrite(&encode_table(&headers), false);
    Properties::parse(raw, warren_amqp::limits::TABLE_DEPTH_MAX).unwrap_or_else(|_| props.clone())
}

#[cfg(test)]
mod tests {
    use super::is_cycle;

    fn d(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(q, r)| ((*q).to_string(), (*r).to_string()))
            .collect()
    }

    #[test]
    fn only_deaths_since_the_last_one_in_the_target_queue_count() {
        assert!(!is_cycle(&d(&[("a", "expired")]), "b"));
        assert!(is_cycle(&d(&[("b", "expired"), ("a", "expired")]), "a"));
        assert!(!is_cycle(&d(&[("b", "rejected"), ("a", "expired")]), "a"));
        // A rejection long ago, before the last lap, does not break the new cycle.
        assert!(is_cycle(
            &d(&[("r", "expired"), ("w", "expired"), ("w", "rejected")]),
            "w"
        ));
    }
}
