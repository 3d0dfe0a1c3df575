"""AMQPS: pika over TLS 1.2 and 1.3, client-certificate verification and SASL EXTERNAL.

Each test module starts Warrens of its own with TLS flags and certificates that
`gen-test-certs` (rcgen) writes, so this file runs against Warren only. The user name SASL
EXTERNAL must produce is computed by `openssl x509 -subject -nameopt RFC2253`, the form
RabbitMQ documents for `ssl_cert_login_from = distinguished_name`.
"""

import os
import ssl
import socket
import subprocess
import tempfile
from pathlib import Path

import pika
import pytest
from pika.exceptions import AMQPConnectionError, ChannelClosedByBroker

from conftest import REPO_ROOT, free_port, warren_process
import wire

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("WARREN_TEST_AMQP_URL")),
    reason="starts Warrens of its own with TLS configured",
)


@pytest.fixture(scope="module")
def certs():
    gen = Path(os.environ.get("WARREN_BIN", REPO_ROOT / "target" / "debug" / "warren")).parent / "gen-test-certs"
    with tempfile.TemporaryDirectory(prefix="warren-certs-") as d:
        subprocess.run([str(gen), d], check=True, timeout=60)
        yield Path(d)


def subject_dn(cert_path):
    out = subprocess.run(
        ["openssl", "x509", "-in", str(cert_path), "-noout", "-subject", "-nameopt", "RFC2253"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    assert out.startswith("subject=")
    return out[len("subject="):]


def tls_args(certs, amqps_port, *extra):
    # EXTERNAL is offered only when listed, as RabbitMQ's auth_mechanisms (default PLAIN,
    # AMQPLAIN); these tests exercise it.
    return ("--amqps-listen", f"127.0.0.1:{amqps_port}",
            "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
            "--tls-ca", str(certs / "ca.pem"),
            "--auth-mechanisms", "PLAIN,AMQPLAIN,EXTERNAL", *extra)


@pytest.fixture(scope="module")
def tls_broker(certs):
    port = free_port()
    with warren_process(*tls_args(certs, port), wait_port=port) as w:
        w["amqps_port"] = port
        yield w


def ctl(w, *args):
    p = subprocess.run([w["binary"], "ctl", "--data-dir", str(w["data_dir"]), *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def client_context(certs, cert=None, version=None):
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    if cert:
        ctx.load_cert_chain(str(certs / f"{cert}.pem"), str(certs / f"{cert}.key"))
    if version:
        ctx.minimum_version = version
        ctx.maximum_version = version
    return ctx


def tls_params(certs, port, cert=None, version=None, credentials=None):
    kwargs = {}
    if credentials is not None:
        kwargs["credentials"] = credentials
    return pika.ConnectionParameters(
        host="localhost", port=port,
        ssl_options=pika.SSLOptions(client_context(certs, cert, version), "localhost"),
        connection_attempts=1, **kwargs,
    )


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_pika_round_trip_over_tls(certs, tls_broker, version):
    conn = pika.BlockingConnection(tls_params(certs, tls_broker["amqps_port"], version=version))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        q = ch.queue_declare("", exclusive=True).method.queue
        # Several frames per message and several TLS records per frame.
        bodies = [os.urandom(n) for n in (0, 1, 70_000, 400_000)]
        for b in bodies:
            ch.basic_publish("", q, b, mandatory=True)
        got = []
        for method, _props, body in ch.consume(q, auto_ack=True, inactivity_timeout=10):
            assert method is not None, "timed out waiting for a delivery over TLS"
            got.append(body)
            if len(got) == len(bodies):
                break
        assert got == bodies
    finally:
        conn.close()


@pytest.mark.parametrize("version,name", [(ssl.TLSVersion.TLSv1_2, "TLSv1.2"),
                                          (ssl.TLSVersion.TLSv1_3, "TLSv1.3")])
def test_negotiated_tls_version(certs, tls_broker, version, name):
    """A raw TLS socket: the protocol version both sides agreed, then connection.start."""
    ctx = client_context(certs, version=version)
    with socket.create_connection(("127.0.0.1", tls_broker["amqps_port"]), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            assert s.version() == name
            s.sendall(wire.PROTOCOL_HEADER)
            data = b""
            while len(data) < 7:
                chunk = s.recv(4096)
                assert chunk, "closed before connection.start"
                data += chunk
            assert data[0] == 1, "the first frame is a method frame (connection.start)"


def test_plain_listener_keeps_working_next_to_tls(tls_broker):
    conn = pika.BlockingConnection(pika.ConnectionParameters(host="127.0.0.1", port=tls_broker["port"]))
    assert conn.channel().is_open
    conn.close()


def test_external_logs_in_as_the_certificate_subject(certs, tls_broker):
    user = subject_dn(certs / "client.pem")
    ctl(tls_broker, "add_user", user, "unused-password")
    ctl(tls_broker, "set_permissions", "-p", "/", user, ".*", ".*", ".*")
    conn = pika.BlockingConnection(tls_params(
        certs, tls_broker["amqps_port"], cert="client",
        credentials=pika.credentials.ExternalCredentials()))
    try:
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        # RabbitMQ checks user_id against the authenticated user: the DN passes...
        ch.basic_publish("", q, b"mine", pika.BasicProperties(user_id=user))
        ch.queue_declare(q, passive=True)
        # ...and any other name is refused with 406.
        with pytest.raises(ChannelClosedByBroker) as e:
            ch.basic_publish("", q, b"forged", pika.BasicProperties(user_id="guest"))
            ch.queue_declare(q, passive=True)
        assert e.value.reply_code == 406
    finally:
        if conn.is_open:
            conn.close()
        ctl(tls_broker, "delete_user", user)


def test_external_refused_when_the_subject_is_not_a_user(certs, tls_broker):
    with pytest.raises(AMQPConnectionError) as e:
        pika.BlockingConnection(tls_params(
            certs, tls_broker["amqps_port"], cert="client",
            credentials=pika.credentials.ExternalCredentials()))
    assert "ACCESS_REFUSED" in repr(e.value) and "EXTERNAL" in repr(e.value)


def test_external_not_offered_without_a_client_certificate(certs, tls_broker):
    with pytest.raises(AMQPConnectionError) as e:
        pika.BlockingConnection(tls_params(
            certs, tls_broker["amqps_port"],
            credentials=pika.credentials.ExternalCredentials()))
    # pika finds no mechanism it can use among those offered.
    assert "AuthenticationError" in repr(e.value) or "EXTERNAL" in repr(e.value)
    # Password login over TLS without a certificate still works (verification is optional).
    conn = pika.BlockingConnection(tls_params(certs, tls_broker["amqps_port"]))
    conn.close()


def test_certificate_from_an_untrusted_ca_fails_the_handshake(certs, tls_broker):
    ctx = client_context(certs, cert="rogue")
    with socket.create_connection(("127.0.0.1", tls_broker["amqps_port"]), timeout=10) as raw:
        with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
            with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                # TLS 1.3: the server judges the client certificate after the client's
                # handshake finished, so the refusal arrives on the first read.
                s.sendall(wire.PROTOCOL_HEADER)
                if not s.recv(4096):
                    raise ConnectionResetError("closed")


def test_fail_if_no_peer_cert_requires_a_certificate(certs):
    port = free_port()
    with warren_process(*tls_args(certs, port, "--tls-fail-if-no-peer-cert"), wait_port=port):
        ctx = client_context(certs)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
                with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                    s.sendall(wire.PROTOCOL_HEADER)
                    if not s.recv(4096):
                        raise ConnectionResetError("closed")
        conn = pika.BlockingConnection(tls_params(certs, port, cert="client"))
        assert conn.channel().is_open
        conn.close()


def test_common_name_login(certs):
    port = free_port()
    args = tls_args(certs, port, "--ssl-cert-login-from", "common-name")
    with warren_process(*args, wait_port=port) as w:
        ctl(w, "add_user", "warren-client", "unused-password")
        ctl(w, "set_permissions", "-p", "/", "warren-client", ".*", ".*", ".*")
        conn = pika.BlockingConnection(tls_params(
            certs, port, cert="client", credentials=pika.credentials.ExternalCredentials()))
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.basic_publish("", q, b"x", pika.BasicProperties(user_id="warren-client"))
        ch.queue_declare(q, passive=True)
        conn.close()


def test_external_is_not_offered_unless_configured(certs):
    """Goal: with RabbitMQ's default auth_mechanisms (PLAIN, AMQPLAIN) a verified client
    certificate does not bring EXTERNAL, so clients that prefer EXTERNAL when offered
    (py-amqp, hence kombu and Celery over mutual TLS) log in with their password. Method: a
    broker without --auth-mechanisms; py-amqp with a client certificate logs in as guest."""
    import amqp
    port = free_port()
    args = ("--amqps-listen", f"127.0.0.1:{port}",
            "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
            "--tls-ca", str(certs / "ca.pem"))
    with warren_process(*args, wait_port=port):
        conn = amqp.Connection(
            f"127.0.0.1:{port}", userid="guest", password="guest",
            ssl={"ca_certs": str(certs / "ca.pem"), "certfile": str(certs / "client.pem"),
                 "keyfile": str(certs / "client.key"), "server_hostname": "localhost"})
        conn.connect()
        try:
            assert b"EXTERNAL" not in conn.mechanisms
            ch = conn.channel()
            ch.queue_declare("", exclusive=True)
        finally:
            conn.close()
