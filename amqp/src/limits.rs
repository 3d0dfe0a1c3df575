//! Protocol limits, each with its name, unit and RabbitMQ-matching default.

/// Largest frame (header + payload + end octet) we accept or send once tuned, in bytes.
pub const FRAME_MAX_DEFAULT: u32 = 131_072;
/// The smallest frame_max a peer may negotiate (AMQP 0-9-1 `frame-min-size`).
pub const FRAME_MIN_SIZE: u32 = 4096;
/// Largest frame accepted before tune-ok has fixed frame_max (covers large client properties).
pub const FRAME_MAX_PRE_TUNE: u32 = FRAME_MAX_DEFAULT;
/// Highest channel number offered in connection.tune.
pub const CHANNEL_MAX_DEFAULT: u16 = 2047;
/// Heartbeat interval offered in connection.tune, in seconds.
pub const HEARTBEAT_DEFAULT_S: u16 = 60;
/// Largest message body accepted, in bytes (RabbitMQ 4.x default `max_message_size`).
pub const MESSAGE_SIZE_MAX_DEFAULT: u64 = 16 * 1024 * 1024;
/// Deepest nesting of field tables and arrays accepted in any table.
pub const TABLE_DEPTH_MAX: usize = 32;
/// Time a client has to finish the handshake, in milliseconds.
pub const HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// Time we wait for close-ok after sending connection.close, in milliseconds.
pub const CLOSE_OK_TIMEOUT_MS: u64 = 3_000;
/// Longest we keep the socket open after answering the peer's connection.close with
/// close-ok, waiting for the peer to close it, in milliseconds (RabbitMQ's `CLOSING_TIMEOUT`;
/// it waits the heartbeat interval instead when that is shorter).
pub const CLOSE_LINGER_MAX_MS: u64 = 30_000;

/// The limits one connection runs with (server side of the negotiation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// frame_max offered in tune (bytes).
    pub frame_max: u32,
    /// channel_max offered in tune.
    pub channel_max: u16,
    /// Heartbeat offered in tune (seconds, 0 disables).
    pub heartbeat_s: u16,
    /// Largest message body (bytes).
    pub message_size_max: u64,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            frame_max: FRAME_MAX_DEFAULT,
            channel_max: CHANNEL_MAX_DEFAULT,
            heartbeat_s: HEARTBEAT_DEFAULT_S,
            message_size_max: MESSAGE_SIZE_MAX_DEFAULT,
        }
    }
}
