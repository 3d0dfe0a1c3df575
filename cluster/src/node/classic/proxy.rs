//! A proxy's side of a classic queue held on another node: the broker's [`Replicator`] whose
//! commands go to the home ([`RemoteHome`]), and making or dropping proxies as the metadata
//! says.

use std::sync::{Arc, Mutex, PoisonError, Weak};

use warren_broker::durable::QueueRecord;
use warren_broker::message::Entry;
use warren_broker::node::replication::{
    Placement, QueueStats, ReplicaDone, ReplicaState, Replicator,
};
use warren_broker::queue::machine::{Command, Reply};

use crate::transport::tcp::{CLASSIC_PREFIX, GroupId};
use crate::types::NodeId;

use super::super::ClusterNode;
use super::super::forwarding::{Forwarder, Target};
use super::super::replicas::forward_commands;

/// The commands of one proxy go to its home through this (batched and pipelined as a quorum
/// queue's go to its leader); its stats come back from the home's periodic report.
pub(in crate::node) struct RemoteHome {
    node: Weak<ClusterNode>,
    /// The node that holds the queue.
    pub(in crate::node) home: NodeId,
    home_name: String,
    /// The queue's id on its home.
    pub(in crate::node) id: u64,
    /// Its record key.
    key: Vec<u8>,
    forwarder: Forwarder,
    /// What the home last reported (None: nothing yet).
    pub(super) stats: Mutex<Option<QueueStats>>,
}

impl std::fmt::Debug for RemoteHome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteHome")
            .field("home", &self.home_name)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Replicator for RemoteHome {
    fn submit(&self, commands: Vec<Command<Entry>>, done: ReplicaDone) {
        let purge = commands.iter().position(|c| matches!(c, Command::Purge));
        let Some(at) = purge else {
            forward_commands(&self.forwarder, commands, done);
            return;
        };
        // A purge's count is known at once (the next report would tell it a second later):
        // purge-ok and a delete right after it see an empty queue, as on the home.
        let node = self.node.clone();
        let key = self.key.clone();
        forward_commands(
            &self.forwarder,
            commands,
            Box::new(move |r| {
                if let Ok(replies) = &r
                    && matches!(replies.get(at), Some(Ok(Reply::Purged(_))))
                    && let Some(p) = node.upgrade().and_then(|n| n.proxy(&key))
                    && let Some(s) = p
                        .stats
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .as_mut()
                {
                    s.ready = 0;
                    s.ready_bytes = 0;
                    s.oldest_ready_age_ms = None;
                }
                done(r);
            }),
        );
    }

    fn is_leader(&self) -> bool {
        // The home alone dead-letters and expires.
        false
    }

    fn local_node(&self) -> u64 {
        self.node.upgrade().map_or(0, |n| n.number())
    }

    fn placement(&self) -> Placement {
        let online = if self.home_down() {
            Vec::new()
        } else {
            vec![self.home_name.clone()]
        };
        Placement {
            leader: Some(self.home_name.clone()),
            members: vec![self.home_name.clone()],
            online,
        }
    }

    fn replica_state(&self, _digest: bool) -> ReplicaState {
        ReplicaState {
            role: "proxy",
            ..ReplicaState::default()
        }
    }

    fn home(&self) -> Option<String> {
        Some(self.home_name.clone())
    }

    fn home_down(&self) -> bool {
        self.node.upgrade().is_none_or(|n| n.is_down(self.home))
    }

    fn remote_stats(&self) -> Option<QueueStats> {
        *self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// How a committed [`DeclareClassic`] names its queue.
///
/// [`DeclareClassic`]: crate::types::MetaChange::DeclareClassic
pub(in crate::node) struct Declared<'a> {
    pub(in crate::node) key: &'a [u8],
    pub(in crate::node) value: &'a [u8],
    pub(in crate::node) home: NodeId,
    pub(in crate::node) id: u64,
    pub(in crate::node) durable: bool,
    pub(in crate::node) exclusive: bool,
}

impl ClusterNode {
    /// A classic queue held on another node was declared (or this node learns of it at
    /// start): serve it here through a proxy, replacing a proxy of an older declaration.
    pub(in crate::node) fn ensure_proxy(self: &Arc<Self>, d: &Declared<'_>) {
        let record = match QueueRecord::decode(d.key, d.value) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "an undecodable classic queue record");
                return;
            }
        };
        let Some(vhost) = self.broker.vhost(&record.vhost) else {
            tracing::warn!(vhost = %record.vhost, queue = %record.name, "a classic queue of an unknown vhost");
            return;
        };
        let existing = vhost.queue(&record.name);
        let mut proxies = self.proxies.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(q) = existing {
            match proxies.get(d.key) {
                Some(p) if p.home == d.home && p.id == d.id => return,
                Some(_) => {
                    // The home declared it anew (its previous incarnation is gone).
                    proxies.remove(d.key);
                    q.home_lost();
                    vhost.drop_replicated(&q);
                }
                None => {
                    tracing::warn!(
                        vhost = %record.vhost,
                        queue = %record.name,
                        home = %self.name_of(d.home),
                        "a queue of that name exists here: it is not served as the cluster's"
                    );
                    return;
                }
            }
        }
        let queue = vhost.proxy_queue(
            d.id,
            &record.name,
            (d.durable, record.auto_delete, d.exclusive),
            record.arguments,
        );
        let group = GroupId {
            name: format!("{CLASSIC_PREFIX}\0{}\0{}", record.vhost, record.name),
            incarnation: d.id,
        };
        let remote = Arc::new(RemoteHome {
            node: Arc::downgrade(self),
            home: d.home,
            home_name: self.name_of(d.home),
            id: d.id,
            key: d.key.to_vec(),
            forwarder: Forwarder::start(Arc::downgrade(self), group, Target::Home(d.home)),
            stats: Mutex::new(None),
        });
        queue.attach_replica(Arc::clone(&remote) as Arc<dyn Replicator>);
        if vhost.insert_replicated(Arc::clone(&queue)) {
            // What consumers of this node's previous run held there goes back (no consumer
            // of this run is older than the proxy).
            if self.number() != 0 {
                remote.submit(
                    vec![Command::Down {
                        node: self.number(),
                        before: self.broker.next_id(),
                    }],
                    Box::new(|_| {}),
                );
            }
            proxies.insert(d.key.to_vec(), remote);
        }
        drop(proxies);
        self.retry_topology();
    }

    /// A classic queue held on `home` was deleted: drop its proxy here (its consumers are
    /// cancelled).
    pub(in crate::node) fn drop_proxy(&self, key: &[u8], home: NodeId, id: u64) {
        let mut proxies = self.proxies.lock().unwrap_or_else(PoisonError::into_inner);
        let matches = proxies
            .get(key)
            .is_some_and(|p| p.home == home && p.id == id);
        if !matches {
            return;
        }
        proxies.remove(key);
        drop(proxies);
        let Ok((vhost, name)) = QueueRecord::decode_key(key) else {
            return;
        };
        if let Some(vh) = self.broker.vhost(&vhost)
            && let Some(q) = vh.queue(&name)
            && q.is_remote()
        {
            vh.drop_replicated(&q);
        }
    }

    /// The proxy of queue `key`.
    pub(in crate::node) fn proxy(&self, key: &[u8]) -> Option<Arc<RemoteHome>> {
        self.proxies
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .cloned()
    }

    /// The proxies whose queues `home` holds.
    pub(in crate::node) fn proxies_of(&self, home: NodeId) -> Vec<(Vec<u8>, Arc<RemoteHome>)> {
        self.proxies
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(_, p)| p.home == home)
            .map(|(k, p)| (k.clone(), Arc::clone(p)))
            .collect()
    }
}
