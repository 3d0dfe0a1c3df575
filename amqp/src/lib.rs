//! AMQP 0-9-1 wire protocol for Warren, free of I/O.
//!
//! Layout:
//! - [`reply`]: reply codes and the channel/connection error split.
//! - [`limits`]: every protocol limit with its RabbitMQ-matching default.
//! - [`frame`]: splitting bytes into frames (checked against `frame_max` before any allocation)
//!   and writing frames into an outbound buffer.
//! - [`table`]: bounds- and depth-checked walking of field tables.
//! - [`properties`]: a zero-copy view of content-header properties (kept raw so they round-trip
//!   byte-exact).
//! - [`method`]: method decoding (on `amq-protocol`) with the checks RabbitMQ applies.
//! - [`assembler`]: the method -> content header -> body state machine of one channel.
//! - [`connection`]: the connection state machine (handshake, tune, channels, heartbeats, close).
//!
//! ```text
//!  bytes ──► frame::FrameDecoder ──► connection::Connection ──► assembler ──► Event::Command
//!                                          │                                   (to the broker)
//!  bytes ◄── frame::FrameWriter ◄──────────┘◄──────────── broker output frames
//! ```

pub mod assembler;
pub mod connection;
pub mod frame;
pub mod limits;
pub mod method;
pub mod properties;
pub mod reply;
pub mod table;
pub mod testkit;

pub use amq_protocol::protocol::AMQPClass;
pub use amq_protocol::types::{AMQPValue, FieldTable};
pub use reply::{AmqpError, ReplyCode, Scope};
