//! The server side of the cluster port: the groups a node serves ([`Groups`]), accepting and
//! authenticating connections, answering Raft RPCs, staging forwarded commands into the
//! leader's proposer ([`stage_here`], pipelined per connection), and the requests of a leader
//! handing over (campaign, abstain); a replicating leader whose connection closes is
//! suspected gone.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use openraft::Raft;
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use warren_broker::node::replication::Listing;

use crate::proposer::{ProposeError, Proposer};
use crate::types::{NodeId, QueueRaft, QueueRequest};

use super::wire::{
    ABSTAIN_MAX, Challenge, ForwardReplies, Forwarded, GroupId, Hello, Proof, RemoteEvent,
    RemoteQueueStats, Request, Response, Secret, Stream, TransportError, Verdict, proof_input,
    read_frame, write_frame,
};
use super::{heard_from, silent_for};

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
    classic: Arc<RwLock<Option<Arc<dyn ClassicService>>>>,
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
    serve_pipelined(s, first, move |f| {
        let (raft, proposer, relay) = (raft.clone(), proposer.clone(), relay.clone());
        async move {
            match &relay {
                Some(relay) if !f.meta.is_empty() => {
                    let rx = relay(f);
                    Staged::Meta(tokio::spawn(async move {
                        rx.await.unwrap_or(Err(ProposeError::Stopped))
                    }))
                }
                _ => stage_here(&raft, &proposer, f).await,
            }
        }
    })
    .await
}

/// Answer a connection's forwards, staged by `stage` in arrival order, in that order.
async fn serve_pipelined<F, Fut>(
    s: Stream,
    first: Forwarded,
    mut stage: F,
) -> Result<(), TransportError>
where
    F: FnMut(Forwarded) -> Fut,
    Fut: Future<Output = Staged>,
{
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
        if tx.send(stage(f).await).await.is_err() {
            break;
        }
    }
    drop(tx);
    let _ = writer.await;
    Ok(())
}

/// The vhost and queue a `$classic\0<vhost>\0<queue>` group names (None: `$classic` alone,
/// or another name).
fn classic_target(name: &str) -> Option<(&str, &str)> {
    name.strip_prefix(CLASSIC_PREFIX)
        .and_then(|rest| rest.strip_prefix('\0'))
        .and_then(|rest| rest.split_once('\0'))
}

/// Serve a connection to the classic queues held here: a proxy's forwarded commands (group
/// `$classic\0<vhost>\0<queue>`), or deliveries and stats between nodes (`$classic`).
async fn serve_classic(
    mut s: Stream,
    from: NodeId,
    group: &GroupId,
    service: Arc<dyn ClassicService>,
) -> Result<(), TransportError> {
    let target = classic_target(&group.name).map(|(v, q)| (v.to_string(), q.to_string()));
    loop {
        let request: Request = match read_frame(&mut s).await {
            Ok(r) => r,
            Err(TransportError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        heard_from(from);
        let response = match (request, &target) {
            (Request::Forward(f), Some((vhost, queue))) => {
                let (vhost, queue) = (vhost.clone(), queue.clone());
                return serve_pipelined(s, f, move |f| {
                    let rx = service.forward(from, &vhost, &queue, f);
                    async move {
                        Staged::Meta(tokio::spawn(async move {
                            rx.await.unwrap_or(Err(ProposeError::Stopped))
                        }))
                    }
                })
                .await;
            }
            (Request::Deliver(events), _) => Response::Delivered(service.deliver(from, events)),
            (Request::ClassicStats, _) => Response::ClassicStats(service.stats(from)),
            (Request::Listing(kind), _) => {
                // An empty array when the management layer does not answer (not started).
                Response::Listing(
                    service
                        .listing(kind)
                        .await
                        .unwrap_or_else(|_| b"[]".to_vec()),
                )
            }
            (Request::CloseConnection { name, reason }, _) => {
                Response::Closed(service.close_connection(&name, reason))
            }
            (Request::Ping, _) => Response::Pong,
            _ => return Err(TransportError::Frame("not a classic queue request".into())),
        };
        write_frame(&mut s, &response).await?;
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
    if hello.group.name.starts_with(CLASSIC_PREFIX) {
        let service = groups
            .classic()
            .filter(|svc| match classic_target(&hello.group.name) {
                Some((vhost, queue)) => svc.holds(vhost, queue),
                None => hello.group.name.len() == CLASSIC_PREFIX.len(),
            });
        let Some(service) = service else {
            write_frame(&mut s, &Verdict::NoSuchGroup).await?;
            return Err(TransportError::NoSuchGroup(hello.group));
        };
        write_frame(&mut s, &Verdict::Welcome).await?;
        heard_from(hello.from);
        return serve_classic(s, hello.from, &hello.group, service).await;
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
            Request::Deliver(_)
            | Request::ClassicStats
            | Request::Listing(_)
            | Request::CloseConnection { .. } => {
                return Err(TransportError::Frame(
                    "a classic request to a Raft group".into(),
                ));
            }
        };
        write_frame(&mut s, &response).await?;
    }
}
