//! What this node answers when another node asks for its connections, channels, consumers
//! or totals (the peer half of the cluster-wide `/api/connections`, `/api/channels`,
//! `/api/consumers` and `/api/overview`).

use std::sync::{Arc, Weak};

use serde_json::{Value, json};
use warren_broker::node::broker::Broker;
use warren_broker::node::connections::LocalListings;
use warren_broker::node::replication::Listing;

use super::connections::{channel_json, channels_of, connection_json};
use super::consumers::consumer_entries;

/// What this node lists for other nodes' `/api/connections` and `/api/channels` (every
/// entry; the asking node applies its caller's visibility).
#[derive(Debug)]
pub struct NodeListings {
    broker: Weak<Broker>,
    node: String,
}

impl NodeListings {
    /// Listings of `broker`'s connections on node `node` (weak: the broker holds this).
    #[must_use]
    pub fn new(broker: &Arc<Broker>, node: &str) -> Self {
        Self {
            broker: Arc::downgrade(broker),
            node: node.to_string(),
        }
    }
}

impl LocalListings for NodeListings {
    fn listing(&self, kind: Listing, done: Box<dyn FnOnce(Vec<u8>) + Send>) {
        let Some(broker) = self.broker.upgrade() else {
            done(b"[]".to_vec());
            return;
        };
        let node = self.node.clone();
        let encode = |v: Vec<Value>| serde_json::to_vec(&Value::Array(v)).unwrap_or_default();
        match kind {
            Listing::Connections => done(encode(
                broker
                    .connections()
                    .list()
                    .iter()
                    .map(|h| connection_json(&node, h))
                    .collect(),
            )),
            Listing::Channels => {
                tokio::spawn(async move {
                    let chans = channels_of(broker.connections().list()).await;
                    done(encode(
                        chans
                            .iter()
                            .map(|(h, c)| channel_json(&node, h, c))
                            .collect(),
                    ));
                });
            }
            Listing::Totals => done(encode(vec![json!({
                "connections": broker.connection_count(),
                "channels": broker.channel_count(),
            })])),
            Listing::Consumers => {
                tokio::spawn(async move {
                    let chans = channels_of(broker.connections().list()).await;
                    done(encode(consumer_entries(&node, &chans)));
                });
            }
        }
    }
}
