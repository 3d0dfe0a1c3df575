//! What crosses the cluster port: length-prefixed frames (at most [`FRAME_MAX`] bytes), the
//! handshake (hello, challenge, proof, verdict) and its HMAC proof over the shared
//! [`Secret`], and the requests and responses a connection then carries.

use openraft::error::{InstallSnapshotError, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use ring::hmac;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use warren_broker::node::replication::Listing;
use warren_broker::queue::machine::{Command, Reply};

use crate::proposer::ProposeError;
use crate::types::{MetaChange, NodeId, QueueRaft, ReplicatedMessage};

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
    /// The target would not serve the request (see [`Refusal`]).
    #[error("refused: {0}")]
    Refused(Refusal),
    /// The request never left this node (the peer could not be dialled, or the link broke
    /// before the request was written): nothing of it happened there.
    #[error("not sent: {0}")]
    NotSent(String),
    /// The link broke after the request was written and before its answer: its outcome is
    /// unknown.
    #[error("no answer: {0}")]
    Broken(String),
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

pub(super) async fn write_frame<T: Serialize, W: AsyncWriteExt + Unpin>(
    s: &mut W,
    value: &T,
) -> Result<(), TransportError> {
    let frame = encode_frame(value)?;
    // One write per frame: the length and the body leave in the same segment (with
    // TCP_NODELAY two writes were two packets, and two syscalls on each side).
    s.write_all(&frame).await?;
    // TLS buffers until flushed (a no-op on plain TCP).
    s.flush().await?;
    Ok(())
}

/// `value` as a frame: its length (u32, big-endian) and its encoding.
pub(super) fn encode_frame<T: Serialize>(value: &T) -> Result<Vec<u8>, TransportError> {
    let mut frame = vec![0u8; 4];
    crate::codec::encode_into(&mut frame, value)
        .map_err(|e| TransportError::Frame(e.to_string()))?;
    let len = u32::try_from(frame.len() - 4)
        .ok()
        .filter(|l| *l <= FRAME_MAX)
        .ok_or_else(|| TransportError::Frame(format!("{} bytes to send", frame.len() - 4)))?;
    frame[..4].copy_from_slice(&len.to_be_bytes());
    Ok(frame)
}

/// A cluster connection: TCP, or TLS over TCP.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send + Sync + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + Sync + 'static> Io for T {}

pub(super) type Stream = Box<dyn Io>;

/// Bytes a link's reader takes from the socket at once: the many small frames of many groups
/// (appends, their answers, forwarded commands) come in one read rather than two reads each
/// (its length, then its body). Per link, so per peer: 2 x 64 KiB.
pub(super) const LINK_READ_BUFFER: usize = 64 * 1024;

pub(super) async fn read_frame<T: DeserializeOwned, R: AsyncReadExt + Unpin>(
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

/// The first frame of a link: who dials whom. A link serves every group the two nodes share.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Hello {
    pub(super) from: NodeId,
    pub(super) to: NodeId,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Challenge {
    pub(super) nonce: Vec<u8>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Proof {
    pub(super) mac: Vec<u8>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Verdict {
    Welcome,
    Refused,
}

/// What the proof covers: the nonce and the whole hello (so a proof for one pair of nodes is
/// no proof for another).
pub(super) fn proof_input(nonce: &[u8], hello: &Hello) -> Vec<u8> {
    let mut m = nonce.to_vec();
    m.extend_from_slice(b"warren-link-1");
    m.extend_from_slice(&hello.from.to_be_bytes());
    m.extend_from_slice(&hello.to.to_be_bytes());
    m
}

/// A request on a link: its id (its answer names it; 0 is the link's own ping), the group it
/// is for, and what is asked. Encoded from borrowed parts ([`EnvelopeRef`]), so a request is
/// not copied to be sent.
#[derive(Debug, Deserialize)]
pub(super) struct Envelope {
    pub(super) id: u64,
    pub(super) group: GroupId,
    pub(super) request: Request,
}

/// [`Envelope`] as it is encoded.
#[derive(Serialize)]
pub(super) struct EnvelopeRef<'a> {
    pub(super) id: u64,
    pub(super) group: &'a GroupId,
    pub(super) request: &'a Request,
}

/// The answer to the request of the same id.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Answer {
    pub(super) id: u64,
    pub(super) outcome: Result<Response, Refusal>,
}

/// Why a link's request was not served.
#[derive(Debug, Clone, Serialize, Deserialize, thiserror::Error)]
pub enum Refusal {
    /// The target does not host that group (or that incarnation of it).
    #[error("no such group on the target")]
    NoSuchGroup,
    /// A request that group does not take (a classic request to a Raft group, say).
    #[error("misdirected: {0}")]
    Misdirected(String),
    /// More forwarded batches of the group in flight on the link than
    /// [`FORWARDS_IN_FLIGHT_MAX`](super::FORWARDS_IN_FLIGHT_MAX) (nothing was staged).
    #[error("too many forwarded batches in flight")]
    Busy,
}

/// What a link carries, by purpose.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Request {
    /// Openraft's RPCs to the group's replica.
    Raft(RaftRequest),
    /// Commands (or metadata changes) from a node that is not the leader, to be proposed by
    /// the one that is, in the order they were sent.
    Forward(Forwarded),
    /// A leader handing over to another voter.
    Handover(HandoverRequest),
    /// Traffic of classic queues between their home and other nodes (group `$classic...`).
    Classic(ClassicRequest),
    /// Are you there (nodes that share no replication traffic still learn each other's
    /// liveness; a link with requests outstanding and nothing heard asks too)?
    Ping,
}

/// Openraft's RPCs.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum RaftRequest {
    AppendEntries(AppendEntriesRequest<QueueRaft>),
    Vote(VoteRequest<NodeId>),
    InstallSnapshot(SnapshotChunk),
}

/// A snapshot chunk as it crosses the wire: openraft's request, its data written as one run of
/// bytes. (Serde writes openraft's `Vec<u8>` as a sequence, a call per byte: a 3 MiB chunk took
/// half a second to encode and as long to decode in a debug build, and the link's reader, which
/// decodes every frame in turn, held every other group's heartbeats meanwhile.)
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct SnapshotChunk {
    vote: openraft::Vote<NodeId>,
    meta: openraft::SnapshotMeta<NodeId, openraft::BasicNode>,
    offset: u64,
    #[serde(with = "crate::codec::raw_bytes")]
    data: Vec<u8>,
    done: bool,
}

impl From<InstallSnapshotRequest<QueueRaft>> for SnapshotChunk {
    fn from(r: InstallSnapshotRequest<QueueRaft>) -> Self {
        Self {
            vote: r.vote,
            meta: r.meta,
            offset: r.offset,
            data: r.data,
            done: r.done,
        }
    }
}

impl From<SnapshotChunk> for InstallSnapshotRequest<QueueRaft> {
    fn from(c: SnapshotChunk) -> Self {
        Self {
            vote: c.vote,
            meta: c.meta,
            offset: c.offset,
            data: c.data,
            done: c.done,
        }
    }
}

/// Openraft's RPC responses.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum RaftResponse {
    AppendEntries(Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>),
    Vote(Result<VoteResponse<NodeId>, RaftError<NodeId>>),
    InstallSnapshot(
        Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>,
    ),
}

/// A leadership handover's requests.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum HandoverRequest {
    /// To a group's leader: hand leadership to this voter (see [`Transfer`]).
    ///
    /// [`Transfer`]: super::Transfer
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

/// A handover's answers.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum HandoverResponse {
    /// The new leader, or why leadership did not move.
    Transferred(Result<NodeId, String>),
    /// Whether the replica stood for election.
    Campaigning(bool),
    /// Whether the replica abstains.
    Abstaining(bool),
}

/// Classic queues' traffic between nodes.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum ClassicRequest {
    /// From a classic queue's home node to a node whose consumers it delivers to.
    Deliver(Vec<RemoteEvent>),
    /// To a classic queue's home: its queues' depths and consumers, for the proxies there.
    Stats,
    /// To any node: its management listing of this kind (`/api/connections` through another
    /// node lists the whole cluster).
    Listing(Listing),
    /// To any node: close this AMQP connection if it is open there.
    CloseConnection {
        /// RabbitMQ's connection name (`peer -> local`).
        name: String,
        /// The connection.close text (320 CONNECTION_FORCED).
        reason: String,
    },
}

/// Classic queues' answers.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum ClassicResponse {
    /// The consumers of a [`ClassicRequest::Deliver`] that are not attached here (their
    /// deliveries go back to the queue).
    Delivered(Vec<u64>),
    /// The home's classic queues.
    Stats(Vec<RemoteQueueStats>),
    /// The node's listing: a JSON array, UTF-8.
    Listing(Vec<u8>),
    /// Whether the node had the connection (it is closing now).
    Closed(bool),
}

/// The answers, by purpose (as [`Request`]).
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Response {
    Raft(RaftResponse),
    Forward(Result<ForwardReplies, ProposeError>),
    Handover(HandoverResponse),
    Classic(ClassicResponse),
    Pong,
}

/// What a classic queue's home sends to another node's consumers of it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum RemoteEvent {
    /// A delivery.
    Deliver {
        /// The queue's vhost.
        vhost: String,
        /// The queue.
        queue: String,
        /// The consumer (of the receiving node).
        consumer: u64,
        /// The message's id in the queue (acks name it).
        id: u64,
        /// The message, as [`warren_broker::node::replication::encode_message`] encodes it.
        #[serde(with = "warren_broker::node::replication::raw_bytes")]
        message: Vec<u8>,
        /// Delivered before.
        redelivered: bool,
        /// Times it was returned before.
        delivery_count: u32,
    },
    /// A direct reply-to message for a requester attached to the receiving node.
    Reply {
        /// The vhost it was published in.
        vhost: String,
        /// The reply (its routing key is the requester's reply name), as
        /// [`warren_broker::node::replication::encode_message`] encodes it.
        #[serde(with = "warren_broker::node::replication::raw_bytes")]
        message: Vec<u8>,
    },
    /// The consumer was cancelled at the home (its queue was deleted).
    Cancel {
        /// The queue's vhost.
        vhost: String,
        /// The queue.
        queue: String,
        /// The consumer.
        consumer: u64,
    },
}

/// One classic queue's state at its home, as its proxies report it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RemoteQueueStats {
    /// The queue's vhost.
    pub vhost: String,
    /// The queue.
    pub queue: String,
    /// Its depth, consumers and counters.
    pub stats: warren_broker::node::replication::QueueStats,
}

/// Longest a replica abstains from elections when a leader asks.
pub const ABSTAIN_MAX: std::time::Duration = std::time::Duration::from_secs(15);

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

/// The shared secret of a cluster, as an HMAC key.
#[derive(Clone)]
pub struct Secret(pub(super) hmac::Key);

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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::{TcpListener, TcpStream};

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
        write_frame(&mut client, &Hello { from: 1, to: 2 })
            .await
            .expect("writes");
        let hello: Hello = read_frame(&mut server).await.expect("reads");
        assert_eq!((hello.from, hello.to), (1, 2));
        let key = Secret::new(b"s");
        let nonce = [7u8; 32];
        let mac = hmac::sign(&key.0, &proof_input(&nonce, &hello));
        assert!(hmac::verify(&key.0, &proof_input(&nonce, &hello), mac.as_ref()).is_ok());
        // The same proof does not pass for another pair of nodes, or another nonce.
        for other in [Hello { from: 3, to: 2 }, Hello { from: 1, to: 3 }] {
            assert!(hmac::verify(&key.0, &proof_input(&nonce, &other), mac.as_ref()).is_err());
        }
        assert!(hmac::verify(&key.0, &proof_input(&[8u8; 32], &hello), mac.as_ref()).is_err());
    }

    #[tokio::test]
    async fn an_envelope_decodes_as_it_was_encoded_from_borrowed_parts() {
        let (mut client, mut server) = pair().await;
        let group = GroupId {
            name: "q".into(),
            incarnation: 4,
        };
        let request = Request::Handover(HandoverRequest::Abstain(250));
        let frame = encode_frame(&EnvelopeRef {
            id: 9,
            group: &group,
            request: &request,
        })
        .expect("encodes");
        client.write_all(&frame).await.expect("writes");
        let e: Envelope = read_frame(&mut server).await.expect("reads");
        assert_eq!((e.id, &e.group), (9, &group));
        assert!(matches!(
            e.request,
            Request::Handover(HandoverRequest::Abstain(250))
        ));
    }

    /// Through a link's read buffer, frames written back to back in one write (as a link
    /// folds them) come out whole and in order, a frame larger than the buffer included.
    #[tokio::test]
    async fn frames_folded_in_one_write_read_through_the_buffer() {
        let (mut client, server) = pair().await;
        let mut server = tokio::io::BufReader::with_capacity(LINK_READ_BUFFER, server);
        let group = GroupId {
            name: "q".into(),
            incarnation: 1,
        };
        let small = Request::Handover(HandoverRequest::Abstain(7));
        let mut bytes = Vec::new();
        for id in 1..=3 {
            bytes.extend(
                encode_frame(&EnvelopeRef {
                    id,
                    group: &group,
                    request: &small,
                })
                .expect("encodes"),
            );
        }
        // A larger frame: a group name past the buffer's size.
        let long = GroupId {
            name: "g".repeat(LINK_READ_BUFFER + 1),
            incarnation: 2,
        };
        bytes.extend(
            encode_frame(&EnvelopeRef {
                id: 4,
                group: &long,
                request: &small,
            })
            .expect("encodes"),
        );
        let writer = tokio::spawn(async move {
            client.write_all(&bytes).await.expect("writes");
            client
        });
        for id in 1..=4 {
            let e: Envelope = read_frame(&mut server).await.expect("reads");
            assert_eq!(e.id, id);
        }
        drop(writer.await);
    }

    #[test]
    fn a_snapshot_chunk_is_its_bytes_and_a_small_header() {
        let request = InstallSnapshotRequest::<QueueRaft> {
            vote: openraft::Vote::new(3, 1),
            meta: openraft::SnapshotMeta::default(),
            offset: 1 << 20,
            data: (0..=255u8).cycle().take(64 * 1024).collect(),
            done: true,
        };
        let encoded = crate::codec::encode(&SnapshotChunk::from(request)).expect("encodes");
        assert!(encoded.len() < 64 * 1024 + 256, "{} bytes", encoded.len());
        let back: InstallSnapshotRequest<QueueRaft> =
            crate::codec::decode::<SnapshotChunk>(&encoded)
                .expect("decodes")
                .into();
        assert_eq!(
            (back.offset, back.done, back.data.len()),
            (1 << 20, true, 64 * 1024)
        );
        assert!(
            back.data
                .iter()
                .zip((0..=255u8).cycle())
                .all(|(a, b)| *a == b)
        );
    }
}
