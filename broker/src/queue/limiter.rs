//! The channel-wide prefetch limit of `basic.qos global=true`, shared by every consumer of a
//! channel across queues (RabbitMQ's `rabbit_limiter`).
//!
//! A consumer under the limit receives one message per slot: its queue reserves a slot here
//! and sends the machine a [`crate::queue::machine::Command::Grant`]. The slot stays taken while
//! the grant is unused and then while the delivered message is unacked; the channel releases it
//! on ack, nack, reject or requeue. A queue that finds the limiter full registers as a waiter and
//! is woken when slots free up.
//!
//! Invariant: `used` = unused grants + unacked counted deliveries of the channel. It may exceed
//! `limit` only after the limit was lowered. Lock order: queue state, then limiter; wake-ups
//! run after the limiter lock is released.

use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::queue::Queue;
use crate::queue::machine::ConsumerId;

#[derive(Debug, Default)]
struct State {
    limit: u32,
    used: u32,
    waiters: Vec<(Weak<Queue>, ConsumerId)>,
}

/// One channel's shared prefetch limit (0 = unlimited, the default).
#[derive(Debug, Default)]
pub struct Limiter {
    state: Mutex<State>,
}

/// Queues with waiting consumers (each gets [`Queue::regrant`]), collected under the limiter
/// lock and woken outside it.
#[derive(Debug, Default)]
#[must_use = "waiters must be woken"]
pub struct Wake(Vec<(Weak<Queue>, ConsumerId)>);

impl Wake {
    /// Offer the waiting consumers slots again.
    pub fn run(self) {
        let mut seen: Vec<*const Queue> = Vec::new();
        for (queue, _) in self.0 {
            if let Some(queue) = queue.upgrade()
                && !seen.contains(&Arc::as_ptr(&queue))
            {
                seen.push(Arc::as_ptr(&queue));
                queue.regrant();
            }
        }
    }
}

impl Limiter {
    /// Take a slot for `consumer` of `queue`, or register it to be woken when one frees up.
    pub fn try_reserve(&self, queue: &Arc<Queue>, consumer: ConsumerId) -> bool {
        let mut s = self.state.lock();
        if s.limit == 0 || s.used < s.limit {
            s.used += 1;
            true
        } else {
            if !s
                .waiters
                .iter()
                .any(|(q, c)| *c == consumer && q.as_ptr() == Arc::as_ptr(queue))
            {
                s.waiters.push((Arc::downgrade(queue), consumer));
            }
            false
        }
    }

    /// Give back `n` slots (acked or returned deliveries, unused grants).
    pub fn release(&self, n: u32) -> Wake {
        if n == 0 {
            return Wake::default();
        }
        let mut s = self.state.lock();
        debug_assert!(s.used >= n, "releasing more slots than reserved");
        s.used = s.used.saturating_sub(n);
        Self::wake_if_room(&mut s)
    }

    /// Change the limit (0 = unlimited).
    pub fn set_limit(&self, limit: u32) -> Wake {
        let mut s = self.state.lock();
        s.limit = limit;
        Self::wake_if_room(&mut s)
    }

    fn wake_if_room(s: &mut State) -> Wake {
        if s.limit == 0 || s.used < s.limit {
            Wake(std::mem::take(&mut s.waiters))
        } else {
            Wake::default()
        }
    }
}
