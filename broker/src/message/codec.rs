//! A queued message as a replicated log carries it: the store's record encoding (exchange,
//! routing key, raw properties, body, with a checksum), and serde for [`Entry`] in snapshots.

use std::sync::Arc;

use bytes::Bytes;
use warren_amqp::properties::Properties;
use warren_store::StoredMessage;

use super::{Entry, Message};

/// The stored form of a message (the body is shared, not copied).
#[must_use]
pub fn stored(message: &Message) -> StoredMessage {
    StoredMessage {
        exchange: Bytes::copy_from_slice(message.exchange.as_bytes()),
        routing_key: Bytes::copy_from_slice(message.routing_key.as_bytes()),
        properties: message.properties.raw.clone(),
        body: message.body.clone(),
    }
}

/// A queued message as a replicated log carries it: the store's record encoding (exchange,
/// routing key, raw properties, body, with a checksum).
///
/// # Panics
/// Never for a message that passed the protocol's checks (short strings, bounded size).
#[must_use]
pub fn encode_message(message: &Message) -> Vec<u8> {
    let record = stored(message);
    let mut out = Vec::with_capacity(8 + record.payload_len());
    record.encode(&mut out);
    out
}

/// [`encode_message`] of a message as a queue loaded it (from memory or from the store, whose
/// record is the same encoding), to send to another node.
#[must_use]
pub fn encode_loaded(loaded: &super::Loaded) -> Vec<u8> {
    match loaded {
        super::Loaded::Mem(m) => encode_message(m),
        super::Loaded::Read(record) => {
            let mut out = Vec::with_capacity(8 + record.payload_len());
            record.encode(&mut out);
            out
        }
    }
}

/// Why a replicated message does not decode.
#[derive(Debug, Clone, thiserror::Error)]
#[error("undecodable replicated message: {0}")]
pub struct DecodeError(pub String);

/// The message [`encode_message`] encoded, checksum verified.
///
/// # Errors
/// A damaged or truncated record.
pub fn decode_message(bytes: &[u8]) -> Result<Message, DecodeError> {
    const HEADER: usize = 8;
    let (Some(len), Some(crc), Some(payload)) =
        (bytes.get(0..4), bytes.get(4..8), bytes.get(HEADER..))
    else {
        return Err(DecodeError("truncated".into()));
    };
    let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
    let crc = u32::from_be_bytes([crc[0], crc[1], crc[2], crc[3]]);
    if len != payload.len() || crc32c::crc32c(payload) != crc {
        return Err(DecodeError("checksum or length mismatch".into()));
    }
    let record = StoredMessage::decode(&Bytes::copy_from_slice(payload))
        .map_err(|e| DecodeError(e.0.into()))?;
    let text = |b: &Bytes| {
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError("a name that is not UTF-8".into()))
    };
    Ok(Message {
        exchange: text(&record.exchange)?,
        routing_key: text(&record.routing_key)?,
        properties: Properties::parse(record.properties, warren_amqp::limits::TABLE_DEPTH_MAX)
            .map_err(|e| DecodeError(e.to_string()))?,
        body: record.body,
    })
}

/// The message of a replicated queue's entry (always in memory: the log holds its body).
///
/// # Errors
/// See [`decode_message`].
pub fn decode_entry(bytes: &[u8]) -> Result<Entry, DecodeError> {
    decode_message(bytes).map(|m| Entry::Mem(Arc::new(m)))
}

/// First byte of a snapshot's [`Entry::Logged`]: a message record starts with its length
/// (big-endian), whose first byte is 0 for any record shorter than 16 MiB and never 0xFF.
const LOGGED_TAG: u8 = 0xFF;
/// Bytes of a snapshot's [`Entry::Logged`]: tag, key, size, priority, TTL.
const LOGGED_LEN: usize = 1 + 8 + 4 + 1 + 4;

fn encode_logged(key: u64, size: u32, priority: u8, ttl_ms: u32) -> [u8; LOGGED_LEN] {
    let mut out = [0u8; LOGGED_LEN];
    out[0] = LOGGED_TAG;
    out[1..9].copy_from_slice(&key.to_be_bytes());
    out[9..13].copy_from_slice(&size.to_be_bytes());
    out[13] = priority;
    out[14..18].copy_from_slice(&ttl_ms.to_be_bytes());
    out
}

fn decode_logged(bytes: &[u8]) -> Option<Entry> {
    if bytes.len() != LOGGED_LEN || bytes[0] != LOGGED_TAG {
        return None;
    }
    let u32_at =
        |i: usize| u32::from_be_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    let mut key = [0u8; 8];
    key.copy_from_slice(&bytes[1..9]);
    Some(Entry::Logged {
        key: u64::from_be_bytes(key),
        size: u32_at(9),
        priority: bytes[13],
        ttl_ms: u32_at(14),
    })
}

/// The body length of a record [`encode_message`] made, read from its header alone (no
/// checksum check, no copy): what a replica needs to count a message it does not load.
///
/// # Errors
/// A record too short for the lengths its header gives.
pub fn record_body_len(bytes: &[u8]) -> Result<u32, DecodeError> {
    let bad = || DecodeError("truncated".into());
    let len = bytes.get(0..4).ok_or_else(bad)?;
    let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
    // Payload: kind, exchange (short string), routing key (short string), properties
    // (u32 length), body.
    let mut at = 8 + 1;
    let exchange = *bytes.get(at).ok_or_else(bad)? as usize;
    at += 1 + exchange;
    let routing_key = *bytes.get(at).ok_or_else(bad)? as usize;
    at += 1 + routing_key;
    let plen = bytes.get(at..at + 4).ok_or_else(bad)?;
    let plen = u32::from_be_bytes([plen[0], plen[1], plen[2], plen[3]]) as usize;
    at += 4 + plen;
    let end = 8 + len;
    if end < at || end > bytes.len() {
        return Err(bad());
    }
    u32::try_from(end - at).map_err(|_| bad())
}

/// [`encode_message`] of an entry; a replicated queue's entries are always in memory.
///
/// # Errors
/// A stored entry (only store-backed queues hold them).
pub fn encode_entry(entry: &Entry) -> Result<Vec<u8>, DecodeError> {
    match entry {
        Entry::Mem(m) => Ok(encode_message(m)),
        Entry::Stored { .. } => Err(DecodeError("a stored entry in a replicated queue".into())),
        Entry::Logged { .. } => Err(DecodeError("a logged entry without its body".into())),
    }
}

/// `#[serde(with = "warren_broker::message::codec::raw_bytes")]` for a `Vec<u8>` that is a message body:
/// serde writes a plain `Vec<u8>` element by element (a call per byte, measured as most of a
/// follower's CPU under load), this writes it as one run of bytes. bincode lays both out the
/// same way (a length, then the bytes), so logs written before read back unchanged.
pub mod raw_bytes {
    use serde::{Deserializer, Serializer};

    /// Write `bytes` as one byte string.
    ///
    /// # Errors
    /// The serializer's.
    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(bytes)
    }

    /// Read a byte string (or, from a format without one, a sequence of bytes).
    ///
    /// # Errors
    /// The deserializer's, or a value that is not bytes.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        d.deserialize_byte_buf(Bytes)
    }

    struct Bytes;

    impl<'de> serde::de::Visitor<'de> for Bytes {
        type Value = Vec<u8>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("bytes")
        }

        fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
            Ok(v.to_vec())
        }

        fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
            Ok(v)
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
            // Bounded by what the input holds (the size limit applies to the whole value).
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64 * 1024));
            while let Some(b) = seq.next_element::<u8>()? {
                out.push(b);
            }
            Ok(out)
        }
    }
}

/// A replicated queue's snapshot holds its messages in the log's encoding, or for a logged
/// message its key (the body stays in the log).
impl serde::Serialize for Entry {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if let Entry::Logged {
            key,
            size,
            priority,
            ttl_ms,
        } = self
        {
            return s.serialize_bytes(&encode_logged(*key, *size, *priority, *ttl_ms));
        }
        let bytes = encode_entry(self).map_err(serde::ser::Error::custom)?;
        s.serialize_bytes(&bytes)
    }
}

impl<'de> serde::Deserialize<'de> for Entry {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // One run of bytes (a plain Vec<u8> would be read a byte at a time).
        let bytes = raw_bytes::deserialize(d)?;
        if let Some(logged) = decode_logged(&bytes) {
            return Ok(logged);
        }
        decode_entry(&bytes).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

    use super::*;

    /// A logged entry round-trips through a snapshot as its key alone, and a message record
    /// is never taken for one.
    #[test]
    fn logged_entries_round_trip_as_keys() {
        let logged = Entry::Logged {
            key: (7 << 16) | 3,
            size: 1024,
            priority: 4,
            ttl_ms: crate::message::NO_TTL,
        };
        let bytes = serde_json::to_vec(&logged).unwrap();
        let Entry::Logged {
            key,
            size,
            priority,
            ttl_ms,
        } = serde_json::from_slice(&bytes).unwrap()
        else {
            panic!("not logged");
        };
        assert_eq!(
            (key, size, priority, ttl_ms),
            ((7 << 16) | 3, 1024, 4, u32::MAX)
        );
        assert!(encode_entry(&logged).is_err());
        let m = Entry::Mem(Arc::new(Message {
            exchange: String::new(),
            routing_key: "r".repeat(5),
            properties: Properties::parse(Bytes::from_static(&[0, 0]), 4).unwrap(),
            body: Bytes::from_static(b"0123"),
        }));
        let back: Entry = serde_json::from_slice(&serde_json::to_vec(&m).unwrap()).unwrap();
        assert!(matches!(back, Entry::Mem(_)));
    }

    #[test]
    fn messages_round_trip_and_damage_is_detected() {
        let raw = Bytes::from_static(&[0x10, 0x00, 0x02]); // delivery-mode 2
        let m = Message {
            exchange: "ex".into(),
            routing_key: "rk".into(),
            properties: Properties::parse(raw, 4).unwrap(),
            body: Bytes::from_static(b"hello"),
        };
        let mut bytes = encode_message(&m);
        let back = decode_message(&bytes).unwrap();
        assert_eq!(
            (
                back.exchange.as_str(),
                back.routing_key.as_str(),
                &back.body[..]
            ),
            ("ex", "rk", &b"hello"[..])
        );
        assert!(back.properties.persistent());
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        assert!(decode_message(&bytes).is_err());
        assert!(decode_message(&bytes[..5]).is_err());
        assert_eq!(record_body_len(&bytes).unwrap(), 5);
        assert!(record_body_len(&bytes[..bytes.len() - 1]).is_err());
        assert!(record_body_len(&bytes[..12]).is_err());
    }
}
