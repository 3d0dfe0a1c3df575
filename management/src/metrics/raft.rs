//! rabbitmq_prometheus' Raft series of quorum queues (`rabbitmq_raft_*`), under RabbitMQ 3.x's
//! and 4.x's names.

use super::{QueueRow, Scrape};
use crate::AppState;

/// rabbitmq_prometheus' Raft series of quorum queues (this node's replica of each), under
/// RabbitMQ 3.x's names (`rabbitmq_raft_log_*_index`, `rabbitmq_raft_term_total`,
/// `rabbitmq_raft_entry_commit_latency_seconds`) and 4.x's (`rabbitmq_raft_*_index`,
/// `rabbitmq_raft_term`, `rabbitmq_raft_commit_latency_seconds`), so both generations of the
/// Quorum-Queues-Raft dashboard have data. (name, help, counter, value)
type RaftSeries = (&'static str, &'static str, bool, fn(&RaftView) -> f64);

/// What the Raft series report of one quorum queue on this node.
struct RaftView {
    term: u64,
    /// The last index applied here (Warren's replicas apply what commits, so this is also
    /// the commit index they report).
    applied: u64,
    last_written: u64,
    snapshot: u64,
    /// The node's mean publish-to-confirm time in seconds (quorum queues confirm once the
    /// entry committed): Warren keeps no commit latency per queue.
    commit_latency_s: f64,
}

const RAFT_SERIES: &[RaftSeries] = &[
    ("raft_term_total", "Current Raft term number", true, |r| {
        r.term as f64
    }),
    ("raft_term", "Current Raft term number", false, |r| {
        r.term as f64
    }),
    (
        "raft_log_last_applied_index",
        "Raft log last applied index",
        false,
        |r| r.applied as f64,
    ),
    ("raft_last_applied", "Last applied index", false, |r| {
        r.applied as f64
    }),
    (
        "raft_log_commit_index",
        "Raft log commit index",
        false,
        |r| r.applied as f64,
    ),
    ("raft_commit_index", "Commit index", false, |r| {
        r.applied as f64
    }),
    (
        "raft_log_last_written_index",
        "Raft log last written index",
        false,
        |r| r.last_written as f64,
    ),
    (
        "raft_last_written_index",
        "Last written index",
        false,
        |r| r.last_written as f64,
    ),
    (
        "raft_log_snapshot_index",
        "Raft log snapshot index",
        false,
        |r| r.snapshot as f64,
    ),
    ("raft_snapshot_index", "Snapshot index", false, |r| {
        r.snapshot as f64
    }),
    (
        "raft_entry_commit_latency_seconds",
        "Time taken for an entry to be committed",
        false,
        |r| r.commit_latency_s,
    ),
    (
        "raft_commit_latency_seconds",
        "Time taken for an entry to be committed",
        false,
        |r| r.commit_latency_s,
    ),
];

/// Per quorum queue when `per_object` (labelled `vhost`, `queue`), else summed, as
/// rabbitmq_prometheus aggregates them. A single node's quorum queue has no Raft log: it
/// reports term 1, the state changes its machine applied (enqueues and removals) as its
/// indices, and no snapshot.
pub(super) fn raft(
    state: &AppState,
    s: &Scrape,
    rows: &[QueueRow],
    labels: &[&str],
    per_object: bool,
) {
    let confirm = state.broker.stats().confirm_seconds.snapshot();
    let commit_latency_s = if confirm.count == 0 {
        0.0
    } else {
        confirm.sum / confirm.count as f64
    };
    let states: Vec<(&QueueRow, RaftView)> = rows
        .iter()
        .filter_map(|r| {
            if let Some(x) = r.queue.replica() {
                let st = x.replica_state(false);
                return Some((
                    r,
                    RaftView {
                        term: st.term,
                        applied: st.applied_index,
                        last_written: st.last_written_index,
                        snapshot: st.snapshot_index,
                        commit_latency_s,
                    },
                ));
            }
            if !r.queue.is_quorum {
                return None;
            }
            let c = &r.stats.counters;
            let applied = c.enqueued + c.settled + c.discarded + c.purged + c.dropped + c.expired;
            Some((
                r,
                RaftView {
                    term: 1,
                    applied,
                    last_written: applied,
                    snapshot: 0,
                    commit_latency_s,
                },
            ))
        })
        .collect();
    if states.is_empty() {
        return;
    }
    for (name, help, counter, value) in RAFT_SERIES {
        let name = format!("rabbitmq_{name}");
        if *counter {
            let Some(c) = s.counters(&name, help, labels) else {
                continue;
            };
            if per_object {
                for (r, st) in &states {
                    c.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                        .inc_by(value(st) as u64);
                }
            } else {
                c.with_label_values::<&str>(&[])
                    .inc_by(states.iter().map(|(_, st)| value(st) as u64).sum());
            }
        } else {
            let Some(g) = s.gauge(&name, help, labels) else {
                continue;
            };
            if per_object {
                for (r, st) in &states {
                    g.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                        .set(value(st));
                }
            } else if name.ends_with("latency_seconds") {
                // Aggregated, a latency is the worst queue's (rabbitmq_prometheus' max_).
                g.with_label_values::<&str>(&[])
                    .set(states.iter().map(|(_, st)| value(st)).fold(0.0, f64::max));
            } else {
                g.with_label_values::<&str>(&[])
                    .set(states.iter().map(|(_, st)| value(st)).sum());
            }
        }
    }
}
