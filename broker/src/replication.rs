//! What the broker needs from replication: the seam between a quorum queue's driver
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

use std::sync::Arc;

use bytes::Bytes;
use warren_amqp::properties::Properties;
use warren_store::StoredMessage;
use warren_store::writer::Completion;

use crate::message::{Entry, Message};
use crate::queue::Queue;
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
}

/// What a cluster does for the broker's metadata changes.
pub trait ClusterHooks: Send + Sync + std::fmt::Debug {
    /// This node's name.
    fn node_name(&self) -> &str;
    /// This node's number, the top bits of the consumer ids it issues.
    fn node_number(&self) -> u64;
    /// Create the replicated queue `queue` on its members: `done` runs once the cluster's
    /// metadata group committed it and this node serves it (inserted in its vhost).
    fn declare_quorum(&self, queue: Arc<Queue>, done: Completion);
    /// Delete a replicated queue everywhere; `done` runs once that committed.
    fn delete_quorum(&self, queue: &Arc<Queue>, done: Completion);
    /// Every node of the cluster, and whether it was heard from lately (this one is).
    fn nodes(&self) -> Vec<NodeStatus>;
    /// Remove a stopped node from the cluster for good (`forget_cluster_node`): from the
    /// metadata group and every queue's members; `done` runs once that committed.
    ///
    /// # Errors
    /// [`MembershipError::UnknownNode`], [`MembershipError::Running`].
    fn forget_node(&self, name: &str, done: Completion) -> Result<(), MembershipError>;
    /// Add or remove a member of a replicated queue's group. Refused at once when the change
    /// makes no sense; otherwise `done` runs once the cluster committed the new member list
    /// (the group's leader then changes its voters, which takes a moment more: an added
    /// member votes once it has caught up).
    ///
    /// # Errors
    /// See [`MembershipError`].
    fn change_members(
        &self,
        queue: &Arc<Queue>,
        change: MemberChange,
        done: Completion,
    ) -> Result<(), MembershipError>;
    /// A change to exchanges or bindings made here: every other node makes it too (through
    /// [`apply_topology`]); `done` runs once the cluster committed it.
    fn replicate_topology(&self, change: TopologyChange, done: Completion);
    /// Hand leadership of a replicated queue to its member `to` (by name): the leader stops
    /// proposing until its log stands still, waits until `to` holds every entry, and has it
    /// stand for election. `done` gets the new leader's name (`to` unless an election went
    /// elsewhere), or why leadership did not move; the log is never at risk either way.
    fn transfer_leader(&self, queue: &Arc<Queue>, to: &str, done: TransferDone);
}

/// Receives a leadership transfer's outcome.
pub type TransferDone = Box<dyn FnOnce(Result<String, TransferError>) + Send>;

/// Why leadership of a replicated queue did not move.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// No node of that name is in the cluster.
    #[error("no node {0} in the cluster")]
    UnknownNode(String),
    /// The node is not a voting member of the queue.
    #[error("{0} is not a voting member of the queue")]
    NotVoter(String),
    /// The queue is not replicated (a classic queue, or not served here yet).
    #[error("not a replicated queue")]
    NotReplicated,
    /// The queue has no leader at the moment (an election is on).
    #[error("the queue has no leader")]
    NoLeader,
    /// The leader could not hand over (busy with a membership change, the target lagging or
    /// unreachable, or the election it started went another way).
    #[error("leadership did not move: {0}")]
    Failed(String),
}

/// A cluster node as this node sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeStatus {
    /// Its name.
    pub name: String,
    /// Heard from within the down-detection window (this node always is).
    pub running: bool,
}

/// A change to a quorum queue's members (`warren ctl queues add_member|delete_member`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberChange {
    /// Make this node (by name) a member.
    Add(String),
    /// Make this node (by name) no longer a member.
    Delete(String),
}

/// Why a membership change was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MembershipError {
    /// No node of that name is in the cluster.
    #[error("no node {0} in the cluster")]
    UnknownNode(String),
    /// Adding a member that is one.
    #[error("{0} is already a member")]
    AlreadyMember(String),
    /// Removing a node that is not a member.
    #[error("{0} is not a member")]
    NotMember(String),
    /// Removing the only member (the queue's state would have nowhere to live).
    #[error("a quorum queue keeps at least one member")]
    LastMember,
    /// The queue is not replicated (a classic queue, or not served here yet).
    #[error("not a replicated queue")]
    NotReplicated,
    /// Forgetting a node that is running (this one, or one heard from lately).
    #[error("{0} is running: stop it before forgetting it")]
    Running(String),
}

/// An exchange or binding change, as the cluster's metadata log carries it (the store's record
/// encodings).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum TopologyChange {
    /// An exchange was declared (an `ExchangeRecord`'s key and value).
    DeclareExchange {
        /// Record key (vhost and name).
        key: Vec<u8>,
        /// Record value (type, flags, arguments).
        value: Vec<u8>,
    },
    /// An exchange was deleted.
    DeleteExchange {
        /// Its vhost.
        vhost: String,
        /// Its name.
        name: String,
    },
    /// A binding was added (a `BindingRecord`'s key and value).
    Bind {
        /// Record key.
        key: Vec<u8>,
        /// Record value.
        value: Vec<u8>,
    },
    /// A binding was removed (its record, as for `Bind`).
    Unbind {
        /// Record key.
        key: Vec<u8>,
        /// Record value.
        value: Vec<u8>,
    },
    /// Users, vhosts, permissions, policies or limits changed.
    Definition(DefinitionChange),
}

/// A change to users, vhosts, permissions, policies or limits, as the cluster's metadata log
/// carries it. Records travel as the JSON the store keeps (RabbitMQ's definitions fields).
/// Each is idempotent, and carries the whole new state of what it names, so nodes that apply
/// the same log in the same order end with the same definitions.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DefinitionChange {
    /// A user as it now is (created, imported, password, tags or limits changed): a
    /// `UserRecord` in JSON, with its password hash.
    PutUser(Vec<u8>),
    /// A user was deleted, with its permissions.
    DeleteUser(String),
    /// A vhost exists with these settings.
    PutVhost {
        /// Its name.
        name: String,
        /// `default_queue_type`.
        default_queue_type: Option<String>,
        /// Its limits (`VhostLimits` in JSON).
        limits: Vec<u8>,
    },
    /// A vhost was deleted, with everything in it.
    DeleteVhost(String),
    /// A `PermissionRecord` (JSON) was set.
    SetPermissions(Vec<u8>),
    /// A user's permissions in a vhost were cleared.
    ClearPermissions {
        /// Vhost.
        vhost: String,
        /// User.
        user: String,
    },
    /// A `TopicPermissionRecord` (JSON) was set.
    SetTopicPermissions(Vec<u8>),
    /// A user's topic permissions in a vhost were cleared (one exchange's, or all).
    ClearTopicPermissions {
        /// Vhost.
        vhost: String,
        /// User.
        user: String,
        /// One exchange's only.
        exchange: Option<String>,
    },
    /// A policy (`PolicyDef` in JSON) was set.
    SetPolicy {
        /// An operator policy rather than a user one.
        operator: bool,
        /// The definition.
        def: Vec<u8>,
    },
    /// A policy was cleared.
    ClearPolicy {
        /// An operator policy rather than a user one.
        operator: bool,
        /// Vhost.
        vhost: String,
        /// Policy name.
        name: String,
    },
}

/// A definition's key in the cluster's metadata: a tag and the JSON of its names.
fn definition_key(tag: &[u8], names: &[&str]) -> Vec<u8> {
    [tag, &serde_json::to_vec(names).unwrap_or_default()].concat()
}

/// The names in a definition key of `tag` (None: another kind of key).
fn definition_names(tag: &[u8], key: &[u8]) -> Option<Vec<String>> {
    key.strip_prefix(tag)
        .and_then(|rest| serde_json::from_slice(rest).ok())
}

fn policy_tag(operator: bool) -> &'static str {
    if operator { "operator" } else { "user" }
}

impl DefinitionChange {
    fn record_key(&self) -> Vec<u8> {
        use crate::users::{PermissionRecord, TopicPermissionRecord};
        match self {
            Self::PutUser(json) => {
                let name = serde_json::from_slice::<crate::users::UserRecord>(json)
                    .map(|u| u.name)
                    .unwrap_or_default();
                definition_key(b"u:", &[&name])
            }
            Self::DeleteUser(name) => definition_key(b"u:", &[name]),
            Self::PutVhost { name, .. } | Self::DeleteVhost(name) => definition_key(b"v:", &[name]),
            Self::SetPermissions(json) => match serde_json::from_slice::<PermissionRecord>(json) {
                Ok(p) => definition_key(b"p:", &[&p.user, &p.vhost]),
                Err(_) => b"p:".to_vec(),
            },
            Self::ClearPermissions { vhost, user } => definition_key(b"p:", &[user, vhost]),
            Self::SetTopicPermissions(json) => {
                match serde_json::from_slice::<TopicPermissionRecord>(json) {
                    Ok(p) => definition_key(b"t:", &[&p.user, &p.vhost, &p.exchange]),
                    Err(_) => b"t:".to_vec(),
                }
            }
            Self::ClearTopicPermissions {
                vhost,
                user,
                exchange,
            } => match exchange {
                Some(x) => definition_key(b"t:", &[user, vhost, x]),
                None => definition_key(b"t:", &[user, vhost]),
            },
            Self::SetPolicy { operator, def } => {
                match serde_json::from_slice::<crate::policy::PolicyDef>(def) {
                    Ok(d) => definition_key(b"P:", &[policy_tag(*operator), &d.vhost, &d.name]),
                    Err(_) => b"P:".to_vec(),
                }
            }
            Self::ClearPolicy {
                operator,
                vhost,
                name,
            } => definition_key(b"P:", &[policy_tag(*operator), vhost, name]),
        }
    }

    fn is_addition(&self) -> bool {
        matches!(
            self,
            Self::PutUser(_)
                | Self::PutVhost { .. }
                | Self::SetPermissions(_)
                | Self::SetTopicPermissions(_)
                | Self::SetPolicy { .. }
        )
    }

    /// Whether removing this also removes the record under `key` (a user's or a vhost's
    /// permissions go with it).
    fn supersedes(&self, key: &[u8]) -> bool {
        let names = |tag: &[u8]| definition_names(tag, key).unwrap_or_default();
        match self {
            Self::DeleteUser(user) => {
                key == self.record_key().as_slice()
                    || names(b"p:").first() == Some(user)
                    || names(b"t:").first() == Some(user)
            }
            Self::DeleteVhost(vhost) => {
                key == self.record_key().as_slice()
                    || names(b"p:").get(1) == Some(vhost)
                    || names(b"t:").get(1) == Some(vhost)
                    || names(b"P:").get(1) == Some(vhost)
            }
            Self::ClearTopicPermissions {
                vhost,
                user,
                exchange: None,
            } => {
                let n = names(b"t:");
                n.first() == Some(user) && n.get(1) == Some(vhost)
            }
            other => key == other.record_key().as_slice(),
        }
    }

    /// Where a snapshot's records are re-applied: vhosts, then users, then what refers to
    /// both.
    fn rank(&self) -> u8 {
        match self {
            Self::PutVhost { .. } | Self::DeleteVhost(_) => 0,
            Self::PutUser(_) | Self::DeleteUser(_) => 1,
            _ => 2,
        }
    }
}

impl TopologyChange {
    /// The key under which the cluster's metadata keeps what this change leaves, or the key
    /// it removes.
    #[must_use]
    pub fn record_key(&self) -> Vec<u8> {
        match self {
            Self::Definition(d) => d.record_key(),
            Self::DeclareExchange { key, .. } => [b"x:".as_slice(), key].concat(),
            Self::DeleteExchange { vhost, name } => [
                b"x:".as_slice(),
                &crate::durable::ExchangeRecord::key(vhost, name),
            ]
            .concat(),
            Self::Bind { key, .. } | Self::Unbind { key, .. } => [b"b:".as_slice(), key].concat(),
        }
    }

    /// Whether it adds (rather than removes) something.
    #[must_use]
    pub fn is_addition(&self) -> bool {
        match self {
            Self::Definition(d) => d.is_addition(),
            other => matches!(other, Self::DeclareExchange { .. } | Self::Bind { .. }),
        }
    }

    /// For a removal: whether the record kept under `key` goes with it.
    #[must_use]
    pub fn supersedes(&self, key: &[u8]) -> bool {
        match self {
            Self::Definition(d) => d.supersedes(key),
            other => key == other.record_key().as_slice(),
        }
    }

    /// The order in which a snapshot's records are re-applied (lower first): definitions,
    /// then exchanges and queues (rank 3), then bindings.
    #[must_use]
    pub fn rank(&self) -> u8 {
        match self {
            Self::Definition(d) => d.rank(),
            Self::Bind { .. } | Self::Unbind { .. } => 5,
            _ => 3,
        }
    }
}

thread_local! {
    /// Set while this thread applies a change that came from the cluster (not to be sent
    /// back to it).
    static APPLYING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the current change came from the cluster.
#[must_use]
pub fn applying() -> bool {
    APPLYING.with(std::cell::Cell::get)
}

/// Make a change another node made (idempotent: this node may have made it itself).
///
/// # Errors
/// It does not apply here (yet): a binding whose queue this node has not started serving, a
/// vhost it does not have. The caller may try again later.
pub fn apply_topology(broker: &crate::Broker, change: &TopologyChange) -> Result<(), String> {
    APPLYING.with(|a| a.set(true));
    let r = apply_topology_here(broker, change);
    APPLYING.with(|a| a.set(false));
    r
}

fn apply_topology_here(broker: &crate::Broker, change: &TopologyChange) -> Result<(), String> {
    use crate::durable::{BindingRecord, ExchangeRecord};
    let none = &mut || -> Completion { Box::new(|_| {}) };
    match change {
        TopologyChange::DeclareExchange { key, value } => {
            let r = ExchangeRecord::decode(key, value).map_err(|e| e.to_string())?;
            let vh = broker.vhost(&r.vhost).ok_or("no such vhost")?;
            vh.declare_exchange(&r.name, r.decl, none)
                .map_err(|e| e.text)?;
        }
        TopologyChange::DeleteExchange { vhost, name } => {
            let vh = broker.vhost(vhost).ok_or("no such vhost")?;
            vh.delete_exchange(name, false, none).map_err(|e| e.text)?;
        }
        TopologyChange::Definition(d) => apply_definition(broker, d)?,
        TopologyChange::Bind { key, value } | TopologyChange::Unbind { key, value } => {
            let r = BindingRecord::decode(key, value).map_err(|e| e.to_string())?;
            let vh = broker.vhost(&r.vhost).ok_or("no such vhost")?;
            if matches!(change, TopologyChange::Bind { .. }) {
                vh.bind(&r.source, r.destination, &r.routing_key, r.arguments, none)
            } else {
                vh.unbind(&r.source, r.destination, &r.routing_key, r.arguments, none)
            }
            .map_err(|e| e.text)?;
        }
    }
    Ok(())
}

/// A queued message as a replicated log carries it: the store's record encoding (exchange,
/// routing key, raw properties, body, with a checksum).
///
/// # Panics
/// Never for a message that passed the protocol's checks (short strings, bounded size).
#[must_use]
pub fn encode_message(message: &Message) -> Vec<u8> {
    let record = crate::durable::stored(message);
    let mut out = Vec::with_capacity(8 + record.payload_len());
    record.encode(&mut out);
    out
}

/// Why a replicated message does not decode.
#[derive(Debug, Clone, thiserror::Error)]
#[error("undecodable replicated message: {0}")]
pub struct DecodeError(pub String);

/// The message [`encode_message`] encoded, checksum verified.
///
/// # Errors
/// A damaged or truncated record.
pub fn decode_message(bytes: &[u8]) -> Result<Message, DecodeError> {
    const HEADER: usize = 8;
    let (Some(len), Some(crc), Some(payload)) =
        (bytes.get(0..4), bytes.get(4..8), bytes.get(HEADER..))
    else {
        return Err(DecodeError("truncated".into()));
    };
    let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
    let crc = u32::from_be_bytes([crc[0], crc[1], crc[2], crc[3]]);
    if len != payload.len() || crc32c::crc32c(payload) != crc {
        return Err(DecodeError("checksum or length mismatch".into()));
    }
    let record = StoredMessage::decode(&Bytes::copy_from_slice(payload))
        .map_err(|e| DecodeError(e.0.into()))?;
    let text = |b: &Bytes| {
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError("a name that is not UTF-8".into()))
    };
    Ok(Message {
        exchange: text(&record.exchange)?,
        routing_key: text(&record.routing_key)?,
        properties: Properties::parse(record.properties, warren_amqp::limits::TABLE_DEPTH_MAX)
            .map_err(|e| DecodeError(e.to_string()))?,
        body: record.body,
    })
}

/// The message of a replicated queue's entry (always in memory: the log holds its body).
///
/// # Errors
/// See [`decode_message`].
pub fn decode_entry(bytes: &[u8]) -> Result<Entry, DecodeError> {
    decode_message(bytes).map(|m| Entry::Mem(Arc::new(m)))
}

/// [`encode_message`] of an entry; a replicated queue's entries are always in memory.
///
/// # Errors
/// A stored entry (only store-backed queues hold them).
pub fn encode_entry(entry: &Entry) -> Result<Vec<u8>, DecodeError> {
    match entry {
        Entry::Mem(m) => Ok(encode_message(m)),
        Entry::Stored { .. } => Err(DecodeError("a stored entry in a replicated queue".into())),
    }
}

/// `#[serde(with = "warren_broker::replication::raw_bytes")]` for a `Vec<u8>` that is a message body:
/// serde writes a plain `Vec<u8>` element by element (a call per byte, measured as most of a
/// follower's CPU under load), this writes it as one run of bytes. bincode lays both out the
/// same way (a length, then the bytes), so logs written before read back unchanged.
pub mod raw_bytes {
    use serde::{Deserializer, Serializer};

    /// Write `bytes` as one byte string.
    ///
    /// # Errors
    /// The serializer's.
    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(bytes)
    }

    /// Read a byte string (or, from a format without one, a sequence of bytes).
    ///
    /// # Errors
    /// The deserializer's, or a value that is not bytes.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        d.deserialize_byte_buf(Bytes)
    }

    struct Bytes;

    impl<'de> serde::de::Visitor<'de> for Bytes {
        type Value = Vec<u8>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("bytes")
        }

        fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
            Ok(v.to_vec())
        }

        fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
            Ok(v)
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
            // Bounded by what the input holds (the size limit applies to the whole value).
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64 * 1024));
            while let Some(b) = seq.next_element::<u8>()? {
                out.push(b);
            }
            Ok(out)
        }
    }
}

/// A replicated queue's snapshot holds its messages in the log's encoding.
impl serde::Serialize for Entry {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let bytes = encode_entry(self).map_err(serde::ser::Error::custom)?;
        s.serialize_bytes(&bytes)
    }
}

impl<'de> serde::Deserialize<'de> for Entry {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // One run of bytes (a plain Vec<u8> would be read a byte at a time).
        let bytes = raw_bytes::deserialize(d)?;
        decode_entry(&bytes).map_err(serde::de::Error::custom)
    }
}

/// Make a definition change another node made (or this one: every node applies the log in
/// order, so concurrent changes end the same everywhere).
fn apply_definition(broker: &crate::Broker, change: &DefinitionChange) -> Result<(), String> {
    use crate::policy::{PolicyDef, PolicyKind};
    use crate::users::UserError;
    let none = &mut || -> Completion { Box::new(|_| {}) };
    let json = |e: serde_json::Error| e.to_string();
    let kind = |operator: bool| {
        if operator {
            PolicyKind::Operator
        } else {
            PolicyKind::User
        }
    };
    // What was already undone here is no failure.
    let gone = |r: Result<(), UserError>| match r {
        Ok(()) | Err(UserError::NoSuchUser(_) | UserError::NoSuchVhost(_)) => Ok(()),
        Err(e) => Err(e.to_string()),
    };
    match change {
        DefinitionChange::PutUser(user) => broker
            .import_user(serde_json::from_slice(user).map_err(json)?, none)
            .map_err(|e| e.to_string()),
        DefinitionChange::DeleteUser(name) => gone(broker.delete_user(name, none)),
        DefinitionChange::PutVhost {
            name,
            default_queue_type,
            limits,
        } => {
            let limits = serde_json::from_slice(limits).map_err(json)?;
            broker
                .add_vhost(name, default_queue_type.as_deref(), none)
                .map_err(|e| e.to_string())?;
            broker
                .set_default_queue_type(name, default_queue_type.as_deref(), none)
                .and_then(|()| broker.set_vhost_limits(name, limits, none))
                .map_err(|e| e.to_string())
        }
        DefinitionChange::DeleteVhost(name) => gone(broker.delete_vhost(name, none)),
        DefinitionChange::SetPermissions(p) => broker
            .set_permissions(serde_json::from_slice(p).map_err(json)?, none)
            .map_err(|e| e.to_string()),
        DefinitionChange::ClearPermissions { vhost, user } => {
            gone(broker.clear_permissions(vhost, user, none))
        }
        DefinitionChange::SetTopicPermissions(p) => broker
            .set_topic_permissions(serde_json::from_slice(p).map_err(json)?, none)
            .map_err(|e| e.to_string()),
        DefinitionChange::ClearTopicPermissions {
            vhost,
            user,
            exchange,
        } => gone(broker.clear_topic_permissions(vhost, user, exchange.as_deref(), none)),
        DefinitionChange::SetPolicy { operator, def } => {
            let def: PolicyDef = serde_json::from_slice(def).map_err(json)?;
            let vh = broker.vhost(&def.vhost).ok_or("no such vhost")?;
            vh.set_policy(kind(*operator), def, none)
                .map_err(|e| e.to_string())
        }
        DefinitionChange::ClearPolicy {
            operator,
            vhost,
            name,
        } => {
            if let Some(vh) = broker.vhost(vhost) {
                vh.clear_policy(kind(*operator), name, none);
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

    use super::*;

    #[test]
    fn messages_round_trip_and_damage_is_detected() {
        let raw = Bytes::from_static(&[0x10, 0x00, 0x02]); // delivery-mode 2
        let m = Message {
            exchange: "ex".into(),
            routing_key: "rk".into(),
            properties: Properties::parse(raw, 4).unwrap(),
            body: Bytes::from_static(b"hello"),
        };
        let mut bytes = encode_message(&m);
        let back = decode_message(&bytes).unwrap();
        assert_eq!(
            (
                back.exchange.as_str(),
                back.routing_key.as_str(),
                &back.body[..]
            ),
            ("ex", "rk", &b"hello"[..])
        );
        assert!(back.properties.persistent());
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        assert!(decode_message(&bytes).is_err());
        assert!(decode_message(&bytes[..5]).is_err());
    }

    #[test]
    fn a_deleted_user_or_vhost_takes_its_definitions_along() {
        use crate::users::PermissionRecord;
        let perm = |user: &str, vhost: &str| {
            TopologyChange::Definition(DefinitionChange::SetPermissions(
                serde_json::to_vec(&PermissionRecord {
                    user: user.into(),
                    vhost: vhost.into(),
                    configure: ".*".into(),
                    write: ".*".into(),
                    read: ".*".into(),
                })
                .unwrap(),
            ))
            .record_key()
        };
        let policy = TopologyChange::Definition(DefinitionChange::ClearPolicy {
            operator: false,
            vhost: "v1".into(),
            name: "p".into(),
        })
        .record_key();
        let del_user = TopologyChange::Definition(DefinitionChange::DeleteUser("alice".into()));
        let del_vhost = TopologyChange::Definition(DefinitionChange::DeleteVhost("v1".into()));
        assert!(del_user.supersedes(&perm("alice", "v1")));
        assert!(!del_user.supersedes(&perm("bob", "v1")));
        assert!(del_vhost.supersedes(&perm("bob", "v1")));
        assert!(!del_vhost.supersedes(&perm("bob", "v2")));
        assert!(del_vhost.supersedes(&policy));
        assert!(!del_user.supersedes(&policy));
        // A vhost and a user of the same name are different records.
        let vhost_key = TopologyChange::Definition(DefinitionChange::DeleteVhost("x".into()));
        let user_key = TopologyChange::Definition(DefinitionChange::DeleteUser("x".into()));
        assert_ne!(vhost_key.record_key(), user_key.record_key());
        assert!(vhost_key.rank() < user_key.rank());
    }
}
