//! Warren's stream series (`warren_stream_*`): each stream's offsets, segments and bytes, and
//! each tracked consumer's position and lag.

use super::{QueueRow, Scrape};

/// Warren's stream series, on both endpoints and always labelled: a stream's offsets and
/// segments (`vhost`, `queue`), and each tracked consumer's position and lag (`vhost`,
/// `queue`, `consumer`: at most `TRACKED_NAMES_MAX` per stream). A sum of lags over
/// consumers would mean nothing, so there is no aggregated form.
pub(super) fn streams(s: &Scrape, rows: &[QueueRow]) {
    let now = warren_broker::timers::wall_ms();
    let stats: Vec<(&QueueRow, warren_broker::queue::stream::StreamStats)> = rows
        .iter()
        .filter_map(|r| r.queue.stream().map(|st| (r, st.stats(now))))
        .collect();
    if stats.is_empty() {
        return;
    }
    type PerStream = (
        &'static str,
        &'static str,
        fn(&warren_broker::queue::stream::StreamStats) -> f64,
    );
    const PER_STREAM: &[PerStream] = &[
        (
            "warren_stream_first_offset",
            "First offset a stream holds",
            |st| st.first_offset as f64,
        ),
        (
            "warren_stream_next_offset",
            "Offset the next message of a stream gets",
            |st| st.next_offset as f64,
        ),
        (
            "warren_stream_segments",
            "Segment files of a stream",
            |st| st.segments as f64,
        ),
        ("warren_stream_bytes", "Bytes a stream holds", |st| {
            st.bytes as f64
        }),
    ];
    for (name, help, value) in PER_STREAM {
        if let Some(g) = s.gauge(name, help, &["vhost", "queue"]) {
            for (r, st) in &stats {
                g.with_label_values(&[r.vhost.as_str(), r.queue.name.as_str()])
                    .set(value(st));
            }
        }
    }
    type PerConsumer = (
        &'static str,
        &'static str,
        fn(&warren_broker::queue::stream::TrackedLag) -> f64,
    );
    const PER_CONSUMER: &[PerConsumer] = &[
        (
            "warren_stream_consumer_offset",
            "First offset a named stream consumer has not acknowledged",
            |t| t.offset as f64,
        ),
        (
            "warren_stream_consumer_lag_messages",
            "Messages between a named stream consumer and the end of the stream",
            |t| t.lag.messages as f64,
        ),
        (
            "warren_stream_consumer_lag_seconds",
            "Age of the oldest message a named stream consumer has not read",
            |t| t.lag.age_ms as f64 / 1000.0,
        ),
        (
            "warren_stream_consumer_lost_to_retention_messages",
            "Messages a named stream consumer never read that retention already dropped",
            |t| t.lag.lost_to_retention as f64,
        ),
    ];
    for (name, help, value) in PER_CONSUMER {
        if let Some(g) = s.gauge(name, help, &["vhost", "queue", "consumer"]) {
            for (r, st) in &stats {
                for t in &st.tracked {
                    g.with_label_values(&[
                        r.vhost.as_str(),
                        r.queue.name.as_str(),
                        t.name.as_str(),
                    ])
                    .set(value(t));
                }
            }
        }
    }
}
