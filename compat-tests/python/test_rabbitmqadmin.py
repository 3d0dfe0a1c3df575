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
