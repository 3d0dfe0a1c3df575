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


def _records(*args):
    with warren_process("--log-format", "json", *args) as w:
        conn = pika.BlockingConnection(pika.ConnectionParameters(host="127.0.0.1", port=w["port"]))
        conn.close()
        lines = w["log"].read_text().splitlines()
    return [json.loads(l) for l in lines if not l.startswith("warren: ") and l.strip()]


def test_log_levels_per_module():
    """`--log-level` is a filter with levels per module: one module's level overrides the
    default in either direction."""
    started = "AMQP 0-9-1 listener started"  # an info record of warren::server
    raised = _records("--log-level", "warn,warren::server=info")
    assert any(r["fields"].get("message") == started for r in raised)
    assert all(r["level"] in ("WARN", "ERROR") or r["target"] == "warren::server" for r in raised)
    lowered = _records("--log-level", "info,warren::server=warn")
    assert not any(r["fields"].get("message") == started for r in lowered)


def test_an_invalid_log_filter_is_refused():
    import subprocess
    from conftest import warren_binary
    p = subprocess.run([warren_binary(), "server", "--log-level", "info,warren=loud",
                        "--amqp-listen", "127.0.0.1:0", "--management-listen", "off",
                        "--prometheus-listen", "off", "--data-dir", "/nonexistent/never-made"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2
    assert "invalid --log-level" in p.stderr


def test_text_logs_are_plain_unless_written_to_a_terminal(tmp_path):
    """Goal: log files and pipes get no ANSI colour codes; a terminal still gets colour.
    Method: run text logs into a file and read it; run the same broker with stderr on a
    pseudo-terminal and read what reaches the terminal."""
    with warren_process("--log-level", "info") as w:
        conn = pika.BlockingConnection(pika.ConnectionParameters(host="127.0.0.1", port=w["port"]))
        conn.close()
        text = w["log"].read_text()
    assert "AMQP 0-9-1 listener started" in text and "INFO" in text
    assert "\x1b[" not in text, text[:500]

    import pty
    import select
    import signal
    import subprocess
    import time
    from conftest import free_port, warren_binary
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    p = subprocess.Popen(
        [warren_binary(), "server", "--amqp-listen", f"127.0.0.1:{free_port()}",
         "--management-listen", "off", "--prometheus-listen", "off",
         "--data-dir", str(tmp_path / "data"), "--log-level", "info"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=follower, env=env)
    os.close(follower)
    seen = b""
    try:
        deadline = time.monotonic() + 20
        while b"listener started" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                try:
                    seen += os.read(leader, 4096)
                except OSError:
                    break
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=15)
        os.close(leader)
    assert b"listener started" in seen, seen
    assert b"\x1b[" in seen, seen[:300]
