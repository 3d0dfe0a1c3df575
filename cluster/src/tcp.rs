//! Raft RPCs between nodes over TCP, authenticated with the cluster's shared secret.
//!
//! Wire format: frames of a 4-byte big-endian length and a [`codec`](crate::codec) body, at most
//! [`FRAME_MAX`] bytes (checked before allocating). A connection opens with a challenge: the
//! client names itself, its target and the group (queue and incarnation), the server answers
//! with a random nonce, the client proves it holds the secret with
//! HMAC-SHA256(secret, nonce ‖ hello), and only then are RPCs served, to that group only. The
//! secret never crosses the wire, and a recorded proof is useless against a new nonce. (TLS
//! for this port comes later; the secret authenticates, it does not encrypt.)
//!
//! A node serves many groups on one port ([`Groups`]). A group is named by its queue and an
//! incarnation id, fixed when the queue is declared: a replica of a deleted queue that comes
//! back asks for the old incarnation and is refused, so it can never replay its entries into
//! a re-created queue of the same name (RabbitMQ issue 12366).
//!
//! One connection carries one RPC at a time: openraft opens a client per replication stream,
//! so streams do not queue behind each other.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, PoisonError, RwLock};

use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{BasicNode, Raft};
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use warren_broker::queue::machine::{Command, Reply};

use crate::proposer::{ProposeError, Proposer};
use crate::types::{MetaChange, NodeId, QueueRaft, QueueRequest, ReplicatedMessage};

/// When each peer was last heard from (an RPC it answered or sent), process-wide: a node
/// runs one transport, and every group's traffic shows the peer is alive.
static HEARD: std::sync::LazyLock<std::sync::Mutex<HashMap<NodeId, std::time::Instant>>> =
    std::sync::LazyLock::new(Default::default);

fn heard_from(peer: NodeId) {
    HEARD
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(peer, std::time::Instant::now());
}

/// How long ago `peer` was last heard from over the cluster port (None: never, in this
/// process's life).
#[must_use]
pub fn silent_for(peer: NodeId) -> Option<std::time::Duration> {
    HEARD
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&peer)
        .map(std::time::Instant::elapsed)
}

/// Largest frame accepted (an append of many entries, or a snapshot chunk).
pub const FRAME_MAX: u32 = 64 * 1024 * 1024;

/// Why a connection failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The socket failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A frame that does not decode, or over [`FRAME_MAX`].
    #[error("bad frame: {0}")]
    Frame(String),
    /// The peer failed the challenge (wrong secret, or it is not who the frame said).
    #[error("authentication failed")]
    Auth,
    /// The target does not host that group (or that incarnation of it).
    #[error("no group {0} on the target")]
    NoSuchGroup(GroupId),
}

/// A replicated queue's identity: its name (vhost-qualified by the caller) and the incarnation
/// it was declared with.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GroupId {
    /// The queue.
    pub name: String,
    /// Chosen when the queue is declared; a re-declared queue gets a new one.
    pub incarnation: u64,
}

impl std::fmt::Display for GroupId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}#{}", self.name, self.incarnation)
    }
}

/// One group as a node serves it: its Raft instance and its leader-side batcher (used when
/// another node forwards commands here).
#[derive(Clone)]
struct Served {
    raft: Raft<QueueRaft>,
    proposer: Proposer,
    relay: Option<Relay>,
    transfer: Option<Transfer>,
    /// Until when this replica abstains from elections (a leader handing over asked).
    abstain_until: Arc<std::sync::Mutex<Option<std::time::Instant>>>,
}

/// Where a node sends metadata changes that peers forwarded to it: its own path to the
/// group's leader, so a peer that reached a follower (a node joining through a seed) is
/// served too.
pub type Relay = Arc<
    dyn Fn(Forwarded) -> tokio::sync::oneshot::Receiver<Result<ForwardReplies, ProposeError>>
        + Send
        + Sync,
>;

/// The groups a node hosts, by id. Clones share the table.
#[derive(Clone, Default)]
pub struct Groups {
    by_id: Arc<RwLock<HashMap<GroupId, Served>>>,
}

impl std::fmt::Debug for Groups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<String> = self
            .by_id
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .map(ToString::to_string)
            .collect();
        f.debug_tuple("Groups").field(&ids).finish()
    }
}

impl Groups {
    /// Serve `raft` as `id` (with a proposer for forwarded commands; call on a runtime).
    pub fn insert(&self, id: GroupId, raft: Raft<QueueRaft>) -> Proposer {
        let proposer = Proposer::start(raft.clone());
        self.by_id
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                id,
                Served {
                    raft,
                    proposer: proposer.clone(),
                    relay: None,
                    transfer: None,
                    abstain_until: Arc::default(),
                },
            );
        proposer
    }

    /// Relay the metadata changes peers forward to group `id` through `relay`.
    pub fn set_relay(&self, id: &GroupId, relay: Relay) {
        if let Some(s) = self
            .by_id
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(id)
        {
            s.relay = Some(relay);
        }
    }

    /// Hand leadership of group `id` to another voter through `transfer` when asked.
    pub fn set_transfer(&self, id: &GroupId, transfer: Transfer) {
        if let Some(s) = self
            .by_id
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(id)
        {
            s.transfer = Some(transfer);
        }
    }

    /// Stop serving `id` (its queue was deleted, or the replica moved).
    pub fn remove(&self, id: &GroupId) -> Option<Raft<QueueRaft>> {
        self.by_id
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id)
            .map(|s| s.raft)
    }

    fn get(&self, id: &GroupId) -> Option<Served> {
        self.by_id
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .cloned()
    }
}

async fn write_frame<T: Serialize, W: AsyncWriteExt + Unpin>(
    s: &mut W,
    value: &T,
) -> Result<(), TransportError> {
    let body = crate::codec::encode(value).map_err(|e| TransportError::Frame(e.to_string()))?;
    let len = u32::try_from(body.len())
        .ok()
        .filter(|l| *l <= FRAME_MAX)
        .ok_or_else(|| TransportError::Frame(format!("{} bytes to send", body.len())))?;
    s.write_all(&len.to_be_bytes()).await?;
    s.write_all(&body).await?;
    // TLS buffers until flushed (a no-op on plain TCP).
    s.flush().await?;
    Ok(())
}

/// A cluster connection: TCP, or TLS over TCP.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send + Sync + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + Sync + 'static> Io for T {}
type Stream = Box<dyn Io>;

/// TLS on the cluster port: every node presents a certificate and verifies its peers' against
/// the cluster's CA, both ways (the shared secret still authenticates each connection; TLS
/// adds confidentiality and keeps nodes without the CA's certificate out).
#[derive(Clone)]
pub struct ClusterTls {
    /// Accepts peers' connections (a client certificate is required).
    pub acceptor: TlsAcceptor,
    /// Dials peers (presenting this node's certificate).
    pub connector: TlsConnector,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterTls")
    }
}

/// Dial `addr`, over TLS when `tls` is given (the server name is the address's IP).
async fn dial(addr: &str, tls: Option<&TlsConnector>) -> Result<Stream, TransportError> {
    let sock: SocketAddr = addr
        .parse()
        .map_err(|e| TransportError::Frame(format!("peer address {addr}: {e}")))?;
    let s = TcpStream::connect(sock).await?;
    s.set_nodelay(true)?;
    match tls {
        None => Ok(Box::new(s)),
        Some(connector) => {
            let name = tokio_rustls::rustls::pki_types::ServerName::from(sock.ip());
            Ok(Box::new(connector.connect(name, s).await?))
        }
    }
}

async fn read_frame<T: DeserializeOwned, R: AsyncReadExt + Unpin>(
    s: &mut R,
) -> Result<T, TransportError> {
    let len = s.read_u32().await?;
    if len > FRAME_MAX {
        return Err(TransportError::Frame(format!("{len} bytes announced")));
    }
    let mut body = vec![0; len as usize];
    s.read_exact(&mut body).await?;
    crate::codec::decode(&body).map_err(|e| TransportError::Frame(e.to_string()))
}

#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    from: NodeId,
    to: NodeId,
    group: GroupId,
}

#[derive(Debug, Serialize, Deserialize)]
struct Challenge {
    nonce: Vec<u8>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Proof {
    mac: Vec<u8>,
}

#[derive(Debug, Serialize, Deserialize)]
enum Verdict {
    Welcome,
    Refused,
    NoSuchGroup,
}

/// What the proof covers: the nonce and the whole hello (so a proof for one group or one pair
/// of nodes is no proof for another).
fn proof_input(nonce: &[u8], hello: &Hello) -> Vec<u8> {
    let mut m = nonce.to_vec();
    m.extend_from_slice(&hello.from.to_be_bytes());
    m.extend_from_slice(&hello.to.to_be_bytes());
    m.extend_from_slice(&hello.group.incarnation.to_be_bytes());
    m.extend_from_slice(hello.group.name.as_bytes());
    m
}

#[derive(Debug, Serialize, Deserialize)]
enum Request {
    AppendEntries(AppendEntriesRequest<QueueRaft>),
    Vote(VoteRequest<NodeId>),
    InstallSnapshot(InstallSnapshotRequest<QueueRaft>),
    /// Commands (or metadata changes) from a node that is not the leader, to be proposed by
    /// the one that is.
    Forward(Forwarded),
    /// Are you there (nodes that share no replication traffic still learn each other's
    /// liveness)?
    Ping,
    /// To a group's leader: hand leadership to this voter (see [`Transfer`]).
    Transfer(NodeId),
    /// From a group's leader to the voter it hands leadership to: stand for election now.
    /// Ignored from any other node, so only the leader can make a replica campaign.
    Campaign,
    /// From a group's leader handing over in a group of more than three: do not stand for
    /// election for this many milliseconds (bounded by [`ABSTAIN_MAX`]), so only the voter it
    /// hands over to does (after it asked that one too). Ignored from any other node, except
    /// 0 ms: take part again at once.
    Abstain(u64),
}

/// Longest a replica abstains from elections when a leader asks.
pub const ABSTAIN_MAX: std::time::Duration = std::time::Duration::from_secs(15);

#[derive(Debug, Serialize, Deserialize)]
enum Response {
    AppendEntries(Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>),
    Vote(Result<VoteResponse<NodeId>, RaftError<NodeId>>),
    InstallSnapshot(
        Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>,
    ),
    Forward(Result<ForwardReplies, ProposeError>),
    Pong,
    /// The new leader, or why leadership did not move.
    Transferred(Result<NodeId, String>),
    /// Whether the replica stood for election.
    Campaigning(bool),
    /// Whether the replica abstains.
    Abstaining(bool),
}

/// How a node's leader replica hands its leadership to another voter: resolves with the new
/// leader, or why leadership did not move.
pub type Transfer = Arc<
    dyn Fn(NodeId) -> std::pin::Pin<Box<dyn Future<Output = Result<NodeId, String>> + Send>>
        + Send
        + Sync,
>;

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

/// What a node forwards to a group's leader.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Forwarded {
    /// Queue machine commands, proposed in order through the leader's batcher.
    pub commands: Vec<Command<ReplicatedMessage>>,
    /// Metadata changes (the metadata group), proposed as one entry.
    pub meta: Vec<MetaChange>,
}

/// The leader's replies to forwarded commands, one per command, in order.
pub type ForwardReplies = Vec<Result<Reply<ReplicatedMessage>, ProposeError>>;

/// A request handed to this node's proposer, its replies still to come. Staging is quick
/// (commands join the proposer's queue, in order), so many requests can be in flight while
/// their entries commit.
#[derive(Debug)]
pub enum Staged {
    /// One pending reply per command.
    Commands(Vec<crate::proposer::Pending>),
    /// A metadata entry being written.
    Meta(tokio::task::JoinHandle<Result<ForwardReplies, ProposeError>>),
    /// Failed before anything was proposed.
    Failed(ProposeError),
}

impl Staged {
    /// Wait for the replies.
    ///
    /// # Errors
    /// [`ProposeError::NotLeader`] when this replica does not lead (nothing was appended), or
    /// [`ProposeError::Unknown`] when the entry may or may not have committed.
    pub async fn replies(self) -> Result<ForwardReplies, ProposeError> {
        match self {
            Self::Failed(e) => Err(e),
            Self::Meta(h) => h
                .await
                .unwrap_or_else(|e| Err(ProposeError::Unknown(e.to_string()))),
            Self::Commands(pending) => {
                let mut replies = Vec::with_capacity(pending.len());
                for p in pending {
                    match p.reply().await {
                        Err(ProposeError::NotLeader(l)) if replies.is_empty() => {
                            return Err(ProposeError::NotLeader(l));
                        }
                        r => replies.push(r),
                    }
                }
                Ok(replies)
            }
        }
    }
}

/// Hand `f` to this node's replica: commands to its proposer (in order), each with its own
/// reply; metadata to a write of its own. A node's own submissions and those forwarded to it
/// take this same path.
pub async fn stage_here(raft: &Raft<QueueRaft>, proposer: &Proposer, f: Forwarded) -> Staged {
    if !f.meta.is_empty() {
        let raft = raft.clone();
        return Staged::Meta(tokio::spawn(async move {
            match raft
                .client_write(QueueRequest {
                    at: crate::proposer::now_ms(),
                    commands: Vec::new(),
                    meta: f.meta,
                })
                .await
            {
                Ok(_) => Ok(Vec::new()),
                Err(openraft::error::RaftError::APIError(
                    openraft::error::ClientWriteError::ForwardToLeader(l),
                )) => Err(ProposeError::NotLeader(l.leader_id)),
                Err(e) => Err(ProposeError::Unknown(e.to_string())),
            }
        }));
    }
    let mut pending = Vec::with_capacity(f.commands.len());
    for c in f.commands {
        match proposer.submit(c).await {
            Ok(p) => pending.push(p),
            Err(e) => return Staged::Failed(e),
        }
    }
    Staged::Commands(pending)
}

/// How long a leader whose connection closed may stay silent before its followers elect
/// another (more than a heartbeat interval, so a leader that merely reconnects is not
/// disturbed).
pub const LEADER_SILENCE_MAX: std::time::Duration = std::time::Duration::from_millis(400);

/// The connection from `peer` closed: if `peer` leads this group and then stays silent, it is
/// gone (a killed process's sockets close at once), so stand for election now rather than
/// after the election timeout. RabbitMQ reacts to a lost node the same way, on its
/// distribution link closing.
fn suspect_leader(raft: &Raft<QueueRaft>, peer: NodeId) {
    if raft.metrics().borrow().current_leader != Some(peer) {
        return;
    }
    let raft = raft.clone();
    tokio::spawn(async move {
        tokio::time::sleep(LEADER_SILENCE_MAX).await;
        let silent = silent_for(peer).is_none_or(|d| d >= LEADER_SILENCE_MAX);
        if silent && raft.metrics().borrow().current_leader == Some(peer) {
            tracing::info!(
                leader = peer,
                "the leader's connection closed and it is silent: electing"
            );
            let _ = raft.trigger().elect().await;
        }
    });
}

/// Stand for election because `leader`, this group's leader, asked to hand over (only a
/// voter does, and only when asked by the node it follows).
async fn campaign(raft: &Raft<QueueRaft>, leader: NodeId) -> bool {
    let (follows, voter) = {
        let m = raft.metrics();
        let m = m.borrow();
        (
            m.current_leader == Some(leader) && m.current_leader != Some(m.id),
            m.membership_config
                .membership()
                .voter_ids()
                .any(|v| v == m.id),
        )
    };
    if !(follows && voter) {
        return false;
    }
    tracing::info!(leader, "the leader hands over: electing");
    raft.trigger().elect().await.is_ok()
}

/// Stop standing for election for `ms` (bounded) because `leader`, whom this replica follows,
/// asked; elections come back on by themselves, or at once for a request of 0 ms. The latest
/// request sets the end.
fn abstain(served: &Served, leader: NodeId, ms: u64) -> bool {
    let raft = &served.raft;
    // Resuming (0 ms) is harmless from anyone: the old leader asks it after the handover.
    if ms > 0 && raft.metrics().borrow().current_leader != Some(leader) {
        return false;
    }
    let span = std::time::Duration::from_millis(ms).min(ABSTAIN_MAX);
    let until = std::time::Instant::now() + span;
    *served
        .abstain_until
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = Some(until);
    raft.runtime_config().elect(false);
    let (raft, abstain_until) = (raft.clone(), Arc::clone(&served.abstain_until));
    tokio::spawn(async move {
        tokio::time::sleep(span).await;
        let mut g = abstain_until.lock().unwrap_or_else(PoisonError::into_inner);
        // Only the timer of the latest request turns elections back on.
        if g.is_some_and(|u| u <= std::time::Instant::now()) {
            *g = None;
            drop(g);
            raft.runtime_config().elect(true);
        }
    });
    true
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

impl std::fmt::Debug for PeerCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerCall")
            .field("to", &self.to)
            .field("group", &self.group)
            .field("addr", &self.addr)
            .finish_non_exhaustive()
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

/// Most forwarded requests in flight on one connection.
pub const FORWARDS_IN_FLIGHT_MAX: usize = 16;

/// Serve a connection that forwards (after its first forward): requests are staged as they
/// arrive and answered in arrival order as their entries commit, so a forwarding node keeps
/// several batches in flight.
async fn serve_forwards(s: Stream, served: Served, first: Forwarded) -> Result<(), TransportError> {
    let Served {
        raft,
        proposer,
        relay,
        ..
    } = served;
    let (mut r, mut w) = tokio::io::split(s);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Staged>(FORWARDS_IN_FLIGHT_MAX);
    let writer = tokio::spawn(async move {
        while let Some(staged) = rx.recv().await {
            let response = Response::Forward(staged.replies().await);
            if write_frame(&mut w, &response).await.is_err() {
                return;
            }
        }
    });
    let mut next = Some(first);
    loop {
        let f = match next.take() {
            Some(f) => f,
            None => match read_frame(&mut r).await {
                Ok(Request::Forward(f)) => f,
                Ok(_) => break,
                Err(_) => break,
            },
        };
        let staged = match &relay {
            Some(relay) if !f.meta.is_empty() => {
                let rx = relay(f);
                Staged::Meta(tokio::spawn(async move {
                    rx.await.unwrap_or(Err(ProposeError::Stopped))
                }))
            }
            _ => stage_here(&raft, &proposer, f).await,
        };
        if tx.send(staged).await.is_err() {
            break;
        }
    }
    drop(tx);
    let _ = writer.await;
    Ok(())
}

/// A pipelined forwarding link to a peer (see [`serve_forwards`]): requests go out as they
/// come, and each gets its response in order.
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

/// The shared secret of a cluster, as an HMAC key.
#[derive(Clone)]
pub struct Secret(hmac::Key);

impl Secret {
    /// The key for `secret` (the same bytes on every node).
    #[must_use]
    pub fn new(secret: &[u8]) -> Self {
        Self(hmac::Key::new(hmac::HMAC_SHA256, secret))
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Serve Raft RPCs for node `me`'s `groups` on `listener` until the task is dropped.
///
/// # Errors
/// When the listener fails.
pub async fn serve(
    listener: TcpListener,
    me: NodeId,
    groups: Groups,
    secret: Secret,
) -> std::io::Result<()> {
    serve_tls(listener, me, groups, secret, None).await
}

/// [`serve`], with TLS on every connection when `tls` is given.
///
/// # Errors
/// When the listener fails.
pub async fn serve_tls(
    listener: TcpListener,
    me: NodeId,
    groups: Groups,
    secret: Secret,
    tls: Option<TlsAcceptor>,
) -> std::io::Result<()> {
    loop {
        let (stream, peer) = listener.accept().await?;
        let groups = groups.clone();
        let secret = secret.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let served = async {
                stream.set_nodelay(true)?;
                let s: Stream = match tls {
                    None => Box::new(stream),
                    Some(acceptor) => Box::new(acceptor.accept(stream).await?),
                };
                serve_connection(s, me, groups, secret).await
            };
            if let Err(e) = served.await {
                tracing::debug!(%peer, error = %e, "cluster connection ended");
            }
        });
    }
}

async fn serve_connection(
    mut s: Stream,
    me: NodeId,
    groups: Groups,
    secret: Secret,
) -> Result<(), TransportError> {
    let hello: Hello = read_frame(&mut s).await?;
    let mut nonce = vec![0u8; 32];
    SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| TransportError::Auth)?;
    write_frame(
        &mut s,
        &Challenge {
            nonce: nonce.clone(),
        },
    )
    .await?;
    let proof: Proof = read_frame(&mut s).await?;
    let valid =
        hello.to == me && hmac::verify(&secret.0, &proof_input(&nonce, &hello), &proof.mac).is_ok();
    if !valid {
        write_frame(&mut s, &Verdict::Refused).await?;
        return Err(TransportError::Auth);
    }
    let Some(served) = groups.get(&hello.group) else {
        write_frame(&mut s, &Verdict::NoSuchGroup).await?;
        return Err(TransportError::NoSuchGroup(hello.group));
    };
    let raft = served.raft.clone();
    write_frame(&mut s, &Verdict::Welcome).await?;
    heard_from(hello.from);
    // Only a connection that carried appends is the leader's replication stream: one-off
    // requests (a handover's, a ping) close as a matter of course.
    let mut replicating = false;
    loop {
        let request: Request = match read_frame(&mut s).await {
            Ok(r) => r,
            // The client closed the connection between RPCs.
            Err(TransportError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                if replicating {
                    suspect_leader(&raft, hello.from);
                }
                return Ok(());
            }
            Err(e) => {
                if replicating {
                    suspect_leader(&raft, hello.from);
                }
                return Err(e);
            }
        };
        heard_from(hello.from);
        replicating |= matches!(request, Request::AppendEntries(_));
        let response = match request {
            Request::AppendEntries(r) => Response::AppendEntries(raft.append_entries(r).await),
            Request::Vote(r) => Response::Vote(raft.vote(r).await),
            Request::InstallSnapshot(r) => {
                Response::InstallSnapshot(raft.install_snapshot(r).await)
            }
            Request::Forward(f) => return serve_forwards(s, served, f).await,
            Request::Ping => Response::Pong,
            Request::Transfer(to) => Response::Transferred(match &served.transfer {
                Some(transfer) => transfer(to).await,
                None => Err("this replica cannot transfer leadership".into()),
            }),
            Request::Campaign => Response::Campaigning(campaign(&raft, hello.from).await),
            Request::Abstain(ms) => Response::Abstaining(abstain(&served, hello.from, ms)),
        };
        write_frame(&mut s, &response).await?;
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
        let mut s = dial(&self.addr, self.tls.as_ref()).await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = l.local_addr().expect("bound");
        let (client, server) = tokio::join!(TcpStream::connect(addr), l.accept());
        (client.expect("connects"), server.expect("accepts").0)
    }

    #[tokio::test]
    async fn an_oversized_frame_is_refused_before_it_is_read() {
        let (mut client, mut server) = pair().await;
        client
            .write_all(&(FRAME_MAX + 1).to_be_bytes())
            .await
            .expect("writes");
        let r: Result<Hello, _> = read_frame(&mut server).await;
        assert!(matches!(r, Err(TransportError::Frame(_))), "{r:?}");
    }

    #[tokio::test]
    async fn frames_round_trip_and_proofs_bind_both_ends() {
        let (mut client, mut server) = pair().await;
        let group = GroupId {
            name: "q".into(),
            incarnation: 1,
        };
        write_frame(
            &mut client,
            &Hello {
                from: 1,
                to: 2,
                group: group.clone(),
            },
        )
        .await
        .expect("writes");
        let hello: Hello = read_frame(&mut server).await.expect("reads");
        assert_eq!((hello.from, hello.to, &hello.group), (1, 2, &group));
        let key = Secret::new(b"s");
        let nonce = [7u8; 32];
        let mac = hmac::sign(&key.0, &proof_input(&nonce, &hello));
        assert!(hmac::verify(&key.0, &proof_input(&nonce, &hello), mac.as_ref()).is_ok());
        // The same proof does not pass for another pair of nodes, another incarnation of the
        // group, or another nonce.
        let other = Hello {
            from: 3,
            to: 2,
            group: group.clone(),
        };
        assert!(hmac::verify(&key.0, &proof_input(&nonce, &other), mac.as_ref()).is_err());
        let reborn = Hello {
            from: 1,
            to: 2,
            group: GroupId {
                name: "q".into(),
                incarnation: 2,
            },
        };
        assert!(hmac::verify(&key.0, &proof_input(&nonce, &reborn), mac.as_ref()).is_err());
        assert!(hmac::verify(&key.0, &proof_input(&[8u8; 32], &hello), mac.as_ref()).is_err());
    }
}
