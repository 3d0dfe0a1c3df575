"""The HTTP queue API (docs/http-queue-api.md) with a real HTTP client (requests) against the
real broker: publish, claim under a lease, ack, extend, release with a delay, generation
fencing of late acks, permissions, and interop with AMQP clients (pika) both ways.

Warren's own API: these tests do not run against RabbitMQ."""

import base64
import os
import time

import pika
import pytest
import requests

from conftest import AUTH, q

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("WARREN_TEST_AMQP_URL")),
    reason="Warren's own HTTP queue API; RabbitMQ has none",
)



def publish(api, queue, messages, vhost="/"):
    base, s = api
    return s.post(f"{base}/v1/queues/{q(vhost)}/{q(queue)}/messages",
                  json={"messages": messages}, timeout=30)


def claim(api, queue, vhost="/", **body):
    base, s = api
    return s.post(f"{base}/v1/queues/{q(vhost)}/{q(queue)}/leases", json=body, timeout=60)


def settle(api, token, verb, **body):
    base, s = api
    return s.post(f"{base}/v1/leases/{token}/{verb}", json=body, timeout=30)


def queue_info(api, queue, vhost="/"):
    base, s = api
    r = s.get(f"{base}/api/queues/{q(vhost)}/{q(queue)}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def eventually(fetch, check, timeout=10.0):
    """Poll the API until `check(fetch())` holds (a lease runs out on the broker's timer)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if check(value):
            return value
        assert time.monotonic() < deadline, f"never held: {value}"
        time.sleep(0.02)


def declare(connect, name, **arguments):
    ch = connect().channel()
    ch.queue_declare(name, durable=True, arguments=arguments or None)
    return ch


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_publish_claim_ack_over_http(api, connect, names, queue_type):
    """Messages published over HTTP come back from a claim in order, each with a token, a
    generation of 1 and its payload, headers and routing key; acking every token empties the
    queue."""
    name = names.q(queue_type)
    declare(connect, name, **{"x-queue-type": queue_type})
    r = publish(api, name, [
        {"payload": "one", "headers": {"job": "a"}},
        {"payload": base64.b64encode(b"\x00\xfftwo").decode(), "payload_encoding": "base64",
         "routing_key": "jobs.b", "priority": 3, "message_id": "m-2"},
    ])
    assert r.status_code == 200, r.text
    published = r.json()["messages"]
    assert [m["duplicate"] for m in published] == [False, False]
    assert published[1]["message_id"] == "m-2"
    r = claim(api, name, max_items=10, lease_ms=30_000)
    assert r.status_code == 200, r.text
    ds = r.json()["deliveries"]
    assert [d["message_id"] for d in ds] == [published[0]["message_id"], "m-2"]
    assert ds[0]["payload"] == "one" and ds[0]["payload_encoding"] == "string"
    assert ds[0]["headers"] == {"job": "a"}
    assert ds[0]["routing_key"] == name
    assert base64.b64decode(ds[1]["payload"]) == b"\x00\xfftwo"
    assert ds[1]["payload_encoding"] == "base64" and ds[1]["routing_key"] == "jobs.b"
    assert all(d["generation"] == 1 and d["attempt"] == 1 for d in ds)
    now_ms = time.time() * 1000
    assert all(now_ms + 20_000 < d["lease_expires_at"] < now_ms + 40_000 for d in ds)
    info = queue_info(api, name)
    assert (info["messages_ready"], info["messages_unacknowledged"]) == (0, 2)
    assert info["leases"]["leased"] == 2
    for d in ds:
        r = settle(api, d["token"], "ack")
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "acked"
    info = queue_info(api, name)
    assert info["messages"] == 0 and info["leases"]["leased"] == 0
    # A second ack of the same token names a message the queue no longer holds.
    assert settle(api, ds[0]["token"], "ack").status_code == 404


def test_a_dead_workers_claim_expires_and_its_late_ack_is_fenced(api, connect, names):
    """Worker A claims and dies; its lease runs out and worker B's long poll receives the
    message with generation 2. A's late ack and extend get 409 stale_generation naming
    generation 2 and change nothing; B's ack settles it."""
    name = names.q()
    declare(connect, name)
    assert publish(api, name, [{"payload": "task"}]).status_code == 200
    a = claim(api, name, lease_ms=300, worker="a").json()["deliveries"]
    assert len(a) == 1
    # B waits; the lease running out is the event that hands it the message.
    b = claim(api, name, lease_ms=30_000, wait_ms=10_000, worker="b").json()["deliveries"]
    assert len(b) == 1
    assert (b[0]["message_id"], b[0]["generation"]) == (a[0]["message_id"], 2)
    assert b[0]["redelivered"] is True and b[0]["delivery_count"] == 1
    for verb, body in (("ack", {}), ("extend", {"lease_ms": 60_000}), ("release", {})):
        r = settle(api, a[0]["token"], verb, **body)
        assert r.status_code == 409, (verb, r.text)
        assert r.json()["error"] == "stale_generation"
        assert r.json()["current_generation"] == 2
    info = queue_info(api, name)
    assert info["messages_unacknowledged"] == 1 and info["leases"]["leased"] == 1
    assert info["leases"]["expired"] == 1
    assert settle(api, b[0]["token"], "ack").status_code == 200
    assert queue_info(api, name)["messages"] == 0


def test_an_expired_lease_is_reported_and_cannot_be_extended(api, connect, names):
    """A token whose lease ran out, with nobody claiming since, gets 409 lease_expired; the
    message is ready again."""
    name = names.q()
    declare(connect, name)
    publish(api, name, [{"payload": "x"}])
    d = claim(api, name, lease_ms=100).json()["deliveries"][0]
    eventually(lambda: queue_info(api, name), lambda i: i["messages_ready"] == 1)
    r = settle(api, d["token"], "extend", lease_ms=10_000)
    assert r.status_code == 409, r.text
    assert r.json() == {
        "error": "lease_expired",
        "reason": r.json()["reason"],
        "current_generation": 1,
    }


def test_extension_is_capped_by_the_queues_arguments(api, connect, names):
    """An extension moves the deadline; one asking past x-lease-extension-max-ms gets the
    cap, and none goes past x-lease-lifetime-max-ms from the claim."""
    name = names.q()
    declare(connect, name, **{"x-lease-extension-max-ms": 5_000,
                              "x-lease-lifetime-max-ms": 8_000})
    publish(api, name, [{"payload": "x"}])
    d = claim(api, name, lease_ms=1_000).json()["deliveries"][0]
    r = settle(api, d["token"], "extend", lease_ms=60_000)
    assert r.status_code == 200, r.text
    first = r.json()
    assert first["state"] == "claimed" and first["generation"] == 1
    now_ms = time.time() * 1000
    assert now_ms + 3_000 < first["lease_expires_at"] <= now_ms + 5_000
    assert first["lease_expires_at"] > d["lease_expires_at"]
    claimed_at = d["lease_expires_at"] - 1_000
    r = settle(api, d["token"], "extend", lease_ms=5_000)
    assert r.json()["lease_expires_at"] <= claimed_at + 8_000


def test_release_with_a_delay_schedules_the_retry(api, connect, names):
    """A release with delay_ms leaves the message scheduled (not claimable) until it is due,
    then a waiting claim gets it with the next generation."""
    name = names.q()
    declare(connect, name)
    publish(api, name, [{"payload": "retry me"}])
    d = claim(api, name).json()["deliveries"][0]
    released_at = time.time() * 1000
    r = settle(api, d["token"], "release", reason="db down", delay_ms=400)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "scheduled"
    assert r.json()["ready_at"] >= released_at + 300
    info = queue_info(api, name)
    assert (info["messages_ready"], info["messages_scheduled"], info["messages"]) == (0, 1, 1)
    assert claim(api, name).json()["deliveries"] == []
    started = time.monotonic()
    again = claim(api, name, wait_ms=10_000).json()["deliveries"]
    assert [x["generation"] for x in again] == [2]
    assert time.time() * 1000 >= r.json()["ready_at"] - 5
    # The due retry woke the waiting claim: it did not sit out its whole 10 s wait.
    assert time.monotonic() - started < 5


def test_delayed_retry_policy_holds_failed_amqp_deliveries(connect, names, api):
    """x-delayed-retry-type failed: a basic.nack with requeue waits x-delayed-retry-min
    before it is delivered again; the queue reports it scheduled meanwhile."""
    name = names.q()
    ch = declare(connect, name, **{"x-delayed-retry-type": "failed",
                                   "x-delayed-retry-min": 300,
                                   "x-delayed-retry-max": 1_000})
    ch.basic_publish("", name, b"flaky")
    method, _, _ = ch.basic_get(name)
    ch.basic_nack(method.delivery_tag, requeue=True)
    info = eventually(lambda: queue_info(api, name), lambda i: i["messages_scheduled"] == 1)
    assert info["messages_ready"] == 0
    again = claim(api, name, wait_ms=10_000).json()["deliveries"]
    assert len(again) == 1 and again[0]["redelivered"] is True


def test_amqp_and_http_interoperate_both_ways(api, connect, names):
    """A message published with pika is claimed over HTTP with its properties; one published
    over HTTP is read by pika with its headers and message id."""
    name = names.q()
    ch = declare(connect, name)
    ch.basic_publish("", name, b"from amqp", pika.BasicProperties(
        headers={"k": "v"}, message_id="amqp-1", delivery_mode=2))
    d = claim(api, name).json()["deliveries"]
    assert [(x["payload"], x["message_id"], x["headers"]) for x in d] == [
        ("from amqp", "amqp-1", {"k": "v"})]
    assert settle(api, d[0]["token"], "ack").status_code == 200
    publish(api, name, [{"payload": "from http", "headers": {"h": 1}, "message_id": "http-1"}])
    method, props, body = ch.basic_get(name, auto_ack=True)
    assert body == b"from http"
    assert props.message_id == "http-1" and props.headers == {"h": 1}
    assert props.delivery_mode == 2


def test_permissions_and_bad_requests(api, connect, names, ctl):
    """A user needs write on the queue to publish and read to claim and settle (403 with
    RabbitMQ's text otherwise); no management tag is needed; unknown tokens are 404, bad
    bodies and limits 400, missing queues 404."""
    base, s = api
    name = names.q()
    declare(connect, name)
    user = f"worker-{name[-10:]}"
    assert ctl("add_user", user, "pw")[0] == 0
    try:
        assert ctl("set_permissions", "-p", "/", user, "", "^$", ".*")[0] == 0
        w = requests.Session()
        w.auth = (user, "pw")
        r = w.post(f"{base}/v1/queues/%2F/{q(name)}/messages",
                   json={"messages": [{"payload": "x"}]}, timeout=30)
        assert r.status_code == 403, r.text
        assert r.json()["error"] == "access_refused"
        assert f"access to queue '{name}' in vhost '/' refused for user '{user}'" in r.json()["reason"]
        publish(api, name, [{"payload": "x"}])
        r = w.post(f"{base}/v1/queues/%2F/{q(name)}/leases", json={}, timeout=30)
        assert r.status_code == 200, r.text
        token = r.json()["deliveries"][0]["token"]
        assert w.post(f"{base}/v1/leases/{token}/ack", json={}, timeout=30).status_code == 200
        # Read taken away: claims and settles are refused.
        assert ctl("set_permissions", "-p", "/", user, "", ".*", "^$")[0] == 0
        publish(api, name, [{"payload": "y"}])
        r = w.post(f"{base}/v1/queues/%2F/{q(name)}/leases", json={}, timeout=30)
        assert r.status_code == 403, r.text
        w.close()
    finally:
        ctl("delete_user", user)
    assert settle(api, "not-a-token", "ack").status_code == 404
    assert claim(api, name, max_items=0).status_code == 400
    assert claim(api, name, max_items=100_000).status_code == 400
    assert claim(api, name, wait_ms=60_000).status_code == 400
    assert claim(api, name, lease_ms=0).status_code == 400
    assert claim(api, name, surprise=1).status_code == 400
    assert claim(api, names.q("missing")).status_code == 404
    assert publish(api, name, []).status_code == 400
    assert publish(api, name, [{"payload": "%%%", "payload_encoding": "base64"}]).status_code == 400
    r = requests.post(f"{base}/v1/queues/%2F/{q(name)}/leases", json={},
                      auth=("guest", "wrong"), timeout=30)
    assert r.status_code == 401


def test_streams_have_no_claims(api, connect, names):
    """A stream keeps its messages for every reader: a claim on one is a 400."""
    name = names.q()
    declare(connect, name, **{"x-queue-type": "stream"})
    r = claim(api, name)
    assert r.status_code == 400, r.text


def test_long_poll_returns_when_a_message_arrives(api, connect, names):
    """A claim waiting on an empty queue returns as soon as an AMQP publish arrives, well
    before its wait ends."""
    import threading

    name = names.q()
    ch = declare(connect, name)
    result = {}

    def waiter():
        started = time.monotonic()
        result["deliveries"] = claim(api, name, wait_ms=15_000).json()["deliveries"]
        result["waited"] = time.monotonic() - started

    t = threading.Thread(target=waiter)
    t.start()
    # The claim is parked once the queue reports no consumer activity needed: publish now;
    # whether it lands before or during the wait, the claim must return it.
    ch.basic_publish("", name, b"wake up")
    t.join(timeout=30)
    assert [d["payload"] for d in result["deliveries"]] == ["wake up"]
    assert result["waited"] < 10


def test_replies_match_the_openapi_description(api, connect, names):
    """docs/http-queue-api.openapi.json and the broker agree: every documented path is
    routed (401 without credentials, not a 404 of no route), and a delivery, a lease state
    and a conflict carry every field the description requires."""
    from pathlib import Path
    import json

    base, s = api
    spec = json.loads((Path(__file__).resolve().parents[2] / "docs" /
                       "http-queue-api.openapi.json").read_text())
    assert spec["openapi"].startswith("3.")
    for path, methods in spec["paths"].items():
        url = base + path.replace("{vhost}", "%2F").replace("{queue}", "q").replace(
            "{token}", "t").replace("{id}", "1")
        for method in methods:
            r = requests.request(method.upper(), url, json={}, timeout=30)
            assert r.status_code == 401, (method, path)
    schemas = spec["components"]["schemas"]
    name = names.q()
    declare(connect, name)
    publish(api, name, [{"payload": "x"}, {"payload": "y"}])
    ds = claim(api, name, max_items=2, lease_ms=100).json()["deliveries"]
    for d in ds:
        assert set(schemas["Delivery"]["required"]) <= set(d), d
    state = settle(api, ds[0]["token"], "extend", lease_ms=1_000).json()
    assert set(schemas["LeaseState"]["required"]) <= set(state), state
    eventually(lambda: queue_info(api, name), lambda i: i["messages_ready"] == 1)
    conflict = settle(api, ds[1]["token"], "ack").json()
    assert set(schemas["Conflict"]["required"]) <= set(conflict), conflict


def test_dead_letter_past_the_limit_carries_the_failure_context(api, connect, names):
    """A quorum queue with x-delivery-limit 1: the second release of a claim dead-letters the
    message, and the dead letter carries what its last worker said (x-failure-reason), who
    that was (x-failure-worker) and how often it was returned (x-failure-attempts) beside
    x-death's delivery_limit."""
    name, dlq = names.q("work"), names.q("dlq")
    ch = connect().channel()
    ch.queue_declare(dlq, durable=True)
    ch.queue_declare(name, durable=True, arguments={
        "x-queue-type": "quorum", "x-delivery-limit": 1,
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    publish(api, name, [{"payload": "poison", "message_id": "p-1"}])
    first = claim(api, name, worker="w1").json()["deliveries"][0]
    r = settle(api, first["token"], "release", reason="boom")
    assert r.status_code == 200 and r.json()["state"] == "released", r.text
    second = claim(api, name, worker="w2").json()["deliveries"][0]
    assert second["generation"] == 2
    r = settle(api, second["token"], "release", reason="boom again")
    assert r.status_code == 200, r.text
    method, props, body = None, None, None
    deadline = time.monotonic() + 10
    while method is None:
        assert time.monotonic() < deadline, "nothing dead-lettered"
        method, props, body = ch.basic_get(dlq, auto_ack=True)
    assert body == b"poison" and props.message_id == "p-1"
    h = props.headers
    assert (h["x-failure-reason"], h["x-failure-worker"], h["x-failure-attempts"]) == (
        "boom again", "w2", 2)
    assert h["x-death"][0]["reason"] == "delivery_limit"
    assert settle(api, second["token"], "ack").status_code == 404
    assert queue_info(api, name)["leases"]["quarantined"] == 1


def test_quorum_redeliveries_carry_delivery_and_acquired_counts(connect, names):
    """A quorum queue's redelivery carries x-delivery-count and RabbitMQ 4.3's
    x-acquired-count (every return counts in Warren, so they agree)."""
    name = names.q()
    ch = connect().channel()
    ch.queue_declare(name, durable=True, arguments={"x-queue-type": "quorum"})
    ch.basic_publish("", name, b"m")
    m, _, _ = ch.basic_get(name)
    ch.basic_nack(m.delivery_tag, requeue=True)
    m, props, _ = ch.basic_get(name, auto_ack=True)
    assert m.redelivered
    assert (props.headers["x-delivery-count"], props.headers["x-acquired-count"]) == (1, 1)


# ------------------------------------------------------------------ the AMQP lease extension

LEASE_X = "amq.warren.lease"


def lease_publish(ch, verb, **headers):
    ch.basic_publish(LEASE_X, verb, b"", pika.BasicProperties(headers=headers))


def test_amqp_extend_keeps_a_delivery_past_its_consumer_timeout(connect, names):
    """x-consumer-timeout 1 s: a delivery whose lease is extended over AMQP (a publish to
    amq.warren.lease) is still held after the original timeout and acks fine; one not
    extended closes its channel with 406, as RabbitMQ's consumer timeout does."""
    name = names.q()
    conn = connect()
    assert conn._impl.server_capabilities.get("warren.lease_extension") is True
    ch = conn.channel()
    ch.queue_declare(name, durable=True, arguments={"x-consumer-timeout": 1_000})
    ch.confirm_delivery()
    ch.basic_publish("", name, b"long task")
    ch.basic_publish("", name, b"forgotten")
    m, _, body = ch.basic_get(name)
    assert body == b"long task"
    lease_publish(ch, "extend", **{"x-delivery-tag": m.delivery_tag, "x-lease-ms": 10_000})
    other = conn.channel()
    m2, _, _ = other.basic_get(name)
    assert m2 is not None
    # The other channel's delivery times out and closes it; ours must stay open through it.
    deadline = time.monotonic() + 10
    while other.is_open:
        assert time.monotonic() < deadline, "the consumer timeout never fired"
        conn.process_data_events(time_limit=0.1)
    conn.process_data_events(time_limit=0.5)
    assert ch.is_open
    ch.basic_ack(m.delivery_tag)
    assert ch.queue_declare(name, passive=True).method.message_count == 1


def test_amqp_release_with_a_delay_and_a_reason(connect, names, api):
    """A release over AMQP gives the delivery back as failed, scheduled for x-delay-ms; it is
    redelivered after that, and a quorum queue past its delivery limit dead-letters it with
    x-reason as its failure reason."""
    name, dlq = names.q("work"), names.q("dlq")
    conn = connect()
    ch = conn.channel()
    ch.queue_declare(dlq, durable=True)
    ch.queue_declare(name, durable=True, arguments={
        "x-queue-type": "quorum", "x-delivery-limit": 1,
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    ch.confirm_delivery()
    ch.basic_publish("", name, b"job", pika.BasicProperties(delivery_mode=2))
    m, _, _ = ch.basic_get(name)
    lease_publish(ch, "release", **{"x-delivery-tag": m.delivery_tag, "x-delay-ms": 400,
                                    "x-reason": "upstream 503"})
    info = queue_info(api, name)
    assert info["messages_scheduled"] == 1 and info["messages_ready"] == 0
    got = []
    ch.basic_consume(name, lambda c, mm, p, b: got.append(mm), auto_ack=False)
    deadline = time.monotonic() + 10
    while not got:
        assert time.monotonic() < deadline, "never redelivered"
        conn.process_data_events(time_limit=0.1)
    assert got[0].redelivered
    lease_publish(ch, "release", **{"x-delivery-tag": got[0].delivery_tag,
                                    "x-reason": "still failing"})
    deadline = time.monotonic() + 10
    while True:
        dm, props, _ = ch.basic_get(dlq, auto_ack=True)
        if dm is not None:
            break
        assert time.monotonic() < deadline, "not dead-lettered"
        conn.process_data_events(time_limit=0.05)
    assert props.headers["x-failure-reason"] == "still failing"
    assert props.headers["x-death"][0]["reason"] == "delivery_limit"


def test_amqp_lease_extension_refuses_misuse(connect, names):
    """An unknown delivery tag is 406 unknown delivery tag (as basic.ack), and so are a
    missing tag and an unknown verb."""
    name = names.q()
    conn = connect()
    for headers, verb, text in (
        ({"x-delivery-tag": 99}, "extend", "unknown delivery tag 99"),
        ({}, "release", "x-delivery-tag"),
        ({"x-delivery-tag": 1}, "bogus", "extend or release"),
    ):
        ch = conn.channel()
        ch.queue_declare(name, durable=True)
        ch.basic_publish("", name, b"x")
        ch.basic_get(name)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            lease_publish(ch, verb, **{**headers, "x-lease-ms": 1_000})
            ch.queue_declare(name, passive=True)
        assert e.value.reply_code == 406 and text in e.value.reply_text, e.value
    # Inside tx.select it is refused rather than deferred to the commit.
    ch = conn.channel()
    ch.tx_select()
    ch.basic_publish("", name, b"x")
    ch.tx_commit()
    m, _, _ = ch.basic_get(name)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        lease_publish(ch, "extend", **{"x-delivery-tag": m.delivery_tag, "x-lease-ms": 1_000})
        ch.queue_declare(name, passive=True)
    assert e.value.reply_code == 406 and "not transactional" in e.value.reply_text


# ------------------------------------------------------------------ deduplication

@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_dedup_token_drops_a_retried_publish(api, connect, names, queue_type):
    """With x-message-deduplication, a publish retried with the same dedup_token (HTTP) or
    x-deduplication-header (AMQP) is confirmed and dropped: the reply says duplicate, the
    publisher's confirm is an ack, and the queue holds one copy."""
    name = names.q(queue_type)
    ch = connect().channel()
    ch.queue_declare(name, durable=True, arguments={
        "x-queue-type": queue_type, "x-message-deduplication": True})
    r = publish(api, name, [{"payload": "order 7", "dedup_token": "order-7"},
                            {"payload": "order 7 again", "dedup_token": "order-7"},
                            {"payload": "order 8", "dedup_token": "order-8"}])
    assert r.status_code == 200, r.text
    assert [m["duplicate"] for m in r.json()["messages"]] == [False, True, False]
    ch.confirm_delivery()
    # A confirm, no exception: the duplicate is acked, not nacked.
    ch.basic_publish("", name, b"order 8 via amqp",
                     pika.BasicProperties(headers={"x-deduplication-header": "order-8"}))
    ch.basic_publish("", name, b"order 9",
                     pika.BasicProperties(headers={"x-deduplication-header": "order-9"}))
    bodies = [d["payload"] for d in claim(api, name, max_items=10).json()["deliveries"]]
    assert bodies == ["order 7", "order 8", "order 9"]
    assert queue_info(api, name)["leases"]["deduplicated"] == 2


def test_dedup_window_runs_out_after_the_cache_ttl(api, connect, names):
    """x-cache-ttl bounds the window in time: the same key is taken again once it passed."""
    name = names.q()
    ch = connect().channel()
    ch.queue_declare(name, durable=True, arguments={
        "x-message-deduplication": True, "x-cache-ttl": 200})
    assert publish(api, name, [{"payload": "a", "dedup_token": "k"}]).json()["messages"][0][
        "duplicate"] is False
    assert publish(api, name, [{"payload": "a", "dedup_token": "k"}]).json()["messages"][0][
        "duplicate"] is True
    # Time passing is the behaviour under test: nothing to await but the clock.
    time.sleep(0.3)
    assert publish(api, name, [{"payload": "a", "dedup_token": "k"}]).json()["messages"][0][
        "duplicate"] is False
    assert queue_info(api, name)["messages"] == 2


def test_dedup_token_needs_a_deduplicating_queue(api, connect, names):
    """A dedup_token on a queue without x-message-deduplication is a 400 (it could not be
    honoured), and x-cache-size must be positive."""
    name = names.q()
    ch = connect().channel()
    ch.queue_declare(name, durable=True)
    r = publish(api, name, [{"payload": "a", "dedup_token": "k"}])
    assert r.status_code == 400 and "x-message-deduplication" in r.text
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        ch.queue_declare(names.q("bad"), durable=True, arguments={"x-cache-size": 0})
    assert e.value.reply_code == 406 and "x-cache-size" in e.value.reply_text


# ------------------------------------------------------------------ browse and metrics

def test_browse_lists_ready_scheduled_and_claimed_without_claiming(api, connect, names):
    """GET .../messages lists a queue's ready messages in delivery order by position (with
    next_from for the next page), scheduled ones with ready_at, and claimed ones with their
    generation, deadline and worker; browsing changes nothing."""
    base, s = api
    name = names.q()
    declare(connect, name)
    publish(api, name, [{"payload": f"m{i}"} for i in range(5)])
    claimed = claim(api, name, worker="w-1", lease_ms=60_000).json()["deliveries"][0]
    held = claim(api, name).json()["deliveries"][0]
    settle(api, held["token"], "release", delay_ms=60_000)
    url = f"{base}/v1/queues/%2F/{q(name)}/messages"
    page = s.get(url, params={"limit": 2}, timeout=30).json()
    assert [m["payload"] for m in page["messages"]] == ["m2", "m3"]
    assert [m["position"] for m in page["messages"]] == [0, 1]
    assert page["next_from"] == 2
    rest = s.get(url, params={"from": 2, "limit": 2}, timeout=30).json()
    assert [m["payload"] for m in rest["messages"]] == ["m4"] and rest["next_from"] is None
    scheduled = s.get(url, params={"state": "scheduled"}, timeout=30).json()["messages"]
    assert [(m["payload"], m["state"]) for m in scheduled] == [("m1", "scheduled")]
    assert scheduled[0]["ready_at"] > time.time() * 1000 + 50_000
    unacked = s.get(url, params={"state": "unacked"}, timeout=30).json()["messages"]
    assert [(m["payload"], m["state"], m["generation"], m["worker"]) for m in unacked] == [
        ("m0", "claimed", 1, "w-1")]
    assert unacked[0]["lease_expires_at"] == claimed["lease_expires_at"]
    info = queue_info(api, name)
    assert (info["messages_ready"], info["messages_scheduled"],
            info["messages_unacknowledged"]) == (3, 1, 1)
    assert s.get(url, params={"state": "lost"}, timeout=30).status_code == 400
    assert s.get(url, params={"limit": 0}, timeout=30).status_code == 400


def test_work_queue_series_in_prometheus(api, connect, names, prometheus_url):
    """/metrics/per-object carries warren_queue_* series for a queue's scheduled and leased
    messages and its claim, release and dedup counters."""
    name = names.q()
    ch = connect().channel()
    ch.queue_declare(name, durable=True, arguments={"x-message-deduplication": True})
    publish(api, name, [{"payload": "a", "dedup_token": "1"}, {"payload": "a", "dedup_token": "1"},
                        {"payload": "b"}])
    ds = claim(api, name, max_items=2).json()["deliveries"]
    settle(api, ds[0]["token"], "release", delay_ms=60_000)
    text = requests.get(f"{prometheus_url}/metrics/per-object", timeout=30).text
    label = f'vhost="/",queue="{name}"'

    def value(series):
        for line in text.splitlines():
            if line.startswith(series + "{") and label in line:
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{series} for {name} not in /metrics/per-object")

    assert value("warren_queue_messages_scheduled") == 1
    assert value("warren_queue_messages_leased") == 1
    assert value("warren_queue_claims_total") == 2
    assert value("warren_queue_leases_released_total") == 1
    assert value("warren_queue_retries_delayed_total") == 1
    assert value("warren_queue_messages_deduplicated_total") == 1
    assert value("warren_queue_oldest_lease_age_seconds") >= 0


def test_batch_ack_reports_each_token(api, connect, names):
    """POST /v1/leases/ack acks a batch of tokens and answers each with the status its own
    ack would get: 200 for a current claim, 409 for a superseded one, 404 for garbage; the
    queue keeps exactly the messages not acked."""
    base, s = api
    name = names.q()
    declare(connect, name)
    publish(api, name, [{"payload": f"m{i}"} for i in range(4)])
    first = claim(api, name, max_items=4, lease_ms=200).json()["deliveries"]
    again = claim(api, name, max_items=4, lease_ms=60_000, wait_ms=10_000).json()["deliveries"]
    assert len(again) >= 1 and again[0]["generation"] == 2
    stale = next(d for d in first if d["message_id"] == again[0]["message_id"])
    # The stale token first: after the current one acked it, the message would be gone (404).
    tokens = [stale["token"]] + [x["token"] for x in again] + ["garbage"]
    r = s.post(f"{base}/v1/leases/ack", json={"tokens": tokens}, timeout=30)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["status"] for x in results] == [409] + [200] * len(again) + [404]
    assert results[0]["error"] == "stale_generation" and results[0]["current_generation"] == 2
    assert [x["token"] for x in results] == tokens
    assert queue_info(api, name)["messages"] == 4 - len(again)
    assert s.post(f"{base}/v1/leases/ack", json={"tokens": []}, timeout=30).status_code == 400


def test_priority_aging_serves_a_passed_over_message(connect, names):
    """x-priority-aging-ms: a low-priority message that has waited that long is served ahead
    of higher priorities that keep arriving (strict priority would starve it)."""
    name = names.q()
    ch = connect().channel()
    ch.queue_declare(name, durable=True, arguments={"x-max-priority": 5,
                                                    "x-priority-aging-ms": 200})
    ch.basic_publish("", name, b"low", pika.BasicProperties(priority=0))
    ch.basic_publish("", name, b"high-1", pika.BasicProperties(priority=5))
    assert ch.basic_get(name, auto_ack=True)[2] == b"high-1"
    # Time passing is the behaviour under test: nothing to await but the clock.
    time.sleep(0.25)
    ch.basic_publish("", name, b"high-2", pika.BasicProperties(priority=5))
    assert ch.basic_get(name, auto_ack=True)[2] == b"low"
    assert ch.basic_get(name, auto_ack=True)[2] == b"high-2"
