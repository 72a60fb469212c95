#!/usr/bin/env bash
# Petrel's server beside NATS JetStream (file storage) and Redis lists (append-only file), one
# after another in one run, each driven by its own load generator; prints a table with ratios.
#
#   bench/peers/server.sh            COUNT (default 1000000) messages of 32 B per workload
#
# Installs what is missing: nats-server v2.10.22 and natscli v0.3.0 (Go module proxy; the
# natscli version list is refused, so it is downloaded by exact version and built), and Debian's
# redis-server and redis-tools.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
count="${COUNT:-1000000}"
work="$(mktemp -d)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

command -v redis-benchmark >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server redis-tools; }
source "$root/bench/peers/nats.sh"
(cd "$root" && cargo build --release --locked -q -p petrel)
petrel="$root/target/release/petrel"
results="$work/results"

echo "petrel…" >&2
"$petrel" serve --data "$work/petrel" --native-addr 127.0.0.1:0 > "$work/petrel.out" 2>/dev/null &
pids+=($!)
for _ in $(seq 100); do grep -q '^native' "$work/petrel.out" 2>/dev/null && break; sleep 0.1; done
addr="$(awk '/^native/{print $2}' "$work/petrel.out")"
p() { "$petrel" bench queue --server "$addr" --durable --payload-bytes 32 --count "$count" --json "$@" | tail -n 1; }
p --mode offer --pipeline 64 > /dev/null   # warm-up (see docs/benchmarks.md: this VM's cold memory)
echo "petrel offer $(p --mode offer --pipeline 64 | python3 -c 'import json,sys; print(json.load(sys.stdin)["msgs_per_sec"])')" >> "$results"
echo "petrel offer_deep $(p --mode offer --pipeline 256 | python3 -c 'import json,sys; print(json.load(sys.stdin)["msgs_per_sec"])')" >> "$results"
echo "petrel offer_batched $(p --mode offer --pipeline 64 --batch 100 | python3 -c 'import json,sys; print(json.load(sys.stdin)["msgs_per_sec"])')" >> "$results"
echo "petrel offer_poll $(p --mode offer-poll --connections 2 --pipeline 64 --batch 10 | python3 -c 'import json,sys; print(json.load(sys.stdin)["msgs_per_sec"])')" >> "$results"

echo "nats jetstream…" >&2
"$gobin/nats-server" -js -sd "$work/js" -a 127.0.0.1 -p 4250 > /dev/null 2>&1 &
pids+=($!)
sleep 1
rate() { grep -oE '[0-9,]+ msgs/sec' | head -1 | tr -d ', msgs/ec'; }
n() { "$gobin/nats" -s nats://127.0.0.1:4250 bench js "$@" --msgs "$count" --size 32 --no-progress 2>&1; }
echo "nats offer $(n pub async bench.js --create --storage file | rate)" >> "$results"
n fetch > "$work/nats-fetch.txt" || true
echo "nats offer_poll $(rate < "$work/nats-fetch.txt")" >> "$results"
tail -3 "$work/nats-fetch.txt" >&2

echo "redis…" >&2
redis-server --port 6391 --bind 127.0.0.1 --dir "$work" --appendonly yes --save '' > /dev/null 2>&1 &
pids+=($!)
sleep 1
redis-benchmark -h 127.0.0.1 -p 6391 -n "$count" -P 64 -d 32 -t lpush,rpop --csv > "$work/redis.csv"
echo "redis offer $(awk -F'","' '/^"LPUSH/{print $2}' "$work/redis.csv")" >> "$results"
echo "redis offer_poll $(awk -F'","' '/^"RPOP/{print $2}' "$work/redis.csv")" >> "$results"
redis-benchmark -h 127.0.0.1 -p 6391 -n "$count" -P 256 -d 32 -t lpush --csv > "$work/redis-deep.csv"
echo "redis offer_deep $(awk -F'","' '/^"LPUSH/{print $2}' "$work/redis-deep.csv")" >> "$results"

python3 - "$results" "$count" <<'PY'
import sys
rows = {}
for line in open(sys.argv[1]):
    parts = line.split()
    if len(parts) != 3:
        print(f"no figure for: {line.strip()} (see the tool's output)", file=sys.stderr)
        continue
    system, workload, value = parts
    rows[(system, workload)] = float(value)
print(f"{sys.argv[2]} messages of 32 B; ratio = petrel / peer")
labels = {"offer": "offer, 1 per request, 64 in flight", "offer_deep": "offer, 1 per request, 256 in flight",
          "offer_batched": "offer, 100 per request", "offer_poll": "consume (poll/fetch/rpop)"}
for (system, workload), v in rows.items():
    peer_ratios = ""
    if system == "petrel":
        for peer in ("nats", "redis"):
            q = rows.get((peer, "offer" if workload == "offer_batched" else workload))
            if q:
                peer_ratios += f"  {peer} {v / q:.2f}x"
    print(f"{system:<7} {labels[workload]:<34} {v:>12,.0f} msg/s{peer_ratios}")
PY
