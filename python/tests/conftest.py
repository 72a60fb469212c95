"""A real `petrel serve` for the client tests: the binary from $PETREL_BIN (scripts/test.sh sets
it) or target/debug/petrel, on loopback ports it picks, in a temporary data directory."""

import os
import pathlib
import subprocess
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def server(tmp_path):
    binary = os.environ.get("PETREL_BIN", str(ROOT / "target" / "debug" / "petrel"))
    out = tmp_path / "out"
    args = [binary, "serve", "--data", str(tmp_path / "data"), "--native-addr", "127.0.0.1:0",
            "--memcache-addr", "off", "--http-addr", "off"]
    with open(out, "w") as stdout:
        process = subprocess.Popen(args, stdout=stdout, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            lines = [l.split() for l in out.read_text().splitlines()]
            native = [l[1] for l in lines if l and l[0] == "native"]
            if native:
                yield native[0]
                break
            assert process.poll() is None, "petrel serve exited"
            time.sleep(0.05)
        else:
            raise AssertionError("petrel serve did not print its native address")
    finally:
        process.terminate()
        process.wait(timeout=10)
