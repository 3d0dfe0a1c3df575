"""basic.get / consume / qos / ack / nack / reject / recover / cancel semantics."""

import pika
import pytest
from pika.exceptions import UnroutableError

from amqp_helpers import (
    bodies_of,
    channel_closed,
    connection_closed,
    counts,
    get_all,
    pump,
    wait_until,
    wait_get,
)


def _fill(conn, q, bodies, declare=True, **declare_kw):
    pub = conn.channel()
    if declare:
        pub.queue_declare(q, **declare_kw)
    pub.confirm_delivery()
    for b in bodies:
        pub.basic_publish("", q, b)
    pub.close()


def test_basic_get_and_get_empty(conn, ch, names):
    """basic.get returns messages in FIFO order with the remaining message_count, then get-empty."""
    q = names.q()
    _fill(conn, q, [b"1", b"2", b"3"])
    m, props, body = ch.basic_get(q, auto_ack=True)
    assert (body, m.message_count, m.redelivered, m.routing_key, m.exchange) == (b"1", 2, False, q, "")
    assert m.delivery_tag == 1
    m2, _, body2 = ch.basic_get(q, auto_ack=True)
    assert (body2, m2.message_count, m2.delivery_tag) == (b"2", 1, 2)
    m3, _, body3 = ch.basic_get(q, auto_ack=True)
    assert (body3, m3.message_count) == (b"3", 0)
    assert ch.basic_get(q, auto_ack=True) == (None, None, None)


def test_basic_get_missing_queue_is_404(ch, names):
    """basic.get on a missing queue closes the channel with 404."""
    with channel_closed(404, "no queue"):
        ch.basic_get(names.q("missing"))


def test_consume_missing_queue_is_404(ch, names):
    """basic.consume on a missing queue closes the channel with 404."""
    with channel_closed(404, "no queue"):
        ch.basic_consume(names.q("missing"), lambda *a: None)


def test_consume_delivers_in_order(conn, ch, names):
    """A consumer receives queued messages in FIFO order with increasing delivery tags and its consumer tag."""
    q = names.q()
    _fill(conn, q, [b"%d" % i for i in range(10)])
    got = []
    tag = ch.basic_consume(q, lambda c, m, p, b: got.append((m, b)), auto_ack=True,
                           consumer_tag="my-tag-1")
    assert tag == "my-tag-1"
    wait_until(conn, lambda: len(got) == 10)
    assert [b for _, b in got] == [b"%d" % i for i in range(10)]
    assert [m.delivery_tag for m, _ in got] == list(range(1, 11))
    assert all(m.consumer_tag == "my-tag-1" for m, _ in got)
    assert all(m.exchange == "" and m.routing_key == q for m, _ in got)


def test_round_robin_between_consumers(conn, names):
    """Two consumers on one queue receive messages alternately (round-robin)."""
    q = names.q()
    c1, c2 = conn.channel(), conn.channel()
    c1.queue_declare(q)
    order = []
    c1.basic_consume(q, lambda c, m, p, b: order.append(("c1", b)), auto_ack=True)
    c2.basic_consume(q, lambda c, m, p, b: order.append(("c2", b)), auto_ack=True)
    _fill(conn, q, [b"%d" % i for i in range(6)], declare=False)
    wait_until(conn, lambda: len(order) == 6)
    # pika dispatches callbacks channel by channel, so check by body, not callback order:
    # strict alternation means one consumer got the even-numbered messages, the other the odd.
    by = {w: [b for ww, b in order if ww == w] for w in ("c1", "c2")}
    assert sorted([by["c1"], by["c2"]]) == [[b"0", b"2", b"4"], [b"1", b"3", b"5"]], order


def test_prefetch_limits_unacked(conn, ch, names):
    """basic.qos prefetch_count caps unacked deliveries; each ack releases exactly one more."""
    q = names.q()
    _fill(conn, q, [b"%d" % i for i in range(5)])
    ch.basic_qos(prefetch_count=2)
    got = []
    ch.basic_consume(q, lambda c, m, p, b: got.append((m.delivery_tag, b)))
    wait_until(conn, lambda: len(got) == 2)
    pump(conn, 0.3)  # prove that no third delivery arrives
    assert len(got) == 2
    assert counts(conn, q) == (3, 1)
    ch.basic_ack(got[0][0])
    wait_until(conn, lambda: len(got) == 3)
    pump(conn, 0.2)
    assert len(got) == 3
    ch.basic_ack(got[2][0], multiple=True)
    wait_until(conn, lambda: len(got) == 5)
    assert [b for _, b in got] == [b"0", b"1", b"2", b"3", b"4"]


def test_prefetch_is_per_consumer(conn, ch, names):
    """With per-consumer QoS (global=false) each consumer on the channel gets its own prefetch window."""
    q1, q2 = names.q("a"), names.q("b")
    _fill(conn, q1, [b"a%d" % i for i in range(3)])
    _fill(conn, q2, [b"b%d" % i for i in range(3)])
    ch.basic_qos(prefetch_count=1)
    got = []
    ch.basic_consume(q1, lambda c, m, p, b: got.append(b))
    ch.basic_consume(q2, lambda c, m, p, b: got.append(b))
    wait_until(conn, lambda: len(got) == 2)
    pump(conn, 0.3)
    assert sorted(got) == [b"a0", b"b0"]


def test_global_prefetch_is_shared_by_the_channel(conn, ch, names):
    """basic.qos global=true is one limit for all consumers of the channel, across queues;
    each ack frees exactly one slot, which the next ready message takes."""
    q1, q2 = names.q("a"), names.q("b")
    _fill(conn, q1, [b"a%d" % i for i in range(3)])
    _fill(conn, q2, [b"b%d" % i for i in range(3)])
    ch.basic_qos(prefetch_count=2, global_qos=True)
    got = []
    ch.basic_consume(q1, lambda c, m, p, b: got.append((m.delivery_tag, b)))
    ch.basic_consume(q2, lambda c, m, p, b: got.append((m.delivery_tag, b)))
    wait_until(conn, lambda: len(got) == 2)
    pump(conn, 0.3)  # prove that no third delivery arrives
    assert len(got) == 2
    assert counts(conn, q1)[0] + counts(conn, q2)[0] == 4
    ch.basic_ack(got[0][0])
    wait_until(conn, lambda: len(got) == 3)
    pump(conn, 0.2)
    assert len(got) == 3
    ch.basic_ack(0, multiple=True)
    wait_until(conn, lambda: len(got) == 5)
    pump(conn, 0.2)
    assert len(got) == 5
    # Lifting the limit releases the rest.
    ch.basic_qos(prefetch_count=0, global_qos=True)
    wait_until(conn, lambda: len(got) == 6)
    assert sorted(b for _, b in got) == [b"a0", b"a1", b"a2", b"b0", b"b1", b"b2"]


def test_global_prefetch_applies_to_existing_consumers(conn, ch, names):
    """A global limit set after a consumer attached holds that consumer back too."""
    q = names.q()
    ch.queue_declare(q)
    got = []
    ch.basic_consume(q, lambda c, m, p, b: got.append(m.delivery_tag))
    ch.basic_qos(prefetch_count=2, global_qos=True)
    _fill(conn, q, [b"%d" % i for i in range(5)], declare=False)
    wait_until(conn, lambda: len(got) == 2)
    pump(conn, 0.3)
    assert len(got) == 2
    assert counts(conn, q) == (3, 1)


def test_global_and_per_consumer_prefetch_both_apply(conn, ch, names):
    """A per-consumer limit (global=false) and a channel limit (global=true) apply together."""
    q1, q2 = names.q("a"), names.q("b")
    _fill(conn, q1, [b"a%d" % i for i in range(4)])
    _fill(conn, q2, [b"b%d" % i for i in range(4)])
    ch.basic_qos(prefetch_count=3, global_qos=True)
    ch.basic_qos(prefetch_count=1)
    got = []
    ch.basic_consume(q1, lambda c, m, p, b: got.append(b))
    ch.basic_consume(q2, lambda c, m, p, b: got.append(b))
    wait_until(conn, lambda: len(got) == 2)
    pump(conn, 0.3)
    assert sorted(got) == [b"a0", b"b0"]


def test_global_prefetch_ignores_no_ack_consumers(conn, ch, names):
    """no-ack consumers are not held back by the channel's shared limit."""
    q = names.q()
    _fill(conn, q, [b"%d" % i for i in range(5)])
    ch.basic_qos(prefetch_count=1, global_qos=True)
    got = []
    ch.basic_consume(q, lambda c, m, p, b: got.append(b), auto_ack=True)
    wait_until(conn, lambda: len(got) == 5)


def test_ack_multiple(conn, ch, names):
    """basic.ack multiple=True acknowledges every outstanding delivery up to the tag."""
    q = names.q()
    _fill(conn, q, [b"1", b"2", b"3", b"4"])
    tags = [ch.basic_get(q)[0].delivery_tag for _ in range(4)]
    assert tags == [1, 2, 3, 4]
    ch.basic_ack(3, multiple=True)
    ch.close()  # only delivery 4 was unacked: it is requeued
    c2 = conn.channel()
    msgs = get_all(c2, q)
    assert bodies_of(msgs) == [b"4"]
    assert msgs[0][0].redelivered is True


def test_ack_zero_multiple_acks_all(conn, ch, names):
    """basic.ack with delivery_tag=0 and multiple=True acknowledges all outstanding deliveries."""
    q = names.q()
    _fill(conn, q, [b"1", b"2", b"3"])
    for _ in range(3):
        ch.basic_get(q)
    ch.basic_ack(0, multiple=True)
    ch.close()
    assert counts(conn, q) == (0, 0)


def test_nack_requeue_sets_redelivered(conn, ch, names):
    """basic.nack requeue=True puts the message back at the head with redelivered=True."""
    q = names.q()
    _fill(conn, q, [b"first", b"second"])
    m, _, body = ch.basic_get(q)
    assert (body, m.redelivered) == (b"first", False)
    ch.basic_nack(m.delivery_tag, requeue=True)
    m2, _, body2 = ch.basic_get(q)
    assert (body2, m2.redelivered) == (b"first", True)
    assert m2.delivery_tag == m.delivery_tag + 1
    ch.basic_ack(m2.delivery_tag)


def test_nack_multiple_without_requeue_drops(conn, ch, names):
    """basic.nack multiple=True requeue=False discards every outstanding delivery up to the tag."""
    q = names.q()
    _fill(conn, q, [b"1", b"2", b"3"])
    tags = [ch.basic_get(q)[0].delivery_tag for _ in range(3)]
    ch.basic_nack(tags[1], multiple=True, requeue=False)
    ch.close()
    c2 = conn.channel()
    assert bodies_of(get_all(c2, q)) == [b"3"]


def test_reject_without_requeue_drops(conn, ch, names):
    """basic.reject requeue=False discards the message."""
    q = names.q()
    _fill(conn, q, [b"gone", b"kept"])
    m, _, _ = ch.basic_get(q)
    ch.basic_reject(m.delivery_tag, requeue=False)
    assert counts(conn, q) == (1, 0)
    assert bodies_of(get_all(ch, q)) == [b"kept"]


def test_reject_requeue(conn, ch, names):
    """basic.reject requeue=True requeues the message with redelivered=True."""
    q = names.q()
    _fill(conn, q, [b"r"])
    m, _, _ = ch.basic_get(q)
    ch.basic_reject(m.delivery_tag, requeue=True)
    m2, _, body = ch.basic_get(q, auto_ack=True)
    assert (body, m2.redelivered) == (b"r", True)


def test_unacked_requeued_in_original_order_on_channel_close(conn, ch, names):
    """Unacked deliveries are requeued in their original order (redelivered) when the channel closes."""
    q = names.q()
    bodies = [b"%d" % i for i in range(8)]
    _fill(conn, q, bodies)
    got = []
    ch.basic_consume(q, lambda c, m, p, b: got.append(b))
    wait_until(conn, lambda: len(got) == 8)
    ch.close()
    c2 = conn.channel()
    msgs = get_all(c2, q)
    assert bodies_of(msgs) == bodies
    assert all(m.redelivered for m, _, _ in msgs)


def test_unacked_requeued_on_connection_close(connect, conn, names):
    """Unacked deliveries are requeued when the consuming connection closes."""
    q = names.q()
    _fill(conn, q, [b"a", b"b"])
    other = connect()
    och = other.channel()
    assert och.basic_get(q)[2] == b"a"
    assert och.basic_get(q)[2] == b"b"
    assert counts(conn, q) == (0, 0)
    other.close()
    msgs = get_all(conn.channel(), q)
    assert bodies_of(msgs) == [b"a", b"b"]
    assert all(m.redelivered for m, _, _ in msgs)


def test_no_ack_consumer(conn, ch, names):
    """A no-ack (auto_ack) consumer receives messages that are removed immediately and not requeued."""
    q = names.q()
    _fill(conn, q, [b"1", b"2", b"3"])
    ch.basic_qos(prefetch_count=1)  # prefetch does not limit no-ack consumers
    got = []
    ch.basic_consume(q, lambda c, m, p, b: got.append(b), auto_ack=True)
    wait_until(conn, lambda: len(got) == 3)
    ch.close()
    assert counts(conn, q) == (0, 0)


def test_exclusive_consumer_blocks_others(conn, names):
    """An exclusive consumer makes a second consumer fail with 403 ACCESS_REFUSED, and vice versa."""
    q = names.q()
    c1 = conn.channel()
    c1.queue_declare(q)
    c1.basic_consume(q, lambda *a: None, exclusive=True)
    c2 = conn.channel()
    # RabbitMQ: "ACCESS_REFUSED - queue '<q>' in vhost '/' in exclusive use"
    with channel_closed(403, "in exclusive use"):
        c2.basic_consume(q, lambda *a: None)
    q2 = names.q("two")
    c3 = conn.channel()
    c3.queue_declare(q2)
    c3.basic_consume(q2, lambda *a: None)
    c4 = conn.channel()
    with channel_closed(403, "ACCESS_REFUSED"):
        c4.basic_consume(q2, lambda *a: None, exclusive=True)


def test_duplicate_consumer_tag_closes_connection_530(conn, ch, names):
    """Reusing a consumer tag on the same channel closes the connection with 530 NOT_ALLOWED."""
    q = names.q()
    ch.queue_declare(q)
    ch.basic_consume(q, lambda *a: None, consumer_tag="dup")
    # pika refuses duplicate tags client-side, so send the raw method.
    ch._impl._send_method(pika.spec.Basic.Consume(queue=q, consumer_tag="dup"))
    # RabbitMQ: "NOT_ALLOWED - attempt to reuse consumer tag 'dup'"
    with connection_closed(530, "attempt to reuse consumer tag"):
        wait_until(conn, lambda: False, timeout=5)
    assert conn.is_closed


def test_same_consumer_tag_on_different_channels_ok(conn, names):
    """The same consumer tag may be used on two different channels."""
    q = names.q()
    c1, c2 = conn.channel(), conn.channel()
    c1.queue_declare(q)
    c1.basic_consume(q, lambda *a: None, consumer_tag="same")
    c2.basic_consume(q, lambda *a: None, consumer_tag="same")
    assert counts(conn, q) == (0, 2)


def test_consumer_cancel_notification_on_queue_delete(conn, ch, names):
    """Deleting a queue sends basic.cancel to its consumers (pika's on_cancel callback fires)."""
    q = names.q()
    ch.queue_declare(q)
    cancels = []
    ch.add_on_cancel_callback(lambda frame: cancels.append(frame.method))
    tag = ch.basic_consume(q, lambda *a: None)
    other = conn.channel()
    other.queue_delete(q)
    wait_until(conn, lambda: cancels)
    assert isinstance(cancels[0], pika.spec.Basic.Cancel)
    assert cancels[0].consumer_tag == tag
    assert ch.is_open  # the channel survives the cancel


def test_basic_cancel_stops_deliveries(conn, ch, names):
    """After basic.cancel returns cancel-ok, no further messages are delivered to that consumer."""
    q = names.q()
    ch.queue_declare(q)
    got = []
    tag = ch.basic_consume(q, lambda c, m, p, b: got.append(b), auto_ack=True)
    _fill(conn, q, [b"1"], declare=False)
    wait_until(conn, lambda: got == [b"1"])
    ch.basic_cancel(tag)
    _fill(conn, q, [b"2"], declare=False)
    assert counts(conn, q) == (1, 0)
    assert got == [b"1"]


def test_cancel_unknown_consumer_tag_is_ok(ch):
    """basic.cancel with an unknown consumer tag is answered with cancel-ok (no error)."""
    replies = []
    ch._impl._rpc(pika.spec.Basic.Cancel(consumer_tag="never-registered"),
                  lambda frame: replies.append(frame), [pika.spec.Basic.CancelOk])
    wait_until(ch.connection, lambda: replies)
    assert replies[0].method.consumer_tag == "never-registered"
    assert ch.is_open


def test_unknown_delivery_tag_ack_is_406(ch, names):
    """Acking a delivery tag that was never issued closes the channel with 406 PRECONDITION_FAILED."""
    ch.basic_ack(42)
    # RabbitMQ: "PRECONDITION_FAILED - unknown delivery tag 42"
    with channel_closed(406, "unknown delivery tag 42"):
        ch.queue_declare("", exclusive=True)


def test_double_ack_is_406(conn, ch, names):
    """Acking the same delivery twice closes the channel with 406 (the tag is unknown the second time)."""
    q = names.q()
    _fill(conn, q, [b"x"])
    m, _, _ = ch.basic_get(q)
    ch.basic_ack(m.delivery_tag)
    ch.basic_ack(m.delivery_tag)
    with channel_closed(406, "unknown delivery tag"):
        ch.queue_declare("", exclusive=True)


def test_basic_recover_requeue(conn, ch, names):
    """basic.recover requeue=True requeues all unacked deliveries of the channel as redelivered."""
    q = names.q()
    _fill(conn, q, [b"1", b"2"])
    m1, _, _ = ch.basic_get(q)
    m2, _, _ = ch.basic_get(q)
    assert counts(conn, q) == (0, 0)
    ch.basic_recover(requeue=True)
    msgs = get_all(ch, q)
    assert bodies_of(msgs) == [b"1", b"2"]
    assert all(m.redelivered for m, _, _ in msgs)


def test_consumer_priorities(conn, names):
    """A consumer with a higher x-priority receives messages while it has prefetch capacity."""
    q = names.q()
    lo, hi = conn.channel(), conn.channel()
    lo.queue_declare(q)
    got = []
    lo.basic_consume(q, lambda c, m, p, b: got.append("lo"), auto_ack=True,
                     arguments={"x-priority": 1})
    hi.basic_consume(q, lambda c, m, p, b: got.append("hi"), auto_ack=True,
                     arguments={"x-priority": 10})
    _fill(conn, q, [b"%d" % i for i in range(5)], declare=False)
    wait_until(conn, lambda: len(got) == 5)
    assert got == ["hi"] * 5


def test_delivery_after_publish_to_waiting_consumer(conn, ch, names):
    """A consumer waiting on an empty queue receives a message published afterwards via an exchange binding."""
    x, q = names.x(), names.q()
    ch.exchange_declare(x, exchange_type="topic")
    ch.queue_declare(q)
    ch.queue_bind(q, x, "k.#")
    got = []
    ch.basic_consume(q, lambda c, m, p, b: got.append((m.exchange, m.routing_key, b)), auto_ack=True)
    pub = conn.channel()
    pub.basic_publish(x, "k.1", b"hello")
    wait_until(conn, lambda: got)
    assert got == [(x, "k.1", b"hello")]


def test_consume_generator_with_inactivity_timeout(conn, ch, names):
    """BlockingChannel.consume yields queued messages then (None, None, None) on inactivity."""
    q = names.q()
    _fill(conn, q, [b"g1", b"g2"])
    seen = []
    for method, props, body in ch.consume(q, inactivity_timeout=0.5):
        if method is None:
            break
        seen.append(body)
        ch.basic_ack(method.delivery_tag)
    ch.cancel()
    assert seen == [b"g1", b"g2"]
    assert counts(conn, q) == (0, 0)


def test_direct_reply_to_round_trip(conn, names):
    """Direct reply-to: a reply published to the pseudo-queue name from reply_to reaches the requester's amq.rabbitmq.reply-to consumer."""
    q = names.q("rpc")
    client = conn.channel()
    server = conn.channel()
    server.queue_declare(q)
    replies = []
    client.basic_consume("amq.rabbitmq.reply-to",
                         lambda c, m, p, b: replies.append((p.correlation_id, b)), auto_ack=True)
    client.basic_publish("", q, b"request",
                         pika.BasicProperties(reply_to="amq.rabbitmq.reply-to", correlation_id="c-1"))
    req = []
    server.basic_consume(q, lambda c, m, p, b: req.append(p), auto_ack=True)
    wait_until(conn, lambda: req)
    reply_to = req[0].reply_to
    # The broker rewrites reply_to to a routable pseudo-queue name (3.10 and 4.2 alike:
    # "amq.rabbitmq.reply-to.<opaque suffix>"; the requester must publish on the same
    # channel that consumes from amq.rabbitmq.reply-to).
    assert reply_to.startswith("amq.rabbitmq.reply-to."), reply_to
    server.basic_publish("", reply_to, b"response",
                         pika.BasicProperties(correlation_id=req[0].correlation_id))
    wait_until(conn, lambda: replies)
    assert replies == [("c-1", b"response")]


def test_direct_reply_to_requires_no_ack(ch):
    """Consuming amq.rabbitmq.reply-to in ack mode is refused with 406 PRECONDITION_FAILED."""
    # RabbitMQ 3.10: "PRECONDITION_FAILED - reply consumer cannot acknowledge". RabbitMQ 4.2
    # reimplemented direct reply-to (rabbit_volatile_queue), so only the code is asserted.
    with channel_closed(406):
        ch.basic_consume("amq.rabbitmq.reply-to", lambda *a: None, auto_ack=False)


def test_direct_reply_to_publish_without_consumer_is_406(ch):
    """Publishing with reply_to=amq.rabbitmq.reply-to without first consuming from it is refused with 406."""
    ch.basic_publish("", "some-queue", b"x",
                     pika.BasicProperties(reply_to="amq.rabbitmq.reply-to"))
    # RabbitMQ 3.10: "PRECONDITION_FAILED - fast reply consumer does not exist" (text not
    # asserted: direct reply-to was reimplemented in 4.2).
    with channel_closed(406):
        ch.queue_declare("", exclusive=True)


def test_direct_reply_to_unknown_name_is_unroutable(ch):
    """A publish to a reply-to name nobody holds is unroutable: returned when mandatory."""
    ch.confirm_delivery()
    with pytest.raises(UnroutableError):
        ch.basic_publish("", "amq.rabbitmq.reply-to.no-such-requester", b"x", mandatory=True)


def test_direct_reply_to_stops_after_cancel(conn, names):
    """After the reply consumer is cancelled, its name no longer routes."""
    q = names.q("rpc")
    client, server = conn.channel(), conn.channel()
    server.queue_declare(q)
    tag = client.basic_consume("amq.rabbitmq.reply-to", lambda *a: None, auto_ack=True)
    client.basic_publish("", q, b"req", pika.BasicProperties(reply_to="amq.rabbitmq.reply-to"))
    _, props, _ = server.basic_get(q, auto_ack=True)
    client.basic_cancel(tag)
    server.confirm_delivery()
    with pytest.raises(UnroutableError):
        server.basic_publish("", props.reply_to, b"late", mandatory=True)


@pytest.mark.warren_only
def test_consumer_timeout_closes_the_channel_and_requeues(conn, names):
    """x-consumer-timeout: a delivery not acked in time closes its channel with 406 and the
    message goes back to the queue. (The queue argument exists from RabbitMQ 3.12, and
    RabbitMQ checks timeouts only about once a minute, so the 3.10 reference cannot run it.)"""
    q = names.q()
    ch = conn.channel()
    ch.queue_declare(q, arguments={"x-consumer-timeout": 300})
    ch.confirm_delivery()
    ch.basic_publish("", q, b"slow")
    got = []
    ch.basic_consume(q, lambda c, m, p, b: got.append(b))
    wait_until(conn, lambda: ch.is_closed, timeout=10)
    assert got == [b"slow"]
    wait_until(conn, lambda: counts(conn, q) == (1, 0))


def test_direct_reply_to_declares_answer_with_one_consumer(conn, names):
    """Goal: clients that declare the reply-to pseudo-queue (passive or not) before consuming
    it, or check a reply name exists, get RabbitMQ's answers (rabbit_channel's reply-to clause
    of queue.declare). Method: declare amq.rabbitmq.reply-to both ways; declare the name a
    reply consumer was given, from another channel, while the consumer lives and after."""
    ch = conn.channel()
    for passive in (True, False):
        ok = ch.queue_declare("amq.rabbitmq.reply-to", passive=passive)
        assert (ok.method.queue, ok.method.message_count, ok.method.consumer_count) == \
            ("amq.rabbitmq.reply-to", 0, 1)
    client = conn.channel()
    tag = client.basic_consume("amq.rabbitmq.reply-to", lambda *a: None, auto_ack=True)
    q = names.q("rpc")
    client.queue_declare(q)
    client.basic_publish("", q, b"request", pika.BasicProperties(reply_to="amq.rabbitmq.reply-to"))
    _, props, _ = wait_get(conn, client, q)
    reply_name = props.reply_to
    other = conn.channel()
    ok = other.queue_declare(reply_name, passive=True)
    assert (ok.method.queue, ok.method.message_count, ok.method.consumer_count) == (reply_name, 0, 1)
    client.basic_cancel(tag)
    with channel_closed(404, f"NOT_FOUND - no queue '{reply_name}' in vhost '/'"):
        other.queue_declare(reply_name, passive=True)


def test_second_reply_consumer_on_a_channel_is_406_and_the_connection_survives(conn):
    """Goal: a channel has at most one reply consumer, and asking for a second costs that
    channel only (rabbit_channel: "reply consumer already set"). Method: consume
    amq.rabbitmq.reply-to twice with new tags; the second closes the channel with 406 and the
    connection still opens channels."""
    ch = conn.channel()
    ch.basic_consume("amq.rabbitmq.reply-to", lambda *a: None, auto_ack=True, consumer_tag="r1")
    with channel_closed(406, "PRECONDITION_FAILED - reply consumer already set"):
        ch.basic_consume("amq.rabbitmq.reply-to", lambda *a: None, auto_ack=True, consumer_tag="r2")
    assert conn.is_open
    assert conn.channel().is_open
