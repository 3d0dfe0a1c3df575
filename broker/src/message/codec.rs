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

/// [`encode_message`] of an entry; a replicated queue's entries are always in memory.
///
/// # Errors
/// A stored entry (only store-backed queues hold them).
pub fn encode_entry(entry: &Entry) -> Result<Vec<u8>, DecodeError> {
    match entry {
        Entry::Mem(m) => Ok(encode_message(m)),
        Entry::Stored { .. } => Err(DecodeError("a stored entry in a replicated queue".into())),
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

/// A replicated queue's snapshot holds its messages in the log's encoding.
impl serde::Serialize for Entry {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let bytes = encode_entry(self).map_err(serde::ser::Error::custom)?;
        s.serialize_bytes(&bytes)
    }
}

impl<'de> serde::Deserialize<'de> for Entry {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // One run of bytes (a plain Vec<u8> would be read a byte at a time).
        let bytes = raw_bytes::deserialize(d)?;
        decode_entry(&bytes).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

    use super::*;

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
    }
}
