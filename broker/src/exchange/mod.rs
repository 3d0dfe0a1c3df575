//! Exchanges and their bindings. One file per matching scheme that needs more than a lookup.

pub mod hash;
pub mod headers;
pub mod topic;

use std::cell::OnceCell;
use std::collections::HashMap;

use amq_protocol::types::FieldTable;
use warren_amqp::properties::Properties;

/// The type name of delayed exchanges (compatible with rabbitmq_delayed_message_exchange).
pub const DELAYED_TYPE: &str = "x-delayed-message";

/// A message's headers as routing sees them: decoded at most once, and only when a headers
/// exchange with bindings is reached, so a publish that never meets one does not pay for it.
pub struct RoutingHeaders<'a> {
    properties: &'a Properties,
    decoded: OnceCell<Option<FieldTable>>,
}

impl<'a> RoutingHeaders<'a> {
    /// Headers of `properties`, not yet decoded.
    #[must_use]
    pub fn new(properties: &'a Properties) -> Self {
        Self {
            properties,
            decoded: OnceCell::new(),
        }
    }

    /// The message's properties (hash exchanges read ids and the timestamp).
    #[must_use]
    pub fn properties(&self) -> &'a Properties {
        self.properties
    }

    /// The decoded table (decoding it on first use); `None` if the message has no headers.
    pub fn get(&self) -> Option<&FieldTable> {
        self.decoded
            .get_or_init(|| self.properties.headers())
            .as_ref()
    }
}

/// Exchange types Warren routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExchangeKind {
    /// Exact routing-key match.
    Direct,
    /// Every binding.
    Fanout,
    /// Dotted-word patterns with `*` and `#`.
    Topic,
    /// Header table match.
    Headers,
    /// `x-consistent-hash`: one destination by a consistent hash of the key, the binding key
    /// being the destination's weight.
    ConsistentHash,
    /// `x-modulus-hash`: one destination, the key's hash modulo the number of destinations.
    ModulusHash,
}

impl ExchangeKind {
    /// Parse a type name as sent in exchange.declare.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "direct" => Some(Self::Direct),
            "fanout" => Some(Self::Fanout),
            "topic" => Some(Self::Topic),
            "headers" => Some(Self::Headers),
            "x-consistent-hash" => Some(Self::ConsistentHash),
            "x-modulus-hash" => Some(Self::ModulusHash),
            _ => None,
        }
    }

    /// The type name.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Fanout => "fanout",
            Self::Topic => "topic",
            Self::Headers => "headers",
            Self::ConsistentHash => "x-consistent-hash",
            Self::ModulusHash => "x-modulus-hash",
        }
    }
}

/// Where a binding leads.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Destination {
    /// A queue, by name.
    Queue(String),
    /// An exchange (exchange-to-exchange binding), by name.
    Exchange(String),
}

/// One binding from an exchange.
#[derive(Debug, Clone, PartialEq)]
pub struct Binding {
    /// Where matching messages go.
    pub destination: Destination,
    /// The binding key.
    pub routing_key: String,
    /// Binding arguments (headers exchanges match on them).
    pub arguments: FieldTable,
}

/// An exchange with its bindings and a type-specific index over them.
#[derive(Debug, Clone)]
pub struct Exchange {
    /// Name.
    pub name: String,
    /// Type.
    pub kind: ExchangeKind,
    /// Survives restarts (once the store exists).
    pub durable: bool,
    /// Deleted when its last binding goes.
    pub auto_delete: bool,
    /// Refuses direct publishes.
    pub internal: bool,
    /// Declared as `x-delayed-message` (`kind` is its `x-delayed-type`): publishes with an
    /// `x-delay` header are held until due.
    pub delayed: bool,
    /// Declare arguments.
    pub arguments: FieldTable,
    /// The alternate exchange its policy gives it (its argument wins).
    pub policy_alternate: Option<String>,
    bindings: Vec<Binding>,
    direct: HashMap<String, Vec<usize>>,
    topic: topic::TopicTrie,
    /// What a hash exchange hashes (from its arguments).
    hash_source: hash::HashSource,
    /// An `x-consistent-hash` exchange's buckets.
    ring: hash::Ring,
    /// An `x-modulus-hash` exchange's destinations (binding indexes, natural order).
    modulus: Vec<usize>,
}

impl Exchange {
    /// A new exchange without bindings.
    #[must_use]
    pub fn new(
        name: &str,
        kind: ExchangeKind,
        durable: bool,
        auto_delete: bool,
        internal: bool,
        arguments: FieldTable,
    ) -> Self {
        Self {
            name: name.to_string(),
            kind,
            durable,
            auto_delete,
            internal,
            delayed: false,
            policy_alternate: None,
            bindings: Vec::new(),
            direct: HashMap::new(),
            topic: topic::TopicTrie::default(),
            hash_source: match kind {
                // Checked at declare; an exchange restored from the store was checked then.
                ExchangeKind::ConsistentHash => {
                    hash::HashSource::from_arguments(&arguments).unwrap_or_default()
                }
                _ => hash::HashSource::RoutingKey,
            },
            ring: hash::Ring::default(),
            modulus: Vec::new(),
            arguments,
        }
    }

    /// The type name as declared (`x-delayed-message` for delayed exchanges).
    #[must_use]
    pub fn type_name(&self) -> &'static str {
        if self.delayed {
            DELAYED_TYPE
        } else {
            self.kind.as_str()
        }
    }

    /// Bindings from this exchange.
    #[must_use]
    pub fn bindings(&self) -> &[Binding] {
        &self.bindings
    }

    /// Add a binding; binding twice is a no-op. Returns whether it was new.
    pub fn bind(&mut self, binding: Binding) -> bool {
        if self.bindings.contains(&binding) {
            return false;
        }
        // Indexed incrementally: declaring many bindings costs O(n) each for the duplicate
        // check, not a rebuild of the whole index.
        let i = self.bindings.len();
        self.index(i, &binding.routing_key);
        self.bindings.push(binding);
        self.rebuild_hashing();
        true
    }

    /// Remove a binding. Returns whether it existed.
    pub fn unbind(&mut self, binding: &Binding) -> bool {
        let before = self.bindings.len();
        self.bindings.retain(|b| b != binding);
        let removed = self.bindings.len() != before;
        if removed {
            self.reindex();
        }
        removed
    }

    /// Remove every binding to `destination`. Returns how many went.
    pub fn unbind_destination(&mut self, destination: &Destination) -> usize {
        let before = self.bindings.len();
        self.bindings.retain(|b| &b.destination != destination);
        let removed = before - self.bindings.len();
        if removed > 0 {
            self.reindex();
        }
        removed
    }

    /// Rebuild the index after removals (binding positions shift).
    fn reindex(&mut self) {
        self.direct.clear();
        self.topic = topic::TopicTrie::default();
        let keys: Vec<String> = self
            .bindings
            .iter()
            .map(|b| b.routing_key.clone())
            .collect();
        for (i, key) in keys.iter().enumerate() {
            self.index(i, key);
        }
        self.rebuild_hashing();
    }

    /// Rebuild a hash exchange's destination order from its bindings (every change: the order
    /// is canonical, so it cannot be patched by position).
    fn rebuild_hashing(&mut self) {
        match self.kind {
            ExchangeKind::ConsistentHash => self.ring = hash::Ring::build(&self.bindings),
            ExchangeKind::ModulusHash => self.modulus = hash::modulus_order(&self.bindings),
            _ => {}
        }
    }

    /// Index binding number `i` with routing key `key`.
    fn index(&mut self, i: usize, key: &str) {
        match self.kind {
            ExchangeKind::Direct => self.direct.entry(key.to_string()).or_default().push(i),
            ExchangeKind::Topic => self.topic.insert(key, i),
            ExchangeKind::Fanout
            | ExchangeKind::Headers
            | ExchangeKind::ConsistentHash
            | ExchangeKind::ModulusHash => {}
        }
    }

    /// Append the destinations a message matches (possibly with repeats).
    pub fn route<'a>(
        &'a self,
        routing_key: &str,
        headers: &RoutingHeaders<'_>,
        out: &mut Vec<&'a Destination>,
    ) {
        match self.kind {
            ExchangeKind::Direct => {
                if let Some(ix) = self.direct.get(routing_key) {
                    out.extend(ix.iter().map(|i| &self.bindings[*i].destination));
                }
            }
            ExchangeKind::Fanout => out.extend(self.bindings.iter().map(|b| &b.destination)),
            ExchangeKind::Topic => {
                out.extend(
                    self.topic
                        .matches(routing_key)
                        .into_iter()
                        .map(|i| &self.bindings[i].destination),
                );
            }
            ExchangeKind::Headers => out.extend(
                self.bindings
                    .iter()
                    .filter(|b| headers::matches(&b.arguments, headers.get()))
                    .map(|b| &b.destination),
            ),
            ExchangeKind::ConsistentHash => {
                if let Some(i) = self.ring.pick(self.hash_source.hash(routing_key, headers)) {
                    out.push(&self.bindings[i].destination);
                }
            }
            ExchangeKind::ModulusHash => {
                if !self.modulus.is_empty() {
                    let h = hash::key_hash(routing_key.as_bytes());
                    let n = self.modulus.len() as u64;
                    #[allow(clippy::cast_possible_truncation)] // below n, a usize
                    let at = (h % n) as usize;
                    out.push(&self.bindings[self.modulus[at]].destination);
                }
            }
        }
    }
}

/// The declaration flags of an exchange.
#[derive(Debug, Clone)]
pub struct ExchangeDecl {
    /// Type.
    pub kind: ExchangeKind,
    /// Durable.
    pub durable: bool,
    /// Auto-delete.
    pub auto_delete: bool,
    /// Internal.
    pub internal: bool,
    /// `x-delayed-message` with `kind` as its `x-delayed-type`.
    pub delayed: bool,
    /// Arguments.
    pub arguments: FieldTable,
}

impl ExchangeDecl {
    /// Its type name as clients see it (`x-delayed-message` for delayed exchanges).
    #[must_use]
    pub fn type_name(&self) -> &'static str {
        if self.delayed {
            DELAYED_TYPE
        } else {
            self.kind.as_str()
        }
    }

    /// The exchange these flags declare.
    #[must_use]
    pub fn build(&self, name: &str) -> Exchange {
        let mut ex = Exchange::new(
            name,
            self.kind,
            self.durable,
            self.auto_delete,
            self.internal,
            self.arguments.clone(),
        );
        ex.delayed = self.delayed;
        ex
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bind(ex: &mut Exchange, queue: &str, key: &str) -> bool {
        ex.bind(Binding {
            destination: Destination::Queue(queue.into()),
            routing_key: key.into(),
            arguments: FieldTable::default(),
        })
    }

    fn routed(ex: &Exchange, key: &str) -> Vec<String> {
        let mut out = Vec::new();
        let props = Properties::default();
        ex.route(key, &RoutingHeaders::new(&props), &mut out);
        let mut names: Vec<String> = out
            .into_iter()
            .map(|d| match d {
                Destination::Queue(q) | Destination::Exchange(q) => q.clone(),
            })
            .collect();
        names.sort();
        names.dedup();
        names
    }

    #[test]
    fn incremental_binds_and_unbinds_keep_the_index_right() {
        for kind in [ExchangeKind::Direct, ExchangeKind::Topic] {
            let mut ex = Exchange::new("x", kind, false, false, false, FieldTable::default());
            assert!(bind(&mut ex, "q1", "a"));
            assert!(bind(&mut ex, "q2", "b"));
            assert!(bind(&mut ex, "q3", "a"));
            assert!(!bind(&mut ex, "q1", "a"), "duplicate binding");
            assert_eq!(routed(&ex, "a"), ["q1", "q3"]);
            assert_eq!(routed(&ex, "b"), ["q2"]);
            ex.unbind(&Binding {
                destination: Destination::Queue("q1".into()),
                routing_key: "a".into(),
                arguments: FieldTable::default(),
            });
            assert_eq!(routed(&ex, "a"), ["q3"]);
            assert_eq!(routed(&ex, "b"), ["q2"]);
            assert!(bind(&mut ex, "q4", "b"));
            assert_eq!(routed(&ex, "b"), ["q2", "q4"]);
            assert_eq!(ex.unbind_destination(&Destination::Queue("q2".into())), 1);
            assert_eq!(routed(&ex, "b"), ["q4"]);
        }
    }

    #[test]
    fn headers_are_decoded_only_when_a_headers_binding_is_consulted() {
        use amq_protocol::types::AMQPValue;
        let mut table = FieldTable::default();
        table.insert("k".into(), AMQPValue::LongString("v".into()));
        let mut raw = (1u16 << 13).to_be_bytes().to_vec(); // headers flag only
        raw.extend(warren_amqp::table::encode_table(&table));
        let props = Properties::parse(raw.into(), 8).expect("valid properties");

        let mut direct = Exchange::new(
            "d",
            ExchangeKind::Direct,
            false,
            false,
            false,
            FieldTable::default(),
        );
        bind(&mut direct, "q", "k");
        let headers = RoutingHeaders::new(&props);
        let mut out = Vec::new();
        direct.route("k", &headers, &mut out);
        assert_eq!(out.len(), 1);
        assert!(
            headers.decoded.get().is_none(),
            "a direct exchange needs no headers"
        );

        let mut by_headers = Exchange::new(
            "h",
            ExchangeKind::Headers,
            false,
            false,
            false,
            FieldTable::default(),
        );
        by_headers.route("", &headers, &mut out);
        assert!(
            headers.decoded.get().is_none(),
            "no bindings, nothing to match"
        );
        let mut args = FieldTable::default();
        args.insert("x-match".into(), AMQPValue::LongString("all".into()));
        args.insert("k".into(), AMQPValue::LongString("v".into()));
        assert!(by_headers.bind(Binding {
            destination: Destination::Queue("hq".into()),
            routing_key: String::new(),
            arguments: args,
        }));
        let mut out = Vec::new();
        by_headers.route("", &headers, &mut out);
        assert_eq!(out.len(), 1, "the binding matches the message headers");
        assert!(headers.decoded.get().is_some());
    }
}
