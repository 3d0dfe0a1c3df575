//! The group machine against a model of the members: random joins, leaves, node losses and
//! releases (members release what they are told to give up, in any order); after every step
//! no partition is with two members, and once every release is in, every partition is owned by
//! a member and shares differ by at most one. The machine's state survives a snapshot (serde)
//! and the same commands give the same effects (replay).

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::machine::*;

fn key() -> GroupKey {
    GroupKey {
        vhost: "/".into(),
        queue: "orders".into(),
        group: "g".into(),
    }
}

fn member(n: u8) -> MemberId {
    MemberId {
        node: u64::from(n % 3),
        consumer: u64::from(n),
    }
}

#[derive(Debug, Clone)]
enum Step {
    Join(u8),
    Leave(u8),
    /// Deliver the pending release at this position (modulo the number pending).
    Release(usize),
    NodeDown(u8),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0u8..8).prop_map(Step::Join),
        2 => (0u8..8).prop_map(Step::Leave),
        4 => any::<usize>().prop_map(Step::Release),
        1 => (0u8..3).prop_map(Step::NodeDown),
    ]
}

/// What the members believe: who consumes each partition, and the revokes they still have to
/// release.
#[derive(Debug, Default)]
struct Model {
    members: Vec<MemberId>,
    owner: BTreeMap<u32, MemberId>,
    pending: Vec<(MemberId, u32)>,
    epoch: u64,
}

impl Model {
    fn effects(&mut self, effects: Vec<GroupEffect>) {
        for e in effects {
            match e {
                GroupEffect::Assign {
                    member,
                    partition,
                    epoch,
                    ..
                } => {
                    assert!(self.members.contains(&member), "assigned to a non-member");
                    assert!(
                        !self.owner.contains_key(&partition),
                        "partition {partition} assigned to {member:?} while {:?} has it",
                        self.owner[&partition]
                    );
                    assert!(epoch >= self.epoch && epoch > 0, "epochs never go back");
                    self.epoch = epoch;
                    self.owner.insert(partition, member);
                }
                GroupEffect::Revoke {
                    member, partition, ..
                } => {
                    assert_eq!(
                        self.owner.get(&partition),
                        Some(&member),
                        "revoked from a non-owner"
                    );
                    self.pending.push((member, partition));
                }
            }
        }
    }

    fn gone(&mut self, m: MemberId) {
        self.members.retain(|x| *x != m);
        // A member that leaves returned its deliveries: it holds nothing.
        self.owner.retain(|_, o| *o != m);
        self.pending.retain(|(o, _)| *o != m);
    }
}

fn apply(t: &mut GroupTable, c: GroupCommand) -> Vec<GroupEffect> {
    let mut out = Vec::new();
    t.apply(c, &mut out);
    out
}

fn run(steps: &[Step], partitions: u32) -> (GroupTable, Model, Vec<Vec<GroupEffect>>) {
    let mut t = GroupTable::default();
    let mut model = Model::default();
    let mut log = Vec::new();
    for s in steps {
        let command = match s {
            Step::Join(n) => {
                if !model.members.contains(&member(*n)) {
                    model.members.push(member(*n));
                }
                GroupCommand::Join {
                    key: key(),
                    member: member(*n),
                    partitions,
                    tag: format!("t{n}"),
                }
            }
            Step::Leave(n) => {
                model.gone(member(*n));
                GroupCommand::Leave {
                    key: key(),
                    member: member(*n),
                }
            }
            Step::Release(i) => {
                if model.pending.is_empty() {
                    continue;
                }
                let (m, p) = model.pending.remove(i % model.pending.len());
                model.owner.remove(&p);
                GroupCommand::Released {
                    key: key(),
                    member: m,
                    partition: p,
                }
            }
            Step::NodeDown(node) => {
                for m in model.members.clone() {
                    if m.node == u64::from(*node) {
                        model.gone(m);
                    }
                }
                GroupCommand::NodeDown {
                    node: u64::from(*node),
                }
            }
        };
        let effects = apply(&mut t, command);
        log.push(effects.clone());
        model.effects(effects);
    }
    (t, model, log)
}

fn settle(t: &mut GroupTable, model: &mut Model) {
    while let Some((m, p)) = model.pending.pop() {
        model.owner.remove(&p);
        let effects = apply(
            t,
            GroupCommand::Released {
                key: key(),
                member: m,
                partition: p,
            },
        );
        model.effects(effects);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn one_owner_per_partition_and_balanced_once_released(
        steps in proptest::collection::vec(step(), 0..60),
        partitions in 1u32..13,
    ) {
        let (mut t, mut model, _) = run(&steps, partitions);
        settle(&mut t, &mut model);
        if model.members.is_empty() {
            prop_assert!(t.group(&key()).is_none());
            prop_assert!(model.owner.is_empty());
            return Ok(());
        }
        let g = t.group(&key()).expect("a group with members");
        prop_assert_eq!(g.members(), &model.members[..]);
        prop_assert_eq!(model.owner.len() as u32, partitions, "every partition owned");
        let mut counts: BTreeMap<MemberId, usize> = model.members.iter().map(|m| (*m, 0)).collect();
        for (p, m) in &model.owner {
            prop_assert_eq!(g.slots()[*p as usize], Slot::Owned(*m));
            *counts.get_mut(m).expect("an owner is a member") += 1;
        }
        let (lo, hi) = (counts.values().min().unwrap(), counts.values().max().unwrap());
        prop_assert!(hi - lo <= 1, "unbalanced: {counts:?}");
    }

    #[test]
    fn a_snapshot_continues_as_the_original_and_replay_is_deterministic(
        before in proptest::collection::vec(step(), 0..30),
        after in proptest::collection::vec(step(), 0..30),
    ) {
        let (t, _, log) = run(&before, 6);
        let (t2, _, log2) = run(&before, 6);
        prop_assert_eq!(&t, &t2);
        prop_assert_eq!(log, log2);
        let bytes = serde_json::to_vec(&t).expect("serialisable");
        let restored: GroupTable = serde_json::from_slice(&bytes).expect("readable");
        prop_assert_eq!(&restored, &t);
        // The same further commands give the same effects on both.
        let (mut a, mut b) = (t, restored);
        for s in &after {
            let c = match s {
                Step::Join(n) => GroupCommand::Join {
                    key: key(),
                    member: member(*n),
                    partitions: 6,
                    tag: format!("t{n}"),
                },
                Step::Leave(n) => GroupCommand::Leave { key: key(), member: member(*n) },
                Step::Release(i) => GroupCommand::Released {
                    key: key(),
                    member: member((*i % 8) as u8),
                    partition: (*i % 6) as u32,
                },
                Step::NodeDown(n) => GroupCommand::NodeDown { node: u64::from(*n) },
            };
            prop_assert_eq!(apply(&mut a, c.clone()), apply(&mut b, c));
        }
        prop_assert_eq!(a, b);
    }
}

#[test]
fn a_join_moves_only_the_surplus_after_its_release() {
    let mut t = GroupTable::default();
    let a = member(1);
    let b = member(2);
    let join = |m: MemberId| GroupCommand::Join {
        key: key(),
        member: m,
        partitions: 4,
        tag: format!("t{}", m.consumer),
    };
    let effects = apply(&mut t, join(a));
    assert_eq!(effects.len(), 4, "the first member gets every partition");
    let effects = apply(&mut t, join(b));
    assert_eq!(
        effects,
        vec![
            GroupEffect::Revoke {
                key: key(),
                member: a,
                partition: 3,
                epoch: 1
            },
            GroupEffect::Revoke {
                key: key(),
                member: a,
                partition: 2,
                epoch: 1
            },
        ],
        "nothing is assigned to b before a gives it up"
    );
    let effects = apply(
        &mut t,
        GroupCommand::Released {
            key: key(),
            member: a,
            partition: 2,
        },
    );
    assert_eq!(
        effects,
        vec![GroupEffect::Assign {
            key: key(),
            member: b,
            partition: 2,
            epoch: 2
        }]
    );
    // A second report of the same release changes nothing.
    assert!(
        apply(
            &mut t,
            GroupCommand::Released {
                key: key(),
                member: a,
                partition: 2
            }
        )
        .is_empty()
    );
    let g = t.group(&key()).unwrap();
    assert_eq!(g.owned_by(a).collect::<Vec<_>>(), [0, 1]);
    assert_eq!(g.slots()[3], Slot::Releasing(a));
    // a leaves: its partitions are free at once and go to b.
    let effects = apply(
        &mut t,
        GroupCommand::Leave {
            key: key(),
            member: a,
        },
    );
    let assigned: Vec<u32> = effects
        .iter()
        .map(|e| match e {
            GroupEffect::Assign {
                member, partition, ..
            } => {
                assert_eq!(*member, b);
                *partition
            }
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(assigned, [0, 1, 3]);
    assert_eq!(t.group(&key()).unwrap().epoch(), 3);
}
