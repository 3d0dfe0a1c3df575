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

# Every metric the official dashboards query (rabbitmq-server deps/rabbitmq_prometheus/
# docker/grafana/dashboards/), extracted with scripts/dashboard_metrics.py from each
# dashboard's JSON (label names such as rabbitmq_node are left out). They join on
# rabbitmq_identity_info.
# RabbitMQ-Overview.json of v3.10.8 and of v4.2.0:
OVERVIEW_METRICS = """
rabbitmq_build_info rabbitmq_channel_consumers rabbitmq_channels rabbitmq_channels_closed_total
rabbitmq_channels_opened_total rabbitmq_connections rabbitmq_connections_closed_total
rabbitmq_connections_opened_total rabbitmq_consumers rabbitmq_disk_space_available_bytes
rabbitmq_erlang_uptime_seconds rabbitmq_global_consumers
rabbitmq_global_messages_acknowledged_total rabbitmq_global_messages_confirmed_total
rabbitmq_global_messages_delivered_consume_auto_ack_total
rabbitmq_global_messages_delivered_consume_manual_ack_total
rabbitmq_global_messages_delivered_get_auto_ack_total
rabbitmq_global_messages_delivered_get_manual_ack_total rabbitmq_global_messages_delivered_total
rabbitmq_global_messages_get_empty_total rabbitmq_global_messages_received_confirm_total
rabbitmq_global_messages_received_total rabbitmq_global_messages_redelivered_total
rabbitmq_global_messages_routed_total rabbitmq_global_messages_unroutable_dropped_total
rabbitmq_global_messages_unroutable_returned_total rabbitmq_global_publishers
rabbitmq_identity_info rabbitmq_message_size_bytes_bucket rabbitmq_message_size_bytes_count
rabbitmq_message_size_bytes_sum rabbitmq_process_max_fds rabbitmq_process_max_tcp_sockets
rabbitmq_process_open_fds rabbitmq_process_open_tcp_sockets
rabbitmq_process_resident_memory_bytes rabbitmq_queue_messages_ready
rabbitmq_queue_messages_unacked rabbitmq_queues rabbitmq_queues_created_total
rabbitmq_queues_declared_total rabbitmq_queues_deleted_total
rabbitmq_resident_memory_limit_bytes
""".split()
# RabbitMQ-Quorum-Queues-Raft.json of v3.13.7 and v4.2.0, plus the 4.x names of the same
# series (prometheus_rabbitmq_raft_metrics_collector, from ra's counters):
RAFT_METRICS = """
rabbitmq_raft_entry_commit_latency_seconds rabbitmq_raft_log_commit_index
rabbitmq_raft_log_last_written_index rabbitmq_raft_log_snapshot_index rabbitmq_raft_term_total
rabbitmq_raft_commit_latency_seconds rabbitmq_raft_term rabbitmq_raft_commit_index
rabbitmq_raft_last_written_index rabbitmq_raft_snapshot_index
""".split()
# The older list this suite checked (a 3.x Overview with the per-channel series).
DASHBOARD_METRICS = sorted(set(OVERVIEW_METRICS) | set("""
rabbitmq_channel_get_ack_total rabbitmq_channel_get_empty_total rabbitmq_channel_get_total
rabbitmq_channel_messages_acked_total rabbitmq_channel_messages_confirmed_total
rabbitmq_channel_messages_delivered_ack_total rabbitmq_channel_messages_delivered_total
rabbitmq_channel_messages_published_total rabbitmq_channel_messages_redelivered_total
rabbitmq_channel_messages_unconfirmed rabbitmq_channel_messages_unroutable_dropped_total
rabbitmq_channel_messages_unroutable_returned_total rabbitmq_queue_messages_published_total
""".split()))


def scrape(prometheus_url, path="/metrics"):
    status, text, headers = http("GET", prometheus_url + path, user=None)
    assert status == 200, (path, status)
    assert headers["Content-Type"].startswith("text/plain")
    return text


def total(text, name):
    """Sum of a metric over all its series (what a dashboard's sum() sees)."""
    return sum(series(text, name).values())


@pytest.mark.warren_only
def test_every_dashboard_metric_is_exposed(prometheus_url, ch, names):
    """Goal: every panel of both generations of the Overview dashboard has data. Warren-only:
    no one RabbitMQ serves them all (3.x has the tcp_sockets series, 4.1+ the message-size
    histogram)."""
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


@pytest.mark.warren_only
def test_quorum_queues_raft_dashboard_has_data(prometheus_url, conn, names):
    """Goal: every series of the Quorum-Queues-Raft dashboard (3.x and 4.x names) is served,
    also for a quorum queue on a single node, and the indices move with its traffic
    (Warren-only: each RabbitMQ serves one generation's names; 4.0.5 has the 3.x ones).
    Method:
    declare a quorum queue, scrape, publish, scrape again."""
    ch = conn.channel()
    queue = names.q()
    ch.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
    mine = frozenset({("vhost", "/"), ("queue", queue)})
    before = scrape(prometheus_url, "/metrics/per-object")
    missing = [m for m in RAFT_METRICS if mine not in series(before, m)]
    assert not missing, missing
    ch.confirm_delivery()
    for _ in range(3):
        ch.basic_publish("", queue, b"x", pika.BasicProperties(delivery_mode=2))
    after = eventually(lambda: scrape(prometheus_url, "/metrics/per-object"),
                       lambda t: series(t, "rabbitmq_raft_commit_index")[mine]
                       >= series(before, "rabbitmq_raft_commit_index")[mine] + 3)
    for m in ("rabbitmq_raft_commit_index", "rabbitmq_raft_log_commit_index",
              "rabbitmq_raft_last_written_index"):
        assert series(after, m)[mine] >= series(before, m)[mine] + 3, m
    assert series(after, "rabbitmq_raft_term")[mine] >= 1
    aggregated = scrape(prometheus_url)
    assert all(series(aggregated, m) for m in RAFT_METRICS)


@pytest.mark.warren_only
def test_publishers_consumers_and_message_sizes(prometheus_url, connect, names):
    """Goal: the Overview dashboard's publisher, consumer and message-size panels count what
    happens (rabbit_global_counters, rabbit_msg_size_metrics; the histogram is RabbitMQ 4.1+,
    so 4.0.5 cannot run this). Method: open a publishing
    channel and a consumer, publish a 50-byte and a 5000-byte body, compare with a scrape
    taken before; closing the publisher's connection takes it off the gauge."""
    def gauge(t, name):
        return series(t, name).get(frozenset({("protocol", "amqp091")}), 0)

    def bucket(t, le):
        return series(t, "rabbitmq_message_size_bytes_bucket").get(
            frozenset({("protocol", "amqp091"), ("le", le)}), 0)

    queue = names.q()
    before = scrape(prometheus_url)
    pub = connect()
    ch = pub.channel()
    ch.queue_declare(queue)
    ch.confirm_delivery()
    ch.basic_publish("", queue, b"a" * 50)
    ch.basic_publish("", queue, b"b" * 5000)
    sub = connect()
    sub.channel().basic_consume(queue, lambda *a: None)
    t = eventually(lambda: scrape(prometheus_url),
                   lambda t: gauge(t, "rabbitmq_global_publishers")
                   >= gauge(before, "rabbitmq_global_publishers") + 1
                   and gauge(t, "rabbitmq_global_consumers")
                   >= gauge(before, "rabbitmq_global_consumers") + 1)
    assert gauge(t, "rabbitmq_global_publishers") >= gauge(before, "rabbitmq_global_publishers") + 1
    assert gauge(t, "rabbitmq_global_consumers") >= gauge(before, "rabbitmq_global_consumers") + 1
    assert bucket(t, "100") >= bucket(before, "100") + 1
    assert bucket(t, "10000") >= bucket(before, "10000") + 2
    assert bucket(t, "+Inf") >= bucket(before, "+Inf") + 2
    count = lambda x: series(x, "rabbitmq_message_size_bytes_count").get(
        frozenset({("protocol", "amqp091")}), 0)
    total_bytes = lambda x: series(x, "rabbitmq_message_size_bytes_sum").get(
        frozenset({("protocol", "amqp091")}), 0)
    assert count(t) >= count(before) + 2
    assert total_bytes(t) >= total_bytes(before) + 5050
    publishers = gauge(t, "rabbitmq_global_publishers")
    pub.close()
    sub.close()
    t = eventually(lambda: scrape(prometheus_url),
                   lambda t: gauge(t, "rabbitmq_global_publishers") <= publishers - 1)
    assert gauge(t, "rabbitmq_global_publishers") <= publishers - 1
