//! The node's vhosts: create, delete, default queue type, limits; each change persisted and
//! replicated as a definition.

use super::*;

impl Broker {
    pub(super) fn require_vhost(&self, vhost: &str) -> Result<(), UserError> {
        match self.vhost(vhost) {
            Some(_) => Ok(()),
            None => Err(UserError::NoSuchVhost(vhost.to_string())),
        }
    }

    /// `add_vhost` (a no-op for an existing one, as rabbitmqctl). Returns whether it was created.
    ///
    /// # Errors
    /// [`UserError::QueueType`] for a default queue type other than classic or quorum.
    pub fn add_vhost(
        &self,
        name: &str,
        default_queue_type: Option<&str>,
        on_commit: OnCommit<'_>,
    ) -> Result<bool, UserError> {
        check_queue_type(default_queue_type)?;
        let mut vhosts = self.vhosts.write();
        if vhosts.contains_key(name) {
            return Ok(false);
        }
        let vh = VHost::new(
            name,
            self.store.clone(),
            Some(Arc::clone(&self.timers)),
            Arc::clone(&self.stats),
        );
        *vh.default_queue_type.write() = default_queue_type.map(str::to_string);
        if let Some(c) = self.cluster() {
            vh.set_cluster(Arc::clone(c));
        }
        let slot_op = self.take_delayed_slot(&vh);
        self.submit_meta(vec![slot_op, Self::vhost_put_op(&vh)], on_commit);
        self.replicate_definition(on_commit, || Self::vhost_change(&vh));
        vhosts.insert(name.to_string(), vh);
        Ok(true)
    }

    /// `update_vhost_metadata --default-queue-type`.
    ///
    /// # Errors
    /// [`UserError::NoSuchVhost`], [`UserError::QueueType`].
    pub fn set_default_queue_type(
        &self,
        name: &str,
        default_queue_type: Option<&str>,
        on_commit: OnCommit<'_>,
    ) -> Result<(), UserError> {
        check_queue_type(default_queue_type)?;
        let vh = self
            .vhost(name)
            .ok_or_else(|| UserError::NoSuchVhost(name.to_string()))?;
        *vh.default_queue_type.write() = default_queue_type.map(str::to_string);
        self.persist_vhost(&vh, on_commit);
        Ok(())
    }

    /// Write the vhost's record (limits and metadata), and send it to the cluster.
    pub(super) fn persist_vhost(&self, vh: &VHost, on_commit: OnCommit<'_>) {
        self.submit_meta(vec![Self::vhost_put_op(vh)], on_commit);
        self.replicate_definition(on_commit, || Self::vhost_change(vh));
    }

    /// A vhost's settings as the cluster carries them (its delayed slot is this node's own).
    pub(super) fn vhost_change(vh: &VHost) -> crate::routing::cluster::DefinitionChange {
        crate::routing::cluster::DefinitionChange::PutVhost {
            name: vh.name.clone(),
            default_queue_type: vh.default_queue_type.read().clone(),
            limits: serde_json::to_vec(&*vh.limits.read()).unwrap_or_default(),
        }
    }

    pub(super) fn vhost_put_op(vh: &VHost) -> Op {
        Op::Put {
            table: MetaTable::Vhosts,
            key: vh.name.as_bytes().to_vec(),
            value: serde_json::to_vec(&vh.record()).unwrap_or_default(),
        }
    }

    /// Give `vh` a fresh delayed slot; returns the op that persists the counter (to be
    /// committed with the vhost's record).
    pub(super) fn take_delayed_slot(&self, vh: &VHost) -> Op {
        let slot = self.delayed_slot_next.fetch_add(1, Ordering::AcqRel);
        vh.delayed.set_slot(slot);
        Op::Put {
            table: MetaTable::Vhosts,
            key: DELAYED_SLOT_NEXT.to_vec(),
            value: (slot + 1).to_string().into_bytes(),
        }
    }

    /// `delete_vhost`: its queues (with their messages), exchanges, bindings, policies and
    /// permissions go, and its connections are closed with `320 CONNECTION_FORCED`.
    ///
    /// # Errors
    /// [`UserError::NoSuchVhost`].
    pub fn delete_vhost(&self, name: &str, on_commit: OnCommit<'_>) -> Result<(), UserError> {
        let vh = self
            .vhosts
            .write()
            .remove(name)
            .ok_or_else(|| UserError::NoSuchVhost(name.to_string()))?;
        vh.shut_down();
        let mut ops: Vec<Op> = {
            let mut users = self.users.write();
            let gone: Vec<PermissionRecord> = users.permissions(Some(name), None);
            for p in &gone {
                users.clear_permission(&p.vhost, &p.user);
            }
            let topics = users.topic_permissions(Some(name), None);
            for p in &topics {
                users.clear_topic_permissions(&p.vhost, &p.user, Some(&p.exchange));
            }
            gone.iter()
                .map(|p| Op::Delete {
                    table: MetaTable::Permissions,
                    key: crate::durable::ExchangeRecord::key(&p.vhost, &p.user),
                })
                .chain(topics.iter().map(|p| Op::Delete {
                    table: MetaTable::TopicPermissions,
                    key: Self::topic_key(p),
                }))
                .collect()
        };
        self.permissions_changed();
        // Last, so that waiting for it waits for everything above (commits are in order).
        ops.push(Op::Delete {
            table: MetaTable::Vhosts,
            key: name.as_bytes().to_vec(),
        });
        self.submit_meta(ops, on_commit);
        self.replicate_definition(on_commit, || {
            crate::routing::cluster::DefinitionChange::DeleteVhost(name.to_string())
        });
        Ok(())
    }

    /// `set_vhost_limits` (replaces them).
    ///
    /// # Errors
    /// [`UserError::NoSuchVhost`].
    pub fn set_vhost_limits(
        &self,
        name: &str,
        limits: crate::users::VhostLimits,
        on_commit: OnCommit<'_>,
    ) -> Result<(), UserError> {
        let vh = self
            .vhost(name)
            .ok_or_else(|| UserError::NoSuchVhost(name.to_string()))?;
        *vh.limits.write() = limits;
        self.persist_vhost(&vh, on_commit);
        Ok(())
    }

    /// `list_vhosts`, sorted.
    #[must_use]
    pub fn list_vhosts(&self) -> Vec<String> {
        let mut v: Vec<String> = self.vhosts.read().keys().cloned().collect();
        v.sort();
        v
    }
}

pub(super) fn check_queue_type(t: Option<&str>) -> Result<(), UserError> {
    match t {
        Some(t) if !crate::users::DEFAULT_QUEUE_TYPES.contains(&t) => {
            Err(UserError::QueueType(t.to_string()))
        }
        _ => Ok(()),
    }
}
