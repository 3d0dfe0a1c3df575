//! Method decoding and encoding.
//!
//! Decoding uses amq-protocol's generated parsers after two checks it does not make: tables are
//! walked with a depth limit first (see [`crate::table`]), and `basic.qos` keeps its
//! `prefetch_size` (which amq-protocol drops) so we can refuse a non-zero one as RabbitMQ does.
//! Server-to-client methods on the delivery path are written by hand, straight into the output
//! buffer, to avoid building owned strings per message.

use amq_protocol::protocol::{AMQPClass, parse_class};
use bytes::{BufMut, BytesMut};

use crate::reply::{AmqpError, ReplyCode};
use crate::table::check_table;

/// A decoded method with its numeric ids.
#[derive(Debug, Clone, PartialEq)]
pub struct Method {
    /// Class id from the frame.
    pub class_id: u16,
    /// Method id from the frame.
    pub method_id: u16,
    /// The decoded arguments.
    pub class: AMQPClass,
}

/// Method ids of basic.publish, the only client method that carries content.
pub const BASIC_PUBLISH: (u16, u16) = (60, 40);

/// Argument layout of the client methods that contain field tables, used to find the tables
/// before handing the payload to amq-protocol. Codes: `s` short, `S` short string, `L` long
/// string, `b` bit octet, `T` table.
fn table_layout(class_id: u16, method_id: u16) -> Option<&'static [u8]> {
    Some(match (class_id, method_id) {
        (10, 11) => b"TSLS",   // connection.start-ok
        (40, 10) => b"sSSbT",  // exchange.declare
        (40, 30) => b"sSSSbT", // exchange.bind
        (40, 40) => b"sSSSbT", // exchange.unbind
        (50, 10) => b"sSbT",   // queue.declare
        (50, 20) => b"sSSSbT", // queue.bind
        (50, 50) => b"sSSST",  // queue.unbind
        (60, 20) => b"sSSbT",  // basic.consume
        _ => return None,
    })
}

fn cannot_decode(class_id: u16, method_id: u16, why: impl std::fmt::Display) -> AmqpError {
    let _ = why;
    AmqpError::connection(ReplyCode::FrameError, "cannot decode method arguments")
        .with_method(class_id, method_id)
}

fn check_tables(args: &[u8], layout: &[u8], depth_max: usize) -> Result<(), String> {
    let mut p = 0usize;
    let short = |p: usize| {
        args.get(p)
            .copied()
            .map(usize::from)
            .ok_or("truncated".to_string())
    };
    for code in layout {
        p = match code {
            b's' => p + 2,
            b'b' => p + 1,
            b'S' => p + 1 + short(p)?,
            b'L' => {
                let b = args.get(p..p + 4).ok_or("truncated")?;
                p + 4 + u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize
            }
            b'T' => check_table(args, p, depth_max).map_err(|e| e.to_string())?,
            _ => unreachable!("layout codes are static"),
        };
        if p > args.len() {
            return Err("truncated".into());
        }
    }
    Ok(())
}

/// Decode a method frame payload.
///
/// Malformed arguments are a connection error (501 FRAME_ERROR, as RabbitMQ's
/// `rabbit_misc:frame_error`); unknown class or method ids are 540 NOT_IMPLEMENTED.
pub fn decode(payload: &[u8], table_depth_max: usize) -> Result<Method, AmqpError> {
    if payload.len() < 4 {
        return Err(AmqpError::connection(
            ReplyCode::FrameError,
            "method frame shorter than its ids",
        ));
    }
    let class_id = u16::from_be_bytes([payload[0], payload[1]]);
    let method_id = u16::from_be_bytes([payload[2], payload[3]]);
    let args = &payload[4..];
    if let Some(layout) = table_layout(class_id, method_id) {
        check_tables(args, layout, table_depth_max)
            .map_err(|why| cannot_decode(class_id, method_id, why))?;
    }
    if (class_id, method_id) == (60, 10) && args.len() >= 4 {
        let prefetch_size = u32::from_be_bytes([args[0], args[1], args[2], args[3]]);
        if prefetch_size != 0 {
            return Err(AmqpError::channel(
                ReplyCode::NotImplemented,
                format!("prefetch_size!=0 ({prefetch_size})"),
            )
            .with_method(60, 10));
        }
    }
    match parse_class(payload) {
        Ok((_rest, class)) => Ok(Method {
            class_id,
            method_id,
            class,
        }),
        Err(_) if !known_method(class_id, method_id) => Err(AmqpError::connection(
            ReplyCode::NotImplemented,
            format!("unknown method {class_id}.{method_id}"),
        )
        .with_method(class_id, method_id)),
        Err(e) => Err(cannot_decode(
            class_id,
            method_id,
            format!("{e:?}").chars().take(80).collect::<String>(),
        )),
    }
}

fn known_method(class_id: u16, method_id: u16) -> bool {
    matches!(
        (class_id, method_id),
        (10, 10..=61)
            | (20, 10..=41)
            | (30, 10 | 11)
            | (40, 10..=51)
            | (50, 10..=51)
            | (60, 10..=120)
            | (85, 10 | 11)
            | (90, 10..=31)
    )
}

/// Serialize a method's payload (class id, method id, arguments) with amq-protocol.
#[must_use]
pub fn encode(class: &AMQPClass) -> Vec<u8> {
    let out = cookie_factory::gen_simple(
        amq_protocol::protocol::gen_class(class),
        Vec::with_capacity(64),
    );
    // Generation into a Vec cannot run out of space; an error here is a programming error in
    // a method we built ourselves.
    out.expect("serializing a method into a Vec")
}

fn put_short_string(buf: &mut BytesMut, s: &[u8]) {
    debug_assert!(s.len() <= 255, "short strings are at most 255 bytes");
    let len = s.len().min(255);
    buf.put_u8(len as u8);
    buf.extend_from_slice(&s[..len]);
}

/// basic.deliver arguments.
pub fn put_basic_deliver(
    buf: &mut BytesMut,
    consumer_tag: &[u8],
    delivery_tag: u64,
    redelivered: bool,
    exchange: &[u8],
    routing_key: &[u8],
) {
    buf.put_u16(60);
    buf.put_u16(60);
    put_short_string(buf, consumer_tag);
    buf.put_u64(delivery_tag);
    buf.put_u8(u8::from(redelivered));
    put_short_string(buf, exchange);
    put_short_string(buf, routing_key);
}

/// basic.get-ok arguments.
pub fn put_basic_get_ok(
    buf: &mut BytesMut,
    delivery_tag: u64,
    redelivered: bool,
    exchange: &[u8],
    routing_key: &[u8],
    message_count: u32,
) {
    buf.put_u16(60);
    buf.put_u16(71);
    buf.put_u64(delivery_tag);
    buf.put_u8(u8::from(redelivered));
    put_short_string(buf, exchange);
    put_short_string(buf, routing_key);
    buf.put_u32(message_count);
}

/// basic.return arguments.
pub fn put_basic_return(
    buf: &mut BytesMut,
    reply_code: u16,
    reply_text: &[u8],
    exchange: &[u8],
    routing_key: &[u8],
) {
    buf.put_u16(60);
    buf.put_u16(50);
    buf.put_u16(reply_code);
    put_short_string(buf, reply_text);
    put_short_string(buf, exchange);
    put_short_string(buf, routing_key);
}

/// basic.ack (publisher confirm) arguments.
pub fn put_basic_ack(buf: &mut BytesMut, delivery_tag: u64, multiple: bool) {
    buf.put_u16(60);
    buf.put_u16(80);
    buf.put_u64(delivery_tag);
    buf.put_u8(u8::from(multiple));
}

/// basic.nack (publisher confirm) arguments.
pub fn put_basic_nack(buf: &mut BytesMut, delivery_tag: u64, multiple: bool) {
    buf.put_u16(60);
    buf.put_u16(120);
    buf.put_u64(delivery_tag);
    buf.put_u8(u8::from(multiple));
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::protocol::{basic, queue};

    #[test]
    fn round_trips_through_amq_protocol() {
        let m = AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "q1".into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: Default::default(),
        }));
        let bytes = encode(&m);
        let d = decode(&bytes, 8).unwrap();
        assert_eq!((d.class_id, d.method_id), (50, 10));
        assert_eq!(d.class, m);
    }

    #[test]
    fn qos_with_prefetch_size_is_not_implemented() {
        let mut b = BytesMut::new();
        b.put_u16(60);
        b.put_u16(10);
        b.put_u32(1);
        b.put_u16(10);
        b.put_u8(0);
        let e = decode(&b, 8).unwrap_err();
        assert_eq!(e.code, ReplyCode::NotImplemented);
        assert_eq!(e.text, "NOT_IMPLEMENTED - prefetch_size!=0 (1)");
    }

    #[test]
    fn deep_tables_and_garbage_are_frame_errors() {
        let mut b = BytesMut::new();
        b.put_u16(50);
        b.put_u16(10);
        b.put_u16(0);
        b.put_u8(1);
        b.put_u8(b'q');
        b.put_u8(0);
        // Announce a 1 GiB table in a tiny frame.
        b.put_u32(1 << 30);
        assert_eq!(decode(&b, 8).unwrap_err().code, ReplyCode::FrameError);
        let unknown = [0u8, 99, 0, 1];
        assert_eq!(
            decode(&unknown, 8).unwrap_err().code,
            ReplyCode::NotImplemented
        );
    }

    #[test]
    fn hand_written_deliver_matches_amq_protocol() {
        let mut b = BytesMut::new();
        put_basic_deliver(&mut b, b"ctag", 7, true, b"ex", b"rk");
        let d = decode(&b, 8).unwrap();
        assert_eq!(
            d.class,
            AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                consumer_tag: "ctag".into(),
                delivery_tag: 7,
                redelivered: true,
                exchange: "ex".into(),
                routing_key: "rk".into(),
            }))
        );
    }

    proptest::proptest! {
        #[test]
        fn decode_never_panics(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)) {
            let _ = decode(&data, 8);
        }
    }
}
