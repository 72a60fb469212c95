#!/usr/bin/env bash
# Sets up what the tests need and runs all of them. CI runs exactly this (see .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TERM_COLOR=never
echo "== toolchain"
cargo --version
# The build below takes several GB; say how much room there is, so a full disk is plain.
df -h . | tail -n 1 | awk '{print "disk: " $4 " free of " $2}'
rustup component add rustfmt clippy >/dev/null 2>&1 || true

echo "== system packages the tests use"
# promtool (Debian's prometheus) checks the server's /metrics; a headless Chromium and its
# driver load the dashboard (tests/dashboard).
missing=()
command -v promtool >/dev/null || missing+=(prometheus)
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
if [ "${#missing[@]}" -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
fi
promtool --version | head -n 1
chromium --version

echo "== format and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "== tests"
cargo test --workspace --locked

echo "== Python tests: memcache with an off-the-shelf client (pymemcache), the dashboard in Chromium"
if [ ! -x target/pyenv/bin/python ]; then
  python3.11 -m venv target/pyenv 2>/dev/null || python3 -m venv target/pyenv
fi
target/pyenv/bin/pip install -q --disable-pip-version-check -r tests/requirements.txt
cargo build -q --locked -p petrel
PETREL_BIN="$PWD/target/debug/petrel" target/pyenv/bin/python -m pytest -q -p no:cacheprovider tests

echo "== the Python package (python/): built and installed with pip, then its tests"
cargo fmt --manifest-path python/Cargo.toml -- --check
cargo clippy -q --manifest-path python/Cargo.toml --all-targets -- -D warnings
target/pyenv/bin/pip install -q --disable-pip-version-check ./python
PETREL_BIN="$PWD/target/debug/petrel" target/pyenv/bin/python -m pytest -q -p no:cacheprovider python/tests
for example in queue consumer_groups message_store; do
  target/pyenv/bin/python "python/examples/$example.py" > /dev/null
done

echo "== fuzz targets"
# Each decoder's target, and the request handler's: built always; run briefly where a nightly
# toolchain is at hand (cargo-fuzz needs it), as the long runs by hand are (docs/benchmarks.md).
fuzz_targets=(frame segment files proto memcache handler)
if cargo +nightly --version >/dev/null 2>&1; then
  command -v cargo-fuzz >/dev/null || cargo install -q --locked cargo-fuzz@0.13.2
  for target in "${fuzz_targets[@]}"; do
    log="target/fuzz-$target.log"
    if ! cargo +nightly fuzz run -s none "$target" -- -max_total_time="${PETREL_FUZZ_SECONDS:-15}" \
      -rss_limit_mb=2048 > "$log" 2>&1; then
      tail -n 40 "$log"
      echo "fuzz target $target failed" >&2
      exit 1
    fi
    echo "$target: $(grep -E '^Done' "$log" || tail -n 1 "$log")"
  done
else
  echo "no nightly toolchain: building the fuzz targets without running them"
  cargo check -q --manifest-path fuzz/Cargo.toml --bins
fi

echo "== examples"
for example in queue consumer_groups message_store; do
  cargo run -q --locked -p petrel-log --example "$example" > /dev/null
done
for example in offer_poll reliable_worker coffee topics_functions; do
  cargo run -q --locked -p petrel-client --example "$example" > /dev/null
done
# …and against a running server, as a user would run them.
serve_dir="$(mktemp -d)"
target/debug/petrel serve --data "$serve_dir" --native-addr 127.0.0.1:0 --memcache-addr off --http-addr off > "$serve_dir/out" 2>/dev/null &
serve_pid=$!
for _ in $(seq 100); do grep -q '^native' "$serve_dir/out" 2>/dev/null && break; sleep 0.1; done
cargo run -q --locked -p petrel-client --example offer_poll -- --server "$(awk '/^native/{print $2}' "$serve_dir/out")" > /dev/null
target/pyenv/bin/python python/examples/reliable_worker.py --server "$(awk '/^native/{print $2}' "$serve_dir/out")" > /dev/null
kill "$serve_pid"; wait "$serve_pid" || true; rm -rf "$serve_dir"
