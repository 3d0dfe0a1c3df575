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

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Hello {
    pub(super) from: NodeId,
    pub(super) to: NodeId,
    pub(super) group: GroupId,
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
    NoSuchGroup,
}

/// What the proof covers: the nonce and the whole hello (so a proof for one group or one pair
/// of nodes is no proof for another).
pub(super) fn proof_input(nonce: &[u8], hello: &Hello) -> Vec<u8> {
    let mut m = nonce.to_vec();
    m.extend_from_slice(&hello.from.to_be_bytes());
    m.extend_from_slice(&hello.to.to_be_bytes());
    m.extend_from_slice(&hello.group.incarnation.to_be_bytes());
    m.extend_from_slice(hello.group.name.as_bytes());
    m
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Request {
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
    /// From a classic queue's home node to a node whose consumers it delivers to (on the
    /// metadata group's connection, which every node serves).
    Deliver(Vec<RemoteEvent>),
    /// To a classic queue's home: its queues' depths and consumers, for the proxies there.
    ClassicStats,
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

#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Response {
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
    /// The consumers of a [`Request::Deliver`] that are not attached here (their deliveries
    /// go back to the queue).
    Delivered(Vec<u64>),
    /// The home's classic queues.
    ClassicStats(Vec<RemoteQueueStats>),
    /// The node's listing: a JSON array, UTF-8.
    Listing(Vec<u8>),
    /// Whether the node had the connection (it is closing now).
    Closed(bool),
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
