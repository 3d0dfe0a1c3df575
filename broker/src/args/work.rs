//! The work-queue arguments and policy keys: claim leases (`x-lease-*`, Warren's own) and
//! delayed retries (`x-delayed-retry-*`: RabbitMQ 4.3's type, min and max, plus Warren's
//! multiplier and jitter). Classic and quorum queues take them; a declare argument wins over
//! a policy's key.
//!
//! | argument | policy key | value | default |
//! |---|---|---|---|
//! | `x-lease-ms` | `lease-ms` | ms, 1..=2^32-1 | 30,000 |
//! | `x-lease-extension-max-ms` | `lease-extension-max-ms` | ms, 1..=2^32-1 | 43,200,000 |
//! | `x-lease-lifetime-max-ms` | `lease-lifetime-max-ms` | ms, 1..=2^32-1 | 43,200,000 |
//! | `x-delayed-retry-type` | `delayed-retry-type` | `disabled`, `all`, `failed`, `returned` | `disabled` |
//! | `x-delayed-retry-min` | `delayed-retry-min` | ms, 0..=2^32-1 | 0 |
//! | `x-delayed-retry-max` | `delayed-retry-max` | ms, 0..=2^32-1 | `min` |
//! | `x-delayed-retry-multiplier` | `delayed-retry-multiplier` | 1.0..=100.0 (absent: linear) | linear |
//! | `x-delayed-retry-jitter` | `delayed-retry-jitter` | percent, 0..=100 | 0 |
//! | `x-message-deduplication` | `message-deduplication` | bool | false |
//! | `x-cache-size` | `cache-size` | keys, 1..=2^32-1 | 100,000 |
//! | `x-cache-ttl` | `cache-ttl` | ms, 1..=2^32-1 | 300,000 |
//! | `x-priority-aging-ms` | `priority-aging-ms` | ms, 1..=2^32-1 | none (strict priority) |

use amq_protocol::types::{AMQPValue, FieldTable};
use serde_json::{Map, Value};

use super::{check_int, int_value, string_like, unacceptable};
use crate::queue::machine::{DedupConfig, LeaseConfig, RetryOn, RetryPolicy, WorkConfig};

/// The longest lease, extension, lifetime or retry delay, ms (RabbitMQ's largest timer).
pub const WORK_MS_MAX: i128 = 4_294_967_295;
/// The largest delayed-retry multiplier.
pub const RETRY_MULTIPLIER_MAX: f64 = 100.0;

/// The arguments this module reads, with their validators, in the order a declare checks
/// them (after RabbitMQ's own): classic and quorum queues take them.
pub(super) const WORK_DECLARE_ARGS: &[(&str, super::Check)] = &[
    ("x-lease-ms", check_lease_ms),
    ("x-lease-extension-max-ms", check_lease_ms),
    ("x-lease-lifetime-max-ms", check_lease_ms),
    ("x-delayed-retry-type", check_retry_type),
    ("x-delayed-retry-min", check_retry_ms),
    ("x-delayed-retry-max", check_retry_ms),
    ("x-delayed-retry-multiplier", check_retry_multiplier),
    ("x-delayed-retry-jitter", check_retry_jitter),
    ("x-message-deduplication", check_bool),
    ("x-cache-size", check_cache_size),
    ("x-cache-ttl", check_lease_ms),
    ("x-priority-aging-ms", check_lease_ms),
];

/// The policy keys this module reads.
pub const WORK_POLICY_KEYS: &[&str] = &[
    "lease-ms",
    "lease-extension-max-ms",
    "lease-lifetime-max-ms",
    "delayed-retry-type",
    "delayed-retry-min",
    "delayed-retry-max",
    "delayed-retry-multiplier",
    "delayed-retry-jitter",
    "message-deduplication",
    "cache-size",
    "cache-ttl",
    "priority-aging-ms",
];

const RETRY_TYPES: &[&str] = &["disabled", "all", "failed", "returned"];

fn check_ms(n: i128, min: i128) -> Result<(), String> {
    if n < min {
        Err(format!("{{value_too_small,{n},{min}}}"))
    } else if n > WORK_MS_MAX {
        Err(format!("{{value_too_large,{n},{WORK_MS_MAX}}}"))
    } else {
        Ok(())
    }
}

/// `x-lease-*`: a positive number of ms.
fn check_lease_ms(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    check_ms(check_int(v)?, 1)
}

/// `x-delayed-retry-min` and `-max`: ms, 0 allowed.
fn check_retry_ms(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    check_ms(check_int(v)?, 0)
}

/// `x-delayed-retry-type`.
fn check_retry_type(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    let s = string_like(v).ok_or_else(|| unacceptable(v))?;
    let s = String::from_utf8_lossy(&s);
    if RETRY_TYPES.contains(&s.as_ref()) {
        Ok(())
    } else {
        Err("invalid_delayed_retry_type".to_string())
    }
}

fn number(v: &AMQPValue) -> Option<f64> {
    match v {
        AMQPValue::Float(f) => Some(f64::from(*f)),
        AMQPValue::Double(d) => Some(*d),
        other => int_value(other).map(|i| i as f64),
    }
}

/// `x-delayed-retry-multiplier`: a number from 1 to [`RETRY_MULTIPLIER_MAX`].
fn check_retry_multiplier(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    let m = number(v).ok_or_else(|| unacceptable(v))?;
    if (1.0..=RETRY_MULTIPLIER_MAX).contains(&m) {
        Ok(())
    } else {
        Err(format!(
            "{{value_out_of_range,{m},1,{RETRY_MULTIPLIER_MAX}}}"
        ))
    }
}

/// `x-delayed-retry-jitter`: percent, 0 to 100.
fn check_retry_jitter(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    let n = check_int(v)?;
    if (0..=100).contains(&n) {
        Ok(())
    } else {
        Err(format!("{{value_out_of_range,{n},0,100}}"))
    }
}

/// `x-message-deduplication`: a bool.
fn check_bool(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    match v {
        AMQPValue::Boolean(_) => Ok(()),
        other => Err(unacceptable(other)),
    }
}

/// `x-cache-size`: at least one key, at most 2^32-1.
fn check_cache_size(v: &AMQPValue, _: &FieldTable) -> Result<(), String> {
    check_ms(check_int(v)?, 1)
}

/// Validate a policy's work-queue keys as `set_policy` reports them.
///
/// # Errors
/// The text for the first bad value.
pub fn check_policy(def: &Map<String, Value>) -> Result<(), String> {
    for key in [
        "lease-ms",
        "lease-extension-max-ms",
        "lease-lifetime-max-ms",
    ] {
        if let Some(v) = def.get(key)
            && v.as_u64()
                .is_none_or(|n| n == 0 || i128::from(n) > WORK_MS_MAX)
        {
            return Err(format!("{key} must be a positive integer (ms)"));
        }
    }
    for key in ["delayed-retry-min", "delayed-retry-max"] {
        if let Some(v) = def.get(key)
            && v.as_u64().is_none_or(|n| i128::from(n) > WORK_MS_MAX)
        {
            return Err(format!("{key} must be a non-negative integer (ms)"));
        }
    }
    if let Some(v) = def.get("delayed-retry-type")
        && v.as_str().is_none_or(|s| !RETRY_TYPES.contains(&s))
    {
        return Err(format!(
            "delayed-retry-type must be one of {}",
            RETRY_TYPES.join(", ")
        ));
    }
    if let Some(v) = def.get("delayed-retry-multiplier")
        && v.as_f64()
            .is_none_or(|m| !(1.0..=RETRY_MULTIPLIER_MAX).contains(&m))
    {
        return Err(format!(
            "delayed-retry-multiplier must be a number from 1 to {RETRY_MULTIPLIER_MAX}"
        ));
    }
    for key in ["cache-size", "cache-ttl", "priority-aging-ms"] {
        if let Some(v) = def.get(key)
            && v.as_u64()
                .is_none_or(|n| n == 0 || i128::from(n) > WORK_MS_MAX)
        {
            return Err(format!("{key} must be a positive integer"));
        }
    }
    if let Some(v) = def.get("message-deduplication")
        && !v.is_boolean()
    {
        return Err("message-deduplication must be true or false".into());
    }
    if let Some(v) = def.get("delayed-retry-jitter")
        && v.as_u64().is_none_or(|n| n > 100)
    {
        return Err("delayed-retry-jitter must be an integer from 0 to 100".into());
    }
    Ok(())
}

/// The work-queue settings of validated declare arguments and a policy's definition (an
/// argument wins over the policy's key; values that do not fit are ignored here).
#[must_use]
pub fn work_config(args: &FieldTable, policy: Option<&Map<String, Value>>) -> WorkConfig {
    let arg = |k: &str| args.inner().get(&format!("x-{k}")[..]);
    let pol = |k: &str| policy.and_then(|d| d.get(k));
    let ms = |k: &str| -> Option<u64> {
        arg(k)
            .and_then(int_value)
            .and_then(|n| u64::try_from(n).ok())
            .or_else(|| pol(k).and_then(Value::as_u64))
    };
    let defaults = LeaseConfig::default();
    let lease = LeaseConfig {
        default_ms: ms("lease-ms").unwrap_or(defaults.default_ms).max(1),
        extension_max_ms: ms("lease-extension-max-ms")
            .unwrap_or(defaults.extension_max_ms)
            .max(1),
        lifetime_max_ms: ms("lease-lifetime-max-ms")
            .unwrap_or(defaults.lifetime_max_ms)
            .max(1),
    };
    let kind = arg("delayed-retry-type")
        .and_then(string_like)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .or_else(|| {
            pol("delayed-retry-type")
                .and_then(Value::as_str)
                .map(str::to_string)
        });
    let on = match kind.as_deref() {
        Some("all") => RetryOn::All,
        Some("failed") => RetryOn::Failed,
        Some("returned") => RetryOn::Returned,
        _ => RetryOn::Disabled,
    };
    let min_ms = ms("delayed-retry-min").unwrap_or(0);
    let multiplier = arg("delayed-retry-multiplier")
        .and_then(number)
        .or_else(|| pol("delayed-retry-multiplier").and_then(Value::as_f64))
        .filter(|m| (1.0..=RETRY_MULTIPLIER_MAX).contains(m));
    let jitter = arg("delayed-retry-jitter")
        .and_then(int_value)
        .and_then(|n| u8::try_from(n).ok())
        .or_else(|| {
            pol("delayed-retry-jitter")
                .and_then(Value::as_u64)
                .and_then(|n| u8::try_from(n).ok())
        })
        .unwrap_or(0)
        .min(100);
    let dedup_defaults = DedupConfig::default();
    let dedup = DedupConfig {
        enabled: match arg("message-deduplication") {
            Some(AMQPValue::Boolean(b)) => *b,
            _ => pol("message-deduplication")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        },
        cache_size: ms("cache-size")
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or(dedup_defaults.cache_size)
            .max(1),
        ttl_ms: ms("cache-ttl").filter(|t| *t > 0).or(dedup_defaults.ttl_ms),
    };
    WorkConfig {
        priority_aging_ms: ms("priority-aging-ms").filter(|t| *t > 0),
        dedup,
        lease,
        retry: RetryPolicy {
            on,
            min_ms,
            max_ms: ms("delayed-retry-max").unwrap_or(min_ms).max(min_ms),
            // In thousandths: 1.0..=100.0 fits.
            multiplier_milli: multiplier.map_or(0, |m| (m * 1000.0).round() as u32),
            jitter_percent: jitter,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::types::{LongString, ShortString};

    fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert(ShortString::from(*k), v.clone());
        }
        t
    }

    /// Arguments set the settings, win over a policy's keys, and the policy fills the rest.
    #[test]
    fn arguments_win_over_policy_keys() {
        let args = table(&[
            ("x-lease-ms", AMQPValue::LongInt(5_000)),
            (
                "x-delayed-retry-type",
                AMQPValue::LongString(LongString::from("failed")),
            ),
            ("x-delayed-retry-min", AMQPValue::LongInt(100)),
            ("x-delayed-retry-multiplier", AMQPValue::Double(2.5)),
        ]);
        let policy: Map<String, Value> = serde_json::from_value(serde_json::json!({
            "lease-ms": 9_000, "delayed-retry-max": 60_000, "delayed-retry-type": "all",
            "delayed-retry-jitter": 10
        }))
        .expect("a map");
        let c = work_config(&args, Some(&policy));
        assert_eq!(c.lease.default_ms, 5_000);
        assert_eq!(c.retry.on, RetryOn::Failed);
        assert_eq!(
            (c.retry.min_ms, c.retry.max_ms, c.retry.multiplier_milli),
            (100, 60_000, 2_500)
        );
        assert_eq!(c.retry.jitter_percent, 10);
        assert_eq!(
            work_config(&FieldTable::default(), None),
            WorkConfig::default()
        );
    }

    /// Out-of-range values are refused with a term naming the bound.
    #[test]
    fn bad_values_are_refused() {
        let t = FieldTable::default();
        assert!(check_lease_ms(&AMQPValue::LongInt(0), &t).is_err());
        assert!(check_lease_ms(&AMQPValue::LongLongInt(1 << 40), &t).is_err());
        assert!(check_lease_ms(&AMQPValue::LongInt(1), &t).is_ok());
        assert!(check_retry_ms(&AMQPValue::LongInt(-1), &t).is_err());
        assert_eq!(
            check_retry_type(&AMQPValue::LongString(LongString::from("sometimes")), &t),
            Err("invalid_delayed_retry_type".into())
        );
        assert!(check_retry_multiplier(&AMQPValue::Double(0.5), &t).is_err());
        assert!(check_retry_jitter(&AMQPValue::LongInt(101), &t).is_err());
        let bad: Map<String, Value> =
            serde_json::from_value(serde_json::json!({"lease-ms": 0})).expect("a map");
        assert!(check_policy(&bad).is_err());
        let good: Map<String, Value> = serde_json::from_value(
            serde_json::json!({"lease-ms": 10, "delayed-retry-multiplier": 2.0}),
        )
        .expect("a map");
        assert_eq!(check_policy(&good), Ok(()));
    }
}
