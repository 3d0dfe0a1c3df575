//! Wake-ups at a given time for queues (message expiry now; queue expiry and delayed messages
//! use the same thread later). One thread per broker sleeps until the earliest due time.
//!
//! Entries are hints: a queue rescheduled earlier leaves its old entry behind, which fires
//! harmlessly (the queue applies `Expire` and re-arms for what is really due). Lock order: a
//! queue may schedule while holding its own lock; the thread calls queues without holding the
//! timer lock.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::{Condvar, Mutex};

/// Something the timer thread wakes (a queue, the delayed-message store).
pub trait TimerTarget: Send + Sync {
    /// Called on the timer thread at (or soon after) the time it asked for, with no timer
    /// lock held.
    fn fire(self: Arc<Self>);
}

/// Milliseconds since the Unix epoch: the machine time of queues (absolute, so it survives a
/// restart).
#[must_use]
pub fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

struct Entry {
    due: u64,
    seq: u64,
    target: Weak<dyn TimerTarget>,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        (self.due, self.seq) == (other.due, other.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.due, self.seq).cmp(&(other.due, other.seq))
    }
}

#[derive(Default)]
struct State {
    heap: BinaryHeap<Reverse<Entry>>,
    seq: u64,
}

/// The broker's timer thread.
pub struct Timers {
    state: Mutex<State>,
    wake: Condvar,
}

impl std::fmt::Debug for Timers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Timers")
            .field("pending", &self.state.lock().heap.len())
            .finish()
    }
}

impl Timers {
    /// Start the thread.
    ///
    /// # Panics
    /// If the thread cannot be spawned (the broker cannot run without it).
    #[must_use]
    pub fn start() -> Arc<Self> {
        let timers = Arc::new(Self {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
        });
        let t = Arc::clone(&timers);
        std::thread::Builder::new()
            .name("warren-timers".into())
            .spawn(move || t.run())
            .expect("spawning the timer thread");
        timers
    }

    /// Call `target.fire()` at `due` (wall-clock ms) or soon after (if it still exists).
    pub fn schedule(&self, due: u64, target: Weak<dyn TimerTarget>) {
        let mut s = self.state.lock();
        s.seq += 1;
        let seq = s.seq;
        let earliest = s.heap.peek().is_none_or(|Reverse(e)| due < e.due);
        s.heap.push(Reverse(Entry { due, seq, target }));
        drop(s);
        if earliest {
            self.wake.notify_one();
        }
    }

    fn run(&self) {
        let mut due_now = Vec::new();
        loop {
            {
                let mut s = self.state.lock();
                loop {
                    let now = wall_ms();
                    match s.heap.peek() {
                        None => {
                            self.wake.wait(&mut s);
                        }
                        Some(Reverse(e)) if e.due > now => {
                            let wait = Duration::from_millis(e.due - now);
                            self.wake.wait_for(&mut s, wait);
                        }
                        Some(_) => break,
                    }
                }
                let now = wall_ms();
                while let Some(Reverse(e)) = s.heap.peek() {
                    if e.due > now {
                        break;
                    }
                    if let Some(Reverse(e)) = s.heap.pop() {
                        due_now.push(e.target);
                    }
                }
            }
            for t in due_now.drain(..) {
                if let Some(t) = t.upgrade() {
                    t.fire();
                }
            }
        }
    }
}
