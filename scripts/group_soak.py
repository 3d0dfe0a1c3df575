#!/usr/bin/env python3
"""A consumer group rebalancing under load on a 3-node cluster (issue 25's soak).

Starts a cluster of real `warren server` processes (compat-tests/python/cluster_harness.py),
declares a partitioned quorum queue (`--partitions`, keyed by header `k`), and for `--seconds`:
`--publishers` publishers with confirms each send their own `--keys` keys in turn, each message
carrying its key's next sequence number; members of one consumer group join (on a random node) and leave (basic.cancel,
or a closed connection) every 1-3 s, with one member present throughout. Then publishing stops
and the group drains. Every delivery is recorded, in the order deliveries were received across
all members, before it is acked.

Checks: lost = 0 (every confirmed message delivered); per key, the deliveries not flagged
redelivered arrive in increasing sequence order (a partition is never with two members, and
a revoked partition's unacked deliveries come back flagged redelivered). Exit status 1 on a
failed check.

    .venv-compat/bin/python scripts/group_soak.py                  # 60 s
    .venv-compat/bin/python scripts/group_soak.py --seconds 20 --partitions 3
"""

import argparse
import logging
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat-tests" / "python"))

import pika  # noqa: E402

from cluster_harness import Cluster, cluster_supported, log, safe_close  # noqa: E402

GROUP = "soak"


class Record:
    """What the clients saw, in the order they saw it (one lock across threads)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.confirmed = set()
        self.deliveries = []   # (key, seq, redelivered, member)

    def deliver(self, key, seq, redelivered, member):
        with self.lock:
            self.deliveries.append((key, seq, redelivered, member))

    def seen(self):
        with self.lock:
            return {(k, s) for k, s, _, _ in self.deliveries}


class Member(threading.Thread):
    def __init__(self, cluster, node, queue, tag, record, lifetime, how):
        super().__init__(name=tag, daemon=True)
        self.c, self.node, self.queue, self.tag = cluster, node, queue, tag
        self.record, self.lifetime, self.how = record, lifetime, how
        self.stop = threading.Event()
        self.error = None

    def run(self):
        conn = None
        try:
            conn = self.c.connect(self.node)
            ch = conn.channel()
            ch.basic_qos(prefetch_count=20)

            def on(ch_, m, props, body):
                key, seq = body.decode().split("/")
                self.record.deliver(key, int(seq), m.redelivered, self.tag)
                ch_.basic_ack(m.delivery_tag)

            ch.basic_consume(self.queue, on, consumer_tag=self.tag,
                             arguments={"x-consumer-group": GROUP})
            end = time.monotonic() + self.lifetime
            while time.monotonic() < end and not self.stop.is_set():
                conn.process_data_events(time_limit=0.05)
            if self.how == "cancel":
                ch.basic_cancel(self.tag)
                conn.process_data_events(time_limit=0.1)
        except Exception as e:  # reported by the caller
            self.error = repr(e)
        finally:
            safe_close(conn)


def publisher(cluster, queue, keys, record, stop, counts):
    # counts is shared: += on a dict entry is not atomic, but only for the report.
    seq = {k: 0 for k in keys}
    conn = ch = None
    while not stop.is_set():
        if ch is None:
            try:
                conn = cluster.connect(0)
                ch = conn.channel()
                ch.confirm_delivery()
            except Exception:
                safe_close(conn)
                conn = ch = None
                stop.wait(0.2)
                continue
        for k in keys:
            if stop.is_set():
                break
            body = f"{k}/{seq[k]}"
            try:
                ch.basic_publish("", queue, body.encode(),
                                 pika.BasicProperties(headers={"k": k}, delivery_mode=2))
                with record.lock:
                    record.confirmed.add((k, seq[k]))
                seq[k] += 1
                counts["published"] += 1
            except Exception:
                counts["publish errors"] += 1
                safe_close(conn)
                conn = ch = None
                break
    safe_close(conn)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--keys", type=int, default=40, help="keys per publisher")
    ap.add_argument("--publishers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    ok, why = cluster_supported()
    if not ok:
        sys.exit(f"group_soak: {why}")
    logging.getLogger("pika").setLevel(logging.CRITICAL)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    queue = f"soak.{seed}"
    record, counts = Record(), {"published": 0, "publish errors": 0, "joins": 0, "leaves": 0}
    cluster = Cluster(3)
    failed = False
    try:
        cluster.start_all()
        end = time.monotonic() + 30
        while True:
            conn = None
            try:
                conn = cluster.connect(0)
                conn.channel().queue_declare(queue, durable=True, arguments={
                    "x-queue-type": "quorum", "x-partitions": args.partitions,
                    "x-partition-key": "header:k"})
                break
            except Exception:
                assert time.monotonic() < end, "declare kept failing"
                time.sleep(0.2)
            finally:
                safe_close(conn)
        anchor = Member(cluster, 0, queue, "anchor", record, 1e9, "close")
        anchor.start()
        stop = threading.Event()
        pubs = []
        for p in range(args.publishers):
            keys = [f"p{p}k{i}" for i in range(args.keys)]
            pubs.append(threading.Thread(target=publisher, daemon=True,
                                         args=(cluster, queue, keys, record, stop, counts)))
        for pub in pubs:
            pub.start()
        members, n = [], 0
        churn_end = time.monotonic() + args.seconds
        while time.monotonic() < churn_end:
            time.sleep(rng.uniform(1.0, 3.0))
            n += 1
            m = Member(cluster, rng.randrange(3), queue, f"m{n}", record,
                       rng.uniform(1.0, 6.0), rng.choice(["cancel", "close"]))
            m.start()
            members.append(m)
            counts["joins"] += 1
        stop.set()
        for pub in pubs:
            pub.join(timeout=30)
        for m in members:
            m.join(timeout=30)
            counts["leaves"] += 1
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with record.lock:
                missing = record.confirmed - {(k, s) for k, s, _, _ in record.deliveries}
            if not missing:
                break
            time.sleep(0.2)
        anchor.stop.set()
        anchor.join(timeout=30)
        with record.lock:
            confirmed = set(record.confirmed)
            deliveries = list(record.deliveries)
        lost = confirmed - {(k, s) for k, s, _, _ in deliveries}
        violations = []
        last = {}
        for key, seq, redelivered, member in deliveries:
            if redelivered:
                continue
            if key in last and seq < last[key][0]:
                violations.append((key, last[key], (seq, member)))
            last[key] = max(last.get(key, (-1, "")), (seq, member))
        redelivered = sum(1 for d in deliveries if d[2])
        errors = [f"{m.name}: {m.error}" for m in [anchor, *members] if m.error]
        log(f"group_soak: seed={seed} partitions={args.partitions} seconds={args.seconds} "
            f"{counts} confirmed={len(confirmed)} deliveries={len(deliveries)} "
            f"redelivered={redelivered} lost={len(lost)} order_violations={len(violations)}")
        if errors:
            log(f"member errors: {errors[:5]}")
        if lost or violations:
            failed = True
            log(f"lost (first 10): {sorted(lost)[:10]}")
            log(f"order violations (first 10): {violations[:10]}")
            cluster.keep = True
    finally:
        cluster.close()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
