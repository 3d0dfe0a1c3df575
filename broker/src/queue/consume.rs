//! Consumers: subscribe, cancel, credit (limiter grants, written bytes) and `basic.get`.

use super::*;

impl Queue {
    /// A limiter has room again: offer its waiting consumers here a slot.
    pub fn regrant(self: &Arc<Self>) {
        if self.is_replicated() {
            return;
        }
        {
            let mut st = self.state.lock();
            let mut effects = std::mem::take(&mut st.effects);
            self.offer_grants(&mut st, &mut effects);
            st.effects = effects;
            self.submit_store_ops(&mut st, None);
        }
        self.dead_letter_pending();
    }

    /// Put a consumer under its channel's shared limit or release it from it.
    pub fn set_limited(self: &Arc<Self>, consumer: ConsumerId, limited: bool) {
        if self.is_replicated() {
            // Quorum queues take no consumers under a channel-wide limit.
            return;
        }
        let wake = {
            let mut st = self.state.lock();
            let wake = Self::release_grant(&st, consumer);
            let _ = self.run(&mut st, Command::SetLimited(consumer, limited));
            wake
        };
        wake.run();
        self.dead_letter_pending();
    }

    /// An unused grant goes back to the limiter (the consumer is leaving or changing mode).
    pub(super) fn release_grant(st: &State, consumer: ConsumerId) -> Wake {
        if st.machine.holds_grant(consumer)
            && let Some(l) = st.sinks.get(&consumer).and_then(|s| s.limiter.as_ref())
        {
            l.release(1)
        } else {
            Wake::default()
        }
    }

    /// Attach a consumer.
    pub fn consume(
        self: &Arc<Self>,
        id: ConsumerId,
        spec: ConsumerSpec,
        sink: ConsumerSink,
    ) -> Result<(), MachineError> {
        if let Some(replica) = self.replica() {
            return self.consume_replicated(replica, id, spec, sink);
        }
        {
            let mut st = self.state.lock();
            st.sinks.insert(id, sink);
            if let Err(e) = self.run(&mut st, Command::Checkout(id, spec)) {
                st.sinks.remove(&id);
                return Err(e);
            }
            st.had_consumer = true;
            st.last_used = self.now_ms();
        }
        self.dead_letter_pending();
        Ok(())
    }

    /// Detach a consumer. Returns true when the queue is auto-delete and this was its last
    /// consumer (the caller deletes it).
    pub fn cancel(self: &Arc<Self>, id: ConsumerId) -> bool {
        if let Some(stream) = self.stream() {
            stream.cancel(id);
            return false;
        }
        if let Some(replica) = self.replica() {
            if self.state.lock().sinks.remove(&id).is_some() {
                self.submit_quietly(replica, vec![Command::Cancel(id)]);
            }
            return false;
        }
        let (last, wake) = {
            let mut st = self.state.lock();
            let wake = Self::release_grant(&st, id);
            if st.sinks.remove(&id).is_none() {
                return false;
            }
            st.last_used = self.now_ms();
            let _ = self.run(&mut st, Command::Cancel(id));
            let last = self.auto_delete
                && st.had_consumer
                && st.machine.consumer_count() == 0
                && !st.deleted;
            (last, wake)
        };
        wake.run();
        self.dead_letter_pending();
        last
    }

    /// Deliveries to `consumer` were written to its socket: restore its window.
    pub fn written(self: &Arc<Self>, consumer: ConsumerId, n: u32, bytes: u64) {
        if self.is_replicated() || self.is_stream {
            // Replicated consumers have no socket window (see `consume_replicated`).
            return;
        }
        {
            let mut st = self.state.lock();
            let _ = self.run(&mut st, Command::Written(consumer, n, bytes));
        }
        self.dead_letter_pending();
    }

    /// basic.get: the head message, its redelivered flag, the ready count after it and its
    /// delivery count.
    pub fn get(self: &Arc<Self>, no_ack: bool) -> Option<Got> {
        if self.is_replicated() {
            // A replicated get is a log entry whose reply comes later: not served yet
            // (documented), and never taken from this replica alone.
            return None;
        }
        let got = {
            let mut st = self.state.lock();
            st.last_used = self.now_ms();
            // Pinned before the settle of a no-ack get is submitted.
            let got = match self.apply(&mut st, Command::Get { no_ack }) {
                Ok(Reply::Got(Some((id, entry, redelivered, left, count)))) => Some((
                    id,
                    crate::durable::pin(&entry, self.store.as_deref()),
                    redelivered,
                    left,
                    count,
                )),
                _ => None,
            };
            self.submit_store_ops(&mut st, None);
            got
        };
        self.dead_letter_pending();
        got
    }
}
