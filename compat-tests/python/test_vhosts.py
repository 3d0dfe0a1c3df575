"""Vhosts as tenants, managed with rabbitmqctl's verbs (`warren ctl`, or `rabbitmqctl` when
the suite runs against RabbitMQ)."""

import os

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker, ConnectionClosedByBroker, ProbableAccessDeniedError


@pytest.fixture
def vhost(ctl, prefix):
    name = prefix.replace("compat.", "vh.")[:60]
    assert ctl("add_vhost", name)[0] == 0
    assert ctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")[0] == 0
    yield name
    ctl("delete_vhost", name)


def connect(params, vhost):
    return pika.BlockingConnection(pika.ConnectionParameters(
        host=params.host, port=params.port, virtual_host=vhost,
        credentials=pika.PlainCredentials("guest", "guest"), connection_attempts=1))


def listed(out):
    lines = out.splitlines()
    return lines[lines.index("name") + 1:] if "name" in lines else []


def test_vhosts_are_listed_and_adding_twice_is_harmless(ctl, vhost):
    assert ctl("add_vhost", vhost)[0] == 0
    code, out = ctl("list_vhosts")
    assert code == 0 and vhost in listed(out) and "/" in listed(out)


def test_vhosts_isolate_their_queues(ctl, params, vhost, prefix):
    conn = connect(params, vhost)
    try:
        ch = conn.channel()
        q = prefix + ".iso"
        ch.queue_declare(q)
        ch.basic_publish("", q, b"in the vhost")
        default = connect(params, "/")
        try:
            with pytest.raises(ChannelClosedByBroker) as e:
                default.channel().queue_declare(q, passive=True)
            assert e.value.reply_code == 404
        finally:
            default.close()
        method, _, body = ch.basic_get(q, auto_ack=True)
        assert body == b"in the vhost"
    finally:
        conn.close()


def test_deleting_a_vhost_closes_its_connections_and_removes_everything(ctl, params, vhost, prefix):
    conn = connect(params, vhost)
    ch = conn.channel()
    q = prefix + ".gone"
    ch.queue_declare(q, durable=True)
    ch.basic_publish("", q, b"x", pika.BasicProperties(delivery_mode=2))
    assert ctl("delete_vhost", vhost)[0] == 0
    with pytest.raises(ConnectionClosedByBroker) as e:
        for _ in range(100):
            conn.process_data_events(time_limit=0.1)
    assert e.value.reply_code == 320
    # RabbitMQ sends either, depending on whether the vhost's supervisor stopped before the
    # deletion reached its connections ("is down") or not ("is deleted"); Warren says the latter.
    texts = {f"CONNECTION_FORCED - vhost '{vhost}' is deleted"}
    if os.environ.get("WARREN_TEST_AMQP_URL"):
        texts.add(f"CONNECTION_FORCED - vhost '{vhost}' is down")
    assert e.value.reply_text in texts
    code, out = ctl("list_vhosts")
    assert vhost not in listed(out)
    assert ctl("list_permissions", "-p", vhost)[0] == 65
    with pytest.raises(ProbableAccessDeniedError):
        connect(params, vhost)
    # Created again, it is empty and grants nothing until permissions are set.
    assert ctl("add_vhost", vhost)[0] == 0
    with pytest.raises(ProbableAccessDeniedError):
        connect(params, vhost)
    ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    again = connect(params, vhost)
    try:
        with pytest.raises(ChannelClosedByBroker) as e:
            again.channel().queue_declare(q, passive=True)
        assert e.value.reply_code == 404
    finally:
        again.close()


def test_deleting_a_missing_vhost_is_65(ctl, prefix):
    assert ctl("delete_vhost", prefix + ".none")[0] == 65


@pytest.fixture
def quorum_vhost(ctl, prefix):
    name = prefix.replace("compat.", "vq.")[:60]
    code, out = ctl("add_vhost", name, "--default-queue-type", "quorum")
    assert code == 0, out
    assert ctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")[0] == 0
    yield name
    ctl("delete_vhost", name)


def test_default_queue_type_applies_to_queues_declared_without_one(ctl, params, quorum_vhost):
    code, out = ctl("list_vhosts", "name", "default_queue_type")
    assert code == 0 and f"{quorum_vhost}\tquorum" in out.splitlines(), out
    conn = connect(params, quorum_vhost)
    try:
        ch = conn.channel()
        ch.queue_declare("jobs", durable=True)
        ch.queue_declare("jobs", durable=True)  # redeclaring without a type is equivalent
        # The queue is a quorum queue: declaring it as classic is inequivalent.
        with pytest.raises(ChannelClosedByBroker) as e:
            ch.queue_declare("jobs", durable=True, arguments={"x-queue-type": "classic"})
        assert e.value.reply_code == 406
        assert "inequivalent arg 'x-queue-type'" in e.value.reply_text
        assert "'quorum'" in e.value.reply_text
        # An explicit type wins over the default; exclusive queues stay classic.
        ch = conn.channel()
        ch.queue_declare("explicit", durable=True, arguments={"x-queue-type": "classic"})
        ch.queue_declare("", exclusive=True)
        ch.queue_delete("jobs")
        ch.queue_delete("explicit")
    finally:
        conn.close()


def test_default_queue_type_is_per_vhost(ctl, params, vhost):
    code, out = ctl("list_vhosts", "name", "default_queue_type")
    assert code == 0
    row = [line for line in out.splitlines() if line.startswith(vhost + "\t")]
    assert row and row[0].split("\t")[1] in ("undefined", "classic"), out
    conn = connect(params, vhost)
    try:
        ch = conn.channel()
        ch.queue_declare("plain", durable=True)
        ch.queue_declare("plain", durable=True, arguments={"x-queue-type": "classic"})
        ch.queue_delete("plain")
    finally:
        conn.close()
