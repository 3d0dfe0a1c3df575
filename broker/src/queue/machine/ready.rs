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

mod fresh;

use std::collections::BTreeMap;

use self::fresh::FreshQueue;
use super::command::{Effect, Removal};
use super::{MessageRef, MsgId, QueueMachine};

/// A message waiting for delivery. Compact (a long queue holds one per message): its expiry
/// is kept relative to its enqueue time and its redelivered flag shares a word with its
/// delivery count. Serialized as the full fields (snapshots and digests do not see the packing).
#[derive(Debug, Clone)]
pub(super) struct Ready<M> {
    pub(super) id: MsgId,
    /// Machine time (ms) it entered the queue (or was restored); kept across returns, so the
    /// oldest-ready age counts from the first enqueue.
    pub(super) enqueued_at: u64,
    pub(super) msg: M,
    /// Milliseconds after `enqueued_at` from which it must not be delivered; [`NO_EXPIRY`]
    /// for never.
    expires_after: u32,
    /// Times it was returned after a delivery (low 31 bits) and the redelivered flag (top bit).
    returns: u32,
}

/// [`Ready`]'s `expires_after` of a message that does not expire.
const NO_EXPIRY: u32 = u32::MAX;
const REDELIVERED_BIT: u32 = 1 << 31;

impl<M> Ready<M> {
    /// A ready record. An expiry more than `u32::MAX - 1` ms (49.7 days, RabbitMQ's largest
    /// TTL) after `enqueued_at` is held as that bound; one before it as `enqueued_at` (already
    /// due). A delivery count past 2^31 - 1 stays there.
    pub(super) fn new(
        id: MsgId,
        msg: M,
        redelivered: bool,
        expires_at: Option<u64>,
        delivery_count: u32,
        enqueued_at: u64,
    ) -> Self {
        let expires_after = expires_at.map_or(NO_EXPIRY, |at| {
            u32::try_from(at.saturating_sub(enqueued_at))
                .unwrap_or(NO_EXPIRY - 1)
                .min(NO_EXPIRY - 1)
        });
        let count = delivery_count.min(REDELIVERED_BIT - 1);
        Self {
            id,
            enqueued_at,
            msg,
            expires_after,
            returns: if redelivered {
                count | REDELIVERED_BIT
            } else {
                count
            },
        }
    }

    /// Machine time (ms) from which it must not be delivered.
    pub(super) fn expires_at(&self) -> Option<u64> {
        (self.expires_after != NO_EXPIRY).then(|| {
            self.enqueued_at
                .saturating_add(u64::from(self.expires_after))
        })
    }

    /// It was delivered (or may have been) before.
    pub(super) fn redelivered(&self) -> bool {
        self.returns & REDELIVERED_BIT != 0
    }

    /// Times it was returned after a delivery.
    pub(super) fn delivery_count(&self) -> u32 {
        self.returns & !REDELIVERED_BIT
    }

    /// The same record with its message borrowed.
    pub(super) fn as_ref(&self) -> Ready<&M> {
        Ready {
            id: self.id,
            enqueued_at: self.enqueued_at,
            msg: &self.msg,
            expires_after: self.expires_after,
            returns: self.returns,
        }
    }
}

/// [`Ready`] as serialized: every field whole (the layout snapshots always had).
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename = "Ready")]
struct ReadyFields<M> {
    id: MsgId,
    msg: M,
    redelivered: bool,
    expires_at: Option<u64>,
    delivery_count: u32,
    enqueued_at: u64,
}

impl<M: serde::Serialize> serde::Serialize for Ready<M> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut out = s.serialize_struct("Ready", 6)?;
        out.serialize_field("id", &self.id)?;
        out.serialize_field("msg", &self.msg)?;
        out.serialize_field("redelivered", &self.redelivered())?;
        out.serialize_field("expires_at", &self.expires_at())?;
        out.serialize_field("delivery_count", &self.delivery_count())?;
        out.serialize_field("enqueued_at", &self.enqueued_at)?;
        out.end()
    }
}

impl<'de, M: serde::Deserialize<'de>> serde::Deserialize<'de> for Ready<M> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let f = ReadyFields::<M>::deserialize(d)?;
        Ok(Self::new(
            f.id,
            f.msg,
            f.redelivered,
            f.expires_at,
            f.delivery_count,
            f.enqueued_at,
        ))
    }
}

/// Ready messages of one priority.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct Level<M> {
    /// Never-returned messages, compact (a long queue is mostly these).
    pub(super) fresh: FreshQueue<M>,
    pub(super) returned: BTreeMap<MsgId, Ready<M>>,
}

impl<M> Default for Level<M> {
    fn default() -> Self {
        Self {
            fresh: FreshQueue::default(),
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

    pub(super) fn peek(&self) -> Option<Ready<&M>> {
        self.returned
            .values()
            .next()
            .map(Ready::as_ref)
            .or_else(|| self.fresh.front())
    }

    /// Take the ready record with `id` from wherever it waits in this level, if held.
    fn remove(&mut self, id: MsgId) -> Option<Ready<M>> {
        self.returned.remove(&id).or_else(|| self.fresh.remove(id))
    }

    /// The message of the ready record with `id`, if this level holds it.
    fn get_mut(&mut self, id: MsgId) -> Option<&mut M> {
        if let Some(r) = self.returned.get_mut(&id) {
            return Some(&mut r.msg);
        }
        self.fresh.get_mut(id)
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
            .flat_map(|l| {
                [
                    l.returned.values().next().map(|r| r.enqueued_at),
                    l.fresh.front().map(|r| r.enqueued_at),
                ]
            })
            .flatten()
            .min()
    }

    /// Every message the queue holds, ready (all levels) and unacked, in no particular order.
    pub fn for_each_message(&self, mut f: impl FnMut(&M)) {
        for level in self.levels.values() {
            level.returned.values().for_each(|r| f(&r.msg));
            level.fresh.iter().for_each(|r| f(r.msg));
        }
        self.unacked.values().for_each(|u| f(&u.msg));
        self.work.scheduled.iter().for_each(|r| f(&r.msg));
    }

    /// The delivery count and enqueue time of the ready message `id`, if it is ready (a
    /// returned message waits under its id; a fresh one was never delivered, or was requeued
    /// at the back under a new id).
    pub(super) fn ready_record(&self, id: MsgId) -> Option<(u32, u64)> {
        self.levels.values().find_map(|l| {
            l.returned
                .get(&id)
                .map(|r| (r.delivery_count(), r.enqueued_at))
                .or_else(|| l.fresh.get(id).map(|r| (r.delivery_count(), r.enqueued_at)))
        })
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
        self.push_fresh(Ready::new(id, msg, false, expires_at, 0, self.now));
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
        self.push_fresh(Ready::new(id, msg, redelivered, expires_at, 0, self.now));
    }

    /// Remove all ready messages, highest level first, then the scheduled ones (waiting out
    /// a delayed retry: not checked out, so a purge takes them too); returns how many.
    pub(super) fn purge(&mut self, effects: &mut Vec<Effect<M>>) -> u32 {
        let n = self.ready_len() + self.work.scheduled.len();
        for r in self.work.scheduled.take_all() {
            effects.push(Effect::Unscheduled { id: r.id });
            effects.push(Effect::Removed {
                id: r.id,
                msg: r.msg,
                reason: Removal::Purged,
            });
        }
        for (_, level) in std::mem::take(&mut self.levels).into_iter().rev() {
            for r in level
                .returned
                .into_values()
                .chain(level.fresh.into_records())
            {
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
        let (slot, bytes) = match self.levels.get_mut(&level).and_then(|l| l.get_mut(id)) {
            Some(m) => (Some(m), &mut self.ready_bytes),
            None => match self.unacked.get_mut(&id) {
                Some(u) => (Some(&mut u.msg), &mut self.unacked_bytes),
                None => self.work.scheduled.get_mut(id),
            },
        };
        if let Some(old) = slot {
            let (before, after) = (old.size(), msg.size());
            *old = msg;
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
            l.fresh.last_id().is_none_or(|b| b < r.id),
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

    /// Put a returned message back: in its place among the returned ones or, when its id is
    /// above its level's fresh head (it was taken from the middle of the queue by
    /// [`Command::Take`](super::Command::Take)), at the back under a new id
    /// ([`Effect::Requeued`]), so that every returned id stays below every fresh one. Its
    /// failure context follows it to the new id.
    pub(super) fn place_returned(&mut self, r: Ready<M>, effects: &mut Vec<Effect<M>>) {
        let level = self.level_of(&r.msg);
        let passes_fresh = self
            .levels
            .get(&level)
            .and_then(|l| l.fresh.front())
            .is_some_and(|f| f.id < r.id);
        if passes_fresh {
            self.push_to_back(r, effects);
        } else {
            self.push_returned(r);
        }
    }

    /// Put a message at the back of its level under a new id ([`Effect::Requeued`]), its
    /// failure context moved to the new id.
    pub(super) fn push_to_back(&mut self, mut r: Ready<M>, effects: &mut Vec<Effect<M>>) {
        let new = self.next_id;
        self.next_id += 1;
        effects.push(Effect::Requeued {
            old: r.id,
            new,
            msg: r.msg.clone(),
        });
        if let Some(f) = self.work.failures.remove(&r.id) {
            self.work.failures.insert(new, f);
        }
        r.id = new;
        self.push_fresh(r);
    }

    /// Take the next message to deliver (highest priority, then original order; with
    /// priority aging, first the longest-waiting head past the bound), keeping the ready
    /// counters.
    pub(super) fn pop_ready(&mut self) -> Option<Ready<M>> {
        let top = *self.levels.keys().next_back()?;
        let level = self.aged_level().unwrap_or(top);
        self.pop_level(level)
    }

    /// With priority aging, the level whose head has waited longest, if that is at least the
    /// bound (O(levels); only when aging is on and more than one level holds messages).
    pub(super) fn aged_level(&self) -> Option<u8> {
        let bound = self.work.config.priority_aging_ms?;
        if self.levels.len() < 2 {
            return None;
        }
        self.levels
            .iter()
            .filter_map(|(level, l)| l.peek().map(|r| (r.enqueued_at, *level)))
            .filter(|(at, _)| self.now.saturating_sub(*at) >= bound)
            .min_by_key(|&(at, level)| (at, std::cmp::Reverse(level)))
            .map(|(_, level)| level)
    }

    /// Take the ready message `id` from wherever it waits (not only a head), keeping the
    /// ready counters and dropping a level it empties: O(levels + log n).
    pub(super) fn take_ready(&mut self, id: MsgId) -> Option<Ready<M>> {
        let (level, r) = self
            .levels
            .iter_mut()
            .find_map(|(level, l)| l.remove(id).map(|r| (*level, r)))?;
        if self.levels.get(&level).is_some_and(|l| l.len() == 0) {
            self.levels.remove(&level);
        }
        self.ready_count -= 1;
        self.ready_bytes -= r.msg.size();
        Some(r)
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
    /// deque's slack, docs/benchmarks.md), for a message reference of the broker's size (24
    /// bytes, 8-aligned: `message::size_tests`): a larger one is a regression.
    #[test]
    fn a_ready_message_costs_at_most_48_bytes() {
        assert!(std::mem::size_of::<super::Ready<[u64; 3]>>() <= 48);
    }

    /// The packed fields give back what went in.
    #[test]
    fn packed_fields_round_trip() {
        let r = super::Ready::new(7, (), true, Some(1_500), 3, 1_000);
        assert_eq!(
            (r.redelivered(), r.delivery_count(), r.expires_at()),
            (true, 3, Some(1_500))
        );
        let r = super::Ready::new(7, (), false, None, u32::MAX, 1_000);
        assert_eq!(
            (r.redelivered(), r.delivery_count(), r.expires_at()),
            (false, (1 << 31) - 1, None)
        );
        // Due before it was restored: due at once.
        let r = super::Ready::new(7, (), false, Some(10), 0, 1_000);
        assert_eq!(r.expires_at(), Some(1_000));
        // RabbitMQ's largest TTL is kept to the millisecond but one.
        let r = super::Ready::new(7, (), false, Some(1_000 + u64::from(u32::MAX)), 0, 1_000);
        assert_eq!(r.expires_at(), Some(1_000 + u64::from(u32::MAX) - 1));
    }
}
