//! Warren's work-queue series per queue (`warren_queue_*`): scheduled and leased messages,
//! the oldest lease's age, and the counters of claims, extensions, releases, expired leases,
//! delayed retries, dropped duplicates, delayed publishes, redrive duplicates, and the
//! histogram of attempts at acknowledgement. Labelled per queue on `/metrics/per-object`,
//! summed on `/metrics` (ages take the maximum: a sum of ages means nothing).

use warren_broker::queue::QueueStats;
use warren_broker::queue::machine;

use super::{QueueRow, Scrape, per_queue};

/// A work series: name (after `warren_`), help, whether it is a counter, whether its
/// aggregate is the maximum rather than the sum, value.
type WorkSeries = (
    &'static str,
    &'static str,
    bool,
    bool,
    fn(&QueueStats) -> f64,
);

const WORK_SERIES: &[WorkSeries] = &[
    (
        "queue_messages_scheduled",
        "Messages waiting out a delayed retry (neither ready nor unacknowledged)",
        false,
        false,
        |s| s.work.scheduled as f64,
    ),
    (
        "queue_messages_leased",
        "Messages claimed under a lease (HTTP queue API), counted in unacked too",
        false,
        false,
        |s| s.work.leased as f64,
    ),
    (
        "queue_oldest_lease_age_seconds",
        "How long the oldest claim still leased has been out",
        false,
        true,
        |s| s.work.oldest_claim_age_ms.unwrap_or(0) as f64 / 1000.0,
    ),
    (
        "queue_claims_total",
        "Messages claimed under a lease",
        true,
        false,
        |s| s.work.counters.claimed as f64,
    ),
    (
        "queue_lease_extensions_total",
        "Leases extended",
        true,
        false,
        |s| s.work.counters.extended as f64,
    ),
    (
        "queue_leases_released_total",
        "Claims given back by their worker",
        true,
        false,
        |s| s.work.counters.released as f64,
    ),
    (
        "queue_leases_expired_total",
        "Leases that ran out (their message returned)",
        true,
        false,
        |s| s.work.counters.lease_expired as f64,
    ),
    (
        "queue_retries_delayed_total",
        "Returns held for a delayed retry",
        true,
        false,
        |s| s.work.counters.retries_delayed as f64,
    ),
    (
        "queue_messages_deduplicated_total",
        "Publishes dropped as duplicates (confirmed all the same)",
        true,
        false,
        |s| s.work.counters.deduplicated as f64,
    ),
    (
        "queue_messages_quarantined_total",
        "Messages removed past the delivery limit (dead-lettered with their failure context)",
        true,
        false,
        |s| s.work.counters.quarantined as f64,
    ),
    (
        "queue_delayed_publishes_total",
        "Publishes held for a delay (delay_ms) before they were ready",
        true,
        false,
        |s| s.work.counters.delayed_publishes as f64,
    ),
    (
        "queue_redrive_duplicates_total",
        "Redrive moves into the queue it had taken already (an interrupted redrive run again)",
        true,
        false,
        |s| s.work.counters.moves_refused as f64,
    ),
];

/// `warren_queue_ack_attempts`: acknowledged messages by the attempt that succeeded, a
/// histogram per queue (labelled like the other per-object series) or summed over them.
fn attempts(s: &mut Scrape, rows: &[QueueRow], per_object: bool) {
    use std::fmt::Write;
    let name = "warren_queue_ack_attempts";
    let out = &mut s.histograms;
    let _ = writeln!(
        out,
        "# HELP {name} Acknowledged messages by the attempt that succeeded (1: the first delivery)\n# TYPE {name} histogram"
    );
    let mut write = |labels: &str, c: &machine::WorkCounters| {
        let mut cumulative = 0;
        for (i, n) in c.acked_attempts.iter().enumerate() {
            cumulative += n;
            let le = machine::ATTEMPT_BOUNDS
                .get(i)
                .map_or_else(|| "+Inf".to_string(), u32::to_string);
            let _ = writeln!(out, "{name}_bucket{{{labels}le=\"{le}\"}} {cumulative}");
        }
        let braces = |l: &str| {
            if l.is_empty() {
                String::new()
            } else {
                format!("{{{}}}", l.trim_end_matches(','))
            }
        };
        let _ = writeln!(out, "{name}_sum{} {}", braces(labels), c.acked_attempts_sum);
        let _ = writeln!(out, "{name}_count{} {cumulative}", braces(labels));
    };
    if per_object {
        for r in rows {
            let labels = format!(
                "vhost=\"{}\",queue=\"{}\",",
                crate::prom_text::escape(&r.vhost, true),
                crate::prom_text::escape(&r.queue.name, true)
            );
            write(&labels, &r.stats.work.counters);
        }
    } else {
        let mut total = machine::WorkCounters::default();
        for r in rows {
            let c = &r.stats.work.counters;
            for (t, n) in total.acked_attempts.iter_mut().zip(c.acked_attempts) {
                *t += n;
            }
            total.acked_attempts_sum += c.acked_attempts_sum;
        }
        write("", &total);
    }
}

/// The work series of `rows`.
pub(super) fn work(s: &mut Scrape, rows: &[QueueRow], labels: &[&str], per_object: bool) {
    attempts(s, rows, per_object);
    for (name, help, counter, max, value) in WORK_SERIES {
        let name = format!("warren_{name}");
        per_queue(
            s,
            rows,
            labels,
            per_object,
            (&name, help, *counter, *max),
            *value,
        );
    }
}
