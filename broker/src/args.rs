//! Reading and comparing x-arguments the way RabbitMQ does.

use amq_protocol::types::{AMQPValue, FieldTable};

/// A string-valued argument (long or short string).
#[must_use]
pub fn string_arg(args: &FieldTable, key: &str) -> Option<String> {
    match args.inner().get(key)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

/// RabbitMQ's name for a field type, as shown in equivalence errors.
#[must_use]
pub fn type_name(v: &AMQPValue) -> &'static str {
    match v {
        AMQPValue::Boolean(_) => "bool",
        AMQPValue::ShortShortInt(_) => "byte",
        AMQPValue::ShortShortUInt(_) => "unsignedbyte",
        AMQPValue::ShortInt(_) => "short",
        AMQPValue::ShortUInt(_) => "unsignedshort",
        AMQPValue::LongInt(_) => "signedint",
        AMQPValue::LongUInt(_) => "unsignedint",
        AMQPValue::LongLongInt(_) => "long",
        AMQPValue::Float(_) => "float",
        AMQPValue::Double(_) => "double",
        AMQPValue::DecimalValue(_) => "decimal",
        AMQPValue::ShortString(_) | AMQPValue::LongString(_) => "longstr",
        AMQPValue::FieldArray(_) => "array",
        AMQPValue::Timestamp(_) => "timestamp",
        AMQPValue::FieldTable(_) => "table",
        AMQPValue::ByteArray(_) => "binary",
        AMQPValue::Void => "void",
    }
}

/// A value rendered as RabbitMQ's `val/1` does in equivalence errors.
#[must_use]
pub fn render(v: Option<&AMQPValue>) -> String {
    let Some(v) = v else {
        return "none".to_string();
    };
    let shown = match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(i) => i.to_string(),
        AMQPValue::ShortShortUInt(i) => i.to_string(),
        AMQPValue::ShortInt(i) => i.to_string(),
        AMQPValue::ShortUInt(i) => i.to_string(),
        AMQPValue::LongInt(i) => i.to_string(),
        AMQPValue::LongUInt(i) => i.to_string(),
        AMQPValue::LongLongInt(i) => i.to_string(),
        AMQPValue::Timestamp(i) => i.to_string(),
        other => format!("{other:?}"),
    };
    format!("the value '{shown}' of type '{}'", type_name(v))
}

/// Numeric value of an integer argument, whatever its integer type.
#[must_use]
pub fn int_value(v: &AMQPValue) -> Option<i128> {
    Some(match v {
        AMQPValue::ShortShortInt(i) => i128::from(*i),
        AMQPValue::ShortShortUInt(i) => i128::from(*i),
        AMQPValue::ShortInt(i) => i128::from(*i),
        AMQPValue::ShortUInt(i) => i128::from(*i),
        AMQPValue::LongInt(i) => i128::from(*i),
        AMQPValue::LongUInt(i) => i128::from(*i),
        AMQPValue::LongLongInt(i) => i128::from(*i),
        AMQPValue::Timestamp(i) => i128::from(*i),
        _ => return None,
    })
}

/// Queue arguments RabbitMQ compares on redeclaration.
pub const QUEUE_EQUIVALENCE_KEYS: &[&str] = &[
    "x-expires",
    "x-message-ttl",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-length",
    "x-max-length-bytes",
    "x-max-priority",
    "x-overflow",
    "x-queue-mode",
    "x-queue-type",
    "x-single-active-consumer",
    "x-delivery-limit",
];

/// Whether two argument values are equivalent (integers compare by value across widths).
#[must_use]
pub fn equivalent(a: Option<&AMQPValue>, b: Option<&AMQPValue>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(x), Some(y)) => match (int_value(x), int_value(y)) {
            (Some(i), Some(j)) => i == j,
            _ => string_like(x)
                .zip(string_like(y))
                .map_or(x == y, |(s, t)| s == t),
        },
        _ => false,
    }
}

fn string_like(v: &AMQPValue) -> Option<Vec<u8>> {
    match v {
        AMQPValue::LongString(s) => Some(s.as_bytes().to_vec()),
        AMQPValue::ShortString(s) => Some(s.as_str().as_bytes().to_vec()),
        _ => None,
    }
}

/// A string argument's text (empty if not a string), for name lookups.
#[must_use]
pub fn render_plain(v: &AMQPValue) -> String {
    string_like(v)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

fn invalid(key: &str, what: &str, why: &str) -> warren_amqp::AmqpError {
    warren_amqp::AmqpError::channel(
        warren_amqp::ReplyCode::PreconditionFailed,
        format!("invalid arg '{key}' for {what}: \"{why}\""),
    )
}

/// Validate the x-arguments of a new queue as RabbitMQ does (type and range).
///
/// `what` is `queue 'q' in vhost '/'`.
pub fn validate_queue_args(args: &FieldTable, what: &str) -> Result<(), warren_amqp::AmqpError> {
    for (key, value) in args.inner() {
        let key = key.as_str();
        match key {
            "x-expires" | "x-message-ttl" | "x-max-length" | "x-max-length-bytes"
            | "x-max-priority" | "x-delivery-limit" => {
                let Some(n) = int_value(value) else {
                    return Err(invalid(
                        key,
                        what,
                        &format!("expected integer, got {}", type_name(value)),
                    ));
                };
                if n < 0 || (key == "x-expires" && n == 0) {
                    return Err(warren_amqp::AmqpError::channel(
                        warren_amqp::ReplyCode::PreconditionFailed,
                        format!(
                            "invalid arg '{key}' for {what}: {{value_{}, {n}}}",
                            if n < 0 { "negative" } else { "zero" }
                        ),
                    ));
                }
            }
            "x-dead-letter-exchange"
            | "x-dead-letter-routing-key"
            | "x-overflow"
            | "x-queue-mode"
                if string_like(value).is_none() =>
            {
                return Err(invalid(
                    key,
                    what,
                    &format!("expected string, got {}", type_name(value)),
                ));
            }
            "x-queue-type" => match string_like(value).as_deref() {
                Some(b"classic") => {}
                Some(other) => {
                    // Quorum queues and streams arrive with their own issues; accepting them as
                    // classic queues would silently weaken what the application asked for.
                    return Err(warren_amqp::AmqpError::channel(
                        warren_amqp::ReplyCode::PreconditionFailed,
                        format!(
                            "invalid arg '{key}' for {what}: queue type '{}' is not supported yet",
                            String::from_utf8_lossy(other)
                        ),
                    ));
                }
                None => {
                    return Err(invalid(
                        key,
                        what,
                        &format!("expected string, got {}", type_name(value)),
                    ));
                }
            },
            _ => {}
        }
    }
    Ok(())
}
