//! The consumer-group machine: which member of a group owns which partition of a partitioned
//! queue. Pure and deterministic (`apply(command) -> effects`, no clock, no I/O), so the same
//! commands give the same assignment wherever they are applied: on one node today, from the
//! cluster's replicated metadata log across nodes.
//!
//! Each partition has at most one owner. A partition moving from a live member to another is
//! first revoked ([`GroupEffect::Revoke`]): the old owner stops consuming it and returns its
//! unacked deliveries, then reports [`GroupCommand::Released`]; only then is it assigned
//! ([`GroupEffect::Assign`]) to the new owner, so one partition's messages are never with two
//! members at once. A member that leaves (cancelled, its channel or connection closed, its node
//! down) has already returned its deliveries, so its partitions are free at once.
//!
//! The assignment is balanced and sticky: with P partitions and M members (in join order), the
//! first `P mod M` members own `P / M + 1` partitions and the others `P / M`; a rebalance only
//! moves partitions off members above their share, onto members below it. Every assignment
//! bumps the group's epoch.
//!
//! Invariants (checked in debug builds after every command, and by the property test against a
//! model in `machine_tests.rs`): an owner or a releasing member is a member; when nothing is
//! being released and the group has members, every partition is owned and shares differ by at
//! most one.

use std::collections::BTreeMap;

/// A member of a consumer group: one consumer on one node.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct MemberId {
    /// The node it is connected to (0 on a node outside a cluster).
    pub node: u64,
    /// Its consumer id on that node.
    pub consumer: u64,
}

/// A group: its name and the partitioned queue it consumes.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct GroupKey {
    /// The vhost.
    pub vhost: String,
    /// The partitioned queue's (logical) name.
    pub queue: String,
    /// The group's name (`x-consumer-group`).
    pub group: String,
}

/// What changes a group.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum GroupCommand {
    /// A consumer joins `key` (a queue of `partitions` partitions). Joining twice is a no-op.
    Join {
        /// The group.
        key: GroupKey,
        /// The consumer.
        member: MemberId,
        /// The queue's partition count (used when the group is new).
        partitions: u32,
        /// Its consumer tag (shown in listings on every node).
        tag: String,
    },
    /// A consumer left, its deliveries already returned.
    Leave {
        /// The group.
        key: GroupKey,
        /// The consumer.
        member: MemberId,
    },
    /// A member finished giving up a revoked partition.
    Released {
        /// The group.
        key: GroupKey,
        /// The member it was revoked from.
        member: MemberId,
        /// The partition.
        partition: u32,
    },
    /// Every member on `node` left (the node is down).
    NodeDown {
        /// The node.
        node: u64,
    },
}

/// What the members of a group are told to do.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum GroupEffect {
    /// `member` now owns `partition`: it starts consuming it.
    Assign {
        /// The group.
        key: GroupKey,
        /// The new owner.
        member: MemberId,
        /// The partition.
        partition: u32,
        /// The group's epoch with this assignment.
        epoch: u64,
    },
    /// `member` must give up `partition`: stop consuming it, return its unacked deliveries,
    /// then send [`GroupCommand::Released`].
    Revoke {
        /// The group.
        key: GroupKey,
        /// The owner giving it up.
        member: MemberId,
        /// The partition.
        partition: u32,
        /// The group's epoch when revoked.
        epoch: u64,
    },
}

/// One partition's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Slot {
    /// Nobody has it.
    Free,
    /// `0` consumes it.
    Owned(MemberId),
    /// `0` was told to give it up and has not confirmed yet.
    Releasing(MemberId),
}

/// One group's state.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Group {
    /// Members in join order.
    members: Vec<MemberId>,
    /// Their consumer tags, by the same index.
    tags: Vec<String>,
    /// One slot per partition.
    slots: Vec<Slot>,
    /// The epoch of its last assignment.
    epoch: u64,
}

impl Group {
    /// Members in join order.
    #[must_use]
    pub fn members(&self) -> &[MemberId] {
        &self.members
    }

    /// A member's consumer tag.
    #[must_use]
    pub fn tag(&self, member: MemberId) -> Option<&str> {
        let i = self.members.iter().position(|m| *m == member)?;
        self.tags.get(i).map(String::as_str)
    }

    /// The partitions' states.
    #[must_use]
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// The current epoch.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The partitions `member` owns (not those it is releasing).
    pub fn owned_by(&self, member: MemberId) -> impl Iterator<Item = u32> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter(move |(_, s)| **s == Slot::Owned(member))
            .map(|(i, _)| index(i))
    }

    /// The share of partitions the member at join position `i` should own.
    fn target(&self, i: usize) -> usize {
        let (p, m) = (self.slots.len(), self.members.len());
        p / m + usize::from(i < p % m)
    }

    fn check(&self) {
        for s in &self.slots {
            if let Slot::Owned(m) | Slot::Releasing(m) = s {
                debug_assert!(self.members.contains(m), "a slot held by a non-member");
            }
        }
        if !self.members.is_empty() && !self.slots.iter().any(|s| matches!(s, Slot::Releasing(_))) {
            debug_assert!(self.slots.iter().all(|s| matches!(s, Slot::Owned(_))));
        }
    }
}

/// Every group of a node (or of the cluster).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GroupTable {
    #[serde(with = "as_pairs")]
    groups: BTreeMap<GroupKey, Group>,
    /// The last epoch given out. One counter for every group, so a group's epoch never goes
    /// back, even when it empties and is formed again under the same name.
    epoch: u64,
}

fn index(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

impl GroupTable {
    /// A group's state.
    #[must_use]
    pub fn group(&self, key: &GroupKey) -> Option<&Group> {
        self.groups.get(key)
    }

    /// Every group.
    pub fn groups(&self) -> impl Iterator<Item = (&GroupKey, &Group)> {
        self.groups.iter()
    }

    /// Apply one command; the effects go to `out` in order.
    pub fn apply(&mut self, command: GroupCommand, out: &mut Vec<GroupEffect>) {
        match command {
            GroupCommand::Join {
                key,
                member,
                partitions,
                tag,
            } => {
                let g = self.groups.entry(key.clone()).or_insert_with(|| Group {
                    members: Vec::new(),
                    tags: Vec::new(),
                    slots: vec![Slot::Free; partitions as usize],
                    epoch: 0,
                });
                if g.members.contains(&member) {
                    return;
                }
                g.members.push(member);
                g.tags.push(tag);
                self.rebalance(&key, out);
            }
            GroupCommand::Leave { key, member } => self.leave(&key, member, out),
            GroupCommand::Released {
                key,
                member,
                partition,
            } => {
                let Some(g) = self.groups.get_mut(&key) else {
                    return;
                };
                match g.slots.get_mut(partition as usize) {
                    Some(slot) if *slot == Slot::Releasing(member) => *slot = Slot::Free,
                    // A late or repeated report: nothing to do.
                    _ => return,
                }
                self.rebalance(&key, out);
            }
            GroupCommand::NodeDown { node } => {
                let keys: Vec<GroupKey> = self
                    .groups
                    .iter()
                    .filter(|(_, g)| g.members.iter().any(|m| m.node == node))
                    .map(|(k, _)| k.clone())
                    .collect();
                for key in keys {
                    // All of the node's members at once: none is assigned what another frees.
                    self.leave_where(&key, |m| m.node == node, out);
                }
            }
        }
    }

    fn leave(&mut self, key: &GroupKey, member: MemberId, out: &mut Vec<GroupEffect>) {
        self.leave_where(key, |m| m == member, out);
    }

    fn leave_where(
        &mut self,
        key: &GroupKey,
        gone: impl Fn(MemberId) -> bool,
        out: &mut Vec<GroupEffect>,
    ) {
        let Some(g) = self.groups.get_mut(key) else {
            return;
        };
        let before = g.members.len();
        let (members, tags): (Vec<MemberId>, Vec<String>) = g
            .members
            .iter()
            .copied()
            .zip(std::mem::take(&mut g.tags))
            .filter(|(m, _)| !gone(*m))
            .unzip();
        g.members = members;
        g.tags = tags;
        if g.members.len() == before {
            return;
        }
        for slot in &mut g.slots {
            if matches!(slot, Slot::Owned(m) | Slot::Releasing(m) if gone(*m)) {
                *slot = Slot::Free;
            }
        }
        if g.members.is_empty() {
            self.groups.remove(key);
            return;
        }
        self.rebalance(key, out);
    }

    /// Move partitions toward the balanced share: revoke what members hold above it, assign
    /// free partitions to members below it.
    fn rebalance(&mut self, key: &GroupKey, out: &mut Vec<GroupEffect>) {
        let next_epoch = self.epoch + 1;
        let Some(g) = self.groups.get_mut(key) else {
            return;
        };
        if g.members.is_empty() {
            return;
        }
        // Revoke surplus, highest partitions first (each member keeps its lowest ones).
        for (i, m) in g.members.clone().into_iter().enumerate() {
            let target = g.target(i);
            let owned: Vec<usize> = g
                .slots
                .iter()
                .enumerate()
                .filter(|(_, s)| **s == Slot::Owned(m))
                .map(|(p, _)| p)
                .collect();
            for p in owned
                .into_iter()
                .skip(target)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
            {
                g.slots[p] = Slot::Releasing(m);
                out.push(GroupEffect::Revoke {
                    key: key.clone(),
                    member: m,
                    partition: index(p),
                    epoch: g.epoch,
                });
            }
        }
        // Assign free partitions, lowest first, to members below their share in join order.
        let mut bumped = false;
        for (i, m) in g.members.clone().into_iter().enumerate() {
            let target = g.target(i);
            let held = g
                .slots
                .iter()
                .filter(|s| matches!(s, Slot::Owned(x) | Slot::Releasing(x) if *x == m))
                .count();
            let mut want = target.saturating_sub(held);
            while want > 0 {
                let Some(p) = g.slots.iter().position(|s| *s == Slot::Free) else {
                    break;
                };
                if !bumped {
                    g.epoch = next_epoch;
                    bumped = true;
                }
                g.slots[p] = Slot::Owned(m);
                out.push(GroupEffect::Assign {
                    key: key.clone(),
                    member: m,
                    partition: index(p),
                    epoch: g.epoch,
                });
                want -= 1;
            }
        }
        g.check();
        if bumped {
            self.epoch = next_epoch;
        }
    }
}

/// The table's map as a list of pairs (JSON keys must be strings; a group's key is three).
mod as_pairs {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::{Group, GroupKey};

    pub(super) fn serialize<S: Serializer>(
        map: &BTreeMap<GroupKey, Group>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        let pairs: Vec<(&GroupKey, &Group)> = map.iter().collect();
        pairs.serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<GroupKey, Group>, D::Error> {
        let pairs: Vec<(GroupKey, Group)> = Vec::deserialize(d)?;
        Ok(pairs.into_iter().collect())
    }
}
