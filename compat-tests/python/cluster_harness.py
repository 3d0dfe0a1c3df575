"""Multi-process harness for Warren clusters, and a Jepsen-style total-queue checker.

`Cluster` starts N real `warren server` processes on loopback (free ports, one temp dir per
node holding its data dir and its log) and injects process faults: kill -9 (of one node or of
all), SIGTERM, SIGSTOP / SIGCONT, restart on the same ports and data dir. The traffic between
nodes goes through `NetProxy` (a TCP proxy in this process), so it also injects network
faults: partition(), isolate(), heal_network(). Clients and the management API reach the nodes
directly. It finds a queue's leader through the management API of the nodes that are up.

The checker (`run_total_queue_check`) drives one quorum queue with publishers and a consumer
(real pika clients over TCP) while a fault thread (`FaultInjector`) kills, pauses, partitions
nodes, kills the whole cluster or changes the queue's members, then drains the queue, checks
that every replica reached the same applied index and state digest (`check_replicas`, when
the binary reports them) and checks the history kept by `History`:
  * lost        = confirmed ids never delivered                        (must be 0)
  * unexpected  = delivered ids never published                        (must be 0)
  * duplicates  = ids delivered more than once; allowed only for ids that were delivered with
                  redelivered=True at least once or were republished after an unknown outcome
                  (a nack, a connection or channel error before the confirm).

Used by test_cluster.py (pytest fixtures `cluster_factory`, `cluster3`, `cluster5`) and by
scripts/cluster_soak.py (long runs from the command line). Nothing here sleeps to synchronise:
waits poll an observable event (a port accepting, the management API naming a leader, a
delivery arriving) with a deadline. The only sleeps are fault durations, poll intervals and
clients' back-off between retries.
"""

import asyncio
import base64
import collections
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pika
import pika.exceptions
import pytest

# Reuse the single-node suite's helpers (binary lookup, waiting for a port).
from conftest import STARTUP_DEADLINE_S, _wait_for_port, warren_binary

QUORUM = {"x-queue-type": "quorum"}
USER, PASSWORD = "guest", "guest"
# Errors a client must expect from pika while nodes die, pause and come back.
CLIENT_ERRORS = (pika.exceptions.AMQPError, OSError, EOFError)


def log(msg):
    """Progress line with a timestamp (shown by pytest on failure, or live with -s)."""
    print(f"[{time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d}] {msg}",
          flush=True)


def cluster_supported(binary=None):
    """(True, "") when `warren server --help` lists --peers; else (False, reason)."""
    try:
        binary = binary or warren_binary()
    except RuntimeError as e:
        return False, str(e)
    try:
        out = subprocess.run([binary, "server", "--help"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"`{binary} server --help` failed: {e}"
    if "--peers" not in out.stdout + out.stderr:
        return False, f"{binary} has no clustering yet (`server --help` lists no --peers)"
    return True, ""


# ---------------------------------------------------------------------------------------------
# Ports
# ---------------------------------------------------------------------------------------------

_TAKEN_PORTS = set()
_PORT_LOCK = threading.Lock()


def _ephemeral_range():
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def pick_port():
    """A free loopback port *below* the kernel's ephemeral range. A node restarted on its old
    port must find it free: ports from bind(0) come from the ephemeral range, where any client
    connection made in the meantime (pika's own) may have taken it as its local port."""
    eph_lo, _ = _ephemeral_range()
    lo, hi = 10000, max(10001, eph_lo - 1)
    with _PORT_LOCK:
        for _ in range(1000):
            port = random.randint(lo, hi)
            if port in _TAKEN_PORTS:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _TAKEN_PORTS.add(port)
            return port
    raise RuntimeError("no free port found below the ephemeral range")


# ---------------------------------------------------------------------------------------------
# The network between the nodes: a fault-injecting TCP proxy
# ---------------------------------------------------------------------------------------------

def node_id(name):
    """A node's Raft id as Warren computes it (cluster/src/node/config.rs `node_id`: FNV-1a 64
    of the name, at least 1). The proxy reads it from a connection's hello to know who dialed."""
    h = 0xcbf29ce484222325
    for b in name.encode():
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return max(h, 1)


def _bincode_varint(buf, pos):
    """One bincode varint (DefaultOptions) at buf[pos]: (value, next position)."""
    tag = buf[pos]
    if tag < 251:
        return tag, pos + 1
    size = {251: 2, 252: 4, 253: 8, 254: 16}.get(tag)
    if size is None or pos + 1 + size > len(buf):
        raise ValueError(f"bad varint tag {tag}")
    return int.from_bytes(buf[pos + 1:pos + 1 + size], "little"), pos + 1 + size


def parse_hello(body):
    """(from id, to id) of a cluster connection's first frame, the `Hello` of
    cluster/src/transport/tcp/wire.rs (bincode: from, to, group). Raises ValueError if it is not one."""
    src, pos = _bincode_varint(body, 0)
    dst, _ = _bincode_varint(body, pos)
    return src, dst


def _reset(writer):
    """Close a proxied socket with a TCP RST (SO_LINGER 0, then abort): the far end sees
    ECONNRESET at once, as when a link or a host goes away, not an orderly end of stream."""
    if writer is None:
        return
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


class _ProxiedConn:
    """One connection through the proxy: who dialed whom, and both of its sockets."""

    def __init__(self, dst, client):
        self.src = None          # the dialing node, from its hello or its port (None: unknown)
        self.dst = dst
        self.client = client     # StreamWriter towards the dialing node
        self.upstream = None     # StreamWriter towards dst's real cluster port
        self.identified = False  # its first frame was read (the cut applies from then on)
        self.blackholed = False

    def reset(self):
        _reset(self.client)
        _reset(self.upstream)


class NetProxy:
    """A TCP proxy in front of every node's cluster port, in the harness process (an asyncio
    loop in a daemon thread), that can cut links between nodes.

    Node i's --peers list names each other node j at a port of the proxy for the ordered pair
    (i -> j) (`pair_ports`), and itself at a port for "anyone -> i" (`front_ports`), so every
    cluster connection passes here, and the proxy knows who dialed whom in two ways:
      * the connection's first frame, the `Hello` of cluster/src/transport/tcp/wire.rs, names `from` and
        `to` by Raft id before any authentication (when it can be read: not under TLS);
      * the port it came in on.
    The hello wins when they differ. That happens with binaries that dial a peer at the
    address stored in the Raft membership, taken from the --peers list of whichever node
    initialised the group (before e276047 "nodes dial peers at their own --peers
    addresses"): every node then uses the initialiser's ports, and the initialiser's own
    entry. That is also why a node's own entry is a proxy port and not its real port: with
    such a binary a real port there is dialled around the proxy (direct_cluster_links()
    shows it), and with a newer one nobody dials it.

    A connection is cut when its pair (either direction: a TCP connection needs both) is in
    the cut set. Cutting resets (RST) every existing connection across the cut. New ones
    across it are, by mode: "reset", accepted, the first frame read, then reset (the dialer
    sees a refused link at once); "blackhole", accepted and everything read and discarded,
    nothing ever forwarded or answered (the dialer sees a silent peer and only its own
    timeouts end the wait). Healing resets the black-holed connections (their bytes are gone)
    and lets new ones through. Each accepted connection dials the node's real port afresh, so
    the proxy outlives node restarts; a node that is down makes the proxy reset the dialer."""

    HELLO_TIMEOUT = 10.0
    HELLO_MAX = 4096

    def __init__(self, nodes):
        self.nodes = nodes
        n = len(nodes)
        self.front_ports = [pick_port() for _ in nodes]
        self.pair_ports = {(i, j): pick_port() for i in range(n) for j in range(n) if i != j}
        self.ids = {node_id(x.name): i for i, x in enumerate(nodes)}
        self.stats = collections.Counter()
        self.cut = set()          # frozenset({i, j}) of cut pairs
        self.mode = "reset"
        self._conns = set()
        self._servers = []
        self._loop = None
        self._thread = None

    def peers_for(self, i):
        """The --peers value for node i."""
        return ",".join(
            f"{x.name}@127.0.0.1:{self.front_ports[j] if j == i else self.pair_ports[(i, j)]}"
            for j, x in enumerate(self.nodes))

    # -- control (any thread) ----------------------------------------------------------------

    def start(self):
        if self._thread is not None:
            return
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="netproxy",
                                        daemon=True)
        self._thread.start()
        self._call(self._listen())

    def _call(self, coro, timeout=10.0):
        """Run `coro` on the proxy's loop and wait for it: when a control returns, it holds."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def set_cut(self, pairs, mode="reset"):
        """Cut exactly `pairs` (iterables of two node indices; empty heals everything)."""
        if mode not in ("reset", "blackhole"):
            raise ValueError(f"mode must be reset or blackhole, not {mode!r}")
        cut = {frozenset(p) for p in pairs if len(set(p)) == 2}
        return self._call(self._apply(cut, mode))

    def is_cut(self, i, j):
        return frozenset((i, j)) in self.cut

    def connections(self):
        """[(src, dst, blackholed)] of the connections open now (src None: unidentified)."""
        return self._call(self._list())

    def close(self):
        if self._thread is None:
            return
        try:
            self._call(self._shutdown())
        except Exception:   # noqa: BLE001 - closing after a failure must not mask it
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
        self._thread = None

    # -- the loop ----------------------------------------------------------------------------

    async def _listen(self):
        ports = [(None, j, p) for j, p in enumerate(self.front_ports)]
        ports += [(i, j, p) for (i, j), p in self.pair_ports.items()]
        for i, j, port in ports:
            server = await asyncio.start_server(
                lambda r, w, i=i, j=j: self._serve(i, j, r, w), "127.0.0.1", port,
                reuse_address=True)
            self._servers.append(server)

    async def _list(self):
        return [(c.src, c.dst, c.blackholed) for c in self._conns]

    async def _apply(self, cut, mode):
        was_cut = self.cut
        self.cut, self.mode = cut, mode
        for conn in list(self._conns):
            if not conn.identified:
                continue    # checked against the cut once its first frame is read
            crosses = self._crosses(conn)
            if crosses and not conn.blackholed:
                self.stats["reset at cut"] += 1
                conn.reset()
            elif conn.blackholed and not crosses:
                # Black-holed under a cut now lifted: its bytes were discarded, it cannot
                # resume.
                self.stats["black-holed reset at heal"] += 1
                conn.reset()
        return was_cut

    async def _shutdown(self):
        for server in self._servers:
            server.close()
        for conn in list(self._conns):
            conn.reset()

    def _crosses(self, conn):
        if conn.src is None:
            # Unidentified dialer: cut it whenever its destination is cut from anyone, so a
            # partition never leaks.
            return any(conn.dst in pair for pair in self.cut)
        return frozenset((conn.src, conn.dst)) in self.cut

    async def _read_first(self, port_src, dst, reader):
        """Read the first frame; returns (bytes read, the dialing node or None)."""
        head = await asyncio.wait_for(reader.readexactly(4), self.HELLO_TIMEOUT)
        length = int.from_bytes(head, "big")
        if length > self.HELLO_MAX:
            # Not a hello frame (TLS starts with a record header): the port must tell.
            self.stats["first frame unreadable"] += 1
            return head, port_src
        body = await asyncio.wait_for(reader.readexactly(length), self.HELLO_TIMEOUT)
        try:
            src_id, dst_id = parse_hello(body)
        except (ValueError, IndexError):
            self.stats["first frame unreadable"] += 1
            return head + body, port_src
        src = self.ids.get(src_id)
        if dst_id != node_id(self.nodes[dst].name):
            self.stats["hello names another destination"] += 1
        if src is None:
            return head + body, port_src
        if port_src is not None and src != port_src:
            self.stats["dialed at another node's port"] += 1
        return head + body, src

    async def _serve(self, port_src, dst, reader, writer):
        conn = _ProxiedConn(dst, writer)
        self._conns.add(conn)
        self.stats["accepted"] += 1
        try:
            try:
                first, conn.src = await self._read_first(port_src, dst, reader)
            except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError,
                    OSError):
                self.stats["closed before its first frame"] += 1
                _reset(writer)
                return
            conn.identified = True
            if conn.src is None:
                self.stats["unidentified"] += 1
            pair = f"{self._name(conn.src)}->{self.nodes[dst].name}"
            if self._crosses(conn):
                if self.mode == "blackhole":
                    self.stats[f"black-holed {pair}"] += 1
                    conn.blackholed = True
                    await self._discard(reader)
                else:
                    self.stats[f"refused {pair}"] += 1
                    _reset(writer)
                return
            try:
                up_reader, conn.upstream = await asyncio.open_connection(
                    "127.0.0.1", self.nodes[dst].cluster_port)
            except OSError:
                self.stats[f"{self.nodes[dst].name} down"] += 1
                _reset(writer)
                return
            if self._crosses(conn):
                # Cut while this connection was being dialed.
                conn.reset()
                return
            self.stats[f"forwarded {pair}"] += 1
            conn.upstream.write(first)
            await asyncio.gather(self._pump(reader, conn.upstream, conn),
                                 self._pump(up_reader, writer, conn))
        finally:
            self._conns.discard(conn)
            for w in (writer, conn.upstream):
                if w is not None and not w.transport.is_closing():
                    w.close()

    async def _pump(self, reader, writer, conn):
        """Copy one direction until it ends; an end or error of either side ends both (a
        reset propagates as a reset, an orderly close as a close)."""
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            conn.reset()
            return
        for w in (conn.client, conn.upstream):
            if w is not None and not w.transport.is_closing():
                w.close()

    async def _discard(self, reader):
        try:
            while await reader.read(65536):
                pass
        except (ConnectionError, OSError):
            pass

    def _name(self, i):
        return "?" if i is None else self.nodes[i].name


# ---------------------------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------------------------

class Node:
    """One `warren server` process: its name, ports, directory and current process."""

    def __init__(self, index, root):
        self.index = index
        self.name = f"n{index + 1}"
        self.amqp_port = pick_port()
        self.mgmt_port = pick_port()
        self.prom_port = pick_port()
        self.cluster_port = pick_port()
        self.dir = Path(root) / self.name
        self.data_dir = self.dir / "data"
        self.log_path = self.dir / "warren.log"
        self.data_dir.mkdir(parents=True)
        self.proc = None
        self.paused = False
        self.starts = 0
        # Exits the harness caused (kill -9, SIGTERM); any other exit is a crash.
        self.expected_exit = True

    @property
    def running(self):
        return self.proc is not None and self.proc.poll() is None

    @property
    def up(self):
        """Running and not paused: should answer clients."""
        return self.running and not self.paused

    def state(self):
        if self.proc is None:
            return "never started"
        rc = self.proc.poll()
        if rc is not None:
            return f"exited rc={rc}" + ("" if self.expected_exit else " (UNEXPECTED)")
        return "paused" if self.paused else "up"


class Cluster:
    """N Warren nodes on loopback. Indices are 0-based; node i is named n{i+1}.

    clustered=False starts the same processes without the cluster flags (independent
    single nodes): the fault and management plumbing can then be exercised on a binary that
    has no clustering yet, and the checker can run against one node (n=1).

    proxied=True (the default; WARREN_CLUSTER_PROXY=0 turns it off) routes all traffic between
    the nodes through a NetProxy, so partition(), isolate() and heal_network() can cut links.
    Clients and the management API always reach the nodes directly."""

    def __init__(self, n=3, binary=None, secret=None, log_level=None, extra_args=(),
                 clustered=True, root=None, keep=None, proxied=None):
        self.binary = binary or warren_binary()
        self.clustered = clustered
        if proxied is None:
            proxied = os.environ.get("WARREN_CLUSTER_PROXY", "1") != "0"
        self.proxied = bool(proxied and clustered)
        self.secret = secret or uuid.uuid4().hex
        # openraft logs every vote and append at info: keep it to warnings unless asked.
        self.log_level = log_level or os.environ.get("WARREN_CLUSTER_LOG_LEVEL",
                                                     "info,openraft=warn")
        # WARREN_CLUSTER_EXTRA_ARGS: flags for every node of every cluster (for example
        # "--quorum-log redb" to run the cluster tests on redb rather than the write-ahead log).
        self.extra_args = list(extra_args) + os.environ.get("WARREN_CLUSTER_EXTRA_ARGS", "").split()
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="warren-cluster-"))
        self.keep = (os.environ.get("WARREN_CLUSTER_KEEP") == "1") if keep is None else keep
        self.nodes = [Node(i, self.root) for i in range(n)]
        self.proxy = NetProxy(self.nodes) if self.proxied else None
        self.peers = ",".join(f"{x.name}@127.0.0.1:{x.cluster_port}" for x in self.nodes)
        self.events = []   # (monotonic time, text): what the harness did, for failure reports
        self.past_crashes = []   # (index, return code) of crashes since restarted

    def __len__(self):
        return len(self.nodes)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _event(self, text):
        self.events.append((time.monotonic(), text))

    # -- processes -------------------------------------------------------------------------

    def command(self, i):
        node = self.nodes[i]
        cmd = [self.binary, "server",
               "--amqp-listen", f"127.0.0.1:{node.amqp_port}",
               "--management-listen", f"127.0.0.1:{node.mgmt_port}",
               "--prometheus-listen", f"127.0.0.1:{node.prom_port}",
               "--data-dir", str(node.data_dir),
               "--log-level", self.log_level]
        if self.clustered:
            cmd += ["--node-name", node.name,
                    "--cluster-listen", f"127.0.0.1:{node.cluster_port}",
                    "--peers", self.peers_for(i),
                    "--cluster-secret", self.secret]
        return cmd + self.extra_args

    def peers_for(self, i):
        """Node i's --peers: the real cluster ports, or with the proxy its ports for node i's
        links (see NetProxy)."""
        return self.proxy.peers_for(i) if self.proxy is not None else self.peers

    def start_all(self, wait=True):
        """Start every node (all processes first, so the cluster can form), then wait until
        each accepts AMQP and management connections."""
        for i in range(len(self.nodes)):
            self.start_node(i, wait=False)
        if wait:
            for i in range(len(self.nodes)):
                self.wait_listening(i)
        return self

    def start_node(self, i, wait=True):
        """Start node i on its ports and data dir (its log file is appended to)."""
        node = self.nodes[i]
        assert not node.running, f"{node.name} is already running"
        if self.proxy is not None:
            self.proxy.start()
        if node.proc is not None and not node.expected_exit:
            # It died on its own; remember that before a restart hides it.
            self.past_crashes.append((i, node.proc.returncode))
            self._event(f"{node.name} had exited on its own rc={node.proc.returncode}")
        node.starts += 1
        with open(node.log_path, "ab") as logf:
            logf.write(f"\n===== harness: start #{node.starts} of {node.name} at "
                       f"{time.strftime('%H:%M:%S')} =====\n".encode())
            logf.flush()
            node.proc = subprocess.Popen(
                self.command(i), stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, "NO_COLOR": "1", "RUST_BACKTRACE": "1"})
        node.paused = False
        node.expected_exit = False
        self._event(f"start {node.name} pid={node.proc.pid}")
        if wait:
            self.wait_listening(i)

    def wait_listening(self, i, deadline_s=STARTUP_DEADLINE_S):
        """Wait until node i accepts TCP on its AMQP and management ports (raises with its log
        if it exits first)."""
        node = self.nodes[i]
        _wait_for_port(node.amqp_port, node.proc, deadline_s, node.log_path)
        _wait_for_port(node.mgmt_port, node.proc, deadline_s, node.log_path)

    def kill9(self, i):
        """SIGKILL node i (works on a paused node too) and reap it."""
        node = self.nodes[i]
        if not node.running:
            return
        node.expected_exit = True
        node.proc.kill()
        node.proc.wait()
        node.paused = False
        self._event(f"kill -9 {node.name}")

    def stop(self, i, timeout=15.0):
        """SIGTERM node i (SIGCONT first if paused) and wait; SIGKILL after `timeout`.
        Returns the exit code (None if it had to be killed)."""
        node = self.nodes[i]
        if not node.running:
            return node.proc.returncode if node.proc else None
        node.expected_exit = True
        if node.paused:
            self.resume(i)
        node.proc.send_signal(signal.SIGTERM)
        self._event(f"SIGTERM {node.name}")
        try:
            return node.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._event(f"{node.name} ignored SIGTERM for {timeout}s: kill -9")
            node.proc.kill()
            node.proc.wait()
            return None

    def restart(self, i, wait=True):
        """Start node i again on the same ports and data dir (stopping it with SIGTERM first
        if it is still running)."""
        if self.nodes[i].running:
            self.stop(i)
        self.start_node(i, wait=wait)

    def pause(self, i):
        """SIGSTOP node i: its sockets stay open and nothing answers."""
        node = self.nodes[i]
        assert node.running, f"{node.name} is not running"
        node.proc.send_signal(signal.SIGSTOP)
        node.paused = True
        self._event(f"SIGSTOP {node.name}")

    def resume(self, i):
        """SIGCONT node i."""
        node = self.nodes[i]
        if node.running:
            node.proc.send_signal(signal.SIGCONT)
        node.paused = False
        self._event(f"SIGCONT {node.name}")

    def kill_all(self):
        """kill -9 every running node (a whole-cluster power loss)."""
        for i in range(len(self.nodes)):
            self.kill9(i)

    def restart_all(self, wait=True):
        """Start every node that is not running, all processes first (a majority must be up
        for any of them to serve), then wait until each listens."""
        down = [i for i, x in enumerate(self.nodes) if not x.running]
        for i in down:
            self.start_node(i, wait=False)
        if wait:
            for i in down:
                self.wait_listening(i)
        return down

    # -- the network -----------------------------------------------------------------------

    def _need_proxy(self):
        if self.proxy is None:
            raise RuntimeError("network faults need Cluster(proxied=True)")
        return self.proxy

    def partition(self, groups, mode="reset"):
        """Cut every link between nodes of different `groups` (lists of indices; nodes in
        none form one more group), both directions, until heal_network() or the next
        partition(). mode: "reset" (new connections across the cut are reset) or "blackhole"
        (accepted and never answered); existing ones are reset either way."""
        proxy = self._need_proxy()
        groups = [set(g) for g in groups]
        rest = set(range(len(self.nodes))) - set().union(*groups)
        if rest:
            groups.append(rest)
        side = {i: k for k, g in enumerate(groups) for i in g}
        pairs = [(i, j) for i in range(len(self.nodes)) for j in range(i + 1, len(self.nodes))
                 if side[i] != side[j]]
        proxy.set_cut(pairs, mode)
        self._event(f"partition {[sorted(self.nodes[i].name for i in g) for g in groups]} "
                    f"({mode})")

    def isolate(self, i, mode="reset"):
        """Cut node i off from every other node (it keeps serving its clients)."""
        self.partition([[i]], mode=mode)

    def heal_network(self):
        """Reconnect every link (black-holed connections are reset, so their dialers retry)."""
        if self.proxy is not None and self.proxy.cut:
            self.proxy.set_cut(())
            self._event("network healed")

    def direct_cluster_links(self):
        """Established TCP connections from a node's process straight to another node's real
        cluster port, around the proxy: [(dialer, target)] by name (read from /proc; empty
        where there is none). With the proxy, anything here means a cut can leak."""
        real = {x.cluster_port: x.name for x in self.nodes}
        owner = {}   # socket inode -> the node whose process holds it
        for x in self.nodes:
            if not x.running:
                continue
            try:
                fds = list(Path(f"/proc/{x.proc.pid}/fd").iterdir())
            except OSError:
                continue
            for fd in fds:
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    owner[target[8:-1]] = x.name
        found = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                rows = Path(table).read_text().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                f = row.split()
                if len(f) < 10 or f[3] != "01":     # 01: ESTABLISHED
                    continue
                remote_port = int(f[2].rsplit(":", 1)[1], 16)
                if remote_port in real and f[9] in owner:
                    found.append((owner[f[9]], real[remote_port]))
        return sorted(found)

    def cut_pairs(self):
        """The node-name pairs cut now."""
        if self.proxy is None:
            return []
        return sorted(tuple(sorted(self.nodes[i].name for i in p)) for p in self.proxy.cut)

    def heal(self):
        """Reconnect the network, resume paused nodes and restart dead ones (waiting until
        they listen)."""
        self.heal_network()
        for i, node in enumerate(self.nodes):
            if node.paused:
                self.resume(i)
        for i, node in enumerate(self.nodes):
            if not node.running:
                self.start_node(i)

    def is_up(self, i):
        return self.nodes[i].up

    def up_nodes(self, exclude=()):
        exclude = set(exclude or ())
        return [i for i, x in enumerate(self.nodes) if x.up and i not in exclude]

    def crashed(self):
        """Nodes that exited without the harness stopping them, including those restarted
        since: [(index, return code)]."""
        return self.past_crashes + [
            (i, x.proc.returncode) for i, x in enumerate(self.nodes)
            if x.proc is not None and x.proc.poll() is not None and not x.expected_exit]

    def close(self, remove=None):
        """Kill every node; remove the directory unless keep (WARREN_CLUSTER_KEEP=1) or
        remove=False."""
        for i, node in enumerate(self.nodes):
            if node.proc is not None and node.proc.poll() is None:
                node.expected_exit = True
                try:
                    node.proc.send_signal(signal.SIGCONT)
                    node.proc.kill()
                except ProcessLookupError:
                    pass
                node.proc.wait()
        if self.proxy is not None:
            self.proxy.close()
        if remove is None:
            remove = not self.keep
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- clients ---------------------------------------------------------------------------

    def amqp_params(self, i, **overrides):
        """pika parameters for node i. Short connect and handshake timeouts (a paused node
        accepts TCP but never answers) and a short heartbeat, so a silent node is noticed."""
        kw = dict(host="127.0.0.1", port=self.nodes[i].amqp_port,
                  credentials=pika.PlainCredentials(USER, PASSWORD),
                  connection_attempts=1, socket_timeout=3, stack_timeout=6, heartbeat=2,
                  blocked_connection_timeout=30,
                  client_properties={"connection_name": f"cluster-test->{self.nodes[i].name}"})
        kw.update(overrides)
        return pika.ConnectionParameters(**kw)

    def connect(self, i, **overrides):
        """A BlockingConnection to node i (the caller closes it)."""
        try:
            return pika.BlockingConnection(self.amqp_params(i, **overrides))
        except ValueError as e:
            # pika's connector raises ValueError when the TCP connect completes and the
            # socket is reset at once (the node killed mid-connect): a connection failure
            # like any other, for the callers that move on to the next node.
            if "Expected connected socket" not in str(e):
                raise
            raise pika.exceptions.AMQPConnectionError(str(e)) from e

    def mgmt_url(self, i):
        return f"http://127.0.0.1:{self.nodes[i].mgmt_port}"

    def mgmt_get(self, i, path, timeout=3.0):
        """GET `path` on node i's management API as guest: (status, parsed JSON or text).
        Raises OSError if the node does not answer within `timeout`."""
        return self.mgmt_request(i, "GET", path, timeout=timeout)

    def mgmt_request(self, i, method, path, body=None, timeout=3.0):
        """`method` `path` (with `body` as JSON if given) on node i's management API as
        guest: (status, parsed JSON or text). Raises OSError if it does not answer."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.mgmt_url(i) + path, data=data, method=method)
        token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        text = raw.decode(errors="replace")
        try:
            return status, (json.loads(text) if text else None)
        except json.JSONDecodeError:
            return status, text

    @staticmethod
    def queue_path(queue, vhost="/"):
        return f"/api/queues/{urllib.parse.quote(vhost, safe='')}/" \
               f"{urllib.parse.quote(queue, safe='')}"

    def queue_info(self, i, queue, vhost="/", timeout=3.0):
        """Node i's management record of `queue` (dict), or None if it answers 404."""
        path = self.queue_path(queue, vhost)
        status, body = self.mgmt_get(i, path, timeout=timeout)
        if status == 404:
            return None
        if status != 200 or not isinstance(body, dict):
            raise OSError(f"{self.nodes[i].name}: GET {path} -> {status} {body!r}"[:300])
        return body

    def node_index(self, name):
        """Index of the node called `name` ("n2", or "n2@host..."), or None."""
        if not name:
            return None
        for i, node in enumerate(self.nodes):
            if name == node.name or str(name).split("@", 1)[0] == node.name:
                return i
        return None

    def reported_leader(self, i, queue):
        """The leader of `queue` as node i reports it (index), or None (no answer, no queue,
        no leader known). A non-clustered node is its own queue's leader."""
        try:
            info = self.queue_info(i, queue, timeout=2.0)
        except OSError:
            return None
        if info is None:
            return None
        if not self.clustered:
            return i
        return self.node_index(info.get("leader"))

    def leader_views(self, queue, exclude=()):
        """{node: (the leader it names or None, how many members it lists)} from every node
        that is up (not in `exclude`) and knows `queue`. A classic queue's "leader" is its
        home (its `node`; no `leader` or `members`): it leads once it is up and the others
        name it."""
        views = {}
        for i in self.up_nodes(exclude):
            try:
                info = self.queue_info(i, queue, timeout=2.0)
            except OSError:
                continue
            if info is None:
                continue
            if not self.clustered:
                views[i] = (i, 1)
            else:
                members = info.get("members") or []
                leader = info.get("leader") if "members" in info else info.get("node")
                views[i] = (self.node_index(leader), len(members) or len(self.nodes))
        return views

    def leader_of(self, queue, exclude=()):
        """`queue`'s leader, if it is up, not in `exclude`, names itself, and a majority of
        the queue's members (itself included) name it; else None. (A lone node that names
        itself, e.g. an old leader just resumed from SIGSTOP, is not enough.)"""
        exclude = set(exclude or ())
        views = self.leader_views(queue, exclude)
        if not self.clustered:
            return next(iter(views), None)
        votes = collections.Counter(v[0] for v in views.values() if v[0] is not None)
        for candidate, count in votes.most_common():
            if candidate in exclude or candidate not in views or views[candidate][0] != candidate:
                continue
            if count >= views[candidate][1] // 2 + 1:
                return candidate
        return None

    def wait_for_leader(self, queue, exclude=(), deadline=30.0):
        """Poll leader_of(queue, exclude) until it names a node; returns its index. Raises
        AssertionError after `deadline` seconds."""
        end = time.monotonic() + deadline
        while True:
            leader = self.leader_of(queue, exclude)
            if leader is not None:
                return leader
            if time.monotonic() > end:
                raise AssertionError(
                    f"no leader for {queue} (excluding {sorted(exclude or ())}) within "
                    f"{deadline}s; {self.describe(queue)}")
            time.sleep(0.1)

    def wait_for_agreement(self, queue, include=(), deadline=30.0):
        """Poll until every node that is up and knows `queue` names the same leader, which
        leader_of confirms, and every node in `include` is among them (e.g. a node just
        restarted or resumed); returns the leader's index."""
        include = set(include or ())
        end = time.monotonic() + deadline
        while True:
            views = self.leader_views(queue)
            named = {v[0] for v in views.values()}
            if include <= views.keys() and len(named) == 1:
                leader = named.pop()
                if leader is not None and self.leader_of(queue) == leader:
                    return leader
            if time.monotonic() > end:
                raise AssertionError(
                    f"the nodes {sorted(self.nodes[i].name for i in include)} and the others "
                    f"did not agree on a leader of {queue} within {deadline}s; views "
                    f"{ {self.nodes[i].name: v for i, v in views.items()} }\n"
                    f"{self.describe(queue)}")
            time.sleep(0.1)

    # -- reports ---------------------------------------------------------------------------

    def describe(self, queue=None):
        """One line per node: state, pid, ports and (if up) what it says about `queue`."""
        lines = [f"cluster at {self.root}:"]
        if self.proxy is not None and self.proxy.cut:
            lines.append(f"  network: cut {self.cut_pairs()} ({self.proxy.mode})")
        for i, node in enumerate(self.nodes):
            pid = node.proc.pid if node.proc else None
            line = (f"  {node.name} [{node.state()}] pid={pid} amqp={node.amqp_port} "
                    f"mgmt={node.mgmt_port} raft={node.cluster_port}")
            if self.proxy is not None and i < len(self.proxy.front_ports):
                line += f" (proxied; own entry at {self.proxy.front_ports[i]})"
            if queue and node.up:
                try:
                    info = self.queue_info(i, queue, timeout=2.0)
                    if info is None:
                        line += " queue: 404"
                    else:
                        stats = info.get("message_stats") or {}
                        line += (f" queue: type={info.get('type')} leader={info.get('leader')} "
                                 f"members={info.get('members')} messages={info.get('messages')}"
                                 f" (ready {info.get('messages_ready')}, unacked "
                                 f"{info.get('messages_unacknowledged')}) consumers="
                                 f"{info.get('consumers')} delivered={stats.get('deliver')} "
                                 f"redelivered={stats.get('redeliver')} acked={stats.get('ack')}")
                        if isinstance(info.get("raft"), dict):
                            line += f" raft={info['raft']}"
                except OSError as e:
                    line += f" queue: no answer ({e})"
            lines.append(line)
        return "\n".join(lines)

    def diagnose(self, queue):
        """describe(queue) plus, per node that is up, the queue's consumer_details and the
        node's client connections (who holds what when a queue does not drain)."""
        lines = [self.describe(queue)]
        for i in self.up_nodes():
            name = self.nodes[i].name
            try:
                info = self.queue_info(i, queue, timeout=2.0) or {}
                details = [{k: d.get(k) for k in ("consumer_tag", "prefetch_count", "ack_required",
                                                  "channel_details") if k in d}
                           for d in info.get("consumer_details") or []]
                lines.append(f"  {name} consumer_details: {details}")
                status, conns = self.mgmt_get(i, "/api/connections", timeout=2.0)
                if status == 200 and isinstance(conns, list):
                    names = [(x.get("name"),
                              (x.get("client_properties") or {}).get("connection_name"))
                             for x in conns]
                    lines.append(f"  {name} connections: {names}")
            except OSError as e:
                lines.append(f"  {name}: no answer ({e})")
        return "\n".join(lines)

    def log_tail(self, i, lines=60):
        try:
            text = self.nodes[i].log_path.read_text(errors="replace")
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def report(self, lines=60, queue=None):
        """describe(), the harness's own event list, and each node's log tail."""
        t0 = self.events[0][0] if self.events else 0.0
        out = [self.describe(queue)]
        if self.proxy is not None:
            out.append(f"proxy: {dict(sorted(self.proxy.stats.items()))}")
        out.append("harness events:")
        out += [f"  +{t - t0:7.2f}s {text}" for t, text in self.events[-80:]]
        for i, node in enumerate(self.nodes):
            out.append(f"----- {node.name} log tail ({node.log_path}) -----")
            out.append(self.log_tail(i, lines))
        return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# pytest fixtures
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def cluster_factory(request):
    """make(n=3, **Cluster kwargs) -> a started Cluster. At teardown every cluster is killed;
    if the test failed (or a node crashed on its own) each node's log tail is printed and the
    directory is kept."""
    made = []
    failed_before = request.session.testsfailed
    # pika logs every refused connection and closed channel, which faults make routine.
    pika_logger = logging.getLogger("pika")
    pika_level = pika_logger.level
    pika_logger.setLevel(logging.CRITICAL)

    def make(n=3, start=True, **kw):
        c = Cluster(n, **kw)
        made.append(c)
        if start:
            c.start_all()
        return c

    try:
        yield make
    finally:
        pika_logger.setLevel(pika_level)
    # The call phase's report is logged before teardown runs, so testsfailed already counts
    # a failure of this test.
    failed = request.session.testsfailed > failed_before
    crashed = []
    panicked = []
    for c in made:
        crashed += [(c, i, rc) for i, rc in c.crashed()]
        # A panic in a task (a Raft core, a connection) leaves the process running: it is a
        # failure all the same.
        for i, node in enumerate(c.nodes):
            try:
                if "panicked at" in node.log_path.read_text(errors="replace"):
                    panicked.append(node.name)
            except OSError:
                pass
        if failed or crashed or panicked:
            print(f"\n===== cluster report (test failed={failed}, crashed="
                  f"{[c.nodes[i].name for _, i, _ in crashed]}) =====")
            print(c.report())
            print(f"(directory kept: {c.root})")
        c.close(remove=False if (failed or crashed or panicked) else None)
    if panicked and not failed:
        pytest.fail(f"a task panicked on {panicked} (see their logs)", pytrace=False)
    if crashed and not failed:
        pytest.fail("nodes exited on their own: " + ", ".join(
            f"{c.nodes[i].name} rc={rc}" for c, i, rc in crashed), pytrace=False)


@pytest.fixture
def cluster3(cluster_factory):
    """A started 3-node cluster."""
    return cluster_factory(3)


@pytest.fixture
def cluster5(cluster_factory):
    """A started 5-node cluster."""
    return cluster_factory(5)


# ---------------------------------------------------------------------------------------------
# Client helpers
# ---------------------------------------------------------------------------------------------

def eventually(fetch, check, deadline=10.0, what="condition"):
    """Poll fetch() (a poll, not a sleep: the tests wait for events this way) until check(value) holds; AssertionError with the last value after
    `deadline` seconds."""
    end = time.monotonic() + deadline
    while True:
        try:
            value = fetch()
        except OSError as e:
            value = e
        if not isinstance(value, OSError) and check(value):
            return value
        if time.monotonic() > end:
            raise AssertionError(f"{what} not reached within {deadline}s; last: {value!r}")
        time.sleep(0.1)


def safe_close(conn):
    """Close a pika connection that may already be broken."""
    if conn is None:
        return
    try:
        if conn.is_open:
            conn.close()
    except Exception:   # noqa: BLE001 - a dead connection can fail to close in many ways
        pass


def abort_connection(conn):
    """Shut down a pika connection's socket from another thread: a client-side operation
    timeout. The blocked pika call then fails with a connection error (never close() the fd
    from another thread: it could be reused)."""
    try:
        conn._impl._transport._sock.shutdown(socket.SHUT_RDWR)
    except Exception:   # noqa: BLE001 - already closed, or pika internals changed
        pass


class Watchdog:
    """Client-side deadlines for blocking pika calls. pika's BlockingConnection waits for a
    publisher confirm or an RPC reply forever; with `guard(conn, seconds)` around the call the
    socket is shut down when it overruns, so the call fails and the outcome is "unknown"."""

    def __init__(self, period=0.2):
        self._lock = threading.Lock()
        self._armed = {}
        self._next = 0
        self.timeouts = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._period = period
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, conn, seconds, label):
        with self._lock:
            token = self._next
            self._next += 1
            self._armed[token] = (time.monotonic() + seconds, conn, label)
        try:
            yield
        finally:
            with self._lock:
                self._armed.pop(token, None)

    def _run(self):
        while not self._stop.wait(self._period):
            now = time.monotonic()
            with self._lock:
                expired = [(t, c, lbl) for t, (d, c, lbl) in self._armed.items() if d < now]
                for token, _, _ in expired:
                    del self._armed[token]
            for _, conn, label in expired:
                self.timeouts[label] += 1
                abort_connection(conn)

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)


def declare_quorum(cluster, i, queue, deadline=30.0, arguments=None):
    """Declare durable quorum `queue` through node i, retrying connection and channel errors
    until `deadline` (a cluster that has just started may still be electing)."""
    end = time.monotonic() + deadline
    while True:
        conn = None
        try:
            conn = cluster.connect(i)
            conn.channel().queue_declare(queue, durable=True,
                                         arguments={**QUORUM, **(arguments or {})})
            return
        except CLIENT_ERRORS as e:
            if time.monotonic() > end:
                raise AssertionError(f"declare of {queue} on {cluster.nodes[i].name} kept "
                                     f"failing for {deadline}s: {e!r}\n"
                                     f"{cluster.describe(queue)}") from e
            time.sleep(0.2)
        finally:
            safe_close(conn)


def wait_visible(cluster, queue, nodes, deadline=10.0):
    """Poll a passive declare of `queue` on each of `nodes` until it succeeds. Returns
    {node: message_count}."""
    counts = {}
    for i in nodes:
        end = time.monotonic() + deadline
        while True:
            conn = None
            try:
                conn = cluster.connect(i)
                ok = conn.channel().queue_declare(queue, passive=True)
                counts[i] = ok.method.message_count
                break
            except CLIENT_ERRORS as e:
                if time.monotonic() > end:
                    raise AssertionError(f"{queue} not visible on {cluster.nodes[i].name} "
                                         f"within {deadline}s: {e!r}") from e
                time.sleep(0.1)
            finally:
                safe_close(conn)
    return counts


# ---------------------------------------------------------------------------------------------
# History and check
# ---------------------------------------------------------------------------------------------

class History:
    """What the clients did and saw. Thread-safe. Message ids are strings ("p0-17")."""

    def __init__(self):
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.attempts = collections.Counter()         # id -> publishes tried
        self.confirmed = set()
        self.confirm_order = []                       # ids in confirm order
        self.retried = collections.defaultdict(list)  # id -> reasons it was republished
        self.deliveries = collections.defaultdict(list)  # id -> [(t, node, redelivered, via)]
        self.delivery_order = []
        self.last_delivery = time.monotonic()

    def _t(self):
        return round(time.monotonic() - self.t0, 3)

    def attempt(self, mid):
        with self.lock:
            self.attempts[mid] += 1

    def confirm(self, mid):
        with self.lock:
            if mid not in self.confirmed:
                self.confirmed.add(mid)
                self.confirm_order.append(mid)

    def retry(self, mid, reason):
        with self.lock:
            self.retried[mid].append(f"{self._t()}s {reason}")

    def deliver(self, mid, redelivered, node, via):
        with self.lock:
            self.deliveries[mid].append((self._t(), node, bool(redelivered), via))
            self.delivery_order.append(mid)
            self.last_delivery = time.monotonic()

    def missing(self):
        """Confirmed ids not delivered yet."""
        with self.lock:
            return self.confirmed - self.deliveries.keys()

    def check(self):
        with self.lock:
            return CheckResult(self)

    def dump(self, path):
        with self.lock:
            Path(path).write_text(json.dumps({
                "attempts": self.attempts, "confirmed": self.confirm_order,
                "retried": self.retried, "deliveries": self.deliveries}, indent=1))


class CheckResult:
    """The checker's verdict on a History (computed under its lock)."""

    def __init__(self, h):
        delivered = set(h.deliveries)
        self.attempted = len(h.attempts)
        self.confirmed = len(h.confirmed)
        self.delivered = len(delivered)
        self.retried = len(h.retried)
        self.lost = sorted(h.confirmed - delivered)
        self.unexpected = sorted(delivered - set(h.attempts))
        dups = sorted(m for m, d in h.deliveries.items() if len(d) > 1)
        self.duplicates = dups
        self.bad_duplicates = [m for m in dups if m not in h.retried
                               and not any(red for (_, _, red, _) in h.deliveries[m])]
        # Delivered although never confirmed: published with an unknown outcome that committed.
        self.unconfirmed_delivered = len(delivered - h.confirmed - set(self.unexpected))
        self._detail = {m: {"attempts": h.attempts.get(m, 0), "confirmed": m in h.confirmed,
                            "retried": list(h.retried.get(m, [])),
                            "deliveries": list(h.deliveries.get(m, []))}
                        for m in self.lost[:20] + self.unexpected[:20] + self.bad_duplicates[:20]}

    @property
    def ok(self):
        return not (self.lost or self.unexpected or self.bad_duplicates)

    def summary(self):
        return (f"attempted={self.attempted} confirmed={self.confirmed} "
                f"delivered={self.delivered} lost={len(self.lost)} "
                f"unexpected={len(self.unexpected)} duplicates={len(self.duplicates)} "
                f"(not allowed: {len(self.bad_duplicates)}) retried={self.retried} "
                f"unconfirmed-but-delivered={self.unconfirmed_delivered}")

    def describe(self):
        lines = [self.summary()]
        for label, ids in (("lost", self.lost), ("unexpected", self.unexpected),
                           ("duplicates without redelivered or retry", self.bad_duplicates)):
            if ids:
                lines.append(f"{label} ({len(ids)}), first ones:")
                lines += [f"  {m}: {self._detail[m]}" for m in ids[:20]]
        return "\n".join(lines)


def body_id(body):
    try:
        return body.decode()
    except (AttributeError, UnicodeDecodeError):
        return repr(body)


# ---------------------------------------------------------------------------------------------
# Simple (fault-tolerant) publish and drain helpers for the scenario tests
# ---------------------------------------------------------------------------------------------

def publish_with_retry(cluster, nodes, queue, ids, history, deadline=60.0, confirm_timeout=20.0,
                       watchdog=None):
    """Publish each id (persistent, confirmed, mandatory) through `nodes` in turn: a nack, a
    return or a connection/channel error records the id as retried and republishes it through
    the next node. Raises AssertionError if not all are confirmed by `deadline`."""
    own_watchdog = watchdog is None
    watchdog = watchdog or Watchdog()
    end = time.monotonic() + deadline
    k, conn, ch = 0, None, None
    pending = list(ids)
    try:
        while pending:
            if time.monotonic() > end:
                raise AssertionError(f"{len(pending)} of {len(ids)} publishes not confirmed "
                                     f"within {deadline}s\n{cluster.describe(queue)}")
            node = nodes[k % len(nodes)]
            if ch is None:
                try:
                    conn = cluster.connect(node)
                    ch = conn.channel()
                    with watchdog.guard(conn, confirm_timeout, "confirm.select"):
                        ch.confirm_delivery()
                except CLIENT_ERRORS:
                    safe_close(conn)
                    conn, ch, k = None, None, k + 1
                    time.sleep(0.2)
                    continue
            mid = pending[0]
            history.attempt(mid)
            try:
                with watchdog.guard(conn, confirm_timeout, "confirm"):
                    ch.basic_publish("", queue, mid.encode(),
                                     pika.BasicProperties(delivery_mode=2, message_id=mid),
                                     mandatory=True)
                history.confirm(mid)
                pending.pop(0)
            except (pika.exceptions.NackError, pika.exceptions.UnroutableError) as e:
                history.retry(mid, f"{type(e).__name__} via {cluster.nodes[node].name}")
                k += 1
                time.sleep(0.05)   # an election: do not spin on nacks
            except CLIENT_ERRORS as e:
                history.retry(mid, f"{type(e).__name__} via {cluster.nodes[node].name}")
                safe_close(conn)
                conn, ch, k = None, None, k + 1
    finally:
        safe_close(conn)
        if own_watchdog:
            watchdog.close()


def drain_until(cluster, nodes, queue, history, want, deadline=30.0, via="drain",
                prefetch=50):
    """Consume `queue` through `nodes` (rotating on errors), recording and acking every
    delivery, until every id in `want` has been delivered at least once. Raises
    AssertionError with the missing ids after `deadline`."""
    want = set(want)
    end = time.monotonic() + deadline
    k = 0
    while True:
        if want <= history.deliveries.keys():
            return
        if time.monotonic() > end:
            missing = sorted(want - history.deliveries.keys())
            path = cluster.root / f"history-{queue}.json"
            history.dump(path)
            raise AssertionError(f"{len(missing)} ids not delivered within {deadline}s via "
                                 f"{[cluster.nodes[i].name for i in nodes]}: {missing[:20]}\n"
                                 f"(history written to {path})\n{cluster.diagnose(queue)}")
        node = nodes[k % len(nodes)]
        conn = None
        try:
            conn = cluster.connect(node)
            ch = conn.channel()
            ch.basic_qos(prefetch_count=prefetch)

            def on_message(c, method, props, body, node=node):
                history.deliver(body_id(body), method.redelivered, cluster.nodes[node].name, via)
                c.basic_ack(method.delivery_tag)

            ch.basic_consume(queue, on_message)
            while not want <= history.deliveries.keys() and time.monotonic() < end:
                conn.process_data_events(time_limit=0.2)
        except CLIENT_ERRORS:
            k += 1
            time.sleep(0.2)
        finally:
            safe_close(conn)


def queue_depth(cluster, queue, fallback_node):
    """`messages` (ready + unacked) as the leader's management API reports it (or
    fallback_node's, when no leader is known); raises OSError if it does not answer."""
    leader = cluster.leader_of(queue)
    info = cluster.queue_info(leader if leader is not None else fallback_node, queue)
    if info is None:
        # A partitioned queue's logical name has no record of its own: its partitions'
        # sum (`<queue>-0`, `<queue>-1`, ... up to the first missing one).
        total, i = None, 0
        while True:
            part = f"{queue}-{i}"
            leader = cluster.leader_of(part)
            pinfo = cluster.queue_info(leader if leader is not None else fallback_node, part)
            if pinfo is None:
                return total
            total = (total or 0) + (pinfo.get("messages") or 0)
            i += 1
    return info.get("messages")


def sweep(cluster, nodes, queue, history, deadline=30.0, via="sweep", prefetch=50):
    """Consume whatever is left in `queue` through `nodes` (recording and acking every
    delivery) until the leader's management API reports 0 messages. Returns the number
    delivered. (A consumer, not basic.get: it also receives messages that come back from a
    dead node's consumers while it runs.)"""
    end = time.monotonic() + deadline
    fetched, k = [], 0
    while True:
        node = nodes[k % len(nodes)]
        conn = None
        try:
            conn = cluster.connect(node)
            ch = conn.channel()
            ch.basic_qos(prefetch_count=prefetch)

            def on_message(c, method, props, body, node=node):
                history.deliver(body_id(body), method.redelivered, cluster.nodes[node].name, via)
                c.basic_ack(method.delivery_tag)
                fetched.append(1)

            ch.basic_consume(queue, on_message)
            while time.monotonic() < end:
                conn.process_data_events(time_limit=0.3)
                if queue_depth(cluster, queue, node) == 0:
                    # Acks were sent before the depth was read; pump once more in case a
                    # delivery raced the read, then it is empty.
                    conn.process_data_events(time_limit=0)
                    return len(fetched)
        except CLIENT_ERRORS:
            k += 1
            time.sleep(0.2)
        finally:
            safe_close(conn)
        if time.monotonic() > end:
            raise AssertionError(f"sweep of {queue} (consuming via "
                                 f"{[cluster.nodes[i].name for i in nodes]}) did not empty it "
                                 f"within {deadline}s; {len(fetched)} delivered meanwhile\n"
                                 f"{cluster.diagnose(queue)}")


# ---------------------------------------------------------------------------------------------
# The total-queue checker's workers
# ---------------------------------------------------------------------------------------------

class Worker(threading.Thread):
    """A daemon thread that records an unexpected exception (a bug in the harness or an
    exception type nobody expected) instead of dying silently."""

    def __init__(self, name):
        super().__init__(name=name, daemon=True)
        self.crash = None

    def run(self):
        try:
            self.work()
        except Exception:   # noqa: BLE001 - reported by the checker
            self.crash = traceback.format_exc()


class Publisher(Worker):
    """Publishes ids f"p{n}-{k}" with confirms until stopped, one at a time. A nack, a return
    or an error before the confirm republishes the same id (recorded as retried); connection
    errors move to the next node."""

    def __init__(self, cluster, queue, history, number, stop, watchdog, stats,
                 confirm_timeout=20.0):
        super().__init__(f"publisher-{number}")
        self.c, self.queue, self.h, self.n = cluster, queue, history, number
        self.stop, self.watchdog, self.stats = stop, watchdog, stats
        self.confirm_timeout = confirm_timeout
        self.node = number % len(cluster)

    def work(self):
        conn = ch = None
        k, pending = 0, None
        while not self.stop.is_set():
            if ch is None:
                try:
                    conn = self.c.connect(self.node)
                    ch = conn.channel()
                    with self.watchdog.guard(conn, self.confirm_timeout, "confirm.select"):
                        ch.confirm_delivery()
                    self.stats["publisher connects"] += 1
                except CLIENT_ERRORS as e:
                    self.stats[f"publisher connect error {type(e).__name__}"] += 1
                    safe_close(conn)
                    conn = ch = None
                    self.node = (self.node + 1) % len(self.c)
                    self.stop.wait(0.2)
                    continue
            if pending is None:
                pending = f"p{self.n}-{k}"
                k += 1
            mid = pending
            self.h.attempt(mid)
            try:
                with self.watchdog.guard(conn, self.confirm_timeout, "confirm"):
                    ch.basic_publish("", self.queue, mid.encode(),
                                     pika.BasicProperties(delivery_mode=2, message_id=mid),
                                     mandatory=True)
                self.h.confirm(mid)
                pending = None
            except (pika.exceptions.NackError, pika.exceptions.UnroutableError) as e:
                self.h.retry(mid, f"{type(e).__name__} via {self.c.nodes[self.node].name}")
                self.stats[f"publish {type(e).__name__}"] += 1
                # No leader (an election): back off a little instead of spinning on nacks.
                self.stop.wait(0.05)
            except CLIENT_ERRORS as e:
                self.h.retry(mid, f"{type(e).__name__} via {self.c.nodes[self.node].name}")
                self.stats[f"publish {type(e).__name__}"] += 1
                safe_close(conn)
                conn = ch = None
                self.node = (self.node + 1) % len(self.c)
        safe_close(conn)


class Consumer(Worker):
    """Consumes with manual acks, recording each delivery before acking it. Reconnects to the
    next node on any error, on a broker-sent basic.cancel, or when asked (`reconnect`)."""

    def __init__(self, cluster, queue, history, stop, watchdog, stats, prefetch=100, node=0):
        super().__init__("consumer")
        self.c, self.queue, self.h = cluster, queue, history
        self.stop, self.watchdog, self.stats = stop, watchdog, stats
        self.prefetch, self.node = prefetch, node
        self.reconnect = threading.Event()
        self.cancels = []   # (history time, node) of each basic.cancel the broker sent

    def work(self):
        while not self.stop.is_set():
            conn = None
            cancelled = []
            node = self.node
            try:
                conn = self.c.connect(node)
                ch = conn.channel()
                name = self.c.nodes[node].name

                def on_message(c, method, props, body):
                    self.h.deliver(body_id(body), method.redelivered, name, "consumer")
                    c.basic_ack(method.delivery_tag)

                with self.watchdog.guard(conn, 20.0, "consume"):
                    ch.basic_qos(prefetch_count=self.prefetch)
                    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame))
                    ch.basic_consume(self.queue, on_message)
                self.stats["consumer connects"] += 1
                while not (self.stop.is_set() or cancelled or self.reconnect.is_set()):
                    conn.process_data_events(time_limit=0.2)
                if cancelled:
                    self.stats[f"consumer cancelled by broker on {name}"] += 1
                    self.cancels.append((self.h._t(), name))
                    self.node = (self.node + 1) % len(self.c)
                if self.reconnect.is_set():
                    self.reconnect.clear()
                    self.stats["consumer stall reconnects"] += 1
                    self.node = (self.node + 1) % len(self.c)
            except CLIENT_ERRORS as e:
                self.stats[f"consumer {type(e).__name__}"] += 1
                self.node = (self.node + 1) % len(self.c)
                self.stop.wait(0.2)
            finally:
                safe_close(conn)


FAULT_KINDS = ("kill9", "pause", "term", "partition", "killall", "membership", "transfer")
PARTITION_MODES = ("reset", "blackhole", "mixed")


class FaultInjector(Worker):
    """Applies faults one at a time until stopped, then heals each and waits for recovery:
      kill9      kill -9 one node, restart it 0.5-3 s later;
      pause      SIGSTOP one node for 3-5 s (beyond the election timeout), then SIGCONT;
      term       SIGTERM one node and restart it;
      partition  cut a minority off (the leader alone, or random nodes) for 4-8 s, beyond the
                 election timeout, then reconnect (partition_mode: "reset" or "blackhole"
                 new connections across the cut, or "mixed": either at random);
      killall    kill -9 every node, restart them all 0.2-2 s later;
      membership remove a random member of the queue (the leader or not) through the
                 management API, wait until the leader no longer lists it, add it back and
                 wait until it is listed again;
      transfer   hand the queue's leadership to another member at random (POST
                 .../leader through a random node), under load.
    Half the node faults hit the queue's current leader. order="random" picks each kind at
    random; "cycle" takes every kind once per round (in a random order), so a short run still
    applies each. After healing a fault it waits until every node (the healed ones included)
    names the same confirmed leader, so at most one fault is ever in effect; a fault that does
    not recover ends the injector with an error."""

    def __init__(self, cluster, queue, stop, rng, kinds=("kill9", "pause"), leader_bias=0.5,
                 recover_deadline=30.0, order="random", partition_mode="mixed"):
        super().__init__("faults")
        self.c, self.queue, self.stop, self.rng = cluster, queue, stop, rng
        self.kinds, self.leader_bias = list(kinds), leader_bias
        unknown = set(self.kinds) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
        if partition_mode not in PARTITION_MODES:
            raise ValueError(f"partition_mode must be one of {PARTITION_MODES}")
        if "partition" in self.kinds and cluster.proxy is None:
            raise ValueError("partition faults need a proxied cluster")
        self.recover_deadline = recover_deadline
        self.order, self.partition_mode = order, partition_mode
        self._round = []
        self.applied = collections.Counter()
        self.log = []       # (t, kind, node(s), was_leader, held_s, recovered_s)
        self.errors = []

    def _next_kind(self):
        if self.order == "cycle":
            if not self._round:
                self._round = self.rng.sample(self.kinds, len(self.kinds))
            return self._round.pop()
        return self.rng.choice(self.kinds)

    def work(self):
        t0 = time.monotonic()
        while not self.stop.wait(self.rng.uniform(1.0, 2.5)):
            leader = self.c.leader_of(self.queue)
            if leader is not None and self.rng.random() < self.leader_bias:
                victim = leader
            else:
                victim = self.rng.randrange(len(self.c))
            kind = self._next_kind()
            t = time.monotonic() - t0
            impaired = {victim}
            name = self.c.nodes[victim].name
            # The fault's duration is the fault itself, not synchronisation.
            try:
                if kind == "kill9":
                    self.c.kill9(victim)
                    held = self.rng.uniform(0.5, 3.0)
                    time.sleep(held)
                    self.c.restart(victim)
                elif kind == "pause":
                    self.c.pause(victim)
                    held = self.rng.uniform(3.0, 5.0)
                    time.sleep(held)
                    self.c.resume(victim)
                elif kind == "term":
                    held = 0.0
                    self.c.stop(victim)
                    self.c.restart(victim)
                elif kind == "partition":
                    impaired, mode, held = self._partition(victim)
                    name = "+".join(self.c.nodes[i].name for i in sorted(impaired)) + f" ({mode})"
                elif kind == "killall":
                    impaired = set(range(len(self.c)))
                    name = "all"
                    self.c.kill_all()
                    held = self.rng.uniform(0.2, 2.0)
                    time.sleep(held)
                    self.c.restart_all()
                elif kind == "membership":
                    member, held = self._membership(leader)
                    impaired = {member}
                    name = self.c.nodes[member].name
                elif kind == "transfer":
                    target, held = self._transfer(leader)
                    impaired = {target}
                    name = self.c.nodes[target].name
            except Exception as e:   # noqa: BLE001 - e.g. a node that fails to restart
                self.errors.append(f"+{t:.1f}s {kind} {name}: {e}")
                try:
                    self.c.heal()
                except Exception as e2:   # noqa: BLE001
                    self.errors.append(f"heal after the failed fault: {e2}")
                return
            self.applied[kind] += 1
            recovered = self._recover(impaired)
            self.log.append((round(t, 2), kind, name, leader in impaired, round(held, 2),
                             recovered))
            if recovered is None:
                return

    def _partition(self, victim):
        """Cut a minority containing `victim` off from the rest for 4-8 s, then reconnect.
        Returns (the minority, the mode, seconds held)."""
        n = len(self.c)
        size = self.rng.randint(1, max(1, (n - 1) // 2))
        others = [i for i in range(n) if i != victim]
        minority = {victim, *self.rng.sample(others, size - 1)}
        mode = self.partition_mode
        if mode == "mixed":
            mode = self.rng.choice(("reset", "blackhole"))
        self.c.partition([sorted(minority)], mode=mode)
        held = self.rng.uniform(4.0, 8.0)
        try:
            time.sleep(held)
        finally:
            self.c.heal_network()
        return minority, mode, held

    def _membership(self, leader):
        """Remove a random member of the queue and add it back (see class doc). Returns (the
        member's index, seconds it stayed out)."""
        deadline = self.recover_deadline
        if leader is None:
            leader = self.c.wait_for_leader(self.queue, deadline=deadline)
        members = queue_members(self.c, leader, self.queue)
        if not members:
            raise AssertionError(f"{self.c.nodes[leader].name} lists no members of "
                                 f"{self.queue}")
        member = self.rng.choice(sorted(members))
        name = self.c.nodes[member].name
        change_member(self.c, self.queue, name, add=False, deadline=deadline)
        wait_members(self.c, self.queue, lambda m: member not in m, deadline=deadline,
                     what=f"the leader no longer listing {name}")
        held = self.rng.uniform(0.5, 2.0)
        time.sleep(held)
        change_member(self.c, self.queue, name, add=True, deadline=deadline)
        wait_members(self.c, self.queue, lambda m: member in m, deadline=deadline,
                     what=f"the leader listing {name} again")
        return member, held

    def _transfer(self, leader):
        """Hand leadership to a random other member (see class doc). Returns (the new
        leader's index, seconds the handover took)."""
        if leader is None:
            leader = self.c.wait_for_leader(self.queue, deadline=self.recover_deadline)
        members = sorted((queue_members(self.c, leader, self.queue) or set()) - {leader})
        if not members:
            raise AssertionError(f"{self.queue} has no member to hand over to")
        target = self.rng.choice(members)
        start = time.monotonic()
        transfer_leader(self.c, self.queue, self.c.nodes[target].name,
                        via=self.rng.choice(self.c.up_nodes()))
        return target, time.monotonic() - start

    def _recover(self, healed):
        """Seconds until every node (the healed ones included) names the same confirmed
        leader; None (and an error) if that does not happen within the deadline."""
        start = time.monotonic()
        try:
            self.c.wait_for_agreement(self.queue, include=set(healed),
                                      deadline=self.recover_deadline)
        except AssertionError as e:
            names = sorted(self.c.nodes[i].name for i in healed)
            self.errors.append(f"after healing {names}: {e}")
            return None
        return round(time.monotonic() - start, 2)


# ---------------------------------------------------------------------------------------------
# Membership changes and replica agreement (management API)
# ---------------------------------------------------------------------------------------------

def queue_members(cluster, i, queue):
    """The members node i lists for `queue`, as a set of indices (None if it has no record
    or does not answer)."""
    try:
        info = cluster.queue_info(i, queue, timeout=2.0)
    except OSError:
        return None
    if info is None:
        return None
    return {cluster.node_index(m) for m in info.get("members") or []} - {None}


class MembershipUnsupported(AssertionError):
    """The binary has no members endpoint (404 with an empty body: no such route)."""


class MembershipRefused(AssertionError):
    """The broker refused the change (a 4xx with a reason: already a member, not a member,
    no such node, the last member)."""


def change_member(cluster, queue, name, add, deadline=30.0):
    """POST /api/queues/%2F/<queue>/members {"node": name} (add=True) or DELETE
    .../members/<name>, through the leader (another node while there is none). No answer or a
    5xx is retried until `deadline`; a refusal (4xx) is final, except that after an attempt
    with an unknown outcome "already a member" / "not a member" means it was done. The
    answer comes before the change is in effect: poll wait_members. Returns (node index used,
    status, body). Raises MembershipUnsupported if the route does not exist."""
    base = cluster.queue_path(queue) + "/members"
    end = time.monotonic() + deadline
    last = None
    k = 0
    done_already = "already a member" if add else "not a member"
    while True:
        leader = cluster.leader_of(queue)
        ups = cluster.up_nodes()
        via = leader if leader is not None else (ups[k % len(ups)] if ups else None)
        k += 1
        if via is not None:
            try:
                if add:
                    status, body = cluster.mgmt_request(via, "POST", base, body={"node": name},
                                                        timeout=10.0)
                else:
                    status, body = cluster.mgmt_request(
                        via, "DELETE", f"{base}/{urllib.parse.quote(name, safe='')}",
                        timeout=10.0)
                if 200 <= status < 300:
                    cluster._event(f"{'add' if add else 'remove'} member {name} of {queue} via "
                                   f"{cluster.nodes[via].name}: {status}")
                    return via, status, body
                if status in (404, 405) and not body:
                    raise MembershipUnsupported(
                        f"{'POST' if add else 'DELETE'} {base}: {status} with no body (the "
                        f"binary has no membership endpoints)")
                reason = str((body or {}).get("reason", body) if isinstance(body, dict)
                             else body)
                if 400 <= status < 500:
                    if last is not None and done_already in reason:
                        return via, status, body
                    raise MembershipRefused(
                        f"{'adding' if add else 'removing'} member {name} of {queue} via "
                        f"{cluster.nodes[via].name}: {status} {reason}")
                last = f"{cluster.nodes[via].name}: {status} {body!r}"[:300]
            except OSError as e:
                last = f"{cluster.nodes[via].name}: {e}"
        if time.monotonic() > end:
            raise AssertionError(f"{'adding' if add else 'removing'} member {name} of {queue} "
                                 f"kept failing for {deadline}s; last: {last}\n"
                                 f"{cluster.describe(queue)}")
        time.sleep(0.3)


def wait_members(cluster, queue, check, deadline=30.0, what="membership"):
    """Poll until the queue's confirmed leader lists members (indices) for which check()
    holds; returns them."""
    end = time.monotonic() + deadline
    seen = None
    while True:
        leader = cluster.leader_of(queue)
        if leader is not None:
            seen = queue_members(cluster, leader, queue)
            if seen is not None and check(seen):
                return seen
        if time.monotonic() > end:
            raise AssertionError(f"{what} not reached within {deadline}s; leader "
                                 f"{leader} lists {seen}\n{cluster.describe(queue)}")
        time.sleep(0.1)


def transfer_leader(cluster, queue, name, via=0, timeout=30.0):
    """POST /api/queues/%2F/<queue>/leader {"node": name} through node `via`; asserts it
    answered 200 naming `name` as the leader. Returns the answer's body."""
    status, body = cluster.mgmt_request(via, "POST", cluster.queue_path(queue) + "/leader",
                                        body={"node": name}, timeout=timeout)
    cluster._event(f"hand {queue} to {name} via {cluster.nodes[via].name}: {status} {body}")
    assert status == 200 and (body or {}).get("leader") == name, (status, body)
    return body


def membership_supported(cluster, queue):
    """Whether the binary has the members endpoint: a POST adding a node that is already a
    member is refused (400 "already a member") or accepted, rather than answered 404 with no
    body (no such route)."""
    leader = cluster.wait_for_leader(queue)
    members = queue_members(cluster, leader, queue) or {leader}
    try:
        change_member(cluster, queue, cluster.nodes[min(members)].name, add=True,
                      deadline=10.0)
    except MembershipUnsupported:
        return False
    except MembershipRefused:
        return True     # "already a member": the route exists
    return True


def raft_views(cluster, queue):
    """{node: its `raft` object for `queue`} from every node that is up and answers (a node
    whose record has no `raft` maps to None)."""
    views = {}
    for i in cluster.up_nodes():
        try:
            info = cluster.queue_info(i, queue, timeout=2.0)
        except OSError:
            continue
        if info is not None:
            raft = info.get("raft")
            views[i] = raft if isinstance(raft, dict) else None
    return views


def check_replicas(cluster, queue, deadline=20.0):
    """After the traffic stopped: poll every up node's `raft` (applied_index, term, digest,
    role of its own replica) until all report the same applied_index, then compare their
    digests. Returns a dict: supported (False: no node reports `raft`, nothing checked),
    agree (True, False, or None when the indexes never converged), index, nodes, views,
    summary."""
    end = time.monotonic() + deadline
    views = {}
    while True:
        views = raft_views(cluster, queue)
        if views and all(v is None for v in views.values()):
            return {"supported": False, "agree": None, "index": None, "nodes": len(views),
                    "views": {}, "summary": "replica agreement not checked (the binary "
                                            "reports no `raft` for the queue)"}
        indexes = {v.get("applied_index") for v in views.values() if v is not None}
        if (views and None not in views.values() and len(indexes) == 1
                and len(views) == len(cluster.up_nodes())):
            break
        if time.monotonic() > end:
            named = {cluster.nodes[i].name: v for i, v in views.items()}
            if not views:
                return {"supported": None, "agree": None, "index": None, "nodes": 0,
                        "views": {}, "summary": f"REPLICAS NOT CHECKED: no node reported "
                                                f"{queue} within {deadline}s"}
            return {"supported": True, "agree": None, "index": None, "nodes": len(views),
                    "views": named,
                    "summary": f"REPLICAS DID NOT CONVERGE: applied indexes still differ after "
                               f"{deadline}s with no traffic: {named}"}
        time.sleep(0.2)
    named = {cluster.nodes[i].name: v for i, v in views.items()}
    index = indexes.pop()
    digests = {v.get("digest") for v in views.values()}
    if len(digests) == 1 and None not in digests:
        return {"supported": True, "agree": True, "index": index, "nodes": len(views),
                "views": named,
                "summary": f"replicas agree at index {index} over {len(views)} nodes"}
    return {"supported": True, "agree": False, "index": index, "nodes": len(views),
            "views": named,
            "summary": f"REPLICAS DISAGREE at index {index}: digests {named}"}


CHECK_QUEUE_TYPES = ("quorum", "classic", "partitioned")
# A partitioned quorum queue of this many partitions, keyed by message id: its publishers and
# consumer use the logical name; leader-directed faults aim at its first partition.
CHECK_PARTITIONS = 3
# A classic queue has one copy on its home node: no members to change, no leadership to move.
CLASSIC_FAULT_KINDS = ("kill9", "pause", "term", "partition", "killall")


def declare_classic(cluster, i, queue, deadline=30.0):
    """Declare durable classic `queue` through node i (its home), retrying as declare_quorum."""
    end = time.monotonic() + deadline
    while True:
        conn = None
        try:
            conn = cluster.connect(i)
            conn.channel().queue_declare(queue, durable=True)
            return
        except CLIENT_ERRORS as e:
            if time.monotonic() > end:
                raise AssertionError(f"declare of {queue} on {cluster.nodes[i].name} kept "
                                     f"failing for {deadline}s: {e!r}") from e
            time.sleep(0.2)
        finally:
            safe_close(conn)


def run_total_queue_check(cluster, seconds=30.0, seed=None, publishers=2,
                          kinds=("kill9", "pause"), queue=None, drain_deadline=90.0,
                          order="random", partition_mode="mixed", replica_deadline=20.0,
                          until_each_kind=False, queue_type="quorum"):
    """One run of the total-queue checker on a started cluster. Returns a dict with the
    CheckResult ("result"), fault counts, client statistics, the replica-agreement check
    ("replicas", see check_replicas) and any errors ("errors": faults that did not recover,
    workers that crashed, replicas that disagree or never converge); the caller asserts.
    `order` and `partition_mode` go to the FaultInjector. With queue_type "classic" the
    queue is a durable classic queue homed on a random node, and the publishers and the
    consumer start on the other nodes (everything goes through proxies to the home; faults
    hit the home half the time, as they hit a quorum queue's leader)."""
    if queue_type not in CHECK_QUEUE_TYPES:
        raise ValueError(f"queue_type must be one of {CHECK_QUEUE_TYPES}")
    if queue_type == "classic" and set(kinds) - set(CLASSIC_FAULT_KINDS):
        raise ValueError(f"classic queues take only the faults {CLASSIC_FAULT_KINDS}")
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    queue = queue or f"cluster.check.{queue_type}.{uuid.uuid4().hex[:10]}"
    history = History()
    stats = collections.Counter()
    watchdog = Watchdog()
    pub_stop, fault_stop, cons_stop = threading.Event(), threading.Event(), threading.Event()
    errors = []
    log(f"checker: seed={seed} seconds={seconds} queue={queue} nodes={len(cluster)} "
        f"faults={list(kinds)} order={order} partition_mode={partition_mode} "
        f"proxied={cluster.proxied} type={queue_type}")

    n = len(cluster)
    # The queue whose leader faults aim at and whose replicas are compared (a partitioned
    # queue's partitions: each is checked).
    probe, replicated = queue, [queue]
    if queue_type == "classic":
        home = rng.randrange(n)
        declare_classic(cluster, home, queue)
        elsewhere = [i for i in range(n) if i != home] or [home]
    elif queue_type == "partitioned":
        declare_quorum(cluster, 0, queue, arguments={
            "x-partitions": CHECK_PARTITIONS, "x-partition-key": "property:message_id"})
        replicated = [f"{queue}-{i}" for i in range(CHECK_PARTITIONS)]
        probe = replicated[0]
        elsewhere = list(range(n))
    else:
        declare_quorum(cluster, 0, queue)
        elsewhere = list(range(n))
    wait_visible(cluster, queue, range(n))
    for q in replicated:
        cluster.wait_for_leader(q)

    consumer = Consumer(cluster, queue, history, cons_stop, watchdog, stats,
                        node=rng.choice(elsewhere))
    pubs = [Publisher(cluster, queue, history, k, pub_stop, watchdog, stats)
            for k in range(publishers)]
    if queue_type == "classic":
        for k, p in enumerate(pubs):
            p.node = elsewhere[k % len(elsewhere)]
    faults = FaultInjector(cluster, probe, fault_stop, rng, kinds=kinds, order=order,
                           partition_mode=partition_mode)
    workers = [consumer, *pubs, faults]
    replicas = None
    try:
        for w in workers:
            w.start()
        end = time.monotonic() + seconds
        # until_each_kind: past `seconds`, go on (up to `seconds` more) until every kind was
        # applied once, so a short run still covers each.
        hard_end = end + (seconds if until_each_kind else 0.0)
        while not any(w.crash for w in workers):
            now = time.monotonic()
            uncovered = until_each_kind and faults.is_alive() and set(kinds) - set(faults.applied)
            if now >= hard_end or (now >= end and not uncovered):
                break
            time.sleep(0.2)     # the run's duration; workers report through `history`
        # Stop publishing, then let the fault in progress heal.
        pub_stop.set()
        for p in pubs:
            p.join(timeout=60)
        fault_stop.set()
        faults.join(timeout=90)
        errors += faults.errors
        try:
            cluster.heal()
        except RuntimeError as e:
            errors.append(f"heal failed: {e}")
        log(f"checker: faults healed ({dict(faults.applied)}); draining "
            f"{len(history.missing())} confirmed ids not yet delivered")
        try:
            for q in replicated:
                cluster.wait_for_leader(q)
        except AssertionError as e:
            errors.append(str(e))
        # Drain: the consumer keeps going until every confirmed id was delivered. If it makes
        # no progress for 10 s it is moved to another node (counted in stats).
        drain_end = time.monotonic() + drain_deadline
        while history.missing() and time.monotonic() < drain_end and consumer.is_alive():
            if time.monotonic() - history.last_delivery > 10.0:
                history.last_delivery = time.monotonic()
                consumer.reconnect.set()
            time.sleep(0.1)
        if history.missing():
            errors.append(f"drain: {len(history.missing())} confirmed ids still undelivered "
                          f"after {drain_deadline}s\n{cluster.diagnose(queue)}")
        cons_stop.set()
        consumer.join(timeout=30)
        # Whatever is left (unconfirmed publishes that committed, returns of messages the
        # consumer held when it stopped) is consumed by a last sweep.
        try:
            stats["swept after drain"] += sweep(cluster, cluster.up_nodes(), queue, history)
        except AssertionError as e:
            errors.append(str(e))
        # No traffic now: every replica must reach the same applied index and state (a
        # classic queue has one copy).
        if queue_type == "classic":
            replicas = {"supported": False, "agree": None, "index": None, "nodes": 1,
                        "views": {}, "summary": "classic queue: one copy, on its home"}
        else:
            for q in replicated:
                replicas = check_replicas(cluster, q, deadline=replica_deadline)
                log(f"checker: {q}: {replicas['summary']}")
                if replicas["supported"] is not False and not replicas["agree"]:
                    errors.append(f"{q}: {replicas['summary']}")
    finally:
        pub_stop.set()
        fault_stop.set()
        cons_stop.set()
        for w in workers:
            w.join(timeout=30)
        watchdog.close()
    for w in workers:
        if w.crash:
            errors.append(f"worker {w.name} crashed:\n{w.crash}")
        elif w.is_alive():
            errors.append(f"worker {w.name} did not stop")
    for i, rc in cluster.crashed():
        errors.append(f"{cluster.nodes[i].name} exited on its own (rc={rc})")
    stats.update({f"client timeout {k}": v for k, v in watchdog.timeouts.items()})
    leader = cluster.leader_of(probe)
    result = history.check()
    if not result.ok or errors:
        path = cluster.root / f"history-{queue}.json"
        history.dump(path)
        errors.append(f"history written to {path}")
        cluster.keep = True
    if cluster.proxy is not None:
        stats.update({f"proxy {k}": v for k, v in cluster.proxy.stats.items()
                      if not k.startswith(("forwarded ", "refused ", "black-holed n"))})
    return {"seed": seed, "queue": queue, "result": result, "faults": faults.applied,
            "fault_log": faults.log, "stats": stats, "errors": errors,
            "final_leader": leader, "consumer_cancels": consumer.cancels,
            "replicas": replicas}


def summarize(runs):
    """One line over several checker runs."""
    faults = collections.Counter()
    for r in runs:
        faults.update(r["faults"])

    def total(attr):
        values = [getattr(r["result"], attr) for r in runs]
        return sum(len(v) if isinstance(v, list) else v for v in values)

    replicas = "; ".join(r["replicas"]["summary"] for r in runs if r.get("replicas"))
    return (f"cluster total-queue check: runs={len(runs)} "
            f"faults={dict(sorted(faults.items()))} confirmed={total('confirmed')} "
            f"lost={total('lost')} unexpected={total('unexpected')} "
            f"duplicates={total('duplicates')} (not allowed: {total('bad_duplicates')}) "
            f"retried={total('retried')} seeds={[r['seed'] for r in runs]}"
            + (f"; {replicas}" if replicas else ""))


def env_number(name, default, kind=float):
    try:
        return kind(os.environ.get(name, default))
    except ValueError:
        return kind(default)


def check_env():
    """(seconds, runs, seed or None, fault kinds) from WARREN_CLUSTER_CHECK_SECONDS,
    WARREN_CLUSTER_CHECK_RUNS, WARREN_CLUSTER_CHECK_SEED, WARREN_CLUSTER_FAULTS."""
    seed = os.environ.get("WARREN_CLUSTER_CHECK_SEED")
    kinds = fault_kinds_env("WARREN_CLUSTER_FAULTS", "kill9,pause")
    return (env_number("WARREN_CLUSTER_CHECK_SECONDS", 30.0),
            env_number("WARREN_CLUSTER_CHECK_RUNS", 1, int),
            int(seed) if seed else None, kinds)


def fault_kinds_env(name, default):
    """A comma list of fault kinds from the environment variable `name` (or `default`)."""
    return tuple(k.strip() for k in os.environ.get(name, default).split(",") if k.strip())


def partition_mode_env():
    """WARREN_CLUSTER_PARTITION_MODE: reset, blackhole or mixed (the default)."""
    mode = os.environ.get("WARREN_CLUSTER_PARTITION_MODE", "mixed")
    return mode if mode in PARTITION_MODES else "mixed"


if __name__ == "__main__":
    sys.exit("use test_cluster.py (pytest) or scripts/cluster_soak.py")
