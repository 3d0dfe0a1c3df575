#!/usr/bin/env python3
"""Run Warren's total-queue cluster checker for long durations or many runs.

Each run starts a fresh cluster of real `warren server` processes (compat-tests/python/
cluster_harness.py), drives one quorum queue (or, with --queue-type classic, a durable classic queue used through
the nodes other than its home) with two confirmed publishers and an acking
consumer while a fault thread kills (-9) and pauses (SIGSTOP) nodes, then drains the queue and
checks: lost = 0, unexpected = 0, duplicates only for redelivered or republished ids, and (when
the binary reports `raft` for a queue) that every replica reaches the same applied index with
the same digest. Fault kinds: kill9, pause, term, partition (a minority cut off through the
harness's TCP proxy between the nodes), killall (kill -9 of every node, then all restarted),
membership (a member removed and added back through the management API), transfer (the
leadership handed to another member through the management API).

    .venv-compat/bin/python scripts/cluster_soak.py --seconds 600 --runs 5
    .venv-compat/bin/python scripts/cluster_soak.py --nodes 5 --faults kill9,pause,term
    .venv-compat/bin/python scripts/cluster_soak.py --faults partition,killall --order cycle \
        --partition-mode blackhole

A failed run keeps its directory (node logs, data dirs, history-*.json) and is named in the
output; the exit status is 1 if any run failed. --standalone runs one node without cluster
flags (for checking the harness itself on a binary without clustering).
"""

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat-tests" / "python"))

from cluster_harness import (CHECK_QUEUE_TYPES, CLASSIC_FAULT_KINDS,  # noqa: E402
                             FAULT_KINDS, PARTITION_MODES, Cluster, cluster_supported, log,
                             run_total_queue_check, summarize)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0, help="length of each run")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--seed", type=int, default=None, help="seed of run 0 (run k: seed + k)")
    ap.add_argument("--faults", default="kill9,pause",
                    help=f"comma list of: {', '.join(FAULT_KINDS)}")
    ap.add_argument("--order", choices=("random", "cycle"), default="random",
                    help="pick each fault at random, or every kind once per round")
    ap.add_argument("--partition-mode", choices=PARTITION_MODES, default="mixed",
                    help="new connections across a cut: reset, black-holed, or either")
    ap.add_argument("--no-proxy", action="store_true",
                    help="nodes talk directly (no partition faults)")
    ap.add_argument("--publishers", type=int, default=2)
    ap.add_argument("--queue-type", choices=CHECK_QUEUE_TYPES, default="quorum",
                    help="the checked queue: quorum, or a durable classic queue homed on a "
                         "random node, used through the others (faults: "
                         f"{', '.join(CLASSIC_FAULT_KINDS)})")
    ap.add_argument("--binary", default=os.environ.get("WARREN_BIN"),
                    help="warren binary (default: WARREN_BIN or target/debug/warren)")
    ap.add_argument("--log-level", default=None, help="nodes' --log-level (default info)")
    ap.add_argument("--keep", action="store_true", help="keep every run's directory")
    ap.add_argument("--standalone", action="store_true",
                    help="one node without cluster flags (harness self-check)")
    args = ap.parse_args()

    if not args.standalone:
        ok, why = cluster_supported(args.binary)
        if not ok:
            sys.exit(f"cluster_soak: {why}")
    logging.getLogger("pika").setLevel(logging.CRITICAL)
    kinds = tuple(k for k in args.faults.split(",") if k)
    unknown = set(kinds) - set(FAULT_KINDS)
    if unknown:
        sys.exit(f"cluster_soak: unknown fault kinds {sorted(unknown)}")
    if args.queue_type == "classic" and set(kinds) - set(CLASSIC_FAULT_KINDS):
        sys.exit(f"cluster_soak: a classic queue takes only {', '.join(CLASSIC_FAULT_KINDS)}")
    if args.no_proxy and "partition" in kinds:
        sys.exit("cluster_soak: partition faults need the proxy")

    runs, failed = [], []
    for run in range(args.runs):
        cluster = Cluster(1 if args.standalone else args.nodes, binary=args.binary,
                          log_level=args.log_level, clustered=not args.standalone,
                          keep=args.keep, proxied=not args.no_proxy)
        try:
            cluster.start_all()
            seed = None if args.seed is None else args.seed + run
            r = run_total_queue_check(cluster, seconds=args.seconds, seed=seed,
                                      publishers=args.publishers, kinds=kinds,
                                      order=args.order, partition_mode=args.partition_mode,
                                      queue_type=args.queue_type)
        except Exception:
            cluster.keep = True
            print(cluster.report())
            raise
        finally:
            cluster.close()
        runs.append(r)
        res = r["result"]
        log(f"run {run}: seed={r['seed']} faults={dict(r['faults'])} {res.summary()}")
        log(f"run {run}: stats={dict(r['stats'])}")
        log(f"run {run}: fault log (t, kind, node, was leader, held s, recovered s): "
            f"{r['fault_log']}")
        if r["replicas"]:
            log(f"run {run}: {r['replicas']['summary']}")
        if r["consumer_cancels"]:
            log(f"run {run}: basic.cancel from the broker (t, node): {r['consumer_cancels']}")
        if r["errors"] or not res.ok:
            failed.append(run)
            log(f"run {run} FAILED (directory kept: {cluster.root})")
            for e in r["errors"]:
                print(e)
            if not res.ok:
                print(res.describe())
            print(cluster.report(lines=40))
    print(summarize(runs))
    if failed:
        print(f"failed runs: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
