//! RabbitMQ's management HTTP API (`/api/...`) and Prometheus metrics (`/metrics`) for Warren.
//!
//! The JSON field names, status codes and error bodies are RabbitMQ's, so that `rabbitmqadmin`,
//! the management UI's habits and monitoring scripts work unchanged. Requests are authenticated
//! with HTTP basic auth against the broker's users; the user's tags decide what it may do, as
//! in RabbitMQ. Changes to queues and exchanges go through an in-process AMQP session (as
//! RabbitMQ's management plugin uses a direct AMQP connection), so they get exactly the checks
//! and replies an AMQP client gets.

mod api;
mod auth;
mod direct;
mod error;
mod json;
pub mod listing;
mod metrics;
mod process;
mod prom_text;
mod properties;
pub mod rates;
mod ui;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use tokio::net::TcpListener;
use warren_broker::Broker;
use warren_broker::stats::MessageStats;

use api::RABBITMQ_API_VERSION;
pub use auth::LocalAdmin;
pub use error::ApiError;

/// Largest request body accepted (RabbitMQ's `management.http_max_body_size` default, which
/// bounds definitions uploads).
pub const REQUEST_BODY_MAX: usize = 20 * 1024 * 1024;

/// What the API reports about the node it runs on.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    /// Node name, e.g. `warren@host`.
    pub node: String,
    /// Cluster name (server-properties `cluster_name`).
    pub cluster_name: String,
    /// AMQP listeners, for `/api/overview`'s `listeners`.
    pub listeners: Vec<(String, SocketAddr)>,
    /// The largest message accepted (publishes through the API are held to it too).
    pub message_size_max: u64,
    /// The product and version advertised (`product_name`, `product_version`).
    pub identity: warren_amqp::connection::ServerIdentity,
}

/// Shared state of the HTTP handlers.
#[derive(Debug, Clone)]
pub struct AppState {
    /// The broker served.
    pub broker: Arc<Broker>,
    /// Node facts.
    pub node: Arc<NodeInfo>,
    /// Message rates, updated by [`sample_rates`].
    pub rates: Arc<std::sync::Mutex<rates::Rates>>,
    /// Per-queue message rates, updated by [`sample_rates`].
    pub queue_rates: Arc<std::sync::Mutex<rates::QueueRates>>,
    /// When the management state was made (at node start): the node's uptime.
    pub started: std::time::Instant,
}

impl AppState {
    /// State for `broker` on `node`, with no rates sampled yet.
    #[must_use]
    pub fn new(broker: Arc<Broker>, node: NodeInfo) -> Self {
        // Other nodes' `/api/connections` and `/api/channels` ask this node for its own.
        broker.set_local_listings(Arc::new(api::node_listings::NodeListings::new(
            &broker, &node.node,
        )));
        Self {
            broker,
            node: Arc::new(node),
            rates: Arc::new(std::sync::Mutex::new(rates::Rates::default())),
            queue_rates: Arc::new(std::sync::Mutex::new(rates::QueueRates::default())),
            started: std::time::Instant::now(),
        }
    }
}

/// Sample the message counters every [`rates::SAMPLE_INTERVAL`] for the API's `*_details.rate`
/// (RabbitMQ's management statistics interval is 5 s too). Runs until dropped.
pub async fn sample_rates(state: AppState) {
    let mut tick = tokio::time::interval(rates::SAMPLE_INTERVAL);
    // After a stall, one tick late rather than a burst over microseconds (rate spikes).
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let at = std::time::Instant::now();
        let now = state.broker.stats().snapshot();
        if let Ok(mut r) = state.rates.lock() {
            r.sample(at, now);
        }
        // Read every queue's counters before taking the lock: the API's readers wait on it.
        let mut samples = Vec::new();
        for name in state.broker.list_vhosts() {
            if let Some(vh) = state.broker.vhost(&name) {
                for q in vh.queues() {
                    let stats = queue_message_stats(&q.stats().counters);
                    samples.push(((vh.name.clone(), q.name.clone()), stats));
                }
            }
        }
        if let Ok(mut r) = state.queue_rates.lock() {
            r.sample(at, samples);
        }
    }
}

/// A queue's lifetime counters in the shape of the node's message statistics (what a queue
/// does not know, such as confirms and routing, stays zero).
#[must_use]
pub fn queue_message_stats(c: &warren_broker::queue::machine::Counters) -> MessageStats {
    MessageStats {
        published: c.enqueued,
        delivered: c.delivered,
        got: c.got,
        redelivered: c.redelivered,
        acked: c.acked,
        ..MessageStats::default()
    }
}

/// Make one management API request in process, as the local administrator (`warren ctl`
/// over the admin socket, whose file permissions are the authentication). Returns the status
/// and the body.
pub async fn local_call(
    state: AppState,
    method: &str,
    path: &str,
    body: Option<Vec<u8>>,
    headers: &[(String, String)],
) -> (u16, Vec<u8>) {
    use tower::ServiceExt;
    let mut builder = axum::http::Request::builder()
        .method(method)
        .uri(path)
        .header(axum::http::header::CONTENT_TYPE, "application/json");
    for (k, v) in headers {
        builder = builder.header(k.as_str(), v.as_str());
    }
    let Ok(mut req) = builder.body(axum::body::Body::from(body.unwrap_or_default())) else {
        return (400, b"bad request line".to_vec());
    };
    req.extensions_mut().insert(LocalAdmin);
    let Ok(resp) = api::router(state).oneshot(req).await;
    let status = resp.status().as_u16();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .map(|b| b.to_vec())
        .unwrap_or_default();
    (status, bytes)
}

/// The management listener's router: the API (`/api/...`) and the web UI (`/`).
pub fn management_router(state: AppState) -> Router {
    api::router(state).merge(ui::router())
}

/// The Prometheus router (`/metrics`, `/metrics/per-object`).
pub fn prometheus_router(state: AppState) -> Router {
    metrics::router(state)
}

/// Serve `router` on `listener` until the task is dropped.
///
/// # Errors
/// When the listener fails.
pub async fn serve(listener: TcpListener, router: Router) -> std::io::Result<()> {
    // The peer address reaches the handlers: loopback-only users (guest) are refused from
    // other addresses, as RabbitMQ's management plugin does.
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
}
