//! Deliveries from the classic queues held here to consumers attached on a peer: one
//! [`Pump`] per peer, whose outbox is those consumers' sink in the queues here, drained by a
//! task that sends what it holds to the peer in batches. Direct replies published here for
//! requesters on that peer travel the same way, in order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use warren_broker::node::replication::{encode_loaded, encode_message};
use warren_broker::queue::Queue;
use warren_broker::queue::machine::{ConsumerId, MsgId};
use warren_broker::queue::outbox::{Outbound, Outbox};

use crate::transport::tcp::{ClassicPeer, RemoteEvent};
use crate::types::NodeId;

use super::super::ClusterNode;

/// Most bytes of messages sent to a peer in one request (well below the frame limit).
pub(super) const DELIVER_BATCH_BYTES_MAX: usize = 4 * 1024 * 1024;
/// The pause before a delivery the peer did not answer is sent again.
const RESEND_PAUSE: Duration = Duration::from_millis(200);

/// One peer's consumers of the classic queues held here.
pub(in crate::node) struct Pump {
    /// Their sink in the queues here.
    pub(in crate::node) outbox: Arc<Outbox>,
    /// Each consumer's queue (vhost, name), for the cancellations the outbox carries
    /// without one.
    pub(super) consumers: Mutex<HashMap<ConsumerId, (String, String)>>,
}

/// A delivery sent, to take back if the peer has no such consumer.
struct Sent {
    consumer: ConsumerId,
    queue: Arc<Queue>,
    id: MsgId,
}

impl ClusterNode {
    /// The pump of `peer`'s consumers, started on first use.
    pub(in crate::node) fn pump(self: &Arc<Self>, peer: NodeId) -> Arc<Pump> {
        let mut pumps = self.pumps.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = pumps.get(&peer) {
            return Arc::clone(p);
        }
        let pump = Arc::new(Pump {
            outbox: Arc::new(Outbox::default()),
            consumers: Mutex::new(HashMap::new()),
        });
        pumps.insert(peer, Arc::clone(&pump));
        tokio::spawn(run(Arc::downgrade(self), peer, Arc::clone(&pump)));
        pump
    }
}

/// Drain `pump`'s outbox to `peer` for as long as the node runs.
async fn run(node: Weak<ClusterNode>, peer: NodeId, pump: Arc<Pump>) {
    let mut conn: Option<ClassicPeer> = None;
    let mut items = Vec::new();
    loop {
        pump.outbox.drain(&mut items);
        if items.is_empty() {
            pump.outbox.notified().await;
            continue;
        }
        let Some(n) = node.upgrade() else {
            return;
        };
        let (batches, sent) = events(&pump, std::mem::take(&mut items));
        for (events, sent) in batches.into_iter().zip(sent) {
            send(&n, peer, &mut conn, events, sent).await;
        }
    }
}

/// What `items` send to the peer, in batches of at most [`DELIVER_BATCH_BYTES_MAX`].
fn events(pump: &Pump, items: Vec<Outbound>) -> (Vec<Vec<RemoteEvent>>, Vec<Vec<Sent>>) {
    let mut batches = vec![Vec::new()];
    let mut sent = vec![Vec::new()];
    let mut bytes = 0usize;
    for item in items {
        let event = match item {
            Outbound::Deliver(d) => {
                let message = match d.message.load() {
                    Ok(loaded) => encode_loaded(&loaded),
                    Err(e) => {
                        // As a local consumer's connection does with an unreadable record.
                        tracing::error!(queue = %d.queue.name, error = %e, "an unreadable message is dropped");
                        d.queue.discard(vec![d.id], None);
                        continue;
                    }
                };
                bytes += message.len();
                let last = sent.len() - 1;
                sent[last].push(Sent {
                    consumer: d.consumer,
                    queue: Arc::clone(&d.queue),
                    id: d.id,
                });
                RemoteEvent::Deliver {
                    vhost: d.queue.vhost.clone(),
                    queue: d.queue.name.clone(),
                    consumer: d.consumer,
                    id: d.id,
                    message,
                    redelivered: d.redelivered,
                    delivery_count: d.delivery_count,
                }
            }
            Outbound::Cancel { consumer, .. } => {
                let known = pump
                    .consumers
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&consumer);
                let Some((vhost, queue)) = known else {
                    continue;
                };
                RemoteEvent::Cancel {
                    vhost,
                    queue,
                    consumer,
                }
            }
            Outbound::PeerReply { vhost, message } => {
                let message = encode_message(&message);
                bytes += message.len();
                RemoteEvent::Reply { vhost, message }
            }
            // Confirms, commits and replies go to the proxy's own connections there.
            _ => continue,
        };
        let last = batches.len() - 1;
        batches[last].push(event);
        if bytes >= DELIVER_BATCH_BYTES_MAX {
            batches.push(Vec::new());
            sent.push(Vec::new());
            bytes = 0;
        }
    }
    (batches, sent)
}

/// Send one batch, again while the peer is up and did not answer; deliveries to consumers the
/// peer does not have go back to their queues, and so do those of a batch given up (the peer
/// down, or not dialable): "down" is this node's view of the moment, which need not last
/// until the watch detaches the peer's consumers, and a delivery dropped while its consumer
/// stays attached here would stay checked out to it for good. A delivery given back that the
/// peer did take (its answer lost) is delivered again, redelivered; so is one sent again (the
/// soak saw a batch whose answer was lost to a cut reach the same consumer twice).
async fn send(
    node: &Arc<ClusterNode>,
    peer: NodeId,
    conn: &mut Option<ClassicPeer>,
    mut events: Vec<RemoteEvent>,
    sent: Vec<Sent>,
) {
    if events.is_empty() {
        return;
    }
    let mut attempt = 0u32;
    loop {
        let down = node.is_down(peer);
        if conn.is_none() && !down {
            *conn = node.classic_peer(peer);
        }
        let Some(c) = conn.as_mut().filter(|_| !down) else {
            // Down, or not dialable.
            // Not at once: the consumer may still be attached here, and what goes back would
            // be delivered to it again straight away.
            tokio::time::sleep(RESEND_PAUSE).await;
            for s in &sent {
                s.queue.give_back(vec![s.id]);
            }
            return;
        };
        if attempt == 1 {
            // The peer may have handed the first attempt's deliveries to their consumers (its
            // answer lost): as again, they may have been delivered before.
            for e in &mut events {
                if let RemoteEvent::Deliver { redelivered, .. } = e {
                    *redelivered = true;
                }
            }
        }
        attempt = attempt.saturating_add(1);
        match tokio::time::timeout(super::super::FORWARD_REPLY_MAX, c.deliver(events.clone())).await
        {
            Ok(Ok(unknown)) => {
                if !unknown.is_empty() {
                    for s in sent.iter().filter(|s| unknown.contains(&s.consumer)) {
                        s.queue.give_back(vec![s.id]);
                    }
                }
                return;
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "deliveries to a peer failed"),
            Err(_) => tracing::debug!("a peer did not take its deliveries in time"),
        }
        *conn = None;
        tokio::time::sleep(RESEND_PAUSE).await;
    }
}
