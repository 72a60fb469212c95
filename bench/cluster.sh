#!/usr/bin/env bash
# What the cluster client's routing costs (issue 13): one client against one server reached
# directly, and against clusters of 1, 2 and 3 servers on this machine, each server its own
# process. On two shared cores the total cannot grow with the servers, so the figure is the
# ratio to the direct run: what spreading, failover bookkeeping and per-server acks cost.
# Runs alternate so that the machine's drift falls on all; each figure a median of ROUNDS, the
# first run of each series included (fresh servers).
#
#   cargo build --release -p petrel && bench/cluster.sh        (COUNT, ROUNDS, BATCH, PIPELINE)
set -euo pipefail
cd "$(dirname "$0")/.."
petrel=target/release/petrel
count=${COUNT:-1000000}
rounds=${ROUNDS:-3}
batch=${BATCH:-1}
pipeline=${PIPELINE:-64}
data=$(mktemp -d)
base=$((20000 + RANDOM % 20000))
pids=()
addrs=()
for k in 0 1 2; do
  addr=127.0.0.1:$((base + k))
  mkdir -p "$data/s$k"
  "$petrel" serve --data "$data/s$k" --native-addr "$addr" --memcache-addr off --http-addr off >"$data/s$k.out" 2>&1 &
  pids+=($!)
  addrs+=("$addr")
done
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$data"' EXIT
for k in 0 1 2; do
  for _ in $(seq 100); do grep -q '^native' "$data/s$k.out" 2>/dev/null && break; sleep 0.05; done
done

rate() { # mode, --server value → "msg/s client-CPU-µs-per-message"
  "$petrel" bench queue --server "$2" --durable --mode "$1" --batch "$batch" --pipeline "$pipeline" \
    --connections 2 --count "$count" --json 2>/dev/null | tail -1 |
    sed -E 's/.*"client_cpu_us_per_msg":([0-9.]+).*"msgs_per_sec":([0-9.]+).*/\2 \1/'
}
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

a=${addrs[0]} b=${addrs[1]} c=${addrs[2]}
targets=("$a" "$a," "$a,$b" "$a,$b,$c")
names=("one server, direct" "cluster of 1" "cluster of 2" "cluster of 3")
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) CPUs; $count messages of 32 B," \
  "$batch per offer, $pipeline in flight per client, 2 clients, durable queues (durability none)"
for mode in offer offer-poll; do
  declare -A runs=() cpus=()
  for _ in $(seq "$rounds"); do
    for i in "${!targets[@]}"; do
      read -r r c < <(rate "$mode" "${targets[$i]}")
      runs[$i]+="$r " cpus[$i]+="$c "
    done
  done
  direct=$(printf '%s\n' ${runs[0]} | median)
  for i in "${!targets[@]}"; do
    m=$(printf '%s\n' ${runs[$i]} | median)
    cpu=$(printf '%s\n' ${cpus[$i]} | median)
    printf '%-10s %-20s %10.0f msg/s  ratio to direct %.2f  client CPU %.2f µs/msg   (runs: %s)\n' "$mode" \
      "${names[$i]}" "$m" "$(echo "$m / $direct" | bc -l)" "$cpu" "$(printf '%.0f ' ${runs[$i]})"
  done
  unset runs cpus
done
