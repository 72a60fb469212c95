#!/usr/bin/env bash
# Petrel's topics and functions beside core NATS in one run, each driven by its own load
# generator (`petrel bench queue --mode call|publish`, `nats bench service|pub|sub`):
#   - request/reply, 5 KiB request and a small reply: one at a time on 1, 2, 4, 10 and 100
#     connections, and (Petrel) pipelined on one connection;
#   - publish 32-byte messages to 1, 10 and 100 subscribers, in messages delivered per second.
#
#   bench/peers/pubsub.sh       CALLS (default 20000) requests, MSGS (default 200000) published
#
# Installs nats-server v2.10.22 and natscli v0.3.0 if missing (as server.sh does).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
calls="${CALLS:-20000}"
msgs="${MSGS:-200000}"
work="$(mktemp -d)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

source "$root/bench/peers/nats.sh"
(cd "$root" && cargo build --release --locked -q -p petrel)
petrel="$root/target/release/petrel"

"$petrel" serve --data "$work/petrel" --native-addr 127.0.0.1:0 --memcache-addr off --http-addr off > "$work/petrel.out" 2>/dev/null &
pids+=($!)
for _ in $(seq 100); do grep -q '^native' "$work/petrel.out" 2>/dev/null && break; sleep 0.1; done
addr="$(awk '/^native/{print $2}' "$work/petrel.out")"
"$gobin/nats-server" -a 127.0.0.1 -p 4252 > /dev/null 2>&1 &
pids+=($!)
sleep 1
nats() { "$gobin/nats" -s nats://127.0.0.1:4252 "$@" --no-progress 2>&1; }
rate() { grep -oE '[0-9,]+ msgs/sec' | head -1 | tr -d ', msgs/ec'; }
p() { "$petrel" bench queue --server "$addr" --json "$@" | tail -n 1 | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["msgs_per_sec"]))'; }
results="$work/results"

p --mode call --count "$calls" --payload-bytes 5120 --pipeline 1 > /dev/null # warm-up
for c in 1 2 4 10 100; do
  echo "call_c$c petrel $(p --mode call --count "$calls" --payload-bytes 5120 --connections "$c" --pipeline 1)" | tee -a "$results" >&2
  serve_log="$work/serve-$c.txt"
  nats bench service serve bench.svc --clients 1 > "$serve_log" &
  serve=$!
  sleep 0.5
  echo "call_c$c nats $(nats bench service request bench.svc --clients "$c" --msgs "$calls" --size 5KB | rate)" | tee -a "$results" >&2
  kill "$serve" 2>/dev/null || true
done
echo "call_pipelined petrel $(p --mode call --count $((calls * 10)) --payload-bytes 5120 --pipeline 64)" | tee -a "$results" >&2

for s in 1 10 100; do
  n=$((msgs * 10 / s)) # fewer messages for many subscribers: similar total deliveries
  echo "publish_s$s petrel $(p --mode publish --count "$n" --payload-bytes 32 --batch 100 --subscribers "$s")" | tee -a "$results" >&2
  nats bench sub bench.ps --clients "$s" --msgs "$n" --size 32 > "$work/sub-$s.txt" &
  sub=$!
  sleep 1
  nats bench pub bench.ps --clients 1 --msgs "$n" --size 32 > /dev/null
  wait "$sub" || true
  echo "publish_s$s nats $(grep -i 'aggregated stats\|subscriber stats' "$work/sub-$s.txt" | rate)" | tee -a "$results" >&2
done

python3 - "$results" <<'PY'
import sys
rows = {}
for line in open(sys.argv[1]):
    parts = line.split()
    if len(parts) == 3 and parts[2]:
        rows[(parts[0], parts[1])] = float(parts[2])
labels = [(f"call_c{c}", f"request/reply 5 KiB, {c} connection(s), one at a time") for c in (1, 2, 4, 10, 100)]
labels += [("call_pipelined", "request/reply 5 KiB, 1 connection, 64 in flight")]
labels += [(f"publish_s{s}", f"publish 32 B, {s} subscriber(s), delivered") for s in (1, 10, 100)]
print("messages per second; ratio = petrel / nats")
for key, label in labels:
    pv, nv = rows.get((key, "petrel")), rows.get((key, "nats"))
    ratio = f"{pv / nv:.2f}x" if pv and nv else ""
    pv_s = f"{pv:,.0f}" if pv else "-"
    nv_s = f"{nv:,.0f}" if nv else "-"
    print(f"{label:<55} petrel {pv_s:>12}  nats {nv_s:>12}  {ratio}")
PY
