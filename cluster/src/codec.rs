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

/// Decode a value [`encode`] wrote.
///
/// # Errors
/// When the bytes are not such a value (truncated, corrupt, or claiming more than
/// [`VALUE_MAX`]).
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, bincode::Error> {
    options().deserialize(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

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
