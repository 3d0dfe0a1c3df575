//! Attached consumers: their credit (prefetch, write window, shared-limit grants), the service
//! rings that hold the ones with credit, exclusive and single active consumers, and the
//! commands that attach, detach or re-credit them (checkout, cancel, written, grant,
//! set-limited, node down).
//!
//! Invariants:
//! - a consumer is in the ring of its priority exactly when its `in_ring` flag is set, at most
//!   once; it enters only with credit ([`Consumer::has_credit`]), and whatever may give a
//!   consumer credit calls [`QueueMachine::refresh_ring`]. Rings are never empty (an emptied
//!   one is removed);
//! - `limited_consumers` counts the attached consumers under a shared limit, and only they hold
//!   grants;
//! - with single active consumer, exactly the longest-attached consumer is active;
//! - a cancelled consumer's unacked messages stay checked out (owned by no consumer's prefetch
//!   but still by its node, for [`Command::Down`]).

use super::command::{Command, ConsumerSpec, Effect, MachineError, Reply};
use super::{ConsumerId, MessageRef, MsgId, QueueMachine, consumer_node};

/// An attached consumer and its credit.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct Consumer {
    pub(super) spec: ConsumerSpec,
    pub(super) unacked: u32,
    pub(super) unwritten: u32,
    pub(super) unwritten_bytes: u64,
    /// Holds an unused [`Command::Grant`] (limited consumers only).
    pub(super) granted: bool,
    /// May receive (always, unless the queue has a single active consumer and this is not it).
    pub(super) active: bool,
    /// Attach order (single active consumer fails over to the smallest).
    pub(super) attached: u64,
    /// Present in the service ring.
    pub(super) in_ring: bool,
}

impl Consumer {
    pub(super) fn is_limited(&self) -> bool {
        self.spec.limited && !self.spec.no_ack
    }

    /// Credit apart from a shared limit: prefetch and window (and being the active consumer).
    pub(super) fn own_credit(&self) -> bool {
        self.active
            && (self.spec.no_ack || self.spec.prefetch == 0 || self.unacked < self.spec.prefetch)
            && self.unwritten < self.spec.window
            && (self.unwritten == 0 || self.unwritten_bytes < self.spec.window_bytes)
    }

    pub(super) fn has_credit(&self) -> bool {
        self.own_credit() && (!self.is_limited() || self.granted)
    }
}

impl<M: MessageRef> QueueMachine<M> {
    /// Attached consumers.
    #[must_use]
    pub fn consumer_count(&self) -> usize {
        self.consumers.len()
    }

    /// Whether `consumer` is attached.
    #[must_use]
    pub fn has_consumer(&self, consumer: ConsumerId) -> bool {
        self.consumers.contains_key(&consumer)
    }

    /// Whether an exclusive consumer holds the queue.
    #[must_use]
    pub fn has_exclusive_consumer(&self) -> bool {
        self.exclusive_consumer.is_some()
    }

    /// Consumers under a shared limit that would receive a message now if granted one (no
    /// unused grant, other credit left, messages ready): the driver obtains limiter slots for
    /// them and sends [`Command::Grant`]. Empty unless some consumer is limited.
    pub fn grant_candidates(&self, out: &mut Vec<ConsumerId>) {
        if self.limited_consumers == 0 || self.ready_len() == 0 {
            return;
        }
        out.extend(
            self.consumers
                .iter()
                .filter(|(_, c)| c.is_limited() && !c.granted && c.own_credit())
                .map(|(id, _)| *id),
        );
    }

    /// Whether `consumer` holds an unused grant (released to the limiter when it goes).
    #[must_use]
    pub fn holds_grant(&self, consumer: ConsumerId) -> bool {
        self.consumers.get(&consumer).is_some_and(|c| c.granted)
    }

    /// Whether `consumer` is attached and under a shared limit.
    #[must_use]
    pub fn is_limited(&self, consumer: ConsumerId) -> bool {
        self.consumers
            .get(&consumer)
            .is_some_and(Consumer::is_limited)
    }

    /// Attach a consumer.
    pub(super) fn checkout(
        &mut self,
        consumer: ConsumerId,
        spec: ConsumerSpec,
    ) -> Result<(), MachineError> {
        if self.consumers.contains_key(&consumer) {
            return Err(MachineError::DuplicateConsumer);
        }
        if self.exclusive_consumer.is_some() || (spec.exclusive && !self.consumers.is_empty()) {
            return Err(MachineError::ExclusiveInUse);
        }
        if spec.exclusive {
            self.exclusive_consumer = Some(consumer);
        }
        if spec.limited && !spec.no_ack {
            self.limited_consumers += 1;
        }
        let active = !self.config.single_active || self.consumers.is_empty();
        self.attach_seq += 1;
        self.consumers.insert(
            consumer,
            Consumer {
                spec,
                unacked: 0,
                unwritten: 0,
                unwritten_bytes: 0,
                granted: false,
                active,
                attached: self.attach_seq,
                in_ring: false,
            },
        );
        self.refresh_ring(consumer);
        Ok(())
    }

    /// Detach a consumer (absent ones are ignored); its unacked messages stay checked out.
    pub(super) fn cancel(&mut self, consumer: ConsumerId) {
        if let Some(gone) = self.consumers.remove(&consumer) {
            if gone.is_limited() {
                self.limited_consumers -= 1;
            }
            if gone.in_ring {
                self.ring_remove(gone.spec.priority, consumer);
            }
            if gone.unacked > 0 {
                // Its messages stay checked out, owned by nobody's prefetch.
                for u in self
                    .unacked
                    .values_mut()
                    .filter(|u| u.consumer == Some(consumer))
                {
                    u.consumer = None;
                }
            }
            if self.exclusive_consumer == Some(consumer) {
                self.exclusive_consumer = None;
            }
            // Single active consumer: the longest-attached remaining one takes over.
            if gone.active
                && self.config.single_active
                && let Some((&next, c)) = self.consumers.iter_mut().min_by_key(|(_, c)| c.attached)
            {
                c.active = true;
                self.refresh_ring(next);
            }
        }
    }

    /// `n` of the consumer's deliveries, `bytes` in all, have been written out.
    pub(super) fn written(&mut self, consumer: ConsumerId, n: u32, bytes: u64) {
        if let Some(c) = self.consumers.get_mut(&consumer) {
            c.unwritten = c.unwritten.saturating_sub(n);
            c.unwritten_bytes = c.unwritten_bytes.saturating_sub(bytes);
            self.refresh_ring(consumer);
        }
    }

    /// A limited consumer may receive one more message.
    pub(super) fn grant(&mut self, consumer: ConsumerId) {
        if let Some(c) = self.consumers.get_mut(&consumer)
            && c.is_limited()
        {
            c.granted = true;
            self.refresh_ring(consumer);
        }
    }

    /// Put a consumer under a shared limit or release it; an unused grant is dropped.
    pub(super) fn set_limited(&mut self, consumer: ConsumerId, limited: bool) {
        if let Some(c) = self.consumers.get_mut(&consumer) {
            let was = c.is_limited();
            c.spec.limited = limited;
            c.granted = false;
            match (was, c.is_limited()) {
                (false, true) => self.limited_consumers += 1,
                (true, false) => self.limited_consumers -= 1,
                _ => {}
            }
            let (in_ring, credit, priority) = (c.in_ring, c.has_credit(), c.spec.priority);
            if in_ring && !credit {
                c.in_ring = false;
                self.ring_remove(priority, consumer);
            }
            self.refresh_ring(consumer);
        }
    }

    /// Node `node` is down or restarted: cancel its consumers with ids below `before` and
    /// return every message delivered to them and not settled, each as a command of its own
    /// (so each ends as every command does).
    pub(super) fn down(
        &mut self,
        now_ms: u64,
        node: u64,
        before: ConsumerId,
        effects: &mut Vec<Effect<M>>,
    ) -> Result<Reply<M>, MachineError> {
        let of_node = |c: ConsumerId| consumer_node(c) == node && c < before;
        let mut gone: Vec<ConsumerId> = self
            .consumers
            .keys()
            .copied()
            .filter(|c| of_node(*c))
            .collect();
        gone.sort_unstable();
        for c in gone {
            let _ = self.apply(now_ms, Command::Cancel(c), effects);
        }
        let mut held: Vec<MsgId> = self
            .unacked
            .iter()
            .filter(|(_, u)| u.owner.is_some_and(of_node))
            .map(|(id, _)| *id)
            .collect();
        // Replicas must produce the same effects in the same order.
        held.sort_unstable();
        self.apply(now_ms, Command::Return(held), effects)
    }

    /// Put the consumer in its priority's ring if it has credit and is not there yet.
    pub(super) fn refresh_ring(&mut self, id: ConsumerId) {
        if let Some(c) = self.consumers.get_mut(&id)
            && !c.in_ring
            && c.has_credit()
        {
            c.in_ring = true;
            self.rings.entry(c.spec.priority).or_default().push_back(id);
        }
    }

    fn ring_remove(&mut self, priority: i32, id: ConsumerId) {
        if let Some(ring) = self.rings.get_mut(&priority) {
            ring.retain(|c| *c != id);
            if ring.is_empty() {
                self.rings.remove(&priority);
            }
        }
    }

    /// The next consumer in turn at the highest priority that has one.
    pub(super) fn pop_ring(&mut self) -> Option<ConsumerId> {
        let mut entry = self.rings.last_entry()?;
        let id = entry.get_mut().pop_front();
        if entry.get().is_empty() {
            entry.remove();
        }
        id
    }
}
