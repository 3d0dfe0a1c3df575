//! The client side of the cluster port, over this node's one [`Link`] per peer: openraft's
//! network ([`TcpNetwork`], a [`TcpConnection`] per group and peer), pipelined forwarding to a
//! group's leader ([`ForwardLink`]), one-off requests to a peer's replica ([`PeerCall`]), the
//! classic queues' traffic ([`ClassicPeer`]) and pings ([`ping_loop`]). Where each peer is
//! dialled, and the link to it, is [`Addresses`].

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use openraft::BasicNode;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use tokio_rustls::TlsConnector;

use warren_broker::node::replication::Listing;

use crate::proposer::ProposeError;
use crate::types::{NodeId, QueueRaft};

use super::link::{Answering, Link, Links, refused};
use super::silent_for;
use super::wire::{
    ClassicRequest, ClassicResponse, ForwardReplies, Forwarded, GroupId, HandoverRequest,
    HandoverResponse, RaftRequest, RaftResponse, RemoteEvent, RemoteQueueStats, Request, Response,
    Secret, TransportError,
};

/// Requests to one group on one peer, over the node's link to that peer.
#[derive(Debug, Clone)]
struct ToGroup {
    link: Link,
    group: GroupId,
}

impl ToGroup {
    /// From `from` to `to`'s `group`, over the link `addresses` keeps (it dials `addr` when the
    /// node has no address of its own for `to`).
    fn new(
        addresses: &Addresses,
        from: NodeId,
        to: NodeId,
        group: GroupId,
        addr: String,
        secret: &Secret,
    ) -> Self {
        Self {
            link: addresses.link(from, to, secret, Some(addr)),
            group,
        }
    }

    /// Send `request` and wait for its answer (a refusal names the group).
    async fn call(&self, request: &Request) -> Result<Response, TransportError> {
        self.link
            .call(&self.group, request)
            .await
            .map_err(|e| refused(e, &self.group))
    }
}

/// One-off requests to one peer's replica of a group (a handover's).
#[derive(Debug, Clone)]
pub struct PeerCall(ToGroup);

impl PeerCall {
    /// Requests from `from` to `to`'s replica of `group`, over the link `addresses` keeps (it
    /// dials `addr` when the node has no address of its own for `to`).
    #[must_use]
    pub fn new(
        addresses: &Addresses,
        from: NodeId,
        to: NodeId,
        group: GroupId,
        addr: String,
        secret: &Secret,
    ) -> Self {
        Self(ToGroup::new(addresses, from, to, group, addr, secret))
    }

    async fn handover(&self, request: HandoverRequest) -> Result<HandoverResponse, TransportError> {
        match self.0.call(&Request::Handover(request)).await? {
            Response::Handover(r) => Ok(r),
            _ => Err(other_kind()),
        }
    }
}

fn other_kind() -> TransportError {
    TransportError::Frame("a response of another kind".into())
}

/// Ask voter `peer` not to stand for election for `ms` (this node leads the group).
///
/// # Errors
/// The peer could not be reached or answered out of turn.
pub async fn request_abstain(peer: PeerCall, ms: u64) -> Result<bool, TransportError> {
    match peer.handover(HandoverRequest::Abstain(ms)).await? {
        HandoverResponse::Abstaining(ok) => Ok(ok),
        _ => Err(other_kind()),
    }
}

/// Ask `peer`, the group's leader (for all this node knows), to hand leadership to `target`;
/// resolves with the new leader, or why it did not move.
///
/// # Errors
/// The peer could not be reached or answered out of turn.
pub async fn request_transfer(
    peer: PeerCall,
    target: NodeId,
) -> Result<Result<NodeId, String>, TransportError> {
    match peer.handover(HandoverRequest::Transfer(target)).await? {
        HandoverResponse::Transferred(r) => Ok(r),
        _ => Err(other_kind()),
    }
}

/// Ask voter `peer` to stand for election now (this node leads the group).
///
/// # Errors
/// The peer could not be reached or answered out of turn.
pub async fn request_campaign(peer: PeerCall) -> Result<bool, TransportError> {
    match peer.handover(HandoverRequest::Campaign).await? {
        HandoverResponse::Campaigning(started) => Ok(started),
        _ => Err(other_kind()),
    }
}

/// Forwarding to a peer that leads a group (or holds a classic queue): batches go out as they
/// come, each staged at the peer in the order sent, each answered on its own.
#[derive(Debug, Clone)]
pub struct ForwardLink(ToGroup);

/// A forwarded batch's replies to come (see [`ForwardLink::send`]).
pub struct ForwardAnswer {
    answering: Answering,
    group: GroupId,
}

impl ForwardAnswer {
    /// The leader's replies, or why there are none: [`TransportError::NotSent`] when nothing
    /// reached the peer, anything else when the outcome is unknown.
    ///
    /// # Errors
    /// As above.
    pub async fn replies(self) -> Result<Result<ForwardReplies, ProposeError>, TransportError> {
        match self.answering.await {
            Ok(Response::Forward(r)) => Ok(r),
            Ok(_) => Err(other_kind()),
            Err(e) => Err(refused(e, &self.group)),
        }
    }
}

impl ForwardLink {
    /// Forwarding from `from` to peer `to` for `group`, over the link `addresses` keeps (it
    /// dials `addr` when the node has no address of its own for `to`).
    #[must_use]
    pub fn new(
        addresses: &Addresses,
        from: NodeId,
        to: NodeId,
        group: GroupId,
        addr: String,
        secret: &Secret,
    ) -> Self {
        Self(ToGroup::new(addresses, from, to, group, addr, secret))
    }

    /// Queue `f` after the batches sent before it; resolves once it is queued.
    ///
    /// # Errors
    /// [`TransportError::NotSent`] (the link is gone) or a frame that does not encode:
    /// nothing was sent.
    pub async fn send(&self, f: Forwarded) -> Result<ForwardAnswer, TransportError> {
        let request = Request::Forward(f);
        let answering = self.0.link.send(&self.0.group, &request).await?;
        Ok(ForwardAnswer {
            answering,
            group: self.0.group.clone(),
        })
    }
}

/// Requests to a peer's classic queue service (group `$classic`): deliveries from the classic
/// queues held here to consumers attached there, the stats of those held there, listings and
/// closing connections.
#[derive(Debug, Clone)]
pub struct ClassicPeer(ToGroup);

impl ClassicPeer {
    /// Requests from `from` to peer `to`, over the link `addresses` keeps (it dials `addr`
    /// when the node has no address of its own for `to`).
    #[must_use]
    pub fn new(
        addresses: &Addresses,
        from: NodeId,
        to: NodeId,
        addr: String,
        secret: &Secret,
    ) -> Self {
        let group = GroupId {
            name: super::server::CLASSIC_PREFIX.into(),
            incarnation: 0,
        };
        Self(ToGroup::new(addresses, from, to, group, addr, secret))
    }

    async fn call(&self, request: ClassicRequest) -> Result<ClassicResponse, TransportError> {
        match self.0.call(&Request::Classic(request)).await? {
            Response::Classic(r) => Ok(r),
            _ => Err(other_kind()),
        }
    }

    /// Send deliveries; answers the consumers the peer does not have (their deliveries go
    /// back to their queues).
    ///
    /// # Errors
    /// The peer could not be reached or answered out of turn (whether it took the
    /// deliveries is unknown).
    pub async fn deliver(&mut self, events: Vec<RemoteEvent>) -> Result<Vec<u64>, TransportError> {
        match self.call(ClassicRequest::Deliver(events)).await? {
            ClassicResponse::Delivered(unknown) => Ok(unknown),
            _ => Err(other_kind()),
        }
    }

    /// The classic queues the peer holds.
    ///
    /// # Errors
    /// The peer could not be reached or answered out of turn.
    pub async fn stats(&mut self) -> Result<Vec<RemoteQueueStats>, TransportError> {
        match self.call(ClassicRequest::Stats).await? {
            ClassicResponse::Stats(stats) => Ok(stats),
            _ => Err(other_kind()),
        }
    }

    /// The peer's management listing of `kind` (a JSON array, UTF-8).
    ///
    /// # Errors
    /// The peer could not be reached or answered out of turn.
    pub async fn listing(&mut self, kind: Listing) -> Result<Vec<u8>, TransportError> {
        match self.call(ClassicRequest::Listing(kind)).await? {
            ClassicResponse::Listing(json) => Ok(json),
            _ => Err(other_kind()),
        }
    }

    /// Close AMQP connection `name` if it is open on the peer; whether it was.
    ///
    /// # Errors
    /// The peer could not be reached or answered out of turn.
    pub async fn close_connection(
        &mut self,
        name: String,
        reason: String,
    ) -> Result<bool, TransportError> {
        match self
            .call(ClassicRequest::CloseConnection { name, reason })
            .await?
        {
            ClassicResponse::Closed(found) => Ok(found),
            _ => Err(other_kind()),
        }
    }
}

/// Where this node dials each peer, and its one link to each: its own `--peers` list, not the
/// addresses a group's membership recorded (those are the initialising node's view, which a
/// proxy, a NAT or a renamed host can make wrong from here). Shared by every group of a node.
#[derive(Clone, Default)]
pub struct Addresses {
    known: Arc<RwLock<HashMap<NodeId, String>>>,
    tls: Option<TlsConnector>,
    links: Links,
}

impl std::fmt::Debug for Addresses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Addresses")
            .field("known", &self.known)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl Addresses {
    /// Dial every peer over TLS with `connector`.
    #[must_use]
    pub fn with_tls(mut self, connector: TlsConnector) -> Self {
        self.tls = Some(connector);
        self
    }

    /// The TLS connector peers are dialled with, if any.
    #[must_use]
    pub fn tls(&self) -> Option<TlsConnector> {
        self.tls.clone()
    }

    /// Dial `id` at `addr` from now on.
    pub fn insert(&self, id: NodeId, addr: String) {
        self.known
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, addr);
    }

    /// Where to dial `id`, if this node knows.
    #[must_use]
    pub fn get(&self, id: NodeId) -> Option<String> {
        self.known
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&id)
            .cloned()
    }

    /// The link from `from` to `to` (made on first use; call on a runtime), dialling
    /// `fallback` while this node has no address of its own for `to`.
    fn link(&self, from: NodeId, to: NodeId, secret: &Secret, fallback: Option<String>) -> Link {
        self.links
            .get(from, to, secret, self.tls.clone(), &self.known, fallback)
    }
}

/// Pings peer `to` over this node's link to it (kept in `addresses`) while nothing else was
/// heard from it lately, so [`silent_for`] reflects every peer, not only those this node
/// replicates with.
pub async fn ping_loop(
    from: NodeId,
    to: NodeId,
    group: GroupId,
    addresses: Addresses,
    secret: Secret,
    every: std::time::Duration,
    stop: impl Fn() -> bool,
) {
    let Some(addr) = addresses.get(to) else {
        return;
    };
    let link = addresses.link(from, to, &secret, Some(addr));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop() {
        tick.tick().await;
        if silent_for(to).is_some_and(|s| s < every) {
            continue;
        }
        // A peer behind a black hole must not hold the loop: an answer takes a moment.
        let _ = tokio::time::timeout(every, link.call(&group, &Request::Ping)).await;
    }
}

/// Node `from`'s client side for one group: openraft's network factory over the node's links.
#[derive(Debug, Clone)]
pub struct TcpNetwork {
    from: NodeId,
    group: GroupId,
    secret: Secret,
    addresses: Addresses,
    /// The links this group used, by peer: openraft asks for a client per heartbeat, and the
    /// node's table of links is shared by every group.
    links: HashMap<NodeId, Link>,
}

impl TcpNetwork {
    /// The network of node `from`'s replica of `group`, in a cluster sharing `secret`. It
    /// dials peers at the addresses their membership records, over links of its own.
    #[must_use]
    pub fn new(from: NodeId, group: GroupId, secret: Secret) -> Self {
        Self {
            from,
            group,
            secret,
            addresses: Addresses::default(),
            links: HashMap::new(),
        }
    }

    /// Use the links `addresses` keeps (shared with the node's other groups) and dial the
    /// peers it knows there rather than where the membership says.
    #[must_use]
    pub fn resolving(mut self, addresses: Addresses) -> Self {
        self.addresses = addresses;
        self.links.clear();
        self
    }
}

/// Openraft's client of one peer's replica of a group: RPCs over the node's link to the peer.
///
/// At most one request of a client is in flight. Openraft drops an append that outlives its
/// timeout (the heartbeat interval) and sends the same entries again; over a link shared by
/// every group, the dropped request is still on its way and the peer still works through it,
/// so under overload each retry would queue more stale megabytes ahead of the live ones and
/// every append would time out (measured: 1,000 queues at 20 msg/s each stalled). So a call
/// first waits out its predecessor's answer (within its own timeout), as a connection per
/// replication stream, closed on a timeout, bounded it before.
pub struct TcpConnection {
    to: NodeId,
    group: GroupId,
    link: Link,
    /// The answer of a request openraft gave up on, still to come.
    inflight: Option<Answering>,
}

impl std::fmt::Debug for TcpConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpConnection")
            .field("to", &self.to)
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

impl RaftNetworkFactory<QueueRaft> for TcpNetwork {
    type Network = TcpConnection;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> TcpConnection {
        let link = match self.links.get(&target).filter(|l| !l.is_closed()) {
            Some(link) => link.clone(),
            None => {
                let link =
                    self.addresses
                        .link(self.from, target, &self.secret, Some(node.addr.clone()));
                self.links.insert(target, link.clone());
                link
            }
        };
        TcpConnection {
            to: target,
            group: self.group.clone(),
            link,
            inflight: None,
        }
    }
}

type Rpc<T, E = openraft::error::Infallible> =
    Result<T, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>;

impl TcpConnection {
    async fn call(&mut self, request: RaftRequest) -> Result<RaftResponse, TransportError> {
        // Cancellation-safe: a call dropped while waiting leaves the answer to the next.
        if let Some(earlier) = &mut self.inflight {
            let _ = earlier.await;
            self.inflight = None;
        }
        let sent = self.link.send(&self.group, &Request::Raft(request)).await;
        let answer = match sent {
            Ok(answering) => self.inflight.insert(answering).await,
            Err(e) => Err(e),
        };
        self.inflight = None;
        match answer {
            Ok(Response::Raft(r)) => Ok(r),
            Ok(_) => Err(other_kind()),
            Err(e) => Err(refused(e, &self.group)),
        }
    }

    fn failed<E: std::error::Error>(
        &self,
        e: TransportError,
    ) -> RPCError<NodeId, BasicNode, RaftError<NodeId, E>> {
        match e {
            TransportError::Io(io) => Unreachable::new(&io).into(),
            e @ TransportError::NotSent(_) => Unreachable::new(&e).into(),
            other => NetworkError::new(&other).into(),
        }
    }

    // openraft's own RPC error type, returned through its network trait.
    #[allow(clippy::result_large_err)]
    fn remote<T, E: std::error::Error>(&self, r: Result<T, RaftError<NodeId, E>>) -> Rpc<T, E> {
        r.map_err(|e| RPCError::RemoteError(RemoteError::new(self.to, e)))
    }

    fn mismatch<E: std::error::Error>(&self) -> RPCError<NodeId, BasicNode, RaftError<NodeId, E>> {
        self.failed(other_kind())
    }
}

// The calls are boxed: openraft keeps each replication stream's future for the life of the
// leadership, sized for the largest future it awaits, so an unboxed call would make every
// leader's streams that much larger (thousands of groups per node).
impl RaftNetwork<QueueRaft> for TcpConnection {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<QueueRaft>,
        _option: RPCOption,
    ) -> Rpc<AppendEntriesResponse<NodeId>> {
        match Box::pin(self.call(RaftRequest::AppendEntries(rpc))).await {
            Ok(RaftResponse::AppendEntries(r)) => self.remote(r),
            Ok(_) => Err(self.mismatch()),
            Err(e) => Err(self.failed(e)),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<QueueRaft>,
        _option: RPCOption,
    ) -> Rpc<InstallSnapshotResponse<NodeId>, InstallSnapshotError> {
        match Box::pin(self.call(RaftRequest::InstallSnapshot(rpc.into()))).await {
            Ok(RaftResponse::InstallSnapshot(r)) => self.remote(r),
            Ok(_) => Err(self.mismatch()),
            Err(e) => Err(self.failed(e)),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        _option: RPCOption,
    ) -> Rpc<VoteResponse<NodeId>> {
        match Box::pin(self.call(RaftRequest::Vote(rpc))).await {
            Ok(RaftResponse::Vote(r)) => self.remote(r),
            Ok(_) => Err(self.mismatch()),
            Err(e) => Err(self.failed(e)),
        }
    }
}
