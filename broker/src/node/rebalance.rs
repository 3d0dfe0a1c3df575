//! Which quorum queue leaders to move so that every running node leads about as many queues
//! (`rabbitmq-queues rebalance quorum`). Pure: it takes each queue's leader and members and
//! the running nodes, and returns the moves; carrying them out is the cluster's business
//! ([`crate::routing::cluster::ClusterHooks::transfer_leader`]).
//!
//! Invariants of a plan: each queue moves at most once, always to one of its own running
//! members other than its leader, and each move narrows the gap between the node it leaves
//! and the node it goes to (so a plan never makes the spread worse). When every queue has
//! every running node as a member, the plan leaves leader counts at most one apart.

use std::collections::BTreeMap;

/// One queue as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leadership {
    /// Its leader's node name (None during an election: it is left alone).
    pub leader: Option<String>,
    /// Its voting members' node names.
    pub members: Vec<String>,
}

/// A leader to move: the queue (its index in the planner's input) and the member to lead it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Move {
    /// Index into the queues given to [`plan`].
    pub queue: usize,
    /// The node that is to lead it.
    pub to: String,
}

/// Leaders per running node: how many of `queues` each leads (running nodes that lead none
/// count 0; leaders on nodes not running are not counted).
#[must_use]
pub fn leader_counts(queues: &[Leadership], running: &[String]) -> BTreeMap<String, usize> {
    let mut counts: BTreeMap<String, usize> = running.iter().map(|n| (n.clone(), 0)).collect();
    for q in queues {
        if let Some(c) = q.leader.as_ref().and_then(|l| counts.get_mut(l)) {
            *c += 1;
        }
    }
    counts
}

/// The moves that even out leaders over the `running` nodes.
///
/// Greedy, as RabbitMQ's rebalance: take a queue led by the busiest node and give it to its
/// least busy running member, while that narrows their gap (the member leads at least two
/// fewer); stop when no queue can move. At most one move per queue, so at most
/// `queues.len()` moves.
#[must_use]
pub fn plan(queues: &[Leadership], running: &[String]) -> Vec<Move> {
    let mut counts = leader_counts(queues, running);
    let mut leader: Vec<Option<String>> = queues.iter().map(|q| q.leader.clone()).collect();
    let mut moved = vec![false; queues.len()];
    let mut moves = Vec::new();
    loop {
        // The best move: from the busiest leader, to the least busy member (ties by name, so
        // every node computes the same plan).
        let mut best: Option<(usize, usize, usize, String)> = None; // (gap, from, queue, to)
        for (i, q) in queues.iter().enumerate() {
            if moved[i] {
                continue;
            }
            let Some(from) = leader[i].as_ref() else {
                continue;
            };
            let Some(&from_count) = counts.get(from) else {
                continue;
            };
            let target = q
                .members
                .iter()
                .filter(|m| *m != from)
                .filter_map(|m| counts.get(m).map(|c| (*c, m)))
                .min();
            let Some((to_count, to)) = target else {
                continue;
            };
            if to_count + 2 > from_count {
                continue;
            }
            let gap = from_count - to_count;
            let better = match &best {
                None => true,
                Some((g, f, _, _)) => gap > *g || (gap == *g && from_count > *f),
            };
            if better {
                best = Some((gap, from_count, i, to.clone()));
            }
        }
        let Some((_, _, i, to)) = best else {
            return moves;
        };
        if let Some(from) = leader[i].as_ref()
            && let Some(c) = counts.get_mut(from)
        {
            *c -= 1;
        }
        if let Some(c) = counts.get_mut(&to) {
            *c += 1;
        }
        leader[i] = Some(to.clone());
        moved[i] = true;
        moves.push(Move { queue: i, to });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn names(n: usize) -> Vec<String> {
        (1..=n).map(|i| format!("n{i}")).collect()
    }

    #[test]
    fn leaders_piled_on_one_node_spread_over_three() {
        let nodes = names(3);
        let queues: Vec<Leadership> = (0..6)
            .map(|_| Leadership {
                leader: Some("n1".into()),
                members: nodes.clone(),
            })
            .collect();
        let moves = plan(&queues, &nodes);
        assert_eq!(moves.len(), 4);
        let mut after = queues.clone();
        for m in &moves {
            after[m.queue].leader = Some(m.to.clone());
        }
        let counts = leader_counts(&after, &nodes);
        assert_eq!(counts.values().copied().collect::<Vec<_>>(), vec![2, 2, 2]);
    }

    #[test]
    fn a_balanced_cluster_and_a_leaderless_queue_are_left_alone() {
        let nodes = names(3);
        let mut queues: Vec<Leadership> = nodes
            .iter()
            .map(|n| Leadership {
                leader: Some(n.clone()),
                members: nodes.clone(),
            })
            .collect();
        queues.push(Leadership {
            leader: None,
            members: nodes.clone(),
        });
        assert!(plan(&queues, &nodes).is_empty());
    }

    #[test]
    fn a_queue_only_moves_to_its_own_running_members() {
        let running = vec!["n1".to_string(), "n2".to_string()];
        // n3 is down and n2 is not a member: nowhere to go.
        let queues = vec![
            Leadership {
                leader: Some("n1".into()),
                members: vec!["n1".into(), "n3".into()],
            },
            Leadership {
                leader: Some("n1".into()),
                members: vec!["n1".into(), "n3".into()],
            },
        ];
        assert!(plan(&queues, &running).is_empty());
    }

    /// Node count; per queue its leader (an index) and which nodes are members; which run.
    type Scenario = (usize, Vec<(Option<usize>, Vec<bool>)>, Vec<bool>);

    fn scenario() -> impl Strategy<Value = Scenario> {
        (1usize..=5).prop_flat_map(|n| {
            (
                Just(n),
                proptest::collection::vec(
                    (
                        proptest::option::weighted(0.9, 0..n),
                        proptest::collection::vec(any::<bool>(), n),
                    ),
                    0..20,
                ),
                proptest::collection::vec(proptest::bool::weighted(0.8), n),
            )
        })
    }

    proptest! {
        /// Against the simple model "each move goes to a running member, each queue moves at
        /// most once, and every move narrows a gap": and with full membership, leader counts
        /// end at most one apart.
        #[test]
        fn plans_keep_their_invariants((n, raw, up) in scenario(), full in any::<bool>()) {
            let nodes = names(n);
            let running: Vec<String> = nodes
                .iter()
                .zip(&up)
                .filter(|(_, up)| **up)
                .map(|(name, _)| name.clone())
                .collect();
            let queues: Vec<Leadership> = raw
                .iter()
                .map(|(leader, member)| {
                    let mut members: Vec<String> = if full {
                        nodes.clone()
                    } else {
                        nodes.iter().zip(member).filter(|(_, m)| **m).map(|(x, _)| x.clone()).collect()
                    };
                    if let Some(l) = leader && !members.contains(&nodes[*l]) {
                        members.push(nodes[*l].clone());
                    }
                    Leadership { leader: leader.map(|l| nodes[l].clone()), members }
                })
                .collect();
            let moves = plan(&queues, &running);
            let mut after = queues.clone();
            let mut seen = std::collections::BTreeSet::new();
            let mut counts = leader_counts(&queues, &running);
            for m in &moves {
                prop_assert!(seen.insert(m.queue), "a queue moved twice");
                let q = &queues[m.queue];
                prop_assert!(q.members.contains(&m.to));
                prop_assert!(running.contains(&m.to));
                let from = after[m.queue].leader.clone().expect("a leaderless queue moved");
                prop_assert_ne!(&from, &m.to);
                let (f, t) = (counts[&from], counts[&m.to]);
                prop_assert!(t + 2 <= f, "a move that does not narrow the gap");
                *counts.get_mut(&from).expect("counted") -= 1;
                *counts.get_mut(&m.to).expect("counted") += 1;
                after[m.queue].leader = Some(m.to.clone());
            }
            prop_assert_eq!(counts.clone(), leader_counts(&after, &running));
            let led_by_running = queues
                .iter()
                .filter(|q| q.leader.as_ref().is_some_and(|l| running.contains(l)))
                .count();
            prop_assert_eq!(counts.values().sum::<usize>(), led_by_running);
            if full && !running.is_empty() {
                let max = counts.values().max().copied().unwrap_or(0);
                let min = counts.values().min().copied().unwrap_or(0);
                prop_assert!(max - min <= 1, "unbalanced after the plan: {:?}", counts);
            }
        }
    }
}
