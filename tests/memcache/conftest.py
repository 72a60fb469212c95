"""Starts the real `petrel serve` for the memcache tests: one server per test, on free loopback
ports, data in the test's temporary directory."""

import os
import signal
import subprocess

import pytest
from pymemcache.client.base import Client

PETREL = os.environ.get("PETREL_BIN", os.path.join(os.path.dirname(__file__), "../../target/debug/petrel"))


class Server:
    def __init__(self, data, extra_args=(), config=None):
        self.data = data
        self.args = [PETREL, "serve", "--data", str(data), "--native-addr", "127.0.0.1:0", "--memcache-addr", "127.0.0.1:0", "--http-addr", "off"]
        if config is not None:
            path = data.parent / (data.name + ".toml")
            path.write_text(config)
            self.args += ["--config", str(path)]
        self.args += list(extra_args)
        self.start()

    def start(self):
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        listeners = {}
        while "memcache" not in listeners:
            line = self.proc.stdout.readline()
            assert line, "petrel serve exited before listening"
            kind, addr = line.split()
            listeners[kind] = addr
        host, port = listeners["memcache"].rsplit(":", 1)
        self.memcache = (host, int(port))
        self.native = listeners["native"]

    def client(self, **kw):
        kw.setdefault("default_noreply", False)
        kw.setdefault("connect_timeout", 5)
        kw.setdefault("timeout", 10)
        return Client(self.memcache, **kw)

    def kill9(self):
        self.proc.kill()
        self.proc.wait()

    def terminate(self):
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "data")
    yield s
    s.stop()


@pytest.fixture
def make_server(tmp_path):
    started = []

    def make(**kw):
        s = Server(tmp_path / "data", **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
