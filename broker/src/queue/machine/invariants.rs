//! [`QueueMachine::check_invariants`]: every invariant the other modules keep, checked from
//! scratch (O(messages)). Tests run it after every command; debug builds check only message
//! conservation there. Reads the machine, never changes it.

use super::config::Overflow;
use super::{MessageRef, QueueMachine};

impl<M: MessageRef> QueueMachine<M> {
    /// Assert the machine's invariants (all of them after every apply in tests; the O(1)
    /// conservation check after every apply in debug builds). Costs O(messages).
    ///
    /// # Panics
    /// When an invariant is broken: that is a bug in the machine.
    pub fn check_invariants(&self) {
        let c = self.counters;
        assert_eq!(self.len() as u64, c.live(), "message conservation");
        self.work.scheduled.check();
        self.work.dedup.check(&self.work.config.dedup);
        self.work.moves.check();
        self.work.leases.check();
        for (id, lease) in self.work.leases.iter() {
            let u = self
                .unacked
                .get(id)
                .expect("a lease names an unacked message");
            assert!(u.consumer.is_none(), "a claim is held by no consumer");
            assert_eq!(
                lease.generation,
                u.delivery_count.saturating_add(1),
                "generation is the delivery count plus one"
            );
            assert!(lease.expires_at > self.now, "no lease has run out");
            assert!(
                self.levels.values().all(|l| !l.returned.contains_key(id)),
                "a claimed message is not ready"
            );
        }
        for id in self.work.failures.keys() {
            assert!(
                self.unacked.contains_key(id)
                    || self.ready_record(*id).is_some()
                    || self.work.scheduled.get(*id).is_some(),
                "failure context only for messages still in the queue"
            );
        }
        if let Some(due) = self.work.scheduled.next_due() {
            assert!(due > self.now, "no scheduled message is due");
        }
        let mut ready_bytes = 0;
        let mut ready_count = 0;
        for (level, l) in &self.levels {
            assert!(l.len() > 0, "no empty levels");
            if let (Some((max_returned, _)), Some(first_fresh)) =
                (l.returned.last_key_value(), l.fresh.front())
            {
                assert!(
                    *max_returned < first_fresh.id,
                    "returned messages precede fresh ones"
                );
            }
            assert!(
                l.fresh
                    .iter()
                    .zip(l.fresh.iter().skip(1))
                    .all(|(a, b)| a.id < b.id),
                "fresh is FIFO"
            );
            for r in l
                .fresh
                .iter()
                .chain(l.returned.values().map(super::ready::Ready::as_ref))
            {
                assert_eq!(self.level_of(r.msg), *level, "message in its level");
                ready_bytes += r.msg.size();
                ready_count += 1;
            }
        }
        assert_eq!(ready_count, self.ready_count, "ready count");
        assert_eq!(ready_bytes, self.ready_bytes, "ready bytes");
        if self.config.overflow == Overflow::DropHead {
            assert!(!self.over_limits(), "within length limits");
        }
        let unacked_bytes: u64 = self.unacked.values().map(|u| u.msg.size()).sum();
        assert_eq!(unacked_bytes, self.unacked_bytes, "unacked bytes");
        assert_eq!(
            self.limited_consumers,
            self.consumers.values().filter(|c| c.is_limited()).count(),
            "limited consumer count"
        );
        if self.config.single_active {
            let active: Vec<_> = self.consumers.iter().filter(|(_, c)| c.active).collect();
            let oldest = self.consumers.values().map(|c| c.attached).min();
            assert!(
                active.len() == usize::from(!self.consumers.is_empty())
                    && active
                        .first()
                        .is_none_or(|(_, c)| Some(c.attached) == oldest),
                "exactly the longest-attached consumer is active"
            );
        }
        for (id, consumer) in &self.consumers {
            let owned = self
                .unacked
                .values()
                .filter(|u| u.consumer == Some(*id))
                .count() as u32;
            assert_eq!(owned, consumer.unacked, "consumer unacked count");
            let in_ring = self
                .rings
                .get(&consumer.spec.priority)
                .is_some_and(|r| r.contains(id));
            assert_eq!(consumer.in_ring, in_ring, "ring membership flag");
            if !consumer.spec.no_ack && consumer.spec.prefetch > 0 {
                assert!(
                    consumer.unacked <= consumer.spec.prefetch,
                    "prefetch respected"
                );
            }
            assert!(
                consumer.unwritten <= consumer.spec.window,
                "window respected"
            );
            assert!(
                !consumer.granted || consumer.is_limited(),
                "only limited consumers hold grants"
            );
        }
        if self.ready_len() > 0 {
            assert!(
                self.rings.is_empty(),
                "no consumer with credit while messages are ready"
            );
        }
    }
}
