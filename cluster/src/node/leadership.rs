//! Handing a queue's leadership to another voter: as the leader, hold the log, wait until
//! the target holds every entry and ask it to stand for election (in groups of more than
//! three, after the other voters agreed to abstain and their leases ran out).

use std::time::Duration;

use openraft::Raft;
use warren_broker::node::replication::TransferError;

use crate::transport::tcp;
use crate::types::{NodeId, QueueRaft};

use super::replicas::QueueReplica;
use super::{ClusterNode, PEER_REQUEST_MAX};

/// How long a leader handing over waits for its log to settle, and then for the target to
/// hold every entry.
pub(super) const HOLD_MAX: Duration = Duration::from_secs(2);
/// How long a handover waits for the target's election.
pub(super) const TRANSFER_MAX: Duration = Duration::from_secs(5);
/// Past the leader lease before a handover starts (clocks of one process, so small).
pub(super) const TRANSFER_MARGIN: Duration = Duration::from_millis(50);

impl ClusterNode {
    /// A single request to `peer`'s replica of `replica`'s group (None: no address known).
    pub(super) fn peer_call(&self, replica: &QueueReplica, peer: NodeId) -> Option<tcp::PeerCall> {
        let raft = replica.raft.get()?;
        Some(tcp::PeerCall::new(
            &self.addresses,
            self.me,
            peer,
            replica.group.clone(),
            self.peer_addr(raft, peer)?,
            &self.secret,
        ))
    }

    /// As the leader of a queue group, hand leadership to voter `to`: hold the proposer
    /// (the log stands still and all it proposed has committed), wait until `to` holds every
    /// entry, and ask it to stand for election. In a group of at most three voters this
    /// replica's vote and the target's are a majority: the handover takes milliseconds.
    /// Otherwise (more voters, or this replica no longer one) the other voters abstain and
    /// their leader lease runs out first (openraft's, the maximum election timeout).
    pub(super) async fn lead_transfer(
        &self,
        incarnation: u64,
        to: NodeId,
    ) -> Result<NodeId, TransferError> {
        use std::sync::atomic::Ordering;
        let replica = self
            .replica_of(incarnation)
            .ok_or(TransferError::NotReplicated)?;
        let (Some(raft), Some(proposer)) = (replica.raft.get(), replica.proposer.get()) else {
            return Err(TransferError::NotReplicated);
        };
        {
            let m = raft.metrics();
            let m = m.borrow();
            if m.current_leader != Some(self.me) {
                return Err(TransferError::Failed(format!(
                    "{} does not lead the queue",
                    self.config.name
                )));
            }
            if !m
                .membership_config
                .membership()
                .voter_ids()
                .any(|v| v == to)
            {
                return Err(TransferError::NotVoter(self.name_of(to)));
            }
        }
        if to == self.me {
            return Ok(to);
        }
        // One change of the group at a time (membership changes take the same flag).
        if replica.changing.swap(true, Ordering::AcqRel) {
            return Err(TransferError::Failed(
                "the queue's members are changing".into(),
            ));
        }
        struct Clear<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Clear<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _clear = Clear(&replica.changing);
        // A leader refuses a candidate for a lease after its own election (openraft's leader
        // lease, the maximum election timeout): wait that out rather than have the target
        // campaign in vain (its higher term would then depose this leader anyway).
        let lease = Duration::from_millis(self.raft_config.election_timeout_max);
        let age = raft
            .with_raft_state(|st| st.vote_last_modified().map(|t| t.elapsed()))
            .await
            .map_err(|e| TransferError::Failed(e.to_string()))?;
        if let Some(age) = age
            && age < lease + TRANSFER_MARGIN
        {
            tokio::time::sleep(lease + TRANSFER_MARGIN - age).await;
        }
        let hold = tokio::time::timeout(HOLD_MAX, proposer.hold())
            .await
            .map_err(|_| TransferError::Failed("the log did not settle in time".into()))?
            .map_err(|e| TransferError::Failed(e.to_string()))?;
        let last = raft.metrics().borrow().last_log_index;
        raft.wait(Some(HOLD_MAX))
            .metrics(
                |m| {
                    m.replication
                        .as_ref()
                        .and_then(|r| r.get(&to))
                        .and_then(|l| l.map(|l| l.index))
                        >= last
                },
                "the target holds every entry",
            )
            .await
            .map_err(|_| {
                TransferError::Failed(format!("{} did not catch up in time", self.name_of(to)))
            })?;
        let call = |peer: NodeId| {
            self.peer_call(&replica, peer).ok_or_else(|| {
                TransferError::Failed(format!("no address for {}", self.name_of(peer)))
            })
        };
        // Beyond three voters (or when this replica no longer votes), this replica's vote and
        // the target's are no majority: the others must grant theirs too, which they do only
        // once their leader lease ran out.
        // So they (and the target) abstain, this replica stops its heartbeats, and the
        // target campaigns once every lease is over.
        let voters: Vec<NodeId> = raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .voter_ids()
            .collect();
        let others: Vec<NodeId> = voters.iter().copied().filter(|v| *v != self.me).collect();
        // The fast path needs this replica's vote to count and, with the target's, to be a
        // majority: a voter in a group of at most three.
        let slow = voters.len() > 3 || !voters.contains(&self.me);
        let _resume = if slow {
            let span = lease + TRANSFER_MAX;
            for peer in &others {
                let asked = tokio::time::timeout(
                    PEER_REQUEST_MAX,
                    tcp::request_abstain(
                        call(*peer)?,
                        u64::try_from(span.as_millis()).unwrap_or(u64::MAX),
                    ),
                )
                .await;
                if !matches!(asked, Ok(Ok(true))) {
                    resume_elections(call, &others).await;
                    return Err(TransferError::Failed(format!(
                        "{} would not abstain from elections",
                        self.name_of(*peer)
                    )));
                }
            }
            raft.runtime_config().heartbeat(false);
            let guard = Heartbeats(raft.clone());
            tokio::time::sleep(lease + TRANSFER_MARGIN).await;
            Some(guard)
        } else {
            None
        };
        let started = tokio::time::timeout(PEER_REQUEST_MAX, tcp::request_campaign(call(to)?))
            .await
            .map_err(|_| TransferError::Failed(format!("{} did not answer", self.name_of(to))))?
            .map_err(|e| {
                TransferError::Failed(format!("cannot reach {}: {e}", self.name_of(to)))
            })?;
        if !started {
            return Err(TransferError::Failed(format!(
                "{} did not stand for election",
                self.name_of(to)
            )));
        }
        let moved = raft
            .wait(Some(TRANSFER_MAX))
            .metrics(
                |m| m.current_leader.is_some_and(|l| l != self.me),
                "leadership moved",
            )
            .await;
        // Commands held meanwhile now go to the new leader (forwarded) or fail as not led.
        drop(hold);
        if slow {
            resume_elections(call, &others).await;
        }
        match moved {
            Ok(m) => {
                let new = m.current_leader.unwrap_or(to);
                tracing::info!(queue = %replica.queue.name, to = %self.name_of(new), "leadership handed over");
                Ok(new)
            }
            Err(_) => Err(TransferError::Failed(
                "no new leader was elected in time".into(),
            )),
        }
    }
}

/// Turns a replica's heartbeats back to its configuration when dropped (a leader handing
/// over stops them; a queue group's are off anyway, its node watching liveness).
struct Heartbeats(Raft<QueueRaft>);

impl Drop for Heartbeats {
    fn drop(&mut self) {
        let configured = self.0.config().enable_heartbeat;
        self.0.runtime_config().heartbeat(configured);
    }
}

/// Ask `peers` to take part in elections again (after a handover asked them to abstain);
/// those that do not answer resume by themselves when their abstention runs out.
async fn resume_elections(
    call: impl Fn(NodeId) -> Result<tcp::PeerCall, TransferError>,
    peers: &[NodeId],
) {
    for peer in peers {
        if let Ok(c) = call(*peer) {
            let _ = tokio::time::timeout(PEER_REQUEST_MAX, tcp::request_abstain(c, 0)).await;
        }
    }
}
