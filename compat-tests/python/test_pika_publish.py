"""basic.publish: errors, mandatory returns, publisher confirms, transactions, properties, large bodies."""

import datetime
import decimal
import hashlib
import os

import pika
import pytest
from pika.exceptions import UnroutableError

from amqp_helpers import bodies_of, channel_closed, counts, get_all, wait_until


def test_publish_to_missing_exchange_closes_channel_404(conn, ch, names):
    """Publishing to a non-existent exchange closes the channel with 404 NOT_FOUND."""
    x = names.x("missing")
    ch.basic_publish(x, "k", b"lost")
    # basic.publish has no reply; the channel.close arrives asynchronously and surfaces
    # on the next synchronous call.
    # RabbitMQ: "NOT_FOUND - no exchange '<x>' in vhost '/'"
    with channel_closed(404, "no exchange"):
        ch.queue_declare("", exclusive=True)
    assert ch.is_closed
    assert conn.is_open  # only the channel is closed


def test_publish_to_missing_exchange_in_confirm_mode(ch, names):
    """In confirm mode, publishing to a missing exchange raises the 404 channel close from basic_publish."""
    ch.confirm_delivery()
    with channel_closed(404):
        ch.basic_publish(names.x("missing"), "k", b"lost")


def test_publish_to_internal_exchange_is_403(conn, ch, names):
    """Publishing directly to an internal exchange closes the channel with 403 ACCESS_REFUSED."""
    x = names.x("internal")
    ch.exchange_declare(x, exchange_type="fanout", internal=True)
    ch.basic_publish(x, "", b"nope")
    # RabbitMQ: "ACCESS_REFUSED - cannot publish to internal exchange '<x>' in vhost '/'"
    with channel_closed(403, "internal exchange"):
        ch.queue_declare("", exclusive=True)


def test_mandatory_unroutable_returned_before_ack(ch, names):
    """A mandatory unroutable publish is returned with 312 NO_ROUTE before its confirm ack (pika raises UnroutableError)."""
    x = names.x()
    ch.exchange_declare(x, exchange_type="direct")
    ch.confirm_delivery()
    with pytest.raises(UnroutableError) as info:
        ch.basic_publish(x, "nowhere", b"bounce", pika.BasicProperties(message_id="m-1"),
                         mandatory=True)
    [returned] = info.value.messages
    assert returned.method.reply_code == 312
    assert returned.method.reply_text == "NO_ROUTE"
    assert returned.method.exchange == x
    assert returned.method.routing_key == "nowhere"
    assert returned.properties.message_id == "m-1"
    assert returned.body == b"bounce"
    # The channel stays usable.
    q = names.q()
    ch.queue_declare(q)
    ch.queue_bind(q, x, "somewhere")
    ch.basic_publish(x, "somewhere", b"ok", mandatory=True)
    assert bodies_of(get_all(ch, q)) == [b"ok"]


def test_mandatory_unroutable_without_confirms_uses_return_callback(conn, ch, names):
    """Without confirms a mandatory unroutable message is delivered to the on_return callback."""
    returns = []
    ch.add_on_return_callback(lambda c, method, props, body: returns.append((method, body)))
    ch.basic_publish("", names.q("nobody"), b"r", mandatory=True)
    wait_until(conn, lambda: returns)
    method, body = returns[0]
    assert (method.reply_code, method.reply_text, body) == (312, "NO_ROUTE", b"r")


def test_non_mandatory_unroutable_is_silently_dropped(ch, names):
    """A non-mandatory unroutable publish is acked and not returned."""
    ch.confirm_delivery()
    ch.basic_publish("", names.q("nobody"), b"dropped")  # would raise on nack/return


def test_publisher_confirms_ack_every_publish(conn, ch, names):
    """In confirm mode every publish is acked (pika raises NackError otherwise) and all messages are enqueued."""
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    for i in range(50):
        ch.basic_publish("", q, b"c%d" % i)
    assert counts(conn, q) == (50, 0)


def test_publisher_confirm_delivery_tags_are_sequential(conn, names):
    """Raw confirm mode: basic.ack delivery tags count publishes 1..N (possibly multiple=True)."""
    q = names.q()
    ch = conn.channel()
    ch.queue_declare(q)
    impl = ch._impl
    acked = set()
    done = []

    def on_select_ok(_frame):
        done.append(True)

    def on_confirm(frame):
        m = frame.method
        assert isinstance(m, pika.spec.Basic.Ack), m
        if m.multiple:
            acked.update(t for t in range(1, m.delivery_tag + 1))
        else:
            acked.add(m.delivery_tag)

    impl.confirm_delivery(ack_nack_callback=on_confirm, callback=on_select_ok)
    wait_until(conn, lambda: done)
    for i in range(20):
        impl.basic_publish("", q, b"t%d" % i)
    wait_until(conn, lambda: len(acked) >= 20)
    assert acked == set(range(1, 21))


def test_tx_commit_and_rollback(conn, ch, names):
    """In tx mode publishes are invisible until tx.commit, and rolled-back publishes are discarded."""
    q = names.q()
    ch.queue_declare(q)
    ch.tx_select()
    ch.basic_publish("", q, b"t1")
    ch.basic_publish("", q, b"t2")
    assert counts(conn, q) == (0, 0)
    ch.tx_commit()
    assert counts(conn, q) == (2, 0)
    ch.basic_publish("", q, b"t3")
    ch.tx_rollback()
    assert counts(conn, q) == (2, 0)
    ch.basic_publish("", q, b"t4")
    ch.tx_commit()
    assert bodies_of(get_all(conn.channel(), q)) == [b"t1", b"t2", b"t4"]


def test_tx_acks_applied_on_commit(conn, ch, names):
    """In tx mode acks take effect only on commit; a rolled-back ack leaves the message unacked."""
    q = names.q()
    ch.queue_declare(q)
    pub = conn.channel()
    pub.confirm_delivery()
    pub.basic_publish("", q, b"a")
    ch.tx_select()
    m, _, _ = ch.basic_get(q, auto_ack=False)
    ch.basic_ack(m.delivery_tag)
    ch.tx_rollback()
    ch.close()  # rollback did not ack: closing the channel requeues the message
    assert counts(conn, q) == (1, 0)


def test_tx_publish_error_discards_whole_transaction(conn, ch, names):
    """A publish to an internal exchange fails at publish time inside a transaction: the
    channel closes with 403 and the earlier, uncommitted publishes are never enqueued."""
    q, x = names.q(), names.x("internal")
    ch.queue_declare(q)
    ch.exchange_declare(x, exchange_type="fanout", internal=True)
    ch.tx_select()
    ch.basic_publish("", q, b"before")
    ch.basic_publish(x, "", b"refused")
    with channel_closed(403, "internal exchange"):
        ch.tx_commit()
    assert counts(conn, q) == (0, 0)


def test_tx_mandatory_unroutable_is_returned_at_commit(conn, ch, names):
    """In tx mode a mandatory unroutable publish is returned (312 NO_ROUTE) when the
    transaction commits, not at publish time."""
    x = names.x()
    ch.exchange_declare(x, exchange_type="direct")
    returned = []
    ch.add_on_return_callback(lambda c, m, p, b: returned.append((m.reply_code, b)))
    ch.tx_select()
    ch.basic_publish(x, "nowhere", b"bounce", mandatory=True)
    ch.tx_rollback()
    ch.basic_publish(x, "nowhere", b"bounce2", mandatory=True)
    ch.tx_commit()
    wait_until(conn, lambda: len(returned) == 1)
    assert returned == [(312, b"bounce2")]


def test_tx_commit_without_select_is_406(ch):
    """tx.commit on a channel that is not in tx mode fails with 406 PRECONDITION_FAILED."""
    # RabbitMQ: "PRECONDITION_FAILED - channel is not transactional"
    with channel_closed(406, "not transactional"):
        ch.tx_commit()


def test_confirm_select_on_tx_channel_is_406(ch):
    """confirm.select on a transactional channel fails with 406 PRECONDITION_FAILED."""
    ch.tx_select()
    # RabbitMQ: "PRECONDITION_FAILED - cannot switch from tx to confirm mode"
    with channel_closed(406, "cannot switch from tx to confirm mode"):
        ch.confirm_delivery()


def test_tx_select_on_confirm_channel_is_406(ch):
    """tx.select on a confirm-mode channel fails with 406 PRECONDITION_FAILED."""
    ch.confirm_delivery()
    # RabbitMQ: "PRECONDITION_FAILED - cannot switch from confirm to tx mode"
    with channel_closed(406, "cannot switch from confirm to tx mode"):
        ch.tx_select()


HEADERS = {
    "str": "hello \u00e9\u4e16",
    "int": 42,
    "neg": -7,
    "long": 2**40 + 3,
    # pika cannot encode Python floats (UnsupportedAMQPFieldException); float ('d') headers
    # are covered through py-amqp in test_kombu.py::test_py_amqp_header_types_round_trip.
    "true": True,
    "false": False,
    "none": None,
    "decimal": decimal.Decimal("3.14"),
    "ts": datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.timezone.utc),  # pika decodes T as aware UTC
    "nested": {"inner": "v", "n": 1, "deeper": {"list": [1, "two", None]}},
    "list": [1, "a", True, decimal.Decimal("2.5"), {"k": "v"}, [3, 4]],
    "bytes": b"\x00\x01\xff binary",
    "empty-str": "",
    "empty-list": [],
    "empty-table": {},
}


def test_message_properties_round_trip(conn, ch, names):
    """Every basic property, and headers of every field type pika can encode, round-trip unchanged."""
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    props = pika.BasicProperties(
        content_type="application/json",
        content_encoding="utf-8",
        headers=HEADERS,
        delivery_mode=2,
        priority=5,
        correlation_id="corr-1",
        reply_to="reply.queue",
        expiration="60000",
        message_id="msg-1",
        timestamp=1700000000,
        type="my.type",
        user_id="guest",  # must equal the authenticated user, else 406 (see next test)
        app_id="compat-tests",
    )
    ch.basic_publish("", q, b'{"k": 1}', props)
    method, got, body = ch.basic_get(q, auto_ack=True)
    assert body == b'{"k": 1}'
    for attr in ("content_type", "content_encoding", "delivery_mode", "priority",
                 "correlation_id", "reply_to", "expiration", "message_id", "timestamp",
                 "type", "user_id", "app_id"):
        assert getattr(got, attr) == getattr(props, attr), attr
    assert got.cluster_id is None
    assert got.headers == HEADERS
    # Field types are preserved on the wire: 'l' (64-bit) decodes to pika's long subclass,
    # 'I' (32-bit) to plain int.
    assert isinstance(got.headers["long"], pika.compat.long)
    assert type(got.headers["int"]) is int
    assert isinstance(got.headers["decimal"], decimal.Decimal)
    assert isinstance(got.headers["ts"], datetime.datetime)
    assert isinstance(got.headers["bytes"], bytes)


def test_minimal_properties_round_trip(ch, names):
    """A message with no properties at all arrives with every property unset."""
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    ch.basic_publish("", q, b"")
    method, got, body = ch.basic_get(q, auto_ack=True)
    assert body == b""
    for attr in ("content_type", "content_encoding", "headers", "delivery_mode", "priority",
                 "correlation_id", "reply_to", "expiration", "message_id", "timestamp",
                 "type", "user_id", "app_id", "cluster_id"):
        assert getattr(got, attr) is None, attr


def test_user_id_mismatch_is_406(ch, names):
    """Publishing with a user_id other than the authenticated user fails with 406 PRECONDITION_FAILED."""
    q = names.q()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"x", pika.BasicProperties(user_id="mallory"))
    # RabbitMQ: "PRECONDITION_FAILED - user_id property set to 'mallory' but authenticated user was 'guest'"
    with channel_closed(406, "user_id property set to 'mallory'"):
        ch.queue_declare("", exclusive=True)


@pytest.mark.parametrize("size", [1024 * 1024, 5 * 1024 * 1024], ids=["1MB", "5MB"])
def test_large_body_round_trip(conn, ch, names, size):
    """Large bodies spanning many frames round-trip byte-exact via consume and basic.get."""
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    body = os.urandom(size)
    digest = hashlib.sha256(body).hexdigest()
    ch.basic_publish("", q, body)
    ch.basic_publish("", q, body)
    received = []
    ch.basic_consume(q, lambda c, m, p, b: received.append(b), auto_ack=True)
    wait_until(conn, lambda: len(received) == 2, timeout=20)
    for b in received:
        assert len(b) == size
        assert hashlib.sha256(b).hexdigest() == digest


def test_frame_boundary_body_sizes(ch, names, conn):
    """Bodies of sizes around the negotiated frame_max boundary arrive intact."""
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    frame_max = conn._impl.params.frame_max
    payload_max = frame_max - 8  # frame header (7) + end octet (1)
    sizes = [0, 1, payload_max - 1, payload_max, payload_max + 1, 2 * payload_max, 2 * payload_max + 1]
    bodies = [bytes([i % 251]) * s for i, s in enumerate(sizes)]
    for b in bodies:
        ch.basic_publish("", q, b)
    assert bodies_of(get_all(ch, q)) == bodies
