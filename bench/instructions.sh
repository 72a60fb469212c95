#!/usr/bin/env bash
# The server's instructions per offered message, counted by valgrind's callgrind, for a plain
# durable queue and for each of issue 15's features. Unlike a rate, a count of instructions does
# not move with the host's load or its wake-up costs, so a change's cost shows in one run; what
# it leaves out (cache misses, system calls, waiting) is what bench/features.sh measures.
#
#   cargo build --release -p petrel && bench/instructions.sh     (COUNT, BATCH to change)
#
# Needs valgrind (Debian: `apt-get install valgrind`). The server runs ~50× slower under it, so a
# 1 ms delay covers fewer messages at a time than at full speed; the counts include the server's
# start and the queue's creation, spread over COUNT messages.
set -euo pipefail
cd "$(dirname "$0")/.."
petrel=$PWD/target/release/petrel
count=${COUNT:-600000}
batch=${BATCH:-10}
command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install valgrind)" >&2; exit 1; }
work=$(mktemp -d)
server_pid=
stop_server() {
  [ -n "$server_pid" ] || return 0
  kill -INT "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=
}
trap 'stop_server; rm -rf "$work"' EXIT

# count NAME FLAGS… → instructions per message, whole server and in the offer path.
count() {
  local name=$1; shift
  rm -rf "$work/d" && mkdir -p "$work/d"
  valgrind --tool=callgrind --callgrind-out-file="$work/$name.cg" "$petrel" serve --data "$work/d" \
    --native-addr 127.0.0.1:0 --memcache-addr off --http-addr off >"$work/serve.out" 2>"$work/serve.err" &
  server_pid=$!
  for _ in $(seq 600); do grep -q '^native' "$work/serve.out" 2>/dev/null && break; sleep 0.1; done
  local addr
  addr=$(awk '/^native/ {print $2; exit}' "$work/serve.out")
  [ -n "$addr" ] || { echo "server did not start" >&2; cat "$work/serve.err" >&2; exit 1; }
  "$petrel" bench queue --server "$addr" --durable --mode offer --batch "$batch" --connections 1 \
    --count "$count" --keep --json "$@" >/dev/null 2>&1
  stop_server
  callgrind_annotate --inclusive=yes --threshold=100 "$work/$name.cg" >"$work/$name.txt" 2>/dev/null
  python3 - "$work/$name.txt" "$count" "$name" <<'PY'
import re, sys
path, n, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
found = {}
for line in open(path):
    m = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(\S+)", line)
    if not m:
        continue
    cost, where = int(m.group(1).replace(",", "")), m.group(2)
    for key, suffix in [("total", "PROGRAM"),
                        ("offer", "broker/src/queue.rs:petrel_broker::queue::Queue::offer_unsynced"),
                        ("decode", "proto/src/message.rs:petrel_proto::message::Message::decode")]:
        if where.endswith(suffix):
            found.setdefault(key, cost)
print("| %s | %.0f | %.0f | %.0f |" % (name, *(found.get(k, 0) / n for k in ("total", "offer", "decode"))))
PY
}

echo "Server instructions per message, $count messages of 32 B, $batch per request, one connection:"
echo
echo "| offers | whole server | offer (under the queue's lock and before) | decoding |"
echo "|---|---|---|---|"
count plain
count "priorities 3" --priorities 3
count "a key per message" --idempotency-keys
count "delay 1 ms" --delay-ms 1
