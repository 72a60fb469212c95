#!/usr/bin/env bash
# Sets up what the tests need and runs all of them. CI runs exactly this (see .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TERM_COLOR=never
echo "== toolchain"
cargo --version
rustup component add rustfmt clippy >/dev/null 2>&1 || true

echo "== format and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "== tests"
cargo test --workspace --locked

echo "== memcache protocol with an off-the-shelf client (pymemcache)"
if [ ! -x target/pyenv/bin/python ]; then
  python3.11 -m venv target/pyenv 2>/dev/null || python3 -m venv target/pyenv
fi
target/pyenv/bin/pip install -q --disable-pip-version-check -r tests/requirements.txt
cargo build -q --locked -p petrel
PETREL_BIN="$PWD/target/debug/petrel" target/pyenv/bin/python -m pytest -q -p no:cacheprovider tests

echo "== examples"
for example in queue consumer_groups message_store; do
  cargo run -q --locked -p petrel-log --example "$example" > /dev/null
done
for example in offer_poll reliable_worker coffee topics_functions; do
  cargo run -q --locked -p petrel-client --example "$example" > /dev/null
done
