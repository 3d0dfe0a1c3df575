//! One connection's channels and the broker-side meaning of every AMQP method.
//!
//! A [`Session`] is driven by the connection task: [`Session::handle_command`] for each complete
//! command, [`Session::drain_outbox`] when deliveries arrive, [`Session::flush`] before writing,
//! [`Session::channel_closed`] / [`Session::close`] to release what a channel or the connection
//! holds. Errors come back as [`AmqpError`] values; the connection machine turns them into
//! `channel.close` or `connection.close` in one place. No method here blocks or awaits.

use crate::stats::Lifecycle;
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use amq_protocol::protocol::{AMQPClass, access, basic, channel, confirm, exchange, queue, tx};
use amq_protocol::types::{AMQPValue, FieldTable};
use warren_amqp::assembler::{Command, Content};
use warren_amqp::frame::FrameWriter;
use warren_amqp::method::{
    put_basic_ack, put_basic_deliver, put_basic_get_ok, put_basic_nack, put_basic_return,
};
use warren_amqp::{AmqpError, ReplyCode};

use crate::access::{Access, Perm, Resource};
use crate::broker::Broker;
use crate::exchange::{Destination, ExchangeKind, RoutingHeaders};
use crate::limiter::Limiter;
use crate::message::Message;
use crate::outbox::{Delivery, Outbound, Outbox};
use crate::queue::machine::{ConsumerId, ConsumerSpec, MachineError, MsgId};
use crate::queue::{ConsumerSink, Enqueued, Queue, publish_routed};
use crate::reply_to::{REPLY_TO, REPLY_TO_PREFIX};
use crate::vhost::{ExchangeDecl, OnCommit, VHost, rs};

/// What a connection knows about itself, shared by its channels.
#[derive(Debug)]
struct Ctx {
    broker: Arc<Broker>,
    vhost: Arc<VHost>,
    conn_id: u64,
    user: String,
    outbox: Arc<Outbox>,
    /// Client supports server-sent basic.cancel.
    cancel_notify: bool,
    /// Store submissions whose replies this connection holds back until they are durable.
    gate: Cell<u32>,
    /// A queue this connection published into that asks publishers to pause (flow).
    flow: std::cell::RefCell<Option<Arc<Queue>>>,
    /// The user's permissions in this vhost.
    access: std::cell::RefCell<Access>,
    /// basic.publish commands received (resource alarms block connections that publish).
    publishes: Cell<u64>,
    /// The user has the `impersonator` tag: it may publish with any `user_id`.
    impersonator: bool,
    /// Counts since they were last added to the broker's totals.
    stats: Cell<crate::stats::MessageStats>,
    /// The connection and its channels were counted against the limits (a network
    /// connection); in-process sessions of the management API were not and release nothing.
    counted: bool,
}

impl Ctx {
    fn count(&self, f: impl FnOnce(&mut crate::stats::MessageStats)) {
        let mut s = self.stats.get();
        f(&mut s);
        self.stats.set(s);
    }
}

impl Ctx {
    /// RabbitMQ's permission check (403 channel error when refused).
    fn allow(&self, perm: Perm, resource: Resource, name: &str) -> Result<(), AmqpError> {
        self.access.borrow_mut().check(perm, resource, name)
    }

    /// Topic permissions: a routing key (write) or binding key (read) on a topic exchange.
    fn allow_topic(&self, perm: Perm, exchange: &str, key: &str) -> Result<(), AmqpError> {
        let mut access = self.access.borrow_mut();
        if !access.has_topic_permissions(exchange) || !self.vhost.is_topic_exchange(exchange) {
            return Ok(());
        }
        access.check_topic(perm, exchange, key)
    }

    /// A completion for a change the client's next reply depends on: output is held until it
    /// arrives (see [`Session::output_held`]).
    fn on_commit(&self) -> warren_store::writer::Completion {
        self.gate.set(self.gate.get() + 1);
        let outbox = Arc::clone(&self.outbox);
        Box::new(move |r| outbox.push(Outbound::Committed { ok: r.is_ok() }))
    }
}

#[derive(Debug)]
struct ConsumerEntry {
    id: ConsumerId,
    queue: Arc<Queue>,
    no_ack: bool,
    /// basic.consume's `exclusive`, for the management API.
    exclusive: bool,
    /// basic.consume's arguments as given, for the management API (a consumer's arguments
    /// are a few small fields).
    arguments: FieldTable,
    /// The channel's per-consumer prefetch when it subscribed.
    prefetch: u32,
}

#[derive(Debug, Clone)]
struct Unacked {
    queue: Arc<Queue>,
    /// The message id (a stream's: the offset).
    id: MsgId,
    /// The consumer it was delivered to (0 for basic.get): a stream gives its credit back.
    consumer: ConsumerId,
    /// Holds a slot of the channel's [`Limiter`].
    counted: bool,
    /// Wall-clock ms by which it must be acked (consumer timeout), `u64::MAX` for never.
    deadline: u64,
}

/// A settled-or-requeued decision, applied now or at tx.commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AckAction {
    Settle,
    /// The client asked for a requeue (nack, reject, recover).
    Requeue,
    /// Back without the client asking (its channel closed).
    Release,
    Discard,
}

/// A publish routed at publish time (as RabbitMQ does) and enqueued at commit.
#[derive(Debug)]
struct TxPublish {
    message: Arc<Message>,
    targets: Vec<Arc<Queue>>,
    mandatory: bool,
}

#[derive(Debug, Default)]
struct TxBuffer {
    publishes: Vec<TxPublish>,
    acks: Vec<(AckAction, u64, Unacked)>,
}

#[derive(Debug)]
enum Mode {
    Plain,
    Confirm {
        /// Sequence number of the last publish (0 = none yet).
        last_seq: u64,
        /// Highest sequence number already acked to the publisher.
        acked_upto: u64,
        /// Publishes waiting for the store; nothing at or above the lowest is acked.
        unconfirmed: BTreeSet<u64>,
        /// Publishes a queue refused: nacked (never acked) when their turn comes.
        nacks: BTreeSet<u64>,
        /// For the publish-to-confirm histogram: (last sequence number, when) at each flush
        /// that saw new publishes; a mark is observed once everything up to it is confirmed.
        marks: std::collections::VecDeque<(u64, std::time::Instant)>,
        /// Sequence number of the last mark observed.
        marked_upto: u64,
    },
    Tx(TxBuffer),
}

impl Mode {
    /// In confirm mode, number the next publish (from 1, as the client counts); else `None`.
    fn next_publish_seq(&mut self) -> Option<u64> {
        match self {
            Mode::Confirm { last_seq, .. } => {
                *last_seq += 1;
                Some(*last_seq)
            }
            _ => None,
        }
    }
}

#[derive(Debug)]
struct Channel {
    /// Incarnation: store completions for a closed channel must not touch a reopened one.
    epoch: u64,
    consumers: HashMap<String, ConsumerEntry>,
    unacked: BTreeMap<u64, Unacked>,
    next_tag: u64,
    /// basic.qos global=false: prefetch for consumers created afterwards.
    prefetch_consumer: u32,
    /// basic.qos global=true: shared by all consumers of the channel (0 = none).
    prefetch_channel: u32,
    limiter: Arc<Limiter>,
    mode: Mode,
    /// For the empty-queue-name shortcut.
    last_queue: Option<String>,
    /// Consumer of `amq.rabbitmq.reply-to` on this channel: (consumer tag, reply name).
    reply_consumer: Option<(String, String)>,
    /// (deadline, delivery tag) of unacked deliveries with a consumer timeout; entries whose
    /// tag is no longer unacked are dropped lazily.
    deadlines: BTreeSet<(u64, u64)>,
    /// Closed by a consumer timeout (waiting for the client's close-ok).
    timed_out: bool,
    /// Has published (counted once in the node's publishers).
    publishing: bool,
    route_buf: Vec<Arc<Queue>>,
}

impl Channel {
    /// Record an unacked delivery (and its consumer-timeout deadline).
    fn track(&mut self, tag: u64, u: Unacked) {
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
            route_buf: Vec::new(),
        }
    }
}

/// All channels of one connection.
#[derive(Debug)]
pub struct Session {
    ctx: Ctx,
    channels: HashMap<u16, Channel>,
    drained: Vec<Outbound>,
    /// Deliveries (count, bytes) written per (queue, consumer) since the last write completed.
    written: HashMap<(usize, ConsumerId), (Arc<Queue>, u32, u64)>,
    /// A store write this connection waited for failed.
    store_failed: bool,
}

fn reply(out: &mut FrameWriter, ch: u16, m: AMQPClass) {
    out.method(ch, &m);
}

/// basic.consume-ok for `tag`, unless the consume was nowait.
fn consume_ok(out: &mut FrameWriter, ch: u16, nowait: bool, tag: &str) {
    if !nowait {
        reply(
            out,
            ch,
            AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                consumer_tag: tag.into(),
            })),
        );
    }
}

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
fn apply_acks(
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

impl Session {
    /// A session for an opened connection.
    #[must_use]
    pub fn new(
        broker: Arc<Broker>,
        vhost: Arc<VHost>,
        user: String,
        outbox: Arc<Outbox>,
        cancel_notify: bool,
    ) -> Self {
        let access = Access::new(Arc::clone(&broker), &vhost.name, &user);
        Self::with_access(broker, vhost, user, outbox, cancel_notify, access)
    }

    /// A session of the broker itself (definitions import): no permission is checked, and
    /// it counts against no limit.
    #[must_use]
    pub fn internal(broker: Arc<Broker>, vhost: Arc<VHost>, outbox: Arc<Outbox>) -> Self {
        let access = Access::internal(Arc::clone(&broker), &vhost.name);
        let user = "warren-internal".to_string();
        let mut s = Self::with_access(broker, vhost, user, outbox, false, access);
        s.ctx.counted = false;
        s
    }

    /// An in-process session acting as `user` (the management API): permissions are the
    /// user's, and it counts against no connection or channel limit.
    #[must_use]
    pub fn direct(
        broker: Arc<Broker>,
        vhost: Arc<VHost>,
        user: String,
        outbox: Arc<Outbox>,
    ) -> Self {
        let mut s = Self::new(broker, vhost, user, outbox, false);
        s.ctx.counted = false;
        s
    }

    fn with_access(
        broker: Arc<Broker>,
        vhost: Arc<VHost>,
        user: String,
        outbox: Arc<Outbox>,
        cancel_notify: bool,
        access: Access,
    ) -> Self {
        let conn_id = broker.next_id();
        let impersonator = broker.user_has_tag(&user, "impersonator");
        Self {
            ctx: Ctx {
                broker,
                vhost,
                conn_id,
                user,
                outbox,
                cancel_notify,
                gate: Cell::new(0),
                flow: std::cell::RefCell::new(None),
                access: std::cell::RefCell::new(access),
                publishes: Cell::new(0),
                impersonator,
                stats: Cell::new(crate::stats::MessageStats::default()),
                counted: true,
            },
            channels: HashMap::new(),
            drained: Vec::new(),
            written: HashMap::new(),
            store_failed: false,
        }
    }

    /// The vhost this connection uses.
    #[must_use]
    pub fn vhost(&self) -> &Arc<VHost> {
        &self.ctx.vhost
    }

    /// This connection's id (owner of its exclusive queues).
    #[must_use]
    pub fn connection_id(&self) -> u64 {
        self.ctx.conn_id
    }

    /// The outbox other tasks deliver into.
    #[must_use]
    pub fn outbox(&self) -> &Arc<Outbox> {
        &self.ctx.outbox
    }

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
        for (_, c) in chan.consumers {
            if c.queue.cancel(c.id) {
                self.ctx
                    .vhost
                    .delete_queue(&c.queue, &mut || self.ctx.on_commit());
            }
        }
        let mut pending: Vec<Unacked> = chan.unacked.into_values().collect();
        if let Mode::Tx(buf) = chan.mode {
            pending.extend(buf.acks.into_iter().map(|(_, _, u)| u));
        }
        apply_acks(&chan.limiter, AckAction::Release, pending, None);
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

    /// Write what is owed before the output is flushed: coalesced publisher confirms.
    pub fn flush(&mut self, out: &mut FrameWriter) {
        // One clock read per flush, and only when a confirm channel needs it: this measures,
        // it never decides anything.
        let mut now = None;
        for (ch, chan) in &mut self.channels {
            if let Mode::Confirm {
                last_seq,
                acked_upto,
                unconfirmed,
                nacks,
                marks,
                marked_upto,
            } = &mut chan.mode
            {
                let marked = marks.back().map_or(*marked_upto, |m| m.0);
                if *last_seq > marked {
                    let t = *now.get_or_insert_with(std::time::Instant::now);
                    marks.push_back((*last_seq, t));
                    self.ctx.count(|s| s.received_confirm += *last_seq - marked);
                }
                let upto = unconfirmed.first().map_or(*last_seq, |first| first - 1);
                while let Some(&n) = nacks.first()
                    && n <= upto
                {
                    nacks.pop_first();
                    unconfirmed.remove(&n);
                    if n - 1 > *acked_upto {
                        let multiple = n - 1 - *acked_upto > 1;
                        out.method_with(*ch, |b| put_basic_ack(b, n - 1, multiple));
                        let acked = n - 1 - *acked_upto;
                        self.ctx.count(|s| s.confirmed += acked);
                    }
                    out.method_with(*ch, |b| put_basic_nack(b, n, false));
                    self.ctx.count(|s| s.nacked += 1);
                    *acked_upto = n;
                }
                if upto > *acked_upto {
                    let multiple = upto - *acked_upto > 1;
                    out.method_with(*ch, |b| put_basic_ack(b, upto, multiple));
                    let n = upto - *acked_upto;
                    self.ctx.count(|s| s.confirmed += n);
                    *acked_upto = upto;
                }
                while let Some(&(seq, at)) = marks.front()
                    && seq <= *acked_upto
                {
                    marks.pop_front();
                    let t = *now.get_or_insert_with(std::time::Instant::now);
                    self.ctx.broker.stats().confirm_seconds.observe_n(
                        t.saturating_duration_since(at).as_secs_f64(),
                        seq - *marked_upto,
                    );
                    *marked_upto = seq;
                }
            }
        }
        let stats = self.ctx.stats.take();
        if !stats.is_zero() {
            self.ctx.broker.stats().add(&stats);
        }
    }

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
                        if let Err(e) =
                            write_get(&self.ctx, chan, channel, &queue, no_ack, got, out)
                        {
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

    fn store_completion(&mut self, item: &Outbound) {
        match *item {
            Outbound::Committed { ok } => {
                if ok {
                    self.ctx.gate.set(self.ctx.gate.get().saturating_sub(1));
                } else {
                    // The held replies must never go out: keep the gate raised.
                    self.store_failed = true;
                }
            }
            Outbound::Confirmed {
                channel,
                epoch,
                seq,
                ok,
                nack,
            } => {
                if nack {
                    if let Some(chan) = self.channels.get_mut(&channel)
                        && chan.epoch == epoch
                        && let Mode::Confirm {
                            unconfirmed, nacks, ..
                        } = &mut chan.mode
                    {
                        unconfirmed.remove(&seq);
                        nacks.insert(seq);
                    }
                } else if !ok {
                    // Never confirmed: the seq stays waiting, so no ack passes it.
                    self.store_failed = true;
                } else if let Some(chan) = self.channels.get_mut(&channel)
                    && chan.epoch == epoch
                    && let Mode::Confirm { unconfirmed, .. } = &mut chan.mode
                {
                    unconfirmed.remove(&seq);
                }
            }
            _ => {}
        }
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

    /// The earliest consumer-timeout deadline (wall-clock ms) on any channel.
    pub fn next_deadline(&mut self) -> Option<u64> {
        self.channels
            .values_mut()
            .filter_map(Channel::next_deadline)
            .min()
    }

    /// Channels with a delivery not acked within its consumer timeout at `now` (wall-clock
    /// ms), with the error RabbitMQ closes them with (406).
    pub fn timed_out(&mut self, now: u64) -> Vec<(u16, AmqpError)> {
        let mut closing = Vec::new();
        for (ch, chan) in &mut self.channels {
            if let Some(deadline) = chan.next_deadline()
                && deadline <= now
            {
                let timeout = chan
                    .deadlines
                    .first()
                    .and_then(|(_, tag)| chan.unacked.get(tag))
                    .map_or(0, |u| consumer_timeout(&self.ctx, &u.queue).unwrap_or(0));
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
            }
        }
        closing
    }

    /// Whether output must be held: a change the client was (or is about to be) answered for
    /// is not durable yet. Reading may go on; replies stay in order because nothing is written.
    #[must_use]
    pub fn output_held(&self) -> bool {
        self.ctx.gate.get() > 0
    }

    /// A queue this connection published into is over its flow limits while its consumers
    /// are receiving: the caller should stop reading until [`Queue::flow_released`] (bounded
    /// by [`crate::limits::FLOW_PAUSE_MAX_MS`]). Taking it clears it.
    pub fn take_flow(&mut self) -> Option<Arc<Queue>> {
        self.ctx.flow.borrow_mut().take()
    }

    /// Its channels and consumers, for the management API.
    #[must_use]
    pub fn channel_infos(&self) -> Vec<crate::connections::ChannelInfo> {
        let mut v: Vec<_> = self
            .channels
            .iter()
            .map(|(n, c)| {
                let mut consumers: Vec<_> = c
                    .consumers
                    .iter()
                    .map(|(tag, e)| crate::connections::ConsumerInfo {
                        tag: tag.clone(),
                        queue: e.queue.name.clone(),
                        ack_required: !e.no_ack,
                        exclusive: e.exclusive,
                        arguments: e.arguments.clone(),
                        prefetch_count: e.prefetch,
                    })
                    .collect();
                consumers.sort_by(|a, b| a.tag.cmp(&b.tag));
                crate::connections::ChannelInfo {
                    number: *n,
                    prefetch_count: c.prefetch_consumer,
                    global_prefetch_count: c.prefetch_channel,
                    unacked: c.unacked.len() as u64,
                    confirm: matches!(c.mode, Mode::Confirm { .. }),
                    transactional: matches!(c.mode, Mode::Tx(_)),
                    consumers,
                }
            })
            .collect();
        v.sort_by_key(|c| c.number);
        v
    }

    /// The authenticated user.
    #[must_use]
    pub fn user(&self) -> &str {
        &self.ctx.user
    }

    /// Open channels.
    #[must_use]
    pub fn channel_count(&self) -> usize {
        self.channels.len()
    }

    /// The connection's id (unique on this node).
    #[must_use]
    pub fn conn_id(&self) -> u64 {
        self.ctx.conn_id
    }

    /// How many basic.publish commands this connection sent so far. Under a resource alarm a
    /// connection is blocked once this moves (RabbitMQ blocks publishers, not consumers).
    #[must_use]
    pub fn publishes(&self) -> u64 {
        self.ctx.publishes.get()
    }

    /// The store failed a write (or a read) this connection depends on. The connection must
    /// be dropped without writing what it holds: held replies and confirms would promise what
    /// is not on disk.
    #[must_use]
    pub fn store_failed(&self) -> bool {
        self.store_failed
    }

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
            let deadline = consumer_deadline(&self.ctx, &d.queue);
            chan.track(
                tag,
                Unacked {
                    queue: Arc::clone(&d.queue),
                    id: d.id,
                    consumer: d.consumer,
                    counted: d.counted,
                    deadline,
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
        chan.consumers.remove(&tag);
        if self.ctx.cancel_notify {
            reply(
                out,
                ch,
                AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                    consumer_tag: tag.into(),
                    nowait: true,
                })),
            );
        }
    }

    /// Handle one command on an open channel.
    pub fn handle_command(
        &mut self,
        ch: u16,
        cmd: Command,
        out: &mut FrameWriter,
    ) -> Result<(), AmqpError> {
        let (class_id, method_id) = (cmd.method.class_id, cmd.method.method_id);
        let Some(chan) = self.channels.get_mut(&ch) else {
            return Err(AmqpError::connection(
                ReplyCode::ChannelError,
                "expected 'channel.open'",
            ));
        };
        let ctx = &self.ctx;
        let r = match cmd.method.class {
            AMQPClass::Basic(m) => handle_basic(ctx, chan, ch, m, cmd.content, out),
            AMQPClass::Queue(m) => handle_queue(ctx, chan, ch, m, out),
            AMQPClass::Exchange(m) => handle_exchange(ctx, ch, m, out),
            AMQPClass::Confirm(confirm::AMQPMethod::Select(s)) => match chan.mode {
                Mode::Tx(_) => Err(AmqpError::channel(
                    ReplyCode::PreconditionFailed,
                    "cannot switch from tx to confirm mode",
                )),
                Mode::Confirm { .. } => Ok(()),
                Mode::Plain => {
                    chan.mode = Mode::Confirm {
                        last_seq: 0,
                        acked_upto: 0,
                        unconfirmed: BTreeSet::new(),
                        nacks: BTreeSet::new(),
                        marks: std::collections::VecDeque::new(),
                        marked_upto: 0,
                    };
                    Ok(())
                }
            }
            .map(|()| {
                if !s.nowait {
                    reply(
                        out,
                        ch,
                        AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
                    );
                }
            }),
            AMQPClass::Tx(m) => handle_tx(ctx, chan, ch, m, out),
            AMQPClass::Channel(channel::AMQPMethod::Flow(f)) => {
                if f.active {
                    reply(
                        out,
                        ch,
                        AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk {
                            active: true,
                        })),
                    );
                    Ok(())
                } else {
                    Err(AmqpError::channel(
                        ReplyCode::NotImplemented,
                        "active=false",
                    ))
                }
            }
            AMQPClass::Access(access::AMQPMethod::Request(_)) => {
                reply(
                    out,
                    ch,
                    AMQPClass::Access(access::AMQPMethod::RequestOk(access::RequestOk {})),
                );
                Ok(())
            }
            _ => Err(AmqpError::connection(
                ReplyCode::CommandInvalid,
                "unimplemented method",
            )),
        };
        r.map_err(|e| e.with_method(class_id, method_id))
    }
}

fn expand_queue_name(chan: &Channel, name: &str) -> Result<String, AmqpError> {
    if !name.is_empty() {
        return Ok(name.to_string());
    }
    chan.last_queue
        .clone()
        .ok_or_else(|| AmqpError::channel(ReplyCode::NotFound, "no previously declared queue"))
}

fn locked(q: &Queue, vhost: &str) -> AmqpError {
    AmqpError::channel(
        ReplyCode::ResourceLocked,
        format!(
            "cannot obtain exclusive access to locked {}. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration.",
            rs("queue", &q.name, vhost)
        ),
    )
}

/// The queue, if this connection may use it (exclusive queues belong to one connection).
fn usable_queue(ctx: &Ctx, name: &str) -> Result<Arc<Queue>, AmqpError> {
    let q = ctx.vhost.queue_or_404(name)?;
    match q.exclusive_owner {
        Some(owner) if owner != ctx.conn_id => Err(locked(&q, &ctx.vhost.name)),
        _ => Ok(q),
    }
}

fn handle_queue(
    ctx: &Ctx,
    chan: &mut Channel,
    ch: u16,
    m: queue::AMQPMethod,
    out: &mut FrameWriter,
) -> Result<(), AmqpError> {
    let vhost = &ctx.vhost;
    match m {
        queue::AMQPMethod::Declare(d) if d.queue.as_str().starts_with(REPLY_TO) => {
            // rabbit_channel: every declare of a reply-to name is in effect passive; the
            // pseudo-queue, and a name handed out to a live reply consumer, exist with one
            // consumer (rabbit_volatile_queue:declare/2).
            let name = d.queue.as_str();
            if name != REPLY_TO && !vhost.replies.contains(name) {
                return Err(vhost.not_found("queue", name));
            }
            if !d.nowait {
                reply(
                    out,
                    ch,
                    AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                        queue: name.into(),
                        message_count: 0,
                        consumer_count: 1,
                    })),
                );
            }
            Ok(())
        }
        queue::AMQPMethod::Declare(mut d) => {
            // The vhost's default queue type stands in for a missing x-queue-type on queues a
            // quorum queue can be (durable, neither exclusive nor auto-delete).
            if !d.passive
                && d.durable
                && !d.exclusive
                && !d.auto_delete
                && !d.arguments.inner().contains_key("x-queue-type")
                && let Some(t) = vhost.default_queue_type.read().as_deref()
                && t != "classic"
            {
                d.arguments.insert(
                    "x-queue-type".into(),
                    AMQPValue::LongString(t.as_bytes().to_vec().into()),
                );
            }
            let requested = d.queue.as_str();
            let kind = crate::args::QueueType::of(&d.arguments);
            if requested.is_empty() && !d.passive && !kind.server_named() {
                // rabbit_channel, before any other check of the declare.
                return Err(AmqpError::channel(
                    ReplyCode::PreconditionFailed,
                    format!(
                        "Cannot declare a server-named queue for type {}",
                        kind.module()
                    ),
                ));
            }
            let name = if requested.is_empty() {
                ctx.broker.unique_name("amq.gen-")
            } else {
                requested.to_string()
            };
            let q = if d.passive {
                usable_queue(ctx, &name)?
            } else {
                if requested.starts_with("amq.") {
                    return Err(AmqpError::channel(
                        ReplyCode::AccessRefused,
                        format!("queue name '{requested}' contains reserved prefix 'amq.*'"),
                    ));
                }
                ctx.allow(Perm::Configure, Resource::Queue, &name)?;
                vhost_up(ctx)?;
                if let Some(dlx) = crate::args::string_arg(&d.arguments, "x-dead-letter-exchange") {
                    ctx.allow(Perm::Write, Resource::Exchange, &dlx)?;
                    ctx.allow(Perm::Read, Resource::Queue, &name)?;
                }
                crate::args::validate_queue_args(
                    &d.arguments,
                    &rs("queue", &name, &vhost.name),
                    vhost.queue(&name).is_none(),
                )?;
                let what = rs("queue", &name, &vhost.name);
                if kind == crate::args::QueueType::Stream {
                    crate::stream::config_from_args(&d.arguments, &what)?;
                }
                if kind != crate::args::QueueType::Classic {
                    // rabbit_quorum_queue:declare's checks, in its order (rabbit_stream_queue
                    // makes the same ones).
                    for (bad, property) in [
                        (d.auto_delete, "auto-delete"),
                        (d.exclusive, "exclusive-owner"),
                        (!d.durable, "non-durable"),
                    ] {
                        if bad {
                            return Err(AmqpError::channel(
                                ReplyCode::PreconditionFailed,
                                format!(
                                    "invalid property '{property}' for {}",
                                    rs("queue", &name, &vhost.name)
                                ),
                            ));
                        }
                    }
                }
                let limit = vhost.limits.read().max_queues;
                if vhost.queue(&name).is_none()
                    && let Some(max) = crate::users::reached(limit, vhost.queue_count() as i64)
                {
                    return Err(AmqpError::channel(
                        ReplyCode::PreconditionFailed,
                        format!(
                            "cannot declare queue '{name}': queue limit in vhost '{}' ({max}) is reached",
                            vhost.name
                        ),
                    ));
                }
                // RabbitMQ forces exclusive queues to be non-durable.
                let durable = d.durable && !d.exclusive;
                let owner = d.exclusive.then_some(ctx.conn_id);
                let (q, created) = vhost.declare_queue(
                    || {
                        Queue::new(
                            ctx.broker.next_id(),
                            &name,
                            &vhost.name,
                            durable,
                            d.auto_delete,
                            owner,
                            d.arguments.clone(),
                            vhost.queue_env(),
                        )
                    },
                    &mut || ctx.on_commit(),
                )?;
                if !created {
                    check_queue_equivalence(
                        ctx,
                        &q,
                        d.exclusive,
                        durable,
                        d.auto_delete,
                        &d.arguments,
                    )?;
                }
                q
            };
            chan.last_queue = Some(q.name.clone());
            ctx.broker.stats().event(Lifecycle::QueueDeclared);
            // A declare counts as use for x-expires (and arms its timer on a new queue).
            q.touch();
            if !d.nowait {
                let c = q.counts();
                reply(
                    out,
                    ch,
                    AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                        queue: q.name.as_str().into(),
                        message_count: c.messages,
                        consumer_count: c.consumers,
                    })),
                );
            }
            Ok(())
        }
        queue::AMQPMethod::Bind(b) => {
            let (qname, rk) = queue_binding(ctx, chan, b.queue.as_str(), b.routing_key.as_str())?;
            ctx.allow(Perm::Write, Resource::Queue, &qname)?;
            ctx.allow(Perm::Read, Resource::Exchange, b.exchange.as_str())?;
            ctx.allow_topic(Perm::Read, b.exchange.as_str(), &rk)?;
            vhost.bind(
                b.exchange.as_str(),
                Destination::Queue(qname),
                &rk,
                b.arguments,
                &mut || ctx.on_commit(),
            )?;
            if !b.nowait {
                reply(
                    out,
                    ch,
                    AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})),
                );
            }
            Ok(())
        }
        queue::AMQPMethod::Unbind(u) => {
            let (qname, rk) = queue_binding(ctx, chan, u.queue.as_str(), u.routing_key.as_str())?;
            ctx.allow(Perm::Write, Resource::Queue, &qname)?;
            ctx.allow(Perm::Read, Resource::Exchange, u.exchange.as_str())?;
            ctx.allow_topic(Perm::Read, u.exchange.as_str(), &rk)?;
            vhost.unbind(
                u.exchange.as_str(),
                Destination::Queue(qname),
                &rk,
                u.arguments,
                &mut || ctx.on_commit(),
            )?;
            reply(
                out,
                ch,
                AMQPClass::Queue(queue::AMQPMethod::UnbindOk(queue::UnbindOk {})),
            );
            Ok(())
        }
        queue::AMQPMethod::Purge(p) => {
            let name = expand_queue_name(chan, p.queue.as_str())?;
            ctx.allow(Perm::Read, Resource::Queue, &name)?;
            let q = usable_queue(ctx, &name)?;
            if q.is_stream {
                // rabbit_stream_queue:purge is not supported (rabbitmq-server#2483).
                return Err(stream_unsupported(&q, "queue.purge"));
            }
            let n = q.purge(&mut || ctx.on_commit());
            if !p.nowait {
                reply(
                    out,
                    ch,
                    AMQPClass::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk {
                        message_count: n,
                    })),
                );
            }
            Ok(())
        }
        queue::AMQPMethod::Delete(d) => {
            let name = expand_queue_name(chan, d.queue.as_str())?;
            ctx.allow(Perm::Configure, Resource::Queue, &name)?;
            let count = match vhost.queue(&name) {
                None => 0,
                Some(_) => {
                    let q = usable_queue(ctx, &name)?;
                    let c = q.counts();
                    if d.if_empty && c.messages > 0 {
                        return Err(AmqpError::channel(
                            ReplyCode::PreconditionFailed,
                            format!("{} not empty", rs("queue", &name, &vhost.name)),
                        ));
                    }
                    if d.if_unused && c.consumers > 0 {
                        return Err(AmqpError::channel(
                            ReplyCode::PreconditionFailed,
                            format!("{} in use", rs("queue", &name, &vhost.name)),
                        ));
                    }
                    vhost.delete_queue(&q, &mut || ctx.on_commit()).unwrap_or(0)
                }
            };
            if !d.nowait {
                reply(
                    out,
                    ch,
                    AMQPClass::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk {
                        message_count: count,
                    })),
                );
            }
            Ok(())
        }
        _ => Err(AmqpError::connection(
            ReplyCode::CommandInvalid,
            "unimplemented method",
        )),
    }
}

fn check_queue_equivalence(
    ctx: &Ctx,
    q: &Queue,
    exclusive: bool,
    durable: bool,
    auto_delete: bool,
    args: &FieldTable,
) -> Result<(), AmqpError> {
    let what = rs("queue", &q.name, &ctx.vhost.name);
    // rabbit_amqqueue:check_exclusive_access(Q, Owner, strict): the declare's owner (this
    // connection when exclusive, else none) must be the queue's, so the owner redeclaring
    // its exclusive queue as non-exclusive is refused too.
    let declared_owner = exclusive.then_some(ctx.conn_id);
    if q.exclusive_owner != declared_owner {
        return Err(locked(q, &ctx.vhost.name));
    }
    for (arg, want, have) in [
        ("durable", durable, q.durable),
        ("auto_delete", auto_delete, q.auto_delete),
    ] {
        if want != have {
            return Err(AmqpError::channel(
                ReplyCode::PreconditionFailed,
                format!(
                    "inequivalent arg '{arg}' for {what}: received '{want}' but current is '{have}'"
                ),
            ));
        }
    }
    for key in crate::args::QUEUE_EQUIVALENCE_KEYS {
        let (want, have) = (args.inner().get(*key), q.arguments.inner().get(*key));
        // A queue without a type is classic: 'classic' and no type are equivalent.
        let classic = |v: Option<&AMQPValue>| {
            *key == "x-queue-type"
                && v.is_none_or(|v| crate::args::string_like(v).is_some_and(|t| t == b"classic"))
        };
        if !(crate::args::equivalent(want, have) || classic(want) && classic(have)) {
            return Err(AmqpError::channel(
                ReplyCode::PreconditionFailed,
                format!(
                    "inequivalent arg '{key}' for {what}: received {} but current is {}",
                    crate::args::render(want),
                    crate::args::render(have)
                ),
            ));
        }
    }
    Ok(())
}

fn handle_exchange(
    ctx: &Ctx,
    ch: u16,
    m: exchange::AMQPMethod,
    out: &mut FrameWriter,
) -> Result<(), AmqpError> {
    let vhost = &ctx.vhost;
    let default_refused = || {
        AmqpError::channel(
            ReplyCode::AccessRefused,
            "operation not permitted on the default exchange",
        )
    };
    match m {
        exchange::AMQPMethod::Declare(d) => {
            let name = d.exchange.as_str();
            if d.passive {
                if name.is_empty() {
                    return Err(default_refused());
                }
                vhost.check_exchange(name)?;
            } else {
                let delayed = d.kind.as_str() == crate::exchange::DELAYED_TYPE;
                let kind = if delayed {
                    // rabbitmq_delayed_message_exchange: the routing type comes from
                    // x-delayed-type.
                    crate::args::string_arg(&d.arguments, "x-delayed-type")
                        .and_then(|t| ExchangeKind::parse(&t))
                        .ok_or_else(|| {
                            AmqpError::channel(
                                ReplyCode::PreconditionFailed,
                                "Invalid argument, 'x-delayed-type' must be an existing exchange type",
                            )
                        })?
                } else {
                    ExchangeKind::parse(d.kind.as_str()).ok_or_else(|| {
                        AmqpError::channel(
                            ReplyCode::PreconditionFailed,
                            format!("unknown exchange type '{}'", d.kind.as_str()),
                        )
                    })?
                };
                if name.is_empty() {
                    return Err(default_refused());
                }
                ctx.allow(Perm::Configure, Resource::Exchange, name)?;
                vhost_up(ctx)?;
                if let Some(ae) = crate::args::string_arg(&d.arguments, "alternate-exchange") {
                    ctx.allow(Perm::Write, Resource::Exchange, &ae)?;
                    ctx.allow(Perm::Read, Resource::Exchange, name)?;
                }
                vhost.declare_exchange(
                    name,
                    ExchangeDecl {
                        kind,
                        durable: d.durable,
                        auto_delete: d.auto_delete,
                        internal: d.internal,
                        delayed,
                        arguments: d.arguments,
                    },
                    &mut || ctx.on_commit(),
                )?;
            }
            if !d.nowait {
                reply(
                    out,
                    ch,
                    AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
                );
            }
            Ok(())
        }
        exchange::AMQPMethod::Delete(d) => {
            if d.exchange.as_str().is_empty() {
                return Err(default_refused());
            }
            ctx.allow(Perm::Configure, Resource::Exchange, d.exchange.as_str())?;
            vhost.delete_exchange(d.exchange.as_str(), d.if_unused, &mut || ctx.on_commit())?;
            if !d.nowait {
                reply(
                    out,
                    ch,
                    AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {})),
                );
            }
            Ok(())
        }
        exchange::AMQPMethod::Bind(b) => {
            ctx.allow(Perm::Write, Resource::Exchange, b.destination.as_str())?;
            ctx.allow(Perm::Read, Resource::Exchange, b.source.as_str())?;
            ctx.allow_topic(Perm::Read, b.source.as_str(), b.routing_key.as_str())?;
            vhost.bind(
                b.source.as_str(),
                Destination::Exchange(b.destination.as_str().to_string()),
                b.routing_key.as_str(),
                b.arguments,
                &mut || ctx.on_commit(),
            )?;
            if !b.nowait {
                reply(
                    out,
                    ch,
                    AMQPClass::Exchange(exchange::AMQPMethod::BindOk(exchange::BindOk {})),
                );
            }
            Ok(())
        }
        exchange::AMQPMethod::Unbind(u) => {
            ctx.allow(Perm::Write, Resource::Exchange, u.destination.as_str())?;
            ctx.allow(Perm::Read, Resource::Exchange, u.source.as_str())?;
            ctx.allow_topic(Perm::Read, u.source.as_str(), u.routing_key.as_str())?;
            vhost.unbind(
                u.source.as_str(),
                Destination::Exchange(u.destination.as_str().to_string()),
                u.routing_key.as_str(),
                u.arguments,
                &mut || ctx.on_commit(),
            )?;
            if !u.nowait {
                reply(
                    out,
                    ch,
                    AMQPClass::Exchange(exchange::AMQPMethod::UnbindOk(exchange::UnbindOk {})),
                );
            }
            Ok(())
        }
        _ => Err(AmqpError::connection(
            ReplyCode::CommandInvalid,
            "unimplemented method",
        )),
    }
}

fn handle_tx(
    ctx: &Ctx,
    chan: &mut Channel,
    ch: u16,
    m: tx::AMQPMethod,
    out: &mut FrameWriter,
) -> Result<(), AmqpError> {
    let not_tx = || {
        AmqpError::channel(
            ReplyCode::PreconditionFailed,
            "channel is not transactional",
        )
    };
    match m {
        tx::AMQPMethod::Select(_) => {
            match chan.mode {
                Mode::Confirm { .. } => {
                    return Err(AmqpError::channel(
                        ReplyCode::PreconditionFailed,
                        "cannot switch from confirm to tx mode",
                    ));
                }
                Mode::Plain => chan.mode = Mode::Tx(TxBuffer::default()),
                Mode::Tx(_) => {}
            }
            reply(
                out,
                ch,
                AMQPClass::Tx(tx::AMQPMethod::SelectOk(tx::SelectOk {})),
            );
            Ok(())
        }
        tx::AMQPMethod::Commit(_) => {
            let Mode::Tx(buf) = &mut chan.mode else {
                return Err(not_tx());
            };
            let buf = std::mem::take(buf);
            for p in buf.publishes {
                enqueue_routed(ctx, chan, ch, &p.message, p.targets, p.mandatory, out);
            }
            for action in [AckAction::Settle, AckAction::Requeue, AckAction::Discard] {
                let of_kind = buf
                    .acks
                    .iter()
                    .filter(|(a, _, _)| *a == action)
                    .map(|(_, _, u)| u.clone());
                apply_acks(
                    &chan.limiter,
                    action,
                    of_kind,
                    Some(&mut || ctx.on_commit()),
                );
            }
            reply(
                out,
                ch,
                AMQPClass::Tx(tx::AMQPMethod::CommitOk(tx::CommitOk {})),
            );
            Ok(())
        }
        tx::AMQPMethod::Rollback(_) => {
            let Mode::Tx(buf) = &mut chan.mode else {
                return Err(not_tx());
            };
            let buf = std::mem::take(buf);
            // Acks not committed make their messages unacked again.
            for (_, tag, u) in buf.acks {
                chan.track(tag, u);
            }
            reply(
                out,
                ch,
                AMQPClass::Tx(tx::AMQPMethod::RollbackOk(tx::RollbackOk {})),
            );
            Ok(())
        }
        _ => Err(AmqpError::connection(
            ReplyCode::CommandInvalid,
            "unimplemented method",
        )),
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
    if multiple {
        if tag == 0 {
            return Ok(std::mem::take(&mut chan.unacked).into_iter().collect());
        }
        if !chan.unacked.contains_key(&tag) {
            return Err(unknown());
        }
        let rest = chan.unacked.split_off(&(tag + 1));
        let taken = std::mem::replace(&mut chan.unacked, rest);
        Ok(taken.into_iter().collect())
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

fn handle_basic(
    ctx: &Ctx,
    chan: &mut Channel,
    ch: u16,
    m: basic::AMQPMethod,
    content: Option<Content>,
    out: &mut FrameWriter,
) -> Result<(), AmqpError> {
    match m {
        basic::AMQPMethod::Publish(p) => {
            ctx.publishes.set(ctx.publishes.get() + 1);
            let content = content.ok_or_else(|| {
                AmqpError::connection(ReplyCode::FrameError, "publish without content")
            })?;
            let size = content.body.len() as u64;
            ctx.count(|s| {
                s.published += 1;
                s.observe_message_size(size);
            });
            if !chan.publishing {
                chan.publishing = true;
                ctx.broker.stats().publisher(true);
            }
            if p.immediate {
                return Err(AmqpError::channel(
                    ReplyCode::NotImplemented,
                    "immediate=true",
                ));
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
                let Some((_, name)) = &chan.reply_consumer else {
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
                chan,
                ch,
                p.exchange.as_str(),
                p.routing_key.as_str(),
                &content,
            ) {
                return Ok(());
            }
            let mut targets = std::mem::take(&mut chan.route_buf);
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
                    chan.route_buf = targets;
                    return Err(e);
                }
            };
            if let Mode::Tx(buf) = &mut chan.mode {
                // Routed now, enqueued at commit (RabbitMQ's order: errors surface at publish).
                buf.publishes.push(TxPublish {
                    message,
                    targets: targets.clone(),
                    mandatory: p.mandatory,
                });
                targets.clear();
                chan.route_buf = targets;
                return Ok(());
            }
            let targets = enqueue_routed(ctx, chan, ch, &message, targets, p.mandatory, out);
            chan.route_buf = targets;
            Ok(())
        }
        basic::AMQPMethod::Ack(a) => {
            let n = settle(chan, AckAction::Settle, a.delivery_tag, a.multiple)?;
            ctx.count(|s| s.acked += n as u64);
            Ok(())
        }
        basic::AMQPMethod::Nack(n) => settle(
            chan,
            if n.requeue {
                AckAction::Requeue
            } else {
                AckAction::Discard
            },
            n.delivery_tag,
            n.multiple,
        )
        .map(drop),
        basic::AMQPMethod::Reject(r) => settle(
            chan,
            if r.requeue {
                AckAction::Requeue
            } else {
                AckAction::Discard
            },
            r.delivery_tag,
            false,
        )
        .map(drop),
        basic::AMQPMethod::Qos(q) => {
            if q.global {
                let (before, after) = (chan.prefetch_channel, u32::from(q.prefetch_count));
                chan.prefetch_channel = after;
                let wake = chan.limiter.set_limit(after);
                if (before == 0) != (after == 0) {
                    for c in chan.consumers.values().filter(|c| !c.no_ack) {
                        c.queue.set_limited(c.id, after > 0);
                    }
                }
                wake.run();
            } else {
                chan.prefetch_consumer = u32::from(q.prefetch_count);
            }
            reply(
                out,
                ch,
                AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})),
            );
            Ok(())
        }
        basic::AMQPMethod::Consume(c) if c.queue.as_str() == REPLY_TO => {
            // rabbit_channel's reply-to clause, in its order.
            if chan.consumers.contains_key(c.consumer_tag.as_str()) {
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
            if chan.reply_consumer.is_some() {
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
            let name = format!("{REPLY_TO_PREFIX}{}", ctx.broker.unique_name(""));
            ctx.vhost
                .replies
                .register(&name, &ctx.outbox, ch, chan.epoch);
            chan.reply_consumer = Some((tag.clone(), name));
            consume_ok(out, ch, c.nowait, &tag);
            Ok(())
        }
        basic::AMQPMethod::Consume(c) => {
            if let Some(max) = ctx.broker.config.consumer_max_per_channel
                && chan.consumers.len() as u64 >= max
                && !chan.consumers.contains_key(c.consumer_tag.as_str())
            {
                // rabbit_channel: a hard error, so the whole connection closes.
                return Err(AmqpError::connection(
                    ReplyCode::NotAllowed,
                    format!("reached maximum ({max}) of consumers per channel"),
                )
                .with_method(60, 20));
            }
            let qname = expand_queue_name(chan, c.queue.as_str())?;
            ctx.allow(Perm::Read, Resource::Queue, &qname)?;
            let q = usable_queue(ctx, &qname)?;
            if q.is_stream && q.stream().is_none() {
                return Err(AmqpError::connection(
                    ReplyCode::InternalError,
                    format!(
                        "the files of stream {} could not be opened",
                        rs("queue", &q.name, &ctx.vhost.name)
                    ),
                ));
            }
            let stream_spec = match q.stream() {
                Some(_) => Some(crate::stream::reader::consume_spec(
                    &c.arguments,
                    u16::try_from(chan.prefetch_consumer).unwrap_or(u16::MAX),
                    c.no_ack,
                    &rs("queue", &q.name, &ctx.vhost.name),
                )?),
                None => None,
            };
            if (q.is_quorum || q.is_stream) && chan.prefetch_channel > 0 {
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
            let tag = if c.consumer_tag.as_str().is_empty() {
                ctx.broker.unique_name("amq.ctag-")
            } else {
                c.consumer_tag.as_str().to_string()
            };
            if chan.consumers.contains_key(&tag) {
                return Err(AmqpError::channel(
                    ReplyCode::NotAllowed,
                    format!("attempt to reuse consumer tag '{tag}'"),
                ));
            }
            if chan.consumers.len() >= crate::limits::CONSUMERS_PER_CHANNEL_MAX {
                return Err(AmqpError::channel(
                    ReplyCode::NotAllowed,
                    format!(
                        "reached maximum ({}) of consumers per channel",
                        crate::limits::CONSUMERS_PER_CHANNEL_MAX
                    ),
                ));
            }
            let prefetch = chan.prefetch_consumer;
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
                limited: !c.no_ack && chan.prefetch_channel > 0,
            };
            if let (Some(stream), Some(stream_spec)) = (q.stream(), &stream_spec) {
                stream.consume(
                    id,
                    stream_spec,
                    u16::try_from(prefetch).unwrap_or(u16::MAX),
                    ConsumerSink {
                        outbox: Arc::clone(&ctx.outbox),
                        channel: ch,
                        limiter: None,
                    },
                    crate::timers::wall_ms(),
                )?;
                chan.consumers.insert(
                    tag.clone(),
                    ConsumerEntry {
                        id,
                        queue: Arc::clone(&q),
                        no_ack: false,
                        exclusive: c.exclusive,
                        arguments: c.arguments.clone(),
                        prefetch,
                    },
                );
                consume_ok(out, ch, c.nowait, &tag);
                return Ok(());
            }
            chan.consumers.insert(
                tag.clone(),
                ConsumerEntry {
                    id,
                    queue: Arc::clone(&q),
                    no_ack: c.no_ack,
                    exclusive: c.exclusive,
                    arguments: c.arguments.clone(),
                    prefetch,
                },
            );
            if let Err(MachineError::ExclusiveInUse | MachineError::DuplicateConsumer) = q.consume(
                id,
                spec,
                ConsumerSink {
                    outbox: Arc::clone(&ctx.outbox),
                    channel: ch,
                    limiter: (!c.no_ack).then(|| Arc::clone(&chan.limiter)),
                },
            ) {
                chan.consumers.remove(&tag);
                return Err(AmqpError::channel(
                    ReplyCode::AccessRefused,
                    format!("{} in exclusive use", rs("queue", &q.name, &ctx.vhost.name)),
                ));
            }
            // Deliveries reach the socket only when the outbox is drained, after this reply.
            consume_ok(out, ch, c.nowait, &tag);
            Ok(())
        }
        basic::AMQPMethod::Cancel(c) => {
            if let Some((_, name)) = chan
                .reply_consumer
                .take_if(|(tag, _)| tag.as_str() == c.consumer_tag.as_str())
            {
                ctx.vhost.replies.unregister(&name);
            }
            if let Some(entry) = chan.consumers.remove(c.consumer_tag.as_str())
                && entry.queue.cancel(entry.id)
            {
                ctx.vhost
                    .delete_queue(&entry.queue, &mut || ctx.on_commit());
            }
            if !c.nowait {
                reply(
                    out,
                    ch,
                    AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                        consumer_tag: c.consumer_tag,
                    })),
                );
            }
            Ok(())
        }
        basic::AMQPMethod::Get(g) => {
            let name = expand_queue_name(chan, g.queue.as_str())?;
            ctx.allow(Perm::Read, Resource::Queue, &name)?;
            let q = usable_queue(ctx, &name)?;
            if q.is_stream {
                return Err(stream_unsupported(&q, "basic.get"));
            }
            if q.is_replicated() {
                // Its reply comes with the commit (see `Outbound::Got`).
                let (outbox, epoch, no_ack) = (Arc::clone(&ctx.outbox), chan.epoch, g.no_ack);
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
            write_get(ctx, chan, ch, &q, g.no_ack, got, out)
        }
        basic::AMQPMethod::Recover(r) => {
            recover(chan, r.requeue)?;
            reply(
                out,
                ch,
                AMQPClass::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {})),
            );
            Ok(())
        }
        basic::AMQPMethod::RecoverAsync(r) => recover(chan, r.requeue),
        _ => Err(AmqpError::connection(
            ReplyCode::CommandInvalid,
            "unimplemented method",
        )),
    }
}

/// Write basic.get-ok (tracking the delivery unless no-ack) or basic.get-empty.
fn write_get(
    ctx: &Ctx,
    chan: &mut Channel,
    ch: u16,
    q: &Arc<Queue>,
    no_ack: bool,
    got: Option<crate::queue::Got>,
    out: &mut FrameWriter,
) -> Result<(), AmqpError> {
    match got {
        None => {
            ctx.count(|s| s.get_empty += 1);
            reply(
                out,
                ch,
                AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
            )
        }
        Some((id, msg, redelivered, remaining, delivery_count)) => {
            let tag = chan.next_tag;
            chan.next_tag += 1;
            ctx.count(|s| {
                s.got += 1;
                s.got_no_ack += u64::from(no_ack);
                s.redelivered += u64::from(redelivered);
            });
            if !no_ack {
                let deadline = consumer_deadline(ctx, q);
                chan.track(
                    tag,
                    Unacked {
                        queue: Arc::clone(q),
                        id,
                        consumer: 0,
                        counted: false,
                        deadline,
                    },
                );
            }
            let msg = msg.load().map_err(|e| {
                tracing::error!(queue = %q.name, error = %e, "cannot read a stored message");
                AmqpError::connection(ReplyCode::InternalError, "cannot read a stored message")
            })?;
            out.method_with(ch, |b| {
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
                out.content(ch, &props, msg.body());
            } else {
                out.content(ch, msg.properties(), msg.body());
            }
        }
    }
    Ok(())
}

/// An outbox item the connection will not write (it is closing, or the channel is gone): a
/// message it holds goes back to its queue.
fn requeue_undelivered(item: Outbound) {
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
fn stream_unsupported(q: &Queue, what: &str) -> AmqpError {
    AmqpError::connection(
        ReplyCode::NotImplemented,
        format!(
            "{what} not supported by stream queues {}",
            rs("queue", &q.name, &q.vhost)
        ),
    )
}

/// RabbitMQ's refusal of anything but an ack for a stream's deliveries.
fn stream_requeue_refused(q: &Queue) -> AmqpError {
    stream_unsupported(q, "basic.nack and basic.reject")
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

/// The queue and routing key a queue.bind or queue.unbind names: an empty queue name means the
/// channel's last declared queue, and with it an empty key means that queue's name (RabbitMQ's
/// shortcut). A queue that exists must be usable by this connection (exclusive queues).
fn queue_binding(
    ctx: &Ctx,
    chan: &Channel,
    queue: &str,
    routing_key: &str,
) -> Result<(String, String), AmqpError> {
    let qname = expand_queue_name(chan, queue)?;
    let rk = if routing_key.is_empty() && queue.is_empty() {
        qname.clone()
    } else {
        routing_key.to_string()
    };
    if ctx.vhost.queue(&qname).is_some() {
        usable_queue(ctx, &qname)?;
    }
    Ok((qname, rk))
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

/// The consumer timeout of deliveries from `queue`: its `x-consumer-timeout`, else the
/// broker's default.
fn consumer_timeout(ctx: &Ctx, queue: &Queue) -> Option<u64> {
    queue
        .consumer_timeout
        .or(ctx.broker.config.consumer_timeout_ms)
        .filter(|t| *t > 0)
}

fn consumer_deadline(ctx: &Ctx, queue: &Queue) -> u64 {
    if queue.is_stream {
        // An unacked stream delivery holds nothing but the consumer's own credit.
        return u64::MAX;
    }
    consumer_timeout(ctx, queue).map_or(u64::MAX, |t| crate::timers::wall_ms().saturating_add(t))
}

/// The completion a publish waiting for the store gets: in confirm mode it confirms `seq`
/// (acks are held below the lowest waiting one), in tx mode it releases the held commit-ok.
fn durable_completion(
    ctx: &Ctx,
    mode: &mut Mode,
    epoch: u64,
    ch: u16,
    seq: Option<u64>,
) -> warren_store::writer::Completion {
    match (mode, seq) {
        (Mode::Confirm { unconfirmed, .. }, Some(seq)) => {
            unconfirmed.insert(seq);
            let outbox = Arc::clone(&ctx.outbox);
            Box::new(move |r| {
                outbox.push(Outbound::Confirmed {
                    channel: ch,
                    epoch,
                    seq,
                    ok: r.is_ok(),
                    nack: matches!(&r, Err(e) if matches!(**e, warren_store::StoreError::Replication(_))),
                });
            })
        }
        (Mode::Tx(_), _) => ctx.on_commit(),
        _ => Box::new(|_| {}),
    }
}

/// A publish to a delayed exchange with a positive `x-delay`: held until due (see
/// [`crate::delayed`]). Returns false if it is not one.
fn schedule_delayed(
    ctx: &Ctx,
    chan: &mut Channel,
    ch: u16,
    exchange: &str,
    routing_key: &str,
    content: &Content,
) -> bool {
    let Some(delay) = crate::delayed::delay_of(&content.properties) else {
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
        durable_completion(ctx, mode, epoch, ch, seq)
    });
    true
}

/// A deleted vhost takes no new declarations (its connections are being closed): they would
/// be stored for a vhost that no longer exists.
fn vhost_up(ctx: &Ctx) -> Result<(), AmqpError> {
    if ctx.vhost.is_down() {
        return Err(AmqpError::connection(
            ReplyCode::ConnectionForced,
            format!("vhost '{}' is deleted", ctx.vhost.name),
        ));
    }
    Ok(())
}

/// Whether a publish is a direct reply (default exchange, a reply-to name as routing key).
fn is_direct_reply(exchange: &str, routing_key: &str) -> bool {
    exchange.is_empty() && routing_key.starts_with(REPLY_TO_PREFIX)
}

/// Enqueue a routed message; returns it unroutable (basic.return) when mandatory and no queue
/// took it, and counts the publish for confirms. Gives back the emptied target buffer.
fn enqueue_routed(
    ctx: &Ctx,
    chan: &mut Channel,
    ch: u16,
    message: &Arc<Message>,
    mut targets: Vec<Arc<Queue>>,
    mandatory: bool,
    out: &mut FrameWriter,
) -> Vec<Arc<Queue>> {
    let seq = chan.mode.next_publish_seq();
    let mut outcome = Enqueued::Gone;
    if is_direct_reply(&message.exchange, &message.routing_key)
        && ctx.vhost.replies.deliver(message)
    {
        outcome = Enqueued::Accepted;
    }
    let epoch = chan.epoch;
    let mode = &mut chan.mode;
    let (routed, _) = publish_routed(&targets, message, || {
        durable_completion(ctx, mode, epoch, ch, seq)
    });
    outcome = outcome.and(routed);
    if let Some(q) = targets.iter().find(|q| q.flow_pressure()) {
        *ctx.flow.borrow_mut() = Some(Arc::clone(q));
    }
    targets.clear();
    if let (Enqueued::Rejected, Some(seq), Mode::Confirm { nacks, .. }) =
        (outcome, seq, &mut chan.mode)
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
        out.method_with(ch, |b| {
            put_basic_return(
                b,
                ReplyCode::NoRoute.code(),
                b"NO_ROUTE",
                message.exchange.as_bytes(),
                message.routing_key.as_bytes(),
            )
        });
        out.content(ch, &message.properties.raw, &message.body);
    }
    targets
}
