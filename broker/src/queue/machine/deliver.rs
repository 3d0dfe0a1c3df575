//! Handing ready messages out: to consumers with credit in turn ([`QueueMachine::dispatch`],
//! run at the end of every command) and to basic.get.
//!
//! Invariants: after a dispatch, either no message is ready or no consumer has credit (every
//! ring is empty); consumers of the highest priority with credit are served first, round-robin
//! among them, one message each in turn. A delivery to a consumer that acks, and a get that
//! acks, makes the message unacked; a no-ack one settles it at once. Expired messages met on
//! the way are removed, never delivered.

use super::command::{Effect, Removal};
use super::ready::Ready;
use super::settle::Unacked;
use super::{ConsumerId, MessageRef, MsgId, QueueMachine};

impl<M: MessageRef> QueueMachine<M> {
    /// basic.get: take the head message (the message, whether redelivered, the ready count
    /// after it, and how often it was returned before); with `no_ack` it is settled at once.
    pub(super) fn get(
        &mut self,
        no_ack: bool,
        effects: &mut Vec<Effect<M>>,
    ) -> Option<(MsgId, M, bool, u32, u32)> {
        let r = self.pop_live(effects)?;
        self.counters.got += 1;
        self.counters.redelivered += u64::from(r.redelivered());
        if no_ack {
            self.counters.settled += 1;
            effects.push(Effect::Removed {
                id: r.id,
                msg: r.msg.clone(),
                reason: Removal::Settled,
            });
        } else {
            self.check_out(&r, None);
        }
        let remaining = u32::try_from(self.ready_len()).unwrap_or(u32::MAX);
        let (redelivered, count) = (r.redelivered(), r.delivery_count());
        Some((r.id, r.msg, redelivered, remaining, count))
    }

    /// Make ready record `r` unacked, held for `consumer` (None: a get or a claim), keeping
    /// the unacked byte total (the consumer's own count is the caller's).
    pub(super) fn check_out(&mut self, r: &Ready<M>, consumer: Option<ConsumerId>) {
        self.unacked_bytes += r.msg.size();
        self.unacked.insert(
            r.id,
            Unacked {
                msg: r.msg.clone(),
                consumer,
                owner: consumer,
                expires_at: r.expires_at(),
                delivery_count: r.delivery_count(),
                enqueued_at: r.enqueued_at,
            },
        );
    }

    /// Hand ready messages to consumers with credit, one each in turn.
    pub(super) fn dispatch(&mut self, effects: &mut Vec<Effect<M>>) {
        while !self.rings.is_empty() && self.ready_len() > 0 {
            let Some(cid) = self.pop_ring() else {
                break;
            };
            let Some(c) = self.consumers.get_mut(&cid) else {
                continue;
            };
            c.in_ring = false;
            if !c.has_credit() {
                continue;
            }
            let Some(r) = self.pop_live(effects) else {
                // Only expired messages were left: the consumer keeps its turn.
                self.refresh_ring(cid);
                break;
            };
            let Some(c) = self.consumers.get_mut(&cid) else {
                break;
            };
            let size = r.msg.size();
            self.counters.delivered += 1;
            self.counters.redelivered += u64::from(r.redelivered());
            c.unwritten += 1;
            c.unwritten_bytes += size;
            if c.is_limited() {
                c.granted = false;
            }
            if c.spec.no_ack {
                self.counters.settled += 1;
            } else {
                c.unacked += 1;
                // `c` is still borrowed here, so not through check_out.
                self.unacked_bytes += size;
                self.unacked.insert(
                    r.id,
                    Unacked {
                        msg: r.msg.clone(),
                        consumer: Some(cid),
                        owner: Some(cid),
                        expires_at: r.expires_at(),
                        delivery_count: r.delivery_count(),
                        enqueued_at: r.enqueued_at,
                    },
                );
            }
            let (redelivered, delivery_count) = (r.redelivered(), r.delivery_count());
            effects.push(Effect::Deliver {
                consumer: cid,
                id: r.id,
                msg: r.msg,
                redelivered,
                settled: c.spec.no_ack,
                delivery_count,
            });
            if c.has_credit() {
                c.in_ring = true;
                self.rings
                    .entry(c.spec.priority)
                    .or_default()
                    .push_back(cid);
            }
        }
    }
}
