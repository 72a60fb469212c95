#!/bin/bash
# Pipelined 32 B offers (one message per request) against a server with the HTTP listener (and
# its observers, a scrape each second) on, and off; alternating, 3 rounds.
set -e
# Build first: cargo build --release -p petrel
B="$(cd "$(dirname "$0")/.." && pwd)/target/release/petrel"
for round in 1 2 3; do
  for mode in on off; do
    d=$(mktemp -d)
    if [ $mode = on ]; then h=127.0.0.1:0; else h=off; fi
    $B serve --data $d --native-addr 127.0.0.1:0 --memcache-addr off --http-addr $h > $d/out 2>/dev/null &
    pid=$!
    for i in $(seq 100); do grep -q '^native' $d/out 2>/dev/null && break; sleep 0.05; done
    addr=$(awk '/^native/{print $2}' $d/out)
    scraper=""
    if [ $mode = on ]; then
      http=$(awk '/^http/{print $2}' $d/out)
      (while true; do curl -s http://$http/metrics > /dev/null; sleep 1; done) & scraper=$!
    fi
    r=$($B bench queue --server $addr --mode offer --payload-bytes 32 --count 2000000 --connections 2 --pipeline 256 --batch 1 --json 2>/dev/null | tail -1)
    echo "$round $mode $r"
    [ -n "$scraper" ] && kill $scraper
    kill $pid; wait $pid 2>/dev/null || true; rm -rf $d
  done
done
