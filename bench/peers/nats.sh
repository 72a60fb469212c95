# Sourced by the peer scripts: installs nats-server v2.10.22 and natscli v0.3.0 if missing (the
# natscli module's version list is refused, so it is downloaded by exact version and built) and
# sets $gobin to where they are.
gobin="$(go env GOPATH)/bin"
[ -x "$gobin/nats-server" ] || go install github.com/nats-io/nats-server/v2@v2.10.22
if [ ! -x "$gobin/nats" ]; then
  dir="$(go mod download -json github.com/nats-io/natscli@v0.3.0 | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
  (cd "$dir" && go build -o "$gobin/nats" ./nats)
fi
