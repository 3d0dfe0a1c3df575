//! Helpers several of the class files share: applying acks to queues, finding the queue a
//! method names (and whether this connection may use it), consumer timeouts, and the refusals
//! RabbitMQ words the same way for several methods. It imports none of the class files.

use std::sync::Arc;

use warren_amqp::{AmqpError, ReplyCode};

use crate::args::rs;
use crate::durable::OnCommit;
use crate::queue::Queue;
use crate::queue::limiter::Limiter;
use crate::queue::machine::{ConsumerId, MsgId};
use crate::queue::outbox::Outbound;

use super::{AckAction, Channel, Ctx, Unacked};

/// Group unacked entries by queue. A stream's go to it at once, by consumer: acks (`acked`)
/// give credit back and move a named consumer's offset; anything else (a closed channel:
/// nack and reject are refused earlier) only releases the credit.
fn group_by_queue(
    items: impl IntoIterator<Item = Unacked>,
    acked: bool,
) -> Vec<(Arc<Queue>, Vec<MsgId>)> {
    let mut groups: Vec<(Arc<Queue>, Vec<MsgId>)> = Vec::new();
    // A stream removes nothing: whatever the action, credit goes back to each consumer.
    let mut streams: Vec<(Arc<Queue>, ConsumerId, Vec<u64>)> = Vec::new();
    for u in items {
        if u.queue.is_stream {
            match streams
                .iter_mut()
                .find(|(q, c, _)| *c == u.consumer && Arc::ptr_eq(q, &u.queue))
            {
                Some((_, _, offsets)) => offsets.push(u.id),
                None => streams.push((u.queue, u.consumer, vec![u.id])),
            }
            continue;
        }
        match groups.iter_mut().find(|(q, _)| Arc::ptr_eq(q, &u.queue)) {
            Some((_, ids)) => ids.push(u.id),
            None => groups.push((u.queue, vec![u.id])),
        }
    }
    for (q, consumer, offsets) in streams {
        if acked {
            q.settle_stream(consumer, &offsets);
        } else {
            q.release_stream(consumer, &offsets);
        }
    }
    groups
}

/// Settle, requeue or discard unacked messages, then give their slots back to the channel's
/// shared limit (after the queue locks are released).
/// `on_commit` is given when the caller waits for the removals to be durable (tx.commit).
pub(super) fn apply_acks(
    limiter: &Limiter,
    action: AckAction,
    items: impl IntoIterator<Item = Unacked>,
    mut on_commit: Option<OnCommit<'_>>,
) {
    let mut counted = 0u32;
    let items = items
        .into_iter()
        .inspect(|u| counted += u32::from(u.counted));
    for (q, ids) in group_by_queue(items, action == AckAction::Settle) {
        match action {
            AckAction::Settle => {
                q.settle(ids, on_commit.as_mut().map(|f| &mut **f as OnCommit<'_>))
            }
            AckAction::Requeue => q.requeue(ids),
            AckAction::Release => q.give_back(ids),
            AckAction::Discard => {
                q.discard(ids, on_commit.as_mut().map(|f| &mut **f as OnCommit<'_>));
            }
        }
    }
    limiter.release(counted).run();
}

pub(super) fn expand_queue_name(chan: &Channel, name: &str) -> Result<String, AmqpError> {
    if !name.is_empty() {
        return Ok(name.to_string());
    }
    chan.last_queue
        .clone()
        .ok_or_else(|| AmqpError::channel(ReplyCode::NotFound, "no previously declared queue"))
}

pub(super) fn locked(q: &Queue, vhost: &str) -> AmqpError {
    AmqpError::channel(
        ReplyCode::ResourceLocked,
        format!(
            "cannot obtain exclusive access to locked {}. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration.",
            rs("queue", &q.name, vhost)
        ),
    )
}

/// The queue, if this connection may use it (exclusive queues belong to one connection).
pub(super) fn usable_queue(ctx: &Ctx, name: &str) -> Result<Arc<Queue>, AmqpError> {
    let q = ctx.vhost.queue_or_404(name)?;
    match q.exclusive_owner {
        Some(owner) if owner != ctx.conn_id => Err(locked(&q, &ctx.vhost.name)),
        _ => Ok(q),
    }
}

/// An outbox item the connection will not write (it is closing, or the channel is gone): a
/// message it holds goes back to its queue.
pub(super) fn requeue_undelivered(item: Outbound) {
    match item {
        Outbound::Deliver(d) => d.queue.give_back(vec![d.id]),
        Outbound::Got {
            queue,
            no_ack: false,
            got: Some((id, ..)),
            ..
        } => queue.give_back(vec![id]),
        _ => {}
    }
}

/// RabbitMQ's refusal of a method a stream does not support (540, which closes the
/// connection): `what not supported by stream queues queue 'q' in vhost 'v'`.
pub(super) fn stream_unsupported(q: &Queue, what: &str) -> AmqpError {
    AmqpError::connection(
        ReplyCode::NotImplemented,
        format!(
            "{what} not supported by stream queues {}",
            rs("queue", &q.name, &q.vhost)
        ),
    )
}

/// RabbitMQ's refusal of anything but an ack for a stream's deliveries.
pub(super) fn stream_requeue_refused(q: &Queue) -> AmqpError {
    stream_unsupported(q, "basic.nack and basic.reject")
}

/// The consumer timeout of deliveries from `queue`: its `x-consumer-timeout`, else the
/// broker's default.
pub(super) fn consumer_timeout(ctx: &Ctx, queue: &Queue) -> Option<u64> {
    queue
        .consumer_timeout
        .or(ctx.broker.config.consumer_timeout_ms)
        .filter(|t| *t > 0)
}

/// A delivery's consumer-timeout deadline and its delivery time (wall-clock ms; the clock
/// is read only when a timeout applies: `(u64::MAX, 0)` otherwise).
pub(super) fn consumer_deadline(ctx: &Ctx, queue: &Queue) -> (u64, u64) {
    if queue.is_stream {
        // An unacked stream delivery holds nothing but the consumer's own credit.
        return (u64::MAX, 0);
    }
    consumer_timeout(ctx, queue).map_or((u64::MAX, 0), |t| {
        let now = crate::timers::wall_ms();
        (now.saturating_add(t), now)
    })
}

/// A deleted vhost takes no new declarations (its connections are being closed): they would
/// be stored for a vhost that no longer exists.
pub(super) fn vhost_up(ctx: &Ctx) -> Result<(), AmqpError> {
    if ctx.vhost.is_down() {
        return Err(AmqpError::connection(
            ReplyCode::ConnectionForced,
            format!("vhost '{}' is deleted", ctx.vhost.name),
        ));
    }
    Ok(())
}
