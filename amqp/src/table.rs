//! Bounds- and depth-checked walking of AMQP field tables and arrays.
//!
//! amq-protocol's parser recurses once per nesting level; a 128 KiB frame can nest tens of
//! thousands of levels and overflow the stack. Every table that reaches that parser is first
//! walked here with an explicit depth limit and with each length prefix checked against the
//! bytes that remain.
//!
//! Field value types accepted (RabbitMQ's set, which differs from the 0-9-1 spec for 's'):
//!
//! | tag | type | size |
//! |-----|------|------|
//! | t b B | bool, i8, u8 | 1 |
//! | s u | i16, u16 | 2 |
//! | I i f | i32, u32, f32 | 4 |
//! | l L d T | i64, u64, f64, timestamp | 8 |
//! | D | decimal (scale u8, value u32) | 5 |
//! | S x | long string, byte array | 4 + n |
//! | F | nested table | 4 + n |
//! | A | array | 4 + n |
//! | V | void | 0 |

use thiserror::Error;

/// Why a table was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TableError {
    /// A length prefix points past the end of the data.
    #[error("field table truncated")]
    Truncated,
    /// A value tag we do not know.
    #[error("unknown field type '{0}'")]
    UnknownType(char),
    /// Tables or arrays nested deeper than the limit.
    #[error("field table nested deeper than {0} levels")]
    TooDeep(usize),
    /// The structure checked out but a value did not decode.
    #[error("field table value does not decode")]
    BadValue,
}

fn need(data: &[u8], pos: usize, n: usize) -> Result<usize, TableError> {
    let end = pos.checked_add(n).ok_or(TableError::Truncated)?;
    if end > data.len() {
        Err(TableError::Truncated)
    } else {
        Ok(end)
    }
}

fn read_u32(data: &[u8], pos: usize) -> Result<(u32, usize), TableError> {
    let end = need(data, pos, 4)?;
    let v = u32::from_be_bytes([data[pos], data[pos + 1], data[pos + 2], data[pos + 3]]);
    Ok((v, end))
}

/// Encode a field table as on the wire (4-byte length + entries), deterministically: the same
/// table always gives the same bytes (entries are kept sorted by amq-protocol).
#[must_use]
pub fn encode_table(table: &amq_protocol::types::FieldTable) -> Vec<u8> {
    cookie_factory::gen_simple(
        amq_protocol::types::generation::gen_field_table(table),
        Vec::with_capacity(64),
    )
    // Generation into a Vec cannot run out of space.
    .expect("serializing a field table into a Vec")
}

/// Decode a field table written by [`encode_table`] (or received on the wire), checking lengths
/// and nesting depth first. Returns the table and the bytes it used.
pub fn decode_table(
    data: &[u8],
    depth_max: usize,
) -> Result<(amq_protocol::types::FieldTable, usize), TableError> {
    let end = check_table(data, 0, depth_max)?;
    let (_, table) = amq_protocol::types::parsing::parse_field_table(&data[..end])
        .map_err(|_| TableError::BadValue)?;
    Ok((table, end))
}

/// Check the table (4-byte length + entries) that starts at `pos`; return the position after it.
pub fn check_table(data: &[u8], pos: usize, depth_max: usize) -> Result<usize, TableError> {
    check_table_at(data, pos, depth_max, 1)
}

fn check_table_at(
    data: &[u8],
    pos: usize,
    depth_max: usize,
    depth: usize,
) -> Result<usize, TableError> {
    if depth > depth_max {
        return Err(TableError::TooDeep(depth_max));
    }
    let (len, start) = read_u32(data, pos)?;
    let end = need(data, start, len as usize)?;
    let inner = &data[..end];
    let mut p = start;
    while p < end {
        let key_len = *inner.get(p).ok_or(TableError::Truncated)? as usize;
        p = need(inner, p + 1, key_len)?;
        p = check_value(inner, p, depth_max, depth)?;
    }
    Ok(end)
}

fn check_array_at(
    data: &[u8],
    pos: usize,
    depth_max: usize,
    depth: usize,
) -> Result<usize, TableError> {
    if depth > depth_max {
        return Err(TableError::TooDeep(depth_max));
    }
    let (len, start) = read_u32(data, pos)?;
    let end = need(data, start, len as usize)?;
    let inner = &data[..end];
    let mut p = start;
    while p < end {
        p = check_value(inner, p, depth_max, depth)?;
    }
    Ok(end)
}

fn check_value(
    data: &[u8],
    pos: usize,
    depth_max: usize,
    depth: usize,
) -> Result<usize, TableError> {
    let tag = *data.get(pos).ok_or(TableError::Truncated)?;
    let p = pos + 1;
    match tag {
        b't' | b'b' | b'B' => need(data, p, 1),
        b's' | b'u' => need(data, p, 2),
        b'I' | b'i' | b'f' => need(data, p, 4),
        b'l' | b'L' | b'd' | b'T' => need(data, p, 8),
        b'D' => need(data, p, 5),
        b'S' | b'x' => {
            let (len, start) = read_u32(data, p)?;
            need(data, start, len as usize)
        }
        b'F' => check_table_at(data, p, depth_max, depth + 1),
        b'A' => check_array_at(data, p, depth_max, depth + 1),
        b'V' => Ok(p),
        other => Err(TableError::UnknownType(char::from(other))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested_tables(levels: usize) -> Vec<u8> {
        // Build from the inside out: innermost is an empty table.
        let mut inner: Vec<u8> = 0u32.to_be_bytes().to_vec();
        for _ in 1..levels {
            let mut entry = vec![1u8, b'k', b'F'];
            entry.extend_from_slice(&inner);
            let mut t = (entry.len() as u32).to_be_bytes().to_vec();
            t.extend_from_slice(&entry);
            inner = t;
        }
        inner
    }

    #[test]
    fn accepts_every_rabbitmq_field_type() {
        let mut entries = Vec::new();
        for (tag, bytes) in [
            (b't', vec![1]),
            (b'b', vec![0xff]),
            (b'B', vec![1]),
            (b's', vec![0, 1]),
            (b'u', vec![0, 1]),
            (b'I', vec![0; 4]),
            (b'i', vec![0; 4]),
            (b'f', vec![0; 4]),
            (b'l', vec![0; 8]),
            (b'd', vec![0; 8]),
            (b'T', vec![0; 8]),
            (b'D', vec![2, 0, 0, 0, 5]),
            (b'S', vec![0, 0, 0, 2, b'h', b'i']),
            (b'x', vec![0, 0, 0, 1, 0xff]),
            (b'A', vec![0, 0, 0, 2, b't', 1]),
            (b'F', vec![0, 0, 0, 0]),
            (b'V', vec![]),
        ] {
            entries.extend_from_slice(&[1, b'k', tag]);
            entries.extend_from_slice(&bytes);
        }
        let mut t = (entries.len() as u32).to_be_bytes().to_vec();
        t.extend_from_slice(&entries);
        assert_eq!(check_table(&t, 0, 8), Ok(t.len()));
    }

    #[test]
    fn depth_is_capped_without_recursion_blowup() {
        assert!(check_table(&nested_tables(8), 0, 8).is_ok());
        assert_eq!(
            check_table(&nested_tables(9), 0, 8),
            Err(TableError::TooDeep(8))
        );
        // Far deeper than the stack could take if we recursed all the way.
        assert_eq!(
            check_table(&nested_tables(20_000), 0, 32),
            Err(TableError::TooDeep(32))
        );
    }

    #[test]
    fn length_prefixes_beyond_the_data_are_refused() {
        let t = [0u8, 0, 0, 10, 1, b'k', b't'];
        assert_eq!(check_table(&t, 0, 8), Err(TableError::Truncated));
        let s = [0u8, 0, 0, 7, 1, b'k', b'S', 0xff, 0xff, 0xff, 0xff];
        assert_eq!(check_table(&s, 0, 8), Err(TableError::Truncated));
        let unknown = [0u8, 0, 0, 3, 1, b'k', b'Z'];
        assert_eq!(
            check_table(&unknown, 0, 8),
            Err(TableError::UnknownType('Z'))
        );
    }

    proptest::proptest! {
        #[test]
        fn never_panics_on_arbitrary_bytes(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let _ = check_table(&data, 0, 8);
        }
    }
}
