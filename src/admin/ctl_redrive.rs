//! `warren ctl redrive_queue`, `list_redrives` and `cancel_redrive`: the HTTP queue API's
//! redrives (`/v1/queues/{vhost}/{queue}/redrive`, `/v1/redrives`) from the command line,
//! called in process over the admin socket.

use std::path::Path;
use std::time::Duration;

use serde_json::{Map, Value, json};

use super::client::{api_failure, api_request, percent_segment as seg};
use super::command::{CtlCommand, RedriveArgs};

/// How often `redrive_queue` prints progress while it waits.
const PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// Carry out a redrive verb; None for any other command.
pub fn run(data_dir: &Path, command: &CtlCommand) -> Option<anyhow::Result<u8>> {
    Some(match command {
        CtlCommand::RedriveQueue(a) => redrive(data_dir, a),
        CtlCommand::ListRedrives => list(data_dir),
        CtlCommand::CancelRedrive { id } => api_request(
            data_dir,
            "DELETE",
            &format!("/v1/redrives/{id}"),
            None,
            Vec::new(),
        )
        .map(|(status, body)| {
            if status == 200 {
                println!("{}", line(&body));
                0
            } else {
                api_failure(status, &body)
            }
        }),
        _ => return None,
    })
}

fn redrive(data_dir: &Path, a: &RedriveArgs) -> anyhow::Result<u8> {
    let mut headers = Map::new();
    for h in &a.headers {
        let Some((k, v)) = h.split_once('=') else {
            eprintln!("Error:\n--header takes NAME=VALUE, got '{h}'");
            return Ok(64);
        };
        headers.insert(k.to_string(), Value::String(v.to_string()));
    }
    let mut body = json!({
        "destination": a.to,
        "max_messages": a.max_messages,
        "filter": {
            "origin": a.origin,
            "reason": a.reason,
            "routing_key": a.routing_key,
            "headers": headers,
        },
    });
    if let Some(rate) = a.rate {
        body["rate"] = json!(rate);
    }
    println!(
        "Redriving messages of queue \"{}\" in vhost \"{}\" to {} ...",
        a.queue,
        a.vhost,
        a.to.as_deref().map_or_else(
            || "their x-death origins".to_string(),
            |to| format!("\"{to}\"")
        )
    );
    let (status, task) = api_request(
        data_dir,
        "POST",
        &format!("/v1/queues/{}/{}/redrive", seg(&a.vhost), seg(&a.queue)),
        Some(body),
        Vec::new(),
    )?;
    if status != 202 {
        return Ok(api_failure(status, &task));
    }
    let id = task["id"].as_u64().unwrap_or_default();
    if a.no_wait {
        println!("{}", line(&task));
        return Ok(0);
    }
    let mut last = String::new();
    loop {
        let (status, task) = api_request(
            data_dir,
            "GET",
            &format!("/v1/redrives/{id}"),
            None,
            Vec::new(),
        )?;
        if status != 200 {
            return Ok(api_failure(status, &task));
        }
        let now = line(&task);
        if now != last {
            println!("{now}");
            last = now;
        }
        match task["status"].as_str() {
            Some("RUNNING") => std::thread::sleep(PROGRESS_EVERY),
            Some("COMPLETED") => return Ok(0),
            Some("CANCELLED") => return Ok(1),
            _ => {
                eprintln!(
                    "Error:\n{}",
                    task["error"].as_str().unwrap_or("the redrive failed")
                );
                return Ok(70);
            }
        }
    }
}

/// One task as a line: id, status and counts.
fn line(t: &Value) -> String {
    format!(
        "redrive {} {}: moved {}, duplicates {}, skipped {}, refused {}",
        t["id"],
        t["status"].as_str().unwrap_or("?"),
        t["moved"],
        t["duplicates"],
        t["skipped"],
        t["refused"]
    )
}

fn list(data_dir: &Path) -> anyhow::Result<u8> {
    let (status, list) = api_request(data_dir, "GET", "/v1/redrives", None, Vec::new())?;
    if status != 200 {
        return Ok(api_failure(status, &list));
    }
    println!("Listing redrives ...");
    let fields = [
        "id",
        "vhost",
        "source",
        "destination",
        "status",
        "moved",
        "duplicates",
        "skipped",
        "refused",
    ];
    let rows: Vec<Vec<String>> = list
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            fields
                .iter()
                .map(|f| match &t[*f] {
                    Value::String(s) => s.clone(),
                    Value::Null => String::new(),
                    v => v.to_string(),
                })
                .collect()
        })
        .collect();
    if !rows.is_empty() {
        println!("{}", fields.join("\t"));
    }
    for r in rows {
        println!("{}", r.join("\t"));
    }
    Ok(0)
}
