//! The Raft type configuration of a replicated queue.

use openraft::{BasicNode, Entry, TokioRuntime};
use serde::{Deserialize, Serialize};
use warren_broker::queue::machine::{Command, MachineError, MessageRef, Reply};

/// A message as a replicated queue holds it. The body travels in the log entry that enqueues
/// it, so every replica has it once the entry commits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicatedMessage {
    /// The body (properties and payload as the broker stores them).
    #[serde(with = "crate::codec::raw_bytes")]
    pub body: Vec<u8>,
    /// The `priority` property.
    pub priority: u8,
    /// The message's own TTL (`expiration` property), in milliseconds.
    pub expiration_ms: Option<u64>,
}

impl MessageRef for ReplicatedMessage {
    fn size(&self) -> u64 {
        self.body.len() as u64
    }

    fn priority(&self) -> u8 {
        self.priority
    }

    fn expiration_ms(&self) -> Option<u64> {
        self.expiration_ms
    }
}

/// One log entry's payload: queue machine commands, applied in order at time `at` (the
/// leader's wall clock in milliseconds when it proposed them; replicas never read their own
/// clock, so they all compute the same expiries).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QueueRequest {
    /// Milliseconds since the epoch, stamped by the leader.
    pub at: u64,
    /// Commands, applied one after the other (many publishes batch into one entry).
    pub commands: Vec<Command<ReplicatedMessage>>,
    /// Metadata changes (entries of the cluster's metadata group; queue groups carry none).
    pub meta: Vec<MetaChange>,
}

/// A change to the cluster's metadata, an entry of the metadata group that every node
/// applies to its local copy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaChange {
    /// A quorum queue exists, with its group's members.
    DeclareQueue {
        /// The broker's queue record key (vhost and name).
        key: Vec<u8>,
        /// The broker's queue record (arguments).
        value: Vec<u8>,
        /// The group's incarnation: a re-declared queue is a new group.
        incarnation: u64,
        /// Member node ids.
        members: Vec<NodeId>,
    },
    /// A quorum queue was deleted.
    DeleteQueue {
        /// Its record key.
        key: Vec<u8>,
        /// The incarnation deleted (a later one of the same name stays).
        incarnation: u64,
    },
    /// An exchange or binding changed on some node.
    Topology(warren_broker::node::replication::TopologyChange),
    /// A node of the cluster. Proposed with `number: None` by a node that joins (the
    /// metadata group assigns it one, from 63 down, never reused) and with its number by a
    /// founding node; `forgotten` removes it for good (`forget_cluster_node`).
    Node {
        /// Its name.
        name: String,
        /// Its cluster port address, as the others dial it.
        addr: String,
        /// Its number (the top bits of the consumer ids it issues).
        number: Option<u64>,
        /// Removed from the cluster.
        forgotten: bool,
    },
    /// A quorum queue's members from now on: its group's leader makes them the voters
    /// (an added member is a learner first and votes once it has caught up; a removed one
    /// stays a learner, as every non-member is).
    SetMembers {
        /// The queue's record key.
        key: Vec<u8>,
        /// The incarnation concerned (a change to a deleted one is void).
        incarnation: u64,
        /// Member node ids, in placement order.
        members: Vec<NodeId>,
    },
    /// A classic queue exists on node `home`, which alone holds its messages; every other
    /// node serves it through a proxy. The first declaration of a name wins; the home may
    /// declare it again (with a new id after a restart of a non-durable queue's name).
    DeclareClassic {
        /// The broker's queue record key (vhost and name).
        key: Vec<u8>,
        /// The broker's queue record (id, auto-delete, arguments).
        value: Vec<u8>,
        /// The node that holds it.
        home: NodeId,
        /// Its id on the home.
        id: u64,
        /// Durable (it outlives its home's restart).
        durable: bool,
        /// Exclusive to a connection on its home.
        exclusive: bool,
    },
    /// A classic queue was deleted (on its home, or the home is gone and it did not outlive
    /// it). Void unless `home` and `id` match the declaration that stands.
    DeleteClassic {
        /// Its record key.
        key: Vec<u8>,
        /// The node that held it.
        home: NodeId,
        /// Its id there.
        id: u64,
    },
    /// A consumer-group command (join, leave, release, node down), applied by every node to
    /// its copy of the group table in log order.
    Group(warren_broker::groups::GroupCommand),
    /// The whole group table (a snapshot carries it; never proposed).
    GroupTable(Vec<u8>),
}

/// The replies to one entry's commands, in order.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct QueueResponse {
    /// One per command.
    pub replies: Vec<Result<Reply<ReplicatedMessage>, MachineError>>,
}

openraft::declare_raft_types!(
    /// The openraft types of a replicated queue.
    pub QueueRaft:
        D = QueueRequest,
        R = QueueResponse,
        NodeId = u64,
        Node = BasicNode,
        Entry = Entry<QueueRaft>,
        SnapshotData = crate::snapshot_data::SnapshotBuf,
        AsyncRuntime = TokioRuntime,
);

/// The node id type.
pub type NodeId = u64;
/// The storage error of this configuration.
pub type StorageError = openraft::StorageError<NodeId>;
