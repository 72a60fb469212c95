#!/usr/bin/env bash
# Runs the same workload (enqueue N, then dequeue N) on Petrel's log and on the embedded peers,
# one after another in one run, and prints a table with the ratio Petrel/peer.
#
#   bench/peers/run.sh [DATA_DIR]        (default: ./petrel-data)
#
# Workloads: COUNT_32 (default 10000000) messages of 32 B; COUNT_1K (default 1000000) of 1 KiB;
# and a lookup workload, COUNT_KEYED (default 2000000) messages of 32 B with 100000 keys, then
# random gets by offset, by time and by key (klevdb only: bigqueue has no lookups).
# Each system runs ROUNDS times (default 3), interleaved with the others, the order rotating each
# round. On a VM, a run that follows another program's pays for memory the host took back (it
# halves write rates here), so every measured run directly follows an unmeasured warm-up run of
# the same system. The table shows each system's median.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
data="$(realpath -m "${1:-$root/petrel-data}")"
count_32="${COUNT_32:-10000000}"
count_1k="${COUNT_1K:-1000000}"
count_keyed="${COUNT_KEYED:-2000000}"
rounds="${ROUNDS:-3}"
mkdir -p "$data"

echo "building petrel (release) and the peers…" >&2
(cd "$root" && cargo build --release --locked -q -p petrel)
bin="$root/bench/peers/bin"
mkdir -p "$bin"
(cd "$root/bench/peers" && go build -o "$bin/bigqueue" ./bigqueue && go build -o "$bin/klevdb" ./klevdb)

results="$(mktemp)"
trap 'rm -f "$results" "$results.warmup" "$results.measured"' EXIT
for spec in "32 $count_32 0" "1024 $count_1k 0" "32 $count_keyed 100000"; do
  set -- $spec
  size=$1 count=$2 keys=$3
  if [ "$keys" = 0 ]; then order=(petrel bigqueue klevdb); else order=(petrel klevdb); fi
  for round in $(seq "$rounds"); do
    for system in "${order[@]}"; do
      echo "payload $size B × $count, round $round: $system…" >&2
      for run in warmup measured; do
        if [ "$system" = petrel ]; then
          "$root/target/release/petrel" bench log --data "$data" --payload-bytes "$size" --count "$count" --keys "$keys" --json \
            | tail -n 1 | python3 -c 'import json,sys; d=json.load(sys.stdin); d["peer"]="petrel"; print(json.dumps(d))'
        else
          "$bin/$system" -dir "$data" -count "$count" -payload-bytes "$size" -keys "$keys"
        fi > "$results.$run"
      done
      cat "$results.measured" >> "$results"
    done
    order=("${order[@]:1}" "${order[0]}")
  done
done

python3 - "$results" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
metrics = [("append_msgs_per_sec", "enqueue"), ("read_msgs_per_sec", "dequeue/read"),
           ("poll_ack_msgs_per_sec", "consumer read+ack"), ("get_by_offset_per_sec", "get by offset"),
           ("get_by_time_per_sec", "get by time"), ("get_by_key_per_sec", "get by key")]
workloads = list(dict.fromkeys((r["payload_bytes"], r.get("keys", 0), r["count"]) for r in runs))
print(f"medians of the measured runs; ratio = petrel / peer")
print(f"{'workload':<28} {'operation':<18} {'petrel':>12} {'peer':<16} {'peer ops/s':>12} {'ratio':>8}")
for size, keys, count in workloads:
    w = f"{size} B x {count}" + (f", {keys} keys" if keys else "")
    group = [r for r in runs if (r["payload_bytes"], r.get("keys", 0), r["count"]) == (size, keys, count)]
    def median(peer, key):
        vals = [r[key] for r in group if r["peer"] == peer and r.get(key) is not None]
        return statistics.median(vals) if vals else None
    peers = [p for p in dict.fromkeys(r["peer"] for r in group) if p != "petrel"]
    for key, label in metrics:
        p = median("petrel", key)
        for peer in peers:
            q = median(peer, key)
            if p is None or q is None:
                continue
            print(f"{w:<28} {label:<18} {p:>12,.0f} {peer:<16} {q:>12,.0f} {p / q:>7.2f}x")
PY
