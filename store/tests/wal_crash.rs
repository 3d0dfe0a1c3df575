//! kill -9 of a process writing the WAL for many groups at once: after reopening, every entry
//! the WAL acknowledged is there with its bytes, each group's entries are one run from 1 with
//! no hole and no half entry, and the log goes on.
//!
//! The test runs itself as the child: with `WAL_CRASH_CHILD_DIR` set, `child_writes_until_killed`
//! writes rounds of entries to 64 groups from 4 threads and prints `group index` to stdout for
//! each acknowledged entry; the parent reads those lines and kills the child mid-stream.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use warren_store::wal::{Op, Wal, WalOptions};

const GROUPS: u64 = 64;
const CHILD_ENV: &str = "WAL_CRASH_CHILD_DIR";

fn body(group: u64, index: u64) -> Bytes {
    Bytes::from(format!(
        "group {group} entry {index} {}",
        "p".repeat((index % 7 * 97) as usize)
    ))
}

#[test]
#[ignore = "the child of wal_survives_kill_9_in_the_middle_of_rounds"]
fn child_writes_until_killed() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return;
    };
    let wal = Arc::new(
        Wal::open(
            std::path::Path::new(&dir),
            WalOptions {
                segment_bytes: 256 * 1024,
            },
        )
        .expect("open"),
    );
    let out = Arc::new(Mutex::new(std::io::stdout()));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let wal = Arc::clone(&wal);
            let out = Arc::clone(&out);
            std::thread::spawn(move || {
                let mine: Vec<u64> = (0..GROUPS).filter(|g| g % 4 == t).collect();
                let mut next: BTreeMap<u64, u64> = mine
                    .iter()
                    .map(|g| (*g, wal.group(*g).and_then(|v| v.last).unwrap_or(0) + 1))
                    .collect();
                loop {
                    for g in &mine {
                        let index = next[g];
                        let ops: Vec<Op> = (index..index + 3)
                            .map(|i| Op::Append {
                                index: i,
                                data: body(*g, i),
                            })
                            .collect();
                        let out = Arc::clone(&out);
                        let group = *g;
                        wal.write(
                            group,
                            &ops,
                            Box::new(move |r| {
                                if r.is_ok() {
                                    let mut o = out.lock().unwrap_or_else(|e| e.into_inner());
                                    let _ = writeln!(o, "{group} {}", index + 2);
                                    let _ = o.flush();
                                }
                            }),
                        );
                        next.insert(*g, index + 3);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
}

#[test]
fn wal_survives_kill_9_in_the_middle_of_rounds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut acked: BTreeMap<u64, u64> = BTreeMap::new();
    for life in 0..3 {
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "--exact",
                "child_writes_until_killed",
                "--ignored",
                "--nocapture",
            ])
            .env(CHILD_ENV, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the child");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let mut seen = 0;
        // Kill after a few thousand acknowledgements: the child is in the middle of rounds.
        while seen < 3000 + life * 1000 {
            let Some(Ok(line)) = lines.next() else { break };
            let mut parts = line.split_whitespace().map(str::parse::<u64>);
            if let (Some(Ok(g)), Some(Ok(i))) = (parts.next(), parts.next()) {
                let a = acked.entry(g).or_default();
                *a = (*a).max(i);
                seen += 1;
            }
        }
        child.kill().expect("kill -9");
        let _ = child.wait();
        assert!(seen > 0, "the child acknowledged nothing in life {life}");

        let wal = Wal::open(
            dir.path(),
            WalOptions {
                segment_bytes: 256 * 1024,
            },
        )
        .expect("reopen after kill -9");
        for g in 0..GROUPS {
            let entries = wal.entries(g, ..).expect("read");
            let last = entries.last().map_or(0, |(i, _)| *i);
            assert!(
                last >= acked.get(&g).copied().unwrap_or(0),
                "group {g}: {last} entries, {:?} acknowledged",
                acked.get(&g)
            );
            for (n, (index, data)) in entries.iter().enumerate() {
                assert_eq!(*index, n as u64 + 1, "group {g}: a hole");
                assert_eq!(data, &body(g, *index), "group {g} entry {index}");
            }
        }
    }
}
