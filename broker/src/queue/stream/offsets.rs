//! Server-side offset tracking for named consumers: tracked offsets never pass an unacked
//! delivery; a replicated stream proposes them through its group, at most every
//! [`super::TRACK_PROPOSE_EVERY`].

use super::*;

impl StreamQueue {
    /// Record `name`'s tracked offset (here at once; a replica also proposes it to its
    /// group, throttled, so the consumer resumes there on any member); false (warned) if the
    /// stream cannot track it.
    pub(super) fn track(&self, name: &str, next: u64) -> bool {
        let stored = self.shared.disk.lock().store_offset(name, next);
        match stored {
            Ok(()) => {
                self.shared.offsets_changed();
                if self.replica.is_some() {
                    self.propose(name, next);
                }
                true
            }
            Err(e) => {
                tracing::warn!(stream = %self.what, consumer = %name, error = %e, "offset not tracked");
                false
            }
        }
    }

    /// Propose `name`'s offset to the group now, or keep it for later if the last proposal
    /// was less than [`TRACK_PROPOSE_EVERY`] ago.
    pub(super) fn propose(&self, name: &str, next: u64) {
        let now = std::time::Instant::now();
        {
            let mut proposals = self.proposals.lock();
            match proposals.get_mut(name) {
                Some((at, pending)) if now.duration_since(*at) < TRACK_PROPOSE_EVERY => {
                    *pending = Some(next);
                    return;
                }
                Some(entry) => *entry = (now, None),
                None => {
                    proposals.insert(name.to_string(), (now, None));
                }
            }
        }
        self.submit_offset(name, next);
    }

    /// Propose what has waited at least [`TRACK_PROPOSE_EVERY`] (the ticker: a consumer
    /// that stopped acking still gets its last offset replicated).
    pub(super) fn propose_due(&self) {
        let now = std::time::Instant::now();
        let due: Vec<(String, u64)> = self
            .proposals
            .lock()
            .iter_mut()
            .filter(|(_, (at, pending))| {
                pending.is_some() && now.duration_since(*at) >= TRACK_PROPOSE_EVERY
            })
            .filter_map(|(name, (at, pending))| {
                *at = now;
                pending.take().map(|next| (name.clone(), next))
            })
            .collect();
        for (name, next) in due {
            self.submit_offset(&name, next);
        }
    }

    /// Propose what waits for `name`, if anything.
    pub(super) fn propose_pending(&self, name: &str) {
        let pending = self
            .proposals
            .lock()
            .get_mut(name)
            .and_then(|(at, pending)| {
                *at = std::time::Instant::now();
                pending.take()
            });
        if let Some(next) = pending {
            self.submit_offset(name, next);
        }
    }

    pub(super) fn submit_offset(&self, name: &str, next: u64) {
        if let Some(q) = self.owner.upgrade()
            && let Some(replica) = q.replica()
        {
            replica.submit(
                vec![crate::queue::machine::Command::TrackOffset {
                    name: name.to_string(),
                    next,
                }],
                Box::new(|_| {}),
            );
        }
    }

    /// Save tracked offsets that changed (at shutdown).
    pub fn save_offsets(&self) {
        if let Err(e) = self.shared.save_offsets() {
            tracing::error!(stream = %self.what, error = %e, "saving stream offsets failed");
        }
    }
}
