"""Connection-level behaviour: handshake, server properties, authentication, vhosts."""

import pika
import pytest
from pika.exceptions import (
    ConnectionClosedByBroker,
    ProbableAccessDeniedError,
    ProbableAuthenticationError,
)

REQUIRED_CAPABILITIES = [
    "publisher_confirms",
    "exchange_exchange_bindings",
    "basic.nack",
    "consumer_cancel_notify",
    "connection.blocked",
    "consumer_priorities",
    "authentication_failure_close",
    "per_consumer_qos",
    "direct_reply_to",
]


def _reply_code(exc):
    """pika wraps the broker's Connection.Close in Probable*Error during the handshake;
    dig out the original ConnectionClosedByBroker's reply code."""
    if isinstance(exc, ConnectionClosedByBroker):
        return exc.reply_code
    for arg in exc.args:
        if isinstance(arg, ConnectionClosedByBroker):
            return arg.reply_code
    text = str(exc)
    for code in (403, 530):
        if f"({code})" in text:
            return code
    return None


def test_connect_and_server_capabilities(conn):
    """A plain connect succeeds and connection.start advertises every capability pika/kombu/celery rely on."""
    props = conn._impl.server_properties
    caps = props.get("capabilities")
    assert isinstance(caps, dict), props
    for cap in REQUIRED_CAPABILITIES:
        assert caps.get(cap) is True, f"capability {cap!r} missing/false in {caps}"
    # RabbitMQ sends these informational string properties; clients log them.
    for key in ("product", "version", "platform"):
        assert isinstance(props.get(key), str) and props[key], (key, props)


def test_server_identity_is_rabbitmq_compatible(conn):
    """Goal: clients that branch on the server's identity behave as with RabbitMQ (kombu's
    qos_semantics_matches_spec needs product == "RabbitMQ", which changes Celery's prefetch).
    Method: read connection.start's product and version, and ask kombu what it concluded."""
    import os
    import kombu
    props = conn._impl.server_properties
    assert props["product"] == "RabbitMQ", props
    major = int(props["version"].split(".")[0])
    assert major >= 3, props
    if not os.environ.get("WARREN_TEST_AMQP_URL"):
        assert props["version"] == "4.2.0", props
        # Warren names itself where RabbitMQ names Erlang/OTP and its licence.
        assert props["platform"].startswith("Warren "), props
        assert "Warren" in props["information"], props
    p = conn._impl.params
    with kombu.Connection(f"amqp://guest:guest@{p.host}:{p.port}//") as k:
        k.connect()
        # kombu 5.7: RabbitMQ 3.3-3.x applies prefetch per channel, 4.x per consumer.
        assert k.qos_semantics_matches_spec is (major >= 4)


@pytest.mark.warren_only
def test_advertised_identity_is_a_setting(tmp_path):
    """Goal: an operator can make Warren advertise its own name (RabbitMQ's product.name and
    product.version settings). Method: start a Warren whose file sets product_name and
    product_version; connection.start and /api/overview report them."""
    import json
    import urllib.request
    from base64 import b64encode
    from conftest import warren_process
    cfg = tmp_path / "warren.toml"
    cfg.write_text('product_name = "Warren"\nproduct_version = "0.1.0"\n')
    with warren_process("--config", str(cfg)) as w:
        c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", w["port"]))
        try:
            props = c._impl.server_properties
            assert (props["product"], props["version"]) == ("Warren", "0.1.0"), props
        finally:
            c.close()
        req = urllib.request.Request(
            f"http://127.0.0.1:{w['management_port']}/api/overview",
            headers={"Authorization": "Basic " + b64encode(b"guest:guest").decode()})
        with urllib.request.urlopen(req, timeout=10) as r:
            overview = json.load(r)
        assert (overview["product_name"], overview["product_version"]) == ("Warren", "0.1.0")
        assert overview["rabbitmq_version"] == "4.2.0"


def test_channel_open_close_many(conn):
    """Many channels can be opened and closed on one connection and each gets a distinct number."""
    chans = [conn.channel() for _ in range(20)]
    numbers = {c.channel_number for c in chans}
    assert len(numbers) == 20
    for c in chans:
        assert c.is_open
        c.close()
        assert c.is_closed
    assert conn.is_open


def test_negotiated_tuning(conn):
    """Tune negotiation yields a sane frame_max (>= 4096) and a channel_max that allows many channels."""
    p = conn._impl.params
    assert p.frame_max >= 4096
    assert p.channel_max == 0 or p.channel_max >= 100


def test_wrong_password_is_refused(amqp_url):
    """A wrong password is refused with ACCESS_REFUSED (403) which pika reports as an authentication error."""
    params = pika.URLParameters(amqp_url)
    params.credentials = pika.PlainCredentials("guest", "definitely-wrong")
    params.connection_attempts = 1
    with pytest.raises((ProbableAuthenticationError, ConnectionClosedByBroker)) as info:
        pika.BlockingConnection(params)
    assert _reply_code(info.value) == 403, repr(info.value)
    # RabbitMQ: "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN.
    # For details see the broker logfile."
    assert "ACCESS_REFUSED" in str(info.value)


def test_unknown_user_is_refused(amqp_url):
    """An unknown user is refused exactly like a wrong password (403, no user enumeration)."""
    params = pika.URLParameters(amqp_url)
    params.credentials = pika.PlainCredentials("no-such-user-xyz", "guest")
    params.connection_attempts = 1
    with pytest.raises((ProbableAuthenticationError, ConnectionClosedByBroker)) as info:
        pika.BlockingConnection(params)
    assert _reply_code(info.value) == 403, repr(info.value)


def test_wrong_vhost_is_not_allowed(amqp_url):
    """Opening a vhost that does not exist is refused with NOT_ALLOWED (530)."""
    params = pika.URLParameters(amqp_url)
    params.virtual_host = "no-such-vhost-compat"
    params.connection_attempts = 1
    with pytest.raises((ProbableAccessDeniedError, ConnectionClosedByBroker)) as info:
        pika.BlockingConnection(params)
    assert _reply_code(info.value) == 530, repr(info.value)
    # RabbitMQ 3.10 and 4.x: "NOT_ALLOWED - vhost no-such-vhost-compat not found"
    assert "NOT_ALLOWED" in str(info.value)


def test_connection_close_is_clean(params):
    """A client-initiated connection.close completes and leaves the connection closed."""
    c = pika.BlockingConnection(params)
    ch = c.channel()
    ch.queue_declare("", exclusive=True)
    c.close()
    assert c.is_closed
