//! Message properties between AMQP's encoding and the management API's JSON
//! (`{"delivery_mode": 2, "headers": {...}, "content_type": ...}`).

use amq_protocol::protocol::BasicProperties;
use amq_protocol::protocol::basic::{gen_properties, parse_properties};
use amq_protocol::types::ShortString;
use serde_json::{Map, Value, json};

use crate::json::{json_to_table, table_to_json};

/// Encode the API's `properties` object as an AMQP property list.
///
/// # Errors
/// When a field has the wrong type or a header does not convert.
pub fn from_json(v: Option<&Value>) -> Result<Vec<u8>, String> {
    let mut p = BasicProperties::default();
    let Some(Value::Object(m)) = v else {
        return encode(&p);
    };
    let text = |k: &str| -> Result<Option<ShortString>, String> {
        match m.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s.len() <= 255 => Ok(Some(s.as_str().into())),
            Some(Value::Number(n)) => Ok(Some(n.to_string().as_str().into())),
            Some(_) => Err(format!("property {k} must be a string")),
        }
    };
    let octet = |k: &str| -> Result<Option<u8>, String> {
        match m.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| u8::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| format!("property {k} must be an integer 0..255")),
        }
    };
    if let Some(v) = text("content_type")? {
        p = p.with_content_type(v);
    }
    if let Some(v) = text("content_encoding")? {
        p = p.with_content_encoding(v);
    }
    if let Some(h) = m.get("headers").filter(|h| !h.is_null()) {
        p = p.with_headers(json_to_table(h)?);
    }
    if let Some(v) = octet("delivery_mode")? {
        p = p.with_delivery_mode(v);
    }
    if let Some(v) = octet("priority")? {
        p = p.with_priority(v);
    }
    if let Some(v) = text("correlation_id")? {
        p = p.with_correlation_id(v);
    }
    if let Some(v) = text("reply_to")? {
        p = p.with_reply_to(v);
    }
    if let Some(v) = text("expiration")? {
        p = p.with_expiration(v);
    }
    if let Some(v) = text("message_id")? {
        p = p.with_message_id(v);
    }
    if let Some(v) = m.get("timestamp").and_then(Value::as_u64) {
        p = p.with_timestamp(v);
    }
    if let Some(v) = text("type")? {
        p = p.with_type(v);
    }
    if let Some(v) = text("user_id")? {
        p = p.with_user_id(v);
    }
    if let Some(v) = text("app_id")? {
        p = p.with_app_id(v);
    }
    encode(&p)
}

fn encode(p: &BasicProperties) -> Result<Vec<u8>, String> {
    cookie_factory::gen_simple(gen_properties(p), Vec::new()).map_err(|e| e.to_string())
}

/// Decode an AMQP property list into the API's JSON object (absent fields left out).
#[must_use]
pub fn to_json(raw: &[u8]) -> Value {
    let Ok((_, p)) = parse_properties(raw) else {
        return json!({});
    };
    let mut m = Map::new();
    let mut put = |k: &str, v: Option<Value>| {
        if let Some(v) = v {
            m.insert(k.to_string(), v);
        }
    };
    let s = |v: &Option<ShortString>| v.as_ref().map(|s| Value::from(s.as_str()));
    put("content_type", s(p.content_type()));
    put("content_encoding", s(p.content_encoding()));
    put("headers", p.headers().as_ref().map(table_to_json));
    put("delivery_mode", p.delivery_mode().map(Value::from));
    put("priority", p.priority().map(Value::from));
    put("correlation_id", s(p.correlation_id()));
    put("reply_to", s(p.reply_to()));
    put("expiration", s(p.expiration()));
    put("message_id", s(p.message_id()));
    put("timestamp", p.timestamp().map(Value::from));
    put("type", s(p.kind()));
    put("user_id", s(p.user_id()));
    put("app_id", s(p.app_id()));
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

    use super::*;

    #[test]
    fn json_properties_round_trip() {
        let v = json!({"delivery_mode": 2, "content_type": "text/plain",
                       "headers": {"a": 1, "b": "x"}, "priority": 3, "message_id": "m1"});
        assert_eq!(to_json(&from_json(Some(&v)).unwrap()), v);
        assert_eq!(to_json(&from_json(None).unwrap()), json!({}));
        assert!(from_json(Some(&json!({"delivery_mode": 300}))).is_err());
    }
}
