//! The local admin socket (`<data-dir>/warren.sock`) and `warren ctl`, its client: the
//! rabbitmqctl-style commands that need a running broker (policies for now). One JSON request
//! per line, one JSON reply per line. Access is governed by the socket file's permissions
//! (owner only); the management HTTP API (issue 7) will offer the same over the network.
//!
//! Layout: [`protocol`] is the wire format; [`socket`] serves it in the broker; [`client`]
//! sends it for `warren ctl` and holds what every verb shares; [`command`] is the command line.
//! The verbs: this module dispatches them, [`listing`] and [`status`] print API reads,
//! [`ctl_api`] carries out users, vhosts, permissions, limits and policies, [`ctl_cluster`]
//! cluster membership. No child imports this module: the verbs import [`client`] and
//! [`command`] (which takes the `queues` subcommands from [`ctl_cluster`]), and [`client`]
//! and [`socket`] import [`protocol`].

mod client;
mod command;
mod ctl_api;
mod ctl_cluster;
mod ctl_redrive;
mod ctl_streams;
mod listing;
mod protocol;
mod socket;
mod status;

use std::path::Path;

use anyhow::Context;
use serde_json::{Value, json};

use client::{api_failure, api_request, percent_segment, send};
pub use command::CtlCommand;
use listing::{api_listing, cell};
use protocol::Request;
pub use protocol::socket_path;
pub use socket::{bind, serve};
use status::status;

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
            return Some(ctl_cluster::join_cluster(
                data_dir,
                seeds,
                address.as_deref(),
            ));
        }
        CtlCommand::ClusterStatus { formatter } => {
            return Some(ctl_cluster::cluster_status(
                data_dir,
                formatter.as_deref() == Some("json"),
            ));
        }
        CtlCommand::Queues { command } => {
            return Some(ctl_cluster::queues(data_dir, command));
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

/// Run a ctl command against the broker owning `data_dir`; prints the reply.
pub fn ctl(data_dir: &Path, command: CtlCommand) -> anyhow::Result<u8> {
    if let Some(result) = api_ctl(data_dir, &command) {
        return result;
    }
    if let Some(banner) = command.banner() {
        println!("{banner}");
    }
    if let Some(result) = ctl_api::run(data_dir, &command) {
        return result;
    }
    if let Some(result) = ctl_redrive::run(data_dir, &command) {
        return result;
    }
    if let Some(result) = ctl_streams::run(data_dir, &command) {
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
