//! Permission checks for one connection, as RabbitMQ's permission table defines them.
//!
//! | operation | needs |
//! |---|---|
//! | exchange.declare / delete, queue.declare / delete | configure on it |
//! | queue.declare with `x-dead-letter-exchange` | also write on the DLX and read on the queue |
//! | exchange.declare with `alternate-exchange` | also write on the AE and read on the exchange |
//! | queue.bind / unbind, exchange.bind / unbind | write on the destination, read on the source |
//! | basic.publish | write on the exchange (`""` is `amq.default`) |
//! | basic.consume / get, queue.purge | read on the queue |
//!
//! Patterns are unanchored regular expressions (Erlang's `re:run`); an empty pattern grants
//! nothing. Passive declares need no permission. Refusal is a 403 channel error. The compiled
//! patterns are cached per connection and refreshed when any permission changes; publish
//! results are cached per exchange name.

use std::collections::HashMap;
use std::sync::Arc;

use regex::Regex;
use warren_amqp::{AmqpError, ReplyCode};

use crate::node::broker::Broker;

/// Which of the three patterns an operation needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Perm {
    /// Declare and delete.
    Configure,
    /// Publish, bind destination.
    Write,
    /// Consume, get, purge, bind source.
    Read,
}

/// What a permission applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    /// An exchange (`""` is checked as `amq.default`).
    Exchange,
    /// A queue.
    Queue,
}

#[derive(Debug, Default)]
struct Compiled {
    configure: Option<Regex>,
    write: Option<Regex>,
    read: Option<Regex>,
    /// Topic permissions by exchange: (write, read) patterns for routing / binding keys.
    topics: HashMap<String, (Option<Regex>, Option<Regex>)>,
}

fn compile(pattern: &str) -> Option<Regex> {
    // An empty pattern grants nothing (RabbitMQ's special case); one that does not compile was
    // refused when it was set.
    if pattern.is_empty() {
        None
    } else {
        Regex::new(pattern).ok()
    }
}

/// One connection's view of its user's permissions in its vhost.
#[derive(Debug)]
pub struct Access {
    broker: Arc<Broker>,
    vhost: String,
    user: String,
    generation: u64,
    compiled: Compiled,
    /// basic.publish results by exchange name (the hot path).
    write_cache: HashMap<String, bool>,
    /// The broker's own internal user (definitions import): everything is allowed.
    internal: bool,
}

impl Access {
    /// The permissions of `user` in `vhost`, loaded now.
    #[must_use]
    pub fn new(broker: Arc<Broker>, vhost: &str, user: &str) -> Self {
        let mut a = Self {
            broker,
            vhost: vhost.to_string(),
            user: user.to_string(),
            generation: u64::MAX,
            compiled: Compiled::default(),
            write_cache: HashMap::new(),
            internal: false,
        };
        a.refresh();
        a
    }

    /// Access for the broker's own work (importing definitions): nothing is refused, as
    /// RabbitMQ's internal user is not checked.
    #[must_use]
    pub fn internal(broker: Arc<Broker>, vhost: &str) -> Self {
        let mut a = Self::new(broker, vhost, "");
        a.internal = true;
        a
    }

    fn refresh(&mut self) {
        let generation = self.broker.permission_generation();
        if generation == self.generation {
            return;
        }
        self.generation = generation;
        self.write_cache.clear();
        self.compiled = match self
            .broker
            .list_permissions(Some(&self.vhost), Some(&self.user))
            .into_iter()
            .next()
        {
            Some(p) => Compiled {
                configure: compile(&p.configure),
                write: compile(&p.write),
                read: compile(&p.read),
                topics: HashMap::new(),
            },
            None => Compiled::default(),
        };
        for t in self
            .broker
            .list_topic_permissions(Some(&self.vhost), Some(&self.user))
        {
            let pattern = |p: &str| compile(&crate::users::expand(p, &self.user, &self.vhost));
            self.compiled
                .topics
                .insert(t.exchange.clone(), (pattern(&t.write), pattern(&t.read)));
        }
    }

    /// Whether topic permissions constrain `exchange` at all (cheap: no lookup of the
    /// exchange's type is needed when this is false).
    pub fn has_topic_permissions(&mut self, exchange: &str) -> bool {
        if self.internal {
            return false;
        }
        self.refresh();
        self.compiled.topics.contains_key(exchange)
    }

    /// RabbitMQ's topic permission check of a routing key (publish: `Perm::Write`) or binding
    /// key (bind: `Perm::Read`) on a topic exchange. Allowed when the user has no topic
    /// permission for the exchange.
    ///
    /// # Errors
    /// `403 ACCESS_REFUSED - access to topic '<key>' in exchange '<x>' in vhost '<v>' refused
    /// for user '<u>'`.
    pub fn check_topic(&mut self, perm: Perm, exchange: &str, key: &str) -> Result<(), AmqpError> {
        self.refresh();
        let Some((write, read)) = self.compiled.topics.get(exchange) else {
            return Ok(());
        };
        let re = if perm == Perm::Write { write } else { read };
        if re.as_ref().is_some_and(|re| re.is_match(key)) {
            return Ok(());
        }
        Err(AmqpError::channel(
            ReplyCode::AccessRefused,
            format!(
                "access to topic '{key}' in exchange '{exchange}' in vhost '{}' refused for user '{}'",
                self.vhost, self.user
            ),
        ))
    }

    /// Allow `perm` on the resource, or refuse with RabbitMQ's 403.
    ///
    /// # Errors
    /// `403 ACCESS_REFUSED - access to <resource> '<name>' in vhost '<vhost>' refused for user
    /// '<user>'` as a channel error.
    pub fn check(&mut self, perm: Perm, resource: Resource, name: &str) -> Result<(), AmqpError> {
        if self.internal {
            return Ok(());
        }
        self.refresh();
        let name = match (resource, name) {
            (Resource::Exchange, "") => "amq.default",
            _ => name,
        };
        let cached = (perm == Perm::Write && resource == Resource::Exchange)
            .then(|| self.write_cache.get(name).copied())
            .flatten();
        let allowed = cached.unwrap_or_else(|| {
            let re = match perm {
                Perm::Configure => &self.compiled.configure,
                Perm::Write => &self.compiled.write,
                Perm::Read => &self.compiled.read,
            };
            re.as_ref().is_some_and(|re| re.is_match(name))
        });
        if cached.is_none() && perm == Perm::Write && resource == Resource::Exchange {
            self.write_cache.insert(name.to_string(), allowed);
        }
        if allowed {
            Ok(())
        } else {
            let kind = match resource {
                Resource::Exchange => "exchange",
                Resource::Queue => "queue",
            };
            Err(AmqpError::channel(
                ReplyCode::AccessRefused,
                format!(
                    "access to {kind} '{name}' in vhost '{}' refused for user '{}'",
                    self.vhost, self.user
                ),
            ))
        }
    }
}
