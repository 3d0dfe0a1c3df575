"""Stream consumer groups (Warren): several groups read one partitioned stream independently
(seed 001's indexer, loader and notifier on "orders"). Each group's position in each partition
is kept by the stream under the group's name: a member assigned a partition resumes where the
group was (`x-stream-offset` only says where a group with no position yet starts), after a
rebalance, a reconnect or a broker restart."""

import pika
import pytest

from amqp_helpers import wait_until

pytestmark = pytest.mark.warren_only

KEYS = [f"cust{i}" for i in range(12)]


def declare(ch, name, n=3):
    ch.queue_declare(name, durable=True, arguments={
        "x-partitions": n, "x-queue-type": "stream", "x-partition-key": "header:k"})


def publish(ch, name, rounds, start=0):
    ch.confirm_delivery()
    for n in range(start, start + rounds):
        for k in KEYS:
            ch.basic_publish("", name, f"{k}/{n}".encode(),
                             pika.BasicProperties(headers={"k": k}, delivery_mode=2))


class Member:
    """One group member on its own connection, recording what it reads (and acking unless
    told to hold)."""

    def __init__(self, connection, name, group, tag, ack=True, offset="first"):
        self.conn = connection
        self.ch = connection.channel()
        self.ch.basic_qos(prefetch_count=500)
        self.got, self.held, self.ack = [], [], ack
        self.ch.basic_consume(name, self.on, consumer_tag=tag, arguments={
            "x-consumer-group": group, "x-stream-offset": offset})

    def on(self, ch, m, _p, body):
        self.got.append(body.decode())
        if self.ack:
            ch.basic_ack(m.delivery_tag)
        else:
            self.held.append(m.delivery_tag)

    def pump(self):
        self.conn.process_data_events(time_limit=0.02)


def pump_until(members, predicate):
    wait_until(members[0].conn, lambda: ([m.pump() for m in members[1:]], predicate())[1],
               timeout=10)


def in_order_per_key(bodies):
    for k in KEYS:
        seq = [int(b.split("/")[1]) for b in bodies if b.split("/")[0] == k]
        assert seq == sorted(seq), f"{k}: {seq}"


def assigned(api, name, group, members):
    base, s = api
    for g in s.get(f"{base}/api/consumer-groups/%2F/{name}").json():
        if g["name"] == group:
            return sorted(m["consumer_tag"] for m in g["members"] if m["partitions"]) == members
    return False


def test_groups_read_the_stream_independently(connect, api, names):
    """Members join first (no rebalance while reading): each group reads every message once,
    the loader group's two members split the keys, each key in order."""
    name = names.q("orders")
    pub = connect().channel()
    declare(pub, name)
    indexer = Member(connect(), name, "indexer", "i1")
    loaders = [Member(connect(), name, "loader", f"l{i}") for i in range(2)]
    everyone = [indexer, *loaders]
    pump_until(everyone, lambda: assigned(api, name, "loader", ["l0", "l1"])
               and assigned(api, name, "indexer", ["i1"]))
    publish(pub, name, 3)
    total = 3 * len(KEYS)
    pump_until(everyone, lambda: len(indexer.got) == total
               and sum(len(m.got) for m in loaders) == total)
    assert sorted(indexer.got) == sorted(f"{k}/{n}" for k in KEYS for n in range(3))
    assert sorted(loaders[0].got + loaders[1].got) == sorted(indexer.got)
    in_order_per_key(indexer.got)
    for m in loaders:
        in_order_per_key(m.got)
    for k in KEYS:
        assert sum(any(b.startswith(k + "/") for b in m.got) for m in loaders) == 1, k


def test_a_new_member_resumes_where_the_group_was(connect, names):
    name = names.q("resume")
    pub = connect().channel()
    declare(pub, name)
    publish(pub, name, 2)
    first = Member(connect(), name, "notifier", "n1")
    pump_until([first], lambda: len(first.got) == 2 * len(KEYS))
    first.ch.basic_cancel("n1")
    first.conn.close()
    publish(pub, name, 1, start=2)
    second = Member(connect(), name, "notifier", "n2")
    pump_until([second], lambda: len(second.got) == len(KEYS))
    assert sorted(second.got) == sorted(f"{k}/2" for k in KEYS), "only what the group had not read"


def test_a_rebalanced_partition_is_read_again_from_the_groups_offset(connect, names):
    """A member holds unacked deliveries; a second member joins and takes partitions from it:
    it reads them from the group's offset (the first unacked), so nothing is lost."""
    name = names.q("rebalance")
    pub = connect().channel()
    declare(pub, name, 2)
    publish(pub, name, 2)
    a = Member(connect(), name, "g", "a", ack=False)
    pump_until([a], lambda: len(a.got) == 2 * len(KEYS))
    b = Member(connect(), name, "g", "b")
    pump_until([a, b], lambda: len(b.got) > 0)
    moved = set(b.got)
    pump_until([a, b], lambda: len(set(b.got)) == len(moved) and len(b.got) >= 1)
    assert moved <= set(a.got), "b re-reads what a held"
    keys_b = {x.split("/")[0] for x in moved}
    for k in keys_b:
        assert {f"{k}/0", f"{k}/1"} <= moved, f"{k} not fully re-read"
    in_order_per_key(b.got)


def test_group_offsets_survive_a_restart(tmp_path):
    from conftest import warren_process
    data = tmp_path / "data"
    data.mkdir()
    with warren_process(data_dir=data) as w:
        c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", w["port"]))
        pub = c.channel()
        declare(pub, "events")
        publish(pub, "events", 2)
        m = Member(pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", w["port"])),
                   "events", "audit", "x")
        pump_until([m], lambda: len(m.got) == 2 * len(KEYS))
        m.conn.close()
        c.close()
    with warren_process(data_dir=data) as w:
        c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", w["port"]))
        publish(c.channel(), "events", 1, start=2)
        m = Member(pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", w["port"])),
                   "events", "audit", "y")
        pump_until([m], lambda: len(m.got) == len(KEYS))
        assert sorted(m.got) == sorted(f"{k}/2" for k in KEYS)
        c.close()
