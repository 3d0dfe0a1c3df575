//! The queue machine alone as openraft's state machine: a replicated queue without a broker,
//! as the replication tests and the `replicated_bench` example run it. (The broker's quorum
//! queues apply into the broker's own queue instead, `node/replicas.rs`; both are a
//! [`GroupStateMachine`], which tracks what openraft needs and keeps entry times monotonic.)
//!
//! The effects the machine produces (deliveries, removals) are the same on every replica; the
//! driver on the leader acts on them ([`QueueStateMachine::take_effects`]), followers drop them.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use warren_broker::queue::machine::{Effect, QueueConfig, QueueMachine};

use crate::group::{Applied, GroupStateMachine};
use crate::types::{QueueRequest, QueueResponse, ReplicatedMessage};

/// The machine and the effects of applied entries not yet taken by the driver (bounded by
/// what the driver leaves: a follower's driver takes and drops them after every apply).
#[derive(Debug)]
pub struct LocalQueue {
    inner: Mutex<(
        QueueMachine<ReplicatedMessage>,
        Vec<Effect<ReplicatedMessage>>,
    )>,
}

impl LocalQueue {
    fn lock(
        &self,
    ) -> MutexGuard<
        '_,
        (
            QueueMachine<ReplicatedMessage>,
            Vec<Effect<ReplicatedMessage>>,
        ),
    > {
        // A panic while applying would have stopped the replica; the state itself stays
        // consistent (each command is applied whole), so a poisoned lock is still readable.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Applied for LocalQueue {
    fn apply(&self, at: u64, _index: u64, request: QueueRequest) -> QueueResponse {
        let mut inner = self.lock();
        let (machine, effects) = &mut *inner;
        QueueResponse {
            replies: request
                .commands
                .into_iter()
                .map(|c| machine.apply(at, c, effects))
                .collect(),
        }
    }

    fn snapshot(&self) -> Result<Vec<u8>, String> {
        crate::codec::encode(&self.lock().0).map_err(|e| e.to_string())
    }

    fn install(&self, bytes: &[u8], _last: u64) -> Result<(), String> {
        let machine = crate::codec::decode_machine(bytes).map_err(|e| e.to_string())?;
        let mut inner = self.lock();
        inner.0 = machine;
        // Effects of the replaced state no longer describe anything.
        inner.1.clear();
        Ok(())
    }
}

/// One replica's queue state. Clones share it (the snapshot builder is a clone).
pub type QueueStateMachine = GroupStateMachine<LocalQueue>;

impl GroupStateMachine<LocalQueue> {
    /// An empty queue with `config`.
    #[must_use]
    pub fn new(config: QueueConfig) -> Self {
        Self::over(Arc::new(LocalQueue {
            inner: Mutex::new((QueueMachine::with_config(config), Vec::new())),
        }))
    }

    /// The effects of the entries applied since the last call (deliveries, removals).
    pub fn take_effects(&self) -> Vec<Effect<ReplicatedMessage>> {
        std::mem::take(&mut self.applied().lock().1)
    }

    /// A canonical rendering of the machine's state (maps in key order), to check that
    /// replicas at the same applied index hold the same state.
    #[must_use]
    pub fn state_digest(&self) -> String {
        serde_json::to_value(&self.applied().lock().0)
            .map(|v| v.to_string())
            .unwrap_or_default()
    }

    /// Run `f` on the machine (reads for the driver and tests).
    pub fn with_machine<T>(&self, f: impl FnOnce(&QueueMachine<ReplicatedMessage>) -> T) -> T {
        f(&self.applied().lock().0)
    }
}
