"""Classic queues in a 3-node cluster (real nodes over TCP, pika): a classic queue lives on the
node it was declared through (its home, as in RabbitMQ 4) and every node serves it. A publish
through any node routes to it (confirmed after the home's commit, mandatory returns as on one
node); consume, get, ack, requeue, purge, delete and passive declare work through any node;
the home killed -9 gives RabbitMQ's 404 on the other nodes and cancels their consumers, and
nothing confirmed is lost once it restarts."""

import time
import urllib.parse
import uuid

import pika
import pytest

from cluster_harness import CLIENT_ERRORS, eventually, safe_close, wait_visible
from cluster_harness import cluster3, cluster_factory  # noqa: F401 (fixtures)


def name(prefix):
    return f"{prefix}.{uuid.uuid4().hex[:8]}"


def declare_classic(c, i, queue, deadline=30.0, **kw):
    """Declare classic `queue` through node i, retrying while the cluster elects."""
    end = time.monotonic() + deadline
    while True:
        conn = None
        try:
            conn = c.connect(i)
            conn.channel().queue_declare(queue, **kw)
            return
        except CLIENT_ERRORS:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)
        finally:
            safe_close(conn)


def publish(c, i, bodies, exchange="", routing_key="", persistent=True, mandatory=False):
    """Publish `bodies` through node i with confirms; returns the bodies returned unroutable."""
    conn = c.connect(i)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        returned = []
        props = pika.BasicProperties(delivery_mode=2 if persistent else 1)
        for b in bodies:
            try:
                ch.basic_publish(exchange, routing_key, b.encode(), props, mandatory=mandatory)
            except pika.exceptions.UnroutableError as e:
                returned += [m.body.decode() for m in e.messages]
        return returned
    finally:
        safe_close(conn)


def consume(c, i, queue, n, prefetch=10, ack=True, deadline=20.0):
    """Consume `n` messages of `queue` through node i: [(body, redelivered)]."""
    conn = c.connect(i)
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=prefetch)
        got = []

        def on(ch_, m, p, b):
            got.append((b.decode(), m.redelivered))
            if ack:
                ch_.basic_ack(m.delivery_tag)
        ch.basic_consume(queue, on)
        end = time.monotonic() + deadline
        while len(got) < n:
            assert time.monotonic() < end, f"{len(got)} of {n} consumed through node {i}"
            conn.process_data_events(time_limit=0.1)
        return got
    finally:
        safe_close(conn)


def declare_reply(c, i, queue, **kw):
    """queue.declare of `queue` through node i: (200, "") or the broker's (code, text)."""
    conn = c.connect(i)
    try:
        conn.channel().queue_declare(queue, **kw)
        return (200, "")
    except pika.exceptions.ChannelClosedByBroker as e:
        return (e.reply_code, e.reply_text)
    finally:
        safe_close(conn)


def depth(c, i, queue):
    conn = c.connect(i)
    try:
        return conn.channel().queue_declare(queue, passive=True).method.message_count
    finally:
        safe_close(conn)


@pytest.mark.timeout(120)
def test_a_classic_queue_is_used_through_every_node(cluster3):
    c = cluster3
    q, ex = name("classic"), name("classic.ex")
    declare_classic(c, 0, q, durable=True)
    conn = c.connect(0)
    ch = conn.channel()
    ch.exchange_declare(ex, "direct", durable=True)
    ch.queue_bind(q, ex, routing_key="k")
    safe_close(conn)
    wait_visible(c, q, [1, 2])

    # A mandatory publish through n2 to the bound exchange is routed to the queue on n1,
    # and confirmed; one with an unbound key comes back.
    bodies = [f"m{k}" for k in range(50)]
    assert eventually(lambda: publish(c, 1, ["probe"], ex, "k", mandatory=True),
                      lambda r: r == [], what="the binding on n2") == []
    assert publish(c, 1, bodies, ex, "k", mandatory=True) == []
    assert publish(c, 1, ["lost"], ex, "nokey", mandatory=True) == ["lost"]
    assert depth(c, 0, q) == 51
    # Another node's count is the home's last report (at most a second old).
    assert eventually(lambda: depth(c, 2, q), lambda d: d == 51, what="depth on n3") == 51

    # basic.get through n3, then the rest consumed through n3 with prefetch and acked.
    conn = c.connect(2)
    ch = conn.channel()
    m, _, body = ch.basic_get(q, auto_ack=False)
    assert body == b"probe" and not m.redelivered
    ch.basic_ack(m.delivery_tag)
    safe_close(conn)
    got = consume(c, 2, q, 50, prefetch=5)
    assert [b for b, _ in got] == bodies
    assert eventually(lambda: depth(c, 0, q), lambda d: d == 0, what="drained") == 0

    # The home's management record says where it lives; every node lists it with that node.
    for i in range(3):
        info = eventually(lambda: c.queue_info(i, q), lambda v: v is not None,
                          what=f"{q} on node {i}")
        assert info["node"] == c.nodes[0].name or str(info["node"]).startswith(
            c.nodes[0].name), info
        assert info["type"] == "classic"


@pytest.mark.timeout(120)
def test_requeue_order_purge_and_delete_through_another_node(cluster3):
    c = cluster3
    q = name("classic.rq")
    declare_classic(c, 1, q, durable=True)
    wait_visible(c, q, [0, 2])
    assert publish(c, 0, [f"r{k}" for k in range(5)], routing_key=q) == []

    # Five delivered through n3 with no acks, then rejected with requeue: they come back in
    # their order, marked redelivered.
    conn = c.connect(2)
    ch = conn.channel()
    ch.basic_qos(prefetch_count=5)
    tags = []
    ch.basic_consume(q, lambda ch_, m, p, b: tags.append(m.delivery_tag))
    end = time.monotonic() + 20
    while len(tags) < 5:
        assert time.monotonic() < end
        conn.process_data_events(time_limit=0.1)
    ch.basic_nack(tags[-1], multiple=True, requeue=True)
    safe_close(conn)
    got = consume(c, 0, q, 5)
    assert [b for b, _ in got] == [f"r{k}" for k in range(5)]
    assert all(r for _, r in got), got

    assert publish(c, 2, ["p1", "p2"], routing_key=q) == []
    # purge-ok's count through another node is the home's last report.
    eventually(lambda: depth(c, 0, q), lambda d: d == 2, what="depth 2 on n1")
    conn = c.connect(0)
    ch = conn.channel()
    assert ch.queue_purge(q).method.message_count == 2
    assert ch.queue_delete(q).method.message_count == 0
    safe_close(conn)

    for i in range(3):
        code = eventually(lambda: declare_reply(c, i, q, passive=True)[0], lambda v: v != 200,
                          what=f"{q} deleted on node {i}")
        assert code == 404


@pytest.mark.timeout(60)
def test_another_nodes_exclusive_queue_is_locked(cluster3):
    c = cluster3
    q = name("classic.excl")
    owner = c.connect(0)
    owner.channel().queue_declare(q, exclusive=True)
    try:
        assert eventually(lambda: declare_reply(c, 1, q, passive=True)[0],
                          lambda code: code == 405, what="405 on n2") == 405
    finally:
        safe_close(owner)

    # The owner's connection closed: the queue goes everywhere.
    assert eventually(lambda: declare_reply(c, 2, q, passive=True)[0], lambda v: v == 404,
                      what="deleted on n3") == 404


@pytest.mark.timeout(180)
def test_home_killed_gives_404_cancels_consumers_and_keeps_confirmed_messages(cluster3):
    c = cluster3
    q = name("classic.home")
    declare_classic(c, 0, q, durable=True)
    wait_visible(c, q, [1, 2])
    bodies = [f"d{k}" for k in range(200)]
    assert publish(c, 1, bodies, routing_key=q) == []

    # A consumer through n3, told of cancellation.
    conn = c.connect(2)
    ch = conn.channel()
    ch.basic_qos(prefetch_count=1)
    cancelled = []
    got = []
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame))
    ch.basic_consume(q, lambda ch_, m, p, b: got.append(b))
    end = time.monotonic() + 20
    while not got:
        assert time.monotonic() < end
        conn.process_data_events(time_limit=0.1)

    c.kill9(0)
    end = time.monotonic() + 30
    while not cancelled:
        assert time.monotonic() < end, "the consumer through n3 was not cancelled"
        conn.process_data_events(time_limit=0.1)
    safe_close(conn)

    # RabbitMQ's text for a durable queue whose node is down, on declare and on get.
    def refused(i, op):
        conn = c.connect(i)
        try:
            ch = conn.channel()
            if op == "declare":
                ch.queue_declare(q, durable=True)
            else:
                ch.basic_get(q)
            return None
        except pika.exceptions.ChannelClosedByBroker as e:
            return (e.reply_code, e.reply_text)
        finally:
            safe_close(conn)
    home = c.nodes[0].name
    for i, op in [(1, "declare"), (2, "get")]:
        code, text = eventually(lambda: refused(i, op), lambda r: r is not None,
                                what=f"{op} refused on node {i}")
        assert code == 404, text
        assert text.startswith(f"NOT_FOUND - home node '{home}") and text.endswith(
            f"of durable queue '{q}' in vhost '/' is down or inaccessible"), text

    # Back: every confirmed message is there (the one delivered unacked redelivered), and
    # the re-declare during the outage made no second queue.
    c.restart(0)
    wait_visible(c, q, [0, 1, 2], deadline=30)
    assert eventually(lambda: depth(c, 1, q), lambda d: d == 200, deadline=30,
                      what="all 200 back") == 200
    got = consume(c, 1, q, 200, prefetch=50)
    assert sorted(b for b, _ in got) == sorted(bodies)
    for i in range(3):
        assert eventually(lambda: c.queue_info(i, q), lambda v: v is not None)["node"] \
            .startswith(home)


@pytest.mark.timeout(120)
def test_dead_letters_cross_nodes(cluster3):
    c = cluster3
    dlq, src = name("classic.dlq"), name("classic.src")
    declare_classic(c, 2, dlq, durable=True)
    wait_visible(c, dlq, [0, 1])
    declare_classic(c, 0, src, durable=True, arguments={
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq,
        "x-message-ttl": 50})
    wait_visible(c, src, [1, 2])
    assert publish(c, 1, ["x1", "x2", "x3"], routing_key=src) == []
    assert eventually(lambda: depth(c, 1, dlq), lambda d: d == 3, deadline=20,
                      what="dead-lettered on n3") == 3
    conn = c.connect(1)
    ch = conn.channel()
    m, p, body = ch.basic_get(dlq, auto_ack=True)
    safe_close(conn)
    assert body == b"x1"
    death = p.headers["x-death"][0]
    assert death["queue"] == src and death["reason"] == "expired", death


@pytest.mark.timeout(180)
def test_a_partition_between_home_and_client_node_heals(cluster3):
    """n1 (the home) cut off from n2 and n3: through n2 the queue answers RabbitMQ's 404 and
    its consumer is cancelled; once healed it is used through n2 again, and every message
    confirmed before the cut is there."""
    c = cluster3
    if c.proxy is None:
        pytest.skip("needs the harness's network proxy")
    q = name("classic.part")
    declare_classic(c, 0, q, durable=True)
    wait_visible(c, q, [1, 2])
    bodies = [f"p{k}" for k in range(30)]
    assert publish(c, 1, bodies, routing_key=q) == []

    conn = c.connect(1)
    ch = conn.channel()
    cancelled = []
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame))
    ch.basic_qos(prefetch_count=1)
    ch.basic_consume(q, lambda ch_, m, p, b: None)
    c.isolate(0)
    end = time.monotonic() + 30
    while not cancelled:
        assert time.monotonic() < end, "the consumer through n2 was not cancelled"
        conn.process_data_events(time_limit=0.1)
    safe_close(conn)

    def code():
        return declare_reply(c, 1, q, passive=True)[0]
    assert eventually(code, lambda v: v == 404, what="404 through n2") == 404

    c.heal_network()
    assert eventually(code, lambda v: v == 200, deadline=30, what="back through n2") == 200
    # Every confirmed message is there. The one the cancelled consumer held may come twice,
    # flagged redelivered: the home returned it when it lost n2, and n2's own return of it,
    # retried until the home answered, may arrive after it was delivered again.
    conn = c.connect(1)
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=10)
        got = []

        def on(ch_, m, p, b):
            got.append((b.decode(), m.redelivered))
            ch_.basic_ack(m.delivery_tag)
        ch.basic_consume(q, on)
        end = time.monotonic() + 20
        while {b for b, _ in got} != set(bodies):
            assert time.monotonic() < end, f"{len(got)} deliveries, missing {set(bodies) - {b for b, _ in got}}"
            conn.process_data_events(time_limit=0.1)
        conn.process_data_events(time_limit=0.5)
    finally:
        safe_close(conn)
    seen = set()
    for b, redelivered in got:
        assert b in bodies, b
        assert b not in seen or redelivered, f"{b} delivered twice without redelivered: {got}"
        seen.add(b)


@pytest.mark.timeout(180)
def test_queues_that_do_not_outlive_their_node_go_with_it(cluster3):
    """n1 killed: its exclusive and non-durable queues are deleted cluster-wide (as RabbitMQ
    does), so their names can be declared again through another node; its durable queue
    stays (404 while n1 is down)."""
    c = cluster3
    excl, transient, durable = name("classic.x"), name("classic.t"), name("classic.d")
    owner = c.connect(0)
    owner.channel().queue_declare(excl, exclusive=True)
    declare_classic(c, 0, transient, durable=False)
    declare_classic(c, 0, durable, durable=True)
    wait_visible(c, transient, [1, 2])
    wait_visible(c, durable, [1, 2])
    c.kill9(0)

    def declared(q, **kw):
        return declare_reply(c, 1, q, **kw)
    for q in (excl, transient):
        # First the home-down 404, then the queue's record is deleted: RabbitMQ's plain 404.
        code, text = eventually(lambda: declared(q, passive=True),
                                lambda r: r[0] == 404 and "no queue" in r[1], deadline=30,
                                what=f"{q} gone")
        assert text == f"NOT_FOUND - no queue '{q}' in vhost '/'", text
        # Its name is free: declared anew through n2 (homed there now).
        assert declared(q, durable=False) == (200, "")
    code, text = declared(durable, durable=True)
    assert code == 404 and "is down or inaccessible" in text, text
    c.restart(0)
    wait_visible(c, durable, [0, 1, 2], deadline=30)
    for q in (excl, transient):
        info = eventually(lambda: c.queue_info(2, q), lambda v: v is not None)
        assert str(info["node"]).startswith(c.nodes[1].name), info


def test_a_publish_to_a_queue_whose_home_is_down_is_nacked(cluster3):
    """With n1 (the queue's home) killed and known down, a confirmed publish through n2 routed
    to that queue is nacked (basic.nack), not confirmed and not left waiting; routed to it and
    to a queue on a live node as well, it is nacked too (RabbitMQ's channel nacks a message
    when a queue it went to is down) while the live queue has it."""
    c = cluster3
    down_q, up_q, ex = name("classic.down"), name("classic.up"), name("fan")
    declare_classic(c, 0, down_q, durable=True)
    declare_classic(c, 2, up_q, durable=True)
    conn = c.connect(1)
    try:
        ch = conn.channel()
        ch.exchange_declare(ex, "fanout", durable=True)
        ch.queue_bind(down_q, ex)
        ch.queue_bind(up_q, ex)
    finally:
        safe_close(conn)
    wait_visible(c, down_q, [1, 2])
    c.kill9(0)
    # n2 knows n1 is down once a declare there gets the home-down 404.
    eventually(lambda: declare_reply(c, 1, down_q, durable=True), lambda r: r[0] == 404,
               deadline=30, what="n2 seeing n1 down")

    conn = c.connect(1)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        props = pika.BasicProperties(delivery_mode=2)
        with pytest.raises(pika.exceptions.NackError):
            ch.basic_publish("", down_q, b"only-there", props)
        # Routed to the live queue as well: still nacked, as RabbitMQ does.
        with pytest.raises(pika.exceptions.NackError):
            ch.basic_publish(ex, "", b"both", props)
    finally:
        safe_close(conn)
    assert eventually(lambda: depth(c, 2, up_q), lambda d: d == 1, deadline=20,
                      what="the live queue holding the fanout's message") == 1


def on_node(c, i, v):
    """Whether listing entry `v` names node i as its node."""
    return str(v.get("node", "")).startswith(c.nodes[i].name)


@pytest.mark.timeout(120)
def test_connections_and_channels_are_listed_from_every_node(cluster3):
    """/api/connections, /api/channels and /api/consumers list the whole cluster through any
    node, each entry with its node, as RabbitMQ's API does (a queue's view lists its consumers
    on every node); one connection is shown, its channels listed and it is closed through a
    node it is not on."""
    c = cluster3
    tag = uuid.uuid4().hex[:8]
    q = name("listed")
    declare_classic(c, 2, q)
    wait_visible(c, q, [0, 1])
    a = c.connect(0, client_properties={"connection_name": f"a.{tag}"})
    a.channel().basic_consume(q, lambda *_: None, consumer_tag=f"ca.{tag}")
    a.channel()
    b = c.connect(1, client_properties={"connection_name": f"b.{tag}"})
    b.channel().basic_consume(q, lambda *_: None, consumer_tag=f"cb.{tag}")
    try:
        def mine(i, path):
            status, items = c.mgmt_get(i, path)
            assert status == 200, (status, items)
            return [v for v in items if tag in json_name(v)]

        def json_name(v):
            return str(v.get("user_provided_name") or
                       v.get("connection_details", {}).get("user_provided_name") or "")

        for i in range(3):
            conns = mine(i, "/api/connections")
            assert sorted(v["user_provided_name"] for v in conns) == [f"a.{tag}", f"b.{tag}"]
            by = {v["user_provided_name"]: v for v in conns}
            assert on_node(c, 0, by[f"a.{tag}"]) and on_node(c, 1, by[f"b.{tag}"]), conns
            chans = mine(i, "/api/channels")
            assert sorted((json_name(v), v["number"]) for v in chans) == [
                (f"a.{tag}", 1), (f"a.{tag}", 2), (f"b.{tag}", 1)], chans
            assert all(on_node(c, 0 if json_name(v) == f"a.{tag}" else 1, v) for v in chans)
            assert len(mine(i, "/api/vhosts/%2F/connections")) == 2
            # The overview's totals are the cluster's, as the listings are.
            status, overview = c.mgmt_get(i, "/api/overview")
            assert status == 200, overview
            status, everyone = c.mgmt_get(i, "/api/connections")
            totals = overview["object_totals"]
            assert totals["connections"] == len(everyone) >= 2, (totals, everyone)
            assert totals["channels"] == len(c.mgmt_get(i, "/api/channels")[1]) >= 3, totals
            # Consumers too: each on its connection's node; the queue (homed on n3) lists both.
            for path in ("/api/consumers", "/api/consumers/%2F"):
                status, consumers = c.mgmt_get(i, path)
                assert status == 200, consumers
                got = {k["consumer_tag"]: k for k in consumers if tag in k["consumer_tag"]}
                assert sorted(got) == [f"ca.{tag}", f"cb.{tag}"], consumers
                assert on_node(c, 0, got[f"ca.{tag}"]["channel_details"]), got
                assert on_node(c, 1, got[f"cb.{tag}"]["channel_details"]), got
            # The view asks for them once the queue counts consumers (through another node
            # than the home, from the home's report: up to a second old).
            eventually(lambda: sorted(k["consumer_tag"] for k in
                                      c.mgmt_get(i, f"/api/queues/%2F/{q}")[1]["consumer_details"]),
                       lambda tags: tags == [f"ca.{tag}", f"cb.{tag}"],
                       what=f"both consumers in the queue's view on node {i}")

        # One connection through a node it is not on: shown, its channels, one channel.
        a_name = next(v["name"] for v in mine(0, "/api/connections")
                      if v["user_provided_name"] == f"a.{tag}")
        quoted = urllib.parse.quote(a_name, safe="")
        status, info = c.mgmt_get(2, f"/api/connections/{quoted}")
        assert status == 200 and on_node(c, 0, info), info
        status, chans = c.mgmt_get(2, f"/api/connections/{quoted}/channels")
        assert status == 200 and sorted(v["number"] for v in chans) == [1, 2], chans
        status, chan = c.mgmt_get(2, "/api/channels/" + urllib.parse.quote(f"{a_name} (2)", safe=""))
        assert status == 200 and chan["number"] == 2 and on_node(c, 0, chan), chan
        assert c.mgmt_get(2, "/api/connections/" + urllib.parse.quote("no such", safe=""))[0] == 404

        # Closed through n3: the client on n1 hears 320 CONNECTION_FORCED with the reason.
        status, _ = c.mgmt_request(2, "DELETE", f"/api/connections/{quoted}")
        assert status == 204
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
            end = time.monotonic() + 10
            while time.monotonic() < end:
                a.process_data_events(time_limit=0.1)
        assert closed.value.reply_code == 320
        assert "Closed via management plugin" in closed.value.reply_text
        eventually(lambda: [json_name(v) for v in mine(1, "/api/connections")],
                   lambda names: names == [f"b.{tag}"], what="the closed connection gone")
    finally:
        safe_close(a)
        safe_close(b)


@pytest.mark.timeout(120)
def test_direct_reply_to_across_nodes(cluster3):
    """An RPC requester on n1 (amq.rabbitmq.reply-to) and its server on n3: the requests go
    through a classic queue homed on n2, the replies, published through n3 to the reply name,
    reach the requester on n1 in order; a reply name no node issued is unroutable."""
    c = cluster3
    q = name("rpc")
    declare_classic(c, 1, q)
    wait_visible(c, q, [0, 2])
    requester = c.connect(0)
    server = c.connect(2)
    try:
        rch = requester.channel()
        replies = []
        rch.basic_consume("amq.rabbitmq.reply-to",
                          lambda ch_, m, p, b: replies.append((b.decode(), p.correlation_id)),
                          auto_ack=True)
        for k in range(20):
            rch.basic_publish("", q, f"req{k}".encode(), pika.BasicProperties(
                reply_to="amq.rabbitmq.reply-to", correlation_id=str(k)))

        sch = server.channel()
        sch.confirm_delivery()
        reply_names = set()
        served = []
        for _ in range(20):
            m, props, body = eventually(lambda: sch.basic_get(q, auto_ack=True),
                                        lambda r: r[0] is not None, what="a request on n3")
            reply_names.add(props.reply_to)
            # Mandatory: an unroutable reply would raise UnroutableError here.
            sch.basic_publish("", props.reply_to, b"re:" + body,
                              pika.BasicProperties(correlation_id=props.correlation_id),
                              mandatory=True)
            served.append(body)
        assert len(reply_names) == 1, reply_names
        (reply_name,) = reply_names
        assert reply_name.startswith("amq.rabbitmq.reply-to."), reply_name

        end = time.monotonic() + 10
        while len(replies) < 20 and time.monotonic() < end:
            requester.process_data_events(time_limit=0.1)
        assert replies == [(f"re:req{k}", str(k)) for k in range(20)], replies

        # A name of the same form that no node issued: returned.
        bogus = reply_name.rsplit(".", 1)[0] + ".999999"
        with pytest.raises(pika.exceptions.UnroutableError):
            sch.basic_publish("", bogus, b"nobody", mandatory=True)
    finally:
        safe_close(requester)
        safe_close(server)


def get_all(c, i, queue, limit=100):
    """basic.get (auto-ack) of `queue` through node i until it answers empty: the bodies."""
    conn = c.connect(i)
    try:
        ch = conn.channel()
        out = []
        for _ in range(limit):
            m, _, body = ch.basic_get(queue, auto_ack=True)
            if m is None:
                break
            out.append(body.decode())
        return out
    finally:
        safe_close(conn)


@pytest.mark.timeout(120)
def test_alternate_exchanges_and_policies_work_through_every_node(cluster3):
    """An exchange's alternate exchange declared through n1 catches, through n2, what its
    bindings do not route, into a queue homed on n3; a policy made through n3 (max-length)
    bounds a queue homed on n1 that is published to through n2."""
    c = cluster3
    main, ae = name("main.ex"), name("ae.ex")
    caught, bound = name("ae.caught"), name("ae.bound")
    conn = c.connect(0)
    ch = conn.channel()
    ch.exchange_declare(ae, "fanout", durable=True)
    ch.exchange_declare(main, "direct", durable=True, arguments={"alternate-exchange": ae})
    safe_close(conn)
    declare_classic(c, 2, caught, durable=True)
    declare_classic(c, 0, bound, durable=True)
    conn = c.connect(2)
    ch = conn.channel()
    ch.queue_bind(caught, ae)
    ch.queue_bind(bound, main, routing_key="k")
    safe_close(conn)
    wait_visible(c, caught, [0, 1])
    wait_visible(c, bound, [1, 2])

    # Mandatory publishes through n2: none comes back, the unbound key lands on n3's queue.
    eventually(lambda: publish(c, 1, ["probe"], main, "k", mandatory=True),
               lambda r: r == [], what="the binding on n2")
    assert publish(c, 1, ["a1", "a2"], main, "nowhere", mandatory=True) == []
    assert publish(c, 1, ["b1"], main, "k", mandatory=True) == []
    assert get_all(c, 0, caught) == ["a1", "a2"]
    assert get_all(c, 1, bound) == ["probe", "b1"]

    prefix = name("pol").replace(".", "_")
    limited = f"{prefix}.q"
    status, _ = c.mgmt_request(2, "PUT", f"/api/policies/%2F/{prefix}", {
        "pattern": f"^{prefix}\\.", "definition": {"max-length": 2},
        "apply-to": "queues"}, timeout=30)
    assert status in (201, 204), status
    declare_classic(c, 0, limited, durable=True)
    wait_visible(c, limited, [1])
    # The home applies the policy once the change reached it: a queue over its bound drops
    # its head, whichever node the publisher used.
    eventually(lambda: (publish(c, 1, ["p1", "p2", "p3"], routing_key=limited),
                        depth(c, 0, limited))[1],
               lambda d: d == 2, what="max-length 2 on n1")
    assert publish(c, 1, ["x1", "x2", "x3"], routing_key=limited) == []
    assert get_all(c, 2, limited) == ["x2", "x3"]
    info = eventually(lambda: c.queue_info(1, limited), lambda v: v and v.get("policy"),
                      what="policy named on n2")
    assert info["policy"] == prefix, info


@pytest.mark.timeout(120)
def test_delays_ttls_and_server_named_queues_work_through_every_node(cluster3):
    """A delayed-message exchange used through n2 delivers to a queue on n3 only after the
    delay; a message's own TTL expires it in a queue on n1 published through n2; a
    server-named queue declared through n2 is reachable through n1 and n3."""
    c = cluster3
    delayed, target = name("delay.ex"), name("delay.q")
    conn = c.connect(0)
    conn.channel().exchange_declare(delayed, "x-delayed-message", durable=True,
                                    arguments={"x-delayed-type": "direct"})
    safe_close(conn)
    declare_classic(c, 2, target, durable=True)
    conn = c.connect(2)
    conn.channel().queue_bind(target, delayed, routing_key="k")
    safe_close(conn)
    wait_visible(c, target, [0, 1])

    conn = c.connect(1)
    ch = conn.channel()
    ch.confirm_delivery()
    eventually(lambda: ch.exchange_declare(delayed, passive=True), lambda _: True,
               what="the delayed exchange on n2")
    sent = time.monotonic()
    ch.basic_publish(delayed, "k", b"later", pika.BasicProperties(
        delivery_mode=2, headers={"x-delay": 1500}))
    ch.basic_publish(delayed, "k", b"now", pika.BasicProperties(delivery_mode=2))
    safe_close(conn)
    assert eventually(lambda: get_all(c, 0, target), lambda got: got != [],
                      what="the undelayed message") == ["now"]
    got = eventually(lambda: get_all(c, 0, target), lambda got: got != [],
                     what="the delayed message")
    assert got == ["later"] and time.monotonic() - sent >= 1.5

    ttlq = name("ttl.q")
    declare_classic(c, 0, ttlq, durable=True)
    wait_visible(c, ttlq, [1, 2])
    conn = c.connect(1)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("", ttlq, b"short", pika.BasicProperties(delivery_mode=2,
                                                             expiration="200"))
    ch.basic_publish("", ttlq, b"long", pika.BasicProperties(delivery_mode=2))
    safe_close(conn)
    eventually(lambda: depth(c, 0, ttlq), lambda d: d == 1, what="the short one expired")
    assert get_all(c, 2, ttlq) == ["long"]

    owner = c.connect(1)
    try:
        och = owner.channel()
        gen = och.queue_declare("", exclusive=True).method.queue
        assert gen.startswith("amq.gen-"), gen
        plain = och.queue_declare("", durable=True).method.queue
        assert plain.startswith("amq.gen-") and plain != gen
        wait_visible(c, plain, [0, 2])
        assert eventually(lambda: declare_reply(c, 0, gen, passive=True)[0],
                          lambda code: code == 405, what="exclusive on n1") == 405
        assert publish(c, 0, ["to-gen"], routing_key=gen, mandatory=True) == []
        assert publish(c, 2, ["to-plain"], routing_key=plain, mandatory=True) == []
        m, _, body = och.basic_get(gen, auto_ack=True)
        assert body == b"to-gen"
        assert get_all(c, 0, plain) == ["to-plain"]
    finally:
        safe_close(owner)
