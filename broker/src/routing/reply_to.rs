//! Direct reply-to (`amq.rabbitmq.reply-to`): RPC replies go straight to the requester's
//! channel without a queue.
//!
//! A channel consuming from `amq.rabbitmq.reply-to` (no-ack only) gets a unique name
//! `amq.rabbitmq.reply-to.<token>`; a publish from that channel with `reply_to` set to the
//! pseudo-queue has the property rewritten to that name; a publish to the default exchange with
//! that name as routing key is handed to the channel's connection directly. Unknown names are
//! unroutable (returned if mandatory), as in RabbitMQ.
//!
//! In a cluster a name ends with `.<node number>` of the node that issued it (RabbitMQ's
//! names encode the channel's process, node included), so a reply published through any node
//! finds the requester: another node's name goes to that node (through
//! [`crate::routing::cluster::ClusterHooks::reply_outbox`]), which hands it on as here.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use parking_lot::RwLock;

use crate::message::Message;
use crate::queue::outbox::{Outbound, Outbox};

/// The pseudo-queue clients consume from and put in `reply_to`.
pub const REPLY_TO: &str = "amq.rabbitmq.reply-to";
/// Prefix of the per-channel names the broker hands out.
pub const REPLY_TO_PREFIX: &str = "amq.rabbitmq.reply-to.";

/// The name of a new reply consumer: `token` (no dots), followed by `.<node>` when this node
/// is in a cluster with that number.
#[must_use]
pub fn reply_name(token: &str, node: Option<u64>) -> String {
    debug_assert!(!token.contains('.'), "the node is the only dotted part");
    match node {
        Some(n) => format!("{REPLY_TO_PREFIX}{token}.{n}"),
        None => format!("{REPLY_TO_PREFIX}{token}"),
    }
}

/// The number of the node that issued reply name `name` (None: not a reply name, or one
/// issued outside a cluster).
#[must_use]
pub fn reply_node(name: &str) -> Option<u64> {
    let (_, node) = name.strip_prefix(REPLY_TO_PREFIX)?.rsplit_once('.')?;
    node.parse().ok()
}

#[derive(Debug, Clone)]
struct Route {
    outbox: Weak<Outbox>,
    channel: u16,
    epoch: u64,
}

/// Reply names of one vhost and where they lead.
#[derive(Debug, Default)]
pub struct Replies {
    routes: RwLock<HashMap<String, Route>>,
}

impl Replies {
    /// `name` now leads to `channel` (incarnation `epoch`) of the connection owning `outbox`.
    pub fn register(&self, name: &str, outbox: &Arc<Outbox>, channel: u16, epoch: u64) {
        self.routes.write().insert(
            name.to_string(),
            Route {
                outbox: Arc::downgrade(outbox),
                channel,
                epoch,
            },
        );
    }

    /// Forget `name` (consumer cancelled, channel or connection closed).
    pub fn unregister(&self, name: &str) {
        self.routes.write().remove(name);
    }

    /// Whether `name` leads to a live reply consumer.
    #[must_use]
    pub fn contains(&self, name: &str) -> bool {
        self.routes
            .read()
            .get(name)
            .is_some_and(|r| r.outbox.strong_count() > 0)
    }

    /// Hand `message` to the requester named by its routing key; false if there is none.
    pub fn deliver(&self, message: &Arc<Message>) -> bool {
        let route = self.routes.read().get(&message.routing_key).cloned();
        match route.and_then(|r| r.outbox.upgrade().map(|o| (o, r))) {
            Some((outbox, r)) => {
                outbox.push(Outbound::Reply {
                    channel: r.channel,
                    epoch: r.epoch,
                    message: Arc::clone(message),
                });
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_name_says_which_node_issued_it() {
        let clustered = reply_name("AbC-_9", Some(7));
        assert_eq!(clustered, "amq.rabbitmq.reply-to.AbC-_9.7");
        assert_eq!(reply_node(&clustered), Some(7));
        assert_eq!(reply_node(&reply_name("AbC-_9", None)), None);
        assert_eq!(reply_node("amq.rabbitmq.reply-to.x.notanumber"), None);
        assert_eq!(reply_node("some.queue.7"), None);
    }
}
