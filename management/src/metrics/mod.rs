//! Prometheus metrics under RabbitMQ's names (rabbitmq_prometheus), so that the official
//! Grafana dashboards, which join on `rabbitmq_identity_info`, work:
//!
//! - `/metrics`: node-wide totals, per-queue series summed (RabbitMQ's aggregated default);
//! - `/metrics/per-object`: one series per queue;
//! - `/metrics/detailed?family=..&vhost=..`: only the asked families, `rabbitmq_detailed_`
//!   prefix, filtered by vhost, as RabbitMQ's detailed endpoint.
//!
//! Warren's own series (`warren_*`): the oldest ready message's age per queue, and histograms of
//! publish-to-confirm latency, segment fsync and commit latency, and group-commit sizes.
//!
//! This file holds the endpoints, the scrape registry and the queue rows read once per scrape;
//! the series are by family: [`node`] (identity, resources, alarms, message counters,
//! lifecycle, histograms), [`queues`] (per-queue series), [`streams`] and [`raft`].

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::sync::Arc;

use axum::Router;
use axum::extract::{RawQuery, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus::{GaugeVec, IntCounterVec, Opts, Registry};
use warren_broker::queue::{Queue, QueueStats};
use warren_store::histogram::HistogramSnapshot;

use crate::AppState;
use node::{identity, node};
use queues::{Family, OLDEST_READY, OLDEST_READY_HELP, QUEUE_SERIES, oldest_ready_seconds, queues};

mod groups;
mod node;
mod queues;
mod raft;
mod streams;
mod work;

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(aggregated))
        .route("/metrics/per-object", get(per_object))
        .route("/metrics/detailed", get(detailed))
        .with_state(state)
}

/// The protocol label RabbitMQ puts on its global counters.
const PROTOCOL: (&str, &str) = ("protocol", "amqp091");

/// A registry filled at scrape time: metrics are read from the broker when asked, so nothing
/// is counted twice and nothing is kept between scrapes.
struct Scrape {
    registry: Registry,
    /// Histograms, written in the text format directly (their buckets come ready-made from
    /// lock-free recorders, which the prometheus crate's types cannot take).
    histograms: String,
}

impl Scrape {
    fn new() -> Self {
        Self {
            registry: Registry::new(),
            histograms: String::new(),
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

    fn counters(&self, name: &str, help: &str, labels: &[&str]) -> Option<IntCounterVec> {
        let c = IntCounterVec::new(Opts::new(name, help), labels).ok()?;
        self.registry.register(Box::new(c.clone())).ok()?;
        Some(c)
    }

    fn counter(&self, name: &str, help: &str, value: u64) {
        if let Some(c) = self.counters(name, help, &[]) {
            c.with_label_values::<&str>(&[]).inc_by(value);
        }
    }

    /// A counter with RabbitMQ's `protocol="amqp091"` label.
    fn protocol_counter(&self, name: &str, help: &str, value: u64) {
        if let Some(c) = self.counters(name, help, &[PROTOCOL.0]) {
            c.with_label_values(&[PROTOCOL.1]).inc_by(value);
        }
    }

    fn histogram(&mut self, name: &str, help: &str, h: &HistogramSnapshot) {
        let out = &mut self.histograms;
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bound, n) in &h.cumulative {
            if bound.is_infinite() {
                let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
            } else {
                let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {n}");
            }
        }
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", h.sum, h.count);
    }

    fn render(&self) -> Response {
        let mut buf = String::new();
        crate::prom_text::encode(&self.registry.gather(), &mut buf);
        buf.push_str(&self.histograms);
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

/// One queue's numbers, read once per scrape.
struct QueueRow {
    vhost: String,
    queue: Arc<Queue>,
    stats: QueueStats,
}

/// Every queue (of `vhosts`, when given) with its stats.
fn queue_rows(state: &AppState, vhosts: Option<&BTreeSet<String>>) -> Vec<QueueRow> {
    let mut rows = Vec::new();
    for name in state.broker.list_vhosts() {
        if vhosts.is_some_and(|v| !v.contains(&name)) {
            continue;
        }
        let Some(vh) = state.broker.vhost(&name) else {
            continue;
        };
        // A classic queue held on another node is that node's to report: a Prometheus
        // scraping every node sees it once.
        for queue in vh.queues().into_iter().filter(|q| !q.is_remote()) {
            let stats = queue.stats();
            rows.push(QueueRow {
                vhost: vh.name.clone(),
                queue,
                stats,
            });
        }
    }
    rows
}

async fn aggregated(State(state): State<AppState>) -> Response {
    let mut s = Scrape::new();
    let rows = queue_rows(&state, None);
    node(&state, &mut s, &rows);
    queues(&state, &mut s, &rows, false);
    s.render()
}

async fn per_object(State(state): State<AppState>) -> Response {
    let mut s = Scrape::new();
    let rows = queue_rows(&state, None);
    node(&state, &mut s, &rows);
    queues(&state, &mut s, &rows, true);
    s.render()
}

/// RabbitMQ's `/metrics/detailed`: only the families asked for (`family=`, repeatable), of
/// the vhosts asked for (`vhost=`, repeatable; all when absent), with the `rabbitmq_detailed_`
/// prefix; identity and build always. Families Warren does not have are ignored, as RabbitMQ
/// ignores unknown ones. Warren's oldest-ready age comes with `queue_metrics`.
async fn detailed(State(state): State<AppState>, RawQuery(query): RawQuery) -> Response {
    let mut families = Vec::new();
    let mut vhosts = BTreeSet::new();
    for (k, v) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match &*k {
            "family" => families.extend(Family::parse(&v)),
            "vhost" => {
                vhosts.insert(v.into_owned());
            }
            _ => {}
        }
    }
    let s = Scrape::new();
    identity(&state, &s);
    if !families.is_empty() {
        let rows = queue_rows(&state, (!vhosts.is_empty()).then_some(&vhosts));
        for (name, help, family, counter, value) in QUEUE_SERIES {
            if !families.contains(family) {
                continue;
            }
            let name = format!("rabbitmq_detailed_{name}");
            let labels = ["vhost", "queue"];
            if *counter {
                if let Some(c) = s.counters(&name, help, &labels) {
                    for r in &rows {
                        c.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                            .inc_by(value(&r.stats) as u64);
                    }
                }
            } else if let Some(g) = s.gauge(&name, help, &labels) {
                for r in &rows {
                    g.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                        .set(value(&r.stats));
                }
            }
        }
        if families.contains(&Family::Queue)
            && let Some(g) = s.gauge(
                &format!("warren_detailed_{OLDEST_READY}"),
                OLDEST_READY_HELP,
                &["vhost", "queue"],
            )
        {
            for r in &rows {
                g.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                    .set(oldest_ready_seconds(&r.stats));
            }
        }
    }
    s.render()
}

/// One per-queue series `(name, help, is a counter, aggregate by maximum)` of `value`:
/// labelled (`vhost`, `queue`) when `per_object`, else one series of the sum (or the
/// maximum, for ages: a sum of ages means nothing).
fn per_queue(
    s: &Scrape,
    rows: &[QueueRow],
    labels: &[&str],
    per_object: bool,
    (name, help, counter, max): (&str, &str, bool, bool),
    value: fn(&QueueStats) -> f64,
) {
    if counter {
        let Some(c) = s.counters(name, help, labels) else {
            return;
        };
        if per_object {
            for r in rows {
                c.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                    .inc_by(value(&r.stats) as u64);
            }
        } else {
            c.with_label_values::<&str>(&[])
                .inc_by(rows.iter().map(|r| value(&r.stats) as u64).sum());
        }
        return;
    }
    let Some(g) = s.gauge(name, help, labels) else {
        return;
    };
    if per_object {
        for r in rows {
            g.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                .set(value(&r.stats));
        }
    } else {
        let values = rows.iter().map(|r| value(&r.stats));
        g.with_label_values::<&str>(&[]).set(if max {
            values.fold(0.0, f64::max)
        } else {
            values.sum()
        });
    }
}
