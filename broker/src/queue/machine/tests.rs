//! Unit and property tests of the queue machine against a naive model.
#![allow(clippy::map_entry)] // The model mirrors the machine step by step, clearer than entry().

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;

#[derive(Debug, Clone, PartialEq, Eq)]
struct M(u64);
impl MessageRef for M {
    fn size(&self) -> u64 {
        self.0 % 7 + 1
    }

    /// Hundreds digit: M(0..99) have priority 0, M(300..399) priority 3.
    fn priority(&self) -> u8 {
        u8::try_from(self.0 / 100).unwrap_or(u8::MAX)
    }

    /// Values ending in 9 carry their own TTL of (value % 4) ms.
    fn expiration_ms(&self) -> Option<u64> {
        (self.0 % 10 == 9).then_some(self.0 % 4)
    }
}

fn got_id(r: Result<Reply<M>, MachineError>) -> Option<MsgId> {
    match r {
        Ok(Reply::Got(Some((id, _, _, _, _)))) => Some(id),
        _ => None,
    }
}

fn removed(effects: &[Effect<M>]) -> Vec<(MsgId, Removal)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Removed { id, reason, .. } => Some((*id, *reason)),
            Effect::Deliver { .. }
            | Effect::Requeued { .. }
            | Effect::Failed { .. }
            | Effect::KeyForgotten { .. }
            | Effect::Scheduled { .. }
            | Effect::Unscheduled { .. } => None,
        })
        .collect()
}

fn spec(prefetch: u32) -> ConsumerSpec {
    ConsumerSpec {
        prefetch,
        window: 1000,
        window_bytes: u64::MAX,
        no_ack: false,
        exclusive: false,
        priority: 0,
        limited: false,
    }
}

fn delivered(effects: &[Effect<M>]) -> Vec<(ConsumerId, MsgId, bool)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Deliver {
                consumer,
                id,
                redelivered,
                ..
            } => Some((*consumer, *id, *redelivered)),
            Effect::Removed { .. }
            | Effect::Requeued { .. }
            | Effect::Failed { .. }
            | Effect::KeyForgotten { .. }
            | Effect::Scheduled { .. }
            | Effect::Unscheduled { .. } => None,
        })
        .collect()
}

#[test]
fn round_robin_within_prefetch_and_fifo() {
    let mut q = QueueMachine::new();
    let mut fx = Vec::new();
    q.apply(0, Command::Checkout(1, spec(2)), &mut fx).unwrap();
    q.apply(0, Command::Checkout(2, spec(2)), &mut fx).unwrap();
    for i in 0..6 {
        q.apply(0, Command::Enqueue(M(i)), &mut fx).unwrap();
    }
    assert_eq!(
        delivered(&fx),
        vec![(1, 1, false), (2, 2, false), (1, 3, false), (2, 4, false)]
    );
    assert_eq!((q.ready_len(), q.unacked_len()), (2, 4));
    fx.clear();
    q.apply(0, Command::Settle(vec![1]), &mut fx).unwrap();
    assert_eq!(delivered(&fx), vec![(1, 5, false)]);
}

#[test]
fn returned_messages_go_back_in_original_order_marked_redelivered() {
    let mut q = QueueMachine::new();
    let mut fx = Vec::new();
    for i in 0..4 {
        q.apply(0, Command::Enqueue(M(i)), &mut fx).unwrap();
    }
    q.apply(0, Command::Checkout(1, spec(3)), &mut fx).unwrap();
    q.apply(0, Command::Cancel(1), &mut fx).unwrap();
    // Return out of order: 3, then 1.
    q.apply(0, Command::Return(vec![3, 1]), &mut fx).unwrap();
    q.apply(0, Command::Return(vec![2]), &mut fx).unwrap();
    fx.clear();
    q.apply(0, Command::Checkout(2, spec(0)), &mut fx).unwrap();
    assert_eq!(
        delivered(&fx),
        vec![(2, 1, true), (2, 2, true), (2, 3, true), (2, 4, false)]
    );
}

/// A node that went down takes its consumers with it: what they held, including what a
/// consumer cancelled before the node died still held, is returned redelivered, and the
/// consumers of other nodes keep theirs.
#[test]
fn down_returns_what_the_nodes_consumers_held_and_detaches_them() {
    let node1 = 1 << CONSUMER_NODE_SHIFT;
    let node2 = 2 << CONSUMER_NODE_SHIFT;
    let mut q = QueueMachine::new();
    let mut fx = Vec::new();
    for i in 0..6 {
        q.apply(0, Command::Enqueue(M(i)), &mut fx).unwrap();
    }
    q.apply(0, Command::Checkout(node1 + 1, spec(2)), &mut fx)
        .unwrap();
    q.apply(0, Command::Checkout(node1 + 2, spec(1)), &mut fx)
        .unwrap();
    q.apply(0, Command::Checkout(node2 + 1, spec(1)), &mut fx)
        .unwrap();
    assert_eq!(q.unacked_len(), 4);
    // One of node 1's consumers was cancelled; its delivery is still out.
    q.apply(0, Command::Cancel(node1 + 2), &mut fx).unwrap();
    fx.clear();
    // A Down for node 1's previous run (ids below node1 + 1) takes nothing of this one.
    q.apply(
        0,
        Command::Down {
            node: 1,
            before: node1 + 1,
        },
        &mut fx,
    )
    .unwrap();
    assert_eq!((q.consumer_count(), q.unacked_len()), (2, 4));
    q.apply(
        0,
        Command::Down {
            node: 1,
            before: u64::MAX,
        },
        &mut fx,
    )
    .unwrap();
    assert_eq!(q.consumer_count(), 1, "only node 2's consumer is left");
    assert_eq!(q.unacked_len(), 1);
    assert_eq!(q.ready_len(), 5);
    // Node 2's consumer takes the returned messages first, in order, once it has credit.
    q.apply(0, Command::Settle(vec![4]), &mut fx).unwrap();
    assert_eq!(delivered(&fx), vec![(node2 + 1, 1, true)]);
    q.check_invariants();
}

#[test]
fn exclusive_consumers_exclude() {
    let mut q: QueueMachine<M> = QueueMachine::new();
    let mut fx = Vec::new();
    q.apply(0, Command::Checkout(1, spec(0)), &mut fx).unwrap();
    let ex = ConsumerSpec {
        exclusive: true,
        ..spec(0)
    };
    assert_eq!(
        q.apply(0, Command::Checkout(2, ex), &mut fx),
        Err(MachineError::ExclusiveInUse)
    );
    q.apply(0, Command::Cancel(1), &mut fx).unwrap();
    q.apply(0, Command::Checkout(2, ex), &mut fx).unwrap();
    assert_eq!(
        q.apply(0, Command::Checkout(3, spec(0)), &mut fx),
        Err(MachineError::ExclusiveInUse)
    );
}

#[test]
fn window_bounds_unwritten_deliveries_for_no_ack_consumers() {
    let mut q = QueueMachine::new();
    let mut fx = Vec::new();
    q.apply(
        0,
        Command::Checkout(
            1,
            ConsumerSpec {
                prefetch: 0,
                window: 2,
                window_bytes: u64::MAX,
                no_ack: true,
                exclusive: false,
                priority: 0,
                limited: false,
            },
        ),
        &mut fx,
    )
    .unwrap();
    for i in 0..5 {
        q.apply(0, Command::Enqueue(M(i)), &mut fx).unwrap();
    }
    assert_eq!(fx.len(), 2);
    q.apply(0, Command::Written(1, 2, 3), &mut fx).unwrap();
    assert_eq!(fx.len(), 4);
    assert_eq!(q.unacked_len(), 0);
    assert_eq!(q.counters().settled, 4);
}

#[test]
fn byte_window_bounds_unwritten_deliveries_but_always_admits_one() {
    let mut q = QueueMachine::new();
    let mut fx = Vec::new();
    let spec = ConsumerSpec {
        window_bytes: 5,
        ..spec(0)
    };
    q.apply(0, Command::Checkout(1, spec), &mut fx).unwrap();
    // Sizes 4, 4, 1: the second delivery starts below the budget, the third waits.
    for m in [M(3), M(3), M(0)] {
        q.apply(0, Command::Enqueue(m), &mut fx).unwrap();
    }
    assert_eq!(fx.len(), 2);
    q.apply(0, Command::Written(1, 2, 8), &mut fx).unwrap();
    assert_eq!(fx.len(), 3);
    // A message larger than the whole budget still goes out when nothing is unwritten.
    let mut q = QueueMachine::new();
    let mut fx = Vec::new();
    let tiny = ConsumerSpec {
        window_bytes: 1,
        ..spec
    };
    q.apply(0, Command::Checkout(1, tiny), &mut fx).unwrap();
    q.apply(0, Command::Enqueue(M(6)), &mut fx).unwrap();
    q.apply(0, Command::Enqueue(M(6)), &mut fx).unwrap();
    assert_eq!(fx.len(), 1);
}

#[test]
fn higher_priority_consumers_are_served_first_while_they_have_credit() {
    let mut q = QueueMachine::new();
    let mut fx = Vec::new();
    q.apply(0, Command::Checkout(1, spec(0)), &mut fx).unwrap();
    q.apply(
        0,
        Command::Checkout(
            2,
            ConsumerSpec {
                priority: 10,
                ..spec(2)
            },
        ),
        &mut fx,
    )
    .unwrap();
    for i in 0..4 {
        q.apply(0, Command::Enqueue(M(i)), &mut fx).unwrap();
    }
    // Consumer 2 takes two (its prefetch), then the lower-priority consumer gets the rest.
    assert_eq!(
        delivered(&fx),
        vec![(2, 1, false), (2, 2, false), (1, 3, false), (1, 4, false)]
    );
}

#[test]
fn limited_consumers_receive_one_message_per_grant() {
    let mut q = QueueMachine::new();
    let mut fx = Vec::new();
    for i in 0..4 {
        q.apply(0, Command::Enqueue(M(i)), &mut fx).unwrap();
    }
    let limited = ConsumerSpec {
        limited: true,
        ..spec(0)
    };
    q.apply(0, Command::Checkout(1, limited), &mut fx).unwrap();
    let mut want = Vec::new();
    q.grant_candidates(&mut want);
    assert!(fx.is_empty() && want == [1]);
    q.apply(0, Command::Grant(1), &mut fx).unwrap();
    q.apply(0, Command::Grant(1), &mut fx).unwrap();
    assert_eq!(delivered(&fx), vec![(1, 1, false), (1, 2, false)]);
    assert!(!q.holds_grant(1));
    // Lifting the limit serves the rest; imposing it again stops it.
    fx.clear();
    q.apply(0, Command::SetLimited(1, false), &mut fx).unwrap();
    assert_eq!(delivered(&fx), vec![(1, 3, false), (1, 4, false)]);
    q.apply(0, Command::SetLimited(1, true), &mut fx).unwrap();
    q.apply(0, Command::Enqueue(M(9)), &mut fx).unwrap();
    assert_eq!(fx.len(), 2);
    assert_eq!(q.ready_len(), 1);
    // Nothing ready: no grant is asked for (it would idle a slot of the shared limit).
    q.apply(0, Command::Grant(1), &mut fx).unwrap();
    want.clear();
    q.grant_candidates(&mut want);
    assert!(want.is_empty());
}

#[test]
fn swap_replaces_a_reference_without_moving_it() {
    let mut q = QueueMachine::new();
    let mut fx = Vec::new();
    for i in 0..3 {
        q.apply(0, Command::Enqueue(M(i)), &mut fx).unwrap();
    }
    // M(7) and M(0) have the same size (7 % 7 + 1 == 0 % 7 + 1).
    q.apply(0, Command::Swap { id: 1, msg: M(7) }, &mut fx)
        .unwrap();
    q.apply(0, Command::Swap { id: 99, msg: M(7) }, &mut fx)
        .unwrap();
    assert_eq!(
        q.apply(0, Command::Get { no_ack: false }, &mut fx),
        Ok(Reply::Got(Some((1, M(7), false, 2, 0))))
    );
    q.apply(0, Command::Swap { id: 1, msg: M(14) }, &mut fx)
        .unwrap();
    q.apply(0, Command::Return(vec![1]), &mut fx).unwrap();
    assert_eq!(
        q.apply(0, Command::Get { no_ack: true }, &mut fx),
        Ok(Reply::Got(Some((1, M(14), true, 2, 1))))
    );
}

#[test]
fn priorities_are_served_highest_first_fifo_within_a_level_and_clamped() {
    let mut q = QueueMachine::with_config(QueueConfig {
        max_priority: Some(3),
        ..QueueConfig::default()
    });
    let mut fx = Vec::new();
    // ids 1..=5 with priorities 0, 5 (clamped to 3), 1, 3, 2.
    for m in [M(0), M(500), M(100), M(300), M(200)] {
        q.apply(0, Command::Enqueue(m), &mut fx).unwrap();
    }
    let order: Vec<MsgId> = (0..5)
        .filter_map(|_| got_id(q.apply(0, Command::Get { no_ack: false }, &mut fx)))
        .collect();
    assert_eq!(order, [2, 4, 5, 3, 1]);
    // A requeued message keeps its priority and goes before fresh ones of its level.
    q.apply(0, Command::Return(vec![4, 3]), &mut fx).unwrap();
    q.apply(0, Command::Enqueue(M(301)), &mut fx).unwrap();
    let order: Vec<MsgId> = (0..3)
        .filter_map(|_| got_id(q.apply(0, Command::Get { no_ack: true }, &mut fx)))
        .collect();
    assert_eq!(order, [4, 6, 3]);
}

#[test]
fn without_max_priority_the_priority_property_is_ignored() {
    let mut q = QueueMachine::new();
    let mut fx = Vec::new();
    for m in [M(0), M(900)] {
        q.apply(0, Command::Enqueue(m), &mut fx).unwrap();
    }
    assert_eq!(
        got_id(q.apply(0, Command::Get { no_ack: true }, &mut fx)),
        Some(1)
    );
}

#[test]
fn drop_head_trims_ready_messages_after_waiting_consumers_took_theirs() {
    let mut q = QueueMachine::with_config(QueueConfig {
        max_length: Some(2),
        ..QueueConfig::default()
    });
    let mut fx = Vec::new();
    for i in 0..3 {
        q.apply(0, Command::Enqueue(M(i)), &mut fx).unwrap();
    }
    assert_eq!(removed(&fx), [(1, Removal::MaxLen)]);
    assert_eq!(q.ready_len(), 2);
    assert_eq!(q.counters().dropped, 1);
    // Unacked messages do not count; a consumer with credit takes a message before the limit
    // applies.
    fx.clear();
    q.apply(0, Command::Checkout(1, spec(1)), &mut fx).unwrap();
    q.apply(0, Command::Enqueue(M(3)), &mut fx).unwrap();
    q.apply(0, Command::Enqueue(M(4)), &mut fx).unwrap();
    assert_eq!(delivered(&fx), [(1, 2, false)]);
    assert_eq!(removed(&fx), [(3, Removal::MaxLen)]);
    assert_eq!((q.ready_len(), q.unacked_len()), (2, 1));
}

#[test]
fn max_length_bytes_counts_ready_body_bytes() {
    let mut q = QueueMachine::with_config(QueueConfig {
        max_length_bytes: Some(10),
        ..QueueConfig::default()
    });
    let mut fx = Vec::new();
    // Sizes 4, 4, 4: the third makes 12 > 10 and the head goes.
    for m in [M(3), M(10), M(17)] {
        q.apply(0, Command::Enqueue(m), &mut fx).unwrap();
    }
    assert_eq!(removed(&fx), [(1, Removal::MaxLen)]);
    assert_eq!(q.ready_bytes(), 8);
}

#[test]
fn reject_publish_refuses_at_the_limit_and_keeps_the_queue() {
    let mut q = QueueMachine::with_config(QueueConfig {
        max_length: Some(1),
        overflow: Overflow::RejectPublish,
        ..QueueConfig::default()
    });
    let mut fx = Vec::new();
    assert_eq!(q.apply(0, Command::Enqueue(M(1)), &mut fx), Ok(Reply::Ok));
    assert!(q.would_reject(&M(2)));
    assert_eq!(
        q.apply(0, Command::Enqueue(M(2)), &mut fx),
        Ok(Reply::Rejected(M(2)))
    );
    assert_eq!((q.ready_len(), q.counters().enqueued), (1, 1));
    assert!(fx.is_empty());
}

#[test]
fn ttl_expires_at_the_head_and_zero_ttl_only_reaches_waiting_consumers() {
    let mut q = QueueMachine::with_config(QueueConfig {
        message_ttl: Some(10),
        ..QueueConfig::default()
    });
    let mut fx = Vec::new();
    q.apply(0, Command::Enqueue(M(1)), &mut fx).unwrap();
    q.apply(5, Command::Enqueue(M(2)), &mut fx).unwrap();
    assert_eq!(q.next_expiry(), Some(10));
    q.apply(10, Command::Expire, &mut fx).unwrap();
    assert_eq!(removed(&fx), [(1, Removal::Expired)]);
    assert_eq!(q.next_expiry(), Some(15));
    // A requeued message keeps its original expiry.
    assert_eq!(
        got_id(q.apply(11, Command::Get { no_ack: false }, &mut fx)),
        Some(2)
    );
    q.apply(12, Command::Return(vec![2]), &mut fx).unwrap();
    assert_eq!(q.next_expiry(), Some(15));
    fx.clear();
    assert_eq!(
        got_id(q.apply(15, Command::Get { no_ack: true }, &mut fx)),
        None
    );
    assert_eq!(removed(&fx), [(2, Removal::Expired)]);

    // TTL 0: delivered to a consumer waiting for it, otherwise expired at once.
    let mut q = QueueMachine::with_config(QueueConfig {
        message_ttl: Some(0),
        ..QueueConfig::default()
    });
    let mut fx = Vec::new();
    q.apply(0, Command::Enqueue(M(1)), &mut fx).unwrap();
    assert_eq!(removed(&fx), [(1, Removal::Expired)]);
    q.apply(0, Command::Checkout(7, spec(1)), &mut fx).unwrap();
    q.apply(0, Command::Enqueue(M(2)), &mut fx).unwrap();
    assert_eq!(delivered(&fx), [(7, 2, false)]);
    q.apply(0, Command::Enqueue(M(3)), &mut fx).unwrap();
    assert_eq!(removed(&fx), [(1, Removal::Expired), (3, Removal::Expired)]);
}

#[test]
fn the_shorter_of_queue_and_message_ttl_applies() {
    let mut q = QueueMachine::with_config(QueueConfig {
        message_ttl: Some(100),
        ..QueueConfig::default()
    });
    let mut fx = Vec::new();
    // M(9): own TTL 9 % 4 = 1 ms.
    q.apply(0, Command::Enqueue(M(9)), &mut fx).unwrap();
    assert_eq!(q.next_expiry(), Some(1));
}

#[test]
fn single_active_consumer_serves_one_and_fails_over_in_attach_order() {
    let mut q = QueueMachine::with_config(QueueConfig {
        single_active: true,
        ..QueueConfig::default()
    });
    let mut fx = Vec::new();
    q.apply(0, Command::Checkout(1, spec(1)), &mut fx).unwrap();
    q.apply(0, Command::Checkout(2, spec(1)), &mut fx).unwrap();
    q.apply(0, Command::Checkout(3, spec(1)), &mut fx).unwrap();
    for i in 0..3 {
        q.apply(0, Command::Enqueue(M(i)), &mut fx).unwrap();
    }
    // Only consumer 1 receives, within its prefetch of 1.
    assert_eq!(delivered(&fx), [(1, 1, false)]);
    fx.clear();
    // It leaves with its message unacked: consumer 2 takes over; the message comes back.
    q.apply(0, Command::Cancel(1), &mut fx).unwrap();
    assert_eq!(delivered(&fx), [(2, 2, false)]);
    fx.clear();
    q.apply(0, Command::Return(vec![1]), &mut fx).unwrap();
    q.apply(0, Command::Settle(vec![2]), &mut fx).unwrap();
    assert_eq!(delivered(&fx), [(2, 1, true)]);
}

#[test]
fn delivery_limit_removes_a_message_returned_too_often() {
    let mut q = QueueMachine::with_config(QueueConfig {
        delivery_limit: Some(2),
        ..QueueConfig::default()
    });
    let mut fx = Vec::new();
    q.apply(0, Command::Enqueue(M(1)), &mut fx).unwrap();
    for returned in 0..3 {
        let got = q.apply(0, Command::Get { no_ack: false }, &mut fx);
        assert_eq!(got_id(got), Some(1), "delivery after {returned} returns");
        q.apply(0, Command::Return(vec![1]), &mut fx).unwrap();
    }
    assert_eq!(removed(&fx), [(1, Removal::DeliveryLimit)]);
    assert_eq!(q.ready_len(), 0);
}

#[test]
fn get_and_purge() {
    let mut q = QueueMachine::new();
    let mut fx = Vec::new();
    for i in 0..3 {
        q.apply(0, Command::Enqueue(M(i)), &mut fx).unwrap();
    }
    assert_eq!(
        q.apply(0, Command::Get { no_ack: false }, &mut fx),
        Ok(Reply::Got(Some((1, M(0), false, 2, 0))))
    );
    assert_eq!(q.apply(0, Command::Purge, &mut fx), Ok(Reply::Purged(2)));
    assert_eq!(
        q.apply(0, Command::Get { no_ack: true }, &mut fx),
        Ok(Reply::Got(None))
    );
    q.apply(0, Command::Return(vec![1]), &mut fx).unwrap();
    assert_eq!(
        q.apply(0, Command::Get { no_ack: true }, &mut fx),
        Ok(Reply::Got(Some((1, M(0), true, 0, 1))))
    );
}

/// A naive model: sets of ids and per-consumer counts.
#[derive(Default)]
struct Model {
    next: u64,
    ready: BTreeSet<u64>,
    redelivered: BTreeSet<u64>,
    unacked: BTreeMap<u64, Option<u64>>,
    consumers: BTreeMap<u64, MC>,
}

/// Model consumer.
struct MC {
    prefetch: u32,
    unacked: u32,
    limited: bool,
    granted: bool,
}

impl MC {
    fn has_credit(&self) -> bool {
        (self.prefetch == 0 || self.unacked < self.prefetch) && (!self.limited || self.granted)
    }
}

#[derive(Debug, Clone)]
enum Op {
    Enqueue,
    Checkout(u64, u32, bool),
    Cancel(u64),
    Grant(u64),
    Settle(usize),
    Return(usize),
    Discard(usize),
    Get(bool),
    Purge,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Enqueue),
        1 => (0u64..4, 0u32..4, any::<bool>()).prop_map(|(c, p, l)| Op::Checkout(c, p, l)),
        1 => (0u64..4).prop_map(Op::Cancel),
        2 => (0u64..4).prop_map(Op::Grant),
        2 => (0usize..8).prop_map(Op::Settle),
        2 => (0usize..8).prop_map(Op::Return),
        1 => (0usize..8).prop_map(Op::Discard),
        1 => any::<bool>().prop_map(Op::Get),
        1 => Just(Op::Purge),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The machine agrees with the model on every step: deliveries always take the smallest
    /// ready id, go to a consumer with credit, and the ready/unacked sets match.
    #[test]
    fn machine_matches_model(ops in proptest::collection::vec(op(), 1..120)) {
        let mut q: QueueMachine<M> = QueueMachine::new();
        let mut m = Model { next: 1, ..Model::default() };
        for op in ops {
            let mut fx = Vec::new();
            let pick = |m: &Model, i: usize| m.unacked.keys().nth(i % m.unacked.len().max(1)).copied();
            match op {
                Op::Enqueue => {
                    q.apply(0, Command::Enqueue(M(m.next)), &mut fx).unwrap();
                    m.ready.insert(m.next);
                    m.next += 1;
                }
                Op::Checkout(c, p, limited) => {
                    let r = q.apply(0, Command::Checkout(c, ConsumerSpec { limited, ..spec(p) }), &mut fx);
                    if m.consumers.contains_key(&c) {
                        prop_assert_eq!(r, Err(MachineError::DuplicateConsumer));
                    } else {
                        prop_assert!(r.is_ok());
                        m.consumers.insert(c, MC { prefetch: p, unacked: 0, limited, granted: false });
                    }
                }
                Op::Grant(c) => {
                    q.apply(0, Command::Grant(c), &mut fx).unwrap();
                    if let Some(mc) = m.consumers.get_mut(&c) && mc.limited { mc.granted = true; }
                }
                Op::Cancel(c) => {
                    q.apply(0, Command::Cancel(c), &mut fx).unwrap();
                    m.consumers.remove(&c);
                    for owner in m.unacked.values_mut() {
                        if *owner == Some(c) { *owner = None; }
                    }
                }
                Op::Settle(i) | Op::Discard(i) | Op::Return(i) => {
                    let Some(id) = pick(&m, i) else { continue };
                    let owner = m.unacked.remove(&id).flatten();
                    if let Some(o) = owner.and_then(|o| m.consumers.get_mut(&o)) { o.unacked -= 1; }
                    let cmd = match op {
                        Op::Settle(_) => Command::Settle(vec![id]),
                        Op::Discard(_) => Command::Discard(vec![id]),
                        _ => { m.ready.insert(id); m.redelivered.insert(id); Command::Return(vec![id]) }
                    };
                    q.apply(0, cmd, &mut fx).unwrap();
                }
                Op::Get(no_ack) => {
                    let r = q.apply(0, Command::Get { no_ack }, &mut fx).unwrap();
                    let expected = m.ready.pop_first();
                    match (r, expected) {
                        (Reply::Got(None), None) => {}
                        (Reply::Got(Some((id, _, redelivered, left, _))), Some(e)) => {
                            prop_assert_eq!(id, e);
                            prop_assert_eq!(redelivered, m.redelivered.contains(&e));
                            prop_assert_eq!(left as usize, m.ready.len());
                            if !no_ack { m.unacked.insert(id, None); }
                        }
                        (r, e) => prop_assert!(false, "get mismatch {:?} vs {:?}", r, e),
                    }
                }
                Op::Purge => {
                    let r = q.apply(0, Command::Purge, &mut fx).unwrap();
                    prop_assert_eq!(r, Reply::Purged(m.ready.len() as u32));
                    m.ready.clear();
                }
            }
            for (consumer, id, redelivered) in delivered(&fx) {
                let expected = m.ready.pop_first();
                prop_assert_eq!(Some(id), expected, "deliveries take the oldest ready message");
                prop_assert_eq!(redelivered, m.redelivered.contains(&id));
                let c = m.consumers.get_mut(&consumer).expect("delivered to a live consumer");
                prop_assert!(c.has_credit(), "delivery within prefetch and grant");
                c.unacked += 1;
                c.granted = false;
                m.unacked.insert(id, Some(consumer));
            }
            // If messages are ready, no consumer may have spare credit.
            if !m.ready.is_empty() {
                prop_assert!(m.consumers.values().all(|c| !c.has_credit()));
            }
            prop_assert_eq!(q.ready_len(), m.ready.len());
            prop_assert_eq!(q.unacked_len(), m.unacked.len());
        }
    }
}

fn config() -> impl Strategy<Value = QueueConfig> {
    (
        proptest::option::of(0u8..4),
        proptest::option::of(0u64..5),
        proptest::option::of(0u64..20),
        prop_oneof![
            Just(Overflow::DropHead),
            Just(Overflow::RejectPublish),
            Just(Overflow::RejectPublishDlx)
        ],
        proptest::option::of(0u64..6),
    )
        .prop_map(
            |(max_priority, max_length, max_length_bytes, overflow, message_ttl)| QueueConfig {
                max_priority: max_priority.filter(|p| *p > 0),
                max_length,
                max_length_bytes,
                overflow,
                message_ttl,
                single_active: message_ttl.is_some_and(|t| t % 2 == 0),
                delivery_limit: max_length.map(|n| u32::try_from(n).unwrap_or(0)),
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// With priorities and length limits, over random commands: the machine's invariants hold
    /// after every step (checked inside `apply` in tests), every accepted message is accounted
    /// for exactly once (queued, unacked, or reported removed), and a delivery or get never
    /// passes over a ready message of a higher priority level.
    #[test]
    fn limits_and_priorities_account_for_every_message(
        cfg in config(),
        ops in proptest::collection::vec((0u8..7, 0u64..600, 0usize..8, 0u64..3), 1..150),
    ) {
        let mut q: QueueMachine<M> = QueueMachine::with_config(cfg);
        let mut unacked: Vec<MsgId> = Vec::new();
        let mut accepted = 0u64;
        let mut gone = 0u64;
        let mut now = 0u64;
        for (kind, value, pick, dt) in ops {
            now += dt;
            let mut fx = Vec::new();
            let reply = match kind {
                0 | 1 => q.apply(now, Command::Enqueue(M(value)), &mut fx).unwrap(),
                2 => q.apply(now, Command::Get { no_ack: pick % 2 == 0 }, &mut fx).unwrap(),
                3 if !unacked.is_empty() => {
                    let id = unacked.remove(pick % unacked.len());
                    q.apply(now, Command::Return(vec![id]), &mut fx).unwrap()
                }
                4 if !unacked.is_empty() => {
                    let id = unacked.remove(pick % unacked.len());
                    q.apply(now, Command::Settle(vec![id]), &mut fx).unwrap()
                }
                5 => q.apply(now, Command::Checkout(value % 3, spec(1)), &mut fx).unwrap_or(Reply::Ok),
                6 => q.apply(now, Command::Expire, &mut fx).unwrap(),
                _ => Reply::Ok,
            };
            match reply {
                Reply::Ok if kind <= 1 => accepted += 1,
                Reply::Got(Some((id, msg, _, _, _))) => {
                    // Nothing of a higher level is left behind a get.
                    if let Some(top) = q.levels.keys().next_back() {
                        prop_assert!(q.level_of(&msg) >= *top, "get takes the highest level");
                    }
                    if pick % 2 != 0 { unacked.push(id); }
                }
                _ => {}
            }
            // Nothing expired is left at a head.
            for l in q.levels.values() {
                if let Some(r) = l.peek() {
                    prop_assert!(r.expires_at().is_none_or(|at| at > q.now), "expired head left");
                }
            }
            for e in &fx {
                match e {
                    Effect::Removed { .. } => gone += 1,
                    Effect::Deliver { id, settled, .. } => {
                        if *settled { gone += 1 } else { unacked.push(*id) }
                    }
                    Effect::Requeued { .. }
                    | Effect::Failed { .. }
                    | Effect::KeyForgotten { .. }
                    | Effect::Scheduled { .. }
                    | Effect::Unscheduled { .. } => {}
                }
            }
            prop_assert_eq!(
                accepted,
                gone + q.ready_len() as u64 + q.unacked_len() as u64,
                "every accepted message is queued, unacked or removed"
            );
        }
    }
}

#[test]
fn oldest_ready_counts_from_first_enqueue_across_priorities_and_returns() {
    let mut q = QueueMachine::with_config(QueueConfig {
        max_priority: Some(5),
        ..QueueConfig::default()
    });
    let mut fx = Vec::new();
    assert_eq!(q.oldest_ready_at(), None);
    q.apply(10, Command::Enqueue(M(1)), &mut fx).unwrap();
    q.apply(20, Command::Enqueue(M(300)), &mut fx).unwrap();
    // The high-priority message leaves first; the oldest ready is still the t=10 one.
    let high = got_id(q.apply(30, Command::Get { no_ack: false }, &mut fx)).unwrap();
    assert_eq!(q.oldest_ready_at(), Some(10));
    let low = got_id(q.apply(40, Command::Get { no_ack: false }, &mut fx)).unwrap();
    assert_eq!(q.oldest_ready_at(), None);
    // Returned messages keep the time they first arrived.
    q.apply(50, Command::Return(vec![high]), &mut fx).unwrap();
    assert_eq!(q.oldest_ready_at(), Some(20));
    q.apply(60, Command::Return(vec![low]), &mut fx).unwrap();
    assert_eq!(q.oldest_ready_at(), Some(10));
    let c = q.counters();
    assert_eq!((c.got, c.redelivered, c.delivered, c.acked), (2, 0, 0, 0));
    let again = got_id(q.apply(70, Command::Get { no_ack: false }, &mut fx)).unwrap();
    q.apply(80, Command::Settle(vec![again]), &mut fx).unwrap();
    let c = q.counters();
    assert_eq!((c.got, c.redelivered, c.acked), (3, 1, 1));
}

/// Requeues a quorum queue without a delivery limit makes (`Effect::Requeued`), as (old, new).
fn requeued(effects: &[Effect<M>]) -> Vec<(MsgId, MsgId)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Requeued { old, new, .. } => Some((*old, *new)),
            _ => None,
        })
        .collect()
}

#[test]
fn without_a_delivery_limit_returned_messages_go_to_the_back() {
    // Goal: rabbit_fifo without a delivery limit requeues a message the client gives back
    // behind those already waiting, and counts its deliveries without ever removing it; a
    // return the client did not ask for keeps its place. Method: three messages, take the
    // first, requeue it: the order is now 2, 3, 1, under a new id.
    let mut q = QueueMachine::with_config(QueueConfig {
        delivery_limit: Some(DELIVERY_LIMIT_NONE),
        ..QueueConfig::default()
    });
    let mut fx = Vec::new();
    for i in 1..=3 {
        q.apply(0, Command::Enqueue(M(i)), &mut fx).unwrap();
    }
    let first = got_id(q.apply(0, Command::Get { no_ack: false }, &mut fx)).unwrap();
    q.apply(0, Command::Requeue(vec![first]), &mut fx).unwrap();
    assert_eq!(requeued(&fx), vec![(first, 4)]);
    let mut order = Vec::new();
    for _ in 0..3 {
        match q.apply(0, Command::Get { no_ack: false }, &mut fx).unwrap() {
            Reply::Got(Some((id, msg, redelivered, _, count))) => {
                order.push((id, msg.0, redelivered, count));
            }
            other => panic!("expected a message, got {other:?}"),
        }
    }
    assert_eq!(
        order,
        vec![(2, 2, false, 0), (3, 3, false, 0), (4, 1, true, 1)]
    );
    // Returned without the client asking (a channel closed): back in its place, first.
    let mut back = Vec::new();
    q.apply(0, Command::Return(vec![3]), &mut back).unwrap();
    assert!(requeued(&back).is_empty(), "{back:?}");
    assert_eq!(
        got_id(q.apply(0, Command::Get { no_ack: false }, &mut fx)),
        Some(3)
    );
    // Returned far more often than any limit allows: never removed, counted every time.
    let (mut id, mut count) = (4, 1);
    q.apply(0, Command::Settle(vec![2, 3]), &mut fx).unwrap();
    for _ in 0..50 {
        fx.clear();
        q.apply(0, Command::Requeue(vec![id]), &mut fx).unwrap();
        assert!(removed(&fx).is_empty());
        id = requeued(&fx)[0].1;
        count += 1;
        match q.apply(0, Command::Get { no_ack: false }, &mut fx).unwrap() {
            Reply::Got(Some((got, _, true, _, c))) => assert_eq!((got, c), (id, count)),
            other => panic!("expected the requeued message, got {other:?}"),
        }
    }
    q.check_invariants();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Without a delivery limit, against a FIFO model: every return puts the message at the
    /// tail under a fresh, larger id (Requeued names both), every get takes the model's head,
    /// nothing is ever removed but by a settle, and ids stay in increasing order.
    #[test]
    fn returns_to_the_back_match_a_fifo_model(
        ops in proptest::collection::vec((0u8..4, 0usize..8), 1..150),
    ) {
        let mut q: QueueMachine<M> = QueueMachine::with_config(QueueConfig {
            delivery_limit: Some(DELIVERY_LIMIT_NONE),
            ..QueueConfig::default()
        });
        // (id, payload) in serving order; unacked (id -> payload).
        let mut fifo: std::collections::VecDeque<(MsgId, u64)> = std::collections::VecDeque::new();
        let mut unacked: BTreeMap<MsgId, u64> = BTreeMap::new();
        let mut payload = 0u64;
        for (kind, pick) in ops {
            let mut fx = Vec::new();
            match kind {
                0 => {
                    payload += 1;
                    q.apply(0, Command::Enqueue(M(payload)), &mut fx).unwrap();
                    fifo.push_back((q.next_id() - 1, payload));
                }
                1 => {
                    let r = q.apply(0, Command::Get { no_ack: false }, &mut fx).unwrap();
                    match (r, fifo.pop_front()) {
                        (Reply::Got(None), None) => {}
                        (Reply::Got(Some((id, msg, _, _, _))), Some((e, p))) => {
                            prop_assert_eq!((id, msg.0), (e, p));
                            unacked.insert(id, p);
                        }
                        (r, e) => prop_assert!(false, "get {:?} vs model {:?}", r, e),
                    }
                }
                2 if !unacked.is_empty() => {
                    let id = *unacked.keys().nth(pick % unacked.len()).unwrap();
                    let p = unacked.remove(&id).unwrap();
                    q.apply(0, Command::Requeue(vec![id]), &mut fx).unwrap();
                    let moved = requeued(&fx);
                    prop_assert_eq!(moved.len(), 1);
                    prop_assert_eq!(moved[0].0, id);
                    prop_assert!(fifo.back().is_none_or(|(b, _)| *b < moved[0].1));
                    fifo.push_back((moved[0].1, p));
                }
                3 if !unacked.is_empty() => {
                    let id = *unacked.keys().nth(pick % unacked.len()).unwrap();
                    unacked.remove(&id);
                    q.apply(0, Command::Settle(vec![id]), &mut fx).unwrap();
                }
                _ => {}
            }
            prop_assert!(removed(&fx).iter().all(|(_, r)| *r == Removal::Settled));
            prop_assert_eq!(q.ready_len(), fifo.len());
            prop_assert_eq!(q.unacked_len(), unacked.len());
        }
    }
}
