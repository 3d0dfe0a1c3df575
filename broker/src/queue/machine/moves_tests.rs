//! Tests of what a redrive relies on: taking chosen ready messages from anywhere in the queue
//! (`Take`), move keys (a move taken twice is refused, a finished one forgotten, the window
//! bounded, kept in snapshots), and the key effects a store-backed driver persists.

use super::*;

/// A message of 1 byte, its value its identity.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct M(u64);
impl MessageRef for M {
    fn size(&self) -> u64 {
        1
    }
}

fn apply(q: &mut QueueMachine<M>, now: u64, c: Command<M>) -> (Reply<M>, Vec<Effect<M>>) {
    let mut effects = Vec::new();
    let r = q.apply(now, c, &mut effects).expect("not refused");
    q.check_invariants();
    (r, effects)
}

fn take(q: &mut QueueMachine<M>, now: u64, ids: &[MsgId]) -> Vec<(MsgId, M)> {
    match apply(
        q,
        now,
        Command::Take {
            ids: ids.to_vec(),
            lease_ms: Some(60_000),
            worker: "redrive 1".into(),
        },
    )
    .0
    {
        Reply::Claimed(c) => c.into_iter().map(|c| (c.id, c.msg)).collect(),
        other => panic!("take replied {other:?}"),
    }
}

fn ready_ids(q: &QueueMachine<M>) -> Vec<MsgId> {
    q.browse(BrowseState::Ready, 0, usize::MAX)
        .into_iter()
        .map(|b| b.id)
        .collect()
}

fn moved(q: &mut QueueMachine<M>, now: u64, key: &str, v: u64) -> Reply<M> {
    apply(
        q,
        now,
        Command::MoveKey {
            key: key.as_bytes().to_vec(),
        },
    );
    apply(q, now, Command::Enqueue(M(v))).0
}

/// `Take` claims exactly the ready ids asked for, from the middle of fresh messages (across
/// chunks), from returned ones and from any priority level; the rest keep their order, ids not
/// ready are passed over, and a message past its TTL leaves as expired instead.
#[test]
fn take_claims_chosen_ready_messages_and_keeps_the_rest_in_order() {
    let mut q: QueueMachine<M> = QueueMachine::new();
    for v in 1..=40 {
        apply(&mut q, 0, Command::Enqueue(M(v)));
    }
    // Ids 1..=40 (the machine numbers from 1).
    let first = ready_ids(&q);
    assert_eq!(first.len(), 40);
    // Claim the head two and return one, so a returned message exists.
    let claimed = match apply(
        &mut q,
        0,
        Command::Claim {
            max: 2,
            lease_ms: Some(1_000),
            worker: "w".into(),
        },
    )
    .0
    {
        Reply::Claimed(c) => c,
        other => panic!("{other:?}"),
    };
    apply(&mut q, 0, Command::Return(vec![claimed[0].id]));
    let chosen = [first[0], first[5], first[17], first[39], first[1], 9_999];
    let got = take(&mut q, 1, &chosen);
    assert_eq!(
        got.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        vec![first[0], first[5], first[17], first[39]],
        "returned, fresh across chunks, the tail; a claimed id and an unknown one passed over"
    );
    let want: Vec<MsgId> = first[2..]
        .iter()
        .copied()
        .filter(|id| ![first[5], first[17], first[39]].contains(id))
        .collect();
    assert_eq!(ready_ids(&q), want, "the others keep their order");
    assert_eq!(q.leased_len(), 5, "four taken, one claimed before");
    // The taken ones settle by their tokens as any claim does.
    let mut effects = Vec::new();
    let r = q.apply(
        2,
        Command::AckLease {
            id: first[5],
            generation: 1,
            enqueued_at: 0,
        },
        &mut effects,
    );
    assert_eq!(r, Ok(Reply::Lease(Ok(LeaseState::Acked))));

    // A message whose TTL ran out leaves as expired, not claimed.
    let mut t: QueueMachine<M> = QueueMachine::with_config(QueueConfig {
        message_ttl: Some(100),
        ..QueueConfig::default()
    });
    for v in 1..=3 {
        apply(&mut t, 0, Command::Enqueue(M(v)));
    }
    let ids = ready_ids(&t);
    let (reply, effects) = apply(
        &mut t,
        50,
        Command::Take {
            ids: vec![ids[1]],
            lease_ms: None,
            worker: "r".into(),
        },
    );
    assert!(matches!(reply, Reply::Claimed(ref c) if c.len() == 1));
    assert!(effects.is_empty());
    let (reply, _) = apply(
        &mut t,
        150,
        Command::Take {
            ids: vec![ids[2]],
            lease_ms: None,
            worker: "r".into(),
        },
    );
    assert_eq!(reply, Reply::Claimed(Vec::new()), "expired by then");
}

/// A move key makes a second enqueue of the same move a duplicate, whatever the queue's
/// deduplication settings; forgetting it (the source acknowledged) lets the key be used again
/// and says so as an effect; unknown keys forget nothing.
#[test]
fn a_move_is_taken_once_until_forgotten() {
    let mut q: QueueMachine<M> = QueueMachine::new();
    assert_eq!(moved(&mut q, 0, "dlq/7", 1), Reply::Ok);
    assert_eq!(moved(&mut q, 1, "dlq/7", 1), Reply::Duplicate(M(1)));
    assert_eq!(moved(&mut q, 1, "dlq/8", 2), Reply::Ok);
    assert_eq!(
        apply(&mut q, 2, Command::Enqueue(M(3))).0,
        Reply::Ok,
        "no key, no check"
    );
    assert_eq!(q.len(), 3);
    assert_eq!(q.move_keys_len(), 2);
    assert_eq!(q.work_counters().moves_refused, 1);
    let (_, effects) = apply(
        &mut q,
        3,
        Command::ForgetMoveKeys {
            keys: vec![b"dlq/7".to_vec(), b"never".to_vec()],
        },
    );
    assert_eq!(
        effects,
        vec![Effect::KeyForgotten {
            kind: KeyKind::Move,
            key: b"dlq/7".to_vec()
        }]
    );
    assert_eq!(q.move_keys_len(), 1);
    assert_eq!(moved(&mut q, 4, "dlq/7", 4), Reply::Ok, "forgotten");
    // A refused enqueue (reject-publish) does not remember its key.
    let mut full: QueueMachine<M> = QueueMachine::with_config(QueueConfig {
        max_length: Some(0),
        overflow: Overflow::RejectPublish,
        ..QueueConfig::default()
    });
    assert!(matches!(moved(&mut full, 0, "k", 1), Reply::Rejected(_)));
    assert_eq!(full.move_keys_len(), 0);
}

/// The window holds at most MOVE_KEYS_MAX keys, forgetting the oldest (an effect each); a
/// snapshot keeps the keys, and the store's keys put back by `RestoreKeys` count as taken.
#[test]
fn move_keys_are_bounded_kept_in_snapshots_and_restored() {
    let mut q: QueueMachine<M> = QueueMachine::new();
    let mut forgotten = Vec::new();
    // Invariants checked once at the end (each check walks the whole window).
    for n in 0..=MOVE_KEYS_MAX as u64 {
        let key = n.to_be_bytes().to_vec();
        q.apply(0, Command::MoveKey { key }, &mut forgotten)
            .expect("taken");
        q.apply(0, Command::Enqueue(M(n)), &mut forgotten)
            .expect("taken");
    }
    q.check_invariants();
    assert_eq!(q.move_keys_len(), MOVE_KEYS_MAX);
    assert_eq!(
        forgotten,
        vec![Effect::KeyForgotten {
            kind: KeyKind::Move,
            key: 0u64.to_be_bytes().to_vec()
        }],
        "the oldest key went"
    );
    // As a replica's snapshot is encoded.
    let bytes = bincode::serialize(&q).expect("encodes");
    let mut back: QueueMachine<M> = bincode::deserialize(&bytes).expect("decodes");
    assert_eq!(back.move_keys_len(), MOVE_KEYS_MAX);
    assert!(back.would_refuse_move(&1u64.to_be_bytes()));
    assert_eq!(
        moved(&mut back, 1, std::str::from_utf8(&[0; 8]).expect("utf8"), 9),
        Reply::Ok,
        "the pushed-out key is free"
    );

    let mut r: QueueMachine<M> = QueueMachine::new();
    apply(
        &mut r,
        0,
        Command::RestoreKeys {
            dedup: Vec::new(),
            moves: vec![b"m".to_vec()],
            due: Vec::new(),
        },
    );
    assert_eq!(moved(&mut r, 1, "m", 1), Reply::Duplicate(M(1)));
}

/// Restored deduplication keys count as seen within their window (from the time each was
/// remembered); those whose window ran out while the broker was down are forgotten at once,
/// an effect each, so the store can drop them; and a key trimmed while a publish remembers
/// it again is reported forgotten but is remembered (the driver keeps its record).
#[test]
fn dedup_keys_restore_with_their_times() {
    let mut q: QueueMachine<M> = QueueMachine::with_configs(
        QueueConfig::default(),
        WorkConfig {
            dedup: DedupConfig {
                enabled: true,
                cache_size: 10,
                ttl_ms: Some(1_000),
            },
            ..WorkConfig::default()
        },
    );
    let (_, effects) = apply(
        &mut q,
        5_000,
        Command::RestoreKeys {
            dedup: vec![(b"old".to_vec(), 3_000), (b"new".to_vec(), 4_500)],
            moves: Vec::new(),
            due: Vec::new(),
        },
    );
    assert_eq!(
        effects,
        vec![Effect::KeyForgotten {
            kind: KeyKind::Dedup,
            key: b"old".to_vec()
        }]
    );
    assert_eq!(q.dedup_len(), 1);
    let publish = |q: &mut QueueMachine<M>, now, key: &str, v| {
        apply(
            q,
            now,
            Command::Dedup {
                key: key.as_bytes().to_vec(),
            },
        );
        apply(q, now, Command::Enqueue(M(v)))
    };
    assert_eq!(publish(&mut q, 5_100, "new", 1).0, Reply::Duplicate(M(1)));
    assert_eq!(publish(&mut q, 5_100, "old", 2).0, Reply::Ok);
    let (reply, effects) = publish(&mut q, 5_600, "new", 3);
    assert_eq!(reply, Reply::Ok, "its window ran out at 5,500");
    assert!(effects.contains(&Effect::KeyForgotten {
        kind: KeyKind::Dedup,
        key: b"new".to_vec()
    }));
    assert!(
        q.remembers_dedup_key(b"new"),
        "remembered again by this publish"
    );
}

/// A message taken from the middle and given back (its lease ran out, or released) cannot go
/// back among the returned messages (its id is above fresh ones): it goes to the back under a
/// new id, an `Effect::Requeued` for the driver's store record, and is served after the
/// messages that were ahead of it; a delayed release comes due the same way.
#[test]
fn a_taken_message_given_back_goes_to_the_back() {
    let mut q: QueueMachine<M> = QueueMachine::new();
    for v in 1..=5 {
        apply(&mut q, 0, Command::Enqueue(M(v)));
    }
    let ids = ready_ids(&q);
    let got = take(&mut q, 0, &[ids[2]]);
    assert_eq!(got.len(), 1);
    // Its 60 s lease runs out.
    let (_, effects) = apply(&mut q, 60_000, Command::Expire);
    let requeued: Vec<_> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Requeued { old, new, .. } => Some((*old, *new)),
            _ => None,
        })
        .collect();
    assert_eq!(requeued.len(), 1, "{effects:?}");
    assert_eq!(requeued[0].0, ids[2]);
    let after = ready_ids(&q);
    assert_eq!(after, vec![ids[0], ids[1], ids[3], ids[4], requeued[0].1]);

    // Released with a delay: due later, then at the back as well.
    let got = match apply(
        &mut q,
        60_001,
        Command::Take {
            ids: vec![after[2]],
            lease_ms: Some(1_000),
            worker: "w".into(),
        },
    )
    .0
    {
        Reply::Claimed(c) => c,
        other => panic!("{other:?}"),
    };
    let c = &got[0];
    let (r, _) = apply(
        &mut q,
        60_002,
        Command::Release {
            id: c.id,
            generation: c.generation,
            enqueued_at: c.enqueued_at,
            delay_ms: Some(500),
            reason: "later".into(),
        },
    );
    assert!(matches!(r, Reply::Lease(Ok(LeaseState::Released { .. }))));
    assert_eq!(q.scheduled_len(), 1);
    let (_, effects) = apply(&mut q, 60_502, Command::Expire);
    assert!(
        effects
            .iter()
            .any(|e| matches!(e, Effect::Requeued { old, .. } if *old == c.id))
    );
    let last = *ready_ids(&q).last().expect("ready");
    assert!(last > c.id, "at the back under a new id");
}
