"""RabbitMQ 4.3's consumer timeout on quorum queues (its consumer_timeout_SUITE, with pika): a
consumer whose delivery is not acked in time is cancelled (basic.cancel from the server), the
delivery goes back to the queue and the channel stays open; a late ack of it is ignored. A
basic.get delivery, a client without consumer_cancel_notify, a classic queue, or
`consumer_timeout_response = close_channel` close the channel with 406 instead.

RabbitMQ before 4.3 (the 3.10 and 4.0 references) closes the channel in every case, so these
run against Warren only."""

import os
import tempfile
from pathlib import Path

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker

from amqp_helpers import counts, wait_until
from conftest import warren_process

pytestmark = pytest.mark.warren_only

TIMEOUT_MS = 400


def declare(ch, name, queue_type="quorum"):
    ch.queue_declare(name, durable=True, arguments={
        "x-queue-type": queue_type, "x-consumer-timeout": TIMEOUT_MS})
    ch.confirm_delivery()


def test_a_timed_out_consumer_is_cancelled_and_its_delivery_returned(conn, names):
    """The consumer gets basic.cancel, its delivery returns to the queue (ready, redelivered
    to the next consumer), the channel stays open, and a late ack changes nothing."""
    q = names.q()
    ch = conn.channel()
    declare(ch, q)
    ch.basic_publish("", q, b"slow")
    got = []
    cancelled = []
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    tag = ch.basic_consume(q, lambda c, m, p, b: got.append(m))
    wait_until(conn, lambda: cancelled, timeout=10)
    assert cancelled == [tag]
    assert len(got) == 1
    assert ch.is_open
    wait_until(conn, lambda: counts(conn, q) == (1, 0))
    # The late ack is ignored: no 406, and the message stays in the queue.
    ch.basic_ack(got[0].delivery_tag)
    assert ch.queue_declare(q, passive=True).method.message_count == 1
    assert ch.is_open
    # The next consumer gets it again, marked redelivered.
    again = []
    ch.basic_consume(q, lambda c, m, p, b: (again.append((m.redelivered, b)),
                                             c.basic_ack(m.delivery_tag)))
    wait_until(conn, lambda: again, timeout=10)
    assert again == [(True, b"slow")]
    wait_until(conn, lambda: counts(conn, q)[0] == 0)


def test_other_deliveries_of_the_consumer_can_still_be_acked(conn, names):
    """Only the timed-out delivery goes back: one acked in time stays acked, and the channel's
    other consumer keeps consuming."""
    q, other = names.q(), names.q("other")
    ch = conn.channel()
    declare(ch, q)
    declare(ch, other)
    ch.basic_publish("", q, b"a")
    ch.basic_publish("", q, b"b")
    ch.basic_publish("", other, b"x")
    got, cancelled, from_other = [], [], []
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    ch.basic_consume(q, lambda c, m, p, b: got.append((m, b)))
    wait_until(conn, lambda: len(got) == 2, timeout=10)
    ch.basic_ack(got[0][0].delivery_tag)
    wait_until(conn, lambda: cancelled, timeout=10)
    wait_until(conn, lambda: counts(conn, q) == (1, 0))
    ch.basic_consume(other, lambda c, m, p, b: (from_other.append(b),
                                                 c.basic_ack(m.delivery_tag)))
    wait_until(conn, lambda: from_other == [b"x"], timeout=10)
    assert ch.is_open


def test_basic_get_and_classic_queues_still_close_the_channel(conn, names):
    """A basic.get delivery has no consumer to cancel, and classic queues keep RabbitMQ's
    channel close: 406 PRECONDITION_FAILED, the message back in the queue."""
    q = names.q()
    ch = conn.channel()
    declare(ch, q)
    ch.basic_publish("", q, b"got")
    m, _, _ = ch.basic_get(q)
    assert m is not None
    wait_until(conn, lambda: ch.is_closed, timeout=10)
    assert counts(conn, q) == (1, 0)

    c = names.q("classic")
    ch = conn.channel()
    declare(ch, c, queue_type="classic")
    ch.basic_publish("", c, b"slow")
    ch.basic_consume(c, lambda *a: None)
    wait_until(conn, lambda: ch.is_closed, timeout=10)
    wait_until(conn, lambda: counts(conn, c) == (1, 0))


def test_a_client_without_cancel_notify_gets_its_channel_closed(params, names):
    """Without the consumer_cancel_notify capability the server cannot cancel the consumer:
    it closes the channel, as RabbitMQ 4.3 does."""
    p = pika.ConnectionParameters(
        params.host, params.port, params.virtual_host, params.credentials,
        client_properties={"capabilities": {"publisher_confirms": True,
                                            "basic.nack": True,
                                            "consumer_cancel_notify": False}})
    conn = pika.BlockingConnection(p)
    try:
        q = names.q()
        ch = conn.channel()
        declare(ch, q)
        ch.basic_publish("", q, b"slow")
        ch.basic_consume(q, lambda *a: None)
        wait_until(conn, lambda: ch.is_closed, timeout=10)
        assert conn.is_open
        wait_until(conn, lambda: counts(conn, q) == (1, 0))
    finally:
        conn.close()


def test_close_channel_response_keeps_the_old_behaviour():
    """`consumer_timeout_response = close_channel` (and a broker-wide consumer_timeout from
    the config file): the channel closes with 406 even for a quorum queue's consumer."""
    with tempfile.TemporaryDirectory(prefix="warren-timeout-") as tmp:
        conf = Path(tmp) / "warren.toml"
        conf.write_text(f'consumer_timeout = {TIMEOUT_MS}\n'
                        'consumer_timeout_response = "close_channel"\n')
        with warren_process("--config", str(conf)) as w:
            conn = pika.BlockingConnection(pika.ConnectionParameters(
                "127.0.0.1", w["port"], credentials=pika.PlainCredentials("guest", "guest")))
            try:
                ch = conn.channel()
                ch.queue_declare("q", durable=True, arguments={"x-queue-type": "quorum"})
                ch.confirm_delivery()
                ch.basic_publish("", "q", b"slow")
                closed = []
                ch._impl.add_on_close_callback(lambda c, reason: closed.append(reason))
                ch.basic_consume("q", lambda *a: None)
                wait_until(conn, lambda: ch.is_closed, timeout=10)
                assert isinstance(closed[0], ChannelClosedByBroker)
                assert closed[0].reply_code == 406
                assert "timed out" in closed[0].reply_text
            finally:
                conn.close()
