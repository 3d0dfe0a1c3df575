"""exchange.declare / delete / bind semantics."""

import pika
import pytest

from amqp_helpers import channel_closed, exchange_exists, get_all, bodies_of


@pytest.mark.parametrize("etype", ["direct", "fanout", "topic", "headers"])
def test_declare_each_type(conn, ch, names, etype):
    """Each built-in exchange type can be declared, passively re-declared, and deleted."""
    x = names.x(etype)
    ok = ch.exchange_declare(x, exchange_type=etype)
    assert isinstance(ok.method, pika.spec.Exchange.DeclareOk)
    # Identical redeclare is a no-op.
    ch.exchange_declare(x, exchange_type=etype)
    ch.exchange_declare(x, passive=True)
    assert exchange_exists(conn, x)
    ok = ch.exchange_delete(x)
    assert isinstance(ok.method, pika.spec.Exchange.DeleteOk)
    assert not exchange_exists(conn, x)


def test_passive_declare_missing_is_404(ch, names):
    """Passive declare of a missing exchange closes the channel with NOT_FOUND (404)."""
    x = names.x("missing")
    # RabbitMQ: "NOT_FOUND - no exchange '<name>' in vhost '/'"
    with channel_closed(404, "NOT_FOUND"):
        ch.exchange_declare(x, passive=True)


def test_redeclare_inequivalent_type_is_406(conn, ch, names):
    """Redeclaring an exchange with a different type fails with PRECONDITION_FAILED (406)."""
    x = names.x()
    ch.exchange_declare(x, exchange_type="direct")
    # RabbitMQ: "PRECONDITION_FAILED - inequivalent arg 'type' for exchange '<x>' in vhost '/':
    #            received 'fanout' but current is 'direct'"
    with channel_closed(406, "inequivalent arg 'type'"):
        ch.exchange_declare(x, exchange_type="fanout")
    # The original exchange is untouched.
    ch2 = conn.channel()
    ch2.exchange_declare(x, exchange_type="direct")


def test_redeclare_inequivalent_durable_is_406(conn, ch, names):
    """Redeclaring an exchange with a different durable flag fails with 406."""
    x = names.x()
    ch.exchange_declare(x, exchange_type="topic", durable=False)
    with channel_closed(406, "inequivalent arg 'durable'"):
        ch.exchange_declare(x, exchange_type="topic", durable=True)


def test_reserved_amq_prefix_is_403(ch, prefix):
    """Declaring an exchange named amq.* is refused with ACCESS_REFUSED (403)."""
    # RabbitMQ: "ACCESS_REFUSED - exchange name 'amq.<...>' contains reserved prefix 'amq.*'"
    with channel_closed(403, "ACCESS_REFUSED"):
        ch.exchange_declare("amq." + prefix, exchange_type="direct")


def test_predeclared_amq_exchanges_exist(ch):
    """The standard amq.* exchanges exist and can be passively declared."""
    for x in ("amq.direct", "amq.fanout", "amq.topic", "amq.headers", "amq.match"):
        ch.exchange_declare(x, passive=True)


def test_default_exchange_is_protected(conn, ch, names):
    """The default exchange cannot be deleted or bound to (403 ACCESS_REFUSED)."""
    # RabbitMQ: "ACCESS_REFUSED - operation not permitted on the default exchange"
    with channel_closed(403, "operation not permitted on the default exchange"):
        ch.exchange_delete("")
    q = names.q()
    ch2 = conn.channel()
    ch2.queue_declare(q)
    with channel_closed(403, "operation not permitted on the default exchange"):
        ch2.queue_bind(q, "", routing_key="anything")


def test_system_exchange_cannot_be_deleted(ch):
    """Deleting a predeclared amq.* exchange is refused with 403."""
    # RabbitMQ: "ACCESS_REFUSED - deletion of system exchange 'amq.direct' in vhost '/' not allowed"
    with channel_closed(403, "ACCESS_REFUSED"):
        ch.exchange_delete("amq.direct")


def test_redeclare_system_exchange_inequivalent_is_406(conn, ch):
    """amq.direct can be redeclared with its own properties (durable direct) but not as another type."""
    ch.exchange_declare("amq.direct", exchange_type="direct", durable=True)
    with channel_closed(406, "inequivalent arg 'type'"):
        ch.exchange_declare("amq.direct", exchange_type="fanout", durable=True)


def test_bind_missing_queue_or_exchange_is_404(conn, ch, names):
    """queue.bind with a missing queue or a missing exchange closes the channel with 404."""
    q, x = names.q(), names.x()
    ch.queue_declare(q)
    with channel_closed(404, "no exchange"):
        ch.queue_bind(q, x)
    ch2 = conn.channel()
    with channel_closed(404, "no queue"):
        ch2.queue_bind(names.q("missing"), "amq.direct")


def test_delete_if_unused_with_binding_is_406(conn, ch, names):
    """exchange.delete if-unused on an exchange that is a binding source fails with 406."""
    x, q = names.x(), names.q()
    ch.exchange_declare(x, exchange_type="direct")
    ch.queue_declare(q)
    ch.queue_bind(q, x, routing_key="k")
    # RabbitMQ: "PRECONDITION_FAILED - exchange '<x>' in vhost '/' in use"
    with channel_closed(406, "in use"):
        ch.exchange_delete(x, if_unused=True)
    assert exchange_exists(conn, x)
    ch2 = conn.channel()
    ch2.queue_unbind(q, x, routing_key="k")
    ch2.exchange_delete(x, if_unused=True)
    assert not exchange_exists(conn, x)


def test_delete_missing_exchange_is_ok(ch, names):
    """Deleting a non-existent exchange succeeds (RabbitMQ treats exchange.delete as idempotent)."""
    ok = ch.exchange_delete(names.x("never-declared"))
    assert isinstance(ok.method, pika.spec.Exchange.DeleteOk)


def test_exchange_to_exchange_binding_routes(conn, ch, names):
    """A message published to a source exchange reaches queues bound to an exchange bound to it (e2e binding)."""
    src, dst, q = names.x("src"), names.x("dst"), names.q()
    ch.exchange_declare(src, exchange_type="topic")
    ch.exchange_declare(dst, exchange_type="fanout")
    ch.queue_declare(q)
    ch.queue_bind(q, dst)
    ch.exchange_bind(destination=dst, source=src, routing_key="a.*")
    ch.confirm_delivery()
    ch.basic_publish(src, "a.b", b"routed")
    ch.basic_publish(src, "x.y", b"not-routed")
    assert bodies_of(get_all(ch, q)) == [b"routed"]
    # After unbinding, nothing flows any more.
    ch.exchange_unbind(destination=dst, source=src, routing_key="a.*")
    ch.basic_publish(src, "a.c", b"after-unbind")
    assert get_all(ch, q) == []


def test_internal_exchange_declare_and_e2e(conn, ch, names):
    """An internal exchange is usable as an e2e binding destination but not for direct publishing."""
    src, internal, q = names.x("src"), names.x("internal"), names.q()
    ch.exchange_declare(src, exchange_type="fanout")
    ch.exchange_declare(internal, exchange_type="fanout", internal=True)
    ch.queue_declare(q)
    ch.queue_bind(q, internal)
    ch.exchange_bind(destination=internal, source=src)
    ch.confirm_delivery()
    ch.basic_publish(src, "", b"via-internal")
    assert bodies_of(get_all(ch, q)) == [b"via-internal"]


def test_auto_delete_exchange_goes_away_after_last_unbind(conn, ch, names):
    """An auto-delete exchange is deleted when its last binding is removed."""
    x, q = names.x(), names.q()
    ch.exchange_declare(x, exchange_type="direct", auto_delete=True)
    ch.queue_declare(q)
    ch.queue_bind(q, x, "k")
    assert exchange_exists(conn, x)
    ch.queue_unbind(q, x, "k")
    assert not exchange_exists(conn, x)


@pytest.mark.parametrize("x_match,needle", [
    ("some", "Invalid x-match field value"),
    (1, "Invalid x-match field type"),
])
def test_headers_binding_with_invalid_x_match_is_406(conn, ch, names, x_match, needle):
    """Binding to a headers exchange with an unknown or non-string x-match is refused with 406."""
    x, q = names.x(), names.q()
    ch.exchange_declare(x, exchange_type="headers")
    ch.queue_declare(q)
    with channel_closed(406, needle):
        ch.queue_bind(q, x, arguments={"x-match": x_match, "k": "v"})


def test_trace_exchange_is_predeclared_internal_topic(ch, conn):
    """Goal: every vhost has amq.rabbitmq.trace as RabbitMQ declares it
    (rabbit_vhost:declare_default_exchanges/2): durable, internal, topic. Method: passive
    declare finds it; declaring it as topic with internal set matches; publishing to it
    directly is refused as for any internal exchange."""
    ch.exchange_declare("amq.rabbitmq.trace", passive=True)
    with channel_closed(403, "ACCESS_REFUSED"):
        ch.basic_publish("amq.rabbitmq.trace", "publish.x", b"x")
        ch.queue_declare("", exclusive=True)  # the close has arrived by this reply


@pytest.mark.rabbitmq4
@pytest.mark.parametrize("binding,header,routed", [
    ("abc", b"abc", True),          # a longstr binding and a byte-array header: same bytes
    (b"abc", "abc", True),
    (7, 7, True),                   # integers by value (pika picks each one's width)
    (2 ** 40, 2 ** 40, True),
    (1, True, False),               # booleans never equal integers
    (True, 1, False),
    ("1", 1, False),                # strings never equal numbers
    (1, "1", False),
])
def test_headers_exchange_compares_decoded_values(ch, names, binding, header, routed):
    """Goal: a headers binding matches as rabbit_exchange_type_headers:match/2 compares the
    decoded values (mc_amqpl:routing_headers/2), whatever the field types. Checked on
    RabbitMQ 4.0.5. Method: bind with one value, publish with another, see if it arrives."""
    x = names.x()
    ch.exchange_declare(x, "headers", auto_delete=True)
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, x, arguments={"x-match": "all", "k": binding})
    ch.confirm_delivery()
    ch.basic_publish(x, "", b"m", pika.BasicProperties(headers={"k": header}))
    assert (ch.queue_declare(q, passive=True).method.message_count == 1) is routed
