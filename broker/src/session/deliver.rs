//! Writing what queues left in the connection's outbox: consumer deliveries (tracked for
//! acks and consumer timeouts), stream readiness, direct replies, replicated basic.get
//! replies, server-sent basic.cancel, and the consumer windows given back after a write.

use std::sync::Arc;

use amq_protocol::protocol::{AMQPClass, basic};
use warren_amqp::frame::FrameWriter;
use warren_amqp::method::put_basic_deliver;

use crate::message::Message;
use crate::queue::machine::ConsumerId;
use crate::queue::outbox::{Delivery, Outbound};

use super::common::{consumer_deadline, requeue_undelivered};
use super::{Call, Session, Unacked};

impl Session {
    /// Write deliveries and cancellations that queues left in the outbox, then give the
    /// consumers their window back.
    pub fn drain_outbox(&mut self, out: &mut FrameWriter) {
        self.ctx.outbox.drain(&mut self.drained);
        let mut items = std::mem::take(&mut self.drained);
        for item in items.drain(..) {
            match item {
                Outbound::Deliver(d) => self.deliver(d, out),
                Outbound::Cancel { channel, consumer } => {
                    self.consumer_cancelled(channel, consumer, out)
                }
                Outbound::Group {
                    channel,
                    epoch,
                    consumer,
                    effect,
                } => self.group_effect(channel, epoch, consumer, effect),
                Outbound::StreamReady {
                    queue, consumer, ..
                } => {
                    if let Some(stream) = queue.stream() {
                        for d in stream.pump(consumer) {
                            self.deliver(d, out);
                        }
                    }
                }
                Outbound::Reply {
                    channel,
                    epoch,
                    message,
                } => self.deliver_reply(channel, epoch, &message, out),
                // Only a cluster link's outbox carries these.
                Outbound::PeerReply { .. } => {}
                done @ (Outbound::Committed { .. } | Outbound::Confirmed { .. }) => {
                    self.store_completion(&done);
                }
                Outbound::Got {
                    channel,
                    epoch,
                    queue,
                    no_ack,
                    got,
                } => match self.channels.get_mut(&channel) {
                    Some(chan) if chan.epoch == epoch => {
                        let mut call = Call {
                            ctx: &self.ctx,
                            chan,
                            ch: channel,
                            out,
                        };
                        if let Err(e) = call.write_get(&queue, no_ack, got) {
                            tracing::error!(queue = %queue.name, error = %e.text, "basic.get reply");
                            self.store_failed = true;
                        }
                    }
                    _ => requeue_undelivered(Outbound::Got {
                        channel,
                        epoch,
                        queue,
                        no_ack,
                        got,
                    }),
                },
            }
        }
        self.drained = items;
    }

    /// A direct reply-to message for this connection's reply consumer (no-ack: nothing to
    /// track); dropped if the channel or consumer is gone meanwhile.
    fn deliver_reply(&mut self, ch: u16, epoch: u64, m: &Message, out: &mut FrameWriter) {
        let Some(chan) = self.channels.get_mut(&ch) else {
            return;
        };
        let Some((tag, _)) = chan.reply_consumer.as_ref().filter(|_| chan.epoch == epoch) else {
            return;
        };
        let delivery_tag = chan.next_tag;
        chan.next_tag += 1;
        out.method_with(ch, |b| {
            put_basic_deliver(
                b,
                tag.as_bytes(),
                delivery_tag,
                false,
                m.exchange.as_bytes(),
                m.routing_key.as_bytes(),
            );
        });
        out.content(ch, &m.properties.raw, &m.body);
    }

    /// The connection is closing: take the store completions from the outbox (so held replies
    /// can be released); deliveries found there go back to their queues.
    pub fn drain_completions(&mut self) {
        self.ctx.outbox.drain(&mut self.drained);
        let mut items = std::mem::take(&mut self.drained);
        for item in items.drain(..) {
            match item {
                done @ (Outbound::Committed { .. } | Outbound::Confirmed { .. }) => {
                    self.store_completion(&done);
                }
                other => requeue_undelivered(other),
            }
        }
        self.drained = items;
    }

    /// A consumer's delivery: written, and tracked unless no-ack.
    fn deliver(&mut self, d: Delivery, out: &mut FrameWriter) {
        let Some(chan) = self.channels.get_mut(&d.channel) else {
            // The channel closed after the queue chose its consumer: the message goes back.
            d.queue.give_back(vec![d.id]);
            return;
        };
        // One lookup gives both the tag to write and the ack mode.
        let Some((consumer_tag, no_ack)) = chan
            .consumers
            .iter()
            .find(|(_, e)| e.id == d.consumer)
            .map(|(t, e)| (t.as_str(), e.no_ack))
        else {
            // The consumer went away after the queue chose it: the message goes back.
            d.queue.give_back(vec![d.id]);
            if d.counted {
                chan.limiter.release(1).run();
            }
            return;
        };
        let m = match d.message.load() {
            Ok(m) => m,
            Err(e) => {
                // The message goes back to its queue; the connection closes with 541.
                tracing::error!(queue = %d.queue.name, error = %e, "cannot read a stored message");
                self.store_failed = true;
                d.queue.give_back(vec![d.id]);
                return;
            }
        };
        let tag = chan.next_tag;
        chan.next_tag += 1;
        let redelivered = d.redelivered;
        self.ctx.count(|s| {
            s.delivered += 1;
            s.delivered_no_ack += u64::from(no_ack);
            s.redelivered += u64::from(redelivered);
        });
        out.method_with(d.channel, |b| {
            put_basic_deliver(
                b,
                consumer_tag.as_bytes(),
                tag,
                d.redelivered,
                m.exchange(),
                m.routing_key(),
            );
        });
        if d.delivery_count > 0 && d.queue.is_quorum {
            let props = crate::deadletter::with_delivery_count(m.properties(), d.delivery_count);
            out.content(d.channel, &props, m.body());
        } else {
            out.content(d.channel, m.properties(), m.body());
        }
        if !no_ack {
            let (deadline, delivered_at) = consumer_deadline(&self.ctx, &d.queue);
            chan.track(
                tag,
                Unacked {
                    queue: Arc::clone(&d.queue),
                    id: d.id,
                    consumer: d.consumer,
                    counted: d.counted,
                    deadline,
                    delivered_at,
                },
            );
        }
        let key = (Arc::as_ptr(&d.queue) as usize, d.consumer);
        let entry = self
            .written
            .entry(key)
            .or_insert_with(|| (Arc::clone(&d.queue), 0, 0));
        entry.1 += 1;
        entry.2 += d.message.size();
    }

    /// Restore consumer windows for what was just written. Call after the write completes.
    pub fn after_write(&mut self) {
        for ((_, consumer), (queue, n, bytes)) in self.written.drain() {
            queue.written(consumer, n, bytes);
        }
    }

    /// A queue cancelled a consumer (deleted, or a stream's consumer failed): basic.cancel
    /// when the client takes server-sent cancels.
    fn consumer_cancelled(&mut self, ch: u16, consumer: ConsumerId, out: &mut FrameWriter) {
        let Some(chan) = self.channels.get_mut(&ch) else {
            return;
        };
        let Some(tag) = chan
            .consumers
            .iter()
            .find(|(_, e)| e.id == consumer)
            .map(|(t, _)| t.clone())
        else {
            return;
        };
        if let Some(entry) = chan.consumers.remove(&tag) {
            // A consumer of a partitioned queue leaves every partition when one cancels it.
            self.ctx.consumer_gone(chan, &entry);
        }
        if self.ctx.cancel_notify {
            out.method(
                ch,
                &AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                    consumer_tag: tag.into(),
                    nowait: true,
                })),
            );
        }
    }
}
