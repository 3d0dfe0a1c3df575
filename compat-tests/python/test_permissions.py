"""RabbitMQ's permission table, enforced per operation: a user whose configure / write / read
patterns leave something out gets 403 ACCESS_REFUSED (a channel error) with RabbitMQ's text.
Runs against RabbitMQ too (WARREN_TEST_AMQP_URL), through rabbitmqctl."""

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker


@pytest.fixture
def user(ctl, prefix):
    name = prefix.replace("compat.", "p.")[:60]
    assert ctl("add_user", name, "pw")[0] == 0
    yield name
    ctl("delete_user", name)


@pytest.fixture
def as_user(params, user):
    opened = []

    def connect():
        conn = pika.BlockingConnection(pika.ConnectionParameters(
            host=params.host, port=params.port, virtual_host="/",
            credentials=pika.PlainCredentials(user, "pw"), connection_attempts=1))
        opened.append(conn)
        return conn

    yield connect
    for c in opened:
        if c.is_open:
            c.close()


def refused(e, kind, name, user):
    assert e.value.reply_code == 403, e.value
    assert e.value.reply_text == (
        f"ACCESS_REFUSED - access to {kind} '{name}' in vhost '/' refused for user '{user}'"), e.value


def test_configure_pattern_limits_what_can_be_declared_and_deleted(ctl, as_user, user, prefix, names):
    mine = names.q("mine")
    other = names.q("other")
    ctl("set_permissions", user, "^" + mine.replace(".", r"\.") + "$", ".*", ".*")
    ch = as_user().channel()
    ch.queue_declare(mine, auto_delete=True)
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare(other)
    refused(e, "queue", other, user)
    ch = as_user().channel()
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.exchange_declare(names.x("x"), "fanout")
    refused(e, "exchange", names.exchanges[-1], user)


def test_passive_declare_needs_no_permission(ctl, ch, as_user, user, names):
    q = names.q()
    ch.queue_declare(q)
    ctl("set_permissions", user, "", "", "")
    uch = as_user().channel()
    assert uch.queue_declare(q, passive=True).method.queue == q


def test_publishing_needs_write_on_the_exchange(ctl, as_user, user, names):
    ctl("set_permissions", user, ".*", "^nothing$", ".*")
    ch = as_user().channel()
    ch.confirm_delivery()
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.basic_publish("", names.q(), b"x")
    refused(e, "exchange", "amq.default", user)


def test_get_consume_and_purge_need_read_on_the_queue(ctl, ch, as_user, user, names):
    q = names.q()
    ch.queue_declare(q)
    ctl("set_permissions", user, ".*", ".*", "^nothing$")
    for op in (lambda c: c.basic_get(q),
               lambda c: c.basic_consume(q, lambda *a: None),
               lambda c: c.queue_purge(q)):
        uch = as_user().channel()
        with pytest.raises(ChannelClosedByBroker) as e:
            op(uch)
        refused(e, "queue", q, user)


def test_binding_needs_write_on_the_queue_and_read_on_the_exchange(ctl, ch, as_user, user, names):
    q = names.q()
    ch.queue_declare(q)
    ctl("set_permissions", user, ".*", ".*", "^nothing$")
    uch = as_user().channel()
    with pytest.raises(ChannelClosedByBroker) as e:
        uch.queue_bind(q, "amq.fanout")
    refused(e, "exchange", "amq.fanout", user)
    ctl("set_permissions", user, ".*", "^nothing$", ".*")
    uch = as_user().channel()
    with pytest.raises(ChannelClosedByBroker) as e:
        uch.queue_bind(q, "amq.fanout")
    refused(e, "queue", q, user)


def test_dead_letter_exchange_needs_write_on_it(ctl, as_user, user, names):
    ctl("set_permissions", user, ".*", "^nothing$", ".*")
    ch = as_user().channel()
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare(names.q(), arguments={"x-dead-letter-exchange": "amq.direct"})
    refused(e, "exchange", "amq.direct", user)


def test_a_permission_change_applies_to_open_connections(ctl, as_user, user, names):
    ctl("set_permissions", user, ".*", ".*", ".*")
    conn = as_user()
    ch = conn.channel()
    ch.queue_declare(names.q("first"), auto_delete=True)
    ctl("set_permissions", user, "^nothing$", ".*", ".*")
    second = names.q("second")
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare(second)
    refused(e, "queue", second, user)


def topic_rows(out):
    return [tuple(l.split("\t")) for l in out.splitlines() if l.count("\t") == 3
            and not l.startswith(("user\t", "vhost\t"))]


def test_topic_permissions_constrain_routing_and_binding_keys(ctl, as_user, user, names):
    ctl("set_permissions", user, ".*", ".*", ".*")
    assert ctl("set_topic_permissions", user, "amq.topic", r"^{username}\.", r"^allowed\.")[0] == 0
    code, out = ctl("list_topic_permissions", "-p", "/")
    assert (user, "amq.topic", r"^{username}\.", r"^allowed\.") in topic_rows(out)
    conn = as_user()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("amq.topic", f"{user}.ok", b"x")  # {username} expanded
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.basic_publish("amq.topic", "other.key", b"x")
    assert e.value.reply_code == 403
    assert e.value.reply_text == (f"ACCESS_REFUSED - access to topic 'other.key' in exchange "
                                  f"'amq.topic' in vhost '/' refused for user '{user}'")
    ch = conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, "amq.topic", "allowed.x")
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_bind(q, "amq.topic", "other.x")
    assert e.value.reply_text == (f"ACCESS_REFUSED - access to topic 'other.x' in exchange "
                                  f"'amq.topic' in vhost '/' refused for user '{user}'")
    # Other exchanges and exchange types are not constrained.
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("amq.direct", "other.key", b"x")
    assert ctl("set_topic_permissions", user, "other.topic", ".*", ".*")[0] == 0
    assert ctl("clear_topic_permissions", user, "amq.topic")[0] == 0
    # Only that exchange's entry went.
    mine = [r for r in topic_rows(ctl("list_topic_permissions", "-p", "/")[1]) if r[0] == user]
    assert mine == [(user, "other.topic", ".*", ".*")], mine
    ch.basic_publish("amq.topic", "other.key", b"x")
