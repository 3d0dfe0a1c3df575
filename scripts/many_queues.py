#!/usr/bin/env python3
"""Many quorum queues on a 3-node cluster (issue 23): what declaring them costs, and a low rate
on each of them.

For each broker (one 3-node cluster at a time, started and torn down as
`scripts/cluster_bench.py` does), the script:
1. samples every node's RSS (VmRSS) and open file descriptors (/proc/<pid>/fd);
2. declares `--queues` quorum queues `mq-0` .. through node 1, one after another, and times it;
3. waits until every node lists them all (management API), lets the cluster settle, and samples
   again: RSS and descriptors per queue replica are the growth over the queue count;
4. measures the nodes' CPU over `--idle` seconds with every queue idle (what a queue costs
   when nothing happens: heartbeats, timers);
5. with `--rate R` (> 0), runs `warren-perf` against node 1 with one producer per queue at R
   msg/s each (1 KB persistent, confirms) and one consumer per queue for `--duration` seconds,
   and reports the confirmed rate against the offered one, confirm p50/p99, and the nodes' CPU
   per message;
6. with `--restart` (Warren), kills node 2 (`kill -9`), starts it again and times how long it
   takes until its management API lists every queue again (a node opens its ports only once
   its committed metadata is applied and the replicas it names are started).

    scripts/many_queues.py                             # 1,000 queues, Warren only, no load
    scripts/many_queues.py --queues 10000 --restart    # 10,000 queues and a node's restart
    scripts/many_queues.py --rate 20 --duration 30     # and 1,000 producers at 20 msg/s
    scripts/many_queues.py --brokers warren,rabbitmq --rate 20

Python 3 standard library only (it imports cluster_bench.py's cluster classes).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster_bench as cb  # noqa: E402


def sample(pids):
    """{node: (rss bytes, open fds)} of the nodes' processes (and their children)."""
    out = {}
    for node, pid in pids.items():
        rss = 0
        fds = 0
        for p in [pid] + children(pid):
            try:
                for line in open(f"/proc/{p}/status"):
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1]) * 1024
                fds += len(os.listdir(f"/proc/{p}/fd"))
            except OSError:
                pass
        out[node] = (rss, fds)
    return out


def children(pid):
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except OSError:
        return []
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in children(k)]


def listed(cluster, node, prefix):
    """How many queues named prefix-* node lists (None: it does not answer)."""
    try:
        if isinstance(cluster, cb.WarrenCluster):
            qs = cluster._mgmt_get(node, "/api/queues?columns=name")
        else:
            return None
    except (OSError, ValueError, urllib.error.HTTPError):
        return None
    return sum(1 for q in qs if q.get("name", "").startswith(prefix + "-"))


def declare_all(port, n, prefix):
    conn = cb.Amqp(port, timeout=60)
    t0 = time.monotonic()
    for i in range(n):
        conn.declare(f"{prefix}-{i}", dict(cb.QUORUM_ARGS))
    elapsed = time.monotonic() - t0
    conn.close()
    return elapsed


def run_load(cluster, port, n, prefix, rate, duration):
    out = cb.OUT_DIR / f"{cluster.name}-many-{n}-{rate}.json"
    cb.OUT_DIR.mkdir(parents=True, exist_ok=True)
    # A failed run's figures are kept if it wrote them: never an earlier run's.
    out.unlink(missing_ok=True)
    cmd = [str(cb.PERF), "--uri", f"amqp://guest:guest@127.0.0.1:{port}/%2F",
           "--no-declare", "--queue", prefix, "--queues", str(n), "--producers", str(n),
           "--consumers", "1", "--rate", str(rate), "--duration", str(duration),
           "--size", "1024", "--confirm", "100", "--prefetch", "100", "--multi-ack", "10",
           "--persistent", "--json", str(out)]
    pgids = list(cluster.pids().values())
    cpu0 = cb.group_cpu_s(pgids)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 300)
    cpu = cb.group_cpu_s(pgids) - cpu0
    (cb.OUT_DIR / f"{cluster.name}-many-{n}-{rate}.stderr").write_text(r.stderr)
    if r.returncode != 0:
        # The tasks' own errors come first; the exit's reason last (all of it in the
        # .stderr file beside the JSON).
        err = r.stderr.splitlines()
        shown = "\n".join(err[:20] + (["..."] if len(err) > 25 else []) + err[-5:])
        cb.log(f"  warren-perf exited {r.returncode}:\n{shown}")
    if not out.exists():
        return None
    # A run where some connections failed still measured the others: its figures are kept,
    # with how many tasks failed.
    res = json.loads(out.read_text())
    res["cluster_cpu_s"] = cpu
    return res


def restart_node(cluster, node, prefix, n, deadline_s=300):
    """kill -9 `node`, start it again and return the seconds until it lists all `n` queues."""
    cluster.kill(node)
    t0 = time.monotonic()
    cluster.start_node(node)
    while listed(cluster, node, prefix) != n:
        if time.monotonic() - t0 > deadline_s:
            raise RuntimeError(f"{node} does not list the {n} queues {deadline_s} s after its start")
        time.sleep(0.2)
    took = time.monotonic() - t0
    cb.log(f"  {node} killed and started again: lists all {n} queues after {took:.1f} s")
    return took


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queues", type=int, default=1000)
    p.add_argument("--brokers", default="warren")
    p.add_argument("--rate", type=int, default=0, help="msg/s per producer (0: no load)")
    p.add_argument("--duration", type=int, default=30)
    p.add_argument("--settle", type=float, default=5.0, help="seconds before the second sample")
    p.add_argument("--idle", type=float, default=10.0,
                   help="seconds of idle CPU measured with the queues declared (0: skip)")
    p.add_argument("--restart", action="store_true",
                   help="Warren: kill -9 node 2 at the end, start it again and time its return")
    a = p.parse_args()
    prefix = "mq"
    rows = []
    with tempfile.TemporaryDirectory(prefix="warren-many-") as root:
        for b in a.brokers.split(","):
            cluster = cb.WarrenCluster(root) if b == "warren" else cb.RabbitCluster(root)
            if b != "warren":
                cb.RabbitCluster.ensure_installed()
            cb.log(f"starting the {b} cluster")
            cluster.start()
            try:
                port = cluster.amqp[cluster.nodes[0]]
                before = sample(cluster.pids())
                took = declare_all(port, a.queues, prefix)
                cb.log(f"  {a.queues} quorum queues declared through {cluster.nodes[0]} in {took:.1f} s")
                deadline = time.monotonic() + 300
                if isinstance(cluster, cb.WarrenCluster):
                    for n in cluster.nodes:
                        while listed(cluster, n, prefix) != a.queues:
                            if time.monotonic() > deadline:
                                raise RuntimeError(f"{n} does not list the {a.queues} queues")
                            time.sleep(0.5)
                time.sleep(a.settle)
                after = sample(cluster.pids())
                row = {"broker": b, "queues": a.queues, "declare_s": took, "nodes": {}}
                for n in cluster.nodes:
                    rss = (after[n][0] - before[n][0]) / a.queues
                    fds = (after[n][1] - before[n][1]) / a.queues
                    row["nodes"][n] = {"rss_before_mb": before[n][0] / 1e6,
                                       "rss_after_mb": after[n][0] / 1e6,
                                       "rss_per_queue_kb": rss / 1024, "fds_per_queue": fds,
                                       "fds_after": after[n][1]}
                    cb.log(f"  {n}: RSS {before[n][0] / 1e6:.0f} -> {after[n][0] / 1e6:.0f} MB "
                           f"({rss / 1024:.1f} KB per queue), fds {before[n][1]} -> {after[n][1]} "
                           f"({fds:.2f} per queue)")
                if a.idle > 0:
                    pgids = list(cluster.pids().values())
                    cpu0 = cb.group_cpu_s(pgids)
                    time.sleep(a.idle)
                    busy = (cb.group_cpu_s(pgids) - cpu0) / a.idle
                    row["idle_cpu_cores"] = busy
                    cb.log(f"  idle: {busy * 100:.1f}% of a core over the {len(cluster.nodes)} "
                           f"nodes ({busy * 1e6 / a.queues:.1f} µs CPU per queue per second)")
                if a.rate > 0:
                    res = run_load(cluster, port, a.queues, prefix, a.rate, a.duration)
                    if res is not None:
                        offered = a.rate * a.queues
                        lat = res.get("confirm_latency_us") or {}
                        load = {"offered": offered, "confirmed_rate": res["confirm_rate"],
                                "nacked": res["nacked"], "consume_rate": res["consume_rate"],
                                "confirm_p50_ms": (lat.get("p50") or 0) / 1000,
                                "confirm_p99_ms": (lat.get("p99") or 0) / 1000,
                                "cpu_us_per_msg": res["cluster_cpu_s"] * 1e6
                                / max(res["confirmed"], 1),
                                "failed_tasks": res.get("failed", 0)}
                        row["load"] = load
                        cb.log(f"  load: offered {offered} msg/s, confirmed "
                               f"{load['confirmed_rate']:.0f} msg/s, nacked {load['nacked']}, "
                               f"confirm p50/p99 {load['confirm_p50_ms']:.1f}/"
                               f"{load['confirm_p99_ms']:.1f} ms, "
                               f"{load['cpu_us_per_msg']:.1f} µs CPU/msg (3 nodes), "
                               f"{load['failed_tasks']} of {2 * a.queues} client tasks failed")
                if a.restart and isinstance(cluster, cb.WarrenCluster):
                    row["restart_s"] = restart_node(cluster, cluster.nodes[1], prefix, a.queues)
                rows.append(row)
            finally:
                cluster.stop()
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
