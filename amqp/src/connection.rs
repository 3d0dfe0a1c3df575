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

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use amq_protocol::protocol::{AMQPClass, channel, connection};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use bytes::{Buf, BytesMut};

use crate::assembler::{Assembler, AssemblyLimits, Command};
use crate::frame::{
    FRAME_HEARTBEAT, FRAME_METHOD, FrameWriter, PROTOCOL_HEADER, RawFrame, decode_frame,
};
use crate::limits::{self, ConnectionLimits};
use crate::method;
use crate::reply::{AmqpError, ReplyCode, Scope};

/// What a successful login yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Login {
    /// The authenticated user name.
    pub user: String,
}

/// Why a login or vhost open was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// Wrong credentials, unknown user, or a user not allowed from this peer.
    #[error("login refused")]
    LoginRefused,
    /// The vhost does not exist.
    #[error("vhost {0} not found")]
    VhostNotFound(String),
    /// A limit refuses it; the text is RabbitMQ's.
    #[error("{0}")]
    Limit(String),
    /// The user may not use the vhost.
    #[error("access to vhost '{vhost}' refused for user '{user}'")]
    VhostRefused {
        /// The vhost asked for.
        vhost: String,
        /// The user.
        user: String,
    },
}

/// Answers the questions the handshake asks of the broker.
pub trait Gatekeeper: Send + Sync {
    /// Check a user name and password. `peer_is_loopback` lets loopback-only users (guest) in.
    fn login(
        &self,
        user: &str,
        password: &[u8],
        peer_is_loopback: bool,
    ) -> Result<Login, AccessError>;
    /// Log in a user whose identity a verified TLS client certificate established (SASL
    /// EXTERNAL): the user must exist; no password is checked; loopback-only users still
    /// need a loopback peer.
    fn login_external(&self, user: &str, peer_is_loopback: bool) -> Result<Login, AccessError>;
    /// Check that the vhost exists and the user may use it (and count the connection against
    /// the vhost's and the user's limits).
    fn open_vhost(&self, user: &str, vhost: &str) -> Result<(), AccessError>;
    /// A channel is about to open for `user`: refuse it over the user's channel limit, count
    /// it otherwise (the broker uncounts it when the channel closes).
    fn open_channel(&self, _user: &str) -> Result<(), AccessError> {
        Ok(())
    }
}

/// Static configuration of the connection machine.
#[derive(Debug, Clone)]
pub struct ConnectionConfig {
    /// Limits offered in tune and enforced.
    pub limits: ConnectionLimits,
    /// Deepest field-table nesting accepted.
    pub table_depth_max: usize,
    /// The server-properties table sent in connection.start.
    pub server_properties: FieldTable,
    /// Handshake deadline.
    pub handshake_timeout: Duration,
    /// SASL mechanisms offered, in order (RabbitMQ's `auth_mechanisms`, `PLAIN AMQPLAIN` by
    /// default). `EXTERNAL` is offered only where a verified client certificate gives an
    /// identity; a mechanism not listed is refused as an unknown one.
    pub mechanisms: Vec<Mechanism>,
}

/// A SASL mechanism Warren implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mechanism {
    /// `PLAIN` (RFC 4616).
    Plain,
    /// `AMQPLAIN` (a field table with LOGIN and PASSWORD).
    Amqplain,
    /// `EXTERNAL`: the identity of the verified TLS client certificate.
    External,
}

impl Mechanism {
    /// Its name on the wire.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Plain => "PLAIN",
            Self::Amqplain => "AMQPLAIN",
            Self::External => "EXTERNAL",
        }
    }

    /// The mechanism of that name.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Plain, Self::Amqplain, Self::External]
            .into_iter()
            .find(|m| m.name() == name)
    }

    /// RabbitMQ's default `auth_mechanisms`.
    pub const DEFAULT: [Mechanism; 2] = [Mechanism::Plain, Mechanism::Amqplain];
}

impl Default for ConnectionConfig {
    fn default() -> Self {
        Self {
            limits: ConnectionLimits::default(),
            table_depth_max: limits::TABLE_DEPTH_MAX,
            server_properties: server_properties(&ServerIdentity::default(), "warren"),
            handshake_timeout: Duration::from_millis(limits::HANDSHAKE_TIMEOUT_MS),
            mechanisms: Mechanism::DEFAULT.to_vec(),
        }
    }
}

/// What the broker calls itself in connection.start's `product` and `version` (and the
/// management API's `product_name` / `product_version`).
///
/// The default is RabbitMQ's name and the version whose behaviour Warren follows, because
/// clients decide behaviour from it: kombu's `qos_semantics_matches_spec` applies prefetch
/// per consumer only when `product == "RabbitMQ"`, which changes how Celery workers prefetch.
/// Warren's own name and version are always in `platform` and `information`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerIdentity {
    /// `product` (RabbitMQ's `rabbit:product_name()`).
    pub product: String,
    /// `version` (RabbitMQ's `rabbit:product_version()`).
    pub version: String,
}

/// The RabbitMQ release whose observable behaviour Warren matches.
pub const RABBITMQ_COMPATIBLE_VERSION: &str = "4.2.0";

/// Warren's own version.
pub const WARREN_VERSION: &str = env!("CARGO_PKG_VERSION");

impl Default for ServerIdentity {
    fn default() -> Self {
        Self {
            product: "RabbitMQ".into(),
            version: RABBITMQ_COMPATIBLE_VERSION.into(),
        }
    }
}

/// The server-properties table with RabbitMQ's keys and capabilities.
#[must_use]
pub fn server_properties(identity: &ServerIdentity, cluster_name: &str) -> FieldTable {
    let mut caps = FieldTable::default();
    for cap in [
        "publisher_confirms",
        "exchange_exchange_bindings",
        "basic.nack",
        "consumer_cancel_notify",
        "connection.blocked",
        "consumer_priorities",
        "authentication_failure_close",
        "per_consumer_qos",
        "direct_reply_to",
    ] {
        caps.insert(cap.into(), AMQPValue::Boolean(true));
    }
    let mut t = FieldTable::default();
    let s = |v: &str| AMQPValue::LongString(LongString::from(v.as_bytes().to_vec()));
    t.insert("capabilities".into(), AMQPValue::FieldTable(caps));
    t.insert("cluster_name".into(), s(cluster_name));
    t.insert("copyright".into(), s("Copyright (c) the Warren authors"));
    t.insert(
        "information".into(),
        s(&format!(
            "Warren {WARREN_VERSION}, an AMQP 0-9-1 broker compatible with RabbitMQ \
             {RABBITMQ_COMPATIBLE_VERSION}. Licensed under the Apache License 2.0."
        )),
    );
    t.insert(
        "platform".into(),
        s(&format!(
            "Warren {WARREN_VERSION} (Rust, {})",
            std::env::consts::OS
        )),
    );
    t.insert("product".into(), s(&identity.product));
    t.insert("version".into(), s(&identity.version));
    t
}

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

    fn expect_method(&self, frame: &RawFrame, expected: &str) -> Result<method::Method, AmqpError> {
        if frame.kind != FRAME_METHOD || frame.channel != 0 {
            if self.state == State::AwaitOpen {
                // RabbitMQ's text for anything but connection.open while opening.
                return Err(AmqpError::connection(
                    ReplyCode::UnexpectedFrame,
                    format!(
                        "type {}, all octets = {}",
                        frame.kind,
                        crate::frame::erlang_binary(&frame.payload)
                    ),
                ));
            }
            return Err(AmqpError::connection(
                ReplyCode::CommandInvalid,
                format!("expected '{expected}'"),
            ));
        }
        method::decode(&frame.payload, self.config.table_depth_max)
            .map_err(AmqpError::into_connection)
    }

    fn handle_handshake(
        &mut self,
        frame: RawFrame,
        out: &mut FrameWriter,
        now: Instant,
        gate: &dyn Gatekeeper,
    ) -> Result<(), AmqpError> {
        let expected = match self.state {
            State::AwaitStartOk => "connection.start_ok",
            State::AwaitTuneOk => "connection.tune_ok",
            _ => "connection.open",
        };
        let m = self.expect_method(&frame, expected)?;
        match (self.state, m.class) {
            (_, AMQPClass::Connection(connection::AMQPMethod::Close(_))) => {
                // Before connection.open there is nothing in flight worth waiting for, and a
                // peer that has not logged in must not hold a socket for the linger time.
                Self::send_close_ok(out);
                self.finish();
                Ok(())
            }
            (
                State::AwaitStartOk,
                AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)),
            ) => {
                self.client_properties = start_ok.client_properties;
                let mechanism = start_ok.mechanism.as_str().to_string();
                let offered = Mechanism::from_name(&mechanism).filter(|m| self.offers(*m));
                let credentials = match (offered, &self.external_identity) {
                    (Some(Mechanism::Plain), _) => parse_plain(start_ok.response.as_bytes()),
                    (Some(Mechanism::Amqplain), _) => {
                        parse_amqplain(start_ok.response.as_bytes(), self.config.table_depth_max)
                    }
                    (Some(Mechanism::External), Some(identity)) => {
                        Some((identity.clone(), Vec::new()))
                    }
                    _ => {
                        // RabbitMQ sends no close method for an unknown mechanism; it drops the socket.
                        self.state = State::Closed;
                        return Ok(());
                    }
                };
                let login =
                    credentials
                        .ok_or(AccessError::LoginRefused)
                        .and_then(|(user, pass)| {
                            if mechanism == "EXTERNAL" {
                                gate.login_external(&user, self.peer_is_loopback)
                            } else {
                                gate.login(&user, &pass, self.peer_is_loopback)
                            }
                        });
                match login {
                    Ok(login) => {
                        self.user = Some(login.user);
                        let l = self.config.limits;
                        out.method(
                            0,
                            &AMQPClass::Connection(connection::AMQPMethod::Tune(
                                connection::Tune {
                                    channel_max: l.channel_max,
                                    frame_max: l.frame_max,
                                    heartbeat: l.heartbeat_s,
                                },
                            )),
                        );
                        self.state = State::AwaitTuneOk;
                        Ok(())
                    }
                    Err(_) => {
                        let e = AmqpError::connection(
                            ReplyCode::AccessRefused,
                            format!(
                                "Login was refused using authentication mechanism {mechanism}. For details see the broker logfile."
                            ),
                        );
                        if self.client_capability("authentication_failure_close") {
                            self.close_with(e, out, now);
                        } else {
                            // Clients without the capability expect the socket to be dropped.
                            self.state = State::Closed;
                        }
                        Ok(())
                    }
                }
            }
            (
                State::AwaitTuneOk,
                AMQPClass::Connection(connection::AMQPMethod::TuneOk(tune_ok)),
            ) => {
                let l = self.config.limits;
                let frame_max = negotiate(
                    "frame_max",
                    tune_ok.frame_max,
                    limits::FRAME_MIN_SIZE,
                    l.frame_max,
                )?;
                let channel_max = negotiate(
                    "channel_max",
                    u32::from(tune_ok.channel_max),
                    1,
                    u32::from(l.channel_max),
                )?;
                self.frame_max = frame_max;
                out.set_frame_max(frame_max);
                self.channel_max = u16::try_from(channel_max).unwrap_or(l.channel_max);
                self.heartbeat = (tune_ok.heartbeat > 0)
                    .then(|| Duration::from_secs(u64::from(tune_ok.heartbeat)));
                self.state = State::AwaitOpen;
                Ok(())
            }
            (State::AwaitOpen, AMQPClass::Connection(connection::AMQPMethod::Open(open))) => {
                let user = self.user.clone().unwrap_or_default();
                let vhost = open.virtual_host.as_str().to_string();
                gate.open_vhost(&user, &vhost).map_err(|e| {
                    AmqpError::connection(ReplyCode::NotAllowed, e.to_string()).with_method(10, 40)
                })?;
                out.method(
                    0,
                    &AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
                );
                self.state = State::Open;
                self.events.push_back(Event::Opened {
                    user,
                    vhost,
                    client_properties: self.client_properties.clone(),
                });
                Ok(())
            }
            _ => Err(AmqpError::connection(
                ReplyCode::CommandInvalid,
                format!("expected '{expected}'"),
            )
            .with_method(m.class_id, m.method_id)),
        }
    }

    fn handle_channel_zero(
        &mut self,
        frame: RawFrame,
        out: &mut FrameWriter,
        now: Instant,
    ) -> Result<(), AmqpError> {
        if frame.kind != FRAME_METHOD {
            return Err(AmqpError::connection(
                ReplyCode::UnexpectedFrame,
                format!("type {}, all octets = <<>>", frame.kind),
            ));
        }
        let m = method::decode(&frame.payload, self.config.table_depth_max)
            .map_err(AmqpError::into_connection)?;
        match m.class {
            AMQPClass::Connection(connection::AMQPMethod::Close(_)) => {
                self.answer_peer_close(out, now);
                Ok(())
            }
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => Ok(()),
            AMQPClass::Connection(connection::AMQPMethod::UpdateSecret(_)) => {
                out.method(
                    0,
                    &AMQPClass::Connection(connection::AMQPMethod::UpdateSecretOk(
                        connection::UpdateSecretOk {},
                    )),
                );
                Ok(())
            }
            AMQPClass::Connection(
                connection::AMQPMethod::Blocked(_) | connection::AMQPMethod::Unblocked(_),
            ) => Ok(()),
            _ => {
                let _ = now;
                Err(AmqpError::connection(
                    ReplyCode::ChannelError,
                    "unexpected method in connection state running",
                )
                .with_method(m.class_id, m.method_id))
            }
        }
    }

    fn handle_channel_frame(
        &mut self,
        frame: RawFrame,
        out: &mut FrameWriter,
        gate: &dyn Gatekeeper,
    ) -> Result<(), AmqpError> {
        let ch = frame.channel;
        let limits = AssemblyLimits {
            message_size_max: self.config.limits.message_size_max,
            table_depth_max: self.config.table_depth_max,
        };
        match self.channels.get_mut(&ch) {
            None => {
                if frame.kind == FRAME_METHOD
                    && let Ok(m) = method::decode(&frame.payload, self.config.table_depth_max)
                    && let AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) = m.class
                {
                    // A close-ok for a channel already gone (the two sides' closes crossed
                    // and were both answered): nothing is owed, and it must not cost the peer
                    // its other channels.
                    return Ok(());
                }
                if frame.kind != FRAME_METHOD {
                    return Err(AmqpError::connection(
                        ReplyCode::ChannelError,
                        "expected 'channel.open'",
                    ));
                }
                let m = method::decode(&frame.payload, self.config.table_depth_max)?;
                match m.class {
                    AMQPClass::Channel(channel::AMQPMethod::Open(_)) => {
                        // RabbitMQ limits how many channels are open, not their numbers.
                        if self.channels.len() >= usize::from(self.channel_max) {
                            return Err(AmqpError::connection(
                                ReplyCode::NotAllowed,
                                format!(
                                    "number of channels opened ({}) has reached the negotiated channel_max ({})",
                                    self.channels.len(),
                                    self.channel_max
                                ),
                            ));
                        }
                        gate.open_channel(self.user.as_deref().unwrap_or_default())
                            .map_err(|e| {
                                AmqpError::connection(ReplyCode::NotAllowed, e.to_string())
                            })?;
                        self.channels.insert(ch, ChannelState::Open(Box::default()));
                        out.method(
                            ch,
                            &AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
                        );
                        self.events.push_back(Event::ChannelOpened(ch));
                        Ok(())
                    }
                    _ => Err(AmqpError::connection(
                        ReplyCode::ChannelError,
                        "expected 'channel.open'",
                    )
                    .with_method(m.class_id, m.method_id)),
                }
            }
            Some(ChannelState::Closing) => {
                // Drop everything but close / close-ok, as RabbitMQ does after channel.close.
                if frame.kind == FRAME_METHOD
                    && let Ok(m) = method::decode(&frame.payload, self.config.table_depth_max)
                {
                    match m.class {
                        AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => {
                            self.channels.remove(&ch);
                        }
                        AMQPClass::Channel(channel::AMQPMethod::Close(_)) => {
                            // The peer's close crossed ours: answer it, and keep waiting for
                            // the close-ok it owes for ours (RabbitMQ's closing channel does
                            // the same), so that close-ok is not taken for a frame on an
                            // unopened channel.
                            out.method(
                                ch,
                                &AMQPClass::Channel(channel::AMQPMethod::CloseOk(
                                    channel::CloseOk {},
                                )),
                            );
                        }
                        _ => {}
                    }
                }
                Ok(())
            }
            Some(ChannelState::Open(assembler)) => {
                let cmd = match assembler.handle_frame(frame, limits) {
                    Ok(Some(cmd)) => cmd,
                    Ok(None) => return Ok(()),
                    Err(e) if e.scope == Scope::Channel => {
                        self.close_channel(ch, e, out);
                        return Ok(());
                    }
                    Err(e) => return Err(e),
                };
                let (class_id, method_id) = (cmd.method.class_id, cmd.method.method_id);
                match &cmd.method.class {
                    AMQPClass::Connection(_) => Err(connection_on_channel(&cmd.method)),
                    AMQPClass::Channel(channel::AMQPMethod::Open(_)) => Err(AmqpError::connection(
                        ReplyCode::ChannelError,
                        "second 'channel.open' seen",
                    )
                    .with_method(class_id, method_id)),
                    AMQPClass::Channel(channel::AMQPMethod::Close(_)) => {
                        out.method(
                            ch,
                            &AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                        );
                        self.channels.remove(&ch);
                        self.events.push_back(Event::ChannelClosed(ch));
                        Ok(())
                    }
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => Ok(()),
                    _ => {
                        self.events.push_back(Event::Command(ch, Box::new(cmd)));
                        Ok(())
                    }
                }
            }
        }
    }

    /// Close a channel because of an error the broker found (or the assembler).
    ///
    /// Sends channel.close, drops further frames on it until close-ok, and emits
    /// [`Event::ChannelClosed`] so the broker releases what the channel holds.
    pub fn close_channel(&mut self, ch: u16, e: AmqpError, out: &mut FrameWriter) {
        debug_assert_eq!(e.scope, Scope::Channel);
        if !self.channel_is_open(ch) {
            return;
        }
        out.method(
            ch,
            &AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: e.code.code(),
                reply_text: ShortString::from(e.text),
                class_id: e.class_id,
                method_id: e.method_id,
            })),
        );
        self.channels.insert(ch, ChannelState::Closing);
        self.events.push_back(Event::ChannelClosed(ch));
    }

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
    fn answer_peer_close(&mut self, out: &mut FrameWriter, now: Instant) {
        Self::send_close_ok(out);
        self.release_channels();
        // RabbitMQ waits for the heartbeat interval when it is shorter than its own bound.
        let linger_max = Duration::from_millis(limits::CLOSE_LINGER_MAX_MS);
        let linger = self.heartbeat.map_or(linger_max, |hb| hb.min(linger_max));
        self.state = State::Lingering {
            deadline: now + linger,
        };
    }

    fn send_close_ok(out: &mut FrameWriter) {
        out.method(
            0,
            &AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
        );
    }

    fn finish(&mut self) {
        self.release_channels();
        self.state = State::Closed;
    }

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

    /// The socket is gone: every channel is released.
    pub fn handle_disconnect(&mut self) {
        self.finish();
    }

    /// Whether `m` is offered on this connection: configured, and for EXTERNAL a verified
    /// certificate identity.
    fn offers(&self, m: Mechanism) -> bool {
        self.config.mechanisms.contains(&m)
            && (m != Mechanism::External || self.external_identity.is_some())
    }

    fn send_start(&mut self, out: &mut FrameWriter) {
        out.method(
            0,
            &AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: self.config.server_properties.clone(),
                mechanisms: LongString::from(
                    self.config
                        .mechanisms
                        .iter()
                        .filter(|m| self.offers(**m))
                        .map(|m| m.name())
                        .collect::<Vec<_>>()
                        .join(" ")
                        .into_bytes(),
                ),
                locales: LongString::from(b"en_US".to_vec()),
            })),
        );
    }
}

fn connection_on_channel(m: &method::Method) -> AmqpError {
    AmqpError::connection(ReplyCode::CommandInvalid, "unimplemented method")
        .with_method(m.class_id, m.method_id)
}

/// RabbitMQ's tune-ok validation: below the minimum or above what we offered is refused.
fn negotiate(field: &str, client: u32, min: u32, server: u32) -> Result<u32, AmqpError> {
    if client != 0 && client < min {
        return Err(AmqpError::connection(
            ReplyCode::NotAllowed,
            format!(
                "negotiated {field} = {client} is lower than the minimum allowed value ({min})"
            ),
        )
        .with_method(10, 31));
    }
    if client == 0 || client > server {
        // 0 asks for "no limit", which is above any limit we offered.
        let shown = if client == 0 {
            "0 (no limit)".to_string()
        } else {
            client.to_string()
        };
        return Err(AmqpError::connection(
            ReplyCode::NotAllowed,
            format!(
                "negotiated {field} = {shown} is higher than the maximum allowed value ({server})"
            ),
        )
        .with_method(10, 31));
    }
    Ok(client)
}

/// Whether a client-properties table announces `name` in its capabilities.
#[must_use]
pub fn client_capability(props: &FieldTable, name: &str) -> bool {
    match props.inner().get("capabilities") {
        Some(AMQPValue::FieldTable(caps)) => {
            matches!(caps.inner().get(name), Some(AMQPValue::Boolean(true)))
        }
        _ => false,
    }
}

/// SASL PLAIN: `authzid \0 authcid \0 password`.
fn parse_plain(response: &[u8]) -> Option<(String, Vec<u8>)> {
    let mut parts = response.splitn(3, |b| *b == 0);
    let _authzid = parts.next()?;
    let user = parts.next()?;
    let pass = parts.next()?;
    Some((String::from_utf8(user.to_vec()).ok()?, pass.to_vec()))
}

/// AMQPLAIN: a field table body (no length prefix) with LOGIN and PASSWORD.
fn parse_amqplain(response: &[u8], depth_max: usize) -> Option<(String, Vec<u8>)> {
    let mut table = Vec::with_capacity(response.len() + 4);
    table.extend_from_slice(&u32::try_from(response.len()).ok()?.to_be_bytes());
    table.extend_from_slice(response);
    crate::table::check_table(&table, 0, depth_max).ok()?;
    let (_, t) = amq_protocol::types::parsing::parse_field_table(&table[..]).ok()?;
    let text = |v: Option<&AMQPValue>| -> Option<Vec<u8>> {
        match v? {
            AMQPValue::LongString(s) => Some(s.as_bytes().to_vec()),
            AMQPValue::ShortString(s) => Some(s.as_str().as_bytes().to_vec()),
            _ => None,
        }
    };
    let user = text(t.inner().get("LOGIN"))?;
    let pass = text(t.inner().get("PASSWORD"))?;
    Some((String::from_utf8(user).ok()?, pass))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Open;
    impl Gatekeeper for Open {
        fn login(
            &self,
            user: &str,
            password: &[u8],
            _loopback: bool,
        ) -> Result<Login, AccessError> {
            if user == "guest" && password == b"guest" {
                Ok(Login { user: user.into() })
            } else {
                Err(AccessError::LoginRefused)
            }
        }
        fn login_external(&self, user: &str, _loopback: bool) -> Result<Login, AccessError> {
            if user == "CN=client" {
                Ok(Login { user: user.into() })
            } else {
                Err(AccessError::LoginRefused)
            }
        }
        fn open_vhost(&self, _user: &str, vhost: &str) -> Result<(), AccessError> {
            if vhost == "/" {
                Ok(())
            } else {
                Err(AccessError::VhostNotFound(vhost.into()))
            }
        }
    }

    /// Client bytes for a complete handshake plus channel.open on channel 1.
    fn handshake() -> BytesMut {
        BytesMut::from(&crate::testkit::client_handshake(2047, 131_072, 0)[..])
    }

    /// Feed input until no frame is left, discarding events.
    fn drive(c: &mut Connection, input: &mut BytesMut, out: &mut FrameWriter, now: Instant) {
        loop {
            let before = input.len();
            c.handle_input(input, out, now, &Open);
            let mut any = false;
            while c.poll_event().is_some() {
                any = true;
            }
            if !any && input.len() == before {
                break;
            }
        }
    }

    #[test]
    fn handshake_opens_connection_and_channel() {
        let now = Instant::now();
        let mut c = Connection::new(ConnectionConfig::default(), true, now);
        let mut out = FrameWriter::new();
        let mut input = handshake();
        c.handle_input(&mut input, &mut out, now, &Open);
        assert!(matches!(c.poll_event(), Some(Event::Opened { .. })));
        assert!(c.is_open());
        assert!(
            !c.channel_is_open(1),
            "frames after an event wait for the broker"
        );
        c.handle_input(&mut input, &mut out, now, &Open);
        assert_eq!(c.poll_event(), Some(Event::ChannelOpened(1)));
        assert!(c.channel_is_open(1));
    }

    fn client_frames(f: impl FnOnce(&mut FrameWriter)) -> BytesMut {
        let mut w = FrameWriter::new();
        f(&mut w);
        BytesMut::from(w.as_slice())
    }

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

    #[test]
    fn crossing_channel_closes_wait_for_the_peers_close_ok() {
        let now = Instant::now();
        let mut c = Connection::new(ConnectionConfig::default(), true, now);
        let mut out = FrameWriter::new();
        let mut input = handshake();
        drive(&mut c, &mut input, &mut out, now);
        c.close_channel(
            1,
            AmqpError::channel(ReplyCode::NotFound, "NOT_FOUND - no exchange"),
            &mut out,
        );
        let close = AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        }));
        let close_ok = AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}));
        let mut input = client_frames(|w| w.method(1, &close));
        drive(&mut c, &mut input, &mut out, now);
        assert!(
            matches!(c.channels.get(&1), Some(ChannelState::Closing)),
            "still owed the peer's close-ok"
        );
        let mut input = client_frames(|w| {
            w.method(1, &close_ok);
            w.method(1, &close_ok); // stray, for a channel already gone
        });
        drive(&mut c, &mut input, &mut out, now);
        assert!(c.channels.is_empty());
        assert!(c.is_open(), "a stray close-ok never closes the connection");
    }

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
        assert!(out.as_slice().ends_with(&[
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

    /// Client bytes for the protocol header and a start-ok with `mechanism`.
    fn start_ok(mechanism: &str, response: &[u8]) -> BytesMut {
        let mut w = FrameWriter::new();
        w.raw(PROTOCOL_HEADER);
        let mut caps = FieldTable::default();
        caps.insert(
            "authentication_failure_close".into(),
            AMQPValue::Boolean(true),
        );
        let mut props = FieldTable::default();
        props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
        w.method(
            0,
            &AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: props,
                mechanism: mechanism.into(),
                response: LongString::from(response.to_vec()),
                locale: "en_US".into(),
            })),
        );
        BytesMut::from(w.as_slice())
    }

    fn offered_mechanisms(out: &FrameWriter) -> String {
        let mut written = BytesMut::from(out.as_slice());
        let frame = crate::frame::decode_frame(&mut written, u32::MAX)
            .ok()
            .flatten()
            .expect("connection.start is written first");
        let m = method::decode(&frame.payload, 8).expect("connection.start decodes");
        match m.class {
            AMQPClass::Connection(connection::AMQPMethod::Start(s)) => {
                String::from_utf8_lossy(s.mechanisms.as_bytes()).into_owned()
            }
            other => panic!("expected connection.start, got {other:?}"),
        }
    }

    #[test]
    fn external_is_offered_and_accepted_only_with_a_certificate_identity() {
        let now = Instant::now();
        // With a certificate identity: offered, and the identity logs in without a password.
        let with_external = || ConnectionConfig {
            mechanisms: vec![Mechanism::Plain, Mechanism::Amqplain, Mechanism::External],
            ..ConnectionConfig::default()
        };
        let mut c =
            Connection::new(with_external(), false, now).with_external_identity("CN=client".into());
        let mut out = FrameWriter::new();
        let mut input = start_ok("EXTERNAL", b"");
        drive(&mut c, &mut input, &mut out, now);
        assert_eq!(offered_mechanisms(&out), "PLAIN AMQPLAIN EXTERNAL");
        assert_eq!(c.state, State::AwaitTuneOk, "EXTERNAL login succeeded");

        // A certificate naming an unknown user: 403, as a refused password.
        let mut c = Connection::new(with_external(), false, now)
            .with_external_identity("CN=stranger".into());
        let mut out = FrameWriter::new();
        let mut input = start_ok("EXTERNAL", b"");
        drive(&mut c, &mut input, &mut out, now);
        assert!(matches!(c.state, State::CloseSent { .. }));
        assert!(
            String::from_utf8_lossy(out.as_slice())
                .contains("Login was refused using authentication mechanism EXTERNAL")
        );

        // Without a certificate EXTERNAL is not offered, and asking for it drops the socket.
        let mut c = Connection::new(with_external(), false, now);
        let mut out = FrameWriter::new();
        let mut input = start_ok("EXTERNAL", b"");
        drive(&mut c, &mut input, &mut out, now);
        assert_eq!(offered_mechanisms(&out), "PLAIN AMQPLAIN");
        assert!(c.is_closed());

        // Not configured (RabbitMQ's default auth_mechanisms): not offered even with a
        // certificate, so clients that prefer EXTERNAL (py-amqp) log in with a password.
        let mut c = Connection::new(ConnectionConfig::default(), false, now)
            .with_external_identity("CN=client".into());
        let mut out = FrameWriter::new();
        let mut input = start_ok("EXTERNAL", b"");
        drive(&mut c, &mut input, &mut out, now);
        assert_eq!(offered_mechanisms(&out), "PLAIN AMQPLAIN");
        assert!(
            c.is_closed(),
            "an unoffered mechanism is refused like an unknown one"
        );
    }

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
