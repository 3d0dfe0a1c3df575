"""Partitioned queues (Warren): `x-partitions: N` on queue.declare makes N ordinary queues
`name-0 .. name-(N-1)` of the declared type; a message published to the logical name goes to
the partition its key's hash picks (`x-partition-key`: `routing_key` by default, `header:<name>`,
`property:message_id|correlation_id|timestamp`), so one key's messages stay in one partition in
publish order. The logical name answers passive declares, purge and delete for all partitions."""

import pika
import pytest

from amqp_helpers import channel_closed
from conftest import q

pytestmark = pytest.mark.warren_only

TYPES = ["classic", "quorum", "stream"]


def declare(ch, name, n, kind="quorum", key=None, **extra):
    args = {"x-partitions": n, "x-queue-type": kind, **extra}
    if key:
        args["x-partition-key"] = key
    return ch.queue_declare(name, durable=True, arguments=args)


def bodies(ch, queue, kind):
    """Every body in `queue` in order (streams are read, the others drained)."""
    if kind == "stream":
        out = []
        ch.basic_qos(prefetch_count=1000)
        total = ch.queue_declare(queue, passive=True).method.message_count
        if total == 0:
            return out
        for m, _props, body in ch.consume(queue, arguments={"x-stream-offset": "first"},
                                          inactivity_timeout=5):
            assert m is not None, f"{queue}: {len(out)} of {total} read"
            out.append(body.decode())
            ch.basic_ack(m.delivery_tag)
            if len(out) == total:
                break
        ch.cancel()
        return out
    out = []
    while True:
        m, _p, body = ch.basic_get(queue, auto_ack=True)
        if m is None:
            return out
        out.append(body.decode())


@pytest.mark.parametrize("kind", TYPES)
def test_a_key_stays_in_one_partition_in_order(conn, names, kind):
    ch = conn.channel()
    name = names.q("orders")
    ok = declare(ch, name, 4, kind, key="header:customer")
    assert ok.method.queue == name
    ch.confirm_delivery()
    customers = [f"c{i}" for i in range(40)]
    for n in range(5):
        for c in customers:
            ch.basic_publish("", name, f"{c}/{n}".encode(),
                             pika.BasicProperties(headers={"customer": c}, delivery_mode=2),
                             mandatory=True)
    where = {}
    for i in range(4):
        got = bodies(ch, f"{name}-{i}", kind)
        for pos, body in enumerate(got):
            c, n = body.split("/")
            where.setdefault(c, []).append((i, int(n), pos))
    assert sorted(where) == sorted(customers)
    used = set()
    for c, places in where.items():
        assert len(places) == 5, f"{c}: {places}"
        assert len({p for p, _, _ in places}) == 1, f"{c} in several partitions: {places}"
        assert [n for _, n, _ in sorted(places, key=lambda x: x[2])] == list(range(5)), places
        used.add(places[0][0])
    assert used == {0, 1, 2, 3}


def test_the_partitions_are_ordinary_queues_of_the_type(api, conn, names):
    base, s = api
    ch = conn.channel()
    name = names.q("parts")
    declare(ch, name, 3, "quorum", **{"x-delivery-limit": 5})
    for i in range(3):
        queue = s.get(f"{base}/api/queues/%2F/{q(f'{name}-{i}')}").json()
        assert queue["type"] == "quorum"
        assert queue["arguments"]["x-partition-of"] == name
        assert queue["arguments"]["x-partition-index"] == i
        assert queue["arguments"]["x-delivery-limit"] == 5
    assert s.get(f"{base}/api/queues/%2F/{q(f'{name}-3')}").status_code == 404


def test_a_bound_exchange_routes_by_routing_key(conn, names):
    ch = conn.channel()
    name, x = names.q("bound"), names.x("events")
    declare(ch, name, 3, "classic")
    ch.exchange_declare(x, exchange_type="topic")
    ch.queue_bind(name, x, "#")
    ch.confirm_delivery()
    keys = [f"user.{i}" for i in range(60)]
    for n in range(3):
        for k in keys:
            ch.basic_publish(x, k, f"{k}/{n}".encode(), mandatory=True)
    seen = {}
    for i in range(3):
        for body in bodies(ch, f"{name}-{i}", "classic"):
            seen.setdefault(body.split("/")[0], set()).add(i)
    assert len(seen) == 60 and all(len(v) == 1 for v in seen.values())
    assert {next(iter(v)) for v in seen.values()} == {0, 1, 2}


def test_the_logical_name_answers_declare_purge_and_delete(conn, names):
    ch = conn.channel()
    name = names.q("logical")
    declare(ch, name, 2, "quorum", key="property:message_id")
    ch.confirm_delivery()
    for i in range(10):
        ch.basic_publish("", name, b"m", pika.BasicProperties(message_id=f"id-{i}"))
    ok = ch.queue_declare(name, passive=True)
    assert ok.method.queue == name and ok.method.message_count == 10
    again = declare(ch, name, 2, "quorum", key="property:message_id")
    assert again.method.message_count == 10, "the same spec again is a no-op"
    assert ch.queue_purge(name).method.message_count == 10
    assert ch.queue_declare(name, passive=True).method.message_count == 0
    assert ch.queue_delete(name).method.message_count == 0
    for i in range(2):
        with channel_closed(404):
            conn.channel().queue_declare(f"{name}-{i}", passive=True)
    with channel_closed(404):
        conn.channel().queue_declare(name, passive=True)


def test_a_different_spec_or_an_ordinary_declare_is_refused(conn, names):
    name = names.q("spec")
    declare(conn.channel(), name, 2, "quorum")
    with channel_closed(406, "inequivalent arg 'x-partitions'"):
        declare(conn.channel(), name, 3, "quorum")
    with channel_closed(406, "inequivalent arg 'x-partitions'"):
        conn.channel().queue_declare(name, durable=True, arguments={"x-queue-type": "quorum"})
    plain = names.q("plain")
    conn.channel().queue_declare(plain)
    with channel_closed(406, "inequivalent arg 'x-partitions'"):
        declare(conn.channel(), plain, 2, "classic")


@pytest.mark.parametrize("args,text", [
    ({"x-partitions": 0}, "invalid arg 'x-partitions'"),
    ({"x-partitions": 5000}, "invalid arg 'x-partitions'"),
    ({"x-partitions": 2, "x-partition-key": "body"}, "invalid arg 'x-partition-key'"),
    ({"x-partition-of": "other"}, "invalid arg 'x-partition-of'"),
])
def test_bad_arguments_are_406(conn, names, args, text):
    with channel_closed(406, text):
        conn.channel().queue_declare(names.q("bad"), durable=True, arguments=args)


def test_deleting_the_last_partition_removes_the_logical_queue_and_its_bindings(api, conn, names):
    base, s = api
    ch = conn.channel()
    name, x = names.q("gone"), names.x("src")
    declare(ch, name, 2, "classic")
    ch.exchange_declare(x, exchange_type="fanout")
    ch.queue_bind(name, x)
    assert any(b["destination"] == name
               for b in s.get(f"{base}/api/exchanges/%2F/{q(x)}/bindings/source").json())
    ch.queue_delete(f"{name}-0")
    assert ch.queue_declare(name, passive=True).method.queue == name
    ch.queue_delete(f"{name}-1")
    with channel_closed(404):
        conn.channel().queue_declare(name, passive=True)
    assert not any(b["destination"] == name
                   for b in s.get(f"{base}/api/exchanges/%2F/{q(x)}/bindings/source").json())


def test_a_partitioned_queue_survives_a_restart(tmp_path):
    """Nothing but the partitions is stored: the logical queue and its routing come back from
    their arguments. The same keys reach the same partitions after the restart."""
    from conftest import warren_process
    data = tmp_path / "data"
    data.mkdir()
    keys = [f"k{i}" for i in range(50)]

    def placements(port):
        c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
        ch = c.channel()
        ch.confirm_delivery()
        for k in keys:
            ch.basic_publish("", "p", k.encode(),
                             pika.BasicProperties(headers={"k": k}, delivery_mode=2))
        seen = {}
        for i in range(3):
            for body in bodies(ch, f"p-{i}", "quorum"):
                seen[body] = i
        c.close()
        return seen

    with warren_process(data_dir=data) as w:
        c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", w["port"]))
        declare(c.channel(), "p", 3, "quorum", key="header:k")
        c.close()
        before = placements(w["port"])
    with warren_process(data_dir=data) as w:
        c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", w["port"]))
        assert c.channel().queue_declare("p", passive=True).method.queue == "p"
        c.close()
        after = placements(w["port"])
    assert len(before) == 50 and after == before


@pytest.mark.parametrize("kind", TYPES)
def test_a_consumer_of_the_logical_name_gets_every_partition(conn, names, kind):
    """Without a consumer group a consumer of the logical name is subscribed to each partition;
    its acks settle in the partition a message came from; cancelling leaves them all."""
    ch = conn.channel()
    name = names.q("all")
    declare(ch, name, 3, kind, key="header:k")
    ch.confirm_delivery()
    for i in range(30):
        ch.basic_publish("", name, f"m{i}".encode(),
                         pika.BasicProperties(headers={"k": f"key{i}"}, delivery_mode=2))
    got = []
    ch.basic_qos(prefetch_count=50)
    args = {"x-stream-offset": "first"} if kind == "stream" else {}
    for m, _props, body in ch.consume(name, arguments=args, inactivity_timeout=5):
        assert m is not None, f"only {len(got)} of 30 arrived"
        got.append(body.decode())
        ch.basic_ack(m.delivery_tag)
        if len(got) == 30:
            break
    assert sorted(got) == sorted(f"m{i}" for i in range(30))
    consumers = ch.queue_declare(name, passive=True).method.consumer_count
    assert consumers == 3, "one subscription per partition"
    ch.cancel()
    assert ch.queue_declare(name, passive=True).method.consumer_count == 0
    if kind != "stream":
        assert ch.queue_declare(name, passive=True).method.message_count == 0, "acks settled"


def test_unacked_deliveries_of_a_logical_consumer_return_when_its_channel_closes(conn, names):
    name = names.q("ret")
    ch = conn.channel()
    declare(ch, name, 2, "quorum", key="header:k")
    ch.confirm_delivery()
    for i in range(6):
        ch.basic_publish("", name, b"x", pika.BasicProperties(headers={"k": f"{i}"}))
    worker = conn.channel()
    worker.basic_qos(prefetch_count=10)
    seen = 0
    for m, _p, _b in worker.consume(name, inactivity_timeout=5):
        assert m is not None
        seen += 1
        if seen == 6:
            break
    worker.close()
    assert ch.queue_declare(name, passive=True).method.message_count == 6


def test_basic_get_on_the_logical_name_takes_from_any_partition(conn, names):
    ch = conn.channel()
    name = names.q("get")
    declare(ch, name, 3, "quorum", key="header:k")
    ch.confirm_delivery()
    for i in range(9):
        ch.basic_publish("", name, f"m{i}".encode(), pika.BasicProperties(headers={"k": f"{i}"}))
    got = []
    for _ in range(9):
        m, _p, body = ch.basic_get(name, auto_ack=False)
        assert m is not None, f"only {len(got)} of 9"
        got.append(body.decode())
        ch.basic_ack(m.delivery_tag)
    assert sorted(got) == sorted(f"m{i}" for i in range(9))
    assert ch.basic_get(name)[0] is None
    assert ch.queue_declare(name, passive=True).method.message_count == 0
