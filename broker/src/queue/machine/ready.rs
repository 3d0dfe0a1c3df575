//! The ready set: messages waiting for delivery, one [`Level`] per priority, and the commands
//! that add to it or change it wholesale (enqueue, restore, purge, swap).
//!
//! Invariants:
//! - levels are served highest first; no level is empty (an emptied one is removed);
//! - within a level, `fresh` holds never-delivered messages in increasing id order (FIFO) and
//!   `returned` holds returned ones by id; every returned id is smaller than every fresh id of
//!   its level, so "returned first, then fresh" is original order;
//! - a message waits in the level [`QueueMachine::level_of`] gives it;
//! - `ready_count` and `ready_bytes` are the number and body bytes of the messages in all
//!   levels: every push and pop goes through [`QueueMachine::push_fresh`],
//!   [`QueueMachine::push_returned`] or [`QueueMachine::pop_level`], which keep them.

use std::collections::{BTreeMap, VecDeque};

use super::command::{Effect, Removal};
use super::{MessageRef, MsgId, QueueMachine};

/// A message waiting for delivery.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct Ready<M> {
    pub(super) id: MsgId,
    pub(super) msg: M,
    pub(super) redelivered: bool,
    /// Machine time (ms) from which it must not be delivered.
    pub(super) expires_at: Option<u64>,
    /// Times it was returned after a delivery.
    pub(super) delivery_count: u32,
    /// Machine time (ms) it entered the queue (or was restored); kept across returns, so the
    /// oldest-ready age counts from the first enqueue.
    pub(super) enqueued_at: u64,
}

/// Ready messages of one priority.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct Level<M> {
    pub(super) fresh: VecDeque<Ready<M>>,
    pub(super) returned: BTreeMap<MsgId, Ready<M>>,
}

impl<M> Default for Level<M> {
    fn default() -> Self {
        Self {
            fresh: VecDeque::new(),
            returned: BTreeMap::new(),
        }
    }
}

impl<M> Level<M> {
    pub(super) fn len(&self) -> usize {
        self.fresh.len() + self.returned.len()
    }

    fn pop(&mut self) -> Option<Ready<M>> {
        match self.returned.pop_first() {
            Some((_, r)) => Some(r),
            None => self.fresh.pop_front(),
        }
    }

    pub(super) fn peek(&self) -> Option<&Ready<M>> {
        self.returned.values().next().or_else(|| self.fresh.front())
    }

    fn get_mut(&mut self, id: MsgId) -> Option<&mut Ready<M>> {
        if let Some(r) = self.returned.get_mut(&id) {
            return Some(r);
        }
        let i = self.fresh.binary_search_by_key(&id, |r| r.id).ok()?;
        self.fresh.get_mut(i)
    }
}

impl<M: MessageRef> QueueMachine<M> {
    /// Messages ready for delivery.
    #[must_use]
    pub fn ready_len(&self) -> usize {
        self.ready_count
    }

    /// Bytes of ready messages.
    #[must_use]
    pub fn ready_bytes(&self) -> u64 {
        self.ready_bytes
    }

    /// When the oldest ready message entered the queue (machine time, ms), if any is ready.
    /// A returned message counts from its first enqueue; a restored one from its restore.
    #[must_use]
    pub fn oldest_ready_at(&self) -> Option<u64> {
        self.levels
            .values()
            .flat_map(|l| [l.returned.values().next(), l.fresh.front()])
            .flatten()
            .map(|r| r.enqueued_at)
            .min()
    }

    /// Every message the queue holds, ready (all levels) and unacked, in no particular order.
    pub fn for_each_message(&self, mut f: impl FnMut(&M)) {
        for level in self.levels.values() {
            level.returned.values().for_each(|r| f(&r.msg));
            level.fresh.iter().for_each(|r| f(&r.msg));
        }
        self.unacked.values().for_each(|u| f(&u.msg));
    }

    /// The priority level a message waits in: its priority capped at `x-max-priority`, or 0
    /// when the queue has no priorities.
    pub(super) fn level_of(&self, msg: &M) -> u8 {
        self.config
            .max_priority
            .map_or(0, |max| msg.priority().min(max))
    }

    /// Add a message to the tail under the next id (a length limit has been checked).
    pub(super) fn enqueue(&mut self, msg: M) {
        let id = self.next_id;
        self.next_id += 1;
        self.counters.enqueued += 1;
        let expires_at = self.expiry_of(&msg);
        self.arriving = Some(id);
        self.push_fresh(Ready {
            id,
            msg,
            redelivered: false,
            expires_at,
            delivery_count: 0,
            enqueued_at: self.now,
        });
    }

    /// Put back a message recovered from durable storage under its stored id.
    pub(super) fn restore(
        &mut self,
        id: MsgId,
        msg: M,
        redelivered: bool,
        stored_expiry: Option<u64>,
    ) {
        debug_assert!(
            id >= self.next_id,
            "restored ids arrive in increasing order"
        );
        self.next_id = self.next_id.max(id + 1);
        self.counters.enqueued += 1;
        let expires_at = stored_expiry.or_else(|| self.expiry_of(&msg));
        self.push_fresh(Ready {
            id,
            msg,
            redelivered,
            expires_at,
            delivery_count: 0,
            enqueued_at: self.now,
        });
    }

    /// Remove all ready messages, highest level first; returns how many.
    pub(super) fn purge(&mut self, effects: &mut Vec<Effect<M>>) -> u32 {
        let n = self.ready_len();
        for (_, level) in std::mem::take(&mut self.levels).into_iter().rev() {
            for r in level.returned.into_values().chain(level.fresh) {
                effects.push(Effect::Removed {
                    id: r.id,
                    msg: r.msg,
                    reason: Removal::Purged,
                });
            }
        }
        self.ready_count = 0;
        self.ready_bytes = 0;
        self.counters.purged += n as u64;
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// Replace the reference held for a ready or unacked message by one of the same size.
    pub(super) fn swap(&mut self, id: MsgId, msg: M) {
        let level = self.level_of(&msg);
        let slot = match self.levels.get_mut(&level).and_then(|l| l.get_mut(id)) {
            Some(r) => Some((&mut r.msg, true)),
            None => self.unacked.get_mut(&id).map(|u| (&mut u.msg, false)),
        };
        if let Some((old, ready)) = slot {
            let (before, after) = (old.size(), msg.size());
            *old = msg;
            let bytes = if ready {
                &mut self.ready_bytes
            } else {
                &mut self.unacked_bytes
            };
            *bytes = *bytes - before + after;
        }
    }

    /// Add a message at the tail of its level (its id is above every id there).
    pub(super) fn push_fresh(&mut self, r: Ready<M>) {
        let level = self.level_of(&r.msg);
        self.ready_bytes += r.msg.size();
        self.ready_count += 1;
        let l = self.levels.entry(level).or_default();
        debug_assert!(
            l.fresh.back().is_none_or(|b| b.id < r.id),
            "fresh ids increase"
        );
        l.fresh.push_back(r);
    }

    /// Put a returned message back in its place in its level (its id is below every fresh
    /// id there).
    pub(super) fn push_returned(&mut self, r: Ready<M>) {
        let level = self.level_of(&r.msg);
        self.ready_bytes += r.msg.size();
        self.ready_count += 1;
        let l = self.levels.entry(level).or_default();
        debug_assert!(l.fresh.front().is_none_or(|f| f.id > r.id));
        l.returned.insert(r.id, r);
    }

    /// Take the next message to deliver (highest priority, then original order), keeping the
    /// ready counters.
    pub(super) fn pop_ready(&mut self) -> Option<Ready<M>> {
        let top = *self.levels.keys().next_back()?;
        self.pop_level(top)
    }

    /// Take the head of one level, keeping the ready counters and dropping the level when it
    /// empties.
    pub(super) fn pop_level(&mut self, level: u8) -> Option<Ready<M>> {
        let l = self.levels.get_mut(&level)?;
        let r = l.pop();
        if l.len() == 0 {
            self.levels.remove(&level);
        }
        let r = r?;
        self.ready_count -= 1;
        self.ready_bytes -= r.msg.size();
        Some(r)
    }
}

#[cfg(test)]
mod size_tests {
    /// What a queue holds per ready message (RAM per queued message is about this plus the
    /// deque's slack, docs/benchmarks.md), for a message reference of the broker's size (32
    /// bytes, 8-aligned: `message::size_tests`): a larger one is a regression.
    #[test]
    fn a_ready_message_costs_at_most_72_bytes() {
        assert!(std::mem::size_of::<super::Ready<[u64; 4]>>() <= 72);
    }
}
