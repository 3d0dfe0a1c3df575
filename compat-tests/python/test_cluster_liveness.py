"""Liveness per node (issue 42): a quorum queue's group sends no heartbeats of its own; each
node pings its peers and, for every group it serves, elects when the leader's node falls
silent and retries followers that lag. On real `warren server` processes (cluster_harness).

What is asserted: idle queues cost the cluster port next to nothing (/api/nodes'
`cluster_links` byte counters, as RabbitMQ lists its distribution links); idle queues whose
leader's node stops answering (SIGSTOP, the socket stays open) get new leaders and the old
leader follows once resumed; a follower killed and restarted while its queues took writes
catches up with no new write to carry it.
"""

import os
import time
import uuid

import pytest

from cluster_harness import (check_replicas, cluster_supported, declare_quorum, eventually,
                             publish_with_retry)

if os.environ.get("WARREN_TEST_AMQP_URL"):
    pytest.skip("cluster tests start their own Warren nodes", allow_module_level=True)
_SUPPORTED, _WHY = cluster_supported()
if not _SUPPORTED:
    pytest.skip(_WHY, allow_module_level=True)

from cluster_harness import History, cluster_factory  # noqa: E402,F401 (fixture)

DEADLINE = 30.0


def link_bytes(cluster, i):
    """Node i's (sent, received) bytes over its cluster links, summed over its peers."""
    status, nodes = cluster.mgmt_request(i, "GET", "/api/nodes", timeout=10)
    assert status == 200, (status, nodes)
    me = next(n for n in nodes if n["name"] == cluster.nodes[i].name)
    links = me["cluster_links"]
    return (sum(link["stats"]["send_bytes"] for link in links),
            sum(link["stats"]["recv_bytes"] for link in links))


def replicas_agree(cluster, queue):
    """Every up node's replica of `queue` reaches one applied index with one digest
    (cluster_harness.check_replicas); returns the index."""
    r = check_replicas(cluster, queue, deadline=DEADLINE)
    assert r["agree"], r["summary"]
    return r["index"]


def test_idle_queues_cost_the_cluster_port_next_to_nothing(cluster_factory):
    """100 quorum queues, each written once, then idle: over 4 s each node receives less than
    16 bytes per queue per second from its peers (pings only). One AppendEntries heartbeat
    per group and follower, openraft's own every 450 ms, is several times that."""
    c = cluster_factory(3)
    queues = [f"idle{k}-" + uuid.uuid4().hex[:4] for k in range(100)]
    for k, q in enumerate(queues):
        declare_quorum(c, k % 3, q)
    history = History()
    for k, q in enumerate(queues):
        publish_with_retry(c, [k % 3], q, [f"m-{k}"], history)
    for q in queues[:5]:
        replicas_agree(c, q)
    # A leader sends one heartbeat a second after its log last moved (the commit point
    # again): a timer, nothing to await; let those of the last writes go out first.
    time.sleep(1.5)
    # The links carry counts from the start; the window's difference is what idling costs.
    before = [link_bytes(c, i) for i in range(3)]
    started = time.monotonic()
    time.sleep(4.0)  # the idle window measured (no event to await: nothing must happen)
    after = [link_bytes(c, i) for i in range(3)]
    window = time.monotonic() - started
    budget = len(queues) * window * 16
    for i in range(3):
        received = after[i][1] - before[i][1]
        sent = after[i][0] - before[i][0]
        assert received < budget, (f"n{i + 1} received {received} bytes in {window:.1f} s "
                                   f"from its peers while 100 queues idled (budget {budget:.0f})")
        assert sent < budget, (f"n{i + 1} sent {sent} bytes in {window:.1f} s while 100 "
                               f"queues idled (budget {budget:.0f})")
    # The counters count: the writes above crossed the links.
    assert all(b[0] > 0 and b[1] > 0 for b in before), before


def test_idle_queues_of_a_silent_leader_elect_and_the_old_leader_follows(cluster_factory):
    """Six idle queues led by n1; n1 is paused (SIGSTOP: its sockets stay open, so only its
    silence tells): each queue gets a leader among n2 and n3, takes writes there, and once
    n1 resumes it follows (its replica reaches the others' index and digest)."""
    c = cluster_factory(3)
    queues = [f"silent{k}-" + uuid.uuid4().hex[:4] for k in range(6)]
    for q in queues:
        declare_quorum(c, 0, q)
    for q in queues:
        leader = c.wait_for_leader(q)
        if leader != 0:
            status, body = c.mgmt_request(1, "POST", c.queue_path(q) + "/leader",
                                          {"node": "n1"}, timeout=30)
            assert status == 200, (status, body)
    for q in queues:
        eventually(lambda q=q: c.leader_of(q), lambda v: v == 0, DEADLINE, f"n1 leads {q}")
    c.pause(0)
    try:
        for q in queues:
            new = c.wait_for_leader(q, exclude={0}, deadline=DEADLINE)
            assert new in (1, 2), new
        history = History()
        for k, q in enumerate(queues):
            publish_with_retry(c, [1, 2], q, [f"m-{k}"], history)
    finally:
        c.resume(0)
    for q in queues:
        replicas_agree(c, q)
        assert c.leader_of(q) in (1, 2), q


def test_a_restarted_follower_catches_up_without_another_write(cluster_factory):
    """n3 is killed while its queues take writes, restarted, and reaches the others' index
    and digest though nothing is written after it came back (openraft retries a failed
    append by itself; the node's watch would retry a follower that stays behind)."""
    c = cluster_factory(3)
    queues = [f"behind{k}-" + uuid.uuid4().hex[:4] for k in range(4)]
    for q in queues:
        declare_quorum(c, 0, q)
        c.wait_for_leader(q)
    c.kill9(2)
    history = History()
    for k, q in enumerate(queues):
        publish_with_retry(c, [0, 1], q, [f"m-{k}-{n}" for n in range(50)], history)
    c.start_node(2)
    for q in queues:
        index = replicas_agree(c, q)
        assert index > 50, (q, index)
