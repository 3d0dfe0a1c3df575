//! The cluster port: everything nodes say to each other, over one authenticated link per peer.
//!
//! Wire format: frames of a 4-byte big-endian length and a [`codec`](crate::codec) body, at most
//! [`FRAME_MAX`] bytes (checked before allocating). A link opens with a challenge: the client
//! names itself and its target, the server answers with a random nonce, the client proves it
//! holds the secret with HMAC-SHA256(secret, nonce ‖ hello), and only then are requests served.
//! The secret never crosses the wire, and a recorded proof is useless against a new nonce. With
//! TLS configured ([`ClusterTls`]) the link runs over TLS, both sides presenting certificates.
//!
//! A node dials each peer once (`link`): every group's Raft RPCs, forwarded commands,
//! handover requests, classic queues' traffic and pings to that peer share the link, many in
//! flight at once, each request naming its group and an id its answer repeats. So a node's
//! descriptors and handshakes grow with its peers, not its queues, and the frames of many
//! groups leave in one write.
//!
//! A group is named by its queue and an incarnation id, fixed when the queue is declared: a
//! replica of a deleted queue that comes back asks for the old incarnation and is refused
//! ([`TransportError::NoSuchGroup`]), so it can never replay its entries into a re-created queue
//! of the same name (RabbitMQ issue 12366).
//!
//! The code, by side:
//!
//! - this file: when each peer was last heard from ([`silent_for`]) and the port's TLS
//!   settings ([`ClusterTls`]);
//! - `wire`: frames, the handshake's messages and proof, the requests and answers by purpose;
//! - `link`: a node's link to one peer (queueing, folding writes, routing answers, breaking on
//!   silence);
//! - `server`: the groups a node serves ([`Groups`]) and the links it accepts;
//! - `client`: what the node asks over its links: openraft's network ([`TcpNetwork`]),
//!   forwarding ([`ForwardLink`]), handover requests, classic queues' traffic, pings;
//! - `traffic`: the bytes each peer's links carried ([`traffic`]).

mod client;
mod link;
mod server;
mod traffic;
mod wire;

use std::collections::HashMap;
use std::sync::PoisonError;

use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::types::NodeId;

pub use client::{
    Addresses, ClassicPeer, ForwardAnswer, ForwardLink, PeerCall, TcpConnection, TcpNetwork,
    ping_loop, request_abstain, request_campaign, request_transfer,
};
pub use link::{DIAL_MAX, FOLD_MAX, LINK_PING_AFTER, LINK_QUEUE_MAX, LINK_SILENCE_MAX};
pub use server::{
    CLASSIC_PREFIX, ClassicService, FORWARDS_IN_FLIGHT_MAX, Groups, LEADER_SILENCE_MAX, Relay,
    Staged, Transfer, serve, serve_tls, stage_here,
};
pub use traffic::traffic;
pub use wire::{
    ABSTAIN_MAX, FRAME_MAX, ForwardReplies, Forwarded, GroupId, Io, Refusal, RemoteEvent,
    RemoteQueueStats, Secret, TransportError,
};

/// A link tells the node-wide liveness table ([`heard_from`]) at most this often: every
/// frame shows the peer alive, but the table is shared by every link.
const HEARD_EVERY: std::time::Duration = std::time::Duration::from_millis(50);

/// When each peer was last heard from (an RPC it answered or sent), process-wide: a node
/// runs one transport, and every group's traffic shows the peer is alive.
static HEARD: std::sync::LazyLock<std::sync::Mutex<HashMap<NodeId, std::time::Instant>>> =
    std::sync::LazyLock::new(Default::default);

fn heard_from(peer: NodeId) {
    HEARD
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(peer, std::time::Instant::now());
    REFUSED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&peer);
}

/// The peers whose cluster port refused a connection since they were last heard from: a
/// killed process's port refuses at once, so it is known gone well before its silence says so
/// (RabbitMQ learns it from its distribution link closing).
static REFUSED: std::sync::LazyLock<std::sync::Mutex<std::collections::HashSet<NodeId>>> =
    std::sync::LazyLock::new(Default::default);

fn refused_by(peer: NodeId) {
    REFUSED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(peer);
}

/// Whether `peer`'s cluster port refused a connection since it was last heard from.
#[must_use]
pub fn refusing(peer: NodeId) -> bool {
    REFUSED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .contains(&peer)
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

/// When each peer was last heard from, read at once (a watch looking at many groups reads
/// this once per look rather than once per group).
#[must_use]
pub fn heard() -> HashMap<NodeId, std::time::Instant> {
    HEARD.lock().unwrap_or_else(PoisonError::into_inner).clone()
}

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
