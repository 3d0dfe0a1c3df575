//! The node: vhosts, users, id allocation, and the handshake's questions answered.

mod gatekeeper;
mod permissions;
mod users;
mod vhosts;

use permissions::full_permission;

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;
use warren_amqp::connection::{AccessError, Gatekeeper, Login};

use warren_store::{MetaTable, Op};

use crate::durable::Durable;
use crate::durable::OnCommit;
use crate::routing::vhost::VHost;
use crate::users::{PermissionRecord, TopicPermissionRecord, UserError, UserRecord};

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
    /// What a consumer timeout does to a quorum queue's consumer (RabbitMQ 4.3's
    /// `consumer_timeout_response`): cancel it and return its timed-out deliveries (the
    /// default), or close the channel as classic queues do.
    pub consumer_timeout_response: TimeoutResponse,
    /// Open connections the node accepts (RabbitMQ's `connection_max`; None is infinity).
    /// Checked at connection.open: 530 "node connection limit (N) is reached".
    pub connection_max: Option<u64>,
    /// Consumers one channel may hold (RabbitMQ's `consumer_max_per_channel`; None is
    /// infinity). A basic.consume over it closes the connection with 530.
    pub consumer_max_per_channel: Option<u64>,
    /// The user a fresh node creates, with the administrator tag and full permissions on
    /// "/" (RabbitMQ's `default_user` / `default_pass`; guest/guest by default). Used only
    /// when the store holds no users yet.
    pub default_user: (String, String),
    /// Users that may log in only from a loopback address (RabbitMQ's `loopback_users`).
    pub loopback_users: Vec<String>,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        Self {
            consumer_window: crate::limits::CONSUMER_WINDOW_DEFAULT,
            consumer_window_bytes: crate::limits::CONSUMER_WINDOW_BYTES_DEFAULT,
            consumer_timeout_ms: Some(crate::limits::CONSUMER_TIMEOUT_DEFAULT_MS),
            consumer_timeout_response: TimeoutResponse::NotifyConsumer,
            connection_max: None,
            consumer_max_per_channel: None,
            default_user: (
                crate::limits::DEFAULT_USER.to_string(),
                crate::limits::DEFAULT_PASS.to_string(),
            ),
            loopback_users: crate::limits::LOOPBACK_USERS
                .iter()
                .map(|u| (*u).to_string())
                .collect(),
        }
    }
}

/// What a consumer timeout does on a quorum queue (RabbitMQ 4.3's
/// `consumer_timeout_response`). Classic queues and `basic.get` deliveries always close the
/// channel (406).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TimeoutResponse {
    /// Send the client `basic.cancel` for the consumer and return its timed-out deliveries
    /// to the queue; the channel stays open and late acks of them are ignored. A client
    /// without the `consumer_cancel_notify` capability gets its channel closed instead.
    #[default]
    NotifyConsumer,
    /// Close the channel with 406, as before RabbitMQ 4.3.
    CloseChannel,
}

impl TimeoutResponse {
    /// The `consumer_timeout_response` value named `s` (`notify_consumer`, `close_channel`).
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "notify_consumer" => Some(Self::NotifyConsumer),
            "close_channel" => Some(Self::CloseChannel),
            _ => None,
        }
    }
}

/// One broker node.
#[derive(Debug)]
pub struct Broker {
    /// Settings.
    pub config: BrokerConfig,
    vhosts: RwLock<HashMap<String, Arc<VHost>>>,
    users: RwLock<crate::users::Users>,
    /// Where node-wide metadata (users, permissions) is persisted.
    store: Option<Arc<Durable>>,
    /// Bumped on every permission change; connections recompile their patterns when it moves.
    permission_generation: AtomicU64,
    /// The timer thread every vhost's queues share.
    timers: Arc<crate::timers::Timers>,
    /// Open connections per vhost and per user, open channels per user (limits).
    counts: parking_lot::Mutex<Counts>,
    next_id: AtomicU64,
    name_seed: std::collections::hash_map::RandomState,
    /// Memory and disk alarms; connections that publish are blocked while one is on.
    alarms: crate::node::alarms::ResourceAlarms,
    /// The next delayed slot ("/" has 0); persisted under [`DELAYED_SLOT_NEXT`].
    delayed_slot_next: std::sync::atomic::AtomicU32,
    /// Open connections (management API).
    connections: crate::node::connections::Connections,
    /// Message counters since start.
    stats: Arc<crate::stats::GlobalStats>,
    /// The cluster this node is in (set once at start-up; every vhost gets it).
    cluster: std::sync::OnceLock<Arc<dyn crate::routing::cluster::ClusterHooks>>,
    /// What the management layer lists for other nodes (set once when it starts).
    local_listings: std::sync::OnceLock<Arc<dyn crate::node::connections::LocalListings>>,
    /// Redrive tasks (moving messages out of dead-letter queues).
    redrives: crate::node::redrive::Redrives,
    /// Consumer groups of partitioned queues.
    groups: crate::node::groups::Groups,
}

impl Broker {
    /// The node's consumer groups.
    #[must_use]
    pub fn groups(&self) -> &crate::node::groups::Groups {
        &self.groups
    }

    /// The redrives this node runs.
    #[must_use]
    pub fn redrives(&self) -> &crate::node::redrive::Redrives {
        &self.redrives
    }

    /// Start a redrive in `spec.vhost` (see [`crate::node::redrive`]).
    ///
    /// # Errors
    /// What is wrong with `spec`; nothing started.
    pub fn start_redrive(
        &self,
        spec: crate::node::redrive::RedriveSpec,
        may_write: crate::node::redrive::MayWrite,
    ) -> Result<Arc<crate::node::redrive::RedriveTask>, crate::node::redrive::RedriveError> {
        self.redrives
            .start(self.vhost(&spec.vhost), spec, may_write)
    }

    /// The store's commit measurements (None for a node without a store).
    #[must_use]
    pub fn store_metrics(&self) -> Option<&warren_store::StoreMetrics> {
        self.store.as_deref().map(Durable::metrics)
    }

    /// The node's message counters and lifecycle totals.
    #[must_use]
    pub fn stats(&self) -> &crate::stats::GlobalStats {
        &self.stats
    }

    /// The node's open connections.
    #[must_use]
    pub fn connections(&self) -> &crate::node::connections::Connections {
        &self.connections
    }

    /// The node's resource alarms (memory high watermark, disk free limit).
    #[must_use]
    pub fn alarms(&self) -> &crate::node::alarms::ResourceAlarms {
        &self.alarms
    }

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
            users: RwLock::new(crate::users::Users::default()),
            store: store.clone(),
            permission_generation: AtomicU64::new(0),
            timers: crate::timers::Timers::start(),
            counts: parking_lot::Mutex::new(Counts::default()),
            next_id: AtomicU64::new(1),
            name_seed: std::collections::hash_map::RandomState::new(),
            alarms: crate::node::alarms::ResourceAlarms::default(),
            delayed_slot_next: std::sync::atomic::AtomicU32::new(1),
            connections: crate::node::connections::Connections::default(),
            stats: Arc::default(),
            cluster: std::sync::OnceLock::new(),
            local_listings: std::sync::OnceLock::new(),
            redrives: crate::node::redrive::Redrives::default(),
            groups: crate::node::groups::Groups::default(),
        };
        b.vhosts.write().insert(
            "/".into(),
            VHost::new(
                DEFAULT_VHOST,
                store,
                Some(Arc::clone(&b.timers)),
                Arc::clone(&b.stats),
            ),
        );
        let (user, pass) = &b.config.default_user;
        b.users.write().put(crate::users::UserRecord::new(
            user,
            pass,
            vec!["administrator".into()],
        ));
        b.users.write().set_permission(full_permission(user, "/"));
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

    /// Join a cluster: every vhost, now and later, creates quorum queues through it, and
    /// consumer ids from now on carry the node's number in their top bits (so they never
    /// collide with another node's, nor with this node's before a restart: the low bits
    /// start from the clock).
    pub fn set_cluster(&self, cluster: Arc<dyn crate::routing::cluster::ClusterHooks>) {
        let node = cluster.node_number();
        assert!(
            node > 0 && node < 1 << (64 - crate::queue::machine::CONSUMER_NODE_SHIFT),
            "node numbers fit the consumer id's top bits"
        );
        let boot_s = crate::timers::wall_ms() / 1000;
        let base = (node << crate::queue::machine::CONSUMER_NODE_SHIFT) | (boot_s << 24);
        self.next_id.fetch_max(base, Ordering::Relaxed);
        for vh in self.vhosts.read().values() {
            vh.set_cluster(Arc::clone(&cluster));
        }
        let _ = self.cluster.set(cluster);
    }

    /// The cluster this node is in.
    #[must_use]
    pub fn cluster(&self) -> Option<&Arc<dyn crate::routing::cluster::ClusterHooks>> {
        self.cluster.get()
    }

    /// Register what this node lists for other nodes' management API (the first call wins).
    pub fn set_local_listings(&self, l: Arc<dyn crate::node::connections::LocalListings>) {
        let _ = self.local_listings.set(l);
    }

    /// What this node lists for other nodes' management API (None before the management
    /// layer started, or on a node without one).
    #[must_use]
    pub fn local_listings(&self) -> Option<&Arc<dyn crate::node::connections::LocalListings>> {
        self.local_listings.get()
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

/// What limits count (taken only at connection and channel open and close).
#[derive(Debug, Default)]
struct Counts {
    /// Connections past connection.open on this node.
    node_connections: u64,
    vhost_connections: HashMap<String, i64>,
    user_connections: HashMap<String, i64>,
    user_channels: HashMap<String, i64>,
}

fn add(map: &mut HashMap<String, i64>, key: &str, by: i64) {
    let n = map.entry(key.to_string()).or_insert(0);
    *n += by;
    if *n <= 0 {
        map.remove(key);
    }
}

/// The vhost a fresh node has.
const DEFAULT_VHOST: &str = "/";

/// Key of the marker row saying the users table was initialised (an empty user name cannot
/// exist): a node whose operator deleted every user does not get guest back on restart.
const USERS_INITIALISED: &[u8] = b"";
/// Key in the vhosts table of the next delayed slot to hand out (not UTF-8, so no vhost name).
/// Slots only grow: a deleted vhost's slot is never reused, so records it left behind can
/// never be taken for another vhost's.
const DELAYED_SLOT_NEXT: &[u8] = b"\xffdelayed-slot-next";

/// Users and permissions, as `rabbitmqctl` manages them. Every change is persisted; `on_commit`
/// is asked for a completion when there is a store write to wait for.
impl Broker {
    /// The store this broker persists to (None: in memory only).
    pub(crate) fn durable(&self) -> Option<&Arc<Durable>> {
        self.store.as_ref()
    }

    fn submit_meta(&self, ops: Vec<Op>, on_commit: OnCommit<'_>) {
        if let Some(store) = &self.store {
            store.submit_meta(ops, on_commit);
        }
    }

    /// In a cluster, send a definition change made here to the other nodes (unless it came
    /// from them); the caller's reply waits for its commit too.
    fn replicate_definition(
        &self,
        on_commit: OnCommit<'_>,
        change: impl FnOnce() -> crate::routing::cluster::DefinitionChange,
    ) {
        if let Some(cluster) = self.cluster()
            && !crate::routing::cluster::applying()
        {
            cluster.replicate_topology(
                crate::routing::cluster::TopologyChange::Definition(change()),
                on_commit(),
            );
        }
    }

    /// Remove the directories in `dir` (`<data-dir>/streams`) that belong to no recovered
    /// stream: left by a deletion a crash interrupted, or by a declare whose record never
    /// committed. Queue ids are reused after a restart, so a new stream must never open them.
    /// Returns how many went.
    pub fn sweep_stream_dirs(&self, dir: &std::path::Path) -> usize {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return 0;
        };
        let vhosts: Vec<Arc<VHost>> = self.vhosts.read().values().cloned().collect();
        let kept: std::collections::HashSet<u64> = vhosts
            .iter()
            .flat_map(|vh| vh.queues())
            .filter(|q| q.is_stream)
            .map(|q| q.id)
            .collect();
        let mut removed = 0;
        for e in entries.flatten() {
            let id = e.file_name().to_str().and_then(|n| n.parse::<u64>().ok());
            if id.is_some_and(|id| !kept.contains(&id)) {
                match std::fs::remove_dir_all(e.path()) {
                    Ok(()) => removed += 1,
                    Err(err) => {
                        tracing::warn!(dir = %e.path().display(), error = %err, "an orphaned stream directory was not removed")
                    }
                }
            }
        }
        removed
    }

    /// Save every stream's tracked offsets that changed (at shutdown: a restart resumes
    /// named consumers exactly where they acked).
    pub fn save_stream_offsets(&self) {
        let vhosts: Vec<Arc<VHost>> = self.vhosts.read().values().cloned().collect();
        for vh in vhosts {
            for q in vh.queues() {
                if let Some(stream) = q.stream() {
                    stream.save_offsets();
                }
            }
        }
    }

    /// Put back the vhosts the store lists (before anything that lives in them); on a fresh
    /// store, persist the default one.
    pub(crate) fn restore_vhosts(&self, rows: &[(Vec<u8>, Vec<u8>)]) -> usize {
        if rows.is_empty() {
            self.submit_meta(
                vec![
                    Op::Put {
                        table: MetaTable::Vhosts,
                        key: USERS_INITIALISED.to_vec(),
                        value: b"initialised".to_vec(),
                    },
                    Op::Put {
                        table: MetaTable::Vhosts,
                        key: DEFAULT_VHOST.as_bytes().to_vec(),
                        value: Vec::new(),
                    },
                ],
                &mut || Box::new(|_| {}),
            );
            return 0;
        }
        let stored_next = rows
            .iter()
            .find(|(k, _)| k.as_slice() == DELAYED_SLOT_NEXT)
            .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse::<u32>().ok())
            .unwrap_or(1);
        let listed: Vec<(String, crate::users::VhostRecord)> = rows
            .iter()
            .filter(|(k, _)| k.as_slice() != USERS_INITIALISED && k.as_slice() != DELAYED_SLOT_NEXT)
            .filter_map(|(k, v)| {
                let name = String::from_utf8(k.clone()).ok()?;
                // A fresh store writes the default vhost with an empty record: its defaults.
                let record = if v.is_empty() {
                    crate::users::VhostRecord::default()
                } else {
                    serde_json::from_slice(v).unwrap_or_else(|_| {
                        tracing::warn!(vhost = %name, "unreadable vhost record; its limits and metadata are reset");
                        crate::users::VhostRecord::default()
                    })
                };
                Some((name, record))
            })
            .collect();
        let live_max = listed
            .iter()
            .map(|(_, r)| r.delayed_slot)
            .max()
            .unwrap_or(0);
        self.delayed_slot_next.store(
            stored_next.max(live_max.saturating_add(1)).max(1),
            Ordering::Release,
        );
        let mut vhosts = self.vhosts.write();
        vhosts.retain(|name, _| listed.iter().any(|(n, _)| n == name));
        let mut unslotted = Vec::new();
        for (name, record) in &listed {
            let vh = vhosts.entry(name.clone()).or_insert_with(|| {
                VHost::new(
                    name,
                    self.store.clone(),
                    Some(Arc::clone(&self.timers)),
                    Arc::clone(&self.stats),
                )
            });
            if let Some(c) = self.cluster.get() {
                vh.set_cluster(Arc::clone(c));
            }
            *vh.limits.write() = record.limits.clone();
            *vh.default_queue_type.write() = record.default_queue_type.clone();
            vh.delayed.set_slot(record.delayed_slot);
            if record.delayed_slot == 0 && name != DEFAULT_VHOST {
                unslotted.push(Arc::clone(vh));
            }
        }
        // Records written before vhosts had delayed slots (such a vhost had no delayed
        // messages: they were refused outside "/").
        for vh in unslotted {
            let slot_op = self.take_delayed_slot(&vh);
            self.submit_meta(vec![slot_op, Self::vhost_put_op(&vh)], &mut || {
                Box::new(|_| {})
            });
        }
        listed.len()
    }

    /// Put back the users and permissions the store held; on a fresh store, persist the
    /// default user instead. Returns how many users were restored.
    pub(crate) fn restore_users(
        &self,
        users: &[(Vec<u8>, Vec<u8>)],
        permissions: &[(Vec<u8>, Vec<u8>)],
        topic_permissions: &[(Vec<u8>, Vec<u8>)],
    ) -> Result<usize, crate::durable::DecodeError> {
        if users.is_empty() {
            let (user, perm) = {
                let u = self.users.read();
                let name = &self.config.default_user.0;
                (u.get(name).cloned(), u.permission("/", name).cloned())
            };
            let mut ops = vec![Op::Put {
                table: MetaTable::Users,
                key: USERS_INITIALISED.to_vec(),
                value: b"initialised".to_vec(),
            }];
            ops.extend(user.as_ref().map(Self::put_user_op));
            ops.extend(perm.as_ref().map(Self::put_permission_op));
            self.submit_meta(ops, &mut || Box::new(|_| {}));
            return Ok(0);
        }
        let mut fresh = crate::users::Users::default();
        let mut n = 0;
        for (k, v) in users {
            if k.as_slice() == USERS_INITIALISED {
                continue;
            }
            let u: UserRecord = serde_json::from_slice(v)
                .map_err(|_| crate::durable::DecodeError::new("user", "bad JSON"))?;
            fresh.put(u);
            n += 1;
        }
        for (_, v) in permissions {
            let p: PermissionRecord = serde_json::from_slice(v)
                .map_err(|_| crate::durable::DecodeError::new("permission", "bad JSON"))?;
            fresh.set_permission(p);
        }
        for (_, v) in topic_permissions {
            let p: TopicPermissionRecord = serde_json::from_slice(v)
                .map_err(|_| crate::durable::DecodeError::new("topic permission", "bad JSON"))?;
            fresh.set_topic_permission(p);
        }
        *self.users.write() = fresh;
        self.permissions_changed();
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Directories under `streams/` that no recovered stream owns go at start (a crash in a
    /// deletion, a declare whose record never committed); others stay.
    #[test]
    fn start_up_removes_stream_directories_no_stream_owns() {
        let dir = tempfile::tempdir().expect("tempdir");
        for name in ["7", "12", "notes"] {
            std::fs::create_dir(dir.path().join(name)).expect("mkdir");
        }
        let b = Broker::new(BrokerConfig::default());
        let vh = b.vhost(DEFAULT_VHOST).expect("default vhost");
        let args = crate::args::table(&[(
            "x-queue-type",
            amq_protocol::types::AMQPValue::LongString("stream".into()),
        )]);
        vh.restore_queue(crate::queue::Queue::new(
            12,
            "kept",
            DEFAULT_VHOST,
            true,
            false,
            None,
            args,
            crate::queue::QueueEnv::default(),
        ));
        assert_eq!(b.sweep_stream_dirs(dir.path()), 1);
        assert!(!dir.path().join("7").exists());
        assert!(dir.path().join("12").exists());
        assert!(
            dir.path().join("notes").exists(),
            "not a stream's: left alone"
        );
    }

    #[test]
    fn external_login_needs_an_existing_user_and_keeps_the_loopback_rule() {
        let b = Broker::new(BrokerConfig::default());
        assert!(b.login_external("guest", true).is_ok());
        assert_eq!(
            b.login_external("guest", false),
            Err(AccessError::LoginRefused),
            "a certificate naming guest does not lift loopback_users"
        );
        assert_eq!(
            b.login_external("CN=nobody", true),
            Err(AccessError::LoginRefused)
        );
    }

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
