//! Users and their permissions, in RabbitMQ's model and formats.
//!
//! Passwords are stored as RabbitMQ stores them (`rabbit_password_hashing_sha256` by default,
//! `_sha512` also read): base64(salt ++ H(salt ++ password)) with a 4-byte random salt, so
//! definitions exported from RabbitMQ import unchanged. Verification compares in constant
//! time. Permissions are per (user, vhost): configure / write / read regular expressions.

use std::collections::HashMap;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256, Sha512};

/// RabbitMQ's default hashing module name.
pub const SHA256: &str = "rabbit_password_hashing_sha256";
/// The SHA-512 variant.
pub const SHA512: &str = "rabbit_password_hashing_sha512";
/// The hashing modules Warren verifies.
pub const HASHING_ALGORITHMS: &[&str] = &[SHA256, SHA512];

/// A user as stored (RabbitMQ's definitions fields).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserRecord {
    /// User name.
    pub name: String,
    /// base64(salt ++ hash), empty when the user has no password (cannot log in with one).
    pub password_hash: String,
    /// `rabbit_password_hashing_sha256` or `rabbit_password_hashing_sha512`.
    pub hashing_algorithm: String,
    /// Tags (administrator, monitoring, policymaker, management, impersonator, or any).
    pub tags: Vec<String>,
    /// `set_user_limits` (RabbitMQ keeps them in the user record too).
    #[serde(default)]
    pub limits: UserLimits,
}

/// Per-user limits; absent or negative means unlimited (RabbitMQ's convention).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct UserLimits {
    /// Connections the user may have open at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<i64>,
    /// Channels the user may have open at once, over all its connections.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_channels: Option<i64>,
}

/// Per-vhost limits; absent or negative means unlimited.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct VhostLimits {
    /// Connections to the vhost at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<i64>,
    /// Queues in the vhost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queues: Option<i64>,
}

/// What is stored for a vhost: its limits and its metadata, one JSON object (records
/// written before the metadata existed hold only the limits' keys and still decode).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VhostRecord {
    /// `set_vhost_limits`.
    #[serde(flatten)]
    pub limits: VhostLimits,
    /// `add_vhost --default-queue-type`: the type of queues declared without `x-queue-type`.
    #[serde(
        default,
        rename = "default-queue-type",
        skip_serializing_if = "Option::is_none"
    )]
    pub default_queue_type: Option<String>,
    /// Which store id holds the vhost's scheduled delayed messages (see
    /// [`crate::routing::delayed::store_id`]); 0 is vhost "/", and records from before slots existed.
    #[serde(default, rename = "delayed-slot", skip_serializing_if = "is_zero")]
    pub delayed_slot: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The queue types a vhost default may name (streams arrive with issue 9).
pub const DEFAULT_QUEUE_TYPES: &[&str] = &["classic", "quorum"];

/// Whether `count` more would go over `limit` (absent or negative: unlimited).
#[must_use]
pub fn reached(limit: Option<i64>, count: i64) -> Option<i64> {
    limit.filter(|&max| max >= 0 && count >= max)
}

/// Why a user operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UserError {
    /// add_user of an existing name.
    #[error("user '{0}' already exists")]
    Exists(String),
    /// The user does not exist.
    #[error("no such user '{0}'")]
    NoSuchUser(String),
    /// A vhost default queue type that is not one of [`DEFAULT_QUEUE_TYPES`].
    #[error("unsupported default queue type '{0}' (classic or quorum)")]
    QueueType(String),
    /// The vhost does not exist.
    #[error("no such vhost '{0}'")]
    NoSuchVhost(String),
    /// A permission pattern is not a valid regular expression.
    #[error("invalid regular expression '{0}': {1}")]
    BadPattern(String, String),
    /// An unknown hashing algorithm in a stored or imported record.
    #[error("unsupported password hashing algorithm '{0}'")]
    Algorithm(String),
}

fn digest(algorithm: &str, salt: &[u8], password: &[u8]) -> Result<Vec<u8>, UserError> {
    match algorithm {
        SHA256 => Ok(Sha256::new()
            .chain_update(salt)
            .chain_update(password)
            .finalize()
            .to_vec()),
        SHA512 => Ok(Sha512::new()
            .chain_update(salt)
            .chain_update(password)
            .finalize()
            .to_vec()),
        other => Err(UserError::Algorithm(other.to_string())),
    }
}

/// Hash `password` with a fresh 4-byte salt, in RabbitMQ's stored form.
#[must_use]
pub fn hash_password(password: &str) -> String {
    let mut salt = [0u8; 4];
    // A salt only has to differ between users; if the OS source fails, a per-process random
    // hasher still gives distinct values.
    if getrandom::getrandom(&mut salt).is_err() {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write(password.as_bytes());
        salt.copy_from_slice(&h.finish().to_le_bytes()[..4]);
    }
    let mut stored = salt.to_vec();
    stored.extend(digest(SHA256, &salt, password.as_bytes()).unwrap_or_default());
    BASE64.encode(stored)
}

impl UserRecord {
    /// A new user with a freshly hashed password.
    #[must_use]
    pub fn new(name: &str, password: &str, tags: Vec<String>) -> Self {
        Self {
            name: name.to_string(),
            password_hash: hash_password(password),
            hashing_algorithm: SHA256.to_string(),
            tags,
            limits: UserLimits::default(),
        }
    }

    /// Whether `password` is this user's password. Constant time in the password's content.
    #[must_use]
    pub fn verify(&self, password: &[u8]) -> bool {
        let Ok(stored) = BASE64.decode(&self.password_hash) else {
            return false;
        };
        if stored.len() <= 4 {
            return false;
        }
        let (salt, expected) = stored.split_at(4);
        let Ok(actual) = digest(&self.hashing_algorithm, salt, password) else {
            return false;
        };
        actual.len() == expected.len()
            && actual
                .iter()
                .zip(expected)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

/// configure / write / read patterns of one user in one vhost (RabbitMQ's definitions fields).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermissionRecord {
    /// User name.
    pub user: String,
    /// Vhost.
    pub vhost: String,
    /// Pattern for declare / delete.
    pub configure: String,
    /// Pattern for publish / bind destination.
    pub write: String,
    /// Pattern for consume / get / purge / bind source.
    pub read: String,
}

impl PermissionRecord {
    /// Check that every pattern compiles.
    ///
    /// # Errors
    /// [`UserError::BadPattern`] naming the first bad one.
    pub fn validate(&self) -> Result<(), UserError> {
        for p in [&self.configure, &self.write, &self.read] {
            regex::Regex::new(p).map_err(|e| UserError::BadPattern(p.clone(), e.to_string()))?;
        }
        Ok(())
    }
}

/// Write / read patterns for routing keys on one topic exchange (RabbitMQ's topic
/// permissions). `{username}` and `{vhost}` in a pattern stand for the user's and vhost's
/// names (regex-escaped).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopicPermissionRecord {
    /// User name.
    pub user: String,
    /// Vhost.
    pub vhost: String,
    /// The topic exchange.
    pub exchange: String,
    /// Pattern routing keys of publishes must match.
    pub write: String,
    /// Pattern binding keys must match.
    pub read: String,
}

impl TopicPermissionRecord {
    /// Check that both patterns compile once variables are expanded.
    ///
    /// # Errors
    /// [`UserError::BadPattern`].
    pub fn validate(&self) -> Result<(), UserError> {
        for p in [&self.write, &self.read] {
            let expanded = expand(p, &self.user, &self.vhost);
            regex::Regex::new(&expanded)
                .map_err(|e| UserError::BadPattern(p.clone(), e.to_string()))?;
        }
        Ok(())
    }
}

/// `{username}` and `{vhost}` replaced by the escaped names.
#[must_use]
pub fn expand(pattern: &str, user: &str, vhost: &str) -> String {
    pattern
        .replace("{username}", &regex::escape(user))
        .replace("{vhost}", &regex::escape(vhost))
}

/// The node's users and permissions (in memory; the broker persists changes).
#[derive(Debug, Default)]
pub struct Users {
    /// Keyed by (vhost, user, exchange).
    topic_permissions: HashMap<(String, String, String), TopicPermissionRecord>,
    users: HashMap<String, UserRecord>,
    /// Keyed by (vhost, user).
    permissions: HashMap<(String, String), PermissionRecord>,
}

impl Users {
    /// A user by name.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<&UserRecord> {
        self.users.get(name)
    }

    /// Insert or replace a user.
    pub fn put(&mut self, user: UserRecord) {
        self.users.insert(user.name.clone(), user);
    }

    /// Set a topic permission.
    pub fn set_topic_permission(&mut self, p: TopicPermissionRecord) {
        self.topic_permissions
            .insert((p.vhost.clone(), p.user.clone(), p.exchange.clone()), p);
    }

    /// Clear topic permissions of `user` in `vhost` (one exchange, or all); returns those removed.
    pub fn clear_topic_permissions(
        &mut self,
        vhost: &str,
        user: &str,
        exchange: Option<&str>,
    ) -> Vec<TopicPermissionRecord> {
        let keys: Vec<_> = self
            .topic_permissions
            .keys()
            .filter(|(v, u, x)| v == vhost && u == user && exchange.is_none_or(|e| e == x))
            .cloned()
            .collect();
        keys.iter()
            .filter_map(|k| self.topic_permissions.remove(k))
            .collect()
    }

    /// Topic permissions matching the filters, sorted.
    #[must_use]
    pub fn topic_permissions(
        &self,
        vhost: Option<&str>,
        user: Option<&str>,
    ) -> Vec<TopicPermissionRecord> {
        let mut v: Vec<_> = self
            .topic_permissions
            .values()
            .filter(|p| vhost.is_none_or(|x| p.vhost == x) && user.is_none_or(|x| p.user == x))
            .cloned()
            .collect();
        v.sort_by(|a, b| (&a.vhost, &a.user, &a.exchange).cmp(&(&b.vhost, &b.user, &b.exchange)));
        v
    }

    /// Remove a user and its permissions; returns the permission keys removed (topic
    /// permissions go too; the caller deletes them from the store by listing them first).
    pub fn remove(&mut self, name: &str) -> Option<Vec<(String, String)>> {
        self.users.remove(name)?;
        self.topic_permissions.retain(|(_, u, _), _| u != name);
        let keys: Vec<_> = self
            .permissions
            .keys()
            .filter(|(_, u)| u == name)
            .cloned()
            .collect();
        for k in &keys {
            self.permissions.remove(k);
        }
        Some(keys)
    }

    /// Every user, sorted by name.
    #[must_use]
    pub fn list(&self) -> Vec<UserRecord> {
        let mut v: Vec<_> = self.users.values().cloned().collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Set a permission.
    pub fn set_permission(&mut self, p: PermissionRecord) {
        self.permissions
            .insert((p.vhost.clone(), p.user.clone()), p);
    }

    /// Clear a permission; false if there was none.
    pub fn clear_permission(&mut self, vhost: &str, user: &str) -> bool {
        self.permissions
            .remove(&(vhost.to_string(), user.to_string()))
            .is_some()
    }

    /// The permission of `user` in `vhost`.
    #[must_use]
    pub fn permission(&self, vhost: &str, user: &str) -> Option<&PermissionRecord> {
        self.permissions.get(&(vhost.to_string(), user.to_string()))
    }

    /// Permissions matching the filters, sorted by (vhost, user).
    #[must_use]
    pub fn permissions(&self, vhost: Option<&str>, user: Option<&str>) -> Vec<PermissionRecord> {
        let mut v: Vec<_> = self
            .permissions
            .values()
            .filter(|p| vhost.is_none_or(|x| p.vhost == x) && user.is_none_or(|x| p.user == x))
            .cloned()
            .collect();
        v.sort_by(|a, b| (&a.vhost, &a.user).cmp(&(&b.vhost, &b.user)));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verifies_a_hash_exported_by_rabbitmq() {
        // `rabbitmqctl add_user alice secret` then `export_definitions`, RabbitMQ 3.10.8.
        let u = UserRecord {
            name: "alice".into(),
            password_hash: "1dzyWYeZEDTB5zNlmfXP4Dkma4ukPz9zpEaRrZnMvJT04RtM".into(),
            hashing_algorithm: SHA256.into(),
            tags: vec![],
            limits: UserLimits::default(),
        };
        assert!(u.verify(b"secret"));
        assert!(!u.verify(b"Secret"));
        assert!(!u.verify(b""));
    }

    fn rabbit_style_hash(algo: &str, salt: [u8; 4], password: &str) -> String {
        let mut v = salt.to_vec();
        v.extend(digest(algo, &salt, password.as_bytes()).unwrap());
        BASE64.encode(v)
    }

    #[test]
    fn sha512_hashes_verify_and_unknown_algorithms_never_do() {
        let mut u = UserRecord {
            name: "bob".into(),
            password_hash: rabbit_style_hash(SHA512, [9, 9, 9, 9], "pw"),
            hashing_algorithm: SHA512.into(),
            tags: vec![],
            limits: UserLimits::default(),
        };
        assert!(u.verify(b"pw"));
        u.hashing_algorithm = "rabbit_password_hashing_md5".into();
        assert!(!u.verify(b"pw"));
    }

    #[test]
    fn new_hashes_are_salted() {
        let a = UserRecord::new("a", "same", vec![]);
        let b = UserRecord::new("b", "same", vec![]);
        assert_ne!(a.password_hash, b.password_hash);
        assert!(a.verify(b"same") && b.verify(b"same"));
        // base64 of 4 salt bytes + 32 hash bytes.
        assert_eq!(BASE64.decode(&a.password_hash).unwrap().len(), 36);
    }

    #[test]
    fn limits_absent_or_negative_are_unlimited_and_zero_refuses_all() {
        assert_eq!(reached(None, 1_000_000), None);
        assert_eq!(reached(Some(-1), 1_000_000), None);
        assert_eq!(reached(Some(0), 0), Some(0));
        assert_eq!(reached(Some(2), 1), None);
        assert_eq!(reached(Some(2), 2), Some(2));
        let l: UserLimits = serde_json::from_str(r#"{"max-channels": 3}"#).unwrap();
        assert_eq!(l.max_channels, Some(3));
        assert_eq!(serde_json::to_string(&l).unwrap(), r#"{"max-channels":3}"#);
    }

    #[test]
    fn topic_pattern_variables_are_escaped_names() {
        assert_eq!(expand(r"^{username}\.", "a.b+c", "/"), r"^a\.b\+c\.");
        assert_eq!(expand("^{vhost}-x", "u", "v(1)"), r"^v\(1\)-x");
        let p = TopicPermissionRecord {
            user: "u".into(),
            vhost: "/".into(),
            exchange: "amq.topic".into(),
            write: "(".into(),
            read: ".*".into(),
        };
        assert!(matches!(p.validate(), Err(UserError::BadPattern(..))));
    }

    #[test]
    fn removing_a_user_removes_its_permissions() {
        let mut users = Users::default();
        users.put(UserRecord::new("u", "p", vec![]));
        for vhost in ["/", "v2"] {
            users.set_permission(PermissionRecord {
                user: "u".into(),
                vhost: vhost.into(),
                configure: ".*".into(),
                write: ".*".into(),
                read: ".*".into(),
            });
        }
        assert_eq!(users.remove("u").map(|k| k.len()), Some(2));
        assert!(users.permissions(None, None).is_empty());
    }
}
