//! The broker: vhosts, exchanges, routing, queues and AMQP channel semantics, in layers that
//! each import only the ones below (checked by `scripts/layers.py` against
//! `scripts/layers.toml`; docs/architecture.md draws them):
//!
//! ```text
//!  session/   one connection's channels: every AMQP method's broker-side meaning
//!  node/      broker (vhosts, users, ids), access, connections, alarms, recovery, replication
//!  routing/   vhost topology (exchanges, queues, bindings), delayed exchange, reply-to, cluster seam
//!  queue/     the queue driver (locks, store, timers, consumers, outbox), limiter, streams as queues,
//!             the replica seam, and the pure machine under queue/machine
//!  durable    the store handle and its records (on warren-store, which knows nothing of this crate)
//!  exchange/ stream/ policy deadletter   pure tables and machines: matching, logs, settings
//!  message/ args limits timers stats users queue/machine   plain data and the queue machine
//! ```
//!
//! ```text
//!  publish ─► session ─► routing::vhost.route ─► queue.publish ─► machine ─► Deliver effect
//!                                                                             │
//!  consumer's connection task ◄── queue::outbox ◄─────────────────────────────┘
//!  ack ─► session ─► queue.settle ─► machine (may deliver more)
//! ```
//!
//! Lock order: vhost topology -> queue state -> outbox. No lock is held across an `.await`
//! (this crate has no `.await` on any of these paths).

pub mod args;
pub mod deadletter;
pub mod durable;
pub mod exchange;
pub mod groups;
pub mod limits;
pub mod message;
pub mod node;
pub mod policy;
pub mod queue;
pub mod routing;
pub mod session;
pub mod stats;
pub mod stream;
pub mod timers;
pub mod users;

pub use node::broker::{Broker, BrokerConfig};
pub use session::Session;
