//! Tests of claims under leases, generation fencing, extension caps and delayed retries:
//! unit cases, then a proptest of the machine against a naive model, with snapshot and replay.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

/// A message of 1 + (value % 5) bytes, no priority, no TTL.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct M(u64);
impl MessageRef for M {
    fn size(&self) -> u64 {
        self.0 % 5 + 1
    }
}

fn machine(work: WorkConfig) -> QueueMachine<M> {
    QueueMachine::with_configs(QueueConfig::default(), work)
}

fn run(q: &mut QueueMachine<M>, now: u64, c: Command<M>) -> Reply<M> {
    let mut effects = Vec::new();
    q.apply(now, c, &mut effects)
        .expect("lease commands are not refused")
}

fn claim(q: &mut QueueMachine<M>, now: u64, max: u32, lease_ms: Option<u64>) -> Vec<Claimed<M>> {
    match run(
        q,
        now,
        Command::Claim {
            max,
            lease_ms,
            worker: "w".into(),
        },
    ) {
        Reply::Claimed(c) => c,
        other => panic!("claim replied {other:?}"),
    }
}

fn lease(q: &mut QueueMachine<M>, now: u64, c: Command<M>) -> Result<LeaseState, LeaseError> {
    match run(q, now, c) {
        Reply::Lease(r) => r,
        other => panic!("lease command replied {other:?}"),
    }
}

// The unit tests enqueue at machine time 0, so their tokens carry enqueued_at 0.

fn ack(id: MsgId, generation: u32) -> Command<M> {
    Command::AckLease {
        id,
        generation,
        enqueued_at: 0,
    }
}

fn extend(id: MsgId, generation: u32, lease_ms: u64) -> Command<M> {
    Command::Extend {
        id,
        generation,
        enqueued_at: 0,
        lease_ms,
    }
}

fn release(id: MsgId, generation: u32, delay_ms: Option<u64>) -> Command<M> {
    Command::Release {
        id,
        generation,
        enqueued_at: 0,
        delay_ms,
        reason: "test".into(),
    }
}

/// A worker that dies mid-task: its lease runs out, a second worker's claim takes a newer
/// generation, and the first worker's late ack is refused and changes nothing.
#[test]
fn a_late_ack_of_an_expired_claim_is_fenced_by_the_newer_generation() {
    let mut q = machine(WorkConfig::default());
    run(&mut q, 0, Command::Enqueue(M(1)));
    let first = claim(&mut q, 0, 10, Some(1_000));
    assert_eq!(first.len(), 1);
    assert_eq!((first[0].generation, first[0].delivery_count), (1, 0));
    assert_eq!(first[0].lease_expires_at, 1_000);
    assert_eq!(q.next_expiry(), Some(1_000));
    // Before the deadline nothing else can claim it.
    assert!(claim(&mut q, 999, 10, None).is_empty());
    // At the deadline the lease runs out; the message is ready again, a delivery counted.
    let second = claim(&mut q, 1_000, 10, Some(1_000));
    assert_eq!(second.len(), 1);
    assert_eq!(second[0].id, first[0].id);
    assert_eq!((second[0].generation, second[0].delivery_count), (2, 1));
    assert!(second[0].redelivered);
    let id = first[0].id;
    assert_eq!(
        lease(&mut q, 1_001, ack(id, 1)),
        Err(LeaseError::StaleGeneration { current: 2 })
    );
    assert_eq!(
        lease(&mut q, 1_001, extend(id, 1, 5_000)),
        Err(LeaseError::StaleGeneration { current: 2 })
    );
    assert_eq!(q.leased_len(), 1, "the stale token changed nothing");
    assert_eq!(lease(&mut q, 1_002, ack(id, 2)), Ok(LeaseState::Acked));
    assert!(q.is_empty());
    assert_eq!(lease(&mut q, 1_003, ack(id, 2)), Err(LeaseError::NotFound));
    assert_eq!(q.counters().settled, 1);
    assert_eq!(q.work_counters().lease_expired, 1);
}

/// A token whose lease ran out, with nothing claiming the message since, is told so (409
/// lease_expired), and cannot extend it back.
#[test]
fn an_expired_lease_reports_lease_expired_until_claimed_again() {
    let mut q = machine(WorkConfig::default());
    run(&mut q, 0, Command::Enqueue(M(1)));
    let c = claim(&mut q, 0, 1, Some(50));
    assert_eq!(
        lease(&mut q, 50, extend(c[0].id, 1, 1_000)),
        Err(LeaseError::LeaseExpired { current: 1 })
    );
    assert_eq!(q.ready_len(), 1);
    assert_eq!(q.leased_len(), 0);
}

/// One extension is cut to the extension cap, and no extension goes past the claim's lifetime
/// cap.
#[test]
fn extension_is_capped_per_call_and_over_the_claims_lifetime() {
    let mut q = machine(WorkConfig {
        lease: LeaseConfig {
            default_ms: 100,
            extension_max_ms: 1_000,
            lifetime_max_ms: 2_500,
        },
        ..WorkConfig::default()
    });
    run(&mut q, 0, Command::Enqueue(M(1)));
    // A claim asking more than the extension cap gets the cap.
    let c = claim(&mut q, 0, 1, Some(60_000));
    assert_eq!(c[0].lease_expires_at, 1_000);
    let id = c[0].id;
    assert_eq!(
        lease(&mut q, 500, extend(id, 1, 60_000)),
        Ok(LeaseState::Claimed {
            lease_expires_at: 1_500
        })
    );
    assert_eq!(
        lease(&mut q, 1_400, extend(id, 1, 1_000)),
        Ok(LeaseState::Claimed {
            lease_expires_at: 2_400
        })
    );
    // The lifetime cap (claimed at 0, 2,500 ms) bounds the next one.
    assert_eq!(
        lease(&mut q, 2_000, extend(id, 1, 1_000)),
        Ok(LeaseState::Claimed {
            lease_expires_at: 2_500
        })
    );
    assert_eq!(
        lease(&mut q, 2_500, extend(id, 1, 1_000)),
        Err(LeaseError::LeaseExpired { current: 1 })
    );
    assert_eq!(q.work_counters().extended, 3);
}

/// A release with a delay holds the message (scheduled, not ready) until it is due, then puts
/// it back in its place ahead of later messages; a purge takes scheduled messages too.
#[test]
fn release_with_a_delay_schedules_the_message_back_in_its_place() {
    let mut q = machine(WorkConfig::default());
    for v in 1..=3 {
        run(&mut q, 0, Command::Enqueue(M(v)));
    }
    let c = claim(&mut q, 0, 1, None);
    let id = c[0].id;
    assert_eq!(
        lease(&mut q, 10, release(id, 1, Some(500))),
        Ok(LeaseState::Released {
            ready_at: Some(510)
        })
    );
    assert_eq!((q.ready_len(), q.scheduled_len(), q.len()), (2, 1, 3));
    assert_eq!(q.next_expiry(), Some(510));
    let next = claim(&mut q, 509, 1, None);
    assert_ne!(next[0].id, id, "not before it is due");
    let due = claim(&mut q, 510, 1, None);
    assert_eq!((due[0].id, due[0].generation), (id, 2));
    assert_eq!(
        lease(&mut q, 511, release(id, 2, Some(100))),
        Ok(LeaseState::Released {
            ready_at: Some(611)
        })
    );
    let mut effects = Vec::new();
    let purged = q.apply(512, Command::Purge, &mut effects).expect("purge");
    assert_eq!(purged, Reply::Purged(2), "one ready, one scheduled");
    assert_eq!(q.scheduled_len(), 0);
}

/// A durable classic queue's restart restores its messages at their restore time: a token
/// issued before names a message of the same id but another enqueue time, and is refused as
/// unknown, even when the new claim has the same generation.
#[test]
fn a_token_from_before_a_restore_is_unknown() {
    let mut q = machine(WorkConfig::default());
    run(&mut q, 0, Command::Enqueue(M(1)));
    let before = claim(&mut q, 0, 1, None);
    let mut restored = machine(WorkConfig::default());
    run(
        &mut restored,
        5_000,
        Command::Restore {
            id: before[0].id,
            msg: M(1),
            redelivered: true,
            expires_at: None,
        },
    );
    let after = claim(&mut restored, 5_000, 1, None);
    assert_eq!((after[0].id, after[0].generation), (before[0].id, 1));
    assert_eq!(after[0].enqueued_at, 5_000);
    assert_eq!(
        lease(&mut restored, 5_001, ack(before[0].id, 1)),
        Err(LeaseError::NotFound)
    );
    let token = Command::AckLease {
        id: after[0].id,
        generation: 1,
        enqueued_at: after[0].enqueued_at,
    };
    assert_eq!(lease(&mut restored, 5_002, token), Ok(LeaseState::Acked));
}

/// RabbitMQ 4.3's delayed retry: linear in the delivery count up to the max, applied to the
/// kind of return the policy names.
#[test]
fn retry_policy_delays_returns_of_the_kind_it_names() {
    let policy = RetryPolicy {
        on: RetryOn::Failed,
        min_ms: 100,
        max_ms: 250,
        multiplier_milli: 0,
        jitter_percent: 0,
    };
    assert_eq!(policy.delay_ms(ReturnKind::Failed, 1, 7), 100);
    assert_eq!(policy.delay_ms(ReturnKind::Failed, 2, 7), 200);
    assert_eq!(policy.delay_ms(ReturnKind::Failed, 3, 7), 250);
    assert_eq!(policy.delay_ms(ReturnKind::Returned, 1, 7), 0);
    let mut q = machine(WorkConfig {
        retry: policy,
        ..WorkConfig::default()
    });
    run(&mut q, 0, Command::Enqueue(M(1)));
    let c = claim(&mut q, 0, 1, Some(10));
    // A lease running out is not a failure: ready at once.
    assert_eq!(q.next_expiry(), Some(10));
    let again = claim(&mut q, 10, 1, Some(1_000));
    assert_eq!(again[0].generation, 2);
    // A release without a delay is a failure: the policy holds it (delivery count 2).
    assert_eq!(
        lease(&mut q, 20, release(c[0].id, 2, None)),
        Ok(LeaseState::Released {
            ready_at: Some(220)
        })
    );
    // basic.nack with requeue of an AMQP delivery is a failure too.
    let mut effects = Vec::new();
    q.apply(220, Command::Get { no_ack: false }, &mut effects)
        .expect("get");
    q.apply(230, Command::Requeue(vec![c[0].id]), &mut effects)
        .expect("requeue");
    assert_eq!(q.scheduled_len(), 1);
    assert_eq!(q.next_expiry(), Some(480), "min(100 * 4, 250) after 230");
}

/// The exponential form grows by the multiplier up to the max, and jitter stays within its
/// spread and is the same on every call (replicas agree).
#[test]
fn exponential_retry_with_jitter_is_bounded_and_deterministic() {
    let policy = RetryPolicy {
        on: RetryOn::All,
        min_ms: 100,
        max_ms: 10_000,
        multiplier_milli: 2_000,
        jitter_percent: 0,
    };
    let delays: Vec<u64> = (1..=9)
        .map(|n| policy.delay_ms(ReturnKind::Returned, n, 1))
        .collect();
    assert_eq!(
        delays,
        [100, 200, 400, 800, 1_600, 3_200, 6_400, 10_000, 10_000]
    );
    let jittered = RetryPolicy {
        jitter_percent: 20,
        ..policy
    };
    for id in 0..200 {
        let d = jittered.delay_ms(ReturnKind::Failed, 4, id);
        assert!((640..=960).contains(&d), "800 +- 20%: {d}");
        assert_eq!(d, jittered.delay_ms(ReturnKind::Failed, 4, id));
    }
    let spread: std::collections::BTreeSet<u64> = (0..200)
        .map(|id| jittered.delay_ms(ReturnKind::Failed, 4, id))
        .collect();
    assert!(spread.len() > 50, "jitter spreads retries");
}

/// Past the delivery limit a returned claim is removed (dead-lettered) rather than retried.
#[test]
fn a_claim_past_the_delivery_limit_is_removed() {
    let mut q = QueueMachine::with_configs(
        QueueConfig {
            delivery_limit: Some(1),
            ..QueueConfig::default()
        },
        WorkConfig::default(),
    );
    run(&mut q, 0, Command::Enqueue(M(1)));
    let c = claim(&mut q, 0, 1, Some(10));
    let c2 = claim(&mut q, 10, 1, Some(10));
    assert_eq!(c2[0].generation, 2);
    let mut effects = Vec::new();
    // Before the second lease (10..20) runs out.
    q.apply(
        15,
        Command::Release {
            id: c[0].id,
            generation: 2,
            enqueued_at: 0,
            delay_ms: None,
            reason: "poison".into(),
        },
        &mut effects,
    )
    .expect("release");
    // The failure context comes just ahead of the removal it describes.
    let at = effects
        .iter()
        .position(|e| {
            matches!(
                e,
                Effect::Removed {
                    reason: Removal::DeliveryLimit,
                    ..
                }
            )
        })
        .expect("removed past the limit");
    assert_eq!(
        effects[at - 1],
        Effect::Failed {
            id: c[0].id,
            reason: "poison".into(),
            worker: "w".into(),
            delivery_count: 2,
        }
    );
    assert!(q.is_empty());
    assert!(
        q.work.failures.is_empty(),
        "no context outlives its message"
    );
}

/// A lease that runs out records why; a later ack of the message drops the record.
#[test]
fn failure_context_lives_as_long_as_its_message() {
    let mut q = machine(WorkConfig::default());
    run(&mut q, 0, Command::Enqueue(M(1)));
    claim(&mut q, 0, 1, Some(10));
    let again = claim(&mut q, 10, 1, Some(100));
    assert_eq!(
        q.work.failures.get(&again[0].id).map(|f| f.reason.as_str()),
        Some("lease expired")
    );
    assert_eq!(
        lease(&mut q, 20, ack(again[0].id, 2)),
        Ok(LeaseState::Acked)
    );
    assert!(q.work.failures.is_empty());
}

/// A machine encoded before it had work-queue state decodes as [`QueueMachineV1`] and
/// converts without losing a message.
#[test]
fn a_machine_encoded_without_work_state_still_decodes() {
    #[derive(serde::Serialize)]
    struct V1<'a> {
        config: QueueConfig,
        now: u64,
        arriving: Option<MsgId>,
        next_id: MsgId,
        levels: &'a BTreeMap<u8, super::ready::Level<M>>,
        ready_count: usize,
        unacked: &'a std::collections::HashMap<MsgId, super::settle::Unacked<M>>,
        consumers: &'a BTreeMap<ConsumerId, super::consumers::Consumer>,
        rings: &'a BTreeMap<i32, std::collections::VecDeque<ConsumerId>>,
        exclusive_consumer: Option<ConsumerId>,
        limited_consumers: usize,
        attach_seq: u64,
        ready_bytes: u64,
        unacked_bytes: u64,
        counters: Counters,
    }
    let mut q = machine(WorkConfig::default());
    for v in 1..=40 {
        run(&mut q, v, Command::Enqueue(M(v)));
    }
    let mut effects = Vec::new();
    q.apply(50, Command::Get { no_ack: false }, &mut effects)
        .expect("get");
    let old = bincode::serialize(&V1 {
        config: q.config,
        now: q.now,
        arriving: q.arriving,
        next_id: q.next_id,
        levels: &q.levels,
        ready_count: q.ready_count,
        unacked: &q.unacked,
        consumers: &q.consumers,
        rings: &q.rings,
        exclusive_consumer: q.exclusive_consumer,
        limited_consumers: q.limited_consumers,
        attach_seq: q.attach_seq,
        ready_bytes: q.ready_bytes,
        unacked_bytes: q.unacked_bytes,
        counters: q.counters,
    })
    .expect("encodes");
    assert!(
        bincode::deserialize::<QueueMachine<M>>(&old).is_err(),
        "the new layout does not read the old one"
    );
    let v1: QueueMachineV1<M> = bincode::deserialize(&old).expect("old layout decodes");
    let back = QueueMachine::from(v1);
    back.check_invariants();
    assert_eq!(
        (back.ready_len(), back.unacked_len(), back.next_id()),
        (39, 1, 41)
    );
}

// ------------------------------------------------------------------ model

/// The model's view of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Ready, with its delivery count.
    Ready(u32),
    /// Claimed under a lease.
    Claimed {
        generation: u32,
        claimed_at: u64,
        expires_at: u64,
    },
    /// Waiting out a delayed retry.
    Scheduled { due: u64, count: u32 },
}

#[derive(Debug, Clone)]
struct Model {
    now: u64,
    next_id: MsgId,
    msgs: BTreeMap<MsgId, State>,
    /// Each message's enqueue time (its tokens carry it).
    at: BTreeMap<MsgId, u64>,
    limit: Option<u32>,
    work: WorkConfig,
}

impl Model {
    fn delay(&self, kind: ReturnKind, count: u32) -> u64 {
        let p = self.work.retry;
        let applies = match p.on {
            RetryOn::Disabled => false,
            RetryOn::All => true,
            RetryOn::Failed => kind == ReturnKind::Failed,
            RetryOn::Returned => kind == ReturnKind::Returned,
        };
        if applies && p.min_ms > 0 {
            (p.min_ms * u64::from(count)).min(p.max_ms.max(p.min_ms))
        } else {
            0
        }
    }

    /// Return message `id` (claimed, generation `g`): counted, removed past the limit, held
    /// for a delay or ready. Returns the scheduled due time.
    fn put_back(&mut self, id: MsgId, g: u32, kind: ReturnKind, delay: Option<u64>) -> Option<u64> {
        let count = g;
        if self.limit.is_some_and(|l| count > l) {
            self.msgs.remove(&id);
            self.at.remove(&id);
            return None;
        }
        let d = delay.unwrap_or_else(|| self.delay(kind, count));
        if d > 0 {
            let due = self.now + d;
            self.msgs.insert(id, State::Scheduled { due, count });
            Some(due)
        } else {
            self.msgs.insert(id, State::Ready(count));
            None
        }
    }

    /// Time passes to `now`: leases run out, then due retries become ready.
    fn advance(&mut self, now: u64) {
        self.now = self.now.max(now);
        let expired: Vec<(MsgId, u32)> = self
            .msgs
            .iter()
            .filter_map(|(id, s)| match s {
                State::Claimed {
                    generation,
                    expires_at,
                    ..
                } if *expires_at <= self.now => Some((*id, *generation)),
                _ => None,
            })
            .collect();
        for (id, g) in expired {
            self.put_back(id, g, ReturnKind::Returned, None);
        }
        for s in self.msgs.values_mut() {
            if let State::Scheduled { due, count } = *s
                && due <= self.now
            {
                *s = State::Ready(count);
            }
        }
    }

    fn check(&self, id: MsgId, g: u32, at: u64) -> Result<(u64, u64), LeaseError> {
        if self.at.get(&id) != Some(&at) {
            return Err(LeaseError::NotFound);
        }
        match self.msgs.get(&id) {
            None => Err(LeaseError::NotFound),
            Some(State::Claimed {
                generation,
                claimed_at,
                expires_at,
            }) => {
                if *generation == g {
                    Ok((*claimed_at, *expires_at))
                } else {
                    Err(LeaseError::StaleGeneration {
                        current: *generation,
                    })
                }
            }
            Some(State::Ready(c) | State::Scheduled { count: c, .. }) => {
                if *c == g {
                    Err(LeaseError::LeaseExpired { current: *c })
                } else {
                    Err(LeaseError::StaleGeneration { current: *c })
                }
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Enqueue,
    Claim {
        max: u32,
        lease_ms: Option<u64>,
    },
    Extend {
        pick: usize,
        skew: u32,
        lease_ms: u64,
    },
    Ack {
        pick: usize,
        skew: u32,
    },
    Release {
        pick: usize,
        skew: u32,
        delay_ms: Option<u64>,
    },
    Advance(u64),
    /// Encode the machine and go on with the decoded copy.
    Snapshot,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Enqueue),
        3 => (1u32..4, proptest::option::of(1u64..300))
            .prop_map(|(max, lease_ms)| Op::Claim { max, lease_ms }),
        2 => (any::<usize>(), 0u32..4, 1u64..400)
            .prop_map(|(pick, skew, lease_ms)| Op::Extend { pick, skew, lease_ms }),
        2 => (any::<usize>(), 0u32..4).prop_map(|(pick, skew)| Op::Ack { pick, skew }),
        2 => (any::<usize>(), 0u32..4, proptest::option::of(0u64..200))
            .prop_map(|(pick, skew, delay_ms)| Op::Release { pick, skew, delay_ms }),
        3 => (0u64..150).prop_map(Op::Advance),
        1 => Just(Op::Snapshot),
    ]
}

fn work_config() -> impl Strategy<Value = (WorkConfig, Option<u32>)> {
    (
        1u64..200,
        1u64..300,
        1u64..600,
        prop_oneof![
            Just(RetryOn::Disabled),
            Just(RetryOn::All),
            Just(RetryOn::Failed),
            Just(RetryOn::Returned)
        ],
        0u64..100,
        0u64..300,
        proptest::option::of(1u32..5),
    )
        .prop_map(|(default_ms, ext, life, on, min_ms, max_ms, limit)| {
            (
                WorkConfig {
                    lease: LeaseConfig {
                        default_ms,
                        extension_max_ms: ext,
                        lifetime_max_ms: life,
                    },
                    retry: RetryPolicy {
                        on,
                        min_ms,
                        max_ms,
                        multiplier_milli: 0,
                        jitter_percent: 0,
                    },
                    dedup: DedupConfig::default(),
                    priority_aging_ms: None,
                },
                limit,
            )
        })
}

fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("encodes")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Claims, extensions, acks and releases with current, stale and future generations, time
    /// passing and snapshots: every reply and every message's state match the model; replaying
    /// the same commands on a new machine, whole or from a snapshot taken halfway, gives the
    /// same state.
    #[test]
    fn leases_match_the_model(
        (work, limit) in work_config(),
        ops in proptest::collection::vec(op(), 1..150),
    ) {
        let config = QueueConfig { delivery_limit: limit, ..QueueConfig::default() };
        let mut q: QueueMachine<M> = QueueMachine::with_configs(config, work);
        let mut model = Model {
            now: 0, next_id: 1, msgs: BTreeMap::new(), at: BTreeMap::new(), limit, work,
        };
        let mut log: Vec<(u64, Command<M>)> = Vec::new();
        let mut halfway: Option<(usize, String)> = None;
        let mut now = 0u64;
        for (step, op) in ops.iter().enumerate() {
            if step == ops.len() / 2 {
                halfway = Some((log.len(), json(&q)));
            }
            let command = match op {
                Op::Advance(ms) => {
                    now += ms;
                    Command::Expire
                }
                Op::Snapshot => {
                    q = bincode::deserialize(&bincode::serialize(&q).expect("encodes"))
                        .expect("decodes");
                    q.check_invariants();
                    continue;
                }
                Op::Enqueue => Command::Enqueue(M(model.next_id)),
                Op::Claim { max, lease_ms } => Command::Claim {
                    max: *max,
                    lease_ms: *lease_ms,
                    worker: "w".into(),
                },
                Op::Extend { pick, skew, lease_ms } => {
                    let (id, generation, enqueued_at) = token(&model, *pick, *skew);
                    Command::Extend { id, generation, enqueued_at, lease_ms: *lease_ms }
                }
                Op::Ack { pick, skew } => {
                    let (id, generation, enqueued_at) = token(&model, *pick, *skew);
                    Command::AckLease { id, generation, enqueued_at }
                }
                Op::Release { pick, skew, delay_ms } => {
                    let (id, generation, enqueued_at) = token(&model, *pick, *skew);
                    Command::Release {
                        id, generation, enqueued_at, delay_ms: *delay_ms, reason: "r".into(),
                    }
                }
            };
            log.push((now, command.clone()));
            let mut effects = Vec::new();
            let reply = q.apply(now, command.clone(), &mut effects).expect("not refused");
            model.advance(now);
            match (command, reply) {
                (Command::Enqueue(_), Reply::Ok) => {
                    model.msgs.insert(model.next_id, State::Ready(0));
                    model.at.insert(model.next_id, model.now);
                    model.next_id += 1;
                }
                (Command::Expire, Reply::Ok) => {}
                (Command::Claim { max, lease_ms, .. }, Reply::Claimed(claims)) => {
                    let cfg = model.work.lease;
                    let lease = lease_ms
                        .unwrap_or(cfg.default_ms)
                        .clamp(1, cfg.extension_max_ms)
                        .min(cfg.lifetime_max_ms);
                    let ready: Vec<(MsgId, u32)> = model
                        .msgs
                        .iter()
                        .filter_map(|(id, s)| match s {
                            State::Ready(c) => Some((*id, *c)),
                            _ => None,
                        })
                        .take(max as usize)
                        .collect();
                    let got: Vec<(MsgId, u32, u64)> = claims
                        .iter()
                        .map(|c| (c.id, c.generation, c.lease_expires_at))
                        .collect();
                    let want: Vec<(MsgId, u32, u64)> = ready
                        .iter()
                        .map(|(id, c)| (*id, c + 1, model.now + lease))
                        .collect();
                    prop_assert_eq!(got, want);
                    for (id, c) in ready {
                        model.msgs.insert(id, State::Claimed {
                            generation: c + 1,
                            claimed_at: model.now,
                            expires_at: model.now + lease,
                        });
                    }
                }
                (Command::Extend { id, generation, enqueued_at, lease_ms }, Reply::Lease(r)) => {
                    let want = model.check(id, generation, enqueued_at).map(|(claimed_at, _)| {
                        let cfg = model.work.lease;
                        let at = (model.now + lease_ms.clamp(1, cfg.extension_max_ms))
                            .min(claimed_at + cfg.lifetime_max_ms)
                            .max(model.now + 1);
                        model.msgs.insert(id, State::Claimed {
                            generation, claimed_at, expires_at: at,
                        });
                        LeaseState::Claimed { lease_expires_at: at }
                    });
                    prop_assert_eq!(r, want);
                }
                (Command::AckLease { id, generation, enqueued_at }, Reply::Lease(r)) => {
                    let want = model.check(id, generation, enqueued_at).map(|_| {
                        model.msgs.remove(&id);
                        model.at.remove(&id);
                        LeaseState::Acked
                    });
                    prop_assert_eq!(r, want);
                }
                (Command::Release { id, generation, enqueued_at, delay_ms, .. }, Reply::Lease(r)) => {
                    let want = match model.check(id, generation, enqueued_at) {
                        Ok(_) => {
                            let ready_at = model.put_back(id, generation, ReturnKind::Failed, delay_ms);
                            Ok(LeaseState::Released { ready_at })
                        }
                        Err(e) => Err(e),
                    };
                    prop_assert_eq!(r, want);
                }
                (c, r) => prop_assert!(false, "{c:?} replied {r:?}"),
            }
            // Every message's state agrees.
            let mut seen = BTreeMap::new();
            for (id, s) in &model.msgs {
                let machine_state = match s {
                    State::Ready(_) => q.ready_record(*id).map(|(c, _)| State::Ready(c)),
                    State::Claimed { .. } => q.work.leases.get(*id).map(|l| State::Claimed {
                        generation: l.generation,
                        claimed_at: l.claimed_at,
                        expires_at: l.expires_at,
                    }),
                    State::Scheduled { .. } => q.work.scheduled.get(*id).map(|r| State::Scheduled {
                        due: q.work.scheduled.due(*id).unwrap_or(0),
                        count: r.delivery_count(),
                    }),
                };
                seen.insert(*id, machine_state);
            }
            let want: BTreeMap<MsgId, Option<State>> =
                model.msgs.iter().map(|(id, s)| (*id, Some(s.clone()))).collect();
            prop_assert_eq!(seen, want);
            prop_assert_eq!(q.len(), model.msgs.len());
        }
        // Replay: the log alone rebuilds the same machine, from the start or from the
        // snapshot taken halfway.
        let mut again: QueueMachine<M> = QueueMachine::with_configs(config, work);
        let mut effects = Vec::new();
        for (at, c) in &log {
            let _ = again.apply(*at, c.clone(), &mut effects);
        }
        prop_assert_eq!(json(&again), json(&q));
        if let Some((from, snapshot)) = halfway {
            let mut resumed: QueueMachine<M> = serde_json::from_str(&snapshot).expect("decodes");
            for (at, c) in &log[from..] {
                let _ = resumed.apply(*at, c.clone(), &mut effects);
            }
            prop_assert_eq!(json(&resumed), json(&q));
        }
    }
}

/// A token for the `pick`-th message the model knows: its current generation, one before or
/// after it (`skew` 1 and 2), or the right generation with another enqueue time (3: the
/// message of another incarnation under the same id).
fn token(model: &Model, pick: usize, skew: u32) -> (MsgId, u32, u64) {
    let ids: Vec<MsgId> = model.msgs.keys().copied().collect();
    let Some(&id) = ids.get(pick % ids.len().max(1)) else {
        // Nothing in the queue: a token of a message settled or never there.
        return (model.next_id.saturating_sub(1).max(1), 1, 0);
    };
    let current = match model.msgs[&id] {
        State::Claimed { generation, .. } => generation,
        State::Ready(c) | State::Scheduled { count: c, .. } => c,
    };
    let at = model.at[&id];
    match skew {
        0 => (id, current, at),
        1 => (id, current.saturating_sub(1), at),
        2 => (id, current + 1, at),
        _ => (id, current, at + 1),
    }
}

// ------------------------------------------------------------------ deduplication

fn dedup_machine(cache_size: u32, ttl_ms: Option<u64>) -> QueueMachine<M> {
    machine(WorkConfig {
        dedup: DedupConfig {
            enabled: true,
            cache_size,
            ttl_ms,
        },
        ..WorkConfig::default()
    })
}

fn publish_keyed(q: &mut QueueMachine<M>, now: u64, key: &str, v: u64) -> Reply<M> {
    run(
        q,
        now,
        Command::Dedup {
            key: key.as_bytes().to_vec(),
        },
    );
    run(q, now, Command::Enqueue(M(v)))
}

/// A key seen within the window drops the message (handed back as a duplicate); after the
/// window's time, or once the size pushed it out, the same key is taken again. A message
/// without a key, or a queue without deduplication, is never dropped.
#[test]
fn dedup_window_is_bounded_by_time_and_count() {
    let mut q = dedup_machine(2, Some(1_000));
    assert_eq!(publish_keyed(&mut q, 0, "a", 1), Reply::Ok);
    assert_eq!(publish_keyed(&mut q, 10, "a", 2), Reply::Duplicate(M(2)));
    assert_eq!(run(&mut q, 20, Command::Enqueue(M(3))), Reply::Ok);
    assert_eq!(publish_keyed(&mut q, 999, "a", 4), Reply::Duplicate(M(4)));
    assert_eq!(
        publish_keyed(&mut q, 1_000, "a", 5),
        Reply::Ok,
        "window ran out"
    );
    assert_eq!(publish_keyed(&mut q, 1_001, "b", 6), Reply::Ok);
    assert_eq!(publish_keyed(&mut q, 1_002, "c", 7), Reply::Ok);
    assert_eq!(q.dedup_len(), 2, "the size keeps two keys");
    assert_eq!(
        publish_keyed(&mut q, 1_003, "a", 8),
        Reply::Ok,
        "pushed out by b and c"
    );
    assert_eq!(q.len(), 6);
    assert_eq!(q.work_counters().deduplicated, 2);
    let mut off = machine(WorkConfig::default());
    assert_eq!(publish_keyed(&mut off, 0, "a", 1), Reply::Ok);
    assert_eq!(publish_keyed(&mut off, 0, "a", 2), Reply::Ok);
}

/// A message refused by a length limit is not remembered: its retry is taken once there is
/// room.
#[test]
fn a_refused_message_leaves_its_key_unremembered() {
    let mut q = QueueMachine::with_configs(
        QueueConfig {
            max_length: Some(1),
            overflow: Overflow::RejectPublish,
            ..QueueConfig::default()
        },
        WorkConfig {
            dedup: DedupConfig {
                enabled: true,
                ..DedupConfig::default()
            },
            ..WorkConfig::default()
        },
    );
    assert_eq!(publish_keyed(&mut q, 0, "a", 1), Reply::Ok);
    assert_eq!(publish_keyed(&mut q, 0, "b", 2), Reply::Rejected(M(2)));
    let mut effects = Vec::new();
    q.apply(1, Command::Get { no_ack: true }, &mut effects)
        .expect("get");
    assert_eq!(publish_keyed(&mut q, 2, "b", 3), Reply::Ok);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random keyed and unkeyed publishes over time against a model of the window (a key is
    /// a duplicate when remembered within the TTL; the oldest go once there are more than
    /// the size), with the machine encoded and decoded along the way.
    #[test]
    fn dedup_matches_a_window_model(
        size in 1u32..6,
        ttl in proptest::option::of(1u64..200),
        ops in proptest::collection::vec((proptest::option::of(0u8..8), 0u64..60, any::<bool>()), 1..120),
    ) {
        let mut q = dedup_machine(size, ttl);
        // Model: keys in remembering order with their time.
        let mut window: Vec<(u8, u64)> = Vec::new();
        let mut now = 0;
        for (i, (key, dt, snapshot)) in ops.into_iter().enumerate() {
            now += dt;
            if snapshot {
                q = bincode::deserialize(&bincode::serialize(&q).expect("encodes")).expect("decodes");
            }
            let v = i as u64;
            let reply = match key {
                Some(k) => publish_keyed(&mut q, now, &k.to_string(), v),
                None => run(&mut q, now, Command::Enqueue(M(v))),
            };
            let Some(k) = key else {
                prop_assert_eq!(reply, Reply::Ok);
                continue;
            };
            window.retain(|&(_, t)| ttl.is_none_or(|ttl| t + ttl > now));
            let latest = window.iter().rev().find(|(w, _)| *w == k).copied();
            if latest.is_some() {
                prop_assert_eq!(reply, Reply::Duplicate(M(v)));
            } else {
                prop_assert_eq!(reply, Reply::Ok);
                window.retain(|(w, _)| *w != k);
                window.push((k, now));
                while window.len() > size as usize {
                    window.remove(0);
                }
            }
        }
    }
}

// ------------------------------------------------------------------ priority aging

/// A message whose priority is its value mod 4.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct P(u64);
impl MessageRef for P {
    fn size(&self) -> u64 {
        1
    }
    fn priority(&self) -> u8 {
        (self.0 % 4) as u8
    }
}

fn aging_machine(bound: Option<u64>) -> QueueMachine<P> {
    QueueMachine::with_configs(
        QueueConfig {
            max_priority: Some(3),
            ..QueueConfig::default()
        },
        WorkConfig {
            priority_aging_ms: bound,
            ..WorkConfig::default()
        },
    )
}

fn get_value(q: &mut QueueMachine<P>, now: u64) -> Option<u64> {
    let mut effects = Vec::new();
    match q.apply(now, Command::Get { no_ack: true }, &mut effects) {
        Ok(Reply::Got(Some((_, m, _, _, _)))) => Some(m.0),
        _ => None,
    }
}

/// Strict priority passes a low-priority message over while higher ones keep coming; with
/// x-priority-aging-ms it is served once it has waited that long.
#[test]
fn priority_aging_bounds_how_long_a_level_is_passed_over() {
    for (bound, want) in [(None, vec![3, 7, 11, 0]), (Some(100), vec![3, 0, 7, 11])] {
        let mut q = aging_machine(bound);
        run_p(&mut q, 0, 0); // priority 0
        run_p(&mut q, 50, 3); // priority 3
        run_p(&mut q, 60, 7); // priority 3
        run_p(&mut q, 70, 11); // priority 3
        let got: Vec<u64> = [90, 100, 110, 120]
            .into_iter()
            .filter_map(|t| get_value(&mut q, t))
            .collect();
        assert_eq!(got, want, "bound {bound:?}");
    }
}

fn run_p(q: &mut QueueMachine<P>, now: u64, v: u64) {
    let mut effects = Vec::new();
    q.apply(now, Command::Enqueue(P(v)), &mut effects)
        .expect("enqueue");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Against a model of one FIFO per priority: each get takes the oldest head that has
    /// waited at least the bound (ties to the higher priority), else the highest priority's
    /// head; so no message waits past the bound while another is served ahead of it.
    #[test]
    fn priority_aging_matches_a_model(
        bound in 1u64..100,
        ops in proptest::collection::vec((any::<bool>(), 0u64..4, 0u64..40), 1..150),
    ) {
        let mut q = aging_machine(Some(bound));
        let mut levels: BTreeMap<u8, std::collections::VecDeque<(u64, u64)>> = BTreeMap::new();
        let (mut now, mut next) = (0u64, 0u64);
        for (publish, priority, dt) in ops {
            now += dt;
            if publish {
                let v = next * 4 + priority;
                next += 1;
                run_p(&mut q, now, v);
                levels.entry(priority as u8).or_default().push_back((v, now));
                continue;
            }
            let aged = levels
                .iter()
                .filter_map(|(l, f)| f.front().map(|&(_, at)| (at, *l)))
                .filter(|(at, _)| now - at >= bound)
                .min_by_key(|&(at, l)| (at, std::cmp::Reverse(l)))
                .map(|(_, l)| l);
            let level = aged.or_else(|| levels.keys().next_back().copied());
            let want = level.and_then(|l| {
                let f = levels.get_mut(&l)?;
                let v = f.pop_front().map(|(v, _)| v);
                if f.is_empty() {
                    levels.remove(&l);
                }
                v
            });
            prop_assert_eq!(get_value(&mut q, now), want);
        }
    }
}
