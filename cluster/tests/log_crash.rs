//! The node-wide Raft log under kill -9: a child process appends to eight groups at once from
//! eight threads (so batches hold several groups' entries) and reports each append openraft
//! would have been told is done; it is killed with SIGKILL in the middle of that. Reopened,
//! every reported entry is there, each group's entries are contiguous from 1 and each decodes
//! whole: no acknowledged entry lost, no half entry.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use openraft::{CommittedLeaderId, EntryPayload, LogId, RaftLogReader};
use warren_broker::queue::machine::Command as MachineCommand;
use warren_cluster::log::node_log::NodeLog;
use warren_cluster::log::store::LogStore;
use warren_cluster::types::{QueueRaft, QueueRequest, ReplicatedMessage};

const GROUPS: u64 = 8;
const ENV: &str = "WARREN_LOG_CRASH_DIR";
/// Acknowledged appends the parent waits for before the kill.
const ACKED_BEFORE_KILL: usize = 2_000;

fn entry(group: u64, index: u64) -> openraft::Entry<QueueRaft> {
    // 4 KB bodies whose bytes name the group and index: a torn or mixed-up entry shows.
    let body = vec![(group * 31 + index) as u8; 4096];
    openraft::Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(QueueRequest {
            at: index,
            commands: vec![MachineCommand::Enqueue(ReplicatedMessage {
                body,
                priority: 0,
                expiration_ms: None,
            })],
            meta: Vec::new(),
        }),
    }
}

/// The child: appends forever until killed, printing `group index` after each durable append.
#[test]
#[ignore = "run by a_kill_during_batches_loses_no_acknowledged_entry in a child process"]
fn crash_child() {
    let Ok(dir) = std::env::var(ENV) else {
        return;
    };
    let node = NodeLog::open(&std::path::Path::new(&dir).join("raft-log.redb"), 1 << 20)
        .expect("the node log");
    let out = std::sync::Arc::new(std::sync::Mutex::new(std::io::stdout()));
    let threads: Vec<_> = (0..GROUPS)
        .map(|g| {
            let log = LogStore::in_node_log(&node, g).expect("a group");
            let out = std::sync::Arc::clone(&out);
            std::thread::spawn(move || {
                for i in 1.. {
                    log.append_now(vec![entry(g, i)]).expect("an append");
                    let mut o = out.lock().expect("stdout");
                    writeln!(o, "{g} {i}").expect("stdout");
                    o.flush().expect("stdout");
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
}

#[tokio::test]
async fn a_kill_during_batches_loses_no_acknowledged_entry() {
    let dir = tempfile::tempdir().expect("a directory");
    let mut child = Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            "--ignored",
            "--exact",
            "crash_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ENV, dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the child");
    let stdout = child.stdout.take().expect("its stdout");
    let mut acked = vec![0u64; GROUPS as usize];
    let mut count = 0;
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("a line");
        let mut parts = line.split_whitespace();
        let (Some(g), Some(i)) = (parts.next(), parts.next()) else {
            continue; // the test harness's own lines
        };
        let (Ok(g), Ok(i)) = (g.parse::<usize>(), i.parse::<u64>()) else {
            continue;
        };
        acked[g] = acked[g].max(i);
        count += 1;
        if count == ACKED_BEFORE_KILL {
            // SIGKILL while the eight threads keep appending.
            child.kill().expect("kill -9");
            break;
        }
    }
    let _ = child.wait();
    assert_eq!(
        count, ACKED_BEFORE_KILL,
        "the child stopped before the kill"
    );

    let node = NodeLog::open(&dir.path().join("raft-log.redb"), 1 << 20).expect("reopened");
    for g in 0..GROUPS {
        let mut log = LogStore::in_node_log(&node, g).expect("a group");
        let entries = log.try_get_log_entries(1..).await.expect("its entries");
        let last = entries.len() as u64;
        assert!(
            last >= acked[g as usize],
            "group {g}: {last} entries, {} acknowledged",
            acked[g as usize]
        );
        for (n, e) in entries.iter().enumerate() {
            let index = n as u64 + 1;
            assert_eq!(e.log_id.index, index, "group {g}: a gap or a stray entry");
            let expected = entry(g, index);
            assert_eq!(
                warren_cluster::codec::encode(e).expect("encodes"),
                warren_cluster::codec::encode(&expected).expect("encodes"),
                "group {g} entry {index} is not what was appended"
            );
        }
    }
}
