#!/usr/bin/env bash
# What a Prometheus scrape of /metrics costs on a server with QUEUES queues (default 10,000,
# made by memcache first use, one message each): time and bytes of SCRAPES scrapes (default 5,
# the first counted too), with per-queue series and with `metrics_per_queue = false`.
#
#   bench/metrics.sh
set -euo pipefail
queues="${QUEUES:-10000}"
scrapes="${SCRAPES:-5}"
source "$(dirname "$0")/common.sh"
for per_queue in true false; do
  printf 'metrics_per_queue = %s\nmax_queues = %s\n' "$per_queue" "$((queues + 10))" > "$work/petrel.toml"
  rm -rf "$work/data" "$work/serve.out"
  "$petrel" serve --config "$work/petrel.toml" --data "$work/data" --native-addr 127.0.0.1:0 \
    --memcache-addr 127.0.0.1:0 --http-addr 127.0.0.1:0 > "$work/serve.out" 2>/dev/null &
  pid=$!
  for _ in $(seq 100); do grep -q '^http' "$work/serve.out" 2>/dev/null && break; sleep 0.1; done
  mc="$(awk '/^memcache/{print $2}' "$work/serve.out")"
  http="$(awk '/^http/{print $2}' "$work/serve.out")"
  python3 - "$mc" "$queues" <<'PY'
import socket, sys
host, port = sys.argv[1].rsplit(":", 1)
s = socket.create_connection((host, int(port)))
n = int(sys.argv[2])
for start in range(0, n, 500):
    s.sendall(b"".join(b"set q%d 0 0 1\r\nx\r\n" % i for i in range(start, min(n, start + 500))))
    got = b""
    while got.count(b"STORED\r\n") < min(n, start + 500) - start:
        got += s.recv(65536)
PY
  for i in $(seq "$scrapes"); do
    curl -s -o /dev/null -w "metrics_per_queue=$per_queue queues=$queues scrape=$i seconds=%{time_total} bytes=%{size_download}\n" \
      "http://$http/metrics"
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
done
