//! Content-header properties of class basic, read in place.
//!
//! The broker forwards the property bytes exactly as the publisher sent them (so every field type
//! and table key order round-trips byte-exact) and only reads the few fields routing and delivery
//! need. [`Properties::parse`] validates the whole property list once, at publish.
//!
//! Property flags (first 16-bit word, bit 15 first): content-type, content-encoding, headers,
//! delivery-mode, priority, correlation-id, reply-to, expiration, message-id, timestamp, type,
//! user-id, app-id, cluster-id; bit 0 means another flags word follows.

use std::ops::Range;

use bytes::Bytes;

use crate::table::{TableError, check_table};

/// Why a property list was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PropertiesError {
    /// The list is shorter than its flags announce.
    #[error("content header properties truncated")]
    Truncated,
    /// Flags for properties basic does not define.
    #[error("unknown content header property flags 0x{0:04x}")]
    UnknownFlags(u16),
    /// The headers table is malformed.
    #[error("headers table: {0}")]
    Headers(#[from] TableError),
}

const FLAG_CONTENT_TYPE: u16 = 1 << 15;
const FLAG_CONTENT_ENCODING: u16 = 1 << 14;
const FLAG_HEADERS: u16 = 1 << 13;
const FLAG_DELIVERY_MODE: u16 = 1 << 12;
const FLAG_PRIORITY: u16 = 1 << 11;
const FLAG_CORRELATION_ID: u16 = 1 << 10;
const FLAG_REPLY_TO: u16 = 1 << 9;
const FLAG_EXPIRATION: u16 = 1 << 8;
const FLAG_MESSAGE_ID: u16 = 1 << 7;
const FLAG_TIMESTAMP: u16 = 1 << 6;
const FLAG_TYPE: u16 = 1 << 5;
const FLAG_USER_ID: u16 = 1 << 4;
const FLAG_APP_ID: u16 = 1 << 3;
const FLAG_CLUSTER_ID: u16 = 1 << 2;
const FLAGS_KNOWN: u16 = 0xfffc;

/// A validated property list with the positions of the fields the broker reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Properties {
    /// The raw flags + list, forwarded unchanged.
    pub raw: Bytes,
    /// delivery-mode (2 = persistent), if present.
    pub delivery_mode: Option<u8>,
    /// priority, if present.
    pub priority: Option<u8>,
    headers: Option<Range<usize>>,
    /// Where the headers field is, or would be inserted.
    headers_at: usize,
    expiration: Option<Range<usize>>,
    user_id: Option<Range<usize>>,
    reply_to: Option<Range<usize>>,
}

impl Properties {
    /// Validate `raw` (flags + property list) and note where the interesting fields are.
    pub fn parse(raw: Bytes, table_depth_max: usize) -> Result<Self, PropertiesError> {
        let data = &raw[..];
        if data.len() < 2 {
            return Err(PropertiesError::Truncated);
        }
        let flags = u16::from_be_bytes([data[0], data[1]]);
        if flags & !FLAGS_KNOWN != 0 {
            return Err(PropertiesError::UnknownFlags(flags & !FLAGS_KNOWN));
        }
        let mut p = 2usize;
        let mut props = Properties::default();
        let short_string = |p: &mut usize| -> Result<Range<usize>, PropertiesError> {
            let len = *data.get(*p).ok_or(PropertiesError::Truncated)? as usize;
            let start = *p + 1;
            let end = start + len;
            if end > data.len() {
                return Err(PropertiesError::Truncated);
            }
            *p = end;
            Ok(start..end)
        };
        let octet = |p: &mut usize| -> Result<u8, PropertiesError> {
            let v = *data.get(*p).ok_or(PropertiesError::Truncated)?;
            *p += 1;
            Ok(v)
        };
        if flags & FLAG_CONTENT_TYPE != 0 {
            short_string(&mut p)?;
        }
        if flags & FLAG_CONTENT_ENCODING != 0 {
            short_string(&mut p)?;
        }
        props.headers_at = p;
        if flags & FLAG_HEADERS != 0 {
            let end = check_table(data, p, table_depth_max)?;
            props.headers = Some(p..end);
            p = end;
        }
        if flags & FLAG_DELIVERY_MODE != 0 {
            props.delivery_mode = Some(octet(&mut p)?);
        }
        if flags & FLAG_PRIORITY != 0 {
            props.priority = Some(octet(&mut p)?);
        }
        if flags & FLAG_CORRELATION_ID != 0 {
            short_string(&mut p)?;
        }
        if flags & FLAG_REPLY_TO != 0 {
            props.reply_to = Some(short_string(&mut p)?);
        }
        if flags & FLAG_EXPIRATION != 0 {
            props.expiration = Some(short_string(&mut p)?);
        }
        if flags & FLAG_MESSAGE_ID != 0 {
            short_string(&mut p)?;
        }
        if flags & FLAG_TIMESTAMP != 0 {
            if p + 8 > data.len() {
                return Err(PropertiesError::Truncated);
            }
            p += 8;
        }
        if flags & FLAG_TYPE != 0 {
            short_string(&mut p)?;
        }
        if flags & FLAG_USER_ID != 0 {
            props.user_id = Some(short_string(&mut p)?);
        }
        if flags & FLAG_APP_ID != 0 {
            short_string(&mut p)?;
        }
        if flags & FLAG_CLUSTER_ID != 0 {
            short_string(&mut p)?;
        }
        // Trailing bytes after the last property are tolerated, as RabbitMQ does.
        let _ = p;
        props.raw = raw;
        Ok(props)
    }

    /// The same property list with the headers table replaced by `headers` (an encoded table,
    /// length prefix included) and, if `drop_expiration`, without the expiration property:
    /// what a dead-lettered message carries. Every other property is kept byte for byte.
    #[must_use]
    pub fn rewrite(&self, headers: &[u8], drop_expiration: bool) -> Bytes {
        let raw = &self.raw[..];
        if raw.len() < 2 {
            // No property list at all (a default value, never a parsed one): headers alone.
            let mut out = FLAG_HEADERS.to_be_bytes().to_vec();
            out.extend_from_slice(headers);
            return Bytes::from(out);
        }
        let mut flags = u16::from_be_bytes([raw[0], raw[1]]) | FLAG_HEADERS;
        let mut out = Vec::with_capacity(raw.len() + headers.len());
        let after_headers = self.headers.as_ref().map_or(self.headers_at, |h| h.end);
        let (skip_from, skip_to) = match (&self.expiration, drop_expiration) {
            (Some(e), true) => {
                flags &= !FLAG_EXPIRATION;
                // The short string's length octet precedes its text.
                (e.start - 1, e.end)
            }
            _ => (raw.len(), raw.len()),
        };
        out.extend_from_slice(&flags.to_be_bytes());
        out.extend_from_slice(&raw[2..self.headers_at]);
        out.extend_from_slice(headers);
        out.extend_from_slice(&raw[after_headers..skip_from]);
        out.extend_from_slice(&raw[skip_to..]);
        Bytes::from(out)
    }

    /// The same property list with the reply-to property (which must be present) replaced by
    /// `value` (at most 255 bytes): how direct reply-to names the requester.
    #[must_use]
    pub fn with_reply_to(&self, value: &[u8]) -> Bytes {
        let raw = &self.raw[..];
        let Some(r) = &self.reply_to else {
            return self.raw.clone();
        };
        let value = &value[..value.len().min(255)];
        let mut out = Vec::with_capacity(raw.len() + value.len());
        out.extend_from_slice(&raw[..r.start - 1]);
        out.push(u8::try_from(value.len()).unwrap_or(u8::MAX));
        out.extend_from_slice(value);
        out.extend_from_slice(&raw[r.end..]);
        Bytes::from(out)
    }

    /// The raw headers table (length prefix included), if present.
    #[must_use]
    pub fn headers_raw(&self) -> Option<&[u8]> {
        self.headers.clone().map(|r| &self.raw[r])
    }

    /// The headers table decoded (validated for depth at parse time).
    #[must_use]
    pub fn headers(&self) -> Option<amq_protocol::types::FieldTable> {
        let raw = self.headers_raw()?;
        amq_protocol::types::parsing::parse_field_table(raw)
            .ok()
            .map(|(_, t)| t)
    }

    /// The expiration property.
    #[must_use]
    pub fn expiration(&self) -> Option<&[u8]> {
        self.expiration.clone().map(|r| &self.raw[r])
    }

    /// The user-id property.
    #[must_use]
    pub fn user_id(&self) -> Option<&[u8]> {
        self.user_id.clone().map(|r| &self.raw[r])
    }

    /// The reply-to property.
    #[must_use]
    pub fn reply_to(&self) -> Option<&[u8]> {
        self.reply_to.clone().map(|r| &self.raw[r])
    }

    /// Whether the message asks to be persisted (delivery-mode 2).
    #[must_use]
    pub fn persistent(&self) -> bool {
        self.delivery_mode == Some(2)
    }

    /// The correlation-id property (found by walking the list: hash routing is its only
    /// reader, so messages do not carry its position).
    #[must_use]
    pub fn correlation_id(&self) -> Option<&[u8]> {
        self.locate(FLAG_CORRELATION_ID).map(|r| &self.raw[r])
    }

    /// The message-id property.
    #[must_use]
    pub fn message_id(&self) -> Option<&[u8]> {
        self.locate(FLAG_MESSAGE_ID).map(|r| &self.raw[r])
    }

    /// The timestamp property (seconds since the epoch, as AMQP 0-9-1 sends it).
    #[must_use]
    pub fn timestamp(&self) -> Option<u64> {
        let r = self.locate(FLAG_TIMESTAMP)?;
        Some(u64::from_be_bytes(self.raw[r].try_into().ok()?))
    }

    /// Where the value of the property `flag` is, walking the validated list; `None` if the
    /// property is absent (or the list is not one `parse` accepted).
    fn locate(&self, flag: u16) -> Option<Range<usize>> {
        let data = &self.raw[..];
        let flags = u16::from_be_bytes([*data.first()?, *data.get(1)?]);
        if flags & flag == 0 {
            return None;
        }
        let mut p = 2usize;
        let mut bit = FLAG_CONTENT_TYPE;
        while bit > FLAG_CLUSTER_ID / 2 {
            if flags & bit == 0 {
                bit >>= 1;
                continue;
            }
            let len = match bit {
                FLAG_HEADERS => {
                    4 + u32::from_be_bytes(data.get(p..p + 4)?.try_into().ok()?) as usize
                }
                FLAG_DELIVERY_MODE | FLAG_PRIORITY => 1,
                FLAG_TIMESTAMP => 8,
                _ => 1 + *data.get(p)? as usize,
            };
            let value = match bit {
                FLAG_HEADERS | FLAG_DELIVERY_MODE | FLAG_PRIORITY | FLAG_TIMESTAMP => p..p + len,
                _ => p + 1..p + len,
            };
            if value.end > data.len() {
                return None;
            }
            if bit == flag {
                return Some(value);
            }
            p += len;
            bit >>= 1;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_fields_in_place() {
        let mut raw = vec![0u8, 0];
        let flags = FLAG_CONTENT_TYPE | FLAG_HEADERS | FLAG_DELIVERY_MODE | FLAG_USER_ID;
        raw[..2].copy_from_slice(&flags.to_be_bytes());
        raw.extend_from_slice(&[4, b't', b'e', b'x', b't']);
        raw.extend_from_slice(&[0, 0, 0, 5, 1, b'a', b's', 0, 0x01]);
        raw.push(2);
        raw.extend_from_slice(&[5, b'g', b'u', b'e', b's', b't']);
        let p = Properties::parse(Bytes::from(raw.clone()), 8).unwrap();
        assert_eq!(p.delivery_mode, Some(2));
        assert!(p.persistent());
        assert_eq!(p.user_id(), Some(&b"guest"[..]));
        assert_eq!(p.headers_raw().map(<[u8]>::len), Some(9));
        assert_eq!(&p.raw[..], &raw[..]);
    }

    #[test]
    fn finds_the_ids_and_timestamp_hash_routing_reads() {
        use amq_protocol::protocol::BasicProperties;
        use amq_protocol::types::{AMQPValue, FieldTable};
        let mut h = FieldTable::default();
        h.insert("k".into(), AMQPValue::LongInt(1));
        let full = BasicProperties::default()
            .with_content_type("text/plain".into())
            .with_headers(h)
            .with_delivery_mode(2)
            .with_priority(3)
            .with_correlation_id("c-1".into())
            .with_reply_to("r".into())
            .with_expiration("5".into())
            .with_message_id("m-22".into())
            .with_timestamp(1_700_000_000)
            .with_app_id("app".into());
        let raw = cookie_factory::gen_simple(
            amq_protocol::protocol::basic::gen_properties(&full),
            Vec::new(),
        )
        .unwrap();
        let p = Properties::parse(Bytes::from(raw), 8).unwrap();
        assert_eq!(p.correlation_id(), Some(&b"c-1"[..]));
        assert_eq!(p.message_id(), Some(&b"m-22"[..]));
        assert_eq!(p.timestamp(), Some(1_700_000_000));
        let only_id = BasicProperties::default().with_message_id("x".into());
        let raw = cookie_factory::gen_simple(
            amq_protocol::protocol::basic::gen_properties(&only_id),
            Vec::new(),
        )
        .unwrap();
        let p = Properties::parse(Bytes::from(raw), 8).unwrap();
        assert_eq!(p.message_id(), Some(&b"x"[..]));
        assert_eq!(p.correlation_id(), None);
        assert_eq!(p.timestamp(), None);
        assert_eq!(Properties::default().message_id(), None);
    }

    #[test]
    fn rewrite_replaces_headers_and_drops_expiration_keeping_the_rest() {
        use amq_protocol::protocol::BasicProperties;
        use amq_protocol::types::{AMQPValue, FieldTable};
        let mut h = FieldTable::default();
        h.insert("old".into(), AMQPValue::LongInt(1));
        let original = BasicProperties::default()
            .with_content_type("text/plain".into())
            .with_headers(h)
            .with_delivery_mode(2)
            .with_expiration("60000".into())
            .with_message_id("m-1".into())
            .with_app_id("app".into());
        let raw = cookie_factory::gen_simple(
            amq_protocol::protocol::basic::gen_properties(&original),
            Vec::new(),
        )
        .unwrap();
        let p = Properties::parse(Bytes::from(raw), 8).unwrap();
        let mut new_headers = FieldTable::default();
        new_headers.insert("x-death".into(), AMQPValue::LongString("yes".into()));
        let encoded = crate::table::encode_table(&new_headers);
        for drop_expiration in [true, false] {
            let rewritten = p.rewrite(&encoded, drop_expiration);
            let (_, back) =
                amq_protocol::protocol::basic::parse_properties(&rewritten[..]).unwrap();
            assert_eq!(back.headers(), &Some(new_headers.clone()));
            assert_eq!(back.content_type(), original.content_type());
            assert_eq!(back.delivery_mode(), &Some(2));
            assert_eq!(back.message_id(), original.message_id());
            assert_eq!(back.app_id(), original.app_id());
            let expected = if drop_expiration {
                &None
            } else {
                original.expiration()
            };
            assert_eq!(back.expiration(), expected);
        }
        // No headers before: they are inserted in their place.
        let bare = Properties::parse(Bytes::from_static(&[0x10, 0x00, 2]), 8).unwrap();
        let rewritten = bare.rewrite(&encoded, true);
        let (_, back) = amq_protocol::protocol::basic::parse_properties(&rewritten[..]).unwrap();
        assert_eq!(back.headers(), &Some(new_headers));
        assert_eq!(back.delivery_mode(), &Some(2));
    }

    #[test]
    fn truncated_or_unknown_flags_are_refused() {
        let raw = Bytes::from_static(&[0x80, 0x00, 10, b'a']);
        assert_eq!(Properties::parse(raw, 8), Err(PropertiesError::Truncated));
        let raw = Bytes::from_static(&[0x00, 0x01]);
        assert_eq!(
            Properties::parse(raw, 8),
            Err(PropertiesError::UnknownFlags(1))
        );
    }

    proptest::proptest! {
        #[test]
        fn never_panics(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
            let _ = Properties::parse(Bytes::from(data), 8);
        }
    }
}
