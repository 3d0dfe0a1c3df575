"""Delayed publishes of the HTTP queue API (`delay_ms`, docs/http-queue-api.md) and scheduled
messages across a restart: a delayed message is held (counted as scheduled) until its time,
then ready at the back of the queue, for HTTP claims and AMQP consumers alike; a durable queue
on the local store keeps the due times of delayed publishes and delayed retries across kill -9.

Warren's own API: these tests do not run against RabbitMQ."""

import os
import signal
import tempfile
import time
from pathlib import Path

import pika
import pytest
import requests

from conftest import AUTH, q, warren_process

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("WARREN_TEST_AMQP_URL")),
    reason="Warren's own HTTP queue API; RabbitMQ has none",
)



def publish(api, queue, messages):
    base, s = api
    return s.post(f"{base}/v1/queues/%2F/{q(queue)}/messages", json={"messages": messages},
                  timeout=30)


def claim(api, queue, **body):
    base, s = api
    return s.post(f"{base}/v1/queues/%2F/{q(queue)}/leases", json=body, timeout=60)


def info(api, queue):
    base, s = api
    r = s.get(f"{base}/api/queues/%2F/{q(queue)}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_a_delayed_publish_is_held_then_ready(api, connect, names, queue_type):
    """Published with delay_ms 1,500 beside one without: a claim gets only the other; the
    held one counts as scheduled (and in messages), an AMQP basic.get does not see it; a
    claim waiting for it is woken when it comes due, not before 1.4 s after the publish."""
    name = names.q()
    ch = connect().channel()
    ch.queue_declare(name, durable=True, arguments={"x-queue-type": queue_type})
    t0 = time.monotonic()
    r = publish(api, name, [{"payload": "late", "delay_ms": 1500}, {"payload": "now"}])
    assert r.status_code == 200, r.text
    got = claim(api, name, max_items=10, lease_ms=60_000).json()["deliveries"]
    assert [d["payload"] for d in got] == ["now"]
    i = info(api, name)
    assert (i["messages_scheduled"], i["messages"], i["messages_ready"]) == (1, 2, 0), i
    assert i["leases"]["delayed_publishes"] == 1
    method, _, _ = ch.basic_get(name)
    assert method is None, "held from AMQP consumers too"
    got = claim(api, name, max_items=10, lease_ms=60_000, wait_ms=10_000).json()["deliveries"]
    elapsed = time.monotonic() - t0
    assert [d["payload"] for d in got] == ["late"]
    assert elapsed >= 1.4, f"ready after {elapsed:.2f}s"
    assert info(api, name)["messages_scheduled"] == 0


def test_delayed_publish_limits(api, connect, names):
    """A delay past a day is a 400, as is a delay into a stream; 0 is no delay."""
    name, stream = names.q(), names.q("stream")
    ch = connect().channel()
    ch.queue_declare(name, durable=True)
    ch.queue_declare(stream, durable=True, arguments={"x-queue-type": "stream"})
    assert publish(api, name, [{"payload": "x", "delay_ms": 86_400_001}]).status_code == 400
    assert publish(api, stream, [{"payload": "x", "delay_ms": 10}]).status_code == 400
    assert publish(api, name, [{"payload": "x", "delay_ms": 0}]).status_code == 200
    assert info(api, name)["messages_ready"] == 1


def test_due_times_survive_kill_9_of_a_durable_classic_queue():
    """A delayed publish and a delayed retry in a durable classic queue are still held after
    kill -9 and a restart, then ready when due."""
    with tempfile.TemporaryDirectory(prefix="warren-delay-") as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        with warren_process(data_dir=data_dir) as w:
            api = (f"http://127.0.0.1:{w['management_port']}", requests.Session())
            api[1].auth = AUTH
            c = pika.BlockingConnection(pika.ConnectionParameters(
                "127.0.0.1", w["port"], credentials=pika.PlainCredentials("guest", "guest")))
            c.channel().queue_declare("work", durable=True)
            c.close()
            assert publish(api, "work", [{"payload": "retry-me"}]).status_code == 200
            d = claim(api, "work", max_items=1, lease_ms=60_000).json()["deliveries"][0]
            r = api[1].post(f"{api[0]}/v1/leases/{d['token']}/release",
                            json={"reason": "later", "delay_ms": 8000}, timeout=30)
            assert r.status_code == 200, r.text
            # Durable before its reply; the store commits in order, so the release's due
            # time is on disk too.
            assert publish(api, "work", [{"payload": "delayed", "delay_ms": 8000}]).status_code == 200
            t0 = time.monotonic()
            os.kill(w["pid"], signal.SIGKILL)
        with warren_process(data_dir=data_dir) as w:
            api = (f"http://127.0.0.1:{w['management_port']}", requests.Session())
            api[1].auth = AUTH
            i = info(api, "work")
            # A restart takes far less than the 8 s delays.
            assert (i["messages_scheduled"], i["messages_ready"]) == (2, 0), i
            got = []
            deadline = time.monotonic() + 20
            while len(got) < 2:
                got += [d["payload"] for d in claim(api, "work", max_items=10, lease_ms=60_000,
                                                    wait_ms=5_000).json()["deliveries"]]
                assert time.monotonic() < deadline, got
            assert time.monotonic() - t0 >= 7.9, "held until due across the restart"
            assert sorted(got) == ["delayed", "retry-me"]


def test_attempts_histogram_in_the_api_and_prometheus(api, connect, names, prometheus_url):
    """Acknowledgements count by the attempt that succeeded: one acked at its first claim, one
    released and acked at its second. The queue object has the cumulative buckets and the
    p99; /metrics/per-object has the histogram for the queue; /metrics sums over queues."""
    name = names.q()
    ch = connect().channel()
    ch.queue_declare(name, durable=True)
    publish(api, name, [{"payload": "first"}, {"payload": "second"}])
    base, s = api
    ds = claim(api, name, max_items=2, lease_ms=60_000).json()["deliveries"]
    assert s.post(f"{base}/v1/leases/{ds[0]['token']}/ack", timeout=30).status_code == 200
    assert s.post(f"{base}/v1/leases/{ds[1]['token']}/release", json={"delay_ms": 0},
                  timeout=30).status_code == 200
    again = claim(api, name, max_items=1, lease_ms=60_000).json()["deliveries"]
    assert again[0]["attempt"] == 2
    assert s.post(f"{base}/v1/leases/{again[0]['token']}/ack", timeout=30).status_code == 200
    leases = info(api, name)["leases"]
    assert leases["acked_attempts"][:3] == [{"le": 1, "count": 1}, {"le": 2, "count": 2},
                                           {"le": 3, "count": 2}]
    assert leases["acked_attempts"][-1] == {"le": "+Inf", "count": 2}
    assert leases["acked_attempts_p99"] == 2
    text = requests.get(f"{prometheus_url}/metrics/per-object", timeout=30).text
    label = f'vhost="/",queue="{name}",'
    lines = {l.split(" ")[0]: l.split(" ")[1] for l in text.splitlines()
             if l.startswith("warren_queue_ack_attempts") and label.rstrip(",") in l}
    assert lines[f'warren_queue_ack_attempts_bucket{{{label}le="1"}}'] == "1"
    assert lines[f'warren_queue_ack_attempts_bucket{{{label}le="2"}}'] == "2"
    assert lines[f'warren_queue_ack_attempts_sum{{{label.rstrip(",")}}}'] == "3"
    assert lines[f'warren_queue_ack_attempts_count{{{label.rstrip(",")}}}'] == "2"
    total = requests.get(f"{prometheus_url}/metrics", timeout=30).text
    assert "# TYPE warren_queue_ack_attempts histogram" in total
    count = [l for l in total.splitlines() if l.startswith("warren_queue_ack_attempts_count ")]
    assert count and int(count[0].split(" ")[1]) >= 2
