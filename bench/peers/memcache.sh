#!/usr/bin/env bash
# Petrel's memcache port beside Debian's memcached (an in-memory cache: the ceiling for this
# protocol on this machine), in one run, driven by two load generators:
#   - memcslap (libmemcached-tools), which nobody here wrote: its set test and its get test;
#   - `petrel bench queue --protocol memcache`: set-then-get of 64-byte values over a bounded
#     set of keys (= queues), many connections, pipelined and not.
# Each measurement follows a warm-up run of the same command; ROUNDS rounds (default 3) are
# interleaved (petrel, memcached, petrel, …) and the median is reported, with Petrel's figure as
# a ratio of memcached's. Petrel runs with its defaults: durable queues, durability `none`.
#
#   bench/peers/memcache.sh        COUNT (default 400000) items per petrel-bench run
#
# Installs what is missing: Debian's memcached and libmemcached-tools.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
count="${COUNT:-400000}"
rounds="${ROUNDS:-3}"
work="$(mktemp -d)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

command -v memcslap >/dev/null && command -v memcached >/dev/null ||
  { apt-get update -qq && apt-get install -y -qq memcached libmemcached-tools; }
(cd "$root" && cargo build --release --locked -q -p petrel)
petrel="$root/target/release/petrel"

memcached -l 127.0.0.1 -p 11311 -U 0 -m 2048 -c 4096 -u "$(id -un)" > /dev/null 2>&1 &
pids+=($!)
"$petrel" serve --data "$work/petrel" --native-addr 127.0.0.1:0 --memcache-addr 127.0.0.1:0 --http-addr off > "$work/petrel.out" 2>/dev/null &
pids+=($!)
for _ in $(seq 100); do grep -q '^memcache' "$work/petrel.out" 2>/dev/null && break; sleep 0.1; done
declare -A addr=([petrel]="$(awk '/^memcache/{print $2}' "$work/petrel.out")" [memcached]=127.0.0.1:11311)

# One measurement, in requests per second, on stdout.
bench() {
  local server="$1" workload="$2"
  case "$workload" in
    pipelined | unpipelined)
      local pipeline=32; [ "$workload" = unpipelined ] && pipeline=1
      "$petrel" bench queue --protocol memcache --server "${addr[$server]}" --mode offer-poll \
        --payload-bytes 64 --keys 100 --connections 8 --pipeline "$pipeline" --count "$count" --json |
        tail -n 1 | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["requests_per_sec"]))' ;;
    memcslap_set | memcslap_get)
      # 500 keys, each set (or got) once by each of 40 threads: 20,000 requests, over the time
      # memcslap reports. (Its get count is of hits: memcached hits every time, while a queue's
      # item goes to the first get only; both answer all 20,000.)
      memcslap --servers="${addr[$server]}" --test="${workload#memcslap_}" --execute-number=500 \
        --concurrency=40 --tcp-nodelay |
        awk '/^Time to (set|get) .* threads:/ {print int(500 * 40 / $(NF-1))}' ;;
  esac
}

results="$work/results"
# memcslap first: its set test makes 500 new queues per run (its keys are random each time), and
# ext4 allocates inodes slowly for a minute or two after many files were deleted (as the
# petrel-bench runs' retention deletes consumed segments). Run this on a quiet disk.
for workload in memcslap_set memcslap_get pipelined unpipelined; do
  for server in petrel memcached; do bench "$server" "$workload" > /dev/null; done # warm-up
  for round in $(seq "$rounds"); do
    for server in petrel memcached; do
      echo "$server $workload $(bench "$server" "$workload")" | tee -a "$results" >&2
    done
  done
done

python3 - "$results" "$count" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    server, workload, value = line.split()
    runs.setdefault((workload, server), []).append(float(value))
labels = {
    "memcslap_set": "memcslap --test=set, 500 new keys x 40 threads",
    "memcslap_get": "memcslap --test=get, 500 keys x 40 threads",
    "pipelined": "petrel-bench set-then-get, 64 B, 100 keys, 8 conns, pipeline 32",
    "unpipelined": "petrel-bench set-then-get, 64 B, 100 keys, 8 conns, no pipelining",
}
print(f"requests per second, median of {len(next(iter(runs.values())))} rounds; ratio = petrel / memcached")
for workload, label in labels.items():
    p = statistics.median(runs.get((workload, "petrel"), [0]))
    m = statistics.median(runs.get((workload, "memcached"), [0]))
    ratio = f"{p / m:.2f}x" if m else "n/a"
    print(f"{label:<66} petrel {p:>10,.0f}  memcached {m:>10,.0f}  {ratio}")
PY
