//! Message TTLs (`x-message-ttl` and the per-message `expiration` property).
//!
//! Invariants: a message's expiry is fixed when it enters the queue (the shorter of the queue's
//! and its own TTL, from then; a restored message keeps its stored one, and a returned one its
//! original). Messages expire only at a level's head, as in RabbitMQ, so a long TTL in front
//! holds shorter ones behind it; one met expired on its way out is removed, not delivered.
//! After every command no level's head has expired; within the command, the message it
//! enqueues may still go to a waiting consumer even with a TTL of 0 (`arriving`).

use super::command::{Effect, Removal};
use super::ready::{Level, Ready};
use super::{MessageRef, QueueMachine};

impl<M: MessageRef> QueueMachine<M> {
    /// When a message arriving now expires: the shorter of the queue's and its own TTL.
    pub(super) fn expiry_of(&self, msg: &M) -> Option<u64> {
        self.expiry_at(msg, self.now)
    }

    /// When `msg` would expire if enqueued at `now` (drivers store it with the message).
    #[must_use]
    pub fn expiry_at(&self, msg: &M, now: u64) -> Option<u64> {
        let ttl = match (self.config.message_ttl, msg.expiration_ms()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        ttl.map(|t| now.saturating_add(t))
    }

    pub(super) fn is_expired<T>(&self, r: &Ready<T>) -> bool {
        r.expires_at().is_some_and(|at| at <= self.now) && self.arriving != Some(r.id)
    }

    /// Drop expired messages at the head of every level (RabbitMQ expires messages when they
    /// reach the head, so a long per-message TTL in front holds shorter ones behind it).
    pub(super) fn expire_heads(&mut self, effects: &mut Vec<Effect<M>>) {
        // Runs on every command: the common case (no expired head) must not allocate.
        if !self
            .levels
            .values()
            .any(|l| l.peek().is_some_and(|r| self.is_expired(&r)))
        {
            return;
        }
        let levels: Vec<u8> = self.levels.keys().copied().collect();
        for level in levels {
            loop {
                let head_expired = self
                    .levels
                    .get(&level)
                    .and_then(Level::peek)
                    .is_some_and(|r| self.is_expired(&r));
                if !head_expired {
                    break;
                }
                let Some(r) = self.pop_level(level) else {
                    break;
                };
                self.counters.expired += 1;
                effects.push(Effect::Removed {
                    id: r.id,
                    msg: r.msg,
                    reason: Removal::Expired,
                });
            }
        }
    }

    /// The next ready message that has not expired (expired ones met on the way are removed).
    pub(super) fn pop_live(&mut self, effects: &mut Vec<Effect<M>>) -> Option<Ready<M>> {
        loop {
            let r = self.pop_ready()?;
            if !self.is_expired(&r) {
                return Some(r);
            }
            self.counters.expired += 1;
            effects.push(Effect::Removed {
                id: r.id,
                msg: r.msg,
                reason: Removal::Expired,
            });
        }
    }

    /// The earliest time at which time alone changes the queue: a message at the head of a
    /// level expires, a lease runs out or a delayed retry comes due. The driver runs
    /// [`Command::Expire`](super::Command::Expire) then.
    #[must_use]
    pub fn next_expiry(&self) -> Option<u64> {
        self.levels
            .values()
            .filter_map(|l| l.peek().and_then(|r| r.expires_at()))
            .chain(self.work.leases.next_deadline())
            .chain(self.work.scheduled.next_due())
            .min()
    }
}
