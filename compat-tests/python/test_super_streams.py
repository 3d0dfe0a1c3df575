"""Super streams as RabbitMQ lays them out (rabbit_stream_manager:create_super_stream): a durable
direct exchange NAME with `x-super-stream: true`, a stream NAME-KEY per partition bound with the
routing key KEY and `x-stream-partition-order: i` (the layout checked against RabbitMQ 4.0.5's
`rabbitmq-streams add_super_stream`). Created through the management API
(`PUT /api/stream/super-streams/{vhost}/{name}`, the stream management plugin's endpoint in
releases after 4.0; 4.0.5 answers 405) and
`warren ctl add_super_stream` (rabbitmq-streams' verb); the partitions are found the way a
stream client's topology lookup finds them: the exchange's bindings ordered by
`x-stream-partition-order`."""

import pika
import pytest

from conftest import q

pytestmark = pytest.mark.warren_only  # the endpoint is the stream management plugin's


def lookup_partitions(base, s, vhost, name):
    """A super stream's partitions in order, from the exchange's bindings (what the stream
    protocol's `partitions` command answers: rabbit_stream_utils:sort_partitions)."""
    r = s.get(f"{base}/api/exchanges/{q(vhost)}/{q(name)}/bindings/source")
    r.raise_for_status()
    bindings = [b for b in r.json() if b["destination_type"] == "queue"]
    bindings.sort(key=lambda b: b["arguments"].get("x-stream-partition-order", 1 << 62))
    return [(b["destination"], b["routing_key"]) for b in bindings]


def test_the_api_creates_rabbitmqs_layout(api, names):
    base, s = api
    name = names.q("orders")
    r = s.put(f"{base}/api/stream/super-streams/%2F/{q(name)}",
              json={"partitions": 3, "arguments": {"max-length-bytes": 100000000}})
    assert r.status_code == 201, r.text
    x = s.get(f"{base}/api/exchanges/%2F/{q(name)}").json()
    assert x["type"] == "direct" and x["durable"] and not x["auto_delete"]
    assert x["arguments"] == {"x-super-stream": True}
    assert lookup_partitions(base, s, "/", name) == [
        (f"{name}-0", "0"), (f"{name}-1", "1"), (f"{name}-2", "2")]
    for i in range(3):
        queue = s.get(f"{base}/api/queues/%2F/{q(f'{name}-{i}')}").json()
        assert queue["type"] == "stream" and queue["durable"]
        assert queue["arguments"] == {"x-max-length-bytes": 100000000,
                                      "x-queue-leader-locator": "balanced",
                                      "x-queue-type": "stream"}, "as RabbitMQ 4.0.5 makes it"
    binding = [b for b in s.get(f"{base}/api/exchanges/%2F/{q(name)}/bindings/source").json()
               if b["destination"] == f"{name}-2"][0]
    assert binding["arguments"] == {"x-stream-partition-order": 2}
    assert s.get(f"{base}/api/stream/super-streams/%2F/{q(name)}").json()["partitions"] == [
        f"{name}-0", f"{name}-1", f"{name}-2"]


def test_binding_keys_name_the_partitions_and_route(api, names, conn):
    base, s = api
    name = names.q("regions")
    r = s.put(f"{base}/api/stream/super-streams/%2F/{q(name)}",
              json={"binding-keys": "amer, emea,apac"})
    assert r.status_code == 201, r.text
    assert lookup_partitions(base, s, "/", name) == [
        (f"{name}-amer", "amer"), (f"{name}-emea", "emea"), (f"{name}-apac", "apac")]
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish(name, "emea", b"hello", pika.BasicProperties(delivery_mode=2), mandatory=True)
    stats = s.get(f"{base}/api/stream/super-streams/%2F/{q(name)}").json()
    assert stats["routing_keys"] == ["amer", "emea", "apac"]
    ok = ch.queue_declare(f"{name}-emea", passive=True, durable=True,
                          arguments={"x-queue-type": "stream"})
    assert ok.method.message_count == 1
    assert ch.queue_declare(f"{name}-amer", passive=True).method.message_count == 0


@pytest.mark.parametrize("body,reason", [
    ({}, "Must specify partitions or binding keys"),
    ({"partitions": 2, "binding-keys": "a"}, "Specify partitions or binding keys, not both"),
    ({"partitions": "many"}, "The partitions must be a number"),
    ({"partitions": 0}, "The partition number must be greater than 0"),
    ({"partitions": 100000}, "The partition number must not exceed"),
    ({"binding-keys": " , "}, "The number of binding keys must be greater than 0"),
])
def test_bad_bodies_are_400_with_rabbitmqs_reasons(api, names, body, reason):
    base, s = api
    r = s.put(f"{base}/api/stream/super-streams/%2F/{q(names.q('bad'))}", json=body)
    assert r.status_code == 400 and reason in r.json()["reason"], r.text


def test_an_existing_partition_refuses_the_whole_super_stream(api, names, conn):
    base, s = api
    name = names.q("clash")
    conn.channel().queue_declare(f"{name}-1", durable=True)
    r = s.put(f"{base}/api/stream/super-streams/%2F/{q(name)}", json={"partitions": 2})
    assert r.status_code == 400, r.text
    assert r.json()["reason"] == f"there is already a queue named {name}-1"
    assert s.get(f"{base}/api/exchanges/%2F/{q(name)}").status_code == 404
    assert s.get(f"{base}/api/queues/%2F/{q(name + '-0')}").status_code == 404
    assert s.put(f"{base}/api/stream/super-streams/%2F/{q(name + 'x')}",
                 json={"partitions": 1}).status_code == 201
    r = s.put(f"{base}/api/stream/super-streams/%2F/{q(name + 'x')}", json={"partitions": 1})
    assert r.status_code == 400, "a second create of the same name"
    assert r.json()["reason"] == f"there is already an exchange named {name}x"


def test_a_failed_partition_rolls_back_what_was_created(api, names, ctl):
    """A user may configure the exchange and the first partition but not the second: the
    creation fails on it and removes the exchange and the first partition again."""
    base, s = api
    name = names.q("rb")
    user = names.q("limited")
    assert ctl("add_user", user, "pw")[0] == 0
    try:
        assert ctl("set_user_tags", user, "management")[0] == 0
        pattern = f"^({name}|{name}-0)$"
        assert ctl("set_permissions", "-p", "/", user, pattern, pattern, pattern)[0] == 0
        r = s.put(f"{base}/api/stream/super-streams/%2F/{q(name)}", json={"partitions": 2},
                  auth=(user, "pw"))
        assert r.status_code in (401, 403), r.text
        assert f"{name}-1" in r.json()["reason"], "it got as far as the second partition"
        assert s.get(f"{base}/api/exchanges/%2F/{q(name)}").status_code == 404
        assert s.get(f"{base}/api/queues/%2F/{q(name + '-0')}").status_code == 404
    finally:
        ctl("delete_user", user)


def test_ctl_adds_and_deletes_a_super_stream(api, names, ctl):
    base, s = api
    name = names.q("invoices")
    code, out = ctl("add_super_stream", name, "--partitions", "4", "--max-age", "7D")
    assert code == 0, out
    # rabbitmq-streams 4.0.5's lines and exit statuses (checked against it).
    assert out.splitlines()[:2] == ["Adding a super stream...",
                                    f"Super stream {name} has been created"], out
    parts = lookup_partitions(base, s, "/", name)
    assert parts == [(f"{name}-{i}", str(i)) for i in range(4)]
    queue = s.get(f"{base}/api/queues/%2F/{q(name + '-3')}").json()
    assert queue["arguments"]["x-max-age"] == "7D"
    code, out = ctl("delete_super_stream", name)
    assert code == 0, out
    assert f"Super stream {name} has been deleted" in out
    assert s.get(f"{base}/api/exchanges/%2F/{q(name)}").status_code == 404
    for i in range(4):
        assert s.get(f"{base}/api/queues/%2F/{q(f'{name}-{i}')}").status_code == 404
    code, out = ctl("delete_super_stream", name)
    assert code == 70 and "stream_not_found" in out, (code, out)
    code, out = ctl("add_super_stream", name + "-d")
    assert code == 0, out
    assert len(lookup_partitions(base, s, "/", name + "-d")) == 3, "3 partitions by default"
    code, out = ctl("add_super_stream", name + "-d")
    assert code == 70 and f"there is already an exchange named {name}-d" in out, (code, out)
