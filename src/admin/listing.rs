//! `warren ctl list_*` verbs backed by one management API listing: which path and default
//! columns each reads, and how a cell is printed under rabbitmqctl's column names.

use serde_json::Value;

use super::client::percent_segment;
use super::command::CtlCommand;

/// A listing through the management API: (banner, API path, default columns).
pub(super) fn api_listing(
    command: &CtlCommand,
) -> Option<(String, String, Vec<&'static str>, &[String])> {
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

/// One cell of a listing, from the API object, with rabbitmqctl's column names.
pub(super) fn cell(item: &Value, column: &str) -> String {
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
