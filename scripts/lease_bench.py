#!/usr/bin/env python3
"""Claim/ack throughput of the HTTP queue API against AMQP consume/ack, on one Warren.

Starts target/release/warren on free loopback ports with a throw-away data directory, fills a
durable queue with --messages persistent messages of --size bytes (HTTP publishes of 1,000),
then drains it three ways, refilling in between, each with --workers client processes:

  http-bN   POST /v1/queues/%2F/q/leases {max_items: N} then POST /v1/leases/ack with the
            batch's tokens, until the queue is empty (N from --batches, default 10 and 100);
  amqp      basic.consume with prefetch 100 and one basic.ack per message (pika).

For each it reports messages/s, the broker's CPU per message (µs, from /proc) and its RSS.
Prints a JSON line per run and a Markdown table; with --doc, writes the table into
docs/benchmarks.md between the lease-bench markers (`--cluster`: the cluster's markers).
Run it with nothing else busy.

With --cluster, three nodes on loopback form a cluster and the queue is a quorum queue
replicated on all of them: every claim, ack and publish is a Raft commit; the workers spread
over the three nodes' HTTP APIs and AMQP listeners (two of three reach the leader through a
forward), and CPU and RSS are the sum over the three processes.

    cargo build --release --bin warren
    scripts/lease_bench.py --messages 100000 --workers 4 --doc
    scripts/lease_bench.py --cluster --messages 50000 --workers 4 --doc

Needs: .venv-compat (pika, requests), built by ./scripts/test.
"""

import argparse
import datetime
import http.client
import json
import multiprocessing
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pika

ROOT = Path(__file__).resolve().parent.parent
WARREN = ROOT / "target/release/warren"
DOC = ROOT / "docs/benchmarks.md"
BEGIN = "<!-- lease-bench:begin -->"
END = "<!-- lease-bench:end -->"
CLUSTER_BEGIN = "<!-- lease-bench-cluster:begin -->"
CLUSTER_END = "<!-- lease-bench-cluster:end -->"
AUTH = "Basic Z3Vlc3Q6Z3Vlc3Q="  # guest:guest
QUEUE = "lease-bench"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid):
    """utime + stime of `pid`, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def request(conn, method, path, body=None):
    data = None if body is None else json.dumps(body)
    headers = {"Authorization": AUTH}
    if data is not None:
        headers["Content-Type"] = "application/json"
    conn.request(method, path, body=data, headers=headers)
    r = conn.getresponse()
    raw = r.read()
    if r.status != 200:
        raise RuntimeError(f"{method} {path}: {r.status} {raw[:200]!r}")
    return json.loads(raw)


def fill(mgmt_port, n, size):
    conn = http.client.HTTPConnection("127.0.0.1", mgmt_port, timeout=60)
    payload = "x" * size
    left = n
    while left:
        k = min(1000, left)
        request(conn, "POST", f"/v1/queues/%2F/{QUEUE}/messages",
                {"messages": [{"payload": payload}] * k})
        left -= k
    conn.close()


def http_worker(mgmt_port, batch, counter):
    conn = http.client.HTTPConnection("127.0.0.1", mgmt_port, timeout=60)
    done = 0
    while True:
        d = request(conn, "POST", f"/v1/queues/%2F/{QUEUE}/leases",
                    {"max_items": batch, "lease_ms": 60_000})["deliveries"]
        if not d:
            break
        results = request(conn, "POST", "/v1/leases/ack",
                          {"tokens": [x["token"] for x in d]})["results"]
        bad = [r for r in results if r["status"] != 200]
        if bad:
            raise RuntimeError(f"acks refused: {bad[:3]}")
        done += len(d)
    conn.close()
    with counter.get_lock():
        counter.value += done


def amqp_worker(amqp_port, share, counter):
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", amqp_port, credentials=pika.PlainCredentials("guest", "guest")))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=100)
    got = 0
    for method, _, _ in ch.consume(QUEUE, inactivity_timeout=2.0):
        if method is None:
            break
        ch.basic_ack(method.delivery_tag)
        got += 1
        if got >= share:
            break
    ch.cancel()
    conn.close()
    with counter.get_lock():
        counter.value += got


def drain(kind, args, brokers, nodes, batch):
    """Drain with --workers processes, worker k on node k mod len(nodes)."""
    counter = multiprocessing.Value("q", 0)
    if kind == "amqp":
        share = -(-args.messages // args.workers)
        procs = [multiprocessing.Process(
            target=amqp_worker, args=(nodes[k % len(nodes)]["amqp"], share, counter))
            for k in range(args.workers)]
    else:
        procs = [multiprocessing.Process(
            target=http_worker, args=(nodes[k % len(nodes)]["mgmt"], batch, counter))
            for k in range(args.workers)]
    cpu = lambda: sum(cpu_seconds(b.pid) for b in brokers)  # noqa: E731
    cpu0, t0 = cpu(), time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    elapsed, cpu = time.monotonic() - t0, cpu() - cpu0
    n = counter.value
    if any(p.exitcode for p in procs) or n != args.messages:
        raise RuntimeError(f"{kind}: drained {n} of {args.messages}")
    return {
        "mode": kind if kind == "amqp" else f"http-b{batch}",
        "messages": n,
        "msg_per_s": n / elapsed,
        "broker_cpu_us_per_msg": cpu / n * 1e6,
        "broker_rss_mb": sum(rss_mb(b.pid) for b in brokers),
        "elapsed_s": elapsed,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=50_000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batches", default="10,100")
    ap.add_argument("--queue-type", default="classic", choices=["classic", "quorum"])
    ap.add_argument("--cluster", action="store_true",
                    help="three nodes, a quorum queue replicated on all of them")
    ap.add_argument("--doc", action="store_true", help="write the table into docs/benchmarks.md")
    args = ap.parse_args()
    if args.cluster:
        args.queue_type = "quorum"
    if not WARREN.exists():
        sys.exit(f"{WARREN} missing: cargo build --release --bin warren")
    count = 3 if args.cluster else 1
    nodes = [{"amqp": free_port(), "mgmt": free_port(), "prom": free_port(),
              "cluster": free_port()} for _ in range(count)]
    peers = ",".join(f"n{i + 1}@127.0.0.1:{n['cluster']}" for i, n in enumerate(nodes))
    data = Path(tempfile.mkdtemp(prefix="warren-lease-bench-"))
    brokers = []
    for i, n in enumerate(nodes):
        cmd = [str(WARREN), "server", "--amqp-listen", f"127.0.0.1:{n['amqp']}",
               "--management-listen", f"127.0.0.1:{n['mgmt']}",
               "--prometheus-listen", f"127.0.0.1:{n['prom']}",
               "--data-dir", str(data / f"n{i + 1}"), "--log-level", "warn"]
        if args.cluster:
            cmd += ["--node-name", f"n{i + 1}", "--cluster-listen",
                    f"127.0.0.1:{n['cluster']}", "--peers", peers, "--cluster-secret", "bench"]
        brokers.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL))
    rows = []
    try:
        deadline = time.monotonic() + 60
        for n in nodes:
            while True:
                try:
                    socket.create_connection(("127.0.0.1", n["amqp"]), timeout=0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        while True:
            # A cluster declares once its metadata group has a leader.
            try:
                c = pika.BlockingConnection(pika.ConnectionParameters(
                    "127.0.0.1", nodes[0]["amqp"],
                    credentials=pika.PlainCredentials("guest", "guest")))
                c.channel().queue_declare(QUEUE, durable=True,
                                          arguments={"x-queue-type": args.queue_type})
                c.close()
                break
            except pika.exceptions.AMQPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        modes = [("http", int(b)) for b in args.batches.split(",")] + [("amqp", 100)]
        for kind, batch in modes:
            fill(nodes[0]["mgmt"], args.messages, args.size)
            row = drain(kind, args, brokers, nodes, batch)
            row.update(queue_type=args.queue_type, size=args.size, workers=args.workers,
                       nodes=count)
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        for b in brokers:
            b.send_signal(signal.SIGTERM)
        for b in brokers:
            try:
                b.wait(timeout=15)
            except subprocess.TimeoutExpired:
                b.kill()
        shutil.rmtree(data, ignore_errors=True)
    where = "3-node cluster on loopback, CPU and RSS summed over the nodes" if args.cluster \
        else "one node"
    head = (f"`scripts/lease_bench.py {'--cluster ' if args.cluster else ''}"
            f"--messages {args.messages} --size {args.size} "
            f"--workers {args.workers} --queue-type {args.queue_type}`, "
            f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, "
            f"release build, {where}, clients on the same machine (Python)")
    table = [head, "", "| mode | msg/s | broker CPU µs/msg | broker RSS MB |", "|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['mode']} | {r['msg_per_s']:,.0f} | "
                     f"{r['broker_cpu_us_per_msg']:.1f} | {r['broker_rss_mb']:.0f} |")
    text = "\n".join(table)
    print(text)
    if args.doc:
        begin, end = (CLUSTER_BEGIN, CLUSTER_END) if args.cluster else (BEGIN, END)
        doc = DOC.read_text()
        block = f"{begin}\n{text}\n{end}"
        if begin in doc:
            doc = doc[:doc.index(begin)] + block + doc[doc.index(end) + len(end):]
        else:
            doc += f"\n{block}\n"
        DOC.write_text(doc)


if __name__ == "__main__":
    main()
