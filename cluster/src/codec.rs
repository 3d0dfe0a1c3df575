//! The binary encoding of log entries, snapshots and RPC frames: bincode (varint integers,
//! byte vectors as length and bytes), with a size limit checked before any allocation, so a
//! corrupt or hostile length cannot make the decoder reserve gigabytes.
//!
//! Chosen over JSON by measurement (docs/clustering.md): JSON wrote each body byte as a decimal
//! number, four bytes a byte, in every log write and on every hop.

use bincode::Options;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// The largest encoded value (a log entry, a snapshot, a frame).
pub const VALUE_MAX: u64 = 256 * 1024 * 1024;

fn options() -> impl Options {
    bincode::DefaultOptions::new().with_limit(VALUE_MAX)
}

/// Encode `value`.
///
/// # Errors
/// When it does not serialize or is over [`VALUE_MAX`].
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, bincode::Error> {
    options().serialize(value)
}

/// Encode `value` into `out` as [`encode`] would (a size pass, then the bytes, with no copy
/// of the value in memory).
///
/// # Errors
/// When it does not serialize, is over [`VALUE_MAX`], or `out` fails.
pub fn encode_into<T: Serialize>(
    out: &mut dyn std::io::Write,
    value: &T,
) -> Result<(), bincode::Error> {
    options().serialize_into(out, value)
}

/// Decode a value [`encode`] wrote.
///
/// # Errors
/// When the bytes are not such a value (truncated, corrupt, or claiming more than
/// [`VALUE_MAX`]).
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, bincode::Error> {
    options().deserialize(bytes)
}

pub use warren_broker::node::replication::raw_bytes;

/// Decode a queue machine, also in the layout written before it had work-queue state
/// ([`QueueMachineV1`](warren_broker::queue::machine::QueueMachineV1)): a snapshot taken by an
/// older member still installs.
///
/// # Errors
/// Neither layout decodes (the error is the current layout's).
pub fn decode_machine<M: DeserializeOwned>(
    bytes: &[u8],
) -> Result<warren_broker::queue::machine::QueueMachine<M>, bincode::Error> {
    decode(bytes).or_else(|e| {
        decode::<warren_broker::queue::machine::QueueMachineV1<M>>(bytes)
            .map(Into::into)
            .map_err(|_| e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Plain {
        body: Vec<u8>,
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Raw {
        #[serde(with = "raw_bytes")]
        body: Vec<u8>,
    }

    #[test]
    fn raw_bytes_encode_as_plain_vectors_do() {
        for len in [0usize, 1, 250, 251, 1024, 70_000] {
            let body: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let plain = encode(&Plain { body: body.clone() }).expect("encodes");
            let raw = encode(&Raw { body: body.clone() }).expect("encodes");
            assert_eq!(plain, raw, "same layout at {len} bytes");
            assert_eq!(decode::<Raw>(&plain).expect("decodes").body, body);
            assert_eq!(decode::<Plain>(&raw).expect("decodes").body, body);
        }
        // Formats without a byte string (JSON) read back too.
        let json = serde_json::to_vec(&Raw {
            body: vec![1, 2, 3],
        })
        .expect("json");
        assert_eq!(
            serde_json::from_slice::<Raw>(&json).expect("json").body,
            vec![1, 2, 3]
        );
    }

    #[test]
    fn bodies_cost_their_length_and_garbage_is_refused() {
        let body = vec![b'x'; 1024];
        let bytes = encode(&body).expect("encodes");
        assert!(bytes.len() < 1024 + 8, "{} bytes", bytes.len());
        assert_eq!(decode::<Vec<u8>>(&bytes).expect("decodes"), body);
        // A length prefix claiming far more than the limit: refused, not allocated.
        let hostile = [0xFD, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x7F];
        assert!(decode::<Vec<u8>>(&hostile).is_err());
        assert!(decode::<Vec<u8>>(&bytes[..100]).is_err(), "truncated");
    }
}
