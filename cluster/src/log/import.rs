//! Moving quorum queues' logs from redb into the node's write-ahead log, once, when a node
//! whose logs are in redb starts on the WAL (the default since issue 42 step 4).
//!
//! Two redb layouts are read: the node-wide database `queues/raft-log.redb` (every group's
//! three tables, [`GroupTables::of_group`]) and the older file of one queue's own
//! ([`GroupTables::single`]). A group is copied as the WAL would have written it: its purge
//! point, its entries in index order, its copied-out bodies, then its vote and commit index.
//!
//! Invariants:
//! - a group's import starts with [`Op::Forget`], so an import cut short by a crash and run
//!   again replaces what the first attempt wrote rather than appending after it;
//! - the redb file is removed (and the removal made durable) only after every write of every
//!   group is durable in the WAL, so a crash at any point leaves one complete copy: the redb
//!   file (imported again at the next start) or the WAL's;
//! - memory is bounded by [`IMPORT_TXN_BYTES`](crate::log::node_log::IMPORT_TXN_BYTES) of rows read at once plus the WAL's own bound
//!   on bytes waiting for its writer.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::mpsc;

use bytes::Bytes;
use openraft::LogId;
use redb::{Database, ReadableDatabase, ReadableTable, TableHandle};
use warren_store::wal::{MetaSlot, Op, Wal};

use crate::log::backend::{LogError, MetaKey};
use crate::log::node_log::{GroupTables, read_u64_rows};
use crate::types::NodeId;

/// Cache of the redb database read by an import: rows are read once, in key order.
const IMPORT_CACHE_BYTES: usize = 16 * 1024 * 1024;

/// What an import copied.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Imported {
    /// Groups copied.
    pub groups: usize,
    /// Entries copied.
    pub entries: u64,
    /// Copied-out bodies copied.
    pub bodies: u64,
    /// Bytes of entries and bodies copied.
    pub bytes: u64,
}

/// Import every group of the node-wide redb log at `path` into `wal`, then remove the file.
/// Returns None when there is no file.
///
/// # Errors
/// When the database cannot be read, the WAL refuses a write (the file is kept then), or
/// the file cannot be removed.
pub fn node_log_into_wal(path: &Path, wal: &Wal) -> Result<Option<Imported>, LogError> {
    if !path.exists() {
        return Ok(None);
    }
    let db = open(path)?;
    let groups = node_log_groups(&db)?;
    let mut writes = Writes::new(wal);
    let mut imported = Imported::default();
    for group in groups {
        copy_group(
            &db,
            &GroupTables::of_group(group),
            group,
            &mut writes,
            &mut imported,
        )?;
    }
    writes.wait()?;
    drop(db);
    remove_durably(path)?;
    Ok(Some(imported))
}

/// Import the log of one queue's own file at `path` (the layout before the node-wide log)
/// into `wal` as group `group`, then remove the file. Returns whether there was a file.
///
/// # Errors
/// As [`node_log_into_wal`].
pub fn queue_file_into_wal(path: &Path, wal: &Wal, group: u64) -> Result<bool, LogError> {
    if !path.exists() {
        return Ok(false);
    }
    let db = open(path)?;
    let mut writes = Writes::new(wal);
    copy_group(
        &db,
        &GroupTables::single(),
        group,
        &mut writes,
        &mut Imported::default(),
    )?;
    writes.wait()?;
    drop(db);
    remove_durably(path)?;
    Ok(true)
}

fn open(path: &Path) -> Result<Database, LogError> {
    Database::builder()
        .set_cache_size(IMPORT_CACHE_BYTES)
        .open(path)
        .map_err(|e| redb::Error::from(e).into())
}

/// The groups whose tables the node-wide log holds (`g<16 hex digits>.<table>`).
fn node_log_groups(db: &Database) -> Result<BTreeSet<u64>, LogError> {
    let tx = db.begin_read().map_err(LogError::of)?;
    let mut groups = BTreeSet::new();
    for table in tx.list_tables().map_err(LogError::of)? {
        if let Some(group) = group_of_table(table.name()) {
            groups.insert(group);
        }
    }
    Ok(groups)
}

/// The group of a node-wide log's table name, if it is one.
fn group_of_table(name: &str) -> Option<u64> {
    let (prefix, _) = name.split_once('.')?;
    let hex = prefix.strip_prefix('g')?;
    (hex.len() == 16)
        .then(|| u64::from_str_radix(hex, 16).ok())
        .flatten()
}

/// Queue the writes copying `tables` of `db` into group `group` of the WAL.
fn copy_group(
    db: &Database,
    tables: &GroupTables,
    group: u64,
    writes: &mut Writes<'_>,
    imported: &mut Imported,
) -> Result<(), LogError> {
    let meta = read_meta(db, &tables.meta)?;
    let value = |key: MetaKey| {
        meta.iter()
            .find(|(k, _)| k == key.name())
            .map(|(_, v)| Bytes::copy_from_slice(v))
    };
    writes.send(group, vec![Op::Forget]);
    let mut purged_upto = None;
    if let Some(v) = value(MetaKey::Purged) {
        let purged: Option<LogId<NodeId>> =
            serde_json::from_slice(&v).map_err(|e| LogError::Storage(e.to_string()))?;
        let mut ops = vec![Op::Meta {
            slot: MetaSlot::Purged,
            value: v,
        }];
        if let Some(p) = purged {
            ops.push(Op::Purge { upto: p.index });
            purged_upto = Some(p.index);
        }
        writes.send(group, ops);
    }
    copy_rows(db, &tables.log, group, writes, |index, data| {
        // A purge removes its entries in the same transaction: none should be left.
        if purged_upto.is_some_and(|p| index <= p) {
            return None;
        }
        imported.entries += 1;
        imported.bytes += data.len() as u64;
        Some(Op::Append {
            index,
            data: Bytes::from(data),
        })
    })?;
    copy_rows(db, &tables.bodies, group, writes, |key, data| {
        imported.bodies += 1;
        imported.bytes += data.len() as u64;
        Some(Op::Body {
            key,
            data: Bytes::from(data),
        })
    })?;
    let mut ops = Vec::new();
    for (key, slot) in [
        (MetaKey::Vote, MetaSlot::Vote),
        (MetaKey::Committed, MetaSlot::Committed),
    ] {
        if let Some(value) = value(key) {
            ops.push(Op::Meta { slot, value });
        }
    }
    writes.send(group, ops);
    imported.groups += 1;
    Ok(())
}

/// Queue the rows of table `name` (keyed by u64, in key order) as the ops `op` makes of them,
/// one write per [`IMPORT_TXN_BYTES`](crate::log::node_log::IMPORT_TXN_BYTES) read.
fn copy_rows(
    db: &Database,
    name: &str,
    group: u64,
    writes: &mut Writes<'_>,
    mut op: impl FnMut(u64, Vec<u8>) -> Option<Op>,
) -> Result<(), LogError> {
    let mut after = None;
    loop {
        let rows = read_u64_rows(db, name, after).map_err(LogError::of)?;
        let Some(&(last, _)) = rows.last() else {
            return Ok(());
        };
        after = Some(last);
        writes.send(
            group,
            rows.into_iter().filter_map(|(k, v)| op(k, v)).collect(),
        );
    }
}

/// The rows of meta table `name` (none if it does not exist).
fn read_meta(db: &Database, name: &str) -> Result<Vec<(String, Vec<u8>)>, LogError> {
    let tx = db.begin_read().map_err(LogError::of)?;
    match tx.open_table(redb::TableDefinition::<&str, &[u8]>::new(name)) {
        Ok(table) => table
            .iter()
            .map_err(LogError::of)?
            .map(|r| {
                r.map(|(k, v)| (k.value().to_owned(), v.value().to_vec()))
                    .map_err(LogError::of)
            })
            .collect(),
        Err(redb::TableError::TableDoesNotExist(_)) => Ok(Vec::new()),
        Err(e) => Err(LogError::of(e)),
    }
}

/// Writes queued to the WAL without waiting for each (the WAL's writer syncs many in one
/// round), waited for together.
struct Writes<'a> {
    wal: &'a Wal,
    sent: usize,
    tx: mpsc::Sender<Result<(), LogError>>,
    rx: mpsc::Receiver<Result<(), LogError>>,
}

impl<'a> Writes<'a> {
    fn new(wal: &'a Wal) -> Self {
        let (tx, rx) = mpsc::channel();
        Self {
            wal,
            sent: 0,
            tx,
            rx,
        }
    }

    fn send(&mut self, group: u64, ops: Vec<Op>) {
        if ops.is_empty() {
            return;
        }
        let tx = self.tx.clone();
        self.sent += 1;
        self.wal.write(
            group,
            &ops,
            Box::new(move |r| {
                // The receiver lives until every write is told (`wait`).
                let _ = tx.send(r.map_err(LogError::of));
            }),
        );
    }

    /// Wait until every write is durable; the first failure if one failed.
    fn wait(self) -> Result<(), LogError> {
        let mut first = Ok(());
        for _ in 0..self.sent {
            let r = self
                .rx
                .recv()
                .unwrap_or_else(|_| Err(LogError::Storage("the log's writer stopped".into())));
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

/// Remove `path` and make the removal durable: a removal lost to a crash would bring the
/// old log back over the newer WAL at the next start.
fn remove_durably(path: &Path) -> Result<(), LogError> {
    std::fs::remove_file(path).map_err(LogError::of)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(LogError::of)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::backend::{LogBackend, LogOp, RedbGroup, WalGroup};
    use crate::log::node_log::{NODE_LOG_CACHE_BYTES, NodeLog};
    use warren_store::wal::WalOptions;

    fn write(backend: &dyn LogBackend, ops: Vec<LogOp>) {
        let (tx, rx) = mpsc::channel();
        backend.write(
            ops,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx.recv().unwrap().unwrap();
    }

    fn purged_at(index: u64) -> Bytes {
        let id: Option<LogId<NodeId>> =
            Some(LogId::new(openraft::CommittedLeaderId::new(2, 1), index));
        Bytes::from(serde_json::to_vec(&id).unwrap())
    }

    /// A group's log as its backend shows it: entries, bodies and the three values.
    type Contents = (Vec<Bytes>, Vec<(u64, Bytes)>, [Option<Bytes>; 3]);

    fn contents(b: &dyn LogBackend) -> Contents {
        use std::ops::Bound::Unbounded;
        let entries = b.entries((Unbounded, Unbounded)).unwrap();
        let bodies = b
            .body_keys(0..u64::MAX)
            .unwrap()
            .into_iter()
            .map(|k| (k, b.body(k).unwrap().unwrap()))
            .collect();
        let meta = [MetaKey::Vote, MetaKey::Committed, MetaKey::Purged].map(|k| b.meta(k).unwrap());
        (entries, bodies, meta)
    }

    /// Fill group `group` of `log`: entries 1..=20 with 1..=5 purged, two bodies, a vote and
    /// a commit index.
    fn fill(log: &std::sync::Arc<NodeLog>, group: u64) {
        let backend = RedbGroup::new(log.clone(), GroupTables::of_group(group)).unwrap();
        let mut ops: Vec<LogOp> = (1..=20)
            .map(|i| LogOp::Append {
                index: i,
                bytes: Bytes::from(format!("entry {i} of {group}")),
            })
            .collect();
        ops.push(LogOp::Purge { upto: 5 });
        ops.push(LogOp::Meta {
            key: MetaKey::Purged,
            value: purged_at(5),
        });
        ops.push(LogOp::PutBody {
            key: 3 << 16,
            body: Bytes::from_static(b"body of 3"),
        });
        ops.push(LogOp::PutBody {
            key: (4 << 16) | 1,
            body: Bytes::from(vec![group as u8; 3000]),
        });
        ops.push(LogOp::Meta {
            key: MetaKey::Vote,
            value: Bytes::from(format!("vote of {group}")),
        });
        ops.push(LogOp::Meta {
            key: MetaKey::Committed,
            value: Bytes::from_static(b"committed"),
        });
        write(&backend, ops);
    }

    /// Every group of the node-wide log comes over whole (entries after the purge point,
    /// bodies, vote, commit index, purge point) and the file is gone; a group the WAL held
    /// already (a first import cut short) is replaced, not appended to.
    #[test]
    fn the_node_log_comes_over_whole_and_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("raft-log.redb");
        let groups = [7_u64, 0x1234_5678_9abc];
        let expected: Vec<_> = {
            let log = NodeLog::open(&path, NODE_LOG_CACHE_BYTES).unwrap();
            for g in groups {
                fill(&log, g);
            }
            groups
                .iter()
                .map(|g| contents(&RedbGroup::new(log.clone(), GroupTables::of_group(*g)).unwrap()))
                .collect()
        };
        let wal =
            std::sync::Arc::new(Wal::open(&dir.path().join("wal"), WalOptions::default()).unwrap());
        // A first attempt that stopped halfway through group 7.
        wal.write_and_wait(
            7,
            &[Op::Append {
                index: 1,
                data: Bytes::from_static(b"stale"),
            }],
        )
        .unwrap();
        let imported = node_log_into_wal(&path, &wal).unwrap().unwrap();
        assert_eq!(imported.groups, 2);
        assert_eq!(imported.entries, 30);
        assert_eq!(imported.bodies, 4);
        assert!(!path.exists());
        for (g, want) in groups.iter().zip(&expected) {
            let got = contents(&WalGroup::new(wal.clone(), *g));
            assert_eq!(&got, want, "group {g}");
            assert_eq!(got.0.len(), 15);
        }
        // Durable: a reopened WAL holds the same.
        drop(wal);
        let wal =
            std::sync::Arc::new(Wal::open(&dir.path().join("wal"), WalOptions::default()).unwrap());
        for (g, want) in groups.iter().zip(&expected) {
            assert_eq!(
                &contents(&WalGroup::new(wal.clone(), *g)),
                want,
                "group {g}"
            );
        }
        assert_eq!(node_log_into_wal(&path, &wal).unwrap(), None);
    }

    /// A queue's own file (the layout before the node-wide log) comes over as its group.
    #[test]
    fn a_queue_file_comes_over_as_its_group() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("q.redb");
        let want = {
            let log = NodeLog::open(&path, NODE_LOG_CACHE_BYTES).unwrap();
            let backend = RedbGroup::new(log.clone(), GroupTables::single()).unwrap();
            write(
                &backend,
                vec![
                    LogOp::Append {
                        index: 1,
                        bytes: Bytes::from_static(b"one"),
                    },
                    LogOp::Meta {
                        key: MetaKey::Vote,
                        value: Bytes::from_static(b"v"),
                    },
                ],
            );
            contents(&backend)
        };
        let wal =
            std::sync::Arc::new(Wal::open(&dir.path().join("wal"), WalOptions::default()).unwrap());
        assert!(queue_file_into_wal(&path, &wal, 42).unwrap());
        assert!(!path.exists());
        assert_eq!(contents(&WalGroup::new(wal.clone(), 42)), want);
        assert!(!queue_file_into_wal(&path, &wal, 42).unwrap());
    }

    #[test]
    fn table_names_give_their_group() {
        assert_eq!(group_of_table("g00000000000000ff.log"), Some(255));
        assert_eq!(group_of_table("g00000000000000ff.bodies"), Some(255));
        assert_eq!(group_of_table("gff.log"), None);
        assert_eq!(group_of_table("raft_log"), None);
        assert_eq!(group_of_table("g00000000000000zz.log"), None);
    }
}
