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
use warren_broker::users::UserError;

/// Longest request line accepted: a definitions file for import_definitions (RabbitMQ's
/// management body limit, 20 MiB, with room for JSON escaping).
const REQUEST_MAX: usize = 48 * 1024 * 1024;

/// The socket of a data directory.
#[must_use]
pub fn socket_path(data_dir: &Path) -> PathBuf {
    data_dir.join("warren.sock")
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Request {
    /// A management API request (method, path, JSON body).
    Api {
        method: String,
        path: String,
        body: Option<Value>,
        #[serde(default)]
        headers: Vec<(String, String)>,
    },
    SetMemoryWatermark {
        relative: Option<f64>,
        absolute: Option<u64>,
    },
    SetDiskFreeLimit {
        absolute: Option<u64>,
        mem_relative: Option<f64>,
    },
    ListAlarms,
    AuthenticateUser {
        name: String,
        password: String,
    },
    /// Join the cluster of these seeds (`name@host:port,...`), this node reached at
    /// `address` (default: its cluster listen address); see [`crate::join`].
    JoinCluster {
        seeds: String,
        address: Option<String>,
    },
}

/// rabbitmqctl's exit codes for the errors it reports (sysexits).
pub(crate) fn exit_code(e: &UserError) -> u8 {
    match e {
        UserError::NoSuchUser(_) => 67,
        UserError::NoSuchVhost(_) | UserError::BadPattern(..) | UserError::Algorithm(_) => 69,
        UserError::QueueType(_) => 64,
        UserError::Exists(_) => 70,
    }
}

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
            use warren_broker::alarms::MemoryWatermark;
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
            use warren_broker::alarms::DiskFreeLimit;
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

/// The arguments of `set_policy` and `set_operator_policy`.
#[derive(Debug, clap::Args)]
pub struct PolicyArgs {
    /// Policy name.
    pub name: String,
    /// Regular expression matched against queue / exchange names.
    pub pattern: String,
    /// JSON object of settings.
    pub definition: String,
    /// Higher wins when several match.
    #[arg(long, default_value_t = 0)]
    pub priority: i32,
    /// all, queues, classic_queues, quorum_queues or exchanges.
    #[arg(long = "apply-to", default_value = "all")]
    pub apply_to: String,
    /// Vhost.
    #[arg(short = 'p', long, default_value = "/")]
    pub vhost: String,
}

/// `warren ctl` subcommands (rabbitmqctl names).
#[derive(Debug, clap::Subcommand)]
#[command(rename_all = "snake_case")]
pub enum CtlCommand {
    /// Set a policy: NAME PATTERN DEFINITION (JSON), e.g.
    /// `set_policy limits '^orders\.' '{"max-length": 1000}' --apply-to queues`. Keys:
    /// message-ttl, expires, max-length, max-length-bytes, overflow, dead-letter-exchange,
    /// dead-letter-routing-key, delivery-limit, alternate-exchange.
    SetPolicy(PolicyArgs),
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
    /// Create a user (no tags, no permissions).
    AddUser {
        /// User name.
        name: String,
        /// Password.
        password: String,
    },
    /// Delete a user and its permissions.
    DeleteUser {
        /// User name.
        name: String,
    },
    /// Set a user's password.
    ChangePassword {
        /// User name.
        name: String,
        /// New password.
        password: String,
    },
    /// Replace a user's tags (none clears them).
    SetUserTags {
        /// User name.
        name: String,
        /// Tags: administrator, monitoring, policymaker, management, impersonator, ...
        tags: Vec<String>,
    },
    /// List users and their tags.
    ListUsers,
    /// Check a user's password.
    AuthenticateUser {
        /// User name.
        name: String,
        /// Password.
        password: String,
    },
    /// Grant a user configure / write / read patterns in a vhost.
    SetPermissions {
        /// User name.
        user: String,
        /// Pattern for declare / delete.
        configure: String,
        /// Pattern for publish / bind destination.
        write: String,
        /// Pattern for consume / get / purge / bind source.
        read: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Remove a user's permissions in a vhost.
    ClearPermissions {
        /// User name.
        user: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// List the permissions in a vhost.
    ListPermissions {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// List a user's permissions in every vhost.
    ListUserPermissions {
        /// User name.
        user: String,
    },
    /// Create a vhost (no-op if it exists).
    AddVhost {
        /// Vhost name.
        name: String,
        /// Type of queues declared without x-queue-type: classic or quorum.
        #[arg(long = "default-queue-type")]
        default_queue_type: Option<String>,
    },
    /// Change a vhost's metadata.
    UpdateVhostMetadata {
        /// Vhost name.
        name: String,
        /// Type of queues declared without x-queue-type: classic or quorum.
        #[arg(long = "default-queue-type")]
        default_queue_type: Option<String>,
    },
    /// Delete a vhost with everything in it; its connections are closed.
    DeleteVhost {
        /// Vhost name.
        name: String,
    },
    /// List vhosts; columns: name (default), default_queue_type.
    ListVhosts {
        /// Columns to show.
        columns: Vec<String>,
    },
    /// Set a vhost's limits, e.g. `'{"max-connections": 100, "max-queues": 10}'` (a negative
    /// value means unlimited).
    SetVhostLimits {
        /// JSON object with max-connections and/or max-queues.
        definition: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Remove a vhost's limits.
    ClearVhostLimits {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Print a vhost's limits as JSON.
    ListVhostLimits {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Set a user's limits, e.g. `'{"max-connections": 10, "max-channels": 100}'`.
    SetUserLimits {
        /// User name.
        name: String,
        /// JSON object with max-connections and/or max-channels.
        definition: String,
    },
    /// Remove one limit of a user (max-connections, max-channels) or all of them.
    ClearUserLimits {
        /// User name.
        name: String,
        /// The limit, or `all`.
        limit: String,
    },
    /// Print a user's limits as JSON.
    ListUserLimits {
        /// User name.
        #[arg(long)]
        user: String,
    },
    /// Constrain a user's routing keys (write) and binding keys (read) on a topic exchange;
    /// `{username}` and `{vhost}` in the patterns stand for the names.
    SetTopicPermissions {
        /// User name.
        user: String,
        /// The topic exchange.
        exchange: String,
        /// Pattern for routing keys of publishes.
        write: String,
        /// Pattern for binding keys.
        read: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Remove a user's topic permissions (on one exchange, or all) in a vhost.
    ClearTopicPermissions {
        /// User name.
        user: String,
        /// The exchange (all when omitted).
        exchange: Option<String>,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// List the topic permissions in a vhost.
    ListTopicPermissions {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// List a user's topic permissions.
    ListUserTopicPermissions {
        /// User name.
        user: String,
    },
    /// Change the memory high watermark at run time: `<fraction>` of RAM, or
    /// `absolute <size>` ("2GB", "512MiB", bytes). Not persisted, as in RabbitMQ.
    SetVmMemoryHighWatermark {
        /// A fraction, or `absolute`.
        value: String,
        /// The size after `absolute`.
        size: Option<String>,
    },
    /// Change the disk free limit at run time: `<size>`, or `mem_relative <fraction>` of RAM.
    /// Not persisted, as in RabbitMQ.
    SetDiskFreeLimit {
        /// A size, or `mem_relative`.
        value: String,
        /// The fraction after `mem_relative`.
        fraction: Option<String>,
    },
    /// Show the resource alarms in effect (rabbitmq-diagnostics alarms).
    Alarms,
    /// List queues; columns are the management API's queue fields [default: name messages].
    ListQueues {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
        /// Columns.
        columns: Vec<String>,
    },
    /// List exchanges [default columns: name type].
    ListExchanges {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
        /// Columns.
        columns: Vec<String>,
    },
    /// List bindings [default columns: source_name source_kind destination_name
    /// destination_kind routing_key arguments].
    ListBindings {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
        /// Columns.
        columns: Vec<String>,
    },
    /// List connections [default columns: user peer_host peer_port state].
    ListConnections {
        /// Columns.
        columns: Vec<String>,
    },
    /// List channels [default columns: pid user consumer_count messages_unacknowledged].
    ListChannels {
        /// Columns.
        columns: Vec<String>,
    },
    /// List consumers [default columns: queue_name consumer_tag ack_required prefetch_count
    /// arguments].
    ListConsumers {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
        /// Columns.
        columns: Vec<String>,
    },
    /// Remove every ready message from a queue.
    PurgeQueue {
        /// Queue.
        name: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Delete a queue with its messages.
    DeleteQueue {
        /// Queue.
        name: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Close a connection (320 CONNECTION_FORCED with the explanation).
    CloseConnection {
        /// The connection's id: its `pid` (or `name`) in list_connections (`peer -> local`).
        name: String,
        /// Reason given to the client.
        explanation: String,
    },
    /// The node's status: version, uptime, listeners, alarms, memory, disk, file descriptors
    /// and object totals.
    Status,
    /// Set an operator policy (limits that cap users' policies and queue arguments): NAME
    /// PATTERN DEFINITION, e.g. `set_operator_policy cap '.*' '{"max-length": 100000}'`.
    /// Keys: message-ttl, expires, max-length, max-length-bytes, delivery-limit.
    SetOperatorPolicy(PolicyArgs),
    /// Remove an operator policy.
    ClearOperatorPolicy {
        /// Policy name.
        name: String,
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// List operator policies [columns: vhost name pattern apply-to definition priority].
    ListOperatorPolicies {
        /// Vhost.
        #[arg(short = 'p', long, default_value = "/")]
        vhost: String,
    },
    /// Write the node's definitions (RabbitMQ's JSON format) to a file, or `-` for stdout.
    ExportDefinitions {
        /// Target file.
        path: String,
    },
    /// Import definitions (RabbitMQ's JSON format) from a file.
    ImportDefinitions {
        /// Source file.
        path: String,
    },
    /// Remove a stopped node from the cluster for good (from the metadata group and every
    /// quorum queue's members). It cannot join again under that name.
    ForgetClusterNode {
        /// Node name.
        node: String,
    },
    /// Make this node (running alone, with --node-name and --cluster-secret, holding nothing
    /// of its own) join the running cluster of SEEDS (`name@host:port,...`, their cluster
    /// ports): it restarts into the cluster. Answers once it runs as a member.
    JoinCluster {
        /// Nodes of the cluster to join: `name@host:port,...`.
        seeds: String,
        /// Where the other nodes reach this one's cluster port [default: its listen address].
        #[arg(long)]
        address: Option<String>,
    },
    /// The cluster's name, its nodes, and which of them this node hears from.
    ClusterStatus {
        /// `json` for one JSON object.
        #[arg(long)]
        formatter: Option<String>,
    },
    /// Quorum queue membership (rabbitmq-queues): add_member, delete_member, grow, shrink.
    Queues {
        /// The verb.
        #[command(subcommand)]
        command: crate::ctl_cluster::QueuesCommand,
    },
}

/// A listing through the management API: (banner, API path, default columns).
fn api_listing(command: &CtlCommand) -> Option<(String, String, Vec<&'static str>, &[String])> {
    let v = |vhost: &str| percent_segment(vhost);
    Some(match command {
        CtlCommand::ListQueues { vhost, columns } => (
            format!("Listing queues for vhost {vhost} ..."),
            format!("/api/queues/{}", v(vhost)),
            vec!["name", "messages"],
            columns,
        ),
        CtlCommand::ListExchanges { vhost, columns } => (
            format!("Listing exchanges for vhost {vhost} ..."),
            format!("/api/exchanges/{}", v(vhost)),
            vec!["name", "type"],
            columns,
        ),
        CtlCommand::ListBindings { vhost, columns } => (
            format!("Listing bindings for vhost {vhost}..."),
            format!("/api/bindings/{}", v(vhost)),
            vec![
                "source_name",
                "source_kind",
                "destination_name",
                "destination_kind",
                "routing_key",
                "arguments",
            ],
            columns,
        ),
        CtlCommand::ListConnections { columns } => (
            "Listing connections ...".to_string(),
            "/api/connections".to_string(),
            vec!["user", "peer_host", "peer_port", "state"],
            columns,
        ),
        CtlCommand::ListChannels { columns } => (
            "Listing channels ...".to_string(),
            "/api/channels".to_string(),
            vec!["pid", "user", "consumer_count", "messages_unacknowledged"],
            columns,
        ),
        CtlCommand::ListOperatorPolicies { vhost } => (
            format!("Listing operator policy overrides for vhost \"{vhost}\" ..."),
            format!("/api/operator-policies/{}", v(vhost)),
            vec![
                "vhost",
                "name",
                "pattern",
                "apply-to",
                "definition",
                "priority",
            ],
            &[],
        ),
        CtlCommand::ListConsumers { vhost, columns } => (
            format!("Listing consumers in vhost {vhost} ..."),
            format!("/api/consumers/{}", v(vhost)),
            vec![
                "queue_name",
                "consumer_tag",
                "ack_required",
                "prefetch_count",
                "arguments",
            ],
            columns,
        ),
        _ => return None,
    })
}

pub(crate) fn percent_segment(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// One cell of a listing, from the API object, with rabbitmqctl's column names.
fn cell(item: &Value, column: &str) -> String {
    let v = match column {
        "source_name" => item.get("source"),
        "source_kind" => return "exchange".into(),
        "destination_name" => item.get("destination"),
        "destination_kind" => item.get("destination_type"),
        "queue_name" => item.get("queue").and_then(|q| q.get("name")),
        // rabbitmqctl's connection id for close_connection; Warren's is the name.
        "pid" => item.get("name"),
        other => item.get(other),
    };
    match v {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(m)) if m.is_empty() => "[]".into(),
        Some(Value::Array(a)) if a.is_empty() => "[]".into(),
        Some(other) => other.to_string(),
    }
}

/// Ask the broker to join the cluster of `seeds` (see [`crate::join`]): its reply.
pub(crate) fn request_join(
    data_dir: &Path,
    seeds: &str,
    address: Option<&str>,
) -> anyhow::Result<Value> {
    send(
        data_dir,
        &Request::JoinCluster {
            seeds: seeds.into(),
            address: address.map(str::to_string),
        },
    )
}

/// One request over the admin socket, one JSON reply.
fn send(data_dir: &Path, request: &Request) -> anyhow::Result<Value> {
    let path = socket_path(data_dir);
    let mut stream = std::os::unix::net::UnixStream::connect(&path)
        .with_context(|| format!("connecting to {} (is the broker running?)", path.display()))?;
    let mut line = serde_json::to_string(request)?;
    line.push('\n');
    stream.write_all(line.as_bytes())?;
    let mut reply = String::new();
    BufReader::new(&stream).read_line(&mut reply)?;
    serde_json::from_str(&reply).context("bad reply from the broker")
}

/// Send one management API request over the admin socket.
pub(crate) fn api_request(
    data_dir: &Path,
    method: &str,
    path: &str,
    body: Option<Value>,
    headers: Vec<(String, String)>,
) -> anyhow::Result<(u16, Value)> {
    let reply = send(
        data_dir,
        &Request::Api {
            method: method.into(),
            path: path.into(),
            body,
            headers,
        },
    )?;
    let status = reply["status"].as_u64().unwrap_or(500);
    Ok((u16::try_from(status).unwrap_or(500), reply["api"].clone()))
}

/// `warren ctl status`: what `rabbitmqctl status` shows that applies to Warren, from the
/// management API's overview and node.
fn status(data_dir: &Path) -> anyhow::Result<u8> {
    let (code, overview) = api_request(data_dir, "GET", "/api/overview", None, Vec::new())?;
    if code != 200 {
        return Ok(api_failure(code, &overview));
    }
    let (code, nodes) = api_request(data_dir, "GET", "/api/nodes", None, Vec::new())?;
    if code != 200 {
        return Ok(api_failure(code, &nodes));
    }
    let n = &nodes[0];
    let num = |v: &Value| {
        v.as_u64()
            .map_or_else(|| "unknown".to_string(), |x| x.to_string())
    };
    let node = overview["node"].as_str().unwrap_or("");
    println!("Status of node {node} ...");
    println!("Runtime\n");
    println!("OS PID: {}", n["os_pid"].as_str().unwrap_or(""));
    println!(
        "Uptime (seconds): {}",
        n["uptime"].as_u64().map_or(0, |ms| ms / 1000)
    );
    println!(
        "Product name: {}",
        overview["product_name"].as_str().unwrap_or("")
    );
    println!(
        "Product version: {}",
        overview["product_version"].as_str().unwrap_or("")
    );
    println!(
        "RabbitMQ API version: {}",
        overview["rabbitmq_version"].as_str().unwrap_or("")
    );
    println!("\nAlarms\n");
    let alarms: Vec<&str> = [("memory", "mem_alarm"), ("disk", "disk_free_alarm")]
        .into_iter()
        .filter(|(_, k)| n[*k].as_bool().unwrap_or(false))
        .map(|(name, _)| name)
        .collect();
    if alarms.is_empty() {
        println!("(none)");
    } else {
        for a in alarms {
            println!("resource limit alarm: {a}");
        }
    }
    println!("\nMemory\n");
    println!(
        "Total memory used: {} bytes\nMemory high watermark: {} bytes",
        num(&n["mem_used"]),
        num(&n["mem_limit"])
    );
    println!("\nFree Disk Space\n");
    println!(
        "Low free disk space watermark: {} bytes\nFree disk space: {} bytes",
        num(&n["disk_free_limit"]),
        num(&n["disk_free"])
    );
    println!("\nFile Descriptors\n");
    println!(
        "Total: {}, limit: {}\nSockets: {}, limit: {}",
        num(&n["fd_used"]),
        num(&n["fd_total"]),
        num(&n["sockets_used"]),
        num(&n["sockets_total"])
    );
    println!("\nListeners\n");
    for l in overview["listeners"].as_array().into_iter().flatten() {
        println!(
            "Interface: {}, port: {}, protocol: {}",
            l["ip_address"].as_str().unwrap_or(""),
            num(&l["port"]),
            l["protocol"].as_str().unwrap_or("")
        );
    }
    println!("\nTotals\n");
    let t = &overview["object_totals"];
    let q = &overview["queue_totals"];
    println!(
        "Connection count: {}\nChannel count: {}\nQueue count: {}\nConsumer count: {}\nMessages ready: {}\nMessages unacknowledged: {}",
        num(&t["connections"]),
        num(&t["channels"]),
        num(&t["queues"]),
        num(&t["consumers"]),
        num(&q["messages_ready"]),
        num(&q["messages_unacknowledged"])
    );
    Ok(0)
}

/// rabbitmqctl-like exit codes for API failures.
pub(crate) fn api_failure(status: u16, body: &Value) -> u8 {
    let reason = body["reason"].as_str().unwrap_or("failed");
    eprintln!("Error:\n{reason}");
    match status {
        404 => 69,
        400 | 401 => 65,
        _ => 70,
    }
}

/// The ctl verbs served by the management API; `None` for the others.
fn api_ctl(data_dir: &Path, command: &CtlCommand) -> Option<anyhow::Result<u8>> {
    if let Some((banner, path, defaults, columns)) = api_listing(command) {
        println!("{banner}");
        let columns: Vec<String> = if columns.is_empty() {
            defaults.iter().map(|c| (*c).to_string()).collect()
        } else {
            columns.to_vec()
        };
        return Some(api_request(data_dir, "GET", &path, None, Vec::new()).map(
            |(status, body)| {
                if status != 200 {
                    return api_failure(status, &body);
                }
                let rows = body.as_array().cloned().unwrap_or_default();
                if !rows.is_empty() {
                    println!("{}", columns.join("\t"));
                }
                for item in rows {
                    let line: Vec<String> = columns.iter().map(|c| cell(&item, c)).collect();
                    println!("{}", line.join("\t"));
                }
                0
            },
        ));
    }
    let (banner, method, path, body, headers) = match command {
        CtlCommand::PurgeQueue { name, vhost } => (
            format!("Purging queue '{name}' in vhost '{vhost}' ..."),
            "DELETE",
            format!(
                "/api/queues/{}/{}/contents",
                percent_segment(vhost),
                percent_segment(name)
            ),
            None,
            Vec::new(),
        ),
        CtlCommand::DeleteQueue { name, vhost } => (
            format!("Deleting queue '{name}' on vhost '{vhost}' ..."),
            "DELETE",
            format!(
                "/api/queues/{}/{}",
                percent_segment(vhost),
                percent_segment(name)
            ),
            None,
            Vec::new(),
        ),
        CtlCommand::ForgetClusterNode { node } => (
            format!("Removing node {node} from the cluster"),
            "DELETE",
            format!("/api/nodes/{}", percent_segment(node)),
            None,
            Vec::new(),
        ),
        CtlCommand::CloseConnection { name, explanation } => (
            format!("Closing connection {name}, reason: {explanation}..."),
            "DELETE",
            format!("/api/connections/{}", percent_segment(name)),
            None,
            vec![("x-reason".to_string(), explanation.clone())],
        ),
        CtlCommand::Status => return Some(status(data_dir)),
        CtlCommand::JoinCluster { seeds, address } => {
            return Some(crate::ctl_cluster::join_cluster(
                data_dir,
                seeds,
                address.as_deref(),
            ));
        }
        CtlCommand::ClusterStatus { formatter } => {
            return Some(crate::ctl_cluster::cluster_status(
                data_dir,
                formatter.as_deref() == Some("json"),
            ));
        }
        CtlCommand::Queues { command } => {
            return Some(crate::ctl_cluster::queues(data_dir, command));
        }
        CtlCommand::ExportDefinitions { path } => {
            if path != "-" {
                println!("Exporting definitions in JSON to a file at \"{path}\" ...");
            }
            return Some(
                api_request(data_dir, "GET", "/api/definitions", None, Vec::new()).and_then(
                    |(status, body)| {
                        if status != 200 {
                            return Ok(api_failure(status, &body));
                        }
                        let text = serde_json::to_string_pretty(&body)?;
                        if path == "-" {
                            println!("{text}");
                        } else {
                            std::fs::write(path, text)
                                .with_context(|| format!("writing {path}"))?;
                        }
                        Ok(0)
                    },
                ),
            );
        }
        CtlCommand::ImportDefinitions { path } => {
            println!("Importing definitions in JSON from a file at \"{path}\" ...");
            let body = std::fs::read_to_string(path)
                .with_context(|| format!("reading {path}"))
                .and_then(|t| serde_json::from_str::<Value>(&t).context("parsing the file"));
            let body = match body {
                Ok(b) => b,
                Err(e) => return Some(Err(e)),
            };
            (
                String::new(),
                "POST",
                "/api/definitions".to_string(),
                Some(body),
                Vec::new(),
            )
        }
        _ => return None,
    };
    if !banner.is_empty() {
        println!("{banner}");
    }
    Some(
        api_request(data_dir, method, &path, body, headers).map(|(status, body)| {
            if status < 300 {
                0
            } else {
                api_failure(status, &body)
            }
        }),
    )
}

impl CtlCommand {
    /// The line rabbitmqctl prints before doing it.
    fn banner(&self) -> Option<String> {
        Some(match self {
            Self::AddUser { name, .. } => format!("Adding user \"{name}\" ..."),
            Self::DeleteUser { name } => format!("Deleting user \"{name}\" ..."),
            Self::ChangePassword { name, .. } => {
                format!("Changing password for user \"{name}\" ...")
            }
            Self::SetUserTags { name, tags } => {
                format!(
                    "Setting tags for user \"{name}\" to [{}] ...",
                    tags.join(", ")
                )
            }
            Self::ListUsers => "Listing users ...".into(),
            Self::AuthenticateUser { name, .. } => format!("Authenticating user \"{name}\" ..."),
            Self::SetPermissions { user, vhost, .. } => {
                format!("Setting permissions for user \"{user}\" in vhost \"{vhost}\" ...")
            }
            Self::ClearPermissions { user, vhost } => {
                format!("Clearing permissions for user \"{user}\" in vhost \"{vhost}\" ...")
            }
            Self::ListPermissions { vhost } => {
                format!("Listing permissions for vhost \"{vhost}\" ...")
            }
            Self::ListUserPermissions { user } => {
                format!("Listing permissions for user \"{user}\" ...")
            }
            Self::AddVhost { name, .. } => format!("Adding vhost \"{name}\" ..."),
            Self::UpdateVhostMetadata { name, .. } => {
                format!("Updating metadata of vhost \"{name}\" ...")
            }
            Self::DeleteVhost { name } => format!("Deleting vhost \"{name}\" ..."),
            Self::ListVhosts { .. } => "Listing vhosts ...".into(),
            Self::SetVhostLimits { definition, vhost } => {
                format!("Setting vhost limits to \"{definition}\" for vhost \"{vhost}\" ...")
            }
            Self::ClearVhostLimits { vhost } => format!("Clearing vhost \"{vhost}\" limits ..."),
            Self::ListVhostLimits { vhost } => format!("Listing limits for vhost \"{vhost}\" ..."),
            Self::SetUserLimits { name, definition } => {
                format!("Setting user limits to \"{definition}\" for user \"{name}\" ...")
            }
            Self::ClearUserLimits { name, limit } => {
                format!("Clearing \"{limit}\" limit for user \"{name}\" ...")
            }
            Self::ListUserLimits { user } => format!("Listing limits for user \"{user}\" ..."),
            Self::SetTopicPermissions {
                user,
                exchange,
                vhost,
                ..
            } => format!(
                "Setting topic permissions on \"{exchange}\" for user \"{user}\" in vhost \"{vhost}\" ..."
            ),
            Self::ClearTopicPermissions { user, vhost, .. } => {
                format!("Clearing topic permissions for user \"{user}\" in vhost \"{vhost}\" ...")
            }
            Self::ListTopicPermissions { vhost } => {
                format!("Listing topic permissions for vhost \"{vhost}\" ...")
            }
            Self::ListUserTopicPermissions { user } => {
                format!("Listing topic permissions for user \"{user}\" ...")
            }
            Self::SetOperatorPolicy(a) => format!(
                "Setting operator policy override \"{}\" for pattern \"{}\" to \"{}\" with priority \"{}\" ...",
                a.name, a.pattern, a.definition, a.priority
            ),
            Self::ClearOperatorPolicy { name, vhost } => {
                format!("Clearing operator policy \"{name}\" on vhost \"{vhost}\" ...")
            }
            Self::SetVmMemoryHighWatermark { value, size } => match size {
                Some(size) => format!("Setting memory threshold on warren to {size} bytes ..."),
                None => format!("Setting memory threshold on warren to {value} ..."),
            },
            Self::SetDiskFreeLimit { value, fraction } => match fraction {
                Some(f) => {
                    format!("Setting disk free limit on warren to {f} times the total RAM ...")
                }
                None => format!("Setting disk free limit on warren to {value} bytes ..."),
            },
            _ => return None,
        })
    }
}

/// Run a ctl command against the broker owning `data_dir`; prints the reply.
pub fn ctl(data_dir: &Path, command: CtlCommand) -> anyhow::Result<u8> {
    if let Some(result) = api_ctl(data_dir, &command) {
        return result;
    }
    if let Some(banner) = command.banner() {
        println!("{banner}");
    }
    if let Some(result) = crate::ctl_api::run(data_dir, &command) {
        return result;
    }
    let request = match command {
        CtlCommand::AuthenticateUser { name, password } => {
            Request::AuthenticateUser { name, password }
        }
        CtlCommand::SetVmMemoryHighWatermark { value, size } => match (value.as_str(), size) {
            ("absolute", Some(size)) => Request::SetMemoryWatermark {
                relative: None,
                absolute: Some(crate::config::size("absolute", &size)?),
            },
            (fraction, None) => Request::SetMemoryWatermark {
                relative: Some(
                    fraction
                        .parse()
                        .context("the watermark must be a fraction")?,
                ),
                absolute: None,
            },
            _ => anyhow::bail!("usage: set_vm_memory_high_watermark <fraction> | absolute <size>"),
        },
        CtlCommand::SetDiskFreeLimit { value, fraction } => match (value.as_str(), fraction) {
            ("mem_relative", Some(f)) => Request::SetDiskFreeLimit {
                absolute: None,
                mem_relative: Some(f.parse().context("mem_relative needs a number")?),
            },
            (size, None) => Request::SetDiskFreeLimit {
                absolute: Some(crate::config::size("disk_limit", size)?),
                mem_relative: None,
            },
            _ => anyhow::bail!("usage: set_disk_free_limit <size> | mem_relative <fraction>"),
        },
        CtlCommand::Alarms => Request::ListAlarms,
        // Served by the management API (api_ctl, ctl_api) before this match.
        other => anyhow::bail!("{other:?} is served through the management API"),
    };
    let reply = send(data_dir, &request)?;
    if reply["ok"] == json!(true) {
        if let Some(p) = reply.get("policies") {
            println!("{}", serde_json::to_string_pretty(p)?);
        }
        if let Some(m) = reply.get("message").and_then(Value::as_str) {
            println!("{m}");
        }
        // Tables as rabbitmqctl prints them: a header row, then tab-separated rows.
        if let (Some(header), Some(rows)) = (reply.get("header"), reply.get("rows")) {
            let line = |v: &Value| {
                v.as_array()
                    .map(|cells| {
                        cells
                            .iter()
                            .map(|c| c.as_str().unwrap_or_default())
                            .collect::<Vec<_>>()
                            .join("\t")
                    })
                    .unwrap_or_default()
            };
            // rabbitmqctl prints no header for an empty listing.
            if rows.as_array().is_some_and(|r| !r.is_empty()) {
                println!("{}", line(header));
            }
            for row in rows.as_array().into_iter().flatten() {
                println!("{}", line(row));
            }
        }
        Ok(0)
    } else {
        let error = reply["error"].as_str().unwrap_or("failed");
        match reply.get("code").and_then(Value::as_u64) {
            Some(code) => {
                eprintln!("Error:\n{error}");
                Ok(u8::try_from(code).unwrap_or(1))
            }
            None => anyhow::bail!("{error}"),
        }
    }
}
