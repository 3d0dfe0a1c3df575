//! Submissions to a group's leader: a group's [`Forwarder`] proposes them here when this
//! replica leads, or batches them over a pipelined link to the leader (in submission order);
//! [`send_retrying`] retries them across an election.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use openraft::Raft;
use tokio::sync::mpsc;
use warren_broker::node::replication::ReplicationError;
use warren_broker::queue::machine::{MachineError, Reply};

use crate::proposer::{ProposeError, Proposer};
use crate::transport::tcp;
use crate::transport::tcp::{
    FORWARDS_IN_FLIGHT_MAX, ForwardLink, Forwarded, GroupId, Refusal, TransportError,
};
use crate::types::{NodeId, QueueRaft};

use super::{ClusterNode, FORWARD_REPLY_MAX, PEER_REQUEST_MAX};

/// Most commands forwarded in one request.
pub const FORWARD_BATCH_MAX: usize = 256;
/// Most submissions waiting to be forwarded, per queue (beyond it they fail at once).
pub const FORWARD_QUEUE_MAX: usize = 16 * 1024;
/// How long a forward waits for a group to have a leader.
const LEADER_WAIT: Duration = Duration::from_secs(10);

/// How long a submission is retried across an election before it fails.
pub const RETRY_FOR: Duration = Duration::from_secs(15);
/// The pause between attempts.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

impl ClusterNode {
    /// Where this node dials `peer` for a group run by `raft`: its own `--peers` address,
    /// else the one the group's membership recorded.
    pub(super) fn peer_addr(&self, raft: &Raft<QueueRaft>, peer: NodeId) -> Option<String> {
        self.addresses.get(peer).or_else(|| {
            raft.metrics()
                .borrow()
                .membership_config
                .membership()
                .get_node(&peer)
                .map(|n| n.addr.clone())
        })
    }
}

/// Send `f`, again after a pause while it failed and may be retried (see
/// [`QueueReplica::submit`]), until `deadline`.
///
/// [`QueueReplica::submit`]: super::replicas::QueueReplica
pub(super) fn send_retrying(
    forwarder: Forwarder,
    f: Forwarded,
    idempotent: bool,
    deadline: std::time::Instant,
    attempt: u32,
    done: ForwardDone,
) {
    let again = f.clone();
    let next = forwarder.clone();
    forwarder.send(
        f,
        Box::new(move |r| {
            let retry = match &r {
                Err(ReplicationError::Unavailable) => true,
                Err(ReplicationError::Unknown(_)) => idempotent,
                Ok(_) => false,
            };
            // A proxy's home that is down fails its publishes and gets at once (no retry for
            // them). Acks, returns and cancels are retried until the deadline all the same:
            // "down" here is this node's view, which the home need not share (a short cut
            // can look like one from a side), and a return lost while the home is up would
            // leave its messages checked out to a consumer that is gone. A home down for
            // longer than the deadline has detached this node's consumers itself.
            let home_down = next
                .home
                .is_some_and(|h| next.node.upgrade().is_none_or(|n| n.is_down(h)));
            if retry && (idempotent || !home_down) && std::time::Instant::now() < deadline {
                // On the node's runtime: a submission may come from the timer thread.
                let runtime = next.runtime.clone();
                runtime.spawn(async move {
                    tokio::time::sleep(RETRY_PAUSE).await;
                    send_retrying(next, again, idempotent, deadline, attempt + 1, done);
                });
                return;
            }
            let r = r.map(|replies| {
                if attempt == 0 {
                    return replies;
                }
                // A retried checkout that had in fact committed before finds itself there.
                replies
                    .into_iter()
                    .map(|reply| match reply {
                        Err(ProposeError::Refused(MachineError::DuplicateConsumer)) => {
                            Ok(Reply::Ok)
                        }
                        other => other,
                    })
                    .collect()
            });
            done(r);
        }),
    );
}

/// Where a [`Forwarder`] sends.
#[derive(Clone)]
pub(super) enum Target {
    /// A Raft group's leader: this replica (proposed here), or a peer.
    Group {
        /// The group's Raft instance on this node (who leads).
        raft: Raft<QueueRaft>,
        /// This replica's batcher, used while it leads.
        proposer: Proposer,
    },
    /// A classic queue's home node (always a peer: a proxy's queue lives elsewhere).
    Home(NodeId),
}

/// Called once with the leader's replies to a forwarded request.
pub(super) type ForwardDone = Box<dyn FnOnce(Result<tcp::ForwardReplies, ReplicationError>) + Send>;

/// A submission waiting in a [`Forwarder`]'s queue: boxed, since a channel allocates 32 of
/// its items up front for every group.
type Queued = (Box<Forwarded>, ForwardDone);

/// Sends a group's submissions to its leader, in submission order: proposed here when this
/// replica leads, else batched into forward requests to the leader (one in flight).
#[derive(Clone)]
pub(super) struct Forwarder {
    tx: mpsc::Sender<Queued>,
    pub(super) node: Weak<ClusterNode>,
    runtime: tokio::runtime::Handle,
    /// A proxy's home ([`Target::Home`]).
    home: Option<NodeId>,
}

impl Forwarder {
    pub(super) fn start(node: Weak<ClusterNode>, group: GroupId, target: Target) -> Self {
        let (tx, rx) = mpsc::channel(FORWARD_QUEUE_MAX);
        let home = match &target {
            Target::Home(h) => Some(*h),
            Target::Group { .. } => None,
        };
        tokio::spawn(forward_loop(node.clone(), group, target, rx));
        Self {
            tx,
            node,
            runtime: tokio::runtime::Handle::current(),
            home,
        }
    }

    /// Queue `f`; a full queue fails it at once (the caller nacks), never blocks.
    fn send(&self, f: Forwarded, done: ForwardDone) {
        if let Err(e) = self.tx.try_send((Box::new(f), done)) {
            let (_, done) = e.into_inner();
            done(Err(ReplicationError::Unavailable));
        }
    }
}

async fn forward_loop(
    node: Weak<ClusterNode>,
    group: GroupId,
    target: Target,
    mut rx: mpsc::Receiver<Queued>,
) {
    let mut links: HashMap<NodeId, ForwardLink> = HashMap::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(FORWARDS_IN_FLIGHT_MAX));
    let mut held: Option<Queued> = None;
    loop {
        let first = match held.take() {
            Some(item) => item,
            None => match rx.recv().await {
                Some(item) => item,
                None => return,
            },
        };
        let mut batch = vec![first];
        let mut count = batch[0].0.commands.len();
        // Metadata changes go one at a time; commands batch up to the limit.
        while batch[0].0.meta.is_empty() && count < FORWARD_BATCH_MAX {
            match rx.try_recv() {
                Ok(item) if item.0.meta.is_empty() => {
                    count += item.0.commands.len();
                    batch.push(item);
                }
                Ok(item) => {
                    held = Some(item);
                    break;
                }
                Err(_) => break,
            }
        }
        let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        send_batch(&node, &group, &target, &mut links, batch, permit).await;
    }
}

/// Send one batch to the leader (this replica, or a peer over a pipelined link) and hand the
/// replies out in a task of their own, so the next batch goes while this one commits.
/// Batches are staged in order, so their commands are applied in submission order.
async fn send_batch(
    node: &Weak<ClusterNode>,
    group: &GroupId,
    target: &Target,
    links: &mut HashMap<NodeId, ForwardLink>,
    batch: Vec<Queued>,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    let Some(me) = node.upgrade().map(|n| n.me) else {
        return;
    };
    let mut lengths = Vec::with_capacity(batch.len());
    let mut request = Forwarded {
        commands: Vec::new(),
        meta: Vec::new(),
    };
    let mut dones = Vec::with_capacity(batch.len());
    for (f, done) in batch {
        lengths.push(f.commands.len());
        request.commands.extend(f.commands);
        request.meta.extend(f.meta);
        dones.push(done);
    }
    let meta = !request.meta.is_empty();
    let finish = move |outcome: Result<tcp::ForwardReplies, ReplicationError>| {
        drop(permit);
        match outcome {
            Ok(replies) if !meta => {
                let mut replies = replies.into_iter();
                for (done, n) in dones.into_iter().zip(lengths) {
                    done(Ok(replies.by_ref().take(n).collect()));
                }
            }
            Ok(_) => {
                for done in dones {
                    done(Ok(Vec::new()));
                }
            }
            Err(e) => {
                for done in dones {
                    done(Err(e.clone()));
                }
            }
        }
    };
    let leader = match target {
        Target::Home(home) => {
            // A proxy's commands fail at once while its home is down (publishers are
            // nacked, as for a quorum queue without a leader).
            if node.upgrade().is_none_or(|n| n.is_down(*home)) {
                finish(Err(ReplicationError::Unavailable));
                return;
            }
            *home
        }
        Target::Group { raft, proposer } => {
            let Some(mut leader) = wait_for_leader(raft).await else {
                finish(Err(ReplicationError::Unavailable));
                return;
            };
            if leader == me && proposer.is_held() {
                // This replica is handing its leadership over: wait, then send to whoever
                // leads (this batcher is sequential, so submission order holds across the
                // move).
                proposer.unheld().await;
                let Some(now) = wait_for_leader(raft).await else {
                    finish(Err(ReplicationError::Unavailable));
                    return;
                };
                leader = now;
            }
            if leader == me {
                let staged = tcp::stage_here(raft, proposer, request).await;
                tokio::spawn(async move {
                    finish(staged.replies().await.map_err(unknown));
                });
                return;
            }
            leader
        }
    };
    let link = match links.entry(leader) {
        std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => {
            let made = node.upgrade().and_then(|n| {
                let addr = match target {
                    Target::Group { raft, .. } => n.peer_addr(raft, leader),
                    Target::Home(_) => n.dial_addr(leader),
                }?;
                Some(ForwardLink::new(
                    &n.addresses,
                    me,
                    leader,
                    group.clone(),
                    addr,
                    &n.secret,
                ))
            });
            let Some(made) = made else {
                finish(Err(ReplicationError::Unavailable));
                return;
            };
            v.insert(made)
        }
    };
    // A link whose peer stopped reading fills up: waiting for room must not hang (nothing
    // was sent if it times out).
    let answer = match tokio::time::timeout(PEER_REQUEST_MAX, link.send(request)).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "cannot reach the leader");
            finish(Err(ReplicationError::Unavailable));
            return;
        }
        Err(_) => {
            finish(Err(ReplicationError::Unavailable));
            return;
        }
    };
    tokio::spawn(async move {
        let outcome = match tokio::time::timeout(FORWARD_REPLY_MAX, answer.replies()).await {
            Ok(Ok(r)) => r.map_err(unknown),
            // Nothing reached the leader (it could not be dialled), or it staged nothing:
            // safe to try again.
            Ok(Err(
                e @ (TransportError::NotSent(_)
                | TransportError::NoSuchGroup(_)
                | TransportError::Refused(Refusal::Busy)),
            )) => {
                tracing::debug!(error = %e, "cannot reach the leader");
                Err(ReplicationError::Unavailable)
            }
            Ok(Err(e)) => Err(ReplicationError::Unknown(e.to_string())),
            Err(_) => Err(ReplicationError::Unknown(
                "the leader did not answer in time".into(),
            )),
        };
        finish(outcome);
    });
}

/// A leader's refusal as the broker sees it: nothing appended (NotLeader) or unknown.
fn unknown(e: ProposeError) -> ReplicationError {
    match e {
        ProposeError::NotLeader(_) => ReplicationError::Unavailable,
        other => ReplicationError::Unknown(other.to_string()),
    }
}

/// The group's leader, waiting up to [`LEADER_WAIT`] for one to be elected.
async fn wait_for_leader(raft: &Raft<QueueRaft>) -> Option<NodeId> {
    if let Some(l) = raft.metrics().borrow().current_leader {
        return Some(l);
    }
    let mut metrics = raft.metrics();
    tokio::time::timeout(LEADER_WAIT, async {
        loop {
            if let Some(l) = metrics.borrow().current_leader {
                return Some(l);
            }
            if metrics.changed().await.is_err() {
                return None;
            }
        }
    })
    .await
    .ok()
    .flatten()
}
