//! Prometheus metrics under RabbitMQ's names (rabbitmq_prometheus), so that the official
//! Grafana dashboards, which join on `rabbitmq_identity_info`, work: `/metrics` with
//! node-wide totals and `/metrics/per-object` with one series per queue.

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus::{Encoder, GaugeVec, Opts, Registry, TextEncoder};

use crate::AppState;

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(aggregated))
        .route("/metrics/per-object", get(per_object))
        .with_state(state)
}

/// A registry filled at scrape time: metrics are read from the broker when asked, so nothing
/// is counted twice and nothing is kept between scrapes.
struct Scrape {
    registry: Registry,
}

impl Scrape {
    fn new() -> Self {
        Self {
            registry: Registry::new(),
        }
    }

    fn gauge(&self, name: &str, help: &str, labels: &[&str]) -> Option<GaugeVec> {
        let g = GaugeVec::new(Opts::new(name, help), labels).ok()?;
        self.registry.register(Box::new(g.clone())).ok()?;
        Some(g)
    }

    fn set(&self, name: &str, help: &str, value: f64) {
        if let Some(g) = self.gauge(name, help, &[]) {
            g.with_label_values::<&str>(&[]).set(value);
        }
    }

    fn counter(&self, name: &str, help: &str, value: u64) {
        if let Ok(c) = prometheus::IntCounter::new(name, help)
            && self.registry.register(Box::new(c.clone())).is_ok()
        {
            c.inc_by(value);
        }
    }

    fn render(&self) -> Response {
        let mut buf = Vec::new();
        if TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .is_err()
        {
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        }
        (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            buf,
        )
            .into_response()
    }
}

/// What both endpoints carry: identity, build, node resources, alarms and object counts.
fn common(state: &AppState, s: &Scrape) {
    let node = state.node.node.as_str();
    if let Some(g) = s.gauge(
        "rabbitmq_identity_info",
        "RabbitMQ node & cluster identity info",
        &[
            "rabbitmq_node",
            "rabbitmq_cluster",
            "rabbitmq_cluster_permanent_id",
        ],
    ) {
        g.with_label_values(&[node, &state.node.cluster_name, &state.node.cluster_name])
            .set(1.0);
    }
    if let Some(g) = s.gauge(
        "rabbitmq_build_info",
        "RabbitMQ & Erlang/OTP version info",
        &["rabbitmq_version", "product_name", "product_version"],
    ) {
        g.with_label_values(&["4.2.0", "Warren", env!("CARGO_PKG_VERSION")])
            .set(1.0);
    }
    let b = &state.broker;
    s.set(
        "rabbitmq_connections",
        "Connections currently open",
        b.connection_count() as f64,
    );
    s.set(
        "rabbitmq_channels",
        "Channels currently open",
        b.channel_count() as f64,
    );
    let alarms = b.alarms();
    let st = alarms.state();
    let w = alarms.watermarks();
    if let Some(sample) = alarms.last_sample() {
        s.set(
            "rabbitmq_process_resident_memory_bytes",
            "Memory used in bytes",
            sample.memory_used as f64,
        );
        s.set(
            "rabbitmq_resident_memory_limit_bytes",
            "Memory high watermark in bytes",
            w.memory_limit(sample.memory_total) as f64,
        );
        s.set(
            "rabbitmq_disk_space_available_bytes",
            "Disk space available in bytes",
            sample.disk_free as f64,
        );
        s.set(
            "rabbitmq_disk_space_available_limit_bytes",
            "Free disk space low watermark in bytes",
            w.disk_limit(sample.memory_total) as f64,
        );
    }
    let t = b.stats().snapshot();
    for (name, help, v) in [
        (
            "rabbitmq_global_messages_received_total",
            "Total number of messages received from publishers",
            t.published,
        ),
        (
            "rabbitmq_global_messages_delivered_total",
            "Total number of messages delivered to consumers",
            t.delivered + t.got,
        ),
        (
            "rabbitmq_global_messages_redelivered_total",
            "Total number of messages redelivered to consumers",
            t.redelivered,
        ),
        (
            "rabbitmq_global_messages_acknowledged_total",
            "Total number of messages acknowledged by consumers",
            t.acked,
        ),
        (
            "rabbitmq_global_messages_confirmed_total",
            "Total number of messages confirmed to publishers",
            t.confirmed,
        ),
    ] {
        s.counter(name, help, v);
    }
    s.set(
        "rabbitmq_alarms_memory_used_watermark",
        "is 1 if VM memory watermark alarm is in effect",
        f64::from(u8::from(st.memory)),
    );
    s.set(
        "rabbitmq_alarms_free_disk_space_watermark",
        "is 1 if free disk space watermark alarm is in effect",
        f64::from(u8::from(st.disk)),
    );
}

/// Per-queue series, or their sums when `per_object` is false (RabbitMQ aggregates
/// per-object metrics by default on `/metrics`).
fn queues(state: &AppState, s: &Scrape, per_object: bool) {
    const SERIES: [(&str, &str); 5] = [
        (
            "rabbitmq_queue_messages_ready",
            "Messages ready to be delivered to consumers",
        ),
        (
            "rabbitmq_queue_messages_unacked",
            "Messages delivered to consumers but not yet acknowledged",
        ),
        (
            "rabbitmq_queue_messages",
            "Sum of ready and unacknowledged messages - total queue depth",
        ),
        (
            "rabbitmq_queue_messages_bytes",
            "Size in bytes of ready and unacknowledged messages",
        ),
        ("rabbitmq_queue_consumers", "Consumers on a queue"),
    ];
    let labels: &[&str] = if per_object { &["vhost", "queue"] } else { &[] };
    let gauges: Vec<Option<GaugeVec>> = SERIES
        .iter()
        .map(|(name, help)| s.gauge(name, help, labels))
        .collect();
    let mut sums = [0.0f64; 5];
    let mut count = 0u64;
    for name in state.broker.list_vhosts() {
        let Some(vh) = state.broker.vhost(&name) else {
            continue;
        };
        for q in vh.queues() {
            count += 1;
            let st = q.stats();
            let values = [
                st.ready as f64,
                st.unacked as f64,
                (st.ready + st.unacked) as f64,
                (st.ready_bytes + st.unacked_bytes) as f64,
                st.consumers as f64,
            ];
            for (i, v) in values.iter().enumerate() {
                sums[i] += v;
                if per_object && let Some(g) = &gauges[i] {
                    g.with_label_values(&[vh.name.as_str(), q.name.as_str()])
                        .set(*v);
                }
            }
        }
    }
    if !per_object {
        for (g, v) in gauges.iter().zip(sums) {
            if let Some(g) = g {
                g.with_label_values::<&str>(&[]).set(v);
            }
        }
    }
    s.set("rabbitmq_queues", "Queues available", count as f64);
}

async fn aggregated(State(state): State<AppState>) -> Response {
    let s = Scrape::new();
    common(&state, &s);
    queues(&state, &s, false);
    s.render()
}

async fn per_object(State(state): State<AppState>) -> Response {
    let s = Scrape::new();
    common(&state, &s);
    queues(&state, &s, true);
    s.render()
}
