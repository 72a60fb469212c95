"""A real `petrel serve` for the client tests: the binary from $PETREL_BIN (scripts/test.sh sets
it) or target/debug/petrel, on loopback ports it picks, in a temporary data directory.
`secure_server` turns on authentication and TLS (a dev CA, an admin, an ordinary user and a
client certificate's user)."""

import os
import pathlib
import subprocess
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("PETREL_BIN", str(ROOT / "target" / "debug" / "petrel"))

# The users `secure_server` knows, with their passwords ("client" logs in by certificate).
USERS = {"max": ("S3cret-admin", True), "tom": ("S3cret-tom", False), "client": ("unused-Pw-1", False)}


def restartable_addr():
    """A free loopback address to start a server at and again after it stops: below the range the
    kernel picks outgoing ports from, where, while the server is down, another socket could take
    the port, or a client reconnecting to it could be given it as its own and connect to itself."""
    import random
    import socket
    try:
        first = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768
    if first - 10000 < 100:
        return "127.0.0.1:0"
    start_at = random.randrange(first - 10000)
    for i in range(first - 10000):
        port = 10000 + (start_at + i) % (first - 10000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return f"127.0.0.1:{port}"
    raise RuntimeError(f"no free port between 10000 and {first}")


def start(data, native_addr="127.0.0.1:0", *extra):
    """Starts `petrel serve` on `data`; returns (process, native address) once it listens."""
    data.mkdir(parents=True, exist_ok=True)
    out = data / "out"
    args = [BINARY, "serve", "--data", str(data / "data"), "--native-addr", native_addr,
            "--memcache-addr", "off", "--http-addr", "off", *extra]
    with open(out, "w") as stdout:
        process = subprocess.Popen(args, stdout=stdout, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [l.split() for l in out.read_text().splitlines()]
        native = [l[1] for l in lines if l and l[0] == "native"]
        if native:
            return process, native[0]
        if process.poll() is not None:
            raise AssertionError("petrel serve exited")
        time.sleep(0.05)
    process.kill()
    raise AssertionError("petrel serve did not print its native address")


def stop(process):
    process.terminate()
    process.wait(timeout=10)


def serve(tmp_path, *extra):
    """Starts `petrel serve`; yields its native address once it listens, stops it after."""
    process, address = start(tmp_path, "127.0.0.1:0", *extra)
    try:
        yield address
    finally:
        stop(process)


@pytest.fixture
def server(tmp_path):
    yield from serve(tmp_path)


@pytest.fixture
def secure_server(tmp_path):
    """Yields (address, certificates directory) of a server that requires TLS and a login."""
    certs = tmp_path / "certs"
    subprocess.run([BINARY, "cert", "dev", str(certs)], check=True, capture_output=True)
    users = tmp_path / "users.toml"
    for name, (password, admin) in USERS.items():
        subprocess.run([BINARY, "user", "add", str(users), name, *(["--admin"] if admin else [])],
                       input=password + "\n", text=True, check=True, capture_output=True)
    config = tmp_path / "petrel.toml"
    config.write_text(
        "[security]\n"
        f'users_file = "{users}"\n'
        f'tls_cert = "{certs / "server.pem"}"\n'
        f'tls_key = "{certs / "server.key"}"\n'
        f'tls_client_ca = "{certs / "ca.pem"}"\n'
        "require_tls = true\n"
    )
    for address in serve(tmp_path, "--config", str(config)):
        yield address, certs
