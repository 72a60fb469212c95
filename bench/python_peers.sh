#!/usr/bin/env bash
# Petrel's Python package beside its Python peers in one run (GitHub issue #12, item 5): embedded
# put/get against persist-queue (file and SQLite queues) and diskcache.Deque; client offers and
# polls against redis-py on Debian's Redis; request/reply against nats-py on nats-server. Prints
# Markdown tables with ratios (what each workload does and guarantees: bench/python_peers.py).
#
#   bench/python_peers.sh [--count N] [--slow-count N] [--client-count N] [--rr-count N] [--latency-count N]
#                         [--rounds R] [--only embedded|client|rr] [--json]
#
# Environment:
#   PYTHON      a Python that already has petrel, persist-queue, diskcache, redis and nats-py;
#               without it, a venv at target/bench-pyenv gets them (petrel built from ./python)
#   PETREL_BIN  the petrel server binary; without it, `cargo build --release` of this checkout
#
# Installs what is missing: Debian's redis-server (apt, as root) and nats-server v2.10.22 (Go
# module proxy). The servers it starts listen on 127.0.0.1 ports 23101-23104 (--port-base) and
# are stopped at the end; data goes to a temporary directory, removed at the end.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

if [ -z "${PETREL_BIN:-}" ]; then
  (cd "$root" && cargo build --release --locked -q -p petrel)
  PETREL_BIN="$root/target/release/petrel"
fi

if [ -z "${PYTHON:-}" ]; then
  venv="$root/target/bench-pyenv"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q "$root/python" persist-queue==1.1.0 diskcache==5.6.3 redis==8.1.0 nats-py==2.16.0
  PYTHON="$venv/bin/python"
fi

if ! command -v redis-server > /dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq redis-server
  else
    echo "redis-server is missing (apt-get install redis-server): the Redis columns will be empty" >&2
  fi
fi

gobin="$(go env GOPATH 2> /dev/null || echo "$HOME/go")/bin"
if [ ! -x "$gobin/nats-server" ] && ! command -v nats-server > /dev/null; then
  if command -v go > /dev/null; then
    go install github.com/nats-io/nats-server/v2@v2.10.22
  else
    echo "nats-server and go are missing: the NATS column will be empty" >&2
  fi
fi
nats_server="$(command -v nats-server || true)"
[ -x "$gobin/nats-server" ] && nats_server="$gobin/nats-server"

cd "$root"   # not python/: there `import petrel` would find the source tree, not the package
exec "$PYTHON" "$root/bench/python_peers.py" --petrel-bin "$PETREL_BIN" \
  --redis-server "$(command -v redis-server || true)" --nats-server "$nats_server" "$@"
