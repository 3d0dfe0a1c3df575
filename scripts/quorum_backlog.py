#!/usr/bin/env python3
"""A backlog in one quorum queue on a 3-node Warren cluster: every node's RSS per queued message.

The script starts the 3-node cluster of `scripts/cluster_bench.py` (release build, loopback),
declares one quorum queue through n1 and, with `warren-perf`, publishes `--messages` persistent
1 KB messages into it with confirms (1,000 in flight) and no consumer. It samples every node's
RSS (/proc/<pid>/status VmRSS) every 0.5 s throughout. With the backlog in place and applied
on every replica it drains the queue with one consumer (prefetch 1,000, acks every 100),
restarts a follower (SIGKILL, then start 2 s later) `--restart-after` seconds into the drain
(1 by default: the drain takes seconds, and the member must catch up with most of the backlog
still queued), and records how long
that member takes to be back at the leader's applied index and the longest time the queue
depth did not fall (a stall). Per-message RSS is (RSS with the backlog - RSS before) /
messages, per node.

    scripts/quorum_backlog.py                      # 1,000,000 x 1 KB
    scripts/quorum_backlog.py --messages 100000    # quick check
    scripts/quorum_backlog.py --doc                # also write the section into docs/benchmarks.md

With `--behind` the follower is instead killed before the publish and started once the
backlog is in and the leader's log is purged past it (`--quorum-log-pin-max 0` on every
node): it catches up from a snapshot that carries the backlog's bodies, which the script times,
with both ends' peak RSS meanwhile; the drain then runs without a restart.

    scripts/quorum_backlog.py --behind             # the member behind the purged log
    scripts/quorum_backlog.py --behind --pin-max 50000   # the default bound: from the log

Python 3 standard library only. The cluster's data directory is removed at the end (kept with
WARREN_BENCH_KEEP=1). Raw figures go to target/cluster-bench/backlog-*.json.
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster_bench as cb  # noqa: E402

SECTION = "## A 1M-message backlog in one quorum queue (issue 22)"
PREFIX = "backlog"
QUEUE = PREFIX + "-0"  # warren-perf's name of its first queue


def rss_mb(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Sampler(threading.Thread):
    """Every node's RSS and the queue's depth (through n1, or n2 while n1 is down)."""

    def __init__(self, cluster):
        super().__init__(daemon=True)
        self.cluster = cluster
        self.stop = threading.Event()
        self.rss = {n: [] for n in cluster.nodes}  # (t, MB)
        self.depth = []  # (t, messages)
        self.phase = "start"
        self.peak = {}  # (phase, node) -> MB

    def run(self):
        while not self.stop.is_set():
            t = time.monotonic()
            for n, pid in self.cluster.pids().items():
                mb = rss_mb(pid)
                if mb is not None:
                    self.rss[n].append((t, mb))
                    key = (self.phase, n)
                    self.peak[key] = max(self.peak.get(key, 0), mb)
            d = depth(self.cluster)
            if d is not None:
                self.depth.append((t, d))
            self.stop.wait(0.5)


def queue_info(cluster, node):
    try:
        return cluster._mgmt_get(node, f"/api/queues/%2F/{urllib.parse.quote(QUEUE, safe='')}")
    except (OSError, ValueError, urllib.error.HTTPError):
        return None


def depth(cluster):
    for n in cluster.nodes:
        if n in cluster.procs:
            info = queue_info(cluster, n)
            if info is not None and info.get("messages") is not None:
                return info["messages"]
    return None


def applied(cluster, node):
    info = queue_info(cluster, node)
    raft = (info or {}).get("raft") or {}
    return raft.get("applied_index")


def perf(extra, out):
    cmd = [str(cb.PERF), "--uri", "amqp://guest:guest@127.0.0.1:5701/%2f", "--queue", PREFIX,
           "--queues", "1", "--size", "1024", "--persistent", "--durable",
           "--queue-arg", "x-queue-type=quorum", "--duration", "0", "--json", str(out)] + extra
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_until(pred, timeout, what):
    deadline = time.monotonic() + timeout
    v = None
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what} (last: {v!r})")


def raft_field(cluster, node, field):
    info = queue_info(cluster, node)
    return ((info or {}).get("raft") or {}).get(field)


def catch_up_from_snapshot(cluster, sampler, leader, follower, args):
    """Start `follower`, down since before the publish, once the leader's log is purged past
    it; time its catch-up (from a snapshot carrying the bodies) and both ends' peak RSS."""
    if args.pin_max in (None, 0):
        wait_until(lambda: (raft_field(cluster, leader, "purged_index") or 0) > 100, 120,
                   "the leader's log purged past the stopped follower")
    behind = {"node": follower, "leader_purged_index": raft_field(cluster, leader, "purged_index"),
              "leader_rss_before_mb": round(rss_mb(cluster.pids()[leader]), 1)}
    sampler.phase = "behind"
    t_start = time.monotonic()
    cluster.start_node(follower)
    cb.wait_port(cluster.amqp[follower], time.monotonic() + 60)

    def caught_up():
        a, b = applied(cluster, follower), applied(cluster, leader)
        return a is not None and b is not None and a >= b
    wait_until(caught_up, 600, f"{follower} back at the leader's index")
    wait_until(lambda: (queue_info(cluster, follower) or {}).get("messages") == args.messages,
               120, f"{follower} holding the backlog")
    behind["caught_up_s"] = round(time.monotonic() - t_start, 1)
    behind["follower_purged_index"] = raft_field(cluster, follower, "purged_index")
    behind["follower_peak_mb"] = round(sampler.peak.get(("behind", follower), 0), 1)
    behind["leader_peak_mb"] = round(sampler.peak.get(("behind", leader), 0), 1)
    behind["follower_rss_mb"] = round(rss_mb(cluster.pids()[follower]), 1)
    queues = root_of(cluster) / follower / "data"
    behind["follower_data_mb"] = round(sum(f.stat().st_size for f in queues.rglob("*")
                                           if f.is_file()) / 2**20, 1)
    print(json.dumps({"behind": behind}), flush=True)
    return behind


def root_of(cluster):
    return cluster.root


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--restart", default="n3", help="the follower restarted during the drain")
    ap.add_argument("--restart-after", type=float, default=1.0,
                    help="seconds into the drain at which that follower is killed")
    ap.add_argument("--behind", action="store_true",
                    help="the follower is down during the publish and catches up from a snapshot")
    ap.add_argument("--pin-max", type=int, default=None,
                    help="--quorum-log-pin-max for every node (--behind: 0 unless given; with "
                         "a bound the log is not purged past the backlog, so the member "
                         "catches up from the log)")
    ap.add_argument("--doc", action="store_true")
    args = ap.parse_args()
    for b in (cb.WARREN, cb.PERF):
        if not b.exists():
            sys.exit(f"{b} is missing: cargo build --release")
    cb.OUT_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = Path(tempfile.mkdtemp(prefix="warren-backlog-"))
    cluster = cb.WarrenCluster(root)
    pin_max = args.pin_max if args.pin_max is not None else (0 if args.behind else None)
    if pin_max is not None:
        cluster.extra_args += ["--quorum-log-pin-max", str(pin_max)]
    result_pin = pin_max
    cluster.start()
    result = {"messages": args.messages, "size": 1024, "date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()}, {cb.os.cpu_count()} cores",
              "version": cluster.version(), "quorum_log_pin_max": result_pin}
    sampler = Sampler(cluster)
    try:
        cb.until_declared(cluster.amqp["n1"], QUEUE, 60)
        leader = wait_until(lambda: cluster.leaders([QUEUE])[QUEUE], 30, "a leader")
        time.sleep(2)
        base = {n: rss_mb(p) for n, p in cluster.pids().items()}
        result["rss_before_mb"] = base
        follower = args.restart if args.restart != leader else "n2"
        if args.behind:
            cluster.kill(follower)
        sampler.start()

        sampler.phase = "publish"
        t0 = time.monotonic()
        p = perf(["--producers", "1", "--consumers", "0", "--confirm", "1000",
                        "--pmessages", str(args.messages), "--no-declare"],
                 cb.OUT_DIR / f"backlog-{stamp}-publish.json")
        _, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"warren-perf publish failed: {err}")
        result["publish_s"] = round(time.monotonic() - t0, 1)
        result["publish_rate"] = round(args.messages / result["publish_s"])
        # Every replica applied the backlog.
        top = wait_until(lambda: applied(cluster, leader), 30, "the leader's index")
        for n in cluster.pids():
            wait_until(lambda n=n: (applied(cluster, n) or 0) >= top, 120, f"{n} applied")
        wait_until(lambda: depth(cluster) == args.messages, 60, "the whole backlog counted")
        time.sleep(3)
        held = {n: rss_mb(p) for n, p in cluster.pids().items()}
        if args.behind:
            result["behind"] = catch_up_from_snapshot(cluster, sampler, leader, follower, args)
        result["rss_backlog_mb"] = held
        result["bytes_per_message"] = {
            n: round((held[n] - base[n]) * 1024 * 1024 / args.messages, 1) for n in held}
        result["peak_publish_mb"] = {n: round(sampler.peak.get(("publish", n), 0), 1)
                                     for n in cluster.nodes}

        sampler.phase = "drain"
        t0 = time.monotonic()
        d = perf(["--producers", "0", "--consumers", "1", "--cmessages",
                        str(args.messages), "--no-declare", "--prefetch", "1000",
                        "--multi-ack", "100"],
                 cb.OUT_DIR / f"backlog-{stamp}-drain.json")
        if args.behind:
            _, err = d.communicate(timeout=1200)
            if d.returncode != 0:
                raise RuntimeError(f"warren-perf drain failed: {err}")
            result["drain_s"] = round(time.monotonic() - t0, 1)
            result["drain_rate"] = round(args.messages / result["drain_s"])
            result["peak_mb"] = {n: round(max((mb for _, mb in sampler.rss[n]), default=0), 1)
                                 for n in cluster.nodes}
            out = cb.OUT_DIR / f"backlog-behind-{stamp}.json"
            out.write_text(json.dumps(result, indent=2))
            print(json.dumps(result, indent=2))
            return
        time.sleep(args.restart_after)
        restart = {"node": follower, "depth_at_kill": depth(cluster)}
        cluster.kill(follower)
        t_kill = time.monotonic()
        time.sleep(2)
        cluster.start_node(follower)
        cb.wait_port(cluster.amqp[follower], time.monotonic() + 60)
        restart["depth_at_start"] = depth(cluster)

        def caught_up():
            a, b = applied(cluster, follower), applied(cluster, leader)
            return a is not None and b is not None and a >= b
        wait_until(caught_up, 300, f"{follower} back at the leader's index")
        restart["caught_up_s"] = round(time.monotonic() - t_kill, 1)
        _, err = d.communicate(timeout=1200)
        if d.returncode != 0:
            raise RuntimeError(f"warren-perf drain failed: {err}")
        result["drain_s"] = round(time.monotonic() - t0, 1)
        result["drain_rate"] = round(args.messages / result["drain_s"])
        wait_until(lambda: depth(cluster) == 0, 60, "the queue empty")
        time.sleep(6)  # a compaction round (every 5 s)
        # The restarted process's own samples only.
        restart["peak_mb"] = round(max((mb for t, mb in sampler.rss[follower] if t > t_kill),
                                       default=0), 1)
        result["restart"] = restart
        result["rss_after_drain_mb"] = {n: rss_mb(p) for n, p in cluster.pids().items()}
        result["peak_mb"] = {n: round(max(mb for _, mb in sampler.rss[n]), 1)
                             for n in cluster.nodes}
        # The longest time the depth did not fall while draining (samples every ~0.5 s).
        drain = [(t, v) for t, v in sampler.depth if t >= t0]
        longest, since, last = 0.0, None, None
        for t, v in drain:
            if last is None or v < last:
                since, last = t, v
            elif v > 0:
                longest = max(longest, t - since)
        result["longest_stall_s"] = round(longest, 1)
        data = {n: sum(f.stat().st_size for f in (root / "warren" / n / "data").rglob("*")
                       if f.is_file()) for n in cluster.nodes}
        result["data_dir_mb_after_drain"] = {n: round(b / 2**20, 1) for n, b in data.items()}
    finally:
        sampler.stop.set()
        cluster.stop()
        # A million-message run leaves gigabytes of logs: kept only when asked.
        if os.environ.get("WARREN_BENCH_KEEP") != "1":
            shutil.rmtree(root, ignore_errors=True)
    out = cb.OUT_DIR / f"backlog-{stamp}.json"
    out.write_text(json.dumps(result, indent=2))
    text = report(result)
    print(f"{SECTION}\n\n{text}")
    if args.doc:
        cb.SECTION = SECTION  # write_doc replaces the section of that heading
        cb.write_doc(text)


def report(r):
    nodes = sorted(r["rss_backlog_mb"])
    f = lambda v: f"{v:.0f}"  # noqa: E731
    rows = [
        ("RSS before (MB)", [f(r["rss_before_mb"][n]) for n in nodes]),
        ("RSS with the backlog (MB)", [f(r["rss_backlog_mb"][n]) for n in nodes]),
        ("RSS per queued message (bytes)", [f"{r['bytes_per_message'][n]:.0f}" for n in nodes]),
        ("peak RSS, whole run (MB)", [f(r["peak_mb"][n]) for n in nodes]),
        ("RSS after the drain (MB)", [f(r["rss_after_drain_mb"][n]) for n in nodes]),
        ("data directory after the drain (MB)",
         [f"{r['data_dir_mb_after_drain'][n]:.0f}" for n in nodes]),
    ]
    lines = [
        f"{r['date']}, {r['machine']}, {r['version']}. `scripts/quorum_backlog.py "
        f"--messages {r['messages']}`: {r['messages']:,} x 1 KB persistent messages published "
        f"with confirms into one quorum queue of a 3-node cluster on loopback, no consumer; "
        f"then drained by one consumer while follower {r['restart']['node']} was killed "
        f"(SIGKILL) {r['restart']['depth_at_kill']:,} messages before the end and restarted "
        f"2 s later with {r['restart']['depth_at_start']:,} left.", "",
        "| | " + " | ".join(nodes) + " |",
        "|---|" + "---|" * len(nodes),
    ]
    for name, vals in rows:
        lines.append(f"| {name} | " + " | ".join(vals) + " |")
    lines += [
        "",
        f"Published at {r['publish_rate']:,} msg/s ({r['publish_s']} s), drained at "
        f"{r['drain_rate']:,} msg/s ({r['drain_s']} s); longest stretch without the depth "
        f"falling while draining: {r['longest_stall_s']} s. The restarted member was back "
        f"at the leader's applied index {r['restart']['caught_up_s']} s after the kill, its "
        f"RSS peaking at {r['restart']['peak_mb']:.0f} MB while it caught up.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
