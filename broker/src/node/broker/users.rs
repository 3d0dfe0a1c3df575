//! The node's users: create, delete, passwords, tags, limits, import, authentication; each
//! change persisted and replicated as a definition.

use super::*;

impl Broker {
    /// The users lock, once `user` is known to exist (the caller changes it under the lock).
    pub(super) fn users_with(
        &self,
        user: &str,
    ) -> Result<parking_lot::RwLockWriteGuard<'_, crate::users::Users>, UserError> {
        let users = self.users.write();
        if users.get(user).is_none() {
            return Err(UserError::NoSuchUser(user.to_string()));
        }
        Ok(users)
    }

    /// Store a user as it now is, and send it to the cluster.
    pub(super) fn persist_user(&self, user: &UserRecord, on_commit: OnCommit<'_>) {
        self.submit_meta(vec![Self::put_user_op(user)], on_commit);
        self.replicate_definition(on_commit, || {
            crate::routing::cluster::DefinitionChange::PutUser(
                serde_json::to_vec(user).unwrap_or_default(),
            )
        });
    }

    pub(super) fn put_user_op(user: &UserRecord) -> Op {
        Op::Put {
            table: MetaTable::Users,
            key: user.name.as_bytes().to_vec(),
            value: serde_json::to_vec(user).unwrap_or_default(),
        }
    }

    /// `add_user`.
    ///
    /// # Errors
    /// [`UserError::Exists`].
    pub fn add_user(
        &self,
        name: &str,
        password: &str,
        on_commit: OnCommit<'_>,
    ) -> Result<(), UserError> {
        let mut users = self.users.write();
        if users.get(name).is_some() {
            return Err(UserError::Exists(name.to_string()));
        }
        let user = UserRecord::new(name, password, Vec::new());
        self.persist_user(&user, on_commit);
        users.put(user);
        Ok(())
    }

    /// `delete_user` (its permissions go with it).
    ///
    /// # Errors
    /// [`UserError::NoSuchUser`].
    pub fn delete_user(&self, name: &str, on_commit: OnCommit<'_>) -> Result<(), UserError> {
        let mut users = self.users.write();
        let topics = users.topic_permissions(None, Some(name));
        let keys = users
            .remove(name)
            .ok_or_else(|| UserError::NoSuchUser(name.to_string()))?;
        let mut ops = vec![Op::Delete {
            table: MetaTable::Users,
            key: name.as_bytes().to_vec(),
        }];
        ops.extend(keys.iter().map(|(vhost, user)| Op::Delete {
            table: MetaTable::Permissions,
            key: crate::durable::ExchangeRecord::key(vhost, user),
        }));
        ops.extend(topics.iter().map(|p| Op::Delete {
            table: MetaTable::TopicPermissions,
            key: Self::topic_key(p),
        }));
        self.submit_meta(ops, on_commit);
        self.replicate_definition(on_commit, || {
            crate::routing::cluster::DefinitionChange::DeleteUser(name.to_string())
        });
        self.permissions_changed();
        drop(users);
        // rabbit_connection_tracking's user_deleted: that user's connections, and only those,
        // are closed (on every node: a replicated deletion runs this too).
        for c in self.connections.list() {
            if c.info.user == name {
                c.request_close(format!("user '{name}' is deleted"));
            }
        }
        Ok(())
    }

    /// `change_password`.
    ///
    /// # Errors
    /// [`UserError::NoSuchUser`].
    pub fn change_password(
        &self,
        name: &str,
        password: &str,
        on_commit: OnCommit<'_>,
    ) -> Result<(), UserError> {
        self.update_user(name, on_commit, |u| {
            u.password_hash = crate::users::hash_password(password);
            u.hashing_algorithm = crate::users::SHA256.to_string();
        })
    }

    /// `set_user_tags` (replaces the tags).
    ///
    /// # Errors
    /// [`UserError::NoSuchUser`].
    pub fn set_user_tags(
        &self,
        name: &str,
        tags: Vec<String>,
        on_commit: OnCommit<'_>,
    ) -> Result<(), UserError> {
        self.update_user(name, on_commit, |u| u.tags = tags)
    }

    pub(super) fn update_user(
        &self,
        name: &str,
        on_commit: OnCommit<'_>,
        change: impl FnOnce(&mut UserRecord),
    ) -> Result<(), UserError> {
        let mut users = self.users.write();
        let mut user = users
            .get(name)
            .cloned()
            .ok_or_else(|| UserError::NoSuchUser(name.to_string()))?;
        change(&mut user);
        self.persist_user(&user, on_commit);
        users.put(user);
        Ok(())
    }

    /// Create or replace a user from an imported record (RabbitMQ definitions: the password
    /// hash is taken as it is).
    ///
    /// # Errors
    /// [`UserError::Algorithm`] for a hashing algorithm Warren cannot verify.
    pub fn import_user(&self, user: UserRecord, on_commit: OnCommit<'_>) -> Result<(), UserError> {
        if !crate::users::HASHING_ALGORITHMS.contains(&user.hashing_algorithm.as_str()) {
            return Err(UserError::Algorithm(user.hashing_algorithm));
        }
        let mut users = self.users.write();
        self.persist_user(&user, on_commit);
        users.put(user);
        self.permissions_changed();
        Ok(())
    }

    /// `set_user_limits` (replaces them).
    ///
    /// # Errors
    /// [`UserError::NoSuchUser`].
    pub fn set_user_limits(
        &self,
        name: &str,
        limits: crate::users::UserLimits,
        on_commit: OnCommit<'_>,
    ) -> Result<(), UserError> {
        self.update_user(name, on_commit, |u| u.limits = limits)
    }

    /// `list_users`, sorted by name.
    #[must_use]
    pub fn list_users(&self) -> Vec<UserRecord> {
        self.users.read().list()
    }

    /// Whether `user` may log in from loopback addresses only (`loopback_users`).
    #[must_use]
    pub fn is_loopback_user(&self, user: &str) -> bool {
        self.config.loopback_users.iter().any(|u| u == user)
    }

    /// Whether an internal user of that name exists.
    #[must_use]
    pub fn user_exists(&self, name: &str) -> bool {
        self.users.read().get(name).is_some()
    }

    /// Whether the user exists and carries `tag` (tags are read when a connection opens, as
    /// RabbitMQ caches the user record per connection).
    #[must_use]
    pub fn user_has_tag(&self, name: &str, tag: &str) -> bool {
        self.users
            .read()
            .get(name)
            .is_some_and(|u| u.tags.iter().any(|t| t == tag))
    }

    /// `authenticate_user`: whether the credentials are right (no loopback rule).
    #[must_use]
    pub fn authenticate(&self, name: &str, password: &str) -> bool {
        self.users
            .read()
            .get(name)
            .is_some_and(|u| u.verify(password.as_bytes()))
    }
}
