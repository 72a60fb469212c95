"""The embedded API: Log, Group, Queue, in this process and across a kill -9."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import petrel


def test_append_get_iterate_and_lookups(tmp_path):
    with petrel.Log(tmp_path / "log", key_index=True) as log:
        assert log.append(b"first") == 0
        assert log.append(b"second", key=b"k") == 1
        assert log.append_batch([b"a", b"b", b"c"]) == [2, 3, 4]
        record = log.get(1)
        assert (record.offset, record.payload, record.key) == (1, b"second", b"k")
        assert record.timestamp > 0
        assert log.get(5) is None
        found = log.get_many([4, 9, 0, 4])
        assert [r and (r.offset, r.payload) for r in found] == [(4, b"c"), None, (0, b"first"), (4, b"c")]
        assert [r.payload for r in log] == [b"first", b"second", b"a", b"b", b"c"]
        assert [r.offset for r in log.reader(3)] == [3, 4]
        assert log.get_by_key(b"k").offset == 1
        assert log.get_by_time(record.timestamp).offset <= 1
        assert (log.first_offset, log.next_offset) == (0, 5)
    with pytest.raises(petrel.ClosedError):
        log.append(b"after close")


def test_records_survive_a_reopen_and_a_second_opener_is_refused(tmp_path):
    path = tmp_path / "log"
    log = petrel.Log(path, durability="always")
    log.append(b"kept")
    with pytest.raises(petrel.LockedError):
        petrel.Log(path)
    log.close()
    with petrel.Log(path) as again:
        assert again.get(0).payload == b"kept"


def test_bad_durability_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="durability"):
        petrel.Log(tmp_path / "log", durability="sometimes")


def test_a_corrupt_record_before_valid_ones_is_reported_not_skipped(tmp_path):
    path = tmp_path / "log"
    with petrel.Log(path) as log:
        for i in range(100):
            log.append(b"record-%03d" % i)
    segment = sorted(path.glob("*.log"))[0]
    data = bytearray(segment.read_bytes())
    at = data.index(b"record-010")
    data[at] ^= 0xFF  # one flipped byte, its frame's checksum no longer matches
    segment.write_bytes(bytes(data))
    with pytest.raises(petrel.CorruptLogError, match="checksum|CRC|corrupt"):
        petrel.Log(path)


def test_a_group_delivers_at_least_once_and_remembers_its_position(tmp_path):
    path = tmp_path / "log"
    with petrel.Log(path, durability="always") as log:
        log.append_batch([b"one", b"two", b"three"])
        group = log.group("workers")
        group.seek("oldest")
        first = group.poll(2, timeout=1)
        assert [r.payload for r in first] == [b"one", b"two"]
        group.ack(first[0].offset)
        group.nack(first[1].offset)
        again = group.poll(1, timeout=1)
        assert again[0].payload == b"two", "a returned record comes first"
        group.ack(again[0].offset)
        assert group.committed == 2
        assert group.poll(5, timeout=0) and group.lag == 1
        group.close()
    with petrel.Log(path) as log:
        group = log.group("workers")
        assert [r.payload for r in group.poll(5, timeout=0)] == [b"three"], "unacknowledged comes again"
        assert group.poll(5, timeout=0.05) == []
        # A key the log cannot hold is too large, and says so.
        with pytest.raises(petrel.TooLargeError):
            log.append(b"x", key=b"k" * 70_000)


def test_poll_waits_for_an_append_from_another_thread(tmp_path):
    with petrel.Log(tmp_path / "log") as log:
        group = log.group("g")
        threading.Timer(0.2, lambda: log.append(b"late")).start()
        started = time.monotonic()
        records = group.poll(1, timeout=5)
        assert [r.payload for r in records] == [b"late"]
        assert time.monotonic() - started < 4


def test_queue_put_get_in_order_across_threads(tmp_path):
    with petrel.Queue(tmp_path / "q") as q:
        producers = [threading.Thread(target=lambda p=p: [q.put(f"{p}-{i}".encode()) for i in range(500)]) for p in range(4)]
        for t in producers:
            t.start()
        got = []
        while len(got) < 2000:
            item = q.get(timeout=5)
            assert item is not None
            got.append(item.decode())
        for t in producers:
            t.join()
        assert q.get(timeout=0) is None and q.qsize() == 0 and q.empty()
        for p in range(4):
            mine = [g for g in got if g.startswith(f"{p}-")]
            assert mine == [f"{p}-{i}" for i in range(500)]


def test_any_number_is_a_timeout(tmp_path):
    # Infinity and numbers too large for a deadline wait for ever (here: for the item there);
    # NaN and negatives do not wait. None of them is an error.
    with petrel.Queue(tmp_path / "q") as q:
        q.put_many([b"a", b"b", b"c"])
        assert q.get(timeout=float("inf")) == b"a"
        assert q.get(timeout=1e20) == b"b"
        assert q.get(timeout=1e19) == b"c"
        started = time.monotonic()
        assert q.get(timeout=float("nan")) is None
        assert q.get(timeout=-5) is None
        assert time.monotonic() - started < 1


def test_queue_without_auto_ack_gives_back_what_was_not_done(tmp_path):
    path = tmp_path / "q"
    with petrel.Queue(path, durability="always", auto_ack=False) as q:
        with pytest.raises(ValueError):
            q.task_done()  # nothing got yet
        q.put_many([b"a", b"b"])
        assert q.get(timeout=0) == b"a"
        q.task_done()
        assert q.get(timeout=0) == b"b"  # not done
        assert q.qsize() == 0
    with petrel.Queue(path) as q:
        assert q.qsize() == 1
        assert q.get(timeout=0) == b"b"


def test_task_done_finishes_the_callers_own_item(tmp_path):
    path = tmp_path / "q"
    with petrel.Queue(path, durability="always", auto_ack=False) as q:
        q.put_many([b"a", b"b"])
        got = {}
        first = threading.Thread(target=lambda: got.setdefault("first", q.get(timeout=5)))
        first.start()
        first.join()
        second_done = threading.Event()

        def second():
            got["second"] = q.get(timeout=5)
            q.task_done()  # its own item, not the first thread's
            second_done.set()

        threading.Thread(target=second).start()
        assert second_done.wait(10)
        assert (got["first"], got["second"]) == (b"a", b"b")
    with petrel.Queue(path) as q:
        assert q.get(timeout=0) == b"a", "the first thread's item was not done: it comes back"
        assert q.get(timeout=0) is None


def test_a_waiting_get_ends_at_close_and_a_waiting_poll_at_an_append(tmp_path):
    """A thread waiting in `get` (or a group's `poll`) waits without the queue's lock: another
    thread's `qsize` and `close` go meanwhile and end the wait; an append wakes a waiting poll
    at once. (The lock was held through each 100 ms slice of the wait: this passed then too,
    a little slower.)"""
    with petrel.Queue(tmp_path / "q") as q:
        errors = []

        def getter():
            try:
                q.get()
            except petrel.ClosedError as e:
                errors.append(e)

        waiting = threading.Thread(target=getter)
        waiting.start()
        time.sleep(0.2)
        started = time.monotonic()
        assert q.qsize() == 0
        q.close()
        assert time.monotonic() - started < 0.5
        waiting.join(5)
        assert not waiting.is_alive() and len(errors) == 1
    with petrel.Log(tmp_path / "log") as log:
        group = log.group("g")
        polled = []
        waiting = threading.Thread(target=lambda: polled.extend(group.poll(1, timeout=5)))
        waiting.start()
        time.sleep(0.2)
        started = time.monotonic()
        log.append(b"x")
        waiting.join(5)
        assert [r.payload for r in polled] == [b"x"]
        group.ack(polled[0].offset)
        assert time.monotonic() - started < 0.5


def test_task_done_finishes_an_item_handed_over_from_another_thread(tmp_path):
    """An item got on one thread and finished on another (`asyncio.to_thread(q.get)`, a reader
    handing work out) is finished: the oldest of any thread's, when the caller got none."""
    path = tmp_path / "q"
    with petrel.Queue(path, durability="always", auto_ack=False) as q:
        q.put(b"a")
        got = []
        reader = threading.Thread(target=lambda: got.append(q.get(timeout=5)))
        reader.start()
        reader.join()
        assert got == [b"a"]
        q.task_done()  # on this thread, which got nothing itself
        with pytest.raises(ValueError):
            q.task_done()
    with petrel.Queue(path) as q:
        assert q.get(timeout=0) is None, "done: it does not come back"


def test_a_negative_position_is_an_overflow_error(tmp_path):
    with petrel.Log(tmp_path / "log") as log:
        log.append(b"x")
        group = log.group("g")
        with pytest.raises(OverflowError):
            group.seek(-1)


WRITER = """
import sys, petrel
log = petrel.Log(sys.argv[1], durability="always")
i = 0
while True:
    offset = log.append(b"record-%d" % i)
    print(offset, flush=True)
    i += 1
"""


def test_kill_9_while_appending_with_durability_always_loses_nothing_acknowledged(tmp_path):
    path = tmp_path / "log"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    acknowledged = []
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline or len(acknowledged) < 50:
        line = writer.stdout.readline()
        if not line:
            break
        acknowledged.append(int(line))
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    assert len(acknowledged) >= 50
    with petrel.Log(path) as log:
        for offset in acknowledged:
            record = log.get(offset)
            assert record is not None and record.payload == b"record-%d" % offset
        assert log.next_offset >= acknowledged[-1] + 1


def test_python_m_petrel(tmp_path):
    with petrel.Log(tmp_path / "log") as log:
        log.append(b"hello")
    out = subprocess.run([sys.executable, "-m", "petrel", "dump", str(tmp_path / "log")], capture_output=True, text=True)
    assert out.returncode == 0 and "b'hello'" in out.stdout
    out = subprocess.run([sys.executable, "-m", "petrel", "--version"], capture_output=True, text=True)
    assert out.stdout.startswith("petrel ")


def test_closing_a_log_lets_other_threads_run_while_it_syncs(tmp_path):
    """The last close of a log syncs what its durability left unsynced (here everything, 96 MB),
    without the GIL: another thread goes on meanwhile."""
    log = petrel.Log(str(tmp_path / "log"), durability="interval:600000")
    chunk = [b"x" * 4096] * 1024
    for _ in range(24):
        log.append_batch(chunk)
    count = [0]
    stop = threading.Event()

    def counting():
        while not stop.is_set():
            count[0] += 1

    counter = threading.Thread(target=counting)
    counter.start()
    time.sleep(0.05)
    before, started = count[0], time.monotonic()
    log.close()
    took, during = time.monotonic() - started, count[0] - before
    stop.set()
    counter.join()
    if took < 0.05:
        pytest.skip(f"the sync took {took * 1000:.0f} ms: too short to tell")
    # Holding the GIL, the counter gets at most a switch interval or two (5 ms each).
    assert during > 200_000, f"{during} counts in {took * 1000:.0f} ms of closing"


def test_a_drained_queue_gives_its_disk_back(tmp_path):
    # What every item of is done goes: at each new segment, and the last one once the queue
    # is found empty. It kept everything it ever held.
    path = tmp_path / "q"

    def on_disk():
        return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())

    with petrel.Queue(path) as q:
        item = b"x" * 10_000
        for _ in range(3):
            q.put_many([item] * 1000)
            for _ in range(1000):
                assert q.get(timeout=5) == item
        assert on_disk() < 64 << 20
        assert q.get(timeout=0) is None
        assert on_disk() < 4 << 20, on_disk()
