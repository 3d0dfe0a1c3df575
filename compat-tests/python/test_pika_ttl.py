"""Message TTL: x-message-ttl, the per-message expiration property, TTL 0, head-of-queue
expiry, and the expiration property's validation."""

import pika

from amqp_helpers import channel_closed, counts, pump, wait_until


def test_queue_ttl_expires_messages(conn, ch, names):
    """x-message-ttl: unconsumed messages disappear once their TTL has passed."""
    q = names.q()
    ch.queue_declare(q, arguments={"x-message-ttl": 100})
    ch.confirm_delivery()
    ch.basic_publish("", q, b"1")
    ch.basic_publish("", q, b"2")
    wait_until(conn, lambda: counts(conn, q) == (0, 0))
    assert ch.basic_get(q, auto_ack=True) == (None, None, None)


def test_per_message_expiration(conn, ch, names):
    """The expiration property (milliseconds, as a string) expires one message; the others
    stay."""
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    ch.basic_publish("", q, b"short", pika.BasicProperties(expiration="50"))
    ch.basic_publish("", q, b"forever")
    wait_until(conn, lambda: counts(conn, q) == (1, 0))
    m, _, body = ch.basic_get(q, auto_ack=True)
    assert body == b"forever"


def test_ttl_zero_without_consumer_is_dropped_at_once(conn, ch, names):
    """A message with TTL 0 that no consumer can take right away expires immediately."""
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    ch.basic_publish("", q, b"gone", pika.BasicProperties(expiration="0"))
    assert counts(conn, q) == (0, 0)


def test_ttl_zero_reaches_a_waiting_consumer(conn, ch, names):
    """A message with TTL 0 is delivered to a consumer that can take it at once."""
    q = names.q()
    ch.queue_declare(q, arguments={"x-message-ttl": 0})
    got = []
    ch.basic_consume(q, lambda c, m, p, b: got.append(b), auto_ack=True)
    pub = conn.channel()
    pub.confirm_delivery()
    pub.basic_publish("", q, b"now")
    wait_until(conn, lambda: got == [b"now"])


def test_the_shorter_of_queue_and_message_ttl_wins(conn, ch, names):
    """A per-message expiration shorter than the queue's TTL applies."""
    q = names.q()
    ch.queue_declare(q, arguments={"x-message-ttl": 60000})
    ch.confirm_delivery()
    ch.basic_publish("", q, b"soon", pika.BasicProperties(expiration="30"))
    wait_until(conn, lambda: counts(conn, q) == (0, 0))


def test_requeued_message_keeps_its_expiry(conn, ch, names):
    """A message taken and requeued still expires at its original time."""
    q = names.q()
    ch.queue_declare(q, arguments={"x-message-ttl": 300})
    ch.confirm_delivery()
    ch.basic_publish("", q, b"m")
    m, _, _ = ch.basic_get(q, auto_ack=False)
    ch.basic_nack(m.delivery_tag, requeue=True)
    wait_until(conn, lambda: counts(conn, q) == (0, 0))


def test_invalid_expiration_is_406(ch, names):
    """A non-integer expiration property closes the channel with 406."""
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    # RabbitMQ: "PRECONDITION_FAILED - invalid expiration 'soon': no_integer"
    with channel_closed(406, "invalid expiration"):
        ch.basic_publish("", q, b"m", pika.BasicProperties(expiration="soon"))


def _exists(conn, q):
    c = conn.channel()
    try:
        c.queue_declare(q, passive=True)
        return True
    except pika.exceptions.ChannelClosedByBroker as e:
        assert e.reply_code == 404
        return False
    finally:
        if c.is_open:
            c.close()


def _wait_gone(conn, ch, q, timeout=5.0):
    """Wait until the default exchange no longer routes to `q`. A passive declare would count
    as use and restart x-expires, so probe with mandatory publishes (unroutable once gone)."""
    import time
    deadline = time.monotonic() + timeout
    ch.confirm_delivery()
    while True:
        try:
            ch.basic_publish("", q, b"probe", mandatory=True)
        except pika.exceptions.UnroutableError:
            return
        assert time.monotonic() < deadline, "queue did not expire"
        conn.process_data_events(time_limit=0.05)


def test_unused_queue_expires(conn, ch, names):
    """x-expires: a queue without consumers that nobody declares or reads is deleted, even
    with messages in it (publishing does not count as use)."""
    q = names.q()
    ch.queue_declare(q, arguments={"x-expires": 200})
    ch.basic_publish("", q, b"m")
    _wait_gone(conn, ch, q)


def test_queue_with_a_consumer_does_not_expire(conn, ch, names):
    """x-expires does not apply while a consumer is attached; after it leaves, it does."""
    q = names.q()
    ch.queue_declare(q, arguments={"x-expires": 100})
    tag = ch.basic_consume(q, lambda *a: None, auto_ack=True)
    pump(conn, 0.4)  # longer than x-expires: prove it does not expire
    assert _exists(conn, q)
    ch.basic_cancel(tag)
    _wait_gone(conn, ch, q)
