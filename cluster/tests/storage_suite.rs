//! openraft's storage conformance suite (`openraft::testing::Suite`) against Warren's redb log
//! store and the queue state machine: vote and log persistence, truncation and purging, log
//! state, membership recovery from log and state machine, apply, and snapshot transfer.

use openraft::testing::{StoreBuilder, Suite};
use std::sync::Arc;

use tempfile::TempDir;
use warren_broker::queue::machine::QueueConfig;
use warren_cluster::log::node_log::NodeLog;
use warren_cluster::log::store::LogStore;
use warren_cluster::state_machine::QueueStateMachine;
use warren_cluster::types::{QueueRaft, StorageError};
use warren_store::wal::{Wal, WalOptions};

/// Builds a log store (a plain one, a quorum queue's in a file of its own, or a quorum queue
/// group's in a node-wide log) and a queue state machine.
struct Builder {
    queue: bool,
    node_log: bool,
    wal: bool,
}

impl StoreBuilder<QueueRaft, LogStore, QueueStateMachine, TempDir> for Builder {
    async fn build(&self) -> Result<(TempDir, LogStore, QueueStateMachine), StorageError> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("raft.redb");
        let log = if self.wal {
            let wal =
                Arc::new(Wal::open(&dir.path().join("wal"), WalOptions::default()).expect("a WAL"));
            // Another group's entries beside it: the suite sees only its own group's.
            let other = LogStore::in_wal(&wal, 1).expect("another group");
            other
                .append_now(vec![openraft::Entry {
                    log_id: openraft::LogId::new(openraft::CommittedLeaderId::new(9, 9), 1),
                    payload: openraft::EntryPayload::Blank,
                }])
                .expect("another group's entry");
            LogStore::in_wal(&wal, 42)
        } else if self.node_log {
            let node = NodeLog::open(&path, 1 << 20).expect("a node log");
            // Another group's entries beside it: the suite sees only its own group's.
            let other = LogStore::in_node_log(&node, 1).expect("another group");
            other
                .append_now(vec![openraft::Entry {
                    log_id: openraft::LogId::new(openraft::CommittedLeaderId::new(9, 9), 5),
                    payload: openraft::EntryPayload::Blank,
                }])
                .expect("another group's entry");
            LogStore::in_node_log(&node, 42)
        } else if self.queue {
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
    if let Err(e) = Suite::test_all(Builder {
        queue: false,
        node_log: false,
        wal: false,
    }) {
        panic!("the storage suite failed: {e}");
    }
}

/// A quorum queue's log passes the suite alike.
#[test]
fn openraft_storage_conformance_suite_for_a_quorum_queue_log() {
    if let Err(e) = Suite::test_all(Builder {
        queue: true,
        node_log: false,
        wal: false,
    }) {
        panic!("the storage suite failed: {e}");
    }
}

/// A quorum queue group's log in the node-wide log (beside another group's) passes it alike.
#[test]
fn openraft_storage_conformance_suite_for_a_group_in_the_node_log() {
    if let Err(e) = Suite::test_all(Builder {
        queue: true,
        node_log: true,
        wal: false,
    }) {
        panic!("the storage suite failed: {e}");
    }
}

/// A quorum queue group's log in the node's write-ahead log (beside another group's) passes
/// it alike.
#[test]
fn openraft_storage_conformance_suite_for_a_group_in_the_wal() {
    if let Err(e) = Suite::test_all(Builder {
        queue: true,
        node_log: false,
        wal: true,
    }) {
        panic!("the storage suite failed: {e}");
    }
}
