"""Queue arguments that shape delivery: priorities and length limits (x-max-length,
x-max-length-bytes, x-overflow)."""

import pika
import pytest
from pika.exceptions import NackError, UnroutableError

from amqp_helpers import bodies_of, counts, get_all, pump, wait_until


def _publish_all(ch, q, items):
    for body, priority in items:
        ch.basic_publish("", q, body, pika.BasicProperties(priority=priority))


def test_priority_queue_delivers_highest_first_fifo_within_priority(ch, names):
    """x-max-priority: higher priorities first, FIFO within one, priorities above the max
    count as the max, no priority counts as 0."""
    q = names.q()
    ch.queue_declare(q, arguments={"x-max-priority": 10})
    ch.confirm_delivery()
    _publish_all(ch, q, [(b"p1", 1), (b"p5a", 5), (b"p10", 10), (b"none", None),
                         (b"p5b", 5), (b"p200", 200)])
    assert bodies_of(get_all(ch, q)) == [b"p10", b"p200", b"p5a", b"p5b", b"p1", b"none"]


def test_priority_survives_requeue(conn, ch, names):
    """A requeued message keeps its priority: it comes back before lower ones."""
    q = names.q()
    ch.queue_declare(q, arguments={"x-max-priority": 5})
    ch.confirm_delivery()
    _publish_all(ch, q, [(b"low", 1), (b"high", 5)])
    m, _, body = ch.basic_get(q, auto_ack=False)
    assert body == b"high"
    ch.basic_nack(m.delivery_tag, requeue=True)
    assert bodies_of(get_all(ch, q)) == [b"high", b"low"]


def test_queue_without_max_priority_ignores_priority(ch, names):
    """Without x-max-priority the priority property does not reorder messages."""
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    _publish_all(ch, q, [(b"a", 0), (b"b", 9)])
    assert bodies_of(get_all(ch, q)) == [b"a", b"b"]


def test_max_length_bytes_drops_oldest(ch, names):
    """x-max-length-bytes counts ready body bytes; the oldest messages go first."""
    q = names.q()
    ch.queue_declare(q, arguments={"x-max-length-bytes": 10})
    ch.confirm_delivery()
    for body in (b"aaaa", b"bbbb", b"cccc"):
        ch.basic_publish("", q, body)
    assert bodies_of(get_all(ch, q)) == [b"bbbb", b"cccc"]


def test_max_length_counts_only_ready_messages(conn, ch, names):
    """Unacked messages do not count towards x-max-length."""
    q = names.q()
    ch.queue_declare(q, arguments={"x-max-length": 1})
    ch.confirm_delivery()
    ch.basic_publish("", q, b"1")
    m, _, _ = ch.basic_get(q, auto_ack=False)
    ch.basic_publish("", q, b"2")
    assert counts(conn, q) == (1, 0)
    ch.basic_ack(m.delivery_tag)
    assert bodies_of(get_all(ch, q)) == [b"2"]


def test_reject_publish_nacks_the_publish_and_keeps_the_queue(conn, ch, names):
    """x-overflow reject-publish: at the limit a confirmed publish is nacked and the queue keeps
    its oldest messages; a mandatory publish is nacked too, not returned."""
    q = names.q()
    ch.queue_declare(q, arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
    ch.confirm_delivery()
    ch.basic_publish("", q, b"1")
    ch.basic_publish("", q, b"2")
    with pytest.raises(NackError):
        ch.basic_publish("", q, b"3")
    with pytest.raises(NackError):
        ch.basic_publish("", q, b"4", mandatory=True)
    assert counts(conn, q) == (2, 0)
    assert bodies_of(get_all(ch, q)) == [b"1", b"2"]
    # Room again: publishes are accepted.
    ch.basic_publish("", q, b"5")
    assert bodies_of(get_all(ch, q)) == [b"5"]


def test_reject_publish_to_one_of_two_queues_nacks(conn, ch, names):
    """A publish routed to a full reject-publish queue and to another queue is nacked, and the
    other queue still gets it (as RabbitMQ)."""
    full, other, x = names.q("full"), names.q("other"), names.x()
    ch.exchange_declare(x, exchange_type="fanout")
    ch.queue_declare(full, arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
    ch.queue_declare(other)
    ch.queue_bind(full, x)
    ch.queue_bind(other, x)
    ch.confirm_delivery()
    with pytest.raises(NackError):
        ch.basic_publish(x, "", b"m")
    assert counts(conn, full) == (0, 0)
    assert counts(conn, other) == (1, 0)


def test_unroutable_mandatory_is_still_returned_next_to_limits(ch, names):
    """Sanity: an unroutable mandatory publish is returned (312), not nacked."""
    x = names.x()
    ch.exchange_declare(x, exchange_type="direct")
    ch.confirm_delivery()
    with pytest.raises(UnroutableError):
        ch.basic_publish(x, "nowhere", b"m", mandatory=True)


def test_single_active_consumer_fails_over_in_attach_order(conn, names):
    """x-single-active-consumer: only the first consumer receives; when its channel closes,
    its unacked messages come back and the next consumer takes over."""
    q = names.q()
    first, second, pub = conn.channel(), conn.channel(), conn.channel()
    first.queue_declare(q, arguments={"x-single-active-consumer": True})
    got1, got2 = [], []
    first.basic_consume(q, lambda c, m, p, b: got1.append(b))
    second.basic_consume(q, lambda c, m, p, b: got2.append(b))
    pub.confirm_delivery()
    for i in range(4):
        pub.basic_publish("", q, b"%d" % i)
    wait_until(conn, lambda: len(got1) == 4)
    pump(conn, 0.2)
    assert got2 == []
    first.close()
    wait_until(conn, lambda: len(got2) == 4)
    assert sorted(got2) == [b"0", b"1", b"2", b"3"]
