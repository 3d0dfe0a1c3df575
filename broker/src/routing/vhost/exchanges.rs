//! A vhost's exchanges: declare (with RabbitMQ's equivalence checks), delete (with the
//! bindings to and from it), and the changes replicated to the cluster.

use super::*;

impl VHost {
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
        if decl.kind == ExchangeKind::ConsistentHash {
            crate::exchange::hash::HashSource::from_arguments(&decl.arguments)?;
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
            crate::routing::cluster::TopologyChange::DeclareExchange { key, value }
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
            crate::routing::cluster::TopologyChange::DeleteExchange {
                vhost: self.name.clone(),
                name: name.to_string(),
            }
        });
        Ok(())
    }

    /// In a cluster, send a change made here to the other nodes (unless it came from them);
    /// the client's reply waits for its commit too.
    pub(super) fn replicate(
        &self,
        on_commit: OnCommit<'_>,
        change: impl FnOnce() -> crate::routing::cluster::TopologyChange,
    ) {
        if let Some(cluster) = self.cluster()
            && !crate::routing::cluster::applying()
        {
            cluster.replicate_topology(change(), on_commit());
        }
    }

    /// Store ops for an exchange going away: its record and its stored bindings (as source).
    pub(super) fn exchange_removed(&self, t: &Topology, ex: &Exchange, ops: &mut Vec<Op>) {
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
}
