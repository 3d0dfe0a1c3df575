//! Where a node keeps its Raft groups' logs: what openraft's storage traits sit on.
//!
//! - [`store`]: a group's Raft log, vote and commit index (durable before acknowledged), and
//!   the copied-out message records of a quorum queue, over a [`backend`];
//! - [`backend`]: where a group's log is kept: its tables in a redb database, or its records
//!   in the node's write-ahead log (`warren_store::wal`);
//! - [`node_log`]: the node-wide database the logs of all quorum queue groups share, and its
//!   writer committing the writes of every group in one transaction (group commit);
//! - [`queue_logs`]: which of the two a node's quorum queues use (`--quorum-log`);
//! - [`import`]: redb logs moved into the WAL once, when a node starts on it;
//! - [`recent_entries`]: a group's last appended entries, kept until applied;
//! - [`snapshot_file`]: a replica's current snapshot on disk, streamed as it is encoded.

pub mod backend;
pub mod import;
pub mod node_log;
pub mod queue_logs;
pub mod recent_entries;
pub mod snapshot_file;
pub mod store;
