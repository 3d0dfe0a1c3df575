//! Classic queues in a cluster: each lives on one node, its *home* (no mirroring, as in
//! RabbitMQ 4), and is in the replicated metadata ([`MetaChange::DeclareClassic`]), so every
//! other node serves it through a proxy (see `warren_broker::queue::Queue::is_remote`).
//!
//! ```text
//!  client ─► node B: proxy ──Forward (group $classic\0vhost\0queue)──► node A: the queue
//!  client ◄─ node B: deliver_from_home ◄──Deliver (group $classic)──── A's pump for B
//! ```
//!
//! - `proxy`: the proxy's [`Replicator`] (commands to the home, batched and pipelined like
//!   a quorum queue's to its leader) and making or dropping proxies as the metadata says;
//! - `pump`: deliveries from queues held here to consumers on a peer;
//! - this file: the node's [`ClassicService`] (what peers ask of the queues held here and
//!   what homes send to proxies here), what a committed declaration or deletion does here,
//!   a peer going down, the stats poll, and reconciling the records with the queues held
//!   here when the node starts.
//!
//! [`MetaChange::DeclareClassic`]: crate::types::MetaChange::DeclareClassic
//! [`Replicator`]: warren_broker::node::replication::Replicator

mod proxy;
mod pump;

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;

use warren_broker::durable::QueueRecord;
use warren_broker::node::replication::{Listing, decode_entry, decode_message};
use warren_broker::queue::Queue;
use warren_broker::queue::machine::Command;

use crate::proposer::ProposeError;
use crate::transport::tcp;
use crate::transport::tcp::{
    ClassicPeer, ClassicService, ForwardReplies, Forwarded, RemoteEvent, RemoteQueueStats,
};
use crate::types::{MetaChange, NodeId};

use super::ClusterNode;
use super::replicas::wire;

pub(super) use proxy::{Declared, RemoteHome};
pub(super) use pump::Pump;

/// How often a node asks each peer for the depths of the classic queues it holds (what the
/// proxies here report to the management API).
pub const STATS_EVERY: Duration = Duration::from_secs(1);

/// A classic queue of this node that clients elsewhere use: held here (not a proxy, not a
/// replicated or stream queue).
fn held_here(q: &Queue) -> bool {
    !q.is_replicated() && !q.is_stream
}

/// The node's [`ClassicService`].
pub(super) struct Service(pub(super) Weak<ClusterNode>);

impl ClassicService for Service {
    fn holds(&self, vhost: &str, queue: &str) -> bool {
        self.0
            .upgrade()
            .and_then(|n| n.broker.vhost(vhost))
            .and_then(|vh| vh.queue(queue))
            .is_some_and(|q| held_here(&q))
    }

    fn forward(
        &self,
        from: NodeId,
        vhost: &str,
        queue: &str,
        f: Forwarded,
    ) -> tokio::sync::oneshot::Receiver<Result<ForwardReplies, ProposeError>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let Some(node) = self.0.upgrade() else {
            let _ = tx.send(Err(ProposeError::Stopped));
            return rx;
        };
        let found = node
            .broker
            .vhost(vhost)
            .and_then(|vh| vh.queue(queue))
            .filter(|q| held_here(q));
        let Some(q) = found else {
            // Deleted meanwhile: its proxies go once the deletion applies there.
            let _ = tx.send(Err(ProposeError::Unknown(format!(
                "no classic queue '{queue}' here"
            ))));
            return rx;
        };
        let mut commands = Vec::with_capacity(f.commands.len());
        for c in f.commands {
            match c.try_map(|m| decode_entry(&m.body)) {
                Ok(c) => commands.push(c),
                Err(e) => {
                    let _ = tx.send(Err(ProposeError::Unknown(e.to_string())));
                    return rx;
                }
            }
        }
        let pump = node.pump(from);
        {
            let mut consumers = pump
                .consumers
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            for c in &commands {
                match c {
                    Command::Checkout(id, _) => {
                        consumers.insert(*id, (vhost.to_string(), queue.to_string()));
                    }
                    Command::Cancel(id) => {
                        consumers.remove(id);
                    }
                    _ => {}
                }
            }
        }
        q.serve_remote(
            commands,
            &pump.outbox,
            Box::new(move |r| {
                let replies = match r {
                    Ok(replies) => Ok(replies
                        .into_iter()
                        .map(|r| match r {
                            Ok(reply) => reply
                                .try_map(|e| wire(&e))
                                .map_err(|e| ProposeError::Unknown(e.to_string())),
                            Err(e) => Err(ProposeError::Refused(e)),
                        })
                        .collect()),
                    Err(e) => Err(ProposeError::Unknown(e)),
                };
                let _ = tx.send(replies);
            }),
        );
        rx
    }

    fn deliver(&self, from: NodeId, events: Vec<RemoteEvent>) -> Vec<u64> {
        let Some(node) = self.0.upgrade() else {
            return Vec::new();
        };
        let home = node.name_of(from);
        let mut unknown = Vec::new();
        for event in events {
            match event {
                RemoteEvent::Deliver {
                    vhost,
                    queue,
                    consumer,
                    id,
                    message,
                    redelivered,
                    delivery_count,
                } => {
                    let proxy = node
                        .broker
                        .vhost(&vhost)
                        .and_then(|vh| vh.queue(&queue))
                        .filter(|q| q.home().as_deref() == Some(home.as_str()));
                    let delivered = match (proxy, decode_message(&message)) {
                        (Some(q), Ok(m)) => q.deliver_from_home(
                            consumer,
                            id,
                            Arc::new(m),
                            redelivered,
                            delivery_count,
                        ),
                        (_, Err(e)) => {
                            tracing::error!(error = %e, "an undecodable delivery");
                            false
                        }
                        (None, _) => false,
                    };
                    if !delivered && !unknown.contains(&consumer) {
                        unknown.push(consumer);
                    }
                }
                RemoteEvent::Reply { vhost, message } => {
                    // A requester gone meanwhile drops it, as a reply to a closed channel is.
                    match decode_message(&message) {
                        Ok(m) => {
                            if let Some(vh) = node.broker.vhost(&vhost) {
                                vh.replies.deliver(&Arc::new(m));
                            }
                        }
                        Err(e) => tracing::error!(error = %e, "an undecodable direct reply"),
                    }
                }
                RemoteEvent::Cancel {
                    vhost,
                    queue,
                    consumer,
                } => {
                    if let Some(q) = node.broker.vhost(&vhost).and_then(|vh| vh.queue(&queue))
                        && q.home().as_deref() == Some(home.as_str())
                    {
                        q.cancel_from_home(consumer);
                    }
                }
            }
        }
        unknown
    }

    fn stats(&self, _from: NodeId) -> Vec<RemoteQueueStats> {
        let Some(node) = self.0.upgrade() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for vhost in node.broker.list_vhosts() {
            let Some(vh) = node.broker.vhost(&vhost) else {
                continue;
            };
            for q in vh.queues().into_iter().filter(|q| held_here(q)) {
                out.push(RemoteQueueStats {
                    vhost: vhost.clone(),
                    queue: q.name.clone(),
                    stats: q.stats(),
                });
            }
        }
        out
    }

    fn listing(&self, kind: Listing) -> tokio::sync::oneshot::Receiver<Vec<u8>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        // Without a management layer the sender drops, and the peer answers an empty list.
        if let Some(l) = self
            .0
            .upgrade()
            .and_then(|n| n.broker.local_listings().cloned())
        {
            l.listing(
                kind,
                Box::new(move |json| {
                    let _ = tx.send(json);
                }),
            );
        }
        rx
    }

    fn close_connection(&self, name: &str, reason: String) -> bool {
        let Some(h) = self
            .0
            .upgrade()
            .and_then(|n| n.broker.connections().find(name))
            .filter(|h| !h.is_closing())
        else {
            return false;
        };
        h.request_close(reason);
        true
    }
}

impl ClusterNode {
    /// Whether peer `id` is down or unreachable: silent for [`DOWN_AFTER`], or refusing
    /// connections and silent for a moment (a killed process). Never this node.
    ///
    /// [`DOWN_AFTER`]: super::DOWN_AFTER
    pub(super) fn is_down(&self, id: NodeId) -> bool {
        if id == self.me {
            return false;
        }
        let silent = tcp::silent_for(id).unwrap_or_else(|| self.started.elapsed());
        silent > super::DOWN_AFTER || (tcp::refusing(id) && silent > tcp::LEADER_SILENCE_MAX)
    }

    /// Where this node dials peer `id`: its own `--peers` address, else the one the
    /// metadata recorded for it.
    pub(super) fn dial_addr(&self, id: NodeId) -> Option<String> {
        self.addresses
            .get(id)
            .or_else(|| self.member(id).map(|m| m.addr))
    }

    /// A connection to peer `id`'s classic queue service (dialled on first use).
    pub(super) fn classic_peer(&self, id: NodeId) -> Option<ClassicPeer> {
        let addr = self.dial_addr(id)?;
        Some(ClassicPeer::new(
            &self.addresses,
            self.me,
            id,
            addr,
            &self.secret,
        ))
    }

    /// A classic queue's declaration or deletion committed.
    pub(super) fn on_classic(self: &Arc<Self>, change: &MetaChange) {
        match change {
            MetaChange::DeclareClassic {
                key,
                value,
                home,
                id,
                durable,
                exclusive,
            } if *home != self.me => {
                self.ensure_proxy(&Declared {
                    key,
                    value,
                    home: *home,
                    id: *id,
                    durable: *durable,
                    exclusive: *exclusive,
                });
            }
            MetaChange::DeleteClassic { key, home, id } => {
                if *home == self.me {
                    self.delete_held(key, *id);
                } else {
                    self.drop_proxy(key, *home, *id);
                }
                let done = self
                    .classic_deleting
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&(*home, *id));
                if let Some(done) = done {
                    done(Ok(Vec::new()));
                }
            }
            _ => {}
        }
    }

    /// A declaration lost to another of the same name: the copy here goes (it was never the
    /// cluster's).
    pub(super) fn classic_lost(&self, change: &MetaChange) {
        if let MetaChange::DeclareClassic { key, home, id, .. } = change
            && *home == self.me
        {
            tracing::warn!("a classic queue declared here and elsewhere at once: the other stands");
            self.delete_held(key, *id);
        }
    }

    /// Delete the classic queue `key` held here, if it is still incarnation `id`.
    fn delete_held(&self, key: &[u8], id: u64) {
        let Ok((vhost, name)) = QueueRecord::decode_key(key) else {
            return;
        };
        if let Some(vh) = self.broker.vhost(&vhost)
            && let Some(q) = vh.queue(&name)
            && held_here(&q)
            && q.id == id
        {
            vh.delete_queue(&q, &mut || Box::new(|_| {}));
        }
    }

    /// The record of classic queue `q` held here, as the metadata carries it.
    pub(super) fn classic_record(&self, q: &Queue) -> MetaChange {
        let record = QueueRecord {
            vhost: q.vhost.clone(),
            name: q.name.clone(),
            id: q.id,
            auto_delete: q.auto_delete,
            arguments: q.arguments.clone(),
        };
        let warren_store::Op::Put { key, value, .. } = record.put() else {
            unreachable!("a record put is a put");
        };
        MetaChange::DeclareClassic {
            key,
            value,
            home: self.me,
            id: q.id,
            durable: q.durable,
            exclusive: q.exclusive_owner.is_some(),
        }
    }

    /// Peer `peer` went down: its consumers of the queues held here are detached (what they
    /// held goes back) and the consumers here of the queues it holds are cancelled.
    pub(super) fn classic_peer_down(&self, peer: NodeId) {
        if let Some(number) = self.peer_number(peer) {
            for vhost in self.broker.list_vhosts() {
                let Some(vh) = self.broker.vhost(&vhost) else {
                    continue;
                };
                for q in vh.queues().into_iter().filter(|q| held_here(q)) {
                    q.detach_node(number);
                }
            }
        }
        for (key, _) in self.proxies_of(peer) {
            let Ok((vhost, name)) = QueueRecord::decode_key(&key) else {
                continue;
            };
            if let Some(q) = self.broker.vhost(&vhost).and_then(|vh| vh.queue(&name))
                && q.is_remote()
            {
                tracing::info!(queue = %name, home = %self.name_of(peer), "home node down: its consumers here are cancelled");
                q.home_lost();
            }
        }
    }

    /// As the metadata leader, delete the classic queues of down peer `peer` that do not
    /// outlive it (non-durable and exclusive ones, as RabbitMQ does). Checked every second
    /// while it is down: the leader may change after it went down.
    pub(super) fn delete_transient_of(&self, peer: NodeId) {
        let leads = self
            .meta
            .get()
            .is_some_and(|m| m.metrics().borrow().current_leader == Some(self.me));
        if !leads {
            return;
        }
        let Some(state) = self.meta_state() else {
            return;
        };
        let transient: Vec<MetaChange> = state
            .records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .filter_map(|c| match c {
                MetaChange::DeclareClassic {
                    key,
                    home,
                    id,
                    durable,
                    exclusive,
                    ..
                } if *home == peer && (!durable || *exclusive) => Some(MetaChange::DeleteClassic {
                    key: key.clone(),
                    home: *home,
                    id: *id,
                }),
                _ => None,
            })
            .collect();
        for change in transient {
            let _ = self.commit_meta(change, true, Box::new(|_| {}));
        }
    }

    /// After the metadata replayed at start: announce the classic queues held here that the
    /// records lack (or name with an older id), and delete the records of queues held here
    /// no more (non-durable ones, gone with the previous run). Idempotent: also run now and
    /// then (`at_start` false: a name clash is not logged again).
    pub(super) fn reconcile_classic(&self, at_start: bool) {
        let Some(state) = self.meta_state() else {
            return;
        };
        // The classic records only (the bindings and definitions may be many).
        let records: HashMap<Vec<u8>, MetaChange> = state
            .records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(_, v)| matches!(v, MetaChange::DeclareClassic { .. }))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let all_keys_known = |key: &[u8]| {
            state
                .records
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains_key(key)
        };
        let mut held: HashMap<Vec<u8>, u64> = HashMap::new();
        for vhost in self.broker.list_vhosts() {
            let Some(vh) = self.broker.vhost(&vhost) else {
                continue;
            };
            for q in vh.queues().into_iter().filter(|q| held_here(q)) {
                let change = self.classic_record(&q);
                let MetaChange::DeclareClassic { key, .. } = &change else {
                    continue;
                };
                held.insert(key.clone(), q.id);
                match records.get(key) {
                    Some(MetaChange::DeclareClassic { home, id, .. })
                        if *home == self.me && *id == q.id => {}
                    Some(MetaChange::DeclareClassic { home, .. }) if *home == self.me => {
                        let _ = self.commit_meta(change, true, Box::new(|_| {}));
                    }
                    // A quorum queue's record of that name: a clash, left alone.
                    None if all_keys_known(key) => {}
                    None => {
                        let _ = self.commit_meta(change, true, Box::new(|_| {}));
                    }
                    Some(_) if at_start => tracing::warn!(
                        vhost = %vhost,
                        queue = %q.name,
                        "a queue held here has a name the cluster gave another queue"
                    ),
                    Some(_) => {}
                }
            }
        }
        for (key, change) in &records {
            if let MetaChange::DeclareClassic { home, id, .. } = change
                && *home == self.me
                && !held.contains_key(key)
            {
                let delete = MetaChange::DeleteClassic {
                    key: key.clone(),
                    home: self.me,
                    id: *id,
                };
                let _ = self.commit_meta(delete, true, Box::new(|_| {}));
            }
        }
    }

    /// The metadata group's state machine.
    fn meta_state(&self) -> Option<Arc<super::metadata::MetaState>> {
        self.meta_records.get().cloned()
    }
}

/// Every [`STATS_EVERY`]: ask each peer that holds queues proxied here for their depths.
pub(super) async fn poll_stats(weak: Weak<ClusterNode>) {
    let mut tick = tokio::time::interval(STATS_EVERY);
    let mut conns: HashMap<NodeId, ClassicPeer> = HashMap::new();
    loop {
        tick.tick().await;
        let Some(node) = weak.upgrade() else {
            return;
        };
        let mut homes: Vec<NodeId> = node
            .proxies
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .map(|p| p.home)
            .collect();
        homes.sort_unstable();
        homes.dedup();
        for home in homes {
            if node.is_down(home) {
                conns.remove(&home);
                continue;
            }
            let conn = match conns.entry(home) {
                std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => match node.classic_peer(home) {
                    Some(fresh) => v.insert(fresh),
                    None => continue,
                },
            };
            let stats = match tokio::time::timeout(STATS_EVERY, conn.stats()).await {
                Ok(Ok(stats)) => stats,
                _ => {
                    conns.remove(&home);
                    continue;
                }
            };
            let by_key: HashMap<Vec<u8>, _> = stats
                .into_iter()
                .map(|s| (QueueRecord::key(&s.vhost, &s.queue), s.stats))
                .collect();
            for (key, proxy) in node.proxies_of(home) {
                *proxy.stats.lock().unwrap_or_else(PoisonError::into_inner) =
                    by_key.get(&key).copied();
            }
        }
    }
}
