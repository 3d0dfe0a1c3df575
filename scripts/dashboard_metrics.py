#!/usr/bin/env python3
"""Print the metric names a Grafana dashboard's queries use, one per line.

    scripts/dashboard_metrics.py RabbitMQ-Overview.json [more.json ...]

The dashboards are RabbitMQ's (rabbitmq-server, deps/rabbitmq_prometheus/docker/grafana/
dashboards/); compat-tests/python/test_prometheus.py keeps the names this prints for the
versions it names, and checks that Warren serves every one. Label names that look like
metrics (rabbitmq_node, rabbitmq_cluster, ...) are left out.
"""

import json
import re
import sys

LABELS = {"rabbitmq_node", "rabbitmq_cluster", "rabbitmq_endpoint", "rabbitmq_version",
          "rabbitmq_prometheus", "rabbitmq_cluster_permanent_id"}


def expressions(node):
    """Every PromQL expression of a dashboard (targets' expr, templating queries)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "query") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, dict) and isinstance(value.get("query"), str):
                yield value["query"]
            else:
                yield from expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from expressions(item)


def main(paths):
    names = set()
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for expr in expressions(json.load(f)):
                names.update(re.findall(r"\b(rabbitmq_[a-z0-9_]+)\b", expr))
    for name in sorted(names - LABELS):
        print(name)


if __name__ == "__main__":
    main(sys.argv[1:])
