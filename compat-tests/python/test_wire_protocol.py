"""Wire-level protocol robustness: raw AMQP 0-9-1 over a plain socket (see wire.py).

Expected codes and texts follow docs/rabbitmq-reply-reference.md (RabbitMQ 4.x)."""

import os
import random
import select
import signal
import socket
import struct
import subprocess
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pika
import pytest
from pika.exceptions import ConnectionClosedByBroker

import wire
from wire import ServerClosed, WireClient, assert_broker_alive

REPO_ROOT = Path(__file__).resolve().parents[2]
EXTERNAL_BROKER = bool(os.environ.get("WARREN_TEST_AMQP_URL"))
# Fatal frame errors: RabbitMQ sends connection.close, then closes the socket at the latest
# 3 s later (close-ok or not); allow some slack on top.
EOF_AFTER_CLOSE_S = 5.0


@pytest.fixture
def addr(params):
    return params.host, params.port


@pytest.fixture
def client(addr):
    """A raw client that has completed the handshake (heartbeats off, server's frame_max)."""
    c = WireClient(*addr)
    c.handshake()
    yield c
    c.close()


def assert_raw_broker_alive(addr):
    """A fresh raw connection completes the handshake and a queue.declare."""
    c = WireClient(*addr)
    try:
        c.handshake()
        c.open_channel(1)
        c.send(wire.queue_declare(1, "", exclusive=True))
        c.expect_method(wire.QUEUE_DECLARE_OK, channel=1)
    finally:
        c.close()


def deep_table_field(depth):
    """A field table (with its length prefix) nested `depth` levels: {"a": {"a": ... {}}}.
    Each level is key(2) + type(1) + length(4) = 7 bytes, so the lengths are known upfront."""
    parts = [struct.pack(">I", 7 * depth)]
    for d in range(depth, 0, -1):
        parts.append(b"\x01aF" + struct.pack(">I", 7 * (d - 1)))
    return b"".join(parts)


# ----------------------------------------------------------------------------- protocol header

@pytest.mark.parametrize("header", [b"AMQP\x00\x00\x09\x02", b"AMQP\x00\x00\x08\x00", b"HTTP/1.1"],
                         ids=["amqp-0-9-2", "amqp-0-8", "http"])
def test_wrong_protocol_header_gets_supported_header_and_close(addr, header):
    """A wrong protocol header is answered with AMQP 0-9-1's header and the socket is closed."""
    c = WireClient(*addr)
    try:
        c.send(header)
        assert c.read_exact(8) == wire.PROTOCOL_HEADER
        deadline = time.monotonic() + EOF_AFTER_CLOSE_S
        while True:  # nothing else may follow the header; the server closes the socket
            try:
                c._fill(deadline)
            except ServerClosed:
                break
            assert False, f"unexpected bytes after the protocol header: {c.buf!r}"
    finally:
        c.close()


# ----------------------------------------------------------------------------- framing errors

def test_frame_larger_than_frame_max_is_501_without_waiting_for_payload(client):
    """A frame header announcing a 1 GiB payload gets connection.close 501 at once (no buffering)."""
    start = time.monotonic()
    client.send(struct.pack(">BHI", wire.FRAME_METHOD, 1, 1 << 30) + b"\x00" * 16)
    close = client.expect_connection_close(timeout=3.0, eof_timeout=EOF_AFTER_CLOSE_S)
    assert time.monotonic() - start < 3.0 + EOF_AFTER_CLOSE_S
    assert close.reply_code == 501, close
    assert close.reply_text.startswith("FRAME_ERROR - "), close
    assert "frame_too_large" in close.reply_text, close
    assert (close.class_id, close.method_id) == (0, 0), close


def test_bad_frame_end_octet_is_501(client):
    """A frame whose end octet is not 0xCE gets connection.close 501 FRAME_ERROR."""
    client.send(wire.method(1, wire.CHANNEL_OPEN, wire.shortstr(""), end=0x00))
    close = client.expect_connection_close(eof_timeout=EOF_AFTER_CLOSE_S)
    assert close.reply_code == 501, close
    assert close.reply_text.startswith("FRAME_ERROR - "), close
    assert "invalid_frame_end_marker" in close.reply_text, close


def test_unknown_frame_type_is_501(client):
    """A frame of unknown type 9 gets connection.close 501 FRAME_ERROR (unknown_frame)."""
    client.send(wire.frame(9, 0, b""))
    close = client.expect_connection_close(eof_timeout=EOF_AFTER_CLOSE_S)
    assert close.reply_code == 501, close
    assert close.reply_text == "FRAME_ERROR - type 9, all octets = <<>>: unknown_frame", close
    assert (close.class_id, close.method_id) == (0, 0), close


# ----------------------------------------------------------------------------- channel state

def test_method_on_unopened_channel_is_504(client):
    """queue.declare on a channel that was never opened closes the connection with 504."""
    client.send(wire.queue_declare(5, "never-opened"))
    close = client.expect_connection_close()
    assert close.reply_code == 504, close
    assert close.reply_text == "CHANNEL_ERROR - expected 'channel.open'", close
    assert (close.class_id, close.method_id) == wire.QUEUE_DECLARE, close


def test_channel_open_twice_is_504(client):
    """A second channel.open on an open channel closes the connection with 504."""
    client.open_channel(1)
    client.send(wire.channel_open(1))
    close = client.expect_connection_close()
    assert close.reply_code == 504, close
    assert close.reply_text == "CHANNEL_ERROR - second 'channel.open' seen", close
    assert (close.class_id, close.method_id) == wire.CHANNEL_OPEN, close


def test_non_connection_method_on_channel_zero_is_504(client):
    """A queue.declare on channel 0 closes the connection with 504 (connection state running)."""
    client.send(wire.queue_declare(0, "on-channel-zero"))
    close = client.expect_connection_close()
    assert close.reply_code == 504, close
    assert close.reply_text == "CHANNEL_ERROR - unexpected method in connection state running", close


# ----------------------------------------------------------------------------- content assembly

def test_content_header_without_publish_is_505(client):
    """A content header with no preceding basic.publish closes the connection with 505."""
    client.open_channel(1)
    client.send(wire.content_header(1, 5))
    close = client.expect_connection_close()
    assert close.reply_code == 505, close
    assert close.reply_text == "UNEXPECTED_FRAME - expected method frame, got non method frame instead", close
    assert (close.class_id, close.method_id) == (0, 0), close


@pytest.mark.rabbitmq4  # 3.10 does not answer
def test_body_larger_than_declared_size_is_501(client):
    """A body frame with more bytes than the header's body size closes the connection with 501."""
    client.open_channel(1)
    client.send(wire.basic_publish(1, "", "nowhere") + wire.content_header(1, 5)
                + wire.frame(wire.FRAME_BODY, 1, b"0123456789"))
    close = client.expect_connection_close()
    assert close.reply_code == 501, close
    assert close.reply_text == "FRAME_ERROR - content body frame exceeds remaining content size", close
    assert (close.class_id, close.method_id) == wire.BASIC_PUBLISH, close


def test_method_while_body_expected_is_505(client):
    """A method frame arriving before the announced body is complete closes the connection with 505."""
    client.open_channel(1)
    client.send(wire.basic_publish(1, "", "nowhere") + wire.content_header(1, 10)
                + wire.frame(wire.FRAME_BODY, 1, b"01234")
                + wire.basic_publish(1, "", "nowhere"))
    close = client.expect_connection_close()
    assert close.reply_code == 505, close
    assert close.reply_text == "UNEXPECTED_FRAME - expected content body, got non content body frame instead", close
    assert (close.class_id, close.method_id) == wire.BASIC_PUBLISH, close


@pytest.mark.rabbitmq4  # 3.x's max_message_size is 128 MiB
def test_message_over_max_size_is_406_and_connection_survives(client):
    """A 17 MiB message (max 16 MiB) gets channel.close 406 and the connection stays usable."""
    size = 17 * 1024 * 1024
    client.open_channel(1)
    client.send(wire.basic_publish(1, "", f"wire.too-big.{uuid.uuid4().hex}") + wire.content_header(1, size))
    # Send the whole body: RabbitMQ checks the size once the message is assembled; a broker that
    # rejects at the header must drop the remaining body frames of the closing channel.
    client.send(wire.body_frames(1, b"x" * size, client.frame_max))
    close = client.expect_close(timeout=10.0)
    assert close.kind == "channel" and close.channel == 1, close
    assert close.reply_code == 406, close
    assert close.reply_text == (
        f"PRECONDITION_FAILED - message size {size} is larger than configured max size {16 * 1024 * 1024}"
    ), close
    assert (close.class_id, close.method_id) == wire.BASIC_PUBLISH, close
    client.send(wire.channel_close_ok(1))
    client.open_channel(2)
    client.send(wire.queue_declare(2, "", exclusive=True))
    client.expect_method(wire.QUEUE_DECLARE_OK, channel=2)


# ----------------------------------------------------------------------------- malformed methods

def test_deeply_nested_table_closes_connection_and_broker_survives(addr, params):
    """queue.declare arguments nested 10,000 tables deep close the connection; the broker lives on."""
    c = WireClient(*addr)
    try:
        c.handshake()
        c.open_channel(1)
        c.send(wire.queue_declare(1, f"wire.deep.{uuid.uuid4().hex}", exclusive=True,
                                  arguments_field=deep_table_field(10_000)))
        try:
            fr = c.expect_method_or_close(timeout=EOF_AFTER_CLOSE_S)
        except ServerClosed:
            fr = None  # a plain TCP close is acceptable
        if EXTERNAL_BROKER and fr is not None and wire.method_id(fr) == wire.QUEUE_DECLARE_OK:
            # RabbitMQ (checked on 3.10) has no table depth limit and declares the queue.
            # Warren caps nesting (TABLE_DEPTH_MAX) and must refuse the frame instead.
            pass
        elif fr is not None:
            close = wire.decode_close(fr)
            assert close is not None and close.kind == "connection", (fr, close)
            assert close.reply_code == 501, close
            c.send(wire.connection_close_ok())
            c.expect_eof(EOF_AFTER_CLOSE_S)
    finally:
        c.close()
    assert_raw_broker_alive(addr)
    assert_broker_alive(params)


def test_length_prefix_past_end_of_method_closes_connection_and_broker_survives(addr, params):
    """A shortstr claiming 200 bytes inside a 10-byte queue.declare closes the connection; the broker lives on."""
    c = WireClient(*addr)
    try:
        c.handshake()
        c.open_channel(1)
        payload = struct.pack(">HHH", 50, 10, 0) + b"\xc8abc"  # reserved, shortstr len 200, 3 bytes
        assert len(payload) == 10
        c.send(wire.frame(wire.FRAME_METHOD, 1, payload))
        try:
            close = c.expect_close(timeout=EOF_AFTER_CLOSE_S)
        except ServerClosed:
            close = None  # a plain TCP close is acceptable too
        if close is not None:
            assert close.kind == "connection", close
            assert close.reply_code == 501, close
            assert close.reply_text.startswith("FRAME_ERROR - "), close
            c.send(wire.connection_close_ok())
            c.expect_eof(EOF_AFTER_CLOSE_S)
    finally:
        c.close()
    assert_raw_broker_alive(addr)
    assert_broker_alive(params)


# ----------------------------------------------------------------------------- negotiation, auth

@pytest.mark.rabbitmq4  # 3.10 resets the socket
def test_tune_ok_frame_max_above_offer_is_530(addr):
    """tune-ok with frame_max above the server's offer closes the connection with 530 NOT_ALLOWED."""
    c = WireClient(*addr)
    try:
        c.handshake(frame_max=1_000_000, open_vhost=None)
        close = c.expect_connection_close()
        assert close.reply_code == 530, close
        assert close.reply_text == (
            f"NOT_ALLOWED - negotiated frame_max = 1000000 is higher than the maximum allowed value "
            f"({c.tune.frame_max})"
        ), close
        assert (close.class_id, close.method_id) == wire.CONNECTION_TUNE_OK, close
    finally:
        c.close()


def test_auth_failure_with_capability_is_403(addr):
    """Bad credentials with authentication_failure_close=true get connection.close 403 and the safe text."""
    c = WireClient(*addr)
    try:
        c.send(wire.PROTOCOL_HEADER)
        c.expect_method(wire.CONNECTION_START)
        c.send(wire.start_ok("guest", "definitely-not-the-password"))
        close = c.expect_connection_close()
        assert close.reply_code == 403, close
        assert close.reply_text == (
            "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN. "
            "For details see the broker logfile."
        ), close
        assert (close.class_id, close.method_id) == (0, 0), close
    finally:
        c.close()


# ----------------------------------------------------------------------------- heartbeats

def test_silent_client_gets_heartbeats_then_socket_close(addr):
    """With heartbeat=1 and a silent client, the server sends heartbeats and then drops the socket
    without a connection.close."""
    c = WireClient(*addr)
    try:
        c.handshake(heartbeat_s=1)
        silent_since = time.monotonic()
        frames = c.expect_eof(timeout=8.0)
        silent_for = time.monotonic() - silent_since
    finally:
        c.close()
    heartbeats = [f for f in frames if f.type == wire.FRAME_HEARTBEAT]
    others = [f for f in frames if f.type != wire.FRAME_HEARTBEAT]
    assert heartbeats, "server sent no heartbeat frames"
    assert all(f.channel == 0 and f.payload == b"" for f in heartbeats), heartbeats
    assert not others, f"expected only heartbeats before the close, got {others}"
    assert 1.0 <= silent_for <= 6.0, f"socket closed after {silent_for:.2f}s of client silence"


def test_client_sending_heartbeats_stays_connected(addr):
    """With heartbeat=1 and a client that heartbeats every 0.5 s, the connection outlives 3 s."""
    c = WireClient(*addr)
    try:
        c.handshake(heartbeat_s=1)
        end = time.monotonic() + 3.0
        seen = 0
        next_beat = time.monotonic()
        while time.monotonic() < end:
            if time.monotonic() >= next_beat:
                c.send(wire.heartbeat())
                next_beat += 0.5
            try:
                # The read timeout paces the loop: it returns at the next server frame or beat.
                fr = c.read_frame(timeout=max(0.01, next_beat - time.monotonic()))
            except socket.timeout:
                continue
            assert fr.type == wire.FRAME_HEARTBEAT, fr
            seen += 1
        assert seen >= 1, "server sent no heartbeats in 3 s"
        c.open_channel(1)  # still fully alive
    finally:
        c.close()


# ----------------------------------------------------------------------------- shutdown

def _start_private_warren(tmp):
    binary = os.environ.get("WARREN_BIN", str(REPO_ROOT / "target" / "debug" / "warren"))
    data_dir = Path(tmp) / "data"
    data_dir.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(Path(tmp) / "warren.log", "wb")
    proc = subprocess.Popen(
        [binary, "server", "--amqp-listen", f"127.0.0.1:{port}", "--data-dir", str(data_dir),
         "--log-level", "warn", "--management-listen", "off", "--prometheus-listen", "off"],
        stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
    )
    log.close()
    deadline = time.monotonic() + 20.0
    out = b""
    while b"warren: amqp listening on" not in out:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or proc.poll() is not None:
            proc.kill()
            proc.wait()
            raise AssertionError(f"private warren did not start; stdout={out!r}")
        ready, _, _ = select.select([proc.stdout], [], [], remaining)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk and proc.poll() is None:
                continue
            out += chunk
    return proc, port


@pytest.mark.skipif(EXTERNAL_BROKER,
                    reason="needs a private Warren process (not available against an external broker)")
def test_sigterm_closes_connections_with_320_and_exits_zero():
    """SIGTERM makes the broker close client connections with 320 CONNECTION_FORCED and exit 0."""
    with tempfile.TemporaryDirectory(prefix="warren-wire-") as tmp:
        proc, port = _start_private_warren(tmp)
        try:
            conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
            assert conn.is_open
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10.0
            with pytest.raises(ConnectionClosedByBroker) as info:
                while time.monotonic() < deadline:
                    conn.process_data_events(time_limit=0.2)
            assert info.value.reply_code == 320, info.value
            assert info.value.reply_text == (
                "CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'"
            ), info.value
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()


# ----------------------------------------------------------------------------- fuzz

def _fuzz_payloads(seed=0x5EED, count=200):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        junk = rng.randbytes(rng.randint(0, 2000))
        mode = i % 3
        if mode == 0:  # raw bytes straight into the frame parser
            out.append(junk)
        elif mode == 1:  # a well-framed frame of a random type and channel with a random payload
            ftype = rng.choice([wire.FRAME_METHOD, wire.FRAME_HEADER, wire.FRAME_BODY, wire.FRAME_HEARTBEAT])
            out.append(wire.frame(ftype, rng.choice([0, 1, 2]), junk[: rng.randint(0, 200)]))
        else:  # channel.open, then a known method id on channel 1 with random arguments
            cm = rng.choice([(20, 10), (40, 10), (50, 10), (50, 20), (60, 10), (60, 20), (60, 40),
                             (60, 70), (60, 80), (85, 10), (90, 10), (10, 50), (rng.randint(0, 65535),
                                                                                rng.randint(0, 65535))])
            out.append(wire.channel_open(1) + wire.method(1, cm, junk[: rng.randint(0, 300)]))
    return out


def _fuzz_one(addr, payload):
    c = WireClient(*addr)
    try:
        c.handshake()
        try:
            c.send(payload)
            c.sock.shutdown(socket.SHUT_WR)
            c.expect_eof(timeout=5.0)  # whatever the server makes of it, it ends the connection
        except (ServerClosed, OSError):
            pass
    finally:
        c.close()


def test_fuzz_random_bytes_after_handshake_do_not_break_broker(addr, params):
    """200 connections sending seeded random bytes after a valid handshake leave the broker working."""
    payloads = _fuzz_payloads()
    with ThreadPoolExecutor(max_workers=20) as pool:
        for fut in [pool.submit(_fuzz_one, addr, p) for p in payloads]:
            fut.result(timeout=30)
    assert_broker_alive(params)


# ----------------------------------------------------------------------------- closing

def test_client_close_is_answered_every_time_and_socket_waits_for_client(addr):
    """Goal: a client's frames in flight after its connection.close never meet a closed socket
    (amqp091-go's TestConcurrentClose, amqplib's close callback). Method: send two
    connection.close frames and a publish after them in one write; both closes get close-ok,
    the socket stays open (a read times out, no EOF), and it ends once we close our side."""
    c = WireClient(*addr)
    try:
        c.handshake()
        c.open_channel(1)
        c.send(wire.connection_close() + wire.connection_close()
               + wire.basic_publish(1, "", "nowhere") + wire.content_header(1, 0))
        c.expect_method(wire.CONNECTION_CLOSE_OK, channel=0)
        c.expect_method(wire.CONNECTION_CLOSE_OK, channel=0)
        with pytest.raises(socket.timeout):
            c.read_frame(timeout=1.0)
        c.send(wire.connection_close())  # a late close is still answered, not refused
        c.expect_method(wire.CONNECTION_CLOSE_OK, channel=0)
        # A close split across two segments (the pause lets the server read the first half
        # alone) is reassembled, not lost.
        late = wire.connection_close()
        c.send(late[:5])
        time.sleep(0.2)
        c.send(late[5:])
        c.expect_method(wire.CONNECTION_CLOSE_OK, channel=0)
        c.sock.shutdown(socket.SHUT_WR)
        assert c.expect_eof(timeout=EOF_AFTER_CLOSE_S) == []
    finally:
        c.close()
    assert_raw_broker_alive(addr)


def test_crossing_channel_closes_keep_the_connection(addr):
    """Goal: when the server's channel.close and the client's cross (amqp091-go's
    TestChannelExceptionWithCloseIssue43), either order of close and close-ok is accepted and
    the connection survives. Method: publish to a missing exchange and close the channel in the
    same write; answer the server's 404 close with close-ok after our own close; the server
    answers our close, and the channel number can be reused."""
    c = WireClient(*addr)
    try:
        c.handshake()
        c.open_channel(1)
        c.send(wire.basic_publish(1, "no-such-exchange-" + uuid.uuid4().hex, "k")
               + wire.content_header(1, 0) + wire.channel_close(1))
        close = c.expect_close()
        assert (close.kind, close.channel, close.reply_code) == ("channel", 1, 404), close
        c.send(wire.channel_close_ok(1))
        c.expect_method(wire.CHANNEL_CLOSE_OK, channel=1)
        c.open_channel(1)
        c.send(wire.queue_declare(1, "", exclusive=True))
        c.expect_method(wire.QUEUE_DECLARE_OK, channel=1)
        c.open_channel(2)
    finally:
        c.close()


@pytest.mark.warren_only
def test_stray_channel_close_ok_is_ignored(client):
    """Goal: a close-ok for a channel that is already gone costs nothing (RabbitMQ 4.0.5
    answers it with 504 CHANNEL_ERROR - expected 'channel.open' and closes the connection;
    Warren is lenient here by design, issue 20). Method: send close-ok on channels never
    opened and on one just closed; the connection still opens channels."""
    client.send(wire.channel_close_ok(7))
    client.open_channel(1)
    client.send(wire.channel_close(1))
    client.expect_method(wire.CHANNEL_CLOSE_OK, channel=1)
    client.send(wire.channel_close_ok(1))
    client.open_channel(2)
    client.send(wire.queue_declare(2, "", exclusive=True))
    client.expect_method(wire.QUEUE_DECLARE_OK, channel=2)
