#!/usr/bin/env bash
# What TLS and authentication cost, in one run against one server (which speaks plaintext and TLS
# on the same port): pipelined 32 B offers, 5 KiB request/reply one at a time and 64 in flight,
# each plaintext and TLS, interleaved, ROUNDS times (default 3), medians; then handshakes per
# second (TLS alone, AUTH alone over plaintext on loopback, TLS + AUTH). Prints a table.
#
#   bench/security.sh          (COUNT offers, default 1000000; CALLS calls, default 20000)
set -euo pipefail
count="${COUNT:-1000000}"
calls="${CALLS:-20000}"
rounds="${ROUNDS:-3}"
source "$(dirname "$0")/common.sh"
"$petrel" cert dev "$work/certs" > /dev/null
echo 'bench-secret' | "$petrel" user add "$work/users.toml" bench --admin > /dev/null
cat > "$work/petrel.toml" <<EOF
[security]
users_file = "$work/users.toml"
tls_cert = "$work/certs/server.pem"
tls_key = "$work/certs/server.key"
allow_plaintext_auth = true
auth_attempts_per_minute = 1000000
EOF
"$petrel" serve --config "$work/petrel.toml" --data "$work/data" --native-addr 127.0.0.1:0 --memcache-addr off --http-addr off \
  > "$work/serve.out" 2>/dev/null &
pid=$!
for _ in $(seq 100); do grep -q '^native' "$work/serve.out" 2>/dev/null && break; sleep 0.1; done
addr="$(awk '/^native/{print $2}' "$work/serve.out")"
export PETREL_PASSWORD=bench-secret
tls=(--tls-ca "$work/certs/ca.pem")
b() { "$petrel" bench queue --server "$addr" --user bench --json "$@" | tail -n 1 \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["msgs_per_sec"])'; }

b --mode offer --pipeline 64 --count "$count" > /dev/null   # warm-up
for round in $(seq "$rounds"); do
  for mode in plain tls; do
    extra=(); [ "$mode" = tls ] && extra=("${tls[@]}")
    echo "offer32_p64 $mode $(b "${extra[@]}" --mode offer --payload-bytes 32 --pipeline 64 --count "$count")" >> "$work/r"
    echo "call5k_p1 $mode $(b "${extra[@]}" --mode call --payload-bytes 5120 --pipeline 1 --count "$calls")" >> "$work/r"
    echo "call5k_p64 $mode $(b "${extra[@]}" --mode call --payload-bytes 5120 --pipeline 64 --count $((calls * 10)))" >> "$work/r"
  done
done
h() { "$petrel" bench queue --server "$addr" --mode connect --connections 2 --json "$@" | tail -n 1 \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["msgs_per_sec"])'; }
echo "connect tls $(h "${tls[@]}" --count 2000)" >> "$work/r"
echo "connect auth $(h --user bench --count 200)" >> "$work/r"
echo "connect tls+auth $(h "${tls[@]}" --user bench --count 200)" >> "$work/r"
echo "connect plain $(h --count 2000)" >> "$work/r"

python3 - "$work/r" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name, mode, value = line.split()
    rows.setdefault(name, {}).setdefault(mode, []).append(float(value))
print("| workload | plaintext | TLS 1.3 | TLS / plaintext |")
print("|---|---|---|---|")
for name in ("offer32_p64", "call5k_p1", "call5k_p64"):
    p, t = statistics.median(rows[name]["plain"]), statistics.median(rows[name]["tls"])
    print(f"| {name} | {p:,.0f}/s | {t:,.0f}/s | {t / p:.2f} |")
c = rows["connect"]
print()
print("| handshake | per second (2 at a time) |")
print("|---|---|")
for mode in ("plain", "tls", "auth", "tls+auth"):
    print(f"| {mode} | {c[mode][0]:,.0f} |")
PY
