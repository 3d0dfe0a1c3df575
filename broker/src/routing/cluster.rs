//! What the broker needs from a cluster (implemented by `warren-cluster`, never imported back):
//! [`ClusterHooks`], which the vhost calls to create and delete replicated queues and to
//! replicate exchange, binding and definition changes, and the changes themselves as the
//! cluster's metadata log carries them ([`TopologyChange`], [`DefinitionChange`]). Applying a
//! change that came from the cluster is the node layer's job (`crate::node::replication`).

use std::sync::Arc;

use warren_store::writer::Completion;

use crate::queue::Queue;

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
    /// A classic queue was created on this node, its home: every other node learns of it and
    /// makes a proxy through which its clients use it; `done` runs once that committed.
    fn announce_classic(&self, queue: &Arc<Queue>, done: Completion);
    /// A classic queue held on this node was deleted: the others drop their proxies.
    fn retract_classic(&self, queue: &Arc<Queue>);
    /// Delete a classic queue homed on another node, through its proxy here: `done` runs
    /// once the home deleted it.
    fn delete_remote(&self, queue: &Arc<Queue>, done: Completion);
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
    /// The other running nodes' management listings of `kind`, asked concurrently: `done`
    /// gets one JSON array per node that answered within [`PEER_LISTING_WAIT`] (a node that
    /// is down or slow is left out, as RabbitMQ leaves out a node that does not answer).
    fn peer_listings(&self, kind: Listing, done: ListingsDone);
    /// Close connection `name` (320 CONNECTION_FORCED with `reason`) wherever in the cluster
    /// it is open, this node excepted: `done` gets whether a node had it.
    fn close_peer_connection(&self, name: String, reason: String, done: ClosedDone);
    /// Where direct replies for requesters on the node numbered `node` go (push
    /// [`Outbound::PeerReply`]; delivered in order): None when no running node other than this
    /// one has that number.
    ///
    /// [`Outbound::PeerReply`]: crate::queue::outbox::Outbound::PeerReply
    fn reply_outbox(&self, node: u64) -> Option<Arc<crate::queue::outbox::Outbox>>;
    /// A consumer-group command made here: the metadata log carries it to every node, each
    /// of which applies it in log order (`crate::node::groups::Groups::apply_committed`).
    /// Every group command is idempotent, so it may be retried.
    fn replicate_group(&self, command: crate::groups::GroupCommand);
}

/// What a management listing across the cluster asks each node for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Listing {
    /// `/api/connections`: every AMQP connection open on the node.
    Connections,
    /// `/api/channels`: every channel of those connections.
    Channels,
    /// `/api/consumers`: every consumer of those channels.
    Consumers,
    /// `/api/overview`'s `object_totals`: one object with the node's `connections` and
    /// `channels` counts.
    Totals,
}

/// Longest a node waits for another's listing.
pub const PEER_LISTING_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Receives the other nodes' listings, each a JSON array (UTF-8) of the objects the node's
/// own API would list, unfiltered (the asking node applies its caller's visibility).
pub type ListingsDone = Box<dyn FnOnce(Vec<Vec<u8>>) + Send>;

/// Receives whether another node had the connection to close.
pub type ClosedDone = Box<dyn FnOnce(bool) + Send>;

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
    /// Bytes this node sent it over the cluster port since this node started (0 for itself).
    pub send_bytes: u64,
    /// Bytes this node received from it over the cluster port since this node started.
    pub recv_bytes: u64,
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

/// Mark the changes this thread makes from now on as coming from the cluster (or not).
pub(crate) fn set_applying(on: bool) {
    APPLYING.with(|a| a.set(on));
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

    use super::*;

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
