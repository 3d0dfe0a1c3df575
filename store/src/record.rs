//! The message record: what a segment file holds for one stored message (see
//! `docs/storage-format.md` for the byte tables).
//!
//! ```text
//! record  := length:u32 crc32c:u32 payload[length]      (big-endian; crc over the payload)
//! payload := kind:u8 (=1) exchange:shortstr routing_key:shortstr
//!            properties_len:u32 properties[properties_len] body[..]
//! ```

use bytes::{BufMut, Bytes};

/// Bytes before a record's payload: length and checksum.
pub const RECORD_HEADER: usize = 8;
/// Largest payload a record may carry (RabbitMQ's 512 MiB message size cap plus room for the
/// routing fields and properties).
pub const RECORD_MAX: usize = 512 * 1024 * 1024 + 64 * 1024;
/// Payload kind of a message record.
pub const KIND_MESSAGE: u8 = 1;

/// A message as stored: routing information, raw content-header properties and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    /// Exchange it was published to.
    pub exchange: Bytes,
    /// Routing key it was published with.
    pub routing_key: Bytes,
    /// The content header's property flags and property list, byte for byte.
    pub properties: Bytes,
    /// The body.
    pub body: Bytes,
}

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed(pub &'static str);

impl StoredMessage {
    /// Payload length of this message's record.
    #[must_use]
    pub fn payload_len(&self) -> usize {
        1 + 1
            + self.exchange.len()
            + 1
            + self.routing_key.len()
            + 4
            + self.properties.len()
            + self.body.len()
    }

    /// Append the whole record (header + payload) to `out`.
    ///
    /// # Panics
    /// If the exchange or routing key is longer than 255 bytes or the properties longer than
    /// `u32::MAX`: AMQP short strings cannot be, so that is a caller bug.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        let len = u32::try_from(self.payload_len()).expect("record length checked by caller");
        out.put_u32(len);
        out.put_u32(0); // checksum, filled below
        out.put_u8(KIND_MESSAGE);
        put_short(out, &self.exchange);
        put_short(out, &self.routing_key);
        out.put_u32(u32::try_from(self.properties.len()).expect("properties fit a frame"));
        out.put_slice(&self.properties);
        out.put_slice(&self.body);
        let crc = crc32c::crc32c(&out[start + RECORD_HEADER..]);
        out[start + 4..start + 8].copy_from_slice(&crc.to_be_bytes());
    }

    /// Decode a payload whose checksum was already verified. Slices share `payload`'s memory.
    pub fn decode(payload: &Bytes) -> Result<Self, Malformed> {
        let mut at = 0usize;
        let kind = *payload.first().ok_or(Malformed("empty payload"))?;
        if kind != KIND_MESSAGE {
            return Err(Malformed("unknown record kind"));
        }
        at += 1;
        let exchange = take_short(payload, &mut at)?;
        let routing_key = take_short(payload, &mut at)?;
        let plen = payload
            .get(at..at + 4)
            .ok_or(Malformed("truncated properties length"))?;
        let plen = u32::from_be_bytes([plen[0], plen[1], plen[2], plen[3]]) as usize;
        at += 4;
        if payload.len() - at < plen {
            return Err(Malformed("properties run past the record"));
        }
        let properties = payload.slice(at..at + plen);
        at += plen;
        Ok(Self {
            exchange,
            routing_key,
            properties,
            body: payload.slice(at..),
        })
    }
}

fn put_short(out: &mut Vec<u8>, s: &[u8]) {
    out.put_u8(u8::try_from(s.len()).expect("AMQP short strings are at most 255 bytes"));
    out.put_slice(s);
}

fn take_short(payload: &Bytes, at: &mut usize) -> Result<Bytes, Malformed> {
    let n = *payload
        .get(*at)
        .ok_or(Malformed("truncated short string"))? as usize;
    *at += 1;
    if payload.len() - *at < n {
        return Err(Malformed("short string runs past the record"));
    }
    let s = payload.slice(*at..*at + n);
    *at += n;
    Ok(s)
}

/// Checksum of a payload as stored in its record header.
#[must_use]
pub fn checksum(payload: &[u8]) -> u32 {
    crc32c::crc32c(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StoredMessage {
        StoredMessage {
            exchange: Bytes::from_static(b"amq.topic"),
            routing_key: Bytes::from_static(b"a.b"),
            properties: Bytes::from_static(&[0x80, 0x00, 4, b't', b'e', b'x', b't']),
            body: Bytes::from_static(b"hello"),
        }
    }

    #[test]
    fn round_trip() {
        let m = sample();
        let mut out = Vec::new();
        m.encode(&mut out);
        assert_eq!(out.len(), RECORD_HEADER + m.payload_len());
        let payload = Bytes::copy_from_slice(&out[RECORD_HEADER..]);
        let crc = u32::from_be_bytes(out[4..8].try_into().unwrap());
        assert_eq!(checksum(&payload), crc);
        assert_eq!(StoredMessage::decode(&payload).unwrap(), m);
    }

    proptest::proptest! {
        #[test]
        fn decode_never_panics(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            let _ = StoredMessage::decode(&Bytes::from(data));
        }
    }
}
