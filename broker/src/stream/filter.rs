//! Stream filtering: each chunk carries a small Bloom filter of its messages' filter values
//! (`x-stream-filter-value` on publish) and whether it holds messages without one, so a
//! consumer with `x-stream-filter` skips chunks that cannot match without reading them.
//!
//! A Bloom filter can say "maybe" for a value that is not there, never "no" for one that is:
//! skipping is always safe, and the reader checks each message of a chunk it does read.

/// Smallest and largest filter, in bytes (`x-stream-filter-size-bytes`, as RabbitMQ).
pub const FILTER_BYTES_MIN: usize = 16;
/// See [`FILTER_BYTES_MIN`].
pub const FILTER_BYTES_MAX: usize = 255;
/// Bits set per value.
const HASHES: u64 = 2;

/// What one chunk's filter values may be.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChunkFilter {
    bits: Vec<u8>,
    /// Some message of the chunk has no filter value.
    unfiltered: bool,
}

impl ChunkFilter {
    /// An empty filter of `bytes` bytes (clamped to the allowed range).
    #[must_use]
    pub fn new(bytes: usize) -> Self {
        Self {
            bits: vec![0; bytes.clamp(FILTER_BYTES_MIN, FILTER_BYTES_MAX)],
            unfiltered: false,
        }
    }

    /// Record one message's filter value (None: it has none).
    pub fn add(&mut self, value: Option<&str>) {
        let Some(value) = value else {
            self.unfiltered = true;
            return;
        };
        for bit in self.positions(value) {
            self.bits[bit / 8] |= 1 << (bit % 8);
        }
    }

    /// Whether the chunk may hold a message for a consumer that wants any of `wanted` (and,
    /// with `match_unfiltered`, messages without a value). An empty `wanted` matches all.
    #[must_use]
    pub fn may_match(&self, wanted: &[String], match_unfiltered: bool) -> bool {
        wanted.is_empty()
            || (match_unfiltered && self.unfiltered)
            || wanted.iter().any(|w| self.may_contain(w))
    }

    /// The filter as the stream's segment files store it: its bits, then 1 if some message
    /// had no value.
    #[must_use]
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = self.bits.clone();
        out.push(u8::from(self.unfiltered));
        out
    }

    /// A filter [`ChunkFilter::to_bytes`] wrote (None: not one).
    #[must_use]
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let (flag, bits) = bytes.split_last()?;
        if !(FILTER_BYTES_MIN..=FILTER_BYTES_MAX).contains(&bits.len()) || *flag > 1 {
            return None;
        }
        Some(Self {
            bits: bits.to_vec(),
            unfiltered: *flag == 1,
        })
    }

    fn may_contain(&self, value: &str) -> bool {
        self.positions(value)
            .all(|bit| self.bits[bit / 8] & (1 << (bit % 8)) != 0)
    }

    fn positions(&self, value: &str) -> impl Iterator<Item = usize> + use<> {
        let h = fnv1a(value.as_bytes());
        let (a, b) = (h & 0xffff_ffff, (h >> 32) | 1);
        let m = (self.bits.len() * 8) as u64;
        (0..HASHES)
            .map(move |i| usize::try_from(a.wrapping_add(i.wrapping_mul(b)) % m).unwrap_or(0))
    }
}

/// Whether one message matches a consumer's filter exactly (what the reader applies to the
/// messages of a chunk its filter let through).
#[must_use]
pub fn message_matches(value: Option<&str>, wanted: &[String], match_unfiltered: bool) -> bool {
    match value {
        _ if wanted.is_empty() => true,
        None => match_unfiltered,
        Some(v) => wanted.iter().any(|w| w == v),
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_chunk_without_the_value_is_usually_skipped() {
        let mut f = ChunkFilter::new(16);
        f.add(Some("california"));
        f.add(Some("texas"));
        assert!(f.may_match(&["texas".into()], false));
        assert!(!f.may_match(&["ohio".into()], false));
        assert!(f.may_match(&[], false));
        // Unfiltered messages match only when asked for.
        assert!(!f.may_match(&["ohio".into()], true));
        f.add(None);
        assert!(f.may_match(&["ohio".into()], true));
        assert!(message_matches(None, &["ohio".into()], true));
        assert!(!message_matches(None, &["ohio".into()], false));
        assert!(!message_matches(Some("texas"), &["ohio".into()], true));
        assert_eq!(ChunkFilter::from_bytes(&f.to_bytes()), Some(f));
        assert_eq!(ChunkFilter::from_bytes(&[0u8; 4]), None);
    }

    proptest! {
        /// Never a false "no": a chunk holding a wanted value always may match.
        #[test]
        fn no_false_negatives(values in proptest::collection::vec("[a-z]{1,8}", 1..40),
                              pick in any::<proptest::sample::Index>(),
                              bytes in 16usize..64) {
            let mut f = ChunkFilter::new(bytes);
            for v in &values {
                f.add(Some(v));
            }
            let wanted = values[pick.index(values.len())].clone();
            prop_assert!(f.may_match(&[wanted], false));
        }
    }
}
