# Sourced by the bench scripts: `root`, a temporary `work` directory removed on exit with the
# server started as `pid` (if any), and `petrel`, a release build of this checkout.
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
pid=""
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
(cd "$root" && cargo build --release --locked -q -p petrel)
petrel="$root/target/release/petrel"
