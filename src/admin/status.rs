//! `warren ctl status`: the node's runtime, alarms, memory, disk, file descriptors, listeners
//! and totals, as `rabbitmqctl status` prints them, from the management API.

use std::path::Path;

use serde_json::Value;

use super::client::{api_failure, api_request};

/// `warren ctl status`: what `rabbitmqctl status` shows that applies to Warren, from the
/// management API's overview and node.
pub(super) fn status(data_dir: &Path) -> anyhow::Result<u8> {
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
