//! The node: vhosts, users, id allocation, and the handshake's questions answered.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;
use warren_amqp::connection::{AccessError, Gatekeeper, Login};

use crate::durable::Durable;
use crate::vhost::VHost;

/// A user of the broker.
#[derive(Debug, Clone)]
pub struct User {
    /// Name.
    pub name: String,
    /// Password (hashing comes with the security issue).
    pub password: String,
    /// May only connect from loopback (RabbitMQ's `loopback_users`, guest by default).
    pub loopback_only: bool,
}

/// Broker-wide settings.
#[derive(Debug, Clone)]
pub struct BrokerConfig {
    /// Deliveries a consumer may have in flight to its socket before the queue pauses it.
    pub consumer_window: u32,
    /// Unwritten delivery bytes per consumer ([`crate::limits::CONSUMER_WINDOW_BYTES_DEFAULT`]).
    pub consumer_window_bytes: u64,
    /// Time a delivery may stay unacked before its channel is closed with 406 (RabbitMQ's
    /// `consumer_timeout`, 30 minutes by default; None or 0 disables it).
    pub consumer_timeout_ms: Option<u64>,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        Self {
            consumer_window: crate::limits::CONSUMER_WINDOW_DEFAULT,
            consumer_window_bytes: crate::limits::CONSUMER_WINDOW_BYTES_DEFAULT,
            consumer_timeout_ms: Some(crate::limits::CONSUMER_TIMEOUT_DEFAULT_MS),
        }
    }
}

/// One broker node.
#[derive(Debug)]
pub struct Broker {
    /// Settings.
    pub config: BrokerConfig,
    vhosts: RwLock<HashMap<String, Arc<VHost>>>,
    users: RwLock<HashMap<String, User>>,
    next_id: AtomicU64,
    name_seed: std::collections::hash_map::RandomState,
}

impl Broker {
    /// A broker with vhost "/" and the guest user (loopback only), as RabbitMQ starts, keeping
    /// nothing on disk.
    #[must_use]
    pub fn new(config: BrokerConfig) -> Arc<Self> {
        Self::with_store(config, None)
    }

    /// Like [`Broker::new`], with durable objects and persistent messages written to `store`.
    #[must_use]
    pub fn with_store(config: BrokerConfig, store: Option<Arc<Durable>>) -> Arc<Self> {
        let b = Self {
            config,
            vhosts: RwLock::new(HashMap::new()),
            users: RwLock::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            name_seed: std::collections::hash_map::RandomState::new(),
        };
        b.vhosts.write().insert(
            "/".into(),
            VHost::new("/", store, Some(crate::timers::Timers::start())),
        );
        b.users.write().insert(
            "guest".into(),
            User {
                name: "guest".into(),
                password: "guest".into(),
                loopback_only: true,
            },
        );
        Arc::new(b)
    }

    /// A vhost by name.
    #[must_use]
    pub fn vhost(&self, name: &str) -> Option<Arc<VHost>> {
        self.vhosts.read().get(name).cloned()
    }

    pub(crate) fn next_id_counter(&self) -> &AtomicU64 {
        &self.next_id
    }

    /// A fresh id (connections, consumers), unique in this process.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// A unique, unguessable name such as `amq.gen-3kXq...` (22 url-safe characters).
    pub fn unique_name(&self, prefix: &str) -> String {
        const ALPHABET: &[u8; 64] =
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let n = self.next_id();
        let mut out = String::with_capacity(prefix.len() + 22);
        out.push_str(prefix);
        let mut produced = 0;
        let mut round = 0u64;
        while produced < 22 {
            let mut h = self.name_seed.build_hasher();
            h.write_u64(n);
            h.write_u64(round);
            let mut bits = h.finish();
            for _ in 0..10 {
                if produced == 22 {
                    break;
                }
                out.push(char::from(ALPHABET[(bits & 63) as usize]));
                bits >>= 6;
                produced += 1;
            }
            round += 1;
        }
        out
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
        // Compare without early exit on the first differing byte.
        let stored = u.password.as_bytes();
        let same_len = stored.len() == password.len();
        let diff = stored
            .iter()
            .zip(password.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if !same_len || diff != 0 || (u.loopback_only && !peer_is_loopback) {
            return Err(AccessError::LoginRefused);
        }
        Ok(Login {
            user: u.name.clone(),
        })
    }

    fn open_vhost(&self, _user: &str, vhost: &str) -> Result<(), AccessError> {
        if self.vhosts.read().contains_key(vhost) {
            Ok(())
        } else {
            Err(AccessError::VhostNotFound(vhost.to_string()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_is_loopback_only() {
        let b = Broker::new(BrokerConfig::default());
        assert!(b.login("guest", b"guest", true).is_ok());
        assert_eq!(
            b.login("guest", b"guest", false),
            Err(AccessError::LoginRefused)
        );
        assert_eq!(
            b.login("guest", b"nope", true),
            Err(AccessError::LoginRefused)
        );
        assert!(b.open_vhost("guest", "/").is_ok());
        assert_eq!(
            b.open_vhost("guest", "x").unwrap_err().to_string(),
            "vhost x not found"
        );
    }

    #[test]
    fn generated_names_are_unique() {
        let b = Broker::new(BrokerConfig::default());
        let a = b.unique_name("amq.gen-");
        let c = b.unique_name("amq.gen-");
        assert_ne!(a, c);
        assert_eq!(a.len(), "amq.gen-".len() + 22);
    }
}
