//! A virtual host: its exchanges, queues and bindings, and routing over them.
//!
//! Topology changes take the write lock; routing takes the read lock for the time of one
//! lookup and never calls into a queue while holding it (queues are collected, then published
//! to). Lock order: vhost topology, then queue state; never the reverse.
//!
//! With a store, changes to durable objects are submitted to it while the write lock is held
//! (see [`crate::durable`] for why), and the caller's `on_commit` provides the completion that
//! tells it when they are durable (it holds its reply until then).

mod bindings;
mod exchanges;
mod policies;
mod queues;
mod route;

use crate::policy::PolicyKind;
use crate::stats::Lifecycle;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use amq_protocol::types::FieldTable;
use parking_lot::RwLock;
use warren_amqp::{AmqpError, ReplyCode};

use warren_store::writer::Completion;
use warren_store::{MetaTable, Op};

use crate::args::rs;
use crate::durable::{BindingRecord, Durable, ExchangeRecord, OnCommit, QueueRecord};
use crate::exchange::{Binding, Destination, Exchange, ExchangeDecl, ExchangeKind, RoutingHeaders};
use crate::queue::Queue;

/// The exchanges and queues of one vhost.
#[derive(Debug, Default)]
pub struct Topology {
    exchanges: HashMap<String, Exchange>,
    queues: HashMap<String, Arc<Queue>>,
    /// Partitioned queues, rebuilt from the partitions in `queues` (kept in step by
    /// [`Topology::insert_queue`] and [`Topology::remove_queue`]).
    partitions: crate::routing::partitions::PartitionIndex,
}

impl Topology {
    /// Add a queue (and note it if it is a partition).
    fn insert_queue(&mut self, queue: Arc<Queue>) {
        self.partitions.added(&queue);
        self.queues.insert(queue.name.clone(), queue);
    }

    /// Remove this very queue. Returns the logical name if it was the last partition of a
    /// partitioned queue (whose bindings must go too).
    fn remove_queue(&mut self, queue: &Arc<Queue>) -> Option<String> {
        self.queues.remove(&queue.name);
        self.partitions.removed(queue)
    }

    /// Whether `name` is a queue or a partitioned queue (a binding may lead to either).
    fn has_queue(&self, name: &str) -> bool {
        self.queues.contains_key(name) || self.partitions.get(name).is_some()
    }
}

/// One vhost.
#[derive(Debug)]
pub struct VHost {
    /// Name.
    pub name: String,
    topology: RwLock<Topology>,
    store: Option<Arc<Durable>>,
    timers: Option<Arc<crate::timers::Timers>>,
    me: std::sync::Weak<VHost>,
    /// Direct reply-to names of this vhost.
    pub replies: crate::routing::reply_to::Replies,
    /// Messages held by delayed exchanges.
    pub delayed: Arc<crate::routing::delayed::Delayed>,
    /// Policies of this vhost. Lock order: after topology (never topology while holding it).
    policies: RwLock<Vec<crate::policy::Policy>>,
    /// Operator policies (same lock order as `policies`).
    operator_policies: RwLock<Vec<crate::policy::Policy>>,
    /// `set_vhost_limits`.
    pub limits: RwLock<crate::users::VhostLimits>,
    /// The queue type for declarations without `x-queue-type` (None: classic).
    pub default_queue_type: RwLock<Option<String>>,
    /// Set when the vhost is deleted; its connections are closed.
    down: std::sync::atomic::AtomicBool,
    down_notify: tokio::sync::Notify,
    /// The node's counters (queue lifecycle events are counted here).
    stats: Arc<crate::stats::GlobalStats>,
    /// The node's cluster, when it is in one (quorum queues are created through it).
    cluster: std::sync::OnceLock<Arc<dyn crate::routing::cluster::ClusterHooks>>,
}

/// An exchange as the management API lists it.
#[derive(Debug, Clone)]
pub struct ExchangeInfo {
    /// Name ("" for the default exchange).
    pub name: String,
    /// Type (`x-delayed-message` for delayed exchanges).
    pub kind: String,
    /// Survives restarts.
    pub durable: bool,
    /// Deleted when its last binding goes.
    pub auto_delete: bool,
    /// Refuses direct publishes.
    pub internal: bool,
    /// Declare arguments.
    pub arguments: FieldTable,
}

/// A binding as the management API lists it.
#[derive(Debug, Clone)]
pub struct BindingInfo {
    /// Source exchange ("" for the default exchange).
    pub source: String,
    /// Destination queue or exchange.
    pub destination: String,
    /// Whether the destination is a queue (else an exchange).
    pub destination_is_queue: bool,
    /// Binding key.
    pub routing_key: String,
    /// Binding arguments.
    pub arguments: FieldTable,
}

/// Predeclared exchanges every vhost has (rabbit_vhost:declare_default_exchanges/2): name,
/// type, internal. `amq.rabbitmq.trace` is the firehose's exchange; Warren declares it so
/// clients and tools find it, and publishes nothing into it (docs/compatibility.md).
const PREDECLARED: &[(&str, ExchangeKind, bool)] = &[
    ("", ExchangeKind::Direct, false),
    ("amq.direct", ExchangeKind::Direct, false),
    ("amq.fanout", ExchangeKind::Fanout, false),
    ("amq.topic", ExchangeKind::Topic, false),
    ("amq.headers", ExchangeKind::Headers, false),
    ("amq.match", ExchangeKind::Headers, false),
    ("amq.rabbitmq.trace", ExchangeKind::Topic, true),
];

fn equivalence_fail(
    arg: &str,
    what: &str,
    received: impl std::fmt::Display,
    current: impl std::fmt::Display,
) -> AmqpError {
    AmqpError::channel(
        ReplyCode::PreconditionFailed,
        format!(
            "inequivalent arg '{arg}' for {what}: received {received} but current is {current}"
        ),
    )
}

impl VHost {
    /// The vhost's stored record (limits and metadata).
    #[must_use]
    pub fn record(&self) -> crate::users::VhostRecord {
        crate::users::VhostRecord {
            limits: self.limits.read().clone(),
            default_queue_type: self.default_queue_type.read().clone(),
            delayed_slot: self.delayed.slot(),
        }
    }

    /// A vhost with the predeclared exchanges; durable objects go to `store` if given.
    #[must_use]
    pub fn new(
        name: &str,
        store: Option<Arc<Durable>>,
        timers: Option<Arc<crate::timers::Timers>>,
        stats: Arc<crate::stats::GlobalStats>,
    ) -> Arc<Self> {
        let mut t = Topology::default();
        for (ex, kind, internal) in PREDECLARED {
            t.exchanges.insert(
                (*ex).to_string(),
                Exchange::new(ex, *kind, true, false, *internal, FieldTable::default()),
            );
        }
        Arc::new_cyclic(|me: &std::sync::Weak<Self>| Self {
            name: name.to_string(),
            topology: RwLock::new(t),
            delayed: crate::routing::delayed::Delayed::new(
                me.clone(),
                store.clone(),
                timers.clone(),
            ),
            store,
            timers,
            me: me.clone(),
            replies: crate::routing::reply_to::Replies::default(),
            policies: RwLock::new(Vec::new()),
            operator_policies: RwLock::new(Vec::new()),
            limits: RwLock::new(crate::users::VhostLimits::default()),
            default_queue_type: RwLock::new(None),
            down: std::sync::atomic::AtomicBool::new(false),
            down_notify: tokio::sync::Notify::new(),
            stats,
            cluster: std::sync::OnceLock::new(),
        })
    }

    /// Join the node's cluster: quorum queues declared from now on are replicated.
    pub fn set_cluster(&self, cluster: Arc<dyn crate::routing::cluster::ClusterHooks>) {
        let _ = self.cluster.set(cluster);
    }

    /// The node's cluster, if any.
    #[must_use]
    pub fn cluster(&self) -> Option<&Arc<dyn crate::routing::cluster::ClusterHooks>> {
        self.cluster.get()
    }

    /// The vhost's exchanges without their bindings, sorted by name (a snapshot). The default
    /// exchange is listed with the empty name, as RabbitMQ does.
    #[must_use]
    pub fn exchanges(&self) -> Vec<ExchangeInfo> {
        let t = self.topology.read();
        let mut v: Vec<ExchangeInfo> = t
            .exchanges
            .values()
            .map(|x| ExchangeInfo {
                name: x.name.clone(),
                kind: if x.delayed {
                    crate::exchange::DELAYED_TYPE.to_string()
                } else {
                    x.kind.as_str().to_string()
                },
                durable: x.durable,
                auto_delete: x.auto_delete,
                internal: x.internal,
                arguments: x.arguments.clone(),
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Every binding of the vhost, including the default exchange's implicit one to each
    /// queue (listed first, as RabbitMQ's API does), then by source exchange.
    #[must_use]
    pub fn bindings(&self) -> Vec<BindingInfo> {
        let t = self.topology.read();
        let mut queues: Vec<&String> = t.queues.keys().collect();
        queues.sort();
        let mut v: Vec<BindingInfo> = queues
            .into_iter()
            .map(|q| BindingInfo {
                source: String::new(),
                destination: q.clone(),
                destination_is_queue: true,
                routing_key: q.clone(),
                arguments: FieldTable::default(),
            })
            .collect();
        let mut exchanges: Vec<&Exchange> = t
            .exchanges
            .values()
            .filter(|x| !x.name.is_empty())
            .collect();
        exchanges.sort_by(|a, b| a.name.cmp(&b.name));
        for x in exchanges {
            for b in x.bindings() {
                let (destination, destination_is_queue) = match &b.destination {
                    crate::exchange::Destination::Queue(q) => (q.clone(), true),
                    crate::exchange::Destination::Exchange(e) => (e.clone(), false),
                };
                v.push(BindingInfo {
                    source: x.name.clone(),
                    destination,
                    destination_is_queue,
                    routing_key: b.routing_key.clone(),
                    arguments: b.arguments.clone(),
                });
            }
        }
        v
    }

    /// Whether the vhost was deleted.
    #[must_use]
    pub fn is_down(&self) -> bool {
        self.down.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Resolves once the vhost is deleted (at once if it already is): its connections close
    /// with `320 CONNECTION_FORCED`.
    pub async fn until_down(&self) {
        let notified = self.down_notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.is_down() {
            return;
        }
        notified.await;
    }

    /// Delete everything the vhost holds (queues with their messages, exchanges, bindings,
    /// policies) from memory and the store, and close its connections. Store writes are
    /// submitted with no-op completions: the caller submits a last op and waits for that one
    /// (the writer commits in order).
    pub fn shut_down(&self) {
        self.down.store(true, std::sync::atomic::Ordering::Release);
        self.down_notify.notify_waiters();
        let noop = &mut || -> Completion { Box::new(|_| {}) };
        let queues: Vec<Arc<Queue>> = self.topology.read().queues.values().cloned().collect();
        for q in queues {
            let _ = self.delete_queue(&q, noop);
        }
        let exchanges: Vec<String> = self
            .topology
            .read()
            .exchanges
            .keys()
            .filter(|n| !n.starts_with("amq.") && !n.is_empty())
            .cloned()
            .collect();
        for x in exchanges {
            let _ = self.delete_exchange(&x, false, noop);
        }
        for kind in [PolicyKind::User, PolicyKind::Operator] {
            let names: Vec<String> = self.policies(kind).into_iter().map(|p| p.name).collect();
            for name in names {
                self.clear_policy(kind, &name, noop);
            }
        }
        self.delayed.discard_all();
    }

    /// What queues of this vhost are connected to (store, timers, the vhost itself for
    /// dead-lettering).
    #[must_use]
    pub fn queue_env(&self) -> crate::queue::QueueEnv {
        crate::queue::QueueEnv {
            store: self.store.clone(),
            timers: self.timers.clone(),
            vhost: self.me.clone(),
        }
    }

    /// The store durable queues of this vhost write to.
    #[must_use]
    pub fn store(&self) -> Option<&Arc<Durable>> {
        self.store.as_ref()
    }

    /// Submit durable changes (call with the write lock held).
    fn submit(&self, ops: Vec<Op>, on_commit: OnCommit<'_>) {
        if let Some(store) = &self.store {
            store.submit_meta(ops, on_commit);
        }
    }

    pub(crate) fn not_found(&self, kind: &str, name: &str) -> AmqpError {
        AmqpError::channel(
            ReplyCode::NotFound,
            format!("no {}", rs(kind, name, &self.name)),
        )
    }
}
