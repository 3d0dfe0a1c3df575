//! The node's consumer groups: the assignment machine ([`crate::groups`]) and the members it
//! tells what to consume. A command is applied under one lock and its effects are handed to the
//! members' connections through their outboxes (`Outbound::Group`); a connection carries an
//! effect out when it drains (subscribe to an assigned partition; for a revoked one, cancel,
//! return its unacked deliveries, then report [`Groups::released`]).
//!
//! Not on the hot path: the lock is taken on consume, cancel, release and listing, never per
//! message. Lock order: groups, then an outbox (never a queue or the topology).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::groups::{GroupCommand, GroupEffect, GroupKey, GroupTable, MemberId, Slot};
use crate::queue::outbox::{Outbound, Outbox};

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
    /// Its connection's id.
    pub connection: u64,
    /// Its channel.
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
    fn run(inner: &mut Inner, command: GroupCommand) {
        let mut effects = Vec::new();
        inner.table.apply(command, &mut effects);
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

    /// A consumer joins `key` (a queue of `partitions` partitions); its assignments reach its
    /// outbox.
    pub fn join(&self, key: GroupKey, member: MemberId, partitions: u32, handle: MemberHandle) {
        let mut inner = self.inner.lock();
        inner.members.insert(member, handle);
        Self::run(
            &mut inner,
            GroupCommand::Join {
                key,
                member,
                partitions,
            },
        );
    }

    /// A member left, its deliveries already returned; its partitions go to the others.
    pub fn leave(&self, key: GroupKey, member: MemberId) {
        let mut inner = self.inner.lock();
        inner.members.remove(&member);
        Self::run(&mut inner, GroupCommand::Leave { key, member });
    }

    /// A member gave up a revoked partition (stopped consuming it, returned its deliveries).
    pub fn released(&self, key: GroupKey, member: MemberId, partition: u32) {
        let mut inner = self.inner.lock();
        Self::run(
            &mut inner,
            GroupCommand::Released {
                key,
                member,
                partition,
            },
        );
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
                let tag = |m: &MemberId| inner.members.get(m).map(|h| h.tag.clone());
                GroupInfo {
                    key: key.clone(),
                    epoch: g.epoch(),
                    members: g
                        .members()
                        .iter()
                        .map(|m| {
                            let h = inner.members.get(m);
                            MemberInfo {
                                tag: h.map(|h| h.tag.clone()).unwrap_or_default(),
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
