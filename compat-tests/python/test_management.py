"""The management HTTP API and the Prometheus endpoint, over real HTTP against the real
broker. Paths, JSON field names, status codes and error shapes are RabbitMQ's; against
RabbitMQ set WARREN_TEST_MANAGEMENT_URL / WARREN_TEST_PROMETHEUS_URL (plugins
rabbitmq_management and rabbitmq_prometheus enabled)."""

import base64
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pika
import pytest
from pika.exceptions import ProbableAccessDeniedError

from amqp_helpers import counts


def declared_args(queue):
    """A queue object's arguments without the effective x-queue-type RabbitMQ 4 adds to them
    (rabbit_amqqueue:augment_declare_args/5; 3.10 lists only what was declared). When present
    it must be the queue's type."""
    args = dict(queue["arguments"])
    assert args.pop("x-queue-type", queue["type"]) == queue["type"], queue
    return args


def http(method, url, user="guest", password="guest", body=None, headers=None):
    """(status, parsed JSON or text, headers) of one request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, raw, headers = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        status, raw, headers = e.code, e.read(), e.headers
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text) if text else None, headers
    except json.JSONDecodeError:
        return status, text, headers


def q(name):
    return urllib.parse.quote(name, safe="")


def eventually(fetch, check, timeout=30.0):
    """Poll `fetch()` until `check(value)` holds (RabbitMQ's management statistics lag by up
    to their 5 s collection interval; Warren's are current, so the first try passes)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if check(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.25)


def series(text, name):
    """{frozenset(labels): value} of a metric in Prometheus text format."""
    out = {}
    for line in text.splitlines():
        m = re.match(r'^' + re.escape(name) + r'(\{(.*)\})? (\S+)$', line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out[labels] = float(m.group(3))
    return out


@pytest.fixture
def api(management_url):
    def call(method, path, **kw):
        return http(method, management_url + path, **kw)
    return call


def test_overview_counts_queues_and_messages(api, ch, names):
    queue = names.q()
    ch.queue_declare(queue)
    for i in range(3):
        ch.basic_publish("", queue, f"m{i}".encode())
    counts(ch.connection, queue)  # the publishes are in the queue once this answers
    status, o, _ = eventually(lambda: api("GET", "/api/overview"),
                              lambda r: r[1].get("queue_totals", {}).get("messages_ready", 0) >= 3
                              and r[1]["object_totals"]["connections"] >= 1)
    assert status == 200
    for key in ("rabbitmq_version", "cluster_name", "node", "object_totals", "queue_totals",
                "listeners"):
        assert key in o, key
    assert o["object_totals"]["queues"] >= 1
    assert o["object_totals"]["connections"] >= 1
    assert o["queue_totals"]["messages_ready"] >= 3
    assert any(l["protocol"] == "amqp" for l in o["listeners"])
    status, me, _ = api("GET", "/api/whoami")
    assert status == 200 and me["name"] == "guest" and "administrator" in me["tags"]


# The keys rabbit_mgmt_wm_overview:to_json/2 (RabbitMQ 4.2) emits for an administrator, with
# the JSON type of each: management clients (rabbitmq-http-api-rs among them) deserialize them.
OVERVIEW_KEYS = {
    "management_version": str, "rates_mode": str, "sample_retention_policies": dict,
    "exchange_types": list, "product_version": str, "product_name": str,
    "rabbitmq_version": str, "cluster_name": str, "cluster_tags": (dict, list),
    "node_tags": (dict, list), "erlang_version": str, "erlang_full_version": str,
    "disable_stats": bool, "default_queue_type": str, "is_op_policy_updating_enabled": bool,
    "enable_queue_totals": bool, "message_stats": dict, "churn_rates": dict,
    "queue_totals": dict, "object_totals": dict, "statistics_db_event_queue": int,
    "node": str, "listeners": list, "contexts": list,
}


@pytest.mark.rabbitmq4
def test_overview_has_every_key_rabbitmq_emits(api):
    """Goal: /api/overview deserializes in clients written against RabbitMQ 4.2. Method: check
    every key rabbit_mgmt_wm_overview emits is present with its JSON type, and the values
    clients read for their defaults."""
    status, o, _ = api("GET", "/api/overview")
    assert status == 200
    for key, kind in OVERVIEW_KEYS.items():
        assert isinstance(o.get(key), kind), (key, o.get(key))
    assert o["rates_mode"] in ("basic", "detailed", "none")
    assert set(o["sample_retention_policies"]) == {"global", "basic", "detailed"}
    assert o["default_queue_type"] == "classic"
    names = [t["name"] for t in o["exchange_types"]]
    assert names == sorted(names) and {"direct", "fanout", "headers", "topic"} <= set(names)
    for key in ("connection_created", "channel_closed", "queue_declared"):
        assert isinstance(o["churn_rates"][key], int), o["churn_rates"]
    for key in ("messages", "messages_ready", "messages_unacknowledged"):
        assert "rate" in o["queue_totals"][f"{key}_details"], o["queue_totals"]


def test_authentication_and_tags(api, ctl, prefix):
    status, body, headers = api("GET", "/api/overview", user=None)
    assert status == 401 and "WWW-Authenticate" in headers
    status, body, _ = api("GET", "/api/overview", password="wrong")
    assert status == 401 and (body["error"], body["reason"]) == ("not_authorized", "Login failed")
    user = prefix.replace("compat.", "mu.")[:60]
    assert ctl("add_user", user, "pw")[0] == 0
    try:
        status, body, _ = api("GET", "/api/overview", user=user, password="pw")
        assert status == 401, "a user without a management tag is refused"
        assert ctl("set_user_tags", user, "management")[0] == 0
        status, _, _ = api("GET", "/api/overview", user=user, password="pw")
        assert status == 200
        status, body, _ = api("GET", "/api/users", user=user, password="pw")
        assert status == 401, "listing users needs administrator"
    finally:
        ctl("delete_user", user)


def test_vhosts_users_and_permissions(api, params, prefix):
    vhost = prefix.replace("compat.", "mv.")[:60]
    user = prefix.replace("compat.", "mp.")[:60]
    try:
        assert api("PUT", f"/api/vhosts/{q(vhost)}")[0] == 201
        assert api("PUT", f"/api/vhosts/{q(vhost)}")[0] == 204
        status, vhosts, _ = api("GET", "/api/vhosts")
        assert status == 200 and vhost in [v["name"] for v in vhosts]
        status, v, _ = api("GET", f"/api/vhosts/{q(vhost)}")
        assert status == 200 and v["name"] == vhost
        assert api("PUT", f"/api/users/{q(user)}",
                   body={"password": "s3cret", "tags": "management"})[0] == 201
        status, u, _ = api("GET", f"/api/users/{q(user)}")
        assert status == 200 and u["tags"] == ["management"]
        assert u["hashing_algorithm"] == "rabbit_password_hashing_sha256"
        assert api("PUT", f"/api/permissions/{q(vhost)}/{q(user)}",
                   body={"configure": ".*", "write": ".*", "read": ".*"})[0] == 201
        status, p, _ = api("GET", f"/api/permissions/{q(vhost)}/{q(user)}")
        assert status == 200 and (p["user"], p["vhost"], p["read"]) == (user, vhost, ".*")
        conn = pika.BlockingConnection(pika.ConnectionParameters(
            host=params.host, port=params.port, virtual_host=vhost,
            credentials=pika.PlainCredentials(user, "s3cret"), connection_attempts=1))
        conn.close()
        assert api("DELETE", f"/api/permissions/{q(vhost)}/{q(user)}")[0] == 204
        assert api("DELETE", f"/api/permissions/{q(vhost)}/{q(user)}")[0] == 404
        with pytest.raises(ProbableAccessDeniedError):
            pika.BlockingConnection(pika.ConnectionParameters(
                host=params.host, port=params.port, virtual_host=vhost,
                credentials=pika.PlainCredentials(user, "s3cret"), connection_attempts=1))
    finally:
        api("DELETE", f"/api/users/{q(user)}")
        api("DELETE", f"/api/vhosts/{q(vhost)}")
    assert api("GET", f"/api/vhosts/{q(vhost)}")[0] == 404
    assert api("GET", f"/api/users/{q(user)}")[0] == 404


def test_queue_declare_inspect_purge_delete(api, ch, names):
    queue = names.q()
    path = f"/api/queues/%2F/{q(queue)}"
    assert api("PUT", path, body={"durable": True, "arguments": {"x-max-length": 5}})[0] == 201
    assert api("PUT", path, body={"durable": True, "arguments": {"x-max-length": 5}})[0] == 204
    for i in range(3):
        ch.basic_publish("", queue, b"x" * 10)
    counts(ch.connection, queue)
    status, info, _ = eventually(lambda: api("GET", path), lambda r: r[1].get("messages") == 3)
    assert status == 200
    assert (info["name"], info["vhost"], info["durable"], info["type"]) == (queue, "/", True, "classic")
    assert declared_args(info) == {"x-max-length": 5}
    assert (info["messages"], info["messages_ready"], info["messages_unacknowledged"]) == (3, 3, 0)
    assert info["message_bytes"] == 30
    status, listed, _ = api("GET", "/api/queues/%2F")
    assert status == 200 and queue in [x["name"] for x in listed]
    assert api("DELETE", path + "/contents")[0] == 204
    assert eventually(lambda: api("GET", path), lambda r: r[1].get("messages") == 0)[1]["messages"] == 0
    # Inequivalent redeclaration: AMQP's 406 text comes back as a 400.
    status, body, _ = api("PUT", path, body={"durable": True, "arguments": {"x-max-length": 6}})
    assert status == 400 and "inequivalent arg 'x-max-length'" in body["reason"]
    assert api("DELETE", path)[0] == 204
    assert api("GET", path)[0] == 404
    assert api("DELETE", path)[0] == 404


def test_exchanges_and_bindings(api, ch, names):
    x, queue = names.x(), names.q()
    xpath = f"/api/exchanges/%2F/{q(x)}"
    assert api("PUT", xpath, body={"type": "topic", "durable": False})[0] == 201
    status, info, _ = api("GET", xpath)
    assert status == 200 and (info["type"], info["durable"]) == ("topic", False)
    ch.queue_declare(queue)
    ch.queue_bind(queue, x, "orders.*")
    status, bindings, _ = api("GET", "/api/bindings/%2F")
    assert status == 200
    mine = [b for b in bindings if b["destination"] == queue]
    assert {"source": x, "vhost": "/", "destination": queue, "destination_type": "queue",
            "routing_key": "orders.*", "arguments": {}, "properties_key": "orders.%2A"} in mine
    assert any(b["source"] == "" and b["routing_key"] == queue for b in mine), \
        "the default exchange's binding is listed"
    status, exchanges, _ = api("GET", "/api/exchanges/%2F")
    assert {"amq.direct", "amq.topic", ""} <= {e["name"] for e in exchanges}
    status, qb, _ = api("GET", f"/api/queues/%2F/{q(queue)}/bindings")
    assert status == 200 and [(b["source"], b["routing_key"]) for b in qb] == [("", queue), (x, "orders.*")]
    status, xb, _ = api("GET", f"/api/exchanges/%2F/{q(x)}/bindings/source")
    assert status == 200 and [(b["destination"], b["routing_key"]) for b in xb] == [(queue, "orders.*")]
    status, xd, _ = api("GET", f"/api/exchanges/%2F/{q(x)}/bindings/destination")
    assert status == 200 and xd == []
    # One binding by its properties_key, then deleted through the API (as rabbitmqadmin does).
    pair = f"/api/bindings/%2F/e/{q(x)}/q/{q(queue)}"
    status, listed, _ = api("GET", pair)
    assert status == 200 and [b["routing_key"] for b in listed] == ["orders.*"]
    one = f"{pair}/{q(listed[0]['properties_key'])}"
    assert api("GET", one)[0] == 200
    assert api("DELETE", one)[0] == 204
    assert api("GET", pair)[1] == []
    assert api("DELETE", one)[0] == 404
    assert api("DELETE", xpath)[0] == 204
    assert api("GET", xpath)[0] == 404


def test_health_checks_and_aliveness(api, ctl):
    status, body, _ = api("GET", "/api/health/checks/alarms")
    assert (status, body) == (200, {"status": "ok"})
    assert api("GET", "/api/health/checks/virtual-hosts")[0] == 200
    status, body, _ = api("GET", "/api/aliveness-test/%2F")
    assert (status, body) == (200, {"status": "ok"})
    try:
        assert ctl("set_vm_memory_high_watermark", "0.0000001")[0] == 0
        deadline = time.monotonic() + 30
        while True:  # the alarm is raised by the next sample
            status, body, _ = api("GET", "/api/health/checks/local-alarms")
            if status == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert status == 503 and body["status"] == "failed"
        assert {"resource": "memory"}.items() <= body["alarms"][0].items()
    finally:
        ctl("set_vm_memory_high_watermark", "0.6")


def test_prometheus_metrics(prometheus_url, ch, names):
    queue = names.q()
    ch.queue_declare(queue)
    for _ in range(2):
        ch.basic_publish("", queue, b"p")
    counts(ch.connection, queue)
    status, text, headers = http("GET", prometheus_url + "/metrics", user=None)
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert series(text, "rabbitmq_identity_info"), "the dashboards join on it"
    assert series(text, "rabbitmq_queues")[frozenset()] >= 1
    mine = frozenset({("vhost", "/"), ("queue", queue)})

    def per_object():
        return series(http("GET", prometheus_url + "/metrics/per-object", user=None)[1],
                      "rabbitmq_queue_messages_ready")

    ready = eventually(per_object, lambda s: s.get(mine) == 2)
    assert ready.get(mine) == 2, ready.get(mine)


def test_publish_and_get_messages(api, ch, names):
    queue = names.q()
    ch.queue_declare(queue)
    publish = "/api/exchanges/%2F/amq.default/publish"
    status, r, _ = api("POST", publish, body={
        "properties": {"delivery_mode": 2, "headers": {"h": "v"}, "content_type": "text/plain"},
        "routing_key": queue, "payload": "hello", "payload_encoding": "string"})
    assert (status, r) == (200, {"routed": True})
    status, r, _ = api("POST", publish, body={
        "properties": {}, "routing_key": queue, "payload": base64.b64encode(b"\xff\x00").decode(),
        "payload_encoding": "base64"})
    assert (status, r) == (200, {"routed": True})
    status, r, _ = api("POST", publish, body={
        "properties": {}, "routing_key": queue + ".nowhere", "payload": "x",
        "payload_encoding": "string"})
    assert (status, r) == (200, {"routed": False})

    get = f"/api/queues/%2F/{q(queue)}/get"
    status, msgs, _ = api("POST", get, body={"count": 5, "ackmode": "ack_requeue_true",
                                            "encoding": "auto"})
    assert status == 200 and len(msgs) == 2
    first, second = msgs
    assert (first["payload"], first["payload_encoding"], first["payload_bytes"]) == ("hello", "string", 5)
    assert (first["exchange"], first["routing_key"], first["redelivered"]) == ("", queue, False)
    assert first["message_count"] == 1 and second["message_count"] == 0
    assert first["properties"]["delivery_mode"] == 2
    assert first["properties"]["headers"] == {"h": "v"}
    assert first["properties"]["content_type"] == "text/plain"
    assert (second["payload"], second["payload_encoding"]) == (
        base64.b64encode(b"\xff\x00").decode(), "base64")
    # Requeued: both are still there, now redelivered.
    assert counts(ch.connection, queue)[0] == 2
    status, msgs, _ = api("POST", get, body={"count": 1, "ackmode": "ack_requeue_false",
                                            "encoding": "auto"})
    assert status == 200 and len(msgs) == 1 and msgs[0]["redelivered"] is True
    assert counts(ch.connection, queue)[0] == 1
    # Refused (RabbitMQ 3.10 answers 500 from a crashed handler; Warren a 400).
    status, body, _ = api("POST", get, body={"count": 1, "ackmode": "bogus", "encoding": "auto"})
    assert status in (400, 500)
    assert counts(ch.connection, queue)[0] == 1


def test_connections_are_listed_and_closed(api, params):
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        host=params.host, port=params.port,
        client_properties={"connection_name": "mgmt-test-conn"}))
    try:
        conn.channel()
        conn.channel()
        local_port = conn._impl._transport._sock.getsockname()[1]

        def mine(r):
            return [c for c in (r[1] or []) if c.get("peer_port") == local_port]

        status, listed, _ = eventually(lambda: api("GET", "/api/connections"),
                                       lambda r: mine(r) and mine(r)[0].get("channels") == 2)
        assert status == 200
        [c] = mine((status, listed))
        assert (c["user"], c["vhost"], c["channels"], c["protocol"]) == ("guest", "/", 2, "AMQP 0-9-1")
        assert c["client_properties"]["connection_name"] == "mgmt-test-conn"
        path = f"/api/connections/{q(c['name'])}"
        status, one, _ = api("GET", path)
        assert status == 200 and one["name"] == c["name"]
        assert api("DELETE", path, headers={"X-Reason": "maintenance"})[0] == 204
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as e:
            for _ in range(100):
                conn.process_data_events(time_limit=0.2)
        assert e.value.reply_code == 320
        assert e.value.reply_text == "CONNECTION_FORCED - maintenance"
    finally:
        if conn.is_open:
            conn.close()
    gone = eventually(lambda: api("GET", path), lambda r: r[0] == 404)
    assert gone[0] == 404


def test_message_counters_in_prometheus_and_overview(api, prometheus_url, conn, names):
    """rabbitmq_global_messages_*_total count publishes, confirms, deliveries, gets and acks
    exactly (nothing else runs meanwhile); the overview shows totals with rates."""
    names_ = ["rabbitmq_global_messages_received_total",
              "rabbitmq_global_messages_confirmed_total",
              "rabbitmq_global_messages_delivered_total",
              "rabbitmq_global_messages_acknowledged_total"]

    def totals():
        text = http("GET", prometheus_url + "/metrics", user=None)[1]
        return [sum(series(text, n).values()) for n in names_]

    before = totals()
    queue = names.q()
    ch = conn.channel()
    ch.queue_declare(queue)
    ch.confirm_delivery()
    for i in range(5):
        ch.basic_publish("", queue, f"m{i}".encode())
    got = 0
    for method, _props, _body in ch.consume(queue, inactivity_timeout=10):
        assert method is not None
        ch.basic_ack(method.delivery_tag)
        got += 1
        if got == 5:
            break
    ch.cancel()  # nothing is pending: all five were received and acked
    ch.basic_publish("", queue, b"last")
    method, _, _ = ch.basic_get(queue)
    ch.basic_ack(method.delivery_tag)
    counts(conn, queue)  # the acks were processed once this answers
    expected = [before[0] + 6, before[1] + 6, before[2] + 6, before[3] + 6]
    after = eventually(totals, lambda t: t == expected)
    assert after == expected
    status, o, _ = eventually(
        lambda: api("GET", "/api/overview"),
        lambda r: all(r[1].get("message_stats", {}).get(k, 0) >= 5
                      for k in ("publish", "ack", "deliver_get")))
    assert status == 200
    for key in ("publish", "ack", "deliver_get"):
        assert o["message_stats"][key] >= 5
        assert "rate" in o["message_stats"][f"{key}_details"]


def test_policies(api, ch, names):
    """A policy set over HTTP applies to matching queues (max-length), is listed in RabbitMQ's
    shape, and goes away on DELETE."""
    queue = names.q()
    name = queue.replace(".", "_") + "_pol"
    path = f"/api/policies/%2F/{q(name)}"
    body = {"pattern": "^" + re.escape(queue) + "$", "definition": {"max-length": 2},
            "priority": 5, "apply-to": "queues"}
    try:
        assert api("PUT", path, body=body)[0] == 201
        assert api("PUT", path, body=body)[0] == 204
        status, p, _ = api("GET", path)
        assert status == 200
        assert {k: p[k] for k in ("vhost", "name", "pattern", "apply-to", "definition", "priority")} == {
            "vhost": "/", "name": name, "pattern": body["pattern"], "apply-to": "queues",
            "definition": {"max-length": 2}, "priority": 5}
        assert name in [x["name"] for x in api("GET", "/api/policies/%2F")[1]]
        ch.queue_declare(queue)
        ch.confirm_delivery()
        for i in range(4):
            ch.basic_publish("", queue, f"m{i}".encode())
        assert eventually(lambda: counts(ch.connection, queue)[0], lambda n: n == 2) == 2
        status, err, _ = api("PUT", f"/api/policies/%2F/{q(name)}x",
                             body={"pattern": "(", "definition": {"max-length": 1}})
        assert status == 400
    finally:
        assert api("DELETE", path)[0] == 204
    assert api("GET", path)[0] == 404


def test_limits_and_topic_permissions(api, params, prefix):
    vhost = prefix.replace("compat.", "ml.")[:60]
    user = prefix.replace("compat.", "mlu.")[:60]
    try:
        assert api("PUT", f"/api/vhosts/{q(vhost)}")[0] == 201
        assert api("PUT", f"/api/users/{q(user)}", body={"password": "pw", "tags": ""})[0] == 201
        assert api("PUT", f"/api/permissions/{q(vhost)}/{q(user)}",
                   body={"configure": ".*", "write": ".*", "read": ".*"})[0] == 201
        # Vhost limit: one connection.
        assert api("PUT", f"/api/vhost-limits/{q(vhost)}/max-connections",
                   body={"value": 1})[0] == 204
        status, limits, _ = api("GET", f"/api/vhost-limits/{q(vhost)}")
        assert status == 200 and limits == [{"vhost": vhost, "value": {"max-connections": 1}}]
        assert {"vhost": vhost, "value": {"max-connections": 1}} in api("GET", "/api/vhost-limits")[1]
        p = pika.ConnectionParameters(host=params.host, port=params.port, virtual_host=vhost,
                                      credentials=pika.PlainCredentials(user, "pw"),
                                      connection_attempts=1)
        first = pika.BlockingConnection(p)
        with pytest.raises(ProbableAccessDeniedError):
            pika.BlockingConnection(p)
        first.close()
        assert api("DELETE", f"/api/vhost-limits/{q(vhost)}/max-connections")[0] == 204
        assert api("GET", f"/api/vhost-limits/{q(vhost)}")[1] == []
        # User limit.
        assert api("PUT", f"/api/user-limits/{q(user)}/max-channels", body={"value": 3})[0] == 204
        status, ulimits, _ = api("GET", f"/api/user-limits/{q(user)}")
        assert status == 200 and ulimits == [{"user": user, "value": {"max-channels": 3}}]
        assert api("DELETE", f"/api/user-limits/{q(user)}/max-channels")[0] == 204
        # Topic permissions on amq.topic.
        assert api("PUT", f"/api/topic-permissions/{q(vhost)}/{q(user)}",
                   body={"exchange": "amq.topic", "write": "^a\\\\.", "read": ".*"})[0] == 201
        status, tps, _ = api("GET", f"/api/topic-permissions/{q(vhost)}/{q(user)}")
        assert status == 200 and tps == [{"user": user, "vhost": vhost, "exchange": "amq.topic",
                                          "write": "^a\\\\.", "read": ".*"}]
        assert api("DELETE", f"/api/topic-permissions/{q(vhost)}/{q(user)}")[0] == 204
        assert api("GET", f"/api/topic-permissions/{q(vhost)}/{q(user)}")[0] == 404
        assert api("DELETE", f"/api/topic-permissions/{q(vhost)}/{q(user)}")[0] == 404
    finally:
        api("DELETE", f"/api/users/{q(user)}")
        api("DELETE", f"/api/vhosts/{q(vhost)}")


def test_definitions_export(api, ch, names):
    """GET /api/definitions lists users (with hashes), vhosts, permissions, queues, exchanges,
    bindings and policies in RabbitMQ's format; the per-vhost export leaves out `vhost`."""
    queue, x = names.q(), names.x()
    ch.queue_declare(queue, durable=True, arguments={"x-max-length": 7})
    ch.exchange_declare(x, "direct", durable=True)
    ch.queue_bind(queue, x, "rk")
    status, d, _ = api("GET", "/api/definitions")
    assert status == 200
    for key in ("rabbit_version", "users", "vhosts", "permissions", "topic_permissions",
                "parameters", "global_parameters", "policies", "queues", "exchanges", "bindings"):
        assert key in d, key
    guest = [u for u in d["users"] if u["name"] == "guest"][0]
    assert guest["hashing_algorithm"] == "rabbit_password_hashing_sha256"
    assert base64.b64decode(guest["password_hash"]) and "administrator" in guest["tags"]
    assert "/" in [v["name"] for v in d["vhosts"]]
    assert {"user": "guest", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"} in d["permissions"]
    assert {"name": queue, "vhost": "/", "durable": True, "auto_delete": False,
            "arguments": {"x-max-length": 7}} in d["queues"]
    mine_x = [e for e in d["exchanges"] if e["name"] == x]
    assert mine_x and {k: mine_x[0][k] for k in ("vhost", "type", "durable", "auto_delete", "internal")} == {
        "vhost": "/", "type": "direct", "durable": True, "auto_delete": False, "internal": False}
    assert not [e for e in d["exchanges"] if e["name"].startswith("amq.") or e["name"] == ""]
    assert {"source": x, "vhost": "/", "destination": queue, "destination_type": "queue",
            "routing_key": "rk", "arguments": {}} in d["bindings"]
    assert not [b for b in d["bindings"] if b["source"] == ""], "default bindings are implicit"
    status, v, _ = api("GET", "/api/definitions/%2F")
    assert status == 200 and "users" not in v
    assert {"name": queue, "durable": True, "auto_delete": False,
            "arguments": {"x-max-length": 7}} in v["queues"]
    # Both exports import back unchanged (everything in them exists and is equivalent).
    assert api("POST", "/api/definitions/%2F", body=v)[0] == 204
    assert api("POST", "/api/definitions", body=d)[0] == 204


DEFINITIONS = Path(__file__).parent / "data" / "rabbitmq-3.10.8-definitions.json"


def test_a_rabbitmq_export_imports_unchanged(api, params):
    """An export taken from RabbitMQ 3.10.8 imports as it is: the user logs in with its
    original password (the hash is kept), the quorum queue, topology, policy, limits and topic
    permission come back, and messages route through the imported bindings."""
    defs = json.loads(DEFINITIONS.read_text())
    try:
        assert api("POST", "/api/definitions", body=defs)[0] == 204
        assert api("POST", "/api/definitions", body=defs)[0] == 204, "importing twice is harmless"
        conn = pika.BlockingConnection(pika.ConnectionParameters(
            host=params.host, port=params.port, virtual_host="imported",
            credentials=pika.PlainCredentials("importer", "imp0rt"), connection_attempts=1))
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            ch.basic_publish("events", "job.1", b"to jobs")
            ch.basic_publish("events", "other", b"to audit only")
            assert counts(conn, "jobs")[0] == 1
            assert counts(conn, "audit")[0] == 2, "events -> fan -> audit carries both"
        finally:
            conn.close()
        status, jobs, _ = api("GET", "/api/queues/imported/jobs")
        assert status == 200 and jobs["type"] == "quorum"
        assert jobs["arguments"] == {"x-delivery-limit": 5, "x-queue-type": "quorum"}
        status, policy, _ = api("GET", "/api/policies/imported/ttl")
        assert status == 200 and policy["definition"] == {"message-ttl": 60000}
        status, limits, _ = api("GET", "/api/vhost-limits/imported")
        assert limits == [{"vhost": "imported", "value": {"max-queues": 100}}]
        status, tps, _ = api("GET", "/api/topic-permissions/imported/importer")
        assert status == 200 and tps[0]["write"] == "^orders\\."
        status, user, _ = api("GET", "/api/users/importer")
        assert user["password_hash"] == defs["users"][0]["password_hash"]
    finally:
        api("DELETE", "/api/vhosts/imported")
        api("DELETE", "/api/users/importer")


def test_channels_and_consumers(api, params, names):
    conn = pika.BlockingConnection(params)
    try:
        queue = names.q()
        ch = conn.channel()
        ch.queue_declare(queue)
        ch.basic_qos(prefetch_count=7)
        ch.confirm_delivery()
        tag = ch.basic_consume(queue, lambda *a: None)
        local_port = conn._impl._transport._sock.getsockname()[1]

        def mine(r):
            return [c for c in (r[1] or [])
                    if c.get("connection_details", {}).get("peer_port") == local_port]

        status, chans, _ = eventually(lambda: api("GET", "/api/channels"),
                                      lambda r: any(c.get("consumer_count") == 1 for c in mine(r)))
        assert status == 200
        [c] = [c for c in mine((status, chans)) if c["number"] == ch.channel_number]
        assert (c["user"], c["vhost"], c["consumer_count"], c["prefetch_count"], c["confirm"]) == (
            "guest", "/", 1, 7, True)

        def my_consumers(r):
            return [k for k in (r[1] or []) if k.get("consumer_tag") == tag]

        status, cons, _ = eventually(lambda: api("GET", "/api/consumers/%2F"),
                                     lambda r: my_consumers(r))
        [k] = my_consumers((status, cons))
        assert k["queue"] == {"name": queue, "vhost": "/"}
        assert k["ack_required"] is True and k["prefetch_count"] == 7
        assert k["channel_details"]["connection_name"] == c["connection_details"]["name"]
    finally:
        conn.close()


def test_put_defaults_and_user_rules(api, params, prefix, names):
    """RabbitMQ's defaults and checks for PUT: a queue or exchange without fields is transient
    (and the exchange direct); a user PUT needs tags; a password hash is taken as it is."""
    queue, x = names.q(), names.x()
    assert api("PUT", f"/api/queues/%2F/{q(queue)}", body={})[0] == 201
    assert api("GET", f"/api/queues/%2F/{q(queue)}")[1]["durable"] is False
    assert api("PUT", f"/api/exchanges/%2F/{q(x)}", body={})[0] == 201
    info = api("GET", f"/api/exchanges/%2F/{q(x)}")[1]
    assert (info["type"], info["durable"]) == ("direct", False)
    status, body, _ = api("PUT", f"/api/queues/%2F/{'n' * 300}", body={})
    assert status == 400, "a name over 255 bytes is refused, not a crash"
    user = prefix.replace("compat.", "mh.")[:60]
    try:
        status, body, _ = api("PUT", f"/api/users/{q(user)}", body={"password": "x"})
        assert (status, body["reason"]) == (400, "tags_not_present")
        # The hash of "imp0rt" exported by RabbitMQ 3.10.8 (see data/).
        defs = json.loads(DEFINITIONS.read_text())
        assert api("PUT", f"/api/users/{q(user)}",
                   body={"password_hash": defs["users"][0]["password_hash"],
                         "hashing_algorithm": "rabbit_password_hashing_sha256",
                         "tags": ""})[0] == 201
        assert api("PUT", f"/api/permissions/%2F/{q(user)}",
                   body={"configure": ".*", "write": ".*", "read": ".*"})[0] == 201
        pika.BlockingConnection(pika.ConnectionParameters(
            host=params.host, port=params.port,
            credentials=pika.PlainCredentials(user, "imp0rt"), connection_attempts=1)).close()
    finally:
        api("DELETE", f"/api/users/{q(user)}")


def test_publish_waits_for_the_queue_and_reports_refusals(api, ch, names):
    queue = names.q()
    ch.queue_declare(queue, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    publish = "/api/exchanges/%2F/amq.default/publish"
    msg = {"properties": {}, "routing_key": queue, "payload": "x", "payload_encoding": "string"}
    assert api("POST", publish, body=msg)[1] == {"routed": True}
    assert counts(ch.connection, queue)[0] == 1
    status, body, _ = api("POST", publish, body=msg)
    assert (status, body) == (400, {"error": "bad_request",
                                    "reason": "rejected Unable to publish message. Check queue limits."})
    assert counts(ch.connection, queue)[0] == 1


def test_management_sessions_do_not_change_connection_counts(api, prometheus_url, conn):
    """Declares and gets through the API use in-process sessions that count against no
    connection or channel limit, and release none either."""
    def gauges():
        text = http("GET", prometheus_url + "/metrics", user=None)[1]
        return (series(text, "rabbitmq_connections").get(frozenset()),
                series(text, "rabbitmq_channels").get(frozenset()))

    conn.channel()
    before = eventually(gauges, lambda g: g[0] is not None and g[0] >= 1)
    for _ in range(3):
        assert api("GET", "/api/aliveness-test/%2F")[1] == {"status": "ok"}
    assert gauges() == before


@pytest.mark.warren_only
def test_monitoring_and_policymaker_limits(api, ctl, params, prefix):
    """Monitoring sees every connection but closes none but its own; policies are read by
    policymakers and written only where the policymaker has permissions."""
    mon = prefix.replace("compat.", "mm.")[:60]
    pol = prefix.replace("compat.", "mq.")[:60]
    try:
        assert ctl("add_user", mon, "pw")[0] == 0
        assert ctl("set_user_tags", mon, "monitoring")[0] == 0
        assert ctl("add_user", pol, "pw")[0] == 0
        assert ctl("set_user_tags", pol, "policymaker")[0] == 0
        conn = pika.BlockingConnection(params)
        try:
            port = conn._impl._transport._sock.getsockname()[1]
            status, conns, _ = eventually(lambda: api("GET", "/api/connections", user=mon, password="pw"),
                                          lambda r: any(c["peer_port"] == port for c in r[1]))
            [c] = [c for c in conns if c["peer_port"] == port]
            status, _, _ = api("DELETE", f"/api/connections/{q(c['name'])}", user=mon, password="pw")
            assert status == 401
            assert conn.is_open
        finally:
            conn.close()
        assert api("GET", "/api/policies", user=mon, password="pw")[0] == 401
        assert api("GET", "/api/policies", user=pol, password="pw")[0] == 200
        body = {"pattern": "^nothing$", "definition": {"max-length": 1}}
        assert api("PUT", "/api/policies/%2F/p1", user=pol, password="pw", body=body)[0] == 401
        assert ctl("set_permissions", pol, ".*", ".*", ".*")[0] == 0
        assert api("PUT", "/api/policies/%2F/p1", user=pol, password="pw", body=body)[0] == 201
        assert api("DELETE", "/api/policies/%2F/p1", user=pol, password="pw")[0] == 204
    finally:
        ctl("delete_user", mon)
        ctl("delete_user", pol)


def _non_loopback_ipv4():
    import subprocess
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    for m in re.finditer(r"inet (\d+\.\d+\.\d+\.\d+)/", out):
        if not m.group(1).startswith("127."):
            return m.group(1)
    return None


@pytest.mark.warren_only
def test_guest_is_refused_from_a_non_loopback_address():
    from conftest import free_port, warren_process
    addr = _non_loopback_ipv4()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    port = free_port()
    with warren_process("--management-listen", f"0.0.0.0:{port}"):
        status, body, _ = http("GET", f"http://{addr}:{port}/api/overview")
        assert (status, body["reason"]) == (401, "User can only log in via localhost")
        assert http("GET", f"http://127.0.0.1:{port}/api/overview")[0] == 200


def test_list_pagination_sorting_and_columns(api, ch, names):
    """RabbitMQ's list parameters: name filter, sort, sort_reverse, columns, page/page_size."""
    qs = [names.q(f"p{i}") for i in range(3)]
    for i, queue in enumerate(qs):
        ch.queue_declare(queue)
        for _ in range(i):
            ch.basic_publish("", queue, b"m")
    counts(ch.connection, qs[-1])
    prefix = names.prefix
    base = f"/api/queues/%2F?name={q(prefix)}&columns=name,messages"

    def page(extra):
        return api("GET", base + extra)

    status, p, _ = eventually(lambda: page("&page=1&page_size=2&sort=name"),
                              lambda r: r[0] == 200 and r[1].get("filtered_count") == 3
                              and [i.get("messages") for i in r[1]["items"]] == [0, 1])
    assert status == 200
    assert {k: p[k] for k in ("filtered_count", "item_count", "page", "page_count", "page_size")} == {
        "filtered_count": 3, "item_count": 2, "page": 1, "page_count": 2, "page_size": 2}
    assert p["items"] == [{"name": qs[0], "messages": 0}, {"name": qs[1], "messages": 1}]
    status, p2, _ = page("&page=2&page_size=2&sort=name")
    assert status == 200 and p2["items"] == [{"name": qs[2], "messages": 2}]
    status, rev, _ = page("&page=1&sort=name&sort_reverse=true")
    assert status == 200 and [i["name"] for i in rev["items"]] == list(reversed(qs))
    pattern = q(re.escape(prefix) + r"\.p[02]$")
    status, rx, _ = api("GET", f"/api/queues/%2F?page=1&name={pattern}&use_regex=true"
                               "&columns=name&sort=name")
    assert status == 200 and rx["items"] == [{"name": qs[0]}, {"name": qs[2]}]
    status, _, _ = api("GET", f"/api/queues/%2F?page=1&page_size=501")
    assert status == 400


def test_queue_message_stats_count_publishes_deliveries_and_acks(api, ch, names):
    """A queue's own `message_stats` (what the UI's queue rates are computed from)."""
    queue = names.q()
    ch.queue_declare(queue)
    for i in range(4):
        ch.basic_publish("", queue, f"m{i}".encode())
    counts(ch.connection, queue)
    method, _, _ = ch.basic_get(queue, auto_ack=False)
    ch.basic_ack(method.delivery_tag)
    method, _, _ = ch.basic_get(queue, auto_ack=False)
    ch.basic_nack(method.delivery_tag, requeue=True)
    method, _, _ = ch.basic_get(queue, auto_ack=True)  # the requeued one: redelivered
    assert method.redelivered
    counts(ch.connection, queue)
    path = f"/api/queues/%2F/{q(queue)}"
    _, info, _ = eventually(lambda: api("GET", path),
                            lambda r: r[1].get("message_stats", {}).get("deliver_get", 0) >= 3
                            and r[1]["message_stats"].get("ack", 0) >= 1
                            and r[1]["message_stats"].get("publish", 0) >= 4)
    stats = info["message_stats"]
    assert stats["publish"] == 4
    assert stats["ack"] == 1
    assert stats["redeliver"] == 1
    assert stats["deliver_get"] == 3
    assert "rate" in stats["publish_details"]


@pytest.mark.warren_only
def test_oldest_ready_message_age(api, ch, names):
    """Warren's `oldest_ready_message_age_ms`: how long the head of the queue has waited, null
    when nothing is ready; it survives a requeue (counted from the first enqueue)."""
    queue = names.q()
    path = f"/api/queues/%2F/{q(queue)}"
    ch.queue_declare(queue)
    assert api("GET", path)[1]["oldest_ready_message_age_ms"] is None
    before = time.monotonic()
    ch.basic_publish("", queue, b"first")
    counts(ch.connection, queue)
    _, info, _ = api("GET", path)
    age = info["oldest_ready_message_age_ms"]
    assert age is not None and 0 <= age <= (time.monotonic() - before) * 1000 + 5
    # Wait until the head is measurably older than a message published now.
    eventually(lambda: api("GET", path), lambda r: r[1]["oldest_ready_message_age_ms"] >= 200)
    method, _, _ = ch.basic_get(queue, auto_ack=False)
    ch.basic_publish("", queue, b"second")
    counts(ch.connection, queue)
    _, info, _ = api("GET", path)
    assert info["oldest_ready_message_age_ms"] < 200  # only "second" is ready now
    ch.basic_nack(method.delivery_tag, requeue=True)
    counts(ch.connection, queue)
    _, info, _ = api("GET", path)
    assert info["oldest_ready_message_age_ms"] >= 200  # "first" is back and keeps its age
    ch.queue_purge(queue)
    assert api("GET", path)[1]["oldest_ready_message_age_ms"] is None


def test_operator_policies_cap_queue_limits(api, ch, names):
    """An operator policy's limit wins over a higher one from a policy or an argument; the
    queue reports both policies and the effective definition. Only administrators use them."""
    queue = names.q()
    pol, op = "pol-" + queue, "op-" + queue
    pattern = "^" + re.escape(queue) + "$"
    path = f"/api/operator-policies/%2F/{q(op)}"
    assert api("PUT", f"/api/policies/%2F/{q(pol)}",
               body={"pattern": pattern, "definition": {"max-length": 50},
                     "apply-to": "queues"})[0] == 201
    assert api("PUT", path, body={"pattern": pattern, "definition": {"max-length": 3},
                                  "apply-to": "queues"})[0] == 201
    try:
        status, got, _ = api("GET", path)
        assert status == 200
        assert (got["name"], got["pattern"], got["definition"]) == (op, pattern, {"max-length": 3})
        assert op in [p["name"] for p in api("GET", "/api/operator-policies/%2F")[1]]
        assert op in [p["name"] for p in api("GET", "/api/operator-policies")[1]]
        ch.queue_declare(queue, arguments={"x-max-length": 20})
        for i in range(6):
            ch.basic_publish("", queue, f"m{i}".encode())
        assert counts(ch.connection, queue)[0] == 3
        _, info, _ = eventually(lambda: api("GET", f"/api/queues/%2F/{q(queue)}"),
                                lambda r: r[1].get("operator_policy") == op
                                and r[1].get("policy") == pol)
        assert (info["policy"], info["operator_policy"]) == (pol, op)
        assert info["effective_policy_definition"]["max-length"] == 3
        # Limits only: anything else is refused.
        status, body, _ = api("PUT", path, body={"pattern": pattern,
                                                 "definition": {"dead-letter-exchange": "x"}})
        assert status == 400, body
    finally:
        assert api("DELETE", path)[0] == 204
        assert api("DELETE", f"/api/policies/%2F/{q(pol)}")[0] == 204
    assert api("GET", path)[0] == 404
    assert api("DELETE", path)[0] == 404
    # With the cap gone the queue's own limit (20) applies again.
    for i in range(6):
        ch.basic_publish("", queue, f"n{i}".encode())
    assert counts(ch.connection, queue)[0] == 9


def test_operator_policies_need_administrator(api, ctl, prefix):
    user = prefix + "-pm"
    assert api("PUT", f"/api/users/{q(user)}",
               body={"password": "pw", "tags": "policymaker"})[0] in (201, 204)
    assert api("PUT", f"/api/permissions/%2F/{q(user)}",
               body={"configure": ".*", "write": ".*", "read": ".*"})[0] in (201, 204)
    try:
        assert api("GET", "/api/policies/%2F", user=user, password="pw")[0] == 200
        # A policymaker may read operator policies but not set or clear them.
        assert api("GET", "/api/operator-policies/%2F", user=user, password="pw")[0] == 200
        status, _, _ = api("PUT", "/api/operator-policies/%2F/nope", user=user, password="pw",
                           body={"pattern": ".*", "definition": {"max-length": 1},
                                 "apply-to": "queues"})
        assert status == 401
        assert api("DELETE", "/api/operator-policies/%2F/nope", user=user, password="pw")[0] == 401
    finally:
        api("DELETE", f"/api/users/{q(user)}")


def test_port_listener_health_check(api, amqp_url):
    port = urllib.parse.urlparse(amqp_url).port or 5672
    status, body, _ = api("GET", f"/api/health/checks/port-listener/{port}")
    assert (status, body["status"]) == (200, "ok"), body
    status, body, _ = api("GET", "/api/health/checks/port-listener/1")
    assert (status, body["status"]) == (503, "failed"), body
    assert port in body["ports"]
    assert api("GET", "/api/health/checks/port-listener/not-a-port")[0] == 400


@pytest.mark.rabbitmq4
def test_ready_to_serve_clients_health_check(api):
    status, body, _ = api("GET", "/api/health/checks/ready-to-serve-clients")
    assert (status, body["status"]) == (200, "ok"), body


def test_bindings_differing_only_in_arguments_have_their_own_keys(api, ch, names):
    queue, x = names.q(), names.x()
    ch.queue_declare(queue)
    ch.exchange_declare(x, "headers")
    pair = f"/api/bindings/%2F/e/{q(x)}/q/{q(queue)}"
    for fmt in ("pdf", "zip"):
        status, _, headers = api("POST", pair, body={"routing_key": "",
                                                     "arguments": {"x-match": "all", "format": fmt}})
        assert status == 201
        # Relative to the POST's URL, as RabbitMQ writes it: "<queue>/<properties_key>".
        assert headers["Location"].startswith(q(queue) + "/"), headers["Location"]
    status, listed, _ = api("GET", pair)
    assert status == 200 and len(listed) == 2
    keys = {b["arguments"]["format"]: b["properties_key"] for b in listed}
    assert keys["pdf"] != keys["zip"]
    status, one, _ = api("GET", f"{pair}/{keys['zip']}")
    assert status == 200 and one["arguments"]["format"] == "zip"
    assert api("DELETE", f"{pair}/{keys['zip']}")[0] == 204
    status, listed, _ = api("GET", pair)
    assert [b["arguments"]["format"] for b in listed] == ["pdf"]
    assert api("DELETE", f"{pair}/{keys['zip']}")[0] == 404


def test_creating_in_a_missing_vhost_is_vhost_not_found(api):
    missing = "no-such-vhost-" + uuid_hex()
    for method, path, body in [
        ("PUT", f"/api/queues/{missing}/q", {"durable": False}),
        ("PUT", f"/api/exchanges/{missing}/x", {"type": "direct"}),
        ("PUT", f"/api/policies/{missing}/p", {"pattern": ".*", "definition": {"max-length": 1}}),
        ("POST", f"/api/bindings/{missing}/e/x/q/q", {"routing_key": "k"}),
    ]:
        status, reply, _ = api(method, path, body=body)
        assert (status, reply) == (404, {"error": "not_found", "reason": "vhost_not_found"}), path
    # Grants name a user and a vhost: RabbitMQ answers 400 for either missing.
    status, reply, _ = api("PUT", f"/api/permissions/{missing}/guest",
                           body={"configure": ".*", "write": ".*", "read": ".*"})
    assert (status, reply["reason"]) == (400, "vhost_or_user_not_found")


def uuid_hex():
    import uuid
    return uuid.uuid4().hex


@pytest.mark.warren_only
def test_ready_to_serve_clients_fails_at_the_connection_limit(tmp_path):
    """Warren's ready-to-serve-clients is 503 while `connection_max` is reached."""
    from conftest import warren_process
    config = tmp_path / "warren.toml"
    config.write_text("connection_max = 1\n")
    with warren_process("--config", str(config)) as w:
        base = f"http://127.0.0.1:{w['management_port']}"
        path = base + "/api/health/checks/ready-to-serve-clients"
        assert http("GET", path)[:2] == (200, {"status": "ok"})
        conn = pika.BlockingConnection(pika.ConnectionParameters(host="127.0.0.1", port=w["port"]))
        try:
            status, body, _ = http("GET", path)
            assert (status, body["status"]) == (503, "failed"), body
            assert "connection limit (1)" in body["reason"]
        finally:
            conn.close()
        assert eventually(lambda: http("GET", path), lambda r: r[0] == 200)[0] == 200
