//! The leader's side of a replicated queue: commands from many publishers and consumers are
//! batched into log entries, and each caller gets its own reply once its entry commits (a
//! publisher's confirm). Batching is triggered the way the store's group commit is: whatever
//! queued while the previous entries were in flight goes into the next entry, up to
//! [`BATCH_MAX`] commands, so entries grow with load and no timer is involved.
//!
//! At most [`IN_FLIGHT`] entries are proposed at once, and the queue of waiting commands is
//! bounded ([`QUEUE_MAX`]): callers wait for room instead of growing memory without limit.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use openraft::Raft;
use openraft::error::ClientWriteError;
use tokio::sync::{Semaphore, mpsc, oneshot, watch};
use warren_broker::queue::machine::{Command, MachineError, Reply};

use crate::types::{NodeId, QueueRaft, QueueRequest, ReplicatedMessage};

/// Most commands in one entry.
pub const BATCH_MAX: usize = 512;
/// Most entries proposed and not yet committed.
pub const IN_FLIGHT: usize = 16;
/// Most commands waiting for an entry.
pub const QUEUE_MAX: usize = 16 * 1024;

/// Why a command has no reply.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ProposeError {
    /// This node is not the leader (the leader's id, when known): nothing was appended.
    #[error("not the leader (leader: {0:?})")]
    NotLeader(Option<NodeId>),
    /// The entry may or may not have committed (leadership lost, replica stopped). A publisher
    /// must treat the message as unconfirmed (nack), as RabbitMQ does.
    #[error("outcome unknown: {0}")]
    Unknown(String),
    /// The machine refused the command (e.g. a duplicate consumer).
    #[error("refused: {0}")]
    Refused(MachineError),
    /// The proposer stopped.
    #[error("proposer stopped")]
    Stopped,
}

type Waiter = oneshot::Sender<Result<Reply<ReplicatedMessage>, ProposeError>>;

/// A handle to propose commands through one replica's Raft instance. Clones share it.
#[derive(Debug, Clone)]
pub struct Proposer {
    /// Boxed commands: a channel allocates 32 of its items up front, for every group.
    tx: mpsc::Sender<(Box<Command<ReplicatedMessage>>, Waiter)>,
    /// One permit per entry in flight ([`IN_FLIGHT`]); a [`Hold`] takes them all.
    slots: Arc<Semaphore>,
    /// True while a [`Hold`] is taken or being taken.
    held: Arc<watch::Sender<bool>>,
}

/// While alive, the proposer proposes nothing, and every entry it proposed before has
/// committed (or failed): the replica's log stands still, as a leadership transfer needs.
#[derive(Debug)]
pub struct Hold {
    _slots: tokio::sync::OwnedSemaphorePermit,
    _flag: HoldFlag,
}

/// Clears the held flag when dropped (also when taking the hold is abandoned half way).
#[derive(Debug)]
struct HoldFlag(Arc<watch::Sender<bool>>);

impl Drop for HoldFlag {
    fn drop(&mut self) {
        self.0.send_replace(false);
    }
}

/// Wall-clock milliseconds: the leader stamps entries with its time (replicas never read
/// theirs).
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Proposer {
    /// Start proposing through `raft` (a task on the current runtime; it ends when every
    /// handle is dropped).
    #[must_use]
    pub fn start(raft: Raft<QueueRaft>) -> Self {
        let (tx, rx) = mpsc::channel(QUEUE_MAX);
        let slots = Arc::new(Semaphore::new(IN_FLIGHT));
        tokio::spawn(run(raft, rx, Arc::clone(&slots)));
        Self {
            tx,
            slots,
            held: Arc::new(watch::channel(false).0),
        }
    }

    /// Stop proposing: resolves once the commands already queued were proposed and every
    /// entry in flight committed or failed. Commands submitted meanwhile wait (and are
    /// proposed when the hold is dropped). Callers bound the wait with a timeout.
    ///
    /// # Errors
    /// [`ProposeError::Stopped`] when the proposer is gone.
    pub async fn hold(&self) -> Result<Hold, ProposeError> {
        let flag = HoldFlag(Arc::clone(&self.held));
        self.held.send_replace(true);
        // What was queued before the hold goes first (the proposer takes it in batches).
        while self.tx.capacity() < self.tx.max_capacity() {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        let slots = Arc::clone(&self.slots)
            .acquire_many_owned(u32::try_from(IN_FLIGHT).unwrap_or(u32::MAX))
            .await
            .map_err(|_| ProposeError::Stopped)?;
        Ok(Hold {
            _slots: slots,
            _flag: flag,
        })
    }

    /// Whether a hold is taken (or being taken).
    #[must_use]
    pub fn is_held(&self) -> bool {
        *self.held.borrow()
    }

    /// Resolves once no hold is taken.
    pub async fn unheld(&self) {
        let mut rx = self.held.subscribe();
        let _ = rx.wait_for(|held| !held).await;
    }

    /// Queue `command` for the next entry, in call order (one publisher's commands keep their
    /// order; while a [`Hold`] is taken, after it), and return the pending reply, which resolves once the entry has committed on a
    /// majority and been applied.
    ///
    /// # Errors
    /// [`ProposeError::Stopped`] when the proposer is gone.
    pub async fn submit(
        &self,
        command: Command<ReplicatedMessage>,
    ) -> Result<Pending, ProposeError> {
        if self.is_held() {
            self.unheld().await;
        }
        let (tx, rx) = oneshot::channel();
        self.tx
            .send((Box::new(command), tx))
            .await
            .map_err(|_| ProposeError::Stopped)?;
        Ok(Pending(rx))
    }

    /// [`Proposer::submit`] and wait for the reply.
    ///
    /// # Errors
    /// See [`ProposeError`].
    pub async fn propose(
        &self,
        command: Command<ReplicatedMessage>,
    ) -> Result<Reply<ReplicatedMessage>, ProposeError> {
        self.submit(command).await?.reply().await
    }
}

/// A submitted command's reply, to come.
#[derive(Debug)]
pub struct Pending(oneshot::Receiver<Result<Reply<ReplicatedMessage>, ProposeError>>);

impl Pending {
    /// Wait for the reply.
    ///
    /// # Errors
    /// See [`ProposeError`].
    pub async fn reply(self) -> Result<Reply<ReplicatedMessage>, ProposeError> {
        self.0.await.map_err(|_| ProposeError::Stopped)?
    }
}

async fn run(
    raft: Raft<QueueRaft>,
    mut rx: mpsc::Receiver<(Box<Command<ReplicatedMessage>>, Waiter)>,
    slots: Arc<Semaphore>,
) {
    loop {
        let Some(first) = rx.recv().await else {
            return;
        };
        // Then wait for an entry slot (an idle proposer holds none, so a hold can take them
        // all): while all are taken, commands keep queueing and the next entry takes them all.
        let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let mut batch = vec![first];
        while batch.len() < BATCH_MAX {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let (commands, waiters): (Vec<_>, Vec<_>) = batch.into_iter().map(|(c, w)| (*c, w)).unzip();
        // Submitted here, in order (entries are appended in submission order, so one
        // publisher's messages keep their order across entries); awaited in a task.
        let submitted = raft
            .client_write_ff(QueueRequest {
                at: now_ms(),
                commands,
                meta: Vec::new(),
            })
            .await;
        let rx = match submitted {
            Ok(rx) => rx,
            Err(fatal) => {
                let err = ProposeError::Unknown(fatal.to_string());
                for waiter in waiters {
                    let _ = waiter.send(Err(err.clone()));
                }
                return;
            }
        };
        tokio::spawn(async move {
            let result = rx.await;
            drop(permit);
            let replies = match result {
                Ok(Ok(resp)) => Ok(resp.data.replies),
                Ok(Err(ClientWriteError::ForwardToLeader(f))) => {
                    Err(ProposeError::NotLeader(f.leader_id))
                }
                Ok(Err(other)) => Err(ProposeError::Unknown(other.to_string())),
                Err(e) => Err(ProposeError::Unknown(e.to_string())),
            };
            match replies {
                Ok(replies) => {
                    for (waiter, reply) in waiters.into_iter().zip(replies) {
                        let _ = waiter.send(reply.map_err(ProposeError::Refused));
                    }
                }
                Err(err) => {
                    for waiter in waiters {
                        let _ = waiter.send(Err(err.clone()));
                    }
                }
            }
        });
    }
}
