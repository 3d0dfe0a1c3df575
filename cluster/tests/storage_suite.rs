//! openraft's storage conformance suite (`openraft::testing::Suite`) against Warren's redb log
//! store and the queue state machine: vote and log persistence, truncation and purging, log
//! state, membership recovery from log and state machine, apply, and snapshot transfer.

use openraft::testing::{StoreBuilder, Suite};
use tempfile::TempDir;
use warren_broker::queue::machine::QueueConfig;
use warren_cluster::log_store::LogStore;
use warren_cluster::state_machine::QueueStateMachine;
use warren_cluster::types::{QueueRaft, StorageError};

/// Builds a log store (a plain one, or a quorum queue's) and a queue
/// state machine.
struct Builder {
    queue: bool,
}

impl StoreBuilder<QueueRaft, LogStore, QueueStateMachine, TempDir> for Builder {
    async fn build(&self) -> Result<(TempDir, LogStore, QueueStateMachine), StorageError> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("raft.redb");
        let log = if self.queue {
            LogStore::open_queue(&path)
        } else {
            LogStore::open(&path)
        }
        .expect("a new log store");
        Ok((dir, log, QueueStateMachine::new(QueueConfig::default())))
    }
}

#[test]
fn openraft_storage_conformance_suite() {
    if let Err(e) = Suite::test_all(Builder { queue: false }) {
        panic!("the storage suite failed: {e}");
    }
}

/// A quorum queue's log passes the suite alike.
#[test]
fn openraft_storage_conformance_suite_for_a_quorum_queue_log() {
    if let Err(e) = Suite::test_all(Builder { queue: true }) {
        panic!("the storage suite failed: {e}");
    }
}
