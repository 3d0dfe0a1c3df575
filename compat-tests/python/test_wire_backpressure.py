"""A consumer that stops reading its socket must not make the broker buffer its queue."""

import pika
import pytest

import wire
from amqp_helpers import counts
from wire import WireClient

MESSAGES = 100
BODY = b"x" * (1024 * 1024)


@pytest.mark.warren_only
def test_non_reading_consumer_leaves_messages_in_the_queue(conn, params, names):
    """100 x 1 MiB messages for a no-ack consumer that never reads: the broker hands over only
    what fits its per-consumer byte window plus the kernel's socket buffers, so most messages
    stay ready in the queue instead of piling up in the broker's output buffer."""
    q = names.q()
    setup = conn.channel()
    setup.queue_declare(q)
    stalled = WireClient(params.host, params.port)
    try:
        stalled.handshake()
        stalled.open_channel(1)
        stalled.send(wire.basic_consume(1, q, consumer_tag="stalled", no_ack=True))
        stalled.expect_method((60, 21), channel=1)
        # From here on the client reads nothing.
        pub = conn.channel()
        pub.confirm_delivery()
        for _ in range(MESSAGES):
            pub.basic_publish("", q, BODY)
        ready, consumers = counts(conn, q)
        assert consumers == 1
        # Window (4 MiB) + socket buffers (a few MiB on loopback) is far below half the queue.
        assert ready >= MESSAGES // 2, f"only {ready} of {MESSAGES} messages left in the queue"
        # The connection with the stalled consumer is still alive and the others unaffected.
        assert conn.is_open
    finally:
        stalled.close()
    # Once the stalled connection is gone its consumer goes; the messages are still there
    # (no-ack deliveries already written are gone, the rest remain).
    setup.queue_delete(q)
