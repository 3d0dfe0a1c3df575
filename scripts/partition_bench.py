#!/usr/bin/env python3
"""Partitioned quorum queues and streams with consumer groups on a 3-node Warren cluster.

For each partition count (1, 3, 6, 12 by default) and each type (quorum, stream) the script
declares a partitioned queue `x-partitions: P` with `x-partition-key: header:k` through node 1,
and runs `warren-perf` against node 1: min(P, 4) producers publishing persistent 1 KB messages
with confirms to the logical name, each message with one of 1,024 key values, and a consumer
group of P members (`x-consumer-group`). It reports throughput, the cluster's CPU per message
(all three nodes' processes, user + system), where each partition's leader is, and the
ratio of CPU per message to the 1-partition run (the issue's bound: flat within 20%).

    scripts/partition_bench.py                      # 15 s per run, both types
    scripts/partition_bench.py --duration 5 --partitions 1 3 --types quorum
    scripts/partition_bench.py --spread             # a warren-perf per node, clients spread
    scripts/partition_bench.py --spread --producers-per-partition 3   # load grows with P
    scripts/partition_bench.py --doc                # also write the section into docs/benchmarks.md

Reuses scripts/cluster_bench.py's cluster (target/release/warren, nodes n1..n3 on AMQP
5701-5703) and measurement. Raw JSON goes to target/cluster-bench/. Python 3 standard library.
"""

import argparse
import datetime
import json
import os
import platform
import sys
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster_bench as cb  # noqa: E402

SECTION = "## Partitioned queues and consumer groups on a 3-node cluster (issue 25)"


def log_entries(cluster, queues):
    """The Raft log entries the partitions' leaders wrote (their last written index)."""
    total = 0
    for q in queues:
        for n in cluster.nodes:
            try:
                info = cluster._mgmt_get(n, f"/api/queues/%2F/{urllib.parse.quote(q, safe='')}")
            except (OSError, ValueError):
                continue
            raft = info.get("raft") or {}
            if raft.get("role") == "leader":
                total += raft.get("last_written_index", 0)
                break
    return total


def run_spread(cluster, key, prefix, extra_of, queues, duration, declare_args, inspect=None):
    """One warren-perf per node at once (clients spread over the cluster as behind a load
    balancer), `extra_of(i)` its arguments; their figures summed (p99: the largest) and the
    cluster's CPU measured over all of them, as cb.run_perf does for one. The queue is
    declared through n1 first, so that every run starts from the same placement (three first
    declarations at once through three nodes left two unanswered before c1e1a5c)."""
    import subprocess
    cb.until_declared(cluster.amqp[cluster.nodes[0]], prefix, 60, arguments=declare_args)
    procs, outs = [], []
    pgids = set(cluster.pids().values())
    nodes0 = cb.group_cpu_s(pgids)
    for i, node in enumerate(cluster.nodes):
        out = cb.OUT_DIR / f"{key}-spread-{node}.json"
        out.unlink(missing_ok=True)
        outs.append(out)
        cmd = [str(cb.PERF), "--scenario", "quorum", "--uri",
               f"amqp://guest:guest@127.0.0.1:{cluster.amqp[node]}/%2F",
               "--duration", str(duration), "--queue", prefix, "--json", str(out)] + extra_of(i)
        cb.log(f"{cluster.name} {key} spread {node}: {' '.join(cmd[1:])}")
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    for pr in procs:
        text, _ = pr.communicate(timeout=duration + 300)
        if pr.returncode != 0:
            cb.log(f"  warren-perf exited {pr.returncode}:\n{text[:1500]}")
    nodes_s = cb.group_cpu_s(pgids) - nodes0
    leaders = cluster.leaders(queues)
    inspected = inspect(cluster, queues) if inspect else None
    cb.delete_queues(cluster.amqp[cluster.nodes[0]], queues)
    parts = [json.loads(o.read_text()) for o in outs if o.exists()]
    if len(parts) != len(outs):
        return None
    j = {
        "confirmed": sum(x.get("confirmed") or 0 for x in parts),
        "publish_rate": sum(x.get("publish_rate") or 0 for x in parts),
        "consume_rate": sum(x.get("consume_rate") or 0 for x in parts),
        "failed": sum(x.get("failed") or 0 for x in parts),
        "confirm_latency_us": {"p99": max((x.get("confirm_latency_us") or {}).get("p99", 0)
                                          for x in parts)},
        "_leaders": leaders,
        "_inspect": inspected,
    }
    j["_cluster_cpu_us_per_msg"] = nodes_s / j["confirmed"] * 1e6 if j["confirmed"] else None
    return j


def run(cluster, kind, partitions, duration, producers=None, spread=False):
    prefix = f"part-{kind}-{partitions}"
    producers = producers or (len(cluster.nodes) if spread else min(partitions, 4))
    extra = [
        "--exact-name", "--queues", "1", "--producers", str(producers),
        "--consumers", str(partitions), "--key-header", "k", "--keys", "1024",
        "--queue-arg", f"x-queue-type={kind}", "--queue-arg", f"x-partitions={partitions}",
        "--queue-arg", "x-partition-key=header:k",
        "--consumer-arg", "x-consumer-group=bench", "--confirm", "200", "--prefetch", "500",
    ]
    inspect = log_entries if kind == "quorum" else None
    if spread:
        # Producers and group members dealt round-robin over the nodes.
        n = len(cluster.nodes)

        def extra_of(i):
            mine = extra[:]
            mine[mine.index("--producers") + 1] = str(len(range(i, producers, n)))
            mine[mine.index("--consumers") + 1] = str(len(range(i, partitions, n)))
            return mine

        declare_args = {"x-queue-type": kind, "x-partitions": partitions,
                        "x-partition-key": "header:k"}
        j = run_spread(cluster, f"{kind}-{partitions}", prefix, extra_of,
                       [f"{prefix}-{i}" for i in range(partitions)], duration, declare_args,
                       inspect)
    else:
        j = cb.run_perf(cluster, f"{kind}-{partitions}", prefix, extra,
                        lambda p: [f"{p}-{i}" for i in range(partitions)], duration, 1,
                        inspect=inspect)
    if j is None:
        return None
    leaders = j.get("_leaders", {})
    per_node = {n: sum(1 for v in leaders.values() if v == n) for n in cluster.nodes}
    return {
        "kind": kind + (" (spread)" if spread else ""),
        "partitions": partitions,
        "producers": producers,
        "published_per_s": j.get("publish_rate"),
        "consumed_per_s": j.get("consume_rate") or (j.get("consumed", 0) / max(j.get("elapsed_s", 1), 1e-9)),
        "confirmed": j.get("confirmed"),
        "cpu_us_per_msg": j.get("_cluster_cpu_us_per_msg"),
        "confirm_p99_ms": (j.get("confirm_latency_us") or {}).get("p99", 0) / 1000,
        "leaders_per_node": per_node,
        "failed": j.get("failed"),
        # Commands (publishes, settles, ...) are batched into entries: fewer entries per
        # message, less per-entry Raft work.
        "log_entries_per_msg": (j["_inspect"] / j["confirmed"]
                                if j.get("_inspect") and j.get("confirmed") else None),
    }


def table(rows):
    lines = [
        "| type | partitions | producers | published/s | consumed/s | confirm p99 | cluster CPU µs/msg | vs 1 partition | log entries/msg | leaders per node (n1/n2/n3) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {}
    for r in rows:
        if r["partitions"] == 1 and r["cpu_us_per_msg"]:
            base[r["kind"]] = r["cpu_us_per_msg"]
    for r in rows:
        b = base.get(r["kind"])
        ratio = f"{r['cpu_us_per_msg'] / b:.2f}x" if b and r["cpu_us_per_msg"] else "-"
        e = r.get("log_entries_per_msg")
        entries = f"{e:.3f}" if e else "-"
        lp = "/".join(str(r["leaders_per_node"].get(n, 0)) for n in ("n1", "n2", "n3"))
        lines.append(
            f"| {r['kind']} | {r['partitions']} | {r['producers']} | {r['published_per_s']:,.0f} | "
            f"{r['consumed_per_s']:,.0f} | {r['confirm_p99_ms']:.1f} ms | "
            f"{r['cpu_us_per_msg'] or 0:.1f} | {ratio} | {entries} | {lp} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=int, default=15)
    ap.add_argument("--partitions", type=int, nargs="+", default=[1, 3, 6, 12])
    ap.add_argument("--types", nargs="+", default=["quorum", "stream"])
    ap.add_argument("--producers", type=int, default=None,
                    help="publishers in every run (default: min(partitions, 4))")
    ap.add_argument("--producers-per-partition", type=int, default=None,
                    help="publishers in every run: this many per partition (the offered load "
                         "per partition stays the same as partitions grow)")
    ap.add_argument("--spread", action="store_true",
                    help="one warren-perf per node, producers (default 3) and the group's "
                         "members dealt over the nodes, rather than every client on n1")
    ap.add_argument("--doc", action="store_true")
    args = ap.parse_args()
    for binary in (cb.WARREN, cb.PERF):
        if not binary.exists():
            sys.exit(f"{binary} missing: cargo build --release --bin warren -p warren-perf")
    cb.OUT_DIR.mkdir(parents=True, exist_ok=True)
    rows = []
    import tempfile
    with tempfile.TemporaryDirectory(prefix="warren-partition-bench-") as tmp:
        for kind in args.types:
            for p in args.partitions:
                # A fresh cluster per run: leaders, logs and caches start the same.
                cluster = cb.WarrenCluster(tmp)
                cluster.start()
                try:
                    producers = args.producers
                    if args.producers_per_partition:
                        producers = args.producers_per_partition * p
                    r = run(cluster, kind, p, args.duration, producers, args.spread)
                finally:
                    cluster.stop()
                if r:
                    rows.append(r)
                    cb.log(f"{kind} {p}: {json.dumps(r)}")
    text = table(rows)
    print(text)
    (cb.OUT_DIR / "partition-bench.json").write_text(json.dumps(rows, indent=1))
    if args.doc:
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        cmd = "scripts/partition_bench.py " + " ".join(sys.argv[1:])
        body = (f"{SECTION}\n\n`{cmd.strip()}` ({when}, {platform.machine()}, "
                f"{os.cpu_count()} cores; {WarrenVersion()}):\n\n{text}\n")
        doc = cb.DOC.read_text()
        if SECTION in doc:
            start = doc.index(SECTION)
            end = doc.find("\n## ", start + len(SECTION))
            doc = doc[:start] + body + ("" if end < 0 else doc[end:])
        else:
            doc = doc.rstrip() + "\n\n" + body
        cb.DOC.write_text(doc)


def WarrenVersion():  # noqa: N802 - reads like the label it prints
    return cb.WarrenCluster("/tmp").version()


if __name__ == "__main__":
    main()
