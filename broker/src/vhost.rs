//! A virtual host: its exchanges, queues and bindings, and routing over them.
//!
//! Topology changes take the write lock; routing takes the read lock for the time of one
//! lookup and never calls into a queue while holding it (queues are collected, then published
//! to). Lock order: vhost topology, then queue state; never the reverse.
//!
//! With a store, changes to durable objects are submitted to it while the write lock is held
//! (see [`crate::durable`] for why), and the caller's `on_commit` provides the completion that
//! tells it when they are durable (it holds its reply until then).

use crate::policy::PolicyKind;
use crate::stats::Lifecycle;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use amq_protocol::types::FieldTable;
use parking_lot::RwLock;
use warren_amqp::{AmqpError, ReplyCode};

use warren_store::writer::Completion;
use warren_store::{MetaTable, Op};

use crate::durable::{BindingRecord, Durable, ExchangeRecord, QueueRecord};
use crate::exchange::{Binding, Destination, Exchange, ExchangeKind, RoutingHeaders};
use crate::queue::Queue;

/// Produces the completion for a submitted change (called only when something was submitted).
pub type OnCommit<'a> = &'a mut dyn FnMut() -> Completion;

/// The exchanges and queues of one vhost.
#[derive(Debug, Default)]
pub struct Topology {
    exchanges: HashMap<String, Exchange>,
    queues: HashMap<String, Arc<Queue>>,
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
    pub replies: crate::reply_to::Replies,
    /// Messages held by delayed exchanges.
    pub delayed: Arc<crate::delayed::Delayed>,
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
    cluster: std::sync::OnceLock<Arc<dyn crate::replication::ClusterHooks>>,
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

/// The declaration flags of an exchange.
#[derive(Debug, Clone)]
pub struct ExchangeDecl {
    /// Type.
    pub kind: ExchangeKind,
    /// Durable.
    pub durable: bool,
    /// Auto-delete.
    pub auto_delete: bool,
    /// Internal.
    pub internal: bool,
    /// `x-delayed-message` with `kind` as its `x-delayed-type`.
    pub delayed: bool,
    /// Arguments.
    pub arguments: FieldTable,
}

impl ExchangeDecl {
    fn type_name(&self) -> &'static str {
        if self.delayed {
            crate::exchange::DELAYED_TYPE
        } else {
            self.kind.as_str()
        }
    }

    fn build(&self, name: &str) -> Exchange {
        let mut ex = Exchange::new(
            name,
            self.kind,
            self.durable,
            self.auto_delete,
            self.internal,
            self.arguments.clone(),
        );
        ex.delayed = self.delayed;
        ex
    }
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

/// `kind 'name' in vhost 'v'`, as RabbitMQ's `rabbit_misc:rs/1`.
#[must_use]
pub fn rs(kind: &str, name: &str, vhost: &str) -> String {
    format!("{kind} '{name}' in vhost '{vhost}'")
}

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
        Arc::new_cyclic(|me| Self {
            name: name.to_string(),
            topology: RwLock::new(t),
            delayed: crate::delayed::Delayed::new(me.clone(), store.clone(), timers.clone()),
            store,
            timers,
            me: me.clone(),
            replies: crate::reply_to::Replies::default(),
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
    pub fn set_cluster(&self, cluster: Arc<dyn crate::replication::ClusterHooks>) {
        let _ = self.cluster.set(cluster);
    }

    /// The node's cluster, if any.
    #[must_use]
    pub fn cluster(&self) -> Option<&Arc<dyn crate::replication::ClusterHooks>> {
        self.cluster.get()
    }

    /// A replicated queue's replica on this node: durable, without the store (its log is its
    /// durability).
    #[must_use]
    pub fn replicated_queue(&self, id: u64, name: &str, arguments: FieldTable) -> Arc<Queue> {
        let env = crate::queue::QueueEnv {
            store: None,
            ..self.queue_env()
        };
        let q = Queue::new(id, name, &self.name, true, false, None, arguments, env);
        self.apply_policies(&q);
        q
    }

    /// Insert a replicated queue the cluster created (false: one of that name exists).
    pub fn insert_replicated(&self, queue: Arc<Queue>) -> bool {
        let mut t = self.topology.write();
        if t.queues.contains_key(&queue.name) {
            return false;
        }
        t.queues.insert(queue.name.clone(), queue);
        self.stats.event(Lifecycle::QueueCreated);
        true
    }

    /// Queues in the vhost now.
    #[must_use]
    pub fn queue_count(&self) -> usize {
        self.topology.read().queues.len()
    }

    /// The vhost's queues, sorted by name (a snapshot).
    #[must_use]
    pub fn queues(&self) -> Vec<Arc<Queue>> {
        let mut v: Vec<Arc<Queue>> = self.topology.read().queues.values().cloned().collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
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

    fn binding_record(&self, source: &str, b: &Binding) -> BindingRecord {
        BindingRecord {
            vhost: self.name.clone(),
            source: source.to_string(),
            destination: b.destination.clone(),
            routing_key: b.routing_key.clone(),
            arguments: b.arguments.clone(),
        }
    }

    /// Whether a binding from `source` to `dest` is stored: both ends durable (RabbitMQ).
    fn binding_is_durable(t: &Topology, source: &Exchange, dest: &Destination) -> bool {
        source.durable
            && match dest {
                Destination::Queue(q) => t.queues.get(q).is_some_and(|q| q.is_stored()),
                Destination::Exchange(e) => t.exchanges.get(e).is_some_and(|e| e.durable),
            }
    }

    pub(crate) fn not_found(&self, kind: &str, name: &str) -> AmqpError {
        AmqpError::channel(
            ReplyCode::NotFound,
            format!("no {}", rs(kind, name, &self.name)),
        )
    }

    /// exchange.declare (non-passive): create, or check equivalence with the existing one.
    pub fn declare_exchange(
        &self,
        name: &str,
        decl: ExchangeDecl,
        on_commit: OnCommit<'_>,
    ) -> Result<(), AmqpError> {
        let mut t = self.topology.write();
        let what = rs("exchange", name, &self.name);
        if let Some(ex) = t.exchanges.get(name) {
            if ex.kind != decl.kind || ex.delayed != decl.delayed {
                return Err(equivalence_fail(
                    "type",
                    &what,
                    format!("'{}'", decl.type_name()),
                    format!("'{}'", ex.type_name()),
                ));
            }
            for (arg, want, have) in [
                ("durable", decl.durable, ex.durable),
                ("auto_delete", decl.auto_delete, ex.auto_delete),
                ("internal", decl.internal, ex.internal),
            ] {
                if want != have {
                    return Err(equivalence_fail(
                        arg,
                        &what,
                        format!("'{want}'"),
                        format!("'{have}'"),
                    ));
                }
            }
            let key = "alternate-exchange";
            let (want, have) = (
                decl.arguments.inner().get(key),
                ex.arguments.inner().get(key),
            );
            if !crate::args::equivalent(want, have) {
                return Err(equivalence_fail(
                    key,
                    &what,
                    crate::args::render(want),
                    crate::args::render(have),
                ));
            }
            return Ok(());
        }
        if name.starts_with("amq.") {
            return Err(AmqpError::channel(
                ReplyCode::AccessRefused,
                format!("exchange name '{name}' contains reserved prefix 'amq.*'"),
            ));
        }
        if decl.durable {
            self.submit(
                vec![ExchangeRecord::put(&self.name, name, &decl)],
                on_commit,
            );
        }
        self.replicate(on_commit, || {
            let Op::Put { key, value, .. } = ExchangeRecord::put(&self.name, name, &decl) else {
                unreachable!("a record put is a put");
            };
            crate::replication::TopologyChange::DeclareExchange { key, value }
        });
        let mut ex = decl.build(name);
        ex.policy_alternate = crate::policy::alternate_exchange(crate::policy::choose(
            &self.policies.read(),
            name,
            crate::policy::Applies::Exchange,
        ));
        t.exchanges.insert(name.to_string(), ex);
        Ok(())
    }

    /// Put back a durable exchange recovered from the store.
    pub fn restore_exchange(&self, name: &str, decl: ExchangeDecl) {
        let mut ex = decl.build(name);
        ex.policy_alternate = crate::policy::alternate_exchange(
            self.policy_for(PolicyKind::User, name, crate::policy::Applies::Exchange)
                .as_ref(),
        );
        self.topology.write().exchanges.insert(name.to_string(), ex);
    }

    /// Put back a durable queue recovered from the store.
    pub fn restore_queue(&self, queue: Arc<Queue>) {
        self.topology
            .write()
            .queues
            .insert(queue.name.clone(), queue);
    }

    /// Put back a durable binding recovered from the store (false if an end is missing).
    pub fn restore_binding(&self, b: BindingRecord) -> bool {
        let mut t = self.topology.write();
        let dest_exists = match &b.destination {
            Destination::Queue(q) => t.queues.contains_key(q),
            Destination::Exchange(e) => t.exchanges.contains_key(e),
        };
        match t.exchanges.get_mut(&b.source) {
            Some(ex) if dest_exists => {
                ex.bind(Binding {
                    destination: b.destination,
                    routing_key: b.routing_key,
                    arguments: b.arguments,
                });
                true
            }
            _ => false,
        }
    }

    fn policy_set(&self, kind: PolicyKind) -> &RwLock<Vec<crate::policy::Policy>> {
        match kind {
            PolicyKind::User => &self.policies,
            PolicyKind::Operator => &self.operator_policies,
        }
    }

    /// The policy of `kind` that applies to an object named `name` of `applies`, if any.
    #[must_use]
    pub fn policy_for(
        &self,
        kind: PolicyKind,
        name: &str,
        applies: crate::policy::Applies,
    ) -> Option<crate::policy::Policy> {
        crate::policy::choose(&self.policy_set(kind).read(), name, applies).cloned()
    }

    /// Give `queue` the settings of the policy and operator policy that match it now.
    pub fn apply_policies(&self, queue: &Arc<Queue>) {
        let kind = queue.policy_kind();
        let policy = self.policy_for(PolicyKind::User, &queue.name, kind);
        let operator = self.policy_for(PolicyKind::Operator, &queue.name, kind);
        queue.apply_policy(policy.as_ref(), operator.as_ref());
    }

    /// Policies of `kind`, by name.
    #[must_use]
    pub fn policies(&self, kind: PolicyKind) -> Vec<crate::policy::PolicyDef> {
        let mut defs: Vec<_> = self
            .policy_set(kind)
            .read()
            .iter()
            .map(|p| p.def.clone())
            .collect();
        defs.sort_by(|a, b| a.name.cmp(&b.name));
        defs
    }

    /// Set (add or replace) a policy: stored, then applied to every matching queue and
    /// exchange at once.
    ///
    /// # Errors
    /// The definition does not validate.
    pub fn set_policy(
        &self,
        kind: PolicyKind,
        def: crate::policy::PolicyDef,
        on_commit: OnCommit<'_>,
    ) -> Result<(), crate::policy::PolicyError> {
        let policy = crate::policy::Policy::new_of(kind, def)?;
        {
            let mut ps = self.policy_set(kind).write();
            if self.store.is_some() {
                let value = serde_json::to_vec(&policy.def).unwrap_or_default();
                self.submit(
                    vec![Op::Put {
                        table: kind.table(),
                        key: ExchangeRecord::key(&self.name, &policy.def.name),
                        value,
                    }],
                    on_commit,
                );
            }
            self.replicate(on_commit, || {
                crate::replication::TopologyChange::Definition(
                    crate::replication::DefinitionChange::SetPolicy {
                        operator: kind == PolicyKind::Operator,
                        def: serde_json::to_vec(&policy.def).unwrap_or_default(),
                    },
                )
            });
            ps.retain(|p| p.def.name != policy.def.name);
            ps.push(policy);
        }
        self.reapply_policies();
        Ok(())
    }

    /// Remove a policy of `kind`; false if there was none of that name.
    pub fn clear_policy(&self, kind: PolicyKind, name: &str, on_commit: OnCommit<'_>) -> bool {
        let removed = {
            let mut ps = self.policy_set(kind).write();
            let before = ps.len();
            ps.retain(|p| p.def.name != name);
            let removed = ps.len() != before;
            if removed {
                self.submit(
                    vec![Op::Delete {
                        table: kind.table(),
                        key: ExchangeRecord::key(&self.name, name),
                    }],
                    on_commit,
                );
            }
            removed
        };
        self.replicate(on_commit, || {
            crate::replication::TopologyChange::Definition(
                crate::replication::DefinitionChange::ClearPolicy {
                    operator: kind == PolicyKind::Operator,
                    vhost: self.name.clone(),
                    name: name.to_string(),
                },
            )
        });
        if removed {
            self.reapply_policies();
        }
        removed
    }

    /// Put back a policy recovered from the store (before queues and exchanges).
    pub fn restore_policy(&self, kind: PolicyKind, policy: crate::policy::Policy) {
        self.policy_set(kind).write().push(policy);
    }

    /// Recompute every queue's and exchange's policy settings.
    fn reapply_policies(&self) {
        let (queues, exchanges): (Vec<Arc<Queue>>, Vec<String>) = {
            let t = self.topology.read();
            (
                t.queues.values().cloned().collect(),
                t.exchanges.keys().cloned().collect(),
            )
        };
        for q in queues {
            self.apply_policies(&q);
        }
        let alternates: Vec<(String, Option<String>)> = exchanges
            .into_iter()
            .map(|name| {
                let p = self.policy_for(PolicyKind::User, &name, crate::policy::Applies::Exchange);
                (name, crate::policy::alternate_exchange(p.as_ref()))
            })
            .collect();
        let mut t = self.topology.write();
        for (name, ae) in alternates {
            if let Some(ex) = t.exchanges.get_mut(&name) {
                ex.policy_alternate = ae;
            }
        }
    }

    /// For a delayed exchange (`x-delayed-message`), whether it is durable and internal; None
    /// otherwise.
    #[must_use]
    pub fn delayed_exchange(&self, name: &str) -> Option<(bool, bool)> {
        self.topology
            .read()
            .exchanges
            .get(name)
            .filter(|ex| ex.delayed)
            .map(|ex| (ex.durable, ex.internal))
    }

    /// Whether an exchange exists.
    #[must_use]
    pub fn exchange_exists(&self, name: &str) -> bool {
        self.topology.read().exchanges.contains_key(name)
    }

    /// exchange.declare passive.
    /// Whether `name` is a topic exchange (topic permissions apply to those only).
    #[must_use]
    pub fn is_topic_exchange(&self, name: &str) -> bool {
        self.topology
            .read()
            .exchanges
            .get(name)
            .is_some_and(|x| x.kind == ExchangeKind::Topic)
    }

    pub fn check_exchange(&self, name: &str) -> Result<(), AmqpError> {
        if self.exchange_exists(name) {
            Ok(())
        } else {
            Err(self.not_found("exchange", name))
        }
    }

    /// exchange.delete. A missing exchange is not an error (RabbitMQ 4).
    pub fn delete_exchange(
        &self,
        name: &str,
        if_unused: bool,
        on_commit: OnCommit<'_>,
    ) -> Result<(), AmqpError> {
        if name.starts_with("amq.") {
            return Err(AmqpError::channel(
                ReplyCode::AccessRefused,
                format!(
                    "deletion of system exchange '{name}' in vhost '{}' not allowed",
                    self.name
                ),
            ));
        }
        let mut t = self.topology.write();
        let Some(ex) = t.exchanges.get(name) else {
            return Ok(());
        };
        if if_unused && !ex.bindings().is_empty() {
            return Err(AmqpError::channel(
                ReplyCode::PreconditionFailed,
                format!("{} in use", rs("exchange", name, &self.name)),
            ));
        }
        let mut ops = Vec::new();
        self.exchange_removed(&t, ex, &mut ops);
        let durable = ex.durable;
        t.exchanges.remove(name);
        self.remove_destination(
            &mut t,
            &Destination::Exchange(name.to_string()),
            durable,
            &mut ops,
        );
        self.submit(ops, on_commit);
        self.replicate(on_commit, || {
            crate::replication::TopologyChange::DeleteExchange {
                vhost: self.name.clone(),
                name: name.to_string(),
            }
        });
        Ok(())
    }

    /// In a cluster, send a change made here to the other nodes (unless it came from them);
    /// the client's reply waits for its commit too.
    fn replicate(
        &self,
        on_commit: OnCommit<'_>,
        change: impl FnOnce() -> crate::replication::TopologyChange,
    ) {
        if let Some(cluster) = self.cluster()
            && !crate::replication::applying()
        {
            cluster.replicate_topology(change(), on_commit());
        }
    }

    /// A binding's change as the cluster carries it.
    fn binding_change(
        &self,
        source: &str,
        binding: &Binding,
        bind: bool,
    ) -> crate::replication::TopologyChange {
        let Op::Put { key, value, .. } = self.binding_record(source, binding).put() else {
            unreachable!("a record put is a put");
        };
        if bind {
            crate::replication::TopologyChange::Bind { key, value }
        } else {
            crate::replication::TopologyChange::Unbind { key, value }
        }
    }

    /// Store ops for an exchange going away: its record and its stored bindings (as source).
    fn exchange_removed(&self, t: &Topology, ex: &Exchange, ops: &mut Vec<Op>) {
        if !ex.durable || self.store.is_none() {
            return;
        }
        ops.push(Op::Delete {
            table: MetaTable::Exchanges,
            key: ExchangeRecord::key(&self.name, &ex.name),
        });
        for b in ex.bindings() {
            if Self::binding_is_durable(t, ex, &b.destination) {
                ops.push(self.binding_record(&ex.name, b).delete());
            }
        }
    }

    /// Remove every binding to `dest` (already out of the topology; `dest_durable` says
    /// whether it was stored, and so whether bindings to it were), then auto-delete sources left
    /// without bindings. Store ops go to `ops`.
    fn remove_destination(
        &self,
        t: &mut Topology,
        dest: &Destination,
        dest_durable: bool,
        ops: &mut Vec<Op>,
    ) {
        let mut emptied = Vec::new();
        if self.store.is_some() && dest_durable {
            for ex in t.exchanges.values().filter(|ex| ex.durable) {
                for b in ex.bindings().iter().filter(|b| &b.destination == dest) {
                    ops.push(self.binding_record(&ex.name, b).delete());
                }
            }
        }
        for ex in t.exchanges.values_mut() {
            if ex.unbind_destination(dest) > 0 && ex.auto_delete && ex.bindings().is_empty() {
                emptied.push(ex.name.clone());
            }
        }
        for name in emptied {
            let durable = t.exchanges.remove(&name).is_some_and(|ex| {
                self.exchange_removed(t, &ex, ops);
                ex.durable
            });
            self.remove_destination(t, &Destination::Exchange(name), durable, ops);
        }
    }

    /// Add a binding from `source` to `dest`.
    pub fn bind(
        &self,
        source: &str,
        dest: Destination,
        routing_key: &str,
        arguments: FieldTable,
        on_commit: OnCommit<'_>,
    ) -> Result<(), AmqpError> {
        let mut t = self.topology.write();
        self.check_binding_ends(&t, source, &dest)?;
        let ex = t
            .exchanges
            .get(source)
            .ok_or_else(|| self.not_found("exchange", source))?;
        if ex.kind == ExchangeKind::Headers {
            crate::args::validate_x_match(&arguments)?;
        }
        let binding = Binding {
            destination: dest,
            routing_key: routing_key.to_string(),
            arguments,
        };
        let durable = self.store.is_some()
            && Self::binding_is_durable(&t, ex, &binding.destination)
            && !ex.bindings().contains(&binding);
        if durable {
            self.submit(vec![self.binding_record(source, &binding).put()], on_commit);
        }
        self.replicate(on_commit, || self.binding_change(source, &binding, true));
        if let Some(ex) = t.exchanges.get_mut(source) {
            ex.bind(binding);
        }
        Ok(())
    }

    /// Remove a binding; a missing binding is not an error.
    pub fn unbind(
        &self,
        source: &str,
        dest: Destination,
        routing_key: &str,
        arguments: FieldTable,
        on_commit: OnCommit<'_>,
    ) -> Result<(), AmqpError> {
        let mut t = self.topology.write();
        self.check_binding_ends(&t, source, &dest)?;
        let binding = Binding {
            destination: dest,
            routing_key: routing_key.to_string(),
            arguments,
        };
        let mut ops = Vec::new();
        if let Some(ex) = t.exchanges.get(source)
            && ex.bindings().contains(&binding)
            && self.store.is_some()
            && Self::binding_is_durable(&t, ex, &binding.destination)
        {
            ops.push(self.binding_record(source, &binding).delete());
        }
        self.replicate(on_commit, || self.binding_change(source, &binding, false));
        let mut delete_source = false;
        if let Some(ex) = t.exchanges.get_mut(source) {
            delete_source = ex.unbind(&binding) && ex.auto_delete && ex.bindings().is_empty();
        }
        if delete_source {
            let durable = t.exchanges.remove(source).is_some_and(|ex| {
                self.exchange_removed(&t, &ex, &mut ops);
                ex.durable
            });
            self.remove_destination(
                &mut t,
                &Destination::Exchange(source.to_string()),
                durable,
                &mut ops,
            );
        }
        self.submit(ops, on_commit);
        Ok(())
    }

    fn check_binding_ends(
        &self,
        t: &Topology,
        source: &str,
        dest: &Destination,
    ) -> Result<(), AmqpError> {
        let default_refused = || {
            AmqpError::channel(
                ReplyCode::AccessRefused,
                "operation not permitted on the default exchange",
            )
        };
        if source.is_empty() || matches!(dest, Destination::Exchange(d) if d.is_empty()) {
            return Err(default_refused());
        }
        match dest {
            Destination::Queue(q) if !t.queues.contains_key(q) => {
                return Err(self.not_found("queue", q));
            }
            Destination::Exchange(e) if !t.exchanges.contains_key(e) => {
                return Err(self.not_found("exchange", e));
            }
            _ => {}
        }
        if !t.exchanges.contains_key(source) {
            return Err(self.not_found("exchange", source));
        }
        Ok(())
    }

    /// A queue by name.
    #[must_use]
    pub fn queue(&self, name: &str) -> Option<Arc<Queue>> {
        self.topology.read().queues.get(name).cloned()
    }

    /// A queue by name, or 404.
    pub fn queue_or_404(&self, name: &str) -> Result<Arc<Queue>, AmqpError> {
        self.queue(name)
            .ok_or_else(|| self.not_found("queue", name))
    }

    /// Insert a new queue, or return the existing one of that name (the caller checks
    /// equivalence). Returns (queue, created).
    ///
    /// # Errors
    /// A new stream's files cannot be opened (541).
    pub fn declare_queue(
        &self,
        make: impl FnOnce() -> Arc<Queue>,
        on_commit: OnCommit<'_>,
    ) -> Result<(Arc<Queue>, bool), AmqpError> {
        let candidate = make();
        if (candidate.is_quorum || candidate.is_stream)
            && let Some(cluster) = self.cluster()
        {
            if let Some(q) = self.queue(&candidate.name) {
                return Ok((q, false));
            }
            // The cluster agrees on it first; every node (this one too) then inserts its
            // replica, and the declare-ok waits for that.
            cluster.declare_quorum(Arc::clone(&candidate), on_commit());
            return Ok((candidate, true));
        }
        // Applied before the queue is visible (and with no vhost lock held).
        self.apply_policies(&candidate);
        let mut t = self.topology.write();
        if let Some(q) = t.queues.get(&candidate.name) {
            return Ok((Arc::clone(q), false));
        }
        // Under the lock: a concurrent declare of the same name cannot open its files too.
        self.open_stream(&candidate).map_err(|e| {
            AmqpError::connection(
                warren_amqp::ReplyCode::InternalError,
                format!("cannot open the stream's files: {e}"),
            )
        })?;
        if candidate.is_stored() {
            let record = QueueRecord {
                vhost: self.name.clone(),
                name: candidate.name.clone(),
                id: candidate.id,
                auto_delete: candidate.auto_delete,
                arguments: candidate.arguments.clone(),
            };
            self.submit(vec![record.put()], on_commit);
        }
        t.queues
            .insert(candidate.name.clone(), Arc::clone(&candidate));
        self.stats.event(Lifecycle::QueueCreated);
        Ok((candidate, true))
    }

    /// Open a stream queue's files (`<data-dir>/streams/<queue id>`; without a store, a
    /// directory under the system's temporary one). Nothing for other queues.
    ///
    /// # Errors
    /// The files do not recover, or the writer cannot start.
    pub fn open_stream(&self, queue: &Arc<Queue>) -> Result<(), warren_store::StoreError> {
        if !queue.is_stream {
            return Ok(());
        }
        let base = self
            .store
            .as_ref()
            .and_then(|s| s.streams_dir())
            .map_or_else(
                || std::env::temp_dir().join(format!("warren-streams-{}", std::process::id())),
                std::path::Path::to_path_buf,
            );
        queue.open_stream(
            &base.join(queue.id.to_string()),
            warren_amqp::limits::TABLE_DEPTH_MAX,
        )
    }

    /// Remove a queue and its bindings; consumers get basic.cancel. Returns the ready count,
    /// or None if it was already gone. Only removes this very queue (not a re-declared one).
    pub fn delete_queue(&self, queue: &Arc<Queue>, on_commit: OnCommit<'_>) -> Option<u32> {
        self.delete_queue_if(queue, |_| true, on_commit)
    }

    /// [`VHost::delete_queue`] if `still` holds when checked under the vhost write lock (so no
    /// declare can slip in between the check and the deletion).
    pub fn delete_queue_if(
        &self,
        queue: &Arc<Queue>,
        still: impl FnOnce(&Queue) -> bool,
        on_commit: OnCommit<'_>,
    ) -> Option<u32> {
        if queue.is_replicated()
            && let Some(cluster) = self.cluster()
        {
            // Every node drops its replica when the deletion commits
            // ([`VHost::drop_replicated`]).
            if !still(queue) {
                return None;
            }
            let ready = queue.counts().messages;
            cluster.delete_quorum(queue, on_commit());
            return Some(ready);
        }
        let mut t = self.topology.write();
        match t.queues.get(&queue.name) {
            Some(q) if Arc::ptr_eq(q, queue) && still(queue) => {
                t.queues.remove(&queue.name);
                self.stats.event(Lifecycle::QueueDeleted);
            }
            _ => return None,
        }
        let mut ops = Vec::new();
        if queue.is_stored() {
            ops.push(Op::Delete {
                table: MetaTable::Queues,
                key: QueueRecord::key(&self.name, &queue.name),
            });
            self.remove_destination(
                &mut t,
                &Destination::Queue(queue.name.clone()),
                true,
                &mut ops,
            );
            // Record, bindings and messages go in one submission, made under both locks.
            Some(queue.delete(ops, on_commit))
        } else {
            self.remove_destination(
                &mut t,
                &Destination::Queue(queue.name.clone()),
                false,
                &mut ops,
            );
            self.submit(ops, on_commit);
            drop(t);
            Some(queue.delete(Vec::new(), &mut || Box::new(|_| {})))
        }
    }

    /// Remove a replicated queue whose deletion the cluster committed: its bindings go, its
    /// consumers here get basic.cancel.
    pub fn drop_replicated(&self, queue: &Arc<Queue>) {
        let mut t = self.topology.write();
        match t.queues.get(&queue.name) {
            Some(q) if Arc::ptr_eq(q, queue) => {
                t.queues.remove(&queue.name);
                self.stats.event(Lifecycle::QueueDeleted);
            }
            _ => return,
        }
        let mut ops = Vec::new();
        self.remove_destination(
            &mut t,
            &Destination::Queue(queue.name.clone()),
            false,
            &mut ops,
        );
        self.submit(ops, &mut || Box::new(|_| {}));
        drop(t);
        queue.delete(Vec::new(), &mut || Box::new(|_| {}));
    }

    /// Route a message: the queues it reaches, each once. Follows exchange-to-exchange bindings
    /// and alternate exchanges, never visiting an exchange twice.
    pub fn route(
        &self,
        exchange: &str,
        routing_key: &str,
        headers: &RoutingHeaders<'_>,
        out: &mut Vec<Arc<Queue>>,
    ) -> Result<(), AmqpError> {
        self.route_inner(exchange, routing_key, headers, out, true)
    }

    /// Route a message the broker itself publishes (dead-lettering): internal exchanges are
    /// allowed, as in RabbitMQ.
    pub fn route_internal(
        &self,
        exchange: &str,
        routing_key: &str,
        headers: &RoutingHeaders<'_>,
        out: &mut Vec<Arc<Queue>>,
    ) -> Result<(), AmqpError> {
        self.route_inner(exchange, routing_key, headers, out, false)
    }

    fn route_inner(
        &self,
        exchange: &str,
        routing_key: &str,
        headers: &RoutingHeaders<'_>,
        out: &mut Vec<Arc<Queue>>,
        from_client: bool,
    ) -> Result<(), AmqpError> {
        let t = self.topology.read();
        let ex = t
            .exchanges
            .get(exchange)
            .ok_or_else(|| self.not_found("exchange", exchange))?;
        if ex.internal && from_client {
            return Err(AmqpError::channel(
                ReplyCode::AccessRefused,
                format!(
                    "cannot publish to internal {}",
                    rs("exchange", exchange, &self.name)
                ),
            ));
        }
        if exchange.is_empty() {
            // The default exchange binds every queue by its name.
            if let Some(q) = t.queues.get(routing_key) {
                out.push(Arc::clone(q));
            }
            return Ok(());
        }
        let mut visited: HashSet<&str> = HashSet::new();
        let mut pending: Vec<&str> = vec![exchange];
        let mut queue_names: Vec<&str> = Vec::new();
        let mut dests = Vec::new();
        while let Some(name) = pending.pop() {
            if !visited.insert(name) {
                continue;
            }
            let Some(ex) = t.exchanges.get(name) else {
                continue;
            };
            dests.clear();
            ex.route(routing_key, headers, &mut dests);
            if dests.is_empty() {
                // The argument wins over a policy's alternate-exchange.
                let ae = match ex.arguments.inner().get("alternate-exchange") {
                    Some(v) => Some(crate::args::render_plain(v)),
                    None => ex.policy_alternate.clone(),
                };
                if let Some(ae) = ae
                    && let Some(ae_name) = t.exchanges.get_key_value(&ae).map(|(k, _)| k.as_str())
                {
                    pending.push(ae_name);
                }
                continue;
            }
            for d in &dests {
                match d {
                    Destination::Queue(q) => queue_names.push(q),
                    Destination::Exchange(e) => pending.push(e),
                }
            }
        }
        queue_names.sort_unstable();
        queue_names.dedup();
        out.extend(
            queue_names
                .into_iter()
                .filter_map(|q| t.queues.get(q).cloned()),
        );
        Ok(())
    }

    /// Delete every exclusive queue owned by a connection.
    pub fn delete_exclusive_queues(&self, owner: u64) {
        let owned: Vec<Arc<Queue>> = self
            .topology
            .read()
            .queues
            .values()
            .filter(|q| q.exclusive_owner == Some(owner))
            .cloned()
            .collect();
        for q in owned {
            self.delete_queue(&q, &mut || Box::new(|_| {}));
        }
    }
}
