"""Independent black-box tests of the management HTTP API and the Prometheus endpoint.

Written from RabbitMQ's documentation (https://www.rabbitmq.com/docs/http-api-reference,
/docs/management, /docs/prometheus, /docs/monitoring) and from the observed behaviour of
RabbitMQ 3.10.8; every expectation below was checked against that broker. Where RabbitMQ 3.10
is known (or suspected) to differ from RabbitMQ 4.x, the assertion accepts both and says so.

Management statistics (message counts, message_stats, connection/channel stats) are emitted
periodically (every ~5 s by default), so tests poll with a bounded deadline instead of sleeping.
Every test removes what it creates (queues and exchanges through the `names` fixture, users,
vhosts, policies and limits through the `cleanup` fixture or try/finally).
"""

import base64
import json
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import pika
import pytest
from pika.exceptions import ConnectionClosedByBroker

from test_management import declared_args

POLL_TIMEOUT = 15.0
HTTP_TIMEOUT = 30.0


# --------------------------------------------------------------------------------------------
# HTTP helpers (standard library only)
# --------------------------------------------------------------------------------------------

def enc(segment):
    """Percent-encode one path segment (the default vhost "/" becomes %2F)."""
    return urllib.parse.quote(segment, safe="")


class Resp:
    def __init__(self, status, headers, text):
        self.status = status
        self.headers = {k.lower(): v for k, v in headers.items()}
        self.text = text

    def json(self):
        return json.loads(self.text)

    def __repr__(self):
        return f"<Resp {self.status} {self.text[:300]!r}>"


class Api:
    def __init__(self, base, user="guest", password="guest"):
        self.base = base.rstrip("/")
        self.user = user
        self.password = password

    def as_user(self, user, password):
        return Api(self.base, user, password)

    def anonymous(self):
        return Api(self.base, None, None)

    def request(self, method, path, body=None, raw=None, headers=None):
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if self.user is not None:
            token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
            req.add_header("Authorization", "Basic " + token)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        for k, v in (headers or {}).items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as r:
                return Resp(r.status, dict(r.headers), r.read().decode("utf-8", "replace"))
        except urllib.error.HTTPError as e:
            return Resp(e.code, dict(e.headers), e.read().decode("utf-8", "replace"))

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def put(self, path, body=None, **kw):
        return self.request("PUT", path, body=body if body is not None else {}, **kw)

    def post(self, path, body=None, **kw):
        return self.request("POST", path, body=body if body is not None else {}, **kw)

    def delete(self, path, **kw):
        return self.request("DELETE", path, **kw)

    def get_json(self, path):
        r = self.get(path)
        assert r.status == 200, (path, r)
        return r.json()


def poll(fetch, pred, timeout=POLL_TIMEOUT, step=0.2, what="condition"):
    """Call fetch() until pred(value) holds; fail after `timeout` seconds. Returns the value."""
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if pred(value):
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not met within {timeout}s; last value: {value!r}"[:3000])
        time.sleep(step)


def tags_of(value):
    """User tags: a JSON list (RabbitMQ 3.9+) or a comma-separated string (older)."""
    if isinstance(value, list):
        return set(value)
    return {t for t in value.split(",") if t}


def is_num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def qpath(vhost, name):
    return f"/api/queues/{enc(vhost)}/{enc(name)}"


def xpath(vhost, name):
    return f"/api/exchanges/{enc(vhost)}/{enc(name)}"


def queue_stats(api, vhost, name, pred=lambda q: True, what="queue stats"):
    """GET a queue until its statistics (messages, ...) are present and pred(queue) holds."""
    def fetch():
        r = api.get(qpath(vhost, name))
        assert r.status == 200, r
        return r.json()
    return poll(fetch, lambda q: "messages" in q and pred(q), what=what)


def publish_api(api, vhost, exchange, routing_key, payload, encoding="string", properties=None):
    r = api.post(xpath(vhost, exchange) + "/publish", {
        "routing_key": routing_key, "payload": payload, "payload_encoding": encoding,
        "properties": properties or {}})
    assert r.status == 200, r
    return r.json()


def get_msgs(api, vhost, queue, count=1, ackmode="ack_requeue_true", encoding="auto", **extra):
    r = api.post(qpath(vhost, queue) + "/get",
                 {"count": count, "ackmode": ackmode, "encoding": encoding, **extra})
    assert r.status == 200, r
    return r.json()


def passive_count(connection, queue):
    channel = connection.channel()
    try:
        return channel.queue_declare(queue, passive=True).method.message_count
    finally:
        if channel.is_open:
            channel.close()


# --------------------------------------------------------------------------------------------
# Prometheus text format helpers
# --------------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text):
    """[(name, {label: value}, float)] for every sample line."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\")
                  for k, v in _LABEL.findall(m.group(2) or "")}
        out.append((m.group(1), labels, float(m.group(3))))
    return out


def scrape(prometheus_url, path="/metrics"):
    with urllib.request.urlopen(prometheus_url.rstrip("/") + path, timeout=HTTP_TIMEOUT) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode()


def samples(prometheus_url, path="/metrics"):
    return parse_metrics(scrape(prometheus_url, path)[2])


def metric_sum(parsed, name, **labels):
    """Sum of all samples of `name` whose labels include `labels`; None if there is none."""
    values = [v for n, ls, v in parsed
              if n == name and all(ls.get(k) == val for k, val in labels.items())]
    return sum(values) if values else None


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------

@pytest.fixture
def api(management_url):
    return Api(management_url)


@pytest.fixture
def cleanup(api):
    """Register API paths to DELETE after the test (in reverse order)."""
    paths = []
    yield paths.append
    for path in reversed(paths):
        try:
            api.delete(path)
        except Exception:
            pass


@pytest.fixture
def make_user(api, prefix, cleanup):
    """make_user(tags) -> (name, password); the user is deleted after the test."""
    counter = [0]

    def _make(tags="", password=None):
        counter[0] += 1
        name = f"{prefix}.u{counter[0]}"
        password = password or uuid.uuid4().hex
        cleanup(f"/api/users/{enc(name)}")
        r = api.put(f"/api/users/{enc(name)}", {"password": password, "tags": tags})
        assert r.status == 201, r
        return name, password
    return _make


@pytest.fixture
def vhost(api, prefix, cleanup):
    """A fresh vhost on which guest has full permissions; deleted after the test."""
    name = f"{prefix}.vh"
    cleanup(f"/api/vhosts/{enc(name)}")
    assert api.put(f"/api/vhosts/{enc(name)}").status == 201
    r = api.put(f"/api/permissions/{enc(name)}/guest",
                {"configure": ".*", "write": ".*", "read": ".*"})
    assert r.status in (201, 204), r
    return name


@pytest.fixture
def api_queue(api, names):
    """Declare a non-durable classic queue in "/" through the API (deleted by `names`)."""
    def _make(suffix="q", body=None):
        name = names.q(suffix)
        r = api.put(qpath("/", name), body or {"durable": False, "auto_delete": False})
        assert r.status == 201, r
        return name
    return _make


def amqp_port(amqp_url):
    return urllib.parse.urlparse(amqp_url).port or 5672


# ============================================================================================
# Authentication and authorisation
# ============================================================================================

def test_auth_no_credentials_is_401_with_basic_challenge(api):
    r = api.anonymous().get("/api/overview")
    assert r.status == 401, r
    assert "basic" in r.headers.get("www-authenticate", "").lower()


def test_auth_wrong_password_and_unknown_user_are_401(api):
    assert api.as_user("guest", "not-the-password-" + uuid.uuid4().hex).get("/api/overview").status == 401
    assert api.as_user("nobody-" + uuid.uuid4().hex, "x").get("/api/overview").status == 401


def test_auth_user_without_tags_is_refused(api, make_user):
    user, pw = make_user(tags="")
    as_user = api.as_user(user, pw)
    assert as_user.get("/api/overview").status == 401
    assert as_user.get("/api/whoami").status == 401
    assert as_user.get("/api/queues").status == 401


def test_auth_management_tag_can_read_overview_but_not_admin_endpoints(api, make_user, cleanup):
    user, pw = make_user(tags="management")
    cleanup(f"/api/vhosts/{enc(user)}.nope")
    as_user = api.as_user(user, pw)
    r = as_user.get("/api/overview")
    assert r.status == 200, r
    assert "rabbitmq_version" in r.json()
    assert as_user.get("/api/users").status == 401
    assert as_user.put(f"/api/vhosts/{enc(user)}.nope").status == 401
    # node details need the monitoring tag
    assert as_user.get("/api/nodes").status == 401
    # a management user only sees vhosts it has permissions for (none here)
    vhosts = as_user.get_json("/api/vhosts")
    assert "/" not in [v["name"] for v in vhosts]


def test_auth_monitoring_sees_all_connections_and_vhosts(api, make_user, conn):
    user, pw = make_user(tags="monitoring")
    as_user = api.as_user(user, pw)
    # guest's connection (owned by another user) is visible to a monitoring user
    conns = poll(lambda: as_user.get_json("/api/connections"),
                 lambda cs: any(c.get("user") == "guest" for c in cs), what="guest connection listed")
    assert all("name" in c for c in conns)
    # all vhosts are visible although the user has no permissions at all
    assert "/" in [v["name"] for v in as_user.get_json("/api/vhosts")]
    assert as_user.get("/api/nodes").status == 200
    assert as_user.get("/api/users").status == 401


def test_auth_policymaker_manages_policies_only_where_permitted(api, make_user, vhost, cleanup, prefix):
    user, pw = make_user(tags="policymaker")
    assert api.put(f"/api/permissions/{enc(vhost)}/{enc(user)}",
                   {"configure": ".*", "write": ".*", "read": ".*"}).status == 201
    as_user = api.as_user(user, pw)
    pol = f"/api/policies/{enc(vhost)}/pm"
    cleanup(pol)
    r = as_user.put(pol, {"pattern": "^nothing-matches-this$", "definition": {"max-length": 3}})
    assert r.status == 201, r
    got = as_user.get_json(pol)
    assert got["definition"] == {"max-length": 3}
    assert got["apply-to"] == "all" and got["priority"] == 0  # defaults
    # no permissions in "/" -> refused
    other = f"/api/policies/%2F/{enc(prefix)}.pm"
    cleanup(other)
    assert as_user.put(other, {"pattern": "^x$", "definition": {"max-length": 1}}).status == 401
    # operator policies and vhosts are administrator-only
    op = f"/api/operator-policies/{enc(vhost)}/pm"
    cleanup(op)
    assert as_user.put(op, {"pattern": "^x$", "definition": {"max-length": 1}}).status == 401
    assert as_user.delete(pol).status == 204
    assert api.get(pol).status == 404


def test_whoami(api, make_user):
    me = api.get_json("/api/whoami")
    assert me["name"] == "guest"
    assert "administrator" in tags_of(me["tags"])
    user, pw = make_user(tags="management,monitoring")
    me = api.as_user(user, pw).get_json("/api/whoami")
    assert me["name"] == user
    assert tags_of(me["tags"]) == {"management", "monitoring"}


# ============================================================================================
# Overview, nodes, cluster name
# ============================================================================================

def test_overview_fields(api):
    o = api.get_json("/api/overview")
    for key in ("management_version", "rabbitmq_version", "cluster_name", "node"):
        assert isinstance(o[key], str) and o[key], key
    totals = o["object_totals"]
    for key in ("connections", "channels", "exchanges", "queues", "consumers"):
        assert is_int(totals[key]) and totals[key] >= 0, key
    # the default vhost alone has "" and amq.direct/fanout/headers/match/topic
    assert totals["exchanges"] >= 6
    qt = o["queue_totals"]
    for key in ("messages", "messages_ready", "messages_unacknowledged"):
        assert is_int(qt[key]) and qt[key] >= 0, key
    assert qt["messages"] == qt["messages_ready"] + qt["messages_unacknowledged"]
    assert o["cluster_name"] == api.get_json("/api/cluster-name")["name"]
    assert o["node"] in [n["name"] for n in api.get_json("/api/nodes")]


def test_overview_listeners_and_exchange_types(api, amqp_url):
    o = api.get_json("/api/overview")
    listeners = o["listeners"]
    assert isinstance(listeners, list) and listeners
    for listener in listeners:
        assert isinstance(listener["protocol"], str)
        assert is_int(listener["port"])
        assert isinstance(listener["ip_address"], str)
    amqp = [lst for lst in listeners if lst["protocol"] == "amqp"]
    assert amqp_port(amqp_url) in [lst["port"] for lst in amqp]
    types = {t["name"] for t in o["exchange_types"]}
    assert {"direct", "fanout", "topic", "headers"} <= types


def test_overview_message_stats_after_traffic(api, conn, ch, names):
    def stats():
        return api.get_json("/api/overview").get("message_stats", {})
    before = stats()
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    for i in range(3):
        ch.basic_publish("", q, f"m{i}".encode())
    for _ in range(3):
        method, _, _ = ch.basic_get(q, auto_ack=False)
        assert method is not None
        ch.basic_ack(method.delivery_tag)

    def grown(s):
        return all(s.get(k, 0) >= before.get(k, 0) + 3 for k in ("publish", "ack", "deliver_get"))
    after = poll(stats, grown, what="overview message_stats grow by 3")
    for key in ("publish", "ack", "deliver_get"):
        assert is_int(after[key])
        assert is_num(after[f"{key}_details"]["rate"]), key


def test_nodes_fields_and_relations(api):
    nodes = api.get_json("/api/nodes")
    assert isinstance(nodes, list) and nodes
    n = nodes[0]
    assert isinstance(n["name"], str) and n["name"]
    assert n["running"] is True
    for key in ("mem_used", "mem_limit", "disk_free", "disk_free_limit", "fd_used", "fd_total",
                "sockets_used", "sockets_total", "uptime"):
        assert is_int(n[key]), (key, n[key])
    assert isinstance(n["mem_alarm"], bool) and isinstance(n["disk_free_alarm"], bool)
    assert n["mem_used"] > 0 and n["mem_limit"] > 0
    assert n["disk_free"] > 0 and n["disk_free_limit"] >= 0
    assert 0 <= n["fd_used"] <= n["fd_total"] and n["fd_total"] > 0
    # Lenient: RabbitMQ 4.0 removed socket accounting and reports sockets_used and
    # sockets_total as 0 (release notes, "Several Disk I/O-Related Metrics were Removed");
    # 3.10 reports real values.
    assert n["sockets_used"] >= 0 and n["sockets_total"] >= 0
    if n["sockets_total"] > 0:
        assert n["sockets_used"] <= n["sockets_total"]
    assert n["uptime"] > 0
    single = api.get_json(f"/api/nodes/{enc(n['name'])}")
    assert single["name"] == n["name"] and single["running"] is True


def test_cluster_name(api):
    r = api.get("/api/cluster-name")
    assert r.status == 200
    body = r.json()
    assert isinstance(body["name"], str) and body["name"]


# ============================================================================================
# Virtual hosts
# ============================================================================================

def test_vhost_lifecycle(api, prefix, cleanup):
    name = f"{prefix}.life"
    path = f"/api/vhosts/{enc(name)}"
    cleanup(path)
    assert api.get(path).status == 404
    assert api.put(path).status == 201
    assert api.put(path).status == 204
    v = api.get_json(path)
    assert v["name"] == name
    assert v["tracing"] is False
    assert name in [x["name"] for x in api.get_json("/api/vhosts")]
    assert api.delete(path).status == 204
    assert api.delete(path).status == 404
    assert api.get(path).status == 404
    assert name not in [x["name"] for x in api.get_json("/api/vhosts")]


def test_default_vhost_has_message_counters(api):
    v = poll(lambda: api.get_json("/api/vhosts/%2F"), lambda v: "messages" in v,
             what="vhost statistics")
    assert v["name"] == "/"
    for key in ("messages", "messages_ready", "messages_unacknowledged"):
        assert is_int(v[key]) and v[key] >= 0


def test_vhost_permissions_listing(api, vhost, make_user):
    user, _ = make_user(tags="management")
    assert api.put(f"/api/permissions/{enc(vhost)}/{enc(user)}",
                   {"configure": "^c", "write": "^w", "read": "^r"}).status == 201
    perms = api.get_json(f"/api/vhosts/{enc(vhost)}/permissions")
    by_user = {p["user"]: p for p in perms}
    assert set(by_user) == {"guest", user}
    assert by_user[user] == {"user": user, "vhost": vhost, "configure": "^c", "write": "^w",
                             "read": "^r"}
    assert api.get("/api/vhosts/no-such-vhost-" + uuid.uuid4().hex + "/permissions").status == 404


# ============================================================================================
# Users and permissions
# ============================================================================================

def test_user_with_tags_as_string(api, prefix, cleanup):
    name = f"{prefix}.s"
    path = f"/api/users/{enc(name)}"
    cleanup(path)
    assert api.put(path, {"password": "pw", "tags": "management,policymaker"}).status == 201
    assert api.put(path, {"password": "pw", "tags": "management,policymaker"}).status == 204
    u = api.get_json(path)
    assert u["name"] == name
    assert tags_of(u["tags"]) == {"management", "policymaker"}
    assert isinstance(u["password_hash"], str) and u["password_hash"]
    assert isinstance(u["hashing_algorithm"], str) and u["hashing_algorithm"]
    assert "password" not in u
    assert name in [x["name"] for x in api.get_json("/api/users")]
    assert api.as_user(name, "pw").get("/api/whoami").status == 200


def test_user_with_tags_as_list(api, prefix, cleanup):
    name = f"{prefix}.l"
    path = f"/api/users/{enc(name)}"
    cleanup(path)
    assert api.put(path, {"password": "pw", "tags": ["monitoring", "management"]}).status == 201
    assert tags_of(api.get_json(path)["tags"]) == {"monitoring", "management"}
    # updating the tags replaces them
    assert api.put(path, {"password": "pw", "tags": ""}).status == 204
    assert tags_of(api.get_json(path)["tags"]) == set()


def test_user_password_hash_form(api, make_user, prefix, cleanup):
    src, pw = make_user(tags="management")
    src_info = api.get_json(f"/api/users/{enc(src)}")
    clone = f"{prefix}.clone"
    cleanup(f"/api/users/{enc(clone)}")
    r = api.put(f"/api/users/{enc(clone)}", {
        "password_hash": src_info["password_hash"],
        "hashing_algorithm": src_info["hashing_algorithm"], "tags": "management"})
    assert r.status == 201, r
    assert api.get_json(f"/api/users/{enc(clone)}")["password_hash"] == src_info["password_hash"]
    # the clone logs in with the source user's password
    assert api.as_user(clone, pw).get_json("/api/whoami")["name"] == clone
    # an empty hash disables password login
    nohash = f"{prefix}.nohash"
    cleanup(f"/api/users/{enc(nohash)}")
    assert api.put(f"/api/users/{enc(nohash)}", {"password_hash": "", "tags": "management"}).status == 201
    assert api.as_user(nohash, "").get("/api/overview").status == 401


def test_user_delete(api, make_user):
    user, pw = make_user(tags="management")
    path = f"/api/users/{enc(user)}"
    assert api.as_user(user, pw).get("/api/overview").status == 200
    assert api.delete(path).status == 204
    assert api.delete(path).status == 404
    assert api.get(path).status == 404
    assert api.as_user(user, pw).get("/api/overview").status == 401


def test_permissions_crud(api, vhost, make_user):
    user, _ = make_user()
    path = f"/api/permissions/{enc(vhost)}/{enc(user)}"
    assert api.get(path).status == 404
    assert api.get_json(f"/api/users/{enc(user)}/permissions") == []
    body = {"configure": "^cfg", "write": "^wr", "read": ".*"}
    assert api.put(path, body).status == 201
    assert api.put(path, body).status == 204
    expected = {"user": user, "vhost": vhost, **body}
    assert api.get_json(path) == expected
    assert api.get_json(f"/api/users/{enc(user)}/permissions") == [expected]
    assert expected in api.get_json("/api/permissions")
    assert api.delete(path).status == 204
    assert api.delete(path).status == 404
    assert api.get(path).status == 404


def test_permissions_for_unknown_user_or_vhost(api, vhost, make_user):
    user, _ = make_user()
    perms = {"configure": ".*", "write": ".*", "read": ".*"}
    # RabbitMQ answers 400 {"reason": "vhost_or_user_not_found"} for both
    r = api.put(f"/api/permissions/{enc(vhost)}/nobody-{uuid.uuid4().hex}", perms)
    assert r.status == 400, r
    r = api.put(f"/api/permissions/no-such-vhost-{uuid.uuid4().hex}/{enc(user)}", perms)
    assert r.status == 400, r
    assert api.get(f"/api/users/nobody-{uuid.uuid4().hex}/permissions").status == 404


def test_topic_permissions_crud(api, vhost, make_user):
    user, _ = make_user()
    path = f"/api/topic-permissions/{enc(vhost)}/{enc(user)}"
    assert api.get(path).status == 404
    assert api.put(path, {"exchange": "amq.topic", "write": "^a", "read": "^b"}).status == 201
    expected = {"user": user, "vhost": vhost, "exchange": "amq.topic", "write": "^a", "read": "^b"}
    assert api.get_json(path) == [expected]
    assert api.get_json(f"/api/users/{enc(user)}/topic-permissions") == [expected]
    assert expected in api.get_json(f"/api/vhosts/{enc(vhost)}/topic-permissions")
    assert api.delete(path).status == 204
    assert api.get(path).status == 404


# ============================================================================================
# Queues
# ============================================================================================

def test_queue_declare_status_codes(api, names):
    q = names.q()
    path = qpath("/", q)
    assert api.put(path, {"durable": False, "auto_delete": False}).status == 201
    assert api.put(path, {"durable": False, "auto_delete": False}).status == 204
    r = api.put(path, {"durable": False, "auto_delete": False, "arguments": {"x-max-length": 5}})
    assert r.status == 400, r
    body = r.json()
    assert body["error"] == "bad_request"
    assert "x-max-length" in body["reason"]
    r = api.put(path, {"durable": True, "auto_delete": False})
    assert r.status == 400 and "durable" in r.json()["reason"], r


def test_queue_fields(api, names):
    q = names.q()
    assert api.put(qpath("/", q), {"durable": True, "auto_delete": False,
                                   "arguments": {"x-max-length": 100}}).status == 201
    publish_api(api, "/", "amq.default", q, "ab")
    publish_api(api, "/", "amq.default", q, "cde")
    info = queue_stats(api, "/", q, lambda x: x["messages"] == 2)
    assert info["name"] == q and info["vhost"] == "/"
    assert info["durable"] is True and info["auto_delete"] is False and info["exclusive"] is False
    assert declared_args(info) == {"x-max-length": 100}
    assert info["type"] == "classic"
    assert info["state"] == "running"
    assert isinstance(info["node"], str) and info["node"]
    assert info["messages_ready"] == 2 and info["messages_unacknowledged"] == 0
    assert info["consumers"] == 0
    assert info["message_bytes"] == 5


def test_queue_listings(api, api_queue):
    q = api_queue()
    everywhere = api.get_json("/api/queues")
    assert ("/", q) in [(x["vhost"], x["name"]) for x in everywhere]
    in_default = api.get_json("/api/queues/%2F")
    assert q in [x["name"] for x in in_default]
    assert all(x["vhost"] == "/" for x in in_default)
    assert api.get("/api/queues/no-such-vhost-" + uuid.uuid4().hex).status == 404


def test_queue_purge(api, conn, ch, names):
    q = names.q()
    ch.queue_declare(q)
    for i in range(3):
        ch.basic_publish("", q, b"x")
    assert passive_count(conn, q) == 3
    assert api.delete(qpath("/", q) + "/contents").status == 204
    assert passive_count(conn, q) == 0
    assert get_msgs(api, "/", q, count=5) == []


def test_get_ack_requeue_true_keeps_messages(api, conn, ch, names):
    q = names.q()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"m1")
    ch.basic_publish("", q, b"m2")
    msgs = get_msgs(api, "/", q, count=5)
    assert [m["payload"] for m in msgs] == ["m1", "m2"]
    assert [m["message_count"] for m in msgs] == [1, 0]
    assert [m["redelivered"] for m in msgs] == [False, False]
    assert passive_count(conn, q) == 2
    again = get_msgs(api, "/", q, count=1)
    assert again[0]["payload"] == "m1" and again[0]["redelivered"] is True


def test_get_ack_requeue_false_removes_message(api, conn, ch, names):
    q = names.q()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"m1")
    ch.basic_publish("", q, b"m2")
    msgs = get_msgs(api, "/", q, count=1, ackmode="ack_requeue_false")
    assert [m["payload"] for m in msgs] == ["m1"]
    assert passive_count(conn, q) == 1
    assert [m["payload"] for m in get_msgs(api, "/", q, count=1, ackmode="ack_requeue_false")] == ["m2"]
    assert get_msgs(api, "/", q, count=1) == []


def test_get_reject_modes(api, conn, ch, names):
    q = names.q()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"only")
    first = get_msgs(api, "/", q, count=1, ackmode="reject_requeue_true")
    assert first[0]["payload"] == "only" and first[0]["redelivered"] is False
    assert passive_count(conn, q) == 1
    second = get_msgs(api, "/", q, count=1, ackmode="reject_requeue_false")
    assert second[0]["payload"] == "only" and second[0]["redelivered"] is True
    assert passive_count(conn, q) == 0


def test_get_encodings_and_truncate(api, conn, ch, names):
    q = names.q()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"hello world")
    ch.basic_publish("", q, b"\xff\x00\x01")
    auto = get_msgs(api, "/", q, count=2, encoding="auto")
    assert auto[0]["payload"] == "hello world" and auto[0]["payload_encoding"] == "string"
    assert auto[0]["payload_bytes"] == 11
    # not valid UTF-8 -> base64 even in auto mode
    assert auto[1]["payload_encoding"] == "base64"
    assert base64.b64decode(auto[1]["payload"]) == b"\xff\x00\x01"
    b64 = get_msgs(api, "/", q, count=1, encoding="base64")
    assert b64[0]["payload_encoding"] == "base64"
    assert base64.b64decode(b64[0]["payload"]) == b"hello world"
    trunc = get_msgs(api, "/", q, count=1, truncate=5)
    assert trunc[0]["payload"] == "hello"
    assert trunc[0]["payload_bytes"] == 11  # the size of the whole message
    r = api.post(qpath("/", q) + "/get", {"count": 1, "ackmode": "ack_requeue_true",
                                          "encoding": "bogus"})
    assert r.status == 400, r
    assert passive_count(conn, q) == 2


def test_get_response_fields_and_properties(api, ch, names):
    q = names.q()
    x = names.x()
    ch.exchange_declare(x, "direct")
    ch.queue_declare(q)
    ch.queue_bind(q, x, "rk.1")
    props = pika.BasicProperties(content_type="text/plain", delivery_mode=2,
                                 headers={"h1": "v1", "n": 7}, correlation_id="cid-1",
                                 message_id="mid-1", priority=3, app_id="app-1",
                                 reply_to="rt", type="t1")
    ch.basic_publish(x, "rk.1", b"payload", props)
    ch.basic_publish(x, "rk.1", b"plain")
    msgs = get_msgs(api, "/", q, count=2)
    m = msgs[0]
    assert set(m) >= {"payload", "payload_bytes", "payload_encoding", "redelivered", "exchange",
                      "routing_key", "message_count", "properties"}
    assert m["exchange"] == x and m["routing_key"] == "rk.1"
    assert m["payload_bytes"] == 7 and m["message_count"] == 1
    p = m["properties"]
    assert p["content_type"] == "text/plain" and p["delivery_mode"] == 2
    assert p["headers"] == {"h1": "v1", "n": 7}
    assert p["correlation_id"] == "cid-1" and p["message_id"] == "mid-1"
    assert p["priority"] == 3 and p["app_id"] == "app-1"
    assert p["reply_to"] == "rt" and p["type"] == "t1"
    # Lenient: RabbitMQ 3.10 renders empty properties as [] (an Erlang empty proplist);
    # a 4.x-compatible broker may render {}.
    assert msgs[1]["properties"] in ([], {})


def test_queue_delete_if_empty(api, conn, ch, names):
    q = names.q()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"x")
    r = api.delete(qpath("/", q) + "?if-empty=true")
    assert r.status == 400, r
    assert passive_count(conn, q) == 1
    assert api.delete(qpath("/", q) + "/contents").status == 204
    assert api.delete(qpath("/", q) + "?if-empty=true").status == 204
    assert api.get(qpath("/", q)).status == 404


def test_queue_delete_if_unused(api, conn, ch, names):
    q = names.q()
    ch.queue_declare(q)
    tag = ch.basic_consume(q, lambda *a: None)
    r = api.delete(qpath("/", q) + "?if-unused=true")
    assert r.status == 400, r
    assert api.get(qpath("/", q)).status == 200
    ch.basic_cancel(tag)
    assert api.delete(qpath("/", q) + "?if-unused=true").status == 204
    assert api.get(qpath("/", q)).status == 404


def test_queue_not_found_cases(api, names):
    q = names.q()
    missing_vhost = "no-such-vhost-" + uuid.uuid4().hex
    assert api.get(qpath("/", q)).status == 404
    assert api.get(qpath(missing_vhost, q)).status == 404
    assert api.delete(qpath("/", q)).status == 404
    assert api.delete(qpath("/", q) + "/contents").status == 404
    r = api.post(qpath("/", q) + "/get", {"count": 1, "ackmode": "ack_requeue_true",
                                          "encoding": "auto"})
    assert r.status == 404, r
    r = api.put(qpath(missing_vhost, q), {"durable": False})
    assert r.status == 404, r
    assert r.json()["error"] == "not_found"


def test_queue_delete_via_api_then_amqp_sees_it_gone(api, conn, api_queue):
    q = api_queue()
    assert passive_count(conn, q) == 0
    assert api.delete(qpath("/", q)).status == 204
    assert api.delete(qpath("/", q)).status == 404
    channel = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
        channel.queue_declare(q, passive=True)
    assert info.value.reply_code == 404


# ============================================================================================
# Exchanges
# ============================================================================================

def test_exchange_declare_all_types(api, names):
    for kind in ("direct", "fanout", "topic", "headers"):
        x = names.x(kind)
        body = {"type": kind, "durable": True, "auto_delete": False, "internal": False,
                "arguments": {}}
        assert api.put(xpath("/", x), body).status == 201, kind
        assert api.put(xpath("/", x), body).status == 204, kind
        info = api.get_json(xpath("/", x))
        assert info["name"] == x and info["vhost"] == "/" and info["type"] == kind
        assert info["durable"] is True and info["auto_delete"] is False
        assert info["internal"] is False and info["arguments"] == {}
    listed = {e["name"]: e["type"] for e in api.get_json("/api/exchanges/%2F")}
    for x in names.exchanges:
        assert x in listed


def test_exchange_inequivalent_and_invalid(api, names):
    x = names.x()
    assert api.put(xpath("/", x), {"type": "direct", "durable": True}).status == 201
    r = api.put(xpath("/", x), {"type": "fanout", "durable": True})
    assert r.status == 400 and "type" in r.json()["reason"], r
    r = api.put(xpath("/", x), {"type": "direct", "durable": False})
    assert r.status == 400 and "durable" in r.json()["reason"], r
    bogus = names.x("bogus")
    assert api.put(xpath("/", bogus), {"type": "no-such-type"}).status == 400
    assert api.get(xpath("/", bogus)).status == 404


def test_exchange_delete_and_if_unused(api, names, api_queue):
    x = names.x()
    q = api_queue()
    assert api.put(xpath("/", x), {"type": "direct"}).status == 201
    assert api.post(f"/api/bindings/%2F/e/{enc(x)}/q/{enc(q)}", {"routing_key": "k"}).status == 201
    r = api.delete(xpath("/", x) + "?if-unused=true")
    assert r.status == 400, r
    assert api.get(xpath("/", x)).status == 200
    assert api.delete(xpath("/", x)).status == 204
    assert api.delete(xpath("/", x)).status == 404
    assert api.get(xpath("/", x)).status == 404
    assert api.get(xpath("no-such-vhost-" + uuid.uuid4().hex, x)).status == 404


def test_amq_exchanges_are_protected(api, prefix, cleanup):
    # RabbitMQ 3.10 answers 401 {"error":"not_authorised","reason":"Access refused."}; accept
    # 403 too, as the access_refused mapping is the kind of detail that may change across
    # major versions.
    assert api.delete(xpath("/", "amq.direct")).status in (401, 403)
    assert api.get(xpath("/", "amq.direct")).status == 200
    new_amq = f"amq.{prefix}"
    cleanup(xpath("/", new_amq))
    assert api.put(xpath("/", new_amq), {"type": "direct"}).status in (401, 403)
    assert api.get(xpath("/", new_amq)).status == 404
    # redeclaring an existing amq.* exchange with its own definition is fine
    assert api.put(xpath("/", "amq.direct"), {"type": "direct", "durable": True}).status == 204
    default = api.get_json(xpath("/", "amq.default"))
    assert default["name"] == "" and default["type"] == "direct"


def test_publish_reports_routed(api, names, api_queue):
    x = names.x()
    q = api_queue()
    assert api.put(xpath("/", x), {"type": "direct"}).status == 201
    assert api.post(f"/api/bindings/%2F/e/{enc(x)}/q/{enc(q)}", {"routing_key": "hit"}).status == 201
    assert publish_api(api, "/", x, "hit", "a") == {"routed": True}
    assert publish_api(api, "/", x, "miss", "b") == {"routed": False}
    assert publish_api(api, "/", "amq.default", q, "c") == {"routed": True}
    assert [m["payload"] for m in get_msgs(api, "/", q, count=10)] == ["a", "c"]
    # Lenient: RabbitMQ 3.10 answers 400 (reason "404 NOT_FOUND - no exchange ...").
    r = api.post(xpath("/", names.x("missing")) + "/publish",
                 {"routing_key": "k", "payload": "p", "payload_encoding": "string",
                  "properties": {}})
    assert r.status in (400, 404), r


def test_publish_base64_and_properties_reach_amqp_consumer(api, conn, ch, names):
    q = names.q()
    ch.queue_declare(q)
    body = b"\x00\x01binary\xfe"
    result = publish_api(api, "/", "amq.default", q, base64.b64encode(body).decode(),
                         encoding="base64",
                         properties={"content_type": "application/octet-stream",
                                     "delivery_mode": 2, "headers": {"k": "v"},
                                     "correlation_id": "c-9", "priority": 4})
    assert result == {"routed": True}
    method, props, got = ch.basic_get(q, auto_ack=True)
    assert method is not None and got == body
    assert method.routing_key == q and method.exchange == ""
    assert props.content_type == "application/octet-stream"
    assert props.delivery_mode == 2 and props.priority == 4
    assert props.correlation_id == "c-9"
    assert props.headers == {"k": "v"}
    r = api.post(xpath("/", "amq.default") + "/publish",
                 {"routing_key": q, "payload": "x", "payload_encoding": "bogus", "properties": {}})
    assert r.status == 400, r


def test_exchange_binding_source_and_destination_lists(api, names, api_queue):
    src, dst = names.x("src"), names.x("dst")
    q = api_queue()
    for x in (src, dst):
        assert api.put(xpath("/", x), {"type": "topic"}).status == 201
    assert api.post(f"/api/bindings/%2F/e/{enc(src)}/e/{enc(dst)}", {"routing_key": "a.#"}).status == 201
    assert api.post(f"/api/bindings/%2F/e/{enc(dst)}/q/{enc(q)}", {"routing_key": "#"}).status == 201
    src_out = api.get_json(xpath("/", src) + "/bindings/source")
    assert [(b["destination"], b["destination_type"], b["routing_key"]) for b in src_out] == \
        [(dst, "exchange", "a.#")]
    assert api.get_json(xpath("/", src) + "/bindings/destination") == []
    dst_in = api.get_json(xpath("/", dst) + "/bindings/destination")
    assert [(b["source"], b["routing_key"]) for b in dst_in] == [(src, "a.#")]
    dst_out = api.get_json(xpath("/", dst) + "/bindings/source")
    assert [(b["destination"], b["destination_type"]) for b in dst_out] == [(q, "queue")]
    qb = api.get_json(qpath("/", q) + "/bindings")
    # the implicit default-exchange binding is listed too
    assert ("", q) in [(b["source"], b["routing_key"]) for b in qb]
    assert (dst, "#") in [(b["source"], b["routing_key"]) for b in qb]


# ============================================================================================
# Bindings
# ============================================================================================

def test_binding_create_location_and_list(api, names, api_queue):
    x = names.x()
    q = api_queue()
    assert api.put(xpath("/", x), {"type": "direct"}).status == 201
    base = f"/api/bindings/%2F/e/{enc(x)}/q/{enc(q)}"
    r = api.post(base, {"routing_key": "rk1", "arguments": {}})
    assert r.status == 201, r
    assert r.headers.get("location", "").endswith("/rk1"), r.headers
    listed = api.get_json(base)
    assert listed == [{"source": x, "vhost": "/", "destination": q, "destination_type": "queue",
                       "routing_key": "rk1", "arguments": {}, "properties_key": "rk1"}]
    assert any(b["source"] == x and b["destination"] == q
               for b in api.get_json("/api/bindings/%2F"))
    assert any(b["source"] == x and b["destination"] == q for b in api.get_json("/api/bindings"))
    # posting the same binding again is accepted and does not duplicate it
    assert api.post(base, {"routing_key": "rk1", "arguments": {}}).status == 201
    assert len(api.get_json(base)) == 1


def test_binding_get_and_delete_by_properties_key(api, names, api_queue):
    x = names.x()
    q = api_queue()
    assert api.put(xpath("/", x), {"type": "headers"}).status == 201
    base = f"/api/bindings/%2F/e/{enc(x)}/q/{enc(q)}"
    assert api.post(base, {"routing_key": "", "arguments": {"x-match": "all", "a": "1"}}).status == 201
    assert api.post(base, {"routing_key": "", "arguments": {"x-match": "any", "b": "2"}}).status == 201
    listed = api.get_json(base)
    assert len(listed) == 2
    keys = [b["properties_key"] for b in listed]
    assert len(set(keys)) == 2
    for b in listed:
        single = api.get_json(f"{base}/{enc(b['properties_key'])}")
        assert single == b
    assert api.delete(f"{base}/{enc(keys[0])}").status == 204
    assert api.delete(f"{base}/{enc(keys[0])}").status == 404
    assert api.get(f"{base}/{enc(keys[0])}").status == 404
    assert [b["properties_key"] for b in api.get_json(base)] == [keys[1]]


def test_binding_exchange_to_exchange_routes(api, names, api_queue):
    src, dst = names.x("src"), names.x("dst")
    q = api_queue()
    assert api.put(xpath("/", src), {"type": "direct"}).status == 201
    assert api.put(xpath("/", dst), {"type": "fanout"}).status == 201
    e2e = f"/api/bindings/%2F/e/{enc(src)}/e/{enc(dst)}"
    assert api.post(e2e, {"routing_key": "via"}).status == 201
    assert api.post(f"/api/bindings/%2F/e/{enc(dst)}/q/{enc(q)}", {"routing_key": ""}).status == 201
    listed = api.get_json(e2e)
    assert [(b["destination_type"], b["routing_key"], b["properties_key"]) for b in listed] == \
        [("exchange", "via", "via")]
    assert publish_api(api, "/", src, "via", "through") == {"routed": True}
    assert publish_api(api, "/", src, "other", "lost") == {"routed": False}
    assert [m["payload"] for m in get_msgs(api, "/", q, count=5)] == ["through"]
    assert api.delete(f"{e2e}/via").status == 204
    assert api.get_json(e2e) == []
    assert publish_api(api, "/", src, "via", "x") == {"routed": False}


def test_binding_to_missing_queue_or_exchange_is_404(api, names, api_queue):
    x = names.x()
    q = api_queue()
    assert api.put(xpath("/", x), {"type": "direct"}).status == 201
    r = api.post(f"/api/bindings/%2F/e/{enc(x)}/q/{enc(names.q('missing'))}", {"routing_key": "k"})
    assert r.status == 404, r
    r = api.post(f"/api/bindings/%2F/e/{enc(names.x('missing'))}/q/{enc(q)}", {"routing_key": "k"})
    assert r.status == 404, r
    assert api.get_json(xpath("/", x) + "/bindings/source") == []


# ============================================================================================
# Pagination, filtering, sorting, columns
# ============================================================================================

def _five_queues(api, names):
    created = []
    for i in range(5):
        q = names.q(f"p{i}")
        assert api.put(qpath("/", q), {"durable": False}).status == 201
        created.append(q)
    return created


def test_pagination_shape_sort_and_regex(api, names, prefix):
    qs = _five_queues(api, names)
    regex = enc("^" + re.escape(prefix) + r"\.p")
    page1 = api.get_json(f"/api/queues/%2F?page=1&page_size=2&name={regex}&use_regex=true"
                         "&sort=name&sort_reverse=true&columns=name,vhost")
    assert set(page1) >= {"filtered_count", "item_count", "items", "page", "page_count",
                          "page_size", "total_count"}
    assert page1["filtered_count"] == 5 and page1["item_count"] == 2
    assert page1["page"] == 1 and page1["page_count"] == 3 and page1["page_size"] == 2
    assert is_int(page1["total_count"]) and page1["total_count"] >= 5
    assert page1["items"] == [{"name": qs[4], "vhost": "/"}, {"name": qs[3], "vhost": "/"}]
    page3 = api.get_json(f"/api/queues/%2F?page=3&page_size=2&name={regex}&use_regex=true"
                         "&sort=name&columns=name")
    assert page3["item_count"] == 1 and page3["items"] == [{"name": qs[4]}]
    all_pages = api.get_json(f"/api/queues?page=1&page_size=100&name={regex}&use_regex=true&sort=name")
    assert [x["name"] for x in all_pages["items"]] == qs
    # past the last page
    r = api.get(f"/api/queues/%2F?page=4&page_size=2&name={regex}&use_regex=true")
    assert r.status == 400, r


def test_pagination_name_filter_is_case_insensitive_substring(api, names, prefix):
    qs = _five_queues(api, names)
    needle = enc(prefix.upper() + ".P")
    res = api.get_json(f"/api/queues/%2F?page=1&page_size=100&name={needle}&columns=name&sort=name")
    assert [x["name"] for x in res["items"]] == qs
    assert res["filtered_count"] == 5


def test_pagination_columns_with_dotted_path_and_numeric_sort(api, names, prefix):
    qs = _five_queues(api, names)[:3]
    for i, q in enumerate(qs):
        for _ in range(i + 1):
            publish_api(api, "/", "amq.default", q, "x")
    regex = enc("^" + re.escape(prefix) + r"\.p[012]$")
    url = (f"/api/queues/%2F?page=1&page_size=10&name={regex}&use_regex=true&sort=messages"
           "&sort_reverse=true&columns=name,messages,message_stats.publish")

    def ready(res):
        return [x.get("messages") for x in res["items"]] == [3, 2, 1] and all(
            x.get("message_stats", {}).get("publish") == 3 - j for j, x in enumerate(res["items"]))
    res = poll(lambda: api.get_json(url), ready, what="sorted queue stats")
    assert [x["name"] for x in res["items"]] == [qs[2], qs[1], qs[0]]
    for item in res["items"]:
        assert set(item) == {"name", "messages", "message_stats"}
        assert set(item["message_stats"]) == {"publish"}


def test_pagination_invalid_parameters(api):
    assert api.get("/api/queues?page=1&page_size=501").status == 400
    assert api.get("/api/queues?page=1&page_size=0").status == 400
    assert api.get("/api/queues?page=0").status == 400
    assert api.get("/api/queues?page=abc").status == 400
    r = api.get("/api/queues?page=1&page_size=500&columns=name")
    assert r.status == 200 and r.json()["page_size"] == 500
    # without page, the listing is a plain JSON array
    assert isinstance(api.get_json("/api/queues?columns=name"), list)


# ============================================================================================
# Connections, channels, consumers
# ============================================================================================

def _named_connection(connect, amqp_url, name):
    p = pika.URLParameters(amqp_url)
    p.client_properties = {"connection_name": name}
    return connect(p)


def _find_connection(api, name, pred=lambda c: True):
    def fetch():
        return [c for c in api.get_json("/api/connections")
                if c.get("client_properties", {}).get("connection_name") == name]
    return poll(fetch, lambda cs: len(cs) == 1 and pred(cs[0]), what=f"connection {name}")[0]


def _local_port(connection):
    try:
        return connection._impl._transport._sock.getsockname()[1]
    except AttributeError:  # pika internals moved: skip that one comparison
        return None


def test_connection_and_its_channel_listed(api, connect, amqp_url, prefix):
    cname = f"{prefix}.conn"
    c = _named_connection(connect, amqp_url, cname)
    channel = c.channel()
    channel.basic_qos(prefetch_count=11)
    info = _find_connection(api, cname, lambda x: x.get("channels") == 1)
    assert info["user"] == "guest" and info["vhost"] == "/"
    assert info["client_properties"]["connection_name"] == cname
    assert is_int(info["peer_port"])
    local = _local_port(c)
    if local is not None:
        assert info["peer_port"] == local
    assert info["state"] in ("running", "blocked", "blocking", "flow")
    one = api.get_json(f"/api/connections/{enc(info['name'])}")
    assert one["name"] == info["name"] and one["user"] == "guest"
    assert one["client_properties"]["connection_name"] == cname
    assert info["name"] in [x["name"] for x in api.get_json("/api/vhosts/%2F/connections")]
    assert api.get(f"/api/connections/{enc('no such connection ' + prefix)}").status == 404

    def conn_channels():
        return api.get_json(f"/api/connections/{enc(info['name'])}/channels")
    chans = poll(conn_channels, lambda cs: len(cs) == 1, what="channel of the connection")
    chan = chans[0]
    assert chan["connection_details"]["name"] == info["name"]
    assert chan["number"] == channel.channel_number
    assert chan["user"] == "guest" and chan["vhost"] == "/"
    assert chan["name"] == f"{info['name']} ({channel.channel_number})"
    assert chan["name"] in [x["name"] for x in api.get_json("/api/channels")]
    assert chan["name"] in [x["name"] for x in api.get_json("/api/vhosts/%2F/channels")]
    detail = poll(lambda: api.get_json(f"/api/channels/{enc(chan['name'])}"),
                  lambda d: d.get("prefetch_count") == 11, what="channel prefetch_count")
    assert detail["connection_details"]["name"] == info["name"]
    channel.close()


def test_consumers_listed(api, conn, ch, names):
    q = names.q()
    ch.queue_declare(q)
    ch.basic_qos(prefetch_count=7)
    tag = ch.basic_consume(q, lambda *a: None, auto_ack=False, consumer_tag=f"{names.prefix}.ctag")

    def mine(path):
        return [c for c in api.get_json(path) if c["consumer_tag"] == tag]
    found = poll(lambda: mine("/api/consumers"), lambda cs: len(cs) == 1, what="consumer listed")[0]
    assert found["queue"] == {"name": q, "vhost": "/"}
    assert found["ack_required"] is True
    assert found["prefetch_count"] == 7
    assert found["exclusive"] is False
    assert isinstance(found["channel_details"], dict)
    assert len(mine("/api/consumers/%2F")) == 1
    details = api.get_json(qpath("/", q))["consumer_details"]
    assert [d["consumer_tag"] for d in details] == [tag]
    ch.basic_cancel(tag)
    poll(lambda: mine("/api/consumers"), lambda cs: cs == [], what="consumer gone")


def test_close_connection_via_api_with_reason(api, connect, amqp_url, prefix):
    cname = f"{prefix}.kill"
    c = _named_connection(connect, amqp_url, cname)
    c.channel()
    info = _find_connection(api, cname)
    path = f"/api/connections/{enc(info['name'])}"
    r = api.delete(path, headers={"X-Reason": "closed by test"})
    assert r.status == 204, r
    with pytest.raises(ConnectionClosedByBroker) as err:
        deadline = time.monotonic() + POLL_TIMEOUT
        while time.monotonic() < deadline:
            c.process_data_events(time_limit=0.2)
    assert err.value.reply_code == 320
    assert "closed by test" in err.value.reply_text
    poll(lambda: api.get(path).status, lambda s: s == 404, what="connection gone")


# ============================================================================================
# Policies and operator policies
# ============================================================================================

def test_policy_crud(api, prefix, cleanup):
    name = f"{prefix}.pol"
    path = f"/api/policies/%2F/{enc(name)}"
    cleanup(path)
    body = {"pattern": "^" + re.escape(prefix) + r"\.nomatch$", "definition": {"max-length": 2},
            "priority": 3, "apply-to": "queues"}
    assert api.put(path, body).status == 201
    assert api.put(path, body).status == 204
    got = api.get_json(path)
    assert got == {"vhost": "/", "name": name, "pattern": body["pattern"], "apply-to": "queues",
                   "definition": {"max-length": 2}, "priority": 3}
    assert got in api.get_json("/api/policies/%2F")
    assert got in api.get_json("/api/policies")
    assert api.delete(path).status == 204
    assert api.delete(path).status == 404
    assert api.get(path).status == 404


def test_policy_validation(api, prefix, cleanup):
    path = f"/api/policies/%2F/{enc(prefix)}.bad"
    cleanup(path)
    pattern = "^" + re.escape(prefix) + "$"
    r = api.put(path, {"pattern": pattern, "definition": {"no-such-policy-key": 1}})
    assert r.status == 400, r
    assert "no-such-policy-key" in r.json()["reason"]
    assert api.put(path, {"pattern": pattern, "definition": {"max-length": "abc"}}).status == 400
    assert api.put(path, {"pattern": pattern, "definition": {}}).status == 400
    assert api.put(path, {"definition": {"max-length": 1}}).status == 400  # no pattern
    assert api.put(path, {"pattern": pattern, "definition": {"max-length": 1},
                          "apply-to": "bogus"}).status == 400
    assert api.get(path).status == 404
    r = api.put(f"/api/policies/no-such-vhost-{uuid.uuid4().hex}/p",
                {"pattern": "x", "definition": {"max-length": 1}})
    assert r.status == 404, r


def test_policy_max_length_takes_effect(api, conn, ch, names, cleanup):
    q = names.q()
    path = f"/api/policies/%2F/{enc(names.prefix)}.ml"
    cleanup(path)
    assert api.put(path, {"pattern": "^" + re.escape(q) + "$", "definition": {"max-length": 2},
                          "apply-to": "queues"}).status == 201
    ch.queue_declare(q)
    ch.confirm_delivery()
    for i in range(5):
        ch.basic_publish("", q, f"m{i}".encode())
    assert passive_count(conn, q) == 2
    # the oldest messages were dropped
    assert [m["payload"] for m in get_msgs(api, "/", q, count=5)] == ["m3", "m4"]
    info = poll(lambda: api.get_json(qpath("/", q)),
                lambda x: x.get("policy") == f"{names.prefix}.ml", what="queue shows its policy")
    assert info["effective_policy_definition"] == {"max-length": 2}


def test_operator_policy_crud_and_lowest_limit_wins(api, conn, ch, names, cleanup):
    q_arg_high, q_arg_low = names.q("high"), names.q("low")
    name = f"{names.prefix}.op"
    path = f"/api/operator-policies/%2F/{enc(name)}"
    cleanup(path)
    body = {"pattern": "^" + re.escape(names.prefix) + r"\.(high|low)$",
            "definition": {"max-length": 2}, "priority": 1, "apply-to": "queues"}
    assert api.put(path, body).status == 201
    assert api.put(path, body).status == 204
    got = api.get_json(path)
    assert got == {"vhost": "/", "name": name, "pattern": body["pattern"], "apply-to": "queues",
                   "definition": {"max-length": 2}, "priority": 1}
    assert got in api.get_json("/api/operator-policies")
    assert got in api.get_json("/api/operator-policies/%2F")
    # operator policies accept only a restricted set of keys
    bad = f"/api/operator-policies/%2F/{enc(name)}.bad"
    cleanup(bad)
    assert api.put(bad, {"pattern": "^x$", "definition": {"alternate-exchange": "x"}}).status == 400

    ch.confirm_delivery()
    ch.queue_declare(q_arg_high, arguments={"x-max-length": 5})
    ch.queue_declare(q_arg_low, arguments={"x-max-length": 1})
    for i in range(6):
        ch.basic_publish("", q_arg_high, b"h")
        ch.basic_publish("", q_arg_low, b"l")
    assert passive_count(conn, q_arg_high) == 2  # operator policy (2) < argument (5)
    assert passive_count(conn, q_arg_low) == 1   # argument (1) < operator policy (2)
    info = poll(lambda: api.get_json(qpath("/", q_arg_high)),
                lambda x: x.get("operator_policy") == name, what="queue shows operator policy")
    assert info["effective_policy_definition"] == {"max-length": 2}
    assert api.delete(path).status == 204
    assert api.delete(path).status == 404
    assert api.get(path).status == 404


# ============================================================================================
# Limits
# ============================================================================================

def test_vhost_limits(api, vhost):
    base = f"/api/vhost-limits/{enc(vhost)}"
    assert api.get_json(base) == []
    # RabbitMQ answers 204 even when the limit is new
    assert api.put(f"{base}/max-connections", {"value": 5}).status == 204
    assert api.put(f"{base}/max-queues", {"value": 7}).status == 204
    got = api.get_json(base)
    assert got == [{"vhost": vhost, "value": {"max-connections": 5, "max-queues": 7}}]
    assert got[0] in api.get_json("/api/vhost-limits")
    assert api.put(f"{base}/max-bogus", {"value": 1}).status == 400
    assert api.put(f"{base}/max-queues", {"value": "abc"}).status == 400
    assert api.put(f"{base}/max-queues", {}).status == 400
    assert api.delete(f"{base}/max-connections").status == 204
    assert api.get_json(base) == [{"vhost": vhost, "value": {"max-queues": 7}}]
    assert api.delete(f"{base}/max-queues").status == 204
    assert api.get_json(base) == []
    missing = f"/api/vhost-limits/no-such-vhost-{uuid.uuid4().hex}"
    assert api.get(missing).status == 404
    assert api.put(f"{missing}/max-queues", {"value": 1}).status == 404


def test_vhost_max_queues_limit_enforced(api, vhost):
    base = f"/api/vhost-limits/{enc(vhost)}"
    assert api.put(f"{base}/max-queues", {"value": 1}).status == 204
    assert api.put(qpath(vhost, "first"), {"durable": False}).status == 201
    r = api.put(qpath(vhost, "second"), {"durable": False})
    assert r.status == 400, r  # "cannot declare queue 'second': queue limit in vhost ... is reached"
    assert api.get(qpath(vhost, "second")).status == 404


def test_user_limits(api, make_user):
    user, pw = make_user(tags="management")
    base = f"/api/user-limits/{enc(user)}"
    assert api.put(f"{base}/max-connections", {"value": 3}).status == 204
    assert api.put(f"{base}/max-channels", {"value": 4}).status == 204
    got = api.get_json(base)
    assert got == [{"user": user, "value": {"max-connections": 3, "max-channels": 4}}]
    assert got[0] in api.get_json("/api/user-limits")
    assert api.get_json(f"/api/users/{enc(user)}")["limits"] == {"max-connections": 3,
                                                                 "max-channels": 4}
    assert api.delete(f"{base}/max-channels").status == 204
    assert api.get_json(base) == [{"user": user, "value": {"max-connections": 3}}]
    assert api.get(f"/api/user-limits/nobody-{uuid.uuid4().hex}").status == 404
    r = api.put(f"/api/user-limits/nobody-{uuid.uuid4().hex}/max-channels", {"value": 1})
    assert r.status in (400, 404), r  # RabbitMQ 3.10: 400 ["no_such_user", ...]


# ============================================================================================
# Definitions
# ============================================================================================

def test_definitions_export_keys(api):
    d = api.get_json("/api/definitions")
    assert "rabbit_version" in d or "rabbitmq_version" in d
    for key in ("users", "vhosts", "permissions", "topic_permissions", "parameters",
                "global_parameters", "policies", "queues", "exchanges", "bindings"):
        assert isinstance(d[key], list), key
    assert {"name": "/"} in [{"name": v["name"]} for v in d["vhosts"]]
    guest = [u for u in d["users"] if u["name"] == "guest"]
    assert guest and {"password_hash", "hashing_algorithm", "tags"} <= set(guest[0])


def test_definitions_export_contains_created_objects(api, names, make_user):
    q, x = names.q(), names.x()
    user, _ = make_user(tags="management")
    assert api.put(qpath("/", q), {"durable": True, "auto_delete": False,
                                   "arguments": {"x-max-length": 3}}).status == 201
    assert api.put(xpath("/", x), {"type": "fanout", "durable": True}).status == 201
    assert api.post(f"/api/bindings/%2F/e/{enc(x)}/q/{enc(q)}", {"routing_key": "rk"}).status == 201
    d = api.get_json("/api/definitions")
    assert {"name": q, "vhost": "/", "durable": True, "auto_delete": False,
            "arguments": {"x-max-length": 3}} in d["queues"]
    assert {"name": x, "vhost": "/", "type": "fanout", "durable": True, "auto_delete": False,
            "internal": False, "arguments": {}} in d["exchanges"]
    assert {"source": x, "vhost": "/", "destination": q, "destination_type": "queue",
            "routing_key": "rk", "arguments": {}} in d["bindings"]
    users = {u["name"]: u for u in d["users"]}
    assert tags_of(users[user]["tags"]) == {"management"}
    # per-vhost export: same objects, without the server-wide sections
    v = api.get_json("/api/definitions/%2F")
    for key in ("policies", "queues", "exchanges", "bindings"):
        assert isinstance(v[key], list), key
    assert "users" not in v and "vhosts" not in v
    assert q in [x_["name"] for x_ in v["queues"]]
    assert x in [e["name"] for e in v["exchanges"]]


def test_definitions_import_is_idempotent(api, conn, prefix, cleanup):
    vh, user = f"{prefix}.imp", f"{prefix}.impuser"
    cleanup(f"/api/users/{enc(user)}")
    cleanup(f"/api/vhosts/{enc(vh)}")
    doc = {
        "vhosts": [{"name": vh}],
        "users": [{"name": user, "password": "pw", "tags": "management"}],
        "permissions": [{"user": user, "vhost": vh, "configure": ".*", "write": ".*", "read": ".*"}],
        "queues": [{"name": "iq", "vhost": vh, "durable": True, "auto_delete": False,
                    "arguments": {"x-max-length": 10}}],
        "exchanges": [{"name": "ix", "vhost": vh, "type": "fanout", "durable": True,
                       "auto_delete": False, "internal": False, "arguments": {}}],
        "bindings": [{"source": "ix", "vhost": vh, "destination": "iq", "destination_type": "queue",
                      "routing_key": "k", "arguments": {}}],
        "policies": [{"vhost": vh, "name": "ip", "pattern": "^iq$", "apply-to": "queues",
                      "definition": {"max-length": 5}, "priority": 1}],
    }
    for _ in range(2):
        r = api.post("/api/definitions", doc)
        assert r.status in (200, 201, 204), r
        assert api.get_json(f"/api/vhosts/{enc(vh)}")["name"] == vh
        assert tags_of(api.get_json(f"/api/users/{enc(user)}")["tags"]) == {"management"}
        assert api.get_json(f"/api/permissions/{enc(vh)}/{enc(user)}")["configure"] == ".*"
        qi = api.get_json(qpath(vh, "iq"))
        assert qi["durable"] is True and declared_args(qi) == {"x-max-length": 10}
        assert api.get_json(xpath(vh, "ix"))["type"] == "fanout"
        assert [b["routing_key"] for b in api.get_json(f"/api/bindings/{enc(vh)}/e/ix/q/iq")] == ["k"]
        assert api.get_json(f"/api/policies/{enc(vh)}/ip")["definition"] == {"max-length": 5}
    assert api.as_user(user, "pw").get_json("/api/whoami")["name"] == user
    # malformed document
    assert api.post("/api/definitions", raw=b"{not json").status == 400


def test_vhost_definitions_import_and_export(api, vhost):
    doc = {"queues": [{"name": "vq", "durable": True, "auto_delete": False, "arguments": {}}],
           "exchanges": [{"name": "vx", "type": "topic", "durable": True, "auto_delete": False,
                          "internal": False, "arguments": {}}],
           "bindings": [{"source": "vx", "destination": "vq", "destination_type": "queue",
                         "routing_key": "a.*", "arguments": {}}],
           "policies": []}
    r = api.post(f"/api/definitions/{enc(vhost)}", doc)
    assert r.status in (200, 201, 204), r
    assert api.get_json(qpath(vhost, "vq"))["vhost"] == vhost
    assert api.get_json(xpath(vhost, "vx"))["type"] == "topic"
    exported = api.get_json(f"/api/definitions/{enc(vhost)}")
    assert [x["name"] for x in exported["queues"]] == ["vq"]
    assert [x["name"] for x in exported["exchanges"]] == ["vx"]
    assert [(b["source"], b["destination"], b["routing_key"]) for b in exported["bindings"]] == \
        [("vx", "vq", "a.*")]
    r = api.post(f"/api/definitions/no-such-vhost-{uuid.uuid4().hex}", doc)
    assert r.status == 404, r


# ============================================================================================
# Health checks
# ============================================================================================

@pytest.mark.parametrize("check", ["alarms", "local-alarms", "virtual-hosts"])
def test_health_checks_ok(api, check):
    r = api.get(f"/api/health/checks/{check}")
    assert r.status == 200, r
    assert r.json()["status"] == "ok"


def test_health_check_port_listener(api, amqp_url):
    port = amqp_port(amqp_url)
    r = api.get(f"/api/health/checks/port-listener/{port}")
    assert r.status == 200, r
    assert r.json()["status"] == "ok"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        unused = s.getsockname()[1]
    r = api.get(f"/api/health/checks/port-listener/{unused}")
    assert r.status == 503, r
    body = r.json()
    assert body["status"] == "failed"
    assert isinstance(body.get("reason"), str)


def test_aliveness_test(api):
    existed = api.get(qpath("/", "aliveness-test")).status == 200
    try:
        r = api.get("/api/aliveness-test/%2F")
        assert r.status == 200, r
        assert r.json() == {"status": "ok"}
        assert api.get(f"/api/aliveness-test/no-such-vhost-{uuid.uuid4().hex}").status == 404
    finally:
        if not existed:
            api.delete(qpath("/", "aliveness-test"))


# ============================================================================================
# Request validation
# ============================================================================================

def test_malformed_json_is_400(api, names):
    q, x = names.q(), names.x()
    r = api.request("PUT", qpath("/", q), raw=b"{not json")
    assert r.status == 400, r
    assert r.json()["error"] == "bad_request"
    assert api.request("PUT", xpath("/", x), raw=b"[1, 2").status == 400
    assert api.get(qpath("/", q)).status == 404
    assert api.get(xpath("/", x)).status == 404


def test_error_bodies_are_json_with_error_and_reason(api):
    r = api.get(qpath("/", "no-such-queue-" + uuid.uuid4().hex))
    assert r.status == 404
    assert r.headers.get("content-type", "").startswith("application/json")
    body = r.json()
    assert isinstance(body["error"], str) and "reason" in body


# ============================================================================================
# Prometheus
# ============================================================================================

def test_prometheus_format_identity_and_build_info(prometheus_url, api):
    status, ctype, text = scrape(prometheus_url)
    assert status == 200
    assert ctype.startswith("text/plain")
    assert "version=0.0.4" in ctype
    assert "# TYPE rabbitmq_identity_info" in text
    parsed = parse_metrics(text)
    ident = [(ls, v) for n, ls, v in parsed if n == "rabbitmq_identity_info"]
    assert len(ident) == 1
    labels, value = ident[0]
    assert value == 1
    overview = api.get_json("/api/overview")
    assert labels["rabbitmq_node"] == overview["node"]
    assert labels["rabbitmq_cluster"] == overview["cluster_name"]
    build = [(ls, v) for n, ls, v in parsed if n == "rabbitmq_build_info"]
    assert len(build) == 1 and build[0][1] == 1
    assert build[0][0]["rabbitmq_version"] == overview["rabbitmq_version"]


def test_prometheus_process_metrics(prometheus_url):
    parsed = samples(prometheus_url)
    open_fds = metric_sum(parsed, "rabbitmq_process_open_fds")
    max_fds = metric_sum(parsed, "rabbitmq_process_max_fds")
    assert open_fds is not None and max_fds is not None
    assert 0 < open_fds < max_fds
    assert metric_sum(parsed, "rabbitmq_process_resident_memory_bytes") > 0
    assert metric_sum(parsed, "rabbitmq_disk_space_available_bytes") > 0


def test_prometheus_object_gauges_follow_real_objects(prometheus_url, params, names):
    gauges = ("rabbitmq_connections", "rabbitmq_channels", "rabbitmq_consumers")

    def read():
        parsed = samples(prometheus_url)
        return {g: metric_sum(parsed, g) for g in gauges + ("rabbitmq_queues",)}
    before = read()
    for g in gauges:
        assert before[g] is not None and before[g] >= 0, g
    c = pika.BlockingConnection(params)
    try:
        channel = c.channel()
        q = names.q()
        channel.queue_declare(q)
        channel.basic_consume(q, lambda *a: None)
        up = poll(read, lambda v: all(v[g] == before[g] + 1 for g in gauges),
                  what="connection/channel/consumer gauges +1")
        assert up["rabbitmq_queues"] >= 1
    finally:
        c.close()
    poll(read, lambda v: all(v[g] == before[g] for g in gauges),
         what="gauges back to their previous values")


def test_prometheus_aggregated_queue_messages(prometheus_url, conn, ch, names):
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    for _ in range(4):
        ch.basic_publish("", q, b"ready")
    ch.basic_qos(prefetch_count=2)
    ch.basic_consume(q, lambda *a: None, auto_ack=False)  # 2 unacked, 2 ready

    def read():
        parsed = samples(prometheus_url)
        return (metric_sum(parsed, "rabbitmq_queue_messages_ready"),
                metric_sum(parsed, "rabbitmq_queue_messages_unacked"))
    poll(read, lambda v: v[0] is not None and v[1] is not None and v[0] >= 2 and v[1] >= 2,
         what="aggregated ready/unacked gauges")


def test_prometheus_per_object_queue_metrics(prometheus_url, conn, ch, names):
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    for _ in range(3):
        ch.basic_publish("", q, b"x")

    def read():
        parsed = samples(prometheus_url, "/metrics/per-object")
        return (metric_sum(parsed, "rabbitmq_queue_messages_ready", vhost="/", queue=q),
                metric_sum(parsed, "rabbitmq_queue_messages_unacked", vhost="/", queue=q))
    ready, unacked = poll(read, lambda v: v[0] == 3, what="per-object ready count")
    assert unacked == 0
    # the aggregated endpoint does not carry per-queue series
    assert metric_sum(samples(prometheus_url), "rabbitmq_queue_messages_ready", queue=q) is None


def test_prometheus_global_counters_exact_deltas(prometheus_url, conn, ch, names):
    counters = ("rabbitmq_global_messages_received_total",
                "rabbitmq_global_messages_confirmed_total",
                "rabbitmq_global_messages_delivered_total",
                "rabbitmq_global_messages_acknowledged_total",
                "rabbitmq_global_messages_routed_total")

    def read():
        parsed = samples(prometheus_url)
        return {c: metric_sum(parsed, c) or 0 for c in counters}
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    before = read()
    for _ in range(3):
        ch.basic_publish("", q, b"counted")
    got = []
    ch.basic_consume(q, lambda chan, m, p, b: (got.append(b), chan.basic_ack(m.delivery_tag)))
    deadline = time.monotonic() + POLL_TIMEOUT
    while len(got) < 3 and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.1)
    assert len(got) == 3
    expected = {c: before[c] + 3 for c in counters}
    after = poll(read, lambda v: v == expected, what="global counters +3")
    assert after == expected


def test_prometheus_detailed_queue_coarse_metrics(prometheus_url, api, ch, names, vhost):
    q = names.q()
    ch.queue_declare(q)
    ch.confirm_delivery()
    for _ in range(2):
        ch.basic_publish("", q, b"d")
    path = "/metrics/detailed?family=queue_coarse_metrics"

    def read():
        return metric_sum(samples(prometheus_url, path), "rabbitmq_detailed_queue_messages",
                          vhost="/", queue=q)
    assert poll(read, lambda v: v == 2, what="detailed queue messages") == 2
    parsed = samples(prometheus_url, path)
    assert metric_sum(parsed, "rabbitmq_detailed_queue_messages_ready", vhost="/", queue=q) == 2
    assert metric_sum(parsed, "rabbitmq_detailed_queue_messages_unacked", vhost="/", queue=q) == 0
    # vhost filter: our queue is present for "/" and absent for another vhost
    with_vhost = samples(prometheus_url, path + "&vhost=%2F")
    assert metric_sum(with_vhost, "rabbitmq_detailed_queue_messages", queue=q) == 2
    other = samples(prometheus_url, path + f"&vhost={enc(vhost)}")
    assert metric_sum(other, "rabbitmq_detailed_queue_messages", queue=q) is None
    # no family requested -> no per-queue series at all
    bare = samples(prometheus_url, "/metrics/detailed")
    assert not [n for n, ls, _ in bare if "queue" in ls]
