#!/usr/bin/env bash
# Every performance target of docs/benchmarks.md, with its peers, in one run on this host:
# Petrel and each peer measured one after the other, ROUNDS times (default 3) interleaved, the
# median kept, the first run of each series included (no warm-up runs: a lead must hold cold).
# Prints a Markdown table (figure, peer, ratio, target, met or not) and writes it to OUT.
#
#   bench/run-all.sh [OUT]        (default OUT: bench-results.md)   SCALE=0.1 for a quick look
#
# Peers: bigqueue (Go, built here), Chronicle Queue (Java, built here with Maven), Redis lists with an append-only file, a bare loopback echo
# (C, built here: the host's bound for a call), Redis without a disk for pipelined calls,
# memcached with memcslap (Debian packages, installed if missing). Durability of each figure is
# in its row.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(realpath -m "${1:-bench-results.md}")"
rounds="${ROUNDS:-3}"
scale="${SCALE:-1}"
n() { python3 -c "print(max(1, int($1 * $scale)))"; }
work="$(mktemp -d)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

command -v redis-benchmark >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server redis-tools; }
command -v memcslap >/dev/null && command -v memcached >/dev/null ||
  { apt-get update -qq && apt-get install -y -qq memcached libmemcached-tools; }
echo "building petrel (release), bigqueue, Chronicle Queue's peer and the loopback echo…" >&2
(cd "$root" && cargo build --release --locked -q -p petrel)
petrel="$root/target/release/petrel"
mkdir -p "$root/bench/peers/bin"
(cd "$root/bench/peers" && go build -o bin/bigqueue ./bigqueue)
bigqueue="$root/bench/peers/bin/bigqueue"
cc -O2 -o "$root/bench/peers/bin/echo" "$root/bench/peers/echo/echo.c"
chronicle="$root/bench/peers/chronicle/run.sh"
rm -rf "$work/cq" && "$chronicle" append "$work/cq" 1 32 > /dev/null && rm -rf "$work/cq" # builds it
loopback_echo="$root/bench/peers/bin/echo"
results="$work/results"
: > "$results"
# record ROW SYSTEM VALUE
record() { echo "$1 $2 $3" | tee -a "$results" >&2; }
field() { python3 -c "import json,sys; d=json.loads(sys.stdin.readlines()[-1]); print(d['$1'])"; }

# Starts `petrel serve` with extra arguments; sets $native and $memcache to its addresses.
serve() {
  local dir="$work/server-$RANDOM"
  "$petrel" serve --data "$dir" --native-addr 127.0.0.1:0 --memcache-addr 127.0.0.1:0 --http-addr off "$@" \
    > "$dir.out" 2>/dev/null &
  pids+=($!)
  server_pid=$!
  for _ in $(seq 200); do grep -q '^memcache' "$dir.out" 2>/dev/null && break; sleep 0.05; done
  native="$(awk '/^native/{print $2}' "$dir.out")"
  memcache="$(awk '/^memcache/{print $2}' "$dir.out")"
}
stop() { kill "$server_pid"; wait "$server_pid" 2>/dev/null || true; }
queue() { "$petrel" bench queue --server "$native" --json "$@" 2>/dev/null; }
# memcslap's set or get test: sets (gets) per second over 500 keys × 40 threads.
memcslap_rate() {
  memcslap --servers="$1" --test="$2" --execute-number=500 --concurrency=40 --tcp-nodelay |
    awk '/^Time to (set|get) .* threads:/ {print int(500 * 40 / $(NF-1))}'
}

embedded=$(n 10000000)
# This guest hands memory it frees back to the host within seconds (free page reporting), and a
# run on memory just freed by another is up to twice as fast as one on memory the host took back
# (docs/benchmarks.md). So that no embedded system starts on memory the one before it left, each
# starts after a pause long enough for the host to take the last one's back: all start cold,
# as a first run does.
settle() { sleep "${SETTLE_SECONDS:-6}"; }
for round in $(seq "$rounds"); do
  echo "round $round of $rounds" >&2
  # 1, 6. The embedded log beside bigqueue and Chronicle Queue: 32 B appends; reads and a
  # group's poll + ack in a second process (Chronicle's tailers in a second JVM); lookups.
  rm -rf "$work/log" && mkdir -p "$work/log"
  settle
  "$petrel" bench log --data "$work/log" --payload-bytes 32 --count "$embedded" --consumer-process --json \
    > "$work/log.json"
  for f in append_msgs_per_sec read_msgs_per_sec poll_ack_msgs_per_sec get_by_offset_per_sec \
    get_many_by_offset_per_sec bytes_on_disk peak_rss_bytes consumer_peak_rss_bytes; do
    record "log_$f" petrel "$(field "$f" < "$work/log.json")"
  done
  rm -rf "$work/log" && mkdir -p "$work/log"
  settle
  "$bigqueue" -dir "$work/log" -count "$embedded" -payload-bytes 32 -keys 0 > "$work/bq.json"
  for f in append_msgs_per_sec read_msgs_per_sec poll_ack_msgs_per_sec bytes_on_disk; do
    record "log_$f" bigqueue "$(field "$f" < "$work/bq.json")"
  done
  rm -rf "$work/log"
  settle
  "$chronicle" append "$work/cq" "$embedded" 32 > "$work/cq-append.json"
  "$chronicle" tail "$work/cq" "$embedded" 32 > "$work/cq-tail.json"
  for f in append_msgs_per_sec bytes_on_disk peak_rss_bytes; do
    record "log_$f" chronicle "$(field "$f" < "$work/cq-append.json")"
  done
  for f in read_msgs_per_sec poll_ack_msgs_per_sec; do
    record "log_$f" chronicle "$(field "$f" < "$work/cq-tail.json")"
  done
  record log_consumer_peak_rss_bytes chronicle "$(field peak_rss_bytes < "$work/cq-tail.json")"
  rm -rf "$work/cq"

  # 2. Durable appends after fdatasync: one producer, 64 producers (embedded), 64 connections.
  mkdir -p "$work/log"
  record durable_one petrel "$("$petrel" bench log --data "$work/log" --payload-bytes 32 --count "$(n 10000)" \
    --durability always --lookups 1 --json | field append_msgs_per_sec)"
  record durable_64 petrel "$("$petrel" bench log --data "$work/log" --payload-bytes 32 --count "$(n 200000)" \
    --durability always --producers 64 --lookups 1 --json | field append_msgs_per_sec)"
  rm -rf "$work/log"
  serve --durability always
  record durable_server_64 petrel "$(queue --durable --mode offer --payload-bytes 32 --count "$(n 200000)" \
    --connections 64 --pipeline 1 --batch 1 | field msgs_per_sec)"
  stop

  # 3. The server, one connection: 1 message per request with 64 in flight, and 100 per request.
  serve
  record server_one petrel "$(queue --durable --mode offer --payload-bytes 32 --count "$(n 2000000)" --pipeline 64 \
    | field msgs_per_sec)"
  record server_100 petrel "$(queue --durable --mode offer --payload-bytes 32 --count "$(n 5000000)" --pipeline 64 \
    --batch 100 | field msgs_per_sec)"
  # 4. Calls to an echo function, one connection.
  record call_5k_one petrel "$(queue --mode call --payload-bytes 5120 --count "$(n 20000)" --pipeline 1 | field msgs_per_sec)"
  record call_5k_64 petrel "$(queue --mode call --payload-bytes 5120 --count "$(n 200000)" --pipeline 64 | field msgs_per_sec)"
  record call_500k petrel "$(queue --mode call --payload-bytes 512000 --count "$(n 2000)" --pipeline 1 | field mb_per_sec)"
  record call_5m petrel "$(queue --mode call --payload-bytes 5242880 --count "$(n 200)" --pipeline 1 | field mb_per_sec)"
  # 5. The memcache port with memcslap (500 keys, each set or got once by each of 40 threads).
  record memcslap_set petrel "$(memcslap_rate "$memcache" set)"
  record memcslap_get petrel "$(memcslap_rate "$memcache" get)"
  stop

  redis-server --port 6391 --bind 127.0.0.1 --dir "$work" --appendonly yes --save '' > /dev/null 2>&1 &
  pids+=($!)
  redis_pid=$!
  sleep 0.5
  record server_one redis "$(redis-benchmark -h 127.0.0.1 -p 6391 -n "$(n 2000000)" -c 1 -P 64 -d 32 -t lpush --csv \
    | awk -F'","' '/^"LPUSH/{print $2}')"
  kill "$redis_pid"; wait "$redis_pid" 2>/dev/null || true
  rm -rf "$work"/appendonly*

  # The calls' peers. One at a time, the host's own bound (bench/peers/echo: two processes
  # echoing the payload over loopback with blocking sockets, nothing else): a call is two such
  # round trips (caller -> server -> replier and back), so it cannot beat half the echo's rate.
  # 64 in flight: Redis without a disk (calls have none), two LPUSHes of 5 KiB per call.
  record call_5k_one echo "$("$loopback_echo" 5120 "$(n 20000)" | field call_bound_per_sec)"
  record call_500k echo "$("$loopback_echo" 512000 "$(n 2000)" | field call_bound_mb_per_sec)"
  record call_5m echo "$("$loopback_echo" 5242880 "$(n 200)" | field call_bound_mb_per_sec)"
  redis-server --port 6392 --bind 127.0.0.1 --dir "$work" --appendonly no --save '' > /dev/null 2>&1 &
  pids+=($!)
  redis_pid=$!
  sleep 0.5
  record call_5k_64 redis "$(redis-benchmark -h 127.0.0.1 -p 6392 -n "$(n 200000)" -c 1 -P 64 -d 5120 -t lpush --csv |
    awk -F'","' '/^"LPUSH/{print $2 / 2}')"
  kill "$redis_pid"; wait "$redis_pid" 2>/dev/null || true

  memcached -l 127.0.0.1 -p 11311 -U 0 -m 1024 -c 4096 -u "$(id -un)" > /dev/null 2>&1 &
  pids+=($!)
  memcached_pid=$!
  sleep 0.3
  record memcslap_set memcached "$(memcslap_rate 127.0.0.1:11311 set)"
  record memcslap_get memcached "$(memcslap_rate 127.0.0.1:11311 get)"
  kill "$memcached_pid"; wait "$memcached_pid" 2>/dev/null || true
done

cpu="$(awk -F': ' '/^model name/{print $2; exit}' /proc/cpuinfo)"
python3 - "$results" "$rounds" "$cpu" "$(nproc)" "$embedded" > "$out" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    parts = line.split()
    if len(parts) == 3 and parts[2] != "None":
        runs.setdefault((parts[0], parts[1]), []).append(float(parts[2]))
med = lambda row, system: statistics.median(runs[(row, system)]) if (row, system) in runs else None
rounds, cpu, cores, embedded = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])

def fmt(v, unit):
    if v is None: return "n/a"
    if unit == "B": return f"{v / 1e6:,.0f} MB"
    if unit == "MB/s": return f"{v / 1e3:,.2f} GB/s"
    return f"{v / 1e6:,.2f} M/s" if v >= 1e6 else f"{v / 1e3:,.1f} k/s"

# (row, what, unit, peer system or None, what the peer is, targets: list of (kind, value))
rows = [
    ("log_append_msgs_per_sec", f"embedded append, 32 B × {embedded:,}, durability none", "/s", "bigqueue", "bigqueue v0.6.0", [("ratio", 2.5), ("min", 25e6)]),
    ("log_append_msgs_per_sec", f"embedded append, 32 B × {embedded:,}, durability none", "/s", "chronicle", "Chronicle Queue 5.27ea11", []),
    ("log_read_msgs_per_sec", "embedded read, same log, a second process (every CRC checked)", "/s", "bigqueue", "bigqueue v0.6.0 (same process)", []),
    ("log_read_msgs_per_sec", "embedded read, same log, a second process (every CRC checked)", "/s", "chronicle", "Chronicle tailer, a second JVM", []),
    ("log_poll_ack_msgs_per_sec", "embedded group read, poll + ack of each, a second process", "/s", "bigqueue", "bigqueue consumer (no acks, same process)", []),
    ("log_poll_ack_msgs_per_sec", "embedded group read, poll + ack of each, a second process", "/s", "chronicle", "Chronicle named tailer, a second JVM", [("ratio", 1.0)]),
    ("log_bytes_on_disk", "embedded bytes on disk, same log", "B", "bigqueue", "bigqueue v0.6.0", [("max_ratio", 1.0)]),
    ("log_bytes_on_disk", "embedded bytes on disk, same log", "B", "chronicle", "Chronicle Queue 5.27ea11", []),
    ("log_peak_rss_bytes", "embedded peak RSS, the appending process", "B", "chronicle", "Chronicle Queue 5.27ea11", []),
    ("log_consumer_peak_rss_bytes", "embedded peak RSS, the reading process", "B", "chronicle", "Chronicle Queue 5.27ea11", []),
    ("log_get_many_by_offset_per_sec", "random get by offset, 64 per call", "/s", None, "", [("min", 5e6)]),
    ("log_get_by_offset_per_sec", "random get by offset, one per call", "/s", None, "", []),
    ("durable_one", "embedded durable append, 1 producer, always", "/s", None, "", []),
    ("durable_64", "embedded durable append, 64 producers, always", "/s", ("durable_one", "petrel"), "1 producer", [("ratio", 30), ("min", 1e5)]),
    ("durable_server_64", "server durable offers, 64 connections, always", "/s", ("durable_one", "petrel"), "1 producer (embedded)", [("ratio", 30), ("min", 1e5)]),
    ("server_one", "server offers, 1 per request, 64 in flight, 1 connection, durable queue (none)", "/s", "redis", "Redis LPUSH -c 1 -P 64, AOF", [("ratio", 2.5), ("min", 1e6)]),
    ("server_100", "server offers, 100 per request, 1 connection", "/s", None, "", [("min", 3e6)]),
    ("call_5k_one", "call, 5 KiB, one at a time, 1 connection", "/s", "echo", "two bare loopback round trips (bench/peers/echo)", [("min", 30e3)]),
    ("call_5k_64", "call, 5 KiB, 64 in flight, 1 connection", "/s", "redis", "Redis, two LPUSH 5 KiB per call (-c 1 -P 64)", [("min", 300e3)]),
    ("call_500k", "call, 500 KiB, one at a time", "MB/s", "echo", "two bare loopback round trips (bench/peers/echo)", [("min", 3e3)]),
    ("call_5m", "call, 5 MiB, one at a time", "MB/s", "echo", "two bare loopback round trips (bench/peers/echo)", [("min", 3e3)]),
    ("memcslap_set", "memcache port, memcslap set (500 keys × 40 threads)", "/s", "memcached", "memcached", [("ratio", 0.8)]),
    ("memcslap_get", "memcache port, memcslap get", "/s", "memcached", "memcached", [("ratio", 1.0)]),
]
print(f"Host: {cpu}, {cores} vCPUs. Medians of {rounds} rounds, each system's first run included; "
      "ratio = Petrel / peer, same run.\n")
print("| workload | Petrel | peer | peer's figure | ratio | target | met |")
print("|---|---|---|---|---|---|---|")
def shown_ratio(ratio):
    # Two decimals, more where two would hide which side of 1 a ratio is on.
    if ratio is None:
        return ""
    return f"{ratio:.4f}×" if ratio != 1 and round(ratio, 2) == 1 else f"{ratio:.2f}×"

for row, what, unit, peer, peer_name, targets in rows:
    p = med(row, "petrel")
    q = med(*peer) if isinstance(peer, tuple) else med(row, peer) if peer else None
    ratio = p / q if p is not None and q else None
    checks, words = [], []
    for kind, value in targets:
        if kind == "ratio":
            words.append(f"≥ {value:g}×"); checks.append(ratio is not None and ratio >= value)
        elif kind == "max_ratio":
            words.append(f"≤ {value:g}× the peer"); checks.append(ratio is not None and ratio <= value)
        else:
            words.append(f"≥ {fmt(value, unit)}"); checks.append(p is not None and p >= value)
    met = "" if not targets else ("yes" if all(checks) else "no")
    print(f"| {what} | {fmt(p, unit)} | {peer_name} | {fmt(q, unit) if q else ''} | "
          f"{shown_ratio(ratio)} | {', '.join(words)} | {met} |")
PY
cat "$out"
