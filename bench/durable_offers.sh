#!/bin/bash
# Durable offers through the server: CONNECTIONS connections (default 64), one 32 B message per
# request and one request in flight each, to one queue with durability "always" (every offer is
# answered after fdatasync). Prints offers/s, fsyncs/s and records per fsync, from the server's
# own fsync histogram; ROUNDS rounds (default 3), each on a fresh server and data directory.
set -e
source "$(dirname "$0")/common.sh"
connections=${CONNECTIONS:-64}
count=${COUNT:-200000}
for round in $(seq "${ROUNDS:-3}"); do
  data="$work/data-$round"
  "$petrel" serve --data "$data" --durability always --native-addr 127.0.0.1:0 --memcache-addr off \
    --http-addr 127.0.0.1:0 > "$work/out" 2>/dev/null &
  pid=$!
  for _ in $(seq 200); do grep -q '^http' "$work/out" 2>/dev/null && break; sleep 0.05; done
  addr=$(awk '/^native/{print $2}' "$work/out")
  http=$(awk '/^http/{print $2}' "$work/out")
  syncs() { curl -s "http://$http/metrics" | awk '/^petrel_fsync_duration_seconds_count/{print $2}'; }
  before=$(syncs)
  "$petrel" bench queue --server "$addr" --durable --mode offer --payload-bytes 32 --count "$count" \
    --connections "$connections" --pipeline 1 --batch 1 --json 2>/dev/null | tail -1 > "$work/result"
  after=$(syncs)
  python3 - "$work/result" "${before:-0}" "${after:-0}" "$round" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
syncs = float(sys.argv[3]) - float(sys.argv[2])
print(f"round {sys.argv[4]}: {r['msgs_per_sec']:,.0f} offers/s, {syncs / r['secs']:,.0f} fsyncs/s, "
      f"{r['count'] / max(syncs, 1):.1f} records per fsync, p50 {r['latency_p50_us']:.0f} us, "
      f"p99 {r['latency_p99_us']:.0f} us ({r['count']} offers, {r['connections']} connections)")
EOF
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
done
