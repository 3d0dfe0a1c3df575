//! The replication seam of the queue layer: the seam between a quorum queue's driver
//! ([`crate::queue::Queue`]) and the Raft group that orders its commands (implemented by
//! `warren-cluster`).
//!
//! A replicated queue never applies a channel's command directly. It submits the command to its
//! [`Replicator`]; the group commits it on a majority and every replica applies it, in log
//! order and at the entry's time, through [`crate::queue::Queue::apply_committed`]. The
//! machine's effects are the same on every replica; each node carries out the deliveries to the
//! consumers attached on that node and ignores the others, so no delivery crosses the cluster
//! twice and a consumer on any node receives from any queue.
//!
//! ```text
//!  channel ──command──► Replicator ──(forward to leader)──► Raft log ──commit──┐
//!                                                                              ▼
//!      consumers on this node ◄──deliver── Queue::apply_committed ◄── every replica
//! ```

use crate::message::Entry;
use crate::queue::machine::{Command, MachineError, Reply};

/// The replies to one submission's commands, in order.
pub type Replies = Vec<Result<Reply<Entry>, MachineError>>;

/// Why a submission has no replies.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ReplicationError {
    /// No leader could be reached; nothing was appended.
    #[error("no leader for the queue is reachable")]
    Unavailable,
    /// It may or may not have committed (the leader was lost meanwhile): a publisher is
    /// nacked, as RabbitMQ does.
    #[error("outcome unknown: {0}")]
    Unknown(String),
}

/// Called once with the outcome of a submission.
pub type ReplicaDone = Box<dyn FnOnce(Result<Replies, ReplicationError>) + Send>;

/// Who holds a replicated queue, for the management API.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    /// The leader's node name (None during an election).
    pub leader: Option<String>,
    /// The members' node names.
    pub members: Vec<String>,
    /// The members heard from lately (this node counts itself).
    pub online: Vec<String>,
}

/// One replica's view of its group: for operators, and for checking that the replicas of a
/// queue hold the same state at the same applied index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplicaState {
    /// The index of the last log entry applied here (0 before the first).
    pub applied_index: u64,
    /// The term of the vote this replica holds.
    pub term: u64,
    /// The index of the last entry in this replica's log.
    pub last_written_index: u64,
    /// The last index this replica's snapshot covers (0: none).
    pub snapshot_index: u64,
    /// The last index purged from this replica's log (0: none).
    pub purged_index: u64,
    /// `leader`, `follower`, `candidate`, `learner`, or `starting` (no Raft instance yet).
    pub role: &'static str,
    /// A hash of the queue machine's state as of `applied_index` (read under the lock that
    /// applies entries): equal on every replica at the same index. Empty unless asked for.
    pub digest: String,
    /// The nodes that replicate the log without voting.
    pub learners: Vec<String>,
}

/// One replicated queue's side of its Raft group.
pub trait Replicator: Send + Sync + std::fmt::Debug {
    /// Submit commands, applied in submission order (one publisher's messages keep theirs).
    /// `done` gets the replies once the entry committed and was applied on this node, or the
    /// reason there are none. Never blocks.
    fn submit(&self, commands: Vec<Command<Entry>>, done: ReplicaDone);
    /// Whether this node's replica leads the group now (it alone dead-letters and proposes
    /// expiries, so each happens once).
    fn is_leader(&self) -> bool;
    /// This node's number, as consumer ids carry it
    /// ([`crate::queue::machine::consumer_node`]).
    fn local_node(&self) -> u64;
    /// Leader and members.
    fn placement(&self) -> Placement;
    /// This replica's applied index, term, role and log progress; with `digest`, a hash of
    /// its whole state too (costly: for one queue's details, not for listings).
    fn replica_state(&self, digest: bool) -> ReplicaState;
    /// For a classic queue of a cluster seen from another node (a *proxy*: its machine stays
    /// empty, its commands go to the node that holds it): that node's name. None for a
    /// replicated queue.
    fn home(&self) -> Option<String> {
        None
    }
    /// Whether a proxy's home node is down or unreachable from here (operations on the
    /// queue get RabbitMQ's 404 meanwhile). Always false for a replicated queue.
    fn home_down(&self) -> bool {
        false
    }
    /// A proxy's view of its queue on the home node, as last reported (None: not known
    /// yet, or a replicated queue, whose own machine is the view).
    fn remote_stats(&self) -> Option<crate::queue::QueueStats> {
        None
    }
    /// Where this replica keeps the bodies of its [`Entry::Logged`] messages (None: it holds
    /// none).
    fn bodies(&self) -> Option<&dyn crate::message::BodySource> {
        None
    }
}
