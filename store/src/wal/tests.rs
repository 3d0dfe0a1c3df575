//! Tests of the WAL as a whole: group commit, reads before and after sync, recovery, torn
//! tails, segment freeing, and a property test against a model of groups.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use proptest::prelude::*;

use super::*;

const SMALL: WalOptions = WalOptions {
    segment_bytes: WAL_SEGMENT_BYTES_MIN,
};

const MEDIUM: WalOptions = WalOptions {
    segment_bytes: 64 * 1024,
};

fn append(index: u64, text: &str) -> Op {
    Op::Append {
        index,
        data: Bytes::copy_from_slice(text.as_bytes()),
    }
}

fn meta(slot: MetaSlot, text: &str) -> Op {
    Op::Meta {
        slot,
        value: Bytes::copy_from_slice(text.as_bytes()),
    }
}

fn texts(entries: &[(u64, Bytes)]) -> Vec<(u64, String)> {
    entries
        .iter()
        .map(|(i, d)| (*i, String::from_utf8_lossy(d).into_owned()))
        .collect()
}

#[test]
fn writes_are_readable_at_once_and_survive_a_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let wal = Wal::open(dir.path(), WalOptions::default()).expect("open");
        let told = Arc::new(AtomicUsize::new(0));
        let t = Arc::clone(&told);
        wal.write(
            7,
            &[append(1, "a"), append(2, "b"), meta(MetaSlot::Vote, "v1")],
            Box::new(move |r| {
                r.expect("durable");
                t.fetch_add(1, Ordering::SeqCst);
            }),
        );
        // Readable before (or whether or not) the writer has synced it.
        assert_eq!(
            texts(&wal.entries(7, ..).expect("read")),
            vec![(1, "a".into()), (2, "b".into())]
        );
        wal.write_and_wait(
            7,
            &[
                Op::Truncate { from: 2 },
                append(2, "B"),
                append(3, "c"),
                Op::Body {
                    key: 99,
                    data: Bytes::from_static(b"kept"),
                },
                Op::Purge { upto: 1 },
                meta(MetaSlot::Purged, "p1"),
            ],
        )
        .expect("durable");
        assert_eq!(
            told.load(Ordering::SeqCst),
            1,
            "the first write was told first"
        );
        wal.write_and_wait(8, &[append(1, "other"), Op::Forget])
            .expect("forget");
        wal.write_and_wait(9, &[meta(MetaSlot::Committed, "c9")])
            .expect("meta only");
    }
    let wal = Wal::open(dir.path(), WalOptions::default()).expect("reopen");
    assert_eq!(wal.groups(), vec![7, 9]);
    assert_eq!(
        texts(&wal.entries(7, ..).expect("read")),
        vec![(2, "B".into()), (3, "c".into())]
    );
    assert_eq!(wal.entry(7, 1).expect("read"), None, "purged");
    assert_eq!(
        wal.body(7, 99).expect("read"),
        Some(Bytes::from_static(b"kept"))
    );
    let g = wal.group(7).expect("group 7");
    assert_eq!(
        (g.first, g.last, g.state.purged),
        (Some(2), Some(3), Some(1))
    );
    assert_eq!(
        g.state.meta[MetaSlot::Vote as usize].as_deref(),
        Some(&b"v1"[..])
    );
    assert_eq!(
        g.state.meta[MetaSlot::Purged as usize].as_deref(),
        Some(&b"p1"[..])
    );
    assert_eq!(
        wal.group(9).expect("group 9").state.meta[MetaSlot::Committed as usize].as_deref(),
        Some(&b"c9"[..])
    );
}

#[test]
fn a_lazy_write_is_readable_at_once_and_durable_with_the_next_round_or_the_close() {
    let dir = tempfile::tempdir().expect("tempdir");
    let committed = |wal: &Wal, group| {
        wal.group(group)
            .and_then(|g| g.state.meta[MetaSlot::Committed as usize].clone())
    };
    {
        let wal = Wal::open(dir.path(), WalOptions::default()).expect("open");
        wal.write_and_wait(1, &[append(1, "a")]).expect("append");
        let rounds = wal.stats().rounds;
        wal.write_lazy(1, &[meta(MetaSlot::Committed, "c1")])
            .expect("lazy");
        assert_eq!(committed(&wal, 1).as_deref(), Some(&b"c1"[..]));
        // A write of another group's round carries it: one round, not two.
        wal.write_and_wait(2, &[append(1, "b")]).expect("append");
        assert_eq!(wal.stats().rounds, rounds + 1);
        // Refused like any write: nothing staged.
        assert!(matches!(
            wal.write_lazy(1, &[append(5, "gap")]),
            Err(WalError::OutOfOrder { .. })
        ));
        // Staged last, made durable by the close.
        wal.write_lazy(2, &[meta(MetaSlot::Committed, "c2")])
            .expect("lazy");
    }
    let wal = Wal::open(dir.path(), WalOptions::default()).expect("reopen");
    assert_eq!(committed(&wal, 1).as_deref(), Some(&b"c1"[..]));
    assert_eq!(committed(&wal, 2).as_deref(), Some(&b"c2"[..]));
    assert_eq!(wal.last_index(1), Some(1));
}

#[test]
fn lazy_writes_past_their_bound_ask_for_a_round_rather_than_hold_writes_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let wal = Arc::new(Wal::open(dir.path(), WalOptions::default()).expect("open"));
    let w = Arc::clone(&wal);
    let (tx, rx) = std::sync::mpsc::channel();
    // Twice WAL_PENDING_BYTES_MAX of lazy records and nothing else: were they never written,
    // staging would wait for room forever.
    std::thread::spawn(move || {
        let value = Bytes::from(vec![7u8; 1024 * 1024]);
        for _ in 0..(2 * WAL_PENDING_BYTES_MAX) / value.len() {
            let op = Op::Meta {
                slot: MetaSlot::Committed,
                value: value.clone(),
            };
            w.write_lazy(3, &[op]).expect("lazy");
        }
        let _ = tx.send(());
    });
    rx.recv_timeout(std::time::Duration::from_secs(60))
        .expect("lazy writes waited for room the writer never made");
    // Written by the rounds they asked for, or at the latest by the round of this write.
    wal.write_and_wait(4, &[append(1, "after")]).expect("write");
    assert!(
        wal.stats().bytes >= (2 * WAL_PENDING_BYTES_MAX) as u64,
        "{:?}",
        wal.stats()
    );
}

#[test]
fn an_append_out_of_order_writes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let wal = Wal::open(dir.path(), WalOptions::default()).expect("open");
    wal.write_and_wait(1, &[append(1, "a")]).expect("first");
    let refused = wal.write_and_wait(1, &[append(2, "b"), append(4, "d")]);
    assert!(
        matches!(
            refused,
            Err(WalError::OutOfOrder {
                group: 1,
                index: 4,
                expected: 3
            })
        ),
        "{refused:?}"
    );
    assert_eq!(
        wal.group(1).expect("group").last,
        Some(1),
        "nothing of the write was done"
    );
}

#[test]
fn many_writers_share_rounds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let wal = Arc::new(Wal::open(dir.path(), WalOptions::default()).expect("open"));
    let threads: Vec<_> = (0..8u64)
        .map(|group| {
            let wal = Arc::clone(&wal);
            std::thread::spawn(move || {
                for i in 1..=50 {
                    wal.write_and_wait(group, &[append(i, "x")])
                        .expect("durable");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("writer thread");
    }
    let stats = wal.stats();
    assert_eq!(stats.writes, 400);
    // Each write waits for its round, so rounds can only be fewer than writes if rounds are
    // shared; on a machine where one thread runs at a time they still are, as writes stage
    // while the writer syncs.
    assert!(stats.rounds < stats.writes, "{stats:?}");
    for group in 0..8 {
        assert_eq!(wal.group(group).expect("group").last, Some(50));
    }
}

#[test]
fn segments_roll_and_are_freed_once_no_group_needs_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let wal = Wal::open(dir.path(), SMALL).expect("open");
    let body = "x".repeat(300);
    // Group 1 keeps its first entry; group 2 writes enough to fill many segments.
    wal.write_and_wait(1, &[append(1, "pinned")])
        .expect("write");
    for i in 1..=100 {
        wal.write_and_wait(2, &[append(i, &body)]).expect("write");
    }
    let before = wal.stats().segments;
    assert!(
        before > segment::SPARE_SEGMENTS_MAX + 2,
        "{:?}",
        wal.stats()
    );
    wal.write_and_wait(2, &[Op::Purge { upto: 100 }])
        .expect("purge");
    assert_eq!(
        wal.stats().segments,
        before,
        "group 1's entry pins the oldest segment"
    );
    let (oldest, pinning) = wal.pinning().expect("an old segment");
    assert_eq!((oldest, pinning), (1, vec![1]));
    wal.write_and_wait(1, &[Op::Purge { upto: 1 }])
        .expect("purge");
    // Freed once the writer synced the next round; one more write is such a round.
    wal.write_and_wait(3, &[append(1, "tick")]).expect("write");
    let after = wal.stats();
    assert!(after.segments <= 2, "{after:?}");
    assert!(after.freed >= (before - 2) as u64, "{after:?}");
    let spares = segment::list(dir.path()).expect("list").1;
    assert_eq!(
        spares.len(),
        segment::SPARE_SEGMENTS_MAX,
        "freed files kept for reuse"
    );
    drop(wal);
    let wal = Wal::open(dir.path(), SMALL).expect("reopen");
    assert_eq!(wal.group(2).expect("group 2").state.purged, Some(100));
    assert_eq!(
        wal.entry(3, 1).expect("read"),
        Some(Bytes::from_static(b"tick"))
    );
    // Enough writes to need new segments take the spares first.
    for i in 2..=30 {
        wal.write_and_wait(3, &[append(i, &body)]).expect("write");
    }
    assert!(segment::list(dir.path()).expect("list").1.len() < segment::SPARE_SEGMENTS_MAX);
}

/// A body copied out long ago pins the oldest segment on its own (its entries are purged, its
/// message still live); appended again, it frees the segment and reads back the same, before
/// and after a reopen.
#[test]
fn a_body_alone_pinning_the_oldest_segment_is_appended_again_and_frees_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let wal = Wal::open(dir.path(), SMALL).expect("open");
    let filler = "x".repeat(300);
    let body = |key: u64, text: &str| Op::Body {
        key,
        data: Bytes::copy_from_slice(text.as_bytes()),
    };
    wal.write_and_wait(
        1,
        &[append(1, "entry"), body(10, "kept"), body(11, "dropped")],
    )
    .expect("write");
    wal.write_and_wait(1, &[Op::Purge { upto: 1 }])
        .expect("purge");
    for i in 1..=40 {
        wal.write_and_wait(2, &[append(i, &filler)]).expect("write");
    }
    wal.write_and_wait(2, &[Op::Purge { upto: 40 }])
        .expect("purge");
    let before = wal.stats().segments;
    assert!(before > 3, "{:?}", wal.stats());
    let (oldest, pinning) = wal.pinning().expect("an old segment");
    assert_eq!(
        pinning,
        vec![1],
        "only group 1's bodies hold segment {oldest}"
    );
    assert_eq!(wal.oldest_segment(), Some(oldest));
    wal.write_and_wait(1, &[Op::DropBodies { keys: vec![11] }])
        .expect("drop");
    assert_eq!(wal.rewrite_bodies(1, oldest).expect("rewrite"), 1);
    assert_eq!(
        wal.rewrite_bodies(1, oldest).expect("again"),
        0,
        "none left there"
    );
    assert_eq!(wal.rewrite_bodies(2, oldest).expect("other group"), 0);
    // Freed by the round that made the copy durable; one more round recycles it.
    wal.write_and_wait(3, &[append(1, "tick")]).expect("write");
    let after = wal.stats();
    assert!(after.segments <= 2, "{after:?}");
    assert!(wal.pinning().is_none_or(|(seq, _)| seq > oldest));
    assert_eq!(
        wal.body(1, 10).expect("read"),
        Some(Bytes::from_static(b"kept"))
    );
    assert_eq!(
        wal.body(1, 11).expect("read"),
        None,
        "a dropped body stays dropped"
    );
    drop(wal);
    let wal = Wal::open(dir.path(), SMALL).expect("reopen");
    assert_eq!(
        wal.body(1, 10).expect("read"),
        Some(Bytes::from_static(b"kept"))
    );
    assert_eq!(wal.body(1, 11).expect("read"), None);
    assert_eq!(wal.group(1).expect("group 1").bodies, 1);
}

/// Bodies larger together than one batch go in several, every one of them moved.
#[test]
fn bodies_larger_than_a_batch_are_appended_again_in_several() {
    let dir = tempfile::tempdir().expect("tempdir");
    let wal = Wal::open(dir.path(), WalOptions::default()).expect("open");
    let big = Bytes::from(vec![7u8; REWRITE_BATCH_BYTES / 2 + 1]);
    for key in 0..5 {
        wal.write_and_wait(
            1,
            &[Op::Body {
                key,
                data: big.clone(),
            }],
        )
        .expect("write");
    }
    let first = wal.stats().segments;
    wal.write_and_wait(2, &[append(1, "roll")]).expect("write");
    // Roll by hand: a write larger than what is left of the segment starts the next one.
    let rest = Bytes::from(vec![1u8; (WAL_SEGMENT_BYTES as usize) - 5 * big.len()]);
    wal.write_and_wait(2, &[Op::Body { key: 1, data: rest }])
        .expect("write");
    assert!(wal.stats().segments > first, "{:?}", wal.stats());
    let oldest = wal.oldest_segment().expect("an old segment");
    assert_eq!(wal.rewrite_bodies(1, oldest).expect("rewrite"), 5);
    for key in 0..5 {
        assert_eq!(wal.body(1, key).expect("read"), Some(big.clone()));
    }
    assert!(wal.pinning().is_none_or(|(_, g)| !g.contains(&1)));
}

/// The last segment's file, and where each write ended in it (odd writes append entry
/// (i+1)/2, even ones set the commit slot to the number of entries so far).
fn write_history(dir: &Path, writes: u64) -> (PathBuf, Vec<u64>) {
    let wal = Wal::open(dir, MEDIUM).expect("open");
    let mut ends = Vec::new();
    for i in 1..=writes {
        let op = if i % 2 == 1 {
            append(i.div_ceil(2), &format!("entry {i}"))
        } else {
            meta(MetaSlot::Committed, &(i / 2).to_string())
        };
        wal.write_and_wait(5, &[op]).expect("write");
        ends.push(wal.shared.state.lock().tail_start);
    }
    let last = segment::list(dir)
        .expect("list")
        .0
        .last()
        .copied()
        .expect("a segment");
    drop(wal);
    (segment::path(dir, last), ends)
}

#[test]
fn a_torn_tail_is_cut_and_everything_before_it_is_kept() {
    let src = tempfile::tempdir().expect("tempdir");
    let (last, ends) = write_history(src.path(), 24);
    let bytes = std::fs::read(&last).expect("read");
    let end = *ends.last().expect("ends") as usize;
    // Cut the file anywhere in the last writes (a crash in the middle of a round), with
    // garbage after the cut: the records wholly before the cut remain, nothing after.
    for cut in (end - 200..end).step_by(7).chain([end]) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(last.file_name().expect("name"));
        let mut torn = bytes[..cut].to_vec();
        torn.extend_from_slice(&[0xA5; 100]);
        std::fs::write(&path, &torn).expect("write");
        let wal = Wal::open(dir.path(), MEDIUM).expect("reopen a torn log");
        let whole = ends.iter().filter(|e| **e as usize <= cut).count() as u64;
        let entries = whole.div_ceil(2);
        let g = wal.group(5).expect("group 5");
        assert_eq!(g.last, Some(entries), "cut at {cut}");
        let committed = g.state.meta[MetaSlot::Committed as usize].clone();
        assert_eq!(
            committed,
            Some(Bytes::from((whole / 2).to_string())),
            "cut at {cut}"
        );
        // The log goes on after the cut, and a second reopen sees the same and the new.
        wal.write_and_wait(5, &[append(entries + 1, "after")])
            .expect("write after the cut");
        drop(wal);
        let wal = Wal::open(dir.path(), MEDIUM).expect("reopen again");
        assert_eq!(
            wal.entry(5, entries + 1).expect("read"),
            Some(Bytes::from_static(b"after"))
        );
        assert_eq!(wal.group(5).expect("group 5").last, Some(entries + 1));
    }
}

#[test]
fn damage_before_the_newest_segment_refuses_to_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let wal = Wal::open(dir.path(), SMALL).expect("open");
        for i in 1..=40 {
            wal.write_and_wait(1, &[append(i, &"y".repeat(300))])
                .expect("write");
        }
    }
    let first = segment::list(dir.path()).expect("list").0[0];
    let p = segment::path(dir.path(), first);
    let mut bytes = std::fs::read(&p).expect("read");
    bytes[segment::HEADER_LEN + 40] ^= 0xFF;
    std::fs::write(&p, &bytes).expect("write");
    let err = Wal::open(dir.path(), SMALL).expect_err("damage in the middle of the log");
    assert!(matches!(err, WalError::Corrupt { .. }), "{err}");
}

// A model of groups: entries by index, bodies by key, metadata, purge point.
#[derive(Debug, Default, Clone, PartialEq)]
struct ModelGroup {
    entries: BTreeMap<u64, Bytes>,
    next: u64,
    bodies: BTreeMap<u64, Bytes>,
    vote: Option<Bytes>,
    purged: Option<u64>,
}

#[derive(Debug, Clone)]
enum Step {
    Append { group: u64, n: usize, size: usize },
    Truncate { group: u64, back: u64 },
    Purge { group: u64, ahead: u64 },
    Vote { group: u64, v: u8 },
    Body { group: u64, key: u64 },
    Drop { group: u64, key: u64 },
    Forget { group: u64 },
    Reopen,
}

fn step() -> impl Strategy<Value = Step> {
    let group = 0..4u64;
    prop_oneof![
        6 => (group.clone(), 1..4usize, 0..700usize).prop_map(|(group, n, size)| Step::Append { group, n, size }),
        1 => (group.clone(), 0..4u64).prop_map(|(group, back)| Step::Truncate { group, back }),
        2 => (group.clone(), 0..12u64).prop_map(|(group, ahead)| Step::Purge { group, ahead }),
        1 => (group.clone(), any::<u8>()).prop_map(|(group, v)| Step::Vote { group, v }),
        1 => (group.clone(), 0..6u64).prop_map(|(group, key)| Step::Body { group, key }),
        1 => (group.clone(), 0..6u64).prop_map(|(group, key)| Step::Drop { group, key }),
        1 => group.prop_map(|group| Step::Forget { group }),
        1 => Just(Step::Reopen),
    ]
}

fn check(wal: &Wal, model: &BTreeMap<u64, ModelGroup>) {
    let present: Vec<u64> = model.keys().copied().collect();
    assert_eq!(wal.groups(), present);
    for (id, m) in model {
        let entries: BTreeMap<u64, Bytes> =
            wal.entries(*id, ..).expect("read").into_iter().collect();
        assert_eq!(entries, m.entries, "group {id}");
        let g = wal.group(*id).expect("group");
        assert_eq!(g.state.meta[MetaSlot::Vote as usize], m.vote, "group {id}");
        assert_eq!(g.state.purged, m.purged, "group {id}");
        for (key, body) in &m.bodies {
            assert_eq!(
                wal.body(*id, *key).expect("read").as_ref(),
                Some(body),
                "group {id}"
            );
        }
        assert_eq!(g.bodies, m.bodies.len(), "group {id}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The WAL against a model of groups, with small segments so they roll and are freed
    /// often: after every step (a reopen included) every read matches the model, so no
    /// segment a group needs was freed; and once every group has purged, segments are freed.
    #[test]
    fn the_wal_matches_a_model_of_groups(steps in proptest::collection::vec(step(), 1..60)) {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut wal = Wal::open(dir.path(), SMALL).expect("open");
        let mut model: BTreeMap<u64, ModelGroup> = BTreeMap::new();
        let mut counter = 0u64;
        for step in steps {
            match step {
                Step::Append { group, n, size } => {
                    let m = model.entry(group).or_insert_with(|| ModelGroup { next: 1, ..ModelGroup::default() });
                    let mut ops = Vec::new();
                    for _ in 0..n {
                        counter += 1;
                        let data = Bytes::from(format!("{counter}:{}", "z".repeat(size)));
                        ops.push(Op::Append { index: m.next, data: data.clone() });
                        m.entries.insert(m.next, data);
                        m.next += 1;
                    }
                    wal.write_and_wait(group, &ops).expect("append");
                }
                Step::Truncate { group, back } => {
                    let Some(m) = model.get_mut(&group) else { continue };
                    let from = m.next.saturating_sub(back).max(m.purged.map_or(0, |p| p + 1));
                    m.entries.retain(|i, _| *i < from);
                    m.next = from;
                    wal.write_and_wait(group, &[Op::Truncate { from }]).expect("truncate");
                }
                Step::Purge { group, ahead } => {
                    let Some(m) = model.get_mut(&group) else { continue };
                    let upto = m.purged.unwrap_or(0) + ahead;
                    m.entries.retain(|i, _| *i > upto);
                    m.purged = Some(m.purged.map_or(upto, |p| p.max(upto)));
                    m.next = m.next.max(upto + 1);
                    wal.write_and_wait(group, &[Op::Purge { upto }]).expect("purge");
                }
                Step::Vote { group, v } => {
                    let m = model.entry(group).or_insert_with(|| ModelGroup { next: 1, ..ModelGroup::default() });
                    let value = Bytes::from(vec![v]);
                    m.vote = Some(value.clone());
                    wal.write_and_wait(group, &[Op::Meta { slot: MetaSlot::Vote, value }]).expect("vote");
                }
                Step::Body { group, key } => {
                    let m = model.entry(group).or_insert_with(|| ModelGroup { next: 1, ..ModelGroup::default() });
                    counter += 1;
                    let data = Bytes::from(format!("body {counter} {}", "b".repeat(200)));
                    m.bodies.insert(key, data.clone());
                    wal.write_and_wait(group, &[Op::Body { key, data }]).expect("body");
                }
                Step::Drop { group, key } => {
                    let Some(m) = model.get_mut(&group) else { continue };
                    m.bodies.remove(&key);
                    wal.write_and_wait(group, &[Op::DropBodies { keys: vec![key] }]).expect("drop");
                }
                Step::Forget { group } => {
                    if model.remove(&group).is_none() { continue; }
                    wal.write_and_wait(group, &[Op::Forget]).expect("forget");
                }
                Step::Reopen => {
                    drop(wal);
                    wal = Wal::open(dir.path(), SMALL).expect("reopen");
                }
            }
            check(&wal, &model);
        }
        // Everything released: all but the newest two segments go.
        for (id, m) in &model {
            let ops = [Op::Purge { upto: m.next }, Op::DropBodies { keys: m.bodies.keys().copied().collect() }];
            wal.write_and_wait(*id, &ops).expect("purge all");
        }
        wal.write_and_wait(100, &[Op::Forget]).expect("a last round");
        wal.write_and_wait(100, &[Op::Forget]).expect("a last round");
        prop_assert!(wal.stats().segments <= 2, "{:?}", wal.stats());
        drop(wal);
        let wal = Wal::open(dir.path(), SMALL).expect("reopen");
        for (id, m) in &model {
            prop_assert_eq!(wal.group(*id).map(|g| g.state.purged), Some(Some(m.next)));
        }
    }
}

/// Replay reads a segment a window at a time: records across a window's edge and a record
/// larger than a window come back whole.
#[test]
fn a_replay_crosses_its_read_windows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let big = "B".repeat(5 * 1024 * 1024 + 3);
    {
        let wal = Wal::open(dir.path(), WalOptions::default()).expect("open");
        for i in 1..=1500 {
            let text = format!("{i:05}{}", "e".repeat(4000 + (i as usize % 97)));
            wal.write_and_wait(1, &[append(i, &text)]).expect("write");
        }
        wal.write_and_wait(1, &[append(1501, &big)])
            .expect("a record larger than a window");
        wal.write_and_wait(2, &[append(1, "after")]).expect("write");
    }
    let wal = Wal::open(dir.path(), WalOptions::default()).expect("reopen");
    let entries = wal.entries(1, ..).expect("read");
    assert_eq!(entries.len(), 1501);
    for (i, data) in &entries[..1500] {
        assert_eq!(&data[..5], format!("{i:05}").as_bytes());
        assert_eq!(data.len(), 5 + 4000 + (*i as usize % 97));
    }
    assert_eq!(entries[1500].1.len(), big.len());
    assert_eq!(
        wal.entry(2, 1).expect("read"),
        Some(Bytes::from_static(b"after"))
    );
}
