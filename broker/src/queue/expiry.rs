//! A queue's timer: message TTL and `x-expires` (the queue deleting itself when unused).

use super::*;

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
        if let (Some(timers), Some(next)) = (&self.timers, next)
            && st.timer_at.is_none_or(|armed| next < armed)
        {
            st.timer_at = Some(next);
            let weak: std::sync::Weak<Self> = Arc::downgrade(self);
            let target: std::sync::Weak<dyn crate::timers::TimerTarget> = weak;
            timers.schedule(next, target);
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
            // Expiry is a command like any other: the leader proposes it, at its time.
            self.state.lock().timer_at = None;
            if replica.is_leader() {
                self.submit_quietly(replica, vec![Command::Expire]);
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
