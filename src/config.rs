//! Server configuration: defaults, an optional TOML file (`--config`), then command-line flags.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use serde::Deserialize;

/// `warren server` flags. Each overrides the config file, which overrides the defaults.
#[derive(Debug, clap::Args)]
pub struct ServerArgs {
    /// TOML file with any of: amqp_listen, data_dir, log_level, heartbeat_s, frame_max,
    /// channel_max, message_size_max, store_segment_bytes.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Address for AMQP 0-9-1 clients [default: 0.0.0.0:5672].
    #[arg(long)]
    pub amqp_listen: Option<SocketAddr>,
    /// Directory for node data [default: ./warren-data].
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Log filter: error, warn, info, debug, trace, or a tracing filter [default: info].
    #[arg(long)]
    pub log_level: Option<String>,
    /// Size at which the store starts a new message segment file [default: 64 MiB].
    #[arg(long)]
    pub store_segment_bytes: Option<u64>,
}

/// The file format; every key optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    amqp_listen: Option<SocketAddr>,
    data_dir: Option<PathBuf>,
    log_level: Option<String>,
    heartbeat_s: Option<u16>,
    frame_max: Option<u32>,
    channel_max: Option<u16>,
    message_size_max: Option<u64>,
    store_segment_bytes: Option<u64>,
}

/// Effective configuration.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub amqp_listen: SocketAddr,
    pub data_dir: PathBuf,
    pub log_level: String,
    pub limits: warren_amqp::limits::ConnectionLimits,
    pub store: warren_store::Options,
}

/// Smallest segment size accepted (smaller only multiplies files).
const STORE_SEGMENT_MIN: u64 = 64 * 1024;

/// Largest message size RabbitMQ allows to be configured (512 MiB).
const MESSAGE_SIZE_MAX_CAP: u64 = 512 * 1024 * 1024;

impl ServerConfig {
    /// Merge defaults, the file and the flags; refuse values outside the protocol's bounds.
    pub fn load(args: ServerArgs) -> anyhow::Result<Self> {
        let file: FileConfig = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?
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
        Ok(Self {
            amqp_listen: args
                .amqp_listen
                .or(file.amqp_listen)
                .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 5672))),
            data_dir: args
                .data_dir
                .or(file.data_dir)
                .unwrap_or_else(|| PathBuf::from("./warren-data")),
            log_level: args
                .log_level
                .or(file.log_level)
                .unwrap_or_else(|| "info".to_string()),
            limits,
            store: warren_store::Options {
                db_cache: warren_store::DB_CACHE_DEFAULT,
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
