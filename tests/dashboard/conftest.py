"""Starts the real `petrel serve` for the dashboard tests, with all three listeners on free loopback
ports, and a headless Chromium driven by selenium."""

import os
import queue
import shutil
import subprocess
import threading
import time

import pytest

PETREL = os.environ.get("PETREL_BIN", os.path.join(os.path.dirname(__file__), "../../target/debug/petrel"))
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
LISTENERS = ("native", "memcache", "http")


class Server:
    def __init__(self, data):
        args = [PETREL, "serve", "--data", str(data), "--native-addr", "127.0.0.1:0",
                "--memcache-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.listeners = self._read_listeners(timeout=10)
        self.http = "http://" + self.listeners["http"]
        host, port = self.listeners["memcache"].rsplit(":", 1)
        self.memcache = (host, int(port))

    def _read_listeners(self, timeout):
        # readline() blocks, so a thread reads and the deadline stays ours.
        lines = queue.Queue()

        def pump():
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        found = {}
        deadline = time.monotonic() + timeout
        while not all(k in found for k in LISTENERS):
            left = deadline - time.monotonic()
            try:
                line = lines.get(timeout=max(left, 0.01))
            except queue.Empty:
                self.stop()
                pytest.fail(f"petrel serve printed no {LISTENERS} listener lines within {timeout} s (got {found})")
            if line is None:
                self.stop()
                pytest.fail(f"petrel serve exited before listening (got {found})")
            parts = line.split()
            if len(parts) == 2 and parts[0] in LISTENERS:
                found[parts[0]] = parts[1]
        return found

    def stop(self):
        # Only this process: SIGTERM for a clean shutdown, SIGKILL if it does not come.
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def petrel(tmp_path):
    s = Server(tmp_path / "data")
    yield s
    s.stop()


@pytest.fixture
def browser():
    """Headless Chromium keeping the page's console. Missing pieces fail the test, not skip it:
    scripts/test.sh installs them, so their absence is a broken setup to notice."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as e:
        pytest.fail(f"selenium is not installed in this Python ({e}); see tests/requirements.txt")
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not (os.path.exists(path) or shutil.which(os.path.basename(path))):
            pytest.fail(f"{path} is missing: install Debian's {package} package (scripts/test.sh does)")
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()
