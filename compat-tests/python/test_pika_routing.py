"""Binding and routing semantics of the direct, fanout, topic, headers and default exchanges."""

import decimal

import pika

from amqp_helpers import bodies_of, get_all


def _routes(ch, names, etype, bindings, publishes):
    """Declare an exchange of `etype`, one queue per binding, publish, and return
    {binding_index: sorted bodies} of what each queue received."""
    x = names.x(etype)
    ch.exchange_declare(x, exchange_type=etype)
    queues = []
    for i, b in enumerate(bindings):
        q = names.q(f"b{i}")
        ch.queue_declare(q)
        if etype == "headers":
            ch.queue_bind(q, x, routing_key="", arguments=b)
        else:
            ch.queue_bind(q, x, routing_key=b)
        queues.append(q)
    ch.confirm_delivery()
    for rk, body, headers in publishes:
        ch.basic_publish(x, rk, body, pika.BasicProperties(headers=headers))
    return [sorted(bodies_of(get_all(ch, q))) for q in queues]


def test_direct_routing(ch, names):
    """A direct exchange delivers to queues whose binding key equals the routing key exactly."""
    got = _routes(ch, names, "direct", ["a", "b", "a"],
                  [("a", b"1", None), ("b", b"2", None), ("c", b"3", None), ("A", b"4", None)])
    assert got == [[b"1"], [b"2"], [b"1"]]


def test_direct_duplicate_bindings_deliver_once(ch, names):
    """Binding one queue twice with different keys delivers a matching message once per queue."""
    x, q = names.x(), names.q()
    ch.exchange_declare(x, exchange_type="direct")
    ch.queue_declare(q)
    ch.queue_bind(q, x, "k1")
    ch.queue_bind(q, x, "k1")  # identical binding is idempotent
    ch.queue_bind(q, x, "k2")
    ch.confirm_delivery()
    ch.basic_publish(x, "k1", b"one")
    ch.basic_publish(x, "k2", b"two")
    assert bodies_of(get_all(ch, q)) == [b"one", b"two"]


def test_fanout_routing_ignores_key(ch, names):
    """A fanout exchange delivers every message to every bound queue regardless of keys."""
    got = _routes(ch, names, "fanout", ["x", "", "whatever"],
                  [("", b"1", None), ("zzz", b"2", None)])
    assert got == [[b"1", b"2"]] * 3


# Verified on RabbitMQ 3.10; RabbitMQ 4.x (rabbit_db_topic_exchange) splits the same way:
# split_topic_key(<<>>) = [] (zero words), "a..b" = ["a", "", "b"].
TOPIC_CASES = [
    # (binding key, routing key, matches?)
    ("a.b", "a.b", True),
    ("a.b", "a.b.c", False),
    ("a.*", "a.b", True),
    ("a.*", "a", False),
    ("a.*", "a.b.c", False),
    ("a.*", "a.", True),            # empty last word matches *
    # RabbitMQ treats the empty routing key as ZERO words (but "a." as ["a", ""]):
    ("*", "", False),
    ("", "", True),
    ("", "a", False),
    ("*", "a", True),
    ("*", "a.b", False),
    ("#", "", True),
    ("#", "a", True),
    ("#", "a.b.c", True),
    ("a.#", "a", True),             # # matches zero words
    ("a.#", "a.b.c", True),
    ("a.#", "ab", False),
    ("#.c", "a.b.c", True),
    ("#.c", "c", True),
    ("#.c", "a.b.cc", False),
    ("a.#.b", "a.b", True),
    ("a.#.b", "a.x.b", True),
    ("a.#.b", "a.x.y.b", True),
    ("a.#.b", "a.x.y.c", False),
    ("a.*.b", "a..b", True),        # * matches an empty word
    ("a..b", "a..b", True),
    ("a..b", "a.b", False),
    ("a.*.b", "a.b", False),
    ("*.*", "a..", False),
    ("#.#", "a.b", True),
    ("*.#", "", False),             # zero words: * has nothing to take
    ("*.#", "a", True),
    ("#.*", "a.b.c", True),
    ("a.*.#", "a", False),
    ("a.*.#", "a.b", True),
    ("A.b", "a.b", False),          # case-sensitive
]


def test_topic_routing_table(conn, ch, names):
    """Topic matching of *, # and empty words follows RabbitMQ's semantics for a table of cases."""
    x = names.x("topic")
    ch.exchange_declare(x, exchange_type="topic")
    qs = []
    for i, (bkey, _, _) in enumerate(TOPIC_CASES):
        q = names.q(f"t{i}")
        ch.queue_declare(q)
        ch.queue_bind(q, x, bkey)
        qs.append(q)
    ch.confirm_delivery()
    # Publish every distinct routing key once, tagging the body with the key.
    rkeys = sorted({rk for _, rk, _ in TOPIC_CASES})
    for rk in rkeys:
        ch.basic_publish(x, rk, rk.encode() or b"<empty>")
    failures = []
    for (bkey, rk, expected), q in zip(TOPIC_CASES, qs):
        received = set(bodies_of(get_all(ch, q)))
        hit = (rk.encode() or b"<empty>") in received
        if hit != expected:
            failures.append((bkey, rk, expected))
    assert not failures, f"(binding, routing key, expected) mismatches: {failures}"


def test_topic_multiple_bindings_one_copy(ch, names):
    """A queue matching via several topic bindings receives a single copy."""
    got = _routes(ch, names, "topic", ["#", "a.*"], [("a.b", b"ab", None)])
    assert got == [[b"ab"], [b"ab"]]
    x, q = names.x("t2"), names.q("multi")
    ch2 = ch.connection.channel()
    ch2.exchange_declare(x, exchange_type="topic")
    ch2.queue_declare(q)
    for key in ("#", "a.*", "*.b", "a.b"):
        ch2.queue_bind(q, x, key)
    ch2.confirm_delivery()
    ch2.basic_publish(x, "a.b", b"once")
    assert bodies_of(get_all(ch2, q)) == [b"once"]


def test_headers_routing(ch, names):
    """Headers exchange: x-match all/any (x- keys ignored) and all-with-x/any-with-x (x- keys compared)."""
    bindings = [
        {"x-match": "all", "a": "1", "b": 2},                 # 0
        {"x-match": "any", "a": "1", "b": 2},                 # 1
        {"a": "1"},                                           # 2 (default x-match is all)
        {"x-match": "all", "x-foo": "bar"},                  # 3 x- keys ignored -> matches all
        {"x-match": "any", "x-foo": "bar", "c": True},        # 4
        {"x-match": "all-with-x", "a": "1", "x-foo": "bar"},  # 5
        {"x-match": "any-with-x", "x-foo": "bar"},            # 6
        {"x-match": "all"},                                   # 7 empty all -> matches everything
        {"x-match": "any"},                                   # 8 empty any -> matches nothing
    ]
    publishes = [
        ("", b"p0", {"a": "1", "b": 2}),
        ("", b"p1", {"a": "1"}),
        ("", b"p2", {"b": 2, "x-foo": "bar"}),
        ("", b"p3", {"a": "1", "x-foo": "bar"}),
        ("", b"p4", {"a": "2", "b": 3, "c": True}),
        ("", b"p5", None),
        ("", b"p6", {"b": "2"}),  # string "2" != int 2
    ]
    got = _routes(ch, names, "headers", bindings, publishes)
    assert got[0] == [b"p0"]
    assert got[1] == [b"p0", b"p1", b"p2", b"p3"]
    assert got[2] == [b"p0", b"p1", b"p3"]
    assert got[3] == [b"p0", b"p1", b"p2", b"p3", b"p4", b"p5", b"p6"]
    assert got[4] == [b"p4"]
    assert got[5] == [b"p3"]
    assert got[6] == [b"p2", b"p3"]
    assert got[7] == [b"p0", b"p1", b"p2", b"p3", b"p4", b"p5", b"p6"]
    assert got[8] == []


def test_headers_routing_value_types(ch, names):
    """Headers matching compares typed values (bool, int, decimal, nested table) and void means 'key present'."""
    bindings = [
        {"x-match": "all", "flag": True},                                   # 0
        {"x-match": "all", "n": 42},                                        # 1
        {"x-match": "all", "d": decimal.Decimal("1.5")},                    # 2
        {"x-match": "all", "present": None},                                # 3 void: key present
    ]
    publishes = [
        ("", b"q0", {"flag": True, "n": 42}),
        ("", b"q1", {"flag": False, "n": 43, "present": "anything"}),
        ("", b"q2", {"d": decimal.Decimal("1.5"), "present": None}),
    ]
    got = _routes(ch, names, "headers", bindings, publishes)
    assert got[0] == [b"q0"]
    assert got[1] == [b"q0"]
    assert got[2] == [b"q2"]
    assert got[3] == [b"q1", b"q2"]


def test_default_exchange_routes_by_queue_name(ch, names):
    """The default exchange routes to the queue whose name equals the routing key, and nowhere else."""
    q1, q2 = names.q("one"), names.q("two")
    ch.queue_declare(q1)
    ch.queue_declare(q2)
    ch.confirm_delivery()
    ch.basic_publish("", q1, b"to-one")
    ch.basic_publish("", q2, b"to-two")
    ch.basic_publish("", names.q("nobody"), b"dropped")  # not mandatory: silently dropped
    assert bodies_of(get_all(ch, q1)) == [b"to-one"]
    assert bodies_of(get_all(ch, q2)) == [b"to-two"]


def test_unbind_stops_routing(ch, names):
    """After queue.unbind, messages with the old key no longer reach the queue; unbinding a missing binding is ok."""
    x, q = names.x(), names.q()
    ch.exchange_declare(x, exchange_type="direct")
    ch.queue_declare(q)
    ch.queue_bind(q, x, "k")
    ch.confirm_delivery()
    ch.basic_publish(x, "k", b"before")
    ch.queue_unbind(q, x, "k")
    ch.queue_unbind(q, x, "never-bound")  # RabbitMQ: unbind of a missing binding is a no-op
    ch.basic_publish(x, "k", b"after")
    assert bodies_of(get_all(ch, q)) == [b"before"]


def test_cc_and_bcc_headers_route_copies_and_bcc_is_removed(conn, ch, names):
    """Sender-selected distribution: CC and BCC header keys are routed like the routing key;
    the BCC header is removed from every copy, CC is kept."""
    x = names.x()
    qa, qb, qc = names.q("a"), names.q("b"), names.q("c")
    ch.exchange_declare(x, exchange_type="direct")
    for q, key in ((qa, "ka"), (qb, "kb"), (qc, "kc")):
        ch.queue_declare(q)
        ch.queue_bind(q, x, key)
    ch.confirm_delivery()
    ch.basic_publish(x, "ka", b"m", pika.BasicProperties(headers={"CC": ["kb"], "BCC": ["kc", "ka"]}))
    for q in (qa, qb, qc):
        m, props, body = ch.basic_get(q, auto_ack=True)
        assert body == b"m", q
        assert m.routing_key == "ka"
        assert props.headers.get("CC") == ["kb"]
        assert "BCC" not in props.headers
        assert ch.basic_get(q, auto_ack=True)[0] is None, "one copy per queue"
