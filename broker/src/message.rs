//! A published message as the broker holds it: shared, immutable, body never copied; or, for a
//! persistent message in a long durable queue, only where the store keeps it.

use std::sync::Arc;

use bytes::Bytes;
use warren_amqp::properties::Properties;
use warren_store::Location;

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

/// What a queue holds for one message: the message itself, or (stored messages beyond the head
/// of a long queue, and everything recovered at start-up) just its place in the store, read
/// back when it is delivered. The latter costs a few dozen bytes of memory per message.
#[derive(Debug, Clone)]
pub enum Entry {
    /// In memory.
    Mem(Arc<Message>),
    /// In the store only.
    Stored {
        /// The record.
        location: Location,
        /// Body size in bytes (for queue byte counts).
        size: u32,
    },
}

impl Entry {
    /// Whether the message is persistent (delivery mode 2). Stored entries always are.
    #[must_use]
    pub fn is_persistent(&self) -> bool {
        match self {
            Self::Mem(m) => m.properties.persistent(),
            Self::Stored { .. } => true,
        }
    }
}

impl MessageRef for Entry {
    fn size(&self) -> u64 {
        match self {
            Self::Mem(m) => m.body.len() as u64,
            Self::Stored { size, .. } => u64::from(*size),
        }
    }
}

/// A message ready to be written to a client: from memory, or just read from the store.
#[derive(Debug)]
pub enum Loaded {
    /// It was in memory.
    Mem(Arc<Message>),
    /// It was read from the store.
    Read(warren_store::StoredMessage),
}

impl Loaded {
    /// Exchange it was published to.
    #[must_use]
    pub fn exchange(&self) -> &[u8] {
        match self {
            Self::Mem(m) => m.exchange.as_bytes(),
            Self::Read(m) => &m.exchange,
        }
    }

    /// Routing key it was published with.
    #[must_use]
    pub fn routing_key(&self) -> &[u8] {
        match self {
            Self::Mem(m) => m.routing_key.as_bytes(),
            Self::Read(m) => &m.routing_key,
        }
    }

    /// Raw content-header properties.
    #[must_use]
    pub fn properties(&self) -> &[u8] {
        match self {
            Self::Mem(m) => &m.properties.raw,
            Self::Read(m) => &m.properties,
        }
    }

    /// Body.
    #[must_use]
    pub fn body(&self) -> &[u8] {
        match self {
            Self::Mem(m) => &m.body,
            Self::Read(m) => &m.body,
        }
    }
}

impl Entry {
    /// The message itself, reading it from `store` if only its place is held.
    ///
    /// # Errors
    /// The record cannot be read or fails its checksum (or there is no store to read from).
    pub fn load(
        &self,
        store: Option<&crate::durable::Durable>,
    ) -> Result<Loaded, warren_store::StoreError> {
        match self {
            Self::Mem(m) => Ok(Loaded::Mem(Arc::clone(m))),
            Self::Stored { location, .. } => match store {
                Some(s) => s.read(*location).map(Loaded::Read),
                None => Err(warren_store::StoreError::Corrupt {
                    path: std::path::PathBuf::new(),
                    offset: location.offset,
                    detail: "stored message without a store".into(),
                }),
            },
        }
    }
}
