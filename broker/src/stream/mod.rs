//! Streams (`x-queue-type: stream`): append-only logs with offsets and retention, read
//! without removing. The pure parts: where a consumer starts ([`spec`]), the per-chunk
//! filters ([`filter`]), the log's state machine ([`log`]) and a consumer's cursor
//! ([`reader`]). Their drivers: the files ([`disk`]), the group commit ([`writer`]) and the
//! stream as a queue of a vhost is `crate::queue::stream`, in the queue layer above.

pub mod disk;
pub mod filter;
pub mod log;
pub mod reader;
pub mod spec;
pub mod writer;

use amq_protocol::types::FieldTable;
use warren_amqp::AmqpError;

/// A stream's retention settings from its declare arguments (`what` is RabbitMQ's
/// `queue 's' in vhost '/'`): `x-max-age` (an interval such as `"7D"`),
/// `x-max-length-bytes`, `x-stream-max-segment-size-bytes` and `x-stream-filter-size-bytes`
/// (16 to 255).
///
/// # Errors
/// 406 `invalid arg '…' for …` with RabbitMQ's terms, for a value of the wrong type or range.
pub fn config_from_args(args: &FieldTable, what: &str) -> Result<log::StreamConfig, AmqpError> {
    let mut config = log::StreamConfig::default();
    let table = args.inner();
    let positive = |key: &str| -> Result<Option<u64>, AmqpError> {
        match table.get(key) {
            None => Ok(None),
            Some(v) => match crate::args::int_value(v) {
                Some(n) if n >= 0 => Ok(Some(u64::try_from(n).unwrap_or(u64::MAX))),
                Some(n) => Err(crate::args::invalid(
                    key,
                    what,
                    &format!("{{value_negative,{n}}}"),
                )),
                None => Err(crate::args::invalid(
                    key,
                    what,
                    &format!("{{unacceptable_type,{}}}", crate::args::type_name(v)),
                )),
            },
        }
    };
    config.max_bytes = positive("x-max-length-bytes")?;
    if let Some(n) = positive("x-stream-max-segment-size-bytes")? {
        config.segment_max_bytes = n.max(1);
    }
    if let Some(n) = positive("x-stream-filter-size-bytes")? {
        let size = usize::try_from(n).unwrap_or(usize::MAX);
        if !(filter::FILTER_BYTES_MIN..=filter::FILTER_BYTES_MAX).contains(&size) {
            return Err(crate::args::invalid(
                "x-stream-filter-size-bytes",
                what,
                &format!("{{value_out_of_range,{n}}}"),
            ));
        }
        config.filter_bytes = size;
    }
    if let Some(v) = table.get("x-max-age") {
        let text = crate::args::text_value(v).ok_or_else(|| {
            crate::args::invalid(
                "x-max-age",
                what,
                &format!("{{unacceptable_type,{}}}", crate::args::type_name(v)),
            )
        })?;
        config.max_age_ms = Some(
            spec::parse_interval(&text)
                .map_err(|_| crate::args::invalid("x-max-age", what, "invalid_max_age"))?,
        );
    }
    Ok(config)
}

/// Whether the arguments declare a stream.
#[must_use]
pub fn is_stream(args: &FieldTable) -> bool {
    crate::args::QueueType::of(args) == crate::args::QueueType::Stream
}

/// A stream's effective retention: its declare arguments, overridden by a policy's
/// `max-age`, `max-length-bytes`, `stream-max-segment-size-bytes` and
/// `stream-filter-size-bytes` where the policy sets them (RabbitMQ's `rabbit_stream_queue`
/// resolves them with `policy_precedence`: the policy's value wins).
#[must_use]
pub fn config_with_policy(
    args: &FieldTable,
    policy: Option<&crate::policy::Policy>,
    what: &str,
) -> log::StreamConfig {
    let mut config = config_from_args(args, what).unwrap_or_default();
    let Some(p) = policy else {
        return config;
    };
    let d = &p.def.definition;
    let int = |k: &str| d.get(k).and_then(serde_json::Value::as_u64);
    if let Some(n) = int("max-length-bytes") {
        config.max_bytes = Some(n);
    }
    if let Some(ms) = d
        .get("max-age")
        .and_then(serde_json::Value::as_str)
        .and_then(|s| spec::parse_interval(s).ok())
    {
        config.max_age_ms = Some(ms);
    }
    if let Some(n) = int("stream-max-segment-size-bytes") {
        config.segment_max_bytes = n.max(1);
    }
    if let Some(n) = int("stream-filter-size-bytes").and_then(|n| usize::try_from(n).ok())
        && (filter::FILTER_BYTES_MIN..=filter::FILTER_BYTES_MAX).contains(&n)
    {
        config.filter_bytes = n;
    }
    config
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::table as args;
    use amq_protocol::types::{AMQPValue, LongString};
    use warren_amqp::ReplyCode;

    const WHAT: &str = "queue 's' in vhost '/'";

    #[test]
    fn declare_arguments_make_the_retention_settings() {
        let c = config_from_args(&FieldTable::default(), WHAT).unwrap_or_default();
        assert_eq!(c, log::StreamConfig::default());
        let c = config_from_args(
            &args(&[
                ("x-max-age", AMQPValue::LongString(LongString::from("7D"))),
                ("x-max-length-bytes", AMQPValue::LongLongInt(20_000_000_000)),
                (
                    "x-stream-max-segment-size-bytes",
                    AMQPValue::LongInt(100_000_000),
                ),
                ("x-stream-filter-size-bytes", AMQPValue::ShortShortUInt(32)),
            ]),
            WHAT,
        )
        .unwrap_or_default();
        assert_eq!(c.max_age_ms, Some(7 * 86_400_000));
        assert_eq!(c.max_bytes, Some(20_000_000_000));
        assert_eq!(c.segment_max_bytes, 100_000_000);
        assert_eq!(c.filter_bytes, 32);
        for (key, value, term) in [
            (
                "x-max-age",
                AMQPValue::LongString(LongString::from("7 days")),
                "invalid_max_age",
            ),
            (
                "x-max-age",
                AMQPValue::LongLongInt(7),
                "{unacceptable_type,long}",
            ),
            (
                "x-max-length-bytes",
                AMQPValue::LongLongInt(-1),
                "{value_negative,-1}",
            ),
            (
                "x-stream-filter-size-bytes",
                AMQPValue::LongLongInt(8),
                "{value_out_of_range,8}",
            ),
        ] {
            let e = config_from_args(&args(&[(key, value)]), WHAT).expect_err(key);
            assert_eq!(e.code, ReplyCode::PreconditionFailed);
            assert!(
                e.to_string()
                    .contains(&format!("invalid arg '{key}' for {WHAT}: {term}")),
                "{e}"
            );
        }
    }

    #[test]
    fn a_policy_overrides_the_arguments_as_rabbitmq_resolves_streams() {
        let policy = crate::policy::Policy::new(crate::policy::PolicyDef {
            vhost: "/".into(),
            name: "p".into(),
            pattern: ".*".into(),
            apply_to: "streams".into(),
            priority: 0,
            definition: serde_json::json!({
                "max-age": "7D",
                "max-length-bytes": 5000,
                "stream-max-segment-size-bytes": 2000,
            })
            .as_object()
            .cloned()
            .unwrap_or_default(),
        })
        .expect("valid policy");
        let a = args(&[
            ("x-max-age", AMQPValue::LongString(LongString::from("1D"))),
            ("x-max-length-bytes", AMQPValue::LongLongInt(1_000_000)),
        ]);
        let c = config_with_policy(&a, Some(&policy), WHAT);
        assert_eq!(c.max_age_ms, Some(7 * 86_400_000));
        assert_eq!(c.max_bytes, Some(5000));
        assert_eq!(c.segment_max_bytes, 2000);
        // Without the policy, the arguments.
        let c = config_with_policy(&a, None, WHAT);
        assert_eq!(c.max_age_ms, Some(86_400_000));
        assert_eq!(c.max_bytes, Some(1_000_000));
    }
}
