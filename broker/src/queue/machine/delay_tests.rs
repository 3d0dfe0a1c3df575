//! Tests of delayed publishes (`Command::Delay` ahead of an `Enqueue`) and of scheduled
//! messages put back after a restart (`RestoreKeys`'s due times), with the effects a
//! store-backed driver persists.

use super::*;

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
    (r, effects)
}

fn get(q: &mut QueueMachine<M>, now: u64) -> Option<M> {
    match apply(q, now, Command::Get { no_ack: true }).0 {
        Reply::Got(g) => g.map(|(_, m, ..)| m),
        other => panic!("{other:?}"),
    }
}

/// A delayed publish is held (scheduled, counted in the queue) until its time, then ready
/// at the back, behind what was published meanwhile without a delay; entering and leaving
/// the schedule are effects; its TTL counts from when it is ready.
#[test]
fn a_delayed_publish_is_held_then_ready_at_the_back() {
    let mut q: QueueMachine<M> = QueueMachine::with_config(QueueConfig {
        message_ttl: Some(1_000),
        ..QueueConfig::default()
    });
    apply(&mut q, 0, Command::Delay { until: 5_000 });
    let (_, effects) = apply(&mut q, 0, Command::Enqueue(M(1)));
    let scheduled: Vec<_> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Scheduled { id, due } => Some((*id, *due)),
            _ => None,
        })
        .collect();
    assert_eq!(scheduled.len(), 1);
    let held = scheduled[0].0;
    assert_eq!(scheduled[0].1, 5_000);
    assert_eq!((q.len(), q.ready_len(), q.scheduled_len()), (1, 0, 1));
    assert_eq!(q.work_counters().delayed_publishes, 1);
    apply(&mut q, 10, Command::Enqueue(M(2)));
    assert_eq!(
        get(&mut q, 4_000),
        None,
        "M(2) expired at 1,010; M(1) still held"
    );
    apply(&mut q, 4_500, Command::Enqueue(M(3)));
    let (_, effects) = apply(&mut q, 5_000, Command::Expire);
    assert!(effects.contains(&Effect::Unscheduled { id: held }));
    assert!(
        effects
            .iter()
            .any(|e| matches!(e, Effect::Requeued { old, .. } if *old == held))
    );
    assert_eq!(q.scheduled_len(), 0);
    assert_eq!(get(&mut q, 5_001), Some(M(3)));
    assert_eq!(get(&mut q, 5_900), Some(M(1)), "its TTL runs from 5,000");
    q.check_invariants();

    // A delay already past is no delay; the pending delay applies to one Enqueue only.
    let mut p: QueueMachine<M> = QueueMachine::new();
    apply(&mut p, 100, Command::Delay { until: 100 });
    apply(&mut p, 100, Command::Enqueue(M(7)));
    apply(&mut p, 100, Command::Enqueue(M(8)));
    assert_eq!((p.ready_len(), p.scheduled_len()), (2, 0));
}

/// Restored messages with a due time still ahead are held again; those past it stay ready
/// and their records are dropped (an `Unscheduled` each); a purge drops held ones the same way.
#[test]
fn restored_due_times_hold_messages_again() {
    let mut q: QueueMachine<M> = QueueMachine::new();
    for (id, v) in [(4, 1), (5, 2), (6, 3)] {
        apply(
            &mut q,
            1_000,
            Command::Restore {
                id,
                msg: M(v),
                redelivered: true,
                expires_at: None,
            },
        );
    }
    let (_, effects) = apply(
        &mut q,
        1_000,
        Command::RestoreKeys {
            dedup: Vec::new(),
            moves: Vec::new(),
            due: vec![(5, 3_000), (6, 900), (99, 5_000)],
        },
    );
    assert!(effects.contains(&Effect::Scheduled { id: 5, due: 3_000 }));
    assert!(effects.contains(&Effect::Unscheduled { id: 6 }), "past due");
    assert!(
        effects.contains(&Effect::Unscheduled { id: 99 }),
        "no such message"
    );
    assert_eq!((q.ready_len(), q.scheduled_len()), (2, 1));
    assert_eq!(get(&mut q, 1_001), Some(M(1)));
    assert_eq!(get(&mut q, 1_002), Some(M(3)));
    assert_eq!(get(&mut q, 2_999), None);
    assert_eq!(get(&mut q, 3_000), Some(M(2)));

    let mut p: QueueMachine<M> = QueueMachine::new();
    apply(&mut p, 0, Command::Delay { until: 10 });
    apply(&mut p, 0, Command::Enqueue(M(1)));
    let (_, effects) = apply(&mut p, 1, Command::Purge);
    assert!(
        effects
            .iter()
            .any(|e| matches!(e, Effect::Unscheduled { .. }))
    );
    assert_eq!(p.len(), 0);
}

/// Acknowledgements are counted by the attempt that succeeded (the first delivery is attempt
/// 1, each return adds one), into the histogram's buckets; the p99 is the smallest bound
/// holding 99% of them.
#[test]
fn acks_are_counted_by_attempt() {
    let mut q: QueueMachine<M> = QueueMachine::new();
    for v in 0..100 {
        apply(&mut q, 0, Command::Enqueue(M(v)));
    }
    assert_eq!(q.work_counters().attempts_quantile(0.99), None);
    // 98 acked at the first attempt.
    for _ in 0..98 {
        let Reply::Got(Some((id, ..))) = apply(&mut q, 1, Command::Get { no_ack: false }).0 else {
            panic!("a message");
        };
        apply(&mut q, 1, Command::Settle(vec![id]));
    }
    // One returned three times, then acked at attempt 4; one returned seven times (attempt 8).
    for returns in [2, 6] {
        let mut id = 0;
        for _ in 0..=returns {
            let Reply::Got(Some((got, ..))) = apply(&mut q, 2, Command::Get { no_ack: false }).0
            else {
                panic!("a message");
            };
            id = got;
            apply(&mut q, 2, Command::Return(vec![id]));
        }
        let Reply::Got(Some((got, ..))) = apply(&mut q, 2, Command::Get { no_ack: false }).0 else {
            panic!("a message");
        };
        assert_eq!(got, id);
        apply(&mut q, 2, Command::Settle(vec![got]));
    }
    let c = q.work_counters();
    assert_eq!(
        c.acked_attempts,
        [98, 0, 0, 1, 1, 0],
        "attempts 4 and 8 land in (3,5] and (5,10]"
    );
    assert_eq!(c.acked_attempts_sum, 98 + 4 + 8);
    assert_eq!(c.attempts_quantile(0.98), Some(1));
    assert_eq!(c.attempts_quantile(0.99), Some(5));
    assert_eq!(c.attempts_quantile(1.0), Some(10));
    assert_eq!(c.quarantined, 0);

    // Past a delivery limit of 1 the second return removes the message: quarantined.
    let mut l: QueueMachine<M> = QueueMachine::with_config(QueueConfig {
        delivery_limit: Some(1),
        ..QueueConfig::default()
    });
    apply(&mut l, 0, Command::Enqueue(M(1)));
    for _ in 0..2 {
        let Reply::Got(Some((id, ..))) = apply(&mut l, 1, Command::Get { no_ack: false }).0 else {
            panic!("a message");
        };
        apply(&mut l, 1, Command::Return(vec![id]));
    }
    assert_eq!((l.len(), l.work_counters().quarantined), (0, 1));
}

/// New settings do not move the machine's clock: a replica that takes its policies when it is
/// created, then replays its log, stamps every replayed entry with the entry's own time (the
/// leader's), so enqueue times (and lease tokens built on them) agree across replicas.
#[test]
fn settings_do_not_move_the_clock() {
    let mut q: QueueMachine<M> = QueueMachine::new();
    apply(&mut q, 50_000, Command::Configure(QueueConfig::default()));
    apply(
        &mut q,
        50_000,
        Command::ConfigureWork(WorkConfig::default()),
    );
    apply(&mut q, 1_000, Command::Enqueue(M(1)));
    let b = q.browse(BrowseState::Ready, 0, 1);
    assert_eq!(b[0].enqueued_at, 1_000);
}
