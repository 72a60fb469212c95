#!/usr/bin/env bash
# What zstd on the wire does for text payloads (seed 004's compression cutoff): request/reply of
# 5 KiB and 500 KiB English-like text, one call at a time and 8 in flight, without and with
# --compress-min-bytes 1024, interleaved, ROUNDS times (default 3), medians; bytes on the wire
# from the server's own counters. Prints a table.
#
#   bench/compression.sh
set -euo pipefail
rounds="${ROUNDS:-3}"
source "$(dirname "$0")/common.sh"
"$petrel" serve --data "$work/data" --native-addr 127.0.0.1:0 --memcache-addr 127.0.0.1:0 --http-addr off > "$work/serve.out" 2>/dev/null &
pid=$!
for _ in $(seq 100); do grep -q '^memcache' "$work/serve.out" 2>/dev/null && break; sleep 0.1; done
addr="$(awk '/^native/{print $2}' "$work/serve.out")"
mc="$(awk '/^memcache/{print $2}' "$work/serve.out")"
wire() {  # bytes read + written by the server so far
  python3 - "$mc" <<'PY'
import socket, sys
host, port = sys.argv[1].rsplit(":", 1)
s = socket.create_connection((host, int(port)))
s.sendall(b"stats\r\n")
data = b""
while not data.endswith(b"END\r\n"):
    data += s.recv(65536)
stats = dict(l.split()[1:3] for l in data.decode().splitlines() if l.startswith("STAT"))
print(int(stats["bytes_read"]) + int(stats["bytes_written"]))
PY
}
b() { "$petrel" bench queue --server "$addr" --mode call --text --json "$@" | tail -n 1 \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["msgs_per_sec"])'; }
b --payload-bytes 5120 --pipeline 1 --count 2000 > /dev/null   # warm-up
for round in $(seq "$rounds"); do
  for size in 5120 512000; do
    calls=$(( size > 100000 ? 1000 : 20000 ))
    for pipeline in 1 8; do
      for mode in off zstd; do
        extra=(); [ "$mode" = zstd ] && extra=(--compress-min-bytes 1024)
        before=$(wire)
        rate=$(b "${extra[@]}" --payload-bytes "$size" --pipeline "$pipeline" --count "$calls")
        after=$(wire)
        echo "$size $pipeline $mode $rate $(( (after - before) / calls ))" >> "$work/r"
      done
    done
  done
done
python3 - "$work/r" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    size, pipeline, mode, rate, wire = line.split()
    rows.setdefault((int(size), int(pipeline)), {}).setdefault(mode, []).append((float(rate), int(wire)))
print("| payload (text) | in flight | calls/s, off | calls/s, zstd | ratio | wire bytes per call, off | zstd |")
print("|---|---|---|---|---|---|---|")
for (size, pipeline), modes in sorted(rows.items()):
    off = statistics.median(r for r, _ in modes["off"])
    on = statistics.median(r for r, _ in modes["zstd"])
    woff = statistics.median(w for _, w in modes["off"])
    won = statistics.median(w for _, w in modes["zstd"])
    print(f"| {size // 1024} KiB | {pipeline} | {off:,.0f} | {on:,.0f} | {on / off:.2f} | {woff:,.0f} | {won:,.0f} |")
PY
