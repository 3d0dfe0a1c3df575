//! Rebuilding the broker from its store at start-up: durable exchanges, queues and bindings,
//! then every indexed message, back into its queue with its stored id.

use crate::policy::PolicyKind;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use warren_store::{MetaTable, Op, Recovered, StoreError};

use crate::durable::{
    BindingRecord, DecodeError, ExchangeRecord, QueueKeyRecord, QueueRecord, StoredKey,
};
use crate::node::broker::Broker;
use crate::queue::Queue;
use crate::queue::machine::KeyKind;

/// Why recovery stopped the start-up.
#[derive(Debug, thiserror::Error)]
pub enum RecoveryError {
    /// A metadata record or a message did not decode.
    #[error("{0}")]
    Decode(#[from] DecodeError),
    /// A message could not be read back.
    #[error("{0}")]
    Store(#[from] StoreError),
}

/// What was recovered, for the start-up log.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Durable exchanges.
    pub exchanges: usize,
    /// Durable queues.
    pub queues: usize,
    /// Bindings between durable objects.
    pub bindings: usize,
    /// Persistent messages put back into queues.
    pub messages: usize,
    /// Scheduled messages of delayed exchanges put back.
    pub delayed: usize,
    /// Policies put back.
    pub policies: usize,
    /// Users put back (0 on a fresh store, where the default user is created).
    pub users: usize,
    /// Vhosts put back (0 on a fresh store, where `/` is created).
    pub vhosts: usize,
    /// Records dropped because what they belonged to is gone (a vhost that does not exist, a
    /// binding whose end is missing, messages of a deleted queue).
    pub dropped: usize,
}

impl Broker {
    /// Put back what the store held. Call once, before accepting connections.
    ///
    /// # Errors
    /// A record that does not decode or a message that cannot be read: the data directory is
    /// damaged, and starting without it would silently lose what it holds.
    pub fn recover(&self, recovered: Recovered) -> Result<RecoveryReport, RecoveryError> {
        let mut report = RecoveryReport::default();
        let mut cleanup: Vec<Op> = Vec::new();
        let rows = |t: MetaTable| {
            recovered
                .meta
                .get(&t)
                .map(Vec::as_slice)
                .unwrap_or_default()
        };
        report.vhosts = self.restore_vhosts(rows(MetaTable::Vhosts));
        report.users = self.restore_users(
            rows(MetaTable::Users),
            rows(MetaTable::Permissions),
            rows(MetaTable::TopicPermissions),
        )?;
        for kind in [PolicyKind::User, PolicyKind::Operator] {
            for (_, v) in rows(kind.table()) {
                let def: crate::policy::PolicyDef = serde_json::from_slice(v)
                    .map_err(|_| DecodeError::new("policy", "bad JSON"))?;
                let policy = crate::policy::Policy::new_of(kind, def)
                    .map_err(|_| DecodeError::new("policy", "does not validate"))?;
                match self.vhost(&policy.def.vhost) {
                    Some(vh) => {
                        vh.restore_policy(kind, policy);
                        report.policies += 1;
                    }
                    None => report.dropped += 1,
                }
            }
        }
        for (k, v) in rows(MetaTable::Exchanges) {
            let r = ExchangeRecord::decode(k, v)?;
            match self.vhost(&r.vhost) {
                Some(vh) => {
                    vh.restore_exchange(&r.name, r.decl);
                    report.exchanges += 1;
                }
                None => {
                    tracing::warn!(vhost = %r.vhost, exchange = %r.name, "dropping exchange of an unknown vhost");
                    report.dropped += 1;
                }
            }
        }
        let mut by_id: HashMap<u64, Arc<Queue>> = HashMap::new();
        let mut max_id = 0;
        for (k, v) in rows(MetaTable::Queues) {
            let r = QueueRecord::decode(k, v)?;
            max_id = max_id.max(r.id);
            let Some(vh) = self.vhost(&r.vhost) else {
                tracing::warn!(vhost = %r.vhost, queue = %r.name, "dropping queue of an unknown vhost");
                report.dropped += 1;
                continue;
            };
            let q = Queue::new(
                r.id,
                &r.name,
                &r.vhost,
                true,
                r.auto_delete,
                None,
                r.arguments,
                vh.queue_env(),
            );
            by_id.insert(r.id, Arc::clone(&q));
            vh.apply_policies(&q);
            if let Err(e) = vh.open_stream(&q) {
                // The queue stays declared (its files are left for an operator to look at);
                // consuming from it fails with 541 until they open.
                tracing::error!(queue = %r.name, vhost = %r.vhost, error = %e, "a stream's files do not open");
            }
            vh.restore_queue(q);
            report.queues += 1;
        }
        // Ids handed out from now on must not collide with stored queue ids.
        self.bump_next_id(max_id + 1);
        for (k, v) in rows(MetaTable::Bindings) {
            let r = BindingRecord::decode(k, v)?;
            let restored = self
                .vhost(&r.vhost)
                .is_some_and(|vh| vh.restore_binding(r.clone()));
            if restored {
                report.bindings += 1;
            } else {
                cleanup.push(r.delete());
                report.dropped += 1;
            }
        }
        let store = self.durable().cloned();
        let mut orphaned: Vec<u64> = Vec::new();
        let delayed_by_id: HashMap<u64, Arc<crate::routing::vhost::VHost>> = self
            .list_vhosts()
            .iter()
            .filter_map(|name| self.vhost(name))
            .map(|vh| (crate::routing::delayed::store_id(vh.delayed.slot()), vh))
            .collect();
        let mut delayed_orphans: Vec<Op> = Vec::new();
        for (n, m) in recovered.messages.iter().enumerate() {
            if m.queue >= crate::routing::delayed::DELAYED_QUEUE_ID_MIN {
                match delayed_by_id.get(&m.queue) {
                    Some(vh) => {
                        vh.delayed.restore(m.id, m.location, m.expires_at);
                        report.delayed += 1;
                    }
                    None => {
                        // Its vhost is gone (deleted before its settles were written).
                        delayed_orphans.push(Op::Settle {
                            queue: m.queue,
                            id: m.id,
                        });
                        report.dropped += 1;
                    }
                }
                continue;
            }
            let Some(q) = by_id.get(&m.queue) else {
                if orphaned.last() != Some(&m.queue) {
                    orphaned.push(m.queue);
                }
                report.dropped += 1;
                continue;
            };
            // Only the place in the store is kept: bodies are read when delivered (their
            // checksums were verified when the store opened).
            let priority = u8::try_from(m.flags & 0xff).unwrap_or(0);
            q.restore(
                m.id,
                m.location,
                priority,
                (m.expires_at > 0).then_some(m.expires_at),
            );
            report.messages += 1;
            if (n + 1) % 250_000 == 0 {
                tracing::info!(
                    messages = n + 1,
                    total = recovered.messages.len(),
                    "recovery: messages back in their queues"
                );
            }
        }
        // The keys queues remember (deduplication, redrive moves), after their messages.
        // Per queue: deduplication keys with their times, move keys, due times.
        type Keys = (Vec<(Vec<u8>, u64)>, Vec<Vec<u8>>, Vec<(u64, u64)>);
        let mut keys: HashMap<u64, Keys> = HashMap::new();
        for (k, v) in rows(MetaTable::QueueKeys) {
            let r = QueueKeyRecord::decode(k, v)?;
            if !by_id.contains_key(&r.queue) {
                // Its queue was deleted (keys are not dropped with it).
                cleanup.push(r.delete());
                continue;
            }
            let (dedup, moves, due) = keys.entry(r.queue).or_default();
            match r.kind {
                StoredKey::Window(KeyKind::Dedup) => dedup.push((r.key, r.at)),
                StoredKey::Window(KeyKind::Move) => moves.push(r.key),
                StoredKey::Due => due.extend(r.message_id().map(|id| (id, r.at))),
            }
        }
        for (queue, (mut dedup, moves, due)) in keys {
            if let Some(q) = by_id.get(&queue) {
                dedup.sort_by_key(|(_, at)| *at);
                q.restore_keys(dedup, moves, due);
            }
        }
        cleanup.extend(orphaned.into_iter().map(|queue| Op::DropQueue { queue }));
        cleanup.extend(delayed_orphans);
        if let Some(store) = &store {
            store.submit_ops(cleanup);
        }
        Ok(report)
    }

    fn bump_next_id(&self, at_least: u64) {
        self.next_id_counter()
            .fetch_max(at_least, Ordering::Relaxed);
    }
}
