//! The `warren ctl` side of the admin socket, shared by every verb: sending a request and
//! reading its reply, management API calls through it, percent-encoding path segments, and
//! rabbitmqctl's exit codes for what the broker refused.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;

use anyhow::Context;
use serde_json::Value;
use warren_broker::users::UserError;

use super::protocol::{Request, socket_path};

/// rabbitmqctl's exit codes for the errors it reports (sysexits).
pub(crate) fn exit_code(e: &UserError) -> u8 {
    match e {
        UserError::NoSuchUser(_) => 67,
        UserError::NoSuchVhost(_) | UserError::BadPattern(..) | UserError::Algorithm(_) => 69,
        UserError::QueueType(_) => 64,
        UserError::Exists(_) => 70,
    }
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
pub(super) fn send(data_dir: &Path, request: &Request) -> anyhow::Result<Value> {
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
