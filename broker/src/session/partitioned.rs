//! queue.declare, queue.delete and queue.purge of a partitioned queue (`x-partitions: N`): the
//! method applied to each partition `name-0 .. name-(N-1)`, answered once for the logical name
//! with the partitions' totals. Routing to the logical name is `routing::partitions`.

use amq_protocol::protocol::{AMQPClass, queue};
use warren_amqp::{AmqpError, ReplyCode};

use crate::args::rs;
use crate::node::access::{Perm, Resource};
use crate::routing::partitions::{
    PARTITION_INDEX_ARG, PARTITION_OF_ARG, PARTITIONS_ARG, PartitionSet, PartitionSpec,
    partition_name,
};

use super::Call;

/// Messages and consumers of a partitioned queue: the sums over its partitions.
fn totals(set: &PartitionSet) -> (u32, u32) {
    set.queues().fold((0u32, 0u32), |(m, c), q| {
        let n = q.counts();
        (m.saturating_add(n.messages), c.saturating_add(n.consumers))
    })
}

impl Call<'_> {
    /// A declare whose arguments only the broker may give (a partition's identity): 406, so a
    /// client cannot make a queue that routing would take for a partition.
    pub(super) fn refuse_partition_identity(&self, d: &queue::Declare) -> Result<(), AmqpError> {
        for key in [PARTITION_OF_ARG, PARTITION_INDEX_ARG] {
            if d.arguments.inner().contains_key(key) {
                return Err(AmqpError::channel(
                    ReplyCode::PreconditionFailed,
                    format!(
                        "invalid arg '{key}' for {}: set by the broker on partitions",
                        rs("queue", d.queue.as_str(), &self.ctx.vhost.name)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// queue.declare with `x-partitions`: declare each partition as an ordinary queue with the
    /// same flags and arguments (plus its identity), then answer for the logical name. Declaring
    /// it again with the same spec is a no-op that re-declares missing partitions; another
    /// spec, or the name of an ordinary queue, is 406.
    pub(super) fn queue_declare_partitioned(
        &mut self,
        d: queue::Declare,
        spec: PartitionSpec,
    ) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        let vhost = &ctx.vhost;
        let name = d.queue.as_str().to_string();
        let what = rs("queue", &name, &vhost.name);
        if name.is_empty() || d.exclusive {
            return Err(AmqpError::channel(
                ReplyCode::PreconditionFailed,
                format!("a partitioned queue needs a name and cannot be exclusive: {what}"),
            ));
        }
        ctx.allow(Perm::Configure, Resource::Queue, &name)?;
        if vhost.queue(&name).is_some() {
            return Err(AmqpError::channel(
                ReplyCode::PreconditionFailed,
                format!(
                    "inequivalent arg '{PARTITIONS_ARG}' for {what}: received {} but current is none",
                    spec.count
                ),
            ));
        }
        if let Some(existing) = vhost.partitioned(&name)
            && existing.spec != spec
        {
            return Err(AmqpError::channel(
                ReplyCode::PreconditionFailed,
                format!(
                    "inequivalent arg '{PARTITIONS_ARG}' for {what}: received {} ({:?}) but current is {} ({:?})",
                    spec.count, spec.key, existing.spec.count, existing.spec.key
                ),
            ));
        }
        for index in 0..spec.count {
            let partition = partition_name(&name, index);
            let short =
                amq_protocol::types::ShortString::try_new(partition.clone()).map_err(|_| {
                    AmqpError::channel(
                        ReplyCode::PreconditionFailed,
                        format!("partition name too long: {partition:.60}"),
                    )
                })?;
            self.queue_declare_one(queue::Declare {
                queue: short,
                passive: false,
                durable: d.durable,
                exclusive: false,
                auto_delete: d.auto_delete,
                nowait: true,
                arguments: spec.partition_arguments(&name, index, &d.arguments),
            })?;
        }
        self.chan.last_queue = Some(name.clone());
        if !d.nowait {
            // Partitions of a replicated type join the topology when the cluster commits them:
            // a new one counts nothing yet, which is what it holds.
            let (messages, consumers) = vhost.partitioned(&name).map_or((0, 0), |s| totals(&s));
            self.reply(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(
                queue::DeclareOk {
                    queue: name.as_str().into(),
                    message_count: messages,
                    consumer_count: consumers,
                },
            )));
        }
        Ok(())
    }

    /// A passive declare (or a declare without `x-partitions`) of a partitioned queue's name:
    /// declare-ok with the totals, or 406 if the declare asked for an ordinary queue.
    pub(super) fn queue_declare_logical(
        &mut self,
        d: &queue::Declare,
        set: &PartitionSet,
    ) -> Result<(), AmqpError> {
        let name = d.queue.as_str();
        if !d.passive {
            return Err(AmqpError::channel(
                ReplyCode::PreconditionFailed,
                format!(
                    "inequivalent arg '{PARTITIONS_ARG}' for {}: received none but current is {}",
                    rs("queue", name, &self.ctx.vhost.name),
                    set.spec.count
                ),
            ));
        }
        self.chan.last_queue = Some(name.to_string());
        if !d.nowait {
            let (messages, consumers) = totals(set);
            self.reply(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(
                queue::DeclareOk {
                    queue: name.into(),
                    message_count: messages,
                    consumer_count: consumers,
                },
            )));
        }
        Ok(())
    }

    /// queue.delete of a partitioned queue: every partition (if-empty and if-unused judged on
    /// the totals, before any is deleted). Returns the messages deleted.
    pub(super) fn delete_partitioned(
        &mut self,
        d: &queue::Delete,
        name: &str,
        set: &PartitionSet,
    ) -> Result<u32, AmqpError> {
        let ctx = self.ctx;
        let (messages, consumers) = totals(set);
        let what = rs("queue", name, &ctx.vhost.name);
        if d.if_empty && messages > 0 {
            return Err(AmqpError::channel(
                ReplyCode::PreconditionFailed,
                format!("{what} not empty"),
            ));
        }
        if d.if_unused && consumers > 0 {
            return Err(AmqpError::channel(
                ReplyCode::PreconditionFailed,
                format!("{what} in use"),
            ));
        }
        let mut deleted = 0u32;
        for q in set.queues() {
            let n = ctx
                .vhost
                .delete_queue(q, &mut || ctx.on_commit())
                .unwrap_or(0);
            deleted = deleted.saturating_add(n);
        }
        Ok(deleted)
    }

    /// queue.purge of a partitioned queue: every partition. Returns the messages purged.
    pub(super) fn purge_partitioned(&mut self, set: &PartitionSet) -> Result<u32, AmqpError> {
        let ctx = self.ctx;
        let mut purged = 0u32;
        for q in set.queues() {
            if q.is_stream {
                return Err(super::common::stream_unsupported(q, "queue.purge"));
            }
            purged = purged.saturating_add(q.purge(&mut || ctx.on_commit()));
        }
        Ok(purged)
    }
}
