//! A vhost's user and operator policies: set, clear, and applied to its queues and exchanges.

use super::*;

impl VHost {
    pub(super) fn policy_set(&self, kind: PolicyKind) -> &RwLock<Vec<crate::policy::Policy>> {
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
                crate::routing::cluster::TopologyChange::Definition(
                    crate::routing::cluster::DefinitionChange::SetPolicy {
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
            crate::routing::cluster::TopologyChange::Definition(
                crate::routing::cluster::DefinitionChange::ClearPolicy {
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
    pub(super) fn reapply_policies(&self) {
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
}
