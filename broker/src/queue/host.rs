//! What a queue needs from the layer above it, as a trait the vhost implements: the queue
//! layer never imports routing. A queue's dead letters and a delayed exchange's released
//! messages are routed through [`QueueHost::route`]; an `x-expires` queue that ran out asks
//! [`QueueHost::delete_if`] to delete it.

use std::sync::Arc;

use warren_amqp::AmqpError;

use super::Queue;
use crate::durable::OnCommit;
use crate::exchange::RoutingHeaders;

/// The vhost a queue lives in, seen from the queue (held as a `Weak`: the vhost owns its queues).
pub trait QueueHost: Send + Sync {
    /// Add to `out` the queues that a message published internally (a dead letter, a delayed
    /// message released) to `exchange` with `routing_key` and `headers` goes to. Internal
    /// publishes skip the checks made for clients (internal exchanges, permissions).
    ///
    /// # Errors
    /// `404 NOT_FOUND` when the exchange does not exist (the message is then dropped, as
    /// RabbitMQ drops a dead letter to a missing exchange).
    fn route(
        &self,
        exchange: &str,
        routing_key: &str,
        headers: &RoutingHeaders<'_>,
        out: &mut Vec<Arc<Queue>>,
    ) -> Result<(), AmqpError>;

    /// Delete `queue` if it is still this vhost's queue of its name and `still` holds when
    /// checked under the vhost's lock; returns the messages it held when deleted.
    fn delete_if(
        &self,
        queue: &Arc<Queue>,
        still: &dyn Fn(&Queue) -> bool,
        on_commit: OnCommit<'_>,
    ) -> Option<u32>;
}

/// A host that routes nowhere and deletes nothing: for queues outside any vhost (tests, and
/// the stand-alone queues of tools).
#[derive(Debug, Default)]
pub struct NoHost;

impl QueueHost for NoHost {
    fn route(
        &self,
        _exchange: &str,
        _routing_key: &str,
        _headers: &RoutingHeaders<'_>,
        _out: &mut Vec<Arc<Queue>>,
    ) -> Result<(), AmqpError> {
        Ok(())
    }

    fn delete_if(
        &self,
        _queue: &Arc<Queue>,
        _still: &dyn Fn(&Queue) -> bool,
        _on_commit: OnCommit<'_>,
    ) -> Option<u32> {
        None
    }
}
