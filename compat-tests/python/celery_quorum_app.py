"""Celery app on a quorum queue (used by test_celery_quorum.py, imported by the test and the
worker). With quorum queues Celery uses its native delayed delivery for countdown/ETA tasks:
it builds topic exchanges, exchange-to-exchange bindings and quorum queues with TTL and
dead-lettering on the broker.

  WARREN_COMPAT_BROKER   broker URL
  WARREN_COMPAT_QQUEUE   unique quorum task queue name for this test run
"""

import os

from celery import Celery
from kombu import Queue

QUEUE = os.environ.get("WARREN_COMPAT_QQUEUE", "celery-quorum-compat")

app = Celery(
    "celery_quorum_app",
    broker=os.environ.get("WARREN_COMPAT_BROKER", "amqp://guest:guest@127.0.0.1:5672/%2F"),
    backend="rpc://",
)
app.conf.update(
    task_queues=[Queue(QUEUE, queue_arguments={"x-queue-type": "quorum"})],
    task_default_queue=QUEUE,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
    broker_transport_options={"confirm_publish": True},
    worker_prefetch_multiplier=1,
    task_acks_late=True,
)


@app.task
def mul(x, y):
    return x * y
