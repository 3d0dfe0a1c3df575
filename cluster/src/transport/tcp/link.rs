//! One link per peer: a single authenticated connection from this node to a peer that carries
//! every group's Raft RPCs, forwarded commands, handover requests, classic-queue traffic and
//! pings, many in flight at once.
//!
//! A [`Link`] is a handle; a task of its own owns the connection (the *link task*). A caller
//! takes a request id, registers where its answer goes, encodes its frame and queues it; the
//! link task dials when it has frames and no connection, then folds every frame queued by then
//! into one vectored write (one syscall, one TLS flush, for many groups' RPCs); a reader task
//! routes each answer to its caller by id. Requests of one caller keep their order: the queue
//! is FIFO and the peer reads frames in order.
//!
//! Failures keep what a caller may assume: a request whose frame was never written fails with
//! [`TransportError::NotSent`] (nothing happened at the peer; forwarding retries it), one
//! written but not answered when the link broke fails with [`TransportError::Broken`] (outcome
//! unknown). A link breaks when the socket fails, the peer closes it, or the peer stays silent
//! for [`LINK_SILENCE_MAX`] while requests wait (a black hole); the link pings a peer that has
//! been quiet for [`LINK_PING_AFTER`] with requests waiting, so a slow request (a handover, a
//! snapshot's last chunk) on an otherwise idle link is not mistaken for a dead peer. The next
//! request dials again.
//!
//! A caller that stops waiting (openraft's RPC timeout) drops its [`Answering`]: its id is
//! forgotten and a late answer is dropped, while the link stays up for everyone else.

use std::collections::HashMap;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use ring::hmac;
use tokio::io::{AsyncWrite, AsyncWriteExt, ReadHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio_rustls::TlsConnector;

use crate::types::NodeId;

use super::wire::{
    Answer, Challenge, EnvelopeRef, GroupId, Hello, LINK_READ_BUFFER, Proof, Refusal, Request,
    Response, Secret, Stream, TransportError, Verdict, encode_frame, proof_input, read_frame,
    write_frame,
};
use super::{HEARD_EVERY, heard_from, refused_by};

/// Frames queued on a link before callers wait for room (the link task writes them out as
/// one batch; a peer that stops reading stops its callers here, not in memory).
pub const LINK_QUEUE_MAX: usize = 1024;
/// Most frames folded into one vectored write (below the kernel's `IOV_MAX` of 1024).
pub const FOLD_MAX: usize = 256;
/// How long dialling a peer and passing its challenge may take.
pub const DIAL_MAX: Duration = Duration::from_secs(1);
/// With requests waiting, a link pings a peer it has heard nothing from for this long.
pub const LINK_PING_AFTER: Duration = Duration::from_secs(1);
/// With requests waiting, a link breaks once the peer has been silent this long (its pings
/// unanswered too), and so does a write that takes this long: the peer is behind a black
/// hole.
pub const LINK_SILENCE_MAX: Duration = Duration::from_secs(5);

/// Where an answer goes: to the caller waiting for it.
type Waiter = oneshot::Sender<Result<Response, TransportError>>;

/// What the caller, the link task and the reader share.
struct Shared {
    to: NodeId,
    /// The next request id (0 is the link's own ping).
    next_id: AtomicU64,
    /// Callers waiting for an answer, by request id.
    waiting: Mutex<HashMap<u64, Waiter>>,
    /// When the link was made: the origin of `heard_ms`.
    born: Instant,
    /// When the peer was last heard on this link, in ms since `born`.
    heard_ms: AtomicU64,
    /// When `heard_from` was last told, in ms since `born`.
    told_ms: AtomicU64,
    /// When the first frame written since the peer was last heard went out, in ms since
    /// `born` (`u64::MAX`: none): a peer is silent from then, not from its last answer, which
    /// may be long ago on a link that was idle.
    owed_ms: AtomicU64,
}

impl Shared {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }

    fn heard(&self) {
        let now = self.now_ms();
        self.heard_ms.store(now, Ordering::Relaxed);
        self.owed_ms.store(u64::MAX, Ordering::Relaxed);
        let every = u64::try_from(HEARD_EVERY.as_millis()).unwrap_or(u64::MAX);
        if now.saturating_sub(self.told_ms.load(Ordering::Relaxed)) >= every {
            self.told_ms.store(now, Ordering::Relaxed);
            heard_from(self.to);
        }
    }

    /// Frames went out: the peer owes an answer from now, unless it already did.
    fn wrote(&self) {
        let now = self.now_ms();
        let _ = self
            .owed_ms
            .compare_exchange(u64::MAX, now, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// How long the peer has been silent: since it was last heard, or since frames went out
    /// after that (the caller asks only while requests wait).
    fn silent_for(&self) -> Duration {
        let heard = self.heard_ms.load(Ordering::Relaxed);
        let since = match self.owed_ms.load(Ordering::Relaxed) {
            u64::MAX => heard,
            owed => owed.max(heard),
        };
        Duration::from_millis(self.now_ms().saturating_sub(since))
    }

    fn take(&self, id: u64) -> Option<Waiter> {
        self.waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id)
    }

    /// Drop from `batch` the frames whose callers stopped waiting (openraft's RPC timeout):
    /// the peer would do their work for nobody, and under overload, when every caller times
    /// out and sends again, such frames would crowd out the live ones.
    fn keep_awaited(&self, batch: &mut Vec<Queued>) {
        let waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        batch.retain(|q| q.id == 0 || waiting.contains_key(&q.id));
    }

    fn any_waiting(&self) -> bool {
        !self
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty()
    }

    /// Fail every caller still waiting: their requests were written, so the outcome is
    /// unknown.
    fn fail_all(&self, reason: &str) {
        let waiting: Vec<Waiter> = self
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .map(|(_, w)| w)
            .collect();
        for w in waiting {
            let _ = w.send(Err(TransportError::Broken(reason.to_string())));
        }
    }

    /// Fail the callers of frames that were never written.
    fn fail_unsent(&self, frames: impl IntoIterator<Item = Queued>, reason: &str) {
        for q in frames {
            if let Some(w) = self.take(q.id) {
                let _ = w.send(Err(TransportError::NotSent(reason.to_string())));
            }
        }
    }
}

/// A frame waiting for the link task, with the id of the request it carries.
struct Queued {
    id: u64,
    frame: Vec<u8>,
}

/// How a link reaches its peer.
struct Dial {
    from: NodeId,
    to: NodeId,
    secret: Secret,
    tls: Option<TlsConnector>,
    /// The node's `--peers` addresses, read at every dial (a peer may move).
    known: Arc<RwLock<HashMap<NodeId, String>>>,
    /// Where to dial when the node has no address of its own for the peer (the group
    /// membership's, or a seed's).
    fallback: Option<String>,
}

impl Dial {
    fn addr(&self) -> Option<String> {
        self.known
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&self.to)
            .cloned()
            .or_else(|| self.fallback.clone())
    }

    /// Connect and pass the peer's challenge.
    async fn connect(&self) -> Result<Stream, TransportError> {
        let Some(addr) = self.addr() else {
            return Err(TransportError::NotSent(format!(
                "no address for node {}",
                self.to
            )));
        };
        let mut s = match dial(&addr, self.tls.as_ref()).await {
            Ok(s) => s,
            Err(TransportError::Io(e)) => {
                if e.kind() == std::io::ErrorKind::ConnectionRefused {
                    refused_by(self.to);
                }
                return Err(TransportError::Io(e));
            }
            Err(e) => return Err(e),
        };
        let hello = Hello {
            from: self.from,
            to: self.to,
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
        }
    }
}

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

/// A handle on this node's link to one peer (clones share it). See the module's comment.
#[derive(Clone)]
pub(super) struct Link {
    shared: Arc<Shared>,
    tx: mpsc::Sender<Queued>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("to", &self.shared.to)
            .finish_non_exhaustive()
    }
}

/// A request's answer to come: resolves with the peer's response, or why there is none.
/// Dropping it forgets the request (a late answer is discarded).
pub(super) struct Answering {
    id: u64,
    shared: Arc<Shared>,
    rx: oneshot::Receiver<Result<Response, TransportError>>,
}

impl Future for Answering {
    type Output = Result<Response, TransportError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.rx)
            .poll(cx)
            .map(|r| r.unwrap_or_else(|_| Err(TransportError::Broken("the link closed".into()))))
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        self.shared.take(self.id);
    }
}

impl Link {
    fn start(dial: Dial) -> Self {
        let shared = Arc::new(Shared {
            to: dial.to,
            next_id: AtomicU64::new(1),
            waiting: Mutex::default(),
            born: Instant::now(),
            heard_ms: AtomicU64::new(0),
            told_ms: AtomicU64::new(0),
            owed_ms: AtomicU64::new(u64::MAX),
        });
        let (tx, rx) = mpsc::channel(LINK_QUEUE_MAX);
        runtime().spawn(run(Arc::clone(&shared), dial, rx));
        Self { shared, tx }
    }

    /// Whether the link task is gone (its runtime stopped): make a new link.
    pub(super) fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Queue `request` for `group`; resolves once it is queued (requests queued by one caller
    /// reach the peer in that order), with its answer to come.
    ///
    /// # Errors
    /// [`TransportError::Frame`] when it does not encode, [`TransportError::NotSent`] when the
    /// link task is gone.
    pub(super) async fn send(
        &self,
        group: &GroupId,
        request: &Request,
    ) -> Result<Answering, TransportError> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = encode_frame(&EnvelopeRef { id, group, request })?;
        let (tx, rx) = oneshot::channel();
        self.shared
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, tx);
        // From here on, dropping the answer (a caller giving up while the queue is full)
        // forgets the id.
        let answering = Answering {
            id,
            shared: Arc::clone(&self.shared),
            rx,
        };
        self.tx
            .send(Queued { id, frame })
            .await
            .map_err(|_| TransportError::NotSent("the link is closed".into()))?;
        Ok(answering)
    }

    /// Send `request` for `group` and wait for its answer.
    ///
    /// # Errors
    /// See [`Link::send`] and [`TransportError`]; a refusal by the peer is
    /// [`TransportError::NoSuchGroup`] or [`TransportError::Refused`].
    pub(super) async fn call(
        &self,
        group: &GroupId,
        request: &Request,
    ) -> Result<Response, TransportError> {
        self.send(group, request).await?.await
    }
}

/// The link task: dial when frames wait and there is no connection, then write until the
/// connection breaks; again for the next frame.
async fn run(shared: Arc<Shared>, dial: Dial, mut rx: mpsc::Receiver<Queued>) {
    let mut batch: Vec<Queued> = Vec::with_capacity(FOLD_MAX);
    loop {
        if batch.is_empty() && rx.recv_many(&mut batch, FOLD_MAX).await == 0 {
            return;
        }
        let stream = match tokio::time::timeout(DIAL_MAX, dial.connect()).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                fail_queued(&shared, &mut batch, &mut rx, &e.to_string());
                continue;
            }
            Err(_) => {
                fail_queued(&shared, &mut batch, &mut rx, "the peer does not answer");
                continue;
            }
        };
        shared.heard();
        let (r, w) = tokio::io::split(super::traffic::counted(stream, shared.to));
        let reader = tokio::spawn(read_answers(r, Arc::clone(&shared)));
        let reason = write_until_broken(w, reader, &shared, &mut rx, &mut batch).await;
        tracing::debug!(peer = shared.to, %reason, "cluster link broke");
        // What still waits in the queue was never written; every other caller's request
        // was (or may have been).
        fail_queued(&shared, &mut batch, &mut rx, &reason);
        shared.fail_all(&reason);
    }
}

/// The runtime links run on: a thread of their own, so a link's writer and reader are not
/// queued behind the node's thousands of connection tasks when the node is busy (each request
/// passes through both; on the node's runtime, under load, every hop waited a whole round of
/// its run queue and appends outlived openraft's timeout). Falls back to the caller's runtime
/// if the thread cannot be made.
pub(super) fn runtime() -> tokio::runtime::Handle {
    static LINKS: std::sync::LazyLock<Option<tokio::runtime::Runtime>> =
        std::sync::LazyLock::new(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("cluster-link")
                .enable_all()
                .build()
                .ok()
        });
    LINKS
        .as_ref()
        .map_or_else(tokio::runtime::Handle::current, |r| r.handle().clone())
}

/// Fail what is queued (the batch in hand and whatever waits in the queue now): never sent.
fn fail_queued(
    shared: &Shared,
    batch: &mut Vec<Queued>,
    rx: &mut mpsc::Receiver<Queued>,
    reason: &str,
) {
    shared.fail_unsent(batch.drain(..), reason);
    while let Ok(q) = rx.try_recv() {
        shared.fail_unsent([q], reason);
    }
}

/// Write queued frames, a batch at a time, until the connection breaks; answers why.
async fn write_until_broken(
    mut w: tokio::io::WriteHalf<Stream>,
    mut reader: tokio::task::JoinHandle<()>,
    shared: &Shared,
    rx: &mut mpsc::Receiver<Queued>,
    batch: &mut Vec<Queued>,
) -> String {
    let mut tick = tokio::time::interval(LINK_PING_AFTER);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let reason = loop {
        if batch.is_empty() {
            tokio::select! {
                n = rx.recv_many(batch, FOLD_MAX) => {
                    if n == 0 {
                        break "the node stopped".to_string();
                    }
                }
                _ = &mut reader => break "the peer closed the link".to_string(),
                _ = tick.tick() => {
                    if !shared.any_waiting() {
                        continue;
                    }
                    let silent = shared.silent_for();
                    if silent >= LINK_SILENCE_MAX {
                        break format!("the peer has been silent for {silent:?}");
                    }
                    if silent >= LINK_PING_AFTER {
                        match ping_frame() {
                            Ok(frame) => batch.push(Queued { id: 0, frame }),
                            Err(e) => break e.to_string(),
                        }
                    } else {
                        continue;
                    }
                }
            }
        }
        shared.keep_awaited(batch);
        if batch.is_empty() {
            continue;
        }
        let frames: Vec<&[u8]> = batch.iter().map(|q| q.frame.as_slice()).collect();
        match tokio::time::timeout(LINK_SILENCE_MAX, write_frames(&mut w, &frames)).await {
            Ok(Ok(())) => {
                shared.wrote();
                batch.clear();
            }
            // Written or not, the batch's requests may have reached the peer: unknown.
            Ok(Err(e)) => break e.to_string(),
            Err(_) => break "a write to the peer stalled".to_string(),
        }
    };
    reader.abort();
    // The batch in hand may be partly written: its callers are failed as unknown with the
    // rest.
    batch.clear();
    reason
}

fn ping_frame() -> Result<Vec<u8>, TransportError> {
    encode_frame(&EnvelopeRef {
        id: 0,
        group: &GroupId {
            name: String::new(),
            incarnation: 0,
        },
        request: &Request::Ping,
    })
}

/// Route the peer's answers to their callers, until the connection ends.
async fn read_answers(r: ReadHalf<Stream>, shared: Arc<Shared>) {
    let mut r = tokio::io::BufReader::with_capacity(LINK_READ_BUFFER, r);
    while let Ok(answer) = read_frame::<Answer, _>(&mut r).await {
        shared.heard();
        if answer.id == 0 {
            continue;
        }
        if let Some(w) = shared.take(answer.id) {
            let _ = w.send(answer.outcome.map_err(TransportError::Refused));
        }
    }
}

/// Write `frames` as one vectored write (as many as the socket takes, then the rest), and
/// flush (TLS buffers until flushed; a no-op on plain TCP).
pub(super) async fn write_frames<W: AsyncWrite + Unpin>(
    w: &mut W,
    frames: &[&[u8]],
) -> std::io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = frames.iter().map(|f| IoSlice::new(f)).collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = w.write_vectored(rest).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut rest, n);
    }
    w.flush().await
}

/// This node's links, one per peer, shared by every group and purpose; kept with the
/// addresses they dial (see [`Addresses`](super::Addresses)).
#[derive(Clone, Default)]
pub(super) struct Links {
    by_peer: Arc<Mutex<HashMap<(NodeId, NodeId), Link>>>,
}

impl Links {
    /// The link from `from` to `to`, made on first use (dialled on first request).
    pub(super) fn get(
        &self,
        from: NodeId,
        to: NodeId,
        secret: &Secret,
        tls: Option<TlsConnector>,
        known: &Arc<RwLock<HashMap<NodeId, String>>>,
        fallback: Option<String>,
    ) -> Link {
        let mut by_peer = self.by_peer.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(link) = by_peer.get(&(from, to)).filter(|l| !l.is_closed()) {
            return link.clone();
        }
        let link = Link::start(Dial {
            from,
            to,
            secret: secret.clone(),
            tls,
            known: Arc::clone(known),
            fallback,
        });
        by_peer.insert((from, to), link.clone());
        link
    }
}

/// A refusal as the caller sees it (a missing group names the group).
pub(super) fn refused(e: TransportError, group: &GroupId) -> TransportError {
    match e {
        TransportError::Refused(Refusal::NoSuchGroup) => TransportError::NoSuchGroup(group.clone()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link_to(addr: String) -> Link {
        Links::default().get(1, 2, &Secret::new(b"s"), None, &Arc::default(), Some(addr))
    }

    fn group() -> GroupId {
        GroupId {
            name: "q".into(),
            incarnation: 1,
        }
    }

    #[tokio::test]
    async fn a_request_to_a_closed_port_was_not_sent() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let addr = l.local_addr().expect("bound").to_string();
        drop(l);
        let link = link_to(addr);
        let r = link.call(&group(), &Request::Ping).await;
        assert!(matches!(r, Err(TransportError::NotSent(_))), "{r:?}");
        assert!(super::super::refusing(2), "the refusal is recorded");
    }

    #[tokio::test]
    async fn a_peer_that_never_answers_the_handshake_fails_the_request_unsent() {
        // It accepts, then says nothing: the dial gives up after DIAL_MAX.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let addr = l.local_addr().expect("bound").to_string();
        let held = tokio::spawn(async move {
            let (s, _) = l.accept().await.expect("accepts");
            std::future::pending::<()>().await;
            drop(s);
        });
        let link = link_to(addr);
        let r = link.call(&group(), &Request::Ping).await;
        assert!(matches!(r, Err(TransportError::NotSent(_))), "{r:?}");
        held.abort();
    }

    #[tokio::test]
    async fn a_caller_that_stops_waiting_is_forgotten() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let addr = l.local_addr().expect("bound").to_string();
        let link = link_to(addr);
        let answering = link.send(&group(), &Request::Ping).await.expect("queued");
        assert!(link.shared.any_waiting());
        drop(answering);
        assert!(!link.shared.any_waiting());
        drop(l);
    }

    #[tokio::test]
    async fn frames_of_callers_that_stopped_waiting_are_not_written() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let link = link_to(l.local_addr().expect("bound").to_string());
        let kept = link.send(&group(), &Request::Ping).await.expect("queued");
        let gone = link.send(&group(), &Request::Ping).await.expect("queued");
        let gone_id = gone.id;
        drop(gone);
        let mut batch: Vec<Queued> = [0, kept.id, gone_id]
            .into_iter()
            .map(|id| Queued {
                id,
                frame: Vec::new(),
            })
            .collect();
        link.shared.keep_awaited(&mut batch);
        let ids: Vec<u64> = batch.iter().map(|q| q.id).collect();
        // The link's own ping stays, and so does the request still awaited.
        assert_eq!(ids, vec![0, kept.id]);
    }

    #[tokio::test]
    async fn frames_are_written_whole_in_one_vectored_write() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let frames: Vec<Vec<u8>> = (0u8..10).map(|i| vec![i; 100 + usize::from(i)]).collect();
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        write_frames(&mut a, &refs).await.expect("writes");
        drop(a);
        let mut got = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut b, &mut got)
            .await
            .expect("reads");
        assert_eq!(got, frames.concat());
    }
}
