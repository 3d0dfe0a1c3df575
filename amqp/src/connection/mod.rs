//! The connection state machine, sans-IO.
//!
//! Bytes go in through [`Connection::handle_input`]; frames for the peer are written into a
//! [`FrameWriter`]; what the broker must act on comes out of [`Connection::poll_event`]. Time is
//! an input (`now`), so heartbeats and the handshake timeout are testable without a clock.
//!
//! States: `AwaitHeader -> AwaitStartOk -> AwaitTuneOk -> AwaitOpen -> Open -> CloseSent -> Closed`.
//! Channel errors close one channel (`channel.close`, then frames on it are dropped until
//! `channel.close-ok`); connection errors send `connection.close` and everything but
//! `connection.close`/`close-ok` is dropped afterwards, as RabbitMQ does.
//!
//! Layout: this module holds the machine's state and routes each frame by it; `handshake`
//! carries out start / tune / open, `channels` the frames of an open connection, `close` the
//! ways a connection ends, `timers` heartbeats and deadlines. `config` and `access` hold the
//! types the broker configures and answers the machine with (re-exported here).

mod access;
mod channels;
mod close;
mod config;
mod handshake;
#[cfg(test)]
mod test_support;
mod timers;

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use amq_protocol::protocol::{AMQPClass, connection};
use amq_protocol::types::FieldTable;
use bytes::{Buf, BytesMut};

pub use access::{AccessError, Gatekeeper, Login};
pub use config::{
    ConnectionConfig, Mechanism, RABBITMQ_COMPATIBLE_VERSION, ServerIdentity, WARREN_VERSION,
    client_capability, server_properties,
};

use crate::assembler::{Assembler, Command};
use crate::frame::{
    FRAME_HEARTBEAT, FRAME_METHOD, FrameWriter, PROTOCOL_HEADER, RawFrame, decode_frame,
};
use crate::limits;
use crate::method;
use crate::reply::{AmqpError, ReplyCode, Scope};

/// What the broker must act on.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Handshake complete.
    Opened {
        /// Authenticated user.
        user: String,
        /// Vhost opened.
        vhost: String,
        /// Client properties from start-ok.
        client_properties: FieldTable,
    },
    /// The peer opened a channel.
    ChannelOpened(u16),
    /// A complete command on an open channel.
    Command(u16, Box<Command>),
    /// A channel is gone (closed by either side): release what it holds.
    ChannelClosed(u16),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    AwaitHeader,
    AwaitStartOk,
    AwaitTuneOk,
    AwaitOpen,
    Open,
    /// We sent connection.close and wait for close-ok until the deadline.
    CloseSent {
        deadline: Instant,
    },
    /// We answered the peer's connection.close with close-ok. Every channel is released; the
    /// socket stays open until the peer closes it or the deadline passes, so frames the peer
    /// still has in flight (a second close from a concurrent closer, publishes queued ahead of
    /// its close) are read and discarded instead of failing its writes. Each further
    /// connection.close is answered with close-ok again, as RabbitMQ does.
    Lingering {
        deadline: Instant,
    },
    /// Nothing more to read; flush and drop the socket.
    Closed,
}

#[derive(Debug)]
enum ChannelState {
    Open(Box<Assembler>),
    /// We sent channel.close; frames are dropped until close-ok.
    Closing,
}

/// Sans-IO AMQP 0-9-1 server connection.
#[derive(Debug)]
pub struct Connection {
    config: ConnectionConfig,
    state: State,
    peer_is_loopback: bool,
    /// The user name a verified client certificate gives; SASL EXTERNAL is offered only then.
    external_identity: Option<String>,
    user: Option<String>,
    client_properties: FieldTable,
    /// Negotiated frame_max (pre-tune limit until tune-ok).
    frame_max: u32,
    channel_max: u16,
    heartbeat: Option<Duration>,
    channels: HashMap<u16, ChannelState>,
    events: VecDeque<Event>,
    handshake_deadline: Instant,
    last_recv: Instant,
    last_send: Instant,
}

impl Connection {
    /// A connection accepted at `now`.
    #[must_use]
    pub fn new(config: ConnectionConfig, peer_is_loopback: bool, now: Instant) -> Self {
        let handshake_deadline = now + config.handshake_timeout;
        Self {
            config,
            state: State::AwaitHeader,
            peer_is_loopback,
            external_identity: None,
            user: None,
            client_properties: FieldTable::default(),
            frame_max: limits::FRAME_MAX_PRE_TUNE,
            channel_max: 0,
            heartbeat: None,
            channels: HashMap::new(),
            events: VecDeque::new(),
            handshake_deadline,
            last_recv: now,
            last_send: now,
        }
    }

    /// Offer SASL EXTERNAL, logging in as `identity` (taken from the peer's verified TLS
    /// client certificate by the caller).
    #[must_use]
    pub fn with_external_identity(mut self, identity: String) -> Self {
        self.external_identity = Some(identity);
        self
    }

    /// The negotiated heartbeat interval in seconds (0: none).
    #[must_use]
    pub fn heartbeat_s(&self) -> u16 {
        self.heartbeat
            .map_or(0, |d| u16::try_from(d.as_secs()).unwrap_or(u16::MAX))
    }

    /// The negotiated frame_max.
    #[must_use]
    pub fn frame_max(&self) -> u32 {
        self.frame_max
    }

    /// The negotiated channel_max (0 before tune-ok).
    #[must_use]
    pub fn channel_max(&self) -> u16 {
        self.channel_max
    }

    /// Whether the handshake finished and the connection is usable.
    #[must_use]
    pub fn is_open(&self) -> bool {
        self.state == State::Open
    }

    /// Whether the connection is finished; the shell flushes and drops the socket.
    #[must_use]
    pub fn is_closed(&self) -> bool {
        self.state == State::Closed
    }

    /// Whether we answered the peer's connection.close and only wait for it to close the
    /// socket: the session is done, the shell keeps reading (and discarding) until EOF or
    /// [`Connection::poll_timeout`].
    #[must_use]
    pub fn is_lingering(&self) -> bool {
        matches!(self.state, State::Lingering { .. })
    }

    /// Whether the channel is open (not closing) from the peer's point of view.
    #[must_use]
    pub fn channel_is_open(&self, channel: u16) -> bool {
        matches!(self.channels.get(&channel), Some(ChannelState::Open(_)))
    }

    /// The client's properties from start-ok.
    #[must_use]
    pub fn client_properties(&self) -> &FieldTable {
        &self.client_properties
    }

    /// Whether the client announced a capability in its properties.
    #[must_use]
    pub fn client_capability(&self, name: &str) -> bool {
        client_capability(&self.client_properties, name)
    }

    /// The next event for the broker.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Consume complete frames from `input`, stopping after the first frame that produced an
    /// event, so the broker handles each command before later frames change channel state
    /// (frames are processed strictly in order, as RabbitMQ does). Call again, after draining
    /// [`Connection::poll_event`], until it consumes nothing.
    pub fn handle_input(
        &mut self,
        input: &mut BytesMut,
        out: &mut FrameWriter,
        now: Instant,
        gate: &dyn Gatekeeper,
    ) {
        if !input.is_empty() {
            self.last_recv = now;
        }
        loop {
            if !self.events.is_empty() {
                return;
            }
            match self.state {
                State::Closed => {
                    input.clear();
                    return;
                }
                State::AwaitHeader => {
                    if input.len() < PROTOCOL_HEADER.len() {
                        return;
                    }
                    if &input[..8] == PROTOCOL_HEADER {
                        input.advance(8);
                        self.send_start(out);
                        self.state = State::AwaitStartOk;
                    } else {
                        // Wrong protocol: answer with the one we speak, then close.
                        out.raw(PROTOCOL_HEADER);
                        self.state = State::Closed;
                    }
                }
                _ => {
                    let frame = match decode_frame(input, self.frame_max) {
                        Ok(Some(frame)) => frame,
                        Ok(None) => return,
                        Err(e) => {
                            input.clear();
                            self.fail(e, out, now);
                            return;
                        }
                    };
                    if let Err(e) = self.handle_frame(frame, out, now, gate) {
                        self.fail(e, out, now);
                    }
                }
            }
        }
    }

    /// Route an error to channel.close or connection.close.
    ///
    /// Before tune-ok (RabbitMQ's `starting` and `tuning` states) a malformed or unexpected
    /// frame drops the socket without connection.close, as RabbitMQ does; errors about the
    /// expected method's content (refused login, a frame_max above the offer) are still
    /// reported.
    fn fail(&mut self, e: AmqpError, out: &mut FrameWriter, now: Instant) {
        let silent = matches!(self.state, State::AwaitStartOk | State::AwaitTuneOk)
            && matches!(
                e.code,
                ReplyCode::FrameError
                    | ReplyCode::UnexpectedFrame
                    | ReplyCode::CommandInvalid
                    | ReplyCode::SyntaxError
            );
        if silent {
            self.state = State::Closed;
            return;
        }
        match e.scope {
            Scope::Connection => self.close_with(e, out, now),
            Scope::Channel => unreachable!("channel errors are handled with their channel"),
        }
    }

    fn handle_frame(
        &mut self,
        frame: RawFrame,
        out: &mut FrameWriter,
        now: Instant,
        gate: &dyn Gatekeeper,
    ) -> Result<(), AmqpError> {
        if frame.kind == FRAME_HEARTBEAT {
            if frame.channel != 0 {
                return Err(AmqpError::connection(
                    ReplyCode::UnexpectedFrame,
                    "type 8, all octets = <<>>",
                ));
            }
            return Ok(());
        }
        match self.state {
            State::AwaitStartOk | State::AwaitTuneOk | State::AwaitOpen => {
                self.handle_handshake(frame, out, now, gate)
            }
            State::Open => {
                if frame.channel == 0 {
                    self.handle_channel_zero(frame, out, now)
                } else {
                    self.handle_channel_frame(frame, out, gate)
                }
            }
            State::CloseSent { .. } => {
                // Only connection.close / close-ok matter now.
                if frame.channel == 0
                    && frame.kind == FRAME_METHOD
                    && let Ok(m) = method::decode(&frame.payload, self.config.table_depth_max)
                {
                    match m.class {
                        AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => self.finish(),
                        AMQPClass::Connection(connection::AMQPMethod::Close(_)) => {
                            self.answer_peer_close(out, now);
                        }
                        _ => {}
                    }
                }
                Ok(())
            }
            State::Lingering { .. } => {
                if frame.channel == 0
                    && frame.kind == FRAME_METHOD
                    && let Ok(m) = method::decode(&frame.payload, self.config.table_depth_max)
                    && let AMQPClass::Connection(connection::AMQPMethod::Close(_)) = m.class
                {
                    Self::send_close_ok(out);
                }
                Ok(())
            }
            State::AwaitHeader | State::Closed => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{drive, handshake};
    use super::*;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// Arbitrary bytes after a valid handshake never panic the machine, whatever they are.
        #[test]
        fn arbitrary_input_after_handshake_never_panics(
            chunks in proptest::collection::vec(proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64), 0..16),
            framed in proptest::prelude::any::<bool>(),
        ) {
            let now = Instant::now();
            let mut c = Connection::new(ConnectionConfig::default(), true, now);
            let mut out = FrameWriter::new();
            let mut input = handshake();
            drive(&mut c, &mut input, &mut out, now);
            for chunk in chunks {
                if framed {
                    // Well-framed garbage reaches the method decoder and the assembler.
                    let kind = chunk.first().copied().unwrap_or(1) % 4;
                    input.extend_from_slice(&[kind.max(1), 0, 1]);
                    input.extend_from_slice(&(chunk.len() as u32).to_be_bytes());
                    input.extend_from_slice(&chunk);
                    input.extend_from_slice(&[crate::frame::FRAME_END]);
                } else {
                    input.extend_from_slice(&chunk);
                }
                drive(&mut c, &mut input, &mut out, now);
            }
        }
    }
}
