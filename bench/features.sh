#!/usr/bin/env bash
# What each of issue 15's features costs a durable queue's offers and polls, and what a delayed
# message and a remembered idempotency key cost in memory. One server in its own process; runs
# alternate off / on so that the machine's drift falls on both; each figure a median of ROUNDS.
#
#   cargo build --release -p petrel && bench/features.sh        (COUNT, ROUNDS, BATCH to change)
set -euo pipefail
cd "$(dirname "$0")/.."
petrel=target/release/petrel
count=${COUNT:-1000000}
rounds=${ROUNDS:-3}
batch=${BATCH:-10}
data=$(mktemp -d)
addr=127.0.0.1:$((20000 + RANDOM % 20000))
server_pid=
start_server() {
  rm -rf "$data/d" && mkdir -p "$data/d"
  "$petrel" serve --data "$data/d" --native-addr "$addr" --memcache-addr off --http-addr off >"$data/serve.out" 2>&1 &
  server_pid=$!
  for _ in $(seq 100); do grep -q '^native' "$data/serve.out" 2>/dev/null && return; sleep 0.05; done
  echo "server did not start" >&2; exit 1
}
stop_server() { kill "$server_pid" 2>/dev/null; wait "$server_pid" 2>/dev/null || true; }
trap 'stop_server; rm -rf "$data"' EXIT

rate() { # mode, flags… → msg/s
  local mode=$1; shift
  "$petrel" bench queue --server "$addr" --durable --mode "$mode" --batch "$batch" --connections 2 \
    --count "$count" --json "$@" 2>/dev/null | tail -1 | sed -E 's/.*"msgs_per_sec":([0-9.]+).*/\1/'
}
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) CPUs; $count messages of 32 B, $batch per offer, durable queue"
start_server
for mode in offer offer-poll; do
  for feature in "--priorities 3" "--idempotency-keys" "--delay-ms 1"; do
    off=() on=()
    for _ in $(seq "$rounds"); do
      off+=("$(rate "$mode")")
      # shellcheck disable=SC2086
      on+=("$(rate "$mode" $feature)")
    done
    o=$(printf '%s\n' "${off[@]}" | median); n=$(printf '%s\n' "${on[@]}" | median)
    printf '%-11s %-20s off %10.0f msg/s  on %10.0f msg/s  on/off %.2f   (runs: off %s; on %s)\n' \
      "$mode" "$feature" "$o" "$n" "$(echo "$n / $o" | bc -l)" "$(printf '%.0f ' "${off[@]}")" "$(printf '%.0f ' "${on[@]}")"
  done
done
stop_server

rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$server_pid/status"; }
# Memory: RSS growth of a fresh server holding N delayed messages (due in an hour), or N keys.
n=${MEMORY_COUNT:-1000000}
for what in "durable delayed:--durable --delay-ms 3600000" "in-memory delayed:--delay-ms 3600000" \
            "durable keys:--durable --idempotency-keys" "durable plain:--durable"; do
  name=${what%%:*}; flags=${what#*:}
  start_server
  before=$(rss_kib)
  # shellcheck disable=SC2086
  "$petrel" bench queue --server "$addr" --mode offer --batch 100 --count "$n" --queue held $flags --json >/dev/null 2>&1 || true
  after=$(rss_kib)
  printf '%-18s %8d messages: server RSS %6d -> %6d KiB, %.1f bytes each\n' "$name" "$n" "$before" "$after" \
    "$(echo "($after - $before) * 1024 / $n" | bc -l)"
  stop_server
done
