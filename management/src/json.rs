//! AMQP field tables to and from the JSON the management API speaks.

use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString};
use serde_json::{Map, Number, Value};

/// A field table as a JSON object (strings as text, numbers as numbers, nested as nested).
#[must_use]
pub fn table_to_json(t: &FieldTable) -> Value {
    Value::Object(
        t.inner()
            .iter()
            .map(|(k, v)| (k.as_str().to_string(), value_to_json(v)))
            .collect(),
    )
}

fn value_to_json(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(n) => Value::from(*n),
        AMQPValue::ShortShortUInt(n) => Value::from(*n),
        AMQPValue::ShortInt(n) => Value::from(*n),
        AMQPValue::ShortUInt(n) => Value::from(*n),
        AMQPValue::LongInt(n) => Value::from(*n),
        AMQPValue::LongUInt(n) => Value::from(*n),
        AMQPValue::LongLongInt(n) => Value::from(*n),
        AMQPValue::Timestamp(n) => Value::from(*n),
        AMQPValue::Float(f) => Number::from_f64(f64::from(*f)).map_or(Value::Null, Value::Number),
        AMQPValue::Double(f) => Number::from_f64(*f).map_or(Value::Null, Value::Number),
        AMQPValue::ShortString(s) => Value::String(s.as_str().to_string()),
        AMQPValue::LongString(s) => {
            Value::String(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        AMQPValue::ByteArray(b) => {
            Value::String(String::from_utf8_lossy(b.as_slice()).into_owned())
        }
        AMQPValue::FieldTable(t) => table_to_json(t),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(value_to_json).collect()),
        AMQPValue::DecimalValue(_) | AMQPValue::Void => Value::Null,
    }
}

/// A JSON object as a field table (integers as signed 64-bit, as RabbitMQ's management
/// plugin converts them).
///
/// # Errors
/// When `v` is not an object or holds `null`.
pub fn json_to_table(v: &Value) -> Result<FieldTable, String> {
    let Value::Object(map) = v else {
        return Err("arguments must be an object".into());
    };
    object_to_table(map)
}

fn object_to_table(map: &Map<String, Value>) -> Result<FieldTable, String> {
    let mut t = FieldTable::default();
    for (k, v) in map {
        let key = amq_protocol::types::ShortString::try_new(k.clone())
            .map_err(|_| format!("argument name over 255 bytes: {k:.40}..."))?;
        t.insert(key, json_to_value(v)?);
    }
    Ok(t)
}

fn json_to_value(v: &Value) -> Result<AMQPValue, String> {
    Ok(match v {
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().unwrap_or_default()),
        },
        Value::String(s) => AMQPValue::LongString(LongString::from(s.as_bytes().to_vec())),
        Value::Array(a) => {
            let mut arr = FieldArray::default();
            for item in a {
                arr.push(json_to_value(item)?);
            }
            AMQPValue::FieldArray(arr)
        }
        Value::Object(m) => AMQPValue::FieldTable(object_to_table(m)?),
        Value::Null => return Err("null is not a valid argument value".into()),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

    use super::*;

    #[test]
    fn round_trip_of_common_arguments() {
        let v = serde_json::json!({
            "x-max-length": 10,
            "x-queue-type": "quorum",
            "x-single-active-consumer": true,
            "nested": {"a": [1, "b"]}
        });
        let t = json_to_table(&v).unwrap();
        assert_eq!(table_to_json(&t), v);
        assert!(json_to_table(&serde_json::json!({"x": null})).is_err());
        assert!(json_to_table(&serde_json::json!([1])).is_err());
    }
}
