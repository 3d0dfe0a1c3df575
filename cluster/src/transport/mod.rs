//! How a node's Raft groups reach their peers.
//!
//! - [`tcp`]: Raft RPCs, forwarded commands and handovers between nodes over TCP (TLS where
//!   configured), authenticated with the cluster's shared secret;
//! - [`in_process`]: an in-process network, with injected faults, for tests of a group in one
//!   process.

pub mod in_process;
pub mod tcp;
