//! [`FreshQueue`]: a level's never-returned ready messages in id order, stored compactly.
//!
//! A long queue holds one of these records per message, so their size is the queue's RAM per
//! message (the 64-byte budget of docs/benchmarks.md). A `VecDeque<Ready<M>>` costs 48 bytes a
//! record for the broker's 24-byte message reference (16 bytes of id and enqueue time, 8 of
//! expiry and delivery count, padded) and up to twice that after it doubles. Here records live
//! in chunks of at most [`CHUNK`], each field in its own deque, times as `u32` offsets from the
//! chunk's first record. A chunk whose records have consecutive ids and share one relative
//! expiry and one delivery count (a queue's plain publishes) is *dense*: it keeps those once,
//! 4 + 24 = 28 bytes a record. Any other record turns its chunk *sparse*, which keeps them per
//! record as three more `u32`s: 40 bytes. No slack beyond one partly filled chunk at each end.
//!
//! Invariants:
//! - ids increase from the front to the back, across chunks too;
//! - no chunk is empty except the last, and none holds more than [`CHUNK`] records;
//! - in a chunk, `ats`, `msgs` and a sparse chunk's `rest` have the same length; a record's
//!   enqueue time is `base_at + ats[i]`, its id `base_id + taken + i` in a dense chunk and
//!   `base_id + rest[i][0]` in a sparse one;
//! - `len` is the sum of the chunks' lengths.
//!
//! A record whose id or time does not fit its chunk's `u32` offsets (4 billion ids or 49 days
//! past the chunk's first, or a clock that went back) starts a new chunk, so nothing is
//! rounded.

use std::collections::VecDeque;

use super::Ready;
use crate::queue::machine::MsgId;

/// Most records a chunk holds: 28 KiB of dense ones for the broker's message reference. Tests
/// use small chunks so that every machine test crosses chunk boundaries.
pub(in crate::queue::machine) const CHUNK: usize = if cfg!(test) { 16 } else { 1024 };

/// Ready messages in increasing id order (see the module's invariants).
#[derive(Debug, Clone)]
pub(in crate::queue::machine) struct FreshQueue<M> {
    chunks: VecDeque<Chunk<M>>,
    len: usize,
}

#[derive(Debug, Clone)]
struct Chunk<M> {
    base_id: MsgId,
    base_at: u64,
    /// Records taken from the front since `base_id` (a dense chunk numbers its records on).
    taken: u64,
    /// Per record: enqueued_at - `base_at`.
    ats: VecDeque<u32>,
    msgs: VecDeque<M>,
    shape: Shape,
}

#[derive(Debug, Clone)]
enum Shape {
    /// Consecutive ids from `base_id + taken`; every record has these two fields.
    Dense { expires_after: u32, returns: u32 },
    /// Per record: id - `base_id`, `expires_after`, `returns`.
    Sparse(VecDeque<[u32; 3]>),
}

impl<M> Chunk<M> {
    /// A chunk holding only `r`.
    fn new(r: Ready<M>) -> Self {
        let mut c = Self {
            base_id: r.id,
            base_at: r.enqueued_at,
            taken: 0,
            ats: VecDeque::new(),
            msgs: VecDeque::new(),
            shape: Shape::Sparse(VecDeque::new()),
        };
        c.start_over(r);
        c
    }

    /// Make an empty chunk hold only `r`, numbering from it (its deques kept).
    fn start_over(&mut self, r: Ready<M>) {
        debug_assert!(self.ats.is_empty(), "only an empty chunk starts over");
        self.base_id = r.id;
        self.base_at = r.enqueued_at;
        self.taken = 0;
        self.shape = Shape::Dense {
            expires_after: r.expires_after,
            returns: r.returns,
        };
        self.ats.push_back(0);
        self.msgs.push_back(r.msg);
    }

    fn len(&self) -> usize {
        self.ats.len()
    }

    /// Add `r` at the back if it fits: room left, and its offsets within `u32`.
    fn try_push(&mut self, r: Ready<M>) -> Result<(), Ready<M>> {
        if self.ats.is_empty() {
            // An emptied last chunk starts over from this record.
            self.start_over(r);
            return Ok(());
        }
        let offsets =
            r.id.checked_sub(self.base_id)
                .and_then(|d| u32::try_from(d).ok())
                .zip(
                    r.enqueued_at
                        .checked_sub(self.base_at)
                        .and_then(|d| u32::try_from(d).ok()),
                );
        let Some((id_offset, at_offset)) = offsets.filter(|_| self.len() < CHUNK) else {
            return Err(r);
        };
        let next_dense = self.base_id + self.taken + self.len() as u64;
        match &mut self.shape {
            Shape::Dense {
                expires_after,
                returns,
            } if r.id == next_dense
                && r.expires_after == *expires_after
                && r.returns == *returns => {}
            Shape::Dense { .. } => {
                let rest = (0..self.len()).map(|i| self.rest(i)).collect();
                self.shape = Shape::Sparse(rest);
                return self.try_push(r);
            }
            Shape::Sparse(rest) => rest.push_back([id_offset, r.expires_after, r.returns]),
        }
        self.ats.push_back(at_offset);
        self.msgs.push_back(r.msg);
        Ok(())
    }

    /// Record `i`'s id offset, expiry and delivery count.
    fn rest(&self, i: usize) -> [u32; 3] {
        match &self.shape {
            Shape::Dense {
                expires_after,
                returns,
            } => {
                // Within u32: every push checked its id offset.
                let offset = u32::try_from(self.taken + i as u64).unwrap_or(u32::MAX);
                [offset, *expires_after, *returns]
            }
            Shape::Sparse(rest) => rest[i],
        }
    }

    fn record<T>(&self, i: usize, msg: T) -> Ready<T> {
        let [id, expires_after, returns] = self.rest(i);
        Ready {
            id: self.base_id + u64::from(id),
            enqueued_at: self.base_at + u64::from(self.ats[i]),
            msg,
            expires_after,
            returns,
        }
    }

    fn pop_front(&mut self) -> Option<Ready<M>> {
        let msg = self.msgs.pop_front()?;
        let r = self.record(0, msg);
        self.ats.pop_front();
        match &mut self.shape {
            Shape::Dense { .. } => self.taken += 1,
            Shape::Sparse(rest) => {
                rest.pop_front();
            }
        }
        Some(r)
    }

    /// Take record `i` (within the chunk's length). Taking any but the first turns a dense
    /// chunk sparse: its ids are no longer consecutive.
    fn remove_at(&mut self, i: usize) -> Option<Ready<M>> {
        if i == 0 {
            return self.pop_front();
        }
        if let Shape::Dense { .. } = self.shape {
            let rest = (0..self.len()).map(|j| self.rest(j)).collect();
            self.shape = Shape::Sparse(rest);
        }
        let msg = self.msgs.remove(i)?;
        // `rest` and `ats` still hold record i: only its message is out.
        let r = self.record(i, msg);
        self.ats.remove(i);
        if let Shape::Sparse(rest) = &mut self.shape {
            rest.remove(i);
        }
        Some(r)
    }

    fn id_at(&self, i: usize) -> Option<MsgId> {
        (i < self.len()).then(|| self.base_id + u64::from(self.rest(i)[0]))
    }

    /// The position of the record with `id`, if held.
    fn position(&self, id: MsgId) -> Option<usize> {
        let offset = id.checked_sub(self.base_id)?;
        match &self.shape {
            Shape::Dense { .. } => {
                let i = usize::try_from(offset.checked_sub(self.taken)?).ok()?;
                (i < self.len()).then_some(i)
            }
            Shape::Sparse(rest) => {
                let offset = u32::try_from(offset).ok()?;
                rest.binary_search_by_key(&offset, |m| m[0]).ok()
            }
        }
    }
}

impl<M> Default for FreshQueue<M> {
    fn default() -> Self {
        Self {
            chunks: VecDeque::new(),
            len: 0,
        }
    }
}

impl<M> FreshQueue<M> {
    /// Records held.
    pub(in crate::queue::machine) fn len(&self) -> usize {
        self.len
    }

    /// Add `r` at the back. Its id must be above every id held (the caller's invariant).
    pub(in crate::queue::machine) fn push_back(&mut self, r: Ready<M>) {
        debug_assert!(
            self.last_id().is_none_or(|last| last < r.id),
            "fresh ids increase"
        );
        let r = match self.chunks.back_mut() {
            Some(c) => c.try_push(r).err(),
            None => Some(r),
        };
        if let Some(r) = r {
            self.chunks.push_back(Chunk::new(r));
        }
        self.len += 1;
    }

    /// Take the record at the front.
    pub(in crate::queue::machine) fn pop_front(&mut self) -> Option<Ready<M>> {
        let c = self.chunks.front_mut()?;
        let r = c.pop_front()?;
        if c.len() == 0 && self.chunks.len() > 1 {
            self.chunks.pop_front();
        }
        self.len -= 1;
        Some(r)
    }

    /// The record at the front, its message borrowed.
    pub(in crate::queue::machine) fn front(&self) -> Option<Ready<&M>> {
        let c = self.chunks.front()?;
        Some(c.record(0, c.msgs.front()?))
    }

    /// The largest id held.
    pub(in crate::queue::machine) fn last_id(&self) -> Option<MsgId> {
        let c = self.chunks.back()?;
        c.id_at(c.len().checked_sub(1)?)
    }

    /// Every record front to back, messages borrowed.
    pub(in crate::queue::machine) fn iter(&self) -> impl Iterator<Item = Ready<&M>> + '_ {
        self.chunks
            .iter()
            .flat_map(|c| c.msgs.iter().enumerate().map(move |(i, m)| c.record(i, m)))
    }

    /// The record with `id`, its message borrowed, if held.
    pub(in crate::queue::machine) fn get(&self, id: MsgId) -> Option<Ready<&M>> {
        let after = self
            .chunks
            .partition_point(|c| c.id_at(0).is_none_or(|first| first <= id));
        let c = self.chunks.get(after.checked_sub(1)?)?;
        let i = c.position(id)?;
        Some(c.record(i, c.msgs.get(i)?))
    }

    /// Take the record with `id` from wherever it is, if held: O(log chunks + CHUNK).
    pub(in crate::queue::machine) fn remove(&mut self, id: MsgId) -> Option<Ready<M>> {
        let after = self
            .chunks
            .partition_point(|c| c.id_at(0).is_none_or(|first| first <= id));
        let at = after.checked_sub(1)?;
        let c = self.chunks.get_mut(at)?;
        let i = c.position(id)?;
        let r = c.remove_at(i)?;
        if c.len() == 0 && self.chunks.len() > 1 {
            self.chunks.remove(at);
        }
        self.len -= 1;
        Some(r)
    }

    /// The message of the record with `id`, if held.
    pub(in crate::queue::machine) fn get_mut(&mut self, id: MsgId) -> Option<&mut M> {
        // The chunk holding id is the last whose first id is at most id.
        let after = self
            .chunks
            .partition_point(|c| c.id_at(0).is_none_or(|first| first <= id));
        let c = self.chunks.get_mut(after.checked_sub(1)?)?;
        let i = c.position(id)?;
        c.msgs.get_mut(i)
    }

    /// Every record front to back, taken.
    pub(in crate::queue::machine) fn into_records(mut self) -> impl Iterator<Item = Ready<M>> {
        std::iter::from_fn(move || self.pop_front())
    }
}

impl<M: serde::Serialize> serde::Serialize for FreshQueue<M> {
    /// As the sequence of records a `VecDeque<Ready<M>>` was (snapshots keep their layout).
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        // With its length up front: the snapshot codec (bincode) needs it.
        let mut seq = s.serialize_seq(Some(self.len))?;
        for r in self.iter() {
            seq.serialize_element(&r)?;
        }
        seq.end()
    }
}

impl<'de, M: serde::Deserialize<'de>> serde::Deserialize<'de> for FreshQueue<M> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Records<M>(std::marker::PhantomData<M>);
        impl<'de, M: serde::Deserialize<'de>> serde::de::Visitor<'de> for Records<M> {
            type Value = FreshQueue<M>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("ready records in increasing id order")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut q = FreshQueue::default();
                while let Some(r) = seq.next_element::<Ready<M>>()? {
                    if q.last_id().is_some_and(|last| last >= r.id) {
                        return Err(serde::de::Error::custom("ready records out of id order"));
                    }
                    q.push_back(r);
                }
                Ok(q)
            }
        }
        d.deserialize_seq(Records(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    type Rec = Ready<u32>;

    fn fields(r: &Ready<impl Copy + Into<u64>>) -> (u64, u64, u64, Option<u64>, bool, u32) {
        (
            r.id,
            r.enqueued_at,
            r.msg.into(),
            r.expires_at(),
            r.redelivered(),
            r.delivery_count(),
        )
    }

    fn fields_ref(r: &Ready<&u32>) -> (u64, u64, u64, Option<u64>, bool, u32) {
        (
            r.id,
            r.enqueued_at,
            u64::from(*r.msg),
            r.expires_at(),
            r.redelivered(),
            r.delivery_count(),
        )
    }

    fn lengths_agree<M>(c: &Chunk<M>) -> bool {
        let rest = match &c.shape {
            Shape::Sparse(r) => r.len(),
            Shape::Dense { .. } => c.len(),
        };
        c.len() <= CHUNK && c.msgs.len() == c.len() && rest == c.len()
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Push with this id step and time step (time may go back).
        Push {
            id_step: u64,
            at_step: i64,
            ttl: Option<u32>,
            returns: u32,
        },
        Pop,
        /// Take the record at this index (mod length) from the middle.
        Remove(usize),
        Set(usize, u32),
        RoundTrip,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (
                // Mostly what keeps a chunk dense (consecutive ids, one TTL, never returned),
                // then what turns it sparse or starts a new one.
                prop_oneof![
                    20 => Just(1u64),
                    2 => 2u64..4,
                    1 => Just(u64::from(u32::MAX)),
                    1 => 1u64..1 << 40,
                ],
                prop_oneof![20 => 0i64..5, 1 => Just(i64::from(u32::MAX) + 1), 1 => -1000i64..0],
                prop_oneof![
                    10 => Just(None),
                    5 => Just(Some(500u32)),
                    1 => proptest::option::of(0u32..10_000),
                ],
                prop_oneof![20 => Just(0u32), 1 => 0u32..4],
            )
                .prop_map(|(id_step, at_step, ttl, returns)| Op::Push { id_step, at_step, ttl, returns }),
            3 => Just(Op::Pop),
            2 => any::<usize>().prop_map(Op::Remove),
            1 => (any::<usize>(), any::<u32>()).prop_map(|(i, v)| Op::Set(i, v)),
            1 => Just(Op::RoundTrip),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// The chunked queue behaves as a `VecDeque` of records, through chunk boundaries,
        /// offsets that do not fit, clocks going back, in-place changes and a serde round
        /// trip; it never holds more than `CHUNK` records beyond its length.
        #[test]
        fn behaves_as_a_deque(ops in proptest::collection::vec(op(), 1..600)) {
            let mut q = FreshQueue::<u32>::default();
            let mut model: VecDeque<Rec> = VecDeque::new();
            let (mut id, mut at) = (0u64, 1_000_000_000u64);
            for (n, o) in ops.into_iter().enumerate() {
                match o {
                    Op::Push { id_step, at_step, ttl, returns } => {
                        id += id_step;
                        at = at.saturating_add_signed(at_step);
                        let exp = ttl.map(|t| at + u64::from(t));
                        let r = Rec::new(id, n as u32, returns % 2 == 1, exp, returns, at);
                        model.push_back(r.clone());
                        q.push_back(r);
                    }
                    Op::Pop => {
                        let got = q.pop_front();
                        let want = model.pop_front();
                        prop_assert_eq!(got.as_ref().map(fields), want.as_ref().map(fields));
                    }
                    Op::Remove(i) => {
                        if model.is_empty() {
                            prop_assert!(q.remove(id + 1).is_none());
                        } else {
                            let i = i % model.len();
                            let want = model.remove(i);
                            let got = q.remove(want.as_ref().map_or(0, |r| r.id));
                            prop_assert_eq!(got.as_ref().map(fields), want.as_ref().map(fields));
                        }
                    }
                    Op::Set(i, v) => {
                        if !model.is_empty() {
                            let i = i % model.len();
                            model[i].msg = v;
                            *q.get_mut(model[i].id).expect("held id") = v;
                        }
                        prop_assert!(q.get_mut(id + 1).is_none());
                    }
                    Op::RoundTrip => {
                        let bytes = serde_json::to_vec(&q).expect("encodes");
                        let want = serde_json::to_vec(&model).expect("encodes");
                        prop_assert_eq!(&bytes, &want, "same layout as a VecDeque");
                        // The snapshot codec wants sequence lengths up front.
                        let packed = bincode::serialize(&q).expect("bincode encodes");
                        prop_assert_eq!(&packed, &bincode::serialize(&model).expect("encodes"));
                        let back: FreshQueue<u32> = bincode::deserialize(&packed).expect("decodes");
                        prop_assert_eq!(back.len(), q.len());
                        q = serde_json::from_slice(&bytes).expect("decodes");
                    }
                }
                prop_assert_eq!(q.len(), model.len());
                prop_assert_eq!(q.front().as_ref().map(fields_ref), model.front().map(fields));
                prop_assert_eq!(q.last_id(), model.back().map(|r| r.id));
                let held: usize = q.chunks.iter().map(Chunk::len).sum();
                prop_assert_eq!(held, q.len());
                prop_assert!(q.chunks.iter().all(lengths_agree));
                prop_assert!(q.chunks.iter().rev().skip(1).all(|c| c.len() > 0));
            }
            let all: Vec<_> = q.iter().map(|r| fields_ref(&r)).collect();
            let want: Vec<_> = model.iter().map(fields).collect();
            prop_assert_eq!(all, want);
            let taken: Vec<_> = q.into_records().map(|r| fields(&r)).collect();
            prop_assert_eq!(taken, model.iter().map(fields).collect::<Vec<_>>());
        }
    }

    /// Out-of-order records in a snapshot are refused, not held.
    #[test]
    fn decoding_refuses_records_out_of_order() {
        let model: VecDeque<Rec> = [5, 3]
            .into_iter()
            .map(|id| Rec::new(id, 0, false, None, 0, 0))
            .collect();
        let bytes = serde_json::to_vec(&model).expect("encodes");
        assert!(serde_json::from_slice::<FreshQueue<u32>>(&bytes).is_err());
    }

    /// Plain publishes fill dense chunks: 28 bytes a record for a 24-byte message reference
    /// (plus the chunk headers); one odd record turns only its own chunk sparse (40 bytes).
    #[test]
    fn plain_publishes_cost_28_bytes_a_record() {
        let dense = std::mem::size_of::<u32>() + std::mem::size_of::<[u64; 3]>();
        assert_eq!(dense, 28);
        assert_eq!(dense + std::mem::size_of::<[u32; 3]>(), 40);
        let mut q = FreshQueue::<[u64; 3]>::default();
        for id in 0..(3 * CHUNK as u64) {
            let redelivered = id == CHUNK as u64 + 3;
            q.push_back(Ready::new(id, [0; 3], redelivered, None, 0, 7 + id));
        }
        assert_eq!(q.chunks.len(), 3);
        assert!(
            q.chunks
                .iter()
                .all(|c| c.ats.capacity() == CHUNK && c.msgs.capacity() == CHUNK)
        );
        let sparse: Vec<bool> = q
            .chunks
            .iter()
            .map(|c| matches!(c.shape, Shape::Sparse(_)))
            .collect();
        assert_eq!(sparse, [false, true, false]);
        assert!(q.front().is_some_and(|r| r.id == 0 && r.enqueued_at == 7));
    }
}
