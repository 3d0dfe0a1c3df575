"""Hash exchanges: `x-consistent-hash` (the rabbitmq_consistent_hash_exchange plugin's
interface: the binding key is the weight; the routing key, a `hash-header` or a `hash-property`
is hashed) and `x-modulus-hash` (RabbitMQ 4.3). Each message goes to exactly one bound queue,
and one key always to the same queue, in publish order. Which queue a key picks is Warren's
own hash, not RabbitMQ's: the tests assert the contract, not a queue for a key. Checked against
RabbitMQ 4.0.5 with the plugin enabled (the x-modulus-hash case is Warren only)."""

import uuid

import pika
import pytest

from amqp_helpers import channel_closed, counts

MESSAGES = 2000


def _bound_queues(ch, names, x, weights):
    queues = []
    for i, w in enumerate(weights):
        q = names.q(f"p{i}")
        ch.queue_declare(q)
        ch.queue_bind(q, x, str(w))
        queues.append(q)
    return queues


def _drain(ch, q):
    """Every body in `q`, in queue order."""
    out = []
    while True:
        m, _props, body = ch.basic_get(q, auto_ack=True)
        if m is None:
            return out
        out.append(body.decode())


def _where(ch, queues):
    """body -> (queue, position in that queue)."""
    seen = {}
    for q in queues:
        for pos, body in enumerate(_drain(ch, q)):
            assert body not in seen, f"{body} arrived twice"
            seen[body] = (q, pos)
    return seen


@pytest.mark.parametrize("kind", [
    "x-consistent-hash",
    # RabbitMQ 4.3's type (in the sharding plugin before): Warren only here.
    pytest.param("x-modulus-hash", marks=pytest.mark.warren_only),
])
def test_each_message_goes_to_one_queue_and_a_key_to_the_same_queue_in_order(conn, ch, names, kind):
    x = names.x("hash")
    ch.exchange_declare(x, exchange_type=kind)
    queues = _bound_queues(ch, names, x, [1, 1, 1, 1])
    ch.confirm_delivery()
    keys = [f"key-{i}" for i in range(MESSAGES // 4)]
    for round_ in range(4):
        for k in keys:
            ch.basic_publish(x, k, f"{k}/{round_}".encode())
    seen = _where(ch, queues)
    assert len(seen) == MESSAGES, "every message reached exactly one queue"
    per_queue = {q: 0 for q in queues}
    for k in keys:
        places = [seen[f"{k}/{r}"] for r in range(4)]
        assert len({q for q, _ in places}) == 1, f"{k} went to {places}"
        positions = [pos for _, pos in places]
        assert positions == sorted(positions), f"{k} out of order: {places}"
        per_queue[places[0][0]] += 1
    assert all(n > 0 for n in per_queue.values()), per_queue


def test_weights_bias_the_share(conn, ch, names):
    x = names.x("weighted")
    ch.exchange_declare(x, exchange_type="x-consistent-hash")
    light, heavy = _bound_queues(ch, names, x, [1, 4])
    ch.confirm_delivery()
    for i in range(MESSAGES):
        ch.basic_publish(x, uuid.uuid4().hex, b"m")
    n_light, n_heavy = counts(conn, light)[0], counts(conn, heavy)[0]
    assert n_light + n_heavy == MESSAGES
    assert 2.5 < n_heavy / n_light < 6.5, (n_light, n_heavy)


def test_the_binding_key_must_be_a_positive_integer(ch, names):
    x, q = names.x("w"), names.q()
    ch.exchange_declare(x, exchange_type="x-consistent-hash")
    ch.queue_declare(q)
    with channel_closed(406, "The binding key must be an integer"):
        ch.queue_bind(q, x, "abc")


def test_a_zero_weight_is_refused(ch, names):
    x, q = names.x("w0"), names.q()
    ch.exchange_declare(x, exchange_type="x-consistent-hash")
    ch.queue_declare(q)
    with channel_closed(406, "The binding key must be greater than 0"):
        ch.queue_bind(q, x, "0")


def test_hash_header_and_hash_property_are_mutually_exclusive(ch, names):
    with channel_closed(406, "hash-header and hash-property are mutually exclusive"):
        ch.exchange_declare(names.x(), exchange_type="x-consistent-hash",
                            arguments={"hash-header": "h", "hash-property": "message_id"})


def test_an_unknown_hash_property_is_refused(ch, names):
    with channel_closed(406, "Unsupported property: app_id"):
        ch.exchange_declare(names.x(), exchange_type="x-consistent-hash",
                            arguments={"hash-property": "app_id"})


@pytest.mark.parametrize("source", ["header", "message_id", "correlation_id"])
def test_hashing_a_header_or_property_ignores_the_routing_key(conn, ch, names, source):
    x = names.x(source)
    args = {"hash-header": "user"} if source == "header" else {"hash-property": source}
    ch.exchange_declare(x, exchange_type="x-consistent-hash", arguments=args)
    queues = _bound_queues(ch, names, x, [1, 1, 1])
    ch.confirm_delivery()
    users = [f"user-{i}" for i in range(60)]
    for n in range(3):
        for u in users:
            if source == "header":
                props = pika.BasicProperties(headers={"user": u})
            elif source == "message_id":
                props = pika.BasicProperties(message_id=u)
            else:
                props = pika.BasicProperties(correlation_id=u)
            # A different routing key each time: only the hashed value decides.
            ch.basic_publish(x, uuid.uuid4().hex, f"{u}/{n}".encode(), props)
    seen = _where(ch, queues)
    assert len(seen) == 180
    used = set()
    for u in users:
        places = {seen[f"{u}/{n}"][0] for n in range(3)}
        assert len(places) == 1, f"{u} went to {places}"
        used |= places
    assert len(used) == 3, "sixty values spread over every queue"


def test_unbinding_sends_its_keys_to_the_others_and_keeps_theirs(conn, ch, names):
    x = names.x("unbind")
    ch.exchange_declare(x, exchange_type="x-consistent-hash")
    queues = _bound_queues(ch, names, x, [1, 1, 1])
    ch.confirm_delivery()
    keys = [f"k{i}" for i in range(300)]
    for k in keys:
        ch.basic_publish(x, k, k.encode())
    before = {body: q for body, (q, _) in _where(ch, queues).items()}
    ch.queue_unbind(queues[2], x, "1")
    for k in keys:
        ch.basic_publish(x, k, k.encode())
    after = {body: q for body, (q, _) in _where(ch, queues).items()}
    assert len(after) == len(keys)
    assert queues[2] not in after.values()
    for k in keys:
        if before[k] != queues[2]:
            assert after[k] == before[k], f"{k} moved from {before[k]} to {after[k]}"


def test_exchange_types_are_listed_and_the_type_is_kept(conn, ch, names):
    x = names.x("kept")
    ch.exchange_declare(x, exchange_type="x-consistent-hash")
    ch.exchange_declare(x, exchange_type="x-consistent-hash", passive=True)
    with channel_closed(406, "inequivalent arg 'type'"):
        ch.exchange_declare(x, exchange_type="direct")


@pytest.mark.warren_only
def test_a_key_keeps_its_queue_across_a_restart(tmp_path):
    """Goal: the ring is rebuilt the same after a restart (RabbitMQ re-sorts its ring at
    recovery, so a key may move there). Method: on a Warren of our own, bind 12 durable queues
    in an order unlike their names' order, note where 200 keys go, restart on the same data
    directory and publish the same keys: each reaches the queue it reached before."""
    from conftest import warren_process
    data = tmp_path / "data"
    data.mkdir()
    keys = [f"order-{i}" for i in range(200)]
    queues = [f"hq-{i}" for i in (7, 2, 11, 0, 5, 9, 1, 10, 3, 8, 4, 6)]

    def placements(port):
        c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
        ch = c.channel()
        ch.confirm_delivery()
        for k in keys:
            ch.basic_publish("ring", k, k.encode())
        seen = {body: q for body, (q, _) in _where(ch, queues).items()}
        c.close()
        return seen

    with warren_process(data_dir=data) as w:
        c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", w["port"]))
        ch = c.channel()
        ch.exchange_declare("ring", exchange_type="x-consistent-hash", durable=True)
        for q in queues:
            ch.queue_declare(q, durable=True)
            ch.queue_bind(q, "ring", "1")
        c.close()
        before = placements(w["port"])
    with warren_process(data_dir=data) as w:
        after = placements(w["port"])
    assert len(before) == len(keys) and len(set(before.values())) > 6
    assert after == before
