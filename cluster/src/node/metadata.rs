//! The metadata group, which every node runs: its state machine ([`MetaState`]: queue
//! records and their members, node records, exchanges, bindings and definitions), the replay
//! of what it had committed when a node starts, what a committed change does on this node
//! (serve or drop a queue, record a node, apply a topology change), and proposing changes.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use openraft::Raft;
use warren_broker::node::replication::{Replicator, TopologyChange};
use warren_store::writer::Completion;

use crate::group::Applied;
use crate::transport::tcp::Forwarded;
use crate::types::{MetaChange, QueueRaft, QueueRequest, QueueResponse};

use super::forwarding::{RETRY_FOR, send_retrying};
use super::placement::reconcile_members;
use super::{ClusterNode, FOUNDING_NODES_MAX};

/// How long a starting node waits for its metadata to replay before serving anyway.
const REPLAY_MAX: Duration = Duration::from_secs(60);

impl ClusterNode {
    /// Wait until the metadata this node had committed is applied again and the quorum queues
    /// it names are served here (so a client of a node that restarted, even the whole
    /// cluster at once, finds its queues, exchanges and users as they were).
    pub(super) async fn replay(&self, raft: &Raft<QueueRaft>, committed: Option<u64>) {
        if let Some(index) = committed {
            let mut metrics = raft.metrics();
            let applied = tokio::time::timeout(REPLAY_MAX, async {
                loop {
                    if metrics
                        .borrow()
                        .last_applied
                        .is_some_and(|l| l.index >= index)
                    {
                        return;
                    }
                    if metrics.changed().await.is_err() {
                        return;
                    }
                }
            })
            .await;
            if applied.is_err() {
                tracing::warn!(index, "metadata replay is slow; serving meanwhile");
            }
        }
        let serving = self
            .booting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .unwrap_or_default();
        for task in serving {
            let _ = tokio::time::timeout(REPLAY_MAX, task).await;
        }
    }

    /// Stop serving the deleted queue `incarnation` here and remove its log and snapshot
    /// (nothing if no replica of it is registered). Idempotent: the replica leaves the table
    /// once, so only one caller retires it.
    pub(super) fn retire_replica(self: &Arc<Self>, incarnation: u64) {
        let replica = self
            .queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&incarnation);
        let Some(replica) = replica else {
            return;
        };
        if let Some(vh) = self.broker.vhost(&replica.queue.vhost) {
            vh.drop_replicated(&replica.queue);
        }
        let gid = replica.group.clone();
        self.groups.remove(&gid);
        let raft = replica.raft.get().cloned();
        let path = self.queue_log_path(incarnation);
        let snapshot = self.queue_snapshot_path(incarnation);
        let queue_logs = Arc::clone(&self.queue_logs);
        let in_queue_logs = !replica.queue.is_stream || queue_logs.holds_streams();
        tokio::spawn(async move {
            if let Some(raft) = raft {
                let _ = raft.shutdown().await;
            }
            // The log of a deleted incarnation is never read again.
            crate::group::remove_transit_files(&snapshot);
            let _ = std::fs::remove_file(snapshot);
            let _ = std::fs::remove_file(path);
            if in_queue_logs {
                let dropped =
                    tokio::task::spawn_blocking(move || queue_logs.drop_group(incarnation)).await;
                if let Ok(Err(e)) = dropped {
                    tracing::warn!(error = %e, "a deleted queue's log tables were not dropped");
                }
            }
        });
    }

    /// A metadata change committed: serve or drop the queue here.
    fn on_meta(self: &Arc<Self>, change: &MetaChange) {
        match change {
            MetaChange::DeclareQueue {
                key,
                value,
                incarnation,
                members,
            } => {
                self.members
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .entry(*incarnation)
                    .or_insert_with(|| members.clone());
                let node = Arc::clone(self);
                let (key, value, incarnation, members) =
                    (key.clone(), value.clone(), *incarnation, members.clone());
                let task = tokio::spawn(async move {
                    let done = take_waiting(&node.declaring, incarnation);
                    let r = node.serve_queue(&key, &value, incarnation, &members).await;
                    if let Err(e) = &r {
                        tracing::error!(incarnation, error = %e, "cannot serve a quorum queue");
                    }
                    let r = r.map(|()| Vec::new()).map_err(|e| {
                        Arc::new(warren_store::StoreError::Replication(e.to_string()))
                    });
                    let lost = node.served(incarnation, r.is_ok());
                    for done in done.into_iter().chain(lost) {
                        done(r.clone());
                    }
                });
                if let Some(waiting) = self
                    .booting
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .as_mut()
                {
                    waiting.push(task);
                }
            }
            MetaChange::DeleteQueue { incarnation, .. } => {
                self.members
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(incarnation);
                self.retire_replica(*incarnation);
                let done = take_waiting(&self.deleting, *incarnation);
                if let Some(done) = done {
                    done(Ok(Vec::new()));
                }
            }
            MetaChange::Node {
                name,
                addr,
                number,
                forgotten,
            } => self.on_node(name, addr, number.unwrap_or(0), *forgotten),
            MetaChange::SetMembers {
                incarnation,
                members,
                ..
            } => {
                self.members
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(*incarnation, members.clone());
                if let Some(replica) = self.replica_of(*incarnation)
                    && replica.is_leader()
                {
                    reconcile_members(self, &replica);
                }
            }
            MetaChange::DeclareClassic { .. } | MetaChange::DeleteClassic { .. } => {
                self.on_classic(change);
            }
            MetaChange::Group(command) => {
                self.broker
                    .groups()
                    .apply_committed(command.clone(), self.number());
            }
            MetaChange::GroupTable(bytes) => {
                if let Err(e) = self.broker.groups().install(bytes) {
                    tracing::error!(error = %e, "the consumer-group table of a snapshot is unreadable");
                }
            }
            MetaChange::Topology(change) => {
                if warren_broker::node::replication::apply_topology(&self.broker, change).is_ok() {
                    if matches!(change, TopologyChange::DeclareExchange { .. }) {
                        self.retry_topology();
                    }
                } else if matches!(change, TopologyChange::Bind { .. }) {
                    // Its queue or source may not be served here yet (replicas start in tasks
                    // of their own): bound once it is.
                    self.unbound
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(change.clone());
                } else {
                    tracing::debug!(?change, "a topology change that does not apply here");
                }
            }
        }
    }

    /// Apply the bindings that waited for their ends; those still waiting stay.
    pub(super) fn retry_topology(&self) {
        let waiting =
            std::mem::take(&mut *self.unbound.lock().unwrap_or_else(PoisonError::into_inner));
        let still: Vec<TopologyChange> = waiting
            .into_iter()
            .filter(|c| warren_broker::node::replication::apply_topology(&self.broker, c).is_err())
            .collect();
        self.unbound
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(still);
    }

    /// Propose a metadata change, retried across an election (also when its outcome is
    /// unknown if `idempotent`); `done` runs once it committed, or with why not. Gives `done`
    /// back when there is no metadata group to propose to.
    pub(super) fn commit_meta(
        &self,
        change: MetaChange,
        idempotent: bool,
        done: Completion,
    ) -> Result<(), Completion> {
        let Some(forwarder) = self.meta_forwarder.get() else {
            return Err(done);
        };
        send_retrying(
            forwarder.clone(),
            Forwarded {
                commands: Vec::new(),
                meta: vec![change],
            },
            idempotent,
            std::time::Instant::now() + RETRY_FOR,
            0,
            Box::new(move |r| {
                done(
                    r.map(|_| Vec::new()).map_err(|e| {
                        Arc::new(warren_store::StoreError::Replication(e.to_string()))
                    }),
                );
            }),
        );
        Ok(())
    }

    /// Propose a metadata change; a failure fails the waiting declare or delete.
    pub(super) fn propose_meta(&self, change: MetaChange, incarnation: u64, declare: bool) {
        // Completions wait until the change applies here; only a failed proposal takes one
        // out early. Retried across an election while nothing was appended, like topology
        // changes (a declare is not repeated when its outcome is unknown).
        let node = self.weak_self();
        let failed: Completion = Box::new(move |r| {
            if let Err(e) = r
                && let Some(node) = node.upgrade()
            {
                let map = if declare {
                    &node.declaring
                } else {
                    &node.deleting
                };
                if let Some(done) = take_waiting(map, incarnation) {
                    done(Err(e));
                }
            }
        });
        let _ = self.commit_meta(change, false, failed);
    }
}

impl ClusterNode {
    /// A declare made here lost to another node's of the same queue (`won`, committed
    /// first): its completion runs with the winner's once that is served here, or now if it
    /// already is.
    fn declare_lost(&self, lost: u64, won: u64) {
        let Some(done) = take_waiting(&self.declaring, lost) else {
            return;
        };
        let ready = self
            .declared_after
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .lost(won, done);
        if let Some((done, ok)) = ready {
            done(if ok {
                Ok(Vec::new())
            } else {
                Err(Arc::new(warren_store::StoreError::Replication(
                    "the queue declared concurrently elsewhere could not be served here".into(),
                )))
            });
        }
    }

    /// Group `incarnation` is served here (or failed to be): the declares that lost to it.
    fn served(&self, incarnation: u64, ok: bool) -> Vec<Completion> {
        self.declared_after
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .served(incarnation, ok)
    }
}

/// Groups [`DeclaredAfter`] remembers as served at most, for declares that lost to them.
const DECLARED_SERVED_MAX: usize = 1024;

/// Declares made here that lost to another node's: what they wait for.
///
/// Both sides go through one lock: [`DeclaredAfter::served`] marks the winner before it
/// takes the waiting, so a losing declare either finds the winner served or is taken by it,
/// never neither.
#[derive(Default)]
pub(super) struct DeclaredAfter {
    /// By winning incarnation: the losing declares' completions.
    waiting: HashMap<u64, Vec<Completion>>,
    /// Recently served incarnations and whether serving them succeeded (at most
    /// [`DECLARED_SERVED_MAX`]; `order` has each once, oldest first).
    served: HashMap<u64, bool>,
    order: std::collections::VecDeque<u64>,
}

impl DeclaredAfter {
    /// A declare lost to `won`: `done` back with the outcome if `won` is already served,
    /// else kept until it is.
    fn lost(&mut self, won: u64, done: Completion) -> Option<(Completion, bool)> {
        if let Some(ok) = self.served.get(&won).copied() {
            return Some((done, ok));
        }
        self.waiting.entry(won).or_default().push(done);
        None
    }

    /// `incarnation` is served (`ok`) or failed to be: the declares waiting for it. Only
    /// the most recent groups are remembered: a losing declare commits right after the
    /// winning one.
    fn served(&mut self, incarnation: u64, ok: bool) -> Vec<Completion> {
        if self.served.insert(incarnation, ok).is_none() {
            self.order.push_back(incarnation);
        }
        while self.served.len() > DECLARED_SERVED_MAX {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            self.served.remove(&oldest);
        }
        debug_assert_eq!(self.served.len(), self.order.len());
        self.waiting.remove(&incarnation).unwrap_or_default()
    }
}

/// The completion of a declare or delete made here, once (None: not made here, or already
/// completed).
fn take_waiting(map: &Mutex<HashMap<u64, Completion>>, incarnation: u64) -> Option<Completion> {
    map.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&incarnation)
}

/// Where the metadata state keeps a node's record.
fn node_key(name: &str) -> Vec<u8> {
    [b"node:".as_slice(), name.as_bytes()].concat()
}

/// A node record as it commits: a join gets the next free number (from 63 down; numbers are
/// never reused, forgotten nodes keep theirs), a founding node keeps its own, a forget keeps
/// the record as a tombstone. None: nothing to record (a forgotten name rejoining, a forget
/// of an unknown node, no number left).
fn resolve_node(
    records: &BTreeMap<Vec<u8>, MetaChange>,
    name: String,
    addr: String,
    number: Option<u64>,
    forgotten: bool,
) -> Option<MetaChange> {
    let existing = match records.get(&node_key(&name)) {
        Some(MetaChange::Node {
            addr,
            number,
            forgotten,
            ..
        }) => Some((addr.clone(), *number, *forgotten)),
        _ => None,
    };
    let (addr, number, forgotten) = match (existing, forgotten) {
        (Some((old, n, _)), true) => (old, n, true),
        (Some((_, _, true)), false) => {
            tracing::warn!(node = %name, "a forgotten node cannot join again under its name");
            return None;
        }
        (Some((_, n, false)), false) => (addr, n.or(number), false),
        (None, true) => return None,
        (None, false) => {
            let n = number.or_else(|| {
                let lowest_joined = records
                    .values()
                    .filter_map(|c| match c {
                        MetaChange::Node {
                            number: Some(n), ..
                        } if *n > FOUNDING_NODES_MAX as u64 => Some(*n),
                        _ => None,
                    })
                    .min()
                    .unwrap_or(64);
                (lowest_joined > FOUNDING_NODES_MAX as u64 + 1).then(|| lowest_joined - 1)
            });
            if n.is_none() {
                tracing::error!(node = %name, "no node number left: the join is refused");
                return None;
            }
            (addr, n, false)
        }
    };
    Some(MetaChange::Node {
        name,
        addr,
        number,
        forgotten,
    })
}

/// Where the metadata state keeps a queue's later member list (beside its record, which keeps
/// the members it was declared with: those initialise the group, once).
fn members_key(queue_key: &[u8]) -> Vec<u8> {
    [b"members:".as_slice(), queue_key].concat()
}

/// The metadata group's state: the quorum queue records.
pub(super) struct MetaState {
    pub(super) records: Mutex<BTreeMap<Vec<u8>, MetaChange>>,
    pub(super) node: Weak<ClusterNode>,
}

impl Applied for MetaState {
    fn apply(&self, _at: u64, _index: u64, request: QueueRequest) -> QueueResponse {
        let node = self.node.upgrade();
        let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        for change in request.meta {
            let change = match change {
                MetaChange::Node {
                    name,
                    addr,
                    number,
                    forgotten,
                } => match resolve_node(&records, name, addr, number, forgotten) {
                    Some(resolved) => resolved,
                    None => continue,
                },
                other => other,
            };
            match &change {
                MetaChange::Node { name, .. } => {
                    records.insert(node_key(name), change.clone());
                }
                MetaChange::DeclareClassic { key, home, .. } => {
                    let standing = match records.get(key) {
                        None => true,
                        // Its home declares it again (re-announced after a restart).
                        Some(MetaChange::DeclareClassic { home: h, .. }) => h == home,
                        Some(_) => false,
                    };
                    if !standing {
                        // Declared on two nodes at once: the first commit wins, and the
                        // other node drops its copy.
                        if let Some(node) = &node {
                            node.classic_lost(&change);
                        }
                        continue;
                    }
                    records.insert(key.clone(), change.clone());
                }
                MetaChange::DeleteClassic { key, home, id } => {
                    let current = matches!(
                        records.get(key),
                        Some(MetaChange::DeclareClassic { home: h, id: i, .. }) if h == home && i == id
                    );
                    if !current {
                        continue;
                    }
                    records.remove(key);
                }
                MetaChange::DeclareQueue {
                    key, incarnation, ..
                } => {
                    if let Some(standing) = records.get(key) {
                        // Declared twice concurrently (through two nodes): the first commit
                        // wins. The second declare is answered once the winner's replica is
                        // served here, as the winner's own declare is: it must not wait
                        // forever for a group that will never exist.
                        if let (
                            Some(node),
                            MetaChange::DeclareQueue {
                                incarnation: won, ..
                            },
                        ) = (&node, standing)
                        {
                            node.declare_lost(*incarnation, *won);
                        }
                        continue;
                    }
                    records.insert(key.clone(), change.clone());
                }
                MetaChange::DeleteQueue { key, incarnation } => {
                    let current = matches!(
                        records.get(key),
                        Some(MetaChange::DeclareQueue { incarnation: i, .. }) if i == incarnation
                    );
                    if current {
                        records.remove(key);
                        records.remove(&members_key(key));
                    }
                }
                MetaChange::SetMembers {
                    key, incarnation, ..
                } => {
                    let current = matches!(
                        records.get(key),
                        Some(MetaChange::DeclareQueue { incarnation: i, .. }) if i == incarnation
                    );
                    if !current {
                        // The queue was deleted (or re-declared) meanwhile.
                        continue;
                    }
                    records.insert(members_key(key), change.clone());
                }
                // Carried by snapshots as the whole table (`snapshot`), not as records.
                MetaChange::Group(_) | MetaChange::GroupTable(_) => {}
                MetaChange::Topology(t) => {
                    // What a snapshot must carry: the exchanges and bindings that stand.
                    if t.is_addition() {
                        records.insert(t.record_key(), change.clone());
                    } else {
                        // A deleted user's or vhost's permissions and policies go with it.
                        records.retain(|k, _| !t.supersedes(k));
                    }
                }
            }
            if let Some(node) = &node {
                node.on_meta(&change);
            }
        }
        QueueResponse::default()
    }

    fn snapshot(&self) -> Result<Vec<u8>, String> {
        let records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        // The group table is applied under this lock too (`apply` holds it while a group
        // command applies), so it matches the records.
        let groups = match self.node.upgrade() {
            Some(node) => Some(MetaChange::GroupTable(node.broker.groups().encode()?)),
            None => None,
        };
        let list: Vec<&MetaChange> = records.values().chain(groups.as_ref()).collect();
        crate::codec::encode(&list).map_err(|e| e.to_string())
    }

    fn install(&self, bytes: &[u8], _last: u64) -> Result<(), String> {
        let mut list: Vec<MetaChange> = crate::codec::decode(bytes).map_err(|e| e.to_string())?;
        // Definitions (vhosts, users, then what refers to them), queues and exchanges,
        // queues' later members, then the bindings between them.
        list.sort_by_key(|c| match c {
            MetaChange::Node { .. } => 0,
            MetaChange::Topology(t) => 1 + t.rank(),
            MetaChange::SetMembers { .. } => 5,
            MetaChange::GroupTable(_) => 6,
            _ => 4,
        });
        let node = self.node.upgrade();
        let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        records.clear();
        for change in list {
            let key = match &change {
                MetaChange::DeclareQueue { key, .. } | MetaChange::DeclareClassic { key, .. } => {
                    key.clone()
                }
                MetaChange::SetMembers { key, .. } => members_key(key),
                MetaChange::Node { name, .. } => node_key(name),
                MetaChange::Topology(t) if t.is_addition() => t.record_key(),
                MetaChange::GroupTable(_) => {
                    if let Some(node) = &node {
                        node.on_meta(&change);
                    }
                    continue;
                }
                _ => continue,
            };
            records.insert(key, change.clone());
            if let Some(node) = &node {
                node.on_meta(&change);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A completion counting its successful and failed runs.
    fn counted(ok: &Arc<AtomicUsize>, failed: &Arc<AtomicUsize>) -> Completion {
        let (ok, failed) = (Arc::clone(ok), Arc::clone(failed));
        Box::new(move |r| {
            if r.is_ok() {
                ok.fetch_add(1, Ordering::SeqCst);
            } else {
                failed.fetch_add(1, Ordering::SeqCst);
            }
        })
    }

    #[test]
    fn a_declare_lost_before_the_winner_is_served_waits_for_it() {
        let (ok, failed) = (Arc::default(), Arc::default());
        let mut after = DeclaredAfter::default();
        assert!(after.lost(7, counted(&ok, &failed)).is_none());
        assert!(after.lost(7, counted(&ok, &failed)).is_none());
        assert!(after.served(8, true).is_empty(), "another group frees none");
        let waiting = after.served(7, true);
        assert_eq!(waiting.len(), 2);
        for done in waiting {
            done(Ok(Vec::new()));
        }
        assert_eq!(ok.load(Ordering::SeqCst), 2);
        assert_eq!(failed.load(Ordering::SeqCst), 0);
        assert!(after.served(7, true).is_empty(), "each is taken once");
    }

    #[test]
    fn a_declare_lost_after_the_winner_is_served_gets_its_outcome_at_once() {
        let (ok, failed) = (Arc::<AtomicUsize>::default(), Arc::default());
        let mut after = DeclaredAfter::default();
        after.served(7, true);
        after.served(9, false);
        let (_, served) = after.lost(7, counted(&ok, &failed)).expect("served");
        assert!(served);
        let (_, served) = after.lost(9, counted(&ok, &failed)).expect("served");
        assert!(!served, "a group that failed to be served fails its losers");
        assert!(after.waiting.is_empty());
    }

    #[test]
    fn served_groups_are_remembered_up_to_the_bound() {
        let mut after = DeclaredAfter::default();
        for incarnation in 0..(DECLARED_SERVED_MAX as u64 + 10) {
            after.served(incarnation, true);
            // Served twice (a group served again after a restart) is remembered once.
            after.served(incarnation, true);
            assert!(after.served.len() <= DECLARED_SERVED_MAX);
            assert_eq!(after.served.len(), after.order.len());
        }
        assert!(!after.served.contains_key(&9), "the oldest are forgotten");
        assert!(after.served.contains_key(&10));
        let (ok, failed) = (Arc::default(), Arc::default());
        assert!(
            after.lost(3, counted(&ok, &failed)).is_none(),
            "a forgotten group is waited for again"
        );
    }
}
