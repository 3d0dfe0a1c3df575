//! The queue class: queue.declare (server-named, passive, reply-to pseudo-queues, the
//! argument and equivalence checks), queue.bind, queue.unbind, queue.purge and queue.delete.

use amq_protocol::protocol::{AMQPClass, queue};
use amq_protocol::types::{AMQPValue, FieldTable};
use warren_amqp::{AmqpError, ReplyCode};

use crate::args::rs;
use crate::exchange::Destination;
use crate::node::access::{Perm, Resource};
use crate::queue::Queue;
use crate::routing::partitions::PartitionSpec;
use crate::routing::reply_to::REPLY_TO;
use crate::stats::Lifecycle;

use super::common::{expand_queue_name, locked, stream_unsupported, usable_queue, vhost_up};
use super::{Call, Channel, Ctx};

impl Call<'_> {
    /// queue.declare of a direct reply-to name (`amq.rabbitmq.reply-to` or a name it handed out).
    pub(super) fn queue_declare_reply_to(&mut self, d: queue::Declare) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        let vhost = &ctx.vhost;
        // rabbit_channel: every declare of a reply-to name is in effect passive; the
        // pseudo-queue, and a name handed out to a live reply consumer, exist with one
        // consumer (rabbit_volatile_queue:declare/2).
        let name = d.queue.as_str();
        if name != REPLY_TO && !vhost.replies.contains(name) {
            return Err(vhost.not_found("queue", name));
        }
        if !d.nowait {
            self.reply(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(
                queue::DeclareOk {
                    queue: name.into(),
                    message_count: 0,
                    consumer_count: 1,
                },
            )));
        }
        Ok(())
    }

    /// queue.declare: a partitioned queue (`x-partitions`, or the name of one), else
    /// [`Call::queue_declare_one`].
    pub(super) fn queue_declare(&mut self, d: queue::Declare) -> Result<(), AmqpError> {
        self.refuse_partition_identity(&d)?;
        let vhost = &self.ctx.vhost;
        if !d.passive {
            let what = rs("queue", d.queue.as_str(), &vhost.name);
            if let Some(spec) = PartitionSpec::from_arguments(&d.arguments, &what)? {
                return self.queue_declare_partitioned(d, spec);
            }
        }
        if !d.queue.as_str().is_empty()
            && vhost.queue(d.queue.as_str()).is_none()
            && let Some(set) = vhost.partitioned(d.queue.as_str())
        {
            return self.queue_declare_logical(&d, &set);
        }
        self.queue_declare_one(d)
    }

    /// queue.declare of one queue: server-named, passive or a declaration (created, or checked
    /// equivalent to the existing queue); the queue becomes the channel's last declared one.
    pub(super) fn queue_declare_one(&mut self, mut d: queue::Declare) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        let vhost = &ctx.vhost;
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
        self.chan.last_queue = Some(q.name.clone());
        ctx.broker.stats().event(Lifecycle::QueueDeclared);
        // A declare counts as use for x-expires (and arms its timer on a new queue).
        q.touch();
        if !d.nowait {
            let c = q.counts();
            self.reply(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(
                queue::DeclareOk {
                    queue: q.name.as_str().into(),
                    message_count: c.messages,
                    consumer_count: c.consumers,
                },
            )));
        }
        Ok(())
    }

    /// queue.bind.
    pub(super) fn queue_bind(&mut self, b: queue::Bind) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        let vhost = &ctx.vhost;
        let (qname, rk) = queue_binding(ctx, self.chan, b.queue.as_str(), b.routing_key.as_str())?;
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
            self.reply(AMQPClass::Queue(queue::AMQPMethod::BindOk(
                queue::BindOk {},
            )));
        }
        Ok(())
    }

    /// queue.unbind.
    pub(super) fn queue_unbind(&mut self, u: queue::Unbind) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        let vhost = &ctx.vhost;
        let (qname, rk) = queue_binding(ctx, self.chan, u.queue.as_str(), u.routing_key.as_str())?;
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
        self.reply(AMQPClass::Queue(queue::AMQPMethod::UnbindOk(
            queue::UnbindOk {},
        )));
        Ok(())
    }

    /// queue.purge: drop the ready messages (not a stream's).
    pub(super) fn queue_purge(&mut self, p: queue::Purge) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        let name = expand_queue_name(self.chan, p.queue.as_str())?;
        ctx.allow(Perm::Read, Resource::Queue, &name)?;
        if ctx.vhost.queue(&name).is_none()
            && let Some(set) = ctx.vhost.partitioned(&name)
        {
            let n = self.purge_partitioned(&set)?;
            if !p.nowait {
                self.reply(AMQPClass::Queue(queue::AMQPMethod::PurgeOk(
                    queue::PurgeOk { message_count: n },
                )));
            }
            return Ok(());
        }
        let q = usable_queue(ctx, &name)?;
        if q.is_stream {
            // rabbit_stream_queue:purge is not supported (rabbitmq-server#2483).
            return Err(stream_unsupported(&q, "queue.purge"));
        }
        let n = q.purge(&mut || ctx.on_commit());
        if !p.nowait {
            self.reply(AMQPClass::Queue(queue::AMQPMethod::PurgeOk(
                queue::PurgeOk { message_count: n },
            )));
        }
        Ok(())
    }

    /// queue.delete (if-empty, if-unused); deleting a missing queue succeeds with 0.
    pub(super) fn queue_delete(&mut self, d: queue::Delete) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        let vhost = &ctx.vhost;
        let name = expand_queue_name(self.chan, d.queue.as_str())?;
        ctx.allow(Perm::Configure, Resource::Queue, &name)?;
        let count = match vhost.queue(&name) {
            None => match vhost.partitioned(&name) {
                Some(set) => self.delete_partitioned(&d, &name, &set)?,
                None => 0,
            },
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
            self.reply(AMQPClass::Queue(queue::AMQPMethod::DeleteOk(
                queue::DeleteOk {
                    message_count: count,
                },
            )));
        }
        Ok(())
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
