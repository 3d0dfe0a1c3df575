#!/usr/bin/env python3
"""Memory and declare time as quorum queues accumulate on a 3-node Warren cluster.

Starts a fresh cluster (scripts/cluster_bench.py's: target/release/warren, or
WARREN_BENCH_BIN), declares QUEUES quorum queues one after another through n1 (so n1 leads
them all), and after every STEP prints the mean declare time of the last STEP and each node's
RSS. The growth of RSS between two steps over the queues declared between them is the memory
per queue replica: n1's per led replica, n2's and n3's per follower replica.

    scripts/declare_curve.py 3000 1000
    WARREN_BENCH_BIN=/tmp/warren-other scripts/declare_curve.py 3000 1000

Python 3 standard library.
"""

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster_bench as cb  # noqa: E402


def rss_mb(pid):
    """Resident set size of `pid`, MiB."""
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) // 1024


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: declare_curve.py QUEUES STEP")
    n, step = int(sys.argv[1]), int(sys.argv[2])
    with tempfile.TemporaryDirectory(prefix="warren-declare-curve-") as tmp:
        cluster = cb.WarrenCluster(tmp)
        cluster.start()
        try:
            conn = cb.Amqp(cluster.amqp[cluster.nodes[0]], timeout=60)
            t0 = last = time.monotonic()
            for i in range(n):
                conn.declare(f"dq-{i}", dict(cb.QUORUM_ARGS))
                if (i + 1) % step == 0:
                    now = time.monotonic()
                    rss = {node: rss_mb(pid) for node, pid in cluster.pids().items()}
                    print(f"{i + 1} queues: last {step} at {(now - last) / step * 1000:.2f} ms "
                          f"each; total {now - t0:.1f} s; RSS MiB {rss}", flush=True)
                    last = now
            conn.close()
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
