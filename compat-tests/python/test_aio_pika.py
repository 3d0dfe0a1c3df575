"""aio-pika (asyncio, on aiormq/pamqp) round trips.

The tests are plain sync pytest functions that run their scenario with asyncio.run (see
`run_async`), so no asyncio pytest plugin is needed. Synchronisation is always on events
(publisher confirms, synchronous AMQP replies, an asyncio.Queue fed by a consumer callback);
the only timeouts are short bounded waits asserting that something does NOT arrive. A hang
is caught by the suite-wide pytest-timeout.
"""

import asyncio
import datetime
import functools

import aio_pika
import aiormq
import pytest
from aio_pika import DeliveryMode, ExchangeType, Message
from aio_pika.exceptions import (
    ChannelNotFoundEntity,
    ChannelPreconditionFailed,
    DeliveryError,
    PublishError,
    QueueEmpty,
)
from aiormq.exceptions import ChannelLockedResource  # not re-exported by aio_pika.exceptions

# How long we wait to be convinced that a message is NOT delivered.
NO_DELIVERY_WAIT_S = 0.3

HEADERS = {
    "h-str": "héllo wörld",
    "h-small": 7,
    "h-neg": -5,
    "h-short": -20000,
    "h-ushort": 40000,
    "h-int": 2_000_000_000,
    "h-uint": 3_000_000_000,
    "h-long": -(2**40),
    "h-true": True,
    "h-false": False,
    "h-bytes": bytearray(b"\x00\x01\xfe\xff"),
    "h-list": [1, "two", True, {"k": "v"}, [3]],
    "h-table": {"inner-int": 42, "inner-str": "x", "inner-table": {"deep": [1, 2]}},
}


def run_async(fn):
    """Run an `async def test_...(fixtures...)` body with asyncio.run inside a sync test."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


async def _passive_count(conn, name):
    """(message_count, consumer_count) of `name` via a passive declare on a fresh channel."""
    ch = await conn.channel()
    try:
        q = await ch.declare_queue(name, passive=True)
        return q.declaration_result.message_count, q.declaration_result.consumer_count
    finally:
        await ch.close()


async def _drain_get(queue):
    """basic.get everything currently in `queue` (auto-ack), returning the bodies."""
    bodies = []
    while True:
        m = await queue.get(no_ack=True, fail=False)
        if m is None:
            return bodies
        bodies.append(m.body)


def _assert_properties(m, *, body, ts):
    assert m.body == body
    assert m.content_type == "application/x-compat"
    assert m.content_encoding == "identity"
    assert m.headers == HEADERS
    assert isinstance(m.headers["h-bytes"], (bytes, bytearray))
    assert m.correlation_id == "corr-42"
    assert m.message_id == "msg-" + body.decode()
    assert m.delivery_mode == DeliveryMode.PERSISTENT
    assert m.priority == 5
    assert m.reply_to == "reply.here"
    assert m.type == "compat.type"
    assert m.app_id == "warren-compat"
    assert m.user_id == "guest"
    assert m.timestamp == ts


def _message(body, ts):
    return Message(
        body,
        content_type="application/x-compat",
        content_encoding="identity",
        headers=HEADERS,
        correlation_id="corr-42",
        message_id="msg-" + body.decode(),
        delivery_mode=DeliveryMode.PERSISTENT,
        priority=5,
        reply_to="reply.here",
        type="compat.type",
        app_id="warren-compat",
        user_id="guest",  # RabbitMQ requires user_id to match the authenticated user
        timestamp=ts,
    )


@run_async
async def test_aio_pika_robust_get_round_trip_properties(amqp_url, names):
    """connect_robust + basic.get: body, every basic property and a mixed-type headers table
    survive the broker; GetOk carries routing info and the remaining message count."""
    ts = datetime.datetime(2024, 5, 17, 12, 30, 45, tzinfo=datetime.timezone.utc)
    conn = await aio_pika.connect_robust(amqp_url)
    async with conn:
        ch = await conn.channel()
        q = await ch.declare_queue(names.q("props"), durable=False)
        assert q.declaration_result.message_count == 0
        assert q.declaration_result.consumer_count == 0
        for body in (b"one", b"two"):
            confirm = await ch.default_exchange.publish(_message(body, ts), routing_key=q.name)
            assert isinstance(confirm, aiormq.spec.Basic.Ack)

        m1 = await q.get(no_ack=False)
        _assert_properties(m1, body=b"one", ts=ts)
        assert m1.exchange == ""
        assert m1.routing_key == q.name
        assert m1.redelivered is False
        assert m1.message_count == 1  # messages left after this one
        await m1.ack()

        m2 = await q.get(no_ack=True)
        _assert_properties(m2, body=b"two", ts=ts)
        assert m2.message_count == 0

        with pytest.raises(QueueEmpty):
            await q.get()
        assert await _passive_count(conn, q.name) == (0, 0)


@run_async
async def test_aio_pika_server_named_queue_iterator_consume(amqp_url):
    """A server-named exclusive queue gets an amq.gen- name; the queue iterator consumes
    the messages in publish order via basic.deliver with headers/properties intact."""
    ts = datetime.datetime(2023, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    async with await aio_pika.connect(amqp_url) as conn:
        ch = await conn.channel()
        q = await ch.declare_queue(exclusive=True)  # name=None -> server-generated
        assert q.name.startswith("amq.gen-"), q.name
        bodies = [f"m{i}".encode() for i in range(3)]
        for b in bodies:
            await ch.default_exchange.publish(_message(b, ts), routing_key=q.name)

        got = []
        async with q.iterator() as it:
            async for m in it:
                async with m.process():
                    got.append(m)
                if len(got) == len(bodies):
                    break
        assert [m.body for m in got] == bodies
        assert [m.delivery_tag for m in got] == [1, 2, 3]
        for m in got:
            _assert_properties(m, body=m.body, ts=ts)
            assert m.redelivered is False
            assert m.routing_key == q.name
            assert m.exchange == ""
            assert m.consumer_tag
        # All were acked by process(); the iterator's consumer was cancelled on exit.
        assert await _passive_count(conn, q.name) == (0, 0)


@run_async
async def test_aio_pika_publisher_confirms(amqp_url, names):
    """Channels confirm by default: every publish returns Basic.Ack with sequential delivery
    tags, including an unroutable non-mandatory publish (silently dropped, still acked)."""
    async with await aio_pika.connect(amqp_url) as conn:
        ch = await conn.channel()
        assert ch.publisher_confirms is True
        q = await ch.declare_queue(names.q("confirm"))
        acks = []
        for i in range(3):
            acks.append(await ch.default_exchange.publish(Message(b"%d" % i), routing_key=q.name))
        acks.append(await ch.default_exchange.publish(
            Message(b"lost"), routing_key=names.prefix + ".nowhere", mandatory=False))
        for a in acks:
            assert isinstance(a, aiormq.spec.Basic.Ack), a
        assert [a.delivery_tag for a in acks] == [1, 2, 3, 4]
        assert await _passive_count(conn, q.name) == (3, 0)
        assert await _drain_get(q) == [b"0", b"1", b"2"]


@run_async
async def test_aio_pika_mandatory_unroutable(amqp_url, names):
    """A mandatory publish nobody can route comes back as basic.return 312 NO_ROUTE: by default
    aio-pika hands the returned message to return_callbacks and returns it from publish();
    with on_return_raises=True publish raises PublishError (a DeliveryError). The channel
    keeps working afterwards."""
    async with await aio_pika.connect(amqp_url) as conn:
        ch = await conn.channel()
        x = await ch.declare_exchange(names.x("direct"), ExchangeType.DIRECT)
        returned = asyncio.Queue()
        ch.return_callbacks.add(lambda _channel, message: returned.put_nowait(message))

        result = await x.publish(Message(b"bounce", message_id="r1"), routing_key="no.binding")
        assert isinstance(result, aiormq.abc.DeliveredMessage), result
        assert isinstance(result.delivery, aiormq.spec.Basic.Return)
        assert result.delivery.reply_code == 312
        assert result.delivery.reply_text == "NO_ROUTE"
        assert result.delivery.exchange == x.name
        assert result.delivery.routing_key == "no.binding"
        assert result.body == b"bounce"
        cb_msg = await returned.get()
        assert cb_msg.body == b"bounce"
        assert cb_msg.message_id == "r1"
        assert cb_msg.routing_key == "no.binding"

        # Same channel still confirms routable publishes normally.
        q = await ch.declare_queue(names.q("routable"))
        await q.bind(x, routing_key="yes")
        ack = await x.publish(Message(b"ok"), routing_key="yes")
        assert isinstance(ack, aiormq.spec.Basic.Ack)

        raising = await conn.channel(on_return_raises=True)
        with pytest.raises(DeliveryError) as ei:
            await raising.default_exchange.publish(
                Message(b"bounce2"), routing_key=names.prefix + ".no-such-queue")
        assert isinstance(ei.value, PublishError)
        assert isinstance(ei.value.frame, aiormq.spec.Basic.Return)
        assert ei.value.frame.reply_code == 312
        assert ei.value.message.body == b"bounce2"
        assert not raising.is_closed
        ack = await raising.default_exchange.publish(Message(b"ok2"), routing_key=q.name)
        assert isinstance(ack, aiormq.spec.Basic.Ack)
        assert await _drain_get(q) == [b"ok", b"ok2"]


@run_async
async def test_aio_pika_topic_exchange_wildcards(amqp_url, names):
    """Topic bindings: `*` matches exactly one word, `#` zero or more words."""
    async with await aio_pika.connect(amqp_url) as conn:
        ch = await conn.channel()
        x = await ch.declare_exchange(names.x("topic"), ExchangeType.TOPIC)
        q_star = await ch.declare_queue(names.q("star"))
        q_hash = await ch.declare_queue(names.q("hash"))
        q_tail = await ch.declare_queue(names.q("tail"))
        await q_star.bind(x, routing_key="a.*")
        await q_hash.bind(x, routing_key="a.#")
        await q_tail.bind(x, routing_key="#.z")
        for rk in ("a.b", "a.b.c", "a", "x.z", "a.z", "z", "b.a", ""):
            await x.publish(Message(rk.encode()), routing_key=rk, mandatory=False)
        assert await _drain_get(q_star) == [b"a.b", b"a.z"]
        assert await _drain_get(q_hash) == [b"a.b", b"a.b.c", b"a", b"a.z"]
        assert await _drain_get(q_tail) == [b"x.z", b"a.z", b"z"]


@run_async
async def test_aio_pika_fanout_to_two_queues_and_unbind(amqp_url, names):
    """Fanout ignores the routing key and copies to every bound queue; after an unbind only
    the still-bound queue receives."""
    async with await aio_pika.connect(amqp_url) as conn:
        ch = await conn.channel()
        x = await ch.declare_exchange(names.x("fanout"), ExchangeType.FANOUT)
        q1 = await ch.declare_queue(names.q("f1"))
        q2 = await ch.declare_queue(names.q("f2"))
        await q1.bind(x, routing_key="ignored-1")
        await q2.bind(x)
        await x.publish(Message(b"both", headers={"n": 1}), routing_key="whatever")
        m1 = await q1.get(no_ack=True)
        m2 = await q2.get(no_ack=True)
        assert (m1.body, m1.headers, m1.exchange, m1.routing_key) == (b"both", {"n": 1}, x.name, "whatever")
        assert (m2.body, m2.headers, m2.exchange, m2.routing_key) == (b"both", {"n": 1}, x.name, "whatever")

        await q2.unbind(x)
        await x.publish(Message(b"only-q1"), routing_key="")
        assert await _drain_get(q1) == [b"only-q1"]
        assert await _drain_get(q2) == []


@run_async
async def test_aio_pika_prefetch_two_limits_unacked(amqp_url, names):
    """With basic.qos prefetch_count=2 a consumer holds at most 2 unacked messages; each ack
    releases exactly one more, in queue order."""
    async with await aio_pika.connect(amqp_url) as conn:
        ch = await conn.channel()
        await ch.set_qos(prefetch_count=2)
        q = await ch.declare_queue(names.q("prefetch"))
        for i in range(5):
            await ch.default_exchange.publish(Message(b"m%d" % i), routing_key=q.name)

        inbox = asyncio.Queue()
        tag = await q.consume(inbox.put)
        first = await inbox.get()
        second = await inbox.get()
        assert [first.body, second.body] == [b"m0", b"m1"]
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(inbox.get(), NO_DELIVERY_WAIT_S)
        assert await _passive_count(conn, q.name) == (3, 1)  # 3 ready, 2 unacked

        await first.ack()
        third = await inbox.get()
        assert third.body == b"m2"
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(inbox.get(), NO_DELIVERY_WAIT_S)

        await second.ack()
        await third.ack()
        rest = [await inbox.get(), await inbox.get()]
        assert [m.body for m in rest] == [b"m3", b"m4"]
        for m in rest:
            await m.ack()
        await q.cancel(tag)
        assert await _passive_count(conn, q.name) == (0, 0)


@run_async
async def test_aio_pika_reject_requeue_then_nack_drop(amqp_url, names):
    """reject(requeue=True) redelivers the same message with redelivered=True;
    nack(requeue=False) (no dead-letter exchange) drops it for good."""
    async with await aio_pika.connect(amqp_url) as conn:
        ch = await conn.channel()
        q = await ch.declare_queue(names.q("reject"))
        await ch.default_exchange.publish(
            Message(b"again", message_id="once", headers={"a": "b"}), routing_key=q.name)

        inbox = asyncio.Queue()
        tag = await q.consume(inbox.put)
        m = await inbox.get()
        assert (m.body, m.redelivered) == (b"again", False)
        await m.reject(requeue=True)

        again = await inbox.get()
        assert (again.body, again.message_id, again.headers) == (b"again", "once", {"a": "b"})
        assert again.redelivered is True
        assert again.delivery_tag != m.delivery_tag
        await again.nack(requeue=False)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(inbox.get(), NO_DELIVERY_WAIT_S)

        await q.cancel(tag)
        assert await _passive_count(conn, q.name) == (0, 0)
        assert await q.get(fail=False) is None


@run_async
async def test_aio_pika_transactions_commit_and_rollback(amqp_url, names):
    """On a tx channel (publisher_confirms=False) publishes are invisible until commit and
    discarded by rollback; the async-with form commits on success, rolls back on error."""
    async with await aio_pika.connect(amqp_url) as conn:
        ch = await conn.channel(publisher_confirms=False)
        q = await ch.declare_queue(names.q("tx"))
        tx = ch.transaction()
        await tx.select()

        assert await ch.default_exchange.publish(Message(b"rolled-back"), routing_key=q.name) is None
        # A synchronous method on the same channel: the broker has processed the publish.
        assert (await ch.declare_queue(q.name, passive=True)).declaration_result.message_count == 0
        await tx.rollback()
        assert await _passive_count(conn, q.name) == (0, 0)

        await ch.default_exchange.publish(Message(b"committed"), routing_key=q.name)
        assert (await ch.declare_queue(q.name, passive=True)).declaration_result.message_count == 0
        assert await _passive_count(conn, q.name) == (0, 0)
        await tx.commit()
        assert await _passive_count(conn, q.name) == (1, 0)

        async with ch.transaction():
            await ch.default_exchange.publish(Message(b"ctx-commit"), routing_key=q.name)

        class Boom(Exception):
            pass

        with pytest.raises(Boom):
            async with ch.transaction():
                await ch.default_exchange.publish(Message(b"ctx-rollback"), routing_key=q.name)
                raise Boom()

        assert await _drain_get(q) == [b"committed", b"ctx-commit"]


@run_async
async def test_aio_pika_channel_errors_keep_connection_usable(amqp_url, names):
    """Inequivalent redeclares raise ChannelPreconditionFailed (406), a passive declare of a
    missing queue ChannelNotFoundEntity (404); each closes only its channel, the connection
    and its other channels keep working."""
    async with await aio_pika.connect(amqp_url) as conn:
        ch = await conn.channel()
        qname = names.q("args")
        await ch.declare_queue(qname, arguments={"x-max-length": 10})
        x = await ch.declare_exchange(names.x("direct"), ExchangeType.DIRECT)

        bad = await conn.channel()
        with pytest.raises(ChannelPreconditionFailed) as ei:
            await bad.declare_queue(qname, arguments={"x-max-length": 20})
        # aiormq maps the close code to the class (406 here) and keeps only reply_text.
        assert ei.value.args[0].startswith("PRECONDITION_FAILED - inequivalent arg 'x-max-length'")
        assert bad.is_closed

        bad = await conn.channel()
        with pytest.raises(ChannelPreconditionFailed) as ei:
            await bad.declare_exchange(x.name, ExchangeType.FANOUT)
        assert ei.value.args[0].startswith("PRECONDITION_FAILED - inequivalent arg 'type'")
        assert bad.is_closed

        bad = await conn.channel()
        with pytest.raises(ChannelNotFoundEntity) as ei:
            await bad.declare_queue(names.q("missing"), passive=True)
        assert ei.value.args[0].startswith("NOT_FOUND - no queue")
        assert bad.is_closed

        assert not conn.is_closed
        assert not ch.is_closed
        fresh = await conn.channel()
        q = await fresh.declare_queue(qname, passive=True)
        ack = await fresh.default_exchange.publish(Message(b"still-alive"), routing_key=qname)
        assert isinstance(ack, aiormq.spec.Basic.Ack)
        assert (await q.get(no_ack=True)).body == b"still-alive"
        # The first channel was never affected.
        await ch.default_exchange.publish(Message(b"first-channel"), routing_key=qname)
        assert await _drain_get(q) == [b"first-channel"]


@run_async
async def test_aio_pika_exclusive_queue_locked_for_other_connection(amqp_url, names):
    """Another connection touching an exclusive queue gets ChannelLockedResource (405) on
    passive declare and on consume; the owner is unaffected."""
    async with await aio_pika.connect(amqp_url) as owner, \
            await aio_pika.connect(amqp_url) as other:
        och = await owner.channel()
        q = await och.declare_queue(names.q("excl"), exclusive=True)

        ch = await other.channel()
        with pytest.raises(ChannelLockedResource) as ei:
            await ch.declare_queue(q.name, passive=True)
        assert ei.value.args[0].startswith("RESOURCE_LOCKED - cannot obtain exclusive access")

        ch = await other.channel()
        foreign = await ch.get_queue(q.name, ensure=False)

        async def never_called(message):
            raise AssertionError(f"unexpected delivery {message!r}")

        with pytest.raises(ChannelLockedResource):
            await foreign.consume(never_called)
        assert not other.is_closed

        await och.default_exchange.publish(Message(b"mine"), routing_key=q.name)
        assert (await q.get(no_ack=True)).body == b"mine"
