"""A real Celery worker consuming a quorum queue; countdown tasks go through Celery's native
delayed delivery (topic exchanges, exchange-to-exchange bindings, quorum queues with TTL and
dead-lettering)."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from test_celery import READY_DEADLINE_S, TASK_TIMEOUT_S, _wait_for_log

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def quorum_worker(amqp_url, tmp_path_factory):
    queue = f"compat.celery.qq.{uuid.uuid4().hex[:10]}"
    node = f"compat-qq-{uuid.uuid4().hex[:8]}@localhost"
    os.environ["WARREN_COMPAT_BROKER"] = amqp_url
    os.environ["WARREN_COMPAT_QQUEUE"] = queue
    log_path = tmp_path_factory.mktemp("celery-qq") / "worker.log"
    env = dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "celery_quorum_app", "worker",
             "--pool=solo", "-c", "1", "-Q", queue, "-n", node, "--loglevel=INFO"],
            cwd=str(HERE), env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        _wait_for_log(log_path, " ready.", proc, READY_DEADLINE_S)
        import celery_quorum_app

        yield {"proc": proc, "app": celery_quorum_app, "log": log_path, "queue": queue}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        try:
            import pika

            c = pika.BlockingConnection(pika.URLParameters(amqp_url))
            c.channel().queue_delete(queue)
            c.close()
        except Exception:
            pass


def test_celery_task_on_a_quorum_queue(quorum_worker):
    """A task published to a quorum queue is executed and its result returned."""
    assert quorum_worker["app"].mul.apply_async((6, 7)).get(timeout=TASK_TIMEOUT_S) == 42


def test_celery_countdown_uses_native_delayed_delivery(quorum_worker):
    """A countdown task waits at least its countdown (native delayed delivery through the
    broker's TTL + dead-letter topology), then runs."""
    started = time.monotonic()
    result = quorum_worker["app"].mul.apply_async((3, 5), countdown=2)
    assert result.get(timeout=TASK_TIMEOUT_S) == 15
    assert time.monotonic() - started >= 1.9
    log = quorum_worker["log"].read_text(errors="replace")
    assert "Connection to broker lost" not in log, log
    # The native delayed delivery topology exists on the broker (Celery declares it when the
    # worker finds quorum queues): the top-level delay exchange.
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(os.environ["WARREN_COMPAT_BROKER"]))
    try:
        conn.channel().exchange_declare("celery_delayed_27", passive=True)
    finally:
        conn.close()
