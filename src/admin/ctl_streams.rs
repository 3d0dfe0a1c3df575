//! `warren ctl add_super_stream` and `delete_super_stream` (rabbitmq-streams' verbs), called in
//! process over the admin socket through `/api/stream/super-streams/{vhost}/{name}`.

use std::path::Path;

use serde_json::{Map, Value, json};

use super::client::{api_failure, api_request, percent_segment as seg};
use super::command::{CtlCommand, SuperStreamArgs};

/// Carry out a super-stream verb; None for any other command.
pub fn run(data_dir: &Path, command: &CtlCommand) -> Option<anyhow::Result<u8>> {
    Some(match command {
        CtlCommand::AddSuperStream(a) => add(data_dir, a),
        CtlCommand::DeleteSuperStream { name, vhost } => {
            println!("Deleting a super stream...");
            api_request(
                data_dir,
                "DELETE",
                &format!("/api/stream/super-streams/{}/{}", seg(vhost), seg(name)),
                None,
                Vec::new(),
            )
            .map(|(status, body)| {
                if status < 300 {
                    println!("Super stream {name} has been deleted");
                    0
                } else if status == 404 {
                    // rabbitmq-streams' report and status for a missing super stream.
                    eprintln!("Error:\nstream_not_found");
                    70
                } else {
                    api_failure(status, &body)
                }
            })
        }
        _ => return None,
    })
}

/// The request body `add_super_stream`'s options make.
fn body(a: &SuperStreamArgs) -> Value {
    let mut arguments = Map::new();
    let mut put = |key: &str, v: Option<Value>| {
        if let Some(v) = v {
            arguments.insert(key.to_string(), v);
        }
    };
    put("max-length-bytes", a.max_length_bytes.map(Value::from));
    put("max-age", a.max_age.clone().map(Value::from));
    put(
        "stream-max-segment-size-bytes",
        a.stream_max_segment_size_bytes.map(Value::from),
    );
    put(
        "queue-leader-locator",
        a.leader_locator.clone().map(Value::from),
    );
    put(
        "initial-cluster-size",
        a.initial_cluster_size.map(Value::from),
    );
    let mut body = json!({ "arguments": arguments });
    if let Some(n) = a.partitions {
        body["partitions"] = json!(n);
    }
    if let Some(keys) = &a.binding_keys {
        body["binding-keys"] = json!(keys);
    }
    // rabbitmq-streams: 3 partitions when neither is given.
    if a.partitions.is_none() && a.binding_keys.is_none() {
        body["partitions"] = json!(3);
    }
    body
}

fn add(data_dir: &Path, a: &SuperStreamArgs) -> anyhow::Result<u8> {
    println!("Adding a super stream...");
    let (status, reply) = api_request(
        data_dir,
        "PUT",
        &format!(
            "/api/stream/super-streams/{}/{}",
            seg(&a.vhost),
            seg(&a.name)
        ),
        Some(body(a)),
        Vec::new(),
    )?;
    if status == 400 {
        // rabbitmq-streams exits 70 when the broker refuses the super stream.
        eprintln!("Error:\n{}", reply["reason"].as_str().unwrap_or("failed"));
        return Ok(70);
    }
    if status >= 300 {
        return Ok(api_failure(status, &reply));
    }
    println!("Super stream {} has been created", a.name);
    Ok(0)
}
