"""Redrive (docs/http-queue-api.md): moving messages out of a dead-letter queue back to the
queue each died in, or into a named queue, with a count, a rate and a filter, through the
HTTP API and `warren ctl`; nothing lost or doubled when the broker is killed mid-way; the
deduplication window of a durable classic queue survives a restart (the store keeps its keys,
as it keeps a redrive's move keys).

Warren's own API: these tests do not run against RabbitMQ."""

import json
import os
import signal
import tempfile
import time
from pathlib import Path

import pika
import pytest
import requests

from conftest import AUTH, q, warren_process

# The broker's fault injection (broker/src/node/redrive.rs, ACK_DELAY_ENV).
ACK_DELAY_ENV = "WARREN_TEST_REDRIVE_ACK_DELAY_MS"

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("WARREN_TEST_AMQP_URL")),
    reason="Warren's own redrive API; RabbitMQ has none",
)



def start(api, queue, vhost="/", **body):
    base, s = api
    return s.post(f"{base}/v1/queues/{q(vhost)}/{q(queue)}/redrive", json=body, timeout=30)


def wait_done(api, task_id, timeout=60.0):
    """Poll the task until it leaves RUNNING (its end is an event the API reports)."""
    base, s = api
    deadline = time.monotonic() + timeout
    while True:
        r = s.get(f"{base}/v1/redrives/{task_id}", timeout=30)
        assert r.status_code == 200, r.text
        task = r.json()
        if task["status"] != "RUNNING":
            return task
        assert time.monotonic() < deadline, f"still running: {task}"
        time.sleep(0.05)


def dead_letter_setup(connect, dlq, sources, queue_type="classic"):
    """`sources` dead-letter into `dlq` through the default exchange."""
    ch = connect().channel()
    ch.queue_declare(dlq, durable=True, arguments={"x-queue-type": queue_type})
    for s in sources:
        ch.queue_declare(s, durable=True, arguments={
            "x-queue-type": queue_type,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": dlq,
        })
    return ch


def reject_all(ch, queue, n):
    """Take n messages from `queue` and reject them without requeue (they die into the DLQ)."""
    for _ in range(n):
        method, _, _ = ch.basic_get(queue)
        assert method is not None
        ch.basic_reject(method.delivery_tag, requeue=False)


def drain(ch, queue):
    """Every body in `queue`, in order (acked)."""
    out = []
    while True:
        method, props, body = ch.basic_get(queue)
        if method is None:
            return out
        out.append((body.decode(), props.headers or {}))
        ch.basic_ack(method.delivery_tag)


def publish(ch, queue, bodies, headers=None):
    for b in bodies:
        ch.basic_publish("", queue, b, pika.BasicProperties(delivery_mode=2, headers=headers))


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_redrive_returns_each_message_to_the_queue_it_died_in(api, connect, names, queue_type):
    """Messages rejected from two queues into one DLQ go back, each to its own queue, in
    order, once each, with their x-death kept; the task reports them moved and the DLQ ends
    empty."""
    dlq, orders, billing = names.q("dlq"), names.q("orders"), names.q("billing")
    ch = dead_letter_setup(connect, dlq, [orders, billing], queue_type)
    publish(ch, orders, [f"o{i}" for i in range(5)])
    publish(ch, billing, [f"b{i}" for i in range(3)])
    reject_all(ch, orders, 5)
    reject_all(ch, billing, 3)
    assert ch.queue_declare(dlq, passive=True).method.message_count == 8

    r = start(api, dlq)
    assert r.status_code == 202, r.text
    task = wait_done(api, r.json()["id"])
    assert (task["status"], task["moved"], task["duplicates"], task["skipped"]) == \
        ("COMPLETED", 8, 0, 0), task
    assert task["source_ready_at_start"] == 8
    schema = json.loads((Path(__file__).resolve().parents[2] / "docs" /
                         "http-queue-api.openapi.json").read_text())["components"]["schemas"]
    assert set(schema["RedriveTask"]["required"]) <= set(task), task
    base, s = api
    listed = s.get(f"{base}/v1/redrives", timeout=30).json()
    assert any(t["id"] == task["id"] and t["status"] == "COMPLETED" for t in listed)
    assert ch.queue_declare(dlq, passive=True).method.message_count == 0
    got_orders = drain(ch, orders)
    assert [b for b, _ in got_orders] == [f"o{i}" for i in range(5)]
    assert got_orders[0][1]["x-death"][0]["queue"] == orders, "x-death kept"
    assert [b for b, _ in drain(ch, billing)] == [f"b{i}" for i in range(3)]


def test_redrive_progress_in_prometheus(api, connect, names, prometheus_url):
    """/metrics counts what redrives handled by outcome (moved, skipped) and how many run."""
    def totals():
        text = requests.get(f"{prometheus_url}/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            if line.startswith("warren_redrive_messages_total{"):
                outcome = line.split('outcome="')[1].split('"')[0]
                out[outcome] = float(line.rsplit(" ", 1)[1])
            if line.startswith("warren_redrives_running "):
                out["running"] = float(line.rsplit(" ", 1)[1])
        return out

    before = totals()
    dlq, dest = names.q("dlq"), names.q("dest")
    ch = connect().channel()
    ch.queue_declare(dlq, durable=True)
    ch.queue_declare(dest, durable=True)
    publish(ch, dlq, ["a", "b", "c"], headers={"k": "1"})
    publish(ch, dlq, ["d"])
    task = wait_done(api, start(api, dlq, destination=dest, filter={"headers": {"k": "1"}})
                     .json()["id"])
    assert (task["moved"], task["skipped"]) == (3, 1)
    after = totals()
    assert after["moved"] - before.get("moved", 0) >= 3
    assert after["skipped"] - before.get("skipped", 0) >= 1
    assert "running" in after and "duplicate" in after and "refused" in after


def test_filter_count_and_named_destination(api, connect, names):
    """A filter on the origin moves only that queue's messages; the others stay in the DLQ,
    in order, counted as skipped. A count stops the task there. A named destination takes
    them whatever their x-death says."""
    dlq, orders, billing, retry = (names.q("dlq"), names.q("orders"), names.q("billing"),
                                   names.q("retry"))
    ch = dead_letter_setup(connect, dlq, [orders, billing])
    ch.queue_declare(retry, durable=True)
    publish(ch, orders, [f"o{i}" for i in range(4)])
    publish(ch, billing, ["b0", "b1"])
    reject_all(ch, billing, 1)
    reject_all(ch, orders, 4)
    reject_all(ch, billing, 1)

    r = start(api, dlq, filter={"origin": orders}, max_messages=3)
    assert r.status_code == 202, r.text
    task = wait_done(api, r.json()["id"])
    assert (task["status"], task["moved"]) == ("COMPLETED", 3), task
    assert [b for b, _ in drain(ch, orders)] == ["o0", "o1", "o2"]

    r = start(api, dlq, destination=retry, filter={"reason": "rejected"})
    task = wait_done(api, r.json()["id"])
    assert (task["moved"], task["skipped"]) == (3, 0), task
    assert [b for b, _ in drain(ch, retry)] == ["b0", "o3", "b1"]

    # Header filters compare as text; a message without the header stays.
    publish(ch, dlq, ["h1"], headers={"tenant": 7})
    publish(ch, dlq, ["h2"], headers={"tenant": "8"})
    r = start(api, dlq, destination=retry, filter={"headers": {"tenant": 7}})
    task = wait_done(api, r.json()["id"])
    assert (task["moved"], task["skipped"]) == (1, 1), task
    assert [b for b, _ in drain(ch, retry)] == ["h1"]
    assert [b for b, _ in drain(ch, dlq)] == ["h2"]


def test_messages_without_a_destination_stay_and_bad_requests_are_refused(api, connect, names):
    """A message that never died (no x-death) has no origin: it stays. Unknown queues are 404,
    a stream source, a bad rate or the same queue both ends 400; unknown tasks 404."""
    dlq, other = names.q("dlq"), names.q("other")
    ch = connect().channel()
    ch.queue_declare(dlq, durable=True)
    ch.queue_declare(other, durable=True)
    publish(ch, dlq, ["plain"])
    task = wait_done(api, start(api, dlq).json()["id"])
    assert (task["status"], task["moved"], task["skipped"]) == ("COMPLETED", 0, 1)
    assert ch.queue_declare(dlq, passive=True).method.message_count == 1

    assert start(api, names.q("nope")).status_code == 404
    assert start(api, dlq, destination=names.q("nope")).status_code == 404
    assert start(api, dlq, destination=dlq).status_code == 400
    assert start(api, dlq, rate=0).status_code == 400
    assert start(api, dlq, bogus=1).status_code == 400
    stream = names.q("stream")
    ch.queue_declare(stream, durable=True, arguments={"x-queue-type": "stream"})
    assert start(api, stream).status_code == 400
    base, s = api
    assert s.get(f"{base}/v1/redrives/999999", timeout=30).status_code == 404
    assert s.delete(f"{base}/v1/redrives/abc", timeout=30).status_code == 400


def test_permissions(api, connect, names, ctl, management_url):
    """Starting needs read on the source and write on a named destination; without a named
    one, origins the caller may not write keep their messages."""
    dlq, src = names.q("dlq"), names.q("src")
    ch = dead_letter_setup(connect, dlq, [src])
    publish(ch, src, ["m"])
    reject_all(ch, src, 1)
    user = names.q("user")
    assert ctl("add_user", user, "pw")[0] == 0
    try:
        s = requests.Session()
        s.auth = (user, "pw")
        mine = (management_url, s)
        # Read on everything, write on nothing.
        assert ctl("set_permissions", "-p", "/", user, "", "^$", ".*")[0] == 0
        assert start(mine, dlq, destination=src).status_code == 403
        task = wait_done(api, start(mine, dlq).json()["id"])
        assert (task["moved"], task["skipped"]) == (0, 1), task
        # No read on the DLQ.
        assert ctl("set_permissions", "-p", "/", user, "", ".*", "^$")[0] == 0
        assert start(mine, dlq).status_code == 403
        assert mine[1].get(f"{management_url}/v1/redrives/{task['id']}",
                           timeout=30).status_code == 403
    finally:
        ctl("delete_user", user)


def test_rate_limits_the_move(api, connect, names):
    """At 40 messages a second, 60 messages take at least a second (the first batch may go
    at once)."""
    dlq, dest = names.q("dlq"), names.q("dest")
    ch = connect().channel()
    ch.queue_declare(dlq, durable=True)
    ch.queue_declare(dest, durable=True)
    publish(ch, dlq, [f"m{i}" for i in range(60)])
    t0 = time.monotonic()
    task = wait_done(api, start(api, dlq, destination=dest, rate=40).json()["id"])
    elapsed = time.monotonic() - t0
    assert task["moved"] == 60, task
    assert elapsed >= 1.0, f"60 messages at 40/s took {elapsed:.2f}s"


def test_ctl_redrive_list_and_cancel(ctl, connect, names, api):
    """`warren ctl redrive_queue` moves and prints progress until done; `list_redrives` shows
    the task; `cancel_redrive` stops a slow one, whose moved messages stay moved."""
    dlq, dest = names.q("dlq"), names.q("dest")
    ch = connect().channel()
    ch.queue_declare(dlq, durable=True)
    ch.queue_declare(dest, durable=True)
    publish(ch, dlq, [f"m{i}" for i in range(10)])
    code, out = ctl("redrive_queue", dlq, "--to", dest, "-p", "/")
    assert code == 0, out
    assert "COMPLETED: moved 10" in out, out
    assert ch.queue_declare(dest, passive=True).method.message_count == 10
    code, out = ctl("list_redrives")
    assert code == 0 and dlq in out and "COMPLETED" in out, out

    publish(ch, dlq, [f"s{i}" for i in range(50)])
    code, out = ctl("redrive_queue", dlq, "--to", dest, "--rate", "5", "--no-wait")
    assert code == 0, out
    task_id = out.strip().splitlines()[-1].split()[1]
    code, out = ctl("cancel_redrive", task_id)
    assert code == 0, out
    task = wait_done(api, int(task_id))
    assert task["status"] == "CANCELLED"
    moved = task["moved"]
    assert moved < 50
    assert ch.queue_declare(dest, passive=True).method.message_count == 10 + moved
    assert ch.queue_declare(dlq, passive=True).method.message_count == 50 - moved
    assert ctl("cancel_redrive", "424242")[0] != 0


def test_redrive_interrupted_by_kill_9_loses_and_doubles_nothing():
    """A redrive of 2,000 persistent messages is killed (kill -9) twice: once while its
    destination holds a round's messages that the source has not given up yet (held there by
    the broker's fault-injection delay, so the kill lands in that window every time), once
    mid-way at full speed. After each restart the redrive runs again. In the end the
    destination holds every message exactly once and the DLQ none; the runs after the first
    kill find the messages the destination took already and drop them as duplicates."""
    n = 2000
    ids = [f"m{i:05d}" for i in range(n)]

    def connection(w):
        return pika.BlockingConnection(pika.ConnectionParameters(
            "127.0.0.1", w["port"], credentials=pika.PlainCredentials("guest", "guest")))

    def api_of(w):
        s = requests.Session()
        s.auth = AUTH
        return f"http://127.0.0.1:{w['management_port']}", s

    def count(w, queue):
        c = connection(w)
        try:
            return c.channel().queue_declare(queue, passive=True).method.message_count
        finally:
            c.close()

    def wait_for(what, timeout=60.0):
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline
            time.sleep(0.02)

    with tempfile.TemporaryDirectory(prefix="warren-redrive-") as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        with warren_process(data_dir=data_dir) as w:
            c = connection(w)
            ch = c.channel()
            ch.confirm_delivery()
            ch.queue_declare("dlq", durable=True)
            ch.queue_declare("src", durable=True)
            for i in ids:
                ch.basic_publish("", "dlq", i, pika.BasicProperties(
                    delivery_mode=2, headers={"x-last-death-queue": "src"}))
            c.close()

        # 1. Killed while the destination holds a round the source still holds.
        os.environ[ACK_DELAY_ENV] = "60000"
        try:
            with warren_process(data_dir=data_dir) as w:
                r = start(api_of(w), "dlq", rate=100_000)
                assert r.status_code == 202, r.text
                # The broker logs the round it holds once every move of it is durable in
                # the destination (a count of the destination could run ahead of its disk).
                wait_for(lambda: "redrive round held by fault injection" in
                         Path(w["log"]).read_text(errors="replace"))
                assert count(w, "src") >= 100
                os.kill(w["pid"], signal.SIGKILL)
        finally:
            del os.environ[ACK_DELAY_ENV]

        # 2. Killed mid-way at full speed.
        with warren_process(data_dir=data_dir) as w:
            api = api_of(w)
            r = start(api, "dlq", rate=5000)
            base, s = api
            first = {}
            def far_enough():
                first.update(s.get(f"{base}/v1/redrives/{r.json()['id']}", timeout=30).json())
                return first["moved"] + first["duplicates"] >= 500 or first["status"] != "RUNNING"
            wait_for(far_enough)
            os.kill(w["pid"], signal.SIGKILL)
        assert first["duplicates"] >= 100, f"the first kill's round came back: {first}"

        # 3. To the end.
        with warren_process(data_dir=data_dir) as w:
            api = api_of(w)
            task = wait_done(api, start(api, "dlq").json()["id"])
            assert task["status"] == "COMPLETED", task
            c = connection(w)
            ch = c.channel()
            got = [b for b, _ in drain(ch, "src")]
            left = ch.queue_declare("dlq", passive=True).method.message_count
            c.close()
        assert left == 0
        assert len(got) == len(set(got)), "a message arrived twice"
        assert sorted(got) == ids, "a message was lost"


def test_dedup_window_survives_a_restart_of_a_durable_classic_queue():
    """A durable classic queue with x-message-deduplication remembers the keys it took across
    a kill -9 and restart: the retried publish is dropped (and confirmed)."""
    with tempfile.TemporaryDirectory(prefix="warren-dedup-") as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        props = pika.BasicProperties(delivery_mode=2, headers={"x-deduplication-header": "k1"})
        with warren_process(data_dir=data_dir) as w:
            c = pika.BlockingConnection(pika.ConnectionParameters(
                "127.0.0.1", w["port"], credentials=pika.PlainCredentials("guest", "guest")))
            ch = c.channel()
            ch.confirm_delivery()
            ch.queue_declare("d", durable=True, arguments={"x-message-deduplication": True})
            ch.basic_publish("", "d", "first", props)
            os.kill(w["pid"], signal.SIGKILL)
        with warren_process(data_dir=data_dir) as w:
            c = pika.BlockingConnection(pika.ConnectionParameters(
                "127.0.0.1", w["port"], credentials=pika.PlainCredentials("guest", "guest")))
            ch = c.channel()
            ch.confirm_delivery()
            ch.basic_publish("", "d", "retried", props)
            ch.basic_publish("", "d", "other", pika.BasicProperties(
                delivery_mode=2, headers={"x-deduplication-header": "k2"}))
            assert [b for b, _ in drain(ch, "d")] == ["first", "other"]
            c.close()
