//! The cluster's nodes: the registry of members (founding ones from `--peers`, then as the
//! metadata group records them), this node's number, joining a running cluster through its
//! seeds, and — as the metadata leader — making the metadata group's voters the cluster's
//! nodes.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use openraft::BasicNode;

use crate::proposer::ProposeError;
use crate::transport::tcp;
use crate::transport::tcp::{ForwardLink, Forwarded, GroupId};
use crate::types::{MetaChange, NodeId};

use super::config::node_id;
use super::{ClusterNode, FORWARD_REPLY_MAX, META_GROUP, Member};

/// How long a joining node waits between attempts to reach a seed.
const JOIN_RETRY: Duration = Duration::from_millis(500);

impl ClusterNode {
    /// The nodes of the cluster (not forgotten), by id.
    pub(super) fn current(&self) -> Vec<(NodeId, Member)> {
        self.registry
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(_, m)| !m.forgotten)
            .map(|(id, m)| (*id, m.clone()))
            .collect()
    }

    /// The other members that are not down (as [`ClusterNode::is_down`] judges).
    pub(super) fn running_peers(&self) -> Vec<NodeId> {
        self.current()
            .into_iter()
            .map(|(id, _)| id)
            .filter(|id| *id != self.me && !self.is_down(*id))
            .collect()
    }

    pub(super) fn member(&self, id: NodeId) -> Option<Member> {
        self.registry
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&id)
            .cloned()
    }

    pub(super) fn is_forgotten(&self, id: NodeId) -> bool {
        self.member(id).is_some_and(|m| m.forgotten)
    }

    /// This node's number (0 while it joins).
    pub(super) fn number(&self) -> u64 {
        self.number.load(std::sync::atomic::Ordering::Acquire)
    }

    pub(super) fn remember_number(&self, number: u64) {
        let path = self.config.data_dir.join("node-number");
        if stored_number(&self.config.data_dir) != Some(number)
            && let Err(e) = std::fs::write(&path, number.to_string())
        {
            tracing::warn!(path = %path.display(), error = %e, "cannot store the node number");
        }
    }

    pub(super) fn all_members(&self) -> BTreeMap<NodeId, BasicNode> {
        self.current()
            .into_iter()
            .map(|(id, m)| (id, BasicNode::new(m.addr)))
            .collect()
    }

    pub(super) fn peer_name(&self, id: NodeId) -> Option<String> {
        self.member(id).map(|m| m.name)
    }

    pub(super) fn peer_number(&self, id: NodeId) -> Option<u64> {
        self.member(id).map(|m| m.number).filter(|n| *n != 0)
    }

    /// A node's name for messages (its id if unknown).
    pub(super) fn name_of(&self, id: NodeId) -> String {
        self.peer_name(id).unwrap_or_else(|| id.to_string())
    }

    /// Propose the cluster's record of node `m` (idempotent).
    pub(super) fn propose_node(&self, m: &Member) {
        let change = MetaChange::Node {
            name: m.name.clone(),
            addr: m.addr.clone(),
            number: (m.number != 0).then_some(m.number),
            forgotten: false,
        };
        let _ = self.commit_meta(
            change,
            true,
            Box::new(|r| {
                if let Err(e) = r {
                    tracing::warn!(error = %e, "cannot record this node in the cluster");
                }
            }),
        );
    }

    /// Join the cluster through the seeds: ask the metadata leader (found through them) to
    /// record this node, then wait until this node's replica of the metadata knows its
    /// number. Retries until it succeeds: the node serves nothing before.
    pub(super) async fn join(self: &Arc<Self>) {
        let seeds: Vec<(NodeId, String)> = self
            .config
            .peers
            .iter()
            .filter(|p| p.name != self.config.name)
            .map(|p| (node_id(&p.name), p.addr.clone()))
            .collect();
        let Some(own) = self.member(self.me) else {
            return;
        };
        let meta = GroupId {
            name: META_GROUP.into(),
            incarnation: 0,
        };
        let request = MetaChange::Node {
            name: own.name.clone(),
            addr: own.addr.clone(),
            number: None,
            forgotten: false,
        };
        let mut next = 0;
        while self.number() == 0 && !seeds.is_empty() {
            let (id, addr) = &seeds[next % seeds.len()];
            next += 1;
            let link = ForwardLink::new(
                &self.addresses,
                self.me,
                *id,
                meta.clone(),
                addr.clone(),
                &self.secret,
            );
            let sent = link.send(Forwarded {
                commands: Vec::new(),
                meta: vec![request.clone()],
            });
            let reply =
                tokio::time::timeout(
                    FORWARD_REPLY_MAX,
                    async move { sent.await?.replies().await },
                )
                .await
                .unwrap_or_else(|_| Err(tcp::TransportError::Broken("no answer in time".into())));
            let outcome = match reply {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(ProposeError::NotLeader(Some(leader)))) => {
                    // Ask the leader next, when it is one of the seeds.
                    if let Some(i) = seeds.iter().position(|(s, _)| *s == leader) {
                        next = i;
                    }
                    Err("not the metadata leader".to_string())
                }
                Ok(Err(e)) => Err(e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match outcome {
                Ok(()) => {
                    tracing::info!(seed = %addr, "join recorded; catching up");
                    break;
                }
                Err(e) => {
                    tracing::info!(seed = %addr, error = %e, "join: trying again");
                    tokio::time::sleep(JOIN_RETRY).await;
                }
            }
        }
        // The metadata leader adds this node as a learner, then a voter; this node's number
        // arrives with the log.
        loop {
            let notified = self.numbered.notified();
            if self.number() != 0 {
                break;
            }
            notified.await;
        }
        tracing::info!(number = self.number(), "joined the cluster");
    }

    /// A committed node record: update the registry and the addresses; as the metadata
    /// leader, add a new node to the group or remove a forgotten one.
    pub(super) fn on_node(&self, name: &str, addr: &str, number: u64, forgotten: bool) {
        let id = node_id(name);
        self.registry
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                id,
                Member {
                    name: name.to_string(),
                    addr: addr.to_string(),
                    number,
                    forgotten,
                },
            );
        if !forgotten && id != self.me {
            // This node's own --peers address for a peer wins over the record's.
            if self.config.peers.iter().all(|p| p.name != name) {
                self.addresses.insert(id, addr.to_string());
            }
        }
        if id == self.me && self.number() == 0 && !forgotten {
            self.number
                .store(number, std::sync::atomic::Ordering::Release);
            self.remember_number(number);
            self.numbered.notify_waiters();
        }
        reconcile_meta(self);
    }
}

/// The node number this data directory was given, if any.
pub(super) fn stored_number(data_dir: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(data_dir.join("node-number"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .filter(|n| *n > 0 && *n < 64)
}

/// As the metadata group's leader: make the group's voters the cluster's nodes, one change at
/// a time. A forgotten node is removed; a node that joined is added as a learner, caught up,
/// then made a voter (so it never stalls the majority). Founding nodes are voters from the
/// start.
pub(super) fn reconcile_meta(node: &ClusterNode) {
    use std::sync::atomic::Ordering;
    let Some(raft) = node.meta.get().cloned() else {
        return;
    };
    let voters: std::collections::BTreeSet<NodeId> = {
        let m = raft.metrics();
        let m = m.borrow();
        if m.current_leader != Some(node.me) {
            return;
        }
        m.membership_config.membership().voter_ids().collect()
    };
    let gone: std::collections::BTreeSet<NodeId> = voters
        .iter()
        .copied()
        .filter(|id| node.is_forgotten(*id))
        .collect();
    let new: Vec<(NodeId, String)> = node
        .current()
        .into_iter()
        .filter(|(id, _)| !voters.contains(id))
        .map(|(id, m)| (id, m.addr))
        .collect();
    if (gone.is_empty() && new.is_empty()) || node.meta_changing.swap(true, Ordering::AcqRel) {
        return;
    }
    let changing = node.weak_self();
    tokio::spawn(async move {
        let r = if gone.is_empty() {
            let mut r = Ok(());
            for (id, addr) in new {
                let added = match raft.add_learner(id, BasicNode::new(addr), true).await {
                    Ok(_) => raft
                        .change_membership(
                            openraft::ChangeMembers::AddVoterIds([id].into_iter().collect()),
                            false,
                        )
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                if added.is_err() {
                    r = added;
                    break;
                }
                tracing::info!(node = id, "a node joined the metadata group");
            }
            r
        } else {
            raft.change_membership(openraft::ChangeMembers::RemoveVoters(gone.clone()), false)
                .await
                .map(|_| tracing::info!(nodes = ?gone, "forgotten nodes left the metadata group"))
                .map_err(|e| e.to_string())
        };
        if let Err(e) = r {
            tracing::warn!(error = %e, "changing the metadata group");
        }
        if let Some(node) = changing.upgrade() {
            node.meta_changing.store(false, Ordering::Release);
        }
    });
}
