//! A published message as the broker holds it: shared, immutable, body never copied; or, for a
//! persistent message in a long durable queue, only where the store keeps it.

pub mod codec;

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
        /// Its priority property (kept in the store's index flags).
        priority: u8,
    },
    /// In a quorum queue's log on this node only: the body is read back through the queue's
    /// [`BodySource`] when it is delivered. `key` names it the same way on every replica (the
    /// log index of the entry that enqueued it and the command's place in that entry), so
    /// replicas at the same applied index hold the same state.
    Logged {
        /// The body's key in the log.
        key: u64,
        /// Body size in bytes.
        size: u32,
        /// Its priority property.
        priority: u8,
        /// Its own TTL (`expiration` property) in milliseconds, [`NO_TTL`] for none; longer
        /// ones are held as `NO_TTL - 1` (about 49 days).
        ttl_ms: u32,
    },
}

/// [`Entry::Logged`]'s `ttl_ms` of a message without an `expiration` property.
pub const NO_TTL: u32 = u32::MAX;

/// Where a replicated queue's [`Entry::Logged`] bodies are (its Raft log on this node).
pub trait BodySource: Send + Sync + std::fmt::Debug {
    /// The message stored under `key`.
    ///
    /// # Errors
    /// It is not there (released, or never received by this replica) or does not decode.
    fn read(&self, key: u64) -> Result<Arc<Message>, String>;
    /// The message under `key` left the queue on this replica: its body may go (once
    /// nothing else can need it; reads of it may fail from now on).
    fn release(&self, key: u64);
}

impl Entry {
    /// Whether the message is persistent (delivery mode 2). Stored entries always are.
    #[must_use]
    pub fn is_persistent(&self) -> bool {
        match self {
            Self::Mem(m) => m.properties.persistent(),
            Self::Stored { .. } | Self::Logged { .. } => true,
        }
    }
}

impl MessageRef for Entry {
    fn size(&self) -> u64 {
        match self {
            Self::Mem(m) => m.body.len() as u64,
            Self::Stored { size, .. } | Self::Logged { size, .. } => u64::from(*size),
        }
    }

    fn priority(&self) -> u8 {
        match self {
            Self::Mem(m) => m.properties.priority.unwrap_or(0),
            Self::Stored { priority, .. } | Self::Logged { priority, .. } => *priority,
        }
    }

    fn expiration_ms(&self) -> Option<u64> {
        match self {
            Self::Mem(m) => m
                .properties
                .expiration()
                .and_then(|e| std::str::from_utf8(e).ok())
                .and_then(|e| e.parse().ok()),
            // Recovered and paged-out messages keep only the queue's TTL (documented).
            Self::Stored { .. } => None,
            Self::Logged { ttl_ms, .. } => (*ttl_ms != NO_TTL).then_some(u64::from(*ttl_ms)),
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

    /// Body, shared (no copy).
    #[must_use]
    pub fn body_bytes(&self) -> Bytes {
        match self {
            Self::Mem(m) => m.body.clone(),
            Self::Read(m) => m.body.clone(),
        }
    }
}

/// A message on its way to a client (see `durable::pin`, which makes one from an [`Entry`]).
#[derive(Debug, Clone)]
pub enum Outgoing {
    /// In memory.
    Mem(Arc<Message>),
    /// Its record, held open.
    Stored {
        /// The record.
        pinned: warren_store::Pinned,
        /// Body size.
        size: u32,
    },
    /// Its record could not be opened (the store is damaged).
    Unreadable(String),
}

impl Outgoing {
    /// Body size (for consumer windows).
    #[must_use]
    pub fn size(&self) -> u64 {
        match self {
            Self::Mem(m) => m.body.len() as u64,
            Self::Stored { size, .. } => u64::from(*size),
            Self::Unreadable(_) => 0,
        }
    }

    /// The message, read from the store if needed.
    ///
    /// # Errors
    /// The record cannot be read or fails its checksum.
    pub fn load(&self) -> Result<Loaded, String> {
        match self {
            Self::Mem(m) => Ok(Loaded::Mem(Arc::clone(m))),
            Self::Stored { pinned, .. } => {
                pinned.read().map(Loaded::Read).map_err(|e| e.to_string())
            }
            Self::Unreadable(e) => Err(e.clone()),
        }
    }
}

#[cfg(test)]
mod size_tests {
    /// A queue holds one of these per message (`queue::machine::ready`'s size test assumes
    /// at most 24 bytes).
    #[test]
    fn an_entry_is_at_most_24_bytes() {
        assert!(std::mem::size_of::<super::Entry>() <= 24);
        assert_eq!(std::mem::align_of::<super::Entry>(), 8);
    }
}
