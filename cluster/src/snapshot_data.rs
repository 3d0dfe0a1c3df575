//! The bytes of a snapshot as openraft moves them ([`SnapshotBuf`], the groups'
//! `SnapshotData`): in memory for the small ones and for tests, or in a file, so that a
//! snapshot carrying a backlog's bodies (sent to a member behind the purged log) is never in
//! memory whole on the member that sends it or on the one that receives it. openraft reads and
//! writes it one chunk ([`openraft::Config::snapshot_max_chunk_size`]) at a time.
//!
//! A file is read and written inline, from and to the page cache, a chunk per call: no
//! fsync happens here (a received snapshot is made durable when it is installed, in the
//! snapshot file's own layout).
//!
//! A snapshot being sent may still be being written ([`SnapshotBuf::building`]): its first
//! read or seek waits for the writer, so building it (reading every live body from the log)
//! happens off the state machine's worker and does not stall the group's applies.

use std::future::Future;
use std::io::{Cursor, Read, Seek, SeekFrom, Write};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncSeek, AsyncWrite, ReadBuf};

/// A blocking reader that can also go back (to send a snapshot's short form after all).
pub trait ReadSeek: Read + Seek + Send {}
impl<T: Read + Seek + Send> ReadSeek for T {}

/// What a builder hands over: the finished bytes (a file, positioned anywhere, or memory;
/// never another builder), or why there are none.
pub type Built = Result<SnapshotBuf, String>;

enum Inner {
    Memory(Cursor<Vec<u8>>),
    File(std::fs::File),
    Building(tokio::sync::oneshot::Receiver<Built>),
}

/// A snapshot's bytes: a buffer, a file, or a file still being written.
pub struct SnapshotBuf {
    inner: Inner,
    /// A seek asked for while the file was still being written.
    pending_seek: Option<SeekFrom>,
}

impl std::fmt::Debug for SnapshotBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.inner {
            Inner::Memory(c) => format!("memory ({} bytes)", c.get_ref().len()),
            Inner::File(_) => "file".to_string(),
            Inner::Building(_) => "building".to_string(),
        };
        f.debug_struct("SnapshotBuf").field("kind", &kind).finish()
    }
}

impl SnapshotBuf {
    /// Bytes in memory, read from the start.
    #[must_use]
    pub fn memory(bytes: Vec<u8>) -> Self {
        Self {
            inner: Inner::Memory(Cursor::new(bytes)),
            pending_seek: None,
        }
    }

    /// The bytes of `file`, read from where it is positioned (openraft seeks first).
    #[must_use]
    pub fn file(file: std::fs::File) -> Self {
        Self {
            inner: Inner::File(file),
            pending_seek: None,
        }
    }

    /// A file some builder is still writing and will send on `built`.
    #[must_use]
    pub fn building(built: tokio::sync::oneshot::Receiver<Built>) -> Self {
        Self {
            inner: Inner::Building(built),
            pending_seek: None,
        }
    }

    /// A snapshot file being received: an unnamed file in `dir` (removed when it closes,
    /// whatever happens), or memory without one or when it cannot be created (a failure
    /// here would stop the group's state machine).
    #[must_use]
    pub fn receiving(dir: Option<&std::path::Path>) -> Self {
        match dir.map(tempfile::tempfile_in) {
            Some(Ok(file)) => Self::file(file),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "a snapshot is received into memory");
                Self::memory(Vec::new())
            }
            None => Self::memory(Vec::new()),
        }
    }

    /// What a builder's `built` holds, as bytes to read.
    fn settle(
        built: Result<Built, tokio::sync::oneshot::error::RecvError>,
    ) -> std::io::Result<Inner> {
        let buf = built
            .map_err(|_| std::io::Error::other("the snapshot's builder stopped"))?
            .map_err(std::io::Error::other)?;
        match buf.inner {
            Inner::Building(_) => Err(std::io::Error::other("a builder handed over a builder")),
            inner => Ok(inner),
        }
    }

    /// Everything written, as a blocking reader from the first byte (waits for a builder).
    ///
    /// # Errors
    /// The builder failed or the file cannot be rewound.
    pub async fn into_reader(self) -> std::io::Result<Box<dyn Read + Send>> {
        let inner = match self.inner {
            Inner::Building(rx) => Self::settle(rx.await)?,
            inner => inner,
        };
        let mut file = match inner {
            Inner::File(f) => f,
            Inner::Memory(c) => return Ok(Box::new(Cursor::new(c.into_inner()))),
            Inner::Building(_) => unreachable!("settled"),
        };
        file.seek(SeekFrom::Start(0))?;
        Ok(Box::new(std::io::BufReader::with_capacity(
            crate::log::snapshot_file::WRITE_BUFFER,
            file,
        )))
    }

    /// Everything written, as a blocking reader from the first byte, for a thread outside
    /// the runtime (waits for a builder).
    ///
    /// # Errors
    /// The builder failed or the file cannot be rewound.
    pub fn into_blocking_reader(self) -> std::io::Result<Box<dyn ReadSeek>> {
        let inner = match self.inner {
            Inner::Building(rx) => Self::settle(rx.blocking_recv())?,
            inner => inner,
        };
        let mut file = match inner {
            Inner::File(f) => f,
            Inner::Memory(c) => return Ok(Box::new(Cursor::new(c.into_inner()))),
            Inner::Building(_) => unreachable!("settled"),
        };
        file.seek(SeekFrom::Start(0))?;
        Ok(Box::new(std::io::BufReader::with_capacity(
            crate::log::snapshot_file::WRITE_BUFFER,
            file,
        )))
    }

    /// Wait for a builder's file; Ready(Ok) once the bytes can be read.
    fn poll_built(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if let Inner::Building(rx) = &mut self.inner {
            let built = ready!(Pin::new(rx).poll(cx));
            self.inner = Self::settle(built)?;
        }
        if let Some(pos) = self.pending_seek.take() {
            match &mut self.inner {
                Inner::File(f) => drop(f.seek(pos)?),
                Inner::Memory(c) => drop(c.seek(pos)?),
                Inner::Building(_) => unreachable!("settled"),
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for SnapshotBuf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_built(cx))?;
        match &mut this.inner {
            Inner::Memory(c) => Pin::new(c).poll_read(cx, buf),
            Inner::File(f) => {
                let n = f.read(buf.initialize_unfilled())?;
                buf.advance(n);
                Poll::Ready(Ok(()))
            }
            Inner::Building(_) => unreachable!("poll_built leaves no builder"),
        }
    }
}

impl AsyncWrite for SnapshotBuf {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_built(cx))?;
        match &mut this.inner {
            Inner::Memory(c) => Pin::new(c).poll_write(cx, data),
            Inner::File(f) => Poll::Ready(f.write(data)),
            Inner::Building(_) => unreachable!("poll_built leaves no builder"),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    /// The end of what was received: anything after it (a longer transfer of the same id
    /// written into it before) is cut off.
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        Poll::Ready(match &mut this.inner {
            Inner::File(f) => f.stream_position().and_then(|end| f.set_len(end)),
            Inner::Memory(c) => {
                let end = usize::try_from(c.position()).unwrap_or(usize::MAX);
                c.get_mut().truncate(end);
                Ok(())
            }
            Inner::Building(_) => Ok(()),
        })
    }
}

impl AsyncSeek for SnapshotBuf {
    fn start_seek(self: Pin<&mut Self>, position: SeekFrom) -> std::io::Result<()> {
        let this = self.get_mut();
        match &mut this.inner {
            Inner::Memory(c) => Pin::new(c).start_seek(position),
            Inner::File(f) => f.seek(position).map(drop),
            Inner::Building(_) => {
                this.pending_seek = Some(position);
                Ok(())
            }
        }
    }

    fn poll_complete(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<u64>> {
        let this = self.get_mut();
        ready!(this.poll_built(cx))?;
        match &mut this.inner {
            Inner::Memory(c) => Pin::new(c).poll_complete(cx),
            Inner::File(f) => Poll::Ready(f.stream_position()),
            Inner::Building(_) => unreachable!("poll_built leaves no builder"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

    async fn written_then_read(mut buf: SnapshotBuf) -> Vec<u8> {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        // openraft writes chunks at offsets, seeking when an offset is not the next one.
        buf.write_all(&data[..40_000]).await.unwrap();
        buf.seek(SeekFrom::Start(40_000)).await.unwrap();
        buf.write_all(&data[40_000..]).await.unwrap();
        buf.shutdown().await.unwrap();
        let mut back = Vec::new();
        buf.into_reader()
            .await
            .unwrap()
            .read_to_end(&mut back)
            .unwrap();
        assert_eq!(back, data);
        back
    }

    #[tokio::test]
    async fn memory_and_files_read_back_what_was_written() {
        let dir = tempfile::tempdir().unwrap();
        written_then_read(SnapshotBuf::receiving(None)).await;
        written_then_read(SnapshotBuf::receiving(Some(dir.path()))).await;
        // The received file has no name: nothing is left behind in the directory.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn a_snapshot_being_built_is_read_once_its_builder_is_done() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut buf = SnapshotBuf::building(rx);
        let builder = std::thread::spawn(move || {
            let mut f = tempfile::tempfile().unwrap();
            f.write_all(b"0123456789").unwrap();
            let _ = tx.send(Ok(SnapshotBuf::file(f)));
        });
        // As openraft's sender does: the size first, then chunks from offsets.
        let end = buf.seek(SeekFrom::End(0)).await.unwrap();
        assert_eq!(end, 10);
        buf.seek(SeekFrom::Start(4)).await.unwrap();
        let mut chunk = Vec::new();
        buf.read_to_end(&mut chunk).await.unwrap();
        assert_eq!(chunk, b"456789");
        builder.join().unwrap();

        let (tx, rx) = tokio::sync::oneshot::channel::<Built>();
        let mut failed = SnapshotBuf::building(rx);
        tx.send(Err("no bodies".into())).unwrap();
        assert!(failed.seek(SeekFrom::End(0)).await.is_err());

        let (tx, rx) = tokio::sync::oneshot::channel::<Built>();
        let mut in_memory = SnapshotBuf::building(rx);
        tx.send(Ok(SnapshotBuf::memory(b"abc".to_vec()))).unwrap();
        assert_eq!(in_memory.seek(SeekFrom::End(0)).await.unwrap(), 3);
    }

    #[tokio::test]
    async fn a_shorter_transfer_into_the_same_buffer_leaves_no_tail() {
        let dir = tempfile::tempdir().unwrap();
        for mut buf in [
            SnapshotBuf::receiving(None),
            SnapshotBuf::receiving(Some(dir.path())),
        ] {
            buf.write_all(&[9u8; 5000]).await.unwrap();
            // openraft starts a transfer of the same id again from offset 0.
            buf.seek(SeekFrom::Start(0)).await.unwrap();
            buf.write_all(b"short").await.unwrap();
            buf.shutdown().await.unwrap();
            let mut back = Vec::new();
            buf.into_reader()
                .await
                .unwrap()
                .read_to_end(&mut back)
                .unwrap();
            assert_eq!(back, b"short");
        }
    }
}
