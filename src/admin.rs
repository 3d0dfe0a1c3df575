//! The local admin socket (`<data-dir>/warren.sock`) and `warren ctl`, its client: the
//! rabbitmqctl-style commands that need a running broker (policies for now). One JSON request
//! per line, one JSON reply per line. Access is governed by the socket file's permissions
//! (owner only); the management HTTP API (issue 7) will offer the same over the network.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::net::UnixListener;
use warren_broker::Broker;
use warren_broker::policy::PolicyDef;

/// Longest request line accepted (a policy definition is small).
const REQUEST_MAX: usize = 64 * 1024;

/// The socket of a data directory.
#[must_use]
pub fn socket_path(data_dir: &Path) -> PathBuf {
    data_dir.join("warren.sock")
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Request {
    SetPolicy(PolicyDef),
    ClearPolicy { vhost: String, name: String },
    ListPolicies { vhost: String },
}

/// Accept admin connections until the task is dropped.
pub async fn serve(path: PathBuf, broker: Arc<Broker>) -> anyhow::Result<()> {
    let _ = std::fs::remove_file(&path);
    let listener =
        UnixListener::bind(&path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("restricting {}", path.display()))?;
    loop {
        let (stream, _) = listener.accept().await?;
        let broker = Arc::clone(&broker);
        tokio::spawn(async move {
            let (rd, mut wr) = stream.into_split();
            let mut lines = tokio::io::BufReader::new(rd).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let reply = if line.len() > REQUEST_MAX {
                    json!({"ok": false, "error": "request too large"})
                } else {
                    handle(&broker, &line).await
                };
                let mut out = reply.to_string();
                out.push('\n');
                if wr.write_all(out.as_bytes()).await.is_err() {
                    break;
                }
            }
        });
    }
}

async fn handle(broker: &Broker, line: &str) -> Value {
    let request: Request = match serde_json::from_str(line) {
        Ok(r) => r,
        Err(e) => return json!({"ok": false, "error": format!("bad request: {e}")}),
    };
    let vhost_name = match &request {
        Request::SetPolicy(d) => d.vhost.clone(),
        Request::ClearPolicy { vhost, .. } | Request::ListPolicies { vhost } => vhost.clone(),
    };
    let Some(vhost) = broker.vhost(&vhost_name) else {
        return json!({"ok": false, "error": format!("no vhost '{vhost_name}'")});
    };
    // Changes are acknowledged once durable, like declarations.
    let (tx, rx) = tokio::sync::oneshot::channel::<bool>();
    let mut tx = Some(tx);
    let mut on_commit = move || -> warren_store::writer::Completion {
        let tx = tx.take();
        Box::new(move |r| {
            if let Some(tx) = tx {
                let _ = tx.send(r.is_ok());
            }
        })
    };
    let reply = match request {
        Request::SetPolicy(def) => match vhost.set_policy(def, &mut on_commit) {
            Ok(()) => json!({"ok": true}),
            Err(e) => json!({"ok": false, "error": e.to_string()}),
        },
        Request::ClearPolicy { name, .. } => {
            if vhost.clear_policy(&name, &mut on_commit) {
                json!({"ok": true})
            } else {
                json!({"ok": false, "error": format!("no policy '{name}' in vhost '{vhost_name}'")})
            }
        }
        Request::ListPolicies { .. } => json!({"ok": true, "policies": vhost.policies()}),
    };
    drop(on_commit);
    // Without a store write (or with an error) the sender is gone and this returns at once.
    if rx.await == Ok(false) {
        return json!({"ok": false, "error": "store write failed"});
    }
    reply
}

/// `warren ctl` subcommands (rabbitmqctl names).
#[derive(Debug, clap::Subcommand)]
#[command(rename_all = "snake_case")]
pub enum CtlCommand {
    /// Set a policy: NAME PATTERN DEFINITION (JSON), e.g.
    /// `set_policy limits '^orders\.' '{"max-length": 1000}' --apply-to queues`.
    SetPolicy {
        /// Policy name.
        name: String,
        /// Regular expression matched against queue / exchange names.
        pattern: String,
        /// JSON object of settings (message-ttl, expires, max-length, max-length-bytes,
        /// overflow, dead-letter-exchange, dead-letter-routing-key, delivery-limit,
        /// alternate-exchange).
        definition: String,
        /// Higher wins when several match.
        #[arg(long, default_value_t = 0)]
        priority: i32,
        /// all, queues, classic_queues, quorum_queues or exchanges.
        #[arg(long = "apply-to", default_value = "all")]
        apply_to: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Remove a policy.
    ClearPolicy {
        /// Policy name.
        name: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// List policies as JSON.
    ListPolicies {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
}

/// Run a ctl command against the broker owning `data_dir`; prints the reply.
pub fn ctl(data_dir: &Path, command: CtlCommand) -> anyhow::Result<()> {
    let request = match command {
        CtlCommand::SetPolicy {
            name,
            pattern,
            definition,
            priority,
            apply_to,
            vhost,
        } => {
            let definition: serde_json::Map<String, Value> = serde_json::from_str(&definition)
                .context("the definition must be a JSON object")?;
            Request::SetPolicy(PolicyDef {
                vhost,
                name,
                pattern,
                apply_to,
                priority,
                definition,
            })
        }
        CtlCommand::ClearPolicy { name, vhost } => Request::ClearPolicy { vhost, name },
        CtlCommand::ListPolicies { vhost } => Request::ListPolicies { vhost },
    };
    let path = socket_path(data_dir);
    let mut stream = std::os::unix::net::UnixStream::connect(&path)
        .with_context(|| format!("connecting to {} (is the broker running?)", path.display()))?;
    let mut line = serde_json::to_string(&request)?;
    line.push('\n');
    stream.write_all(line.as_bytes())?;
    let mut reply = String::new();
    BufReader::new(&stream).read_line(&mut reply)?;
    let reply: Value = serde_json::from_str(&reply).context("bad reply from the broker")?;
    if reply["ok"] == json!(true) {
        if let Some(p) = reply.get("policies") {
            println!("{}", serde_json::to_string_pretty(p)?);
        }
        Ok(())
    } else {
        anyhow::bail!("{}", reply["error"].as_str().unwrap_or("failed"))
    }
}
