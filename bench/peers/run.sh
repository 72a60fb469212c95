#!/usr/bin/env bash
# Runs the same workload (enqueue N, then dequeue N) on Petrel's log and on the embedded peers,
# one after another in one run, and prints a table with the ratio Petrel/peer.
#
#   bench/peers/run.sh [DATA_DIR]        (default: ./petrel-data)
#
# Counts: COUNT_32 (default 10000000) messages of 32 B, COUNT_1K (default 1000000) of 1 KiB.
# Each system runs ROUNDS times (default 3), interleaved with the others, the order rotating each
# round. On a VM, a run that follows another program's pays for memory the host took back (it
# halves write rates here), so every measured run directly follows an unmeasured warm-up run of
# the same system. The table shows each system's median.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
data="$(realpath -m "${1:-$root/petrel-data}")"
count_32="${COUNT_32:-10000000}"
count_1k="${COUNT_1K:-1000000}"
rounds="${ROUNDS:-3}"
mkdir -p "$data"

echo "building petrel (release) and the peers…" >&2
(cd "$root" && cargo build --release --locked -q -p petrel)
bin="$root/bench/peers/bin"
mkdir -p "$bin"
(cd "$root/bench/peers" && go build -o "$bin/bigqueue" ./bigqueue && go build -o "$bin/klevdb" ./klevdb)

results="$(mktemp)"
trap 'rm -f "$results" "$results.warmup" "$results.measured"' EXIT
for spec in "32 $count_32" "1024 $count_1k"; do
  set -- $spec
  size=$1 count=$2
  order=(petrel bigqueue klevdb)
  for round in $(seq "$rounds"); do
    for system in "${order[@]}"; do
      echo "payload $size B × $count, round $round: $system…" >&2
      for run in warmup measured; do
        if [ "$system" = petrel ]; then
          "$root/target/release/petrel" bench log --data "$data" --payload-bytes "$size" --count "$count" --json \
            | tail -n 1 | python3 -c 'import json,sys; d=json.load(sys.stdin); d["peer"]="petrel"; print(json.dumps(d))'
        else
          "$bin/$system" -dir "$data" -count "$count" -payload-bytes "$size"
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
rows = []
for key in dict.fromkeys((r["payload_bytes"], r["peer"]) for r in runs):
    same = [r for r in runs if (r["payload_bytes"], r["peer"]) == key]
    row = dict(same[0])
    for k in ("append_msgs_per_sec", "read_msgs_per_sec"):
        row[k] = statistics.median(r[k] for r in same)
    rows.append(row)
rows.sort(key=lambda r: (r["payload_bytes"], r["peer"] != "petrel"))
print(f"medians of {len(same)} runs each")
print(f"{'workload':<18} {'system':<16} {'enqueue msg/s':>15} {'dequeue msg/s':>15} {'petrel/peer enq':>16} {'petrel/peer deq':>16}")
for size in sorted({r["payload_bytes"] for r in rows}):
    group = [r for r in rows if r["payload_bytes"] == size]
    p = next(r for r in group if r["peer"] == "petrel")
    for r in group:
        w = f"{size} B × {r['count']}"
        ratio = lambda k: "" if r is p else f"{p[k] / r[k]:.2f}x"
        print(f"{w:<18} {r['peer']:<16} {r['append_msgs_per_sec']:>15,.0f} {r['read_msgs_per_sec']:>15,.0f}"
              f" {ratio('append_msgs_per_sec'):>16} {ratio('read_msgs_per_sec'):>16}")
PY
