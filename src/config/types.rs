//! The configuration's shared data types and value parsers: the file format (`FileConfig`,
//! which `rabbitmq_conf` also fills), a node's cluster settings (`ClusterConfig`, which `join`
//! keeps), `LogFormat`, and the parsers for sizes and peer lists. It imports nothing of the
//! crate but `tls`, so `rabbitmq_conf` and `join` use it while `config` uses them.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use serde::Deserialize;

/// The file format; every key optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileConfig {
    pub(crate) amqp_listen: Option<SocketAddr>,
    pub(crate) amqps_listen: Option<SocketAddr>,
    pub(crate) tls_cert: Option<PathBuf>,
    pub(crate) tls_key: Option<PathBuf>,
    pub(crate) tls_ca: Option<PathBuf>,
    pub(crate) tls_fail_if_no_peer_cert: Option<bool>,
    pub(crate) ssl_cert_login_from: Option<crate::tls::CertLogin>,
    pub(crate) vm_memory_high_watermark: Option<f64>,
    pub(crate) vm_memory_high_watermark_absolute: Option<String>,
    pub(crate) disk_free_limit: Option<String>,
    pub(crate) disk_free_limit_mem_relative: Option<f64>,
    pub(crate) connection_max: Option<u64>,
    pub(crate) consumer_max_per_channel: Option<u64>,
    /// RabbitMQ's `consumer_timeout` (ms; 0 disables it).
    pub(crate) consumer_timeout: Option<u64>,
    /// RabbitMQ 4.3's `consumer_timeout_response`: `notify_consumer` or `close_channel`.
    pub(crate) consumer_timeout_response: Option<String>,
    pub(crate) management_listen: Option<String>,
    pub(crate) prometheus_listen: Option<String>,
    pub(crate) log_format: Option<LogFormat>,
    pub(crate) data_dir: Option<PathBuf>,
    pub(crate) log_level: Option<String>,
    pub(crate) heartbeat_s: Option<u16>,
    pub(crate) frame_max: Option<u32>,
    pub(crate) channel_max: Option<u16>,
    pub(crate) message_size_max: Option<u64>,
    pub(crate) store_segment_bytes: Option<u64>,
    pub(crate) node_name: Option<String>,
    pub(crate) cluster_listen: Option<SocketAddr>,
    pub(crate) peers: Option<String>,
    pub(crate) cluster_secret: Option<String>,
    pub(crate) cluster_tls_cert: Option<PathBuf>,
    pub(crate) cluster_tls_key: Option<PathBuf>,
    pub(crate) cluster_tls_ca: Option<PathBuf>,
    pub(crate) join: Option<bool>,
    pub(crate) quorum_log_pin_max: Option<u64>,
    pub(crate) quorum_log: Option<String>,
    pub(crate) product_name: Option<String>,
    pub(crate) product_version: Option<String>,
    pub(crate) default_user: Option<String>,
    pub(crate) default_pass: Option<String>,
    pub(crate) loopback_users: Option<Vec<String>>,
    pub(crate) auth_mechanisms: Option<Vec<String>>,
}

/// `--node-name`, `--cluster-listen`, `--peers`, `--cluster-secret`.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// This node's name.
    pub node_name: String,
    /// The inter-node port.
    pub listen: SocketAddr,
    /// Every node, this one included.
    pub peers: Vec<warren_cluster::node::Peer>,
    /// The shared secret.
    pub secret: String,
    /// TLS on the cluster port: certificate, key and CA (PEM files).
    pub tls: Option<crate::tls::ClusterTlsFiles>,
    /// Join the cluster of `peers` rather than found it.
    pub join: bool,
    /// Entries a quorum queue's log keeps at most for its oldest live message.
    pub log_pin_max: u64,
    /// Which log this node's quorum queues use.
    pub quorum_log: warren_cluster::node::QueueLogKind,
}

/// Parse `name@host:port,...`.
pub(crate) fn parse_peers(list: &str) -> anyhow::Result<Vec<warren_cluster::node::Peer>> {
    list.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (name, addr) = p
                .split_once('@')
                .with_context(|| format!("peer '{p}' is not name@host:port"))?;
            anyhow::ensure!(
                !name.is_empty() && is_host_port(addr),
                "peer '{p}' is not name@host:port (an IP address or DNS name, and a port)"
            );
            Ok(warren_cluster::node::Peer {
                name: name.to_string(),
                addr: addr.to_string(),
            })
        })
        .collect()
}

/// `ip:port`, `[ipv6]:port` or `dns-name:port` with a port from 1 to 65535.
fn is_host_port(addr: &str) -> bool {
    if addr.parse::<SocketAddr>().is_ok() {
        return true;
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        return false;
    };
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    port.parse::<u16>().is_ok_and(|p| p > 0)
        && host.len() <= 253
        && host.trim_end_matches('.').split('.').all(label_ok)
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (for log shippers).
    Json,
}

/// A size with RabbitMQ's units; the error names `key`.
pub fn size(key: &str, text: &str) -> anyhow::Result<u64> {
    warren_broker::node::alarms::parse_size(text).with_context(|| {
        format!("{key}: {text:?} is not a size (bytes, or with kB/MB/GB/kiB/MiB/GiB)")
    })
}
