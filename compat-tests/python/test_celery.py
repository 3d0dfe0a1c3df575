"""A real Celery worker (subprocess, solo pool) talking to the broker, with the rpc:// result backend."""

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
READY_DEADLINE_S = 30
TASK_TIMEOUT_S = 20


def _wait_for_log(path, needle, proc, deadline_s):
    """Bounded poll of the worker's log file for `needle` (the worker's own ready event)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if needle in text:
            return text
        if proc.poll() is not None:
            raise AssertionError(f"celery worker exited early ({proc.returncode}):\n{text}")
        time.sleep(0.1)
    raise AssertionError(f"celery worker not ready after {deadline_s}s:\n{path.read_text(errors='replace')}")


@contextlib.contextmanager
def run_worker(app_module, queue_env, amqp_url, tmp_path_factory, prefix):
    """Start a real Celery worker (solo pool) for `app_module` on a fresh queue, wait until it
    is ready, and stop it (then delete its queue and same-named exchange) afterwards."""
    queue = f"{prefix}.{uuid.uuid4().hex[:10]}"
    node = f"compat-{uuid.uuid4().hex[:8]}@localhost"
    os.environ["WARREN_COMPAT_BROKER"] = amqp_url
    os.environ[queue_env] = queue
    log_path = tmp_path_factory.mktemp("celery") / "worker.log"
    env = dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", app_module, "worker",
             "--pool=solo", "-c", "1", "-Q", queue, "-n", node, "--loglevel=INFO"],
            cwd=str(HERE), env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        _wait_for_log(log_path, " ready.", proc, READY_DEADLINE_S)
        # Import only after the env vars are set: the app reads them at import time.
        app = importlib.import_module(app_module)
        yield {"proc": proc, "app": app, "node": node, "log": log_path, "queue": queue}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # Clean up the task queue (declared durable by the worker) and its same-named
        # direct exchange. celery's shared celeryev / celery.pidbox / reply.celery.pidbox
        # exchanges are left alone, as on any broker that has seen a worker.
        try:
            import pika

            c = pika.BlockingConnection(pika.URLParameters(amqp_url))
            cch = c.channel()
            cch.queue_delete(queue)
            cch.exchange_delete(queue)
            c.close()
        except Exception:
            pass


@pytest.fixture(scope="module")
def celery_worker(amqp_url, tmp_path_factory):
    with run_worker("celery_compat_app", "WARREN_COMPAT_QUEUE", amqp_url, tmp_path_factory,
                    "compat.celery") as worker:
        yield worker


def test_celery_add_round_trip(celery_worker):
    """add.delay(2, 3) executed by a real worker returns 5 through the rpc:// backend."""
    add = celery_worker["app"].add
    result = add.apply_async((2, 3))
    assert result.get(timeout=TASK_TIMEOUT_S) == 5
    assert result.successful()


def test_celery_many_tasks(celery_worker):
    """Several queued tasks are all executed and each result is routed to its own AsyncResult."""
    add = celery_worker["app"].add
    results = [add.apply_async((i, i)) for i in range(10)]
    assert [r.get(timeout=TASK_TIMEOUT_S) for r in results] == [2 * i for i in range(10)]


def test_celery_task_failure_propagates(celery_worker):
    """An exception raised in the task is re-raised by result.get() in the caller."""
    fail = celery_worker["app"].fail
    result = fail.apply_async(("boom",))
    with pytest.raises(ValueError, match="boom"):
        result.get(timeout=TASK_TIMEOUT_S)
    assert result.state == "FAILURE"


def test_celery_control_ping(celery_worker):
    """A broadcast control ping (pidbox fanout exchange + reply queue) is answered by the worker."""
    app = celery_worker["app"].app
    replies = app.control.ping(destination=[celery_worker["node"]], timeout=5)
    assert replies == [{celery_worker["node"]: {"ok": "pong"}}]


def test_celery_worker_warm_shutdown(celery_worker):
    """SIGTERM makes the worker shut down cleanly (exit code 0) within the deadline."""
    proc = celery_worker["proc"]
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=20)
    log = celery_worker["log"].read_text(errors="replace")
    assert rc == 0, log
    # The only ERROR lines allowed are the deliberate failure of the `fail` task; broker
    # trouble shows up as "consumer: Cannot connect" / "Connection to broker lost" errors.
    unexpected = [line for line in log.splitlines()
                  if ("ERROR/" in line or "CRITICAL/" in line)
                  and "celery_compat_app.fail" not in line]
    assert not unexpected, log
    assert "Connection to broker lost" not in log, log
