//! Where a published message goes: the exchange's matching, alternate exchanges, exchange-to-
//! exchange bindings; for clients (with their checks) and for internal publishes (dead letters,
//! delayed messages) through [`crate::queue::QueueHost`].

use super::*;

impl VHost {
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

    pub(super) fn route_inner(
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
            } else if let Some(p) = t.partitions.get(routing_key)
                && let Some(q) = p.route(routing_key, headers)
            {
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
        let start = out.len();
        out.extend(queue_names.into_iter().filter_map(|q| {
            match t.queues.get(q) {
                Some(q) => Some(Arc::clone(q)),
                None => t
                    .partitions
                    .get(q)
                    .and_then(|p| p.route(routing_key, headers))
                    .cloned(),
            }
        }));
        if out.len() - start > 1 {
            // A partition may also be bound directly: one copy each.
            let mut seen = HashSet::new();
            let mut i = start;
            while i < out.len() {
                if seen.insert(Arc::as_ptr(&out[i])) {
                    i += 1;
                } else {
                    out.swap_remove(i);
                }
            }
        }
        Ok(())
    }
}

impl crate::queue::QueueHost for VHost {
    fn route(
        &self,
        exchange: &str,
        routing_key: &str,
        headers: &RoutingHeaders<'_>,
        out: &mut Vec<Arc<Queue>>,
    ) -> Result<(), AmqpError> {
        self.route_internal(exchange, routing_key, headers, out)
    }

    fn delete_if(
        &self,
        queue: &Arc<Queue>,
        still: &dyn Fn(&Queue) -> bool,
        on_commit: OnCommit<'_>,
    ) -> Option<u32> {
        self.delete_queue_if(queue, still, on_commit)
    }
}
