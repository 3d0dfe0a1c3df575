"""Clustering: quorum queues replicated across several real `warren server` processes.

Every test starts its own cluster (cluster_harness.Cluster: 3 or 5 nodes on loopback, each with
its own data dir and log) and talks to it with real pika clients over TCP. Faults are real
process faults (kill -9 of one node or of all, SIGSTOP/SIGCONT, restarts on the same data dir)
and network partitions: the traffic between nodes goes through the harness's NetProxy, which
cuts links (resetting them; refusing or black-holing new ones); clients reach the nodes
directly. On failure the harness prints each node's log tail and keeps the directory.

The last two tests are the Jepsen-style total-queue checker (see cluster_harness), under
WARREN_CLUSTER_FAULTS (default kill9,pause; any of kill9, pause, term, partition, killall,
membership, transfer) and under WARREN_CLUSTER_SEVERE_FAULTS (default partition,killall, plus
membership and transfer when the binary has the members endpoint; each kind applied at least
once). Each
lasts WARREN_CLUSTER_CHECK_SECONDS (default 30), repeated WARREN_CLUSTER_CHECK_RUNS times
(default 1) on a fresh cluster each, with WARREN_CLUSTER_CHECK_SEED, WARREN_CLUSTER_CHECK_NODES
(3) and WARREN_CLUSTER_PARTITION_MODE (reset, blackhole or mixed: the default). After the
drain every replica must report the same applied index and digest (when the binary reports
`raft` for a queue). scripts/cluster_soak.py runs the checker for longer.

The module is skipped while the binary has no clustering (`warren server --help` lists no
--peers) and against an external broker (WARREN_TEST_AMQP_URL).
"""

import collections
import os
import socket
import threading
import time
import uuid

import pika
import pytest

from cluster_harness import (CLIENT_ERRORS, eventually, Consumer, History, Publisher, Watchdog,
                             change_member, check_env, check_replicas, cluster_supported,
                             declare_quorum, drain_until, env_number, fault_kinds_env, log,
                             membership_supported, partition_mode_env, publish_with_retry,
                             queue_depth, run_total_queue_check, safe_close,
                             summarize, sweep, wait_members, wait_visible)

if os.environ.get("WARREN_TEST_AMQP_URL"):
    pytest.skip("cluster tests start their own Warren nodes", allow_module_level=True)
_SUPPORTED, _WHY = cluster_supported()
if not _SUPPORTED:
    pytest.skip(_WHY, allow_module_level=True)

from cluster_harness import cluster3, cluster5, cluster_factory  # noqa: E402,F401 (fixtures)
import wire  # noqa: E402

# A new leader should serve within ~10 s of losing the old one; deadlines are generous and
# every wait polls for the event.
LEADER_DEADLINE = 30.0
PAUSE_BEYOND_ELECTION_S = 5.0
# A partition is held at least this long: beyond the election timeout (1.5-3 s) and the
# leader's DOWN_AFTER (5 s), so the cut-off node's consumers are given up for lost.
PARTITION_S = 6.0
CHECK_SECONDS, CHECK_RUNS, CHECK_SEED, CHECK_FAULTS = check_env()
CHECK_NODES = env_number("WARREN_CLUSTER_CHECK_NODES", 3, int)
# The second checker test's faults (membership is added when the binary has the endpoint,
# unless this is set) and how partitions treat new connections.
SEVERE_FAULTS = os.environ.get("WARREN_CLUSTER_SEVERE_FAULTS")
PARTITION_MODE = partition_mode_env()


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def new_quorum_queue(cluster, via=0):
    """Declare a fresh quorum queue through node `via`, wait until every node sees it and a
    leader is confirmed. Returns (queue, leader index)."""
    queue = f"cluster.{uuid.uuid4().hex[:12]}"
    declare_quorum(cluster, via, queue)
    wait_visible(cluster, queue, range(len(cluster)), deadline=5.0)
    return queue, cluster.wait_for_leader(queue, deadline=LEADER_DEADLINE)


def member_names(cluster, info):
    """The queue's members as node names (normalising "n1@host" forms); None if absent."""
    members = info.get("members")
    if members is None:
        return None
    return sorted(cluster.nodes[cluster.node_index(m)].name
                  if cluster.node_index(m) is not None else str(m) for m in members)


def hold_deliveries(conn, ch, queue, n, deadline=10.0):
    """Consume without acking until n deliveries are held (prefetch n); returns
    [(method, body)]."""
    held = []
    ch.basic_qos(prefetch_count=n)
    ch.basic_consume(queue, lambda c, m, p, b: held.append((m, b)), auto_ack=False)
    end = time.monotonic() + deadline
    while len(held) < n:
        assert time.monotonic() < end, f"only {len(held)} of {n} deliveries within {deadline}s"
        conn.process_data_events(time_limit=0.1)
    return held


def assert_replicas_agree(cluster, queue):
    """With no traffic, every up node's replica reaches the same applied index with the same
    digest (skipped, and logged, while the binary reports no `raft`)."""
    r = check_replicas(cluster, queue)
    log(f"{queue}: {r['summary']}")
    assert r["supported"] is False or r["agree"], r["summary"]
    return r


def try_publish(cluster, i, queue, mid, history, timeout):
    """One confirmed publish of `mid` through node i, given up after `timeout` s: "confirmed",
    or the reason it was not (recorded as retried, its outcome unknown)."""
    watchdog = Watchdog()
    conn = None
    history.attempt(mid)
    try:
        conn = cluster.connect(i)
        ch = conn.channel()
        with watchdog.guard(conn, timeout, "confirm"):
            ch.confirm_delivery()
            ch.basic_publish("", queue, mid.encode(),
                             pika.BasicProperties(delivery_mode=2, message_id=mid),
                             mandatory=True)
        history.confirm(mid)
        return "confirmed"
    except CLIENT_ERRORS as e:
        reason = f"{type(e).__name__} via {cluster.nodes[i].name}"
        history.retry(mid, reason)
        return reason
    finally:
        safe_close(conn)
        watchdog.close()


def assert_check(history, cluster, queue, expect_ids):
    """lost = 0, unexpected = 0, duplicates only with redelivered or retry, and every id in
    expect_ids delivered."""
    res = history.check()
    log(f"{queue}: {res.summary()}")
    assert res.ok, f"{res.describe()}\n{cluster.describe(queue)}"
    missing = set(expect_ids) - history.deliveries.keys()
    assert not missing, f"never delivered: {sorted(missing)[:20]}"
    return res


# ---------------------------------------------------------------------------------------------
# scenario tests
# ---------------------------------------------------------------------------------------------

def test_quorum_queue_declared_on_one_node_is_visible_on_all(cluster3):
    """A quorum queue declared through node 0 is visible on nodes 1 and 2, whose management
    APIs all report type quorum, the same leader and the three nodes as members."""
    c = cluster3
    queue = f"cluster.{uuid.uuid4().hex[:12]}"
    declare_quorum(c, 0, queue)
    wait_visible(c, queue, [1, 2], deadline=5.0)
    infos = [eventually(lambda i=i: c.queue_info(i, queue),
                        lambda info: info is not None and info.get("leader"),
                        what=f"{c.nodes[i].name} naming a leader of {queue}")
             for i in range(3)]
    for i, info in enumerate(infos):
        assert info["type"] == "quorum", (c.nodes[i].name, info)
        assert info["durable"] is True, (c.nodes[i].name, info)
        assert member_names(c, info) == ["n1", "n2", "n3"], (c.nodes[i].name, info)
    leaders = {info["leader"] for info in infos}
    assert len(leaders) == 1, f"the nodes disagree on the leader: {leaders}"
    assert c.node_index(leaders.pop()) is not None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("partitions", [0, 3])
def test_one_queue_declared_through_every_node_at_once_answers_every_declare(cluster3,
                                                                             partitions):
    """Three clients declare the same new quorum queue (and a partitioned one) through the
    three nodes at the same moment, as app instances starting together do. The first commit
    wins; the other declares are answered too (they used to wait forever for a group that
    would never exist), and a message published through one node is read through another."""
    c = cluster3
    queue = f"together.{uuid.uuid4().hex[:8]}"
    args = {"x-queue-type": "quorum"}
    if partitions:
        args.update({"x-partitions": partitions, "x-partition-key": "header:k"})
    start = threading.Barrier(3)
    answered, errors = {}, {}

    def declare(i):
        conn = c.connect(i, blocked_connection_timeout=60)
        try:
            ch = conn.channel()
            start.wait(10)
            t0 = time.monotonic()
            ch.queue_declare(queue, durable=True, arguments=args)
            answered[i] = time.monotonic() - t0
        except Exception as e:   # noqa: BLE001 - reported below
            errors[i] = repr(e)
        finally:
            safe_close(conn)

    threads = [threading.Thread(target=declare, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(answered) == [0, 1, 2], f"declares unanswered after 60 s: {answered}"
    target = f"{queue}-0" if partitions else queue
    wait_visible(c, target, [0, 1, 2], deadline=10.0)
    conn = c.connect(1)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", target, b"after", pika.BasicProperties(delivery_mode=2),
                         mandatory=True)
    finally:
        safe_close(conn)
    def get_one():
        conn = c.connect(2)
        try:
            return conn.channel().basic_get(target, auto_ack=True)[2]
        finally:
            safe_close(conn)

    got = eventually(get_one, lambda b: b is not None,
                     what=f"the message through n3 from {target}")
    assert got == b"after"


@pytest.mark.timeout(120)
def test_heartbeats_go_out_while_a_reply_waits_for_the_cluster(cluster3):
    """A declare through n1 while n2 and n3 are stopped cannot commit, so n1 holds the
    connection's replies. Its heartbeats still go out meanwhile (RabbitMQ's heartbeater writes
    beside the channels; a client that hears nothing for two intervals leaves), and the
    declare is answered on the same connection once the nodes resume. Read with a raw client
    on a 1 s heartbeat, counting the server's heartbeat frames during the hold: held output
    used to hold them too (none came)."""
    c = cluster3
    queue = f"held.{uuid.uuid4().hex[:8]}"
    client = wire.WireClient("127.0.0.1", c.nodes[0].amqp_port).handshake(heartbeat_s=1)
    try:
        client.open_channel(1)
        c.pause(1)
        c.pause(2)
        client.send(wire.queue_declare(1, queue, durable=True, arguments_field=wire.table(
            {"x-queue-type": "quorum"})))
        beats, answer = 0, None
        # The fault's length (not a wait for an event): several heartbeat intervals.
        hold_until = time.monotonic() + 6.0
        while time.monotonic() < hold_until and answer is None:
            client.send(wire.heartbeat())
            try:
                fr = client.read_frame(timeout=0.5)
            except socket.timeout:
                continue
            if fr.type == wire.FRAME_HEARTBEAT:
                beats += 1
            else:
                answer = fr
        assert answer is None, f"the declare was answered during the hold: {answer}"
        c.resume(1)
        c.resume(2)
        assert beats >= 3, f"{beats} heartbeats from n1 in 6 s of a held reply (interval 1 s)"
        deadline = time.monotonic() + 40.0
        while answer is None:
            client.send(wire.heartbeat())
            try:
                fr = client.read_frame(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            except socket.timeout:
                assert time.monotonic() < deadline, "no answer 40 s after the nodes resumed"
                continue
            if fr.type != wire.FRAME_HEARTBEAT:
                answer = fr
        assert wire.method_id(answer) == wire.QUEUE_DECLARE_OK, (
            answer, wire.decode_close(answer))
    finally:
        client.close()
    wait_visible(c, queue, [0, 1, 2], deadline=20.0)


def test_publish_through_follower_consume_through_other_follower_in_order(cluster3):
    """100 confirmed persistent messages published through a non-leader node are consumed
    in publish order, none redelivered, through a third node, and the acks empty the queue
    on every node."""
    c = cluster3
    queue, leader = new_quorum_queue(c)
    pub_node, con_node = [i for i in range(3) if i != leader]
    bodies = [f"m-{k}".encode() for k in range(100)]

    conn = c.connect(pub_node)
    ch = conn.channel()
    ch.confirm_delivery()
    for body in bodies:
        # Raises NackError / UnroutableError if the cluster refuses a message.
        ch.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2), mandatory=True)
    conn.close()

    conn = c.connect(con_node)
    ch = conn.channel()
    got = []

    def on_message(chan, method, props, body):
        got.append((body, method.redelivered))
        chan.basic_ack(method.delivery_tag)

    ch.basic_qos(prefetch_count=10)
    ch.basic_consume(queue, on_message)
    end = time.monotonic() + 30
    while len(got) < 100 and time.monotonic() < end:
        conn.process_data_events(time_limit=0.1)
    conn.close()
    assert [b for b, _ in got] == bodies, f"{len(got)} delivered; first: {got[:5]}"
    assert not any(red for _, red in got)
    for i in range(3):
        eventually(lambda i=i: c.queue_info(i, queue), lambda info: info["messages"] == 0,
                   what=f"{c.nodes[i].name} reporting 0 messages")


def test_exchanges_and_bindings_declared_on_one_node_route_on_every_node(cluster3):
    """An exchange declared and bound to a quorum queue through node 0 routes on nodes 1 and
    2 too (topology is replicated through the metadata group), and an unbind through node 2
    stops routing everywhere."""
    c = cluster3
    queue, _ = new_quorum_queue(c)
    exchange = f"cluster.x.{uuid.uuid4().hex[:8]}"
    conn = c.connect(0)
    ch = conn.channel()
    ch.exchange_declare(exchange, "direct", durable=True)
    ch.queue_bind(queue, exchange, routing_key="k")
    safe_close(conn)

    def publish_via(i, body):
        pconn = c.connect(i)
        pch = pconn.channel()
        pch.confirm_delivery()
        try:
            pch.basic_publish(exchange, "k", body, pika.BasicProperties(delivery_mode=2),
                              mandatory=True)
            return True
        except pika.exceptions.UnroutableError:
            return False
        finally:
            safe_close(pconn)

    for i in (1, 2):
        # The declare-ok and bind-ok came after the cluster committed them; another node
        # applies the committed change when it learns of the commit, a moment later.
        eventually(lambda i=i: publish_via(i, f"via-{i}".encode()), bool, deadline=10.0,
                   what=f"routing through node {i}")
    got = eventually(lambda: queue_depth(c, queue, 0), lambda d: d is not None and d >= 2,
                     deadline=10.0, what="both messages in the queue")
    assert got >= 2

    conn = c.connect(2)
    ch = conn.channel()
    ch.queue_unbind(queue, exchange, routing_key="k")
    safe_close(conn)
    for i in (0, 1):
        eventually(lambda i=i: not publish_via(i, b"after-unbind"), bool, deadline=10.0,
                   what=f"unroutable through node {i} after the unbind")


def test_basic_get_through_every_node(cluster3):
    """basic.get fetches a replicated queue's messages, in order, through the leader and
    through each follower, and basic.ack of a got message settles it."""
    c = cluster3
    queue, leader = new_quorum_queue(c)
    history = History()
    ids = [f"m-{k}" for k in range(6)]
    publish_with_retry(c, [leader], queue, ids, history)
    got = []
    for node in [leader] + [i for i in range(3) if i != leader]:
        conn = c.connect(node)
        ch = conn.channel()
        for _ in range(2):
            method, _props, body = eventually(
                lambda ch=ch: ch.basic_get(queue, auto_ack=False),
                lambda m: m[0] is not None, deadline=5.0,
                what=f"basic.get via {c.nodes[node].name} returning a message "
                     f"({c.describe(queue)})")
            got.append(body.decode())
            ch.basic_ack(method.delivery_tag)
        conn.close()
    assert got == ids
    eventually(lambda: c.queue_info(leader, queue), lambda info: info["messages"] == 0,
               what="0 messages after the acks")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("consumer_on", ["follower", "leader"])
def test_leader_kill9_loses_no_confirmed_message(cluster3, consumer_on):
    """After kill -9 of the leader, another node leads within the deadline, all 200
    confirmed messages are consumed from survivors (lost = 0), and deliveries a consumer
    held unacked come back with redelivered set (consumer on a surviving follower, or on the
    killed leader itself)."""
    c = cluster3
    queue, leader = new_quorum_queue(c)
    f1, f2 = [i for i in range(3) if i != leader]
    history = History()
    ids = [f"m-{k}" for k in range(200)]
    publish_with_retry(c, [f1], queue, ids, history)
    assert not history.retried, f"fault-free publishes were retried: {dict(history.retried)}"

    holder = f2 if consumer_on == "follower" else leader
    # No heartbeats: this connection sits idle (nobody pumps it) while the leader is replaced,
    # and must stay open through that unless the broker or the node's death closes it.
    hconn = c.connect(holder, heartbeat=0)
    hch = hconn.channel()
    held = hold_deliveries(hconn, hch, queue, 20)
    for method, body in held:
        history.deliver(body.decode(), method.redelivered, c.nodes[holder].name, "held")
    held_ids = [body.decode() for _, body in held]

    t_kill = time.monotonic()
    c.kill9(leader)
    new_leader = c.wait_for_leader(queue, exclude={leader}, deadline=LEADER_DEADLINE)
    log(f"{consumer_on}: {c.nodes[new_leader].name} leads {time.monotonic() - t_kill:.1f}s "
        f"after kill -9 of {c.nodes[leader].name}")
    assert new_leader != leader

    unacked = set(held_ids)
    if consumer_on == "follower":
        # The holder's node survived: ack half of the held deliveries after the leader
        # change (the other half is returned when the connection closes). If the broker
        # closed the channel meanwhile, none was acked and all must come back.
        try:
            for method, body in held[:10]:
                hch.basic_ack(method.delivery_tag)
            hconn.process_data_events(time_limit=0)
            unacked -= set(held_ids[:10])
        except pika.exceptions.AMQPError as e:
            log(f"acks after the leader change failed: {e!r}")
    safe_close(hconn)

    survivors = [f1, f2]
    drain_until(c, survivors, queue, history, ids, deadline=45.0)
    sweep(c, survivors, queue, history)
    assert_check(history, c, queue, ids)
    for mid in unacked:
        again = history.deliveries[mid][1:]
        assert again and all(red for (_, _, red, _) in again), \
            f"held unacked {mid}: deliveries after the first {history.deliveries[mid]}"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault", ["kill9", "pause"])
def test_acks_across_a_leader_fault_settle_every_message(cluster3, fault):
    """A consumer on a surviving follower that acks every delivery while the leader is
    killed (-9, then restarted) or paused (then resumed) mid-stream settles every message:
    the queue reports 0 messages while the consumer is still connected, and after it
    disconnects."""
    c = cluster3
    queue, leader = new_quorum_queue(c)
    follower = next(i for i in range(3) if i != leader)
    history, stats, watchdog = History(), collections.Counter(), Watchdog()
    pub_stop, cons_stop = threading.Event(), threading.Event()
    consumer = Consumer(c, queue, history, cons_stop, watchdog, stats, node=follower)
    publisher = Publisher(c, queue, history, 0, pub_stop, watchdog, stats)
    publisher.node = follower
    try:
        consumer.start()
        publisher.start()
        eventually(lambda: len(history.deliveries), lambda n: n >= 50, deadline=20.0,
                   what="50 deliveries before the fault")
        if fault == "kill9":
            c.kill9(leader)
            c.wait_for_leader(queue, exclude={leader}, deadline=LEADER_DEADLINE)
            c.restart(leader)
        else:
            c.pause(leader)
            c.wait_for_leader(queue, exclude={leader}, deadline=LEADER_DEADLINE)
            c.resume(leader)
        c.wait_for_agreement(queue, include={leader}, deadline=LEADER_DEADLINE)
        n = len(history.confirmed)
        eventually(lambda: len(history.confirmed), lambda m: m >= n + 50, deadline=20.0,
                   what="50 more confirms after the fault")
        pub_stop.set()
        publisher.join(timeout=60)
        eventually(lambda: len(history.missing()), lambda m: m == 0, deadline=30.0,
                   what="every confirmed message delivered")
        depth = eventually(lambda: queue_depth(c, queue, follower), lambda d: d == 0,
                           deadline=15.0, what=f"0 messages with the consumer connected "
                                               f"(it acked all; stats {dict(stats)})")
        cons_stop.set()
        consumer.join(timeout=30)
        depth = eventually(lambda: queue_depth(c, queue, follower), lambda d: d == 0,
                           deadline=15.0, what="0 messages after the consumer left")
        assert depth == 0
    finally:
        pub_stop.set()
        cons_stop.set()
        publisher.join(timeout=30)
        consumer.join(timeout=30)
        watchdog.close()
    assert not (publisher.crash or consumer.crash), publisher.crash or consumer.crash
    assert_check(history, c, queue, history.confirmed)


@pytest.mark.timeout(150)
def test_restarted_follower_catches_up_and_makes_the_majority(cluster3):
    """A follower killed with -9 while 100 messages are published catches up after restart,
    and with another node then killed (so the restarted one is needed for a majority) every
    message is drained through it."""
    c = cluster3
    queue, leader = new_quorum_queue(c)
    f1, f2 = [i for i in range(3) if i != leader]
    history = History()
    ids = [f"m-{k}" for k in range(150)]
    publish_with_retry(c, [f2], queue, ids[:50], history)

    c.kill9(f1)
    publish_with_retry(c, [f2, leader], queue, ids[50:], history)
    c.restart(f1)
    # The restarted node has rejoined when it names a live leader and reports every message.
    eventually(lambda: c.queue_info(f1, queue),
               lambda info: (info is not None and c.node_index(info.get("leader")) is not None
                             and c.node_index(info.get("leader")) != f1
                             and info.get("messages") == 150),
               deadline=LEADER_DEADLINE, what=f"restarted {c.nodes[f1].name} caught up")

    current = c.wait_for_leader(queue)
    victim = current if current != f1 else f2
    c.kill9(victim)
    new_leader = c.wait_for_leader(queue, exclude={victim}, deadline=LEADER_DEADLINE)
    log(f"killed {c.nodes[victim].name}; {c.nodes[new_leader].name} leads with "
        f"{c.nodes[f1].name} (restarted) in the majority")
    drain_until(c, [f1], queue, history, ids, deadline=45.0)
    sweep(c, [f1], queue, history)
    assert_check(history, c, queue, ids)


@pytest.mark.timeout(150)
def test_paused_leader_is_replaced_and_rejoins_as_follower(cluster3):
    """A leader stopped with SIGSTOP beyond the election timeout is replaced by a new
    leader that takes publishes; after SIGCONT the old leader rejoins as a follower, serves
    clients, and nothing is lost."""
    c = cluster3
    queue, leader = new_quorum_queue(c)
    f1, f2 = [i for i in range(3) if i != leader]
    history = History()
    ids = [f"m-{k}" for k in range(100)]
    publish_with_retry(c, [f1], queue, ids[:50], history)

    t_pause = time.monotonic()
    c.pause(leader)
    new_leader = c.wait_for_leader(queue, exclude={leader}, deadline=LEADER_DEADLINE)
    log(f"{c.nodes[new_leader].name} leads {time.monotonic() - t_pause:.1f}s after SIGSTOP "
        f"of {c.nodes[leader].name}")
    publish_with_retry(c, [f1, f2], queue, ids[50:], history)
    # The fault lasts at least PAUSE_BEYOND_ELECTION_S (a fault's length, not a wait).
    time.sleep(max(0.0, PAUSE_BEYOND_ELECTION_S - (time.monotonic() - t_pause)))
    c.resume(leader)

    final = c.wait_for_agreement(queue, include={leader}, deadline=LEADER_DEADLINE)
    assert final != leader, f"the old leader {c.nodes[leader].name} leads again"
    drain_until(c, [leader], queue, history, ids, deadline=45.0)
    sweep(c, [leader], queue, history)
    assert_check(history, c, queue, ids)


@pytest.mark.timeout(150)
def test_five_nodes_three_members_serve_through_non_members(cluster5):
    """On five nodes a quorum queue has three members, all nodes agree on them and on the
    leader, non-member nodes publish and consume, and kill -9 of the leader loses nothing."""
    c = cluster5
    queue, leader = new_quorum_queue(c)
    infos = [eventually(lambda i=i: c.queue_info(i, queue),
                        lambda info: info is not None and info.get("leader"),
                        what=f"{c.nodes[i].name} naming a leader") for i in range(5)]
    members = {tuple(member_names(c, info) or ()) for info in infos}
    assert len(members) == 1, f"the nodes disagree on the members: {members}"
    members = list(members.pop())
    assert len(members) == 3 and len(set(members)) == 3, members
    assert c.nodes[leader].name in members
    outsiders = [i for i in range(5) if c.nodes[i].name not in members]
    assert len(outsiders) == 2

    history = History()
    ids = [f"m-{k}" for k in range(100)]
    publish_with_retry(c, [outsiders[0]], queue, ids[:50], history)
    c.kill9(leader)
    new_leader = c.wait_for_leader(queue, exclude={leader}, deadline=LEADER_DEADLINE)
    assert c.nodes[new_leader].name in members and new_leader != leader
    publish_with_retry(c, [outsiders[0]], queue, ids[50:], history)
    drain_until(c, [outsiders[1]], queue, history, ids, deadline=45.0)
    sweep(c, [outsiders[1]], queue, history)
    assert_check(history, c, queue, ids)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["reset", "blackhole"])
def test_partitioned_leader_is_replaced_and_follows_after_heal(cluster3, mode):
    """The leader cut off from both followers (its links reset; new ones refused, or
    black-holed: accepted and never answered) is replaced by a leader the followers elect.
    A publisher on a follower that runs across the cut keeps getting confirms once the new
    leader is elected, publishes through the other follower are confirmed, and a publish
    through the cut-off old leader is not. After the heal the old leader follows the new one
    and every confirmed message is consumed through it (lost = 0)."""
    c = cluster3
    queue, leader = new_quorum_queue(c)
    f1, f2 = [i for i in range(3) if i != leader]
    # The proxy must carry every cluster connection, or the cut would leak.
    assert c.direct_cluster_links() == [], c.direct_cluster_links()
    history, stats, watchdog = History(), collections.Counter(), Watchdog()
    ids = [f"m-{k}" for k in range(100)]
    publish_with_retry(c, [f1], queue, ids[:50], history)
    pub_stop = threading.Event()
    publisher = Publisher(c, queue, history, 0, pub_stop, watchdog, stats)
    publisher.node = f1
    try:
        publisher.start()
        eventually(lambda: len(history.confirmed), lambda n: n >= 70, deadline=20.0,
                   what="the publisher on the follower confirming before the cut")

        t_cut = time.monotonic()
        c.isolate(leader, mode=mode)
        new_leader = c.wait_for_leader(queue, exclude={leader}, deadline=LEADER_DEADLINE)
        t_elected = time.monotonic()
        log(f"{mode}: {c.nodes[new_leader].name} leads {t_elected - t_cut:.1f}s after "
            f"{c.nodes[leader].name} was cut off")
        n = len(history.confirmed)
        eventually(lambda: len(history.confirmed), lambda m: m >= n + 50, deadline=10.0,
                   what=f"50 more confirms through {c.nodes[f1].name} (the publisher that "
                        f"ran across the cut) within 10 s of the new leader; "
                        f"stats {dict(stats)}")
        publish_with_retry(c, [f2], queue, ids[50:], history, deadline=20.0)
        outcome = try_publish(c, leader, queue, "minority-0", history, timeout=2.0)
        assert outcome != "confirmed", "the cut-off old leader confirmed a publish"
        assert c.proxy.is_cut(leader, f1) and c.proxy.is_cut(leader, f2)
        # The partition lasts at least PARTITION_S (the fault's length, not a wait).
        time.sleep(max(0.0, PARTITION_S - (time.monotonic() - t_cut)))
        c.heal_network()

        final = c.wait_for_agreement(queue, include={leader}, deadline=LEADER_DEADLINE)
        assert final != leader, f"the cut-off old leader {c.nodes[leader].name} leads again"
        pub_stop.set()
        publisher.join(timeout=60)
    finally:
        pub_stop.set()
        publisher.join(timeout=30)
        watchdog.close()
    assert not publisher.crash, publisher.crash
    proxy = dict(c.proxy.stats)
    old = c.nodes[leader].name
    across = sum(v for k, v in proxy.items()
                 if k.startswith("refused " if mode == "reset" else "black-holed n")
                 and old in k)
    log(f"{mode}: proxy {proxy}; publisher {dict(stats)}; minority publish: {outcome}")
    assert proxy.get("reset at cut", 0) > 0, f"no connection was cut: {proxy}"
    assert across > 0, f"no new connection to or from {old} met the cut: {proxy}"
    assert proxy.get("unidentified", 0) == 0, f"connections the proxy could not place: {proxy}"
    drain_until(c, [leader], queue, history, history.confirmed, deadline=45.0)
    sweep(c, [leader], queue, history)
    assert_check(history, c, queue, ids)
    assert_replicas_agree(c, queue)


@pytest.mark.timeout(150)
def test_whole_cluster_kill9_keeps_every_confirmed_message(cluster3):
    """kill -9 of every node at once, after 200 confirmed publishes of which a consumer held
    20 unacked: once all restart, the three nodes agree on a leader, each reports the 200
    messages, and all are consumed (lost = 0), the 20 held ones redelivered."""
    c = cluster3
    queue, leader = new_quorum_queue(c)
    f1, f2 = [i for i in range(3) if i != leader]
    history = History()
    ids = [f"m-{k}" for k in range(200)]
    publish_with_retry(c, [f1], queue, ids[:100], history)
    publish_with_retry(c, [leader], queue, ids[100:], history)
    assert not history.retried, f"fault-free publishes were retried: {dict(history.retried)}"
    hconn = c.connect(f2, heartbeat=0)
    held = hold_deliveries(hconn, hconn.channel(), queue, 20)
    for method, body in held:
        history.deliver(body.decode(), method.redelivered, c.nodes[f2].name, "held")
    held_ids = [body.decode() for _, body in held]

    c.kill_all()
    safe_close(hconn)
    t_restart = time.monotonic()
    c.restart_all()
    new_leader = c.wait_for_agreement(queue, include={0, 1, 2}, deadline=LEADER_DEADLINE)
    log(f"{c.nodes[new_leader].name} leads {time.monotonic() - t_restart:.1f}s after all "
        f"three restarted")
    for i in range(3):
        eventually(lambda i=i: c.queue_info(i, queue),
                   lambda info: info is not None and info.get("messages") == 200,
                   deadline=LEADER_DEADLINE,
                   what=f"{c.nodes[i].name} reporting the 200 messages after the restart")
    drain_until(c, [0, 1, 2], queue, history, ids, deadline=45.0)
    sweep(c, [0, 1, 2], queue, history)
    assert_check(history, c, queue, ids)
    for mid in held_ids:
        again = history.deliveries[mid][1:]
        assert again and all(red for (_, _, red, _) in again), \
            f"held unacked {mid}: deliveries after the first {history.deliveries[mid]}"
    assert_replicas_agree(c, queue)


@pytest.mark.timeout(150)
def test_member_removed_and_added_back_under_load(cluster3):
    """Under a confirmed publisher and an acking consumer, a follower removed from the
    queue's members (management API) disappears from the leader's list while confirms go on,
    and comes back when added again; then the same for the leader itself. Nothing confirmed
    is lost and the replicas agree afterwards."""
    c = cluster3
    queue, leader = new_quorum_queue(c)
    if not membership_supported(c, queue):
        pytest.skip("the binary has no POST/DELETE /api/queues/{vhost}/{queue}/members")
    follower = next(i for i in range(3) if i != leader)
    history, stats, watchdog = History(), collections.Counter(), Watchdog()
    pub_stop, cons_stop = threading.Event(), threading.Event()
    consumer = Consumer(c, queue, history, cons_stop, watchdog, stats, node=follower)
    publisher = Publisher(c, queue, history, 0, pub_stop, watchdog, stats)
    try:
        consumer.start()
        publisher.start()
        for victim in (follower, leader):
            name = c.nodes[victim].name
            n = len(history.confirmed)
            eventually(lambda: len(history.confirmed), lambda m: m >= n + 30, deadline=20.0,
                       what=f"30 confirms before removing {name}")
            change_member(c, queue, name, add=False)
            left = wait_members(c, queue, lambda m: victim not in m, deadline=LEADER_DEADLINE,
                                what=f"the leader no longer listing {name}")
            assert len(left) == 2, left
            # A removed leader hands over to a remaining member (under load here).
            eventually(lambda: c.leader_of(queue), lambda lead: lead in left,
                       deadline=LEADER_DEADLINE, what=f"a remaining member leading, not {name}")
            info = c.queue_info(victim, queue) or {}
            log(f"{name} removed: it reports {info.get('raft')}; leader "
                f"{c.leader_of(queue)}")
            n = len(history.confirmed)
            eventually(lambda: len(history.confirmed), lambda m: m >= n + 30, deadline=20.0,
                       what=f"30 confirms with {name} out")
            change_member(c, queue, name, add=True)
            back = wait_members(c, queue, lambda m: victim in m, deadline=LEADER_DEADLINE,
                                what=f"the leader listing {name} again")
            assert back == {0, 1, 2}, back
            c.wait_for_agreement(queue, include={victim}, deadline=LEADER_DEADLINE)
        pub_stop.set()
        publisher.join(timeout=60)
        eventually(lambda: len(history.missing()), lambda m: m == 0, deadline=30.0,
                   what="every confirmed message delivered")
        cons_stop.set()
        consumer.join(timeout=30)
    finally:
        pub_stop.set()
        cons_stop.set()
        publisher.join(timeout=30)
        consumer.join(timeout=30)
        watchdog.close()
    assert not (publisher.crash or consumer.crash), publisher.crash or consumer.crash
    sweep(c, [0, 1, 2], queue, history)
    assert_check(history, c, queue, history.confirmed)
    assert_replicas_agree(c, queue)


# ---------------------------------------------------------------------------------------------
# the total-queue checker
# ---------------------------------------------------------------------------------------------

def run_checker(cluster_factory, capsys, kinds, cluster_args=(), **kw):
    """CHECK_RUNS runs of the total-queue checker, each on a fresh cluster (its nodes started
    with `cluster_args` as well); fails with every run's problems (errors, a failed check, no
    workload, no fault, replicas that disagree)."""
    runs, failures = [], []
    for run in range(CHECK_RUNS):
        cluster = cluster_factory(CHECK_NODES, extra_args=cluster_args)
        if callable(kinds):
            kinds = kinds(cluster)    # chosen once, on the first run's cluster
        seed = None if CHECK_SEED is None else CHECK_SEED + run
        r = run_total_queue_check(cluster, seconds=CHECK_SECONDS, seed=seed, kinds=kinds,
                                  **kw)
        runs.append(r)
        res = r["result"]
        log(f"run {run}: seed={r['seed']} faults={dict(r['faults'])} {res.summary()} "
            f"stats={dict(r['stats'])}")
        log(f"run {run}: fault log (t, kind, node, was leader, held s, recovered s): "
            f"{r['fault_log']}")
        log(f"run {run}: {r['replicas']['summary'] if r['replicas'] else 'replicas unchecked'}")
        if r["consumer_cancels"]:
            log(f"run {run}: basic.cancel from the broker (t, node): {r['consumer_cancels']}")
        problems = list(r["errors"])
        if not res.ok:
            problems.append(res.describe())
        if res.confirmed < 50:
            problems.append(f"only {res.confirmed} messages confirmed: no real workload")
        if sum(r["faults"].values()) == 0:
            problems.append("no fault was applied")
        if kw.get("until_each_kind"):
            missing = set(kinds) - set(r["faults"])
            if missing:
                problems.append(f"fault kinds never applied: {sorted(missing)}")
        if problems:
            cluster.keep = True
            failures.append(f"run {run} (seed {r['seed']}, {cluster.root}):\n" +
                            "\n".join(problems))
        cluster.close()    # keeps the directory of a failed run (history and logs)
    with capsys.disabled():
        print("\n" + summarize(runs))
    assert not failures, "\n\n".join(failures)


@pytest.mark.timeout(int(CHECK_RUNS * (CHECK_SECONDS + 240)))
def test_total_queue_checker_under_kills_and_pauses(cluster_factory, capsys):
    """Under random kill -9/restart and SIGSTOP/SIGCONT faults, with two confirmed
    publishers and an acking consumer on rotating nodes, no confirmed message is lost, none
    appears that was never published, and duplicates occur only for redelivered or
    republished ids."""
    run_checker(cluster_factory, capsys, CHECK_FAULTS, partition_mode=PARTITION_MODE)


@pytest.mark.timeout(int(CHECK_RUNS * (CHECK_SECONDS + 240)))
def test_total_queue_checker_on_redb(cluster_factory, capsys):
    """The same check with the quorum queues' logs in each node's redb database
    (`--quorum-log redb`) rather than the write-ahead log every other test runs on: kill -9
    in the middle of its rounds and SIGSTOP lose no confirmed message, create none, and leave
    the replicas agreeing."""
    # Under WARREN_CLUSTER_EXTRA_ARGS="--quorum-log ..." every cluster has the flag already.
    on_redb = () if "--quorum-log" in os.environ.get("WARREN_CLUSTER_EXTRA_ARGS", "") \
        else ("--quorum-log", "redb")
    run_checker(cluster_factory, capsys, CHECK_FAULTS, cluster_args=on_redb,
                partition_mode=PARTITION_MODE)


@pytest.mark.timeout(int(CHECK_RUNS * (2 * CHECK_SECONDS + 300)))
def test_total_queue_checker_under_partitions_and_whole_cluster_kills(cluster_factory, capsys):
    """The same check under the severe faults, each applied at least once: a minority (often
    the leader alone) partitioned away for 4-8 s, new connections across the cut refused or
    black-holed; kill -9 of every node, then all restarted; and, when the binary has the
    endpoint, a member removed and added back under load and leadership handed to another
    member. Clients on the cut-off side see
    their operations stall or fail and retry (an unknown outcome)."""
    def kinds(cluster):
        if SEVERE_FAULTS:
            return fault_kinds_env("WARREN_CLUSTER_SEVERE_FAULTS", "")
        probe, _ = new_quorum_queue(cluster)
        supported = membership_supported(cluster, probe)
        log(f"membership endpoints {'present' if supported else 'absent'}")
        return ("partition", "killall") + (("membership", "transfer") if supported else ())

    run_checker(cluster_factory, capsys, kinds, order="cycle",
                partition_mode=PARTITION_MODE, until_each_kind=True)


@pytest.mark.timeout(int(CHECK_RUNS * (2 * CHECK_SECONDS + 300)))
def test_total_queue_checker_on_a_classic_queue(cluster_factory, capsys):
    """The checker on a durable classic queue homed on one node, its publishers and consumer
    on the others (every operation through a proxy): kill -9, SIGSTOP, SIGTERM, a partition
    and a whole-cluster kill, each at least once, lose no confirmed message and create none
    (the home's faults make it unavailable, not lossy)."""
    run_checker(cluster_factory, capsys, ("kill9", "pause", "term", "partition", "killall"),
                order="cycle", partition_mode=PARTITION_MODE, until_each_kind=True,
                queue_type="classic")


@pytest.mark.timeout(int(CHECK_RUNS * (2 * CHECK_SECONDS + 300)))
def test_total_queue_checker_on_a_partitioned_queue(cluster_factory, capsys):
    """The checker on a partitioned quorum queue (3 partitions keyed by message id, used
    through its logical name by two confirmed publishers and one consumer of every partition):
    kill -9 and SIGSTOP, each at least once, the leader-directed ones at a partition's leader,
    lose no confirmed message, create none, and leave every partition's replicas agreeing."""
    run_checker(cluster_factory, capsys, ("kill9", "pause"), order="cycle",
                partition_mode=PARTITION_MODE, until_each_kind=True,
                queue_type="partitioned")
