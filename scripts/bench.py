#!/usr/bin/env python3
"""Warren against RabbitMQ, side by side, on this machine.

Runs every `warren-perf` scenario against a fresh Warren and a locally installed RabbitMQ
(Debian's `rabbitmq-server`, started with `service`), one broker running at a time,
alternating which goes first, `--runs` times each. Reports medians and ratios, checks them
against the targets of the performance issue, and writes the table into docs/benchmarks.md
(between the bench-results markers). Raw JSON of every run goes to target/bench/.

    scripts/bench.py                      # everything, 3 runs, 10 s per timed scenario
    scripts/bench.py --scenarios durable,fanout8 --runs 1
    scripts/bench.py --warren-only        # no RabbitMQ (ratios left out)
    scripts/bench.py --baseline /tmp/before --runs 3   # this Warren against an earlier build
                                          # (DIR holds its warren and warren-perf), for a
                                          # refactor's before/after; prints, leaves docs alone

Needs: cargo, and for the comparison `apt-get install rabbitmq-server` (run as root).
"""

import argparse
import datetime
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARREN = ROOT / "target/release/warren"
PERF = ROOT / "target/release/warren-perf"
OUT_DIR = ROOT / "target/bench"
DOC = ROOT / "docs/benchmarks.md"
BEGIN = "<!-- bench-results:begin -->"
END = "<!-- bench-results:end -->"
WARREN_PORT = 5680
RABBIT_PORT = 5672

SCENARIOS = ["transient", "durable", "durable20k", "quorum", "parallel4", "fanout8", "paced5k",
             "backlog", "idle", "small16", "stream", "streamreplay"]
# Not one of warren-perf's named scenarios: the durable one paced at 20,000 msg/s, a rate both
# brokers sustain, to compare confirm latency at equal load (at full speed it is mostly
# window / throughput).
EXTRA = {"durable20k": ["--scenario", "durable", "--rate", "20000", "--queue", "durable20k"],
         "streamreplay": ["--scenario", "stream-replay"]}

# (scenario, label, how to read it from the JSON, better: "higher"/"lower", target)
# A target is ("ratio", x): Warren/RabbitMQ must be >= x (higher) or <= x (lower);
# or ("abs", x): Warren's own figure must be >= x (higher) or <= x (lower).
METRICS = [
    ("transient", "msg/s (consumed)", lambda j: j["consume_rate"], "higher", ("ratio", 3)),
    ("transient", "broker CPU µs/msg", lambda j: j["broker_cpu_us_per_msg"], "lower", ("ratio", 0.15)),
    ("durable", "msg/s (confirmed)", lambda j: j["confirm_rate"], "higher", ("ratio", 4)),
    ("durable", "confirm p99 ms", lambda j: j["confirm_latency_us"]["p99"] / 1000, "lower", ("ratio", 0.1)),
    ("durable", "broker CPU µs/msg", lambda j: j["broker_cpu_us_per_msg"], "lower", None),
    ("durable20k", "msg/s (confirmed)", lambda j: j["confirm_rate"], "higher", None),
    ("durable20k", "confirm p50 ms", lambda j: j["confirm_latency_us"]["p50"] / 1000, "lower", None),
    ("durable20k", "confirm p99 ms", lambda j: j["confirm_latency_us"]["p99"] / 1000, "lower", None),
    ("quorum", "msg/s (confirmed)", lambda j: j["confirm_rate"], "higher", ("ratio", 4)),
    ("quorum", "confirm p99 ms", lambda j: j["confirm_latency_us"]["p99"] / 1000, "lower", ("ratio", 0.1)),
    ("parallel4", "msg/s (consumed)", lambda j: j["consume_rate"], "higher", ("ratio", 3)),
    ("parallel4", "broker peak RSS MB", lambda j: j["broker_peak_rss_mb"], "lower", None),
    ("fanout8", "deliveries/s", lambda j: j["consume_rate"], "higher", ("ratio", 3)),
    ("fanout8", "published msg/s", lambda j: j["publish_rate"], "higher", None),
    ("paced5k", "end-to-end p99 ms", lambda j: j["e2e_latency_us"]["p99"] / 1000, "lower", ("abs", 10)),
    ("paced5k", "confirm p99 ms", lambda j: j["confirm_latency_us"]["p99"] / 1000, "lower", None),
    ("paced5k", "broker CPU µs/msg", lambda j: j["broker_cpu_us_per_msg"], "lower", None),
    ("backlog", "publish msg/s", lambda j: j["confirm_rate"], "higher", ("ratio", 3)),
    ("backlog", "drain msg/s", lambda j: j["drain_rate"], "higher", ("ratio", 3)),
    ("backlog", "broker peak RSS MB", lambda j: j["broker_peak_rss_mb"], "lower", ("abs", 300)),
    ("idle", "connections held", lambda j: j["idle_connections"], "higher", ("abs", 10000)),
    ("idle", "broker RSS KB/connection", lambda j: j["rss_per_connection_kb"], "lower", ("abs", 20)),
    ("small16", "msg/s (consumed)", lambda j: j["consume_rate"], "higher", None),
    ("small16", "broker CPU µs/msg", lambda j: j["broker_cpu_us_per_msg"], "lower", None),
    ("stream", "msg/s (confirmed)", lambda j: j["confirm_rate"], "higher", ("ratio", 3)),
    ("stream", "deliveries/s (3 consumers)", lambda j: j["consume_rate"], "higher", ("ratio", 3)),
    ("stream", "confirm p99 ms", lambda j: j["confirm_latency_us"]["p99"] / 1000, "lower", None),
    ("stream", "broker CPU µs/msg", lambda j: j["broker_cpu_us_per_msg"], "lower", None),
    ("streamreplay", "publish msg/s (1M)", lambda j: j["confirm_rate"], "higher", None),
    ("streamreplay", "replay msg/s (1M from first)", lambda j: j["drain_rate"], "higher", None),
    ("streamreplay", "broker peak RSS MB", lambda j: j["broker_peak_rss_mb"], "lower", None),
]


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def wait_port(port, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            time.sleep(0.2)
    return False


class Warren:
    name = "warren"
    uri = f"amqp://guest:guest@127.0.0.1:{WARREN_PORT}/%2F"

    def __init__(self, binary=WARREN, perf=PERF, name="warren"):
        self.binary, self.perf, self.name = binary, perf, name

    def start(self):
        self.dir = tempfile.mkdtemp(prefix="warren-bench-")
        self.proc = subprocess.Popen(
            [str(self.binary), "server", "--amqp-listen", f"127.0.0.1:{WARREN_PORT}",
             "--data-dir", self.dir, "--log-level", "warn",
             "--management-listen", "off", "--prometheus-listen", "off"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if "listening" not in line:
            raise RuntimeError(f"warren did not start: {line!r}")
        return self.proc.pid

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        subprocess.run(["rm", "-rf", self.dir], check=False)


class RabbitMQ:
    name = "rabbitmq"
    perf = PERF
    uri = f"amqp://guest:guest@127.0.0.1:{RABBIT_PORT}/%2F"

    def start(self):
        subprocess.run(["service", "rabbitmq-server", "start"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_port(RABBIT_PORT, 120):
            raise RuntimeError("rabbitmq did not open its port")
        pid = subprocess.run(["pgrep", "-f", "beam.smp"], capture_output=True, text=True).stdout.split()
        if not pid:
            raise RuntimeError("no beam.smp process")
        return int(pid[0])

    def stop(self):
        subprocess.run(["service", "rabbitmq-server", "stop"], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run(["pkill", "epmd"], check=False)
        for _ in range(100):
            if subprocess.run(["pgrep", "-f", "beam.smp"], capture_output=True).returncode != 0:
                break
            time.sleep(0.2)


def perf_args(scenario, duration):
    args = list(EXTRA.get(scenario, ["--scenario", scenario]))
    if scenario not in ("backlog", "idle", "streamreplay"):
        args += ["--duration", str(duration)]
    if scenario != "idle":
        # Streams cannot be purged (RabbitMQ refuses it); every run starts from a fresh one.
        args += ["--delete-after"] + ([] if scenario.startswith("stream") else ["--purge"])
    return args


def run_one(broker, scenario, duration, run):
    pid = broker.start()
    try:
        out = OUT_DIR / f"{scenario}-{broker.name}-{run}.json"
        cmd = [str(broker.perf), "--uri", broker.uri, "--broker-pid", str(pid), "--json", str(out)]
        cmd += perf_args(scenario, duration)
        log(f"{broker.name} {scenario} run {run}")
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=900)
        tail = [l for l in r.stdout.splitlines() if l.startswith("|") or "failed" in l]
        for l in tail:
            print("   ", l)
        if r.returncode != 0:
            log(f"warren-perf failed ({r.returncode}); result kept only if the JSON exists")
        return json.loads(out.read_text()) if out.exists() else None
    finally:
        broker.stop()


def fmt(v):
    if v is None:
        return "-"
    if v >= 1000:
        return f"{v / 1000:.1f}k" if v < 1e6 else f"{v / 1e6:.2f}M"
    if v >= 100:
        return f"{v:.0f}"
    return f"{v:.2f}" if v < 10 else f"{v:.1f}"


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def verdict(target, better, warren, rabbit):
    if target is None or warren is None:
        return "", ""
    kind, x = target
    if kind == "abs":
        ok = warren >= x if better == "higher" else warren <= x
        return (f"{'≥' if better == 'higher' else '≤'} {fmt(x)}", "yes" if ok else "**no**")
    if rabbit in (None, 0):
        return (f"{'≥' if better == 'higher' else '≤'} {x}x", "n/a")
    ratio = warren / rabbit
    ok = ratio >= x if better == "higher" else ratio <= x
    return (f"{'≥' if better == 'higher' else '≤'} {x}x", "yes" if ok else "**no**")


def machine():
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    rabbit = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "rabbitmq-server"],
                            capture_output=True, text=True).stdout.strip() or "not installed"
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    return (f"{os.cpu_count()} vCPU ({cpu}), {mem:.0f} GiB RAM, Linux {platform.release()}; "
            f"RabbitMQ {rabbit} (Debian package, default configuration); Warren {rev} "
            f"(release build)")


def metric_values(results, scenario, broker, get):
    """One metric of every run of `broker` in `scenario` (None where a run lacks it)."""
    out = []
    for j in results[scenario].get(broker, []):
        try:
            out.append(get(j))
        except (KeyError, TypeError):
            out.append(None)
    return out


def table(results, runs, duration):
    rows = ["| Scenario | Metric | RabbitMQ | Warren | Warren / RabbitMQ | Target | Met |",
            "|---|---|---|---|---|---|---|"]
    for scenario, label, get, better, target in METRICS:
        if scenario not in results:
            continue

        def values(name, scenario=scenario, get=get):
            return metric_values(results, scenario, name, get)

        w, r = median(values("warren")), median(values("rabbitmq"))
        ratio = f"{w / r:.2f}x" if w is not None and r not in (None, 0) else "-"
        goal, met = verdict(target, better, w, r)
        rows.append(f"| {scenario} | {label} | {fmt(r)} | {fmt(w)} | {ratio} | {goal} | {met} |")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = [
        f"Measured {when} by `scripts/bench.py --runs {runs} --duration {duration}`: medians of "
        f"{runs} runs per broker, one broker running at a time, alternating which goes first.",
        "",
        f"Machine: {machine()}.",
        "",
    ]
    return "\n".join(head + rows) + "\n"


def baseline_table(results, runs, duration, baseline):
    rows = ["| Scenario | Metric | Before | After | After / Before |", "|---|---|---|---|---|"]
    for scenario, label, get, _better, _target in METRICS:
        if scenario not in results:
            continue

        def values(name, scenario=scenario, get=get):
            return metric_values(results, scenario, name, get)

        after, before = median(values("warren")), median(values("baseline"))
        ratio = f"{after / before:.2f}x" if after is not None and before not in (None, 0) else "-"
        spread = {name: "/".join(fmt(v) for v in values(name)) for name in ("baseline", "warren")}
        rows.append(f"| {scenario} | {label} | {fmt(before)} ({spread['baseline']}) | "
                    f"{fmt(after)} ({spread['warren']}) | {ratio} |")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = [
        f"Measured {when} by `scripts/bench.py --baseline {baseline} --runs {runs} --duration "
        f"{duration}`: medians (and each run) of {runs} runs per build, one broker running at a "
        "time, alternating which goes first; each build drives itself with its own warren-perf.",
        "",
        f"Machine: {machine()}.",
        "",
    ]
    return "\n".join(head + rows) + "\n"


def write_doc(text):
    doc = DOC.read_text()
    block = f"{BEGIN}\n{text}{END}"
    if BEGIN in doc and END in doc:
        doc = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, doc, flags=re.S)
    else:
        doc += f"\n## Side by side (generated)\n\n{block}\n"
    DOC.write_text(doc)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--duration", type=int, default=10, help="seconds per timed scenario")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--warren-only", action="store_true")
    p.add_argument("--no-doc", action="store_true", help="print the table, leave docs alone")
    p.add_argument("--baseline", metavar="DIR",
                   help="compare with the warren and warren-perf binaries in DIR instead of RabbitMQ")
    p.add_argument("--merge", action="store_true",
                   help="keep the other scenarios' results from target/bench/results.json")
    a = p.parse_args()
    scenarios = [s for s in a.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        sys.exit(f"unknown scenarios: {', '.join(sorted(unknown))}")
    if a.baseline:
        a.warren_only, a.no_doc = True, True
    if not a.warren_only and subprocess.run(["which", "rabbitmq-server"], capture_output=True).returncode:
        sys.exit("rabbitmq-server is not installed: apt-get install rabbitmq-server "
                 "(or pass --warren-only)")
    subprocess.run(["cargo", "build", "--release", "--locked", "-p", "warren", "-p", "warren-perf"],
                   cwd=ROOT, check=True)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    brokers = [Warren()] + ([] if a.warren_only else [RabbitMQ()])
    if a.baseline:
        base = Path(a.baseline)
        brokers.append(Warren(base / "warren", base / "warren-perf", "baseline"))
    if not a.warren_only:
        RabbitMQ().stop()  # start from a stopped RabbitMQ
    results = {}
    previous = OUT_DIR / "results.json"
    if a.merge and previous.exists():
        results = {k: v for k, v in json.loads(previous.read_text()).items() if k not in scenarios}
    for scenario in scenarios:
        results[scenario] = {}
        for run in range(1, a.runs + 1):
            order = brokers if run % 2 == 1 else list(reversed(brokers))
            for b in order:
                j = run_one(b, scenario, a.duration, run)
                results[scenario].setdefault(b.name, []).append(j)
        (OUT_DIR / ("baseline-results.json" if a.baseline else "results.json")).write_text(
            json.dumps(results, indent=1))
    if a.baseline:
        print(baseline_table(results, a.runs, a.duration, a.baseline))
        return
    text = table(results, a.runs, a.duration)
    print(text)
    if not a.no_doc:
        write_doc(text)
        log(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
