"""Frames are handled strictly in order, even when several arrive in one TCP segment."""

import struct

import pytest

import wire
from wire import WireClient


@pytest.fixture
def client(params):
    c = WireClient(params.host, params.port)
    c.handshake()
    yield c
    c.close()


def test_commands_before_channel_close_in_one_write_are_all_answered_in_order(client, names):
    """queue.declare x2 then channel.close in a single write: both declare-oks, then close-ok."""
    q1, q2 = names.q(), names.q()
    client.open_channel(1)
    client.send(wire.queue_declare(1, q1) + wire.queue_declare(1, q2)
                + wire.method(1, wire.CHANNEL_CLOSE, struct.pack(">H", 200) + wire.shortstr("bye")
                              + struct.pack(">HH", 0, 0)))
    first = client.expect_method(wire.QUEUE_DECLARE_OK, channel=1)
    second = client.expect_method(wire.QUEUE_DECLARE_OK, channel=1)
    assert wire.shortstr(q1) in first.payload and wire.shortstr(q2) in second.payload
    client.expect_method(wire.CHANNEL_CLOSE_OK, channel=1)
    # The declares really happened: a passive declare on a new channel finds both queues.
    client.open_channel(2)
    client.send(wire.queue_declare(2, q1, passive=True) + wire.queue_declare(2, q2, passive=True))
    client.expect_method(wire.QUEUE_DECLARE_OK, channel=2)
    client.expect_method(wire.QUEUE_DECLARE_OK, channel=2)
