//! Unacked messages (delivered, not yet settled) and how they leave: settled (ack), discarded
//! (reject or nack without requeue), or returned to the ready set (requeue, or their consumer
//! or its channel went), where a delivery limit may remove them instead.
//!
//! Invariants: `unacked_bytes` is the body bytes of the unacked messages, and each attached
//! consumer's `unacked` counts the messages held for it (`consumer` is that consumer), so every
//! removal goes through [`QueueMachine::take_unacked`], which keeps both and gives the consumer
//! its credit back. A returned message keeps its expiry and first-enqueue time and counts one
//! more delivery.

use super::command::{Effect, Removal};
use super::config::ReturnKind;
use super::ready::Ready;
use super::{ConsumerId, MessageRef, MsgId, QueueMachine};

/// A message delivered and not yet settled.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct Unacked<M> {
    pub(super) msg: M,
    pub(super) consumer: Option<ConsumerId>,
    /// The consumer it was delivered to, kept after that consumer is cancelled (its node
    /// still holds the delivery until it settles or returns it;
    /// [`Command::Down`](super::Command::Down)).
    pub(super) owner: Option<ConsumerId>,
    /// Kept for a requeue: a returned message keeps its original expiry.
    pub(super) expires_at: Option<u64>,
    /// Times it was returned before this delivery.
    pub(super) delivery_count: u32,
    /// When it entered the queue (see [`Ready`]).
    pub(super) enqueued_at: u64,
}

impl<M: MessageRef> QueueMachine<M> {
    /// Messages delivered and not yet settled.
    #[must_use]
    pub fn unacked_len(&self) -> usize {
        self.unacked.len()
    }

    /// Bytes of unacked messages.
    #[must_use]
    pub fn unacked_bytes(&self) -> u64 {
        self.unacked_bytes
    }

    /// Acknowledge unacked messages (absent ids are ignored).
    pub(super) fn settle(&mut self, ids: Vec<MsgId>, effects: &mut Vec<Effect<M>>) {
        for id in ids {
            if let Some(Unacked {
                msg,
                delivery_count,
                ..
            }) = self.take_unacked(id)
            {
                self.counters.settled += 1;
                self.counters.acked += 1;
                self.work
                    .counters
                    .count_ack(delivery_count.saturating_add(1));
                effects.push(Effect::Removed {
                    id,
                    msg,
                    reason: Removal::Settled,
                });
            }
        }
    }

    /// Drop unacked messages: rejected or nacked without requeue (absent ids are ignored).
    pub(super) fn discard(&mut self, ids: Vec<MsgId>, effects: &mut Vec<Effect<M>>) {
        for id in ids {
            if let Some(Unacked { msg, .. }) = self.take_unacked(id) {
                self.counters.discarded += 1;
                effects.push(Effect::Removed {
                    id,
                    msg,
                    reason: Removal::Rejected,
                });
            }
        }
    }

    /// Put unacked messages back, marked redelivered, counting a delivery each: removed
    /// past the delivery limit; held for the retry policy's delay when it has one for `kind`;
    /// else at the back under new ids when `to_back`, or in their original place.
    pub(super) fn return_messages(
        &mut self,
        ids: Vec<MsgId>,
        to_back: bool,
        kind: ReturnKind,
        effects: &mut Vec<Effect<M>>,
    ) {
        for id in ids {
            self.return_message(id, to_back, kind, None, effects);
        }
    }

    /// Return one unacked message in its place (see [`Self::return_messages`]), held for
    /// `delay_ms` when given (else the retry policy's delay). Returns when a held message is
    /// ready again.
    pub(super) fn return_one(
        &mut self,
        id: MsgId,
        kind: ReturnKind,
        delay_ms: Option<u64>,
        effects: &mut Vec<Effect<M>>,
    ) -> Option<u64> {
        self.return_message(id, false, kind, delay_ms, effects)
    }

    fn return_message(
        &mut self,
        id: MsgId,
        to_back: bool,
        kind: ReturnKind,
        delay_ms: Option<u64>,
        effects: &mut Vec<Effect<M>>,
    ) -> Option<u64> {
        let Unacked {
            msg,
            expires_at,
            delivery_count: count,
            enqueued_at,
            ..
        } = self.take_unacked(id)?;
        let delivery_count = count.saturating_add(1);
        if self
            .config
            .delivery_limit
            .is_some_and(|limit| delivery_count > limit)
        {
            self.counters.discarded += 1;
            self.work.counters.quarantined += 1;
            if let Some(failed) = self.failure_effect(id, delivery_count) {
                effects.push(failed);
            }
            effects.push(Effect::Removed {
                id,
                msg,
                reason: Removal::DeliveryLimit,
            });
            return None;
        }
        let delay =
            delay_ms.unwrap_or_else(|| self.work.config.retry.delay_ms(kind, delivery_count, id));
        if delay > 0 {
            // Back in its place when due (its id is below every fresh id from now on).
            let due = self.now.saturating_add(delay);
            let r = Ready::new(id, msg, true, expires_at, delivery_count, enqueued_at);
            self.schedule(due, r, effects);
            return Some(due);
        }
        if to_back {
            let new = self.next_id;
            self.next_id += 1;
            effects.push(Effect::Requeued {
                old: id,
                new,
                msg: msg.clone(),
            });
            self.push_fresh(Ready::new(
                new,
                msg,
                true,
                expires_at,
                delivery_count,
                enqueued_at,
            ));
            return None;
        }
        self.place_returned(
            Ready::new(id, msg, true, expires_at, delivery_count, enqueued_at),
            effects,
        );
        None
    }

    /// Remove an unacked message, keeping the byte total and its consumer's count (which may
    /// give that consumer credit again).
    fn take_unacked(&mut self, id: MsgId) -> Option<Unacked<M>> {
        let u = self.unacked.remove(&id)?;
        self.work.leases.remove(id);
        self.unacked_bytes -= u.msg.size();
        if let Some(cid) = u.consumer
            && let Some(c) = self.consumers.get_mut(&cid)
        {
            c.unacked -= 1;
            self.refresh_ring(cid);
        }
        Some(u)
    }
}
