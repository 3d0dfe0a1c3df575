"""Dead-lettering: x-dead-letter-exchange / -routing-key, reasons rejected / expired / maxlen,
the x-death header and its companions, cycles."""

import datetime

import pika

from amqp_helpers import counts, pump, wait_get, wait_until


def _dlx_setup(ch, names, **queue_args):
    """A source queue dead-lettering to a fanout exchange bound to a 'dead' queue."""
    src, dead, dlx = names.q("src"), names.q("dead"), names.x("dlx")
    ch.exchange_declare(dlx, exchange_type="fanout")
    ch.queue_declare(dead)
    ch.queue_bind(dead, dlx)
    ch.queue_declare(src, arguments={"x-dead-letter-exchange": dlx, **queue_args})
    return src, dead, dlx


def test_rejected_message_is_dead_lettered_with_x_death(conn, ch, names):
    """basic.reject without requeue dead-letters with reason 'rejected' and a full x-death
    entry; the message keeps its routing key and gets the DLX as exchange."""
    src, dead, dlx = _dlx_setup(ch, names)
    ch.confirm_delivery()
    ch.basic_publish("", src, b"m", pika.BasicProperties(message_id="id-1",
                                                          headers={"app": "keep"}))
    m, _, _ = ch.basic_get(src, auto_ack=False)
    ch.basic_reject(m.delivery_tag, requeue=False)
    method, props, body = wait_get(conn, ch, dead)
    assert body == b"m"
    assert method.exchange == dlx
    assert method.routing_key == src
    assert props.message_id == "id-1"
    h = props.headers
    assert h["app"] == "keep"
    [death] = h["x-death"]
    assert death["count"] == 1
    assert death["reason"] == "rejected"
    assert death["queue"] == src
    assert death["exchange"] == ""
    assert death["routing-keys"] == [src]
    assert isinstance(death["time"], datetime.datetime)
    assert "original-expiration" not in death
    assert h["x-first-death-queue"] == src
    assert h["x-first-death-reason"] == "rejected"
    assert h["x-first-death-exchange"] == ""


def test_nack_without_requeue_dead_letters_and_requeue_does_not(conn, ch, names):
    """basic.nack requeue=false dead-letters; requeue=true does not."""
    src, dead, _ = _dlx_setup(ch, names)
    ch.confirm_delivery()
    ch.basic_publish("", src, b"a")
    ch.basic_publish("", src, b"b")
    m, _, _ = ch.basic_get(src, auto_ack=False)
    ch.basic_nack(m.delivery_tag, requeue=True)
    assert counts(conn, dead) == (0, 0)
    m1, _, _ = ch.basic_get(src, auto_ack=False)
    m2, _, _ = ch.basic_get(src, auto_ack=False)
    ch.basic_nack(m2.delivery_tag, multiple=True, requeue=False)
    wait_until(conn, lambda: counts(conn, dead) == (2, 0))


def test_expired_message_is_dead_lettered_with_original_expiration(conn, ch, names):
    """A per-message TTL expiry dead-letters with reason 'expired'; the expiration property
    moves into x-death's original-expiration."""
    src, dead, _ = _dlx_setup(ch, names)
    ch.confirm_delivery()
    ch.basic_publish("", src, b"old", pika.BasicProperties(expiration="20"))
    method, props, body = wait_get(conn, ch, dead)
    assert body == b"old"
    assert props.expiration is None
    [death] = props.headers["x-death"]
    assert death["reason"] == "expired"
    assert death["original-expiration"] == "20"


def test_queue_ttl_expiry_dead_letters_to_a_routing_key(conn, ch, names):
    """x-message-ttl expiry with x-dead-letter-routing-key: routed by the new key."""
    src, target = names.q("src"), names.q("target")
    ch.queue_declare(target)
    ch.queue_declare(src, arguments={"x-message-ttl": 20, "x-dead-letter-exchange": "",
                                     "x-dead-letter-routing-key": target})
    ch.confirm_delivery()
    ch.basic_publish("", src, b"m")
    method, props, _ = wait_get(conn, ch, target)
    assert method.routing_key == target
    assert props.headers["x-death"][0]["routing-keys"] == [src]


def test_max_length_drop_head_dead_letters_with_maxlen(conn, ch, names):
    """Dropped by x-max-length (drop-head): reason 'maxlen'."""
    src, dead, _ = _dlx_setup(ch, names, **{"x-max-length": 1})
    ch.confirm_delivery()
    ch.basic_publish("", src, b"first")
    ch.basic_publish("", src, b"second")
    method, props, body = wait_get(conn, ch, dead)
    assert body == b"first"
    assert props.headers["x-death"][0]["reason"] == "maxlen"


def test_reject_publish_dlx_dead_letters_the_refused_message(conn, ch, names):
    """x-overflow reject-publish-dlx: the refused publish is nacked and dead-lettered."""
    src, dead, _ = _dlx_setup(ch, names, **{"x-max-length": 1,
                                             "x-overflow": "reject-publish-dlx"})
    ch.confirm_delivery()
    ch.basic_publish("", src, b"kept")
    try:
        ch.basic_publish("", src, b"refused")
    except pika.exceptions.NackError:
        pass
    method, props, body = wait_get(conn, ch, dead)
    assert body == b"refused"
    assert props.headers["x-death"][0]["reason"] == "maxlen"
    assert counts(conn, src) == (1, 0)


def test_repeated_rejection_counts_in_one_entry(conn, ch, names):
    """A message rejected twice in the same queue has one x-death entry with count 2
    (rejections back into the same queue are not a cycle)."""
    q = names.q()
    ch.queue_declare(q, arguments={"x-dead-letter-exchange": "",
                                   "x-dead-letter-routing-key": q})
    ch.confirm_delivery()
    ch.basic_publish("", q, b"m")
    for _ in range(2):
        m, _, _ = wait_get(conn, ch, q, auto_ack=False)
        ch.basic_reject(m.delivery_tag, requeue=False)
    method, props, _ = wait_get(conn, ch, q)
    [death] = props.headers["x-death"]
    assert (death["count"], death["reason"], death["queue"]) == (2, "rejected", q)


def test_expiry_cycle_without_rejection_is_dropped(conn, ch, names):
    """Two queues dead-lettering their expired messages to each other: the message goes round
    once and is then dropped (RabbitMQ's cycle detection), it does not circulate forever."""
    a, b = names.q("a"), names.q("b")
    ch.queue_declare(a, arguments={"x-message-ttl": 10, "x-dead-letter-exchange": "",
                                   "x-dead-letter-routing-key": b})
    ch.queue_declare(b, arguments={"x-message-ttl": 10, "x-dead-letter-exchange": "",
                                   "x-dead-letter-routing-key": a})
    ch.confirm_delivery()
    ch.basic_publish("", a, b"loop")
    wait_until(conn, lambda: counts(conn, a)[0] == 0 and counts(conn, b)[0] == 0)
    pump(conn, 0.3)  # prove it does not come back
    assert counts(conn, a)[0] == 0 and counts(conn, b)[0] == 0


def test_missing_dead_letter_exchange_drops_silently(conn, ch, names):
    """A DLX that does not exist: the rejected message is dropped, nothing fails."""
    q = names.q()
    ch.queue_declare(q, arguments={"x-dead-letter-exchange": names.x("nowhere")})
    ch.confirm_delivery()
    ch.basic_publish("", q, b"m")
    m, _, _ = ch.basic_get(q, auto_ack=False)
    ch.basic_reject(m.delivery_tag, requeue=False)
    assert counts(conn, q) == (0, 0)
    assert ch.is_open
