//! Channels: a channel's delivery bookkeeping (unacked deliveries, consumer-timeout
//! deadlines), its opening and closing (what a closed channel gives back), the connection's
//! close, channel.flow and access.request.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use amq_protocol::protocol::{AMQPClass, access, basic, channel};
use warren_amqp::frame::FrameWriter;
use warren_amqp::{AmqpError, ReplyCode};

use crate::queue::limiter::Limiter;
use crate::stats::Lifecycle;

use super::common::{apply_acks, consumer_timeout, requeue_undelivered};
use super::{AckAction, Call, Channel, Mode, RECLAIMED_TAGS_MAX, Session, Unacked};
use crate::node::broker::TimeoutResponse;

impl Channel {
    /// Record an unacked delivery (and its consumer-timeout deadline).
    pub(super) fn track(&mut self, tag: u64, u: Unacked) {
        if u.deadline != u64::MAX {
            self.deadlines.insert((u.deadline, tag));
        }
        self.unacked.insert(tag, u);
    }

    /// The earliest consumer-timeout deadline of a delivery still unacked.
    fn next_deadline(&mut self) -> Option<u64> {
        if self.timed_out {
            return None;
        }
        while let Some(&(deadline, tag)) = self.deadlines.first() {
            if self
                .unacked
                .get(&tag)
                .is_some_and(|u| u.deadline == deadline)
            {
                return Some(deadline);
            }
            self.deadlines.pop_first();
        }
        None
    }

    fn new(epoch: u64) -> Self {
        Self {
            epoch,
            consumers: HashMap::new(),
            unacked: BTreeMap::new(),
            next_tag: 1,
            prefetch_consumer: 0,
            prefetch_channel: 0,
            limiter: Arc::new(Limiter::default()),
            mode: Mode::Plain,
            last_queue: None,
            reply_consumer: None,
            deadlines: BTreeSet::new(),
            publishing: false,
            timed_out: false,
            reclaimed: BTreeSet::new(),
            route_buf: Vec::new(),
        }
    }
}

impl Session {
    /// A channel was opened.
    pub fn channel_opened(&mut self, ch: u16) {
        let epoch = self.ctx.broker.next_id();
        self.channels.insert(ch, Channel::new(epoch));
        if self.ctx.counted {
            self.ctx.broker.stats().event(Lifecycle::ChannelOpened);
        }
    }

    /// A channel is gone: cancel its consumers and requeue its unacked messages in order.
    pub fn channel_closed(&mut self, ch: u16) {
        let Some(chan) = self.channels.remove(&ch) else {
            return;
        };
        if self.ctx.counted {
            self.ctx.broker.release_channel(&self.ctx.user);
            self.ctx.broker.stats().event(Lifecycle::ChannelClosed);
        }
        if let Some((_, name)) = &chan.reply_consumer {
            self.ctx.vhost.replies.unregister(name);
        }
        if chan.publishing {
            self.ctx.broker.stats().publisher(false);
        }
        if let Mode::Confirm {
            last_seq,
            acked_upto,
            marks,
            marked_upto,
            ..
        } = &chan.mode
        {
            // Publishes since the last flush were not counted yet; none will be confirmed now.
            let marked = marks.back().map_or(*marked_upto, |m| m.0);
            self.ctx.count(|s| {
                s.received_confirm += last_seq - marked;
                s.confirm_abandoned += last_seq - acked_upto;
            });
        }
        let consumers: Vec<super::ConsumerEntry> = chan.consumers.into_values().collect();
        for c in &consumers {
            self.ctx.unsubscribe(c);
        }
        let mut pending: Vec<Unacked> = chan.unacked.into_values().collect();
        if let Mode::Tx(buf) = chan.mode {
            pending.extend(buf.acks.into_iter().map(|(_, _, u)| u));
        }
        apply_acks(&chan.limiter, AckAction::Release, pending, None);
        // Only with its deliveries back may a member's partitions go to another member.
        for c in &consumers {
            self.ctx.leave_group(c);
        }
    }

    /// The connection is gone: release every channel and delete exclusive queues.
    pub fn close(&mut self) {
        let ids: Vec<u16> = self.channels.keys().copied().collect();
        for ch in ids {
            self.channel_closed(ch);
        }
        // Deliveries that raced with the close go back to their queues.
        self.ctx.outbox.drain(&mut self.drained);
        for item in self.drained.drain(..) {
            requeue_undelivered(item);
        }
        self.ctx.vhost.delete_exclusive_queues(self.ctx.conn_id);
        if self.ctx.counted {
            self.ctx
                .broker
                .release_connection(&self.ctx.user, &self.ctx.vhost.name);
        }
        // Counts of a session that ends before its next flush are not lost.
        let stats = self.ctx.stats.take();
        if !stats.is_zero() {
            self.ctx.broker.stats().add(&stats);
        }
    }

    /// The earliest consumer-timeout deadline (wall-clock ms) on any channel.
    pub fn next_deadline(&mut self) -> Option<u64> {
        self.channels
            .values_mut()
            .filter_map(Channel::next_deadline)
            .min()
    }

    /// Deliveries not acked within their consumer timeout at `now` (wall-clock ms). On a
    /// quorum queue, as RabbitMQ 4.3 does (`TimeoutResponse::NotifyConsumer`, a client with
    /// `consumer_cancel_notify`): the delivery goes back to its queue, its consumer is
    /// cancelled (a `basic.cancel` to the client, written to `out`) and the channel stays
    /// open. Otherwise the channel is closed: returned here with the error RabbitMQ closes it
    /// with (406).
    pub fn timed_out(&mut self, now: u64, out: &mut FrameWriter) -> Vec<(u16, AmqpError)> {
        let mut closing = Vec::new();
        let notify = self.ctx.cancel_notify
            && self.ctx.broker.config.consumer_timeout_response == TimeoutResponse::NotifyConsumer;
        for (ch, chan) in &mut self.channels {
            while let Some(deadline) = chan.next_deadline()
                && deadline <= now
            {
                let Some((_, tag)) = chan.deadlines.pop_first() else {
                    break;
                };
                let Some(u) = chan.unacked.get(&tag) else {
                    continue;
                };
                if !(notify && u.queue.is_quorum && u.consumer != 0) {
                    let timeout = consumer_timeout(&self.ctx, &u.queue).unwrap_or(0);
                    chan.timed_out = true;
                    closing.push((
                        *ch,
                        AmqpError::channel(
                            ReplyCode::PreconditionFailed,
                            format!(
                                "delivery acknowledgement on channel {ch} timed out. Timeout value used: {timeout} ms. This timeout value can be configured, see consumers doc guide to learn more"
                            ),
                        ),
                    ));
                    break;
                }
                let Some(u) = chan.unacked.remove(&tag) else {
                    continue;
                };
                chan.reclaimed.insert(tag);
                while chan.reclaimed.len() > RECLAIMED_TAGS_MAX {
                    chan.reclaimed.pop_first();
                }
                let consumer = u.consumer;
                apply_acks(&chan.limiter, AckAction::Release, [u], None);
                if let Some(tag) = chan
                    .consumers
                    .iter()
                    .find(|(_, e)| e.id == consumer)
                    .map(|(t, _)| t.clone())
                    && let Some(entry) = chan.consumers.remove(&tag)
                {
                    // Its last consumer may have left an auto-delete queue.
                    self.ctx.consumer_gone(chan, &entry);
                    out.method(
                        *ch,
                        &AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                            consumer_tag: tag.into(),
                            nowait: true,
                        })),
                    );
                }
            }
        }
        closing
    }
}

impl Call<'_> {
    /// channel.flow: only active=true (RabbitMQ does not pause a channel's deliveries).
    pub(super) fn channel_flow(&mut self, f: channel::Flow) -> Result<(), AmqpError> {
        if f.active {
            self.reply(AMQPClass::Channel(channel::AMQPMethod::FlowOk(
                channel::FlowOk { active: true },
            )));
            Ok(())
        } else {
            Err(AmqpError::channel(
                ReplyCode::NotImplemented,
                "active=false",
            ))
        }
    }

    /// access.request (a deprecated class): granted.
    pub(super) fn access_request(&mut self) -> Result<(), AmqpError> {
        self.reply(AMQPClass::Access(access::AMQPMethod::RequestOk(
            access::RequestOk {},
        )));
        Ok(())
    }
}
