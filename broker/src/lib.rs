//! The broker: vhosts, exchanges, routing, queues and AMQP channel semantics.
//!
//! Layout:
//! - [`broker`]: the node (vhosts, users, ids) and the handshake gatekeeper.
//! - [`vhost`]: topology (exchanges, queues, bindings) and routing.
//! - [`exchange`]: exchange types; topic trie and headers matching.
//! - [`queue`]: the pure queue state machine and its in-memory driver.
//! - [`session`]: one connection's channels; every AMQP method's broker-side meaning.
//! - [`outbox`]: cross-task handoff of deliveries to a connection.
//!
//! ```text
//!  publish ─► session/channel ─► vhost.route ─► queue.publish ─► machine ─► Deliver effect
//!                                                                             │
//!  consumer's connection task ◄── outbox ◄────────────────────────────────────┘
//!  ack ─► session/channel ─► queue.settle ─► machine (may deliver more)
//! ```
//!
//! Lock order: vhost topology -> queue state -> outbox. No lock is held across an `.await`
//! (this crate has no `.await` on any of these paths).

pub mod access;
pub mod alarms;
pub mod args;
pub mod broker;
pub mod connections;
pub mod deadletter;
pub mod delayed;
pub mod durable;
pub mod exchange;
pub mod limiter;
pub mod limits;
pub mod message;
pub mod outbox;
pub mod policy;
pub mod queue;
pub mod rebalance;
pub mod recovery;
pub mod replication;
pub mod reply_to;
pub mod session;
pub mod stats;
pub mod stream;
pub mod timers;
pub mod users;
pub mod vhost;

pub use broker::{Broker, BrokerConfig};
pub use session::Session;
