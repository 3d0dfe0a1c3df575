"""Cluster operations: `warren ctl cluster_status` and quorum queue membership
(`warren ctl queues add_member|delete_member|grow|shrink`, the management API's
/api/queues/{vhost}/{queue}/members), on real `warren server` processes (cluster_harness).

What is asserted is what an operator relies on: a node added to a queue holds its data (the
queue survives losing every original member), a removed member no longer votes (the queue
keeps serving with it stopped), changes under a confirmed publish load lose nothing, refusals
carry rabbitmq-queues' exit codes, and every replica ends with the same state at the same
applied index.
"""

import contextlib
import json
import os
import subprocess
import threading
import time
import uuid

import pytest

from cluster_harness import (History, cluster_supported, declare_quorum, drain_until,
                             eventually, log, publish_with_retry)

if os.environ.get("WARREN_TEST_AMQP_URL"):
    pytest.skip("cluster tests start their own Warren nodes", allow_module_level=True)
_SUPPORTED, _WHY = cluster_supported()
if not _SUPPORTED:
    pytest.skip(_WHY, allow_module_level=True)

from cluster_harness import cluster_factory  # noqa: E402,F401 (fixture)

DEADLINE = 30.0


def ctl(cluster, i, *args, timeout=90):
    """`warren ctl --data-dir <node i's> args...` -> CompletedProcess (text)."""
    return subprocess.run([cluster.binary, "ctl", "--data-dir", str(cluster.nodes[i].data_dir),
                           *args], capture_output=True, text=True, timeout=timeout)


def poll(fetch, check, deadline=DEADLINE, what="condition"):
    """cluster_harness.eventually with this file's deadline."""
    return eventually(fetch, check, deadline, what)


def members(cluster, i, queue):
    info = cluster.queue_info(i, queue) or {}
    return sorted(info.get("members") or [])


def replicas_agree(cluster, queue, nodes, deadline=DEADLINE):
    """Wait until every node in `nodes` reports the same applied index for its replica of
    `queue`, then assert their state digests are equal; returns (index, digest)."""
    def states():
        return {i: (cluster.queue_info(i, queue) or {}).get("raft") for i in nodes}

    seen = poll(states, lambda s: all(s.values())
                and len({r["applied_index"] for r in s.values()}) == 1,
                deadline, f"replicas of {queue} at one applied index")
    digests = {cluster.nodes[i].name: r["digest"] for i, r in seen.items()}
    assert len(set(digests.values())) == 1, f"replicas differ at one index: {seen}"
    first = next(iter(seen.values()))
    return first["applied_index"], first["digest"]


def raft_series(cluster, i, queue):
    """rabbitmq_raft_* values of `queue` in node i's /metrics/per-object."""
    import urllib.request
    url = f"http://127.0.0.1:{cluster.nodes[i].prom_port}/metrics/per-object"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("rabbitmq_raft_") and f'queue="{queue}"' in line:
            out[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_cluster_status_lists_nodes_and_drops_a_killed_one(cluster_factory):
    c = cluster_factory(3)

    def status():
        return cluster_status(c, 0)

    # A node counts a peer as running once it has heard from it: moments after the start.
    poll(status, lambda s: s["running_nodes"] == ["n1", "n2", "n3"], what="all nodes running")
    r = ctl(c, 0, "cluster_status")
    assert r.returncode == 0, r.stderr
    assert "Cluster status of node n1" in r.stdout
    for name in ("n1", "n2", "n3"):
        assert name in r.stdout.split("Running Nodes")[1], r.stdout
    c.kill9(2)
    s = poll(status, lambda s: "n3" not in s["running_nodes"], what="n3 reported down")
    assert s["disk_nodes"] == ["n1", "n2", "n3"]
    c.start_node(2)
    poll(status, lambda s: s["running_nodes"] == ["n1", "n2", "n3"], what="n3 back")


def test_a_grown_queue_survives_losing_its_only_original_member(cluster_factory):
    """A 1-member queue grown to 3 replicates to the new members: with the original member
    killed, the others elect a leader and deliver every confirmed message."""
    c = cluster_factory(3)
    q = "grow-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, q, arguments={"x-quorum-initial-group-size": 1})
    [only] = poll(lambda: members(c, 0, q), lambda m: len(m) == 1, what="one member")
    original = c.node_index(only)
    h = History()
    ids = [f"g{k}" for k in range(200)]
    publish_with_retry(c, [original], q, ids, h)
    others = [i for i in range(3) if i != original]
    r = ctl(c, others[0], "queues", "grow", c.nodes[others[0]].name, "all")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"/\t{q}\t2\tok" in r.stdout, r.stdout
    r = ctl(c, original, "queues", "add_member", q, c.nodes[others[1]].name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert members(c, original, q) == ["n1", "n2", "n3"]
    index, _ = replicas_agree(c, q, range(3))
    # Prometheus has rabbitmq_prometheus' Raft series for each node's replica (at or past the
    # index they agreed at: the leader may yet commit the new voters' promotion).
    for i in range(3):
        series = raft_series(c, i, q)
        assert series["rabbitmq_raft_log_last_applied_index"] >= index, (i, series)
        assert (series["rabbitmq_raft_log_last_written_index"]
                >= series["rabbitmq_raft_log_last_applied_index"]), (i, series)
        assert series["rabbitmq_raft_term_total"] >= 1, (i, series)
    c.kill9(original)
    c.wait_for_leader(q, exclude={original})
    drain_until(c, others, q, h, ids, deadline=DEADLINE)
    assert set(ids) <= h.deliveries.keys()


def test_a_removed_member_no_longer_counts_towards_the_majority(cluster_factory):
    """After delete_member, a 3-node queue has 2 voters: killing the removed node changes
    nothing, and with one of the two remaining stopped the queue cannot commit (a learner does
    not vote) until it is back."""
    c = cluster_factory(3)
    q = "shrink-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, q)
    leader = c.wait_for_leader(q)
    removed = next(i for i in range(3) if i != leader)
    r = ctl(c, leader, "queues", "delete_member", q, c.nodes[removed].name)
    assert r.returncode == 0, r.stdout + r.stderr
    kept = sorted(c.nodes[i].name for i in range(3) if i != removed)
    assert members(c, leader, q) == kept
    # The removed node learns it with the log (moments after the leader).
    poll(lambda: (c.queue_info(removed, q) or {}).get("raft", {}).get("role"),
         lambda role: role == "learner", what="the removed member a learner")
    c.kill9(removed)
    h = History()
    publish_with_retry(c, [leader], q, ["a1", "a2"], h)
    remaining = next(i for i in range(3) if i not in (leader, removed))
    c.kill9(remaining)
    # One voter of two is not a majority: the publish is not confirmed while it is alone.
    conn = c.connect(leader)
    ch = conn.channel()
    ch.confirm_delivery()
    confirmed = threading.Event()

    def publish():
        try:
            ch.basic_publish("", q, b"a3")
            confirmed.set()
        except Exception as e:  # noqa: BLE001 (a nack or a closed channel is the point)
            log(f"publish without a majority failed as expected: {e!r}")

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    # Waiting for an event that must not happen: beyond an election timeout and a retry.
    assert not confirmed.wait(6.0), "confirmed by one voter of two"
    c.start_node(remaining)
    c.start_node(removed)
    c.wait_for_leader(q)
    drain_until(c, [leader, remaining, removed], q, h, ["a1", "a2"], deadline=DEADLINE)


def test_a_removed_leader_hands_over_to_a_member(cluster_factory):
    """delete_member of the queue's leader: it stops leading (a learner now) and one of the
    two remaining members leads, as every node reports; the queue serves on."""
    c = cluster_factory(3)
    q = "oust-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, q)
    h = History()
    publish_with_retry(c, [0], q, ["before"], h)
    leader = c.wait_for_leader(q)
    name = c.nodes[leader].name
    r = ctl(c, (leader + 1) % 3, "queues", "delete_member", q, name)
    assert r.returncode == 0, r.stdout + r.stderr
    kept = {i for i in range(3) if i != leader}
    poll(lambda: {c.reported_leader(i, q) for i in range(3)},
         lambda s: len(s) == 1 and s <= kept, what="every node naming a kept member")
    poll(lambda: (c.queue_info(leader, q) or {}).get("raft", {}).get("role"),
         lambda role: role == "learner", what=f"{name} a learner")
    publish_with_retry(c, [leader], q, ["after"], h)
    drain_until(c, [leader], q, h, ["before", "after"])


def test_membership_refusals(cluster_factory):
    c = cluster_factory(3)
    q = "refuse-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, q, arguments={"x-quorum-initial-group-size": 1})
    [only] = poll(lambda: members(c, 0, q), lambda m: len(m) == 1, what="one member")
    r = ctl(c, 0, "queues", "add_member", q, "nosuchnode")
    assert r.returncode == 69 and "no node nosuchnode" in r.stderr, (r.returncode, r.stderr)
    r = ctl(c, 0, "queues", "add_member", q, only)
    assert r.returncode == 65 and "already a member" in r.stderr, (r.returncode, r.stderr)
    other = next(n.name for n in c.nodes if n.name != only)
    r = ctl(c, 0, "queues", "delete_member", q, other)
    assert r.returncode == 65 and "not a member" in r.stderr, (r.returncode, r.stderr)
    r = ctl(c, 0, "queues", "delete_member", q, only)
    assert r.returncode == 65 and "at least one member" in r.stderr, (r.returncode, r.stderr)
    r = ctl(c, 0, "queues", "add_member", "no-such-queue", only)
    assert r.returncode == 69, (r.returncode, r.stderr)
    assert members(c, 0, q) == [only]


@contextlib.contextmanager
def confirmed_load(c, q, prefix):
    """Two publishers with confirms (through n1 and n2, each falling back on the next node)
    publish ids `prefix`0, 1, ... to `q` in batches of 100 until the block ends; yields their
    History and asserts at the end that neither gave up."""
    h = History()
    stop = threading.Event()
    errors = []
    ids = iter(f"{prefix}{k}" for k in range(10**9))

    def publisher(node):
        while not stop.is_set():
            batch = [next(ids) for _ in range(100)]
            try:
                publish_with_retry(c, [node, (node + 1) % 3], q, batch, h, deadline=60.0)
            except AssertionError as e:
                errors.append(str(e))
                return

    threads = [threading.Thread(target=publisher, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    try:
        yield h
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors


def settle(c, q, h):
    """Drain `q` until every confirmed id was delivered, check the history (lost 0,
    unexpected 0, only allowed duplicates) and that all replicas agree; logs the outcome."""
    drain_until(c, [0, 1, 2], q, h, set(h.confirmed), deadline=60.0)
    index, _ = replicas_agree(c, q, range(3))
    result = h.check()
    assert result.ok, result.describe()
    log(f"replicas agree at index {index}; {result.summary()}")


def test_membership_changes_under_load_lose_nothing(cluster_factory):
    """Publishers with confirms and an acking consumer run while members are removed and
    added again (the leader among them); then every confirmed id is delivered, and all
    replicas agree."""
    c = cluster_factory(3)
    q = "churn-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, q)
    changes = 0
    churn_until = time.monotonic() + 10.0
    with confirmed_load(c, q, "c") as h:
        round_ = 0
        while round_ < 4 or time.monotonic() < churn_until:
            round_ += 1
            leader = c.wait_for_leader(q)
            # Alternate: the leader itself, then a follower.
            victim = leader if round_ % 2 == 0 else (leader + 1) % 3
            name = c.nodes[victim].name
            via = (victim + 2) % 3
            r = ctl(c, via, "queues", "delete_member", q, name)
            assert r.returncode == 0, r.stdout + r.stderr
            r = ctl(c, via, "queues", "add_member", q, name)
            assert r.returncode == 0, r.stdout + r.stderr
            changes += 2
    log(f"membership churn: {changes} changes, {len(h.confirmed)} confirmed")
    # Load while members changed (the exact rate depends on the machine).
    assert len(set(h.confirmed)) >= 200
    settle(c, q, h)
    assert members(c, 0, q) == ["n1", "n2", "n3"]


def api(cluster, i, method, path, body=None):
    """`method` `path` on node i's management API as guest, with a cluster change's time to
    commit: (status, parsed JSON or None)."""
    return cluster.mgmt_request(i, method, path, body, timeout=30)


def test_definitions_replicate_to_every_node_and_survive_a_restart(cluster_factory):
    """Users, vhosts, permissions, topic permissions, policies, operator policies and limits
    made through one node are on every node once the API answered (the change committed),
    a client logs in with them anywhere, deletes cascade everywhere, and a restarted node
    keeps them."""
    import pika
    c = cluster_factory(3)
    ok = (201, 204)
    assert api(c, 0, "PUT", "/api/users/alice",
               {"password": "s3cret", "tags": "management"})[0] in ok
    assert api(c, 1, "PUT", "/api/vhosts/v1", {"default_queue_type": "quorum"})[0] in ok
    # A change is acknowledged once committed and applied on the node that made it; the
    # others apply it as the log reaches them (moments later), as they route from their copy.
    for i in range(3):
        poll(lambda: (api(c, i, "GET", "/api/users/alice")[0],
                      api(c, i, "GET", "/api/vhosts/v1")[0]),
             lambda s: s == (200, 200), what=f"alice and v1 on n{i + 1}")
    assert api(c, 2, "PUT", "/api/permissions/v1/alice",
               {"configure": ".*", "write": ".*", "read": ".*"})[0] in ok
    assert api(c, 0, "PUT", "/api/topic-permissions/v1/alice",
               {"exchange": "amq.topic", "write": "^a", "read": ".*"})[0] in ok
    assert api(c, 1, "PUT", "/api/policies/v1/ttl",
               {"pattern": "^ttl\\.", "definition": {"message-ttl": 60000},
                "apply-to": "queues"})[0] in ok
    assert api(c, 2, "PUT", "/api/operator-policies/v1/cap",
               {"pattern": ".*", "definition": {"max-length": 1000},
                "apply-to": "queues"})[0] in ok
    assert api(c, 0, "PUT", "/api/vhost-limits/v1/max-queues", {"value": 50})[0] in ok
    assert api(c, 1, "PUT", "/api/user-limits/alice/max-channels", {"value": 7})[0] in ok

    def view(i):
        return {
            "user": api(c, i, "GET", "/api/users/alice")[1],
            "vhost": (api(c, i, "GET", "/api/vhosts/v1")[1] or {}).get("default_queue_type"),
            "perm": api(c, i, "GET", "/api/permissions/v1/alice")[1],
            "topic": api(c, i, "GET", "/api/topic-permissions/v1/alice")[1],
            "policy": (api(c, i, "GET", "/api/policies/v1/ttl")[1] or {}).get("definition"),
            "op": (api(c, i, "GET", "/api/operator-policies/v1/cap")[1] or {})
            .get("definition"),
            "vlimits": api(c, i, "GET", "/api/vhost-limits/v1")[1],
            "ulimits": api(c, i, "GET", "/api/user-limits/alice")[1],
        }

    views = dict(enumerate(poll(
        lambda: [view(i) for i in range(3)],
        lambda vs: all(all(v.values()) for v in vs) and vs[0] == vs[1] == vs[2],
        what="the same definitions on every node")))
    for i, v in views.items():
        assert v["user"] and v["user"]["name"] == "alice", (i, v)
        assert v["vhost"] == "quorum", (i, v)
        assert v["perm"] and v["perm"]["write"] == ".*", (i, v)
        assert v["topic"] and v["topic"][0]["write"] == "^a", (i, v)
        assert v["policy"] == {"message-ttl": 60000}, (i, v)
        assert v["op"] == {"max-length": 1000}, (i, v)
        assert v["vlimits"][0]["value"]["max-queues"] == 50, (i, v)
        assert v["ulimits"][0]["value"]["max-channels"] == 7, (i, v)
    # The password (its hash) travels too: alice logs in on a node she was not made on.
    conn = pika.BlockingConnection(c.amqp_params(2, virtual_host="v1",
                                                 credentials=pika.PlainCredentials(
                                                     "alice", "s3cret")))
    conn.channel().queue_declare("ttl.q", durable=True)
    conn.close()
    # A restarted node keeps what the cluster told it.
    c.stop(1)
    c.start_node(1)
    assert view(1) == views[0]
    # Deleting the vhost takes its permissions and policies everywhere; the user goes too.
    assert api(c, 1, "DELETE", "/api/vhosts/v1")[0] in ok
    assert api(c, 2, "DELETE", "/api/users/alice")[0] in ok
    for i in range(3):
        poll(lambda: [api(c, i, "GET", p)[0] for p in
                      ("/api/vhosts/v1", "/api/users/alice", "/api/policies/v1/ttl",
                       "/api/permissions/v1/alice")],
             lambda s: s == [404] * 4, what=f"deletes on n{i + 1}")


def _certs(tmp_path):
    from pathlib import Path
    gen = Path(c_binary()).parent / "gen-test-certs"
    if not gen.exists():
        pytest.skip(f"{gen} not built (cargo build -p warren-compat-tests)")
    subprocess.run([str(gen), str(tmp_path)], check=True, timeout=60)
    return tmp_path


def c_binary():
    from conftest import warren_binary
    return warren_binary()


def tls_args(d, node="node"):
    return ["--cluster-tls-cert", str(d / f"{node}.pem"), "--cluster-tls-key",
            str(d / f"{node}.key"), "--cluster-tls-ca", str(d / "ca.pem")]


def test_cluster_port_over_tls_keeps_out_nodes_without_the_cas_certificate(cluster_factory,
                                                                            tmp_path):
    """With cluster TLS, a 3-node cluster forms and replicates; the cluster port answers a
    plain-TCP peer with nothing it can use; a node restarted with a certificate from another
    CA is not heard from, while the other two go on confirming."""
    import socket
    d = _certs(tmp_path)
    c = cluster_factory(3, extra_args=tls_args(d))
    q = "tls-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, q)
    h = History()
    publish_with_retry(c, [0], q, [f"t{k}" for k in range(50)], h)
    drain_until(c, [2], q, h, [f"t{k}" for k in range(50)])
    # Plain TCP gets no cluster protocol: a TLS server answers a non-TLS hello with an alert
    # (or nothing) and closes.
    with socket.create_connection(("127.0.0.1", c.nodes[1].cluster_port), timeout=10) as s:
        s.sendall(b"\x00\x00\x00\x10" + b"\x01" * 16)
        got = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        assert got[:1] in (b"", b"\x15"), got[:16]   # empty, or a TLS alert record
    # n3 comes back with a certificate of an untrusted CA: the others never hear from it.
    c.stop(2)
    c.extra_args = tls_args(d, "rogue-node")
    c.start_node(2)

    def running():
        r = ctl(c, 0, "cluster_status", "--formatter", "json")
        return json.loads(r.stdout)["running_nodes"]

    poll(running, lambda r: r == ["n1", "n2"], what="n3 (untrusted) not running")
    publish_with_retry(c, [0, 1], q, ["after"], h)
    raft = (c.queue_info(2, q) or {}).get("raft") or {}
    leader_raft = c.queue_info(c.wait_for_leader(q), q)["raft"]
    assert raft.get("applied_index", 0) < leader_raft["applied_index"], (raft, leader_raft)


def add_node(c, extra):
    """Give cluster `c` a node n{len+1} with its own ports and data dir, started (by
    c.start_node like the others) with its cluster identity and `extra` flags; returns its
    index."""
    from cluster_harness import Node
    i = len(c.nodes)
    node = Node(i, c.root)
    c.nodes.append(node)
    plain = c.command

    def command(k):
        if k != i:
            return plain(k)
        return [c.binary, "server",
                "--amqp-listen", f"127.0.0.1:{node.amqp_port}",
                "--management-listen", f"127.0.0.1:{node.mgmt_port}",
                "--prometheus-listen", f"127.0.0.1:{node.prom_port}",
                "--data-dir", str(node.data_dir), "--log-level", c.log_level,
                "--node-name", node.name, "--cluster-listen", f"127.0.0.1:{node.cluster_port}",
                "--cluster-secret", c.secret, *extra(node)]

    c.command = command
    return i


def add_joining_node(c, seeds):
    """A node that joins through `seeds` (indices) with --join."""
    return add_node(c, lambda node: [
        "--join", "--peers",
        ",".join([f"{c.nodes[s].name}@127.0.0.1:{c.nodes[s].cluster_port}" for s in seeds]
                 + [f"{node.name}@127.0.0.1:{node.cluster_port}"])])


def cluster_status(c, i):
    """`warren ctl cluster_status --formatter json` on node i, parsed."""
    r = ctl(c, i, "cluster_status", "--formatter", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_running(c, nodes, everyone):
    """Wait until each of `nodes` lists exactly `everyone` as running."""
    for i in nodes:
        poll(lambda i=i: cluster_status(c, i), lambda s: s["running_nodes"] == everyone,
             what=f"{everyone} running as n{i + 1} sees it")


def test_a_node_joins_a_running_cluster_and_is_forgotten(cluster_factory):
    """n4 joins a running 3-node cluster through one seed (--join): it learns the queues and
    definitions, becomes a queue member and serves, keeps its identity across a restart, and
    once stopped and forgotten it leaves the metadata group and every queue."""
    c = cluster_factory(3)
    q = "join-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, q)
    h = History()
    ids = [f"j{k}" for k in range(100)]
    publish_with_retry(c, [0], q, ids, h)
    assert api(c, 1, "PUT", "/api/users/bob", {"password": "pw", "tags": ""})[0] in (201, 204)
    n4 = add_joining_node(c, seeds=[1])
    c.start_node(n4)

    everyone = ["n1", "n2", "n3", "n4"]
    wait_running(c, (0, n4), everyone)
    # What was there before it joined: the queue (with its messages) and the user.
    poll(lambda: c.queue_info(n4, q), lambda x: x and x.get("messages") == 100,
         what="the queue on n4")
    assert api(c, n4, "GET", "/api/users/bob")[0] == 200
    r = ctl(c, n4, "queues", "add_member", q, "n4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert members(c, 0, q) == everyone
    drain_until(c, [n4], q, h, ids)
    # A restart keeps its identity (its node number comes from its data directory).
    c.stop(n4)
    c.start_node(n4)
    wait_running(c, (n4,), everyone)
    publish_with_retry(c, [n4], q, ["after-restart"], h)
    # Forgetting: refused while it runs, then done once it is stopped.
    r = ctl(c, 0, "forget_cluster_node", "n4")
    assert r.returncode == 65 and "is running" in r.stderr, (r.returncode, r.stderr)
    r = ctl(c, 0, "forget_cluster_node", "n9")
    assert r.returncode == 69, (r.returncode, r.stderr)
    c.kill9(n4)
    poll(lambda: cluster_status(c, 0), lambda s: "n4" not in s["running_nodes"], what="n4 down")
    r = ctl(c, 0, "forget_cluster_node", "n4")
    assert r.returncode == 0, r.stdout + r.stderr
    for i in range(3):
        poll(lambda: cluster_status(c, i)["disk_nodes"], lambda d: d == ["n1", "n2", "n3"],
             what=f"n4 forgotten on n{i + 1}")
    poll(lambda: members(c, 0, q), lambda m: m == ["n1", "n2", "n3"],
         what="n4 no longer a member")
    # The three go on: a majority of three, not of four.
    c.kill9(2)
    publish_with_retry(c, [0, 1], q, ["after-forget"], h)
    drain_until(c, [0, 1], q, h, ["after-restart", "after-forget"])


def add_lone_node(c):
    """A node that runs alone but has a cluster identity (no --peers)."""
    return add_node(c, lambda node: [])


def test_join_cluster_makes_a_lone_node_a_member(cluster_factory):
    """`warren ctl join_cluster` on a node running alone: refused while it holds a queue of
    its own; once it holds nothing, the node restarts into the cluster (same process), learns
    its queues, serves as a member, and stays in the cluster across a restart with the same
    command line."""
    c = cluster_factory(3)
    q = "joined-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, q)
    h = History()
    ids = [f"jc{k}" for k in range(50)]
    publish_with_retry(c, [0], q, ids, h)
    n4 = add_lone_node(c)
    c.start_node(n4)
    pid = c.nodes[n4].proc.pid
    seed = f"{c.nodes[1].name}@127.0.0.1:{c.nodes[1].cluster_port}"
    # A node with something of its own is not joined (RabbitMQ wants it reset first).
    assert api(c, n4, "PUT", c.queue_path("mine"), {"durable": True})[0] in (201, 204)
    r = ctl(c, n4, "join_cluster", seed)
    assert r.returncode == 69 and "has queues" in r.stderr, (r.returncode, r.stdout, r.stderr)
    assert api(c, n4, "DELETE", c.queue_path("mine"))[0] == 204
    r = ctl(c, n4, "join_cluster", seed)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"Clustering node n4 with {seed}" in r.stdout, r.stdout
    # The same process, restarted in place.
    assert c.nodes[n4].proc.poll() is None and c.nodes[n4].proc.pid == pid

    everyone = ["n1", "n2", "n3", "n4"]
    wait_running(c, (0, n4), everyone)
    poll(lambda: c.queue_info(n4, q), lambda x: x and x.get("messages") == 50,
         what="the queue on n4")
    r = ctl(c, n4, "queues", "add_member", q, "n4")
    assert r.returncode == 0, r.stdout + r.stderr
    drain_until(c, [n4], q, h, ids)
    # Its command line has no --peers: the recorded seeds keep it a member.
    c.stop(n4)
    c.start_node(n4)
    wait_running(c, (n4,), everyone)
    publish_with_retry(c, [n4], q, ["after-restart"], h)
    drain_until(c, [n4], q, h, ["after-restart"])
    # A member cannot join again.
    r = ctl(c, n4, "join_cluster", seed)
    assert r.returncode == 69 and "member already" in r.stderr, (r.returncode, r.stderr)


def test_shrink_then_grow_even(cluster_factory):
    """`queues shrink n2` takes n2 out of every queue it is a member of; `grow n2 even` puts
    it back into those with an even number of members only."""
    c = cluster_factory(3)
    three = "three-" + uuid.uuid4().hex[:6]
    one = "one-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, three)
    declare_quorum(c, 0, one, arguments={"x-quorum-initial-group-size": 1})
    [only] = poll(lambda: members(c, 0, one), lambda m: len(m) == 1, what="one member")
    # n2 must not be the single member of `one` for the even/odd split below.
    other = next(n for n in ("n2", "n3") if n != only)
    r = ctl(c, 0, "queues", "shrink", other)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"/\t{three}\t2\tok" in r.stdout, r.stdout
    assert one not in r.stdout, r.stdout
    assert other not in members(c, 0, three)
    r = ctl(c, 0, "queues", "grow", other, "even")
    assert r.returncode == 0, r.stdout + r.stderr
    # `three` has 2 members now (even): grown; `one` has 1 (odd): left alone.
    assert f"/\t{three}\t3\tok" in r.stdout and one not in r.stdout, r.stdout
    assert members(c, 0, three) == ["n1", "n2", "n3"]
    assert members(c, 0, one) == [only]


def leaders_on(cluster, i, queues):
    """{queue: leader name} as node i's queue listing reports them."""
    _, listed = api(cluster, i, "GET", "/api/queues")
    return {q["name"]: q.get("leader") for q in listed or [] if q["name"] in queues}


def test_leadership_handed_over_under_load_loses_nothing(cluster_factory):
    """`queues transfer_leader` moves the leadership to the named member (every node then
    names it), six times round the members while two publishers with confirms run; then every
    confirmed id is delivered and all replicas agree."""
    c = cluster_factory(3)
    q = "handover-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, q)
    took = []
    with confirmed_load(c, q, "h") as h:
        for k in range(6):
            leader = c.wait_for_leader(q)
            target = (leader + 1 + k % 2) % 3
            name = c.nodes[target].name
            start = time.monotonic()
            r = ctl(c, k % 3, "queues", "transfer_leader", q, name)
            took.append(round(time.monotonic() - start, 2))
            assert r.returncode == 0, r.stdout + r.stderr
            assert f"{name} leads {q}" in r.stdout, r.stdout
            # Every node follows the new leader.
            poll(lambda: {c.reported_leader(i, q) for i in range(3)}, lambda s: s == {target},
                 what=f"every node naming {name} the leader")
    log(f"handovers took {took} s (ctl round trips); {len(h.confirmed)} confirmed")
    assert len(set(h.confirmed)) >= 200
    settle(c, q, h)


def test_rebalance_spreads_leaders_over_the_nodes(cluster_factory):
    """Six queues all led by n1 (handed there through the API): `queues rebalance quorum`
    leaves each node leading two, every node's listing agrees, and a second rebalance has
    nothing to move."""
    c = cluster_factory(3)
    queues = [f"rebal{k}-" + uuid.uuid4().hex[:4] for k in range(6)]
    for q in queues:
        declare_quorum(c, k_via(queues, q), q)
    for q in queues:
        leader = c.wait_for_leader(q)
        if c.nodes[leader].name != "n1":
            status, body = api(c, 2, "POST", c.queue_path(q) + "/leader", {"node": "n1"})
            assert status == 200 and body == {"leader": "n1"}, (status, body)
    poll(lambda: leaders_on(c, 1, queues), lambda m: set(m.values()) == {"n1"},
         what="n1 leading every queue")
    r = ctl(c, 1, "queues", "rebalance", "quorum", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("moved\t/\t") == 4, r.stdout
    for line in ("n1\t2", "n2\t2", "n3\t2"):
        assert line in r.stdout, r.stdout
    for i in range(3):
        seen = poll(lambda i=i: leaders_on(c, i, queues),
                    lambda m: len(m) == 6 and None not in m.values(), what="every leader known")
        counts = {n: list(seen.values()).count(n) for n in ("n1", "n2", "n3")}
        assert counts == {"n1": 2, "n2": 2, "n3": 2}, (i, seen)
    status, body = api(c, 0, "POST", "/api/rebalance/queues")
    assert status == 200 and body["moved"] == [] and body["failed"] == [], body
    # A pattern that matches nothing moves nothing and reports no leaders of its queues.
    status, body = api(c, 0, "POST", "/api/rebalance/queues", {"queue_pattern": "^nomatch$"})
    assert status == 200 and body["moved"] == [], body
    assert body["leaders"] == {"n1": 0, "n2": 0, "n3": 0}, body


def k_via(queues, q):
    """Declare round the nodes."""
    return queues.index(q) % 3


def test_handover_refusals(cluster_factory):
    """A handover to a node that is no member is refused (400), as is one to an unknown node
    or of a classic queue (404); the leader stays where it was."""
    c = cluster_factory(3)
    q = "solo-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, q, arguments={"x-quorum-initial-group-size": 1})
    [only] = poll(lambda: members(c, 0, q), lambda m: len(m) == 1, what="one member")
    other = next(n for n in ("n1", "n2", "n3") if n != only)
    status, body = api(c, 0, "POST", c.queue_path(q) + "/leader", {"node": other})
    assert status == 400 and "not a voting member" in body["reason"], (status, body)
    status, body = api(c, 0, "POST", c.queue_path(q) + "/leader", {"node": "n9"})
    assert status == 404 and "no node n9" in body["reason"], (status, body)
    r = ctl(c, 0, "queues", "transfer_leader", q, other)
    assert r.returncode != 0 and "not a voting member" in (r.stdout + r.stderr), r
    at = c.node_index(only)
    assert c.reported_leader(at, q) == at
    classic = "classic-" + uuid.uuid4().hex[:6]
    status, _ = api(c, 0, "PUT", c.queue_path(classic), {"durable": True})
    assert status in (201, 204)
    status, body = api(c, 0, "POST", c.queue_path(classic) + "/leader", {"node": "n2"})
    assert status == 404, (status, body)


@pytest.mark.timeout(180)
def test_five_member_queue_hands_over(cluster_factory):
    """In a group of five the old leader's and the target's votes are no majority: the
    handover waits out the other voters' leader lease (seconds), then the target wins."""
    c = cluster_factory(5)
    q = "five-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, q, arguments={"x-quorum-initial-group-size": 5})
    poll(lambda: members(c, 0, q), lambda m: len(m) == 5, what="five members")
    for k in range(2):
        leader = c.wait_for_leader(q)
        target = (leader + 2) % 5
        name = c.nodes[target].name
        start = time.monotonic()
        status, body = api(c, (leader + 1) % 5, "POST", c.queue_path(q) + "/leader",
                           {"node": name})
        log(f"five-member handover to {name}: {status} {body} in "
            f"{time.monotonic() - start:.2f} s")
        assert status == 200 and body == {"leader": name}, (status, body)
        poll(lambda: {c.reported_leader(i, q) for i in range(5)}, lambda s: s == {target},
             what=f"every node naming {name} the leader")


def test_a_one_node_cluster_serves_quorum_queues_and_keeps_them(cluster_factory):
    """A cluster of one (`--peers` naming only itself): a quorum queue has that one member,
    confirms need only it, and its messages survive a restart; a second node can then join
    it with `join_cluster` and become a member."""
    c = cluster_factory(1)
    q = "solo-cluster-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, q)
    assert members(c, 0, q) == ["n1"]
    h = History()
    ids = [f"s{k}" for k in range(20)]
    publish_with_retry(c, [0], q, ids, h)
    c.stop(0)
    c.start_node(0)
    poll(lambda: c.queue_info(0, q), lambda x: x and x.get("messages") == 20,
         what="the queue after a restart")
    n2 = add_lone_node(c)
    c.start_node(n2)
    r = ctl(c, n2, "join_cluster", f"n1@127.0.0.1:{c.nodes[0].cluster_port}")
    assert r.returncode == 0, r.stdout + r.stderr
    wait_running(c, (0, n2), ["n1", "n2"])
    r = ctl(c, 0, "queues", "add_member", q, "n2")
    assert r.returncode == 0, r.stdout + r.stderr
    drain_until(c, [n2], q, h, ids)


def test_leader_locator_client_local_by_default_balanced_on_request(cluster_factory):
    """Queues declared through n2 are led by n2 (client-local, RabbitMQ's default); one
    declared through n2 with `x-queue-leader-locator: balanced` is led by a member leading
    none; an unknown locator is refused with 406 as RabbitMQ refuses it."""
    import pika.exceptions
    c = cluster_factory(3)
    local = ["local-" + uuid.uuid4().hex[:6] for _ in range(2)]
    for q in local:
        declare_quorum(c, 1, q)
    assert {c.wait_for_leader(q) for q in local} == {1}
    # n2 must know it leads both before it balances against that.
    poll(lambda: leaders_on(c, 1, local), lambda m: set(m.values()) == {"n2"},
         what="n2 seen leading both")
    q = "balanced-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 1, q, arguments={"x-queue-leader-locator": "balanced"})
    assert c.wait_for_leader(q) in (0, 2)
    conn = c.connect(1)
    try:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            conn.channel().queue_declare("bad-" + uuid.uuid4().hex[:6], durable=True,
                                         arguments={"x-queue-type": "quorum",
                                                    "x-queue-leader-locator": "nearest"})
        assert e.value.reply_code == 406
        assert "invalid_queue_locator_arg" in e.value.reply_text, e.value.reply_text
    finally:
        conn.close()


def test_peers_named_by_dns_form_a_cluster_that_replicates(cluster_factory):
    """Peers given by DNS name (`n1@localhost:port`, as a Kubernetes StatefulSet's headless
    service names its pods) are resolved when dialled: the three nodes form a cluster, and a
    quorum queue declared through n1 takes a confirmed message that n3 then gets."""
    import pika

    c = cluster_factory(3, start=False, proxied=False)
    c.peers = ",".join(f"{x.name}@localhost:{x.cluster_port}" for x in c.nodes)
    c.start_all()
    queue = f"dns.{uuid.uuid4().hex[:12]}"
    declare_quorum(c, 0, queue)
    conn = c.connect(0)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("", queue, b"by-name", pika.BasicProperties(delivery_mode=2))
    conn.close()
    conn = c.connect(2)
    ch = conn.channel()
    got = eventually(lambda: ch.basic_get(queue, auto_ack=True),
                     lambda r: r[0] is not None, deadline=DEADLINE,
                     what=f"n3 getting the message of {queue}")
    assert got[2] == b"by-name"
    conn.close()
    poll(lambda: cluster_status(c, 1), lambda s: s["running_nodes"] == ["n1", "n2", "n3"],
         what="n2 seeing every node running")
