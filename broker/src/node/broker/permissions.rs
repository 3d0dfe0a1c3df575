//! Permissions and topic permissions: set, clear, list; a generation counter that open
//! channels compare to drop their cached checks.

use super::*;

impl Broker {
    pub(super) fn put_permission_op(p: &PermissionRecord) -> Op {
        Op::Put {
            table: MetaTable::Permissions,
            key: crate::durable::ExchangeRecord::key(&p.vhost, &p.user),
            value: serde_json::to_vec(p).unwrap_or_default(),
        }
    }

    pub(super) fn topic_key(p: &TopicPermissionRecord) -> Vec<u8> {
        serde_json::to_vec(&(&p.vhost, &p.user, &p.exchange)).unwrap_or_default()
    }

    /// `set_topic_permissions`.
    ///
    /// # Errors
    /// [`UserError::NoSuchUser`], [`UserError::NoSuchVhost`], [`UserError::BadPattern`].
    pub fn set_topic_permissions(
        &self,
        p: TopicPermissionRecord,
        on_commit: OnCommit<'_>,
    ) -> Result<(), UserError> {
        self.require_vhost(&p.vhost)?;
        p.validate()?;
        let mut users = self.users_with(&p.user)?;
        self.submit_meta(
            vec![Op::Put {
                table: MetaTable::TopicPermissions,
                key: Self::topic_key(&p),
                value: serde_json::to_vec(&p).unwrap_or_default(),
            }],
            on_commit,
        );
        self.replicate_definition(on_commit, || {
            crate::routing::cluster::DefinitionChange::SetTopicPermissions(
                serde_json::to_vec(&p).unwrap_or_default(),
            )
        });
        users.set_topic_permission(p);
        self.permissions_changed();
        Ok(())
    }

    /// `clear_topic_permissions` (one exchange, or all of the user's in the vhost).
    ///
    /// # Errors
    /// [`UserError::NoSuchUser`], [`UserError::NoSuchVhost`].
    pub fn clear_topic_permissions(
        &self,
        vhost: &str,
        user: &str,
        exchange: Option<&str>,
        on_commit: OnCommit<'_>,
    ) -> Result<(), UserError> {
        self.require_vhost(vhost)?;
        let mut users = self.users_with(user)?;
        let gone = users.clear_topic_permissions(vhost, user, exchange);
        self.submit_meta(
            gone.iter()
                .map(|p| Op::Delete {
                    table: MetaTable::TopicPermissions,
                    key: Self::topic_key(p),
                })
                .collect(),
            on_commit,
        );
        self.replicate_definition(on_commit, || {
            crate::routing::cluster::DefinitionChange::ClearTopicPermissions {
                vhost: vhost.to_string(),
                user: user.to_string(),
                exchange: exchange.map(str::to_string),
            }
        });
        self.permissions_changed();
        Ok(())
    }

    /// `list_topic_permissions` / `list_user_topic_permissions`.
    #[must_use]
    pub fn list_topic_permissions(
        &self,
        vhost: Option<&str>,
        user: Option<&str>,
    ) -> Vec<TopicPermissionRecord> {
        self.users.read().topic_permissions(vhost, user)
    }

    /// Changes with every permission change (see [`crate::node::access::Access`]).
    #[must_use]
    pub fn permission_generation(&self) -> u64 {
        self.permission_generation.load(Ordering::Acquire)
    }

    pub(super) fn permissions_changed(&self) {
        self.permission_generation.fetch_add(1, Ordering::AcqRel);
    }

    /// `set_permissions`.
    ///
    /// # Errors
    /// [`UserError::NoSuchUser`], [`UserError::NoSuchVhost`], [`UserError::BadPattern`].
    pub fn set_permissions(
        &self,
        p: PermissionRecord,
        on_commit: OnCommit<'_>,
    ) -> Result<(), UserError> {
        self.require_vhost(&p.vhost)?;
        p.validate()?;
        let mut users = self.users_with(&p.user)?;
        self.submit_meta(vec![Self::put_permission_op(&p)], on_commit);
        self.replicate_definition(on_commit, || {
            crate::routing::cluster::DefinitionChange::SetPermissions(
                serde_json::to_vec(&p).unwrap_or_default(),
            )
        });
        users.set_permission(p);
        self.permissions_changed();
        Ok(())
    }

    /// `clear_permissions`.
    ///
    /// # Errors
    /// [`UserError::NoSuchUser`], [`UserError::NoSuchVhost`].
    pub fn clear_permissions(
        &self,
        vhost: &str,
        user: &str,
        on_commit: OnCommit<'_>,
    ) -> Result<(), UserError> {
        self.require_vhost(vhost)?;
        let mut users = self.users_with(user)?;
        if users.clear_permission(vhost, user) {
            self.permissions_changed();
            self.submit_meta(
                vec![Op::Delete {
                    table: MetaTable::Permissions,
                    key: crate::durable::ExchangeRecord::key(vhost, user),
                }],
                on_commit,
            );
        }
        self.replicate_definition(on_commit, || {
            crate::routing::cluster::DefinitionChange::ClearPermissions {
                vhost: vhost.to_string(),
                user: user.to_string(),
            }
        });
        Ok(())
    }

    /// `list_permissions` (one vhost) / `list_user_permissions` (one user).
    #[must_use]
    pub fn list_permissions(
        &self,
        vhost: Option<&str>,
        user: Option<&str>,
    ) -> Vec<PermissionRecord> {
        self.users.read().permissions(vhost, user)
    }
}

pub(super) fn full_permission(user: &str, vhost: &str) -> PermissionRecord {
    PermissionRecord {
        user: user.to_string(),
        vhost: vhost.to_string(),
        configure: ".*".into(),
        write: ".*".into(),
        read: ".*".into(),
    }
}
