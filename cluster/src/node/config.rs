//! How a node is configured ([`NodeConfig`], from the command line), why it may fail to
//! start, its Raft id, and the Raft settings of its groups.

use std::net::SocketAddr;
use std::path::PathBuf;

use openraft::Config;

use crate::transport::tcp;
use crate::types::NodeId;

/// One member of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// Its node name (`--node-name`).
    pub name: String,
    /// Its cluster port address.
    pub addr: String,
}

/// How a node joins its cluster.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// This node's name (one of `peers`).
    pub name: String,
    /// The cluster port to listen on.
    pub listen: SocketAddr,
    /// Every node of the cluster, this one included.
    pub peers: Vec<Peer>,
    /// The cluster's shared secret.
    pub secret: Vec<u8>,
    /// Where the Raft logs go.
    pub data_dir: PathBuf,
    /// TLS on the cluster port (both ways), if configured.
    pub tls: Option<tcp::ClusterTls>,
    /// Join the running cluster of `peers` (seeds: some of its nodes, and this one for its
    /// own address) rather than found it with them.
    pub join: bool,
    /// Entries a quorum queue's log keeps at most before its snapshot point for its oldest
    /// live message ([`QUEUE_LOG_PIN_MAX`] by default).
    pub queue_log_pin_max: u64,
    /// Which log the quorum queues use (`--quorum-log`).
    pub queue_log: crate::log::queue_logs::QueueLogKind,
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The configuration is inconsistent.
    #[error("cluster configuration: {0}")]
    Config(String),
    /// A log could not be opened.
    #[error("raft log {0}: {1}")]
    Log(PathBuf, crate::log::backend::LogError),
    /// The port or a Raft instance failed.
    #[error("cluster: {0}")]
    Io(String),
}

/// A node's Raft id: FNV-1a of its name (never 0).
#[must_use]
pub fn node_id(name: &str) -> NodeId {
    fnv1a(name.as_bytes()).max(1)
}

pub(super) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Timings for real nodes: heartbeats every 300 ms (the metadata group's; queue and stream
/// groups leave liveness to the node, `elections`), an election after 1.5 to 3 s of silence
/// (sooner when the leader's connection closes: `tcp::suspect_leader`). openraft also takes
/// the heartbeat interval as the AppendEntries timeout, so it must cover a full append and
/// its fsync under load; appends carry at most 8 entries (of up to 512 commands each), which
/// bounds that. Measured: with 200 ms and 300 entries an append of ten busy queues timed out
/// again and again and replication stalled.
#[must_use]
pub fn raft_config() -> Config {
    Config {
        heartbeat_interval: 300,
        election_timeout_min: 1500,
        election_timeout_max: 3000,
        max_payload_entries: 8,
        snapshot_max_chunk_size: SNAPSHOT_CHUNK_MAX,
        ..Config::default()
    }
}

/// Largest chunk of a snapshot sent in one request. Every group's traffic to a peer shares one
/// link, written in order: a chunk holds the requests queued behind it for as long as it
/// takes to write (512 KiB: about 4 ms at 1 Gbit/s; openraft's default, 3 MiB, about 25 ms).
pub const SNAPSHOT_CHUNK_MAX: u64 = 512 * 1024;

/// Entries a quorum queue's log keeps before its snapshot point when nothing older is live,
/// so a member briefly away catches up from the log.
pub const QUEUE_LOG_KEEP: u64 = 1000;

/// Entries a quorum queue's log keeps at most before its snapshot point for its oldest live
/// message (so a member that was away catches up from the log, not from a snapshot carrying
/// the backlog's bodies). Beyond it the log is purged anyway: an old unacked message pins
/// its own body, not the log after it (a member further behind gets such bodies in the
/// snapshot).
pub const QUEUE_LOG_PIN_MAX: u64 = 50_000;

/// How long a queue or stream group's leader waits for a follower's answer to an append
/// (openraft's `heartbeat_interval`, which for these groups sends no heartbeat). openraft's
/// tick (every 1.5 times this) is off for these groups except while the node's watch needs
/// it for an election retried or a removed leader's stepping down (`elections::sync_tick`);
/// a longer wait also suits appends that queue behind others on a shared link.
pub const QUEUE_APPEND_TIMEOUT_MS: u64 = 1000;

/// A quorum queue group's Raft settings: the common ones, with purging left to the node
/// (`QueueReplica::compact_log`, after [`QUEUE_LOG_KEEP`] and [`QUEUE_LOG_PIN_MAX`]), and
/// liveness left to the node too: the group sends no heartbeats and starts no election of
/// its own (`elections`: the node watches its peers once, for all its groups).
#[must_use]
pub fn queue_raft_config() -> Config {
    Config {
        enable_heartbeat: false,
        enable_elect: false,
        // On only while the node's watch needs it (`elections::sync_tick`).
        enable_tick: false,
        heartbeat_interval: QUEUE_APPEND_TIMEOUT_MS,
        max_in_snapshot_log_to_keep: u64::MAX,
        // A snapshot sent to a member behind the purged log carries the backlog's bodies: the
        // member answers its last chunk once they are all in its log.
        install_snapshot_timeout: SNAPSHOT_INSTALL_TIMEOUT_MS,
        ..raft_config()
    }
}

/// Entries of a stream's group between two snapshots ([`STREAM_SNAPSHOT_EVERY_ENV`]
/// overrides it): a snapshot lets Raft purge what it covers, the stream's files holding it.
pub const STREAM_SNAPSHOT_EVERY: u64 = 5000;
/// Environment variable overriding [`STREAM_SNAPSHOT_EVERY`] (tests make it small to make a
/// member catch up from a snapshot).
pub const STREAM_SNAPSHOT_EVERY_ENV: &str = "WARREN_STREAM_SNAPSHOT_EVERY";

/// How long one chunk of a snapshot with data (a stream's chunks, a quorum queue's bodies)
/// may take to be answered; the last chunk's answer waits for the whole install (a member
/// behind a 1,000,000 x 1 KB backlog caught up in 35 s in all, transfer included:
/// `scripts/quorum_backlog.py --behind`, docs/benchmarks.md).
pub const SNAPSHOT_INSTALL_TIMEOUT_MS: u64 = 60_000;

/// A stream group's Raft settings: the queue groups' (liveness left to the node), with its
/// own snapshot interval; as many entries are kept after a snapshot (a member further behind
/// gets the snapshot, with the chunks it lacks).
#[must_use]
pub fn stream_raft_config() -> Config {
    let every = std::env::var(STREAM_SNAPSHOT_EVERY_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|n| *n > 0)
        .unwrap_or(STREAM_SNAPSHOT_EVERY);
    Config {
        snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(every),
        // A member briefly away catches up from the log, not from a whole-stream snapshot.
        max_in_snapshot_log_to_keep: every,
        // A snapshot with data takes longer to send and install than a queue's.
        install_snapshot_timeout: SNAPSHOT_INSTALL_TIMEOUT_MS,
        enable_heartbeat: false,
        enable_elect: false,
        // On only while the node's watch needs it (`elections::sync_tick`).
        enable_tick: false,
        heartbeat_interval: QUEUE_APPEND_TIMEOUT_MS,
        ..raft_config()
    }
}
