"""Consumer groups of partitioned queues (Warren): basic.consume with `x-consumer-group: <group>`
on a partitioned queue's logical name joins the group; the broker gives each partition to exactly
one member (balanced, moving as few as it can when members come and go) and bumps the group's
epoch on every assignment. A partition taken from a member returns that member's unacked
deliveries of it (redelivered, ahead of the rest) before anyone else gets it, and the old
member's late acks of them are ignored. `/api/consumer-groups/{vhost}/{queue}` shows members,
owners, lag and epoch."""

import threading
import time

import pika
import pytest

from amqp_helpers import channel_closed, wait_until
from conftest import q

pytestmark = pytest.mark.warren_only


def declare(ch, name, n):
    ch.queue_declare(name, durable=True, arguments={
        "x-partitions": n, "x-queue-type": "quorum", "x-partition-key": "header:k"})


def groups(api, name):
    base, s = api
    r = s.get(f"{base}/api/consumer-groups/%2F/{q(name)}")
    r.raise_for_status()
    return r.json()


def owners(api, name):
    got = groups(api, name)
    return [p["owner"] for p in got[0]["partitions"]] if got else []


def settled(api, name, members):
    """Every partition owned, by the given consumer tags only, shares within one."""
    own = owners(api, name)
    if not own or any(o is None for o in own) or set(own) != set(members):
        return False
    counts = [own.count(m) for m in members]
    return max(counts) - min(counts) <= 1


def publish(ch, name, keys, rounds, start=0):
    for n in range(start, start + rounds):
        for k in keys:
            ch.basic_publish("", name, f"{k}/{n}".encode(),
                             pika.BasicProperties(headers={"k": k}, delivery_mode=2))


def test_members_share_the_partitions_and_each_key_goes_to_one_member_in_order(connect, api, names):
    name = names.q("g1")
    pub = connect().channel()
    declare(pub, name, 4)
    conns = [connect() for _ in range(2)]
    chans, got = [], [[], []]
    for i, c in enumerate(conns):
        ch = c.channel()
        ch.basic_qos(prefetch_count=100)

        def on(ch_, m, _p, body, i=i):
            got[i].append(body.decode())
            ch_.basic_ack(m.delivery_tag)
        ch.basic_consume(name, on, consumer_tag=f"member-{i}",
                         arguments={"x-consumer-group": "workers"})
        chans.append(ch)
    for c in conns:
        c.process_data_events(time_limit=0.1)
    wait_until(conns[0], lambda: (conns[1].process_data_events(time_limit=0.05),
                                  settled(api, name, ["member-0", "member-1"]))[1])
    g = groups(api, name)[0]
    assert g["name"] == "workers" and g["epoch"] >= 1
    assert sorted(len(m["partitions"]) for m in g["members"]) == [2, 2]
    pub.confirm_delivery()
    keys = [f"key{i}" for i in range(20)]
    publish(pub, name, keys, 10)
    deadline = time.monotonic() + 10
    while len(got[0]) + len(got[1]) < 200 and time.monotonic() < deadline:
        for c in conns:
            c.process_data_events(time_limit=0.05)
    assert len(got[0]) + len(got[1]) == 200
    assert got[0] and got[1], "both members work"
    for k in keys:
        where = [i for i in (0, 1) if any(b.startswith(k + "/") for b in got[i])]
        assert len(where) == 1, f"{k} reached both members"
        seq = [int(b.split("/")[1]) for b in got[where[0]] if b.startswith(k + "/")]
        assert seq == list(range(10)), f"{k} out of order: {seq}"


def test_a_joining_member_takes_partitions_only_after_the_old_owner_gives_them_back(connect, api, names):
    """A holds every partition with unacked deliveries; B joins. The partitions B gets come
    from A: A's unacked deliveries of them return (redelivered) and go to B, A's late acks of
    them are ignored (its channel stays open), and nothing is lost."""
    name = names.q("g2")
    pub = connect().channel()
    declare(pub, name, 2)
    pub.confirm_delivery()
    publish(pub, name, [f"k{i}" for i in range(10)], 1)
    a_conn = connect()
    a = a_conn.channel()
    a.basic_qos(prefetch_count=50)
    held = []
    a.basic_consume(name, lambda ch_, m, p, b: held.append((m, b.decode())), consumer_tag="A",
                    arguments={"x-consumer-group": "g"})
    wait_until(a_conn, lambda: len(held) == 10)
    epoch_before = groups(api, name)[0]["epoch"]
    b_conn = connect()
    b = b_conn.channel()
    b.basic_qos(prefetch_count=50)
    got_b = []
    b.basic_consume(name, lambda ch_, m, p, body: got_b.append((m, body.decode())),
                    consumer_tag="B", arguments={"x-consumer-group": "g"})
    wait_until(b_conn, lambda: (a_conn.process_data_events(time_limit=0.02), len(got_b) > 0)[1])
    wait_until(b_conn, lambda: (a_conn.process_data_events(time_limit=0.02),
                                settled(api, name, ["A", "B"]))[1])
    assert groups(api, name)[0]["epoch"] > epoch_before
    assert all(m.redelivered for m, _ in got_b), "what B got first is A's returned deliveries"
    moved = {body for _, body in got_b}
    # A acks everything it holds, the moved ones too: the late acks are ignored, no 406.
    for m, _ in held:
        a.basic_ack(m.delivery_tag)
    a_conn.process_data_events(time_limit=0.2)
    assert a.is_open
    for m, _ in got_b:
        b.basic_ack(m.delivery_tag)
    b_conn.process_data_events(time_limit=0.2)
    kept = {body for _, body in held} - moved
    assert len(kept) + len(moved) == 10 and moved and kept
    assert pub.queue_declare(name, passive=True).method.message_count == 0


def test_a_leaving_member_hands_its_partitions_over(connect, api, names):
    name = names.q("g3")
    pub = connect().channel()
    declare(pub, name, 3)
    conns = [connect(), connect()]
    chans = []
    for i, c in enumerate(conns):
        ch = c.channel()
        ch.basic_consume(name, lambda *a: None, consumer_tag=f"m{i}", auto_ack=True,
                         arguments={"x-consumer-group": "g"})
        chans.append(ch)
    wait_until(conns[0], lambda: (conns[1].process_data_events(time_limit=0.02),
                                  settled(api, name, ["m0", "m1"]))[1])
    chans[0].basic_cancel("m0")
    wait_until(conns[1], lambda: settled(api, name, ["m1"]))
    conns[1].close()
    wait_until(conns[0], lambda: groups(api, name) == [])


def test_a_closed_connection_leaves_the_group(connect, api, names):
    name = names.q("g4")
    pub = connect().channel()
    declare(pub, name, 2)
    a, b = connect(), connect()
    a.channel().basic_consume(name, lambda *x: None, consumer_tag="a", auto_ack=True,
                              arguments={"x-consumer-group": "g"})
    b.channel().basic_consume(name, lambda *x: None, consumer_tag="b", auto_ack=True,
                              arguments={"x-consumer-group": "g"})
    wait_until(b, lambda: (a.process_data_events(time_limit=0.02), settled(api, name, ["a", "b"]))[1])
    a.close()
    wait_until(b, lambda: settled(api, name, ["b"]))


def test_group_arguments_are_checked(conn, names):
    plain = names.q("plain")
    conn.channel().queue_declare(plain)
    with channel_closed(406, "needs a partitioned queue"):
        conn.channel().basic_consume(plain, lambda *a: None,
                                     arguments={"x-consumer-group": "g"})
    name = names.q("g5")
    declare(conn.channel(), name, 2)
    with channel_closed(406, "invalid arg 'x-consumer-group'"):
        conn.channel().basic_consume(name, lambda *a: None, arguments={"x-consumer-group": ""})


def test_rebalancing_under_load_loses_nothing_and_keeps_key_order(connect, api, names):
    """Members join and leave while a publisher runs; every message is consumed, and per key
    the deliveries not flagged redelivered arrive in publish order."""
    name = names.q("load")
    pub_conn = connect()
    pub = pub_conn.channel()
    declare(pub, name, 6)
    pub.confirm_delivery()
    keys = [f"k{i}" for i in range(30)]
    lock = threading.Condition()
    seen = []  # (key, n, redelivered)
    stop = threading.Event()
    errors = []

    def member(tag, lifetime):
        try:
            c = connect()
            ch = c.channel()
            ch.basic_qos(prefetch_count=20)

            def on(ch_, m, _p, body):
                k, n = body.decode().split("/")
                with lock:
                    seen.append((k, int(n), m.redelivered))
                    lock.notify_all()
                ch_.basic_ack(m.delivery_tag)
            ch.basic_consume(name, on, consumer_tag=tag, arguments={"x-consumer-group": "g"})
            end = time.monotonic() + lifetime
            while time.monotonic() < end and not stop.is_set():
                c.process_data_events(time_limit=0.05)
            c.close()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    anchor = threading.Thread(target=member, args=("anchor", 3600))
    anchor.start()
    threads = []
    rounds = 40
    for r in range(rounds):
        publish(pub, name, keys, 1, start=r)
        if r % 5 == 0:
            t = threading.Thread(target=member, args=(f"m{r}", 0.6))
            t.start()
            threads.append(t)
        pub_conn.process_data_events(time_limit=0.05)
    for t in threads:
        t.join(timeout=30)
    with lock:
        lock.wait_for(lambda: len({(k, n) for k, n, _ in seen}) == len(keys) * rounds,
                      timeout=20)
    stop.set()
    anchor.join(timeout=30)
    assert not errors, errors
    with lock:
        got = list(seen)
    assert {(k, n) for k, n, _ in got} == {(k, n) for k in keys for n in range(rounds)}, "lost"
    for k in keys:
        fresh = [n for kk, n, red in got if kk == k and not red]
        assert fresh == sorted(fresh), f"{k}: {fresh}"


def test_prometheus_shows_members_epoch_and_lag(connect, api, names, prometheus_url):
    import requests
    name = names.q("prom")
    pub = connect().channel()
    declare(pub, name, 3)
    pub.confirm_delivery()
    publish(pub, name, [f"k{i}" for i in range(9)], 2)
    c = connect()
    c.channel().basic_consume(name, lambda *a: None, consumer_tag="only",
                              arguments={"x-consumer-group": "pg", "x-priority": 0})
    wait_until(c, lambda: settled(api, name, ["only"]))
    text = requests.get(prometheus_url + "/metrics", timeout=10).text
    labels = f'{{vhost="/",queue="{name}",group="pg"}}'
    assert f"warren_consumer_group_members{labels} 1" in text
    epoch = groups(api, name)[0]["epoch"]
    assert f"warren_consumer_group_epoch{labels} {epoch}" in text
    # The member has not acked (a prefetch of 0 takes them all): nothing is ready, no lag.
    assert f"warren_consumer_group_lag_messages{labels} 0" in text
    assert (f'warren_consumer_group_partition_lag_messages{{vhost="/",queue="{name}",group="pg",'
            'partition="2"} 0') in text
    c.close()
    text = requests.get(prometheus_url + "/metrics", timeout=10).text
    assert f"warren_consumer_group_members{labels}" not in text, "the group went with its member"
