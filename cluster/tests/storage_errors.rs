//! A storage error stops the replica (openraft's fatal path): it is never retried silently,
//! and the others carry on without it. Here one replica's log starts failing every append; it
//! shuts down, the two others keep a majority, elect a leader among themselves if needed, and
//! go on committing.

mod common;

use std::fmt::Debug;
use std::ops::RangeBounds;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::{Cluster, WAIT, msg};
use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{
    ErrorSubject, ErrorVerb, LogId, LogState, OptionalSend, RaftLogReader, ServerState,
    StorageIOError, Vote,
};
use warren_cluster::log::store::LogStore;
use warren_cluster::types::{NodeId, QueueRaft, StorageError};

type Entry = openraft::Entry<QueueRaft>;

/// A log whose appends fail once `fail` is set (a disk that went bad).
#[derive(Clone)]
struct FailingLog {
    inner: LogStore,
    fail: Arc<AtomicBool>,
}

impl RaftLogReader<QueueRaft> for FailingLog {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        self.inner.try_get_log_entries(range).await
    }
}

impl RaftLogStorage<QueueRaft> for FailingLog {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<QueueRaft>, StorageError> {
        self.inner.get_log_state().await
    }

    async fn get_log_reader(&mut self) -> Self {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        self.inner.save_vote(vote).await
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        self.inner.read_vote().await
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<QueueRaft>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        if self.fail.load(Ordering::SeqCst) {
            let e = std::io::Error::other("injected disk failure");
            let err: StorageError = StorageIOError::new(
                ErrorSubject::Logs,
                ErrorVerb::Write,
                openraft::AnyError::new(&e),
            )
            .into();
            callback.log_io_completed(Err(e));
            return Err(err);
        }
        self.inner.append(entries, callback).await
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        self.inner.truncate(log_id).await
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        self.inner.purge(log_id).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_disk_fails_stops_and_the_others_go_on() {
    let all = [1, 2, 3];
    let mut c = Cluster::empty(Cluster::config());
    let fail = Arc::new(AtomicBool::new(false));
    let log = LogStore::open(&c.log_path(1)).expect("a log");
    c.boot_with(
        1,
        FailingLog {
            inner: log,
            fail: Arc::clone(&fail),
        },
    )
    .await;
    c.boot(2).await;
    c.boot(3).await;
    c.initialize(&all).await;
    let leader = c.leader(&all, None).await;
    c.write(leader, 1_000, (0..5).map(msg).collect()).await;
    c.converged(leader, &all).await;

    // Node 1's disk goes bad; the next append it attempts stops it.
    fail.store(true, Ordering::SeqCst);
    let rest = [2, 3];
    let leader = if leader == 1 {
        // Node 1 leads: its own append of the next entry fails.
        let _ = c.nodes[&1]
            .raft
            .client_write(warren_cluster::types::QueueRequest {
                at: 2_000,
                commands: vec![msg(5)],
                meta: Vec::new(),
            })
            .await;
        c.leader(&rest, Some(1)).await
    } else {
        c.write(leader, 2_000, vec![msg(5)]).await;
        leader
    };
    c.nodes[&1]
        .raft
        .wait(Some(WAIT))
        .state(ServerState::Shutdown, "the failed replica stops")
        .await
        .expect("a storage error stops the replica");
    // The other two carry on and agree.
    c.write(leader, 3_000, vec![msg(6), msg(7)]).await;
    c.converged(leader, &rest).await;
    let ready = c.nodes[&leader].sm.with_machine(|m| m.ready_len());
    assert!((7..=8).contains(&ready), "{ready} ready");
}
