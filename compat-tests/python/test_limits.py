"""Vhost and user limits (rabbitmqctl set_vhost_limits / set_user_limits) with RabbitMQ's
refusals. Runs against RabbitMQ too (WARREN_TEST_AMQP_URL)."""

import contextlib
import json

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker, ConnectionClosedByBroker, ProbableAccessDeniedError


def connect(params, vhost="/", user="guest", password="guest"):
    return pika.BlockingConnection(pika.ConnectionParameters(
        host=params.host, port=params.port, virtual_host=vhost,
        credentials=pika.PlainCredentials(user, password), connection_attempts=1))


@pytest.fixture
def vhost(ctl, prefix):
    name = prefix.replace("compat.", "lim.")[:60]
    ctl("add_vhost", name)
    ctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
    yield name
    ctl("delete_vhost", name)


@pytest.fixture
def user(ctl, prefix):
    name = prefix.replace("compat.", "lu.")[:60]
    ctl("add_user", name, "pw")
    ctl("set_permissions", name, ".*", ".*", ".*")
    yield name
    ctl("delete_user", name)


def limits_listed(out):
    return json.loads(out.strip().splitlines()[-1])


def test_vhost_connection_limit(ctl, params, vhost):
    assert ctl("set_vhost_limits", "-p", vhost, '{"max-connections": 1}')[0] == 0
    assert limits_listed(ctl("list_vhost_limits", "-p", vhost)[1]) == {"max-connections": 1}
    first = connect(params, vhost)
    try:
        with pytest.raises(ProbableAccessDeniedError) as e:
            connect(params, vhost)
        assert (f"NOT_ALLOWED - access to vhost '{vhost}' refused for user 'guest': "
                f"connection limit (1) is reached") in str(e.value)
    finally:
        first.close()
    # The slot is free again once the first connection closed.
    connect(params, vhost).close()
    # Cleared, the vhost has no limits and takes two connections.
    assert ctl("clear_vhost_limits", "-p", vhost)[0] == 0
    assert limits_listed(ctl("list_vhost_limits", "-p", vhost)[1]) == {}
    two = [connect(params, vhost), connect(params, vhost)]
    for c in two:
        c.close()


def test_vhost_queue_limit(ctl, params, vhost):
    ctl("set_vhost_limits", "-p", vhost, '{"max-queues": 1}')
    conn = connect(params, vhost)
    try:
        ch = conn.channel()
        ch.queue_declare("q1")
        ch.queue_declare("q1")  # redeclaring an existing queue is fine
        with pytest.raises(ChannelClosedByBroker) as e:
            ch.queue_declare("q2")
        assert e.value.reply_code == 406
        assert e.value.reply_text == (
            f"PRECONDITION_FAILED - cannot declare queue 'q2': queue limit in vhost '{vhost}' "
            f"(1) is reached")
    finally:
        conn.close()


def test_user_connection_and_channel_limits(ctl, params, user):
    assert ctl("set_user_limits", user, '{"max-connections": 1, "max-channels": 2}')[0] == 0
    assert limits_listed(ctl("list_user_limits", "--user", user)[1]) == {
        "max-connections": 1, "max-channels": 2}
    conn = connect(params, user=user, password="pw")
    try:
        with pytest.raises(ProbableAccessDeniedError) as e:
            connect(params, user=user, password="pw")
        assert (f"NOT_ALLOWED - connection refused for user '{user}': user connection limit (1) "
                f"is reached") in str(e.value)
        conn.channel()
        conn.channel()
        with pytest.raises(ConnectionClosedByBroker) as e:
            conn.channel()
        assert e.value.reply_code == 530
        assert e.value.reply_text == (
            f"NOT_ALLOWED - number of channels opened for user '{user}' has reached the maximum "
            f"allowed user limit of (2)")
    finally:
        if conn.is_open:
            conn.close()
    assert ctl("clear_user_limits", user, "all")[0] == 0
    a = connect(params, user=user, password="pw")
    b = connect(params, user=user, password="pw")
    a.close()
    b.close()


# Node-wide limits live in the configuration file (rabbitmq.conf's connection_max and
# consumer_max_per_channel), so these start a Warren of their own. The refusal texts are
# rabbit_reader's and rabbit_channel's.

@contextlib.contextmanager
def configured_broker(tmp_path, config):
    """A Warren of our own started with `config` as its TOML file; yields its parameters."""
    from conftest import warren_process
    cfg = tmp_path / "warren.toml"
    cfg.write_text(config)
    with warren_process("--config", str(cfg)) as w:
        yield pika.ConnectionParameters(host="127.0.0.1", port=w["port"])


@pytest.mark.warren_only
def test_node_connection_max(tmp_path):
    with configured_broker(tmp_path, "connection_max = 2\n") as params:
        first, second = connect(params), connect(params)
        try:
            with pytest.raises(ProbableAccessDeniedError) as e:
                connect(params)
            assert "NOT_ALLOWED - connection refused: node connection limit (2) is reached" \
                in str(e.value)
        finally:
            first.close()
        # A slot is free again once a connection closed; the others were unaffected.
        connect(params).close()
        assert second.channel().is_open
        second.close()


@pytest.mark.warren_only
def test_consumer_max_per_channel(tmp_path):
    with configured_broker(tmp_path, "consumer_max_per_channel = 2\n") as params:
        conn = connect(params)
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.basic_consume(q, lambda *a: None)
        ch.basic_consume(q, lambda *a: None)
        # Another channel has its own allowance.
        other = conn.channel()
        other.basic_consume(q, lambda *a: None)
        with pytest.raises(ConnectionClosedByBroker) as e:
            ch.basic_consume(q, lambda *a: None)
        assert e.value.reply_code == 530
        assert e.value.reply_text == "NOT_ALLOWED - reached maximum (2) of consumers per channel"


@pytest.mark.warren_only
def test_message_size_max_can_be_raised_for_large_messages(tmp_path):
    """Goal: the 16 MiB default (RabbitMQ 4's max_message_size) can be raised, as RabbitMQ
    allows up to 512 MiB, for clients that publish large bodies (Bunny's suite publishes
    32 MB). Method: a Warren with message_size_max = 40 MiB takes a 32 MB message and gives
    it back whole; one past the limit is still refused with 406."""
    with configured_broker(tmp_path, "message_size_max = 41943040\n") as params:
        conn = connect(params)
        try:
            ch = conn.channel()
            q = ch.queue_declare("", exclusive=True).method.queue
            body = bytes(range(256)) * (32 * 1024 * 1024 // 256)
            ch.basic_publish("", q, body)
            _, _, got = ch.basic_get(q, auto_ack=True)
            assert got == body
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
                ch.basic_publish("", q, b"x" * (41943040 + 1))
                ch.queue_declare("", exclusive=True)
            assert e.value.reply_code == 406
        finally:
            conn.close()
