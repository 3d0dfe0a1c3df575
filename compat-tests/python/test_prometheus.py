"""Prometheus metrics as RabbitMQ's rabbitmq_prometheus plugin exposes them: the series the
official RabbitMQ-Overview Grafana dashboard queries, counters that count exactly, and
`/metrics/detailed` with its family and vhost filters. Against RabbitMQ set
WARREN_TEST_PROMETHEUS_URL (default http://127.0.0.1:15692 when WARREN_TEST_AMQP_URL is set).
Warren's own series (histograms, oldest ready age) are marked warren_only."""

import urllib.parse

import pika
import pytest

from amqp_helpers import counts
from test_management import eventually, http, series

# Every metric the RabbitMQ-Overview dashboard (rabbitmq-server, deps/rabbitmq_prometheus/
# docker/grafana/dashboards/RabbitMQ-Overview.json) queries; it joins them on identity_info.
DASHBOARD_METRICS = """
rabbitmq_build_info rabbitmq_identity_info rabbitmq_channel_consumers rabbitmq_channel_get_ack_total
rabbitmq_channel_get_empty_total rabbitmq_channel_get_total rabbitmq_channel_messages_acked_total
rabbitmq_channel_messages_confirmed_total rabbitmq_channel_messages_delivered_ack_total
rabbitmq_channel_messages_delivered_total rabbitmq_channel_messages_published_total
rabbitmq_channel_messages_redelivered_total rabbitmq_channel_messages_unconfirmed
rabbitmq_channel_messages_unroutable_dropped_total rabbitmq_channel_messages_unroutable_returned_total
rabbitmq_channels rabbitmq_channels_closed_total rabbitmq_channels_opened_total rabbitmq_connections
rabbitmq_connections_closed_total rabbitmq_connections_opened_total rabbitmq_disk_space_available_bytes
rabbitmq_process_max_fds rabbitmq_process_max_tcp_sockets rabbitmq_process_open_fds
rabbitmq_process_open_tcp_sockets rabbitmq_process_resident_memory_bytes
rabbitmq_queue_messages_published_total rabbitmq_queue_messages_ready rabbitmq_queue_messages_unacked
rabbitmq_queues rabbitmq_queues_created_total rabbitmq_queues_declared_total rabbitmq_queues_deleted_total
rabbitmq_resident_memory_limit_bytes
""".split()


def scrape(prometheus_url, path="/metrics"):
    status, text, headers = http("GET", prometheus_url + path, user=None)
    assert status == 200, (path, status)
    assert headers["Content-Type"].startswith("text/plain")
    return text


def total(text, name):
    """Sum of a metric over all its series (what a dashboard's sum() sees)."""
    return sum(series(text, name).values())


def test_every_dashboard_metric_is_exposed(prometheus_url, ch, names):
    # Some series only appear once there is something to count (RabbitMQ omits per-channel and
    # per-queue series of objects that do not exist).
    queue = names.q()
    ch.queue_declare(queue)
    ch.basic_publish("", queue, b"x")
    counts(ch.connection, queue)
    text = eventually(lambda: scrape(prometheus_url),
                      lambda t: all(series(t, m) for m in DASHBOARD_METRICS))
    missing = [m for m in DASHBOARD_METRICS if not series(text, m)]
    assert not missing, missing
    identity = series(text, "rabbitmq_identity_info")
    assert len(identity) == 1 and list(identity.values()) == [1.0]
    labels = dict(next(iter(identity)))
    assert labels["rabbitmq_node"] and labels["rabbitmq_cluster"]
    assert total(text, "rabbitmq_process_open_fds") > 0
    assert total(text, "rabbitmq_process_max_fds") > total(text, "rabbitmq_process_open_fds")


def test_delivery_counters_split_by_ack_mode(prometheus_url, conn, names):
    """basic.consume and basic.get, each with and without acks, land in their own counters;
    returns, drops and empty gets are counted; lifecycle totals move."""
    split = {
        "consume_manual": "rabbitmq_global_messages_delivered_consume_manual_ack_total",
        "consume_auto": "rabbitmq_global_messages_delivered_consume_auto_ack_total",
        "get_manual": "rabbitmq_global_messages_delivered_get_manual_ack_total",
        "get_auto": "rabbitmq_global_messages_delivered_get_auto_ack_total",
        "get_empty": "rabbitmq_global_messages_get_empty_total",
        "returned": "rabbitmq_global_messages_unroutable_returned_total",
        "dropped": "rabbitmq_global_messages_unroutable_dropped_total",
        "ch_delivered_ack": "rabbitmq_channel_messages_delivered_ack_total",
        "ch_get": "rabbitmq_channel_get_total",
        "queues_created": "rabbitmq_queues_created_total",
        "queues_deleted": "rabbitmq_queues_deleted_total",
        "channels_opened": "rabbitmq_channels_opened_total",
    }

    def read():
        text = scrape(prometheus_url)
        return {k: total(text, m) for k, m in split.items()}

    before = read()
    ch = conn.channel()
    queue = names.q()
    ch.queue_declare(queue)

    def publish(n):
        for i in range(n):
            ch.basic_publish("", queue, f"m{i}".encode())

    # Each phase publishes exactly what it takes, so no consumer is handed extra messages.
    publish(2)  # 2 manual-ack consume deliveries
    got = 0
    for method, _p, _b in ch.consume(queue, inactivity_timeout=10):
        ch.basic_ack(method.delivery_tag)
        got += 1
        if got == 2:
            break
    ch.cancel()
    publish(3)  # 2 gets with ack, 1 get without

    for _ in range(2):
        method, _, _ = ch.basic_get(queue, auto_ack=False)
        ch.basic_ack(method.delivery_tag)
    ch.basic_get(queue, auto_ack=True)
    publish(2)  # 2 auto-ack consume deliveries
    got = 0
    for method, _p, _b in ch.consume(queue, auto_ack=True, inactivity_timeout=10):
        got += 1
        if got == 2:
            break
    ch.cancel()
    assert ch.basic_get(queue)[0] is None  # empty
    ch.basic_publish("amq.direct", "nowhere-" + queue, b"r", mandatory=True)
    ch.basic_publish("amq.direct", "nowhere-" + queue, b"d")
    ch.queue_delete(queue)
    ch.close()
    expected = dict(before)
    for k, n in [("consume_manual", 2), ("consume_auto", 2), ("get_manual", 2), ("get_auto", 1),
                 ("get_empty", 1), ("returned", 1), ("dropped", 1), ("ch_delivered_ack", 2),
                 ("ch_get", 1), ("queues_created", 1), ("queues_deleted", 1),
                 ("channels_opened", 1)]:
        expected[k] += n
    after = eventually(read, lambda r: r == expected)
    assert after == expected


def test_unconfirmed_gauge_returns_to_zero(prometheus_url, conn, names):
    ch = conn.channel()
    ch.confirm_delivery()
    queue = names.q()
    ch.queue_declare(queue)
    for i in range(5):
        ch.basic_publish("", queue, f"m{i}".encode())  # each waits for its confirm
    text = eventually(lambda: scrape(prometheus_url),
                      lambda t: total(t, "rabbitmq_channel_messages_unconfirmed") == 0)
    assert total(text, "rabbitmq_channel_messages_unconfirmed") == 0
    assert total(text, "rabbitmq_global_messages_received_confirm_total") >= 5


def test_detailed_endpoint_families_and_vhost_filter(prometheus_url, api_url, ch, names):
    queue = names.q()
    ch.queue_declare(queue)
    for _ in range(3):
        ch.basic_publish("", queue, b"abcd")
    counts(ch.connection, queue)
    mine = frozenset({("vhost", "/"), ("queue", queue)})
    # No family: identity only.
    text = scrape(prometheus_url, "/metrics/detailed")
    assert series(text, "rabbitmq_identity_info")
    assert not series(text, "rabbitmq_detailed_queue_messages_ready")
    path = "/metrics/detailed?family=queue_coarse_metrics&family=queue_consumer_count"
    text = eventually(lambda: scrape(prometheus_url, path),
                      lambda t: series(t, "rabbitmq_detailed_queue_messages_ready").get(mine) == 3)
    assert series(text, "rabbitmq_detailed_queue_messages_ready")[mine] == 3
    assert series(text, "rabbitmq_detailed_queue_messages")[mine] == 3
    assert series(text, "rabbitmq_detailed_queue_consumers")[mine] == 0
    assert not series(text, "rabbitmq_detailed_queue_messages_bytes"), "family not asked"
    assert not series(text, "rabbitmq_queue_messages_ready"), "no aggregated series here"
    text = scrape(prometheus_url, "/metrics/detailed?family=queue_metrics")
    assert series(text, "rabbitmq_detailed_queue_messages_ready_bytes").get(mine) == 12
    # A vhost filter keeps only that vhost's queues.
    other = urllib.parse.quote("no-such-vhost-" + queue, safe="")
    text = scrape(prometheus_url, f"/metrics/detailed?vhost={other}&family=queue_coarse_metrics")
    assert not series(text, "rabbitmq_detailed_queue_messages_ready")
    text = scrape(prometheus_url, "/metrics/detailed?vhost=%2F&family=queue_coarse_metrics")
    assert mine in series(text, "rabbitmq_detailed_queue_messages_ready")


@pytest.fixture
def api_url(management_url):
    return management_url


def histogram(text, name):
    """(count, {le: cumulative}) of a histogram."""
    buckets = {dict(k)["le"]: v for k, v in series(text, name + "_bucket").items()}
    count = total(text, name + "_count")
    return count, buckets


@pytest.mark.warren_only
def test_warren_latency_and_batch_histograms(prometheus_url, conn, names):
    """Warren's own histograms: a durable publish with confirms is one more observation of
    publish-to-confirm latency, of an fsync, of a commit and of a group-commit size."""
    hist = ["warren_publish_confirm_seconds", "warren_store_fsync_seconds",
            "warren_store_commit_seconds", "warren_store_group_commit_batches"]
    before = {h: histogram(scrape(prometheus_url), h)[0] for h in hist}
    ch = conn.channel()
    ch.confirm_delivery()
    queue = names.q()
    ch.queue_declare(queue, durable=True)
    for i in range(3):
        ch.basic_publish("", queue, f"m{i}".encode(),
                         properties=pika.BasicProperties(delivery_mode=2))
    text = scrape(prometheus_url)
    for h in hist:
        count, buckets = histogram(text, h)
        assert count > before[h], h
        assert buckets["+Inf"] == count, h
        values = [buckets[k] for k in sorted(buckets, key=lambda b: float(b))]
        assert values == sorted(values), f"{h} buckets are cumulative"
    assert histogram(text, "warren_publish_confirm_seconds")[0] >= before[hist[0]] + 3


@pytest.mark.warren_only
def test_oldest_ready_age_metric(prometheus_url, ch, names):
    queue = names.q()
    ch.queue_declare(queue)
    ch.basic_publish("", queue, b"waiting")
    counts(ch.connection, queue)
    mine = frozenset({("vhost", "/"), ("queue", queue)})
    name = "warren_queue_oldest_ready_message_age_seconds"
    text = eventually(lambda: scrape(prometheus_url, "/metrics/per-object"),
                      lambda t: series(t, name).get(mine, 0) >= 0.2)
    assert series(text, name)[mine] >= 0.2
    # /metrics carries the largest age over all queues.
    assert total(scrape(prometheus_url), name) >= 0.2
    ch.queue_purge(queue)
    assert series(scrape(prometheus_url, "/metrics/per-object"), name)[mine] == 0


def test_per_object_labels_are_in_rabbitmq_order(prometheus_url, ch, names):
    """Goal: per-object series read as RabbitMQ writes them, `vhost` then `queue`
    (prometheus_rabbitmq_core_metrics_collector:label/1), for tools that match series as
    text. Method: scrape /metrics/per-object and find the queue's lines verbatim."""
    queue = names.q()
    ch.queue_declare(queue)
    ch.basic_publish("", queue, b"x")
    counts(ch.connection, queue)
    text = scrape(prometheus_url, "/metrics/per-object")
    prefix = f'rabbitmq_queue_messages_ready{{vhost="/",queue="{queue}"}} '
    assert any(line.startswith(prefix) for line in text.splitlines()), prefix
    assert f'queue="{queue}",vhost="/"' not in text
