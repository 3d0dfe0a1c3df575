"""Policies set with `warren ctl set_policy` (rabbitmqctl's syntax): matching, precedence
against queue arguments, live application to existing queues, clearing."""

import pika

from amqp_helpers import counts, get_all, bodies_of, wait_until


def _set(ctl, name, pattern, definition, *extra):
    code, out = ctl("set_policy", name, pattern, definition, *extra)
    assert code == 0, out


def test_policy_limits_new_and_existing_queues(conn, ch, ctl, prefix, names):
    """A max-length policy applies to a queue declared afterwards and, at once, to one that
    already holds more messages."""
    old, new = names.q("p.old"), names.q("p.new")
    ch.queue_declare(old)
    ch.confirm_delivery()
    for i in range(5):
        ch.basic_publish("", old, b"%d" % i)
    policy = f"{prefix}.limit"
    _set(ctl, policy, f"^{prefix}\\.p\\.", '{"max-length": 2}', "--apply-to", "queues")
    try:
        wait_until(conn, lambda: counts(conn, old) == (2, 0))
        assert bodies_of(get_all(ch, old)) == [b"3", b"4"]
        ch.queue_declare(new)
        for i in range(3):
            ch.basic_publish("", new, b"%d" % i)
        assert counts(conn, new) == (2, 0)
    finally:
        ctl("clear_policy", policy)


def test_queue_argument_and_policy_the_smaller_limit_wins(conn, ch, ctl, prefix, names):
    """max-length in both the policy and the queue argument: the smaller applies."""
    q = names.q("prec")
    policy = f"{prefix}.prec"
    _set(ctl, policy, f"^{prefix}\\.prec", '{"max-length": 5}', "--apply-to", "queues")
    try:
        ch.queue_declare(q, arguments={"x-max-length": 1})
        ch.confirm_delivery()
        for i in range(3):
            ch.basic_publish("", q, b"%d" % i)
        assert counts(conn, q) == (1, 0)
    finally:
        ctl("clear_policy", policy)


def test_policy_ttl_and_dead_letter_exchange(conn, ch, ctl, prefix, names):
    """message-ttl and dead-letter-exchange from a policy dead-letter expired messages."""
    q, dead, dlx = names.q("ttl"), names.q("dead"), names.x("dlx")
    ch.exchange_declare(dlx, exchange_type="fanout")
    ch.queue_declare(dead)
    ch.queue_bind(dead, dlx)
    policy = f"{prefix}.ttl"
    _set(ctl, policy, f"^{prefix}\\.ttl", f'{{"message-ttl": 50, "dead-letter-exchange": "{dlx}"}}',
         "--apply-to", "queues")
    try:
        ch.queue_declare(q)
        ch.confirm_delivery()
        ch.basic_publish("", q, b"m")
        wait_until(conn, lambda: counts(conn, dead) == (1, 0))
        _, props, _ = ch.basic_get(dead, auto_ack=True)
        assert props.headers["x-death"][0]["reason"] == "expired"
    finally:
        ctl("clear_policy", policy)


def test_clearing_a_policy_lifts_it(conn, ch, ctl, prefix, names):
    """After clear_policy the queue takes messages beyond the former limit."""
    q = names.q("clr")
    policy = f"{prefix}.clr"
    _set(ctl, policy, f"^{prefix}\\.clr", '{"max-length": 1}', "--apply-to", "queues")
    ch.queue_declare(q)
    ch.confirm_delivery()
    ch.basic_publish("", q, b"a")
    ch.basic_publish("", q, b"b")
    assert counts(conn, q) == (1, 0)
    code, out = ctl("clear_policy", policy)
    assert code == 0, out
    ch.basic_publish("", q, b"c")
    assert counts(conn, q) == (2, 0)


def test_alternate_exchange_policy(conn, ch, ctl, prefix, names):
    """alternate-exchange from a policy catches unroutable messages of matching exchanges."""
    x, ae, caught = names.x("aepol"), names.x("ae"), names.q("caught")
    ch.exchange_declare(ae, exchange_type="fanout")
    ch.queue_declare(caught)
    ch.queue_bind(caught, ae)
    policy = f"{prefix}.ae"
    _set(ctl, policy, f"^{prefix}\\.aepol", f'{{"alternate-exchange": "{ae}"}}',
         "--apply-to", "exchanges")
    try:
        ch.exchange_declare(x, exchange_type="direct")
        ch.confirm_delivery()
        ch.basic_publish(x, "nobody", b"lost?")
        assert counts(conn, caught) == (1, 0)
    finally:
        ctl("clear_policy", policy)


def test_invalid_policy_is_refused(ctl, prefix):
    """An unknown definition key is refused and nothing is set."""
    code, out = ctl("set_policy", f"{prefix}.bad", ".*", '{"max-lenght": 1}')
    assert code != 0
