//! Reading and comparing x-arguments the way RabbitMQ does; `work` holds the work-queue
//! arguments (leases, delayed retries).

pub mod work;

use amq_protocol::types::{AMQPValue, FieldTable};

/// A string-valued argument (long or short string).
#[must_use]
pub fn string_arg(args: &FieldTable, key: &str) -> Option<String> {
    text_value(args.inner().get(key)?)
}

/// A long or short string value as text (None for any other type).
#[must_use]
pub fn text_value(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

/// A field table of `pairs`, for tests.
#[cfg(test)]
pub(crate) fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert((*k).into(), v.clone());
    }
    t
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

pub(crate) fn string_like(v: &AMQPValue) -> Option<Vec<u8>> {
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

/// RabbitMQ's `invalid arg '<key>' for <what>: <term>` where the term is printed by `~p`.
pub(crate) fn invalid(key: &str, what: &str, term: &str) -> warren_amqp::AmqpError {
    warren_amqp::AmqpError::channel(
        warren_amqp::ReplyCode::PreconditionFailed,
        format!("invalid arg '{key}' for {what}: {term}"),
    )
}

/// Largest `x-max-priority` (RabbitMQ's `?MAX_SUPPORTED_PRIORITY`).
pub const MAX_SUPPORTED_PRIORITY: i128 = 255;
/// Largest TTL or expiry in milliseconds (RabbitMQ's `?MAX_EXPIRY_TIMER`).
pub const MAX_EXPIRY_TIMER: i128 = 4_294_967_295;

/// One argument's validator result: `Err(term)` is the Erlang term RabbitMQ prints.
type Check = fn(&AMQPValue, &FieldTable) -> Result<(), String>;

fn check_int(v: &AMQPValue) -> Result<i128, String> {
    int_value(v).ok_or_else(|| format!("\"expected integer, got {}\"", type_name(v)))
}

fn check_non_neg_int(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    let n = check_int(v)?;
    if n < 0 {
        return Err(format!("{{value_negative,{n}}}"));
    }
    Ok(())
}

fn check_expiry(n: i128) -> Result<(), String> {
    if n < 0 {
        Err(format!("{{value_negative,{n}}}"))
    } else if n > MAX_EXPIRY_TIMER {
        Err(format!("{{value_too_large,{n},{MAX_EXPIRY_TIMER}}}"))
    } else {
        Ok(())
    }
}

fn check_expires(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    let n = check_int(v)?;
    if n == 0 {
        return Err("{value_zero,0}".to_string());
    }
    check_expiry(n)
}

fn check_message_ttl(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    check_expiry(check_int(v)?)
}

fn check_max_priority(v: &AMQPValue, args: &FieldTable) -> Result<(), String> {
    check_non_neg_int(v, args)?;
    match int_value(v) {
        Some(n) if n > MAX_SUPPORTED_PRIORITY => Err(format!("{{max_value_exceeded,{n}}}")),
        _ => Ok(()),
    }
}

fn unacceptable(v: &AMQPValue) -> String {
    format!("{{unacceptable_type,{}}}", type_name(v))
}

fn check_string(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    string_like(v).map(|_| ()).ok_or_else(|| unacceptable(v))
}

fn check_dlx_routing_key(v: &AMQPValue, args: &FieldTable) -> Result<(), String> {
    check_string(v, args)?;
    if args.inner().contains_key("x-dead-letter-exchange") {
        Ok(())
    } else {
        Err("routing_key_but_no_dlx_defined".to_string())
    }
}

fn check_one_of(
    v: &AMQPValue,
    known: &[&str],
    unknown: impl FnOnce(&str) -> String,
) -> Result<(), String> {
    let s = string_like(v).ok_or_else(|| unacceptable(v))?;
    let s = String::from_utf8_lossy(&s);
    if known.contains(&s.as_ref()) {
        Ok(())
    } else {
        Err(unknown(&s))
    }
}

fn check_overflow(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    check_one_of(
        v,
        &["drop-head", "reject-publish", "reject-publish-dlx"],
        |_| "invalid_overflow".to_string(),
    )
}

fn check_queue_mode(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    check_one_of(v, &["default", "lazy"], |s| {
        format!("\"unsupported queue mode '{s}'\"")
    })
}

/// Where a quorum queue's leader goes: the declaring client's node (`client-local`, the
/// default) or the member leading fewest queues (`balanced`; RabbitMQ 3.10's `random` and
/// `least-leaders` mean the same here).
pub const LEADER_LOCATORS: &[&str] = &["client-local", "balanced", "random", "least-leaders"];

fn check_leader_locator(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    check_one_of(v, LEADER_LOCATORS, |_| {
        "invalid_queue_locator_arg".to_string()
    })
}

fn check_queue_type(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    check_one_of(v, &["classic", "quorum", "stream"], |s| {
        format!("\"unsupported queue type '{s}'\"")
    })
}

fn check_bool(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    match v {
        AMQPValue::Boolean(_) => Ok(()),
        other => Err(unacceptable(other)),
    }
}

/// Queue-declare validators in RabbitMQ's order (`rabbit_amqqueue:declare_args/0`): the first
/// failing one in this order is the one reported.
const DECLARE_ARGS: &[(&str, Check)] = &[
    ("x-expires", check_expires),
    ("x-message-ttl", check_message_ttl),
    ("x-dead-letter-exchange", check_string),
    ("x-dead-letter-routing-key", check_dlx_routing_key),
    ("x-max-length", check_non_neg_int),
    ("x-max-length-bytes", check_non_neg_int),
    ("x-max-in-memory-length", check_non_neg_int),
    ("x-max-in-memory-bytes", check_non_neg_int),
    ("x-max-priority", check_max_priority),
    ("x-overflow", check_overflow),
    ("x-queue-mode", check_queue_mode),
    ("x-single-active-consumer", check_bool),
    ("x-queue-type", check_queue_type),
    // RabbitMQ validates no value here: any integer (negative: unlimited, 0: no redelivery).
    ("x-delivery-limit", check_any_int),
    ("x-queue-leader-locator", check_leader_locator),
];

fn check_any_int(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    check_int(v).map(|_| ())
}

/// A queue type, as `queue.declare`'s `x-queue-type` selects it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueType {
    /// `classic` (the default).
    Classic,
    /// `quorum`.
    Quorum,
    /// `stream`.
    Stream,
}

impl QueueType {
    /// The type `args` declare (classic without an `x-queue-type`).
    #[must_use]
    pub fn of(args: &FieldTable) -> Self {
        match args
            .inner()
            .get("x-queue-type")
            .and_then(string_like)
            .as_deref()
        {
            Some(b"quorum") => Self::Quorum,
            Some(b"stream") => Self::Stream,
            _ => Self::Classic,
        }
    }

    /// RabbitMQ's module name for the type, as its error texts print it.
    #[must_use]
    pub fn module(self) -> &'static str {
        match self {
            Self::Classic => "rabbit_classic_queue",
            Self::Quorum => "rabbit_quorum_queue",
            Self::Stream => "rabbit_stream_queue",
        }
    }

    /// The declare arguments the type takes (each type's `capabilities/0`, RabbitMQ 4.2).
    #[must_use]
    pub fn arguments(self) -> &'static [&'static str] {
        match self {
            Self::Classic => CLASSIC_ARGS,
            Self::Quorum => QUORUM_ARGS,
            Self::Stream => STREAM_ARGS,
        }
    }

    /// Whether the type takes argument `key`: RabbitMQ's list, and for classic and quorum
    /// queues Warren's work-queue arguments ([`work::WORK_DECLARE_ARGS`]).
    #[must_use]
    pub fn takes(self, key: &str) -> bool {
        self.arguments().contains(&key)
            || (self != Self::Stream && work::WORK_DECLARE_ARGS.iter().any(|(k, _)| *k == key))
    }

    /// Whether a server-named (empty name) queue of this type can be declared.
    #[must_use]
    pub fn server_named(self) -> bool {
        self == Self::Classic
    }
}

/// `rabbit_classic_queue:capabilities/0`'s `queue_arguments`.
const CLASSIC_ARGS: &[&str] = &[
    "x-expires",
    "x-message-ttl",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-length",
    "x-max-length-bytes",
    "x-max-priority",
    "x-overflow",
    "x-queue-mode",
    "x-queue-version",
    "x-single-active-consumer",
    "x-queue-type",
    "x-queue-master-locator",
    "x-queue-leader-locator",
];

/// `rabbit_quorum_queue:capabilities/0`'s `queue_arguments`.
const QUORUM_ARGS: &[&str] = &[
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-dead-letter-strategy",
    "x-expires",
    "x-max-length",
    "x-max-length-bytes",
    "x-max-in-memory-length",
    "x-max-in-memory-bytes",
    "x-overflow",
    "x-single-active-consumer",
    "x-queue-type",
    "x-quorum-initial-group-size",
    "x-delivery-limit",
    "x-message-ttl",
    "x-queue-leader-locator",
];

/// `rabbit_stream_queue:capabilities/0`'s `queue_arguments`.
const STREAM_ARGS: &[&str] = &[
    "x-max-length-bytes",
    "x-queue-type",
    "x-max-age",
    "x-stream-max-segment-size-bytes",
    "x-initial-cluster-size",
    "x-queue-leader-locator",
];

/// Refuse an argument that some queue type takes but this one does not
/// (`rabbit_amqqueue:check_arguments_key/4`); arguments no type knows are left alone.
fn check_type_arguments(
    args: &FieldTable,
    kind: QueueType,
    what: &str,
) -> Result<(), warren_amqp::AmqpError> {
    let known = |k: &str| {
        [QueueType::Classic, QueueType::Quorum, QueueType::Stream]
            .iter()
            .any(|t| t.takes(k))
    };
    for key in args.inner().keys() {
        let key = key.as_str();
        if known(key) && !kind.takes(key) {
            return Err(warren_amqp::AmqpError::channel(
                warren_amqp::ReplyCode::PreconditionFailed,
                format!(
                    "invalid arg '{key}' for {what} of queue type {}",
                    kind.module()
                ),
            ));
        }
    }
    Ok(())
}

/// Validate the x-arguments of a declare as RabbitMQ does (type and range), with its texts;
/// when `creating`, also refuse arguments the queue type does not take.
///
/// `what` is `queue 'q' in vhost '/'`.
pub fn validate_queue_args(
    args: &FieldTable,
    what: &str,
    creating: bool,
) -> Result<(), warren_amqp::AmqpError> {
    if let Some(v) = args.inner().get("x-dead-letter-exchange")
        && string_like(v).is_none()
    {
        // rabbit_channel checks the DLX name before the argument validators run.
        return Err(warren_amqp::AmqpError::channel(
            warren_amqp::ReplyCode::PreconditionFailed,
            format!(
                "invalid type '{}' for arg 'x-dead-letter-exchange' in {what}",
                type_name(v)
            ),
        ));
    }
    // rabbit_amqqueue:check_declare_arguments/3: the type first, then the values of the
    // arguments that type takes, then the arguments it does not take.
    if let Some(v) = args.inner().get("x-queue-type") {
        check_queue_type(v, args).map_err(|term| invalid("x-queue-type", what, &term))?;
    }
    let kind = QueueType::of(args);
    for (key, check) in DECLARE_ARGS.iter().chain(work::WORK_DECLARE_ARGS) {
        if !kind.takes(key) {
            continue;
        }
        if let Some(v) = args.inner().get(*key) {
            check(v, args).map_err(|term| invalid(key, what, &term))?;
        }
    }
    // RabbitMQ checks which arguments the type takes only when it creates the queue; a
    // redeclare is compared with the queue as it is.
    if creating {
        check_type_arguments(args, kind, what)?;
    }
    Ok(())
}

/// Validate a headers-exchange binding's `x-match` (RabbitMQ's
/// `rabbit_exchange_type_headers:validate_binding/2`).
pub fn validate_x_match(args: &FieldTable) -> Result<(), warren_amqp::AmqpError> {
    let err = |text: String| {
        warren_amqp::AmqpError::channel(warren_amqp::ReplyCode::PreconditionFailed, text)
    };
    match args.inner().get("x-match") {
        None => Ok(()),
        Some(AMQPValue::LongString(s)) => match s.as_bytes() {
            b"all" | b"any" | b"all-with-x" | b"any-with-x" => Ok(()),
            other => Err(err(format!(
                "Invalid x-match field value <<\"{}\">>; expected all, any, all-with-x, or any-with-x",
                String::from_utf8_lossy(other)
            ))),
        },
        Some(other) => Err(err(format!(
            "Invalid x-match field type {} (value {}); expected longstr",
            type_name(other),
            erlang_value(other)
        ))),
    }
}

/// A field value as Erlang's `~p` prints the decoded value (for error texts).
fn erlang_value(v: &AMQPValue) -> String {
    match v {
        AMQPValue::ShortString(s) => format!("<<\"{}\">>", s.as_str()),
        AMQPValue::LongString(s) => format!("<<\"{}\">>", String::from_utf8_lossy(s.as_bytes())),
        other => int_value(other).map_or_else(
            || match other {
                AMQPValue::Boolean(b) => b.to_string(),
                _ => "...".to_string(),
            },
            |n| n.to_string(),
        ),
    }
}

/// The queue machine's configuration from validated declare arguments (validate first: values
/// that do not fit are ignored here).
#[must_use]
pub fn queue_config(args: &FieldTable) -> crate::queue::machine::QueueConfig {
    use crate::queue::machine::{Overflow, QueueConfig};
    let int = |k: &str| args.inner().get(k).and_then(int_value);
    QueueConfig {
        max_priority: int("x-max-priority")
            .and_then(|n| u8::try_from(n).ok())
            .filter(|n| *n > 0),
        max_length: int("x-max-length").and_then(|n| u64::try_from(n).ok()),
        max_length_bytes: int("x-max-length-bytes").and_then(|n| u64::try_from(n).ok()),
        overflow: match args
            .inner()
            .get("x-overflow")
            .and_then(string_like)
            .as_deref()
        {
            Some(b"reject-publish") => Overflow::RejectPublish,
            Some(b"reject-publish-dlx") => Overflow::RejectPublishDlx,
            _ => Overflow::DropHead,
        },
        message_ttl: int("x-message-ttl").and_then(|n| u64::try_from(n).ok()),
        single_active: matches!(
            args.inner().get("x-single-active-consumer"),
            Some(AMQPValue::Boolean(true))
        ),
        // Only quorum queues count deliveries (20 by default, RabbitMQ 4); a negative limit
        // means none (rabbit_fifo), 0 allows no redelivery.
        delivery_limit: if is_quorum(args) {
            Some(int("x-delivery-limit").map_or(QUORUM_DELIVERY_LIMIT_DEFAULT, delivery_limit_of))
        } else {
            None
        },
    }
}

/// A quorum queue's delivery limit for an `x-delivery-limit` (or policy) value: a negative
/// one is none ([`crate::queue::machine::DELIVERY_LIMIT_NONE`]); a positive one too large
/// for the machine stays just below that, so it never turns requeue-to-back on.
#[must_use]
pub fn delivery_limit_of(v: i128) -> u32 {
    use crate::queue::machine::DELIVERY_LIMIT_NONE;
    if v < 0 {
        DELIVERY_LIMIT_NONE
    } else {
        u32::try_from(v).map_or(DELIVERY_LIMIT_NONE - 1, |n| n.min(DELIVERY_LIMIT_NONE - 1))
    }
}

/// RabbitMQ 4's default `x-delivery-limit` for quorum queues.
pub const QUORUM_DELIVERY_LIMIT_DEFAULT: u32 = 20;

/// Whether the arguments declare a quorum queue.
#[must_use]
pub fn is_quorum(args: &FieldTable) -> bool {
    QueueType::of(args) == QueueType::Quorum
}

/// Validate a message's `expiration` property as RabbitMQ's `rabbit_basic:parse_expiration`
/// does: an integer number of milliseconds, 0 ..= 2^32-1, nothing after it.
///
/// # Errors
/// 406 `invalid expiration '<value>': <reason>` with RabbitMQ's reason term.
pub fn check_expiration(raw: &[u8]) -> Result<u64, warren_amqp::AmqpError> {
    let text = String::from_utf8_lossy(raw);
    let fail = |term: String| {
        warren_amqp::AmqpError::channel(
            warren_amqp::ReplyCode::PreconditionFailed,
            format!("invalid expiration '{text}': {term}"),
        )
    };
    // Erlang's string:to_integer: an optional sign, then digits; the rest is left over.
    let bytes = text.as_bytes();
    let sign_len = usize::from(matches!(bytes.first(), Some(b'-' | b'+')));
    let digits = bytes[sign_len..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    if digits == 0 {
        return Err(fail("no_integer".into()));
    }
    let (number, rest) = text.split_at(sign_len + digits);
    if !rest.is_empty() {
        return Err(fail(format!("{{leftover_string,\"{rest}\"}}")));
    }
    let n: i128 = number.parse().map_err(|_| fail("no_integer".into()))?;
    if n < 0 {
        return Err(fail(format!("{{value_negative,{n}}}")));
    }
    if n > MAX_EXPIRY_TIMER {
        return Err(fail(format!("{{value_too_large,{n},{MAX_EXPIRY_TIMER}}}")));
    }
    u64::try_from(n).map_err(|_| fail("no_integer".into()))
}

/// `kind 'name' in vhost 'v'`, as RabbitMQ's `rabbit_misc:rs/1`.
#[must_use]
pub fn rs(kind: &str, name: &str, vhost: &str) -> String {
    format!("{kind} '{name}' in vhost '{vhost}'")
}

#[cfg(test)]
mod expiration_tests {
    use super::check_expiration;

    #[test]
    fn expiration_is_parsed_as_rabbitmq_does() {
        assert_eq!(check_expiration(b"60000").unwrap(), 60_000);
        assert_eq!(check_expiration(b"0").unwrap(), 0);
        let text = |raw: &[u8]| check_expiration(raw).unwrap_err().text;
        assert_eq!(
            text(b"abc"),
            "PRECONDITION_FAILED - invalid expiration 'abc': no_integer"
        );
        assert_eq!(
            text(b"10s"),
            "PRECONDITION_FAILED - invalid expiration '10s': {leftover_string,\"s\"}"
        );
        assert_eq!(
            text(b"-5"),
            "PRECONDITION_FAILED - invalid expiration '-5': {value_negative,-5}"
        );
    }
}
