//! Client-side byte sequences for tests and fuzz targets of the connection machine.

use amq_protocol::protocol::{AMQPClass, channel, connection};
use amq_protocol::types::{FieldTable, LongString};

use crate::frame::{FrameWriter, PROTOCOL_HEADER};

/// A complete client handshake as guest/guest (PLAIN) into vhost "/", with the given tune-ok
/// values, then channel.open on channel 1.
#[must_use]
pub fn client_handshake(channel_max: u16, frame_max: u32, heartbeat: u16) -> Vec<u8> {
    let mut w = FrameWriter::new();
    w.raw(PROTOCOL_HEADER);
    w.method(
        0,
        &AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: FieldTable::default(),
            mechanism: "PLAIN".into(),
            response: LongString::from(b"\0guest\0guest".to_vec()),
            locale: "en_US".into(),
        })),
    );
    w.method(
        0,
        &AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max,
            frame_max,
            heartbeat,
        })),
    );
    w.method(
        0,
        &AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        })),
    );
    w.method(
        1,
        &AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    );
    w.as_slice().to_vec()
}
