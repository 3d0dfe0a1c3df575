//! Consumer-group members on this connection: joining (basic.consume with
//! `x-consumer-group` on a partitioned queue), carrying out the group's assignments and
//! revocations (`Outbound::Group`), and leaving. The assignment itself is
//! `crate::groups` (pure) driven by `crate::node::groups`.
//!
//! A member subscribes to a partition when it is assigned and, when the partition is revoked or
//! the member leaves, cancels that subscription and returns its unacked deliveries of it before
//! the group may give the partition to anyone else (redelivered, at the head of the partition,
//! so one key's messages keep their order). Their delivery tags are remembered as reclaimed: a
//! late ack, nack or reject of one is ignored (the old owner is fenced).

use std::sync::Arc;

use amq_protocol::protocol::basic;
use warren_amqp::{AmqpError, ReplyCode};

use crate::groups::{GroupEffect, GroupKey, MemberId};
use crate::node::groups::MemberHandle;
use crate::queue::ConsumerSink;
use crate::queue::Queue;
use crate::queue::machine::ConsumerId;
use crate::routing::partitions::{PartitionSet, membership};

use super::common::apply_acks;
use super::{AckAction, Channel, ConsumerEntry, Ctx, RECLAIMED_TAGS_MAX, Session};

/// The consume argument naming the group.
pub const GROUP_ARG: &str = "x-consumer-group";

/// The group a basic.consume asks to join: None without `x-consumer-group`; 406 for a value
/// that is not a non-empty string, or a queue that is not partitioned.
pub(super) fn requested_group(
    ctx: &Ctx,
    c: &basic::Consume,
    queue: &str,
) -> Result<Option<(GroupKey, PartitionSet)>, AmqpError> {
    let Some(v) = c.arguments.inner().get(GROUP_ARG) else {
        return Ok(None);
    };
    let refuse = |text: String| AmqpError::channel(ReplyCode::PreconditionFailed, text);
    let group = crate::args::text_value(v)
        .filter(|g| !g.is_empty())
        .ok_or_else(|| {
            refuse(format!(
                "invalid arg '{GROUP_ARG}' for consumer: a non-empty string"
            ))
        })?;
    let set = ctx.vhost.partitioned(queue).ok_or_else(|| {
        refuse(format!(
            "'{GROUP_ARG}' needs a partitioned queue (x-partitions): {}",
            crate::args::rs("queue", queue, &ctx.vhost.name)
        ))
    })?;
    if let Some(i) = set.members.iter().position(Option::is_none) {
        // In a cluster a partition joins this node's topology when the cluster commits it;
        // a member that could not subscribe to an assigned partition would hold it idle.
        return Err(ctx.vhost.not_found(
            "queue",
            &crate::routing::partitions::partition_name(queue, u32::try_from(i).unwrap_or(0)),
        ));
    }
    Ok(Some((
        GroupKey {
            vhost: ctx.vhost.name.clone(),
            queue: queue.to_string(),
            group,
        },
        set,
    )))
}

/// This node's member id for consumer `id`.
fn member_id(ctx: &Ctx, id: ConsumerId) -> MemberId {
    MemberId {
        node: ctx.broker.cluster().map_or(0, |c| c.node_number()),
        consumer: id,
    }
}

/// Join `key` as consumer `id` on channel `ch`: its assignments arrive through the outbox.
pub(super) fn join(
    ctx: &Ctx,
    chan: &Channel,
    ch: u16,
    tag: &str,
    id: ConsumerId,
    key: GroupKey,
    set: &PartitionSet,
) {
    ctx.broker.groups().join(
        ctx.broker.cluster(),
        key,
        member_id(ctx, id),
        set.spec.count,
        MemberHandle {
            outbox: Arc::clone(&ctx.outbox),
            channel: ch,
            epoch: chan.epoch,
            tag: tag.to_string(),
            connection: ctx.conn_id,
        },
    );
}

/// Return the unacked deliveries `consumer` got from `queue` (every queue if None), marking
/// their tags reclaimed so late settlements are ignored.
fn reclaim(chan: &mut Channel, consumer: ConsumerId, queue: Option<&Arc<Queue>>) {
    let tags: Vec<u64> = chan
        .unacked
        .iter()
        .filter(|(_, u)| u.consumer == consumer && queue.is_none_or(|q| Arc::ptr_eq(q, &u.queue)))
        .map(|(t, _)| *t)
        .collect();
    let mut returned = Vec::with_capacity(tags.len());
    for tag in tags {
        if let Some(u) = chan.unacked.remove(&tag) {
            chan.deadlines.remove(&(u.deadline, tag));
            chan.reclaimed.insert(tag);
            returned.push(u);
        }
    }
    while chan.reclaimed.len() > RECLAIMED_TAGS_MAX {
        chan.reclaimed.pop_first();
    }
    apply_acks(&chan.limiter, AckAction::Release, returned, None);
}

impl Ctx {
    /// A consumer left its channel (cancelled, a queue cancelled it, its consumer timed out):
    /// leave every queue it is subscribed to (deleting auto-delete queues it was the last
    /// consumer of), return a group member's deliveries, then leave its group.
    pub(super) fn consumer_gone(&self, chan: &mut Channel, entry: &ConsumerEntry) {
        self.unsubscribe(entry);
        if entry.group.is_some() {
            reclaim(chan, entry.id, None);
        }
        self.leave_group(entry);
    }

    /// Cancel every subscription of `entry` (deleting auto-delete queues it was the last
    /// consumer of).
    pub(super) fn unsubscribe(&self, entry: &ConsumerEntry) {
        for q in entry.cancel() {
            self.vhost.delete_queue(&q, &mut || self.on_commit());
        }
    }

    /// Take a group member out of its group. Call once its deliveries are back in their
    /// partitions: the group may give them to another member at once.
    pub(super) fn leave_group(&self, entry: &ConsumerEntry) {
        if let Some(key) = &entry.group {
            self.broker.groups().leave(
                self.broker.cluster(),
                key.clone(),
                member_id(self, entry.id),
            );
        }
    }
}

impl Session {
    /// Carry out a group's effect for consumer `consumer` on channel `ch`. Nothing if the
    /// channel or the consumer is gone (it left the group when it went).
    pub(super) fn group_effect(
        &mut self,
        ch: u16,
        epoch: u64,
        consumer: ConsumerId,
        effect: GroupEffect,
    ) {
        let Some(chan) = self.channels.get_mut(&ch).filter(|c| c.epoch == epoch) else {
            return;
        };
        let limiter = Arc::clone(&chan.limiter);
        let Some(entry) = chan.consumers.values_mut().find(|e| e.id == consumer) else {
            return;
        };
        match effect {
            GroupEffect::Assign { key, partition, .. } => {
                let Some(q) = self
                    .ctx
                    .vhost
                    .partitioned(&key.queue)
                    .and_then(|s| s.members.get(partition as usize).cloned().flatten())
                else {
                    return;
                };
                if entry.subscriptions.iter().any(|s| Arc::ptr_eq(s, &q)) {
                    return;
                }
                let subscribed = match (q.stream(), &entry.stream_spec) {
                    (Some(stream), Some(spec)) => stream
                        .consume(
                            consumer,
                            spec,
                            u16::try_from(entry.prefetch).unwrap_or(u16::MAX),
                            ConsumerSink {
                                outbox: Arc::clone(&self.ctx.outbox),
                                channel: ch,
                                limiter: None,
                            },
                            crate::timers::wall_ms(),
                        )
                        .is_ok(),
                    _ => q
                        .consume(
                            consumer,
                            entry.spec,
                            ConsumerSink {
                                outbox: Arc::clone(&self.ctx.outbox),
                                channel: ch,
                                limiter: (!entry.no_ack).then_some(limiter),
                            },
                        )
                        .is_ok(),
                };
                if subscribed {
                    entry.subscriptions.push(q);
                }
            }
            GroupEffect::Revoke { key, partition, .. } => {
                let at = entry
                    .subscriptions
                    .iter()
                    .position(|q| membership(q).is_some_and(|(_, i, _)| i == partition));
                if let Some(at) = at {
                    let q = entry.subscriptions.remove(at);
                    if q.cancel(consumer) {
                        self.ctx
                            .vhost
                            .delete_queue(&q, &mut || self.ctx.on_commit());
                    }
                    reclaim(chan, consumer, Some(&q));
                }
                self.ctx.broker.groups().released(
                    self.ctx.broker.cluster(),
                    key,
                    member_id(&self.ctx, consumer),
                    partition,
                );
            }
        }
    }
}
