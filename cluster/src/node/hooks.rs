//! What the broker asks of the cluster ([`ClusterHooks`]): declaring and deleting quorum
//! queues, replicating topology changes, the nodes and their state, moving a queue's
//! leadership, changing its members, forgetting a node.

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use warren_broker::durable::QueueRecord;
use warren_broker::node::replication::{
    ClosedDone, ClusterHooks, Listing, ListingsDone, MemberChange, MembershipError, NodeStatus,
    PEER_LISTING_WAIT, TransferDone, TransferError,
};
use warren_broker::queue::Queue;
use warren_broker::queue::outbox::Outbox;
use warren_store::writer::Completion;

use crate::transport::tcp;
use crate::types::MetaChange;

use super::config::node_id;
use super::leadership::{HOLD_MAX, TRANSFER_MARGIN, TRANSFER_MAX};
use super::placement::GROUP_SIZE_DEFAULT;
use super::{ClusterNode, DOWN_AFTER, PEER_REQUEST_MAX};

impl ClusterHooks for ClusterNode {
    fn node_name(&self) -> &str {
        &self.config.name
    }

    fn node_number(&self) -> u64 {
        self.number()
    }

    fn declare_quorum(&self, queue: Arc<Queue>, done: Completion) {
        let incarnation = self.broker.next_id()
            ^ node_id(&format!(
                "{}/{}/{}",
                queue.vhost,
                queue.name,
                warren_broker::timers::wall_ms()
            ));
        // A stream's initial group size is `x-initial-cluster-size`, as in RabbitMQ.
        let size = queue
            .arguments
            .inner()
            .get("x-quorum-initial-group-size")
            .or_else(|| queue.arguments.inner().get("x-initial-cluster-size"))
            .and_then(warren_broker::args::int_value)
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(GROUP_SIZE_DEFAULT);
        let record = QueueRecord {
            vhost: queue.vhost.clone(),
            name: queue.name.clone(),
            id: 0,
            auto_delete: false,
            arguments: queue.arguments.clone(),
        };
        let warren_store::Op::Put { key, value, .. } = record.put() else {
            unreachable!("a record put is a put");
        };
        let balanced = warren_broker::args::string_arg(&queue.arguments, "x-queue-leader-locator")
            .is_some_and(|l| l != "client-local");
        let change = MetaChange::DeclareQueue {
            key,
            value,
            incarnation,
            members: self.place(incarnation, size, balanced),
        };
        self.declaring
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(incarnation, done);
        self.propose_meta(change, incarnation, true);
    }

    fn replicate_topology(
        &self,
        change: warren_broker::node::replication::TopologyChange,
        done: Completion,
    ) {
        if let Err(done) = self.commit_meta(MetaChange::Topology(change), false, done) {
            // Not part of a cluster yet: nothing to replicate to.
            done(Ok(Vec::new()));
        }
    }

    fn announce_classic(&self, queue: &Arc<Queue>, done: Completion) {
        if let Err(done) = self.commit_meta(self.classic_record(queue), true, done) {
            done(Ok(Vec::new()));
        }
    }

    fn retract_classic(&self, queue: &Arc<Queue>) {
        let change = MetaChange::DeleteClassic {
            key: QueueRecord::key(&queue.vhost, &queue.name),
            home: self.me,
            id: queue.id,
        };
        // Deleting twice is deleting once.
        let _ = self.commit_meta(change, true, Box::new(|_| {}));
    }

    fn delete_remote(&self, queue: &Arc<Queue>, done: Completion) {
        let key = QueueRecord::key(&queue.vhost, &queue.name);
        let home = self
            .proxies
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .map(|p| (p.home, p.id));
        let Some((home, id)) = home else {
            done(Ok(Vec::new()));
            return;
        };
        self.classic_deleting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((home, id), done);
        let weak = self.weak_self();
        let failed: Completion = Box::new(move |r| {
            if let Err(e) = r
                && let Some(node) = weak.upgrade()
            {
                let done = node
                    .classic_deleting
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&(home, id));
                if let Some(done) = done {
                    done(Err(e));
                }
            }
        });
        let change = MetaChange::DeleteClassic { key, home, id };
        if let Err(failed) = self.commit_meta(change, true, failed) {
            failed(Err(Arc::new(warren_store::StoreError::Replication(
                "not part of a cluster".into(),
            ))));
        }
    }

    fn nodes(&self) -> Vec<NodeStatus> {
        self.current()
            .into_iter()
            .map(|(id, m)| {
                // Nothing for this node itself: it has no link to itself.
                let (send_bytes, recv_bytes) = tcp::traffic(id);
                NodeStatus {
                    name: m.name,
                    running: id == self.me || tcp::silent_for(id).is_some_and(|s| s < DOWN_AFTER),
                    send_bytes,
                    recv_bytes,
                }
            })
            .collect()
    }

    fn peer_listings(&self, kind: Listing, done: ListingsDone) {
        let asks: Vec<_> = self
            .running_peers()
            .into_iter()
            .filter_map(|id| self.classic_peer(id))
            .map(|mut peer| {
                tokio::spawn(async move {
                    match tokio::time::timeout(PEER_LISTING_WAIT, peer.listing(kind)).await {
                        Ok(Ok(json)) => Some(json),
                        _ => None,
                    }
                })
            })
            .collect();
        tokio::spawn(async move {
            let mut out = Vec::with_capacity(asks.len());
            for ask in asks {
                if let Ok(Some(json)) = ask.await {
                    out.push(json);
                }
            }
            done(out);
        });
    }

    fn close_peer_connection(&self, name: String, reason: String, done: ClosedDone) {
        let peers: Vec<_> = self
            .running_peers()
            .into_iter()
            .filter_map(|id| self.classic_peer(id))
            .collect();
        tokio::spawn(async move {
            // A connection name holds its peer and local address: at most one node has it.
            for mut peer in peers {
                let ask = peer.close_connection(name.clone(), reason.clone());
                if let Ok(Ok(true)) = tokio::time::timeout(PEER_LISTING_WAIT, ask).await {
                    done(true);
                    return;
                }
            }
            done(false);
        });
    }

    fn replicate_group(&self, command: warren_broker::groups::GroupCommand) {
        let change = MetaChange::Group(command.clone());
        if self.commit_meta(change, true, Box::new(|_| {})).is_err() {
            // Not part of a cluster yet: this node is the whole group.
            self.broker.groups().apply_committed(command, self.number());
        }
    }

    fn reply_outbox(&self, node: u64) -> Option<Arc<Outbox>> {
        let id = self
            .current()
            .into_iter()
            .find(|(id, m)| m.number == node && *id != self.me)
            .map(|(id, _)| id)
            .filter(|id| !self.is_down(*id))?;
        Some(Arc::clone(&self.weak_self().upgrade()?.pump(id).outbox))
    }

    fn transfer_leader(&self, queue: &Arc<Queue>, to: &str, done: TransferDone) {
        let id = node_id(to);
        if self.peer_name(id).as_deref() != Some(to) || self.is_forgotten(id) {
            done(Err(TransferError::UnknownNode(to.to_string())));
            return;
        }
        let Some(replica) = self
            .incarnation_of(queue)
            .and_then(|inc| self.replica_of(inc))
        else {
            done(Err(TransferError::NotReplicated));
            return;
        };
        let Some(raft) = replica.raft.get() else {
            done(Err(TransferError::NotReplicated));
            return;
        };
        let (leader, voter) = {
            let m = raft.metrics();
            let m = m.borrow();
            (
                m.current_leader,
                m.membership_config
                    .membership()
                    .voter_ids()
                    .any(|v| v == id),
            )
        };
        if !voter {
            done(Err(TransferError::NotVoter(to.to_string())));
            return;
        }
        let Some(leader) = leader else {
            done(Err(TransferError::NoLeader));
            return;
        };
        if leader == id {
            done(Ok(to.to_string()));
            return;
        }
        let Some(node) = self.weak_self().upgrade() else {
            done(Err(TransferError::Failed("the node is stopping".into())));
            return;
        };
        tokio::spawn(async move {
            let outcome = if leader == node.me {
                node.lead_transfer(replica.group.incarnation, id).await
            } else if let Some(call) = node.peer_call(&replica, leader) {
                // The leader may wait out its lease, hold its log, wait out the others'
                // leases (groups of more than three) and the election.
                let lease = Duration::from_millis(node.raft_config.election_timeout_max);
                let answer_max =
                    2 * (lease + TRANSFER_MARGIN + HOLD_MAX) + TRANSFER_MAX + PEER_REQUEST_MAX;
                match tokio::time::timeout(answer_max, tcp::request_transfer(call, id)).await {
                    Ok(Ok(Ok(new))) => Ok(new),
                    Ok(Ok(Err(reason))) => Err(TransferError::Failed(reason)),
                    Ok(Err(e)) => Err(TransferError::Failed(format!(
                        "cannot reach the leader: {e}"
                    ))),
                    Err(_) => Err(TransferError::Failed(
                        "the leader did not answer in time".into(),
                    )),
                }
            } else {
                Err(TransferError::Failed(
                    "the leader's address is unknown".into(),
                ))
            };
            done(outcome.map(|new| node.name_of(new)));
        });
    }

    fn forget_node(&self, name: &str, done: Completion) -> Result<(), MembershipError> {
        let id = node_id(name);
        let known = self
            .member(id)
            .filter(|m| m.name == name && !m.forgotten)
            .ok_or_else(|| MembershipError::UnknownNode(name.to_string()))?;
        if id == self.me || tcp::silent_for(id).is_some_and(|s| s < DOWN_AFTER) {
            return Err(MembershipError::Running(name.to_string()));
        }
        let change = MetaChange::Node {
            name: known.name,
            addr: known.addr,
            number: None,
            forgotten: true,
        };
        self.commit_meta(change, true, done)
            .map_err(|_| MembershipError::NotReplicated)
    }

    fn change_members(
        &self,
        queue: &Arc<Queue>,
        change: MemberChange,
        done: Completion,
    ) -> Result<(), MembershipError> {
        let incarnation = self
            .incarnation_of(queue)
            .ok_or(MembershipError::NotReplicated)?;
        let mut members = self.members_of(incarnation);
        let (MemberChange::Add(name) | MemberChange::Delete(name)) = &change;
        let id = node_id(name);
        if self.peer_name(id).as_deref() != Some(name.as_str()) || self.is_forgotten(id) {
            return Err(MembershipError::UnknownNode(name.clone()));
        }
        match change {
            MemberChange::Add(name) => {
                if members.contains(&id) {
                    return Err(MembershipError::AlreadyMember(name));
                }
                members.push(id);
            }
            MemberChange::Delete(name) => {
                if !members.contains(&id) {
                    return Err(MembershipError::NotMember(name));
                }
                if members.len() == 1 {
                    return Err(MembershipError::LastMember);
                }
                members.retain(|m| *m != id);
            }
        }
        let change = MetaChange::SetMembers {
            key: QueueRecord::key(&queue.vhost, &queue.name),
            incarnation,
            members,
        };
        // Setting the same list twice is setting it once.
        self.commit_meta(change, true, done)
            .map_err(|_| MembershipError::NotReplicated)
    }

    fn delete_quorum(&self, queue: &Arc<Queue>, done: Completion) {
        let found = self.incarnation_of(queue);
        let Some(incarnation) = found else {
            done(Ok(Vec::new()));
            return;
        };
        self.deleting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(incarnation, done);
        let change = MetaChange::DeleteQueue {
            key: QueueRecord::key(&queue.vhost, &queue.name),
            incarnation,
        };
        self.propose_meta(change, incarnation, false);
    }
}
