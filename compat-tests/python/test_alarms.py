"""Resource alarms: with the memory or disk alarm on, a connection that publishes is sent
connection.blocked (when it announced the capability) and is no longer read; connections that
only consume keep draining; connection.unblocked follows when the alarm clears, and nothing
published is lost. Run against RabbitMQ too: the limits are changed with the same
`set_vm_memory_high_watermark` / `set_disk_free_limit` commands as rabbitmqctl's.
"""

import os
import time

import pika
import pytest

import wire
from amqp_helpers import counts
from wire import WireClient

ALARM_DEADLINE_S = 30.0  # RabbitMQ samples free disk space every few seconds
TINY_MEMORY = "0.0000001"  # a fraction of RAM that any broker process exceeds
MEMORY_DEFAULT = "0.6"
HUGE_DISK = "1000000000000000"  # 1 PB free: no disk has that
DISK_DEFAULT = "50000000"


class Watcher:
    """A pika publisher connection that records blocked / unblocked notifications."""

    def __init__(self, params):
        self.events = []
        self.conn = pika.BlockingConnection(params)
        self.conn.add_on_connection_blocked_callback(
            lambda _c, m: self.events.append(("blocked", m.method.reason)))
        self.conn.add_on_connection_unblocked_callback(
            lambda _c, _m: self.events.append(("unblocked", None)))
        self.ch = self.conn.channel()

    def pump(self, seconds=0.1):
        self.conn.process_data_events(time_limit=seconds)

    def publish_until_blocked(self, queue, deadline_s=ALARM_DEADLINE_S):
        """Publish one message per pump until the broker says blocked (the alarm is raised
        asynchronously). Returns how many messages were published."""
        published = 0
        deadline = time.monotonic() + deadline_s
        while not any(e[0] == "blocked" for e in self.events):
            assert time.monotonic() < deadline, f"never blocked; events {self.events}"
            self.ch.basic_publish("", queue, f"m{published}".encode())
            published += 1
            self.pump(0.2)
        return published

    def wait_for(self, kind, deadline_s=ALARM_DEADLINE_S):
        deadline = time.monotonic() + deadline_s
        while not any(e[0] == kind for e in self.events):
            assert time.monotonic() < deadline, f"no {kind}; events {self.events}"
            self.pump(0.2)

    def close(self):
        if self.conn.is_open:
            self.conn.close()


def drain(ch, queue, n, timeout=10):
    got = []
    for method, _props, body in ch.consume(queue, inactivity_timeout=timeout):
        assert method is not None, f"only {len(got)} of {n} messages arrived"
        ch.basic_ack(method.delivery_tag)
        got.append(body)
        if len(got) == n:
            break
    ch.cancel()
    return got


@pytest.fixture
def restore_limits(ctl):
    yield
    ctl("set_vm_memory_high_watermark", MEMORY_DEFAULT)
    ctl("set_disk_free_limit", DISK_DEFAULT)


def test_memory_alarm_blocks_publishers_and_lets_consumers_drain(
        ctl, params, names, connect, restore_limits):
    q = names.q()
    setup = connect().channel()
    setup.queue_declare(q)
    backlog = [f"before{i}".encode() for i in range(20)]
    for body in backlog:
        setup.basic_publish("", q, body)
    consumer = connect().channel()
    idle = Watcher(params)  # never publishes: never blocked
    pub = Watcher(params)
    try:
        code, out = ctl("set_vm_memory_high_watermark", TINY_MEMORY)
        assert code == 0, out
        during = pub.publish_until_blocked(q)
        assert ("blocked", "low on memory") in pub.events
        # A connection that only consumes keeps draining while publishers are blocked.
        assert drain(consumer, q, len(backlog)) == backlog
        # A connection that has not published is read as usual and is not notified.
        idle.ch.queue_declare(q, passive=True)
        idle.pump(0.2)
        assert idle.events == []

        code, out = ctl("set_vm_memory_high_watermark", MEMORY_DEFAULT)
        assert code == 0, out
        pub.wait_for("unblocked")
        # Every message published, including those sent while blocked, is delivered.
        got = drain(consumer, q, during)
        assert sorted(got) == sorted(f"m{i}".encode() for i in range(during))
        assert idle.events == []
    finally:
        pub.close()
        idle.close()


def test_disk_alarm_blocks_with_low_on_disk(ctl, params, names, connect, restore_limits):
    q = names.q()
    connect().channel().queue_declare(q)
    pub = Watcher(params)
    try:
        code, out = ctl("set_disk_free_limit", HUGE_DISK)
        assert code == 0, out
        during = pub.publish_until_blocked(q)
        assert ("blocked", "low on disk") in pub.events
        code, out = ctl("set_disk_free_limit", DISK_DEFAULT)
        assert code == 0, out
        pub.wait_for("unblocked")
        pub.ch.confirm_delivery()
        pub.ch.basic_publish("", q, b"after")  # confirmed: the broker reads again
        ready, _ = counts(pub.conn, q)
        assert ready == during + 1
    finally:
        pub.close()


def test_publisher_without_the_capability_is_paused_silently(ctl, params, names, connect,
                                                             restore_limits):
    """No connection.blocked for a client that did not ask for it; the broker just stops
    reading it after a publish and resumes when the alarm clears."""
    q = names.q()
    connect().channel().queue_declare(q)
    c = WireClient(params.host, params.port)
    try:
        c.handshake()
        c.open_channel(1)
        code, out = ctl("set_vm_memory_high_watermark", TINY_MEMORY)
        assert code == 0, out
        # Publish until the broker stops answering the passive declare that follows each one.
        deadline = time.monotonic() + ALARM_DEADLINE_S
        paused = False
        published = 0
        while not paused:
            assert time.monotonic() < deadline, "the broker never stopped reading"
            c.send(wire.basic_publish(1, "", q) + wire.content_header(1, 1) +
                   wire.frame(wire.FRAME_BODY, 1, b"x"))
            published += 1
            c.send(wire.queue_declare(1, q, passive=True))
            try:
                fr = c.read_frame(timeout=1.0)
            except TimeoutError:
                paused = True
                break
            assert wire.method_id(fr) == wire.QUEUE_DECLARE_OK, "no connection.blocked expected"
        code, out = ctl("set_vm_memory_high_watermark", MEMORY_DEFAULT)
        assert code == 0, out
        # The declare sent while paused is answered once the alarm clears.
        fr = c.read_frame(timeout=ALARM_DEADLINE_S)
        assert wire.method_id(fr) == wire.QUEUE_DECLARE_OK
        ready, _ = counts(connect(), q)
        assert ready == published
    finally:
        c.close()


@pytest.mark.warren_only
def test_alarms_command_lists_the_alarm(ctl, restore_limits):
    code, out = ctl("alarms")
    assert code == 0 and "no alarms" in out, out
    ctl("set_vm_memory_high_watermark", "absolute", "1")
    code, out = ctl("alarms")
    assert code == 0 and "Memory alarm" in out, out
