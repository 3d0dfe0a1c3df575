//! The bytes this node's links to and from each peer carried, both ways, since it started:
//! what `/api/nodes` shows as `cluster_links` (RabbitMQ shows its distribution links'
//! `send_bytes` and `recv_bytes` there). The frames a link writes and reads are counted,
//! above TLS (its records' overhead is not) and after the handshake.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::types::NodeId;

use super::wire::Stream;

/// One peer's counters, shared by every link with it.
#[derive(Debug, Default)]
struct PeerTraffic {
    sent: AtomicU64,
    received: AtomicU64,
}

/// Per peer, process-wide: a node runs one transport (as `heard_from`'s table).
static TRAFFIC: LazyLock<Mutex<HashMap<NodeId, Arc<PeerTraffic>>>> =
    LazyLock::new(Default::default);

fn of(peer: NodeId) -> Arc<PeerTraffic> {
    Arc::clone(
        TRAFFIC
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(peer)
            .or_default(),
    )
}

/// Bytes sent to and received from `peer` over the cluster port since this process started
/// (both directions of every link, the handshake excluded).
#[must_use]
pub fn traffic(peer: NodeId) -> (u64, u64) {
    TRAFFIC
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&peer)
        .map_or((0, 0), |t| {
            (
                t.sent.load(Ordering::Relaxed),
                t.received.load(Ordering::Relaxed),
            )
        })
}

/// `stream`, a link with `peer`, counting what passes (one relaxed add per read or write,
/// which carries many frames).
pub(super) fn counted(stream: Stream, peer: NodeId) -> Stream {
    Box::new(Counted {
        inner: stream,
        traffic: of(peer),
    })
}

struct Counted {
    inner: Stream,
    traffic: Arc<PeerTraffic>,
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) {
            let read = (buf.filled().len() - before) as u64;
            self.traffic.received.fetch_add(read, Ordering::Relaxed);
        }
        polled
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            self.traffic.sent.fetch_add(n as u64, Ordering::Relaxed);
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = polled {
            self.traffic.sent.fetch_add(n as u64, Ordering::Relaxed);
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn a_counted_stream_counts_both_ways() {
        let (a, mut b) = tokio::io::duplex(64);
        // A peer id no other test uses: the table is process-wide.
        let peer = 0xfeed_0001;
        let mut s = counted(Box::new(a), peer);
        s.write_all(b"hello").await.expect("write");
        let mut got = [0u8; 5];
        b.read_exact(&mut got).await.expect("read");
        b.write_all(b"answer!").await.expect("write");
        let mut back = [0u8; 7];
        s.read_exact(&mut back).await.expect("read");
        assert_eq!(traffic(peer), (5, 7));
        assert_eq!(traffic(0xfeed_0002), (0, 0));
    }
}
