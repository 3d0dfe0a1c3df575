//! A queue's timer: message TTL and `x-expires` (the queue deleting itself when unused).

use super::*;

/// How soon a replicated queue's follower looks again at an expiry that is overdue (its
/// leader may be gone; see [`Queue::on_timer`]), ms.
const FOLLOWER_RECHECK_MS: u64 = 1_000;

impl Queue {
    /// Make sure the timer thread wakes this queue when its next message expires.
    pub(super) fn arm_timer(self: &Arc<Self>, st: &mut State) {
        if st.deleted {
            return;
        }
        let next = match (st.machine.next_expiry(), self.unused_until(st)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if let Some(next) = next {
            self.arm_timer_at(st, next);
        }
    }

    /// Make sure the timer thread wakes this queue at `at` (wall-clock ms) or earlier.
    fn arm_timer_at(self: &Arc<Self>, st: &mut State, at: u64) {
        if let Some(timers) = &self.timers
            && st.timer_at.is_none_or(|armed| at < armed)
        {
            st.timer_at = Some(at);
            let weak: std::sync::Weak<Self> = Arc::downgrade(self);
            let target: std::sync::Weak<dyn crate::timers::TimerTarget> = weak;
            timers.schedule(at, target);
        }
    }

    /// `x-expires`: when the queue is deleted if nobody uses it until then (None while it has
    /// consumers or no such argument).
    pub(super) fn unused_until(&self, st: &State) -> Option<u64> {
        st.expires
            .filter(|_| st.machine.consumer_count() == 0 && !st.deleted)
            .map(|ms| st.last_used.saturating_add(ms))
    }

    /// The queue was used (declared, consumed from, read with basic.get): `x-expires` starts
    /// again.
    pub fn touch(self: &Arc<Self>) {
        let mut st = self.state.lock();
        st.last_used = self.now_ms();
        self.arm_timer(&mut st);
    }

    /// Called by the timer thread: expire messages that are due, delete the queue if it has
    /// been unused for its `x-expires`, then re-arm.
    pub fn on_timer(self: &Arc<Self>) {
        if let Some(replica) = self.replica() {
            // Expiry (of TTLs, leases, delayed retries) is a command like any other: the
            // leader proposes it, at its time.
            let mut st = self.state.lock();
            st.timer_at = None;
            if replica.is_leader() {
                drop(st);
                self.submit_quietly(replica, vec![Command::Expire]);
                return;
            }
            // A follower whose timer fires while something is overdue looks again soon: its
            // leader may be gone, and once this replica leads it proposes the expiry itself
            // (a lease of a claim whose worker died must run out even with no traffic).
            let now = self.now_ms();
            if st.machine.next_expiry().is_some_and(|at| at <= now) {
                self.arm_timer_at(&mut st, now.saturating_add(FOLLOWER_RECHECK_MS));
            } else {
                self.arm_timer(&mut st);
            }
            return;
        }
        let unused = {
            let mut st = self.state.lock();
            st.timer_at = None;
            let _ = self.run(&mut st, Command::Expire);
            self.unused_until(&st).is_some_and(|at| at <= self.now_ms())
        };
        self.dead_letter_pending();
        if unused && let Some(vhost) = self.vhost_ref.upgrade() {
            // Checked again under the vhost lock: a consumer or declare may have come since.
            vhost.delete_if(self, &|q: &Queue| q.is_unused_now(), &mut || {
                Box::new(|_| {})
            });
        }
    }

    /// Whether `x-expires` has run out right now.
    pub(super) fn is_unused_now(&self) -> bool {
        let st = self.state.lock();
        self.unused_until(&st).is_some_and(|at| at <= self.now_ms())
    }
}
