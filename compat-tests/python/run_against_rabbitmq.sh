#!/usr/bin/env bash
# Validate the compatibility suite against a real RabbitMQ (the reference behaviour).
# Not used in CI. Installs/starts rabbitmq-server if needed (Debian, needs root),
# creates <repo>/.venv-compat, and runs the suite with WARREN_TEST_AMQP_URL set.
#
# Usage: compat-tests/python/run_against_rabbitmq.sh [extra pytest args]
#   STOP_RABBITMQ=1  stop the broker afterwards if this script started it.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="$REPO/.venv-compat"
URL="amqp://guest:guest@127.0.0.1:5672/%2F"

port_open() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; }

started=0
if ! port_open; then
  if ! command -v rabbitmq-server >/dev/null 2>&1; then
    echo ">> installing rabbitmq-server"
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y rabbitmq-server
  fi
  echo ">> starting rabbitmq-server"
  if ! service rabbitmq-server start >/dev/null 2>&1; then
    (rabbitmq-server >/tmp/rabbitmq-compat.log 2>&1 &)
  fi
  started=1
  for _ in $(seq 1 120); do
    port_open && break
    sleep 0.5
  done
  port_open || { echo "rabbitmq did not come up on 5672" >&2; exit 1; }
  # The port opens slightly before the broker has finished booting.
  rabbitmqctl await_startup >/dev/null 2>&1 || true
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo ">> creating $VENV"
  python3 -m venv "$VENV"
fi
# A venv-local .gitignore keeps the venv out of git (the repo-root path cannot be
# ignored from compat-tests/python/.gitignore).
echo '*' > "$VENV/.gitignore"
"$VENV/bin/pip" install -q -r "$HERE/requirements.txt"

rc=0
(cd "$HERE" && WARREN_TEST_AMQP_URL="$URL" "$VENV/bin/python" -m pytest "$@") || rc=$?

if [ "$started" = 1 ] && [ "${STOP_RABBITMQ:-0}" = 1 ]; then
  echo ">> stopping rabbitmq-server"
  rabbitmqctl stop >/dev/null 2>&1 || service rabbitmq-server stop || true
fi
exit $rc
