"""Streams replicated across a 3-node cluster (real nodes over TCP): every member holds the
same offsets, a publish is confirmed after the majority committed it, any member serves
readers, a killed leader loses no confirmed message, and a restarted member catches up."""

import time
import uuid

import pika
import pytest

from cluster_harness import (CLIENT_ERRORS, History, eventually, publish_with_retry,
                             safe_close, wait_visible, declare_quorum)
from cluster_harness import cluster3, cluster_factory  # noqa: F401 (fixtures)

STREAM = {"x-queue-type": "stream"}
LEADER_DEADLINE = 30.0


def read_all(cluster, i, queue, n, deadline=20.0, arguments=None, ack=True):
    """[(offset, body)] of the first `n` messages of `queue` read through node i from
    `first` unless `arguments` say otherwise (prefetch n, acked after the cancel unless
    `ack` is false: see test_streams.read)."""
    end = time.monotonic() + deadline
    while True:
        conn = None
        try:
            conn = cluster.connect(i)
            ch = conn.channel()
            ch.basic_qos(prefetch_count=n)
            got = []
            tag = ch.basic_consume(
                queue, lambda c, m, p, b: got.append((p.headers["x-stream-offset"],
                                                      b.decode(), m.delivery_tag)),
                arguments=arguments or {"x-stream-offset": "first"})
            while len(got) < n:
                assert time.monotonic() < end, f"{len(got)} of {n} read through node {i}"
                conn.process_data_events(time_limit=0.1)
            ch.basic_cancel(tag)
            if ack:
                ch.basic_ack(got[-1][2], multiple=True)
                ch.basic_qos(prefetch_count=n)  # a round trip: the ack was handled
            return [g[:2] for g in got]
        except CLIENT_ERRORS:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)
        finally:
            safe_close(conn)


def stream_len(cluster, i, queue):
    info = cluster.queue_info(i, queue)
    return info["messages"] if info else None


@pytest.mark.timeout(180)
def test_replicated_stream_survives_leader_kill9_and_a_member_catches_up(cluster3):
    c = cluster3
    queue = f"cluster.stream.{uuid.uuid4().hex[:10]}"
    declare_quorum(c, 0, queue, arguments=STREAM)
    wait_visible(c, queue, range(3), deadline=10.0)
    leader = c.wait_for_leader(queue, deadline=LEADER_DEADLINE)
    info = eventually(lambda: c.queue_info(leader, queue),
                      lambda i: i is not None and len(i.get("members", [])) == 3,
                      what="three members")
    assert info["type"] == "stream", info
    f1, f2 = [i for i in range(3) if i != leader]

    history = History()
    first = [f"a-{k}" for k in range(100)]
    publish_with_retry(c, [f1], queue, first, history)
    # Every member serves readers, and all hold the same offsets and messages.
    views = [read_all(c, i, queue, 100) for i in range(3)]
    assert views[0] == views[1] == views[2]
    assert [o for o, _ in views[0]] == list(range(100))
    assert [b for _, b in views[0]] == first

    # A named consumer's offset is replicated: acked through one node, it resumes on another.
    named = {"x-stream-consumer-name": "billing"}
    read_all(c, f1, queue, 30, arguments={**named, "x-stream-offset": "first"})

    def tracked_on(i):
        info = c.queue_info(i, queue) or {}
        return {t["name"]: t["offset"] for t in info.get("stream", {}).get("consumers", [])}

    eventually(lambda: tracked_on(f2), lambda t: t.get("billing") == 30,
               what="billing's offset replicated to another node")
    assert read_all(c, f2, queue, 1, arguments=named, ack=False) == [(30, first[30])]

    c.kill9(leader)
    new_leader = c.wait_for_leader(queue, exclude={leader}, deadline=LEADER_DEADLINE)
    assert new_leader != leader
    second = [f"b-{k}" for k in range(100)]
    publish_with_retry(c, [f2, f1], queue, second, history)
    total = eventually(lambda: stream_len(c, f1, queue), lambda n: n and n >= 200,
                       what="200 messages on a survivor")
    survivors = [read_all(c, i, queue, total) for i in (f1, f2)]
    assert survivors[0] == survivors[1]
    offsets = [o for o, _ in survivors[0]]
    assert offsets == list(range(total)), "offsets contiguous from 0"
    bodies = [b for _, b in survivors[0]]
    # Every confirmed message is there (a retried publish may be there twice).
    assert set(first + second) <= set(bodies)
    assert bodies[:100] == first

    # The killed member comes back and catches up from the group's log.
    c.restart(leader)
    eventually(lambda: stream_len(c, leader, queue), lambda n: n == total, deadline=60.0,
               what="the restarted member holding every message")
    assert read_all(c, leader, queue, total) == survivors[0]
    for i in range(3):
        tail = c.log_tail(i, lines=5000)
        assert "do not match its log" not in tail, tail
        assert "cannot append" not in tail, tail


@pytest.mark.timeout(180)
def test_a_member_behind_the_purged_log_catches_up_from_a_snapshot(cluster_factory, monkeypatch):
    """With snapshots every 20 entries (and 2 kept), a member that was down while 150
    one-message entries were committed is behind the leader's purged log: it gets a snapshot
    with the chunks it lacks, and then holds exactly what the others hold."""
    monkeypatch.setenv("WARREN_STREAM_SNAPSHOT_EVERY", "20")
    c = cluster_factory(3)
    queue = f"cluster.stream.{uuid.uuid4().hex[:10]}"
    declare_quorum(c, 0, queue, arguments=STREAM)
    wait_visible(c, queue, range(3), deadline=10.0)
    leader = c.wait_for_leader(queue, deadline=LEADER_DEADLINE)
    behind = next(i for i in range(3) if i != leader)
    other = next(i for i in range(3) if i not in (leader, behind))
    history = History()
    publish_with_retry(c, [leader], queue, [f"a-{k}" for k in range(30)], history)
    c.kill9(behind)
    # One confirmed publish at a time: one entry (one chunk) each.
    publish_with_retry(c, [leader, other], queue, [f"b-{k}" for k in range(150)], history)
    total = eventually(lambda: stream_len(c, leader, queue), lambda n: n and n >= 180,
                       what="180 messages on the leader")
    want = read_all(c, leader, queue, total)
    c.restart(behind)
    eventually(lambda: stream_len(c, behind, queue), lambda n: n == total, deadline=60.0,
               what="the member that was down holding every message")
    assert read_all(c, behind, queue, total) == want
    assert [o for o, _ in want] == list(range(total))
    tail = c.log_tail(behind, lines=5000)
    assert "catches up from a snapshot" in tail, "the member caught up from the log instead"
    assert "cannot append" not in tail, tail
