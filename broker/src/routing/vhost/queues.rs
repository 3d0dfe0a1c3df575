//! A vhost's queues: declare (with RabbitMQ's equivalence checks), look up, delete (also when
//! unused or when their owner goes), and the replicated queues the cluster creates.

use super::*;

impl VHost {
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

    /// A proxy of a classic queue homed on another node of the cluster (see
    /// [`crate::queue::Queue::is_remote`]): its declaration as the home has it, no store, and
    /// an exclusive queue owned by no connection of this node.
    #[must_use]
    pub fn proxy_queue(
        &self,
        id: u64,
        name: &str,
        flags: (bool, bool, bool),
        arguments: FieldTable,
    ) -> Arc<Queue> {
        let (durable, auto_delete, exclusive) = flags;
        let env = crate::queue::QueueEnv {
            store: None,
            ..self.queue_env()
        };
        let owner = exclusive.then_some(crate::queue::REMOTE_OWNER);
        Queue::new(
            id,
            name,
            &self.name,
            durable,
            auto_delete,
            owner,
            arguments,
            env,
        )
    }

    /// Insert a replicated queue the cluster created (false: one of that name exists).
    pub fn insert_replicated(&self, queue: Arc<Queue>) -> bool {
        let mut t = self.topology.write();
        if t.queues.contains_key(&queue.name) {
            return false;
        }
        t.insert_queue(queue);
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

    /// Put back a durable queue recovered from the store.
    pub fn restore_queue(&self, queue: Arc<Queue>) {
        self.topology.write().insert_queue(queue);
    }

    /// The partitioned queue named `name` (a snapshot of its spec and partitions).
    #[must_use]
    pub fn partitioned(&self, name: &str) -> Option<crate::routing::partitions::PartitionSet> {
        self.topology.read().partitions.get(name).cloned()
    }

    /// The names of the vhost's partitioned queues, sorted.
    #[must_use]
    pub fn partitioned_names(&self) -> Vec<String> {
        self.topology.read().partitions.names()
    }

    /// A queue by name.
    #[must_use]
    pub fn queue(&self, name: &str) -> Option<Arc<Queue>> {
        self.topology.read().queues.get(name).cloned()
    }

    /// A queue by name, or 404.
    /// A proxy whose home node is down gets RabbitMQ's 404 for a durable queue on a down
    /// node.
    pub fn queue_or_404(&self, name: &str) -> Result<Arc<Queue>, AmqpError> {
        let q = self
            .queue(name)
            .ok_or_else(|| self.not_found("queue", name))?;
        self.reachable(&q)?;
        Ok(q)
    }

    /// Ok unless `q` is a proxy whose home node is down or unreachable:
    /// `404 NOT_FOUND - home node 'n1' of durable queue 'q' in vhost '/' is down or
    /// inaccessible` (rabbit_amqqueue's text).
    ///
    /// # Errors
    /// That 404.
    pub fn reachable(&self, q: &Queue) -> Result<(), AmqpError> {
        if q.home_down() {
            return Err(AmqpError::channel(
                ReplyCode::NotFound,
                format!(
                    "home node '{}' of durable {} is down or inaccessible",
                    q.home().unwrap_or_default(),
                    rs("queue", &q.name, &self.name)
                ),
            ));
        }
        Ok(())
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
                self.reachable(&q)?;
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
            // Re-declaring a queue whose home is down creates no second one.
            self.reachable(q)?;
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
        t.insert_queue(Arc::clone(&candidate));
        drop(t);
        self.stats.event(Lifecycle::QueueCreated);
        if let Some(cluster) = self.cluster() {
            // Every other node learns of it (a proxy each); the declare-ok waits for that.
            cluster.announce_classic(&candidate, on_commit());
        }
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
        if queue.is_remote()
            && let Some(cluster) = self.cluster()
        {
            // The home deletes it, and every node then drops its proxy.
            if !still(queue) {
                return None;
            }
            let ready = queue.counts().messages;
            cluster.delete_remote(queue, on_commit());
            return Some(ready);
        }
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
        let logical_gone = match t.queues.get(&queue.name) {
            Some(q) if Arc::ptr_eq(q, queue) && still(queue) => {
                self.stats.event(Lifecycle::QueueDeleted);
                t.remove_queue(queue)
            }
            _ => return None,
        };
        let mut ops = Vec::new();
        if let Some(logical) = logical_gone {
            // The last partition went: so does the partitioned queue, and bindings to it.
            self.remove_destination(
                &mut t,
                &Destination::Queue(logical),
                queue.is_stored(),
                &mut ops,
            );
        }
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
            let ready = queue.delete(ops, on_commit);
            drop(t);
            self.retract(queue);
            Some(ready)
        } else {
            self.remove_destination(
                &mut t,
                &Destination::Queue(queue.name.clone()),
                false,
                &mut ops,
            );
            self.submit(ops, on_commit);
            drop(t);
            let ready = queue.delete(Vec::new(), &mut || Box::new(|_| {}));
            self.retract(queue);
            Some(ready)
        }
    }

    /// A classic queue held here was deleted: the other nodes drop their proxies.
    fn retract(&self, queue: &Arc<Queue>) {
        if !queue.is_replicated()
            && let Some(cluster) = self.cluster()
        {
            cluster.retract_classic(queue);
        }
    }

    /// Remove a replicated queue whose deletion the cluster committed: its bindings go, its
    /// consumers here get basic.cancel.
    pub fn drop_replicated(&self, queue: &Arc<Queue>) {
        let mut t = self.topology.write();
        let logical_gone = match t.queues.get(&queue.name) {
            Some(q) if Arc::ptr_eq(q, queue) => {
                self.stats.event(Lifecycle::QueueDeleted);
                t.remove_queue(queue)
            }
            _ => return,
        };
        let mut ops = Vec::new();
        if let Some(logical) = logical_gone {
            self.remove_destination(&mut t, &Destination::Queue(logical), false, &mut ops);
        }
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
