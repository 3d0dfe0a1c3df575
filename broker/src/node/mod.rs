//! The node: what one broker process holds above its vhosts. The [`broker::Broker`] (vhosts,
//! users, ids, the handshake gatekeeper), [`access`] checks, open [`connections`], resource
//! [`alarms`], consumer [`groups`], leader [`rebalance`], start-up [`recovery`] from the store, and the node's side of
//! [`replication`] (applying changes other nodes made). Imports routing and below.

pub mod access;
pub mod alarms;
pub mod broker;
pub mod connections;
pub mod groups;
pub mod rebalance;
pub mod recovery;
pub mod redrive;
pub mod replication;
