//! The node's watch, every second: ping peers (so every peer's silence is known), and for
//! each queue this node leads, reconcile its members and return what consumers on silent
//! peers held (down nodes).

use std::sync::{PoisonError, Weak};
use std::time::Duration;

use warren_broker::node::replication::Replicator;
use warren_broker::queue::machine::Command;
use warren_broker::routing::cluster::ClusterHooks;

use crate::transport::tcp;
use crate::transport::tcp::GroupId;
use crate::types::NodeId;

use super::membership::reconcile_meta;
use super::placement::{add_learners, reconcile_members};
use super::{ClusterNode, DOWN_AFTER, META_GROUP};

/// Every this many seconds the classic queues held here are checked against the metadata's
/// records (besides once at start).
const CLASSIC_RECONCILE_TICKS: u64 = 10;

/// Every this many seconds each quorum queue's log here is compacted (released bodies
/// deleted, entries purged: `QueueReplica::compact_log`).
const COMPACT_TICKS: u64 = 5;

/// How often a peer that sent nothing lately is pinged: well within [`DOWN_AFTER`], and
/// within the groups' election timeout (1.5 s at least), which the node's watch measures on
/// this silence (`elections`).
pub(super) const PING_EVERY: Duration = Duration::from_millis(250);

/// Every second: for each queue this node leads, return what consumers on silent peers held.
pub(super) async fn watch_peers(weak: Weak<ClusterNode>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut pinged: std::collections::HashSet<NodeId> = std::collections::HashSet::new();
    let mut ticks: u64 = 0;
    loop {
        tick.tick().await;
        let Some(node) = weak.upgrade() else {
            return;
        };
        reconcile_meta(&node);
        ticks += 1;
        if ticks.is_multiple_of(CLASSIC_RECONCILE_TICKS) {
            // An announcement lost to a long election (the whole cluster starting at once)
            // is made again.
            node.reconcile_classic(false);
        }
        if ticks.is_multiple_of(COMPACT_TICKS) {
            let replicas = node.replicas();
            let logs = std::sync::Arc::clone(&node.queue_logs);
            let here = weak.clone();
            tokio::spawn(async move {
                for replica in replicas {
                    replica.compact_log().await;
                }
                // A WAL grown past its bound: the groups holding its oldest segment snapshot
                // and purge now (an idle queue's old entries would keep every segment after).
                let pinning = logs.pinning_groups();
                if pinning.is_empty() {
                    return;
                }
                tracing::info!(groups = ?pinning, segments = ?logs.wal_segments(), "the write-ahead log is long: compacting the groups holding its oldest segment");
                for incarnation in pinning {
                    let Some(node) = here.upgrade() else {
                        return;
                    };
                    if let Some(replica) = node.replica_of(incarnation) {
                        drop(node);
                        replica.compact_log_now().await;
                    } else if node.is_orphan_log(incarnation) {
                        tracing::info!(
                            incarnation,
                            "dropping the log of a queue deleted while this node was away"
                        );
                        let logs = std::sync::Arc::clone(&logs);
                        let _ =
                            tokio::task::spawn_blocking(move || logs.drop_group(incarnation)).await;
                    }
                }
            });
        }
        for (id, _) in node.current() {
            if id == node.me || !pinged.insert(id) {
                continue;
            }
            let alive = weak.clone();
            tokio::spawn(tcp::ping_loop(
                node.me,
                id,
                GroupId {
                    name: META_GROUP.into(),
                    incarnation: 0,
                },
                node.addresses.clone(),
                node.secret.clone(),
                PING_EVERY,
                move || alive.upgrade().is_none_or(|n| n.is_forgotten(id)),
            ));
        }
        for (id, _) in node.current() {
            let down = node.is_down(id);
            let mut seen = node
                .down_peers
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if down && seen.insert(id) {
                drop(seen);
                node.classic_peer_down(id);
            } else if !down {
                seen.remove(&id);
            } else {
                drop(seen);
            }
            if down {
                node.delete_transient_of(id);
                node.evict_group_members_of(id);
            }
        }
        node.leave_stale_group_members();
        for replica in node.replicas() {
            if !replica.is_leader() {
                continue;
            }
            add_learners(&node, &replica);
            reconcile_members(&node, &replica);
            for (id, peer) in node.current() {
                if id == node.me {
                    continue;
                }
                // A peer never heard from since this node started is silent after a while.
                let silent = node.silence(id) > DOWN_AFTER;
                let mut downed = replica
                    .downed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                match (silent, downed.contains(&id)) {
                    (true, false) => {
                        if let Some(number) = node.peer_number(id) {
                            downed.push(id);
                            tracing::info!(queue = %replica.queue.name, peer = %peer.name, "peer silent: returning what its consumers held");
                            replica.submit(
                                vec![Command::Down {
                                    node: number,
                                    before: u64::MAX,
                                }],
                                Box::new(|_| {}),
                            );
                        }
                    }
                    (false, true) => downed.retain(|d| *d != id),
                    _ => {}
                }
            }
        }
    }
}

impl ClusterNode {
    /// As the metadata leader, take the consumer-group members of down peer `peer` out of
    /// their groups (their partitions go to the members still here). Checked every second
    /// while it is down: the command is idempotent, and the leader may change meanwhile.
    fn evict_group_members_of(&self, peer: NodeId) {
        let leads = self
            .meta
            .get()
            .is_some_and(|m| m.metrics().borrow().current_leader == Some(self.me));
        let Some(number) = self.peer_number(peer) else {
            return;
        };
        if leads && self.broker.groups().has_members_on(number) {
            tracing::info!(node = %self.name_of(peer), "node down: its consumer-group members leave their groups");
            self.replicate_group(warren_broker::groups::GroupCommand::NodeDown { node: number });
        }
    }

    /// Members of this node the group table still lists but no connection here holds (their
    /// Leave was lost, or they are from before a restart) leave.
    fn leave_stale_group_members(&self) {
        for (key, member) in self.broker.groups().stale_members(self.number()) {
            self.replicate_group(warren_broker::groups::GroupCommand::Leave { key, member });
        }
    }
}
