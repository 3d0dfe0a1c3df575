"""Celery app used by test_celery.py (imported both by the test process and by the worker
subprocess). Configuration comes from the environment so both sides agree:

  WARREN_COMPAT_BROKER   broker URL (the amqp_url fixture)
  WARREN_COMPAT_QUEUE    unique task queue name for this test run

Result backend is 'rpc://': results travel back as messages to a per-client reply queue
(no database needed), which exercises reply_to / correlation_id handling in the broker.
"""

import os

from celery import Celery

app = Celery(
    "celery_compat_app",
    broker=os.environ.get("WARREN_COMPAT_BROKER", "amqp://guest:guest@127.0.0.1:5672/%2F"),
    backend="rpc://",
)
app.conf.update(
    task_default_queue=os.environ.get("WARREN_COMPAT_QUEUE", "celery-compat"),
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    task_acks_late=True,
)


@app.task
def add(x, y):
    return x + y


@app.task
def fail(message):
    raise ValueError(message)
