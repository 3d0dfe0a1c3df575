//! A published message as the broker holds it: shared, immutable, body never copied.

use std::sync::Arc;

use bytes::Bytes;
use warren_amqp::properties::Properties;

use crate::queue::machine::MessageRef;

/// One published message. Shared by every queue it was routed to (`Arc`), so a fanout to N
/// queues holds one body.
#[derive(Debug)]
pub struct Message {
    /// Exchange it was published to.
    pub exchange: String,
    /// Routing key it was published with.
    pub routing_key: String,
    /// Properties, raw for byte-exact forwarding.
    pub properties: Properties,
    /// Body.
    pub body: Bytes,
}

impl MessageRef for Arc<Message> {
    fn size(&self) -> u64 {
        self.body.len() as u64
    }
}
