"""Partitioned queues and consumer groups in a 3-node cluster (real `warren server` processes,
cluster_harness): the partitions' leaders spread over the nodes; members connected to
different nodes share one assignment (the group table is replicated metadata: every node
shows the same owners); when a member's node is killed with -9 its partitions go to the
members left, and every confirmed message is consumed.

Skipped while the binary has no clustering, and against an external broker."""

import os
import time
import uuid

import pika
import pytest

from cluster_harness import cluster_supported, log, safe_close

if os.environ.get("WARREN_TEST_AMQP_URL"):
    pytest.skip("cluster tests start their own Warren nodes", allow_module_level=True)
_SUPPORTED, _WHY = cluster_supported()
if not _SUPPORTED:
    pytest.skip(_WHY, allow_module_level=True)

from cluster_harness import cluster3, cluster_factory  # noqa: E402,F401 (fixtures)

PARTITIONS = 6


def declare_partitioned(c, i, name, deadline=30.0):
    end = time.monotonic() + deadline
    while True:
        conn = None
        try:
            conn = c.connect(i)
            conn.channel().queue_declare(name, durable=True, arguments={
                "x-partitions": PARTITIONS, "x-queue-type": "quorum",
                "x-partition-key": "header:k"})
            return
        except Exception as e:  # the cluster may still be electing
            assert time.monotonic() < end, f"declare kept failing: {e!r}"
            time.sleep(0.2)
        finally:
            safe_close(conn)


def group_view(c, i, name):
    status, body = c.mgmt_request(i, "GET", f"/api/consumer-groups/%2F/{name}", timeout=5.0)
    assert status == 200, body
    return body


def owners(c, i, name):
    body = group_view(c, i, name)
    return [p["owner"] for p in body[0]["partitions"]] if body else []


def wait_for(what, check, deadline=30.0, pump=()):
    end = time.monotonic() + deadline
    while True:
        for conn in pump:
            conn.process_data_events(time_limit=0.02)
        if check():
            return
        assert time.monotonic() < end, f"{what} not reached within {deadline}s"
        if not pump:
            time.sleep(0.1)


class Member:
    def __init__(self, c, node, name, tag):
        self.node, self.tag = node, tag
        self.conn = c.connect(node)
        self.ch = self.conn.channel()
        self.ch.basic_qos(prefetch_count=50)
        self.got = []
        self.ch.basic_consume(name, self.on, consumer_tag=tag,
                              arguments={"x-consumer-group": "workers"})

    def on(self, ch, m, _p, body):
        self.got.append((body.decode(), m.redelivered))
        ch.basic_ack(m.delivery_tag)


def publish(c, node, name, keys, rounds, start=0):
    conn = c.connect(node)
    ch = conn.channel()
    ch.confirm_delivery()
    sent = []
    for n in range(start, start + rounds):
        for k in keys:
            ch.basic_publish("", name, f"{k}/{n}".encode(),
                             pika.BasicProperties(headers={"k": k}, delivery_mode=2))
            sent.append(f"{k}/{n}")
    safe_close(conn)
    return sent


@pytest.mark.timeout(240)
def test_members_on_three_nodes_share_the_partitions_and_survive_a_node_kill(cluster3):
    c = cluster3
    name = f"orders.{uuid.uuid4().hex[:8]}"
    declare_partitioned(c, 0, name)
    leaders = {}
    wait_for("every partition with a leader", lambda: all(
        c.leader_of(f"{name}-{p}") is not None for p in range(PARTITIONS)))
    for p in range(PARTITIONS):
        leaders[p] = c.leader_of(f"{name}-{p}")
    per_node = [list(leaders.values()).count(i) for i in range(3)]
    log(f"partition leaders per node: {per_node}")
    assert max(per_node) - min(per_node) <= 1, f"leaders not spread: {leaders}"

    members = [Member(c, i, name, f"m{i}") for i in range(3)]
    conns = [m.conn for m in members]

    def settled(tags, nodes):
        views = [owners(c, i, name) for i in nodes]
        return all(v == views[0] for v in views) and views[0] and \
            all(o in tags for o in views[0]) and \
            all(views[0].count(t) == PARTITIONS // len(tags) for t in tags)

    wait_for("one assignment over three nodes", lambda: settled(["m0", "m1", "m2"], range(3)),
             pump=conns)
    view = group_view(c, 1, name)[0]
    assert sorted(m["node"] for m in view["members"]) == sorted(set(m["node"] for m in view["members"]))

    keys = [f"key{i}" for i in range(30)]
    sent = publish(c, 0, name, keys, 5)
    wait_for("every message consumed", lambda: {b for m in members for b, _ in m.got} >= set(sent),
             pump=conns)
    for k in keys:
        holders = [m.tag for m in members if any(b.startswith(k + "/") for b, _ in m.got)]
        assert len(holders) == 1, f"{k} reached {holders}"

    # kill -9 the node of member m2: its partitions go to m0 and m1.
    c.kill9(2)
    members[2].conn = None
    survivors = members[:2]
    conns = [m.conn for m in survivors]
    wait_for("m2's partitions reassigned", lambda: settled(["m0", "m1"], range(2)),
             deadline=60.0, pump=conns)
    more = publish(c, 0, name, keys, 3, start=5)
    wait_for("every later message consumed",
             lambda: {b for m in survivors for b, _ in m.got} >= set(more),
             deadline=60.0, pump=conns)
    for m in survivors:
        for k in keys:
            fresh = [int(b.split("/")[1]) for b, red in m.got if b.startswith(k + "/") and not red]
            assert fresh == sorted(fresh), f"{m.tag} {k}: {fresh}"
    for m in survivors:
        safe_close(m.conn)


class StreamMember(Member):
    """A member of a stream group (prefetch and x-stream-offset as a stream consumer needs)."""

    def __init__(self, c, node, name, tag, group):
        self.node, self.tag = node, tag
        self.conn = c.connect(node)
        self.ch = self.conn.channel()
        self.ch.basic_qos(prefetch_count=100)
        self.got = []
        self.ch.basic_consume(name, self.on, consumer_tag=tag, arguments={
            "x-consumer-group": group, "x-stream-offset": "first"})


@pytest.mark.timeout(240)
def test_a_stream_group_resumes_from_its_offsets_after_a_node_kill(cluster3):
    """A partitioned stream read by a group with members on n2 and n3. n3 is killed with -9:
    its partitions go to the member on n2, which resumes each from the group's replicated
    offset. Every message published (before and after the kill) is read by the group; what
    is read twice is only what n3's member had not acknowledged."""
    c = cluster3
    name = f"events.{uuid.uuid4().hex[:8]}"
    end = time.monotonic() + 30
    while True:
        conn = None
        try:
            conn = c.connect(0)
            conn.channel().queue_declare(name, durable=True, arguments={
                "x-partitions": PARTITIONS, "x-queue-type": "stream",
                "x-partition-key": "header:k"})
            break
        except Exception as e:
            assert time.monotonic() < end, f"declare kept failing: {e!r}"
            time.sleep(0.2)
        finally:
            safe_close(conn)
    wait_for("every partition with a leader", lambda: all(
        c.leader_of(f"{name}-{p}") is not None for p in range(PARTITIONS)))
    members = [StreamMember(c, 1, name, "s1", "audit"), StreamMember(c, 2, name, "s2", "audit")]
    conns = [m.conn for m in members]
    wait_for("two members", lambda: settled_view(c, name, ["s1", "s2"], [0, 1]), pump=conns)
    keys = [f"key{i}" for i in range(24)]
    before = publish(c, 0, name, keys, 4)
    wait_for("the group read everything",
             lambda: {b for m in members for b, _ in m.got} >= set(before), pump=conns)
    # The group's offsets are kept by the streams and replicated: once n1 reports no lag for
    # the group, every partition's offset is past what was read.
    wait_for("the group's offsets on n1", lambda: group_view(c, 0, name)[0]["lag"] == 0,
             pump=conns)
    c.kill9(2)
    survivor = members[0]
    wait_for("s2's partitions with s1", lambda: settled_view(c, name, ["s1"], [0, 1]),
             deadline=60.0, pump=[survivor.conn])
    after = publish(c, 0, name, keys, 2, start=4)
    wait_for("the group read what came after",
             lambda: {b for b, _ in survivor.got} >= set(after), deadline=60.0,
             pump=[survivor.conn])
    read_by_s1 = [b for b, _ in survivor.got]
    again = [b for b in before if read_by_s1.count(b) > 0 and b in
             {x for x, _ in members[1].got}]
    log(f"read again by s1 after the kill: {len(again)} of {len(before)}")
    assert len(again) < len(before) // 2, "s1 resumed from the group's offsets, not from first"
    safe_close(survivor.conn)


def settled_view(c, name, tags, nodes):
    views = [owners(c, i, name) for i in nodes]
    return bool(views[0]) and all(v == views[0] for v in views) and set(views[0]) == set(tags)
