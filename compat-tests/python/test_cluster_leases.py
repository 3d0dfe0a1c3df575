"""The HTTP queue API's claims on quorum queues in a 3-node cluster (real `warren server`
processes, cluster_harness): claims, generations and leases are replicated machine state, so a
leader killed with -9 in the middle of claims loses no claim and lets no stale token act.

Skipped while the binary has no clustering, and against an external broker."""

import os
import time
import uuid

import pika
import pytest

from cluster_harness import (cluster_supported, declare_quorum, log, safe_close,
                             wait_visible)

if os.environ.get("WARREN_TEST_AMQP_URL"):
    pytest.skip("cluster tests start their own Warren nodes", allow_module_level=True)
_SUPPORTED, _WHY = cluster_supported()
if not _SUPPORTED:
    pytest.skip(_WHY, allow_module_level=True)

from cluster_harness import cluster3, cluster_factory  # noqa: E402,F401 (fixtures)

LEADER_DEADLINE = 30.0


def api(c, i, method, path, body=None, deadline=30.0):
    """`method` `path` on node i's HTTP API, retrying while the node cannot answer (no
    leader yet: 503, or a connection error) until `deadline`."""
    end = time.monotonic() + deadline
    while True:
        try:
            status, reply = c.mgmt_request(i, method, path, body, timeout=35.0)
            if status != 503:
                return status, reply
        except OSError as e:
            status, reply = None, repr(e)
        assert time.monotonic() < end, f"{path} on node {i}: {status} {reply}"
        time.sleep(0.1)


def claim(c, i, queue, **body):
    status, reply = api(c, i, "POST", f"/v1/queues/%2F/{queue}/leases", body)
    assert status == 200, reply
    return reply["deliveries"]


@pytest.mark.timeout(180)
def test_leader_kill9_during_claims_loses_no_claim_and_fences_stale_tokens(cluster3):
    """Claims made through a follower survive kill -9 of the leader: each token still acks
    through the other survivor once a new leader serves. Claims whose lease ran out across the
    failover are claimed again with generation 2, and their old tokens get 409
    stale_generation. In the end every published message was acked exactly once."""
    c = cluster3
    queue = f"leases.{uuid.uuid4().hex[:12]}"
    declare_quorum(c, 0, queue)
    wait_visible(c, queue, range(3))
    leader = c.wait_for_leader(queue, deadline=LEADER_DEADLINE)
    f1, f2 = [i for i in range(3) if i != leader]
    conn = c.connect(f1)
    ch = conn.channel()
    ch.confirm_delivery()
    ids = [f"m-{k}" for k in range(40)]
    for mid in ids:
        ch.basic_publish("", queue, mid.encode(),
                         pika.BasicProperties(delivery_mode=2, message_id=mid))
    safe_close(conn)

    long_claims = claim(c, f1, queue, max_items=10, lease_ms=120_000)
    short_claims = claim(c, f1, queue, max_items=10, lease_ms=1_500)
    assert len(long_claims) == 10 and len(short_claims) == 10
    assert all(d["generation"] == 1 for d in long_claims + short_claims)

    c.kill9(leader)
    new_leader = c.wait_for_leader(queue, exclude={leader}, deadline=LEADER_DEADLINE)
    log(f"{c.nodes[new_leader].name} leads after kill -9 of {c.nodes[leader].name}")

    acked = []
    # No claim lost: the long leases still hold, through the other surviving node.
    for d in long_claims:
        status, reply = api(c, f2, "POST", f"/v1/leases/{d['token']}/ack", {})
        assert status == 200, (d["message_id"], status, reply)
        acked.append(d["message_id"])
    # The short leases ran out: a claim takes them again, with the next generation.
    short_ids = {d["message_id"] for d in short_claims}
    again = {}
    end = time.monotonic() + 60
    while set(again) != short_ids:
        assert time.monotonic() < end, f"reclaimed {sorted(again)} of {sorted(short_ids)}"
        for d in claim(c, f2, queue, max_items=40, lease_ms=120_000, wait_ms=2_000):
            if d["message_id"] in short_ids:
                assert d["generation"] == 2 and d["redelivered"], d
                again[d["message_id"]] = d
            else:
                # One never claimed before: settle it now.
                assert d["generation"] == 1, d
                status, _ = api(c, f2, "POST", f"/v1/leases/{d['token']}/ack", {})
                assert status == 200
                acked.append(d["message_id"])
    for d in short_claims:
        status, reply = api(c, f1, "POST", f"/v1/leases/{d['token']}/ack", {})
        assert status == 409, (d["message_id"], status, reply)
        assert reply["error"] == "stale_generation" and reply["current_generation"] == 2
    for d in again.values():
        status, reply = api(c, f1, "POST", f"/v1/leases/{d['token']}/ack", {})
        assert status == 200, reply
        acked.append(d["message_id"])
    # Whatever is left (none claimed before) goes the same way.
    while True:
        rest = claim(c, f1, queue, max_items=40)
        if not rest:
            break
        for d in rest:
            status, _ = api(c, f1, "POST", f"/v1/leases/{d['token']}/ack", {})
            assert status == 200
            acked.append(d["message_id"])
    assert sorted(acked) == sorted(ids), "every message acked exactly once"
    status, info = api(c, f2, "GET", f"/api/queues/%2F/{queue}")
    assert status == 200 and info["messages"] == 0, info


@pytest.mark.timeout(180)
def test_dedup_window_survives_a_whole_cluster_kill9(cluster3):
    """A quorum queue's deduplication window is replicated machine state: after kill -9 of
    every node and a restart, a publish retried with the same dedup_token is a duplicate,
    through any node, and the queue holds one copy."""
    c = cluster3
    queue = f"dedup.{uuid.uuid4().hex[:12]}"
    declare_quorum(c, 0, queue, arguments={"x-message-deduplication": True})
    wait_visible(c, queue, range(3))
    c.wait_for_leader(queue, deadline=LEADER_DEADLINE)
    body = {"messages": [{"payload": "once", "dedup_token": "t-1"}]}
    status, reply = api(c, 1, "POST", f"/v1/queues/%2F/{queue}/messages", body)
    assert status == 200 and reply["messages"][0]["duplicate"] is False, reply
    status, reply = api(c, 2, "POST", f"/v1/queues/%2F/{queue}/messages", body)
    assert status == 200 and reply["messages"][0]["duplicate"] is True, reply
    c.kill_all()
    c.restart_all()
    c.wait_for_leader(queue, deadline=LEADER_DEADLINE)
    status, reply = api(c, 0, "POST", f"/v1/queues/%2F/{queue}/messages", body, deadline=60)
    assert status == 200 and reply["messages"][0]["duplicate"] is True, reply
    deliveries = claim(c, 0, queue, max_items=10)
    assert [d["payload"] for d in deliveries] == ["once"]


def redrive_until_done(c, i, source, deadline=120.0):
    """Run redrives of `source` on node i until one completes; the tasks' reports."""
    end = time.monotonic() + deadline
    reports = []
    while True:
        status, task = api(c, i, "POST", f"/v1/queues/%2F/{source}/redrive", {"rate": 2000})
        assert status == 202, task
        while task["status"] == "RUNNING":
            assert time.monotonic() < end, task
            time.sleep(0.1)
            status, task = api(c, i, "GET", f"/v1/redrives/{task['id']}")
            assert status == 200, task
        reports.append(task)
        if task["status"] == "COMPLETED":
            return reports
        log(f"redrive {task['id']} {task['status']}: {task['error']}; again")
        assert time.monotonic() < end, reports


def queue_messages(c, i, queue):
    """Messages in `queue` (ready, claimed and scheduled) as node i reports them."""
    status, info = api(c, i, "GET", f"/api/queues/%2F/{queue}")
    assert status == 200, info
    return info["messages"]


@pytest.mark.timeout(300)
def test_redrive_between_quorum_queues_survives_leader_and_runner_kills(cluster3):
    """A redrive from one quorum queue into another while nodes die with kill -9: first the
    source's leader (the task, on a follower, waits out the failover), then the node running
    the task (its claims stay leased in the source until their lease runs out). The redrive is
    run again on a surviving node until the source is empty. The destination's move keys are
    replicated state, so it holds every message exactly once."""
    c = cluster3
    tag = uuid.uuid4().hex[:10]
    dlq, src = f"dlq.{tag}", f"src.{tag}"
    declare_quorum(c, 0, dlq)
    declare_quorum(c, 0, src)
    wait_visible(c, dlq, range(3))
    wait_visible(c, src, range(3))
    dlq_leader = c.wait_for_leader(dlq, deadline=LEADER_DEADLINE)
    runner = next(i for i in range(3) if i != dlq_leader)
    conn = c.connect(runner)
    ch = conn.channel()
    ch.confirm_delivery()
    ids = [f"m-{k:04d}" for k in range(800)]
    for mid in ids:
        ch.basic_publish("", dlq, mid.encode(), pika.BasicProperties(
            delivery_mode=2, headers={"x-last-death-queue": src}))
    safe_close(conn)

    def progress(task, at_least):
        end = time.monotonic() + 60
        while task["moved"] < at_least and task["status"] == "RUNNING":
            assert time.monotonic() < end, task
            time.sleep(0.02)
            task = api(c, runner, "GET", f"/v1/redrives/{task['id']}")[1]
        return task

    status, task = api(c, runner, "POST", f"/v1/queues/%2F/{dlq}/redrive", {"rate": 400})
    assert status == 202, task
    task = progress(task, 150)
    c.kill9(dlq_leader)
    log(f"killed {c.nodes[dlq_leader].name} (leader of {dlq}) at {task['moved']} moved")
    c.wait_for_leader(dlq, exclude={dlq_leader}, deadline=LEADER_DEADLINE)
    c.restart(dlq_leader)
    task = progress(task, task["moved"] + 150)
    assert task["status"] == "RUNNING", task
    c.kill9(runner)
    log(f"killed {c.nodes[runner].name} (running the redrive) at {task['moved']} moved")
    other = next(i for i in range(3) if i != runner)
    c.wait_for_leader(dlq, exclude={runner}, deadline=LEADER_DEADLINE)
    c.restart(runner)

    reports = [task]
    end = time.monotonic() + 120
    while queue_messages(c, other, dlq) > 0:
        if time.monotonic() >= end:
            info = api(c, other, "GET", f"/api/queues/%2F/{dlq}")[1]
            states = {st: api(c, other, "GET", f"/v1/queues/%2F/{dlq}/messages?state={st}&limit=5")[1]
                      for st in ("ready", "scheduled", "unacked")}
            raise AssertionError(f"{reports[-1]} info={ {k: info.get(k) for k in ('messages', 'messages_ready', 'messages_unacknowledged', 'messages_scheduled', 'leases')} } states={states}")
        reports += redrive_until_done(c, other, dlq)
        if queue_messages(c, other, dlq) > 0:
            time.sleep(1)  # the dead runner's claims come back when their lease runs out
    c.wait_for_leader(src, deadline=LEADER_DEADLINE)
    got = []
    conn = c.connect(other)
    ch = conn.channel()
    while True:
        m, _, body = ch.basic_get(src, auto_ack=True)
        if m is None:
            break
        got.append(body.decode())
    safe_close(conn)
    moved = sum(r["moved"] for r in reports)
    duplicates = sum(r["duplicates"] for r in reports)
    log(f"redrives: {len(reports)}, moved {moved} (the killed runner's last report "
        f"undercounts), duplicates {duplicates}")
    assert len(got) == len(set(got)), "a message arrived twice"
    assert sorted(got) == ids, "a message was lost"
