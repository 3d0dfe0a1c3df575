//! Which nodes hold a quorum queue's group: the members a new group gets (rendezvous
//! hashing over the nodes, the first leading as the leader locator says), the members the
//! metadata group last set, and, as a group's leader, making its voters and learners those.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use openraft::BasicNode;

use crate::types::NodeId;

use super::ClusterNode;
use super::config::node_id;
use super::replicas::QueueReplica;

/// How long a placement counts for its chosen leader before the queue has one (a queue whose
/// group never started stops counting then).
const PLACED_FOR: Duration = Duration::from_secs(30);

/// Replicas of a quorum queue unless `x-quorum-initial-group-size` says otherwise.
pub const GROUP_SIZE_DEFAULT: usize = 3;

impl ClusterNode {
    /// A queue's members as the metadata group last set them.
    pub(super) fn members_of(&self, incarnation: u64) -> Vec<NodeId> {
        let mut members = self
            .members
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&incarnation)
            .cloned()
            .unwrap_or_default();
        members.retain(|id| !self.is_forgotten(*id));
        members
    }

    /// The members of a new group of `size`: the nodes ranking highest for this incarnation
    /// (rendezvous hashing spreads groups, and so leaders, over the nodes).
    pub(super) fn place(&self, incarnation: u64, size: usize, balanced: bool) -> Vec<NodeId> {
        let mut ranked: Vec<(u64, NodeId)> = self
            .current()
            .into_iter()
            .map(|(id, _)| (node_id(&format!("{incarnation}/{id}")), id))
            .collect();
        ranked.sort_unstable();
        let mut members: Vec<NodeId> = ranked
            .into_iter()
            .take(size.max(1))
            .map(|(_, id)| id)
            .collect();
        // The first member starts the group and so leads it first: RabbitMQ's leader
        // locator chooses which.
        let leader = if balanced {
            let led = self.leaders_per_node();
            members
                .iter()
                .copied()
                .min_by_key(|m| (led.get(m).copied().unwrap_or(0), *m))
        } else {
            // client-local: this node, the declaring client's, is a member and leads.
            if !members.contains(&self.me) {
                members.pop();
                members.push(self.me);
            }
            Some(self.me)
        };
        if let Some(leader) = leader
            && let Some(at) = members.iter().position(|m| *m == leader)
        {
            members.swap(0, at);
            if balanced {
                self.placed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(incarnation, (leader, Instant::now()));
            }
        }
        members
    }

    /// How many quorum queues each node leads, as this node's replicas see it, counting the
    /// queues placed here lately that have no leader yet as led by the node chosen for them
    /// (queues declared back to back, such as a partitioned queue's partitions, would
    /// otherwise all see the same counts and go to one node).
    fn leaders_per_node(&self) -> HashMap<NodeId, usize> {
        let mut led = HashMap::new();
        let mut placed = self.placed.lock().unwrap_or_else(PoisonError::into_inner);
        placed.retain(|_, (_, at)| at.elapsed() < PLACED_FOR);
        let mut pending = placed.clone();
        drop(placed);
        for r in self.replicas() {
            if let Some(l) = r
                .raft
                .get()
                .and_then(|raft| raft.metrics().borrow().current_leader)
            {
                *led.entry(l).or_insert(0) += 1;
                pending.remove(&r.group.incarnation);
            }
        }
        for (node, _) in pending.into_values() {
            *led.entry(node).or_insert(0) += 1;
        }
        led
    }
}

/// As a queue's leader: every node that is neither voter nor learner yet becomes a learner.
pub(super) fn add_learners(node: &ClusterNode, replica: &QueueReplica) {
    let Some(raft) = replica.raft.get() else {
        return;
    };
    let known: Vec<NodeId> = raft
        .metrics()
        .borrow()
        .membership_config
        .nodes()
        .map(|(id, _)| *id)
        .collect();
    for (id, peer) in node.current() {
        if known.contains(&id) {
            continue;
        }
        let (raft, addr) = (raft.clone(), peer.addr.clone());
        tokio::spawn(async move {
            if let Err(e) = raft.add_learner(id, BasicNode::new(addr), false).await {
                tracing::debug!(error = %e, "adding a learner");
            }
        });
    }
}

/// As a queue's leader: make the group's voters the members the metadata group set, when
/// they differ (one change at a time). Nodes to add are made learners first, caught up
/// (`add_learner` blocks until they are), so a new voter never stalls the majority; removed
/// voters stay learners.
pub(super) fn reconcile_members(node: &ClusterNode, replica: &Arc<QueueReplica>) {
    use std::sync::atomic::Ordering;
    let Some(raft) = replica.raft.get() else {
        return;
    };
    let desired: std::collections::BTreeSet<NodeId> = node
        .members_of(replica.group.incarnation)
        .into_iter()
        .collect();
    let (voters, known): (std::collections::BTreeSet<NodeId>, Vec<NodeId>) = {
        let m = raft.metrics();
        let m = m.borrow();
        let membership = m.membership_config.membership();
        (
            membership.voter_ids().collect(),
            membership.nodes().map(|(id, _)| *id).collect(),
        )
    };
    let forgotten: std::collections::BTreeSet<NodeId> = known
        .iter()
        .copied()
        .filter(|id| !voters.contains(id) && node.is_forgotten(*id))
        .collect();
    if desired.is_empty()
        || (desired == voters && forgotten.is_empty())
        || replica.changing.swap(true, Ordering::AcqRel)
    {
        return;
    }
    if desired == voters {
        // Only learners of forgotten nodes to drop.
        let (raft, replica) = (raft.clone(), Arc::clone(replica));
        tokio::spawn(async move {
            if let Err(e) = raft
                .change_membership(openraft::ChangeMembers::RemoveNodes(forgotten), false)
                .await
            {
                tracing::warn!(queue = %replica.queue.name, error = %e, "dropping forgotten learners");
            }
            replica.changing.store(false, Ordering::Release);
        });
        return;
    }
    let learners: Vec<(NodeId, String)> = desired
        .iter()
        .filter(|id| !known.contains(id))
        .filter_map(|id| node.addresses.get(*id).map(|a| (*id, a)))
        .collect();
    let (raft, replica, weak) = (raft.clone(), Arc::clone(replica), node.weak_self());
    tokio::spawn(async move {
        for (id, addr) in learners {
            if let Err(e) = raft.add_learner(id, BasicNode::new(addr), true).await {
                tracing::debug!(error = %e, "adding a learner before it votes");
            }
        }
        let changed = raft.change_membership(desired.clone(), true).await;
        replica.changing.store(false, Ordering::Release);
        match changed {
            Ok(_) => {
                tracing::info!(queue = %replica.queue.name, members = ?desired, "queue members changed");
            }
            Err(e) => {
                tracing::warn!(queue = %replica.queue.name, error = %e, "changing queue members");
                return;
            }
        }
        // A leader that is no member any more keeps leading as a learner (openraft cannot
        // remove a leader without it stepping down mid-change): hand over to a voter.
        let Some(node) = weak.upgrade() else {
            return;
        };
        if desired.contains(&node.me) || raft.metrics().borrow().current_leader != Some(node.me) {
            return;
        }
        let target = {
            let m = raft.metrics();
            let m = m.borrow();
            // The voter furthest along (it catches up fastest).
            desired.iter().copied().max_by_key(|v| {
                m.replication
                    .as_ref()
                    .and_then(|r| r.get(v).copied().flatten())
                    .map(|l| l.index)
            })
        };
        if let Some(target) = target {
            match node.lead_transfer(replica.group.incarnation, target).await {
                Ok(new) => {
                    tracing::info!(queue = %replica.queue.name, leader = new, "the removed leader handed over")
                }
                Err(e) => {
                    tracing::warn!(queue = %replica.queue.name, error = %e, "the removed leader could not hand over")
                }
            }
        }
    });
}
