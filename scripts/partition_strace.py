#!/usr/bin/env python3
"""Syscall counts of one cluster node during a partitioned-queue run (the profile behind
docs/benchmarks.md's partition section).

Starts scripts/cluster_bench.py's 3-node cluster, runs warren-perf as scripts/partition_bench.py
does for P partitions of TYPE (14 s), attaches `strace -c -f` to node n2 from second 3 to 11, and
prints the confirmed rate and strace's table (divide a call count by rate x 8 s for calls per
message; strace slows the node, so compare runs with each other, not with unprofiled ones).

    scripts/partition_strace.py 1 quorum
    scripts/partition_strace.py 12 quorum
"""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster_bench as cb  # noqa: E402


def main():
    partitions, kind = int(sys.argv[1]), sys.argv[2]
    with tempfile.TemporaryDirectory(prefix="warren-partition-bench-") as tmp:
        cluster = cb.WarrenCluster(tmp)
        cluster.start()
        try:
            pid = cluster.pids()["n2"]
            extra = ["--exact-name", "--queues", "1", "--producers", str(min(partitions, 4)),
                     "--consumers", str(partitions), "--key-header", "k", "--keys", "1024",
                     "--queue-arg", f"x-queue-type={kind}",
                     "--queue-arg", f"x-partitions={partitions}",
                     "--queue-arg", "x-partition-key=header:k",
                     "--consumer-arg", "x-consumer-group=bench", "--confirm", "200",
                     "--prefetch", "500"]
            out = Path(tmp) / "perf.json"
            uri = f"amqp://guest:guest@127.0.0.1:{cluster.amqp['n1']}/%2F"
            perf = subprocess.Popen([str(cb.PERF), "--scenario", "quorum", "--uri", uri,
                                     "--duration", "14", "--queue", "prof", "--json", str(out)]
                                    + extra, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.STDOUT)
            time.sleep(3)
            st = subprocess.run(["timeout", "8", "strace", "-c", "-f", "-p", str(pid)],
                                capture_output=True, text=True)
            perf.wait(timeout=60)
            rate = json.loads(out.read_text())["confirm_rate"]
            print(f"{partitions} {kind} partitions: {rate:,.0f} confirmed/s")
            print("\n".join(line for line in st.stderr.splitlines()
                            if "attached" not in line and "detached" not in line))
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
