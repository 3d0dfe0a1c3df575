//! basic.publish: the checks of a publish, direct reply-to rewriting, delayed publishes,
//! routing (sender-selected CC/BCC too), enqueueing (now, or at tx.commit), mandatory returns
//! and counting the publish for publisher confirms.

use std::sync::Arc;

use amq_protocol::protocol::basic;
use amq_protocol::types::FieldTable;
use warren_amqp::assembler::Content;
use warren_amqp::method::put_basic_return;
use warren_amqp::{AmqpError, ReplyCode};

use crate::exchange::RoutingHeaders;
use crate::message::Message;
use crate::node::access::{Perm, Resource};
use crate::queue::outbox::Outbound;
use crate::queue::{Enqueued, Queue, publish_routed};
use crate::routing::reply_to::{REPLY_TO, REPLY_TO_PREFIX, reply_node};

use super::{Call, Channel, Ctx, Mode, TxPublish};

impl Call<'_> {
    /// basic.publish: routed at once; enqueued now, or at commit on a transactional channel.
    pub(super) fn basic_publish(
        &mut self,
        p: basic::Publish,
        content: Option<Content>,
    ) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        let ch = self.ch;
        ctx.publishes.set(ctx.publishes.get() + 1);
        let content = content.ok_or_else(|| {
            AmqpError::connection(ReplyCode::FrameError, "publish without content")
        })?;
        let size = content.body.len() as u64;
        ctx.count(|s| {
            s.published += 1;
            s.observe_message_size(size);
        });
        if !self.chan.publishing {
            self.chan.publishing = true;
            ctx.broker.stats().publisher(true);
        }
        if p.immediate {
            return Err(AmqpError::channel(
                ReplyCode::NotImplemented,
                "immediate=true",
            ));
        }
        if p.exchange.as_str() == super::lease::LEASE_EXCHANGE {
            // Acts on this channel's own deliveries only: no exchange permission applies.
            return self.lease_extension(p.routing_key.as_str(), &content);
        }
        ctx.allow(Perm::Write, Resource::Exchange, p.exchange.as_str())?;
        ctx.allow_topic(Perm::Write, p.exchange.as_str(), p.routing_key.as_str())?;
        if let Some(user_id) = content.properties.user_id()
            && user_id != ctx.user.as_bytes()
            && !ctx.impersonator
        {
            return Err(AmqpError::channel(
                ReplyCode::PreconditionFailed,
                format!(
                    "user_id property set to '{}' but authenticated user was '{}'",
                    String::from_utf8_lossy(user_id),
                    ctx.user
                ),
            ));
        }
        if let Some(e) = content.properties.expiration() {
            crate::args::check_expiration(e)?;
        }
        let mut content = content;
        if content.properties.reply_to() == Some(REPLY_TO.as_bytes()) {
            let Some((_, name)) = &self.chan.reply_consumer else {
                return Err(AmqpError::channel(
                    ReplyCode::PreconditionFailed,
                    "fast reply consumer does not exist",
                ));
            };
            let raw = content.properties.with_reply_to(name.as_bytes());
            content.properties = warren_amqp::properties::Properties::parse(
                raw,
                warren_amqp::limits::TABLE_DEPTH_MAX,
            )
            .map_err(|_| AmqpError::connection(ReplyCode::InternalError, "reply-to rewrite"))?;
        }
        if schedule_delayed(
            ctx,
            self.chan,
            ch,
            p.exchange.as_str(),
            p.routing_key.as_str(),
            &content,
        ) {
            return Ok(());
        }
        let mut targets = std::mem::take(&mut self.chan.route_buf);
        targets.clear();
        let message = route(
            ctx,
            p.exchange.as_str(),
            p.routing_key.as_str(),
            content,
            &mut targets,
        );
        let message = match message {
            Ok(m) => m,
            Err(e) => {
                self.chan.route_buf = targets;
                return Err(e);
            }
        };
        if let Mode::Tx(buf) = &mut self.chan.mode {
            // Routed now, enqueued at commit (RabbitMQ's order: errors surface at publish).
            buf.publishes.push(TxPublish {
                message,
                targets: targets.clone(),
                mandatory: p.mandatory,
            });
            targets.clear();
            self.chan.route_buf = targets;
            return Ok(());
        }
        let targets = self.enqueue_routed(&message, targets, p.mandatory);
        self.chan.route_buf = targets;
        Ok(())
    }

    /// Enqueue a routed message; returns it unroutable (basic.return) when mandatory and no queue
    /// took it, and counts the publish for confirms. Gives back the emptied target buffer.
    pub(super) fn enqueue_routed(
        &mut self,
        message: &Arc<Message>,
        mut targets: Vec<Arc<Queue>>,
        mandatory: bool,
    ) -> Vec<Arc<Queue>> {
        let (ctx, ch) = (self.ctx, self.ch);
        let seq = self.chan.mode.next_publish_seq();
        let mut outcome = Enqueued::Gone;
        if is_direct_reply(&message.exchange, &message.routing_key)
            && (ctx.vhost.replies.deliver(message) || forward_reply(ctx, message))
        {
            outcome = Enqueued::Accepted;
        }
        let epoch = self.chan.epoch;
        let mode = &mut self.chan.mode;
        let (routed, _) = publish_routed(&targets, message, || {
            mode.durable_completion(ctx, epoch, ch, seq)
        });
        outcome = outcome.and(routed);
        if let Some(q) = targets.iter().find(|q| q.flow_pressure()) {
            *ctx.flow.borrow_mut() = Some(Arc::clone(q));
        }
        targets.clear();
        if let (Enqueued::Rejected, Some(seq), Mode::Confirm { nacks, .. }) =
            (outcome, seq, &mut self.chan.mode)
        {
            // A queue at its limit refused it (reject-publish): nack, and no basic.return.
            nacks.insert(seq);
        }
        ctx.count(|s| match (outcome, mandatory) {
            (Enqueued::Gone, true) => s.unroutable_returned += 1,
            (Enqueued::Gone, false) => s.unroutable_dropped += 1,
            _ => s.routed += 1,
        });
        if outcome == Enqueued::Gone && mandatory {
            self.out.method_with(ch, |b| {
                put_basic_return(
                    b,
                    ReplyCode::NoRoute.code(),
                    b"NO_ROUTE",
                    message.exchange.as_bytes(),
                    message.routing_key.as_bytes(),
                )
            });
            self.out.content(ch, &message.properties.raw, &message.body);
        }
        targets
    }
}

/// Resolve the exchange and collect the queues a message goes to (404 for a missing exchange,
/// 403 for an internal one).
fn route(
    ctx: &Ctx,
    exchange: &str,
    routing_key: &str,
    content: Content,
    targets: &mut Vec<Arc<Queue>>,
) -> Result<Arc<Message>, AmqpError> {
    let mut properties = content.properties;
    // Sender-selected distribution: CC and BCC header keys route too; BCC is removed.
    let (cc, bcc) = crate::deadletter::sender_selected(&properties);
    let headers = RoutingHeaders::new(&properties);
    ctx.vhost.route(exchange, routing_key, &headers, targets)?;
    if !(cc.is_empty() && bcc.is_empty()) {
        for key in cc.iter().chain(&bcc) {
            ctx.vhost.route(exchange, key, &headers, targets)?;
        }
        let mut seen = std::collections::HashSet::new();
        targets.retain(|q| seen.insert(Arc::as_ptr(q)));
        if !bcc.is_empty()
            && let Some(h) = headers.get()
        {
            let mut map = h.inner().clone();
            map.remove("BCC");
            let h = FieldTable::from(map);
            let raw = properties.rewrite(&warren_amqp::table::encode_table(&h), false);
            properties = warren_amqp::properties::Properties::parse(
                raw,
                warren_amqp::limits::TABLE_DEPTH_MAX,
            )
            .map_err(|_| AmqpError::connection(ReplyCode::InternalError, "BCC removal"))?;
        }
    }
    Ok(Arc::new(Message {
        exchange: exchange.to_string(),
        routing_key: routing_key.to_string(),
        properties,
        body: content.body,
    }))
}

/// A publish to a delayed exchange with a positive `x-delay`: held until due (see
/// [`crate::routing::delayed`]). Returns false if it is not one.
fn schedule_delayed(
    ctx: &Ctx,
    chan: &mut Channel,
    ch: u16,
    exchange: &str,
    routing_key: &str,
    content: &Content,
) -> bool {
    let Some(delay) = crate::routing::delayed::delay_of(&content.properties) else {
        return false;
    };
    let Some((durable, internal)) = ctx.vhost.delayed_exchange(exchange) else {
        return false;
    };
    if internal {
        // Routing refuses it with 403, as for any internal exchange.
        return false;
    }
    let seq = chan.mode.next_publish_seq();
    let message = Arc::new(Message {
        exchange: exchange.to_string(),
        routing_key: routing_key.to_string(),
        properties: content.properties.clone(),
        body: content.body.clone(),
    });
    let due = crate::timers::wall_ms().saturating_add(delay);
    let epoch = chan.epoch;
    let mode = &mut chan.mode;
    ctx.vhost.delayed.schedule(message, due, durable, || {
        mode.durable_completion(ctx, epoch, ch, seq)
    });
    true
}

/// Send a direct reply whose requester is on another node there; false when its name names
/// no other running node of the cluster (then it is unroutable).
fn forward_reply(ctx: &Ctx, message: &Arc<Message>) -> bool {
    let Some(cluster) = ctx.broker.cluster() else {
        return false;
    };
    let Some(node) = reply_node(&message.routing_key).filter(|n| *n != cluster.node_number())
    else {
        return false;
    };
    let Some(outbox) = cluster.reply_outbox(node) else {
        return false;
    };
    outbox.push(Outbound::PeerReply {
        vhost: ctx.vhost.name.clone(),
        message: Arc::clone(message),
    });
    true
}

/// Whether a publish is a direct reply (default exchange, a reply-to name as routing key).
fn is_direct_reply(exchange: &str, routing_key: &str) -> bool {
    exchange.is_empty() && routing_key.starts_with(REPLY_TO_PREFIX)
}
