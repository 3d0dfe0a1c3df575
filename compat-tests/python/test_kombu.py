"""kombu (on its default py-amqp transport) and raw py-amqp round trips."""

import datetime
import decimal
import socket
import time
from urllib.parse import unquote, urlparse

import amqp
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue


def _drain_until(conn, predicate, timeout=10):
    """Drain kombu events until predicate() holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"condition not met within {timeout}s")
        try:
            conn.drain_events(timeout=min(0.5, remaining))
        except socket.timeout:
            pass


def _amqp_connection(amqp_url, **kw):
    u = urlparse(amqp_url)
    c = amqp.Connection(
        host=f"{u.hostname}:{u.port or 5672}",
        userid=unquote(u.username or "guest"),
        password=unquote(u.password or "guest"),
        virtual_host=unquote(u.path[1:]) if len(u.path) > 1 else "/",
        **kw,
    )
    c.connect()
    return c


@pytest.fixture
def kconn(amqp_url):
    with Connection(amqp_url, connect_timeout=10) as c:
        c.connect()
        yield c


def test_kombu_uses_py_amqp_with_amqplain(kconn, amqp_url):
    """kombu's default amqp:// transport is py-amqp and it authenticates with AMQPLAIN offered by the broker."""
    assert kconn.transport.driver_name == "py-amqp"
    raw = kconn.connection  # the underlying amqp.Connection
    assert b"AMQPLAIN" in raw.mechanisms, raw.mechanisms
    # py-amqp tries GSSAPI, EXTERNAL, AMQPLAIN, PLAIN in that order and picks the first the
    # server offers; a broker offering EXTERNAL/GSSAPI would break guest/guest logins.
    assert b"EXTERNAL" not in raw.mechanisms and b"GSSAPI" not in raw.mechanisms
    assert raw.server_properties["capabilities"]["publisher_confirms"] is True


def test_kombu_topic_exchange_round_trip(kconn, names):
    """Producer -> topic exchange -> bound Queue -> Consumer delivers the JSON body and headers intact."""
    x = Exchange(names.x("topic"), type="topic", durable=False)
    q = Queue(names.q("topic"), exchange=x, routing_key="orders.#", durable=False)
    received = []

    def on_message(body, message):
        received.append((body, message.headers, message.delivery_info["routing_key"],
                         message.content_type))
        message.ack()

    with kconn.channel() as ch:
        producer = Producer(ch)
        with Consumer(kconn, queues=[q], callbacks=[on_message], accept=["json"]):
            producer.publish({"id": 1, "items": ["a", "b"]}, exchange=x,
                             routing_key="orders.eu.new", serializer="json",
                             headers={"h-str": "v", "h-int": 7, "h-list": [1, "x"]},
                             declare=[q])
            producer.publish({"id": 2}, exchange=x, routing_key="invoices.eu",
                             serializer="json", declare=[q])  # not routed to q
            producer.publish({"id": 3}, exchange=x, routing_key="orders",
                             serializer="json", declare=[q])
            _drain_until(kconn, lambda: len(received) >= 2)
    body, headers, rk, ctype = received[0]
    assert body == {"id": 1, "items": ["a", "b"]}
    assert headers == {"h-str": "v", "h-int": 7, "h-list": [1, "x"]}
    assert rk == "orders.eu.new"
    assert ctype == "application/json"
    assert [r[0]["id"] for r in received] == [1, 3]


def test_kombu_default_exchange_round_trip(kconn, names):
    """Publishing to the default exchange with routing_key=<queue name> reaches that queue via kombu."""
    qname = names.q("default")
    q = Queue(qname, durable=False)
    with kconn.channel() as ch:
        q(ch).declare()
        Producer(ch).publish("plain text", exchange="", routing_key=qname,
                             serializer="raw", content_type="text/plain",
                             headers={"k": "v"})
        received = []
        with Consumer(ch, queues=[q], accept=["text/plain"],
                      callbacks=[lambda body, m: (received.append((body, m.headers)), m.ack())]):
            _drain_until(kconn, lambda: received)
    body, headers = received[0]
    assert body in ("plain text", b"plain text")
    assert headers == {"k": "v"}


def test_kombu_simple_queue(kconn, names):
    """kombu SimpleQueue put/get round trip preserves body and headers and acks remove the message."""
    qname = names.q("simple")
    names.exchanges.append(qname)  # SimpleQueue declares a direct exchange named like the queue
    sq = kconn.SimpleQueue(qname)
    try:
        sq.put({"n": 1}, headers={"trace": "abc"}, serializer="json")
        sq.put({"n": 2}, serializer="json")
        m1 = sq.get(block=True, timeout=10)
        assert m1.payload == {"n": 1}
        assert m1.headers == {"trace": "abc"}
        m1.ack()
        m2 = sq.get(block=True, timeout=10)
        assert m2.payload == {"n": 2}
        m2.ack()
        with pytest.raises(sq.Empty):
            sq.get(block=False)
        assert sq.qsize() == 0
    finally:
        sq.close()


def test_kombu_confirm_publish(amqp_url, names):
    """kombu with confirm_publish=True gets publisher confirms for every publish."""
    qname = names.q("confirm")
    with Connection(amqp_url, transport_options={"confirm_publish": True}) as c:
        with c.channel() as ch:
            q = Queue(qname, durable=False)
            q(ch).declare()
            producer = Producer(ch)
            for i in range(5):
                producer.publish({"i": i}, routing_key=qname, serializer="json")
            _, count, _ = ch.queue_declare(qname, passive=True)
            assert count == 5


def test_kombu_requeue_and_reject(kconn, names):
    """kombu message.requeue() redelivers the message and message.reject() drops it."""
    qname = names.q("requeue")
    q = Queue(qname, durable=False)
    with kconn.channel() as ch:
        q(ch).declare()
        Producer(ch).publish({"v": 1}, routing_key=qname, serializer="json")
        bound = q(ch)
        m = bound.get(no_ack=False)
        assert m is not None and not m.delivery_info["redelivered"]
        m.requeue()
        m2 = bound.get(no_ack=False)
        assert m2.delivery_info["redelivered"] is True
        m2.reject()
        assert bound.get(no_ack=False) is None


# ---- raw py-amqp ----------------------------------------------------------------

PY_AMQP_HEADERS = {
    "str": "\u00fcnicode",
    "int": 12,
    "big": 2**40,  # py-amqp encodes 64-bit ints with the 'L' tag
    "neg-big": -(2**40),
    "float": 2.5,  # 'd' double
    "bool": False,
    "none": None,
    "decimal": decimal.Decimal("-12.345"),
    "ts": datetime.datetime(2023, 1, 2, 3, 4, 5),
    "table": {"a": [1, 2.0, {"b": None}]},
    "array": [True, "s", 3],
}


def test_py_amqp_header_types_round_trip(amqp_url, names):
    """Headers encoded by py-amqp (incl. double 'd' and 64-bit 'L' ints) round-trip with types preserved."""
    qname = names.q("pyamqp")
    c = _amqp_connection(amqp_url)
    try:
        ch = c.channel()
        ch.queue_declare(qname, durable=False, auto_delete=False)
        ch.confirm_select()
        ch.basic_publish(amqp.Message(b"body", application_headers=PY_AMQP_HEADERS,
                                      content_type="application/x-test"),
                         exchange="", routing_key=qname)
        msg = ch.basic_get(qname, no_ack=True)
        assert msg is not None and msg.body == b"body"
        got = msg.properties["application_headers"]
        assert got["str"] == PY_AMQP_HEADERS["str"]
        assert got["int"] == 12
        assert got["big"] == 2**40 and got["neg-big"] == -(2**40)
        assert isinstance(got["float"], float) and got["float"] == 2.5
        assert got["bool"] is False and got["none"] is None
        assert got["decimal"] == decimal.Decimal("-12.345")
        assert got["ts"] == PY_AMQP_HEADERS["ts"]
        assert got["table"] == {"a": [1, 2.0, {"b": None}]}
        assert got["array"] == [True, "s", 3]
        assert msg.properties["content_type"] == "application/x-test"
    finally:
        c.close()


def test_py_amqp_server_generated_consumer_tag(amqp_url, names):
    """basic.consume with an empty consumer tag gets a server-generated amq.ctag-* tag."""
    qname = names.q("ctag")
    c = _amqp_connection(amqp_url)
    try:
        ch = c.channel()
        ch.queue_declare(qname, durable=False, auto_delete=False)
        tag = ch.basic_consume(qname, consumer_tag="", callback=lambda m: None)
        assert tag.startswith("amq.ctag-"), tag
        ch.basic_cancel(tag)
    finally:
        c.close()


def test_kombu_priority_queue_and_ttl_dead_lettering(kconn, names):
    """kombu's queue_arguments and message options: x-max-priority orders by the priority
    option; x-message-ttl with a dead-letter exchange moves expired messages with x-death."""
    prio = Queue(names.q("prio"), queue_arguments={"x-max-priority": 5}, durable=False)
    dlx = Exchange(names.x("dlx"), type="fanout", durable=False)
    dead = Queue(names.q("dead"), exchange=dlx, durable=False)
    ttl = Queue(names.q("ttl"), durable=False,
                queue_arguments={"x-message-ttl": 50, "x-dead-letter-exchange": dlx.name})
    with kconn.channel() as ch:
        for q in (prio, dead, ttl):
            q(ch).declare()
        producer = Producer(ch)
        for body, priority in (("low", 1), ("high", 5), ("mid", 3)):
            producer.publish(body, routing_key=prio.name, priority=priority, serializer="json")
        producer.publish("old", routing_key=ttl.name, serializer="json")
        got = [prio(ch).get(no_ack=True).payload for _ in range(3)]
        assert got == ["high", "mid", "low"]
        deadline = time.monotonic() + 10
        msg = None
        while msg is None and time.monotonic() < deadline:
            msg = dead(ch).get(no_ack=True)
            if msg is None:
                time.sleep(0.02)  # bounded poll of basic.get: the event is the broker's timer
        assert msg is not None and msg.payload == "old"
        assert msg.headers["x-death"][0]["reason"] == "expired"
        assert msg.headers["x-death"][0]["queue"] == ttl.name


def test_kombu_max_length_reject_publish_nacks(kconn, names):
    """With confirms on (kombu's confirm_publish), a reject-publish queue at its limit makes
    the publish fail."""
    q = Queue(names.q("full"), durable=False,
              queue_arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    with Connection(kconn.as_uri(include_password=True),
                    transport_options={"confirm_publish": True}) as c:
        with c.channel() as ch:
            q(ch).declare()
            producer = Producer(ch)
            producer.publish("one", routing_key=q.name, serializer="json")
            with pytest.raises(Exception):
                producer.publish("two", routing_key=q.name, serializer="json")
