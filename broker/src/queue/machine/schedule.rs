//! Scheduled messages: returned messages waiting out a delayed retry (a retry policy, or a
//! lease released with a delay) before they are ready again, and delayed publishes (held from
//! their enqueue; when due they go to the back of the queue under a new id). Entering and
//! leaving is an effect each ([`Effect::Scheduled`], [`Effect::Unscheduled`]), so a queue on
//! the local store keeps due times across restarts.
//!
//! Invariants:
//! - a scheduled message is neither ready nor unacked; it counts as live (message
//!   conservation: `ready + unacked + scheduled == live`);
//! - `by_due` holds exactly one `(due, id)` per message of `by_id`, and `bytes` is their body
//!   bytes;
//! - after every command no scheduled message is due (it was made ready, in its place: a
//!   scheduled id that left `fresh` from its head is smaller than every fresh id and goes back
//!   among the returned messages; one taken from the middle goes to the back).
//!
//! Due times are machine time (the command's `now`), so replicas and replays agree.

use std::collections::{BTreeMap, BTreeSet};

use super::command::Effect;
use super::ready::Ready;
use super::{MessageRef, MsgId, QueueMachine};

/// Messages waiting for their due time.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct Scheduled<M> {
    by_id: BTreeMap<MsgId, Ready<M>>,
    by_due: BTreeSet<(u64, MsgId)>,
    bytes: u64,
}

impl<M> Default for Scheduled<M> {
    fn default() -> Self {
        Self {
            by_id: BTreeMap::new(),
            by_due: BTreeSet::new(),
            bytes: 0,
        }
    }
}

impl<M: MessageRef> Scheduled<M> {
    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(super) fn get(&self, id: MsgId) -> Option<&Ready<M>> {
        self.by_id.get(&id)
    }

    /// The message `id` and the byte total it counts in, if scheduled.
    pub(super) fn get_mut(&mut self, id: MsgId) -> (Option<&mut M>, &mut u64) {
        (self.by_id.get_mut(&id).map(|r| &mut r.msg), &mut self.bytes)
    }

    fn insert(&mut self, due: u64, r: Ready<M>) {
        self.bytes += r.msg.size();
        self.by_due.insert((due, r.id));
        let previous = self.by_id.insert(r.id, r);
        debug_assert!(previous.is_none(), "a message is scheduled once");
    }

    /// The first message due at or before `now`.
    fn pop_due(&mut self, now: u64) -> Option<Ready<M>> {
        let &(due, id) = self.by_due.first()?;
        if due > now {
            return None;
        }
        self.by_due.pop_first();
        let r = self.by_id.remove(&id)?;
        self.bytes -= r.msg.size();
        Some(r)
    }

    /// Every scheduled message, taken out (a purge).
    pub(super) fn take_all(&mut self) -> impl Iterator<Item = Ready<M>> {
        self.by_due.clear();
        self.bytes = 0;
        std::mem::take(&mut self.by_id).into_values()
    }

    pub(super) fn next_due(&self) -> Option<u64> {
        self.by_due.first().map(|&(due, _)| due)
    }

    /// When message `id` is due (tests; O(scheduled)).
    #[cfg(test)]
    pub(super) fn due(&self, id: MsgId) -> Option<u64> {
        self.by_due.iter().find(|&&(_, i)| i == id).map(|&(d, _)| d)
    }

    /// Scheduled messages in due order, each with its due time.
    pub(super) fn in_due_order(&self) -> impl Iterator<Item = (u64, &Ready<M>)> {
        self.by_due
            .iter()
            .filter_map(|&(due, id)| self.by_id.get(&id).map(|r| (due, r)))
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Ready<M>> {
        self.by_id.values()
    }

    /// Checks this module's invariants (see the module doc).
    pub(super) fn check(&self) {
        assert_eq!(self.by_id.len(), self.by_due.len(), "one due time each");
        assert!(
            self.by_due
                .iter()
                .all(|(_, id)| self.by_id.contains_key(id)),
            "due times name scheduled messages"
        );
        let bytes: u64 = self.by_id.values().map(|r| r.msg.size()).sum();
        assert_eq!(bytes, self.bytes, "scheduled bytes");
    }
}

impl<M: MessageRef> QueueMachine<M> {
    /// Messages waiting out a delayed retry.
    #[must_use]
    pub fn scheduled_len(&self) -> usize {
        self.work.scheduled.len()
    }

    /// Body bytes of scheduled messages.
    #[must_use]
    pub fn scheduled_bytes(&self) -> u64 {
        self.work.scheduled.bytes()
    }

    /// Hold a returned message until machine time `due` (a delayed retry).
    pub(super) fn schedule(&mut self, due: u64, r: Ready<M>, effects: &mut Vec<Effect<M>>) {
        self.work.counters.retries_delayed += 1;
        self.hold(due, r, effects);
    }

    /// Hold a message until machine time `due`.
    fn hold(&mut self, due: u64, r: Ready<M>, effects: &mut Vec<Effect<M>>) {
        effects.push(Effect::Scheduled { id: r.id, due });
        self.work.scheduled.insert(due, r);
    }

    /// A delayed publish: the message takes its id now and is held until `until`.
    pub(super) fn enqueue_delayed(&mut self, msg: M, until: u64, effects: &mut Vec<Effect<M>>) {
        let id = self.next_id;
        self.next_id += 1;
        self.counters.enqueued += 1;
        self.work.counters.delayed_publishes += 1;
        // Its TTL counts from when it is ready, as behind RabbitMQ's delayed exchange.
        let expires_at = self
            .expiry_of(&msg)
            .map(|at| at.saturating_add(until.saturating_sub(self.now)));
        self.hold(
            until,
            Ready::new(id, msg, false, expires_at, 0, self.now),
            effects,
        );
    }

    /// Hold again the restored messages whose due time is still ahead; the others stay ready
    /// and their due records go.
    pub(super) fn restore_due(&mut self, due: Vec<(MsgId, u64)>, effects: &mut Vec<Effect<M>>) {
        for (id, at) in due {
            if at > self.now
                && let Some(r) = self.take_ready(id)
            {
                self.hold(at, r, effects);
            } else {
                effects.push(Effect::Unscheduled { id });
            }
        }
    }

    /// Make every scheduled message that is due ready: a retry in its place (see
    /// [`QueueMachine::place_returned`]), a delayed publish at the back.
    pub(super) fn promote_due(&mut self, effects: &mut Vec<Effect<M>>) {
        while let Some(r) = self.work.scheduled.pop_due(self.now) {
            effects.push(Effect::Unscheduled { id: r.id });
            if r.redelivered() {
                self.place_returned(r, effects);
            } else {
                // A delayed publish (never delivered) enters the queue now, at the back.
                self.push_to_back(r, effects);
            }
        }
    }

    /// When the next scheduled message is due (machine time, ms).
    #[must_use]
    pub fn next_scheduled(&self) -> Option<u64> {
        self.work.scheduled.next_due()
    }
}
