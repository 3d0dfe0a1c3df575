//! Samples what the resource alarms watch (resident memory, memory available to the node, free
//! disk space under the data directory) and feeds the broker's alarms, once per
//! [`MONITOR_INTERVAL_MS`] or at once when a limit changes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use warren_broker::Broker;
use warren_broker::node::alarms::{MONITOR_INTERVAL_MS, Sample};

/// The value of a `Key:   123 kB` line of a /proc file, in bytes.
fn proc_kb(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kb.checked_mul(1024)
}

/// Resident set size of this process (RabbitMQ's default `rss` strategy).
fn memory_used() -> Option<u64> {
    proc_kb(
        &std::fs::read_to_string("/proc/self/status").ok()?,
        "VmRSS:",
    )
}

/// Physical memory, or the cgroup v2 limit when one is set and lower.
fn memory_total() -> Option<u64> {
    let ram = proc_kb(&std::fs::read_to_string("/proc/meminfo").ok()?, "MemTotal:")?;
    let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    Some(cgroup.map_or(ram, |c| c.min(ram)))
}

fn disk_free(dir: &Path) -> Option<u64> {
    let st = rustix::fs::statvfs(dir).ok()?;
    st.f_bavail.checked_mul(st.f_frsize)
}

/// One reading; `None` when a source cannot be read (then the alarms keep their state).
pub fn sample(data_dir: &Path) -> Option<Sample> {
    Some(Sample {
        memory_used: memory_used()?,
        memory_total: memory_total()?,
        disk_free: disk_free(data_dir)?,
    })
}

/// Sample forever; a limit change (`warren ctl set_vm_memory_high_watermark`) re-samples at once.
pub async fn monitor(broker: Arc<Broker>, data_dir: PathBuf) {
    let mut warned = false;
    loop {
        match sample(&data_dir) {
            Some(s) => {
                broker.alarms().update(s);
            }
            None if !warned => {
                warned = true;
                tracing::warn!("cannot read memory or disk usage; resource alarms are inactive");
            }
            None => {}
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(MONITOR_INTERVAL_MS)) => {},
            () = broker.alarms().recheck_requested() => {},
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

    use super::*;

    #[test]
    fn proc_lines_parse_to_bytes() {
        let status = "Name:\twarren\nVmRSS:\t   20480 kB\nThreads:\t4\n";
        assert_eq!(proc_kb(status, "VmRSS:"), Some(20480 * 1024));
        assert_eq!(proc_kb(status, "VmSwap:"), None);
    }

    #[test]
    fn this_machine_can_be_sampled() {
        let s = sample(Path::new(".")).unwrap();
        assert!(s.memory_used > 0 && s.memory_used < s.memory_total);
        assert!(s.disk_free > 0);
    }
}
