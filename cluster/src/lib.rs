//! Replication for Warren (issue 8): a quorum queue is an openraft group whose state machine is
//! the same pure [`QueueMachine`](warren_broker::queue::machine::QueueMachine) that drives
//! classic queues. Every state change is a log entry carrying machine commands and the leader's
//! time; each replica applies the committed entries in order and so reaches the same state.
//!
//! - [`types`]: the Raft type configuration, the replicated message and the entry payload.
//! - [`codec`]: the binary encoding of entries, snapshots and frames.
//! - [`log_store`]: the Raft log, vote and commit index in redb (durable before acknowledged).
//! - [`node_log`]: the node-wide database the logs of all quorum queue groups share, and its
//!   writer committing the writes of every group in one transaction (group commit).
//! - [`group`]: openraft's state machine over any replicated state, with snapshots.
//! - [`snapshot_file`]: a replica's current snapshot on disk, streamed as it is encoded.
//! - [`state_machine`]: the queue machine alone as that state (tests, benchmarks).
//! - [`node`]: a cluster node: the metadata group, a replica per quorum queue applying into
//!   the broker's queue, forwarding to leaders, down nodes.
//! - [`proposer`]: the leader's batching of commands into entries, with a reply per command.
//! - [`network`]: an in-process network, with injected faults, for tests of a group in one
//!   process.
//! - [`tcp`]: Raft RPCs between nodes over TCP, authenticated with the cluster's shared secret.

pub mod codec;
pub mod group;
pub mod log_store;
pub mod network;
pub mod node;
pub mod node_log;
pub mod proposer;
pub mod snapshot_data;
pub mod snapshot_file;
pub mod state_machine;
pub mod tcp;
pub mod types;
