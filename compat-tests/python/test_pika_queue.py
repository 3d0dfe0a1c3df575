"""queue.declare / purge / delete semantics, exclusive and auto-delete queues."""

import pytest

from amqp_helpers import (
    channel_closed,
    counts,
    queue_exists,
    wait_queue_gone,
    wait_until,
)

# Note on RabbitMQ 4.x: transient (non-durable) non-exclusive queues are a *deprecated
# feature* there ("transient_nonexcl_queues"), still permitted by default through 4.2 but
# logged as deprecated. The tests use them because kombu/celery still declare them.


def test_server_named_queue(ch):
    """queue.declare with an empty name returns a server-generated amq.gen-* name that is usable."""
    ok = ch.queue_declare("", exclusive=True)
    name = ok.method.queue
    assert name.startswith("amq.gen-"), name
    assert len(name) > len("amq.gen-")
    assert ok.method.message_count == 0 and ok.method.consumer_count == 0
    ok2 = ch.queue_declare("", exclusive=True)
    assert ok2.method.queue != name
    ch.queue_declare(name, passive=True)


def test_passive_declare(conn, ch, names):
    """Passive declare succeeds for an existing queue and fails with 404 for a missing one."""
    q = names.q()
    ch.queue_declare(q)
    ok = ch.queue_declare(q, passive=True)
    assert ok.method.queue == q
    # RabbitMQ: "NOT_FOUND - no queue '<q>' in vhost '/'"
    with channel_closed(404, "NOT_FOUND"):
        ch.queue_declare(names.q("missing"), passive=True)


def test_reserved_amq_queue_name_is_403(ch, prefix):
    """Declaring a queue named amq.* (other than server-named) is refused with 403."""
    # RabbitMQ: "ACCESS_REFUSED - queue name 'amq.<...>' contains reserved prefix 'amq.*'"
    with channel_closed(403, "reserved prefix"):
        ch.queue_declare("amq." + prefix)


def test_declare_ok_counts(conn, ch, names):
    """declare-ok reports ready message_count (excluding unacked) and consumer_count."""
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    for i in range(3):
        ch.basic_publish("", q, b"m%d" % i)
    ok = ch.queue_declare(q)
    assert (ok.method.message_count, ok.method.consumer_count) == (3, 0)

    cons_ch = conn.channel()
    cons_ch.basic_qos(prefetch_count=1)
    got = []
    cons_ch.basic_consume(q, lambda c, m, p, b: got.append(b))
    wait_until(conn, lambda: len(got) == 1)
    # One message is now unacked at the consumer: 2 ready, 1 consumer.
    assert counts(conn, q) == (2, 1)
    ok = ch.queue_declare(q, passive=True)
    assert (ok.method.message_count, ok.method.consumer_count) == (2, 1)


def test_exclusive_queue_from_other_connection_is_405(connect, conn, ch, names):
    """An exclusive queue cannot be used (declare, passive declare or consume) from another connection: 405."""
    q = names.q()
    ch.queue_declare(q, exclusive=True)
    other = connect()
    # RabbitMQ: "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue '<q>' in vhost '/'.
    #            It could be originally declared on another connection or the exclusive property
    #            value does not match that of the original declaration."
    with channel_closed(405, "RESOURCE_LOCKED"):
        other.channel().queue_declare(q, exclusive=True)
    with channel_closed(405):
        other.channel().queue_declare(q, passive=True)
    with channel_closed(405):
        other.channel().basic_consume(q, lambda *a: None)
    # The owner still has it.
    ch.queue_declare(q, passive=True)


def test_exclusive_queue_usable_from_other_channel_same_connection(conn, ch, names):
    """An exclusive queue is usable from any channel of the declaring connection."""
    q = names.q()
    ch.queue_declare(q, exclusive=True)
    ch2 = conn.channel()
    ch2.confirm_delivery()
    ch2.basic_publish("", q, b"x")
    m, _, body = ch2.basic_get(q, auto_ack=True)
    assert body == b"x"


@pytest.mark.parametrize(
    "first,second,arg",
    [
        (dict(durable=False), dict(durable=True), "durable"),
        (dict(auto_delete=False), dict(auto_delete=True), "auto_delete"),
        (dict(arguments={"x-max-length": 10}), dict(arguments={"x-max-length": 20}), "x-max-length"),
        (dict(arguments={"x-message-ttl": 1000}), dict(arguments={}), "x-message-ttl"),
    ],
)
def test_redeclare_inequivalent_is_406(conn, ch, names, first, second, arg):
    """Redeclaring a queue with different flags/arguments fails with 406 naming the argument."""
    q = names.q()
    ch.queue_declare(q, **first)
    # RabbitMQ: "PRECONDITION_FAILED - inequivalent arg '<arg>' for queue '<q>' in vhost '/':
    #            received ... but current is ..."
    with channel_closed(406, f"inequivalent arg '{arg}'"):
        ch.queue_declare(q, **second)
    assert queue_exists(conn, q)


def test_purge_returns_count(conn, ch, names):
    """queue.purge returns the number of ready messages removed and empties the queue."""
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    for i in range(7):
        ch.basic_publish("", q, b"p")
    ok = ch.queue_purge(q)
    assert ok.method.message_count == 7
    assert counts(conn, q) == (0, 0)
    assert ch.queue_purge(q).method.message_count == 0


def test_delete_returns_count(conn, ch, names):
    """queue.delete returns the number of messages deleted and the queue disappears."""
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    for i in range(4):
        ch.basic_publish("", q, b"d")
    ok = ch.queue_delete(q)
    assert ok.method.message_count == 4
    assert not queue_exists(conn, q)


def test_delete_if_empty_is_406(conn, ch, names):
    """queue.delete if-empty on a non-empty queue fails with 406 and keeps the queue."""
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    ch.basic_publish("", q, b"keep")
    # RabbitMQ: "PRECONDITION_FAILED - queue '<q>' in vhost '/' not empty"
    with channel_closed(406, "not empty"):
        ch.queue_delete(q, if_empty=True)
    assert counts(conn, q) == (1, 0)


def test_delete_if_unused_is_406(conn, ch, names):
    """queue.delete if-unused on a queue with a consumer fails with 406."""
    q = names.q()
    ch.queue_declare(q)
    ch.basic_consume(q, lambda *a: None)
    ch2 = conn.channel()
    # RabbitMQ: "PRECONDITION_FAILED - queue '<q>' in vhost '/' in use"
    with channel_closed(406, "in use"):
        ch2.queue_delete(q, if_unused=True)
    assert counts(conn, q) == (0, 1)


def test_delete_missing_queue_is_ok(ch, names):
    """Deleting a non-existent queue succeeds with message_count 0 (idempotent delete)."""
    ok = ch.queue_delete(names.q("never"))
    assert ok.method.message_count == 0


def test_auto_delete_after_last_consumer_cancels(conn, ch, names):
    """An auto-delete queue survives while consumers exist and is deleted after the last one cancels."""
    q = names.q()
    ch.queue_declare(q, auto_delete=True)
    t1 = ch.basic_consume(q, lambda *a: None)
    t2 = ch.basic_consume(q, lambda *a: None)
    ch.basic_cancel(t1)
    assert counts(conn, q) == (0, 1)
    ch.basic_cancel(t2)
    wait_queue_gone(conn, q)


def test_auto_delete_queue_without_consumers_survives(conn, ch, names):
    """An auto-delete queue that never had a consumer is not deleted."""
    q = names.q()
    ch.queue_declare(q, auto_delete=True)
    ch.confirm_delivery()
    ch.basic_publish("", q, b"x")
    assert counts(conn, q) == (1, 0)


def test_exclusive_queue_deleted_when_connection_closes(connect, conn, names):
    """An exclusive queue is deleted when its declaring connection closes."""
    q = names.q()
    owner = connect()
    owner.channel().queue_declare(q, exclusive=True)
    assert counts(owner, q) == (0, 0)
    owner.close()
    wait_queue_gone(conn, q)


def test_queue_max_length_drops_head(conn, ch, names):
    """x-max-length keeps only the newest messages (default overflow drop-head)."""
    q = names.q()
    ch.queue_declare(q, arguments={"x-max-length": 2})
    ch.confirm_delivery()
    for b in (b"1", b"2", b"3"):
        ch.basic_publish("", q, b)
    assert ch.basic_get(q, auto_ack=True)[2] == b"2"
    assert ch.basic_get(q, auto_ack=True)[2] == b"3"
    assert ch.basic_get(q, auto_ack=True)[0] is None


@pytest.mark.parametrize("args,needle", [
    ({"x-max-length": -1}, "x-max-length"),
    ({"x-max-priority": 256}, "max_value_exceeded"),
    ({"x-overflow": "drop-tail"}, "invalid_overflow"),
    ({"x-overflow": 5}, "unacceptable_type"),
    ({"x-dead-letter-routing-key": "rk"}, "routing_key_but_no_dlx_defined"),
    ({"x-expires": 0}, "value_zero"),
    ({"x-message-ttl": -5}, "value_negative"),
    ({"x-queue-mode": "turbo"}, "unsupported queue mode"),
    ({"x-single-active-consumer": "yes"}, "unacceptable_type"),
])
def test_invalid_queue_arguments_are_406(ch, names, args, needle):
    """A new queue with an x-argument of a bad value or type is refused with 406 naming it."""
    with channel_closed(406, needle):
        ch.queue_declare(names.q(), arguments=args)


def test_owner_redeclaring_its_exclusive_queue_as_shared_is_405(conn, ch, names):
    """Goal: the exclusive flag is part of a queue's identity even for its owner
    (rabbit_amqqueue:check_exclusive_access/3, strict; Bunny's queue_declare_spec). Method:
    declare exclusive, redeclare from the same connection with exclusive=False."""
    q = names.q()
    ch.queue_declare(q, exclusive=True)
    with channel_closed(405, "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue"):
        conn.channel().queue_declare(q, exclusive=False)
    ch.queue_declare(q, exclusive=True)  # the same declaration still matches


@pytest.mark.rabbitmq4
@pytest.mark.parametrize("kind,arg,value", [
    ("quorum", "x-max-priority", 5),
    ("quorum", "x-queue-mode", "lazy"),
    ("stream", "x-max-length", 10),
    ("stream", "x-message-ttl", 1000),
    ("stream", "x-max-priority", 5),
    ("classic", "x-delivery-limit", 3),
    ("classic", "x-max-age", "1D"),
])
def test_arguments_of_other_queue_types_are_406(ch, names, kind, arg, value):
    """Goal: an argument that only other queue types take is refused, as
    rabbit_amqqueue:check_declare_arguments/3 refuses it (each type's capabilities/0).
    Method: declare a queue of `kind` with it."""
    q = names.q()
    module = {"classic": "rabbit_classic_queue", "quorum": "rabbit_quorum_queue",
              "stream": "rabbit_stream_queue"}[kind]
    with channel_closed(406, f"PRECONDITION_FAILED - invalid arg '{arg}' for queue '{q}' "
                             f"in vhost '/' of queue type {module}"):
        ch.queue_declare(q, durable=True, arguments={"x-queue-type": kind, arg: value})


@pytest.mark.rabbitmq4
@pytest.mark.parametrize("kind", ["quorum", "stream"])
def test_server_named_quorum_queues_and_streams_are_406(ch, kind):
    """Goal: only classic queues may be server-named (rabbit_channel's queue.declare: "Cannot
    declare a server-named queue for type ..."). Method: declare one with an empty name."""
    module = {"quorum": "rabbit_quorum_queue", "stream": "rabbit_stream_queue"}[kind]
    with channel_closed(406, f"PRECONDITION_FAILED - Cannot declare a server-named queue "
                             f"for type {module}"):
        ch.queue_declare("", durable=True, arguments={"x-queue-type": kind})
