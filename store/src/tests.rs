//! Store tests: round trips through reopen, reclamation, crash debris, corruption, versions.

use std::collections::BTreeMap;
use std::io::Write;

use bytes::Bytes;
use proptest::prelude::*;

use super::*;

fn msg(body: &[u8]) -> StoredMessage {
    StoredMessage {
        exchange: Bytes::from_static(b"x"),
        routing_key: Bytes::from_static(b"rk"),
        properties: Bytes::from_static(&[0, 0]),
        body: Bytes::copy_from_slice(body),
    }
}

fn enqueue(queue: u64, id: u64, body: usize) -> Op {
    Op::Enqueue {
        queue,
        id,
        body: BodyRef::New(body),
        flags: 0,
        expires_at: 0,
    }
}

/// A store that checkpoints at every commit: settled segments go at once.
fn open(dir: &Path, segment_max: u64) -> Result<(Store, Recovered), StoreError> {
    Store::open(
        dir,
        Options {
            segment_max,
            checkpoint_interval: std::time::Duration::ZERO,
            ..Options::default()
        },
    )
}

/// A store with the default checkpoint interval: commits reach redb only at checkpoints.
fn open_deferred(dir: &Path, segment_max: u64) -> Result<(Store, Recovered), StoreError> {
    Store::open(
        dir,
        Options {
            segment_max,
            ..Options::default()
        },
    )
}

fn live(r: &Recovered) -> Vec<(u64, u64)> {
    r.messages.iter().map(|m| (m.queue, m.id)).collect()
}

#[test]
fn messages_and_metadata_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let (mut store, r) = open(dir.path(), SEGMENT_MAX_DEFAULT).unwrap();
    assert!(r.messages.is_empty());
    let batch = Batch {
        bodies: vec![msg(b"one"), msg(b"two")],
        ops: vec![
            Op::Put {
                table: MetaTable::Queues,
                key: b"/\0q".to_vec(),
                value: b"decl".to_vec(),
            },
            enqueue(7, 1, 0),
            enqueue(7, 2, 1),
            enqueue(8, 1, 1), // the same body in a second queue: written once
        ],
    };
    let locs = store.commit(&batch).unwrap();
    assert_eq!(locs.len(), 2);
    assert_eq!(
        store.segments().read(locs[1]).unwrap().body,
        Bytes::from_static(b"two")
    );
    drop(store);

    let (store, r) = open(dir.path(), SEGMENT_MAX_DEFAULT).unwrap();
    assert_eq!(live(&r), vec![(7, 1), (7, 2), (8, 1)]);
    assert_eq!(
        r.meta[&MetaTable::Queues],
        vec![(b"/\0q".to_vec(), b"decl".to_vec())]
    );
    let bodies: Vec<Bytes> = r
        .messages
        .iter()
        .map(|m| store.segments().read(m.location).unwrap().body)
        .collect();
    assert_eq!(
        bodies,
        vec![
            Bytes::from_static(b"one"),
            Bytes::from_static(b"two"),
            Bytes::from_static(b"two")
        ]
    );
    assert_eq!(r.messages[1].location, r.messages[2].location);
    let mut store = store;
    store
        .commit(&Batch {
            bodies: vec![],
            ops: vec![Op::Delete {
                table: MetaTable::Queues,
                key: b"/\0q".to_vec(),
            }],
        })
        .unwrap();
    drop(store);
    let (_, r) = open(dir.path(), SEGMENT_MAX_DEFAULT).unwrap();
    assert!(r.meta[&MetaTable::Queues].is_empty());
}

#[test]
fn settled_segments_are_deleted_while_running() {
    let dir = tempfile::tempdir().unwrap();
    let (mut store, _) = open(dir.path(), 4096).unwrap();
    let body = vec![7u8; 500];
    for round in 0..20u64 {
        let bodies = vec![msg(&body); 4];
        let ops = (0..4)
            .map(|i| enqueue(1, round * 4 + i, i as usize))
            .collect();
        store.commit(&Batch { bodies, ops }).unwrap();
        let settle = (0..4)
            .map(|i| Op::Settle {
                queue: 1,
                id: round * 4 + i,
            })
            .collect();
        store
            .commit(&Batch {
                bodies: vec![],
                ops: settle,
            })
            .unwrap();
    }
    // 20 x 2 KB written through 4 KB segments; everything settled: only the active one is left.
    assert!(
        store.segment_count().unwrap() <= 2,
        "{} segments",
        store.segment_count().unwrap()
    );
    drop(store);
    let (_, r) = open(dir.path(), 4096).unwrap();
    assert!(r.messages.is_empty());
}

#[test]
fn a_pinned_record_stays_readable_after_its_segment_is_deleted() {
    // A no-ack delivery pins its stored record, then settles it; the settle can kill the
    // segment while the delivery has yet to read the body.
    // Bodies over the reclaimer's 4 MiB shrink step, so that shrinking would cut the record.
    let dir = tempfile::tempdir().unwrap();
    let (mut store, _) = open(dir.path(), 8 << 20).unwrap();
    let body = vec![7u8; 5 << 20];
    let locs = store
        .commit(&Batch {
            bodies: vec![msg(&body)],
            ops: vec![enqueue(1, 1, 0)],
        })
        .unwrap();
    // The next body rolls to a new segment, sealing the first.
    store
        .commit(&Batch {
            bodies: vec![msg(&vec![1u8; 5 << 20])],
            ops: vec![enqueue(1, 2, 0)],
        })
        .unwrap();
    let pinned = store.segments().pin(locs[0]).unwrap();
    store
        .commit(&Batch {
            bodies: vec![],
            ops: vec![Op::Settle { queue: 1, id: 1 }],
        })
        .unwrap();
    // segment_count waits for the reclaimer: the first segment is gone from the directory.
    assert_eq!(store.segment_count().unwrap(), 1);
    assert_eq!(pinned.read().unwrap().body, Bytes::from(body));
}

#[test]
fn a_segment_stays_while_any_queue_references_it() {
    let dir = tempfile::tempdir().unwrap();
    let (mut store, _) = open(dir.path(), 1024).unwrap();
    let big = vec![1u8; 700];
    store
        .commit(&Batch {
            bodies: vec![msg(&big)],
            ops: vec![enqueue(1, 1, 0), enqueue(2, 1, 0)],
        })
        .unwrap();
    // Roll to a new segment, then settle one of the two references.
    store
        .commit(&Batch {
            bodies: vec![msg(&big)],
            ops: vec![enqueue(3, 1, 0), Op::Settle { queue: 1, id: 1 }],
        })
        .unwrap();
    drop(store);
    let (mut store, r) = open(dir.path(), 1024).unwrap();
    assert_eq!(live(&r), vec![(2, 1), (3, 1)]);
    assert_eq!(
        store
            .segments()
            .read(r.messages[0].location)
            .unwrap()
            .body
            .len(),
        700
    );
    store
        .commit(&Batch {
            bodies: vec![],
            ops: vec![Op::DropQueue { queue: 2 }, Op::DropQueue { queue: 3 }],
        })
        .unwrap();
    assert_eq!(
        store.segment_count().unwrap(),
        1,
        "only the active segment remains"
    );
}

/// A closed store holding one committed message (queue 1, id 1).
fn store_with_one_message(dir: &Path, body: &[u8]) {
    let (mut store, _) = open(dir, SEGMENT_MAX_DEFAULT).unwrap();
    store
        .commit(&Batch {
            bodies: vec![msg(body)],
            ops: vec![enqueue(1, 1, 0)],
        })
        .unwrap();
}

fn first_segment_file(dir: &Path) -> PathBuf {
    let ids = segment::list(&dir.join("segments")).unwrap();
    segment::segment_path(&dir.join("segments"), ids[0])
}

#[test]
fn uncommitted_torn_tail_is_truncated_and_committed_data_kept() {
    let dir = tempfile::tempdir().unwrap();
    store_with_one_message(dir.path(), b"kept");
    // A crash after appending (part of) a record that was never committed to the index.
    let path = first_segment_file(dir.path());
    let before = std::fs::metadata(&path).unwrap().len();
    let mut rec = Vec::new();
    msg(b"never committed").encode(&mut rec);
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(&rec[..rec.len() - 3]).unwrap();
    drop(f);

    let (store, r) = open(dir.path(), SEGMENT_MAX_DEFAULT).unwrap();
    assert_eq!(live(&r), vec![(1, 1)]);
    assert_eq!(r.truncated_bytes, (rec.len() - 3) as u64);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), before);
    assert_eq!(
        store.segments().read(r.messages[0].location).unwrap().body,
        Bytes::from_static(b"kept")
    );
}

#[test]
fn damage_under_an_older_commit_refuses_to_open() {
    let dir = tempfile::tempdir().unwrap();
    let (mut store, _) = open(dir.path(), SEGMENT_MAX_DEFAULT).unwrap();
    for (id, body) in [(1, b"aaaa"), (2, b"bbbb")] {
        store
            .commit(&Batch {
                bodies: vec![msg(body)],
                ops: vec![enqueue(1, id, 0)],
            })
            .unwrap();
    }
    drop(store);
    let path = first_segment_file(dir.path());
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.windows(4).position(|w| w == b"aaaa").unwrap();
    bytes[at] ^= 0x20;
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(
        open(dir.path(), SEGMENT_MAX_DEFAULT),
        Err(StoreError::Corrupt { .. })
    ));
}

#[test]
fn corruption_under_committed_data_refuses_to_open() {
    let dir = tempfile::tempdir().unwrap();
    let (mut store, _) = open(dir.path(), SEGMENT_MAX_DEFAULT).unwrap();
    store
        .commit(&Batch {
            bodies: vec![msg(b"aaaa"), msg(b"bbbb"), msg(b"cccc")],
            ops: vec![enqueue(1, 1, 0), enqueue(1, 2, 1), enqueue(1, 3, 2)],
        })
        .unwrap();
    drop(store);
    // Flip one byte of the first record's body (bit rot in the middle of the file).
    let path = first_segment_file(dir.path());
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.windows(4).position(|w| w == b"aaaa").unwrap();
    bytes[at] ^= 0x20;
    std::fs::write(&path, &bytes).unwrap();
    match open(dir.path(), SEGMENT_MAX_DEFAULT) {
        Err(StoreError::Corrupt {
            path: p, detail, ..
        }) => {
            assert_eq!(p, path);
            assert!(
                detail.contains("committed message would be lost"),
                "{detail}"
            );
        }
        other => panic!("expected corruption error, got {other:?}"),
    }
}

fn numbered(id: u64) -> String {
    format!("body {id} {}", "x".repeat(200))
}

/// Copy the store's segments as a process killed now would leave them (the page cache is
/// the file).
fn crash_copy(dir: &Path, to: &Path) {
    std::fs::create_dir_all(to.join("segments")).unwrap();
    for e in std::fs::read_dir(dir.join("segments")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join("segments").join(e.file_name())).unwrap();
    }
}

/// redb as of its last checkpoint and the segments as of later commits (a power loss after
/// those commits' segment syncs): the index log records after the checkpoint are replayed,
/// so every commit's enqueues, settles, renumbers, dropped queues and metadata are there.
#[test]
fn commits_after_the_checkpoint_are_replayed_from_the_segments() {
    let dir = tempfile::tempdir().unwrap();
    let crashed = tempfile::tempdir().unwrap();
    let (mut store, _) = open_deferred(dir.path(), 4096).unwrap();
    store
        .commit(&Batch {
            bodies: vec![msg(b"before")],
            ops: vec![enqueue(1, 1, 0), enqueue(3, 1, 0)],
        })
        .unwrap();
    store.checkpoint().unwrap();
    // redb as the checkpoint left it (later commits are not durable in it).
    std::fs::copy(
        dir.path().join("meta.redb"),
        crashed.path().join("meta.redb"),
    )
    .unwrap();
    let mut expected = vec![(1, 1)];
    for id in 2..=40u64 {
        let mut ops = vec![enqueue(1, id, 0)];
        if id % 3 == 0 {
            ops.push(Op::Settle {
                queue: 1,
                id: id - 1,
            });
            expected.retain(|k| *k != (1, id - 1));
        }
        store
            .commit(&Batch {
                bodies: vec![msg(numbered(id).as_bytes())],
                ops,
            })
            .unwrap();
        expected.push((1, id));
    }
    store
        .commit(&Batch {
            bodies: vec![],
            ops: vec![
                Op::Renumber {
                    queue: 1,
                    from: 4,
                    to: 100,
                },
                Op::DropQueue { queue: 3 },
                Op::Put {
                    table: MetaTable::Queues,
                    key: b"q".to_vec(),
                    value: b"declared after".to_vec(),
                },
            ],
        })
        .unwrap();
    expected.retain(|k| *k != (1, 4));
    expected.push((1, 100));
    expected.sort_unstable();
    assert!(
        segment::list(&dir.path().join("segments")).unwrap().len() > 2,
        "the commits span segments"
    );
    crash_copy(dir.path(), crashed.path());
    drop(store);
    let (store, r) = open_deferred(crashed.path(), 4096).unwrap();
    assert_eq!(live(&r), expected);
    assert_eq!(
        r.meta[&MetaTable::Queues],
        vec![(b"q".to_vec(), b"declared after".to_vec())]
    );
    for m in &r.messages {
        let body = store.segments().read(m.location).unwrap().body;
        let want = match m.id {
            1 => "before".to_string(),
            100 => numbered(4),
            id => numbered(id),
        };
        assert_eq!(&body[..], want.as_bytes(), "{m:?}");
    }
    drop(store);
    // Replayed once: the open checkpointed, a second open replays nothing and agrees.
    let (_, again) = open_deferred(crashed.path(), 4096).unwrap();
    assert_eq!(live(&again), expected);
}

/// A process killed after non-durable redb commits (whatever redb's file then shows): the
/// open replays from the checkpoint and ends with exactly the committed state.
#[test]
fn a_kill_after_non_durable_commits_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let crashed = tempfile::tempdir().unwrap();
    let (mut store, _) = open_deferred(dir.path(), SEGMENT_MAX_DEFAULT).unwrap();
    for id in 1..=10u64 {
        let mut ops = vec![enqueue(1, id, 0)];
        if id > 5 {
            ops.push(Op::Settle {
                queue: 1,
                id: id - 5,
            });
        }
        store
            .commit(&Batch {
                bodies: vec![msg(b"m")],
                ops,
            })
            .unwrap();
    }
    std::fs::copy(
        dir.path().join("meta.redb"),
        crashed.path().join("meta.redb"),
    )
    .unwrap();
    crash_copy(dir.path(), crashed.path());
    drop(store);
    let (_, r) = open_deferred(crashed.path(), SEGMENT_MAX_DEFAULT).unwrap();
    assert_eq!(live(&r), (6..=10).map(|id| (1, id)).collect::<Vec<_>>());
}

/// Ops pile up for the next checkpoint only to [`index_log::CHECKPOINT_OPS_MAX`]: the
/// commit that reaches it is a checkpoint, whatever the interval.
#[test]
fn a_commit_reaching_the_ops_bound_is_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (mut store, _) = open_deferred(dir.path(), SEGMENT_MAX_DEFAULT).unwrap();
    assert_eq!(
        store.checkpoint_due(),
        None,
        "just opened: redb holds everything"
    );
    let settle = |n: u64| Batch {
        bodies: vec![],
        ops: (0..n).map(|id| Op::Settle { queue: 1, id }).collect(),
    };
    store.commit(&settle(10)).unwrap();
    assert!(
        store.checkpoint_due().is_some(),
        "ten ops wait for the interval"
    );
    let rest = index_log::CHECKPOINT_OPS_MAX as u64 - 10;
    store.commit(&settle(rest - 1)).unwrap();
    assert!(
        store.checkpoint_due().is_some(),
        "one op short of the bound"
    );
    store.commit(&settle(1)).unwrap();
    assert_eq!(
        store.checkpoint_due(),
        None,
        "the bound reached: checkpointed"
    );
}

/// A directory of format 2 (every redb commit durable, no index log) opens, keeps what it
/// held, and is format 3 after.
#[test]
fn a_format_2_directory_is_upgraded_in_place() {
    let dir = tempfile::tempdir().unwrap();
    store_with_one_message(dir.path(), b"old");
    {
        let db = Database::create(dir.path().join("meta.redb")).unwrap();
        let wtx = db.begin_write().unwrap();
        {
            let mut t = wtx.open_table(META).unwrap();
            t.insert(KEY_FORMAT_VERSION, 2).unwrap();
            t.remove(KEY_CHECKPOINT_SEGMENT).unwrap();
            t.remove(KEY_CHECKPOINT_OFFSET).unwrap();
        }
        wtx.commit().unwrap();
    }
    let (store, r) = open(dir.path(), SEGMENT_MAX_DEFAULT).unwrap();
    assert_eq!(live(&r), vec![(1, 1)]);
    assert_eq!(
        store.segments().read(r.messages[0].location).unwrap().body,
        Bytes::from_static(b"old")
    );
    drop(store);
    let db = Database::create(dir.path().join("meta.redb")).unwrap();
    let rtx = db.begin_read().unwrap();
    let t = rtx.open_table(META).unwrap();
    assert_eq!(
        t.get(KEY_FORMAT_VERSION).unwrap().unwrap().value(),
        FORMAT_VERSION
    );
    assert!(t.get(KEY_CHECKPOINT_SEGMENT).unwrap().is_some());
}

#[test]
fn other_format_versions_refuse_to_open() {
    let dir = tempfile::tempdir().unwrap();
    drop(open(dir.path(), SEGMENT_MAX_DEFAULT).unwrap());
    {
        let db = Database::create(dir.path().join("meta.redb")).unwrap();
        let wtx = db.begin_write().unwrap();
        wtx.open_table(META)
            .unwrap()
            .insert(KEY_FORMAT_VERSION, 99)
            .unwrap();
        wtx.commit().unwrap();
    }
    match open(dir.path(), SEGMENT_MAX_DEFAULT) {
        Err(
            e @ StoreError::VersionMismatch {
                found: 99,
                expected: FORMAT_VERSION,
                ..
            },
        ) => {
            assert!(e.to_string().contains("refusing to start"));
        }
        other => panic!("expected version mismatch, got {other:?}"),
    }
}

#[test]
fn a_segment_of_another_version_refuses_to_open() {
    let dir = tempfile::tempdir().unwrap();
    store_with_one_message(dir.path(), b"x");
    let path = first_segment_file(dir.path());
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..12].copy_from_slice(&2u32.to_be_bytes());
    let crc = record::checksum(&bytes[0..28]);
    bytes[28..32].copy_from_slice(&crc.to_be_bytes());
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(
        open(dir.path(), SEGMENT_MAX_DEFAULT),
        Err(StoreError::VersionMismatch { found: 2, .. })
    ));
    // And a damaged header is corruption, not a version question.
    bytes[0] = b'X';
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(
        open(dir.path(), SEGMENT_MAX_DEFAULT),
        Err(StoreError::Corrupt { .. })
    ));
}

#[test]
fn a_damaged_header_on_an_unreferenced_segment_is_crash_debris() {
    let dir = tempfile::tempdir().unwrap();
    store_with_one_message(dir.path(), b"kept");
    // A crash right after creating the next segment: its header never reached the disk.
    let seg_dir = dir.path().join("segments");
    let next = segment::list(&seg_dir).unwrap().last().unwrap() + 1;
    let debris = segment::segment_path(&seg_dir, next);
    std::fs::write(&debris, [0u8; 40]).unwrap();
    let (store, r) = open(dir.path(), SEGMENT_MAX_DEFAULT).unwrap();
    assert_eq!(live(&r), vec![(1, 1)]);
    assert!(!debris.exists());
    assert_eq!(
        store.segments().read(r.messages[0].location).unwrap().body,
        Bytes::from_static(b"kept")
    );
}

#[derive(Debug, Clone)]
enum StoreOp {
    Publish {
        queues: Vec<u64>,
        len: usize,
    },
    Settle(usize),
    /// Enqueue a live message again with a new body (the same key twice in one group).
    Reenqueue(usize),
    Drop(u64),
    /// Move a live message to a new id (requeued to the back of its queue).
    Renumber(usize),
    /// Commit the ops gathered so far as one group (enqueues and settles of one message may
    /// share a group, as with group commit under load).
    Commit,
    Reopen,
}

fn store_op() -> impl Strategy<Value = StoreOp> {
    prop_oneof![
        4 => (proptest::collection::vec(0u64..3, 1..3), 0usize..900)
            .prop_map(|(queues, len)| StoreOp::Publish { queues, len }),
        3 => (0usize..16).prop_map(StoreOp::Settle),
        1 => (0usize..16).prop_map(StoreOp::Reenqueue),
        1 => (0u64..3).prop_map(StoreOp::Drop),
        2 => (0usize..16).prop_map(StoreOp::Renumber),
        3 => Just(StoreOp::Commit),
        1 => Just(StoreOp::Reopen),
    ]
}

/// Against a map model: after any sequence of grouped commits and reopens, the index holds
/// exactly the live (queue, id) pairs, every body reads back, and segments do not
/// accumulate (checked at every commit when each commit is a checkpoint).
fn store_matches_model(ops: Vec<StoreOp>, deferred: bool) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let (mut store, _) = open_with(dir.path(), 2048, deferred).unwrap();
    let mut model: BTreeMap<(u64, u64), Vec<u8>> = BTreeMap::new();
    let mut group = Batch::default();
    let mut next_id = 1u64;
    for op in ops {
        match op {
            StoreOp::Publish { queues, len } => {
                let body = vec![(next_id % 251) as u8; len];
                group.bodies.push(msg(&body));
                for q in queues {
                    group.ops.push(enqueue(q, next_id, group.bodies.len() - 1));
                    model.insert((q, next_id), body.clone());
                }
                next_id += 1;
            }
            StoreOp::Settle(i) => {
                let Some(key) = model.keys().nth(i % model.len().max(1)).copied() else {
                    continue;
                };
                model.remove(&key);
                group.ops.push(Op::Settle {
                    queue: key.0,
                    id: key.1,
                });
            }
            StoreOp::Reenqueue(i) => {
                let Some(key) = model.keys().nth(i % model.len().max(1)).copied() else {
                    continue;
                };
                let body = vec![(i % 251) as u8 ^ 0x55; 10 + i];
                group.bodies.push(msg(&body));
                group
                    .ops
                    .push(enqueue(key.0, key.1, group.bodies.len() - 1));
                model.insert(key, body);
            }
            StoreOp::Drop(q) => {
                model.retain(|k, _| k.0 != q);
                group.ops.push(Op::DropQueue { queue: q });
            }
            StoreOp::Renumber(i) => {
                let Some(key) = model.keys().nth(i % model.len().max(1)).copied() else {
                    continue;
                };
                let body = model.remove(&key).unwrap();
                model.insert((key.0, next_id), body);
                group.ops.push(Op::Renumber {
                    queue: key.0,
                    from: key.1,
                    to: next_id,
                });
                next_id += 1;
            }
            StoreOp::Commit => {
                store.commit(&std::mem::take(&mut group)).unwrap();
                // Each live message pins at most one segment; besides those only the
                // active one (and one rolled during the last group) exist: disk use
                // follows the live data, never the history.
                if !deferred {
                    prop_assert!(store.segment_count().unwrap() <= model.len() + 2);
                }
            }
            StoreOp::Reopen => {
                store.commit(&std::mem::take(&mut group)).unwrap();
                drop(store);
                let (s, r) = open_with(dir.path(), 2048, deferred).unwrap();
                store = s;
                prop_assert_eq!(live(&r), model.keys().copied().collect::<Vec<_>>());
                for m in &r.messages {
                    let body = store.segments().read(m.location).unwrap().body;
                    prop_assert_eq!(&body[..], &model[&(m.queue, m.id)][..]);
                }
            }
        }
    }
    store.commit(&std::mem::take(&mut group)).unwrap();
    drop(store);
    let (_, r) = open_with(dir.path(), 2048, deferred).unwrap();
    prop_assert_eq!(live(&r), model.keys().copied().collect::<Vec<_>>());

    Ok(())
}

fn open_with(
    dir: &Path,
    segment_max: u64,
    deferred: bool,
) -> Result<(Store, Recovered), StoreError> {
    if deferred {
        open_deferred(dir, segment_max)
    } else {
        open(dir, segment_max)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Every commit a checkpoint.
    #[test]
    fn the_store_matches_a_model(ops in proptest::collection::vec(store_op(), 1..60)) {
        store_matches_model(ops, false)?;
    }

    /// Commits reaching redb only at checkpoints (and at each reopen's close).
    #[test]
    fn the_store_with_deferred_checkpoints_matches_a_model(
        ops in proptest::collection::vec(store_op(), 1..60)
    ) {
        store_matches_model(ops, true)?;
    }
}
