//! Browsing: reading what a queue holds without claiming it, by state and position.
//!
//! Ready messages are listed in the order the queue would hand them out (highest priority
//! first, then returned ones by id, then never-delivered ones in order); scheduled ones by
//! due time; claimed and delivered ones (unacked) by id. A position is an index into that
//! order at the moment of the call, so pages of a queue that changes between calls may
//! overlap or skip: a browse is a look, not a cursor. Reads only; O(position + limit) for
//! ready and scheduled messages, O(unacked) for unacked ones.

use super::{MessageRef, MsgId, QueueMachine};

/// Which messages a browse lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrowseState {
    /// Ready for delivery.
    Ready,
    /// Waiting out a delayed retry.
    Scheduled,
    /// Claimed under a lease or delivered and not yet acknowledged.
    Unacked,
}

/// One message a browse found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Browsed<M> {
    /// Its position in the state's order.
    pub position: usize,
    /// Message id.
    pub id: MsgId,
    /// The message.
    pub msg: M,
    /// Deliveries returned so far.
    pub delivery_count: u32,
    /// Machine time it entered the queue, ms.
    pub enqueued_at: u64,
    /// Scheduled: when it is ready again, ms.
    pub ready_at: Option<u64>,
    /// Claimed: its claim's generation, lease deadline (ms) and worker.
    pub lease: Option<(u32, u64, String)>,
}

impl<M: MessageRef> QueueMachine<M> {
    /// Up to `limit` messages in `state` from position `from`, their references cloned.
    #[must_use]
    pub fn browse(&self, state: BrowseState, from: usize, limit: usize) -> Vec<Browsed<M>> {
        let browsed = |position: usize, id, msg: &M, delivery_count, enqueued_at| Browsed {
            position,
            id,
            msg: msg.clone(),
            delivery_count,
            enqueued_at,
            ready_at: None,
            lease: None,
        };
        match state {
            BrowseState::Ready => self
                .levels
                .values()
                .rev()
                .flat_map(|l| {
                    l.returned
                        .values()
                        .map(super::ready::Ready::as_ref)
                        .chain(l.fresh.iter())
                })
                .enumerate()
                .skip(from)
                .take(limit)
                .map(|(p, r)| browsed(p, r.id, r.msg, r.delivery_count(), r.enqueued_at))
                .collect(),
            BrowseState::Scheduled => self
                .work
                .scheduled
                .in_due_order()
                .enumerate()
                .skip(from)
                .take(limit)
                .map(|(p, (due, r))| Browsed {
                    ready_at: Some(due),
                    ..browsed(p, r.id, &r.msg, r.delivery_count(), r.enqueued_at)
                })
                .collect(),
            BrowseState::Unacked => {
                let mut ids: Vec<MsgId> = self.unacked.keys().copied().collect();
                ids.sort_unstable();
                ids.into_iter()
                    .enumerate()
                    .skip(from)
                    .take(limit)
                    .filter_map(|(p, id)| {
                        let u = self.unacked.get(&id)?;
                        let lease = self
                            .work
                            .leases
                            .get(id)
                            .map(|l| (l.generation, l.expires_at, l.worker.clone()));
                        Some(Browsed {
                            lease,
                            ..browsed(p, id, &u.msg, u.delivery_count, u.enqueued_at)
                        })
                    })
                    .collect()
            }
        }
    }
}
