//! Liveness per node, not per group, as RabbitMQ's Ra does with Aten: a quorum queue's or a
//! stream's group sends no heartbeats and starts no election of its own (openraft's
//! `enable_heartbeat` and `enable_elect` are off for them: [`queue_raft_config`]). The node
//! pings each peer (`liveness`, [`PING_EVERY`]), and this watch, every [`TICK`], looks at each
//! group served here:
//!
//! - a voter whose group's leader has been silent for the group's election timeout (drawn
//!   per group and attempt between openraft's minimum and maximum), or whose group has had no
//!   leader that long, stands for election, provided a majority of the voters is heard from
//!   and its leader did not ask it to abstain (a handover); until a live leader is known
//!   again, openraft's own elections are on for the group, so a failed attempt is retried
//!   the way openraft does (a replica that saw a longer log than its own waits longer);
//! - a leader sends a heartbeat (which carries whatever a follower lacks) when a follower that
//!   is heard from is behind and made no progress for a second, when a member's node dialled
//!   in again (it restarted, or lost its link), and once a second after its log last moved
//!   (the commit point again, in case the one openraft sent was lost).
//!
//! openraft's tick is off for these groups too, except while this watch needs it: when a
//! replica retries an election (openraft's retries run on the tick) and while a leader
//! changes its voters or leads without being one (a removed leader steps down on a tick).
//!
//! Commits still reach followers at once: openraft sends the new commit point after every
//! commit, and retries a failed append by itself. So an idle group costs nothing on the wire,
//! and a thousand idle queues cost a few pings per peer rather than 4,444 AppendEntries a
//! second (openraft's tick, every 450 ms, to two followers each).
//!
//! [`queue_raft_config`]: super::queue_raft_config
//! [`PING_EVERY`]: super::liveness::PING_EVERY

use std::collections::HashMap;
use std::sync::Weak;
use std::time::{Duration, Instant};

use openraft::ServerState;

use crate::transport::tcp;
use crate::types::NodeId;

use super::ClusterNode;
use super::config::fnv1a;
use super::replicas::QueueReplica;

/// How often the watch looks at every group served here. A look reads the group's metrics
/// only when they changed since the last (no call into its Raft core, no message), and a
/// leader whose followers have all of its log is passed over until they change.
pub(super) const TICK: Duration = Duration::from_millis(200);

/// A leader retries a follower that made no progress for this long (openraft retries a
/// failed request only when something new is appended, or on a heartbeat).
const STUCK_AFTER: Duration = Duration::from_secs(1);

/// What the watch remembers of one group between looks.
struct Watch {
    /// This replica's election timeout for the current wait.
    timeout: Duration,
    /// Elections this replica started (drawn timeouts differ between attempts).
    attempts: u64,
    /// Since when the group has had no live leader known here (None: it has one).
    leaderless_since: Option<Instant>,
    /// Whether openraft's own elections are on for the group: from this replica's first
    /// attempt until a live leader is known again (openraft's retries wait longer on a
    /// replica that saw a longer log than its own, so the replica that can win does).
    retrying: bool,
    /// As leader: each follower's matched index at the last look, and since when it was so.
    matched: HashMap<NodeId, (Option<u64>, Instant)>,
    /// As leader: the links each member had opened to this node at the last look.
    dialled: HashMap<NodeId, u64>,
    /// As leader: the last log index at the last look, since when it is so, and whether the
    /// heartbeat that follows a burst of writes went out.
    settled: (Option<u64>, Instant, bool),
    /// The watch's tick that last saw the group served here (groups not seen drop out).
    seen: u64,
    /// The group's metrics, read again only when they changed (an idle group's change only
    /// on openraft's tick, every 1.5 s, while the watch looks every [`TICK`]).
    metrics: Option<MetricsReceiver>,
    /// What the last read of the metrics said.
    look: Option<Look>,
    /// Whether openraft's tick is on for the group ([`sync_tick`]).
    ticking: bool,
    /// As leader: at the last full look nothing was to be sent (every follower had all of
    /// the log, the commit point's heartbeat had gone out). With the metrics unchanged and
    /// no member dialled in again since, the next look would find the same: it is skipped.
    quiet: bool,
}

/// What the watch knows of the peers at one look, read once for every group: a look at a
/// thousand groups would otherwise take the node-wide liveness and link tables' locks (and
/// read the clock) a few thousand times.
pub(super) struct Peers {
    now: Instant,
    /// Since when this node runs (a peer never heard from is silent since then).
    started: Instant,
    heard: HashMap<NodeId, Instant>,
    dialled: HashMap<NodeId, u64>,
    /// Whether a peer opened a link to this node since the previous look (it restarted or
    /// reconnected: every leader looks at its group in full).
    redialled: bool,
}

impl Peers {
    /// The peers as `node` knows them now; `before` is what the previous look found dialled.
    fn of(node: &ClusterNode, now: Instant, before: &HashMap<NodeId, u64>) -> Self {
        let dialled = node.groups.links_accepted_by_peer();
        Self {
            now,
            started: node.started,
            heard: tcp::heard(),
            redialled: dialled != *before,
            dialled,
        }
    }

    /// How long peer `id` had been silent at this look (never heard from: since this node
    /// started); `me` is never silent.
    fn silence(&self, me: NodeId, id: NodeId) -> Duration {
        if id == me {
            return Duration::ZERO;
        }
        let since = self.heard.get(&id).copied().unwrap_or(self.started);
        self.now.saturating_duration_since(since)
    }

    /// How many links peer `id` had opened to this node by this look.
    fn dialled(&self, id: NodeId) -> u64 {
        self.dialled.get(&id).copied().unwrap_or(0)
    }
}

/// Watch every group served here until the node is gone.
pub(super) async fn watch_elections(weak: Weak<ClusterNode>) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut watches: HashMap<u64, Watch> = HashMap::new();
    let mut dialled_before: HashMap<NodeId, u64> = HashMap::new();
    for ticks in 1u64.. {
        tick.tick().await;
        let Some(node) = weak.upgrade() else {
            return;
        };
        let now = Instant::now();
        let peers = Peers::of(&node, now, &dialled_before);
        dialled_before.clone_from(&peers.dialled);
        for replica in node.replicas() {
            let incarnation = replica.group.incarnation;
            let watch = watches.entry(incarnation).or_insert_with(|| Watch {
                timeout: node.election_timeout(incarnation, 0),
                attempts: 0,
                leaderless_since: None,
                retrying: false,
                matched: HashMap::new(),
                dialled: HashMap::new(),
                settled: (None, now, true),
                seen: ticks,
                metrics: None,
                look: None,
                ticking: false,
                quiet: false,
            });
            watch.seen = ticks;
            node.look_after(&replica, watch, &peers);
        }
        // Groups no longer served here drop out.
        watches.retain(|_, w| w.seen == ticks);
    }
}

/// Turn openraft's own elections off again for a group whose leader is known (or which this
/// replica leads, or must not campaign in).
fn stop_retrying(raft: &QueueRaftHandle, watch: &mut Watch) {
    if watch.retrying {
        watch.retrying = false;
        raft.runtime_config().elect(false);
    }
}

/// Turn openraft's tick on or off for a group. For a queue's or a stream's group the tick
/// drives only openraft's own elections (on while this replica retries one) and a removed
/// leader's stepping down (after a change of voters that left it out): off otherwise, so an
/// idle group's Raft core does not wake (nor publish its metrics again) every 1.5 s.
fn sync_tick(raft: &QueueRaftHandle, watch: &mut Watch, want: bool) {
    if watch.ticking != want {
        watch.ticking = want;
        raft.runtime_config().tick(want);
    }
}

/// The election timeout of node `me`'s replica of group `incarnation` for attempt `attempt`:
/// at least `min_ms`, below `max_ms`, different per node, group and attempt (so two voters
/// rarely campaign at once and split the vote).
fn election_timeout(
    (me, incarnation, attempt): (NodeId, u64, u64),
    min_ms: u64,
    max_ms: u64,
) -> Duration {
    let mut seed = [0u8; 24];
    seed[..8].copy_from_slice(&me.to_le_bytes());
    seed[8..16].copy_from_slice(&incarnation.to_le_bytes());
    seed[16..].copy_from_slice(&attempt.to_le_bytes());
    let span = max_ms.saturating_sub(min_ms).max(1);
    Duration::from_millis(min_ms + fnv1a(&seed) % span)
}

/// A group's metrics as openraft publishes them.
type MetricsReceiver =
    tokio::sync::watch::Receiver<openraft::RaftMetrics<NodeId, openraft::BasicNode>>;

/// What one group's metrics say, read at once (no allocation: most looks end here).
#[derive(Debug, Clone, Copy)]
struct Look {
    leads: bool,
    votes: bool,
    /// The leader this replica knows, if it is a voter of the group.
    leader: Option<NodeId>,
    last_log_index: Option<u64>,
}

impl Look {
    fn of(m: &openraft::RaftMetrics<NodeId, openraft::BasicNode>, me: NodeId) -> Self {
        let membership = m.membership_config.membership();
        Self {
            leads: m.state == ServerState::Leader,
            votes: membership.voter_ids().any(|v| v == me),
            leader: m
                .current_leader
                .filter(|l| membership.voter_ids().any(|v| v == *l)),
            last_log_index: m.last_log_index,
        }
    }
}

/// The group's voters (read again: needed only when it has no live leader).
fn voters(raft: &QueueRaftHandle) -> Vec<NodeId> {
    raft.metrics()
        .borrow()
        .membership_config
        .membership()
        .voter_ids()
        .collect()
}

type QueueRaftHandle = openraft::Raft<crate::types::QueueRaft>;

impl ClusterNode {
    /// One look at `replica`'s group: as its leader, send a heartbeat if a follower waits; as
    /// a voter without a live leader for its election timeout, stand for election.
    fn look_after(&self, replica: &QueueReplica, watch: &mut Watch, peers: &Peers) {
        let Some(raft) = replica.raft.get() else {
            return;
        };
        let now = peers.now;
        let metrics = watch.metrics.get_or_insert_with(|| raft.metrics());
        // A closed channel (the group shut down) reads as changed: looked at in full.
        let changed = metrics.has_changed().unwrap_or(true);
        let look = match watch.look {
            Some(look) if !changed => look,
            _ => {
                let look = Look::of(&metrics.borrow_and_update(), self.me);
                watch.look = Some(look);
                look
            }
        };
        let changing = replica.changing.load(std::sync::atomic::Ordering::Acquire);
        sync_tick(
            raft,
            watch,
            watch.retrying || changing || (look.leads && !look.votes),
        );
        if look.leads {
            watch.leaderless_since = None;
            stop_retrying(raft, watch);
            if watch.quiet && !changed && !peers.redialled {
                return;
            }
            // A leader handing over (or changing its voters) holds its heartbeats: the other
            // voters' leases must run out for the target's election.
            if self.follower_waits(&look, watch, peers) && !changing {
                let raft = raft.clone();
                tokio::spawn(async move {
                    let _ = raft.trigger().heartbeat().await;
                });
            }
            return;
        }
        watch.matched.clear();
        watch.dialled.clear();
        watch.settled = (None, now, true);
        watch.quiet = false;
        let live_leader = look.leader;
        // Abstention asked last: most looks end before it.
        if !look.votes
            || live_leader.is_some_and(|l| peers.silence(self.me, l) < watch.timeout)
            || self.groups.abstaining(&replica.group)
        {
            watch.leaderless_since = None;
            stop_retrying(raft, watch);
            return;
        }
        if watch.retrying {
            return;
        }
        // Silent since when: a leader's silence counts from its last word, no leader from
        // when this watch first saw none.
        let since = *watch.leaderless_since.get_or_insert_with(|| {
            live_leader
                .and_then(|l| now.checked_sub(peers.silence(self.me, l)))
                .unwrap_or(now)
        });
        if now.duration_since(since) < watch.timeout || !self.hears_majority(&voters(raft), peers) {
            return;
        }
        watch.attempts += 1;
        watch.timeout = self.election_timeout(replica.group.incarnation, watch.attempts);
        watch.leaderless_since = Some(now);
        tracing::info!(queue = %replica.queue.name, leader = ?look.leader, "no live leader: electing");
        // Should this attempt fail, openraft retries by itself until a leader is known: with
        // retries of our own every voter would campaign on its own clock, and one whose log is
        // shorter (it cannot win) would keep raising the term under the one that can.
        watch.retrying = true;
        raft.runtime_config().elect(true);
        sync_tick(raft, watch, true);
        let raft = raft.clone();
        tokio::spawn(async move {
            let _ = raft.trigger().elect().await;
        });
    }

    /// How long peer `id` has been silent (never heard from: since this node started).
    pub(super) fn silence(&self, id: NodeId) -> Duration {
        if id == self.me {
            return Duration::ZERO;
        }
        tcp::silent_for(id).unwrap_or_else(|| self.started.elapsed())
    }

    /// Whether a majority of `voters` is heard from (this node included): a replica cut off
    /// from most of its group does not campaign (each attempt raises the term, and a higher
    /// term deposes the leader once the partition heals).
    fn hears_majority(&self, voters: &[NodeId], peers: &Peers) -> bool {
        let min = Duration::from_millis(self.queue_raft_config.election_timeout_min);
        let heard = voters
            .iter()
            .filter(|v| peers.silence(self.me, **v) < min)
            .count();
        heard * 2 > voters.len()
    }

    /// Group `incarnation`'s election timeout for attempt `attempt` here
    /// ([`election_timeout`] within the groups' Raft settings).
    fn election_timeout(&self, incarnation: u64, attempt: u64) -> Duration {
        election_timeout(
            (self.me, incarnation, attempt),
            self.queue_raft_config.election_timeout_min,
            self.queue_raft_config.election_timeout_max,
        )
    }

    /// As a group's leader: whether a follower waits for what a heartbeat would send: entries
    /// (it is heard from, behind, and made no progress for [`STUCK_AFTER`]), this leader (its
    /// node dialled in again since the last look), or the commit point (the log has not
    /// moved for [`STUCK_AFTER`] since it last did: openraft sends each commit point once,
    /// and one lost on a broken link would leave the followers' queues a write behind until
    /// the next). Updates `watch`.
    fn follower_waits(&self, look: &Look, watch: &mut Watch, peers: &Peers) -> bool {
        let now = peers.now;
        let mut send = false;
        let (index, since, sent) = &mut watch.settled;
        if *index != look.last_log_index {
            (*index, *since, *sent) = (look.last_log_index, now, false);
        } else if !*sent && now.duration_since(*since) >= STUCK_AFTER {
            *sent = true;
            send = true;
        }
        // Quiet unless a follower turns out behind below (or the heartbeat is still due).
        let mut quiet = *sent;
        let Some(receiver) = watch.metrics.as_ref() else {
            watch.quiet = false;
            return send;
        };
        let metrics = receiver.borrow();
        let Some(replication) = metrics.replication.as_ref() else {
            watch.quiet = quiet;
            return send;
        };
        for (peer, matched) in replication {
            if *peer == self.me {
                continue;
            }
            let matched = &matched.map(|l| l.index);
            let dialled = peers.dialled(*peer);
            if watch
                .dialled
                .insert(*peer, dialled)
                .is_some_and(|d| d != dialled)
            {
                send = true;
            }
            let since = match watch.matched.get(peer) {
                Some((m, since)) if m == matched => *since,
                _ => now,
            };
            watch.matched.insert(*peer, (*matched, since));
            let behind = *matched < look.last_log_index;
            quiet &= !behind;
            let alive = peers.silence(self.me, *peer) < STUCK_AFTER;
            if behind && alive && now.duration_since(since) >= STUCK_AFTER {
                // Looked at again only after another STUCK_AFTER.
                watch.matched.insert(*peer, (*matched, now));
                send = true;
            }
        }
        watch.quiet = quiet;
        send
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn election_timeouts_stay_in_range_and_differ_between_voters_and_attempts() {
        let mut seen = std::collections::HashSet::new();
        for me in 1..4u64 {
            for attempt in 0..50u64 {
                let t = election_timeout((me, 42, attempt), 1500, 3000);
                assert!(
                    t >= Duration::from_millis(1500) && t < Duration::from_millis(3000),
                    "{t:?}"
                );
                seen.insert(t);
            }
        }
        // Spread over the range, not a handful of values.
        assert!(seen.len() > 100, "{}", seen.len());
        assert_ne!(
            election_timeout((1, 42, 0), 1500, 3000),
            election_timeout((2, 42, 0), 1500, 3000)
        );
        assert_eq!(
            election_timeout((1, 7, 3), 100, 100),
            Duration::from_millis(100)
        );
    }
}
