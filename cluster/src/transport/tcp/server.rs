//! The server side of the cluster port: the groups a node serves ([`Groups`]), accepting and
//! authenticating the link each peer dials, and serving what it carries by group and purpose:
//! Raft RPCs (each in a task of its own, so one group's slow append holds no other), forwarded
//! commands staged into the leader's proposer ([`stage_here`]) in the order they came, per
//! group, the requests of a leader handing over (campaign, abstain), classic queues' traffic
//! and pings. Answers are written by a task of the link's own that folds every answer ready
//! into one write. A leader whose link closes is suspected gone in the groups it replicated
//! over it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, PoisonError, RwLock};

use openraft::Raft;
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;

use warren_broker::node::replication::Listing;

use crate::proposer::{ProposeError, Proposer};
use crate::types::{NodeId, QueueRaft, QueueRequest};

use super::link::{FOLD_MAX, LINK_QUEUE_MAX, write_frames};
use super::wire::{
    ABSTAIN_MAX, Answer, Challenge, ClassicRequest, ClassicResponse, Envelope, ForwardReplies,
    Forwarded, GroupId, HandoverRequest, HandoverResponse, Hello, LINK_READ_BUFFER, Proof,
    RaftRequest, RaftResponse, Refusal, RemoteEvent, RemoteQueueStats, Request, Response, Secret,
    Stream, TransportError, Verdict, encode_frame, proof_input, read_frame, write_frame,
};
use super::{HEARD_EVERY, heard_from, silent_for};

/// One group as a node serves it: its Raft instance and its leader-side batcher (used when
/// another node forwards commands here).
#[derive(Clone)]
struct Served {
    /// Which serving of the group this is: a group served again (a replica that moved away
    /// and back) gets a new one, so a link's lane into the old one is not reused.
    serial: u64,
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
    classic: Arc<RwLock<Option<Arc<dyn ClassicService>>>>,
    /// Links from peers open now (authenticated, not yet closed).
    links: Arc<std::sync::atomic::AtomicUsize>,
    /// Links each peer opened to this node since it started (a peer that restarted or lost
    /// its link dials again): leaders tell such a peer about themselves at once.
    accepted: Arc<std::sync::Mutex<HashMap<NodeId, u64>>>,
    /// The last [`Served::serial`] given.
    serials: Arc<std::sync::atomic::AtomicU64>,
}

/// Group names under this prefix are not Raft groups: they reach the node's classic queues
/// ([`ClassicService`]). `$classic` alone carries deliveries and stats between nodes;
/// `$classic\0<vhost>\0<queue>` carries a proxy's commands to the queue's home.
pub const CLASSIC_PREFIX: &str = "$classic";

/// What a node does for the classic queues it holds (their *home*) and for the proxies of
/// classic queues held elsewhere (see `warren_broker::queue::Queue::is_remote`).
pub trait ClassicService: Send + Sync {
    /// Whether this node holds classic queue `queue` of `vhost` (a link to it may open).
    fn holds(&self, vhost: &str, queue: &str) -> bool;
    /// Carry out commands a proxy on node `from` sent to `queue` of `vhost`, held here; the
    /// receiver resolves with one reply per command (an enqueue's after its durable commit).
    fn forward(
        &self,
        from: NodeId,
        vhost: &str,
        queue: &str,
        f: Forwarded,
    ) -> tokio::sync::oneshot::Receiver<Result<ForwardReplies, ProposeError>>;
    /// Deliveries and cancellations from classic queues held on node `from` to consumers
    /// attached here; answers the consumers that are not (their deliveries go back).
    fn deliver(&self, from: NodeId, events: Vec<RemoteEvent>) -> Vec<u64>;
    /// The classic queues held here, for the proxies on node `from`.
    fn stats(&self, from: NodeId) -> Vec<RemoteQueueStats>;
    /// This node's management listing of `kind` (a JSON array, UTF-8).
    fn listing(&self, kind: Listing) -> tokio::sync::oneshot::Receiver<Vec<u8>>;
    /// Close AMQP connection `name` if it is open here; whether it was.
    fn close_connection(&self, name: &str, reason: String) -> bool;
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
        let serial = self
            .serials
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        self.by_id
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                id,
                Served {
                    serial,
                    raft,
                    proposer: proposer.clone(),
                    relay: None,
                    transfer: None,
                    abstain_until: Arc::default(),
                },
            );
        proposer
    }

    /// How many links peers have open to this node now: one per peer that talks to it,
    /// whatever the number of groups.
    #[must_use]
    pub fn open_links(&self) -> usize {
        self.links.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many links each peer opened to this node since it started; a change means the
    /// peer restarted or reconnected.
    #[must_use]
    pub fn links_accepted_by_peer(&self) -> HashMap<NodeId, u64> {
        self.accepted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Whether this node's replica of group `id` abstains from elections now (its leader,
    /// handing over, asked it to).
    #[must_use]
    pub fn abstaining(&self, id: &GroupId) -> bool {
        self.by_id
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .is_some_and(|served| {
                served
                    .abstain_until
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .is_some_and(|until| until > std::time::Instant::now())
            })
    }

    /// Serve classic queues' traffic through `service`.
    pub fn set_classic(&self, service: Arc<dyn ClassicService>) {
        *self.classic.write().unwrap_or_else(PoisonError::into_inner) = Some(service);
    }

    fn classic(&self) -> Option<Arc<dyn ClassicService>> {
        self.classic
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
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

    /// The serial of the serving of `id` now, if it is served.
    fn serial(&self, id: &GroupId) -> Option<u64> {
        self.by_id
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .map(|s| s.serial)
    }

    fn get(&self, id: &GroupId) -> Option<Served> {
        self.by_id
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .cloned()
    }
}

/// How a node's leader replica hands its leadership to another voter: resolves with the new
/// leader, or why leadership did not move.
pub type Transfer = Arc<
    dyn Fn(NodeId) -> std::pin::Pin<Box<dyn Future<Output = Result<NodeId, String>> + Send>>
        + Send
        + Sync,
>;

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
/// request sets the end. A group whose elections the node drives (openraft's own are off:
/// queues and streams) only records the end, which the node's watch reads
/// ([`Groups::abstaining`]).
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
    if !raft.config().enable_elect {
        return true;
    }
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

/// Most forwarded batches of one group in flight on one link (more are refused with
/// [`Refusal::Busy`]; a node's forwarder keeps at most this many in flight per group).
pub const FORWARDS_IN_FLIGHT_MAX: usize = 16;

/// The vhost and queue a `$classic\0<vhost>\0<queue>` group names (None: `$classic` alone,
/// or another name).
fn classic_target(name: &str) -> Option<(&str, &str)> {
    name.strip_prefix(CLASSIC_PREFIX)
        .and_then(|rest| rest.strip_prefix('\0'))
        .and_then(|rest| rest.split_once('\0'))
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
        super::link::runtime().spawn(async move {
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

/// Pass the challenge of a peer dialling in: the peer it says it is, proven with the secret.
async fn authenticate(
    s: &mut Stream,
    me: NodeId,
    secret: &Secret,
) -> Result<NodeId, TransportError> {
    let hello: Hello = read_frame(s).await?;
    let mut nonce = vec![0u8; 32];
    SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| TransportError::Auth)?;
    write_frame(
        s,
        &Challenge {
            nonce: nonce.clone(),
        },
    )
    .await?;
    let proof: Proof = read_frame(s).await?;
    let valid =
        hello.to == me && hmac::verify(&secret.0, &proof_input(&nonce, &hello), &proof.mac).is_ok();
    if !valid {
        write_frame(s, &Verdict::Refused).await?;
        return Err(TransportError::Auth);
    }
    write_frame(s, &Verdict::Welcome).await?;
    Ok(hello.from)
}

async fn serve_connection(
    mut s: Stream,
    me: NodeId,
    groups: Groups,
    secret: Secret,
) -> Result<(), TransportError> {
    let from = authenticate(&mut s, me, &secret).await?;
    heard_from(from);
    *groups
        .accepted
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .entry(from)
        .or_default() += 1;
    let _open = OpenLink::count(&groups.links);
    let (r, w) = tokio::io::split(super::traffic::counted(s, from));
    let mut r = tokio::io::BufReader::with_capacity(LINK_READ_BUFFER, r);
    let (out, rx) = mpsc::channel::<Vec<u8>>(LINK_QUEUE_MAX);
    let writer = tokio::spawn(write_answers(w, rx));
    let mut link = ServedLink {
        from,
        groups,
        out,
        lanes: HashMap::new(),
        replicated: HashSet::new(),
        classic_targets: HashSet::new(),
        told: std::time::Instant::now(),
        pruning: Pruning::default(),
    };
    let ended = loop {
        match read_frame::<Envelope, _>(&mut r).await {
            Ok(envelope) => {
                if link.serve(envelope).await.is_err() {
                    break Ok(());
                }
            }
            // The peer closed the link between requests.
            Err(TransportError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                break Ok(());
            }
            Err(e) => break Err(e),
        }
    };
    // The groups whose leader replicated over this link: if it stays silent, it is gone.
    for group in &link.replicated {
        if let Some(served) = link.groups.get(group) {
            suspect_leader(&served.raft, from);
        }
    }
    drop(link);
    // Answers still being prepared hold the writer; it ends once they are written or fail.
    drop(writer);
    ended
}

/// Counts a link as open while it lives.
struct OpenLink(Arc<std::sync::atomic::AtomicUsize>);

impl OpenLink {
    fn count(links: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        links.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self(Arc::clone(links))
    }
}

impl Drop for OpenLink {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Write answers as they come, every answer queued by then in one vectored write.
async fn write_answers(mut w: tokio::io::WriteHalf<Stream>, mut rx: mpsc::Receiver<Vec<u8>>) {
    let mut batch = Vec::with_capacity(FOLD_MAX);
    while rx.recv_many(&mut batch, FOLD_MAX).await > 0 {
        let frames: Vec<&[u8]> = batch.iter().map(Vec::as_slice).collect();
        if write_frames(&mut w, &frames).await.is_err() {
            return;
        }
        batch.clear();
    }
}

/// A link a peer dialled: the requests it carries, served by group and purpose.
struct ServedLink {
    from: NodeId,
    groups: Groups,
    /// Answers, to the link's writer.
    out: mpsc::Sender<Vec<u8>>,
    /// Per group, the task that stages its forwarded batches in the order they came, and
    /// the serving of the group it stages into ([`Served::serial`]).
    lanes: HashMap<GroupId, (u64, Lane)>,
    /// Groups whose appends came over this link (the peer led them).
    replicated: HashSet<GroupId>,
    /// `$classic\0<vhost>\0<queue>` groups whose queue was found held here.
    classic_targets: HashSet<GroupId>,
    /// When the node-wide liveness table was last told of this peer.
    told: std::time::Instant,
    /// When `lanes` and `replicated` are pruned next.
    pruning: Pruning,
}

/// The link's writer is gone: stop reading.
struct Closed;

/// Where a link queues one group's forwarded batches (request id, batch) for its lane task
/// ([`forward_lane`]).
type Lane = mpsc::Sender<(u64, Box<Forwarded>)>;

/// Fewest groups a link remembers (lanes and groups replicated over it) before it prunes them.
pub const LINK_GROUPS_PRUNE_MIN: usize = 64;

/// When a link prunes what it remembers per group of groups no longer served (deleted, or
/// moved away): once it has grown to twice what was left after the last pruning, so a
/// pruning costs O(1) per group remembered and a link holds at most twice the groups served
/// (a lane holds its group's Raft instance and proposer: without pruning, every queue deleted
/// on a link's life stayed in memory until the link closed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pruning {
    at: usize,
}

impl Default for Pruning {
    fn default() -> Self {
        Self {
            at: LINK_GROUPS_PRUNE_MIN,
        }
    }
}

impl Pruning {
    /// Whether `remembered` groups call for a pruning.
    fn due(self, remembered: usize) -> bool {
        remembered > self.at
    }

    /// A pruning left `remembered`: the next is due at twice that.
    fn pruned(&mut self, remembered: usize) {
        self.at = remembered.saturating_mul(2).max(LINK_GROUPS_PRUNE_MIN);
    }
}

impl ServedLink {
    /// Forget the lanes into servings of groups that ended, and the groups no longer served,
    /// when due ([`Pruning`]). A dropped lane's task stages what it holds, then ends.
    fn prune_if_due(&mut self) {
        if !self.pruning.due(self.lanes.len() + self.replicated.len()) {
            return;
        }
        let groups = &self.groups;
        self.lanes
            .retain(|group, (serial, _)| groups.serial(group) == Some(*serial));
        self.replicated
            .retain(|group| groups.serial(group).is_some());
        self.pruning
            .pruned(self.lanes.len() + self.replicated.len());
    }

    async fn serve(&mut self, envelope: Envelope) -> Result<(), Closed> {
        if self.told.elapsed() >= HEARD_EVERY {
            self.told = std::time::Instant::now();
            heard_from(self.from);
        }
        let Envelope { id, group, request } = envelope;
        if matches!(request, Request::Ping) {
            return answer(&self.out, id, Ok(Response::Pong)).await;
        }
        if group.name.starts_with(CLASSIC_PREFIX) {
            return self.serve_classic(id, group, request).await;
        }
        let Some(served) = self.groups.get(&group) else {
            return answer(&self.out, id, Err(Refusal::NoSuchGroup)).await;
        };
        match request {
            Request::Raft(rpc) => {
                if matches!(rpc, RaftRequest::AppendEntries(_)) && !self.replicated.contains(&group)
                {
                    self.replicated.insert(group);
                    self.prune_if_due();
                }
                let out = self.out.clone();
                tokio::spawn(async move {
                    let raft = &served.raft;
                    let response = match rpc {
                        RaftRequest::AppendEntries(r) => {
                            RaftResponse::AppendEntries(raft.append_entries(r).await)
                        }
                        RaftRequest::Vote(r) => RaftResponse::Vote(raft.vote(r).await),
                        RaftRequest::InstallSnapshot(r) => {
                            RaftResponse::InstallSnapshot(raft.install_snapshot(r.into()).await)
                        }
                    };
                    let _ = answer(&out, id, Ok(Response::Raft(response))).await;
                });
                Ok(())
            }
            Request::Forward(f) => {
                let lane = match self.lanes.get(&group) {
                    Some((serial, lane)) if *serial == served.serial => lane.clone(),
                    // A first batch, or the group is served anew: the old lane ends once
                    // it has staged what it holds (into the serving it was made for).
                    _ => {
                        let serial = served.serial;
                        let lane = forward_lane(served, self.out.clone());
                        self.lanes.insert(group, (serial, lane.clone()));
                        self.prune_if_due();
                        lane
                    }
                };
                match lane.try_send((id, Box::new(f))) {
                    Ok(()) => Ok(()),
                    Err(_) => answer(&self.out, id, Err(Refusal::Busy)).await,
                }
            }
            Request::Handover(h) => {
                let (out, from) = (self.out.clone(), self.from);
                tokio::spawn(async move {
                    let response = match h {
                        HandoverRequest::Transfer(to) => {
                            HandoverResponse::Transferred(match &served.transfer {
                                Some(transfer) => transfer(to).await,
                                None => Err("this replica cannot transfer leadership".into()),
                            })
                        }
                        HandoverRequest::Campaign => {
                            HandoverResponse::Campaigning(campaign(&served.raft, from).await)
                        }
                        HandoverRequest::Abstain(ms) => {
                            HandoverResponse::Abstaining(abstain(&served, from, ms))
                        }
                    };
                    let _ = answer(&out, id, Ok(Response::Handover(response))).await;
                });
                Ok(())
            }
            Request::Classic(_) => {
                let refusal = Refusal::Misdirected("a classic request to a Raft group".into());
                answer(&self.out, id, Err(refusal)).await
            }
            Request::Ping => answer(&self.out, id, Ok(Response::Pong)).await,
        }
    }

    /// A request to the classic queues held here: a proxy's forwarded commands (group
    /// `$classic\0<vhost>\0<queue>`), or deliveries, stats, listings and closings
    /// (`$classic`).
    async fn serve_classic(
        &mut self,
        id: u64,
        group: GroupId,
        request: Request,
    ) -> Result<(), Closed> {
        let service = self.groups.classic();
        let target = classic_target(&group.name);
        let admitted = match (&service, target) {
            (None, _) => false,
            (Some(_), None) => group.name.len() == CLASSIC_PREFIX.len(),
            (Some(_), Some(_)) if self.classic_targets.contains(&group) => true,
            (Some(svc), Some((vhost, queue))) => svc.holds(vhost, queue),
        };
        let Some(service) = service.filter(|_| admitted) else {
            return answer(&self.out, id, Err(Refusal::NoSuchGroup)).await;
        };
        let response = match (request, target) {
            (Request::Forward(f), Some((vhost, queue))) => {
                // Called here, in arrival order: the service queues the commands in order.
                let rx = service.forward(self.from, vhost, queue, f);
                if !self.classic_targets.contains(&group) {
                    self.classic_targets.insert(group);
                }
                let out = self.out.clone();
                tokio::spawn(async move {
                    let replies = rx.await.unwrap_or(Err(ProposeError::Stopped));
                    let _ = answer(&out, id, Ok(Response::Forward(replies))).await;
                });
                return Ok(());
            }
            (Request::Classic(ClassicRequest::Deliver(events)), _) => {
                ClassicResponse::Delivered(service.deliver(self.from, events))
            }
            (Request::Classic(ClassicRequest::Stats), _) => {
                ClassicResponse::Stats(service.stats(self.from))
            }
            (Request::Classic(ClassicRequest::Listing(kind)), _) => {
                let rx = service.listing(kind);
                let out = self.out.clone();
                tokio::spawn(async move {
                    // An empty array when the management layer does not answer (not started).
                    let json = rx.await.unwrap_or_else(|_| b"[]".to_vec());
                    let response = Response::Classic(ClassicResponse::Listing(json));
                    let _ = answer(&out, id, Ok(response)).await;
                });
                return Ok(());
            }
            (Request::Classic(ClassicRequest::CloseConnection { name, reason }), _) => {
                ClassicResponse::Closed(service.close_connection(&name, reason))
            }
            _ => {
                let refusal = Refusal::Misdirected("not a classic queue request".into());
                return answer(&self.out, id, Err(refusal)).await;
            }
        };
        answer(&self.out, id, Ok(Response::Classic(response))).await
    }
}

/// A task staging one group's forwarded batches from one link in the order they came, each
/// answered once its entries commit (so a forwarding node keeps several batches in flight).
///
/// Its items are boxed: a channel allocates 32 of them up front, and a node leading thousands
/// of groups has a lane per group and peer.
fn forward_lane(served: Served, out: mpsc::Sender<Vec<u8>>) -> Lane {
    let (tx, mut rx) = mpsc::channel::<(u64, Box<Forwarded>)>(FORWARDS_IN_FLIGHT_MAX);
    tokio::spawn(async move {
        while let Some((id, f)) = rx.recv().await {
            let staged = match &served.relay {
                Some(relay) if !f.meta.is_empty() => {
                    let rx = relay(*f);
                    Staged::Meta(tokio::spawn(async move {
                        rx.await.unwrap_or(Err(ProposeError::Stopped))
                    }))
                }
                _ => stage_here(&served.raft, &served.proposer, *f).await,
            };
            let out = out.clone();
            tokio::spawn(async move {
                let replies = staged.replies().await;
                let _ = answer(&out, id, Ok(Response::Forward(replies))).await;
            });
        }
    });
    tx
}

/// Queue the answer to request `id` for the link's writer.
async fn answer(
    out: &mpsc::Sender<Vec<u8>>,
    id: u64,
    outcome: Result<Response, Refusal>,
) -> Result<(), Closed> {
    let frame = match encode_frame(&Answer { id, outcome }) {
        Ok(f) => f,
        Err(e) => {
            // An answer too large to send (over the frame limit): say so instead.
            tracing::warn!(error = %e, "a cluster answer does not encode");
            let refusal = Refusal::Misdirected(format!("the answer does not encode: {e}"));
            encode_frame(&Answer {
                id,
                outcome: Err(refusal),
            })
            .map_err(|_| Closed)?
        }
    };
    out.send(frame).await.map_err(|_| Closed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_prunes_once_what_it_remembers_doubled() {
        let mut p = Pruning::default();
        assert!(!p.due(LINK_GROUPS_PRUNE_MIN), "not below the floor");
        assert!(p.due(LINK_GROUPS_PRUNE_MIN + 1));
        // 100 left after a pruning: the next is due past 200.
        p.pruned(100);
        assert!(!p.due(200));
        assert!(p.due(201));
        // Nearly everything pruned: the floor again, not a pruning per group.
        p.pruned(3);
        assert_eq!(p, Pruning::default());
    }
}
