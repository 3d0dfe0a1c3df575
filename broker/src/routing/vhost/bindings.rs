//! A vhost's bindings: bind and unbind (queue and exchange destinations), their durable records
//! and the cluster changes they make.

use super::*;

impl VHost {
    pub(super) fn binding_record(&self, source: &str, b: &Binding) -> BindingRecord {
        BindingRecord {
            vhost: self.name.clone(),
            source: source.to_string(),
            destination: b.destination.clone(),
            routing_key: b.routing_key.clone(),
            arguments: b.arguments.clone(),
        }
    }

    /// Whether a binding from `source` to `dest` is stored: both ends durable (RabbitMQ).
    pub(super) fn binding_is_durable(t: &Topology, source: &Exchange, dest: &Destination) -> bool {
        source.durable
            && match dest {
                Destination::Queue(q) => match t.queues.get(q) {
                    Some(q) => q.is_stored(),
                    // A partitioned queue: as durable as its partitions.
                    None => t
                        .partitions
                        .get(q)
                        .is_some_and(|p| p.queues().any(|q| q.is_stored())),
                },
                Destination::Exchange(e) => t.exchanges.get(e).is_some_and(|e| e.durable),
            }
    }

    /// Put back a durable binding recovered from the store (false if an end is missing).
    pub fn restore_binding(&self, b: BindingRecord) -> bool {
        let mut t = self.topology.write();
        let dest_exists = match &b.destination {
            Destination::Queue(q) => t.has_queue(q),
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

    /// A binding's change as the cluster carries it.
    pub(super) fn binding_change(
        &self,
        source: &str,
        binding: &Binding,
        bind: bool,
    ) -> crate::routing::cluster::TopologyChange {
        let Op::Put { key, value, .. } = self.binding_record(source, binding).put() else {
            unreachable!("a record put is a put");
        };
        if bind {
            crate::routing::cluster::TopologyChange::Bind { key, value }
        } else {
            crate::routing::cluster::TopologyChange::Unbind { key, value }
        }
    }

    /// Remove every binding to `dest` (already out of the topology; `dest_durable` says
    /// whether it was stored, and so whether bindings to it were), then auto-delete sources left
    /// without bindings. Store ops go to `ops`.
    pub(super) fn remove_destination(
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
        match ex.kind {
            ExchangeKind::Headers => crate::args::validate_x_match(&arguments)?,
            ExchangeKind::ConsistentHash => {
                crate::exchange::hash::check_weight(routing_key)?;
            }
            _ => {}
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

    pub(super) fn check_binding_ends(
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
            Destination::Queue(q) if !t.has_queue(q) => {
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
}
