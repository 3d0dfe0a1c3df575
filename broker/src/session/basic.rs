//! The basic class, publishing aside: basic.consume (queues, streams and the direct reply-to
//! pseudo-queue), basic.cancel, basic.get, basic.ack / nack / reject (applied now or at
//! tx.commit), basic.recover and basic.qos. basic.publish is in [`super::publish`]; writing
//! deliveries in [`super::deliver`].

use std::sync::Arc;

use amq_protocol::protocol::{AMQPClass, basic};
use warren_amqp::method::put_basic_get_ok;
use warren_amqp::{AmqpError, ReplyCode};

use crate::args::rs;
use crate::node::access::{Perm, Resource};
use crate::queue::machine::{ConsumerSpec, MachineError};
use crate::queue::outbox::Outbound;
use crate::queue::{ConsumerSink, Queue};
use crate::routing::reply_to::reply_name;

use super::common::{
    apply_acks, consumer_deadline, expand_queue_name, stream_requeue_refused, stream_unsupported,
    usable_queue,
};
use super::{AckAction, Call, Channel, ConsumerEntry, Mode, Unacked};

impl Call<'_> {
    /// basic.ack.
    pub(super) fn basic_ack(&mut self, a: basic::Ack) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        let n = settle(self.chan, AckAction::Settle, a.delivery_tag, a.multiple)?;
        ctx.count(|s| s.acked += n as u64);
        Ok(())
    }

    /// basic.nack: requeued or discarded (dead-lettered).
    pub(super) fn basic_nack(&mut self, n: basic::Nack) -> Result<(), AmqpError> {
        settle(
            self.chan,
            if n.requeue {
                AckAction::Requeue
            } else {
                AckAction::Discard
            },
            n.delivery_tag,
            n.multiple,
        )
        .map(drop)
    }

    /// basic.reject: one delivery, requeued or discarded (dead-lettered).
    pub(super) fn basic_reject(&mut self, r: basic::Reject) -> Result<(), AmqpError> {
        settle(
            self.chan,
            if r.requeue {
                AckAction::Requeue
            } else {
                AckAction::Discard
            },
            r.delivery_tag,
            false,
        )
        .map(drop)
    }

    /// basic.qos: prefetch for consumers created afterwards, or (global) shared by the
    /// channel's consumers.
    pub(super) fn basic_qos(&mut self, q: basic::Qos) -> Result<(), AmqpError> {
        if q.global {
            let (before, after) = (self.chan.prefetch_channel, u32::from(q.prefetch_count));
            self.chan.prefetch_channel = after;
            let wake = self.chan.limiter.set_limit(after);
            if (before == 0) != (after == 0) {
                for c in self.chan.consumers.values().filter(|c| !c.no_ack) {
                    for q in &c.subscriptions {
                        q.set_limited(c.id, after > 0);
                    }
                }
            }
            wake.run();
        } else {
            self.chan.prefetch_consumer = u32::from(q.prefetch_count);
        }
        self.reply(AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})));
        Ok(())
    }

    /// basic.consume of `amq.rabbitmq.reply-to`: the channel's reply consumer (no-ack).
    pub(super) fn basic_consume_reply_to(&mut self, c: basic::Consume) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        let ch = self.ch;
        // rabbit_channel's reply-to clause, in its order.
        if self.chan.consumers.contains_key(c.consumer_tag.as_str()) {
            return Err(AmqpError::channel(
                ReplyCode::NotAllowed,
                format!(
                    "attempt to reuse consumer tag '{}'",
                    c.consumer_tag.as_str()
                ),
            ));
        }
        if !c.no_ack {
            return Err(AmqpError::channel(
                ReplyCode::PreconditionFailed,
                "reply consumer cannot acknowledge",
            ));
        }
        if self.chan.reply_consumer.is_some() {
            return Err(AmqpError::channel(
                ReplyCode::PreconditionFailed,
                "reply consumer already set",
            ));
        }
        let tag = if c.consumer_tag.as_str().is_empty() {
            ctx.broker.unique_name("amq.ctag-")
        } else {
            c.consumer_tag.as_str().to_string()
        };
        let node = ctx.broker.cluster().map(|c| c.node_number());
        let name = reply_name(&ctx.broker.unique_name(""), node);
        ctx.vhost
            .replies
            .register(&name, &ctx.outbox, ch, self.chan.epoch);
        self.chan.reply_consumer = Some((tag.clone(), name));
        self.consume_ok(c.nowait, &tag);
        Ok(())
    }

    /// basic.consume on a queue or a stream.
    pub(super) fn basic_consume(&mut self, c: basic::Consume) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        let ch = self.ch;
        if let Some(max) = ctx.broker.config.consumer_max_per_channel
            && self.chan.consumers.len() as u64 >= max
            && !self.chan.consumers.contains_key(c.consumer_tag.as_str())
        {
            // rabbit_channel: a hard error, so the whole connection closes.
            return Err(AmqpError::connection(
                ReplyCode::NotAllowed,
                format!("reached maximum ({max}) of consumers per channel"),
            ));
        }
        let qname = expand_queue_name(self.chan, c.queue.as_str())?;
        ctx.allow(Perm::Read, Resource::Queue, &qname)?;
        let group = super::group::requested_group(ctx, &c, &qname)?;
        // A partitioned queue's consumer subscribes to every partition (a group member only to
        // those the group assigns it, as they are assigned).
        let targets: Vec<Arc<Queue>> = match ctx.vhost.queue(&qname) {
            None => match ctx.vhost.partitioned(&qname) {
                Some(set) if set.queues().next().is_some() => set.queues().cloned().collect(),
                _ => vec![usable_queue(ctx, &qname)?],
            },
            Some(_) => vec![usable_queue(ctx, &qname)?],
        };
        for q in &targets {
            if q.is_stream && q.stream().is_none() {
                return Err(AmqpError::connection(
                    ReplyCode::InternalError,
                    format!(
                        "the files of stream {} could not be opened",
                        rs("queue", &q.name, &ctx.vhost.name)
                    ),
                ));
            }
            if (q.is_quorum || q.is_stream) && self.chan.prefetch_channel > 0 {
                // rabbit_quorum_queue and rabbit_stream_queue refuse consumers under a
                // channel-wide (global) QoS.
                return Err(AmqpError::connection(
                    ReplyCode::NotImplemented,
                    format!(
                        "{} does not support global qos",
                        rs("queue", &q.name, &ctx.vhost.name)
                    ),
                ));
            }
        }
        let stream_spec = match targets[0].stream() {
            Some(_) => Some(crate::stream::reader::consume_spec(
                &c.arguments,
                u16::try_from(self.chan.prefetch_consumer).unwrap_or(u16::MAX),
                c.no_ack,
                &rs("queue", &qname, &ctx.vhost.name),
            )?),
            None => None,
        };
        let tag = if c.consumer_tag.as_str().is_empty() {
            ctx.broker.unique_name("amq.ctag-")
        } else {
            c.consumer_tag.as_str().to_string()
        };
        if self.chan.consumers.contains_key(&tag) {
            return Err(AmqpError::channel(
                ReplyCode::NotAllowed,
                format!("attempt to reuse consumer tag '{tag}'"),
            ));
        }
        if self.chan.consumers.len() >= crate::limits::CONSUMERS_PER_CHANNEL_MAX {
            return Err(AmqpError::channel(
                ReplyCode::NotAllowed,
                format!(
                    "reached maximum ({}) of consumers per channel",
                    crate::limits::CONSUMERS_PER_CHANNEL_MAX
                ),
            ));
        }
        let prefetch = self.chan.prefetch_consumer;
        let id = ctx.broker.next_id();
        let priority = match c.arguments.inner().get("x-priority") {
            None => 0,
            Some(v) => crate::args::int_value(v)
                .and_then(|p| i32::try_from(p).ok())
                .ok_or_else(|| {
                    AmqpError::channel(
                        ReplyCode::PreconditionFailed,
                        format!(
                            "invalid arg 'x-priority' for consumer: \"expected integer, got {}\"",
                            crate::args::type_name(v)
                        ),
                    )
                })?,
        };
        let spec = ConsumerSpec {
            prefetch,
            window: ctx.broker.config.consumer_window,
            window_bytes: ctx.broker.config.consumer_window_bytes,
            no_ack: c.no_ack,
            exclusive: c.exclusive,
            priority,
            limited: !c.no_ack && self.chan.prefetch_channel > 0,
        };
        self.chan.consumers.insert(
            tag.clone(),
            ConsumerEntry {
                id,
                queue_name: qname.clone(),
                subscriptions: if group.is_some() {
                    Vec::new()
                } else {
                    targets.clone()
                },
                // A stream acks through credit: its deliveries are tracked as acked ones.
                no_ack: c.no_ack && stream_spec.is_none(),
                exclusive: c.exclusive,
                arguments: c.arguments.clone(),
                prefetch,
                spec,
                group: group.as_ref().map(|(key, _)| key.clone()),
                // A group reads each partition stream under its own name: its offset per
                // partition is kept by the stream, and whoever owns the partition next resumes
                // there (`x-stream-offset` only says where a group with no offset yet starts).
                stream_spec: group.as_ref().and(stream_spec.clone()).map(|mut s| {
                    s.name = group.as_ref().map(|(key, _)| key.group.clone());
                    s.explicit_offset = false;
                    s
                }),
            },
        );
        if let Some((key, set)) = group {
            super::group::join(ctx, self.chan, ch, &tag, id, key, &set);
            self.consume_ok(c.nowait, &tag);
            return Ok(());
        }
        for q in &targets {
            let sink = ConsumerSink {
                outbox: Arc::clone(&ctx.outbox),
                channel: ch,
                limiter: (!c.no_ack && stream_spec.is_none())
                    .then(|| Arc::clone(&self.chan.limiter)),
            };
            let refused = match (q.stream(), &stream_spec) {
                (Some(stream), Some(stream_spec)) => stream
                    .consume(
                        id,
                        stream_spec,
                        u16::try_from(prefetch).unwrap_or(u16::MAX),
                        sink,
                        crate::timers::wall_ms(),
                    )
                    .err(),
                _ => match q.consume(id, spec, sink) {
                    Err(MachineError::ExclusiveInUse | MachineError::DuplicateConsumer) => {
                        Some(AmqpError::channel(
                            ReplyCode::AccessRefused,
                            format!("{} in exclusive use", rs("queue", &q.name, &ctx.vhost.name)),
                        ))
                    }
                    _ => None,
                },
            };
            if let Some(e) = refused {
                // Leave the partitions already subscribed to.
                if let Some(entry) = self.chan.consumers.remove(&tag) {
                    ctx.consumer_gone(self.chan, &entry);
                }
                return Err(e);
            }
        }
        // Deliveries reach the socket only when the outbox is drained, after this reply.
        self.consume_ok(c.nowait, &tag);
        Ok(())
    }

    /// basic.cancel (a reply consumer too); an auto-delete queue's last consumer deletes it.
    pub(super) fn basic_cancel(&mut self, c: basic::Cancel) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        if let Some((_, name)) = self
            .chan
            .reply_consumer
            .take_if(|(tag, _)| tag.as_str() == c.consumer_tag.as_str())
        {
            ctx.vhost.replies.unregister(&name);
        }
        if let Some(entry) = self.chan.consumers.remove(c.consumer_tag.as_str()) {
            ctx.consumer_gone(self.chan, &entry);
        }
        if !c.nowait {
            self.reply(AMQPClass::Basic(basic::AMQPMethod::CancelOk(
                basic::CancelOk {
                    consumer_tag: c.consumer_tag,
                },
            )));
        }
        Ok(())
    }

    /// basic.get: a replicated queue's reply comes with the commit (see `Outbound::Got`).
    pub(super) fn basic_get(&mut self, g: basic::Get) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        let ch = self.ch;
        let name = expand_queue_name(self.chan, g.queue.as_str())?;
        ctx.allow(Perm::Read, Resource::Queue, &name)?;
        let q = match ctx.vhost.queue(&name) {
            // A partitioned queue: a partition with ready messages, starting after the one
            // the channel got from last (so one busy partition does not starve the others).
            None => match ctx.vhost.partitioned(&name) {
                Some(set) if set.queues().next().is_some() => {
                    let queues: Vec<&Arc<Queue>> = set.queues().collect();
                    let start = self.chan.next_tag as usize % queues.len();
                    let pick = (0..queues.len())
                        .map(|i| queues[(start + i) % queues.len()])
                        .find(|q| q.counts().messages > 0)
                        .unwrap_or(queues[start]);
                    Arc::clone(pick)
                }
                _ => usable_queue(ctx, &name)?,
            },
            Some(_) => usable_queue(ctx, &name)?,
        };
        if q.is_stream {
            return Err(stream_unsupported(&q, "basic.get"));
        }
        if q.is_replicated() {
            // Its reply comes with the commit (see `Outbound::Got`).
            let (outbox, epoch, no_ack) = (Arc::clone(&ctx.outbox), self.chan.epoch, g.no_ack);
            let queue = Arc::clone(&q);
            q.get_replicated(
                no_ack,
                Box::new(move |got| {
                    outbox.push(Outbound::Got {
                        channel: ch,
                        epoch,
                        queue,
                        no_ack,
                        got,
                    });
                }),
            );
            return Ok(());
        }
        let got = q.get(g.no_ack);
        self.write_get(&q, g.no_ack, got)
    }

    /// basic.recover: requeue every unacked delivery of the channel (requeue=true only).
    pub(super) fn basic_recover(&mut self, r: basic::Recover) -> Result<(), AmqpError> {
        recover(self.chan, r.requeue)?;
        self.reply(AMQPClass::Basic(basic::AMQPMethod::RecoverOk(
            basic::RecoverOk {},
        )));
        Ok(())
    }

    /// basic.recover-async: basic.recover without a reply.
    pub(super) fn basic_recover_async(&mut self, r: basic::RecoverAsync) -> Result<(), AmqpError> {
        recover(self.chan, r.requeue)
    }

    /// basic.consume-ok for `tag`, unless the consume was nowait.
    fn consume_ok(&mut self, nowait: bool, tag: &str) {
        if !nowait {
            self.reply(AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(
                basic::ConsumeOk {
                    consumer_tag: tag.into(),
                },
            )));
        }
    }

    /// Write basic.get-ok (tracking the delivery unless no-ack) or basic.get-empty.
    pub(super) fn write_get(
        &mut self,
        q: &Arc<Queue>,
        no_ack: bool,
        got: Option<crate::queue::Got>,
    ) -> Result<(), AmqpError> {
        let (ctx, ch) = (self.ctx, self.ch);
        match got {
            None => {
                ctx.count(|s| s.get_empty += 1);
                self.reply(AMQPClass::Basic(basic::AMQPMethod::GetEmpty(
                    basic::GetEmpty {},
                )));
            }
            Some((id, msg, redelivered, remaining, delivery_count)) => {
                let tag = self.chan.next_tag;
                self.chan.next_tag += 1;
                ctx.count(|s| {
                    s.got += 1;
                    s.got_no_ack += u64::from(no_ack);
                    s.redelivered += u64::from(redelivered);
                });
                if !no_ack {
                    let (deadline, delivered_at) = consumer_deadline(ctx, q);
                    self.chan.track(
                        tag,
                        Unacked {
                            queue: Arc::clone(q),
                            id,
                            consumer: 0,
                            counted: false,
                            deadline,
                            delivered_at,
                        },
                    );
                }
                let msg = msg.load().map_err(|e| {
                    tracing::error!(queue = %q.name, error = %e, "cannot read a stored message");
                    AmqpError::connection(ReplyCode::InternalError, "cannot read a stored message")
                })?;
                self.out.method_with(ch, |b| {
                    put_basic_get_ok(
                        b,
                        tag,
                        redelivered,
                        msg.exchange(),
                        msg.routing_key(),
                        remaining,
                    );
                });
                if delivery_count > 0 && q.is_quorum {
                    let props =
                        crate::deadletter::with_delivery_count(msg.properties(), delivery_count);
                    self.out.content(ch, &props, msg.body());
                } else {
                    self.out.content(ch, msg.properties(), msg.body());
                }
            }
        }
        Ok(())
    }
}

/// Take the unacked entries an ack/nack/reject names, or fail with 406 unknown delivery tag.
fn take_acked(
    chan: &mut Channel,
    tag: u64,
    multiple: bool,
) -> Result<Vec<(u64, Unacked)>, AmqpError> {
    let unknown = || {
        AmqpError::channel(
            ReplyCode::PreconditionFailed,
            format!("unknown delivery tag {tag}"),
        )
    };
    // A tag a consumer timeout returned is settled already: its ack changes nothing.
    let reclaimed = chan.reclaimed.contains(&tag);
    if multiple {
        if tag == 0 {
            chan.reclaimed.clear();
            return Ok(std::mem::take(&mut chan.unacked).into_iter().collect());
        }
        if !chan.unacked.contains_key(&tag) && !reclaimed {
            return Err(unknown());
        }
        chan.reclaimed = chan.reclaimed.split_off(&(tag + 1));
        let rest = chan.unacked.split_off(&(tag + 1));
        let taken = std::mem::replace(&mut chan.unacked, rest);
        Ok(taken.into_iter().collect())
    } else if reclaimed {
        chan.reclaimed.remove(&tag);
        Ok(Vec::new())
    } else {
        chan.unacked
            .remove(&tag)
            .map(|u| vec![(tag, u)])
            .ok_or_else(unknown)
    }
}

/// Settle, requeue or discard what `tag` (and `multiple`) name; returns how many.
fn settle(
    chan: &mut Channel,
    action: AckAction,
    tag: u64,
    multiple: bool,
) -> Result<usize, AmqpError> {
    if action != AckAction::Settle {
        // rabbit_stream_queue:settle takes only acks; checked before anything is taken.
        let upto = if multiple && tag == 0 { u64::MAX } else { tag };
        let from = if multiple { 0 } else { tag };
        if let Some((_, u)) = chan
            .unacked
            .range(from..=upto)
            .find(|(_, u)| u.queue.is_stream)
        {
            return Err(stream_requeue_refused(&u.queue));
        }
    }
    let taken = take_acked(chan, tag, multiple)?;
    let n = taken.len();
    for (t, u) in &taken {
        if u.deadline != u64::MAX {
            chan.deadlines.remove(&(u.deadline, *t));
        }
    }
    if let Mode::Tx(buf) = &mut chan.mode {
        buf.acks
            .extend(taken.into_iter().map(|(t, u)| (action, t, u)));
    } else {
        apply_acks(
            &chan.limiter,
            action,
            taken.into_iter().map(|(_, u)| u),
            None,
        );
    }
    Ok(n)
}

fn recover(chan: &mut Channel, requeue: bool) -> Result<(), AmqpError> {
    if !requeue {
        return Err(AmqpError::channel(
            ReplyCode::NotImplemented,
            "requeue=false",
        ));
    }
    // Recover requeues: for a stream, what a nack would do (RabbitMQ refuses it the same way).
    if let Some(u) = chan.unacked.values().find(|u| u.queue.is_stream) {
        return Err(stream_requeue_refused(&u.queue));
    }
    let all = std::mem::take(&mut chan.unacked);
    chan.deadlines.clear();
    apply_acks(&chan.limiter, AckAction::Requeue, all.into_values(), None);
    Ok(())
}
