//! Server configuration: defaults, an optional TOML file (`--config`), then command-line flags.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;

pub(crate) mod types;

use types::{ClusterConfig, FileConfig, parse_peers};
pub use types::{LogFormat, size};

/// `warren server` flags. Each overrides the config file, which overrides the defaults.
#[derive(Debug, clap::Args)]
pub struct ServerArgs {
    /// TOML file with any of: amqp_listen, amqps_listen, data_dir, log_level, heartbeat_s,
    /// frame_max, channel_max, message_size_max, store_segment_bytes, tls_cert, tls_key, tls_ca,
    /// tls_fail_if_no_peer_cert, ssl_cert_login_from, vm_memory_high_watermark,
    /// vm_memory_high_watermark_absolute, disk_free_limit, disk_free_limit_mem_relative,
    /// connection_max, consumer_max_per_channel, consumer_timeout, consumer_timeout_response,
    /// management_listen, prometheus_listen,
    /// log_format, product_name, product_version, default_user, default_pass, loopback_users,
    /// auth_mechanisms;
    /// or RabbitMQ's rabbitmq.conf (a `.conf` file, or one with dotted keys), of which the
    /// keys Warren has are taken and the others reported at start.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Address for AMQP 0-9-1 clients [default: 0.0.0.0:5672].
    #[arg(long)]
    pub amqp_listen: Option<SocketAddr>,
    /// Address for AMQP 0-9-1 over TLS; used only when a certificate is configured
    /// [default: 0.0.0.0:5671].
    #[arg(long)]
    pub amqps_listen: Option<SocketAddr>,
    /// Server certificate chain (PEM); enables the AMQPS listener.
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    /// Server private key (PEM).
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
    /// CA certificates (PEM) that client certificates are verified against; clients are asked
    /// for a certificate only when this is set.
    #[arg(long)]
    pub tls_ca: Option<PathBuf>,
    /// Refuse TLS clients that present no certificate (needs --tls-ca).
    #[arg(long)]
    pub tls_fail_if_no_peer_cert: bool,
    /// SASL mechanisms offered, in order, comma-separated (RabbitMQ's auth_mechanisms)
    /// [default: PLAIN,AMQPLAIN]. EXTERNAL (TLS client certificates) must be listed to be
    /// offered, as with RabbitMQ's rabbitmq_auth_mechanism_ssl.
    #[arg(long, value_delimiter = ',')]
    pub auth_mechanisms: Option<Vec<String>>,
    /// Where SASL EXTERNAL reads the user name from [default: distinguished-name].
    #[arg(long, value_enum)]
    pub ssl_cert_login_from: Option<crate::tls::CertLogin>,
    /// Memory high watermark as a fraction of RAM (or of the cgroup limit) [default: 0.6].
    #[arg(long)]
    pub vm_memory_high_watermark: Option<f64>,
    /// Memory high watermark as a size ("2GB", "512MiB", bytes); overrides the fraction.
    #[arg(long)]
    pub vm_memory_high_watermark_absolute: Option<String>,
    /// Free disk space under the data directory below which publishers are blocked
    /// ("50MB", "1GiB", bytes) [default: 50MB].
    #[arg(long)]
    pub disk_free_limit: Option<String>,
    /// Address of the management HTTP API, or `off` [default: 0.0.0.0:15672].
    #[arg(long)]
    pub management_listen: Option<String>,
    /// Address of the Prometheus endpoint (/metrics), or `off` [default: 0.0.0.0:15692].
    #[arg(long)]
    pub prometheus_listen: Option<String>,
    /// Directory for node data [default: ./warren-data].
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Log filter: error, warn, info, debug, trace, or a tracing filter [default: info].
    #[arg(long)]
    pub log_level: Option<String>,
    /// Log format: text or json (one object per line) [default: text].
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,
    /// Size at which the store starts a new message segment file [default: 64 MiB].
    #[arg(long)]
    pub store_segment_bytes: Option<u64>,
    /// This node's name in its cluster (one of --peers).
    #[arg(long)]
    pub node_name: Option<String>,
    /// Address of the inter-node (Raft) port [default: 0.0.0.0:25672].
    #[arg(long)]
    pub cluster_listen: Option<SocketAddr>,
    /// Every node of the cluster, this one included: `name@host:port,...` (their cluster
    /// ports). Without it the node runs alone.
    #[arg(long)]
    pub peers: Option<String>,
    /// The cluster's shared secret (also WARREN_CLUSTER_SECRET); the same on every node.
    #[arg(long, env = "WARREN_CLUSTER_SECRET", hide_env_values = true)]
    pub cluster_secret: Option<String>,
    /// Join the running cluster that --peers names (seeds: some of its nodes, and this node
    /// for its own address) instead of founding one with them.
    #[arg(long)]
    pub join: bool,
    /// TLS on the cluster port: this node's certificate chain (PEM). With
    /// --cluster-tls-key and --cluster-tls-ca, every inter-node connection is TLS both ways.
    #[arg(long)]
    pub cluster_tls_cert: Option<PathBuf>,
    /// This node's private key for the cluster port (PEM).
    #[arg(long)]
    pub cluster_tls_key: Option<PathBuf>,
    /// The CA that signs every node's cluster certificate (PEM).
    #[arg(long)]
    pub cluster_tls_ca: Option<PathBuf>,
    /// Entries a quorum queue's log keeps at most before its snapshot for its oldest live
    /// message; older live bodies are copied out and the log purged [default: 50000].
    #[arg(long)]
    pub quorum_log_pin_max: Option<u64>,
    /// Where this node keeps its quorum queues' Raft logs: `redb` (one database) or `wal`
    /// (the segmented write-ahead log) [default: redb].
    #[arg(long)]
    pub quorum_log: Option<String>,
}

/// Effective configuration.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub amqp_listen: SocketAddr,
    /// The AMQPS listener and its TLS settings, when a certificate is configured.
    pub amqps: Option<(SocketAddr, crate::tls::TlsOptions)>,
    pub data_dir: PathBuf,
    pub log_level: String,
    pub limits: warren_amqp::limits::ConnectionLimits,
    pub store: warren_store::Options,
    /// Resource alarm limits.
    pub watermarks: warren_broker::node::alarms::Watermarks,
    /// Node-wide connection limit (None: infinity, RabbitMQ's default).
    pub connection_max: Option<u64>,
    /// Consumers per channel (None: infinity, RabbitMQ's default).
    pub consumer_max_per_channel: Option<u64>,
    /// A delivery's ack timeout, ms (None: the broker's default, 30 minutes; 0: off).
    pub consumer_timeout: Option<u64>,
    /// What a consumer timeout does to a quorum queue's consumer.
    pub consumer_timeout_response: warren_broker::node::broker::TimeoutResponse,
    /// The management HTTP API's address (None: off).
    pub management_listen: Option<SocketAddr>,
    /// The Prometheus endpoint's address (None: off).
    pub prometheus_listen: Option<SocketAddr>,
    /// How log lines are written.
    pub log_format: LogFormat,
    /// The cluster this node joins (None: it runs alone).
    pub cluster: Option<ClusterConfig>,
    /// A node running alone with a cluster identity (`--node-name`, `--cluster-secret`,
    /// `--cluster-listen`) that `warren ctl join_cluster` can make join a cluster (its
    /// `peers` are empty).
    pub standalone: Option<ClusterConfig>,
    /// The product and version advertised to clients (connection.start, `/api/overview`):
    /// RabbitMQ's by default, as RabbitMQ's `product.name` / `product.version` settings.
    pub identity: warren_amqp::connection::ServerIdentity,
    /// SASL mechanisms offered, in order.
    pub mechanisms: Vec<warren_amqp::connection::Mechanism>,
    /// The user a fresh node creates (name, password).
    pub default_user: (String, String),
    /// Users that may log in from loopback addresses only.
    pub loopback_users: Vec<String>,
    /// Keys of a `rabbitmq.conf` given as `--config` that Warren has no setting for.
    pub ignored_keys: Vec<String>,
}

/// Smallest segment size accepted (smaller only multiplies files).
const STORE_SEGMENT_MIN: u64 = 64 * 1024;

/// Largest message size RabbitMQ allows to be configured (512 MiB).
const MESSAGE_SIZE_MAX_CAP: u64 = 512 * 1024 * 1024;

impl ServerConfig {
    /// Merge defaults, the file and the flags; refuse values outside the protocol's bounds.
    pub fn load(args: ServerArgs) -> anyhow::Result<Self> {
        let mut ignored_keys = Vec::new();
        let file: FileConfig = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                // Warren's TOML first: a rabbitmq.conf never parses as it (unknown keys are
                // refused), and a Warren file must never be half-read as a rabbitmq.conf.
                match toml::from_str::<FileConfig>(&text) {
                    Ok(file) => file,
                    Err(_) if crate::rabbitmq_conf::looks_like(path, &text) => {
                        let parsed = crate::rabbitmq_conf::parse(&text)
                            .with_context(|| format!("parsing {}", path.display()))?;
                        ignored_keys = parsed.ignored;
                        parsed.file
                    }
                    Err(e) => {
                        return Err(e).with_context(|| format!("parsing {}", path.display()));
                    }
                }
            }
            None => FileConfig::default(),
        };
        let mut limits = warren_amqp::limits::ConnectionLimits::default();
        if let Some(v) = file.heartbeat_s {
            limits.heartbeat_s = v;
        }
        if let Some(v) = file.frame_max {
            anyhow::ensure!(
                v >= warren_amqp::limits::FRAME_MIN_SIZE,
                "frame_max must be at least 4096"
            );
            limits.frame_max = v;
        }
        if let Some(v) = file.channel_max {
            anyhow::ensure!(v >= 1, "channel_max must be at least 1");
            limits.channel_max = v;
        }
        if let Some(v) = file.message_size_max {
            anyhow::ensure!(
                v <= MESSAGE_SIZE_MAX_CAP,
                "message_size_max must be at most 512 MiB"
            );
            limits.message_size_max = v;
        }
        let watermarks = watermarks(&args, &file)?;
        let tls_key = args.tls_key.or(file.tls_key);
        let amqps = match args.tls_cert.or(file.tls_cert) {
            Some(cert) => {
                let key = tls_key.context("tls_cert needs tls_key")?;
                let listen = args
                    .amqps_listen
                    .or(file.amqps_listen)
                    .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 5671)));
                Some((
                    listen,
                    crate::tls::TlsOptions {
                        cert,
                        key,
                        ca: args.tls_ca.or(file.tls_ca),
                        fail_if_no_peer_cert: args.tls_fail_if_no_peer_cert
                            || file.tls_fail_if_no_peer_cert.unwrap_or(false),
                        login_from: args
                            .ssl_cert_login_from
                            .or(file.ssl_cert_login_from)
                            .unwrap_or(crate::tls::CertLogin::DistinguishedName),
                    },
                ))
            }
            None => {
                anyhow::ensure!(tls_key.is_none(), "tls_key needs tls_cert");
                None
            }
        };
        let management_listen = listen(
            "management_listen",
            args.management_listen
                .as_ref()
                .or(file.management_listen.as_ref()),
            15672,
        )?;
        let prometheus_listen = listen(
            "prometheus_listen",
            args.prometheus_listen
                .as_ref()
                .or(file.prometheus_listen.as_ref()),
            15692,
        )?;
        let data_dir = args
            .data_dir
            .clone()
            .or(file.data_dir.clone())
            .unwrap_or_else(|| PathBuf::from("./warren-data"));
        // A node that `warren ctl join_cluster` joined keeps its seeds in its data directory.
        let joined = crate::join::read_seeds(&data_dir)?;
        let peers = args.peers.or(file.peers);
        let joining = peers.is_none() && joined.is_some();
        let identity = match args.node_name.or(file.node_name) {
            None => None,
            Some(node_name) => Some(ClusterConfig {
                node_name,
                listen: args
                    .cluster_listen
                    .or(file.cluster_listen)
                    .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 25672))),
                peers: Vec::new(),
                secret: args
                    .cluster_secret
                    .or(file.cluster_secret)
                    .filter(|s| !s.is_empty())
                    .unwrap_or_default(),
                join: args.join || file.join.unwrap_or(false) || joining,
                log_pin_max: args
                    .quorum_log_pin_max
                    .or(file.quorum_log_pin_max)
                    .unwrap_or(warren_cluster::node::QUEUE_LOG_PIN_MAX),
                quorum_log: match args.quorum_log.or(file.quorum_log) {
                    Some(kind) => kind.parse().map_err(anyhow::Error::msg)?,
                    None => warren_cluster::node::QueueLogKind::default(),
                },
                tls: match (
                    args.cluster_tls_cert.or(file.cluster_tls_cert),
                    args.cluster_tls_key.or(file.cluster_tls_key),
                    args.cluster_tls_ca.or(file.cluster_tls_ca),
                ) {
                    (None, None, None) => None,
                    (Some(cert), Some(key), Some(ca)) => {
                        Some(crate::tls::ClusterTlsFiles { cert, key, ca })
                    }
                    _ => anyhow::bail!(
                        "cluster TLS needs all of --cluster-tls-cert, --cluster-tls-key \
                         and --cluster-tls-ca"
                    ),
                },
            }),
        };
        let (cluster, standalone) = match peers.or(joined) {
            None => (None, identity.filter(|c| !c.secret.is_empty())),
            Some(list) => {
                let peers = parse_peers(&list)?;
                let mut c = identity.context("--peers needs --node-name")?;
                anyhow::ensure!(
                    peers.iter().any(|p| p.name == c.node_name),
                    "--peers must name this node ({})",
                    c.node_name
                );
                anyhow::ensure!(
                    !c.secret.is_empty(),
                    "a cluster needs --cluster-secret (or WARREN_CLUSTER_SECRET)"
                );
                c.peers = peers;
                (Some(c), None)
            }
        };
        let mut identity = warren_amqp::connection::ServerIdentity::default();
        if let Some(v) = file.product_name.filter(|v| !v.is_empty()) {
            identity.product = v;
        }
        if let Some(v) = file.product_version.filter(|v| !v.is_empty()) {
            identity.version = v;
        }
        let default_user = (
            file.default_user
                .clone()
                .unwrap_or_else(|| warren_broker::limits::DEFAULT_USER.to_string()),
            file.default_pass
                .clone()
                .unwrap_or_else(|| warren_broker::limits::DEFAULT_PASS.to_string()),
        );
        anyhow::ensure!(!default_user.0.is_empty(), "default_user must not be empty");
        let loopback_users = file.loopback_users.clone().unwrap_or_else(|| {
            warren_broker::limits::LOOPBACK_USERS
                .iter()
                .map(|u| (*u).to_string())
                .collect()
        });
        let mechanisms = args
            .auth_mechanisms
            .clone()
            .or_else(|| file.auth_mechanisms.clone())
            .map(|names| {
                names
                    .iter()
                    .map(|n| {
                        warren_amqp::connection::Mechanism::from_name(n.trim()).with_context(
                            || format!("auth_mechanisms: unknown mechanism {n:?} (PLAIN, AMQPLAIN, EXTERNAL)"),
                        )
                    })
                    .collect::<anyhow::Result<Vec<_>>>()
            })
            .transpose()?
            .unwrap_or_else(|| warren_amqp::connection::Mechanism::DEFAULT.to_vec());
        anyhow::ensure!(!mechanisms.is_empty(), "auth_mechanisms must not be empty");
        Ok(Self {
            identity,
            mechanisms,
            default_user,
            loopback_users,
            ignored_keys,
            cluster,
            standalone,
            log_format: args.log_format.or(file.log_format).unwrap_or_default(),
            management_listen,
            prometheus_listen,
            watermarks,
            connection_max: file.connection_max,
            consumer_max_per_channel: file.consumer_max_per_channel,
            consumer_timeout: file.consumer_timeout,
            consumer_timeout_response: match file.consumer_timeout_response.as_deref() {
                None => warren_broker::node::broker::TimeoutResponse::default(),
                Some(s) => {
                    warren_broker::node::broker::TimeoutResponse::parse(s).ok_or_else(|| {
                        anyhow::anyhow!(
                            "consumer_timeout_response: notify_consumer or close_channel, not {s}"
                        )
                    })?
                }
            },
            amqps,
            amqp_listen: args
                .amqp_listen
                .or(file.amqp_listen)
                .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 5672))),
            data_dir,
            log_level: args
                .log_level
                .or(file.log_level)
                .unwrap_or_else(|| "info".to_string()),
            limits,
            store: warren_store::Options {
                db_cache: warren_store::DB_CACHE_DEFAULT,
                checkpoint_interval: warren_store::index_log::CHECKPOINT_INTERVAL,
                segment_max: match args.store_segment_bytes.or(file.store_segment_bytes) {
                    Some(v) => {
                        anyhow::ensure!(
                            v >= STORE_SEGMENT_MIN,
                            "store_segment_bytes must be at least 65536"
                        );
                        v
                    }
                    None => warren_store::SEGMENT_MAX_DEFAULT,
                },
            },
        })
    }
}

/// An optional listener: an address, `off`, or the default port on all interfaces.
fn listen(
    key: &str,
    value: Option<&String>,
    default_port: u16,
) -> anyhow::Result<Option<SocketAddr>> {
    match value.map(String::as_str) {
        None => Ok(Some(SocketAddr::from(([0, 0, 0, 0], default_port)))),
        Some("off") => Ok(None),
        Some(v) => v
            .parse()
            .map(Some)
            .with_context(|| format!("{key}: {v:?} is neither an address nor off")),
    }
}

/// The alarm limits from flags and the file; absolute forms win over relative ones.
fn watermarks(
    args: &ServerArgs,
    file: &FileConfig,
) -> anyhow::Result<warren_broker::node::alarms::Watermarks> {
    use warren_broker::node::alarms::{DiskFreeLimit, MemoryWatermark, Watermarks};
    let mut w = Watermarks::default();
    if let Some(f) = args
        .vm_memory_high_watermark
        .or(file.vm_memory_high_watermark)
    {
        anyhow::ensure!(
            (0.0..=1.0).contains(&f),
            "vm_memory_high_watermark must be between 0 and 1"
        );
        w.memory = MemoryWatermark::Relative(f);
    }
    if let Some(t) = args
        .vm_memory_high_watermark_absolute
        .as_ref()
        .or(file.vm_memory_high_watermark_absolute.as_ref())
    {
        w.memory = MemoryWatermark::Absolute(size("vm_memory_high_watermark_absolute", t)?);
    }
    if let Some(f) = file.disk_free_limit_mem_relative {
        anyhow::ensure!(
            f >= 0.0,
            "disk_free_limit_mem_relative must not be negative"
        );
        w.disk_free = DiskFreeLimit::MemRelative(f);
    }
    if let Some(t) = args
        .disk_free_limit
        .as_ref()
        .or(file.disk_free_limit.as_ref())
    {
        w.disk_free = DiskFreeLimit::Absolute(size("disk_free_limit", t)?);
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

    use super::*;

    fn args(config: Option<PathBuf>) -> ServerArgs {
        ServerArgs {
            config,
            amqp_listen: None,
            amqps_listen: None,
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            tls_fail_if_no_peer_cert: false,
            ssl_cert_login_from: None,
            auth_mechanisms: None,
            vm_memory_high_watermark: None,
            vm_memory_high_watermark_absolute: None,
            disk_free_limit: None,
            management_listen: None,
            prometheus_listen: None,
            log_format: None,
            data_dir: None,
            log_level: None,
            store_segment_bytes: None,
            node_name: None,
            cluster_listen: None,
            peers: None,
            cluster_secret: None,
            cluster_tls_cert: None,
            cluster_tls_key: None,
            cluster_tls_ca: None,
            join: false,
            quorum_log_pin_max: None,
            quorum_log: None,
        }
    }

    fn file(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    /// Cluster flags: `--peers` makes a cluster node on 25672 by default; the peer list must
    /// parse and name this node, and a secret is required.
    #[test]
    fn cluster_flags_are_checked() {
        let with = |peers: &str, name: Option<&str>, secret: Option<&str>| {
            let mut a = args(None);
            a.peers = Some(peers.into());
            a.node_name = name.map(str::to_string);
            a.cluster_secret = secret.map(str::to_string);
            ServerConfig::load(a)
        };
        let ok = "n1@127.0.0.1:25001, n2@127.0.0.1:25002,n3@127.0.0.1:25003";
        let c = with(ok, Some("n2"), Some("s")).unwrap();
        let cluster = c.cluster.unwrap();
        assert_eq!(cluster.listen, SocketAddr::from(([0, 0, 0, 0], 25672)));
        assert_eq!(cluster.peers.len(), 3);
        assert_eq!(cluster.peers[1].addr, "127.0.0.1:25002");
        assert!(args_cluster_none());
        // Peers by DNS name, as a Kubernetes StatefulSet's headless service gives them.
        let dns = "n1@warren-0.warren.default.svc.cluster.local:25672,n2@localhost:25672";
        let c = with(dns, Some("n2"), Some("s")).unwrap();
        let peers = c.cluster.unwrap().peers;
        assert_eq!(
            peers[0].addr,
            "warren-0.warren.default.svc.cluster.local:25672"
        );
        assert_eq!(peers[1].addr, "localhost:25672");
        for (peers, name, secret, why) in [
            (ok, Some("n9"), Some("s"), "must name this node"),
            (ok, None, Some("s"), "needs --node-name"),
            (ok, Some("n1"), None, "needs --cluster-secret"),
            (ok, Some("n1"), Some(""), "needs --cluster-secret"),
            (
                "n1@localhost",
                Some("n1"),
                Some("s"),
                "is not name@host:port",
            ),
            (
                "n1@localhost:0",
                Some("n1"),
                Some("s"),
                "is not name@host:port",
            ),
            ("n1@:25672", Some("n1"), Some("s"), "is not name@host:port"),
            (
                "n1@bad_host:25672",
                Some("n1"),
                Some("s"),
                "is not name@host:port",
            ),
            ("n1@h:port", Some("n1"), Some("s"), "is not name@host:port"),
            ("n1", Some("n1"), Some("s"), "is not name@host:port"),
        ] {
            let e = with(peers, name, secret).unwrap_err().to_string();
            assert!(e.contains(why), "{peers} {name:?}: {e}");
        }
        // Cluster TLS takes all three files or none.
        let mut a = args(None);
        a.peers = Some(ok.into());
        a.node_name = Some("n1".into());
        a.cluster_secret = Some("s".into());
        a.cluster_tls_cert = Some("node.pem".into());
        let e = ServerConfig::load(a).unwrap_err().to_string();
        assert!(e.contains("needs all of --cluster-tls-cert"), "{e}");
    }

    /// `--quorum-log` picks the quorum queues' log: the WAL by default, redb by name, and
    /// anything else is refused with the choices.
    #[test]
    fn the_quorum_log_is_redb_or_wal() {
        let with = |kind: Option<&str>| {
            let mut a = args(None);
            a.peers = Some("n1@127.0.0.1:25001".into());
            a.node_name = Some("n1".into());
            a.cluster_secret = Some("s".into());
            a.quorum_log = kind.map(str::to_string);
            ServerConfig::load(a).map(|c| c.cluster.map(|c| c.quorum_log))
        };
        use warren_cluster::node::QueueLogKind;
        assert_eq!(with(None).unwrap(), Some(QueueLogKind::Wal));
        assert_eq!(with(Some("wal")).unwrap(), Some(QueueLogKind::Wal));
        assert_eq!(with(Some("redb")).unwrap(), Some(QueueLogKind::Redb));
        let e = with(Some("rocks")).unwrap_err().to_string();
        assert!(e.contains("expected \"redb\" or \"wal\""), "{e}");
    }

    /// A node with a cluster identity and no --peers runs alone but can join
    /// (`standalone`); once `join_cluster` recorded seeds in its data directory it starts as
    /// a joining cluster node with the same flags.
    #[test]
    fn recorded_seeds_make_a_lone_node_a_joining_member() {
        let dir = tempfile::tempdir().unwrap();
        let lone = || {
            let mut a = args(None);
            a.data_dir = Some(dir.path().to_path_buf());
            a.node_name = Some("n4".into());
            a.cluster_listen = Some(SocketAddr::from(([127, 0, 0, 1], 25004)));
            a.cluster_secret = Some("s".into());
            ServerConfig::load(a)
        };
        let c = lone().unwrap();
        assert!(c.cluster.is_none());
        assert_eq!(c.standalone.unwrap().node_name, "n4");
        std::fs::create_dir_all(dir.path().join("cluster")).unwrap();
        std::fs::write(
            dir.path().join(crate::join::SEEDS_FILE),
            "n4@127.0.0.1:25004,n1@127.0.0.1:25001\n",
        )
        .unwrap();
        let c = lone().unwrap();
        assert!(c.standalone.is_none());
        let cluster = c.cluster.unwrap();
        assert!(cluster.join);
        assert_eq!(cluster.peers.len(), 2);
        assert_eq!(cluster.peers[1].name, "n1");
        // Without its secret it does not start at all.
        let mut a = args(None);
        a.data_dir = Some(dir.path().to_path_buf());
        a.node_name = Some("n4".into());
        let e = ServerConfig::load(a).unwrap_err().to_string();
        assert!(e.contains("needs --cluster-secret"), "{e}");
    }

    fn args_cluster_none() -> bool {
        ServerConfig::load(args(None)).unwrap().cluster.is_none()
    }

    #[test]
    fn defaults_without_a_file() {
        let c = ServerConfig::load(args(None)).unwrap();
        assert_eq!(c.amqp_listen, SocketAddr::from(([0, 0, 0, 0], 5672)));
        assert_eq!(c.data_dir, PathBuf::from("./warren-data"));
        assert_eq!(c.log_level, "info");
        assert_eq!(
            c.limits,
            warren_amqp::limits::ConnectionLimits::default(),
            "protocol limits keep their defaults"
        );
        assert_eq!(c.store.segment_max, warren_store::SEGMENT_MAX_DEFAULT);
        assert!(c.amqps.is_none(), "no certificate, no AMQPS listener");
        assert_eq!(
            c.watermarks,
            warren_broker::node::alarms::Watermarks::default()
        );
        assert_eq!((c.connection_max, c.consumer_max_per_channel), (None, None));
        assert_eq!(c.log_format, LogFormat::Text);
        assert_eq!(
            c.management_listen,
            Some(SocketAddr::from(([0, 0, 0, 0], 15672)))
        );
        assert_eq!(
            c.prometheus_listen,
            Some(SocketAddr::from(([0, 0, 0, 0], 15692)))
        );
        let mut off = args(None);
        off.management_listen = Some("off".into());
        off.prometheus_listen = Some("127.0.0.1:9999".into());
        let c = ServerConfig::load(off).unwrap();
        assert_eq!(c.management_listen, None);
        assert_eq!(
            c.prometheus_listen,
            Some(SocketAddr::from(([127, 0, 0, 1], 9999)))
        );
    }

    #[test]
    fn alarm_limits_from_the_file_and_flags() {
        use warren_broker::node::alarms::{DiskFreeLimit, MemoryWatermark};
        let f = file("vm_memory_high_watermark = 0.5\ndisk_free_limit = \"2GB\"\n");
        let c = ServerConfig::load(args(Some(f.path().into()))).unwrap();
        assert_eq!(c.watermarks.memory, MemoryWatermark::Relative(0.5));
        assert_eq!(
            c.watermarks.disk_free,
            DiskFreeLimit::Absolute(2_000_000_000)
        );
        let mut a = args(Some(f.path().into()));
        a.vm_memory_high_watermark_absolute = Some("256MiB".into());
        let c = ServerConfig::load(a).unwrap();
        assert_eq!(c.watermarks.memory, MemoryWatermark::Absolute(256 << 20));
        let f = file("disk_free_limit_mem_relative = 1.5\n");
        let c = ServerConfig::load(args(Some(f.path().into()))).unwrap();
        assert_eq!(c.watermarks.disk_free, DiskFreeLimit::MemRelative(1.5));
        for bad in [
            "vm_memory_high_watermark = 1.5",
            "disk_free_limit = \"lots\"",
        ] {
            let f = file(bad);
            assert!(
                ServerConfig::load(args(Some(f.path().into()))).is_err(),
                "{bad} accepted"
            );
        }
    }

    #[test]
    fn a_certificate_enables_amqps_on_5671() {
        let f = file("tls_cert = \"/c.pem\"\ntls_key = \"/k.pem\"\n");
        let c = ServerConfig::load(args(Some(f.path().into()))).unwrap();
        let (listen, tls) = c.amqps.unwrap();
        assert_eq!(listen, SocketAddr::from(([0, 0, 0, 0], 5671)));
        assert_eq!(tls.login_from, crate::tls::CertLogin::DistinguishedName);
        assert!(!tls.fail_if_no_peer_cert);
        let f = file("tls_cert = \"/c.pem\"\n");
        assert!(
            ServerConfig::load(args(Some(f.path().into()))).is_err(),
            "a certificate without a key"
        );
    }

    #[test]
    fn the_file_sets_every_key_and_flags_override_it() {
        let f = file(
            "amqp_listen = \"127.0.0.1:5999\"\n\
             data_dir = \"/tmp/from-file\"\n\
             log_level = \"debug\"\n\
             heartbeat_s = 30\n\
             frame_max = 8192\n\
             channel_max = 16\n\
             message_size_max = 1048576\n\
             store_segment_bytes = 1048576\n\
             connection_max = 100\n\
             consumer_max_per_channel = 8\n\
             consumer_timeout = 5000\n\
             consumer_timeout_response = \"close_channel\"\n\
             log_format = \"json\"\n",
        );
        let c = ServerConfig::load(args(Some(f.path().into()))).unwrap();
        assert_eq!(c.amqp_listen, SocketAddr::from(([127, 0, 0, 1], 5999)));
        assert_eq!(c.data_dir, PathBuf::from("/tmp/from-file"));
        assert_eq!(c.log_level, "debug");
        assert_eq!(c.limits.heartbeat_s, 30);
        assert_eq!(c.limits.frame_max, 8192);
        assert_eq!(c.limits.channel_max, 16);
        assert_eq!(c.limits.message_size_max, 1_048_576);
        assert_eq!(c.store.segment_max, 1_048_576);
        assert_eq!(c.connection_max, Some(100));
        assert_eq!(c.consumer_max_per_channel, Some(8));
        assert_eq!(c.consumer_timeout, Some(5000));
        assert_eq!(
            c.consumer_timeout_response,
            warren_broker::node::broker::TimeoutResponse::CloseChannel
        );
        assert_eq!(c.log_format, LogFormat::Json);

        let mut flags = args(Some(f.path().into()));
        flags.data_dir = Some("/tmp/from-flag".into());
        flags.store_segment_bytes = Some(2_097_152);
        let c = ServerConfig::load(flags).unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/tmp/from-flag"));
        assert_eq!(c.store.segment_max, 2_097_152);
        assert_eq!(
            c.log_level, "debug",
            "keys without a flag still come from the file"
        );
    }

    #[test]
    fn out_of_bounds_and_unknown_keys_are_refused() {
        for text in [
            "frame_max = 4095",
            "channel_max = 0",
            "message_size_max = 536870913",
            "store_segment_bytes = 65535",
            "no_such_key = 1",
        ] {
            let f = file(text);
            assert!(
                ServerConfig::load(args(Some(f.path().into()))).is_err(),
                "{text} accepted"
            );
        }
    }

    #[test]
    fn a_warren_file_named_conf_is_toml_and_a_rabbitmq_conf_is_recognised() {
        let dir = tempfile::tempdir().unwrap();
        let warren = dir.path().join("warren.conf");
        std::fs::write(&warren, "data_dir = \"/srv/warren\"\nheartbeat_s = 9\n").unwrap();
        let c = ServerConfig::load(args(Some(warren))).unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/srv/warren"));
        assert!(c.ignored_keys.is_empty());
        let rabbit = dir.path().join("rabbitmq.conf");
        std::fs::write(
            &rabbit,
            "heartbeat = 9\ndefault_user = ops\nlog.file = false\n",
        )
        .unwrap();
        let c = ServerConfig::load(args(Some(rabbit))).unwrap();
        assert_eq!(c.limits.heartbeat_s, 9);
        assert_eq!(c.default_user.0, "ops");
        assert_eq!(c.ignored_keys, ["log.file"]);
        // Neither form: the TOML error is reported.
        let bad = dir.path().join("x.toml");
        std::fs::write(&bad, "no_such_key = 1\n").unwrap();
        assert!(ServerConfig::load(args(Some(bad))).is_err());
    }

    /// The image's entrypoint followed by a deployment example's arguments, as `warren server`
    /// would be given them (without the leading `warren server`).
    fn entrypoint() -> Vec<String> {
        let dockerfile = include_str!("../../Dockerfile");
        let line = dockerfile
            .lines()
            .find(|l| l.starts_with("ENTRYPOINT"))
            .expect("the Dockerfile has an ENTRYPOINT");
        let words = quoted(line);
        assert_eq!(&words[..2], ["warren", "server"], "{line}");
        words[2..].to_vec()
    }

    /// The double-quoted strings of `text`, in order.
    fn quoted(text: &str) -> Vec<String> {
        text.split('"')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    }

    /// Parse the arguments as `warren server` does and load the configuration they give, with
    /// the data directory moved to a scratch one and the secret the example takes from the
    /// environment given as a flag.
    fn load_example(what: &str, mut argv: Vec<String>) -> ServerConfig {
        #[derive(clap::Parser)]
        struct Server {
            #[command(flatten)]
            args: ServerArgs,
        }
        let dir = tempfile::tempdir().unwrap();
        argv.extend(["--cluster-secret".to_string(), "example-secret".to_string()]);
        let parsed = <Server as clap::Parser>::try_parse_from(
            std::iter::once("server".to_string()).chain(argv.iter().cloned()),
        )
        .unwrap_or_else(|e| panic!("{what}: `warren server` refuses {argv:?}: {e}"));
        let mut a = parsed.args;
        assert_eq!(
            a.data_dir.as_deref(),
            Some(std::path::Path::new("/var/lib/warren"))
        );
        a.data_dir = Some(dir.path().to_path_buf());
        ServerConfig::load(a).unwrap_or_else(|e| panic!("{what}: {argv:?} does not load: {e}"))
    }

    /// deploy/docker-compose.yml: each service's command, after the image's entrypoint, is a
    /// configuration `warren server` accepts: a cluster of the three services, by DNS name.
    #[test]
    fn the_compose_example_passes_flags_warren_server_accepts() {
        let compose = include_str!("../../deploy/docker-compose.yml");
        let commands: Vec<Vec<String>> = compose
            .split("command: [")
            .skip(1)
            .map(|rest| quoted(&rest[..rest.find(']').expect("a command list ends")]))
            .collect();
        assert_eq!(commands.len(), 3, "three services");
        for (i, command) in commands.into_iter().enumerate() {
            let node = format!("n{}", i + 1);
            let c = load_example(&node, [entrypoint(), command].concat());
            let cluster = c.cluster.expect("a cluster node");
            assert_eq!(cluster.node_name, node);
            let peers: Vec<&str> = cluster.peers.iter().map(|p| p.addr.as_str()).collect();
            assert_eq!(peers, ["n1:25672", "n2:25672", "n3:25672"]);
        }
    }

    /// deploy/kubernetes/warren.yaml: the StatefulSet's container args, after the image's
    /// entrypoint and with `$(POD_NAME)` as Kubernetes expands it for each pod, are a
    /// configuration `warren server` accepts, with peers named by the headless service.
    #[test]
    fn the_kubernetes_example_passes_flags_warren_server_accepts() {
        let manifest = include_str!("../../deploy/kubernetes/warren.yaml");
        let mut lines = manifest.lines().skip_while(|l| l.trim() != "args:").skip(1);
        let mut args = Vec::new();
        for line in lines.by_ref() {
            let Some(item) = line.trim().strip_prefix("- ") else {
                break;
            };
            args.push(item.to_string());
        }
        assert!(args.len() >= 6, "the container's args: {args:?}");
        for pod in ["warren-0", "warren-1", "warren-2"] {
            let argv: Vec<String> = args.iter().map(|a| a.replace("$(POD_NAME)", pod)).collect();
            let c = load_example(pod, [entrypoint(), argv].concat());
            let cluster = c.cluster.expect("a cluster node");
            assert_eq!(cluster.node_name, pod);
            assert_eq!(cluster.peers.len(), 3);
            assert!(
                cluster
                    .peers
                    .iter()
                    .all(|p| p.addr.ends_with(".warren:25672"))
            );
        }
    }
}
