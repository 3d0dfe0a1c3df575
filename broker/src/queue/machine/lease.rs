//! Claims under a lease: the work-queue contract (seeds 003 and 004).
//!
//! `Claim` takes up to `max` ready messages for a worker for a lease; each claim of a message
//! has a **generation**, the number of times the message has been claimed or delivered so far,
//! this time included. Every claim or delivery ends by the message leaving the queue or by a
//! return that counts one more delivery, so the generation is the message's delivery count plus
//! one at the moment of the claim and grows by one with every claim: a later claim always has a
//! larger generation. A token (message id, generation, enqueue time) settles, extends or releases the claim
//! only while that generation holds it and its lease runs; any other token changes nothing and
//! gets a [`LeaseError`] saying why.
//!
//! A lease that runs out returns its message (a delivery counted, kind
//! [`ReturnKind::Returned`]) at the start of the first command at or after its deadline; the
//! driver runs [`Command::Expire`](super::Command::Expire) at
//! [`QueueMachine::next_expiry`]. Nothing else is closed.
//!
//! Invariants:
//! - every lease names an unacked message held by no consumer, and `by_deadline` holds exactly
//!   one `(expires_at, id)` per lease;
//! - a lease's generation is its message's delivery count plus one;
//! - after every command no lease has run out (`expires_at > now`);
//! - a lease never runs past `claimed_at + lifetime_max_ms` of the config it was extended
//!   under.

use std::collections::{BTreeMap, BTreeSet};

use super::command::{Claimed, Effect, LeaseError, LeaseState};
use super::config::ReturnKind;
use super::{MessageRef, MsgId, QueueMachine};

/// What names a claim: the message id, the claim's generation and the message's enqueue time
/// (machine ms). The enqueue time tells apart messages that share an id across a queue's
/// incarnations (a queue deleted and declared again numbers from 1; a durable classic queue's
/// restored messages enter again at their restore time), so a token from before cannot touch
/// them.
pub(super) type Token = (MsgId, u32, u64);

/// A claim's lease.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct Lease {
    /// The claim's generation (see the module doc).
    pub(super) generation: u32,
    /// Machine time of the claim (the lifetime cap counts from it).
    pub(super) claimed_at: u64,
    /// Machine time at which the lease runs out.
    pub(super) expires_at: u64,
    /// Who claimed it (as the driver names workers).
    pub(super) worker: String,
}

/// Why a message came back from its last claim, kept until it leaves the queue.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct Failure {
    /// What the worker said, or `lease expired`.
    pub(super) reason: String,
    /// The worker.
    pub(super) worker: String,
}

/// The reason a failure records when a lease ran out.
pub(super) const LEASE_EXPIRED_REASON: &str = "lease expired";

/// The leases of claimed messages.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub(super) struct Leases {
    by_id: BTreeMap<MsgId, Lease>,
    by_deadline: BTreeSet<(u64, MsgId)>,
}

impl Leases {
    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(super) fn get(&self, id: MsgId) -> Option<&Lease> {
        self.by_id.get(&id)
    }

    fn insert(&mut self, id: MsgId, lease: Lease) {
        self.by_deadline.insert((lease.expires_at, id));
        if let Some(old) = self.by_id.insert(id, lease) {
            self.by_deadline.remove(&(old.expires_at, id));
        }
    }

    /// Drop the lease of a message leaving the unacked set.
    pub(super) fn remove(&mut self, id: MsgId) -> Option<Lease> {
        let lease = self.by_id.remove(&id)?;
        self.by_deadline.remove(&(lease.expires_at, id));
        Some(lease)
    }

    fn set_deadline(&mut self, id: MsgId, expires_at: u64) {
        if let Some(lease) = self.by_id.get_mut(&id) {
            self.by_deadline.remove(&(lease.expires_at, id));
            lease.expires_at = expires_at;
            self.by_deadline.insert((expires_at, id));
        }
    }

    /// The first lease run out at `now`.
    fn first_due(&self, now: u64) -> Option<MsgId> {
        self.by_deadline
            .first()
            .filter(|&&(at, _)| at <= now)
            .map(|&(_, id)| id)
    }

    pub(super) fn next_deadline(&self) -> Option<u64> {
        self.by_deadline.first().map(|&(at, _)| at)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&MsgId, &Lease)> {
        self.by_id.iter()
    }

    pub(super) fn oldest_claim(&self) -> Option<u64> {
        self.by_id.values().map(|l| l.claimed_at).min()
    }

    /// Checks the index (see the module doc).
    pub(super) fn check(&self) {
        assert_eq!(
            self.by_id.len(),
            self.by_deadline.len(),
            "one deadline each"
        );
        assert!(
            self.by_deadline
                .iter()
                .all(|(at, id)| self.by_id.get(id).is_some_and(|l| l.expires_at == *at)),
            "deadlines index the leases"
        );
    }
}

impl<M: MessageRef> QueueMachine<M> {
    /// Messages claimed under a lease.
    #[must_use]
    pub fn leased_len(&self) -> usize {
        self.work.leases.len()
    }

    /// Machine time of the oldest claim still leased, ms.
    #[must_use]
    pub fn oldest_claim_at(&self) -> Option<u64> {
        self.work.leases.oldest_claim()
    }

    /// Claim up to `max` ready messages for `worker`, each for `lease_ms` (the queue's default
    /// lease when None; at most its extension cap and lifetime cap).
    pub(super) fn claim(
        &mut self,
        max: u32,
        lease_ms: Option<u64>,
        worker: String,
        effects: &mut Vec<Effect<M>>,
    ) -> Vec<Claimed<M>> {
        let expires_at = self.lease_deadline(lease_ms);
        let mut out = Vec::new();
        while out.len() < max as usize {
            let Some(r) = self.pop_live(effects) else {
                break;
            };
            out.push(self.lease_out(r, expires_at, &worker));
        }
        out
    }

    /// Claim the ready messages `ids` (wherever they wait, not only at the head) for
    /// `worker`, as [`QueueMachine::claim`] does; ids not ready (claimed, delivered,
    /// scheduled, gone) are passed over, and one whose TTL ran out leaves as expired. A
    /// redrive takes what its filter chose this way.
    pub(super) fn take(
        &mut self,
        ids: &[MsgId],
        lease_ms: Option<u64>,
        worker: &str,
        effects: &mut Vec<Effect<M>>,
    ) -> Vec<Claimed<M>> {
        let expires_at = self.lease_deadline(lease_ms);
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            let Some(r) = self.take_ready(id) else {
                continue;
            };
            if self.is_expired(&r) {
                self.counters.expired += 1;
                effects.push(Effect::Removed {
                    id: r.id,
                    msg: r.msg,
                    reason: super::command::Removal::Expired,
                });
                continue;
            }
            out.push(self.lease_out(r, expires_at, worker));
        }
        out
    }

    /// When a lease of `lease_ms` (the queue's default when None) taken now runs out, within
    /// the extension and lifetime caps.
    fn lease_deadline(&self, lease_ms: Option<u64>) -> u64 {
        let cfg = self.work.config.lease;
        let lease = lease_ms
            .unwrap_or(cfg.default_ms)
            .clamp(1, cfg.extension_max_ms.max(1))
            .min(cfg.lifetime_max_ms.max(1));
        self.now.saturating_add(lease)
    }

    /// Check a ready message out to `worker` under a lease running out at `expires_at`.
    fn lease_out(
        &mut self,
        r: super::ready::Ready<M>,
        expires_at: u64,
        worker: &str,
    ) -> Claimed<M> {
        self.counters.got += 1;
        self.counters.redelivered += u64::from(r.redelivered());
        self.work.counters.claimed += 1;
        self.check_out(&r, None);
        let delivery_count = r.delivery_count();
        let generation = delivery_count.saturating_add(1);
        self.work.leases.insert(
            r.id,
            Lease {
                generation,
                claimed_at: self.now,
                expires_at,
                worker: worker.to_string(),
            },
        );
        Claimed {
            id: r.id,
            generation,
            delivery_count,
            redelivered: r.redelivered(),
            lease_expires_at: expires_at,
            enqueued_at: r.enqueued_at,
            msg: r.msg,
        }
    }

    /// The lease a token `(id, generation, enqueued_at)` names, if it holds; else why not.
    pub(super) fn check_token(&self, token: Token) -> Result<&Lease, LeaseError> {
        let (id, generation, enqueued_at) = token;
        if let Some(lease) = self.work.leases.get(id) {
            let u = self.unacked.get(&id);
            if u.is_none_or(|u| u.enqueued_at != enqueued_at) {
                return Err(LeaseError::NotFound);
            }
            return if lease.generation == generation {
                Ok(lease)
            } else {
                Err(LeaseError::StaleGeneration {
                    current: lease.generation,
                })
            };
        }
        if let Some(u) = self.unacked.get(&id) {
            if u.enqueued_at != enqueued_at {
                return Err(LeaseError::NotFound);
            }
            // Delivered to a consumer or basic.get since: that delivery is the current one.
            return Err(LeaseError::StaleGeneration {
                current: u.delivery_count.saturating_add(1),
            });
        }
        let waiting = self
            .ready_record(id)
            .or_else(|| {
                self.work
                    .scheduled
                    .get(id)
                    .map(|r| (r.delivery_count(), r.enqueued_at))
            })
            .filter(|&(_, at)| at == enqueued_at)
            .map(|(count, _)| count);
        match waiting {
            // Deliveries so far: the generation of the last claim or delivery.
            Some(current) if current == generation => Err(LeaseError::LeaseExpired { current }),
            Some(current) => Err(LeaseError::StaleGeneration { current }),
            None => Err(LeaseError::NotFound),
        }
    }

    /// Extend a claim's lease to `lease_ms` from now, within the caps.
    pub(super) fn extend(&mut self, token: Token, lease_ms: u64) -> Result<LeaseState, LeaseError> {
        let cfg = self.work.config.lease;
        let claimed_at = self.check_token(token)?.claimed_at;
        let id = token.0;
        let asked = self
            .now
            .saturating_add(lease_ms.clamp(1, cfg.extension_max_ms.max(1)));
        let cap = claimed_at.saturating_add(cfg.lifetime_max_ms.max(1));
        // Never shorter than now + 1: an extension past the cap keeps the lease to the cap,
        // and a cap already reached ends it at the next command.
        let expires_at = asked.min(cap).max(self.now.saturating_add(1));
        self.work.leases.set_deadline(id, expires_at);
        self.work.counters.extended += 1;
        Ok(LeaseState::Claimed {
            lease_expires_at: expires_at,
        })
    }

    /// Acknowledge a claim: its message leaves the queue.
    pub(super) fn ack_lease(
        &mut self,
        token: Token,
        effects: &mut Vec<Effect<M>>,
    ) -> Result<LeaseState, LeaseError> {
        self.check_token(token)?;
        self.settle(vec![token.0], effects);
        Ok(LeaseState::Acked)
    }

    /// Release a claim: its message returns (a failed delivery), ready again after `delay_ms`
    /// (the retry policy's delay when None).
    pub(super) fn release_lease(
        &mut self,
        token: Token,
        delay_ms: Option<u64>,
        reason: String,
        effects: &mut Vec<Effect<M>>,
    ) -> Result<LeaseState, LeaseError> {
        let worker = self.check_token(token)?.worker.clone();
        self.work.counters.released += 1;
        self.work
            .failures
            .insert(token.0, Failure { reason, worker });
        let ready_at = self.return_one(token.0, ReturnKind::Failed, delay_ms, effects);
        Ok(LeaseState::Released { ready_at })
    }

    /// Return the messages whose lease ran out (a delivery counted each).
    pub(super) fn expire_leases(&mut self, effects: &mut Vec<Effect<M>>) {
        while let Some(id) = self.work.leases.first_due(self.now) {
            self.work.counters.lease_expired += 1;
            if let Some(lease) = self.work.leases.get(id) {
                let worker = lease.worker.clone();
                self.work.failures.insert(
                    id,
                    Failure {
                        reason: LEASE_EXPIRED_REASON.to_string(),
                        worker,
                    },
                );
            }
            let before = self.work.leases.len();
            self.return_one(id, ReturnKind::Returned, None, effects);
            debug_assert!(self.work.leases.len() < before, "an expired lease ends");
            if self.work.leases.len() >= before {
                // Never loop on a lease that did not go (a bug): drop it instead.
                self.work.leases.remove(id);
            }
        }
    }

    /// The failure context of a message removed past its delivery limit, as an effect ahead
    /// of its removal.
    pub(super) fn failure_effect(&mut self, id: MsgId, delivery_count: u32) -> Option<Effect<M>> {
        let f = self.work.failures.remove(&id)?;
        Some(Effect::Failed {
            id,
            reason: f.reason,
            worker: f.worker,
            delivery_count,
        })
    }

    /// Drop the failure context of messages that left the queue in this command.
    pub(super) fn forget_failures(&mut self, effects: &[Effect<M>]) {
        if self.work.failures.is_empty() {
            return;
        }
        for e in effects {
            if let Effect::Removed { id, .. } = e {
                self.work.failures.remove(id);
            }
        }
    }

    /// Give unacked deliveries back as failed, each held `delay_ms` (None: the retry policy's
    /// delay), keeping `reason` and `worker` as their failure context.
    pub(super) fn retry(
        &mut self,
        ids: Vec<MsgId>,
        delay_ms: Option<u64>,
        reason: &str,
        worker: &str,
        effects: &mut Vec<Effect<M>>,
    ) {
        for id in ids {
            if !self.unacked.contains_key(&id) {
                continue;
            }
            self.work.failures.insert(
                id,
                Failure {
                    reason: reason.to_string(),
                    worker: worker.to_string(),
                },
            );
            self.return_one(id, ReturnKind::Failed, delay_ms, effects);
        }
    }
}
