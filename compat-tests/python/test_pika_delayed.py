"""x-delayed-message exchanges (the rabbitmq_delayed_message_exchange plugin's interface). The
plugin is not part of Debian's rabbitmq-server, so these run against Warren only."""

import time

import pika
import pytest

from amqp_helpers import channel_closed, counts, wait_until

pytestmark = pytest.mark.warren_only


def _setup(ch, names, delayed_type="direct"):
    x, q = names.x("delayed"), names.q()
    ch.exchange_declare(x, exchange_type="x-delayed-message",
                        arguments={"x-delayed-type": delayed_type})
    ch.queue_declare(q)
    ch.queue_bind(q, x, "k")
    ch.confirm_delivery()
    return x, q


def test_message_is_held_for_its_x_delay(conn, ch, names):
    """A publish with x-delay arrives only after the delay, routed with the x-delayed-type."""
    x, q = _setup(ch, names)
    started = time.monotonic()
    ch.basic_publish(x, "k", b"later", pika.BasicProperties(headers={"x-delay": 300}))
    assert counts(conn, q) == (0, 0)
    wait_until(conn, lambda: counts(conn, q) == (1, 0))
    assert time.monotonic() - started >= 0.25
    m, props, body = ch.basic_get(q, auto_ack=True)
    assert body == b"later"
    assert m.exchange == x and m.routing_key == "k"


def test_without_x_delay_it_routes_at_once(conn, ch, names):
    """No (or a non-positive) x-delay: routed immediately."""
    x, q = _setup(ch, names)
    ch.basic_publish(x, "k", b"now")
    ch.basic_publish(x, "k", b"now too", pika.BasicProperties(headers={"x-delay": 0}))
    assert counts(conn, q) == (2, 0)


def test_messages_are_released_in_due_order(conn, ch, names):
    """A shorter delay published later is released first."""
    x, q = _setup(ch, names, delayed_type="fanout")
    ch.basic_publish(x, "", b"slow", pika.BasicProperties(headers={"x-delay": 400}))
    ch.basic_publish(x, "", b"fast", pika.BasicProperties(headers={"x-delay": 50}))
    wait_until(conn, lambda: counts(conn, q)[0] == 2)
    assert ch.basic_get(q, auto_ack=True)[2] == b"fast"
    assert ch.basic_get(q, auto_ack=True)[2] == b"slow"


def test_x_delayed_type_is_required(ch, names):
    """Declaring x-delayed-message without a valid x-delayed-type is refused with 406."""
    with channel_closed(406, "x-delayed-type"):
        ch.exchange_declare(names.x(), exchange_type="x-delayed-message")
