//! An in-process network between the Raft instances of one process: for deterministic tests
//! of a replicated queue, with faults injected by cutting nodes off (their RPCs, both ways,
//! fail as unreachable, as a partition or a dead peer looks to openraft).

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
    fn target(&self) -> Result<Raft<QueueRaft>, Unreachable> {
        self.router.route(self.from, self.to)
    }
}

impl RaftNetwork<QueueRaft> for Connection {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<QueueRaft>,
        _option: RPCOption,
    ) -> Rpc<AppendEntriesResponse<NodeId>> {
        let raft = self.target()?;
        raft.append_entries(rpc)
            .await
            .map_err(|e| RPCError::RemoteError(RemoteError::new(self.to, e)))
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<QueueRaft>,
        _option: RPCOption,
    ) -> Rpc<InstallSnapshotResponse<NodeId>, InstallSnapshotError> {
        let raft = self.target()?;
        raft.install_snapshot(rpc)
            .await
            .map_err(|e| RPCError::RemoteError(RemoteError::new(self.to, e)))
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        _option: RPCOption,
    ) -> Rpc<VoteResponse<NodeId>> {
        let raft = self.target()?;
        raft.vote(rpc)
            .await
            .map_err(|e| RPCError::RemoteError(RemoteError::new(self.to, e)))
    }
}
