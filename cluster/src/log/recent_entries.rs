//! The entries a group appended last, encoded, kept in memory until they are applied: the
//! reads that follow an append (replication to each follower on the leader, the apply on
//! every member) take them from here instead of reading them back from the log (a lock, a
//! pread and a checksum per span on the WAL: 5.5% of the machine with 12 partitions,
//! docs/benchmarks.md).
//!
//! Invariants:
//! - the cache holds a contiguous run of indexes `first ..= first + len - 1` whose last is the
//!   log's last entry: every append passes through [`RecentEntries::appended`], every
//!   truncation through [`RecentEntries::truncate`], and an append that cannot be cached
//!   (past the node's budget, or not following the run) empties it;
//! - its bytes are bounded per group ([`RECENT_ENTRY_BYTES`]) and for the whole process
//!   ([`RECENT_ENTRIES_NODE_BYTES`]); the applied entries leave it, so an idle group holds
//!   nothing.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;

/// Bytes of encoded entries one group keeps at most (the oldest leave first).
pub const RECENT_ENTRY_BYTES: usize = 1024 * 1024;

/// Bytes of encoded entries all groups of the process keep at most: past it an append is not
/// cached (its reads go to the log), so ten thousand groups cannot hold a gigabyte between
/// them.
pub const RECENT_ENTRIES_NODE_BYTES: usize = 64 * 1024 * 1024;

/// Bytes cached by every group of the process.
static CACHED: AtomicUsize = AtomicUsize::new(0);

/// Bytes cached by every group of the process now.
#[must_use]
pub fn cached_bytes() -> usize {
    CACHED.load(Ordering::Relaxed)
}

/// Count `len` more bytes cached in the process, unless that passes `budget`.
fn reserve(len: usize, budget: usize) -> bool {
    if CACHED.fetch_add(len, Ordering::Relaxed) + len > budget {
        CACHED.fetch_sub(len, Ordering::Relaxed);
        return false;
    }
    true
}

/// One group's last appended entries.
#[derive(Debug, Default)]
pub struct RecentEntries {
    /// Index of `entries[0]`.
    first: u64,
    entries: VecDeque<Bytes>,
    bytes: usize,
}

impl RecentEntries {
    /// The entry at `index` was appended (replacing any at `index` and after).
    pub fn appended(&mut self, index: u64, entry: Bytes) {
        self.append_within(index, entry, RECENT_ENTRIES_NODE_BYTES);
    }

    /// [`RecentEntries::appended`] with `budget` bytes for the whole process.
    fn append_within(&mut self, index: u64, entry: Bytes, budget: usize) {
        self.truncate(index);
        if !self.entries.is_empty() && self.next() != index {
            self.clear();
        }
        let len = entry.len();
        if len > RECENT_ENTRY_BYTES || !reserve(len, budget) {
            // The run would have a hole: reads of it go to the log.
            self.clear();
            return;
        }
        if self.entries.is_empty() {
            self.first = index;
        }
        self.entries.push_back(entry);
        self.bytes += len;
        while self.bytes > RECENT_ENTRY_BYTES {
            self.pop_front();
        }
    }

    /// The entries `start ..= end`, if every one of them is here.
    #[must_use]
    pub fn get(&self, start: u64, end: u64) -> Option<Vec<Bytes>> {
        if self.entries.is_empty() || start < self.first || end >= self.next() || start > end {
            return None;
        }
        let from = usize::try_from(start - self.first).ok()?;
        let to = usize::try_from(end - self.first).ok()?;
        Some(self.entries.range(from..=to).cloned().collect())
    }

    /// The entries at `from` and after are gone.
    pub fn truncate(&mut self, from: u64) {
        while !self.entries.is_empty() && self.next() > from {
            let Some(e) = self.entries.pop_back() else {
                break;
            };
            self.release(e.len());
        }
    }

    /// The entries up to `upto` were applied (or purged): nothing reads them soon.
    pub fn applied(&mut self, upto: u64) {
        while !self.entries.is_empty() && self.first <= upto {
            self.pop_front();
        }
    }

    /// Forget every entry (a write that failed).
    pub fn clear(&mut self) {
        while !self.entries.is_empty() {
            self.pop_front();
        }
    }

    fn next(&self) -> u64 {
        self.first + self.entries.len() as u64
    }

    fn pop_front(&mut self) {
        if let Some(e) = self.entries.pop_front() {
            self.first += 1;
            self.release(e.len());
        }
    }

    fn release(&mut self, len: usize) {
        self.bytes -= len;
        CACHED.fetch_sub(len, Ordering::Relaxed);
    }
}

impl Drop for RecentEntries {
    fn drop(&mut self) {
        CACHED.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(i: u64) -> Bytes {
        Bytes::from(format!("entry {i}"))
    }

    #[test]
    fn a_contiguous_run_is_served_and_leaves_once_applied() {
        let mut r = RecentEntries::default();
        for i in 5..=9 {
            r.appended(i, entry(i));
        }
        assert_eq!(r.get(6, 8), Some(vec![entry(6), entry(7), entry(8)]));
        assert_eq!(r.get(4, 6), None, "index 4 was never here");
        assert_eq!(r.get(8, 10), None, "index 10 is not appended");
        r.applied(7);
        assert_eq!(r.get(7, 8), None);
        assert_eq!(r.get(8, 9), Some(vec![entry(8), entry(9)]));
        r.applied(9);
        assert_eq!(r.bytes, 0);
    }

    #[test]
    fn an_overwrite_or_truncation_drops_what_follows() {
        let mut r = RecentEntries::default();
        for i in 1..=5 {
            r.appended(i, entry(i));
        }
        r.appended(3, Bytes::from_static(b"new 3"));
        assert_eq!(r.get(3, 3), Some(vec![Bytes::from_static(b"new 3")]));
        assert_eq!(r.get(4, 4), None);
        r.truncate(2);
        assert_eq!(r.get(1, 1), Some(vec![entry(1)]));
        assert_eq!(r.get(2, 2), None);
        // A gap (the log went on without the cache) starts a new run.
        r.appended(7, entry(7));
        assert_eq!(r.get(1, 1), None);
        assert_eq!(r.get(7, 7), Some(vec![entry(7)]));
    }

    /// Past the process's budget an append is not cached, and the run it would have
    /// continued is emptied (a hole would break contiguity). Other tests share the counter:
    /// the budgets here are all or nothing.
    #[test]
    fn past_the_process_budget_nothing_is_cached() {
        let mut r = RecentEntries::default();
        r.append_within(1, entry(1), usize::MAX);
        r.append_within(2, entry(2), usize::MAX);
        assert!(r.get(1, 2).is_some());
        r.append_within(3, entry(3), 0);
        assert_eq!(r.get(3, 3), None);
        assert_eq!(r.get(1, 1), None, "the run is emptied");
        assert_eq!(r.bytes, 0);
        r.append_within(4, entry(4), usize::MAX);
        assert_eq!(r.get(4, 4), Some(vec![entry(4)]), "a new run starts");
    }

    #[test]
    fn a_group_keeps_at_most_its_bytes() {
        let mut r = RecentEntries::default();
        let big = Bytes::from(vec![0u8; RECENT_ENTRY_BYTES / 4 + 1]);
        for i in 1..=8 {
            r.appended(i, big.clone());
        }
        assert!(r.bytes <= RECENT_ENTRY_BYTES);
        assert_eq!(r.get(8, 8).map(|v| v.len()), Some(1));
        assert_eq!(r.get(1, 1), None);
        let huge = Bytes::from(vec![0u8; RECENT_ENTRY_BYTES + 1]);
        r.appended(9, huge);
        assert_eq!(r.get(8, 8), None, "a hole empties the run");
        assert_eq!(r.bytes, 0);
    }
}
