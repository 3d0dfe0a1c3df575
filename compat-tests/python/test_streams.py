"""Streams (x-queue-type: stream) over AMQP 0-9-1 with pika: declaration rules, offsets,
ack as credit, replay, filtering, Warren's server-side offset tracking, retention and
restarts. RabbitMQ's rules and texts where RabbitMQ has them."""

import datetime
import os
import time

import pika
import pytest

from amqp_helpers import channel_closed, connection_closed, pump, wait_until
from conftest import warren_process
from test_management import eventually, http, q as quote, series

STREAM = {"x-queue-type": "stream"}
WARREN_ONLY = pytest.mark.warren_only


def publish(ch, queue, bodies, headers=None, exchange=""):
    """Publish with confirms (pika's blocking channel waits for each one)."""
    ch.confirm_delivery()
    for b in bodies:
        ch.basic_publish(exchange, queue, b if isinstance(b, bytes) else b.encode(),
                         pika.BasicProperties(headers=headers(b) if callable(headers) else headers))


def read(conn, ch, queue, n, arguments=None, timeout=10):
    """Consume `n` deliveries from `queue`; returns [(offset, body, headers)].

    The prefetch is exactly `n` and the acks go after the cancel: pika's blocking
    basic_cancel nacks deliveries that arrived and were not dispatched yet, and a stream
    refuses nacks with 540 (RabbitMQ too). Acks after the cancel still move a named
    consumer's tracked offset. The closing basic.qos is a round trip: the acks were handled
    when it returns."""
    got = []
    ch.basic_qos(prefetch_count=n)

    def on(c, m, p, body):
        got.append((p.headers.get("x-stream-offset"), body.decode(), p.headers, m.delivery_tag))

    tag = ch.basic_consume(queue, on, arguments=arguments or {})
    wait_until(conn, lambda: len(got) >= n, timeout=timeout)
    ch.basic_cancel(tag)
    ch.basic_ack(got[-1][3], multiple=True)
    ch.basic_qos(prefetch_count=n)
    return [g[:3] for g in got]


def test_stream_declaration_rules(ch, names):
    """A durable stream declares and redeclares; non-durable, exclusive and auto-delete are
    refused with 406, as RabbitMQ refuses them."""
    q = names.q()
    ok = ch.queue_declare(q, durable=True, arguments=STREAM)
    assert ok.method.message_count == 0  # empty
    ch.queue_declare(q, durable=True, arguments=STREAM)
    for kwargs, prop in [({"durable": False}, "non-durable"),
                         ({"durable": True, "exclusive": True}, "exclusive-owner"),
                         ({"durable": True, "auto_delete": True}, "auto-delete")]:
        c = ch.connection.channel()
        with channel_closed(406, f"invalid property '{prop}'"):
            c.queue_declare(names.q(prop), arguments=STREAM, **kwargs)


def test_bad_retention_arguments_are_refused(ch, names):
    for args, term in [({"x-max-age": "7 days"}, "invalid_max_age"),
                       ({"x-max-length-bytes": -1}, "x-max-length-bytes")]:
        c = ch.connection.channel()
        with channel_closed(406, term):
            c.queue_declare(names.q(), durable=True, arguments={**STREAM, **args})


def test_consume_needs_manual_ack_and_a_prefetch(connect, names):
    """RabbitMQ's refusals: no prefetch 406, automatic ack 540, basic.get 540, global QoS
    540 (the last three close the connection)."""
    conn = connect()
    ch = conn.channel()
    q = names.q()
    ch.queue_declare(q, durable=True, arguments=STREAM)
    with channel_closed(406, f"consumer prefetch count is not set for 'queue '{q}' in vhost '/''"):
        ch.basic_consume(q, lambda *a: None)
    ch = conn.channel()
    ch.basic_qos(prefetch_count=10)
    with connection_closed(540, "automatic acknowledgement not supported by stream queues"):
        ch.basic_consume(q, lambda *a: None, auto_ack=True)
    ch = connect().channel()
    with connection_closed(540, "basic.get not supported by stream queues"):
        ch.basic_get(q)
    # A consumer prefetch and a channel-wide one: the latter is refused (with only a
    # channel-wide one, the consumer has no prefetch: 406 above, RabbitMQ's order).
    ch = connect().channel()
    ch.basic_qos(prefetch_count=10)
    ch.basic_qos(prefetch_count=10, global_qos=True)
    with connection_closed(540, "global qos"):
        ch.basic_consume(q, lambda *a: None)


def test_messages_stay_and_every_consumer_replays_them_with_offsets(conn, ch, names):
    """Consumption removes nothing: two consumers from `first` each get every message in
    order, each with its offset in the x-stream-offset header; a routed publish through an
    exchange lands too."""
    q, x = names.q(), names.x()
    ch.queue_declare(q, durable=True, arguments=STREAM)
    ch.exchange_declare(x, "fanout")
    ch.queue_bind(q, x)
    bodies = [f"m{i}" for i in range(20)]
    publish(ch, q, bodies[:10])
    publish(ch, "", bodies[10:], exchange=x)
    for _ in range(2):
        got = read(conn, ch, q, 20, {"x-stream-offset": "first"})
        assert [b for _, b, _ in got] == bodies
        assert [o for o, _, _ in got] == list(range(20))
    # Declare-ok counts what the stream holds (rabbit_stream_queue:stat).
    assert ch.queue_declare(q, passive=True).method.message_count == 20


def test_every_form_of_x_stream_offset(conn, ch, names):
    """first, last, next, a numeric offset, a timestamp and an interval."""
    q = names.q()
    ch.queue_declare(q, durable=True, arguments=STREAM)
    publish(ch, q, [f"old{i}" for i in range(5)])
    # A timestamp is in seconds: wait for the next second so it falls between the batches.
    mark = int(time.time()) + 1
    wait_until(ch.connection, lambda: time.time() >= mark + 0.05, timeout=3)
    publish(ch, q, [f"new{i}" for i in range(5)])
    assert read(conn, ch, q, 1, {"x-stream-offset": "first"})[0][1] == "old0"
    assert read(conn, ch, q, 1, {"x-stream-offset": 7})[0][:2] == (7, "new2")
    # Each confirmed publish was its own chunk: `last` is the last message.
    assert read(conn, ch, q, 1, {"x-stream-offset": "last"})[0][1] == "new4"
    ts = datetime.datetime.fromtimestamp(mark, tz=datetime.timezone.utc)
    assert read(conn, ch, q, 1, {"x-stream-offset": ts})[0][1] == "new0"
    assert read(conn, ch, q, 1, {"x-stream-offset": "1h"})[0][1] == "old0"
    # `next` (the default): only what is published after the consumer attached.
    got = []
    ch.basic_qos(prefetch_count=10)
    tag = ch.basic_consume(q, lambda c, m, p, b: (got.append(b), c.basic_ack(m.delivery_tag)),
                           arguments={"x-stream-offset": "next"})
    publish(ch, q, ["later"])
    wait_until(conn, lambda: got)
    ch.basic_cancel(tag)
    assert got == [b"later"]


@WARREN_ONLY
def test_negative_offsets_read_the_last_n(conn, ch, names):
    q = names.q()
    ch.queue_declare(q, durable=True, arguments=STREAM)
    publish(ch, q, [f"m{i}" for i in range(10)])
    got = read(conn, ch, q, 3, {"x-stream-offset": -3})
    assert [b for _, b, _ in got] == ["m7", "m8", "m9"]


def test_ack_is_credit(conn, ch, names):
    """With prefetch 3 and no acks, three deliveries and no more; acks give credit back."""
    q = names.q()
    ch.queue_declare(q, durable=True, arguments=STREAM)
    publish(ch, q, [f"m{i}" for i in range(10)])
    ch.basic_qos(prefetch_count=3)
    got = []
    ch.basic_consume(q, lambda c, m, p, b: got.append(m.delivery_tag),
                     arguments={"x-stream-offset": "first"})
    wait_until(conn, lambda: len(got) == 3)
    pump(conn, 0.3)
    assert len(got) == 3
    ch.basic_ack(got[1], multiple=True)
    wait_until(conn, lambda: len(got) == 5)
    ch.basic_ack(got[2])
    wait_until(conn, lambda: len(got) == 6)
    pump(conn, 0.3)
    assert len(got) == 6


@pytest.mark.parametrize("how", ["nack", "reject", "recover"])
def test_only_acks_settle_stream_deliveries(connect, names, how):
    """RabbitMQ refuses nack, reject and recover of stream deliveries with 540 (a stream
    redelivers nothing); it closes the connection."""
    conn = connect()
    ch = conn.channel()
    q = names.q()
    ch.queue_declare(q, durable=True, arguments=STREAM)
    publish(ch, q, ["m"])
    ch.basic_qos(prefetch_count=5)
    got = []
    ch.basic_consume(q, lambda c, m, p, b: got.append(m.delivery_tag),
                     arguments={"x-stream-offset": "first"})
    wait_until(conn, lambda: got)
    with connection_closed(540, "basic.nack and basic.reject not supported by stream queues"):
        if how == "nack":
            ch.basic_nack(got[0], requeue=False)
        elif how == "reject":
            ch.basic_reject(got[0], requeue=True)
        else:
            ch.basic_recover(requeue=True)
        pump(conn, 1)


@pytest.mark.parametrize("match_unfiltered", [False, True])
def test_filtering_delivers_only_matching_messages(conn, ch, names, match_unfiltered):
    """x-stream-filter-value on publish, x-stream-filter (and x-stream-match-unfiltered) on
    consume (RabbitMQ 3.13+)."""
    q = names.q()
    ch.queue_declare(q, durable=True, arguments=STREAM)
    colours = ["red", "blue", None, "red", "green", None, "red"]
    ch.confirm_delivery()
    for i, c in enumerate(colours):
        ch.basic_publish("", q, f"{i}:{c}".encode(), pika.BasicProperties(
            headers={"x-stream-filter-value": c} if c else None))
    args = {"x-stream-offset": "first", "x-stream-filter": ["red", "green"]}
    if match_unfiltered:
        args["x-stream-match-unfiltered"] = True
    want = [f"{i}:{c}" for i, c in enumerate(colours)
            if c in ("red", "green") or (match_unfiltered and c is None)]
    got = read(conn, ch, q, len(want), args)
    assert [b for _, b, _ in got] == want
    ch.basic_qos(prefetch_count=100)
    pump(conn, 0.2)


@WARREN_ONLY
def test_a_named_consumer_resumes_after_its_last_ack(conn, ch, names):
    """Warren's server-side offset tracking: x-stream-consumer-name resumes where it acked,
    across reconnects; an explicit x-stream-offset still wins."""
    q = names.q()
    ch.queue_declare(q, durable=True, arguments=STREAM)
    publish(ch, q, [f"m{i}" for i in range(10)])
    name = {"x-stream-consumer-name": "billing"}
    # A consumer of that name that leaves with deliveries unacked: its position stays at
    # the lowest of them (here nothing acked: the start).
    ch.basic_qos(prefetch_count=3)
    held = []
    tag = ch.basic_consume(q, lambda c, m, p, b: held.append(m.delivery_tag),
                           arguments={**name, "x-stream-offset": "first"})
    wait_until(conn, lambda: len(held) == 3)
    ch.basic_cancel(tag)
    ch.close()
    ch = conn.channel()
    got = read(conn, ch, q, 4, {**name, "x-stream-offset": "first"})
    assert [b for _, b, _ in got] == ["m0", "m1", "m2", "m3"]
    c2 = pika.BlockingConnection(conn._impl.params)
    try:
        ch2 = c2.channel()
        got = read(c2, ch2, q, 2, name)
        assert [b for _, b, _ in got] == ["m4", "m5"]
        got = read(c2, ch2, q, 1, {**name, "x-stream-offset": 1})
        assert got[0][1] == "m1"
    finally:
        c2.close()


@WARREN_ONLY
def test_restart_keeps_messages_and_tracked_offsets(tmp_path):
    """After a restart the stream holds what was confirmed, and a named consumer resumes
    where it acked (offsets are saved at shutdown)."""
    def url(w):
        return pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{w['port']}/%2F")

    named = {"x-stream-consumer-name": "c"}
    with warren_process(data_dir=tmp_path) as w:
        conn = pika.BlockingConnection(url(w))
        ch = conn.channel()
        ch.queue_declare("s", durable=True, arguments=STREAM)
        publish(ch, "s", [f"m{i}" for i in range(50)])
        got = read(conn, ch, "s", 20, {**named, "x-stream-offset": "first"})
        assert got[-1][1] == "m19"
        conn.close()
    with warren_process(data_dir=tmp_path) as w:
        conn = pika.BlockingConnection(url(w))
        ch = conn.channel()
        ch.queue_declare("s", durable=True, arguments=STREAM)
        got = read(conn, ch, "s", 50, {"x-stream-offset": "first"})
        assert [b for _, b, _ in got] == [f"m{i}" for i in range(50)]
        assert read(conn, ch, "s", 1, named)[0][:2] == (20, "m20")
        # Offsets go on after the restart's.
        publish(ch, "s", ["after"])
        assert read(conn, ch, "s", 1, {"x-stream-offset": "last"})[0][:2] == (50, "after")
        conn.close()


def test_retention_by_size_drops_whole_segments(conn, ch, names, management_url):
    """Small segments and x-max-length-bytes: the oldest segments go (the stream's first
    offset moves past them), the open one never does."""
    q = names.q()
    ch.queue_declare(q, durable=True, arguments={
        **STREAM, "x-stream-max-segment-size-bytes": 2000, "x-max-length-bytes": 6000})
    publish(ch, q, [("x" * 200) + str(i) for i in range(100)])
    got = read(conn, ch, q, 1, {"x-stream-offset": "first"})
    first = got[0][0]
    # ~21 KB published, at most 6 KB (plus the open segment) kept.
    assert first > 50, first
    if not os.environ.get("WARREN_TEST_AMQP_URL"):
        status, info, _ = http("GET", f"{management_url}/api/queues/%2F/{quote(q)}")
        assert status == 200, info
        assert info["type"] == "stream"
        assert info["messages"] == 100 - first
        assert info["stream"]["first_offset"] == first
        assert info["stream"]["segments"] <= 5


def test_purge_is_refused(connect, names):
    """RabbitMQ refuses queue.purge on a stream with 540 (rabbitmq-server#2483)."""
    ch = connect().channel()
    q = names.q()
    ch.queue_declare(q, durable=True, arguments=STREAM)
    with connection_closed(540, "queue.purge not supported by stream queues"):
        ch.queue_purge(q)


def stream_info(management_url, q):
    status, info, _ = http("GET", f"{management_url}/api/queues/%2F/{quote(q)}")
    assert status == 200, info
    return info


@WARREN_ONLY
@pytest.mark.parametrize("how", ["argument", "policy"])
def test_retention_by_age_reclaims_old_segments(conn, ch, ctl, names, management_url, how):
    """x-max-age, or a policy's max-age (apply-to streams): once segments are older, they go
    (the open segment stays); the broker applies age retention about once a second."""
    q = names.q()
    args = {**STREAM, "x-stream-max-segment-size-bytes": 1000}
    if how == "argument":
        args["x-max-age"] = "1s"
    ch.queue_declare(q, durable=True, arguments=args)
    publish(ch, q, [("y" * 300) + str(i) for i in range(20)])
    info = stream_info(management_url, q)
    assert info["stream"]["first_offset"] == 0 and info["stream"]["segments"] > 3
    if how == "policy":
        code, out = ctl("set_policy", f"{q}-age", f"^{q}$", '{"max-age": "1s"}',
                        "--apply-to", "streams")
        assert code == 0, out
        assert stream_info(management_url, q)["policy"] == f"{q}-age"
    info = eventually(lambda: stream_info(management_url, q),
                      lambda i: i["stream"]["segments"] == 1, timeout=15)
    assert info["stream"]["first_offset"] > 0
    got = read(conn, ch, q, 1, {"x-stream-offset": "first"})
    assert got[0][0] == info["stream"]["first_offset"]
    if how == "policy":
        ctl("clear_policy", f"{q}-age")


def test_invalid_stream_policies_are_refused(ctl, names):
    code, out = ctl("set_policy", "bad-age", "^x$", '{"max-age": "7 days"}', "--apply-to",
                    "streams")
    assert code != 0 and "max-age" in out, out


@WARREN_ONLY
def test_tracked_consumer_lag_in_the_api_and_prometheus(conn, ch, names, management_url,
                                                         prometheus_url):
    """A named consumer's position and lag: messages and age behind the end, and what
    retention dropped before it read it."""
    q = names.q()
    ch.queue_declare(q, durable=True, arguments=STREAM)
    publish(ch, q, [f"m{i}" for i in range(10)])
    read(conn, ch, q, 4, {"x-stream-consumer-name": "audit", "x-stream-offset": "first"})
    info = eventually(lambda: stream_info(management_url, q),
                      lambda i: i["stream"]["consumers"])
    (c,) = info["stream"]["consumers"]
    assert (c["name"], c["offset"], c["lag_messages"]) == ("audit", 4, 6)
    assert c["lag_seconds"] >= 0 and c["lost_to_retention"] == 0
    status, text, _ = http("GET", prometheus_url + "/metrics", user=None)
    assert status == 200
    mine = frozenset({("vhost", "/"), ("queue", q), ("consumer", "audit")})
    assert series(text, "warren_stream_consumer_lag_messages")[mine] == 6
    assert series(text, "warren_stream_consumer_offset")[mine] == 4
    stream = frozenset({("vhost", "/"), ("queue", q)})
    assert series(text, "warren_stream_next_offset")[stream] == 10


@pytest.mark.parametrize("prefetch,named", [(1, False), (50, False), (1000, True)])
def test_counts_after_every_message_is_acked(conn, ch, names, management_url, prefetch, named):
    """Goal: a stream reports what it holds, not what was delivered: 300 published and all
    acked is 300 messages, 300 ready, 0 unacknowledged, with the consumer attached and after
    (checked on RabbitMQ 4.0.5). Method: publish 300 with confirms, consume from first with
    the given prefetch acking each, then read the queue object twice."""
    queue = names.q()
    ch.queue_declare(queue, durable=True, arguments=STREAM)
    publish(ch, queue, [f"m{i}" for i in range(300)])
    consumer = conn.channel()
    consumer.basic_qos(prefetch_count=prefetch)
    got = []

    def on(c, m, p, body):
        got.append(body)
        c.basic_ack(m.delivery_tag)

    args = {"x-stream-offset": "first"}
    if named:
        args["x-stream-consumer-name"] = queue + "-reader"
    consumer.basic_consume(queue, on, arguments=args)
    wait_until(conn, lambda: len(got) == 300, timeout=30)
    consumer.basic_qos(prefetch_count=prefetch)  # a round trip: every ack was handled

    def counts_of(r):
        o = r[1]
        return o.get("messages"), o.get("messages_ready"), o.get("messages_unacknowledged")

    path = management_url + f"/api/queues/%2F/{quote(queue)}"
    r = eventually(lambda: http("GET", path), lambda r: counts_of(r) == (300, 300, 0))
    assert counts_of(r) == (300, 300, 0), r[1]
    consumer.close()
    r = eventually(lambda: http("GET", path), lambda r: counts_of(r) == (300, 300, 0))
    assert counts_of(r) == (300, 300, 0), r[1]
