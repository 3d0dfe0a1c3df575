//! What a connection is configured with and announces: [`ConnectionConfig`] (limits, table
//! depth, handshake deadline, the SASL [`Mechanism`]s offered), the server's identity and the
//! server-properties table of connection.start, and reading the client's capabilities from
//! its properties.

use std::time::Duration;

use amq_protocol::types::{AMQPValue, FieldTable, LongString};

use crate::limits::{self, ConnectionLimits};

/// Static configuration of the connection machine.
#[derive(Debug, Clone)]
pub struct ConnectionConfig {
    /// Limits offered in tune and enforced.
    pub limits: ConnectionLimits,
    /// Deepest field-table nesting accepted.
    pub table_depth_max: usize,
    /// The server-properties table sent in connection.start.
    pub server_properties: FieldTable,
    /// Handshake deadline.
    pub handshake_timeout: Duration,
    /// SASL mechanisms offered, in order (RabbitMQ's `auth_mechanisms`, `PLAIN AMQPLAIN` by
    /// default). `EXTERNAL` is offered only where a verified client certificate gives an
    /// identity; a mechanism not listed is refused as an unknown one.
    pub mechanisms: Vec<Mechanism>,
}

/// A SASL mechanism Warren implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mechanism {
    /// `PLAIN` (RFC 4616).
    Plain,
    /// `AMQPLAIN` (a field table with LOGIN and PASSWORD).
    Amqplain,
    /// `EXTERNAL`: the identity of the verified TLS client certificate.
    External,
}

impl Mechanism {
    /// Its name on the wire.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Plain => "PLAIN",
            Self::Amqplain => "AMQPLAIN",
            Self::External => "EXTERNAL",
        }
    }

    /// The mechanism of that name.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Plain, Self::Amqplain, Self::External]
            .into_iter()
            .find(|m| m.name() == name)
    }

    /// RabbitMQ's default `auth_mechanisms`.
    pub const DEFAULT: [Mechanism; 2] = [Mechanism::Plain, Mechanism::Amqplain];
}

impl Default for ConnectionConfig {
    fn default() -> Self {
        Self {
            limits: ConnectionLimits::default(),
            table_depth_max: limits::TABLE_DEPTH_MAX,
            server_properties: server_properties(&ServerIdentity::default(), "warren"),
            handshake_timeout: Duration::from_millis(limits::HANDSHAKE_TIMEOUT_MS),
            mechanisms: Mechanism::DEFAULT.to_vec(),
        }
    }
}

/// What the broker calls itself in connection.start's `product` and `version` (and the
/// management API's `product_name` / `product_version`).
///
/// The default is RabbitMQ's name and the version whose behaviour Warren follows, because
/// clients decide behaviour from it: kombu's `qos_semantics_matches_spec` applies prefetch
/// per consumer only when `product == "RabbitMQ"`, which changes how Celery workers prefetch.
/// Warren's own name and version are always in `platform` and `information`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerIdentity {
    /// `product` (RabbitMQ's `rabbit:product_name()`).
    pub product: String,
    /// `version` (RabbitMQ's `rabbit:product_version()`).
    pub version: String,
}

/// The RabbitMQ release whose observable behaviour Warren matches.
pub const RABBITMQ_COMPATIBLE_VERSION: &str = "4.2.0";

/// Warren's own version.
pub const WARREN_VERSION: &str = env!("CARGO_PKG_VERSION");

impl Default for ServerIdentity {
    fn default() -> Self {
        Self {
            product: "RabbitMQ".into(),
            version: RABBITMQ_COMPATIBLE_VERSION.into(),
        }
    }
}

/// The server-properties table with RabbitMQ's keys and capabilities.
#[must_use]
pub fn server_properties(identity: &ServerIdentity, cluster_name: &str) -> FieldTable {
    let mut caps = FieldTable::default();
    for cap in [
        "publisher_confirms",
        "exchange_exchange_bindings",
        "basic.nack",
        "consumer_cancel_notify",
        "connection.blocked",
        "consumer_priorities",
        "authentication_failure_close",
        "per_consumer_qos",
        "direct_reply_to",
        // Warren's own: lease extension and delayed release over AMQP (a publish to
        // `amq.warren.lease`, docs/http-queue-api.md).
        "warren.lease_extension",
    ] {
        caps.insert(cap.into(), AMQPValue::Boolean(true));
    }
    let mut t = FieldTable::default();
    let s = |v: &str| AMQPValue::LongString(LongString::from(v.as_bytes().to_vec()));
    t.insert("capabilities".into(), AMQPValue::FieldTable(caps));
    t.insert("cluster_name".into(), s(cluster_name));
    t.insert("copyright".into(), s("Copyright (c) the Warren authors"));
    t.insert(
        "information".into(),
        s(&format!(
            "Warren {WARREN_VERSION}, an AMQP 0-9-1 broker compatible with RabbitMQ \
             {RABBITMQ_COMPATIBLE_VERSION}. Licensed under the Apache License 2.0."
        )),
    );
    t.insert(
        "platform".into(),
        s(&format!(
            "Warren {WARREN_VERSION} (Rust, {})",
            std::env::consts::OS
        )),
    );
    t.insert("product".into(), s(&identity.product));
    t.insert("version".into(), s(&identity.version));
    t
}

/// Whether a client-properties table announces `name` in its capabilities.
#[must_use]
pub fn client_capability(props: &FieldTable, name: &str) -> bool {
    match props.inner().get("capabilities") {
        Some(AMQPValue::FieldTable(caps)) => {
            matches!(caps.inner().get(name), Some(AMQPValue::Boolean(true)))
        }
        _ => false,
    }
}
