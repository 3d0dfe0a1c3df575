//! Where a stream consumer starts (`x-stream-offset` on basic.consume) and how long a stream
//! keeps its messages (`x-max-age`): RabbitMQ's forms, read from AMQP field values.
//!
//! - `"first"`, `"last"` (the start of the last chunk), `"next"` (the default);
//! - a non-negative integer: that offset (clamped to what the stream holds);
//! - a timestamp (AMQP's type, POSIX seconds): the chunk published at or just before it;
//! - an interval string (`"1h"`, units `Y M D h m s`): that long ago;
//! - beyond RabbitMQ, a negative integer `-N`: the last N messages.

use amq_protocol::types::AMQPValue;

/// A consumer's starting point, before it is resolved against a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffsetSpec {
    /// The first message the stream still holds.
    First,
    /// The first message of the stream's last chunk (RabbitMQ's "last").
    Last,
    /// The next message published (nothing already there).
    Next,
    /// This offset (clamped to the stream's span).
    Offset(u64),
    /// The chunk published at or just before this time (milliseconds since the epoch).
    Timestamp(u64),
    /// This long before the consumer attaches (milliseconds).
    Ago(u64),
    /// The last N messages (Warren's own: `x-stream-offset: -N`).
    FromEnd(u64),
}

/// Why an `x-stream-offset` (or `x-max-age`) value was refused (RabbitMQ answers 406
/// PRECONDITION_FAILED for a bad consume argument).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// A string that is neither a keyword nor an interval.
    #[error("invalid x-stream-offset: {0}")]
    Offset(String),
    /// An interval that does not parse (`x-max-age`, or an interval offset).
    #[error("invalid interval: {0}")]
    Interval(String),
}

impl OffsetSpec {
    /// Read an `x-stream-offset` value.
    ///
    /// # Errors
    /// [`SpecError`] for a value of another type or an unknown string.
    pub fn from_value(v: &AMQPValue) -> Result<Self, SpecError> {
        match v {
            AMQPValue::Timestamp(secs) => Ok(Self::Timestamp(secs.saturating_mul(1000))),
            AMQPValue::LongString(_) | AMQPValue::ShortString(_) => {
                let s = crate::args::text_value(v).unwrap_or_default();
                match s.as_str() {
                    "first" => Ok(Self::First),
                    "last" => Ok(Self::Last),
                    "next" => Ok(Self::Next),
                    other => parse_interval(other)
                        .map(Self::Ago)
                        .map_err(|_| SpecError::Offset(other.to_string())),
                }
            }
            other => match crate::args::int_value(other) {
                Some(n) if n >= 0 => Ok(Self::Offset(u64::try_from(n).unwrap_or(u64::MAX))),
                Some(n) => Ok(Self::FromEnd(u64::try_from(-n).unwrap_or(u64::MAX))),
                None => Err(SpecError::Offset(format!("{other:?}"))),
            },
        }
    }
}

/// Milliseconds in an interval such as `"7D"`, `"1h"`, `"30m"`, `"10s"`, `"1M"` (30 days),
/// `"1Y"` (365 days): RabbitMQ's `x-max-age` and interval-offset syntax, one number and one
/// unit.
///
/// # Errors
/// [`SpecError::Interval`] for anything else (an empty number, an unknown unit, overflow).
pub fn parse_interval(s: &str) -> Result<u64, SpecError> {
    let bad = || SpecError::Interval(s.to_string());
    let unit = s.chars().last().ok_or_else(bad)?;
    let digits = &s[..s.len() - unit.len_utf8()];
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let seconds: u64 = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3600,
        'D' => 86_400,
        'M' => 30 * 86_400,
        'Y' => 365 * 86_400,
        _ => return Err(bad()),
    };
    n.checked_mul(seconds)
        .and_then(|s| s.checked_mul(1000))
        .ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::types::LongString;

    fn text(s: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(s))
    }

    #[test]
    fn every_form_of_x_stream_offset_reads() {
        assert_eq!(
            OffsetSpec::from_value(&text("first")),
            Ok(OffsetSpec::First)
        );
        assert_eq!(OffsetSpec::from_value(&text("last")), Ok(OffsetSpec::Last));
        assert_eq!(OffsetSpec::from_value(&text("next")), Ok(OffsetSpec::Next));
        assert_eq!(
            OffsetSpec::from_value(&AMQPValue::LongLongInt(5)),
            Ok(OffsetSpec::Offset(5))
        );
        assert_eq!(
            OffsetSpec::from_value(&AMQPValue::ShortShortInt(-10)),
            Ok(OffsetSpec::FromEnd(10))
        );
        assert_eq!(
            OffsetSpec::from_value(&AMQPValue::Timestamp(1_686_519_750)),
            Ok(OffsetSpec::Timestamp(1_686_519_750_000))
        );
        assert_eq!(
            OffsetSpec::from_value(&text("1h")),
            Ok(OffsetSpec::Ago(3_600_000))
        );
        assert!(OffsetSpec::from_value(&text("yesterday")).is_err());
        assert!(OffsetSpec::from_value(&AMQPValue::Boolean(true)).is_err());
    }

    #[test]
    fn intervals_take_one_number_and_one_unit() {
        assert_eq!(parse_interval("7D"), Ok(7 * 86_400_000));
        assert_eq!(parse_interval("30m"), Ok(1_800_000));
        assert_eq!(parse_interval("10s"), Ok(10_000));
        assert_eq!(parse_interval("1M"), Ok(30 * 86_400_000));
        assert_eq!(parse_interval("1Y"), Ok(365 * 86_400_000));
        for bad in ["", "h", "1", "1w", "-1h", "1.5h", "99999999999999999999Y"] {
            assert!(parse_interval(bad).is_err(), "{bad}");
        }
    }
}
