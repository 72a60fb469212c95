#!/usr/bin/env bash
# What a restart costs a server with QUEUES queues (default 10,000, made by memcache first use,
# one message each): time until it listens, its resident memory (file pages: the mapped
# segments and cursors; anonymous: everything else) and the page cache its segments then take.
# ROUNDS restarts (default 3), each with warm caches and, when this user may drop the kernel's
# caches (root), one with cold ones first (page cache, dentries and inodes: as after a reboot,
# but for the disk's own cache). Petrel's defaults: durable queues, log
# durability `none`.
#
#   bench/restart.sh                 (QUEUES, ROUNDS to change; BINS="a b" to compare builds)
set -euo pipefail
queues="${QUEUES:-10000}"
rounds="${ROUNDS:-3}"
source "$(dirname "$0")/common.sh"
bins=(${BINS:-$petrel})
start() {
  rm -f "$work/serve.out"
  "$1" serve --config "$work/petrel.toml" --data "$work/data" --native-addr 127.0.0.1:0 \
    --memcache-addr 127.0.0.1:0 --http-addr off > "$work/serve.out" 2>/dev/null &
  pid=$!
  for _ in $(seq 2000); do grep -q '^memcache' "$work/serve.out" 2>/dev/null && return; sleep 0.005; done
  echo "server did not start" >&2; exit 1
}
stop() { kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""; }
printf 'max_queues = %s\n' "$((queues + 10))" > "$work/petrel.toml"
start "${bins[0]}"
python3 - "$(awk '/^memcache/{print $2}' "$work/serve.out")" "$queues" <<'PY'
import socket, sys
host, port = sys.argv[1].rsplit(":", 1)
s = socket.create_connection((host, int(port)))
f = s.makefile("rb")
for i in range(int(sys.argv[2])):
    s.sendall(b"set q%d 0 0 5\r\nhello\r\n" % i)
    assert f.readline() == b"STORED\r\n"
PY
stop
caches=(warm)
if [ -w /proc/sys/vm/drop_caches ]; then caches=(cold warm); fi
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) CPUs; $queues queues of one message"
for _ in $(seq "$rounds"); do
  for bin in "${bins[@]}"; do
    for cache in "${caches[@]}"; do
      if [ "$cache" = cold ]; then sync; echo 3 > /proc/sys/vm/drop_caches; sleep 1; fi
      started=$(date +%s%N); start "$bin"; ready=$(date +%s%N)
      status=/proc/$pid/status
      cached=$(find "$work/data/queues" -name '*.log' -print0 | xargs -0 fincore -b -n -o RES | awk '{s += $1} END {printf "%.0f", s / 1048576}')
      printf '%-40s %-4s ready in %5d ms  RSS file %4d MB, anonymous %4d MB  segments in page cache %5s MiB\n' \
        "$bin" "$cache" $(((ready - started) / 1000000)) $(($(awk '/RssFile/ {print $2}' "$status") / 1024)) \
        $(($(awk '/RssAnon/ {print $2}' "$status") / 1024)) "$cached"
      stop
    done
  done
done
