"""A backlog in one quorum queue of a 3-node cluster (real nodes, pika): the replicas keep message
bodies in their logs on disk, not in memory. The CI-sized version of `scripts/quorum_backlog.py`
(which runs 1,000,000 messages and reports the figures in docs/benchmarks.md): every node's RSS
grows by far less per queued message than the bodies' size, a follower killed -9 in the middle
catches up without loading the backlog into memory, and a consumer through another node gets
every message exactly once, bodies intact."""

import os
import time
import uuid

import pytest

from cluster_harness import declare_quorum, eventually, safe_close
from cluster_harness import cluster_factory  # noqa: F401 (fixture)

WARM = 12_000
MESSAGES = 30_000
BODY = 1024
# A replica that held bodies would grow by more than a body per message (it measured about
# 2.3 KB before); metadata alone is about a hundred bytes in a release build at 1M messages
# (docs/benchmarks.md). A debug build's heap over a small backlog measures 180-440 bytes; the
# bound stays below one body.
RSS_PER_MESSAGE_MAX = 800


def rss_bytes(c, i, field="VmRSS"):
    """Node i's resident set (VmRSS), or its peak so far (VmHWM)."""
    for line in open(f"/proc/{c.nodes[i].proc.pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


def depth_on(c, i, q):
    info = c.queue_info(i, q)
    return None if info is None else info.get("messages")


def body(k, size=BODY):
    head = f"m{k:06d}:".encode()
    return head + bytes([k % 251]) * (size - len(head))


def publish(c, i, q, n, first=0, window=1000):
    """Publish n persistent messages through node i, at most `window` ahead of what the queue
    counts there (as a publisher with that many confirms in flight: an unbounded burst would
    measure the buffers of messages in flight, not the queue)."""
    import pika
    conn = c.connect(i)
    try:
        ch = conn.channel()
        props = pika.BasicProperties(delivery_mode=2)
        for k in range(first, first + n):
            if (k - first) % window == 0 and k > first:
                eventually(lambda: depth_on(c, i, q), lambda d, k=k: d is not None and d >= k,
                           60, f"{k} published messages counted")
            ch.basic_publish("", q, body(k), props)
    finally:
        safe_close(conn)


def publish_confirmed(c, i, q, n, size=BODY):
    """Publish body(0) .. body(n - 1) to q through node i, each persistent and confirmed
    before the next: one log entry per message."""
    import pika
    conn = c.connect(i)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        props = pika.BasicProperties(delivery_mode=2)
        for k in range(n):
            ch.basic_publish("", q, body(k, size), props)
    finally:
        safe_close(conn)


def drain(c, i, q, total, size=BODY):
    """Consume and ack q through node i until its `total` messages (body(0) ..) have all come,
    each intact and, unless redelivered, once."""
    seen = set()
    conn = c.connect(i)
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=500)
        deadline = time.monotonic() + 180
        for method, _props, data in ch.consume(q, inactivity_timeout=5):
            if method is None:
                assert time.monotonic() < deadline, f"{len(seen)} of {total} after 180 s"
                continue
            k = int(data[1:7])
            assert data == body(k, size), f"message {k} damaged"
            assert k not in seen or method.redelivered, f"message {k} delivered twice"
            seen.add(k)
            ch.basic_ack(method.delivery_tag)
            if len(seen) == total:
                break
        ch.cancel()
    finally:
        safe_close(conn)
    assert seen == set(range(total))


def read_stream(c, i, q, n):
    """The first n bodies of stream q, read from its first offset through node i."""
    conn = c.connect(i)
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=n)
        got = []
        deadline = time.monotonic() + 60
        for _method, _props, data in ch.consume(q, inactivity_timeout=1,
                                                arguments={"x-stream-offset": "first"}):
            assert time.monotonic() < deadline, f"{len(got)} of {n} read after 60 s"
            if data is not None:
                got.append(data)
            if len(got) == n:
                break
        ch.cancel()
        return got
    finally:
        safe_close(conn)


@pytest.mark.timeout(240)
def test_a_backlog_stays_on_disk_through_a_follower_restart(cluster_factory):
    c = cluster_factory(3)
    q = "backlog-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, q)
    leader = c.wait_for_leader(q)
    follower = next(i for i in range(3) if i != leader)
    # The first WARM messages fill what a log holds whatever the backlog (redb's page cache,
    # the recent bodies, a first snapshot): the growth measured is that of the MESSAGES after.
    publish(c, 0, q, WARM)
    for i in range(3):
        eventually(lambda i=i: depth_on(c, i, q), lambda d: d == WARM, 60, f"n{i + 1} warm")
    time.sleep(1)
    before = [rss_bytes(c, i) for i in range(3)]

    publish(c, 0, q, MESSAGES, first=WARM)
    total = WARM + MESSAGES
    for i in range(3):
        eventually(lambda i=i: depth_on(c, i, q), lambda d: d == total, 120,
                   f"n{i + 1} holding the backlog")
    grown = [(rss_bytes(c, i) - before[i]) / MESSAGES for i in range(3)]
    print(f"RSS per queued message: {[round(g) for g in grown]} bytes (n1..n3)")
    assert max(grown) < RSS_PER_MESSAGE_MAX, (
        f"RSS grew by {[round(g) for g in grown]} bytes per queued {BODY}-byte message")

    # A follower killed -9 and started again catches up (from its own log and the leader's
    # entries) without taking the bodies into memory.
    c.kill9(follower)
    c.start_node(follower)
    eventually(lambda: depth_on(c, follower, q), lambda d: d == total, 120,
               "the restarted follower holding the backlog")
    restarted = rss_bytes(c, follower)
    assert restarted < before[follower] + MESSAGES * RSS_PER_MESSAGE_MAX, (
        f"restarted follower at {restarted >> 20} MB")

    # Drained through the restarted follower: every message once, bodies intact.
    drain(c, follower, q, total)
    for i in range(3):
        eventually(lambda i=i: depth_on(c, i, q), lambda d: d == 0, 60, f"n{i + 1} empty")


PURGED = 6_500


def raft_of(c, i, q):
    info = c.queue_info(i, q)
    return (info or {}).get("raft") or {}


@pytest.mark.timeout(300)
def test_live_messages_keep_their_bodies_when_their_entries_are_purged(cluster_factory):
    """With --quorum-log-pin-max 0 the log is purged past live messages: their bodies are
    copied out of the entries first. A follower restarted after that starts from its snapshot
    and the copies, the leader is killed so another member serves, and every body reads back
    intact through each node."""
    c = cluster_factory(3, extra_args=["--quorum-log-pin-max", "0"])
    q = "purged-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, q)
    leader = c.wait_for_leader(q)
    follower = next(i for i in range(3) if i != leader)
    # One entry per message (each publish waits for its confirm): past the first snapshot
    # (5000 entries) and the 1000 a log keeps before it.
    publish_confirmed(c, leader, q, PURGED)
    for i in range(3):
        eventually(lambda i=i: raft_of(c, i, q).get("purged_index", 0), lambda p: p >= 3000,
                   60, f"n{i + 1} purged past live messages")
        assert depth_on(c, i, q) == PURGED

    c.kill9(follower)
    c.start_node(follower)
    eventually(lambda: depth_on(c, follower, q), lambda d: d == PURGED, 120,
               "the restarted follower holding the queue")
    # The first messages now exist only as copies: read them through a new leader.
    c.kill9(leader)
    drain(c, follower, q, PURGED)


SENT = 6_500
SENT_BODY = 16 * 1024


@pytest.mark.timeout(300)
def test_a_member_behind_the_purged_log_gets_the_bodies_streamed_in_a_snapshot(cluster_factory):
    """A follower down while the leader's log is purged past everything it has gets a snapshot
    carrying the live messages' bodies (about 100 MB here). Neither end holds them in memory:
    the leader writes them to a file, which openraft sends a chunk at a time, and the follower
    writes the chunks to a file and then the bodies to its log in batches; before, both built
    the whole snapshot in memory (twice the bodies on each). Then the follower serves every
    body intact with the old leader gone."""
    c = cluster_factory(3, extra_args=["--quorum-log-pin-max", "0"])
    q = "sent-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, q)
    leader = c.wait_for_leader(q)
    follower = next(i for i in range(3) if i != leader)
    c.kill9(follower)
    # One entry per message, past the first snapshot (5000 entries) and the 1000 kept before it.
    publish_confirmed(c, leader, q, SENT, SENT_BODY)
    eventually(lambda: raft_of(c, leader, q).get("purged_index", 0), lambda p: p >= 3000, 60,
               "the leader's log purged past everything the follower has")
    bodies = SENT * SENT_BODY
    leader_peak = rss_bytes(c, leader, "VmHWM")

    c.start_node(follower)
    eventually(lambda: depth_on(c, follower, q), lambda d: d == SENT, 120,
               "the restarted follower holding the queue")
    log = c.nodes[follower].log_path.read_text(errors="replace")
    assert "installed a snapshot with its bodies" in log, "the follower caught up from a snapshot"
    follower_peak = rss_bytes(c, follower, "VmHWM")
    leader_grew = rss_bytes(c, leader, "VmHWM") - leader_peak
    print(f"bodies {bodies >> 20} MB; follower peak {follower_peak >> 20} MB; "
          f"leader peak grew {leader_grew >> 20} MB")
    assert follower_peak < bodies * 3 // 4, f"follower peaked at {follower_peak >> 20} MB"
    assert leader_grew < bodies // 4, f"the leader's peak grew by {leader_grew >> 20} MB"

    # The follower's copies are all there: read through it with the old leader gone.
    c.kill9(leader)
    drain(c, follower, q, SENT, SENT_BODY)


WAL_SEGMENT = 64 * 1024
WAL_SEGMENTS_SOFT_MAX = 4  # cluster/src/log/queue_logs.rs
ROLLED = 600


def wal_segments(c, i):
    """Node i's write-ahead log segment files (spares not counted)."""
    wal = c.nodes[i].data_dir / "cluster" / "queues" / "wal"
    return sorted(p.name for p in wal.glob("*.wal"))


@pytest.mark.timeout(300)
def test_a_long_wal_makes_the_groups_holding_its_oldest_segment_compact(cluster_factory,
                                                                         monkeypatch):
    """On the write-ahead log with 64 KiB segments: an idle queue and an idle stream hold
    one old message each while another queue passes 600 x 1 KB through (far below the 5000
    entries of a scheduled snapshot). Once a node's WAL holds more than 4 segments, the groups
    holding its oldest snapshot and purge now, the idle queue's body copied out (the stream's
    is in its own files): every node comes back to at most 5 segments. A second 600 then
    make the segment the copy went to the oldest: the copy alone pins it, so it is written
    again and the WAL comes back within its bound once more. Both old messages read back
    intact after a restart of every node."""
    import pika
    monkeypatch.setenv("WARREN_WAL_SEGMENT_BYTES", str(WAL_SEGMENT))
    if "--quorum-log redb" in os.environ.get("WARREN_CLUSTER_EXTRA_ARGS", ""):
        pytest.skip("the write-ahead log's test; the clusters run on redb")
    c = cluster_factory(3)
    idle, busy = "pinning-" + uuid.uuid4().hex[:6], "passing-" + uuid.uuid4().hex[:6]
    stream = "pinning-stream-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, idle)
    declare_quorum(c, 0, busy)
    declare_quorum(c, 0, stream, arguments={"x-queue-type": "stream"})
    leader = c.wait_for_leader(busy)
    conn = c.connect(leader)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        props = pika.BasicProperties(delivery_mode=2)
        ch.basic_publish("", idle, body(0), props)
        ch.basic_publish("", stream, body(1), props)
    finally:
        safe_close(conn)
    for phase in ("the idle logs purged", "the copied body written again"):
        conn = c.connect(leader)
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            for k in range(ROLLED):
                ch.basic_publish("", busy, body(k), props)
        finally:
            safe_close(conn)
        drain(c, leader, busy, ROLLED)
        # 600 KB of bodies went through every node's WAL (each holds a replica of both
        # queues): ten segments' worth. Only compaction ahead of schedule purges the idle
        # queue's few entries (a log keeps 1000 before a snapshot, taken every 5000).
        for i in range(3):
            eventually(lambda i=i: (len(wal_segments(c, i)),
                                    raft_of(c, i, idle).get("purged_index", 0),
                                    raft_of(c, i, stream).get("purged_index", 0)),
                       lambda v: v[0] <= WAL_SEGMENTS_SOFT_MAX + 1 and v[1] > 0 and v[2] > 0,
                       60, f"n{i + 1}'s WAL back within its bound, {phase}")
        assert not list((c.nodes[i].data_dir / "cluster" / "queues").glob("*.redb")), \
            f"n{i + 1}: the stream's log is in the write-ahead log, not a file of its own"
    c.kill_all()
    c.restart_all()
    for i in range(3):
        eventually(lambda i=i: depth_on(c, i, idle), lambda d: d == 1, 60,
                   f"n{i + 1} holding the idle queue's message")
        eventually(lambda i=i: depth_on(c, i, stream), lambda d: d == 1, 60,
                   f"n{i + 1} holding the stream's message")
    drain(c, c.wait_for_leader(idle), idle, 1)
    got = read_stream(c, c.wait_for_leader(stream), stream, 1)
    assert got == [body(1)]


@pytest.mark.timeout(300)
def test_a_cluster_on_redb_restarted_on_the_write_ahead_log_keeps_every_message(
        cluster_factory):
    """Nodes whose quorum queue logs are in redb (`--quorum-log redb`, the default before
    issue 42 step 4), with the log purged past live messages so some bodies exist only as
    copies, are killed -9 and started on the default log: each imports its redb log into the
    write-ahead log once (the redb file is gone after), every message reads back intact
    through a new leader, and the queue takes new messages. A stream's log (a redb file of
    its own there) comes over too: its messages read back and it takes new ones."""
    if "--quorum-log" in os.environ.get("WARREN_CLUSTER_EXTRA_ARGS", ""):
        pytest.skip("the clusters' log is set for the whole run")
    c = cluster_factory(3, extra_args=["--quorum-log", "redb", "--quorum-log-pin-max", "0"])
    q = "imported-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, q)
    leader = c.wait_for_leader(q)
    publish_confirmed(c, leader, q, PURGED)
    stream = "imported-stream-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, stream, arguments={"x-queue-type": "stream"})
    publish_confirmed(c, c.wait_for_leader(stream), stream, 5)
    for i in range(3):
        eventually(lambda i=i: raft_of(c, i, q).get("purged_index", 0), lambda p: p >= 3000,
                   60, f"n{i + 1} purged past live messages")
        eventually(lambda i=i: depth_on(c, i, stream), lambda d: d == 5, 60,
                   f"n{i + 1} holding the stream")
    queues = [c.nodes[i].data_dir / "cluster" / "queues" for i in range(3)]
    redb = [d / "raft-log.redb" for d in queues]
    assert all(p.exists() for p in redb)
    assert all(len(list(d.glob("*.redb"))) == 2 for d in queues), \
        "on redb a stream's log is a file of its own"

    c.kill_all()
    c.extra_args = [a for a in c.extra_args if a not in ("--quorum-log", "redb")]
    c.restart_all()
    for i in range(3):
        eventually(lambda i=i: depth_on(c, i, q), lambda d: d == PURGED, 120,
                   f"n{i + 1} holding the queue after the import")
        eventually(lambda i=i: depth_on(c, i, stream), lambda d: d == 5, 60,
                   f"n{i + 1} holding the stream after the import")
        assert not list(queues[i].glob("*.redb")), f"n{i + 1} kept a redb log"
        assert wal_segments(c, i), f"n{i + 1} has no write-ahead log"
        text = c.nodes[i].log_path.read_text(errors="replace")
        assert "imported the quorum queues' redb log into the write-ahead log" in text
        assert "imported the stream's log into the write-ahead log" in text
    assert read_stream(c, c.wait_for_leader(stream), stream, 5) == [body(k) for k in range(5)]
    # Through another leader, so the bodies are read from a second node's imported copies.
    old = c.wait_for_leader(q)
    c.kill9(old)
    serving = next(i for i in range(3) if i != old)
    c.wait_for_leader(q, exclude=(old,))
    drain(c, serving, q, PURGED)
    c.start_node(old)
    publish(c, serving, q, 10, first=PURGED)
    publish_confirmed(c, serving, stream, 3)
    for i in range(3):
        eventually(lambda i=i: depth_on(c, i, q), lambda d: d == 10, 60,
                   f"n{i + 1} holding the new messages")
        eventually(lambda i=i: depth_on(c, i, stream), lambda d: d == 8, 60,
                   f"n{i + 1} holding the stream's new messages")


@pytest.mark.timeout(300)
def test_a_queue_deleted_while_a_node_was_down_leaves_nothing_there(cluster_factory,
                                                                    monkeypatch):
    """A quorum queue holding a message is deleted while n3 is down. When n3 comes back it
    learns the deletion from the metadata: it does not list or serve the queue, and its
    write-ahead log keeps nothing of it (with 64 KiB segments and another queue's traffic,
    n3's log comes back within its bound: a group left behind would pin its oldest segment,
    and no replica is there to compact it)."""
    if "--quorum-log redb" in os.environ.get("WARREN_CLUSTER_EXTRA_ARGS", ""):
        pytest.skip("the write-ahead log's test; the clusters run on redb")
    monkeypatch.setenv("WARREN_WAL_SEGMENT_BYTES", str(WAL_SEGMENT))
    c = cluster_factory(3)
    gone, busy = "deleted-" + uuid.uuid4().hex[:6], "passing-" + uuid.uuid4().hex[:6]
    declare_quorum(c, 0, gone)
    declare_quorum(c, 0, busy)
    publish_confirmed(c, c.wait_for_leader(gone), gone, 1)
    eventually(lambda: depth_on(c, 2, gone), lambda d: d == 1, 30, "n3 holding the message")
    c.kill9(2)
    c.wait_for_leader(gone, exclude=(2,))
    conn = c.connect(0)
    try:
        conn.channel().queue_delete(gone)
    finally:
        safe_close(conn)
    c.start_node(2)
    leader = c.wait_for_leader(busy)
    publish_confirmed(c, leader, busy, ROLLED)
    drain(c, leader, busy, ROLLED)
    eventually(lambda: depth_on(c, 2, busy), lambda d: d == 0, 60, "n3 caught up")
    assert c.queue_info(2, gone) is None, "n3 still lists the deleted queue"
    eventually(lambda: len(wal_segments(c, 2)), lambda n: n <= WAL_SEGMENTS_SOFT_MAX + 1, 60,
               "n3's WAL back within its bound")
