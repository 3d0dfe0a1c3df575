//! Time as an input: the next deadline, heartbeats sent when the connection is idle, a silent
//! peer dropped after two intervals, and the handshake and close deadlines.

use std::time::Instant;

use super::{Connection, State};
use crate::frame::FrameWriter;

impl Connection {
    /// The transport stopped reading from the peer (output backpressure): the peer's frames
    /// wait in the socket, so it must not be judged silent meanwhile (RabbitMQ pauses its
    /// heartbeat monitor the same way).
    pub fn note_input_paused(&mut self, now: Instant) {
        self.last_recv = now;
    }

    /// Record that bytes were written to the peer at `now` (resets the heartbeat send timer).
    pub fn note_sent(&mut self, now: Instant) {
        self.last_send = now;
    }

    /// The next instant at which [`Connection::handle_timeout`] must run.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            State::AwaitHeader | State::AwaitStartOk | State::AwaitTuneOk | State::AwaitOpen => {
                Some(self.handshake_deadline)
            }
            State::Open => self
                .heartbeat
                .map(|hb| (self.last_send + hb / 2).min(self.last_recv + hb * 2)),
            State::CloseSent { deadline } | State::Lingering { deadline } => Some(deadline),
            State::Closed => None,
        }
    }

    /// Run timers: send a heartbeat when idle, give up on a silent peer, end a stalled handshake
    /// or close.
    pub fn handle_timeout(&mut self, now: Instant, out: &mut FrameWriter) {
        match self.state {
            State::AwaitHeader | State::AwaitStartOk | State::AwaitTuneOk | State::AwaitOpen => {
                if now >= self.handshake_deadline {
                    // RabbitMQ drops the socket on handshake timeout.
                    self.finish();
                }
            }
            State::Open => {
                let Some(hb) = self.heartbeat else { return };
                if now >= self.last_recv + hb * 2 {
                    // Missed heartbeats: RabbitMQ closes the socket without a close method.
                    self.finish();
                    return;
                }
                if now >= self.last_send + hb / 2 {
                    out.heartbeat();
                    self.last_send = now;
                }
            }
            State::CloseSent { deadline } | State::Lingering { deadline } => {
                if now >= deadline {
                    self.finish();
                }
            }
            State::Closed => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::connection::test_support::{drive, handshake};
    use crate::connection::{Connection, ConnectionConfig};
    use crate::frame::{FRAME_HEARTBEAT, FrameWriter};

    #[test]
    fn silent_peer_is_dropped_after_two_heartbeat_intervals() {
        let now = Instant::now();
        let mut c = Connection::new(ConnectionConfig::default(), true, now);
        let mut out = FrameWriter::new();
        let mut input = handshake();
        drive(&mut c, &mut input, &mut out, now);
        c.heartbeat = Some(Duration::from_secs(1));
        c.handle_timeout(now + Duration::from_millis(600), &mut out);
        assert!(c.is_open(), "a heartbeat is due, not a timeout");
        // Ahead of the handshake's frames still waiting to be written.
        assert!(out.as_slice()[..out.urgent()].ends_with(&[
            FRAME_HEARTBEAT,
            0,
            0,
            0,
            0,
            0,
            0,
            crate::frame::FRAME_END
        ]));
        c.handle_timeout(now + Duration::from_millis(2001), &mut out);
        assert!(c.is_closed());
    }
}
