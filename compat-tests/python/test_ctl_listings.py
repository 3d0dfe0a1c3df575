"""rabbitmqctl's daily verbs: `warren ctl` serves them through the management API over its
admin socket; against RabbitMQ the same commands run through rabbitmqctl."""

import json

import pika
import pytest

from amqp_helpers import counts


def rows(out, header):
    """Tab-separated rows after the header line of a rabbitmqctl listing."""
    lines = out.splitlines()
    if header not in lines:
        return []
    return [tuple(l.split("\t")) for l in lines[lines.index(header) + 1:] if "\t" in l]


def test_list_queues_exchanges_bindings_and_consumers(ctl, ch, names):
    queue, x = names.q(), names.x()
    ch.queue_declare(queue)
    ch.exchange_declare(x, "topic")
    ch.queue_bind(queue, x, "a.*")
    for _ in range(2):
        ch.basic_publish("", queue, b"m")
    counts(ch.connection, queue)
    code, out = ctl("list_queues", "name", "messages")
    assert code == 0 and (queue, "2") in rows(out, "name\tmessages"), out
    code, out = ctl("list_exchanges", "name", "type")
    assert code == 0 and (x, "topic") in rows(out, "name\ttype"), out
    code, out = ctl("list_bindings", "source_name", "destination_name", "routing_key")
    assert code == 0 and (x, queue, "a.*") in rows(out, "source_name\tdestination_name\trouting_key"), out
    tag = ch.basic_consume(queue, lambda *a: None, auto_ack=False)
    code, out = ctl("list_consumers", "queue_name", "consumer_tag", "ack_required")
    assert code == 0 and (queue, tag, "true") in rows(out, "queue_name\tconsumer_tag\tack_required"), out
    code, out = ctl("list_channels", "user", "consumer_count")
    assert code == 0 and ("guest", "1") in rows(out, "user\tconsumer_count"), out
    ch.basic_cancel(tag)


def test_purge_and_delete_queue(ctl, ch, names):
    queue = names.q()
    ch.queue_declare(queue)
    ch.basic_publish("", queue, b"m")
    counts(ch.connection, queue)
    code, out = ctl("purge_queue", queue)
    assert code == 0, out
    assert counts(ch.connection, queue)[0] == 0
    code, out = ctl("delete_queue", queue)
    assert code == 0, out
    with pytest.raises(pika.exceptions.ChannelClosedByBroker):
        ch.queue_declare(queue, passive=True)


def test_list_and_close_connections(ctl, params):
    conn = pika.BlockingConnection(params)
    try:
        port = str(conn._impl._transport._sock.getsockname()[1])
        code, out = ctl("list_connections", "pid", "user", "peer_port")
        mine = [r for r in rows(out, "pid\tuser\tpeer_port") if r[2] == port]
        assert code == 0 and mine and mine[0][1] == "guest", out
        code, out = ctl("close_connection", mine[0][0], "maintenance window")
        assert code == 0, out
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as e:
            for _ in range(100):
                conn.process_data_events(time_limit=0.2)
        assert (e.value.reply_code, e.value.reply_text) == (
            320, "CONNECTION_FORCED - maintenance window")
    finally:
        if conn.is_open:
            conn.close()


def test_export_and_import_definitions(ctl, ch, names):
    import os
    import uuid
    from pathlib import Path
    queue = names.q()
    ch.queue_declare(queue, durable=True)
    # /tmp: RabbitMQ's node (another OS user) writes the file itself.
    path = Path("/tmp") / f"warren-defs-{uuid.uuid4().hex}.json"
    code, out = ctl("export_definitions", str(path))
    assert code == 0, out
    defs = json.loads(path.read_text())
    assert queue in [q["name"] for q in defs["queues"]]
    ch.queue_delete(queue)
    code, out = ctl("import_definitions", str(path))
    assert code == 0, out
    ch.queue_declare(queue, passive=True)  # back from the file
    os.unlink(path)


def test_status(ctl, ch):
    code, out = ctl("status")
    assert code == 0, out
    assert "Status of node" in out
    for section in ("Alarms", "Memory", "Listeners"):
        assert section in out, (section, out)
    assert "amqp" in out


def test_operator_policy_verbs(ctl, ch, names):
    """set_operator_policy caps a queue's length below what its own argument asks for."""
    queue = names.q()
    name = "cap-" + queue
    code, out = ctl("set_operator_policy", name, "^" + queue + "$", '{"max-length": 2}',
                    "--apply-to", "queues")
    assert code == 0, out
    try:
        ch.queue_declare(queue, arguments={"x-max-length": 10})
        for i in range(5):
            ch.basic_publish("", queue, f"m{i}".encode())
        assert counts(ch.connection, queue)[0] == 2
        code, out = ctl("list_operator_policies")
        assert code == 0 and name in out, out
    finally:
        code, out = ctl("clear_operator_policy", name)
        assert code == 0, out
    code, out = ctl("list_operator_policies")
    assert name not in out
