//! Measures the storage design choice (issue 3): message bodies in checksummed segments with a
//! redb index (what `warren-store` does) against bodies stored as redb values.
//!
//! Each round commits `batch` 1 KB messages (one fsync'd commit), then commits their settles
//! (another), like a steady publish/consume loop with group commit. Reports messages/s and
//! CPU microseconds per message (enqueue + settle) of this process.
//!
//! Run: `cargo run --release -p warren-store --example store_bench -- [messages] [batch] [dir]`

use std::path::Path;
use std::time::Instant;

use bytes::Bytes;
use redb::{Database, TableDefinition};
use warren_store::{Batch, BodyRef, Op, Options, Store, StoredMessage};

const BODIES: TableDefinition<(u64, u64), &[u8]> = TableDefinition::new("bodies");

fn cpu_seconds() -> f64 {
    // utime + stime of this process, from /proc (clock ticks of 10 ms on Linux).
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn report(name: &str, n: u64, wall: f64, cpu: f64) {
    println!(
        "{name:<28} {:>9.0} msg/s   {:>6.1} us CPU/msg   ({n} msgs, {wall:.2} s)",
        n as f64 / wall,
        cpu * 1e6 / n as f64
    );
}

fn segments(dir: &Path, n: u64, batch: u64, body: &Bytes) {
    let (mut store, _) = Store::open(dir, Options::default()).expect("open store");
    let (t0, c0) = (Instant::now(), cpu_seconds());
    let mut id = 0;
    while id < n {
        let k = batch.min(n - id);
        let mut b = Batch::default();
        for i in 0..k {
            b.bodies.push(StoredMessage {
                exchange: Bytes::new(),
                routing_key: Bytes::from_static(b"bench"),
                properties: Bytes::from_static(&[0x10, 0x00, 2]),
                body: body.clone(),
            });
            b.ops.push(Op::Enqueue {
                queue: 1,
                id: id + i,
                body: BodyRef::New(i as usize),
                flags: 0,
                expires_at: 0,
            });
        }
        store.commit(&b).expect("commit");
        let settle = (0..k)
            .map(|i| Op::Settle {
                queue: 1,
                id: id + i,
            })
            .collect();
        store
            .commit(&Batch {
                bodies: vec![],
                ops: settle,
            })
            .expect("commit");
        id += k;
    }
    report(
        "segments + redb index",
        n,
        t0.elapsed().as_secs_f64(),
        cpu_seconds() - c0,
    );
}

fn redb_values(dir: &Path, n: u64, batch: u64, body: &Bytes) {
    std::fs::create_dir_all(dir).expect("create dir");
    let db = Database::create(dir.join("bodies.redb")).expect("open redb");
    let (t0, c0) = (Instant::now(), cpu_seconds());
    let mut id = 0;
    while id < n {
        let k = batch.min(n - id);
        let w = db.begin_write().expect("begin");
        {
            let mut t = w.open_table(BODIES).expect("table");
            for i in 0..k {
                t.insert((1, id + i), body.as_ref()).expect("insert");
            }
        }
        w.commit().expect("commit");
        let w = db.begin_write().expect("begin");
        {
            let mut t = w.open_table(BODIES).expect("table");
            for i in 0..k {
                t.remove((1, id + i)).expect("remove");
            }
        }
        w.commit().expect("commit");
        id += k;
    }
    report(
        "bodies as redb values",
        n,
        t0.elapsed().as_secs_f64(),
        cpu_seconds() - c0,
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(200_000);
    let batch: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1000);
    let base = args.get(3).map_or_else(
        || std::env::temp_dir().join("warren-store-bench"),
        Into::into,
    );
    let _ = std::fs::remove_dir_all(&base);
    let body = Bytes::from(vec![b'x'; 1024]);
    println!(
        "{n} x 1 KB messages, {batch} per commit, enqueue then settle, data in {}",
        base.display()
    );
    segments(&base.join("segments"), n, batch, &body);
    redb_values(&base.join("redb"), n, batch, &body);
    let _ = std::fs::remove_dir_all(&base);
}
