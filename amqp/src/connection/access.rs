//! What the connection asks of the broker during the handshake and on channel.open: the
//! [`Gatekeeper`] trait (logins, vhost access, channel limits) with its answers, [`Login`] and
//! [`AccessError`].

/// What a successful login yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Login {
    /// The authenticated user name.
    pub user: String,
}

/// Why a login or vhost open was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// Wrong credentials, unknown user, or a user not allowed from this peer.
    #[error("login refused")]
    LoginRefused,
    /// The vhost does not exist.
    #[error("vhost {0} not found")]
    VhostNotFound(String),
    /// A limit refuses it; the text is RabbitMQ's.
    #[error("{0}")]
    Limit(String),
    /// The user may not use the vhost.
    #[error("access to vhost '{vhost}' refused for user '{user}'")]
    VhostRefused {
        /// The vhost asked for.
        vhost: String,
        /// The user.
        user: String,
    },
}

/// Answers the questions the handshake asks of the broker.
pub trait Gatekeeper: Send + Sync {
    /// Check a user name and password. `peer_is_loopback` lets loopback-only users (guest) in.
    fn login(
        &self,
        user: &str,
        password: &[u8],
        peer_is_loopback: bool,
    ) -> Result<Login, AccessError>;
    /// Log in a user whose identity a verified TLS client certificate established (SASL
    /// EXTERNAL): the user must exist; no password is checked; loopback-only users still
    /// need a loopback peer.
    fn login_external(&self, user: &str, peer_is_loopback: bool) -> Result<Login, AccessError>;
    /// Check that the vhost exists and the user may use it (and count the connection against
    /// the vhost's and the user's limits).
    fn open_vhost(&self, user: &str, vhost: &str) -> Result<(), AccessError>;
    /// A channel is about to open for `user`: refuse it over the user's channel limit, count
    /// it otherwise (the broker uncounts it when the channel closes).
    fn open_channel(&self, _user: &str) -> Result<(), AccessError> {
        Ok(())
    }
}
