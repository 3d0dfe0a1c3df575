//! The replication seam as `warren-cluster` sees it, in one place: the queue layer's
//! [`Replicator`] (one replicated queue's Raft group), the routing layer's [`ClusterHooks`] and
//! the changes it replicates, the log's message encoding, and here the node's side: applying a
//! change that another node made ([`apply_topology`]).
//!
//! ```text
//!  channel ──command──► Replicator ──(forward to leader)──► Raft log ──commit──┐
//!                                                                              ▼
//!      consumers on this node ◄──deliver── Queue::apply_committed ◄── every replica
//! ```

use warren_store::writer::Completion;

pub use crate::message::codec::{
    DecodeError, decode_entry, decode_message, encode_entry, encode_loaded, encode_message,
    raw_bytes,
};
pub use crate::queue::replica::{
    Placement, ReplicaDone, ReplicaState, ReplicationError, Replicator, Replies,
};
pub use crate::queue::{QueueStats, REMOTE_OWNER, ServeDone};
use crate::routing::cluster::set_applying;
pub use crate::routing::cluster::{
    ClosedDone, ClusterHooks, DefinitionChange, Listing, ListingsDone, MemberChange,
    MembershipError, NodeStatus, PEER_LISTING_WAIT, TopologyChange, TransferDone, TransferError,
    applying,
};

/// Make a change another node made (idempotent: this node may have made it itself).
///
/// # Errors
/// It does not apply here (yet): a binding whose queue this node has not started serving, a
/// vhost it does not have. The caller may try again later.
pub fn apply_topology(
    broker: &crate::node::broker::Broker,
    change: &TopologyChange,
) -> Result<(), String> {
    set_applying(true);
    let r = apply_topology_here(broker, change);
    set_applying(false);
    r
}

fn apply_topology_here(
    broker: &crate::node::broker::Broker,
    change: &TopologyChange,
) -> Result<(), String> {
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

/// Make a definition change another node made (or this one: every node applies the log in
/// order, so concurrent changes end the same everywhere).
fn apply_definition(
    broker: &crate::node::broker::Broker,
    change: &DefinitionChange,
) -> Result<(), String> {
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
