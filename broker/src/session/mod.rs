//! One connection's channels and the broker-side meaning of every AMQP method.
//!
//! A [`Session`] is driven by the connection task: [`Session::handle_command`] for each complete
//! command, [`Session::drain_outbox`] when deliveries arrive, [`Session::flush`] before writing,
//! [`Session::channel_closed`] / [`Session::close`] to release what a channel or the connection
//! holds. Errors come back as [`AmqpError`] values; the connection machine turns them into
//! `channel.close` or `connection.close` in one place. No method here blocks or awaits.
//!
//! This file holds the session's state (what the connection knows, the channel table, what a
//! channel records), its accessors, and the dispatch from each method to its handler: one
//! function per method, in the file of its class, as rabbit_channel's `handle_method` clauses.
//! Every handler's error leaves through `refused`, the one place it is stamped with the
//! method that caused it; its scope (channel or connection) was chosen where it was made.
//!
//! - `channel`: channel open/close and flow, a channel's delivery bookkeeping, consumer
//!   timeouts, the connection's close.
//! - `basic`: basic.consume, cancel, get, ack, nack, reject, recover, qos.
//! - `publish`: basic.publish: routing, delayed publishes, enqueueing, mandatory returns.
//! - `deliver`: writing what queues left in the outbox (deliveries, cancels, replies).
//! - `queue`, `exchange`, `tx`: their classes' methods.
//! - `confirm`: confirm.select and publisher-confirm bookkeeping (store completions).
//! - `common`: helpers several class files share (acks, queue lookups, refusals).
//! - `lease`: Warren's lease extension (a publish to `amq.warren.lease`: extend a
//!   delivery's consumer timeout, release it with a delay).

mod basic;
mod channel;
mod common;
mod confirm;
mod deliver;
mod exchange;
mod group;
mod lease;
mod partitioned;
mod publish;
mod queue;
mod tx;

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use amq_protocol::protocol::AMQPClass;
use amq_protocol::protocol::access::AMQPMethod as AccessMethod;
use amq_protocol::protocol::basic::AMQPMethod as BasicMethod;
use amq_protocol::protocol::channel::AMQPMethod as ChannelMethod;
use amq_protocol::protocol::confirm::AMQPMethod as ConfirmMethod;
use amq_protocol::protocol::exchange::AMQPMethod as ExchangeMethod;
use amq_protocol::protocol::queue::AMQPMethod as QueueMethod;
use amq_protocol::protocol::tx::AMQPMethod as TxMethod;
use amq_protocol::types::FieldTable;
use warren_amqp::assembler::{Command, Content};
use warren_amqp::frame::FrameWriter;
use warren_amqp::{AmqpError, ReplyCode};

use crate::message::Message;
use crate::node::access::{Access, Perm, Resource};
use crate::node::broker::Broker;
use crate::queue::Queue;
use crate::queue::limiter::Limiter;
use crate::queue::machine::{ConsumerId, MsgId};
use crate::queue::outbox::{Outbound, Outbox};
use crate::routing::reply_to::REPLY_TO;
use crate::routing::vhost::VHost;

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
    /// The queue named in basic.consume (a partitioned queue's logical name).
    queue_name: String,
    /// The queues it is subscribed to, all with consumer id `id` (ids are per queue): the
    /// queue; every partition of a partitioned queue; a group member's assigned partitions
    /// (none while it waits for an assignment).
    subscriptions: Vec<Arc<Queue>>,
    no_ack: bool,
    /// basic.consume's `exclusive`, for the management API.
    exclusive: bool,
    /// basic.consume's arguments as given, for the management API (a consumer's arguments
    /// are a few small fields).
    arguments: FieldTable,
    /// The channel's per-consumer prefetch when it subscribed.
    prefetch: u32,
    /// How it subscribes (a group member subscribes again on each assignment).
    spec: crate::queue::machine::ConsumerSpec,
    /// The consumer group it is a member of (`x-consumer-group`).
    group: Option<crate::groups::GroupKey>,
    /// How a group member reads a partition stream it is assigned (tracked under the group's
    /// name, so the next owner resumes where the group was).
    stream_spec: Option<crate::stream::reader::ConsumeSpec>,
}

impl ConsumerEntry {
    /// Cancel every subscription. Returns the auto-delete queues whose last consumer this was
    /// (the caller deletes them).
    #[must_use]
    fn cancel(&self) -> Vec<Arc<Queue>> {
        self.subscriptions
            .iter()
            .filter(|q| q.cancel(self.id))
            .cloned()
            .collect()
    }
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
    /// Wall-clock ms it was delivered (the lease extension's lifetime cap counts from it).
    delivered_at: u64,
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
    /// Delivery tags a consumer timeout returned to their quorum queue (the consumer was
    /// cancelled): a late ack, nack or reject of one is ignored, not a 406. At most
    /// [`RECLAIMED_TAGS_MAX`], the oldest forgotten first.
    reclaimed: BTreeSet<u64>,
    /// Has published (counted once in the node's publishers).
    publishing: bool,
    route_buf: Vec<Arc<Queue>>,
}

/// Most reclaimed delivery tags a channel remembers (see `Channel::reclaimed`).
pub const RECLAIMED_TAGS_MAX: usize = 10_000;

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

/// One command being handled: the connection, the channel it came on (and its number), and
/// the output its replies go to. The handlers are its methods, one per AMQP method.
struct Call<'a> {
    ctx: &'a Ctx,
    chan: &'a mut Channel,
    ch: u16,
    out: &'a mut FrameWriter,
}

impl Call<'_> {
    /// Write a reply method on this channel.
    fn reply(&mut self, m: AMQPClass) {
        self.out.method(self.ch, &m);
    }

    /// The method's handler (rabbit_channel's `handle_method` clauses).
    fn dispatch(&mut self, method: AMQPClass, content: Option<Content>) -> Result<(), AmqpError> {
        match method {
            AMQPClass::Basic(BasicMethod::Publish(p)) => self.basic_publish(p, content),
            AMQPClass::Basic(BasicMethod::Ack(a)) => self.basic_ack(a),
            AMQPClass::Basic(BasicMethod::Nack(n)) => self.basic_nack(n),
            AMQPClass::Basic(BasicMethod::Reject(r)) => self.basic_reject(r),
            AMQPClass::Basic(BasicMethod::Qos(q)) => self.basic_qos(q),
            AMQPClass::Basic(BasicMethod::Consume(c)) if c.queue.as_str() == REPLY_TO => {
                self.basic_consume_reply_to(c)
            }
            AMQPClass::Basic(BasicMethod::Consume(c)) => self.basic_consume(c),
            AMQPClass::Basic(BasicMethod::Cancel(c)) => self.basic_cancel(c),
            AMQPClass::Basic(BasicMethod::Get(g)) => self.basic_get(g),
            AMQPClass::Basic(BasicMethod::Recover(r)) => self.basic_recover(r),
            AMQPClass::Basic(BasicMethod::RecoverAsync(r)) => self.basic_recover_async(r),
            AMQPClass::Queue(QueueMethod::Declare(d)) if d.queue.as_str().starts_with(REPLY_TO) => {
                self.queue_declare_reply_to(d)
            }
            AMQPClass::Queue(QueueMethod::Declare(d)) => self.queue_declare(d),
            AMQPClass::Queue(QueueMethod::Bind(b)) => self.queue_bind(b),
            AMQPClass::Queue(QueueMethod::Unbind(u)) => self.queue_unbind(u),
            AMQPClass::Queue(QueueMethod::Purge(p)) => self.queue_purge(p),
            AMQPClass::Queue(QueueMethod::Delete(d)) => self.queue_delete(d),
            AMQPClass::Exchange(ExchangeMethod::Declare(d)) => self.exchange_declare(d),
            AMQPClass::Exchange(ExchangeMethod::Delete(d)) => self.exchange_delete(d),
            AMQPClass::Exchange(ExchangeMethod::Bind(b)) => self.exchange_bind(b),
            AMQPClass::Exchange(ExchangeMethod::Unbind(u)) => self.exchange_unbind(u),
            AMQPClass::Confirm(ConfirmMethod::Select(s)) => self.confirm_select(s),
            AMQPClass::Tx(TxMethod::Select(_)) => self.tx_select(),
            AMQPClass::Tx(TxMethod::Commit(_)) => self.tx_commit(),
            AMQPClass::Tx(TxMethod::Rollback(_)) => self.tx_rollback(),
            AMQPClass::Channel(ChannelMethod::Flow(f)) => self.channel_flow(f),
            AMQPClass::Access(AccessMethod::Request(_)) => self.access_request(),
            _ => Err(AmqpError::connection(
                ReplyCode::CommandInvalid,
                "unimplemented method",
            )),
        }
    }
}

/// The one way a handler's error leaves the session: stamped with the method that caused it
/// (sent back in the close). Its scope was chosen where it was made — `AmqpError::channel`
/// (the connection machine sends channel.close) or `AmqpError::connection` (connection.close).
fn refused(e: AmqpError, class_id: u16, method_id: u16) -> AmqpError {
    e.with_method(class_id, method_id)
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
    pub fn channel_infos(&self) -> Vec<crate::node::connections::ChannelInfo> {
        let mut v: Vec<_> = self
            .channels
            .iter()
            .map(|(n, c)| {
                let mut consumers: Vec<_> = c
                    .consumers
                    .iter()
                    .map(|(tag, e)| crate::node::connections::ConsumerInfo {
                        tag: tag.clone(),
                        queue: e.queue_name.clone(),
                        ack_required: !e.no_ack,
                        exclusive: e.exclusive,
                        arguments: e.arguments.clone(),
                        prefetch_count: e.prefetch,
                    })
                    .collect();
                consumers.sort_by(|a, b| a.tag.cmp(&b.tag));
                crate::node::connections::ChannelInfo {
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
        let mut call = Call {
            ctx: &self.ctx,
            chan,
            ch,
            out,
        };
        call.dispatch(cmd.method.class, cmd.content)
            .map_err(|e| refused(e, class_id, method_id))
    }
}
