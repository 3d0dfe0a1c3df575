//! A stream record's encoding: the message as the log stores it, the filter value, and the
//! `x-stream-offset` header added on delivery.

use super::*;

/// A message's `x-stream-filter-value` header, if it has one (a byte search first: most
/// messages have none, and skip the table parse).
#[must_use]
pub fn filter_value(props: &Properties) -> Option<String> {
    let raw = props.headers_raw()?;
    let key = FILTER_VALUE_HEADER.as_bytes();
    if !raw.windows(key.len()).any(|w| w == key) {
        return None;
    }
    props
        .headers()?
        .inner()
        .get(FILTER_VALUE_HEADER)
        .and_then(crate::args::text_value)
}

/// The record a stream stores for `message`: exchange, routing key, raw properties, body.
#[must_use]
pub fn encode(message: &Message) -> Bytes {
    let (exchange, key) = (message.exchange.as_bytes(), message.routing_key.as_bytes());
    let props = &message.properties.raw;
    let mut b =
        BytesMut::with_capacity(7 + exchange.len() + key.len() + props.len() + message.body.len());
    b.put_u8(RECORD_VERSION);
    // Both are AMQP short strings: at most 255 bytes.
    b.put_u8(u8::try_from(exchange.len()).unwrap_or(u8::MAX));
    b.put_slice(&exchange[..exchange.len().min(255)]);
    b.put_u8(u8::try_from(key.len()).unwrap_or(u8::MAX));
    b.put_slice(&key[..key.len().min(255)]);
    b.put_u32(u32::try_from(props.len()).unwrap_or(u32::MAX));
    b.put_slice(props);
    b.put_slice(&message.body);
    b.freeze()
}

/// The message stored as `record` at `offset`, its properties carrying `x-stream-offset`
/// (None: the record is damaged). The body is shared with the record (no copy).
#[must_use]
pub fn decode(record: &Bytes, offset: u64, table_depth_max: usize) -> Option<Message> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Option<std::ops::Range<usize>> {
        let r = at..at.checked_add(n)?;
        if r.end > record.len() {
            return None;
        }
        at = r.end;
        Some(r)
    };
    if record[take(1)?][0] != RECORD_VERSION {
        return None;
    }
    let n = usize::from(record[take(1)?][0]);
    // Lossy: a name cut at 255 bytes may end inside a character; it must still deliver.
    let exchange = String::from_utf8_lossy(&record[take(n)?]).into_owned();
    let n = usize::from(record[take(1)?][0]);
    let routing_key = String::from_utf8_lossy(&record[take(n)?]).into_owned();
    let len = record[take(4)?].try_into().ok().map(u32::from_be_bytes)?;
    let props = record.slice(take(usize::try_from(len).ok()?)?);
    let body = record.slice(at..);
    let parsed = Properties::parse(props, table_depth_max).ok()?;
    let raw = with_offset_header(&parsed, offset);
    Some(Message {
        exchange,
        routing_key,
        properties: Properties::parse(raw, table_depth_max).ok()?,
        body,
    })
}

/// `props` with an `x-stream-offset` (signed 64-bit, as RabbitMQ sends it) appended to its
/// headers table; a header of that name already there is shadowed (decoders keep the last).
pub(super) fn with_offset_header(props: &Properties, offset: u64) -> Bytes {
    const KEY: &[u8] = b"x-stream-offset";
    let mut entry = Vec::with_capacity(1 + KEY.len() + 9);
    entry.push(u8::try_from(KEY.len()).unwrap_or(u8::MAX));
    entry.extend_from_slice(KEY);
    entry.push(b'l');
    entry.extend_from_slice(&i64::try_from(offset).unwrap_or(i64::MAX).to_be_bytes());
    let old = props
        .headers_raw()
        .map_or(&[][..], |h| &h[4.min(h.len())..]);
    let mut table = Vec::with_capacity(4 + old.len() + entry.len());
    table.extend_from_slice(
        &u32::try_from(old.len() + entry.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    table.extend_from_slice(old);
    table.extend_from_slice(&entry);
    props.rewrite(&table, false)
}
