//! Hash routing: the `x-consistent-hash` exchange (RabbitMQ's plugin), the `x-modulus-hash`
//! exchange (RabbitMQ 4.3) and the key hash partitioned queues route by.
//!
//! Every node of a cluster and every restart must send a key to the same destination, so the
//! hash is Warren's own, fixed function ([`key_hash`]: FNV-1a with a murmur3 finaliser), never
//! a seeded or platform hash, and the destinations are taken in one canonical order
//! ([`natural_cmp`]) rather than in the order bindings happened to arrive.
//!
//! RabbitMQ's plugin gives each binding `weight` buckets appended at the end of a ring in binding
//! order (re-sorted at a restart) and picks a bucket with a jump consistent hash of the key.
//! Warren keeps the buckets and the jump hash, with the ring in natural order of the
//! destinations' names: `q-0 .. q-11` are in the order they are usually bound, a destination
//! added at the end of that order takes keys only from the others (none move between the old
//! ones), and the same ring comes back after a restart and on every node.

use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};

use amq_protocol::types::{AMQPValue, FieldTable};
use warren_amqp::{AmqpError, ReplyCode};

use super::{Binding, Destination, RoutingHeaders};

/// A key's 64-bit hash: FNV-1a over the bytes, then murmur3's 64-bit finaliser so that short
/// keys differing in one byte spread over all 64 bits (the jump hash reads the high bits).
#[must_use]
pub fn key_hash(key: &[u8]) -> u64 {
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = FNV_OFFSET;
    for b in key {
        h ^= u64::from(*b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// Lamping and Veach's jump consistent hash: a bucket in `0..buckets` (0 when `buckets` is 0).
/// Growing `buckets` by one moves only the keys that land in the new bucket.
#[must_use]
pub fn jump(mut key: u64, buckets: u32) -> u32 {
    let (mut b, mut j) = (-1i64, 0i64);
    while j < i64::from(buckets) {
        b = j;
        key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        // (b + 1) * 2^31 / ((key >> 33) + 1): the next bucket this key would jump to.
        #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
        {
            j = ((b + 1) as f64 * ((1u64 << 31) as f64 / ((key >> 33) + 1) as f64)) as i64;
        }
    }
    u32::try_from(b.max(0)).unwrap_or(0)
}

/// Names compared with runs of digits as numbers (`q-2` < `q-10`), then bytewise, so that
/// partitions numbered from 0 sort in their numeric order.
#[must_use]
pub fn natural_cmp(a: &str, b: &str) -> Ordering {
    let (mut x, mut y) = (a.as_bytes(), b.as_bytes());
    loop {
        match (x.first(), y.first()) {
            (None, None) => return a.cmp(b),
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(c), Some(d)) if c.is_ascii_digit() && d.is_ascii_digit() => {
                let xn = x.iter().take_while(|c| c.is_ascii_digit()).count();
                let yn = y.iter().take_while(|c| c.is_ascii_digit()).count();
                let (xd, yd) = (trim_zeros(&x[..xn]), trim_zeros(&y[..yn]));
                let ord = xd.len().cmp(&yd.len()).then_with(|| xd.cmp(yd));
                if ord != Ordering::Equal {
                    return ord;
                }
                x = &x[xn..];
                y = &y[yn..];
            }
            (Some(c), Some(d)) => {
                if c != d {
                    return c.cmp(d);
                }
                x = &x[1..];
                y = &y[1..];
            }
        }
    }
}

fn trim_zeros(digits: &[u8]) -> &[u8] {
    let zeros = digits.iter().take_while(|c| **c == b'0').count();
    &digits[zeros..]
}

fn destination_cmp(a: &Destination, b: &Destination) -> Ordering {
    match (a, b) {
        (Destination::Queue(x), Destination::Queue(y))
        | (Destination::Exchange(x), Destination::Exchange(y)) => natural_cmp(x, y),
        (Destination::Queue(_), Destination::Exchange(_)) => Ordering::Less,
        (Destination::Exchange(_), Destination::Queue(_)) => Ordering::Greater,
    }
}

/// A message property an `x-consistent-hash` exchange may hash (`hash-property`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashProperty {
    /// `correlation_id`.
    CorrelationId,
    /// `message_id`.
    MessageId,
    /// `timestamp` (seconds, hashed as its decimal text).
    Timestamp,
}

/// What part of a message a hash exchange hashes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum HashSource {
    /// The routing key (the default).
    #[default]
    RoutingKey,
    /// A header's value (`hash-header`).
    Header(String),
    /// A property (`hash-property`).
    Property(HashProperty),
}

impl HashSource {
    /// The source an `x-consistent-hash` exchange's arguments name, checked as the plugin
    /// checks them at declare: `hash-header` and `hash-property` together, or an unknown
    /// property, are 406.
    pub fn from_arguments(args: &FieldTable) -> Result<Self, AmqpError> {
        let text = |key: &str| match args.inner().get(key) {
            Some(AMQPValue::LongString(s)) => {
                Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
            }
            _ => None,
        };
        let refuse = |text: String| AmqpError::channel(ReplyCode::PreconditionFailed, text);
        match (text("hash-header"), text("hash-property")) {
            (None, None) => Ok(Self::RoutingKey),
            (Some(h), None) => Ok(Self::Header(h)),
            (None, Some(p)) => match p.as_str() {
                "correlation_id" => Ok(Self::Property(HashProperty::CorrelationId)),
                "message_id" => Ok(Self::Property(HashProperty::MessageId)),
                "timestamp" => Ok(Self::Property(HashProperty::Timestamp)),
                _ => Err(refuse(format!("Unsupported property: {p}"))),
            },
            (Some(_), Some(_)) => Err(refuse(
                "hash-header and hash-property are mutually exclusive".into(),
            )),
        }
    }

    /// The hash of this source's value in a message. A missing header or property hashes as
    /// an empty value, so such messages all go to one destination rather than nowhere.
    #[must_use]
    pub fn hash(&self, routing_key: &str, headers: &RoutingHeaders<'_>) -> u64 {
        match self {
            Self::RoutingKey => key_hash(routing_key.as_bytes()),
            Self::Header(name) => match headers.get().and_then(|t| t.inner().get(name.as_str())) {
                Some(v) => value_hash(v),
                None => key_hash(b""),
            },
            Self::Property(p) => {
                let props = headers.properties();
                match p {
                    HashProperty::CorrelationId => key_hash(props.correlation_id().unwrap_or(b"")),
                    HashProperty::MessageId => key_hash(props.message_id().unwrap_or(b"")),
                    HashProperty::Timestamp => match props.timestamp() {
                        Some(t) => key_hash(t.to_string().as_bytes()),
                        None => key_hash(b""),
                    },
                }
            }
        }
    }
}

/// The hash of a header value: strings by their bytes, anything else by its plain rendering
/// (so the integer 7 and the string "7" go to the same destination).
#[must_use]
pub fn value_hash(v: &AMQPValue) -> u64 {
    match v {
        AMQPValue::LongString(s) => key_hash(s.as_bytes()),
        AMQPValue::ShortString(s) => key_hash(s.as_str().as_bytes()),
        other => key_hash(crate::args::render_plain(other).as_bytes()),
    }
}

/// Why a binding to an `x-consistent-hash` exchange was refused (RabbitMQ's `binding_invalid`,
/// sent as 406).
pub fn check_weight(routing_key: &str) -> Result<u32, AmqpError> {
    let refuse = |text: String| AmqpError::channel(ReplyCode::PreconditionFailed, text);
    match routing_key.trim().parse::<i64>() {
        Ok(w) if w < 1 => Err(refuse("The binding key must be greater than 0".into())),
        Ok(w) => u32::try_from(w)
            .ok()
            .filter(|w| *w <= WEIGHT_MAX)
            .ok_or_else(|| {
                refuse(format!(
                    "The binding key must be at most {WEIGHT_MAX}: <<\"{routing_key}\">>"
                ))
            }),
        Err(_) => Err(refuse(format!(
            "The binding key must be an integer: <<\"{routing_key}\">>"
        ))),
    }
}

/// The largest weight one binding may have: a ring holds at most this many buckets per
/// destination, which bounds the lookup table (RabbitMQ keeps one map entry per bucket and has
/// no bound).
pub const WEIGHT_MAX: u32 = 1_000_000;

/// The buckets of an `x-consistent-hash` exchange: each destination owns a contiguous run of
/// `weight` buckets, destinations in natural order. Built from the bindings after each change.
#[derive(Debug, Clone, Default)]
pub struct Ring {
    /// (index of the binding whose destination owns the run, first bucket past the run).
    runs: Vec<(usize, u32)>,
}

impl Ring {
    /// The ring of `bindings`: one run per destination, of the weight of its binding with the
    /// smallest weight if it has several (RabbitMQ counts only one binding per destination).
    /// Bindings whose key is not a valid weight (refused at bind, so only from an older store)
    /// get no buckets.
    #[must_use]
    pub fn build(bindings: &[Binding]) -> Self {
        // Linear in the bindings: a ring is rebuilt on every bind and unbind.
        let mut owners: Vec<(usize, u32)> = Vec::new();
        let mut at: HashMap<&Destination, usize> = HashMap::with_capacity(bindings.len());
        for (i, b) in bindings.iter().enumerate() {
            let Ok(weight) = check_weight(&b.routing_key) else {
                continue;
            };
            match at.get(&b.destination) {
                Some(&k) if weight < owners[k].1 => owners[k] = (i, weight),
                Some(_) => {}
                None => {
                    at.insert(&b.destination, owners.len());
                    owners.push((i, weight));
                }
            }
        }
        owners.sort_by(|(a, _), (b, _)| {
            destination_cmp(&bindings[*a].destination, &bindings[*b].destination)
        });
        let mut end = 0u32;
        let runs = owners
            .into_iter()
            .map(|(i, w)| {
                end = end.saturating_add(w);
                (i, end)
            })
            .collect();
        Self { runs }
    }

    /// The number of buckets.
    #[must_use]
    pub fn buckets(&self) -> u32 {
        self.runs.last().map_or(0, |r| r.1)
    }

    /// The index of the binding whose destination owns the bucket `hash` jumps to.
    #[must_use]
    pub fn pick(&self, hash: u64) -> Option<usize> {
        let total = self.buckets();
        if total == 0 {
            return None;
        }
        let bucket = jump(hash, total);
        let at = self.runs.partition_point(|(_, end)| *end <= bucket);
        self.runs.get(at).map(|(i, _)| *i)
    }
}

/// The destinations of an `x-modulus-hash` exchange: every bound destination once, in natural
/// order (RabbitMQ 4.3 sorts them so a key keeps its destination across restarts).
#[must_use]
pub fn modulus_order(bindings: &[Binding]) -> Vec<usize> {
    let mut order: Vec<usize> = Vec::with_capacity(bindings.len());
    let mut seen: HashSet<&Destination> = HashSet::with_capacity(bindings.len());
    for (i, b) in bindings.iter().enumerate() {
        if seen.insert(&b.destination) {
            order.push(i);
        }
    }
    order.sort_by(|a, b| destination_cmp(&bindings[*a].destination, &bindings[*b].destination));
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binding(queue: &str, key: &str) -> Binding {
        Binding {
            destination: Destination::Queue(queue.into()),
            routing_key: key.into(),
            arguments: FieldTable::default(),
        }
    }

    /// The key of the `i`th of a million distinct test keys (a fixed sequence: the test is
    /// reproducible).
    fn test_key(i: u32) -> String {
        format!("key-{:08x}", i.wrapping_mul(2_654_435_761))
    }

    fn shares(ring: &Ring, bindings: &[Binding], keys: u32) -> Vec<u32> {
        let mut counts = vec![0u32; bindings.len()];
        for i in 0..keys {
            let b = ring
                .pick(key_hash(test_key(i).as_bytes()))
                .expect("a bucket");
            counts[b] += 1;
        }
        counts
    }

    #[test]
    fn equal_weights_share_a_million_keys_within_ten_percent() {
        for n in [2usize, 3, 6, 12] {
            let bindings: Vec<Binding> = (0..n).map(|i| binding(&format!("q-{i}"), "1")).collect();
            let ring = Ring::build(&bindings);
            let counts = shares(&ring, &bindings, 1_000_000);
            let share = 1_000_000.0 / n as f64;
            for (i, c) in counts.iter().enumerate() {
                assert!(
                    f64::from(*c) <= 1.1 * share,
                    "{n} partitions: q-{i} got {c}, share {share}"
                );
            }
        }
    }

    #[test]
    fn weights_scale_shares() {
        let bindings = vec![binding("a", "1"), binding("b", "3")];
        let counts = shares(&Ring::build(&bindings), &bindings, 400_000);
        let ratio = f64::from(counts[1]) / f64::from(counts[0]);
        assert!((2.8..3.2).contains(&ratio), "{counts:?}");
    }

    #[test]
    fn adding_a_destination_moves_keys_only_to_it_and_removing_it_moves_them_back() {
        let mut bindings: Vec<Binding> = (0..4).map(|i| binding(&format!("q-{i}"), "1")).collect();
        let before = Ring::build(&bindings);
        bindings.push(binding("q-4", "1"));
        let after = Ring::build(&bindings);
        let mut moved = 0;
        for i in 0..100_000 {
            let h = key_hash(test_key(i).as_bytes());
            let (x, y) = (before.pick(h).unwrap(), after.pick(h).unwrap());
            if x != y {
                assert_eq!(y, 4, "a key moved between old destinations");
                moved += 1;
            }
        }
        assert!((15_000..25_000).contains(&moved), "moved {moved}");
        bindings.pop();
        let again = Ring::build(&bindings);
        for i in 0..1000 {
            let h = key_hash(test_key(i).as_bytes());
            assert_eq!(before.pick(h), again.pick(h));
        }
    }

    #[test]
    fn ring_order_does_not_depend_on_binding_order() {
        let forward: Vec<Binding> = (0..12).map(|i| binding(&format!("q-{i}"), "2")).collect();
        let mut backward = forward.clone();
        backward.reverse();
        let (f, b) = (Ring::build(&forward), Ring::build(&backward));
        for i in 0..10_000 {
            let h = key_hash(test_key(i).as_bytes());
            let (x, y) = (f.pick(h).unwrap(), b.pick(h).unwrap());
            assert_eq!(forward[x].destination, backward[y].destination);
        }
    }

    #[test]
    fn a_destination_counts_once() {
        let bindings = vec![binding("a", "5"), binding("a", "2"), binding("b", "2")];
        let ring = Ring::build(&bindings);
        assert_eq!(ring.buckets(), 4, "a's smaller weight, then b's");
    }

    #[test]
    fn weights_are_checked_as_the_plugin_checks_them() {
        assert_eq!(check_weight("3").unwrap(), 3);
        let text = |k: &str| {
            let e = check_weight(k).unwrap_err();
            assert_eq!(e.code, ReplyCode::PreconditionFailed);
            e.text
                .trim_start_matches("PRECONDITION_FAILED - ")
                .to_string()
        };
        assert_eq!(text("0"), "The binding key must be greater than 0");
        assert_eq!(text("-2"), "The binding key must be greater than 0");
        assert_eq!(
            text("abc"),
            "The binding key must be an integer: <<\"abc\">>"
        );
        assert!(check_weight("1000001").is_err());
    }

    #[test]
    fn jump_is_lamping_and_veach() {
        // The reference value the published algorithm's implementations document.
        assert_eq!(jump(256, 1024), 520);
        assert_eq!(jump(1, 1), 0);
        assert_eq!(jump(0, 0), 0);
    }

    #[test]
    fn natural_order_compares_numbers_as_numbers() {
        let mut names = vec!["q-10", "q-2", "q-1", "q-0", "p", "q-02", "q-1a"];
        names.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(names, ["p", "q-0", "q-1", "q-1a", "q-02", "q-2", "q-10"]);
    }

    #[test]
    fn hash_arguments_follow_the_plugin() {
        let mut args = FieldTable::default();
        assert_eq!(
            HashSource::from_arguments(&args).unwrap(),
            HashSource::RoutingKey
        );
        args.insert("hash-header".into(), AMQPValue::LongString("k".into()));
        assert_eq!(
            HashSource::from_arguments(&args).unwrap(),
            HashSource::Header("k".into())
        );
        args.insert(
            "hash-property".into(),
            AMQPValue::LongString("message_id".into()),
        );
        let e = HashSource::from_arguments(&args).unwrap_err();
        assert_eq!(
            e.text,
            "PRECONDITION_FAILED - hash-header and hash-property are mutually exclusive"
        );
        let mut args = FieldTable::default();
        args.insert(
            "hash-property".into(),
            AMQPValue::LongString("app_id".into()),
        );
        assert_eq!(
            HashSource::from_arguments(&args).unwrap_err().text,
            "PRECONDITION_FAILED - Unsupported property: app_id"
        );
    }

    #[test]
    fn modulus_hash_shares_a_million_keys_within_ten_percent() {
        for n in [3u64, 6, 12] {
            let mut counts = vec![0u32; usize::try_from(n).unwrap()];
            for i in 0..1_000_000 {
                let h = key_hash(test_key(i).as_bytes());
                counts[usize::try_from(h % n).unwrap()] += 1;
            }
            let share = 1_000_000.0 / n as f64;
            assert!(
                counts.iter().all(|c| f64::from(*c) <= 1.1 * share),
                "{counts:?}"
            );
        }
    }

    #[test]
    fn modulus_order_is_unique_and_natural() {
        let bindings = vec![
            binding("q-10", "x"),
            binding("q-2", "y"),
            binding("q-10", "z"),
        ];
        assert_eq!(modulus_order(&bindings), [1, 0]);
    }
}
