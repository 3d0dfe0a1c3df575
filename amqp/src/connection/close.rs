//! Ending a connection: connection.close with an error (then waiting for close-ok), answering
//! the peer's close and lingering until it drops the socket, releasing every channel, and
//! the socket going away.

use std::time::{Duration, Instant};

use amq_protocol::protocol::{AMQPClass, connection};
use amq_protocol::types::ShortString;

use super::{ChannelState, Connection, Event, State};
use crate::frame::FrameWriter;
use crate::limits;
use crate::reply::AmqpError;

impl Connection {
    /// Close the connection with `e` (a connection error, or 320 on shutdown).
    pub fn close_with(&mut self, e: AmqpError, out: &mut FrameWriter, now: Instant) {
        if matches!(
            self.state,
            State::CloseSent { .. } | State::Lingering { .. } | State::Closed
        ) {
            return;
        }
        if self.state == State::AwaitHeader {
            self.state = State::Closed;
            return;
        }
        out.method(
            0,
            &AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: e.code.code(),
                reply_text: ShortString::from(e.text),
                class_id: e.class_id,
                method_id: e.method_id,
            })),
        );
        self.release_channels();
        self.state = State::CloseSent {
            deadline: now + Duration::from_millis(limits::CLOSE_OK_TIMEOUT_MS),
        };
    }

    fn release_channels(&mut self) {
        let mut ids: Vec<u16> = self
            .channels
            .drain()
            .filter_map(|(id, st)| matches!(st, ChannelState::Open(_)).then_some(id))
            .collect();
        ids.sort_unstable();
        self.events
            .extend(ids.into_iter().map(Event::ChannelClosed));
    }

    /// The peer sent connection.close: answer close-ok, release every channel and linger
    /// until the peer closes the socket (see [`State::Lingering`]).
    pub(super) fn answer_peer_close(&mut self, out: &mut FrameWriter, now: Instant) {
        Self::send_close_ok(out);
        self.release_channels();
        // RabbitMQ waits for the heartbeat interval when it is shorter than its own bound.
        let linger_max = Duration::from_millis(limits::CLOSE_LINGER_MAX_MS);
        let linger = self.heartbeat.map_or(linger_max, |hb| hb.min(linger_max));
        self.state = State::Lingering {
            deadline: now + linger,
        };
    }

    pub(super) fn send_close_ok(out: &mut FrameWriter) {
        out.method(
            0,
            &AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
        );
    }

    pub(super) fn finish(&mut self) {
        self.release_channels();
        self.state = State::Closed;
    }

    /// The socket is gone: every channel is released.
    pub fn handle_disconnect(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use amq_protocol::protocol::{AMQPClass, connection};
    use bytes::BytesMut;

    use crate::connection::test_support::{client_frames, drive, handshake};
    use crate::connection::{Connection, ConnectionConfig};
    use crate::frame::FrameWriter;
    use crate::method;

    fn connection_close() -> AMQPClass {
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        }))
    }

    #[test]
    fn peer_close_lingers_answering_each_close_until_the_deadline() {
        let now = Instant::now();
        let mut c = Connection::new(ConnectionConfig::default(), true, now);
        let mut out = FrameWriter::new();
        let mut input = handshake();
        drive(&mut c, &mut input, &mut out, now);
        c.heartbeat = Some(Duration::from_secs(5));
        out.consume(out.pending());
        let mut input = client_frames(|w| {
            w.method(0, &connection_close());
            w.method(0, &connection_close());
        });
        drive(&mut c, &mut input, &mut out, now);
        assert!(c.is_lingering() && !c.is_open() && !c.is_closed());
        let mut written = BytesMut::from(out.as_slice());
        for _ in 0..2 {
            let f = crate::frame::decode_frame(&mut written, u32::MAX)
                .ok()
                .flatten()
                .expect("a close-ok for each close");
            let m = method::decode(&f.payload, 8).expect("decodes");
            assert!(matches!(
                m.class,
                AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))
            ));
        }
        assert!(written.is_empty(), "nothing but the two close-oks");
        // The heartbeat interval (5 s) is shorter than CLOSE_LINGER_MAX_MS, so it bounds the wait.
        assert_eq!(c.poll_timeout(), Some(now + Duration::from_secs(5)));
        c.handle_timeout(now + Duration::from_secs(4), &mut out);
        assert!(c.is_lingering());
        c.handle_timeout(now + Duration::from_secs(5), &mut out);
        assert!(c.is_closed());
    }
}
