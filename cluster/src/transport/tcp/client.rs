//! The client side of the cluster port: dialling a peer (over TLS when configured) and
//! passing its challenge, openraft's network over it ([`TcpNetwork`], a [`TcpConnection`] per
//! peer), pipelined forwarding links to a group's leader ([`ForwardLink`]), one-off requests
//! to a peer's replica ([`PeerCall`]), and pings ([`ping_loop`]). Where each peer is dialled
//! is [`Addresses`].

use std::collections::HashMap;
use std::net::SocketAddr;
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
use ring::hmac;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use warren_broker::node::replication::Listing;

use crate::proposer::ProposeError;
use crate::types::{NodeId, QueueRaft};

use super::wire::{
    Challenge, ForwardReplies, Forwarded, GroupId, Hello, Proof, RemoteEvent, RemoteQueueStats,
    Request, Response, Secret, Stream, TransportError, Verdict, proof_input, read_frame,
    write_frame,
};
use super::{heard_from, silent_for};

/// Dial `addr` (`ip:port`, or `host:port` resolved at every dial, so a peer whose DNS name
/// moves to a new IP, as a restarted Kubernetes pod's does, is found again), over TLS when `tls`
/// is given: the server name is the address's IP, or the host name it was dialled by.
async fn dial(addr: &str, tls: Option<&TlsConnector>) -> Result<Stream, TransportError> {
    use tokio_rustls::rustls::pki_types::ServerName;
    let (s, name) = match addr.parse::<SocketAddr>() {
        Ok(sock) => (TcpStream::connect(sock).await?, ServerName::from(sock.ip())),
        Err(_) => {
            // An IP literal, bracketed or not, parsed above: this is a DNS name and a port.
            let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
            let name = ServerName::try_from(host.to_string())
                .map_err(|e| TransportError::Frame(format!("peer address {addr}: {e}")))?;
            (connect_any(addr).await?, name)
        }
    };
    s.set_nodelay(true)?;
    match tls {
        None => Ok(Box::new(s)),
        Some(connector) => Ok(Box::new(connector.connect(name, s).await?)),
    }
}

/// Connect to the first of the addresses `host:port` resolves to that answers (`localhost`
/// gives `::1` and `127.0.0.1`; a node may listen on only one of them).
async fn connect_any(addr: &str) -> Result<TcpStream, TransportError> {
    let mut last = None;
    for sock in tokio::net::lookup_host(addr).await? {
        match TcpStream::connect(sock).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.map_or_else(
        || TransportError::Frame(format!("peer address {addr} resolves to nothing")),
        TransportError::from,
    ))
}

/// Where and how to reach one peer's replica of a group, for a single request.
#[derive(Clone)]
pub struct PeerCall {
    /// This node.
    pub from: NodeId,
    /// The peer.
    pub to: NodeId,
    /// The group.
    pub group: GroupId,
    /// The peer's cluster port.
    pub addr: String,
    /// The cluster's secret.
    pub secret: Secret,
    /// TLS to the peer, if the cluster port uses it.
    pub tls: Option<TlsConnector>,
}

impl std::fmt::Debug for PeerCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerCall")
            .field("to", &self.to)
            .field("group", &self.group)
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// Ask voter `peer` not to stand for election for `ms` (this node leads the group).
///
/// # Errors
/// The peer could not be reached or answered out of turn.
pub async fn request_abstain(peer: PeerCall, ms: u64) -> Result<bool, TransportError> {
    match one_call(peer, Request::Abstain(ms)).await? {
        Response::Abstaining(ok) => Ok(ok),
        _ => Err(TransportError::Frame("a response of another kind".into())),
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
    match one_call(peer, Request::Transfer(target)).await? {
        Response::Transferred(r) => Ok(r),
        _ => Err(TransportError::Frame("a response of another kind".into())),
    }
}

/// Ask voter `peer` to stand for election now (this node leads the group).
///
/// # Errors
/// The peer could not be reached or answered out of turn.
pub async fn request_campaign(peer: PeerCall) -> Result<bool, TransportError> {
    match one_call(peer, Request::Campaign).await? {
        Response::Campaigning(started) => Ok(started),
        _ => Err(TransportError::Frame("a response of another kind".into())),
    }
}

async fn one_call(peer: PeerCall, request: Request) -> Result<Response, TransportError> {
    let mut conn = TcpConnection {
        from: peer.from,
        to: peer.to,
        group: peer.group,
        addr: peer.addr,
        secret: peer.secret,
        tls: peer.tls,
        stream: None,
    };
    conn.call(request).await
}

/// A pipelined forwarding link to a peer (see [`serve_forwards`]): requests go out as they
/// come, and each gets its response in order.
///
/// [`serve_forwards`]: super::server
pub struct ForwardLink {
    w: tokio::io::WriteHalf<Stream>,
    waiting: Arc<std::sync::Mutex<std::collections::VecDeque<ForwardWaiter>>>,
    reader: tokio::task::JoinHandle<()>,
}

type ForwardWaiter =
    tokio::sync::oneshot::Sender<Result<Result<ForwardReplies, ProposeError>, String>>;

impl std::fmt::Debug for ForwardLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ForwardLink")
    }
}

impl Drop for ForwardLink {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl ForwardLink {
    /// Open and authenticate a link from `from` to peer `to` at `addr` for `group`.
    ///
    /// # Errors
    /// The connection or the challenge failed.
    pub async fn open(
        from: NodeId,
        to: NodeId,
        group: GroupId,
        addr: String,
        secret: Secret,
        tls: Option<TlsConnector>,
    ) -> Result<Self, TransportError> {
        let conn = TcpConnection {
            from,
            to,
            group,
            addr,
            secret,
            tls,
            stream: None,
        };
        let s = conn.connect().await?;
        let (mut r, w) = tokio::io::split(s);
        let waiting: Arc<std::sync::Mutex<std::collections::VecDeque<ForwardWaiter>>> =
            Arc::default();
        let queue = Arc::clone(&waiting);
        let reader = tokio::spawn(async move {
            loop {
                let outcome = match read_frame::<Response, _>(&mut r).await {
                    Ok(Response::Forward(x)) => Ok(x),
                    Ok(_) => Err("a response of another kind".to_string()),
                    Err(e) => Err(e.to_string()),
                };
                let failed = outcome.is_err();
                let waiter = queue
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .pop_front();
                if let Some(waiter) = waiter {
                    let _ = waiter.send(outcome.clone());
                }
                if failed {
                    // Every request still waiting has an unknown outcome.
                    let rest: Vec<ForwardWaiter> = queue
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .drain(..)
                        .collect();
                    for w in rest {
                        let _ = w.send(outcome.clone());
                    }
                    return;
                }
                heard_from(to);
            }
        });
        Ok(Self { w, waiting, reader })
    }

    /// Whether the link broke (open a new one).
    #[must_use]
    pub fn is_broken(&self) -> bool {
        self.reader.is_finished()
    }

    /// A handle that breaks the link (a reply overdue: the peer is behind a black hole),
    /// so the next batch opens a new one, to whichever node leads by then.
    #[must_use]
    pub fn breaker(&self) -> tokio::task::AbortHandle {
        self.reader.abort_handle()
    }

    /// Send `f`; the receiver resolves with the peer's response, or the reason there is none
    /// (the outcome is then unknown).
    pub async fn send(
        &mut self,
        f: Forwarded,
    ) -> tokio::sync::oneshot::Receiver<Result<Result<ForwardReplies, ProposeError>, String>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(tx);
        if let Err(e) = write_frame(&mut self.w, &Request::Forward(f)).await {
            // The reader fails what waits once the socket closes; make sure it does.
            self.reader.abort();
            let rest: Vec<ForwardWaiter> = self
                .waiting
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .drain(..)
                .collect();
            for w in rest {
                let _ = w.send(Err(e.to_string()));
            }
        }
        rx
    }
}

/// A connection to a peer's classic queue service (group `$classic`): deliveries from the
/// classic queues held here to consumers attached there, and the stats of those held there.
/// One request at a time; a failed one drops the connection, and the next dials again.
#[derive(Debug)]
pub struct ClassicPeer(TcpConnection);

impl ClassicPeer {
    /// A connection from `from` to peer `to` at `addr` (dialled on first use).
    #[must_use]
    pub fn new(
        from: NodeId,
        to: NodeId,
        addr: String,
        secret: Secret,
        tls: Option<TlsConnector>,
    ) -> Self {
        Self(TcpConnection {
            from,
            to,
            group: GroupId {
                name: super::server::CLASSIC_PREFIX.into(),
                incarnation: 0,
            },
            addr,
            secret,
            tls,
            stream: None,
        })
    }

    /// Send deliveries; answers the consumers the peer does not have (their deliveries go
    /// back to their queues).
    ///
    /// # Errors
    /// The peer could not be reached or answered out of turn (whether it took the
    /// deliveries is unknown).
    pub async fn deliver(&mut self, events: Vec<RemoteEvent>) -> Result<Vec<u64>, TransportError> {
        match self.0.call(Request::Deliver(events)).await? {
            Response::Delivered(unknown) => Ok(unknown),
            _ => Err(TransportError::Frame("a response of another kind".into())),
        }
    }

    /// The classic queues the peer holds.
    ///
    /// # Errors
    /// The peer could not be reached or answered out of turn.
    pub async fn stats(&mut self) -> Result<Vec<RemoteQueueStats>, TransportError> {
        match self.0.call(Request::ClassicStats).await? {
            Response::ClassicStats(stats) => Ok(stats),
            _ => Err(TransportError::Frame("a response of another kind".into())),
        }
    }

    /// The peer's management listing of `kind` (a JSON array, UTF-8).
    ///
    /// # Errors
    /// The peer could not be reached or answered out of turn.
    pub async fn listing(&mut self, kind: Listing) -> Result<Vec<u8>, TransportError> {
        match self.0.call(Request::Listing(kind)).await? {
            Response::Listing(json) => Ok(json),
            _ => Err(TransportError::Frame("a response of another kind".into())),
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
            .0
            .call(Request::CloseConnection { name, reason })
            .await?
        {
            Response::Closed(found) => Ok(found),
            _ => Err(TransportError::Frame("a response of another kind".into())),
        }
    }
}

/// Where this node dials each peer: its own `--peers` list, not the addresses a group's
/// membership recorded (those are the initialising node's view, which a proxy, a NAT or a
/// renamed host can make wrong from here). Shared by every group of a node.
#[derive(Clone, Default)]
pub struct Addresses {
    known: Arc<RwLock<HashMap<NodeId, String>>>,
    tls: Option<TlsConnector>,
}

impl std::fmt::Debug for Addresses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Addresses")
            .field("known", &self.known)
            .field("tls", &self.tls.is_some())
            .finish()
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
}

/// Keeps one authenticated connection from `from` to peer `to` (through the metadata group,
/// which every node serves) and pings it while nothing else was heard from it lately, so
/// [`silent_for`] reflects every peer, not only those this node replicates with.
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
    let mut conn = TcpConnection {
        from,
        to,
        group,
        addr,
        secret,
        tls: addresses.tls(),
        stream: None,
    };
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop() {
        tick.tick().await;
        if silent_for(to).is_some_and(|s| s < every) {
            continue;
        }
        if let Some(addr) = addresses.get(to) {
            conn.addr = addr;
        }
        // A peer behind a black hole must not hold the loop: an answer takes a moment.
        let _ = tokio::time::timeout(every, conn.call(Request::Ping)).await;
    }
}

/// Node `from`'s client side for one group: openraft's network factory over TCP.
#[derive(Debug, Clone)]
pub struct TcpNetwork {
    from: NodeId,
    group: GroupId,
    secret: Secret,
    addresses: Addresses,
}

impl TcpNetwork {
    /// The network of node `from`'s replica of `group`, in a cluster sharing `secret`. It
    /// dials peers at the addresses their membership records.
    #[must_use]
    pub fn new(from: NodeId, group: GroupId, secret: Secret) -> Self {
        Self {
            from,
            group,
            secret,
            addresses: Addresses::default(),
        }
    }

    /// Dial the peers `addresses` knows there rather than where the membership says.
    #[must_use]
    pub fn resolving(mut self, addresses: Addresses) -> Self {
        self.addresses = addresses;
        self
    }
}

/// A connection to one peer, opened on first use and again after a failure.
pub struct TcpConnection {
    from: NodeId,
    to: NodeId,
    group: GroupId,
    addr: String,
    secret: Secret,
    tls: Option<TlsConnector>,
    stream: Option<Stream>,
}

impl std::fmt::Debug for TcpConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpConnection")
            .field("from", &self.from)
            .field("to", &self.to)
            .field("group", &self.group)
            .field("addr", &self.addr)
            .field("tls", &self.tls.is_some())
            .field("connected", &self.stream.is_some())
            .finish()
    }
}

impl RaftNetworkFactory<QueueRaft> for TcpNetwork {
    type Network = TcpConnection;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> TcpConnection {
        TcpConnection {
            from: self.from,
            to: target,
            group: self.group.clone(),
            addr: self
                .addresses
                .get(target)
                .unwrap_or_else(|| node.addr.clone()),
            secret: self.secret.clone(),
            tls: self.addresses.tls(),
            stream: None,
        }
    }
}

type Rpc<T, E = openraft::error::Infallible> =
    Result<T, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>;

impl TcpConnection {
    async fn connect(&self) -> Result<Stream, TransportError> {
        let mut s = match dial(&self.addr, self.tls.as_ref()).await {
            Ok(s) => s,
            Err(TransportError::Io(e)) => {
                if e.kind() == std::io::ErrorKind::ConnectionRefused {
                    super::refused_by(self.to);
                }
                return Err(TransportError::Io(e));
            }
            Err(e) => return Err(e),
        };
        let hello = Hello {
            from: self.from,
            to: self.to,
            group: self.group.clone(),
        };
        write_frame(&mut s, &hello).await?;
        let challenge: Challenge = read_frame(&mut s).await?;
        let mac = hmac::sign(&self.secret.0, &proof_input(&challenge.nonce, &hello));
        write_frame(
            &mut s,
            &Proof {
                mac: mac.as_ref().to_vec(),
            },
        )
        .await?;
        match read_frame(&mut s).await? {
            Verdict::Welcome => Ok(s),
            Verdict::Refused => Err(TransportError::Auth),
            Verdict::NoSuchGroup => Err(TransportError::NoSuchGroup(self.group.clone())),
        }
    }

    /// Send `request` and read its response; the connection is dropped on any failure, so
    /// the next RPC starts clean.
    async fn call(&mut self, request: Request) -> Result<Response, TransportError> {
        let mut s = match self.stream.take() {
            Some(s) => s,
            None => self.connect().await?,
        };
        write_frame(&mut s, &request).await?;
        let response = read_frame(&mut s).await?;
        heard_from(self.to);
        self.stream = Some(s);
        Ok(response)
    }

    fn failed<E: std::error::Error>(
        &self,
        e: TransportError,
    ) -> RPCError<NodeId, BasicNode, RaftError<NodeId, E>> {
        match e {
            TransportError::Io(io) => Unreachable::new(&io).into(),
            other => NetworkError::new(&other).into(),
        }
    }

    // openraft's own RPC error type, returned through its network trait.
    #[allow(clippy::result_large_err)]
    fn remote<T, E: std::error::Error>(&self, r: Result<T, RaftError<NodeId, E>>) -> Rpc<T, E> {
        r.map_err(|e| RPCError::RemoteError(RemoteError::new(self.to, e)))
    }

    fn mismatch<E: std::error::Error>(&self) -> RPCError<NodeId, BasicNode, RaftError<NodeId, E>> {
        self.failed(TransportError::Frame("a response of another kind".into()))
    }
}

impl RaftNetwork<QueueRaft> for TcpConnection {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<QueueRaft>,
        _option: RPCOption,
    ) -> Rpc<AppendEntriesResponse<NodeId>> {
        match self.call(Request::AppendEntries(rpc)).await {
            Ok(Response::AppendEntries(r)) => self.remote(r),
            Ok(_) => Err(self.mismatch()),
            Err(e) => Err(self.failed(e)),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<QueueRaft>,
        _option: RPCOption,
    ) -> Rpc<InstallSnapshotResponse<NodeId>, InstallSnapshotError> {
        match self.call(Request::InstallSnapshot(rpc)).await {
            Ok(Response::InstallSnapshot(r)) => self.remote(r),
            Ok(_) => Err(self.mismatch()),
            Err(e) => Err(self.failed(e)),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        _option: RPCOption,
    ) -> Rpc<VoteResponse<NodeId>> {
        match self.call(Request::Vote(rpc)).await {
            Ok(Response::Vote(r)) => self.remote(r),
            Ok(_) => Err(self.mismatch()),
            Err(e) => Err(self.failed(e)),
        }
    }
}
