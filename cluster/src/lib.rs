//! Replication for Warren (issue 8): a quorum queue is an openraft group whose state machine is
//! the same pure [`QueueMachine`](warren_broker::queue::machine::QueueMachine) that drives
//! classic queues. Every state change is a log entry carrying machine commands and the leader's
//! time; each replica applies the committed entries in order and so reaches the same state.
//!
//! - [`types`]: the Raft type configuration, the replicated message and the entry payload.
//! - [`codec`]: the binary encoding of entries, snapshots and frames.
//! - [`log`]: where the groups' logs are kept: each group's Raft log, vote and commit index
//!   (durable before acknowledged) in the node-wide database, written for every group in one
//!   transaction (group commit), and a replica's snapshot file.
//! - [`group`]: openraft's state machine over any replicated state, with snapshots.
//! - [`state_machine`]: the queue machine alone as that state (tests, benchmarks).
//! - [`node`]: a cluster node: the metadata group, a replica per quorum queue applying into
//!   the broker's queue, forwarding to leaders, down nodes.
//! - [`proposer`]: the leader's batching of commands into entries, with a reply per command.
//! - [`transport`]: how groups reach their peers: Raft RPCs between nodes over TCP,
//!   authenticated with the cluster's shared secret, and an in-process network with injected
//!   faults for tests of a group in one process.

pub mod codec;
pub mod group;
pub mod log;
pub mod node;
pub mod proposer;
pub mod snapshot_data;
pub mod state_machine;
pub mod transport;
pub mod types;
