"""Operational behaviour documented in docs/operations.md: structured logs and the listener
announcements scripts wait for."""

import json
import os

import pika
import pytest

from conftest import warren_process

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("WARREN_TEST_AMQP_URL")), reason="starts a Warren of its own")


def test_json_logs_and_listener_lines():
    with warren_process("--log-format", "json", "--log-level", "info") as w:
        conn = pika.BlockingConnection(pika.ConnectionParameters(host="127.0.0.1", port=w["port"]))
        conn.close()
        lines = w["log"].read_text().splitlines()
    announcements = [l for l in lines if l.startswith("warren: ")]
    assert any(l.startswith("warren: amqp listening on 127.0.0.1:") for l in announcements)
    assert any(l.startswith("warren: management listening on ") for l in announcements)
    assert any(l.startswith("warren: prometheus listening on ") for l in announcements)
    records = [json.loads(l) for l in lines if not l.startswith("warren: ") and l.strip()]
    assert records, "info-level records were written"
    for r in records:
        assert {"timestamp", "level", "fields", "target"} <= r.keys()
    assert any(r["fields"].get("message") == "AMQP 0-9-1 listener started" for r in records)
