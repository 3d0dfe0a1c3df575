//! `warren ctl join_cluster`: a node running alone joins a running cluster.
//!
//! RabbitMQ's sequence is `stop_app`, `reset`, `join_cluster`, `start_app`. Here the node
//! must be as a reset one is (only the default vhost, no queues, no exchanges of its own:
//! nothing that would be lost or shadowed by the cluster's definitions) and must know its
//! cluster identity (`--node-name`, `--cluster-secret`, `--cluster-listen`). The request
//! records the seeds in the data directory ([`SEEDS_FILE`]), and the node stops as it does
//! on SIGTERM and starts again in the same process image (`exec`, same arguments): its
//! configuration then reads the seeds and it joins as `--join` does, and stays a cluster
//! node on every later start.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use tokio::sync::Notify;
use warren_broker::Broker;

use crate::config::types::ClusterConfig;

/// Where a joined node keeps its seeds (`name@host:port,...`, this node first).
pub const SEEDS_FILE: &str = "cluster/join-seeds";

/// The seeds `join_cluster` recorded in `data_dir`, if any.
///
/// # Errors
/// The file exists but cannot be read.
pub fn read_seeds(data_dir: &Path) -> anyhow::Result<Option<String>> {
    let path = data_dir.join(SEEDS_FILE);
    match std::fs::read_to_string(&path) {
        Ok(s) => Ok(Some(s.trim().to_string()).filter(|s| !s.is_empty())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Write the seeds durably (a temporary file, fsync, rename, directory fsync): a crash
/// leaves either no file or the whole list.
fn write_seeds(data_dir: &Path, list: &str) -> std::io::Result<()> {
    let path = data_dir.join(SEEDS_FILE);
    let dir = path
        .parent()
        .map_or_else(|| data_dir.to_path_buf(), Path::to_path_buf);
    std::fs::create_dir_all(&dir)?;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(list.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    std::fs::File::open(&dir)?.sync_all()
}

/// Why a join was refused: rabbitmqctl's exit code and the message.
pub type Refusal = (u8, String);

/// What the admin socket needs to make this node join a cluster.
#[derive(Debug)]
pub struct Joiner {
    /// The node's cluster identity when it runs alone with one (None: clustered already, or
    /// no `--node-name` / `--cluster-secret`).
    standalone: Option<ClusterConfig>,
    data_dir: PathBuf,
    /// Notified once the seeds are recorded: the server stops and starts again.
    pub restart: Notify,
}

impl Joiner {
    /// For a node with this configuration.
    #[must_use]
    pub fn new(standalone: Option<ClusterConfig>, data_dir: PathBuf) -> Self {
        Self {
            standalone,
            data_dir,
            restart: Notify::new(),
        }
    }

    /// Record `seeds` (`name@host:port,...`: nodes of the running cluster) with this node at
    /// `address` (default: its cluster listen address), then have the server restart into
    /// the cluster. Returns this node's name.
    ///
    /// # Errors
    /// Refused when the node is clustered, has no cluster identity, holds definitions of its
    /// own, or the seeds do not parse.
    pub fn join(
        &self,
        broker: &Broker,
        seeds: &str,
        address: Option<&str>,
    ) -> Result<String, Refusal> {
        if broker.cluster().is_some() {
            return Err((69, "this node is a cluster member already".into()));
        }
        let Some(me) = &self.standalone else {
            return Err((
                78,
                "this node has no cluster identity: start it with --node-name and \
                 --cluster-secret (and --cluster-listen) to let it join a cluster"
                    .into(),
            ));
        };
        fresh(broker).map_err(|why| {
            (
                69,
                format!("{why}: join_cluster needs a node as reset as RabbitMQ's (stop it, remove its data directory, start it again)"),
            )
        })?;
        let address = match address {
            Some(a) => a.to_string(),
            None if me.listen.ip().is_unspecified() => {
                return Err((
                    64,
                    format!(
                        "the cluster port listens on {}: give the address the other nodes \
                         reach this one at (--address host:port)",
                        me.listen
                    ),
                ));
            }
            None => me.listen.to_string(),
        };
        let list = format!("{}@{address},{seeds}", me.node_name);
        let parsed =
            crate::config::types::parse_peers(&list).map_err(|e| (64, format!("{e:#}")))?;
        if parsed.iter().filter(|p| p.name == me.node_name).count() != 1 {
            return Err((64, "the seeds must not name this node".into()));
        }
        write_seeds(&self.data_dir, &list)
            .map_err(|e| (74, format!("recording the seeds: {e}")))?;
        tracing::info!(seeds, "joining a cluster: restarting");
        self.restart.notify_one();
        Ok(me.node_name.clone())
    }
}

/// Whether the broker holds nothing a join would lose: only the default vhost, with no
/// queues and only the standard exchanges.
fn fresh(broker: &Broker) -> Result<(), String> {
    let vhosts = broker.list_vhosts();
    if let Some(other) = vhosts.iter().find(|v| *v != "/") {
        return Err(format!("the node has a vhost of its own ({other})"));
    }
    let Some(vh) = broker.vhost("/") else {
        return Ok(());
    };
    if let Some(q) = vh.queues().first() {
        return Err(format!("the node has queues ({} and maybe more)", q.name));
    }
    if let Some(x) = vh
        .exchanges()
        .into_iter()
        .find(|x| !x.name.is_empty() && !x.name.starts_with("amq."))
    {
        return Err(format!("the node has exchanges of its own ({})", x.name));
    }
    Ok(())
}
