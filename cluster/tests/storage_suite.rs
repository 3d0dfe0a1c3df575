//! openraft's storage conformance suite (`openraft::testing::Suite`) against Warren's redb log
//! store and the queue state machine: vote and log persistence, truncation and purging, log
//! state, membership recovery from log and state machine, apply, and snapshot transfer.

use openraft::testing::{StoreBuilder, Suite};
use tempfile::TempDir;
use warren_broker::queue::machine::QueueConfig;
use warren_cluster::log_store::LogStore;
use warren_cluster::state_machine::QueueStateMachine;
use warren_cluster::types::{QueueRaft, StorageError};

/// Builds a log store (whole, or with bodies split out as a quorum queue's) and a queue
/// state machine.
struct Builder {
    split: bool,
}

impl StoreBuilder<QueueRaft, LogStore, QueueStateMachine, TempDir> for Builder {
    async fn build(&self) -> Result<(TempDir, LogStore, QueueStateMachine), StorageError> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("raft.redb");
        let log = if self.split {
            LogStore::open_split(&path)
        } else {
            LogStore::open(&path)
        }
        .expect("a new log store");
        Ok((dir, log, QueueStateMachine::new(QueueConfig::default())))
    }
}

#[test]
fn openraft_storage_conformance_suite() {
    if let Err(e) = Suite::test_all(Builder { split: false }) {
        panic!("the storage suite failed: {e}");
    }
}

/// A quorum queue's log, bodies split out, passes the suite alike.
#[test]
fn openraft_storage_conformance_suite_with_bodies_split_out() {
    if let Err(e) = Suite::test_all(Builder { split: true }) {
        panic!("the storage suite failed: {e}");
    }
}
