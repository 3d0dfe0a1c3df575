//! Partitioned queues: a logical queue `name` made of N ordinary queues `name-0 .. name-(N-1)`
//! of one type, a message published to the logical name going to the partition its key's hash
//! picks (so one key's messages stay in one partition, in order).
//!
//! Nothing but the partitions is stored or replicated: each partition carries the logical
//! definition in its own arguments (`x-partition-of`, `x-partition-index`, `x-partitions`,
//! `x-partition-key`), and a vhost rebuilds its [`PartitionIndex`] from the queues it holds, so
//! a restart, a replica and a node joining a cluster all see the same partitioned queues without
//! a record of their own. The logical queue exists while any of its partitions does.

use std::collections::HashMap;
use std::sync::Arc;

use amq_protocol::types::{AMQPValue, FieldTable};
use warren_amqp::{AmqpError, ReplyCode};

use crate::exchange::RoutingHeaders;
use crate::exchange::hash::{HashProperty, HashSource, jump};
use crate::limits::SUPER_STREAM_PARTITIONS_MAX;
use crate::queue::Queue;

/// The declare argument that asks for a partitioned queue (its value: the partition count).
pub const PARTITIONS_ARG: &str = "x-partitions";
/// The declare argument naming what a partitioned queue hashes.
pub const PARTITION_KEY_ARG: &str = "x-partition-key";
/// The argument a partition carries naming its logical queue (set by the broker only).
pub const PARTITION_OF_ARG: &str = "x-partition-of";
/// The argument a partition carries with its index (set by the broker only).
pub const PARTITION_INDEX_ARG: &str = "x-partition-index";

/// What a partitioned queue was declared with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionSpec {
    /// The number of partitions.
    pub count: u32,
    /// What is hashed to pick a partition.
    pub key: HashSource,
}

fn refuse(text: String) -> AmqpError {
    AmqpError::channel(ReplyCode::PreconditionFailed, text)
}

impl PartitionSpec {
    /// The spec a declare's arguments ask for: None without `x-partitions`; 406 for a count
    /// outside 1..=1024 or a key that is not `routing_key`, `header:<name>` or
    /// `property:message_id|correlation_id|timestamp`.
    pub fn from_arguments(args: &FieldTable, what: &str) -> Result<Option<Self>, AmqpError> {
        let Some(v) = args.inner().get(PARTITIONS_ARG) else {
            return Ok(None);
        };
        let count = crate::args::int_value(v)
            .and_then(|n| u32::try_from(n).ok())
            .filter(|n| (1..=SUPER_STREAM_PARTITIONS_MAX).contains(n))
            .ok_or_else(|| {
                refuse(format!(
                    "invalid arg '{PARTITIONS_ARG}' for {what}: it must be an integer from 1 to {SUPER_STREAM_PARTITIONS_MAX}"
                ))
            })?;
        let key = match args.inner().get(PARTITION_KEY_ARG) {
            None => HashSource::RoutingKey,
            Some(v) => {
                let text = crate::args::text_value(v).unwrap_or_default();
                parse_key(&text).ok_or_else(|| {
                    refuse(format!(
                        "invalid arg '{PARTITION_KEY_ARG}' for {what}: '{text}' is not routing_key, header:<name> or property:message_id|correlation_id|timestamp"
                    ))
                })?
            }
        };
        Ok(Some(Self { count, key }))
    }

    /// The partition a message goes to.
    #[must_use]
    pub fn pick(&self, routing_key: &str, headers: &RoutingHeaders<'_>) -> u32 {
        jump(self.key.hash(routing_key, headers), self.count)
    }

    /// The arguments of partition `index` of logical queue `logical` declared with `args`:
    /// the same, plus the partition's identity; `balanced` leader placement unless the
    /// declare chose one, so partitions' leaders spread over a cluster.
    #[must_use]
    pub fn partition_arguments(&self, logical: &str, index: u32, args: &FieldTable) -> FieldTable {
        let mut out = args.clone();
        out.insert(
            PARTITION_OF_ARG.into(),
            AMQPValue::LongString(logical.as_bytes().to_vec().into()),
        );
        out.insert(PARTITION_INDEX_ARG.into(), AMQPValue::LongUInt(index));
        if !out.inner().contains_key("x-queue-leader-locator") {
            out.insert(
                "x-queue-leader-locator".into(),
                AMQPValue::LongString("balanced".into()),
            );
        }
        out
    }
}

/// The name of partition `index` of `logical`.
#[must_use]
pub fn partition_name(logical: &str, index: u32) -> String {
    format!("{logical}-{index}")
}

fn parse_key(text: &str) -> Option<HashSource> {
    if text == "routing_key" {
        return Some(HashSource::RoutingKey);
    }
    if let Some(h) = text.strip_prefix("header:").filter(|h| !h.is_empty()) {
        return Some(HashSource::Header(h.to_string()));
    }
    match text.strip_prefix("property:")? {
        "message_id" => Some(HashSource::Property(HashProperty::MessageId)),
        "correlation_id" => Some(HashSource::Property(HashProperty::CorrelationId)),
        "timestamp" => Some(HashSource::Property(HashProperty::Timestamp)),
        _ => None,
    }
}

/// Which logical queue a queue is a partition of, with its index and the logical spec, read
/// from the arguments the broker gave it. None for any other queue.
#[must_use]
pub fn membership(queue: &Queue) -> Option<(String, u32, PartitionSpec)> {
    let args = queue.arguments.inner();
    let logical = crate::args::text_value(args.get(PARTITION_OF_ARG)?)?;
    let index = u32::try_from(crate::args::int_value(args.get(PARTITION_INDEX_ARG)?)?).ok()?;
    let spec = PartitionSpec::from_arguments(&queue.arguments, "").ok()??;
    (index < spec.count).then_some((logical, index, spec))
}

/// One logical queue: its spec and the partitions this vhost holds now (a slot is empty while a
/// partition is being created or deleted).
#[derive(Debug, Clone)]
pub struct PartitionSet {
    /// The spec.
    pub spec: PartitionSpec,
    /// Partition queues by index.
    pub members: Vec<Option<Arc<Queue>>>,
}

impl PartitionSet {
    /// The partition a message goes to, if it exists now.
    #[must_use]
    pub fn route(&self, routing_key: &str, headers: &RoutingHeaders<'_>) -> Option<&Arc<Queue>> {
        let i = self.spec.pick(routing_key, headers) as usize;
        self.members.get(i)?.as_ref()
    }

    /// The partitions that exist, in index order.
    pub fn queues(&self) -> impl Iterator<Item = &Arc<Queue>> {
        self.members.iter().flatten()
    }
}

/// A vhost's partitioned queues by logical name, kept beside its queue map.
#[derive(Debug, Default)]
pub struct PartitionIndex {
    sets: HashMap<String, PartitionSet>,
}

impl PartitionIndex {
    /// Note a queue that joined the vhost (nothing unless it is a partition).
    pub fn added(&mut self, queue: &Arc<Queue>) {
        let Some((logical, index, spec)) = membership(queue) else {
            return;
        };
        let set = self.sets.entry(logical).or_insert_with(|| PartitionSet {
            members: vec![None; spec.count as usize],
            spec,
        });
        if let Some(slot) = set.members.get_mut(index as usize) {
            *slot = Some(Arc::clone(queue));
        }
    }

    /// Note a queue that left the vhost. Returns the logical name if that was its last
    /// partition (the logical queue is gone).
    pub fn removed(&mut self, queue: &Arc<Queue>) -> Option<String> {
        let (logical, index, _) = membership(queue)?;
        let set = self.sets.get_mut(&logical)?;
        if let Some(slot) = set.members.get_mut(index as usize)
            && slot.as_ref().is_some_and(|q| Arc::ptr_eq(q, queue))
        {
            *slot = None;
        }
        if set.members.iter().all(Option::is_none) {
            self.sets.remove(&logical);
            return Some(logical);
        }
        None
    }

    /// The logical queue named `name`.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<&PartitionSet> {
        self.sets.get(name)
    }

    /// The logical names, sorted.
    #[must_use]
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.sets.keys().cloned().collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), v.clone());
        }
        t
    }

    #[test]
    fn specs_are_checked() {
        assert_eq!(
            PartitionSpec::from_arguments(&FieldTable::default(), "q").unwrap(),
            None
        );
        let s =
            PartitionSpec::from_arguments(&args(&[(PARTITIONS_ARG, AMQPValue::LongInt(6))]), "q")
                .unwrap()
                .unwrap();
        assert_eq!(
            s,
            PartitionSpec {
                count: 6,
                key: HashSource::RoutingKey
            }
        );
        for bad in [
            AMQPValue::LongInt(0),
            AMQPValue::LongInt(1025),
            AMQPValue::LongString("3".into()),
        ] {
            let e = PartitionSpec::from_arguments(&args(&[(PARTITIONS_ARG, bad)]), "queue 'q'")
                .unwrap_err();
            assert_eq!(e.code, ReplyCode::PreconditionFailed);
            assert!(
                e.text.contains("invalid arg 'x-partitions' for queue 'q'"),
                "{}",
                e.text
            );
        }
        let key = |k: &str| {
            PartitionSpec::from_arguments(
                &args(&[
                    (PARTITIONS_ARG, AMQPValue::LongInt(2)),
                    (PARTITION_KEY_ARG, AMQPValue::LongString(k.into())),
                ]),
                "q",
            )
            .map(|s| s.unwrap().key)
        };
        assert_eq!(
            key("header:customer").unwrap(),
            HashSource::Header("customer".into())
        );
        assert_eq!(
            key("property:message_id").unwrap(),
            HashSource::Property(HashProperty::MessageId)
        );
        assert!(key("header:").is_err());
        assert!(key("property:app_id").is_err());
        assert!(key("body").is_err());
    }

    #[test]
    fn partition_arguments_carry_the_identity_and_balanced_placement() {
        let declared = args(&[(PARTITIONS_ARG, AMQPValue::LongInt(3))]);
        let spec = PartitionSpec::from_arguments(&declared, "q")
            .unwrap()
            .unwrap();
        let a = spec.partition_arguments("orders", 2, &declared);
        let a = a.inner();
        assert_eq!(a.get(PARTITION_INDEX_ARG), Some(&AMQPValue::LongUInt(2)));
        assert_eq!(
            crate::args::text_value(&a[PARTITION_OF_ARG]).unwrap(),
            "orders"
        );
        assert_eq!(
            crate::args::text_value(&a["x-queue-leader-locator"]).unwrap(),
            "balanced"
        );
    }
}
