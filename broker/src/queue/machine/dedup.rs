//! Publish deduplication: a queue with `x-message-deduplication` remembers the
//! `x-deduplication-header` value of each message it took, for `x-cache-ttl` ms and up to
//! `x-cache-size` values, and drops a message whose value it remembers (the publisher's
//! confirm is still an ack: the message is there already).
//!
//! The driver sends [`Command::Dedup`](super::Command::Dedup) with the value just before the
//! message's `Enqueue` (in one submission, so in one log entry of a quorum queue): the key
//! waits in `pending` and the next `Enqueue` takes it. The window is machine state, so a quorum
//! queue replicates it and its snapshots keep it.
//!
//! Invariants:
//! - `at` holds exactly the keys of `order` whose entry there is their latest (a key refreshed
//!   after its window ran out has a newer entry; older entries of it are skipped when they
//!   reach the front);
//! - at most `cache_size` keys are remembered; none older than `ttl_ms` counts as seen.

use std::collections::{BTreeMap, VecDeque};

use super::command::{Effect, KeyKind};
use super::config::DedupConfig;
use super::{MessageRef, QueueMachine};

/// The remembered keys.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct DedupWindow {
    /// Key -> machine time it was remembered.
    at: BTreeMap<Vec<u8>, u64>,
    /// Keys in the order they were remembered, with that time.
    order: VecDeque<(u64, Vec<u8>)>,
    /// The key the next `Enqueue` carries.
    pending: Option<Vec<u8>>,
}

impl DedupWindow {
    pub(super) fn len(&self) -> usize {
        self.at.len()
    }

    /// Forget what fell out of the window at `now` (too old, or beyond the size), each key
    /// forgotten an effect.
    fn trim<M>(&mut self, config: &DedupConfig, now: u64, effects: &mut Vec<Effect<M>>) {
        while let Some((t, _)) = self.order.front() {
            let expired = config
                .ttl_ms
                .is_some_and(|ttl| t.saturating_add(ttl) <= now);
            if !expired && self.at.len() <= config.cache_size as usize {
                break;
            }
            let Some((t, key)) = self.order.pop_front() else {
                break;
            };
            if self.at.get(&key) == Some(&t) {
                self.at.remove(&key);
                effects.push(Effect::KeyForgotten {
                    kind: KeyKind::Dedup,
                    key,
                });
            }
        }
    }

    fn seen(&self, config: &DedupConfig, key: &[u8], now: u64) -> bool {
        self.at
            .get(key)
            .is_some_and(|t| config.ttl_ms.is_none_or(|ttl| t.saturating_add(ttl) > now))
    }

    fn remember<M>(
        &mut self,
        config: &DedupConfig,
        key: Vec<u8>,
        now: u64,
        effects: &mut Vec<Effect<M>>,
    ) {
        self.at.insert(key.clone(), now);
        self.order.push_back((now, key));
        self.trim(config, now, effects);
    }

    /// Checks the module's invariants.
    pub(super) fn check(&self, config: &DedupConfig) {
        assert!(
            self.at.len() <= (config.cache_size as usize).max(1) || !config.enabled,
            "the window holds at most cache_size keys"
        );
        for (key, t) in &self.at {
            assert!(
                self.order.iter().any(|(u, k)| u == t && k == key),
                "every remembered key has its entry in order"
            );
        }
    }
}

impl<M: MessageRef> QueueMachine<M> {
    /// Keys the deduplication window remembers.
    #[must_use]
    pub fn dedup_len(&self) -> usize {
        self.work.dedup.len()
    }

    /// Whether the queue deduplicates publishes (its settings say so).
    #[must_use]
    pub fn deduplicates(&self) -> bool {
        self.work.config.dedup.enabled
    }

    /// Whether a message carrying `key`, enqueued now, would be dropped as a duplicate (lets
    /// a driver skip storing it).
    #[must_use]
    pub fn would_deduplicate(&self, key: &[u8], now: u64) -> bool {
        let config = &self.work.config.dedup;
        config.enabled && self.work.dedup.seen(config, key, now.max(self.now))
    }

    /// Whether the window holds `key` (at any age: it is forgotten when trimmed).
    #[must_use]
    pub fn remembers_dedup_key(&self, key: &[u8]) -> bool {
        self.work.dedup.at.contains_key(key)
    }

    /// The next `Enqueue` carries `key`.
    pub(super) fn set_pending_key(&mut self, key: Vec<u8>) {
        self.work.dedup.pending = Some(key);
    }

    /// The pending key of the `Enqueue` being applied, if deduplication is on: whether it is a
    /// duplicate (then the message is dropped), else the key to remember once it is taken.
    pub(super) fn take_pending_key(
        &mut self,
        effects: &mut Vec<Effect<M>>,
    ) -> (bool, Option<Vec<u8>>) {
        let key = self.work.dedup.pending.take();
        let config = self.work.config.dedup;
        let Some(key) = key.filter(|_| config.enabled) else {
            return (false, None);
        };
        self.work.dedup.trim(&config, self.now, effects);
        if self.work.dedup.seen(&config, &key, self.now) {
            self.work.counters.deduplicated += 1;
            return (true, None);
        }
        (false, Some(key))
    }

    /// Remember the key of a message the queue took.
    pub(super) fn remember_key(&mut self, key: Vec<u8>, effects: &mut Vec<Effect<M>>) {
        let config = self.work.config.dedup;
        self.work.dedup.remember(&config, key, self.now, effects);
    }

    /// Put back deduplication keys kept in the store, each with the time it was remembered
    /// (oldest first); what fell out of the window meanwhile is forgotten at once.
    pub(super) fn restore_keys(&mut self, keys: Vec<(Vec<u8>, u64)>, effects: &mut Vec<Effect<M>>) {
        let config = self.work.config.dedup;
        for (key, at) in keys {
            self.work.dedup.remember(&config, key, at, effects);
        }
        self.work.dedup.trim(&config, self.now, effects);
    }
}
