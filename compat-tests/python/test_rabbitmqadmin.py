"""The official rabbitmqadmin v2 CLI against the broker's management API (the test command
builds it once into .cache/rabbitmqadmin; RABBITMQADMIN names the binary)."""

import json
import os
import subprocess
import urllib.parse
import uuid

import pytest

BINARY = os.environ.get("RABBITMQADMIN", "")

pytestmark = pytest.mark.skipif(
    not (BINARY and os.path.exists(BINARY)),
    reason="RABBITMQADMIN does not name a rabbitmqadmin binary (the test command builds one)")


@pytest.fixture
def admin(management_url):
    u = urllib.parse.urlparse(management_url)

    def run(*args, ok=True):
        p = subprocess.run(
            [BINARY, "--host", u.hostname, "--port", str(u.port), "--username", "guest",
             "--password", "guest", *args],
            capture_output=True, text=True, timeout=60)
        if ok:
            assert p.returncode == 0, f"{args}: {p.stdout}{p.stderr}"
        return p
    return run


def test_rabbitmqadmin_declares_lists_and_deletes(admin, prefix):
    queue, x, vhost = f"{prefix}.q", f"{prefix}.x", prefix.replace("compat.", "ra.")[:60]
    admin("declare", "queue", "--name", queue, "--durable", "true")
    admin("declare", "exchange", "--name", x, "--type", "topic")
    admin("declare", "binding", "--source", x, "--destination-type", "queue",
          "--destination", queue, "--routing-key", "a.*")
    out = admin("list", "queues").stdout
    assert queue in out
    out = admin("list", "bindings").stdout
    assert x in out and "a.*" in out
    out = admin("publish", "message", "--routing-key", queue, "--payload", "hello").stdout
    assert "routed" in out.lower()
    out = admin("get", "messages", "--queue", queue).stdout
    assert "hello" in out
    admin("purge", "queue", "--name", queue)
    admin("delete", "binding", "--source", x, "--destination-type", "queue",
          "--destination", queue, "--routing-key", "a.*")
    assert "a.*" not in admin("list", "bindings").stdout
    admin("declare", "vhost", "--name", vhost)
    assert vhost in admin("list", "vhosts").stdout
    admin("delete", "vhost", "--name", vhost)
    admin("delete", "queue", "--name", queue)
    admin("delete", "exchange", "--name", x)
    assert queue not in admin("list", "queues").stdout


def test_rabbitmqadmin_overview_health_and_definitions(admin, tmp_path):
    out = admin("show", "overview").stdout
    assert "RabbitMQ version" in out
    assert "passed" in admin("health_check", "local_alarms").stdout
    path = tmp_path / f"defs-{uuid.uuid4().hex}.json"
    admin("definitions", "export", "--file", str(path))
    defs = json.loads(path.read_text())
    assert "guest" in [u["name"] for u in defs["users"]]
    admin("definitions", "import", "--file", str(path))


def test_rabbitmqadmin_users_permissions_and_policies(admin, prefix):
    user, pol, op = f"{prefix}.u", f"{prefix}.p", f"{prefix}.op"
    admin("declare", "user", "--name", user, "--password", "pw", "--tags", "monitoring")
    try:
        out = admin("list", "users").stdout
        assert user in out and "monitoring" in out
        admin("declare", "permissions", "--username", user, "--configure", "^cfg",
              "--read", ".*", "--write", "^w")
        out = admin("list", "permissions").stdout
        assert user in out and "^cfg" in out
        admin("delete", "permissions", "--username", user)
        assert user not in admin("list", "permissions").stdout
    finally:
        admin("delete", "user", "--name", user)
    assert user not in admin("list", "users").stdout
    admin("declare", "policy", "--name", pol, "--pattern", "^nothing-here$", "--apply-to",
          "queues", "--definition", '{"max-length": 7}')
    out = admin("list", "policies").stdout
    assert pol in out and "max-length" in out
    admin("delete", "policy", "--name", pol)
    assert pol not in admin("list", "policies").stdout
    admin("declare", "operator_policy", "--name", op, "--pattern", "^nothing-here$",
          "--apply-to", "queues", "--definition", '{"max-length": 9}')
    assert op in admin("list", "operator_policies").stdout
    admin("delete", "operator_policy", "--name", op)
    assert op not in admin("list", "operator_policies").stdout


def test_rabbitmqadmin_closes_a_connection_and_checks_listeners(admin, amqp_url, management_url):
    import pika
    params = pika.URLParameters(amqp_url)
    params.client_properties = {"connection_name": "ra-close-" + uuid.uuid4().hex}
    conn = pika.BlockingConnection(params)
    try:
        wanted = params.client_properties["connection_name"]
        # The connection's name (what the API calls it; rabbitmqadmin's table shows it but not
        # the client-provided name) comes from the management API.
        from test_management import eventually, http

        def named():
            listed = http("GET", management_url + "/api/connections")[1]
            return [c["name"] for c in listed
                    if c.get("client_properties", {}).get("connection_name") == wanted]
        found = eventually(named, bool)  # RabbitMQ lists connections after a stats interval
        assert found, "the connection is listed"
        name = found[0]
        assert name in admin("list", "connections").stdout
        admin("close", "connection", "--name", name)
        with pytest.raises(pika.exceptions.ConnectionClosed):
            conn.process_data_events(time_limit=10)
            conn.channel()
    finally:
        if conn.is_open:
            conn.close()
    port = urllib.parse.urlparse(amqp_url).port or 5672
    assert admin("health_check", "port_listener", "--port", str(port)).returncode == 0
    assert admin("health_check", "port_listener", "--port", "1", ok=False).returncode != 0
    assert admin("health_check", "protocol_listener", "--protocol", "amqp").returncode == 0
    assert admin("health_check", "cluster_wide_alarms").returncode == 0
