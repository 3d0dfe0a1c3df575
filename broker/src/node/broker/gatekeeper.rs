//! The handshake's gatekeeper: login (PLAIN, AMQPLAIN, EXTERNAL), opening a vhost and a channel
//! within the node's, vhost's and user's connection and channel limits.

use super::*;

impl Broker {
    /// A connection counted by `open_vhost` ended.
    pub fn release_connection(&self, user: &str, vhost: &str) {
        let mut counts = self.counts.lock();
        counts.node_connections = counts.node_connections.saturating_sub(1);
        add(&mut counts.vhost_connections, vhost, -1);
        add(&mut counts.user_connections, user, -1);
    }

    /// Refuse a connection over the node-wide `connection_max`.
    pub(super) fn node_connection_slot(&self, counts: &Counts) -> Result<(), AccessError> {
        match self.config.connection_max {
            Some(max) if counts.node_connections >= max => Err(AccessError::Limit(format!(
                "connection refused: node connection limit ({max}) is reached"
            ))),
            _ => Ok(()),
        }
    }

    /// Connections past connection.open on this node.
    #[must_use]
    pub fn connection_count(&self) -> u64 {
        self.counts.lock().node_connections
    }

    /// Open channels on this node.
    #[must_use]
    pub fn channel_count(&self) -> u64 {
        self.counts
            .lock()
            .user_channels
            .values()
            .map(|n| u64::try_from(*n).unwrap_or(0))
            .sum()
    }

    /// A channel counted by `open_channel` closed.
    pub fn release_channel(&self, user: &str) {
        add(&mut self.counts.lock().user_channels, user, -1);
    }
}

impl Gatekeeper for Broker {
    fn login(
        &self,
        user: &str,
        password: &[u8],
        peer_is_loopback: bool,
    ) -> Result<Login, AccessError> {
        let users = self.users.read();
        let u = users.get(user).ok_or(AccessError::LoginRefused)?;
        // RabbitMQ's default loopback_users: guest may log in from localhost only.
        let loopback_only = self.is_loopback_user(user);
        if !u.verify(password) || (loopback_only && !peer_is_loopback) {
            return Err(AccessError::LoginRefused);
        }
        Ok(Login {
            user: u.name.clone(),
        })
    }

    fn login_external(&self, user: &str, peer_is_loopback: bool) -> Result<Login, AccessError> {
        let users = self.users.read();
        let u = users.get(user).ok_or(AccessError::LoginRefused)?;
        // rabbit_reader checks loopback_users after every mechanism, EXTERNAL included.
        if self.is_loopback_user(user) && !peer_is_loopback {
            return Err(AccessError::LoginRefused);
        }
        Ok(Login {
            user: u.name.clone(),
        })
    }

    fn open_vhost(&self, user: &str, vhost: &str) -> Result<(), AccessError> {
        // First, as RabbitMQ: the node-wide limit refuses whatever the vhost and user.
        self.node_connection_slot(&self.counts.lock())?;
        if !self.vhosts.read().contains_key(vhost) {
            return Err(AccessError::VhostNotFound(vhost.to_string()));
        }
        let user_limits = {
            let users = self.users.read();
            if users.permission(vhost, user).is_none() {
                return Err(AccessError::VhostRefused {
                    vhost: vhost.to_string(),
                    user: user.to_string(),
                });
            }
            users
                .get(user)
                .map(|u| u.limits.clone())
                .unwrap_or_default()
        };
        let vhost_limit = self
            .vhost(vhost)
            .and_then(|v| v.limits.read().max_connections);
        let mut counts = self.counts.lock();
        let here = counts.vhost_connections.get(vhost).copied().unwrap_or(0);
        if let Some(max) = crate::users::reached(vhost_limit, here) {
            return Err(AccessError::Limit(format!(
                "access to vhost '{vhost}' refused for user '{user}': connection limit ({max}) is reached"
            )));
        }
        let mine = counts.user_connections.get(user).copied().unwrap_or(0);
        if let Some(max) = crate::users::reached(user_limits.max_connections, mine) {
            return Err(AccessError::Limit(format!(
                "connection refused for user '{user}': user connection limit ({max}) is reached"
            )));
        }
        // Again under this lock: another connection may have taken the last slot.
        self.node_connection_slot(&counts)?;
        // Counted from here; the session releases it when the connection ends.
        counts.node_connections += 1;
        add(&mut counts.vhost_connections, vhost, 1);
        add(&mut counts.user_connections, user, 1);
        Ok(())
    }

    fn open_channel(&self, user: &str) -> Result<(), AccessError> {
        let limit = self
            .users
            .read()
            .get(user)
            .and_then(|u| u.limits.max_channels);
        let mut counts = self.counts.lock();
        let open = counts.user_channels.get(user).copied().unwrap_or(0);
        if let Some(max) = crate::users::reached(limit, open) {
            return Err(AccessError::Limit(format!(
                "number of channels opened for user '{user}' has reached the maximum allowed user limit of ({max})"
            )));
        }
        add(&mut counts.user_channels, user, 1);
        Ok(())
    }
}
