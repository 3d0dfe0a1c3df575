"""A real Celery worker consuming a quorum queue; countdown tasks go through Celery's native
delayed delivery (topic exchanges, exchange-to-exchange bindings, quorum queues with TTL and
dead-lettering)."""

import os
import time

import pytest

from test_celery import TASK_TIMEOUT_S, run_worker


@pytest.fixture(scope="module")
def quorum_worker(amqp_url, tmp_path_factory):
    with run_worker("celery_quorum_app", "WARREN_COMPAT_QQUEUE", amqp_url, tmp_path_factory,
                    "compat.celery.qq") as worker:
        yield worker


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
