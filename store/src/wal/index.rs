//! What the WAL keeps in memory per group: where each live entry and body is, the group's
//! metadata and purge point. Entries are a run of locations from the first live index (12
//! bytes an entry); bodies a map by key.
//!
//! Every change is applied through [`GroupLog::apply`], live and when a segment is replayed
//! at start, so both build the same index. It reports which segments lost or gained a live
//! record, for the count that frees segments ([`Liveness`]).

use std::collections::{HashMap, VecDeque};

use crate::wal::record::{GroupState, Op};

/// Where a record is: segment sequence number, offset of the record's first byte, and the
/// record's length (header included). 12 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loc {
    /// The segment's sequence number.
    pub segment: u32,
    /// Offset of the record's first byte in the segment.
    pub offset: u32,
    /// The record's length, header included.
    pub len: u32,
}

impl Loc {
    /// Offset one past the record's last byte.
    #[must_use]
    pub fn end(&self) -> u64 {
        u64::from(self.offset) + u64::from(self.len)
    }
}

/// Counts of live records per segment, changed as records are indexed and released.
pub trait Liveness {
    /// A record in `segment` became live.
    fn hold(&mut self, segment: u32);
    /// A record in `segment` is no longer needed.
    fn release(&mut self, segment: u32);
}

/// Where a group takes appends, followed through the ops of one write before any is applied
/// ([`GroupLog::expect`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expect {
    first: u64,
    next: u64,
    empty: bool,
}

impl Expect {
    /// Take an append at `index`.
    ///
    /// # Errors
    /// [`OutOfOrder`] when the group has entries and `index` is not the next. Without
    /// entries any index starts the run (redb's log took them too, and openraft's storage
    /// suite appends below a purge point of an empty log).
    pub fn append(&mut self, index: u64) -> Result<(), OutOfOrder> {
        if !self.empty && index != self.next {
            return Err(OutOfOrder {
                index,
                expected: self.next,
            });
        }
        if self.empty {
            self.first = index;
        }
        self.next = index + 1;
        self.empty = false;
        Ok(())
    }

    /// Follow `op` (an append is checked).
    ///
    /// # Errors
    /// As [`Expect::append`].
    pub fn follow(&mut self, op: &Op) -> Result<(), OutOfOrder> {
        match op {
            Op::Append { index, .. } => self.append(*index)?,
            Op::Truncate { from } => {
                if *from <= self.first {
                    self.first = *from;
                    self.empty = true;
                }
                self.next = self.next.min(*from).max(self.first);
            }
            Op::Purge { upto } => {
                let after = upto.saturating_add(1);
                if after >= self.next {
                    self.empty = true;
                    self.next = after;
                }
                self.first = self.first.max(after);
            }
            Op::Forget => *self = Self::default(),
            _ => {}
        }
        Ok(())
    }
}

impl Default for Expect {
    fn default() -> Self {
        Self {
            first: 0,
            next: 0,
            empty: true,
        }
    }
}

/// Why an op cannot be applied to a group's index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfOrder {
    /// The index appended.
    pub index: u64,
    /// The index the group expected next.
    pub expected: u64,
}

/// One group's index.
#[derive(Debug, Default)]
pub struct GroupLog {
    /// Index of `entries[0]` (or of the next entry when there are none).
    first: u64,
    entries: VecDeque<Loc>,
    bodies: HashMap<u64, Loc>,
    state: GroupState,
}

impl GroupLog {
    /// A group with nothing written.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The index the next append must have.
    #[must_use]
    pub fn next_index(&self) -> u64 {
        self.first + self.entries.len() as u64
    }

    /// The first live entry's index, if any.
    #[must_use]
    pub fn first_index(&self) -> Option<u64> {
        (!self.entries.is_empty()).then_some(self.first)
    }

    /// The last live entry's index, if any.
    #[must_use]
    pub fn last_index(&self) -> Option<u64> {
        (!self.entries.is_empty()).then(|| self.next_index() - 1)
    }

    /// The metadata, purge point and next index.
    #[must_use]
    pub fn state(&self) -> GroupState {
        GroupState {
            next: self.next_index(),
            ..self.state.clone()
        }
    }

    /// A metadata slot's value.
    #[must_use]
    pub fn meta(&self, slot: crate::wal::record::MetaSlot) -> Option<bytes::Bytes> {
        self.state.meta[slot as usize].clone()
    }

    /// Where the entry at `index` is.
    #[must_use]
    pub fn entry(&self, index: u64) -> Option<Loc> {
        let at = index.checked_sub(self.first)?;
        self.entries.get(usize::try_from(at).ok()?).copied()
    }

    /// Where the body under `key` is.
    #[must_use]
    pub fn body(&self, key: u64) -> Option<Loc> {
        self.bodies.get(&key).copied()
    }

    /// Live bodies and where they are.
    pub fn bodies(&self) -> impl Iterator<Item = (u64, Loc)> + '_ {
        self.bodies.iter().map(|(k, l)| (*k, *l))
    }

    /// Whether a live entry or body of this group is in `segment`.
    #[must_use]
    pub fn pins(&self, segment: u32) -> bool {
        self.entries.iter().any(|l| l.segment == segment)
            || self.bodies.values().any(|l| l.segment == segment)
    }

    /// Where appends may go now: the next index, or anywhere while the group has no entries
    /// (openraft starts logs at 0 or 1, and installs snapshots past the end).
    #[must_use]
    pub fn expect(&self) -> Expect {
        Expect {
            first: self.first,
            next: self.next_index(),
            empty: self.entries.is_empty(),
        }
    }

    /// Apply `op`, whose record is at `loc`. A [`Op::Forget`] only releases; the caller drops
    /// the group.
    ///
    /// # Errors
    /// [`OutOfOrder`] for an append that is not the next index (nothing changes then).
    pub fn apply(&mut self, op: &Op, loc: Loc, live: &mut impl Liveness) -> Result<(), OutOfOrder> {
        match op {
            Op::Append { index, .. } => {
                self.expect().append(*index)?;
                if self.entries.is_empty() {
                    self.first = *index;
                }
                self.entries.push_back(loc);
                live.hold(loc.segment);
            }
            Op::Meta { slot, value } => self.state.meta[*slot as usize] = Some(value.clone()),
            Op::Truncate { from } => {
                if *from < self.first {
                    self.release_entries(live);
                    self.first = *from;
                }
                let keep = from.saturating_sub(self.first);
                let keep = usize::try_from(keep).unwrap_or(usize::MAX);
                while self.entries.len() > keep {
                    if let Some(gone) = self.entries.pop_back() {
                        live.release(gone.segment);
                    }
                }
            }
            Op::Purge { upto } => self.purge(*upto, live),
            Op::Body { key, .. } => {
                live.hold(loc.segment);
                if let Some(old) = self.bodies.insert(*key, loc) {
                    live.release(old.segment);
                }
            }
            Op::DropBodies { keys } => {
                for key in keys {
                    if let Some(old) = self.bodies.remove(key) {
                        live.release(old.segment);
                    }
                }
            }
            Op::Forget => self.release_all(live),
        }
        Ok(())
    }

    /// Take a whole state (a segment head's record): the purge point, the metadata and, for a
    /// group that has no entries so far in the replay, the next index.
    pub fn restore(&mut self, state: &GroupState, live: &mut impl Liveness) {
        if let Some(upto) = state.purged {
            self.purge(upto, live);
        }
        self.state.meta.clone_from(&state.meta);
        if self.entries.is_empty() {
            self.first = self.first.max(state.next);
        }
    }

    fn purge(&mut self, upto: u64, live: &mut impl Liveness) {
        while self.first <= upto {
            match self.entries.pop_front() {
                Some(gone) => live.release(gone.segment),
                None => break,
            }
            self.first += 1;
        }
        self.first = self.first.max(upto.saturating_add(1));
        self.state.purged = Some(self.state.purged.map_or(upto, |p| p.max(upto)));
    }

    fn release_entries(&mut self, live: &mut impl Liveness) {
        for gone in self.entries.drain(..) {
            live.release(gone.segment);
        }
    }

    /// Release every live record (the group is forgotten).
    pub fn release_all(&mut self, live: &mut impl Liveness) {
        self.release_entries(live);
        for (_, gone) in self.bodies.drain() {
            live.release(gone.segment);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::collections::BTreeMap;

    #[derive(Default)]
    struct Counts(BTreeMap<u32, i64>);

    impl Liveness for Counts {
        fn hold(&mut self, segment: u32) {
            *self.0.entry(segment).or_default() += 1;
        }
        fn release(&mut self, segment: u32) {
            *self.0.entry(segment).or_default() -= 1;
        }
    }

    fn at(segment: u32) -> Loc {
        Loc {
            segment,
            offset: 0,
            len: 40,
        }
    }

    fn append(index: u64) -> Op {
        Op::Append {
            index,
            data: Bytes::new(),
        }
    }

    #[test]
    fn appends_truncates_and_purges_keep_a_contiguous_run_and_count_segments() {
        let mut g = GroupLog::new();
        let mut live = Counts::default();
        for i in 1..=5 {
            g.apply(&append(i), at(u32::from(i > 3)), &mut live)
                .expect("in order");
        }
        assert_eq!(
            g.apply(&append(9), at(1), &mut live),
            Err(OutOfOrder {
                index: 9,
                expected: 6
            })
        );
        assert_eq!((g.first_index(), g.last_index()), (Some(1), Some(5)));
        g.apply(&Op::Truncate { from: 4 }, at(1), &mut live)
            .expect("truncate");
        assert_eq!(g.last_index(), Some(3));
        assert_eq!(
            live.0[&1], 0,
            "the truncated entries of segment 1 are released"
        );
        g.apply(&Op::Purge { upto: 2 }, at(1), &mut live)
            .expect("purge");
        assert_eq!((g.first_index(), g.next_index()), (Some(3), 4));
        // A purge past the last entry (a snapshot installed): the next append follows it.
        g.apply(&Op::Purge { upto: 10 }, at(1), &mut live)
            .expect("purge");
        assert_eq!((g.first_index(), g.next_index()), (None, 11));
        assert_eq!(live.0[&0], 0);
        assert_eq!(g.state().purged, Some(10));
    }

    /// The 12 bytes per live entry docs/storage-format.md states.
    #[test]
    fn a_location_is_twelve_bytes() {
        assert_eq!(std::mem::size_of::<Loc>(), 12);
    }

    #[test]
    fn bodies_replace_and_drop_and_a_forget_releases_all() {
        let mut g = GroupLog::new();
        let mut live = Counts::default();
        let body = |key| Op::Body {
            key,
            data: Bytes::new(),
        };
        g.apply(&body(1), at(0), &mut live).expect("body");
        g.apply(&body(1), at(2), &mut live).expect("moved body");
        g.apply(&body(2), at(2), &mut live).expect("body");
        assert_eq!((live.0[&0], live.0[&2]), (0, 2));
        assert_eq!(g.body(1), Some(at(2)));
        g.apply(&Op::DropBodies { keys: vec![2, 7] }, at(3), &mut live)
            .expect("drop");
        g.apply(&append(1), at(3), &mut live).expect("append");
        assert!(g.pins(3) && !g.pins(0));
        g.apply(&Op::Forget, at(3), &mut live).expect("forget");
        assert!(live.0.values().all(|n| *n == 0), "{:?}", live.0);
    }
}
