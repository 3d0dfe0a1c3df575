//! The node's open AMQP connections, for the management API: what each is, and a way to ask
//! one to close (`DELETE /api/connections/{name}`). The connection task owns the socket; the
//! registry only holds a handle it polls.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use amq_protocol::types::FieldTable;
use parking_lot::Mutex;
use tokio::sync::Notify;

/// What a connection is, fixed when it opened.
#[derive(Debug, Clone)]
pub struct ConnectionInfo {
    /// RabbitMQ's connection name: `peer -> local`.
    pub name: String,
    /// The authenticated user.
    pub user: String,
    /// The vhost it opened.
    pub vhost: String,
    /// Client address.
    pub peer: SocketAddr,
    /// Our address it connected to.
    pub local: SocketAddr,
    /// Over TLS.
    pub tls: bool,
    /// The client's properties from connection.start-ok.
    pub client_properties: FieldTable,
    /// Wall-clock milliseconds when it opened.
    pub connected_at_ms: u64,
    /// Negotiated frame_max.
    pub frame_max: u32,
    /// Negotiated channel_max.
    pub channel_max: u16,
    /// Negotiated heartbeat in seconds (0: none).
    pub heartbeat_s: u16,
}

/// One channel as the management API shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ChannelInfo {
    /// Channel number.
    pub number: u16,
    /// basic.qos prefetch for new consumers (global=false).
    pub prefetch_count: u32,
    /// basic.qos prefetch shared by the channel (global=true).
    pub global_prefetch_count: u32,
    /// Deliveries not yet acked.
    pub unacked: u64,
    /// In confirm mode.
    pub confirm: bool,
    /// In tx mode.
    pub transactional: bool,
    /// Its consumers.
    pub consumers: Vec<ConsumerInfo>,
}

/// One consumer as the management API shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsumerInfo {
    /// Consumer tag.
    pub tag: String,
    /// Queue consumed from.
    pub queue: String,
    /// Whether deliveries need acks.
    pub ack_required: bool,
    /// basic.consume's `exclusive`.
    pub exclusive: bool,
    /// basic.consume's arguments as the client gave them.
    pub arguments: FieldTable,
    /// The per-consumer prefetch it runs with (0: unlimited).
    pub prefetch_count: u32,
}

/// A pending request for a connection's channels.
type SnapshotRequest = tokio::sync::oneshot::Sender<Vec<ChannelInfo>>;

/// One registered connection.
#[derive(Debug)]
pub struct ConnectionHandle {
    /// Its facts.
    pub info: ConnectionInfo,
    channels: AtomicU64,
    close_reason: Mutex<Option<String>>,
    close: Notify,
    snapshot_requests: Mutex<Vec<SnapshotRequest>>,
    snapshot: Notify,
}

impl ConnectionHandle {
    /// Open channels (kept current by the connection task).
    #[must_use]
    pub fn channels(&self) -> u64 {
        self.channels.load(Ordering::Relaxed)
    }

    /// Record the open channel count.
    pub fn set_channels(&self, n: u64) {
        self.channels.store(n, Ordering::Relaxed);
    }

    /// Whether a close was requested: the connection is going, and listings leave it out (as
    /// RabbitMQ's, where a connection closed through the API is gone from the next listing).
    #[must_use]
    pub fn is_closing(&self) -> bool {
        self.close_reason.lock().is_some()
    }

    /// Ask the connection to close with 320 CONNECTION_FORCED and `reason`.
    pub fn request_close(&self, reason: String) {
        *self.close_reason.lock() = Some(reason);
        self.close.notify_one();
    }

    /// Ask the connection task for its channels; `None` if it does not answer (it closed).
    pub async fn channels_snapshot(&self) -> Option<Vec<ChannelInfo>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.snapshot_requests.lock().push(tx);
        self.snapshot.notify_one();
        rx.await.ok()
    }

    /// Resolves once a snapshot was asked for (the connection task then calls
    /// [`ConnectionHandle::answer_snapshots`]).
    pub async fn snapshot_requested(&self) {
        loop {
            if !self.snapshot_requests.lock().is_empty() {
                return;
            }
            self.snapshot.notified().await;
        }
    }

    /// Answer every pending snapshot request with `channels`.
    pub fn answer_snapshots(&self, channels: &[ChannelInfo]) {
        for tx in self.snapshot_requests.lock().drain(..) {
            let _ = tx.send(channels.to_vec());
        }
    }

    /// Resolves once a close was requested; returns the reason.
    pub async fn close_requested(&self) -> String {
        loop {
            if let Some(r) = self.close_reason.lock().clone() {
                return r;
            }
            self.close.notified().await;
        }
    }
}

/// The registry.
#[derive(Debug, Default)]
pub struct Connections {
    by_id: Mutex<HashMap<u64, Arc<ConnectionHandle>>>,
}

impl Connections {
    /// Register a connection that completed connection.open.
    pub fn register(&self, id: u64, info: ConnectionInfo) -> Arc<ConnectionHandle> {
        let h = Arc::new(ConnectionHandle {
            info,
            channels: AtomicU64::new(0),
            close_reason: Mutex::new(None),
            close: Notify::new(),
            snapshot_requests: Mutex::new(Vec::new()),
            snapshot: Notify::new(),
        });
        self.by_id.lock().insert(id, Arc::clone(&h));
        h
    }

    /// Remove a connection that ended.
    pub fn remove(&self, id: u64) {
        self.by_id.lock().remove(&id);
    }

    /// Every open connection not asked to close, sorted by name.
    #[must_use]
    pub fn list(&self) -> Vec<Arc<ConnectionHandle>> {
        let mut v: Vec<_> = self
            .by_id
            .lock()
            .values()
            .filter(|h| !h.is_closing())
            .cloned()
            .collect();
        v.sort_by(|a, b| a.info.name.cmp(&b.info.name));
        v
    }

    /// The connection with this name.
    #[must_use]
    pub fn find(&self, name: &str) -> Option<Arc<ConnectionHandle>> {
        self.by_id
            .lock()
            .values()
            .find(|h| h.info.name == name)
            .cloned()
    }
}

/// What this node's management layer lists when another node asks (registered with
/// [`crate::node::broker::Broker::set_local_listings`]: the broker cannot import the layer
/// that renders its API).
pub trait LocalListings: Send + Sync + std::fmt::Debug {
    /// This node's `kind` as a JSON array (UTF-8), every entry (the asking node filters by
    /// its caller); `done` gets it.
    fn listing(
        &self,
        kind: crate::routing::cluster::Listing,
        done: Box<dyn FnOnce(Vec<u8>) + Send>,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str) -> ConnectionInfo {
        let addr: SocketAddr = ([127, 0, 0, 1], 5672).into();
        ConnectionInfo {
            name: name.into(),
            user: "guest".into(),
            vhost: "/".into(),
            peer: addr,
            local: addr,
            tls: false,
            client_properties: FieldTable::default(),
            connected_at_ms: 0,
            frame_max: 4096,
            channel_max: 2047,
            heartbeat_s: 0,
        }
    }

    #[tokio::test]
    async fn registered_connections_are_listed_found_and_closed() {
        let c = Connections::default();
        let b = c.register(2, info("b"));
        c.register(1, info("a"));
        let names: Vec<String> = c.list().iter().map(|h| h.info.name.clone()).collect();
        assert_eq!(names, ["a", "b"]);
        assert!(c.find("b").is_some());
        if let Some(h) = c.find("b") {
            h.request_close("bye".into());
        }
        assert_eq!(b.close_requested().await, "bye");
        c.remove(2);
        assert!(c.find("b").is_none());
    }

    #[tokio::test]
    async fn snapshot_requests_are_answered_by_the_connection_task() {
        let c = Connections::default();
        let h = c.register(1, info("a"));
        let task = {
            let h = Arc::clone(&h);
            tokio::spawn(async move {
                h.snapshot_requested().await;
                h.answer_snapshots(&[ChannelInfo {
                    number: 1,
                    prefetch_count: 10,
                    global_prefetch_count: 0,
                    unacked: 2,
                    confirm: true,
                    transactional: false,
                    consumers: Vec::new(),
                }]);
            })
        };
        let got = h.channels_snapshot().await.unwrap_or_default();
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].number, got[0].unacked), (1, 2));
        let _ = task.await;
    }
}
