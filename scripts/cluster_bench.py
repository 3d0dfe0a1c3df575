#!/usr/bin/env python3
"""Quorum queues on a 3-node Warren cluster against a 3-node RabbitMQ cluster, on this machine.

For each run, and alternating which broker goes first, the script starts one 3-node cluster on
loopback (never both at once), runs `warren-perf --scenario quorum` against node 1 with one
quorum queue and with ten (10 producers, one consumer per queue), then measures failover: two
publishers with confirms (one message in flight each) publish to a fresh quorum queue, one
connected to the queue's leader and one to a follower; the leader node is killed with SIGKILL
and the script times, per publisher, the seconds from the kill to the first confirm of a
message published after it (the leader's publisher reconnects to a surviving node). Then the
cluster is torn down.

    scripts/cluster_bench.py                          # 2 runs, 15 s per throughput scenario
    scripts/cluster_bench.py --duration 5 --runs 1    # quick check
    scripts/cluster_bench.py --brokers warren --no-failover
    scripts/cluster_bench.py --doc                    # also write the section into docs/benchmarks.md

RabbitMQ: Debian's `rabbitmq-server` (installed with apt-get if missing), three nodes
r1..r3@localhost on AMQP ports 5681-5683 and distribution ports 25681-25683, default
configuration apart from ports, directories and no plugins; r2 and r3 join r1 with
`rabbitmqctl join_cluster`. Warren: target/release/warren, nodes n1..n3 on AMQP 5701-5703,
cluster 26001-26003, management 15801-15803, Prometheus 15901-15903. Raw JSON of every
warren-perf run goes to target/cluster-bench/. `WARREN_BENCH_ARGS="--quorum-log redb"` adds flags to every Warren node's command line;
`WARREN_BENCH_BIN=<path>` runs another build of
warren (an older tree's, for a same-hour comparison).

Python 3 standard library only; the failover publishers use the small AMQP 0-9-1 client below.
"""

import argparse
import base64
import datetime
import json
import os
import platform
import random
import resource
import re
import shutil
import signal
import socket
import statistics
import string
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# WARREN_BENCH_BIN: another build of the binary (an older tree, for a same-hour comparison).
WARREN = Path(os.environ.get("WARREN_BENCH_BIN", ROOT / "target/release/warren"))
PERF = ROOT / "target/release/warren-perf"
OUT_DIR = ROOT / "target/cluster-bench"
DOC = ROOT / "docs/benchmarks.md"
SECTION = "## Quorum queues on a 3-node cluster (issue 8)"

RABBIT_SBIN = Path("/usr/lib/rabbitmq/bin")  # the real scripts (/usr/sbin wraps them in `su`)
RABBIT_SERVER = RABBIT_SBIN / "rabbitmq-server"
RABBITMQCTL = RABBIT_SBIN / "rabbitmqctl"

USER, PASSWORD = "guest", "guest"
QUORUM_ARGS = {"x-queue-type": "quorum"}


def log(msg):
    print(f"[cluster-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def wait_port(port, deadline, proc=None, what=""):
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before opening port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what}: port {port} not open in time")


def kill_group(proc, sig=signal.SIGKILL):
    """Signal the process group of `proc` (started with start_new_session=True) and reap it."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


# ---------------------------------------------------------------------------------------------
# A minimal AMQP 0-9-1 client: enough for declare, delete, confirm.select and publish.
# ---------------------------------------------------------------------------------------------

class AmqpError(Exception):
    pass


def _shortstr(s):
    b = s.encode()
    return struct.pack("B", len(b)) + b


def _longstr(b):
    if isinstance(b, str):
        b = b.encode()
    return struct.pack(">I", len(b)) + b


def _table(d):
    out = b""
    for k, v in (d or {}).items():
        out += _shortstr(k)
        if isinstance(v, bool):
            out += b"t" + struct.pack("B", int(v))
        elif isinstance(v, int):
            out += b"l" + struct.pack(">q", v)
        elif isinstance(v, dict):
            out += b"F" + _table(v)
        else:
            out += b"S" + _longstr(str(v))
    return struct.pack(">I", len(out)) + out


def _read_shortstr(buf, i):
    n = buf[i]
    return buf[i + 1:i + 1 + n].decode(errors="replace"), i + 1 + n


class Amqp:
    """One connection with one channel (1). Every wait is bounded by `timeout` seconds."""

    def __init__(self, port, timeout=5.0, name="cluster-bench"):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout = timeout
        self.buf = b""
        self.frame_max = 131072
        self.next_tag = 1
        try:
            self._handshake(name)
        except BaseException:
            self.sock.close()
            raise

    # -- frames --------------------------------------------------------------------------

    def _send(self, ftype, channel, payload):
        self.sock.sendall(struct.pack(">BHI", ftype, channel, len(payload)) + payload + b"\xce")

    def _method(self, channel, cls, mid, args=b""):
        self._send(1, channel, struct.pack(">HH", cls, mid) + args)

    def _recv_exact(self, n, deadline):
        while len(self.buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("amqp read timed out")
            self.sock.settimeout(left)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("connection closed by the broker")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _frame(self, deadline):
        ftype, channel, size = struct.unpack(">BHI", self._recv_exact(7, deadline))
        payload = self._recv_exact(size + 1, deadline)[:-1]
        return ftype, channel, payload

    def _next_method(self, deadline):
        """The next method frame as (class, method, args); handles heartbeats, closes and
        skips content frames (of basic.return)."""
        while True:
            ftype, channel, payload = self._frame(deadline)
            if ftype == 8:
                self._send(8, 0, b"")
                continue
            if ftype != 1:
                continue
            cls, mid = struct.unpack(">HH", payload[:4])
            args = payload[4:]
            if (cls, mid) == (10, 50):
                code = struct.unpack(">H", args[:2])[0]
                text, _ = _read_shortstr(args, 2)
                try:
                    self._method(0, 10, 51)
                except OSError:
                    pass
                raise AmqpError(f"connection.close {code} {text}")
            if (cls, mid) == (20, 40):
                code = struct.unpack(">H", args[:2])[0]
                text, _ = _read_shortstr(args, 2)
                try:
                    self._method(channel, 20, 41)
                except OSError:
                    pass
                raise AmqpError(f"channel.close {code} {text}")
            return cls, mid, args

    def _expect(self, cls, mid, deadline=None):
        deadline = deadline or time.monotonic() + self.timeout
        while True:
            c, m, args = self._next_method(deadline)
            if (c, m) == (cls, mid):
                return args

    # -- protocol ------------------------------------------------------------------------

    def _handshake(self, name):
        deadline = time.monotonic() + self.timeout
        self.sock.sendall(b"AMQP\x00\x00\x09\x01")
        self._expect(10, 10, deadline)  # start
        props = _table({"product": "cluster-bench", "connection_name": name,
                        "capabilities": {"publisher_confirms": True}})
        self._method(0, 10, 11, props + _shortstr("PLAIN")
                     + _longstr(f"\0{USER}\0{PASSWORD}") + _shortstr("en_US"))
        args = self._expect(10, 30, deadline)  # tune
        channel_max, frame_max, _heartbeat = struct.unpack(">HIH", args[:8])
        self.frame_max = frame_max or 131072
        # heartbeat 0: this client never idles long enough to need them
        self._method(0, 10, 31, struct.pack(">HIH", channel_max or 2047, self.frame_max, 0))
        self._method(0, 10, 40, _shortstr("/") + _shortstr("") + b"\x00")
        self._expect(10, 41, deadline)
        self._method(1, 20, 10, _shortstr(""))
        self._expect(20, 11, deadline)

    def declare(self, queue, arguments=None, durable=True):
        self._method(1, 50, 10, struct.pack(">H", 0) + _shortstr(queue)
                     + struct.pack("B", 0b10 if durable else 0) + _table(arguments))
        self._expect(50, 11)

    def delete(self, queue):
        self._method(1, 50, 40, struct.pack(">H", 0) + _shortstr(queue) + b"\x00")
        self._expect(50, 41)

    def confirm_select(self):
        self._method(1, 85, 10, b"\x00")
        self._expect(85, 11)

    def publish(self, routing_key, body, exchange="", mandatory=True, persistent=True):
        """Publish one message; returns its delivery tag (confirm mode)."""
        m = struct.pack(">HH", 60, 40) + struct.pack(">H", 0) + _shortstr(exchange) \
            + _shortstr(routing_key) + struct.pack("B", 1 if mandatory else 0)
        flags = 0x1000 if persistent else 0  # delivery-mode
        props = struct.pack("B", 2) if persistent else b""
        header = struct.pack(">HHQH", 60, 0, len(body), flags) + props
        out = struct.pack(">BHI", 1, 1, len(m)) + m + b"\xce"
        out += struct.pack(">BHI", 2, 1, len(header)) + header + b"\xce"
        step = self.frame_max - 8
        for i in range(0, len(body), step):
            part = body[i:i + step]
            out += struct.pack(">BHI", 3, 1, len(part)) + part + b"\xce"
        self.sock.sendall(out)
        tag = self.next_tag
        self.next_tag += 1
        return tag

    def wait_confirm(self, tag, timeout):
        """'ack', 'nack' or 'returned' for `tag` (a basic.return comes before its ack)."""
        deadline = time.monotonic() + timeout
        returned = False
        while True:
            c, m, args = self._next_method(deadline)
            if (c, m) == (60, 50):
                returned = True
            elif (c, m) in ((60, 80), (60, 120)):
                t = struct.unpack(">Q", args[:8])[0]
                multiple = args[8] & 1
                if t == tag or (multiple and t >= tag):
                    if (c, m) == (60, 120):
                        return "nack"
                    return "returned" if returned else "ack"

    def close(self):
        try:
            self._method(0, 10, 50, struct.pack(">H", 200) + _shortstr("bye")
                         + struct.pack(">HH", 0, 0))
            self._expect(10, 51, time.monotonic() + 2)
        except Exception:
            pass
        finally:
            self.sock.close()


def until_declared(port, queue, timeout, arguments=QUORUM_ARGS):
    """Declare `queue` through node `port`, retrying until it succeeds (the cluster is ready)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            c = Amqp(port, timeout=10)
            try:
                c.declare(queue, arguments)
                return
            finally:
                c.close()
        except (OSError, AmqpError) as e:
            last = e
            time.sleep(0.25)
    raise RuntimeError(f"could not declare {queue} through port {port}: {last}")


def delete_queues(port, queues):
    try:
        c = Amqp(port, timeout=15)
    except (OSError, AmqpError) as e:
        log(f"  delete: cannot connect to {port}: {e}")
        return
    try:
        for q in queues:
            try:
                c.delete(q)
            except (OSError, AmqpError) as e:
                log(f"  delete {q}: {e}")
                return
    finally:
        c.close()


# ---------------------------------------------------------------------------------------------
# Clusters
# ---------------------------------------------------------------------------------------------

class WarrenCluster:
    name = "warren"
    label = "Warren"

    def __init__(self, root):
        self.root = Path(root) / "warren"
        self.nodes = [f"n{i}" for i in (1, 2, 3)]
        self.amqp = {f"n{i}": 5700 + i for i in (1, 2, 3)}
        self.mgmt = {f"n{i}": 15800 + i for i in (1, 2, 3)}
        self.procs = {}
        # Appended to every node's command line; WARREN_BENCH_ARGS adds to it (for example
        # "--quorum-log redb" to measure the redb log rather than the write-ahead log).
        self.extra_args = os.environ.get("WARREN_BENCH_ARGS", "").split()

    def start_node(self, n):
        """Start node `n` (again: its data directory is kept)."""
        i = int(n[1:])
        peers = ",".join(f"n{k}@127.0.0.1:{26000 + k}" for k in (1, 2, 3))
        (self.root / n).mkdir(exist_ok=True)
        cmd = [str(WARREN), "server", "--node-name", n,
               "--cluster-listen", f"127.0.0.1:{26000 + i}", "--peers", peers,
               "--cluster-secret", "bench", "--amqp-listen", f"127.0.0.1:{5700 + i}",
               "--management-listen", f"127.0.0.1:{15800 + i}",
               "--prometheus-listen", f"127.0.0.1:{15900 + i}",
               "--data-dir", str(self.root / n / "data"), "--log-level", "warn"] + self.extra_args
        logf = open(self.root / n / "warren.log", "ab")
        self.procs[n] = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        logf.close()

    def start(self):
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        for n in self.nodes:
            self.start_node(n)
        deadline = time.monotonic() + 60
        for n in self.nodes:
            wait_port(self.amqp[n], deadline, self.procs[n], f"warren {n}")
            wait_port(self.mgmt[n], deadline, self.procs[n], f"warren {n} management")
        # Ready when a quorum queue can be declared (the metadata group has a leader).
        until_declared(self.amqp["n1"], "cluster-bench-ready", 60)
        delete_queues(self.amqp["n1"], ["cluster-bench-ready"])

    def pids(self):
        return {n: p.pid for n, p in self.procs.items() if p.poll() is None}

    def kill(self, node):
        kill_group(self.procs.pop(node))

    def stop(self):
        for n in list(self.procs):
            kill_group(self.procs.pop(n))

    def _mgmt_get(self, node, path):
        req = urllib.request.Request(f"http://127.0.0.1:{self.mgmt[node]}{path}")
        req.add_header("Authorization",
                       "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode())
        with urllib.request.urlopen(req, timeout=3) as r:
            return json.loads(r.read())

    def leaders(self, queues, exclude=()):
        """{queue: leader node name or None} as a running node reports it."""
        out = {}
        for q in queues:
            out[q] = None
            for n in self.nodes:
                if n in exclude or n not in self.procs:
                    continue
                try:
                    info = self._mgmt_get(n, f"/api/queues/%2F/{urllib.parse.quote(q, safe='')}")
                except (OSError, ValueError, urllib.error.HTTPError):
                    continue
                leader = info.get("leader") or info.get("node")
                if leader:
                    out[q] = str(leader).split("@")[0]
                    break
        return out

    def version(self):
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        built = datetime.datetime.fromtimestamp(WARREN.stat().st_mtime, datetime.timezone.utc)
        return (f"Warren release build of {built:%Y-%m-%d %H:%M} UTC (tree at {rev}"
                f"{', with uncommitted changes' if dirty else ''})")


class RabbitCluster:
    name = "rabbitmq"
    label = "RabbitMQ"

    def __init__(self, root):
        self.root = Path(root) / "rabbitmq"
        self.nodes = [f"r{i}" for i in (1, 2, 3)]
        self.amqp = {f"r{i}": 5680 + i for i in (1, 2, 3)}
        self.procs = {}
        self.home = self.root / "home"
        self.epmd_before = bool(subprocess.run(["pgrep", "-x", "epmd"],
                                               capture_output=True).stdout.strip())

    def full(self, n):
        return f"{n}@localhost"

    def env(self, n=None):
        e = {k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")}
        e["HOME"] = str(self.home)
        e["LANG"] = e["LC_ALL"] = "C.UTF-8"
        e["ERL_EPMD_ADDRESS"] = "127.0.0.1"
        e["RABBITMQ_CONF_ENV_FILE"] = str(self.root / "rabbitmq-env.conf")
        if n is not None:
            i = int(n[1:])
            d = self.root / n
            e.update({
                "RABBITMQ_NODENAME": self.full(n),
                "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
                "RABBITMQ_NODE_PORT": str(5680 + i),
                "RABBITMQ_DIST_PORT": str(25680 + i),
                "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
                "RABBITMQ_LOG_BASE": str(d / "log"),
                "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
                "RABBITMQ_PLUGINS_EXPAND_DIR": str(d / "plugins-expand"),
                "RABBITMQ_PID_FILE": str(d / "rabbitmq.pid"),
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            })
        return e

    def ctl(self, *args, timeout=120, check=True, tool=RABBITMQCTL):
        r = subprocess.run([str(tool), *args], env=self.env(), capture_output=True, text=True,
                           timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{tool.name} {' '.join(args)} failed ({r.returncode}): "
                               f"{(r.stdout + r.stderr).strip()[-800:]}")
        return r

    @staticmethod
    def ensure_installed():
        if Path("/usr/sbin/rabbitmq-server").exists() and RABBIT_SERVER.exists():
            return
        log("installing rabbitmq-server (apt-get)")
        subprocess.run(["apt-get", "update"], check=True)
        subprocess.run(["apt-get", "install", "-y", "rabbitmq-server"], check=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        # apt may have started the packaged node (rabbit@<host>): stop it.
        subprocess.run(["service", "rabbitmq-server", "stop"], capture_output=True)

    def start(self):
        shutil.rmtree(self.root, ignore_errors=True)
        self.home.mkdir(parents=True)
        cookie = self.home / ".erlang.cookie"
        cookie.write_text("".join(random.choice(string.ascii_uppercase) for _ in range(20)))
        cookie.chmod(0o400)
        (self.root / "rabbitmq-env.conf").write_text("")
        for n in self.nodes:
            d = self.root / n
            (d / "log").mkdir(parents=True)
            (d / "mnesia").mkdir()
            (d / "rabbitmq.conf").write_text(
                f"listeners.tcp.default = 127.0.0.1:{self.amqp[n]}\n"
                "loopback_users.guest = true\n")
            (d / "enabled_plugins").write_text("[].\n")
        for n in self.nodes:
            out = open(self.root / n / "server.out", "wb")
            self.procs[n] = subprocess.Popen([str(RABBIT_SERVER)], env=self.env(n),
                                             cwd=str(self.root / n), stdout=out,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True)
            out.close()
        for n in self.nodes:
            self.await_node(n)
        for n in self.nodes[1:]:
            self.ctl("-n", self.full(n), "stop_app")
            self.ctl("-n", self.full(n), "join_cluster", self.full("r1"))
            self.ctl("-n", self.full(n), "start_app")
            self.ctl("-n", self.full(n), "await_startup", "--timeout", "120")
        status = json.loads(self.ctl("-n", self.full("r1"), "cluster_status",
                                     "--formatter", "json").stdout)
        running = sorted(status.get("running_nodes", []))
        if running != sorted(self.full(n) for n in self.nodes):
            raise RuntimeError(f"RabbitMQ cluster did not form: running_nodes={running}")
        log(f"  rabbitmq cluster running: {', '.join(running)}")
        until_declared(self.amqp["r1"], "cluster-bench-ready", 60)
        delete_queues(self.amqp["r1"], ["cluster-bench-ready"])

    def await_node(self, n):
        """Wait for node n: `rabbitmqctl wait <pidfile>` (polls the pid file, then the boot),
        then its AMQP port."""
        deadline = time.monotonic() + 120
        pidfile = self.root / n / "rabbitmq.pid"
        while True:
            if self.procs[n].poll() is not None:
                raise RuntimeError(f"rabbitmq {n} exited ({self.procs[n].returncode}); see "
                                   f"{self.root / n / 'server.out'} and {self.root / n / 'log'}")
            r = self.ctl("-n", self.full(n), "wait", str(pidfile), "--timeout", "60",
                         check=False)
            if r.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"rabbitmq {n} did not start: {(r.stdout + r.stderr)[-800:]}")
            time.sleep(0.5)
        wait_port(self.amqp[n], deadline, self.procs[n], f"rabbitmq {n}")

    def pids(self):
        return {n: p.pid for n, p in self.procs.items() if p.poll() is None}

    def kill(self, node):
        kill_group(self.procs.pop(node))

    def stop(self):
        for n in list(self.procs):
            kill_group(self.procs.pop(n))
        if not self.epmd_before:
            # epmd refuses -kill while it still lists the nodes just killed: retry a little.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and subprocess.run(
                    ["pgrep", "-x", "epmd"], capture_output=True).returncode == 0:
                subprocess.run(["epmd", "-kill"], capture_output=True, env=self.env())
                time.sleep(0.3)

    def leaders(self, queues, exclude=()):
        out = {q: None for q in queues}
        for n in self.nodes:
            if n in exclude or n not in self.procs:
                continue
            r = self.ctl("-n", self.full(n), "list_queues", "name", "leader", "--quiet",
                         "--no-table-headers", check=False, timeout=60)
            if r.returncode != 0:
                continue
            for line in r.stdout.splitlines():
                parts = line.split()
                if len(parts) >= 2 and parts[0] in out and "@" in parts[1]:
                    out[parts[0]] = parts[1].split("@")[0]
            return out
        return out

    def version(self):
        v = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "rabbitmq-server"],
                           capture_output=True, text=True).stdout.strip()
        erl = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "erlang-base"],
                             capture_output=True, text=True).stdout.strip()
        return f"RabbitMQ {v} (Debian package; Erlang {erl})"


# ---------------------------------------------------------------------------------------------
# Throughput
# ---------------------------------------------------------------------------------------------

SCENARIOS = [
    # (key, label, queue prefix, extra warren-perf flags, queue names)
    ("q1", "1 quorum queue, 1 → 1", "cb1", [], lambda p: [f"{p}-0"]),
    ("q10", "10 quorum queues, 10 producers, 1 consumer each", "cb10",
     ["--queues", "10", "--producers", "10", "--consumers", "1"],
     lambda p: [f"{p}-{i}" for i in range(10)]),
    # A stream: the same publisher (confirms, window 1000) and three consumers reading it
    # independently from `first` (every consumer gets every message).
    ("s1", "1 stream, 1 → 3 consumers from first", "cbs",
     ["--queue-arg", "x-queue-type=stream", "--consumers", "3",
      "--consumer-arg", "x-stream-offset=first"],
     lambda p: [f"{p}-0"]),
]


CLK = os.sysconf("SC_CLK_TCK")


def machine_jiffies():
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(f) - f[3] - f[4], sum(f)


def group_cpu_s(pgids):
    """CPU seconds (user + system, with reaped children) of every process in these groups."""
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = open(f"/proc/{d}/stat").read()
        except OSError:
            continue
        f = raw[raw.rindex(")") + 2:].split()
        if int(f[2]) in pgids:  # field 5, pgrp
            total += sum(int(x) for x in f[11:15])  # utime stime cutime cstime
    return total / CLK


def run_perf(cluster, key, prefix, extra, queues_of, duration, run, inspect=None):
    """Run warren-perf against n1 and measure the cluster's CPU. `inspect(cluster, queues)`,
    when given, runs after the load and before the queues are deleted; its result is kept in
    the JSON as `_inspect`."""
    port = cluster.amqp[cluster.nodes[0]]
    out = OUT_DIR / f"{key}-{cluster.name}-{run}.json"
    out.unlink(missing_ok=True)
    cmd = [str(PERF), "--scenario", "quorum", "--uri", f"amqp://guest:guest@127.0.0.1:{port}/%2F",
           "--duration", str(duration), "--queue", prefix, "--json", str(out)] + extra
    log(f"{cluster.name} {key} run {run}: {' '.join(cmd[1:])}")
    pgids = set(cluster.pids().values())
    busy0, total0 = machine_jiffies()
    nodes0 = group_cpu_s(pgids)
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=duration + 300)
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    nodes_s = group_cpu_s(pgids) - nodes0
    busy1, total1 = machine_jiffies()
    perf_s = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
    busy_s = (busy1 - busy0) / CLK
    wall_cpu_s = (total1 - total0) / CLK  # elapsed time × cores
    cpu = {"cluster_cpu_s": nodes_s, "perf_cpu_s": perf_s,
           "other_cpu_share": max(0.0, busy_s - nodes_s - perf_s) / max(wall_cpu_s, 1e-9)}
    for line in r.stdout.splitlines():
        if line.startswith("|") or "fail" in line.lower() or "error" in line.lower():
            print("   ", line)
    if r.returncode != 0:
        log(f"  warren-perf exited {r.returncode}:\n{r.stdout[-2000:]}")
    queues = queues_of(prefix)
    leaders = cluster.leaders(queues)
    inspected = inspect(cluster, queues) if inspect else None
    delete_queues(port, queues)
    if not out.exists():
        return None
    j = json.loads(out.read_text())
    j["_leaders"] = leaders
    j["_cpu"] = cpu
    j["_inspect"] = inspected
    n = j.get("confirmed") or 0
    j["_cluster_cpu_us_per_msg"] = nodes_s / n * 1e6 if n else None
    out.write_text(json.dumps(j, indent=1))
    return j


# ---------------------------------------------------------------------------------------------
# Failover
# ---------------------------------------------------------------------------------------------

class Publisher(threading.Thread):
    """Publishes 1 KB persistent mandatory messages with confirms, one in flight, to `queue`.
    On any error it reconnects, trying `ports()` round-robin. Records the monotonic time of
    every confirm and the errors it saw."""

    def __init__(self, name, first_port, ports, queue, stop, reopen_after_nacks):
        super().__init__(daemon=True, name=name)
        self.reopen_after_nacks = reopen_after_nacks
        self.reopens = 0
        self.first_port, self.ports, self.queue, self.stop_ev = first_port, ports, queue, stop
        self.acks = []          # (published at, confirmed at)
        self.events = []        # (time, text)
        self.nacks = self.returns = 0
        self.body = os.urandom(1024)

    def run(self):
        port = self.first_port
        rr = 0
        while not self.stop_ev.is_set():
            conn = None
            try:
                conn = Amqp(port, timeout=3, name=self.name)
                conn.confirm_select()
                self.events.append((time.monotonic(), f"connected to {port}"))
                nacked_since = None
                while not self.stop_ev.is_set():
                    t0 = time.monotonic()
                    tag = conn.publish(self.queue, self.body)
                    res = conn.wait_confirm(tag, timeout=30)
                    t1 = time.monotonic()
                    if res == "ack":
                        self.acks.append((t0, t1))
                        nacked_since = None
                    elif res == "nack":
                        self.nacks += 1
                        nacked_since = nacked_since or t0
                        if t1 - nacked_since >= self.reopen_after_nacks:
                            # RabbitMQ 3.10 nacks every publish of a channel that was opened
                            # while the queue had no leader, even after one is elected.
                            self.reopens += 1
                            raise AmqpError(f"only nacks for {t1 - nacked_since:.2f} s: reopen")
                        time.sleep(0.01)  # back off a little, as a client would
                    else:
                        self.returns += 1
                        time.sleep(0.05)
            except (OSError, AmqpError, struct.error, IndexError) as e:
                self.events.append((time.monotonic(), f"{port}: {type(e).__name__}: {e}"))
                time.sleep(0.05)
            finally:
                if conn is not None:
                    try:
                        conn.sock.close()
                    except OSError:
                        pass
            ports = self.ports()
            port = ports[rr % len(ports)]
            rr += 1

    def recovered_after(self, t_kill):
        for t0, t1 in self.acks:
            if t0 >= t_kill:
                return t1 - t_kill
        return None

    def last_before(self, t_kill):
        before = [t1 for _, t1 in self.acks if t1 < t_kill]
        return t_kill - before[-1] if before else None


def failover(cluster, run, timeout, reopen):
    queue = f"cb-failover-{run}"
    port1 = cluster.amqp[cluster.nodes[0]]
    until_declared(port1, queue, 30)
    deadline = time.monotonic() + 30
    leader = None
    while time.monotonic() < deadline:
        leader = cluster.leaders([queue])[queue]
        if leader in cluster.nodes:
            break
        time.sleep(0.2)
    if leader not in cluster.nodes:
        raise RuntimeError(f"{cluster.name}: no leader reported for {queue}")
    follower = next(n for n in cluster.nodes if n != leader)
    killed = set()

    def survivors():
        return [cluster.amqp[n] for n in cluster.nodes if n not in killed]

    stop = threading.Event()
    pubs = [Publisher("on-leader", cluster.amqp[leader], survivors, queue, stop, reopen),
            Publisher("on-follower", cluster.amqp[follower], survivors, queue, stop, reopen)]
    for p in pubs:
        p.start()
    try:
        warm = time.monotonic() + 30
        while time.monotonic() < warm and not all(len(p.acks) >= 200 for p in pubs):
            time.sleep(0.05)
        if not all(p.acks for p in pubs):
            raise RuntimeError(f"{cluster.name}: publishers got no confirms before the kill: "
                               f"{[p.events[-3:] for p in pubs]}")
        rates = [len(p.acks) for p in pubs]
        time.sleep(1.0)
        rates = [(len(p.acks) - r) for p, r in zip(pubs, rates)]
        log(f"{cluster.name} failover run {run}: leader of {queue} is {leader}; publisher on "
            f"{leader} {rates[0]} and on {follower} {rates[1]} confirms/s; kill -9 {leader}")
        killed.add(leader)
        t_kill = time.monotonic()
        cluster.kill(leader)
        end = t_kill + timeout
        while time.monotonic() < end and not all(p.recovered_after(t_kill) is not None
                                                 for p in pubs):
            time.sleep(0.01)
        time.sleep(0.5)
    finally:
        stop.set()
        for p in pubs:
            p.join(timeout=35)
    new_leader = cluster.leaders([queue], exclude=killed)[queue]
    res = {"leader": leader, "follower": follower, "new_leader": new_leader}
    for p in pubs:
        rec = p.recovered_after(t_kill)
        res[p.name] = rec
        errs = [f"+{t - t_kill:.2f}s {text}" for t, text in p.events if t >= t_kill - 0.5][:6]
        gap = p.last_before(t_kill)
        log(f"  {p.name}: first confirm after the kill at "
            f"{'+%.2f s' % rec if rec is not None else 'NONE within %ds' % timeout}; "
            f"last confirm before it {gap * 1000:.0f} ms before; nacks {p.nacks}, "
            f"returns {p.returns}, reopened after nacks {p.reopens}; "
            f"{'; '.join(errs) or 'no errors'}")
    log(f"  new leader: {new_leader}")
    return res


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt_rate(v):
    if v is None:
        return "-"
    return f"{v / 1000:.1f}k" if v >= 1000 else f"{v:.0f}"


def fmt_ms(v):
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else (f"{v:.1f}" if v >= 10 else f"{v:.2f}")


def fmt_s(vals):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "none"
    m = statistics.median(vals)
    if len(vals) == 1:
        return f"{m:.2f}"
    return f"{m:.2f} ({min(vals):.2f}–{max(vals):.2f})"


def leader_spread(jsons):
    counts = {}
    for j in jsons:
        if not j:
            continue
        for _, n in j.get("_leaders", {}).items():
            counts[n] = counts.get(n, 0) + 1
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=lambda kv: str(kv[0])))


def report(results, fail, args, versions, background):
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Measured {when} by `scripts/cluster_bench.py --runs {args.runs} --duration "
        f"{args.duration}`: medians of {args.runs} runs per broker, one 3-node cluster running "
        f"at a time (all three nodes on this machine's {os.cpu_count()} cores, loopback), "
        f"alternating which broker goes first; each run starts a fresh cluster. "
        f"`warren-perf --scenario quorum` (1 KB persistent messages, confirm window 1000 per "
        f"producer, prefetch 1000, multi-ack 100) connects to node 1.",
        "",
        f"Versions: {'; '.join(versions)}. Machine: {os.cpu_count()} vCPU, Linux "
        f"{platform.release()}.{background}",
        "",
        "| Scenario | Warren msg/s | RabbitMQ msg/s | Warren / RabbitMQ | Warren confirm p50 / p99 ms "
        "| RabbitMQ confirm p50 / p99 ms | CPU µs/msg, 3 nodes (Warren; RabbitMQ) "
        "| Queue leaders (Warren; RabbitMQ) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    others = []
    for key, label, *_ in SCENARIOS:
        if key not in results:
            continue
        cell = {}
        for b in ("warren", "rabbitmq"):
            js = [j for j in results[key].get(b, []) if j]
            rate = median([j.get("confirm_rate") for j in js])
            p50 = median([j.get("confirm_latency_us", {}).get("p50") for j in js])
            p99 = median([j.get("confirm_latency_us", {}).get("p99") for j in js])
            cpu = median([j.get("_cluster_cpu_us_per_msg") for j in js])
            others.extend(j["_cpu"]["other_cpu_share"] for j in js if "_cpu" in j)
            cell[b] = (rate, None if p50 is None else p50 / 1000,
                       None if p99 is None else p99 / 1000, leader_spread(js), cpu)
        w, r = cell["warren"], cell["rabbitmq"]
        ratio = f"{w[0] / r[0]:.2f}x" if w[0] and r[0] else "-"
        lines.append(f"| {label} | {fmt_rate(w[0])} | {fmt_rate(r[0])} | {ratio} | "
                     f"{fmt_ms(w[1])} / {fmt_ms(w[2])} | {fmt_ms(r[1])} / {fmt_ms(r[2])} | "
                     f"{fmt_ms(w[4])}; {fmt_ms(r[4])} | {w[3] or '-'}; {r[3] or '-'} |")
    if others:
        lines += ["", f"CPU µs/msg: user + system time of the three nodes' processes during the "
                      f"run over the confirmed messages. Processes not started by the benchmark "
                      f"used {statistics.median(others) * 100:.0f}% of the machine's CPU "
                      f"during the runs (median; at most {max(others) * 100:.0f}%)."]
    if fail:
        lines += [
            "",
            "Failover: two publishers with confirms (1 KB persistent, one message in flight "
            "each) publish to one quorum queue, one connected to the queue's leader and one to "
            "a follower; the leader node's processes get SIGKILL. Seconds from the kill to the "
            "first confirm of a message published after it (median, and the range over runs). "
            "The leader's publisher reconnects to a surviving node (50 ms after the error). "
            "A nacked message is republished after 10 ms; after "
            f"{args.reopen_after_nacks:g} s of nacks without a confirm a publisher reopens its "
            "connection on the next surviving node (RabbitMQ 3.10 nacks every publish of a "
            "channel opened while the queue had no leader, also after a leader is elected).",
            "",
            "| Failover, seconds | Warren | RabbitMQ | Warren / RabbitMQ |",
            "|---|---|---|---|",
        ]
        for key, label in (("on-leader", "publisher on the killed leader (reconnects)"),
                           ("on-follower", "publisher on a surviving node (stays connected)")):
            w = [f.get(key) for f in fail.get("warren", [])]
            r = [f.get(key) for f in fail.get("rabbitmq", [])]
            mw, mr = median(w), median(r)
            ratio = f"{mw / mr:.2f}x" if mw and mr else "-"
            lines.append(f"| {label} | {fmt_s(w) if w else '-'} | {fmt_s(r) if r else '-'} | "
                         f"{ratio} |")
    return "\n".join(lines) + "\n"


def write_doc(text):
    doc = DOC.read_text()
    block = f"{SECTION}\n\n{text}"
    i = doc.find(SECTION + "\n")
    if i >= 0:
        j = doc.find("\n## ", i + len(SECTION))
        rest = doc[j + 1:] if j >= 0 else ""
        doc = doc[:i] + block + ("\n" + rest if rest else "")
    else:
        doc = doc.rstrip("\n") + "\n\n" + block
    DOC.write_text(doc)


def background_cpu(seconds=2.0):
    """Share of the machine's CPU busy before anything of ours runs (another workload)."""
    def busy():
        f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        idle = f[3] + f[4]
        return sum(f) - idle, sum(f)
    b0, t0 = busy()
    time.sleep(seconds)
    b1, t1 = busy()
    return (b1 - b0) / max(1, t1 - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--duration", type=int, default=15, help="seconds per throughput scenario")
    p.add_argument("--brokers", default="warren,rabbitmq")
    p.add_argument("--scenarios", default=",".join(s[0] for s in SCENARIOS))
    p.add_argument("--no-failover", action="store_true")
    p.add_argument("--failover-timeout", type=int, default=90)
    p.add_argument("--reopen-after-nacks", type=float, default=0.25, metavar="S",
                   help="failover publishers reopen their connection after S seconds of nacks "
                        "without an ack (default 0.25)")
    p.add_argument("--keep", action="store_true", help="keep the clusters' directories")
    p.add_argument("--doc", action="store_true",
                   help=f"write the tables into docs/benchmarks.md under '{SECTION}'")
    a = p.parse_args()
    brokers = [b for b in a.brokers.split(",") if b]
    if set(brokers) - {"warren", "rabbitmq"}:
        sys.exit("--brokers takes warren and/or rabbitmq")
    scenarios = [s for s in SCENARIOS if s[0] in a.scenarios.split(",")]

    if not (WARREN.exists() and PERF.exists()):
        log("building target/release/warren and warren-perf")
        subprocess.run(["cargo", "build", "--release", "-p", "warren", "-p", "warren-perf"],
                       cwd=ROOT, check=True)
    if "rabbitmq" in brokers:
        RabbitCluster.ensure_installed()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="cluster-bench-"))
    bg = background_cpu()
    background = ""
    if bg > 0.05:
        background = (f" Other processes were using {bg * 100:.0f}% of the machine's CPU "
                      f"before the benchmark started.")
        log(f"warning: the machine is {bg * 100:.0f}% busy before starting")

    makers = {"warren": WarrenCluster, "rabbitmq": RabbitCluster}
    results, fail = {}, {}
    versions = [makers[b](root).version() for b in brokers]
    current = None

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for run in range(1, a.runs + 1):
            order = brokers if run % 2 == 1 else list(reversed(brokers))
            for b in order:
                current = makers[b](root)
                log(f"run {run}: starting the {b} cluster")
                t = time.monotonic()
                current.start()
                log(f"  {b} cluster ready in {time.monotonic() - t:.1f} s, pids {current.pids()}")
                for key, _label, prefix, extra, queues_of in scenarios:
                    j = run_perf(current, key, prefix, extra, queues_of, a.duration, run)
                    results.setdefault(key, {}).setdefault(b, []).append(j)
                    if j:
                        log(f"  {b} {key}: {j.get('confirm_rate', 0):.0f} confirmed msg/s, "
                            f"confirm p50/p99 {j['confirm_latency_us']['p50'] / 1000:.2f}/"
                            f"{j['confirm_latency_us']['p99'] / 1000:.2f} ms, leaders "
                            f"{j.get('_leaders')}")
                if not a.no_failover:
                    try:
                        fail.setdefault(b, []).append(failover(current, run, a.failover_timeout,
                                                                a.reopen_after_nacks))
                    except RuntimeError as e:
                        log(f"  failover measurement failed: {e}")
                current.stop()
                current = None
        (OUT_DIR / "results.json").write_text(json.dumps({"throughput": results,
                                                          "failover": fail}, indent=1))
    finally:
        if current is not None:
            current.stop()
        if a.keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    text = report(results, fail, a, versions, background)
    print()
    print(text)
    if a.doc:
        write_doc(text)
        log(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
