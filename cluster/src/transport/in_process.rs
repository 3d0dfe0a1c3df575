//! An in-process network between the Raft instances of one process, for tests of a replicated
//! queue under faults:
//! - cutting nodes off: their RPCs, both ways, fail as unreachable, as a partition or a dead
//!   peer looks to openraft;
//! - [`Faults`] from a seed: RPCs dropped before delivery, replies lost after the target acted
//!   (the sender cannot tell which), and random delays, which reorder concurrent RPCs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use openraft::error::{InstallSnapshotError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{BasicNode, Raft};

use crate::types::{NodeId, QueueRaft};

type Rpc<T, E = openraft::error::Infallible> =
    Result<T, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>;

#[derive(Default)]
struct Table {
    nodes: BTreeMap<NodeId, Raft<QueueRaft>>,
    /// Nodes cut off from every other.
    isolated: BTreeSet<NodeId>,
    faults: Option<Faults>,
}

/// Random message faults, reproducible from a seed (the order in which concurrent RPCs draw
/// from it still depends on scheduling).
#[derive(Debug, Clone)]
pub struct Faults {
    /// Chance in 1000 that an RPC is dropped before it reaches the target.
    pub drop_per_mille: u64,
    /// Chance in 1000 that the reply is lost after the target handled the RPC.
    pub lose_reply_per_mille: u64,
    /// Largest delay before delivery, in milliseconds.
    pub max_delay_ms: u64,
    state: u64,
}

impl Faults {
    /// Faults drawn from `seed`.
    #[must_use]
    pub fn new(
        seed: u64,
        drop_per_mille: u64,
        lose_reply_per_mille: u64,
        max_delay_ms: u64,
    ) -> Self {
        Self {
            drop_per_mille,
            lose_reply_per_mille,
            max_delay_ms,
            state: seed,
        }
    }

    /// The next number of the seeded sequence (tests also draw their own choices from it).
    pub fn pick(&mut self) -> u64 {
        self.next()
    }

    /// splitmix64: small, fast and good enough to spread faults.
    fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// What the faults decided for one RPC.
#[derive(Debug, Clone, Copy, Default)]
struct Fate {
    drop: bool,
    lose_reply: bool,
    delay_ms: u64,
}

/// The nodes of one in-process group. Clones share it.
#[derive(Clone, Default)]
pub struct Router {
    table: Arc<Mutex<Table>>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = self.lock();
        f.debug_struct("Router")
            .field("nodes", &t.nodes.keys().collect::<Vec<_>>())
            .field("isolated", &t.isolated)
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
#[error("node {0} is unreachable")]
struct Cut(NodeId);

impl Router {
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Make `raft` reachable as `id`.
    pub fn add(&self, id: NodeId, raft: Raft<QueueRaft>) {
        self.lock().nodes.insert(id, raft);
    }

    /// Forget `id` (a node that stopped).
    pub fn remove(&self, id: NodeId) -> Option<Raft<QueueRaft>> {
        self.lock().nodes.remove(&id)
    }

    /// Cut `id` off from the others (a partition with it alone on one side).
    pub fn isolate(&self, id: NodeId) {
        self.lock().isolated.insert(id);
    }

    /// Reconnect `id`.
    pub fn heal(&self, id: NodeId) {
        self.lock().isolated.remove(&id);
    }

    /// Inject `faults` into every RPC from now on (None: a perfect network).
    pub fn set_faults(&self, faults: Option<Faults>) {
        self.lock().faults = faults;
    }

    fn fate(&self) -> Fate {
        let mut t = self.lock();
        let Some(f) = t.faults.as_mut() else {
            return Fate::default();
        };
        Fate {
            drop: f.next() % 1000 < f.drop_per_mille,
            lose_reply: f.next() % 1000 < f.lose_reply_per_mille,
            delay_ms: f.next() % (f.max_delay_ms + 1),
        }
    }

    /// The network handle of node `from` (what its Raft instance sends through).
    #[must_use]
    pub fn network(&self, from: NodeId) -> NodeNetwork {
        NodeNetwork {
            router: self.clone(),
            from,
        }
    }

    /// The target's Raft, when `from` can reach it.
    fn route(&self, from: NodeId, to: NodeId) -> Result<Raft<QueueRaft>, Unreachable> {
        let t = self.lock();
        if t.isolated.contains(&from) || t.isolated.contains(&to) {
            return Err(Unreachable::new(&Cut(to)));
        }
        t.nodes
            .get(&to)
            .cloned()
            .ok_or_else(|| Unreachable::new(&Cut(to)))
    }
}

/// One node's view of the router (openraft's network factory).
#[derive(Debug, Clone)]
pub struct NodeNetwork {
    router: Router,
    from: NodeId,
}

/// A connection from one node to another.
#[derive(Debug)]
pub struct Connection {
    router: Router,
    from: NodeId,
    to: NodeId,
}

impl RaftNetworkFactory<QueueRaft> for NodeNetwork {
    type Network = Connection;

    async fn new_client(&mut self, target: NodeId, _node: &BasicNode) -> Connection {
        Connection {
            router: self.router.clone(),
            from: self.from,
            to: target,
        }
    }
}

impl Connection {
    /// Deliver `call` to the target through the faults: maybe delayed, maybe dropped before,
    /// maybe its reply lost after.
    async fn deliver<T, E, F>(&self, call: impl FnOnce(Raft<QueueRaft>) -> F) -> Rpc<T, E>
    where
        E: std::error::Error,
        F: std::future::Future<Output = Result<T, RaftError<NodeId, E>>>,
    {
        let fate = self.router.fate();
        if fate.delay_ms > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(fate.delay_ms)).await;
        }
        if fate.drop {
            return Err(Unreachable::new(&Cut(self.to)).into());
        }
        // Checked after the delay: a partition that began meanwhile stops the message too.
        let raft = self.router.route(self.from, self.to)?;
        let reply = call(raft)
            .await
            .map_err(|e| RPCError::RemoteError(RemoteError::new(self.to, e)));
        if fate.lose_reply {
            return Err(Unreachable::new(&Cut(self.to)).into());
        }
        reply
    }
}

impl RaftNetwork<QueueRaft> for Connection {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<QueueRaft>,
        _option: RPCOption,
    ) -> Rpc<AppendEntriesResponse<NodeId>> {
        self.deliver(|raft| async move { raft.append_entries(rpc).await })
            .await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<QueueRaft>,
        _option: RPCOption,
    ) -> Rpc<InstallSnapshotResponse<NodeId>, InstallSnapshotError> {
        self.deliver(|raft| async move { raft.install_snapshot(rpc).await })
            .await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        _option: RPCOption,
    ) -> Rpc<VoteResponse<NodeId>> {
        self.deliver(|raft| async move { raft.vote(rpc).await })
            .await
    }
}
