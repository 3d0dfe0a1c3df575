//! Warren's consumer-group series (`warren_consumer_group_*`), always labelled by `vhost`,
//! `queue` (the partitioned queue) and `group`: members, epoch and lag in total, and each
//! partition's lag (its ready messages) with `partition`. A group has at most
//! `SUPER_STREAM_PARTITIONS_MAX` partitions, which bounds the per-partition series.

use super::Scrape;
use crate::AppState;

pub(super) fn groups(state: &AppState, s: &Scrape) {
    let groups = state.broker.groups().list(None, None);
    if groups.is_empty() {
        return;
    }
    let labels = ["vhost", "queue", "group"];
    let (Some(members), Some(epoch), Some(lag), Some(partition_lag)) = (
        s.gauge(
            "warren_consumer_group_members",
            "Members of a consumer group",
            &labels,
        ),
        s.gauge(
            "warren_consumer_group_epoch",
            "Epoch of a consumer group's assignment (bumped on every assignment)",
            &labels,
        ),
        s.gauge(
            "warren_consumer_group_lag_messages",
            "Messages over a consumer group's partitions it has not been given",
            &labels,
        ),
        s.gauge(
            "warren_consumer_group_partition_lag_messages",
            "Messages of one partition a consumer group has not been given (a stream: after the group's offset)",
            &["vhost", "queue", "group", "partition"],
        ),
    ) else {
        return;
    };
    for g in &groups {
        let k = [
            g.key.vhost.as_str(),
            g.key.queue.as_str(),
            g.key.group.as_str(),
        ];
        members.with_label_values(&k).set(g.members.len() as f64);
        epoch.with_label_values(&k).set(g.epoch as f64);
        let set = state
            .broker
            .vhost(&g.key.vhost)
            .and_then(|vh| vh.partitioned(&g.key.queue));
        let mut total = 0.0;
        for (i, q) in set.iter().flat_map(|s| s.members.iter().enumerate()) {
            let ready = q.as_ref().map_or(0.0, |q| {
                warren_broker::node::groups::partition_lag(q, &g.key.group) as f64
            });
            total += ready;
            let index = i.to_string();
            partition_lag
                .with_label_values(&[k[0], k[1], k[2], index.as_str()])
                .set(ready);
        }
        lag.with_label_values(&k).set(total);
    }
}
