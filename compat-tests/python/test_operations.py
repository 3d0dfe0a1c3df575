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
    """Goal: log files and pipes get no ANSI colour codes; a terminal still gets colour, and
    NO_COLOR turns it off there too. Method: run text logs into a file and read it; run the
    broker with stderr on a pseudo-terminal, with and without NO_COLOR, and read what
    reaches the terminal."""
    with warren_process("--log-level", "info") as w:
        conn = pika.BlockingConnection(pika.ConnectionParameters(host="127.0.0.1", port=w["port"]))
        conn.close()
        text = w["log"].read_text()
    assert "AMQP 0-9-1 listener started" in text and "INFO" in text
    assert "\x1b[" not in text, text[:500]

    # On a terminal: colour, unless NO_COLOR is set.
    assert b"\x1b[" in _terminal_log(tmp_path / "tty", no_color=False)
    assert b"\x1b[" not in _terminal_log(tmp_path / "tty-no-color", no_color=True)


def _terminal_log(data_dir, no_color):
    """What a Warren whose stderr is a pseudo-terminal writes until its listener starts."""
    import pty
    import select
    import signal
    import subprocess
    import time
    from conftest import free_port, warren_binary
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    if no_color:
        env["NO_COLOR"] = "1"
    p = subprocess.Popen(
        [warren_binary(), "server", "--amqp-listen", f"127.0.0.1:{free_port()}",
         "--management-listen", "off", "--prometheus-listen", "off",
         "--data-dir", str(data_dir), "--log-level", "info"],
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
    return seen


def test_a_rabbitmq_conf_is_read_and_unknown_keys_are_reported(tmp_path):
    """Goal: an operator can start Warren from an existing rabbitmq.conf (sysctl-style): the
    keys Warren has take effect, the others are named in a warning. Method: a file with a
    default user, a heartbeat, a message size limit and two keys Warren lacks; the fresh node
    has that user (and no guest), offers that heartbeat, and its log names the two keys."""
    from pika.exceptions import ProbableAuthenticationError
    conf = tmp_path / "rabbitmq.conf"
    conf.write_text(
        "# from an existing RabbitMQ node\n"
        "default_user = ops\n"
        "default_pass = \"hunter2\"\n"
        "heartbeat = 17\n"
        "max_message_size = 1048576\n"
        "collect_statistics_interval = 10000\n"
        "cluster_formation.peer_discovery_backend = classic_config\n")
    with warren_process("--config", str(conf)) as w:
        params = pika.ConnectionParameters(
            host="127.0.0.1", port=w["port"], connection_attempts=1,
            credentials=pika.PlainCredentials("ops", "hunter2"))
        conn = pika.BlockingConnection(params)
        try:
            assert conn._impl.params.heartbeat == 17  # the server's offer, taken by pika
            ch = conn.channel()
            q = ch.queue_declare("", exclusive=True).method.queue
            ch.basic_publish("", q, b"x" * 1024)
            assert ch.basic_get(q, auto_ack=True)[2] == b"x" * 1024
            # max_message_size took effect: a body over it closes the channel with 406.
            from pika.exceptions import ChannelClosedByBroker
            with pytest.raises(ChannelClosedByBroker) as e:
                ch.basic_publish("", q, b"y" * (1048576 + 1))
                ch.queue_declare("", exclusive=True)
            assert e.value.reply_code == 406
        finally:
            conn.close()
        with pytest.raises(ProbableAuthenticationError):
            pika.BlockingConnection(pika.ConnectionParameters(
                host="127.0.0.1", port=w["port"], connection_attempts=1))
        log = w["log"].read_text()
    for key in ("collect_statistics_interval", "cluster_formation.peer_discovery_backend"):
        assert key in log, log
    assert "default_user" not in log and "heartbeat" not in log
