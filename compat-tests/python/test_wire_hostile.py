"""Hostile input against the real broker (issue 6): each case asserts RabbitMQ's exact answer
(checked against RabbitMQ 3.10 with WARREN_TEST_AMQP_URL), that another connection still
works afterwards, and, against Warren, that the broker's memory stays bounded.

The cases already covered in test_wire_protocol.py (wrong protocol header, 1 GiB length
prefix, bad frame end, unknown frame type, deep tables, body over the size limit, length
prefixes past the end of a method) are not repeated here."""

import os
import socket
import struct
import time

import pytest

import wire
from conftest import broker_pid
from wire import ServerClosed, WireClient, assert_broker_alive

EXTERNAL_BROKER = bool(os.environ.get("WARREN_TEST_AMQP_URL"))
EOF_AFTER_CLOSE_S = 5.0
# RabbitMQ's handshake_timeout (and Warren's): 10 s, plus slack for a loaded CI machine.
HANDSHAKE_TIMEOUT_BOUND_S = 20.0


@pytest.fixture
def addr(params):
    return params.host, params.port


def rss_kb():
    """The broker's resident set in KiB (None against an external broker)."""
    pid = broker_pid()
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


def assert_rss_growth_below(before_kb, bound_kb, what):
    after = rss_kb()
    if before_kb is None or after is None:
        return
    assert after - before_kb < bound_kb, f"{what}: broker RSS grew {after - before_kb} KiB"


def close_of(c):
    close = c.expect_connection_close(eof_timeout=EOF_AFTER_CLOSE_S)
    return close.reply_code, close.reply_text, close.class_id, close.method_id


def assert_dropped_without_close(c):
    """The server closes the socket and sends no connection.close first (RabbitMQ during
    the `starting` and `tuning` handshake states)."""
    frames = c.expect_eof(timeout=EOF_AFTER_CLOSE_S)
    assert not [f for f in frames if f.type == wire.FRAME_METHOD
                and wire.method_id(f) == wire.CONNECTION_CLOSE], frames


def up_to_start(addr):
    c = WireClient(*addr)
    c.send(wire.PROTOCOL_HEADER)
    c.expect_method(wire.CONNECTION_START)
    return c


# ----------------------------------------------------------------------------- framing

def test_protocol_header_mid_stream_is_501_frame_too_large(addr, params):
    """"AMQP\\0\\0\\9\\1" after the handshake reads as a frame of type 65 with a huge size."""
    c = WireClient(*addr).handshake()
    try:
        c.send(wire.PROTOCOL_HEADER)
        code, text, _, _ = close_of(c)
        assert code == 501
        assert text == "FRAME_ERROR - type 65, all octets = <<>>: {frame_too_large,1342177289,131064}"
    finally:
        c.close()
    assert_broker_alive(params)


def test_frame_over_frame_max_before_tune_drops_the_socket(addr, params):
    c = up_to_start(addr)
    try:
        c.send(struct.pack(">BHI", wire.FRAME_METHOD, 0, 200_000) + b"\0" * 16)
        assert_dropped_without_close(c)
    finally:
        c.close()
    assert_broker_alive(params)


def test_frame_over_frame_max_after_tune_is_501(addr, params):
    c = WireClient(*addr).handshake(open_vhost=None)
    try:
        c.send(struct.pack(">BHI", wire.FRAME_METHOD, 0, 200_000) + b"\0" * 16)
        assert close_of(c) == (
            501, "FRAME_ERROR - type 1, all octets = <<>>: {frame_too_large,200000,131064}", 0, 0)
    finally:
        c.close()
    assert_broker_alive(params)


@pytest.mark.parametrize("state", ["starting", "tuning"])
def test_wrong_method_before_tune_ok_drops_the_socket(addr, params, state):
    c = up_to_start(addr)
    try:
        if state == "tuning":
            c.send(wire.start_ok())
            c.expect_method(wire.CONNECTION_TUNE)
        c.send(wire.channel_open(1))
        assert_dropped_without_close(c)
    finally:
        c.close()
    assert_broker_alive(params)


def test_content_header_over_frame_max_is_501(addr, params):
    c = WireClient(*addr).handshake()
    try:
        c.open_channel(1)
        c.send(wire.basic_publish(1, "", "nowhere"))
        header = struct.pack(">HHQ", 60, 0, 5) + b"\0\0" + b"x" * c.frame_max
        c.send(wire.frame(wire.FRAME_HEADER, 1, header))
        code, text, _, _ = close_of(c)
        assert code == 501
        assert text == (f"FRAME_ERROR - type 2, all octets = <<>>: "
                        f"{{frame_too_large,{len(header)},{c.frame_max - 8}}}")
    finally:
        c.close()
    assert_broker_alive(params)


def test_extra_body_frame_is_505(addr, params):
    c = WireClient(*addr).handshake()
    try:
        c.open_channel(1)
        c.send(wire.basic_publish(1, "", "nowhere") + wire.content_header(1, 2)
               + wire.frame(wire.FRAME_BODY, 1, b"ab") + wire.frame(wire.FRAME_BODY, 1, b"cd"))
        assert close_of(c) == (
            505, "UNEXPECTED_FRAME - expected method frame, got non method frame instead", 0, 0)
    finally:
        c.close()
    assert_broker_alive(params)


def test_heartbeat_on_a_channel_is_505(addr, params):
    c = WireClient(*addr).handshake()
    try:
        c.open_channel(1)
        c.send(wire.frame(wire.FRAME_HEARTBEAT, 1, b""))
        assert close_of(c) == (505, "UNEXPECTED_FRAME - type 8, all octets = <<>>", 0, 0)
    finally:
        c.close()
    assert_broker_alive(params)


@pytest.mark.parametrize("frame,text", [
    (wire.channel_open(1), "UNEXPECTED_FRAME - type 1, all octets = <<0,20,0,10,0>>"),
    (wire.frame(wire.FRAME_BODY, 0, b"ab"), 'UNEXPECTED_FRAME - type 3, all octets = <<"ab">>'),
], ids=["channel.open", "body"])
def test_frames_before_connection_open_are_505(addr, params, frame, text):
    c = WireClient(*addr).handshake(open_vhost=None)
    try:
        c.send(frame)
        assert close_of(c) == (505, text, 0, 0)
    finally:
        c.close()
    assert_broker_alive(params)


# ----------------------------------------------------------------------------- field tables

def test_a_table_with_15000_entries_is_accepted(addr, params):
    """A queue.declare whose arguments hold 15,000 (unknown, void) entries, ~109 KB."""
    c = WireClient(*addr).handshake()
    try:
        c.open_channel(1)
        body = b"".join(wire.shortstr(f"k{i}") + b"V" for i in range(15_000))
        args = (struct.pack(">H", 0) + wire.shortstr("") + b"\x04"  # exclusive
                + struct.pack(">I", len(body)) + body)
        c.send(wire.method(1, wire.QUEUE_DECLARE, args))
        c.expect_method(wire.QUEUE_DECLARE_OK, channel=1, timeout=20)
    finally:
        c.close()
    assert_broker_alive(params)


def test_a_table_with_a_million_entries_is_refused_from_its_frame_header(addr, params):
    """A million entries cannot fit a frame: the frame header alone gets 501, before the
    broker buffers any of the ~7 MB announced."""
    c = WireClient(*addr).handshake()
    try:
        c.open_channel(1)
        size = 1_000_000 * 7 + 20
        c.send(struct.pack(">BHI", wire.FRAME_METHOD, 1, size) + b"\x00\x32\x00\x0a")
        code, text, _, _ = close_of(c)
        assert code == 501
        assert text.endswith(f"{{frame_too_large,{size},{c.frame_max - 8}}}"), text
    finally:
        c.close()
    assert_broker_alive(params)


# ----------------------------------------------------------------------------- channels

def test_channel_numbers_above_channel_max_are_counted_not_refused(addr):
    """RabbitMQ limits how many channels are open, not their numbers: channel 65535 opens
    while fewer than channel_max are open."""
    c = WireClient(*addr).handshake()
    try:
        assert c.tune.channel_max < 65535
        c.open_channel(65535)
    finally:
        c.close()


def test_opening_more_than_channel_max_channels_is_530_and_memory_stays_bounded(addr, params):
    before = rss_kb()
    c = WireClient(*addr).handshake()
    try:
        n = c.tune.channel_max
        c.send(b"".join(wire.channel_open(i) for i in range(1, n + 1)))
        opened = set()
        while len(opened) < n:  # RabbitMQ answers channels in any order
            fr = c.read_frame(timeout=20)
            assert fr.type == wire.FRAME_METHOD and wire.method_id(fr) == wire.CHANNEL_OPEN_OK, fr
            opened.add(fr.channel)
        assert_rss_growth_below(before, 64 * 1024, f"{n} open channels")
        c.send(wire.channel_open(n + 1))
        assert close_of(c) == (
            530, f"NOT_ALLOWED - number of channels opened ({n}) has reached the negotiated "
                 f"channel_max ({n})", 0, 0)
    finally:
        c.close()
    assert_broker_alive(params)


def test_65000_pipelined_channel_opens_stop_at_channel_max(addr, params):
    """65,000 channel.open frames in one burst: the first channel_max are opened, the next
    one closes the connection with 530, the rest are discarded unread into memory."""
    import threading
    before = rss_kb()
    c = WireClient(*addr).handshake()
    try:
        n = c.tune.channel_max
        burst = b"".join(wire.channel_open(i) for i in range(1, 65001))

        def send():
            try:
                c.sock.sendall(burst)
            except OSError:
                pass  # the broker closed the socket after its close: expected

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        opened = set()
        while True:
            fr = c.read_frame(timeout=30)
            if fr.type == wire.FRAME_METHOD and wire.method_id(fr) == wire.CHANNEL_OPEN_OK:
                opened.add(fr.channel)
                continue
            close = wire.decode_close(fr)
            assert close is not None, fr
            break
        assert len(opened) == n
        assert (close.kind, close.reply_code) == ("connection", 530), close
        assert close.reply_text == (
            f"NOT_ALLOWED - number of channels opened ({n}) has reached the negotiated "
            f"channel_max ({n})")
        try:
            c.send(wire.connection_close_ok())
        except OSError:
            pass
        c.expect_eof(timeout=EOF_AFTER_CLOSE_S)
        sender.join(timeout=30)
        assert_rss_growth_below(before, 64 * 1024, "65,000 channel.open frames")
    finally:
        c.close()
    assert_broker_alive(params)


# ----------------------------------------------------------------------------- connections

def test_slowloris_handshake_is_dropped_by_the_handshake_timeout(addr, params):
    """A client trickling its protocol header one byte at a time never gets connection.start
    and is disconnected by the handshake timeout (10 s)."""
    s = socket.create_connection(addr)
    try:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_BOUND_S
        sent = 0
        s.settimeout(1.0)
        while True:
            assert time.monotonic() < deadline, "still connected past the handshake timeout"
            if sent < 7:  # never the 8th byte: the header stays incomplete
                try:
                    s.sendall(wire.PROTOCOL_HEADER[sent:sent + 1])
                    sent += 1
                except OSError:
                    break
            try:
                data = s.recv(64)
            except socket.timeout:
                continue
            except OSError:
                break
            if not data:
                break
            assert False, f"the server answered an incomplete header: {data!r}"
    finally:
        s.close()
    assert_broker_alive(params)


def raise_fd_limit(need):
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need and hard >= need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft >= need


def test_ten_thousand_connections_are_served_and_memory_stays_bounded(addr, params):
    n = 10_000
    if not raise_fd_limit(n + 500):
        pytest.skip("this process may not open 10,000 sockets (RLIMIT_NOFILE)")
    before = rss_kb()
    conns = []
    try:
        # Pipelined handshakes in chunks: each step is sent on every socket of a chunk before
        # any answer is read, and a chunk finishes well within the 10 s handshake timeout.
        for _ in range(0, n, 500):
            chunk = [WireClient(*addr, timeout=30) for _ in range(500)]
            conns.extend(chunk)
            for c in chunk:
                c.send(wire.PROTOCOL_HEADER)
            for c in chunk:
                c.expect_method(wire.CONNECTION_START, timeout=30)
                c.send(wire.start_ok())
            for c in chunk:
                fr = c.expect_method(wire.CONNECTION_TUNE, timeout=30)
                channel_max, frame_max, _ = struct.unpack_from(">HIH", fr.payload, 4)
                c.send(wire.tune_ok(channel_max, frame_max, 0) + wire.connection_open("/"))
            for c in chunk:
                c.expect_method(wire.CONNECTION_OPEN_OK, timeout=30)
        # While all are open, a new client is still served.
        assert_broker_alive(params)
        assert_rss_growth_below(before, n * 64, f"{n} idle connections")
    finally:
        for c in conns:
            c.close()
    assert_broker_alive(params)


def test_connect_close_flood_leaves_the_broker_serving_and_bounded(addr, params):
    before = rss_kb()
    for i in range(2000):
        s = socket.create_connection(addr)
        if i % 3 == 1:
            s.sendall(wire.PROTOCOL_HEADER)
        elif i % 3 == 2:
            s.sendall(wire.PROTOCOL_HEADER + wire.start_ok())
        s.close()
    assert_broker_alive(params)
    assert_rss_growth_below(before, 64 * 1024, "2000 connect/close cycles")
