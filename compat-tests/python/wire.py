"""A tiny raw AMQP 0-9-1 client for wire-level tests: frames are built by hand with struct,
and a reader splits the server's byte stream into frames and decodes the few methods the
tests look at (connection.start/tune/close, channel.close, *-ok replies).

Every read has a deadline (socket timeouts); nothing here sleeps."""

import socket
import struct
import time
from collections import namedtuple

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"

FRAME_METHOD = 1
FRAME_HEADER = 2
FRAME_BODY = 3
FRAME_HEARTBEAT = 8
FRAME_END = 0xCE

# (class_id, method_id)
CONNECTION_START = (10, 10)
CONNECTION_START_OK = (10, 11)
CONNECTION_TUNE = (10, 30)
CONNECTION_TUNE_OK = (10, 31)
CONNECTION_OPEN = (10, 40)
CONNECTION_OPEN_OK = (10, 41)
CONNECTION_CLOSE = (10, 50)
CONNECTION_CLOSE_OK = (10, 51)
CHANNEL_OPEN = (20, 10)
CHANNEL_OPEN_OK = (20, 11)
CHANNEL_CLOSE = (20, 40)
CHANNEL_CLOSE_OK = (20, 41)
QUEUE_DECLARE = (50, 10)
QUEUE_DECLARE_OK = (50, 11)
BASIC_PUBLISH = (60, 40)

DEFAULT_TIMEOUT = 5.0

Frame = namedtuple("Frame", "type channel payload")
Close = namedtuple("Close", "kind channel reply_code reply_text class_id method_id")
Tune = namedtuple("Tune", "channel_max frame_max heartbeat")


class ServerClosed(Exception):
    """The server closed the TCP connection (EOF or reset) while we waited for a frame."""


# ---------------------------------------------------------------- field encoders

def shortstr(s):
    if isinstance(s, str):
        s = s.encode()
    assert len(s) < 256
    return struct.pack(">B", len(s)) + s


def longstr(s):
    if isinstance(s, str):
        s = s.encode()
    return struct.pack(">I", len(s)) + s


def table(items):
    """Encode a field table from a dict of name -> value (bool, int, str/bytes, dict)."""
    out = b""
    for key, value in items.items():
        out += shortstr(key)
        if isinstance(value, bool):
            out += b"t" + struct.pack(">B", int(value))
        elif isinstance(value, int):
            out += b"l" + struct.pack(">q", value)
        elif isinstance(value, (str, bytes)):
            out += b"S" + longstr(value)
        elif isinstance(value, dict):
            out += b"F" + table(value)
        else:
            raise TypeError(value)
    return struct.pack(">I", len(out)) + out


# ---------------------------------------------------------------- frame builders

def frame(ftype, channel, payload, end=FRAME_END):
    return struct.pack(">BHI", ftype, channel, len(payload)) + payload + bytes([end])


def method(channel, cm, args=b"", end=FRAME_END):
    return frame(FRAME_METHOD, channel, struct.pack(">HH", *cm) + args, end=end)


def heartbeat():
    return frame(FRAME_HEARTBEAT, 0, b"")


CLIENT_PROPERTIES = {
    "product": "warren-wire-tests",
    "capabilities": {"authentication_failure_close": True},
}


def start_ok(user="guest", password="guest", mechanism="PLAIN", properties=None):
    response = b"\0" + user.encode() + b"\0" + password.encode()
    args = (table(properties if properties is not None else CLIENT_PROPERTIES)
            + shortstr(mechanism) + longstr(response) + shortstr("en_US"))
    return method(0, CONNECTION_START_OK, args)


def tune_ok(channel_max, frame_max, heartbeat_s):
    return method(0, CONNECTION_TUNE_OK, struct.pack(">HIH", channel_max, frame_max, heartbeat_s))


def connection_open(vhost="/"):
    return method(0, CONNECTION_OPEN, shortstr(vhost) + shortstr("") + b"\x00")


def connection_close_ok():
    return method(0, CONNECTION_CLOSE_OK)


def connection_close(code=200, text="Goodbye"):
    return method(0, CONNECTION_CLOSE, struct.pack(">H", code) + shortstr(text) + struct.pack(">HH", 0, 0))


def channel_close(channel, code=200, text="Goodbye"):
    return method(channel, CHANNEL_CLOSE, struct.pack(">H", code) + shortstr(text) + struct.pack(">HH", 0, 0))


def channel_open(channel):
    return method(channel, CHANNEL_OPEN, shortstr(""))


def channel_close_ok(channel):
    return method(channel, CHANNEL_CLOSE_OK)


def queue_declare(channel, name="", passive=False, durable=False, exclusive=False,
                  auto_delete=False, arguments_field=None):
    """queue.declare; `arguments_field` is an already encoded table (length prefix included)."""
    bits = (passive << 0) | (durable << 1) | (exclusive << 2) | (auto_delete << 3)
    args = struct.pack(">H", 0) + shortstr(name) + struct.pack(">B", bits)
    args += arguments_field if arguments_field is not None else table({})
    return method(channel, QUEUE_DECLARE, args)


def basic_publish(channel, exchange="", routing_key="", mandatory=False):
    args = struct.pack(">H", 0) + shortstr(exchange) + shortstr(routing_key) + struct.pack(">B", int(mandatory))
    return method(channel, BASIC_PUBLISH, args)


def basic_consume(channel, queue, consumer_tag="", no_ack=False, exclusive=False):
    bits = (no_ack << 1) | (exclusive << 2)
    args = (struct.pack(">H", 0) + shortstr(queue) + shortstr(consumer_tag)
            + struct.pack(">B", bits) + table({}))
    return method(channel, (60, 20), args)


def content_header(channel, body_size, class_id=60):
    # class, weight, body size, property flags (no properties)
    return frame(FRAME_HEADER, channel, struct.pack(">HHQH", class_id, 0, body_size, 0))


def body_frames(channel, body, frame_max):
    chunk = frame_max - 8
    return b"".join(frame(FRAME_BODY, channel, body[i:i + chunk]) for i in range(0, len(body), chunk))


# ---------------------------------------------------------------- decoding

def _shortstr_at(buf, off):
    n = buf[off]
    return buf[off + 1:off + 1 + n].decode("utf-8", "replace"), off + 1 + n


def method_id(fr):
    if fr.type != FRAME_METHOD or len(fr.payload) < 4:
        return None
    return struct.unpack_from(">HH", fr.payload, 0)


def decode_close(fr):
    """connection.close / channel.close -> Close, else None."""
    cm = method_id(fr)
    if cm not in (CONNECTION_CLOSE, CHANNEL_CLOSE):
        return None
    p = fr.payload
    (code,) = struct.unpack_from(">H", p, 4)
    text, off = _shortstr_at(p, 6)
    class_id, meth = struct.unpack_from(">HH", p, off)
    kind = "connection" if cm == CONNECTION_CLOSE else "channel"
    return Close(kind, fr.channel, code, text, class_id, meth)


# ---------------------------------------------------------------- the client

class WireClient:
    """One raw TCP connection to the broker."""

    def __init__(self, host, port, timeout=DEFAULT_TIMEOUT):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.tune = None
        self.frame_max = None

    # -- I/O
    def send(self, data):
        self.sock.sendall(data)

    def _fill(self, deadline):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("deadline passed")
        self.sock.settimeout(remaining)
        try:
            chunk = self.sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError) as e:
            raise ServerClosed(str(e)) from e
        if not chunk:
            raise ServerClosed("EOF")
        self.buf += chunk

    def read_exact(self, n, timeout=DEFAULT_TIMEOUT):
        deadline = time.monotonic() + timeout
        while len(self.buf) < n:
            self._fill(deadline)
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def read_frame(self, timeout=DEFAULT_TIMEOUT):
        """Next frame; raises socket.timeout after `timeout` s, ServerClosed on EOF/reset."""
        deadline = time.monotonic() + timeout
        while len(self.buf) < 7:
            self._fill(deadline)
        ftype, channel, size = struct.unpack_from(">BHI", self.buf, 0)
        while len(self.buf) < 8 + size:
            self._fill(deadline)
        payload = self.buf[7:7 + size]
        end = self.buf[7 + size]
        self.buf = self.buf[8 + size:]
        assert end == FRAME_END, f"server sent a bad frame end {end:#x}"
        return Frame(ftype, channel, payload)

    def expect_method(self, cm, channel=None, timeout=DEFAULT_TIMEOUT):
        """Read until a method frame arrives (skipping heartbeats); assert it is `cm`."""
        deadline = time.monotonic() + timeout
        while True:
            fr = self.read_frame(max(0.0, deadline - time.monotonic()))
            if fr.type == FRAME_HEARTBEAT:
                continue
            got = method_id(fr)
            assert got == cm, f"expected method {cm}, got frame {fr} (close={decode_close(fr)})"
            if channel is not None:
                assert fr.channel == channel, fr
            return fr

    def expect_close(self, timeout=DEFAULT_TIMEOUT):
        """Read until connection.close or channel.close arrives (skipping heartbeats and
        anything else); return it as Close. Raises ServerClosed if the socket closes first."""
        deadline = time.monotonic() + timeout
        while True:
            fr = self.read_frame(max(0.0, deadline - time.monotonic()))
            close = decode_close(fr)
            if close is not None:
                return close

    def expect_method_or_close(self, timeout=DEFAULT_TIMEOUT):
        """Next method frame (heartbeats skipped), whatever it is; ServerClosed on EOF."""
        deadline = time.monotonic() + timeout
        while True:
            fr = self.read_frame(max(0.0, deadline - time.monotonic()))
            if fr.type == FRAME_METHOD:
                return fr

    def expect_eof(self, timeout=DEFAULT_TIMEOUT):
        """Drain frames until the server closes the socket; return the frames seen.
        Fails (socket.timeout) if the socket is still open after `timeout`."""
        deadline = time.monotonic() + timeout
        frames = []
        while True:
            try:
                frames.append(self.read_frame(max(0.0, deadline - time.monotonic())))
            except ServerClosed:
                return frames

    def expect_connection_close(self, timeout=DEFAULT_TIMEOUT, eof_timeout=DEFAULT_TIMEOUT):
        """connection.close must arrive; answer close-ok and require the socket to close."""
        close = self.expect_close(timeout)
        assert close.kind == "connection", close
        assert close.channel == 0, close
        try:
            self.send(connection_close_ok())
        except OSError:
            pass
        self.expect_eof(eof_timeout)
        return close

    # -- handshake
    def handshake(self, heartbeat_s=0, frame_max=None, channel_max=None, user="guest",
                  password="guest", open_vhost="/"):
        """Protocol header .. open-ok. frame_max/channel_max default to what the server offers."""
        self.send(PROTOCOL_HEADER)
        self.expect_method(CONNECTION_START)
        self.send(start_ok(user, password))
        fr = self.expect_method(CONNECTION_TUNE)
        self.tune = Tune(*struct.unpack_from(">HIH", fr.payload, 4))
        fm = self.tune.frame_max if frame_max is None else frame_max
        cmx = self.tune.channel_max if channel_max is None else channel_max
        self.send(tune_ok(cmx, fm, heartbeat_s))
        self.frame_max = fm
        if open_vhost is not None:
            self.send(connection_open(open_vhost))
            self.expect_method(CONNECTION_OPEN_OK)
        return self

    def open_channel(self, channel):
        self.send(channel_open(channel))
        self.expect_method(CHANNEL_OPEN_OK, channel=channel)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def assert_broker_alive(params):
    """A fresh pika connection can declare a queue and round-trip a message."""
    import pika
    conn = pika.BlockingConnection(params)
    try:
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.basic_publish("", q, b"still alive")
        method, _props, body = ch.basic_get(q, auto_ack=True)
        assert method is not None and body == b"still alive"
    finally:
        conn.close()
