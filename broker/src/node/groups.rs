//! The node's consumer groups: the assignment machine ([`crate::groups`]) and the members it
//! tells what to consume. Outside a cluster a command is applied here at once; in a cluster it
//! goes through the metadata log (`ClusterHooks::replicate_group`) and every node applies it
//! in log order ([`Groups::apply_committed`]), so members on any node share one assignment.
//! Effects are handed to the members on this node through their connections' outboxes
//! (`Outbound::Group`); a connection carries an effect out when it drains (subscribe to an
//! assigned partition; for a revoked one, cancel, return its unacked deliveries, then report
//! [`Groups::released`]).
//!
//! Not on the hot path: the lock is taken on consume, cancel, release and listing, never per
//! message. Lock order: groups, then an outbox (never a queue or the topology).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::groups::{GroupCommand, GroupEffect, GroupKey, GroupTable, MemberId, Slot};
use crate::queue::outbox::{Outbound, Outbox};
use crate::routing::cluster::ClusterHooks;

/// Where a member's effects go.
#[derive(Debug, Clone)]
pub struct MemberHandle {
    /// Its connection's outbox.
    pub outbox: Arc<Outbox>,
    /// Its channel.
    pub channel: u16,
    /// That channel's incarnation.
    pub epoch: u64,
    /// Its consumer tag (for listings).
    pub tag: String,
    /// Its connection's id (for listings).
    pub connection: u64,
}

#[derive(Debug, Default)]
struct Inner {
    table: GroupTable,
    members: HashMap<MemberId, MemberHandle>,
}

/// The groups of this node.
#[derive(Debug, Default)]
pub struct Groups {
    inner: Mutex<Inner>,
}

/// One member as listings show it.
#[derive(Debug, Clone)]
pub struct MemberInfo {
    /// Its consumer tag.
    pub tag: String,
    /// The number of the node it is connected to (0 outside a cluster).
    pub node: u64,
    /// Its connection's id (0 for a member on another node).
    pub connection: u64,
    /// Its channel (0 for a member on another node).
    pub channel: u16,
    /// The partitions it owns.
    pub partitions: Vec<u32>,
}

/// One group as listings show it.
#[derive(Debug, Clone)]
pub struct GroupInfo {
    /// Which group.
    pub key: GroupKey,
    /// Its epoch.
    pub epoch: u64,
    /// Members in join order.
    pub members: Vec<MemberInfo>,
    /// Each partition's owner's consumer tag (None: unowned or being released).
    pub owners: Vec<Option<String>>,
}

impl Groups {
    /// Carry out effects: each goes to its member's outbox if the member is on this node.
    fn dispatch(inner: &Inner, effects: Vec<GroupEffect>) {
        for effect in effects {
            let member = match &effect {
                GroupEffect::Assign { member, .. } | GroupEffect::Revoke { member, .. } => *member,
            };
            if let Some(h) = inner.members.get(&member) {
                h.outbox.push(Outbound::Group {
                    channel: h.channel,
                    epoch: h.epoch,
                    consumer: member.consumer,
                    effect,
                });
            }
        }
    }

    /// Apply `command` here (a node outside a cluster), or hand it to the cluster's metadata
    /// log, which applies it on every node ([`Groups::apply_committed`]).
    fn submit(&self, cluster: Option<&Arc<dyn ClusterHooks>>, command: GroupCommand) {
        match cluster {
            Some(c) => c.replicate_group(command),
            None => self.apply_committed(command, 0),
        }
    }

    /// A group command committed (in a cluster: by the metadata log, in the same order on
    /// every node). Effects for members on this node (`node`) go to their connections; a
    /// `NodeDown` of this very node (it was taken for dead and its members evicted) cancels
    /// its members, whose clients may join again.
    pub fn apply_committed(&self, command: GroupCommand, node: u64) {
        let evicted = matches!(command, GroupCommand::NodeDown { node: n } if n == node);
        let mut inner = self.inner.lock();
        let mut effects = Vec::new();
        inner.table.apply(command, &mut effects);
        Self::dispatch(&inner, effects);
        if evicted {
            for (member, h) in inner.members.drain() {
                h.outbox.push(Outbound::Cancel {
                    channel: h.channel,
                    consumer: member.consumer,
                });
            }
        }
    }

    /// A consumer joins `key` (a queue of `partitions` partitions); its assignments reach its
    /// outbox.
    pub fn join(
        &self,
        cluster: Option<&Arc<dyn ClusterHooks>>,
        key: GroupKey,
        member: MemberId,
        partitions: u32,
        handle: MemberHandle,
    ) {
        let tag = handle.tag.clone();
        self.inner.lock().members.insert(member, handle);
        self.submit(
            cluster,
            GroupCommand::Join {
                key,
                member,
                partitions,
                tag,
            },
        );
    }

    /// A member left, its deliveries already returned; its partitions go to the others.
    pub fn leave(&self, cluster: Option<&Arc<dyn ClusterHooks>>, key: GroupKey, member: MemberId) {
        self.inner.lock().members.remove(&member);
        self.submit(cluster, GroupCommand::Leave { key, member });
    }

    /// A member gave up a revoked partition (stopped consuming it, returned its deliveries).
    pub fn released(
        &self,
        cluster: Option<&Arc<dyn ClusterHooks>>,
        key: GroupKey,
        member: MemberId,
        partition: u32,
    ) {
        self.submit(
            cluster,
            GroupCommand::Released {
                key,
                member,
                partition,
            },
        );
    }

    /// Members on node `node` the table lists but this node does not hold (left while their
    /// Leave was lost, or from before a restart): each should be made to leave.
    #[must_use]
    pub fn stale_members(&self, node: u64) -> Vec<(GroupKey, MemberId)> {
        let inner = self.inner.lock();
        inner
            .table
            .groups()
            .flat_map(|(k, g)| {
                g.members()
                    .iter()
                    .filter(|m| m.node == node && !inner.members.contains_key(m))
                    .map(|m| (k.clone(), *m))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Whether any group has a member on node `node`.
    #[must_use]
    pub fn has_members_on(&self, node: u64) -> bool {
        self.inner
            .lock()
            .table
            .groups()
            .any(|(_, g)| g.members().iter().any(|m| m.node == node))
    }

    /// The table, encoded (for the cluster's metadata snapshot).
    ///
    /// # Errors
    /// Encoding failed.
    pub fn encode(&self) -> Result<Vec<u8>, String> {
        serde_json::to_vec(&self.inner.lock().table).map_err(|e| e.to_string())
    }

    /// Replace the table with one from a snapshot ([`Groups::encode`]).
    ///
    /// # Errors
    /// The bytes are not a table.
    pub fn install(&self, bytes: &[u8]) -> Result<(), String> {
        let table: GroupTable = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        self.inner.lock().table = table;
        Ok(())
    }

    /// The groups of `vhost` (every vhost if None), optionally of one queue, sorted.
    #[must_use]
    pub fn list(&self, vhost: Option<&str>, queue: Option<&str>) -> Vec<GroupInfo> {
        let inner = self.inner.lock();
        inner
            .table
            .groups()
            .filter(|(k, _)| vhost.is_none_or(|v| k.vhost == v))
            .filter(|(k, _)| queue.is_none_or(|q| k.queue == q))
            .map(|(key, g)| {
                let tag = |m: &MemberId| g.tag(*m).map(str::to_string);
                GroupInfo {
                    key: key.clone(),
                    epoch: g.epoch(),
                    members: g
                        .members()
                        .iter()
                        .map(|m| {
                            let h = inner.members.get(m);
                            MemberInfo {
                                tag: g.tag(*m).unwrap_or_default().to_string(),
                                node: m.node,
                                connection: h.map_or(0, |h| h.connection),
                                channel: h.map_or(0, |h| h.channel),
                                partitions: g.owned_by(*m).collect(),
                            }
                        })
                        .collect(),
                    owners: g
                        .slots()
                        .iter()
                        .map(|s| match s {
                            Slot::Owned(m) => tag(m),
                            Slot::Free | Slot::Releasing(_) => None,
                        })
                        .collect(),
                }
            })
            .collect()
    }
}

/// How far group `group` is behind on partition `queue`: a queue's ready messages (what no
/// member has been given yet); a stream's messages after the group's tracked offset (all it
/// holds while the group has none).
#[must_use]
pub fn partition_lag(queue: &crate::queue::Queue, group: &str) -> u64 {
    match queue.stream() {
        Some(stream) => {
            let stats = stream.stats(crate::timers::wall_ms());
            stats
                .tracked
                .iter()
                .find(|t| t.name == group)
                .map_or(stats.messages, |t| t.lag.messages)
        }
        None => u64::from(queue.counts().messages),
    }
}
