//! The admin socket's server side, in the broker: binding `<data-dir>/warren.sock` (owner
//! only) and answering each JSON request line, management API calls made in process among
//! them.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::net::UnixListener;
use warren_broker::Broker;

use super::protocol::Request;

/// Longest request line accepted: a definitions file for import_definitions (RabbitMQ's
/// management body limit, 20 MiB, with room for JSON escaping).
const REQUEST_MAX: usize = 48 * 1024 * 1024;

/// Bind the admin socket (owner-only permissions), replacing a stale one.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    let _ = std::fs::remove_file(path);
    let listener =
        UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("restricting {}", path.display()))?;
    Ok(listener)
}

/// Serve admin requests on a socket from [`bind`] until the task is dropped.
pub async fn serve(
    listener: UnixListener,
    broker: Arc<Broker>,
    app: warren_management::AppState,
    joiner: Arc<crate::join::Joiner>,
) -> anyhow::Result<()> {
    loop {
        let (stream, _) = listener.accept().await?;
        let broker = Arc::clone(&broker);
        let app = app.clone();
        let joiner = Arc::clone(&joiner);
        tokio::spawn(async move {
            let (rd, mut wr) = stream.into_split();
            let mut lines = tokio::io::BufReader::new(rd).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let reply = if line.len() > REQUEST_MAX {
                    json!({"ok": false, "error": "request too large"})
                } else {
                    handle(&broker, &app, &joiner, &line).await
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

async fn handle(
    broker: &Broker,
    app: &warren_management::AppState,
    joiner: &crate::join::Joiner,
    line: &str,
) -> Value {
    let request: Request = match serde_json::from_str(line) {
        Ok(r) => r,
        Err(e) => return json!({"ok": false, "error": format!("bad request: {e}")}),
    };
    match request {
        // Management API calls: made in process as the local administrator. Every change to
        // users, vhosts, permissions, limits, policies and topology goes this way.
        Request::Api {
            method,
            path,
            body,
            headers,
        } => {
            let body = body.map(|b| b.to_string().into_bytes());
            let (status, bytes) =
                warren_management::local_call(app.clone(), &method, &path, body, &headers).await;
            let value: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            json!({"ok": true, "status": status, "api": value})
        }
        Request::SetMemoryWatermark { relative, absolute } => {
            use warren_broker::node::alarms::MemoryWatermark;
            match (relative, absolute) {
                (Some(f), None) if (0.0..=1.0).contains(&f) => {
                    broker
                        .alarms()
                        .set_memory_watermark(MemoryWatermark::Relative(f));
                    json!({"ok": true})
                }
                (None, Some(b)) => {
                    broker
                        .alarms()
                        .set_memory_watermark(MemoryWatermark::Absolute(b));
                    json!({"ok": true})
                }
                _ => {
                    json!({"ok": false, "error": "the fraction must be between 0 and 1", "code": 64})
                }
            }
        }
        Request::SetDiskFreeLimit {
            absolute,
            mem_relative,
        } => {
            use warren_broker::node::alarms::DiskFreeLimit;
            match (absolute, mem_relative) {
                (Some(b), None) => {
                    broker
                        .alarms()
                        .set_disk_free_limit(DiskFreeLimit::Absolute(b));
                    json!({"ok": true})
                }
                (None, Some(f)) if f >= 0.0 => {
                    broker
                        .alarms()
                        .set_disk_free_limit(DiskFreeLimit::MemRelative(f));
                    json!({"ok": true})
                }
                _ => json!({"ok": false, "error": "the fraction must not be negative", "code": 64}),
            }
        }
        Request::ListAlarms => {
            let state = broker.alarms().state();
            let mut lines = Vec::new();
            if state.memory {
                lines.push("Memory alarm on node warren");
            }
            if state.disk {
                lines.push("Free disk space alarm on node warren");
            }
            let message = if lines.is_empty() {
                "Node warren reported no alarms, local or clusterwide".to_string()
            } else {
                lines.join("\n")
            };
            json!({"ok": true, "message": message})
        }
        Request::JoinCluster { seeds, address } => {
            match joiner.join(broker, &seeds, address.as_deref()) {
                Ok(node) => json!({"ok": true, "node": node}),
                Err((code, error)) => json!({"ok": false, "error": error, "code": code}),
            }
        }
        Request::AuthenticateUser { name, password } => {
            if broker.authenticate(&name, &password) {
                json!({"ok": true, "message": "Success"})
            } else {
                json!({"ok": false, "error": format!("failed to authenticate user \"{name}\""), "code": 65})
            }
        }
    }
}
