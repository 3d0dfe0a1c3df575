"""Small helpers shared by the pika tests (no fixed sleeps: everything waits on events
with a deadline)."""

import contextlib
import time

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker, ConnectionClosedByBroker

DEFAULT_TIMEOUT = 5.0


@contextlib.contextmanager
def channel_closed(code, text_contains=None):
    """Assert the block makes the broker close the channel with `code`."""
    with pytest.raises(ChannelClosedByBroker) as info:
        yield info
    assert info.value.reply_code == code, info.value
    if text_contains is not None:
        assert text_contains in info.value.reply_text, info.value


@contextlib.contextmanager
def connection_closed(code, text_contains=None):
    """Assert the block makes the broker close the whole connection with `code`."""
    with pytest.raises(ConnectionClosedByBroker) as info:
        yield info
    assert info.value.reply_code == code, info.value
    if text_contains is not None:
        assert text_contains in info.value.reply_text, info.value


def wait_until(conn, predicate, timeout=DEFAULT_TIMEOUT, step=0.05):
    """Pump `conn`'s I/O until predicate() is true; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"condition not met within {timeout}s")
        conn.process_data_events(time_limit=min(step, remaining))


def wait_get(conn, ch, queue, auto_ack=True, timeout=DEFAULT_TIMEOUT):
    """basic.get from `queue` until a message arrives (pumping I/O); returns (method, props,
    body). For messages the broker moves on its own (expiry, dead-lettering, delays)."""
    box = []

    def poll():
        m = ch.basic_get(queue, auto_ack=auto_ack)
        if m[0] is not None:
            box.append(m)
        return bool(box)

    wait_until(conn, poll, timeout=timeout)
    return box[0]


def pump(conn, duration):
    """Let I/O run for `duration` seconds. Only used to prove that something does NOT
    happen (e.g. no delivery beyond the prefetch window); never as synchronisation."""
    deadline = time.monotonic() + duration
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        conn.process_data_events(time_limit=remaining)


def counts(conn, queue):
    """(message_count, consumer_count) from a passive queue.declare on a fresh channel."""
    ch = conn.channel()
    try:
        ok = ch.queue_declare(queue, passive=True)
        return ok.method.message_count, ok.method.consumer_count
    finally:
        if ch.is_open:
            ch.close()


def queue_exists(conn, queue):
    ch = conn.channel()
    try:
        ch.queue_declare(queue, passive=True)
    except ChannelClosedByBroker as e:
        assert e.reply_code == 404, e
        return False
    ch.close()
    return True


def exchange_exists(conn, exchange):
    ch = conn.channel()
    try:
        ch.exchange_declare(exchange, passive=True)
    except ChannelClosedByBroker as e:
        assert e.reply_code == 404, e
        return False
    ch.close()
    return True


def wait_queue_gone(conn, queue, timeout=DEFAULT_TIMEOUT):
    """Poll (bounded) until a passive declare of `queue` returns 404. RabbitMQ removes
    auto-delete / exclusive queues asynchronously after the triggering event."""
    deadline = time.monotonic() + timeout
    while queue_exists(conn, queue):
        if time.monotonic() > deadline:
            raise AssertionError(f"queue {queue} still exists after {timeout}s")
        conn.process_data_events(time_limit=0.05)


def publish_confirmed(ch, exchange, routing_key, bodies, **props):
    """Publish on a confirm-mode channel (pika raises if any publish is nacked/returned)."""
    for body in bodies:
        ch.basic_publish(exchange, routing_key, body, pika.BasicProperties(**props))


def get_all(ch, queue, auto_ack=True, limit=1000):
    """basic.get until get-empty; returns list of (method, properties, body)."""
    out = []
    for _ in range(limit):
        method, props, body = ch.basic_get(queue, auto_ack=auto_ack)
        if method is None:
            return out
        out.append((method, props, body))
    raise AssertionError("queue did not drain")


def bodies_of(msgs):
    return [m[2] for m in msgs]
