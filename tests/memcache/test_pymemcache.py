"""Petrel's memcache port driven by an off-the-shelf client, the PyPI package pymemcache, used
as it comes (no subclass): Petrel echoes the key as sent in VALUE lines, which stock pymemcache
checks."""

import threading
import time

import pytest
from pymemcache.exceptions import MemcacheClientError


def wait_until(what, done, timeout=10.0):
    """Waits until `done()` holds, checking every few milliseconds; fails saying `what`."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.005)


def test_set_then_get_is_fifo_and_an_empty_queue_gives_none(server):
    c = server.client()
    for i in range(5):
        assert c.set("jobs", b"job %d" % i) is True
    assert [c.get("jobs") for _ in range(6)] == [b"job %d" % i for i in range(5)] + [None]


def test_flags_reach_the_reader(server):
    c = server.client()
    c.set("flagged", b"x", flags=42)
    c.set("flagged", b"y")
    raw = c.raw_command(b"get flagged", b"END\r\n")
    assert raw.startswith(b"VALUE flagged 42 1\r\nx\r\n"), raw
    value, cas = c.gets("flagged")  # gets takes an item too, and gives its id as the cas number
    assert value == b"y" and int(cas) > 0
    assert c.get("flagged") is None


def test_a_blocking_get_waits_for_its_timeout_or_an_item(server):
    c = server.client()
    start = time.monotonic()
    assert c.get("slow/t=300") is None
    waited = time.monotonic() - start
    assert 0.25 <= waited < 3, waited

    def later():
        # Once the get is parked on the queue (counted as a waiter), an item arrives.
        other = server.client()
        wait_until("the get to wait", lambda: other.stats()[b"queue_slow_waiters"] == 1)
        other.set("slow", b"arrived")

    threading.Thread(target=later).start()
    start = time.monotonic()
    assert c.get("slow/t=5000") == b"arrived"
    assert time.monotonic() - start < 4


def test_an_open_item_goes_back_to_the_head_when_its_reader_disconnects(server):
    producer = server.client()
    producer.set("work", b"first")
    producer.set("work", b"second")
    reader = server.client()
    assert reader.get("work/open") == b"first"
    other = server.client()
    assert other.get("work/peek") == b"second", "an open item is invisible to others"
    reader.close()
    deadline = time.monotonic() + 5
    while other.get("work/peek") != b"first":
        assert time.monotonic() < deadline, "the open item never came back"
        time.sleep(0.02)
    assert other.get("work") == b"first"
    assert other.get("work") == b"second"


def test_open_close_confirms_and_open_abort_returns(server):
    c = server.client()
    for item in (b"a", b"b", b"c"):
        c.set("tx", item)
    assert c.get("tx/open") == b"a"
    assert c.get("tx/close/open") == b"b", "close confirms a, open takes b"
    assert c.get("tx/abort") is None, "abort answers END"
    assert c.get("tx/open") == b"b", "b came back to the head"
    assert c.get("tx/close") is None
    assert c.get("tx/peek") == b"c"
    assert c.get("tx/peek") == b"c", "peek leaves the item"
    stats = c.stats()
    assert stats[b"queue_tx_items"] == 1
    assert stats[b"queue_tx_canceled_transactions"] == 1


def test_a_second_open_without_close_is_an_error_and_returns_the_item(server):
    c = server.client()
    c.set("twice", b"only")
    assert c.get("twice/open") == b"only"
    with pytest.raises(Exception):
        c.get("twice/open")
    assert server.client().get("twice/t=2000") == b"only"


def test_expired_items_are_not_served_and_go_to_the_dead_letter_queue(make_server):
    s = make_server(config='[queues.expiring]\ndead_letter = "late"\n')
    c = s.client()
    c.set("expiring", b"short", expire=1)
    c.set("expiring", b"long", expire=60)
    c.set("expiring", b"gone", expire=-1)
    # The broker's tick moves an expired item at the head to the dead-letter queue ("short",
    # after its second); "gone", behind an unexpired item, goes when a get reaches it (Kestrel's way).
    # The tick counts an item expired before it has made the dead-letter queue and moved the item
    # there (a making can take milliseconds on a busy disk): wait for both.
    wait_until("the head item to expire", lambda: c.stats()[b"queue_expiring_expired_items"] == 1)
    wait_until("the head item to reach the dead letters", lambda: c.stats().get(b"queue_late_items") == 1)
    assert c.get("expiring") == b"long"
    assert c.get("expiring") is None
    assert sorted([c.get("late"), c.get("late")]) == [b"gone", b"short"]
    assert c.stats()[b"queue_expiring_expired_items"] == 2


def test_fanout_children_get_copies_after_they_exist(server):
    c = server.client()
    c.set("orders", b"before")
    assert c.get("orders+audit") is None  # creates the child
    c.set("orders", b"o1")
    c.set("orders", b"o2")
    assert [c.get("orders+audit"), c.get("orders+audit")] == [b"o1", b"o2"]
    assert [c.get("orders"), c.get("orders"), c.get("orders")] == [b"before", b"o1", b"o2"]
    assert c.stats()[b"queue_orders_children"] == b"orders+audit"
    c.delete("orders+audit")
    c.set("orders", b"o3")
    assert b"queue_orders+audit_items" not in c.stats()


def test_delete_and_flush(server):
    c = server.client()
    for q in ("keep", "drop"):
        c.set(q, b"1")
        c.set(q, b"2")
    assert c.raw_command(b"flush keep", b"END\r\n") == b"", "flush answers END"
    assert c.get("keep") is None
    assert c.delete("drop") is True
    assert b"queue_drop_items" not in c.stats()
    c.set("keep", b"3")
    c.set("drop", b"4")
    assert c.flush_all() is True  # pymemcache sends "flush_all 0" and expects OK
    assert c.get("keep") is None and c.get("drop") is None
    assert c.raw_command(b"flush_all", b"\r\n") == b"Flushed all queues."


def test_stats_name_what_kestrel_names(server):
    c = server.client()
    c.set("s", b"abc")
    c.set("s", b"de")
    assert c.get("s") == b"abc"
    stats = c.stats()
    for name in ("uptime", "time", "version", "curr_items", "total_items", "bytes", "reserved_memory_ratio",
                 "curr_connections", "total_connections", "cmd_get", "cmd_set", "cmd_peek", "get_hits",
                 "get_misses", "bytes_read", "bytes_written", "queue_creates", "queue_deletes", "queue_expires"):
        assert name.encode() in stats, name
    for name in ("items", "bytes", "total_items", "logsize", "expired_items", "mem_items", "mem_bytes", "age",
                 "discarded", "waiters", "open_transactions", "transactions", "canceled_transactions",
                 "total_flushes", "journal_rewrites", "journal_rotations"):
        assert b"queue_s_" + name.encode() in stats, name
    assert stats[b"queue_s_items"] == 1
    assert stats[b"queue_s_bytes"] == 2
    assert stats[b"queue_s_total_items"] == 2
    assert stats[b"queue_s_open_transactions"] == 0
    assert stats[b"cmd_set"] >= 2 and stats[b"get_hits"] >= 1
    dump = c.raw_command(b"dump_stats s", b"END\r\n")
    assert dump.startswith(b"queue 's' {\r\n  items=1\r\n"), dump


@pytest.mark.parametrize("size", [0, 1, 2, 255, 4096, 65536, 1 << 20])
def test_binary_payloads_from_0_bytes_to_1_mib(server, size):
    c = server.client()
    payload = bytes((i * 131 + size) % 256 for i in range(size))
    if size:
        payload = b"\r\nEND\r\n" + payload[7:]  # protocol bytes inside the data are data
    assert c.set("bin", payload) is True
    assert c.get("bin") == payload


def test_100_concurrent_clients_lose_nothing_and_duplicate_nothing(server):
    per_client, clients = 200, 100
    got, errors = [], []
    lock = threading.Lock()

    def produce(n):
        try:
            c = server.client()
            for i in range(per_client):
                assert c.set("many", b"%d-%d" % (n, i)) is True
            c.close()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def consume():
        try:
            c = server.client()
            mine = []
            while True:
                item = c.get("many/t=1000")
                if item is None:
                    break
                mine.append(item)
            with lock:
                got.extend(mine)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(n,)) for n in range(clients)]
    threads += [threading.Thread(target=consume) for _ in range(clients // 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(got) == per_client * clients
    assert len(set(got)) == len(got), "nothing delivered twice"
    # Each producer's items arrive in its order within any one consumer: FIFO per queue.
    assert server.client().stats()[b"queue_many_items"] == 0


def test_storage_verbs_other_than_set_are_refused_and_the_connection_goes_on(server):
    c = server.client()
    with pytest.raises(MemcacheClientError):
        c.add("q", b"x")
    with pytest.raises(MemcacheClientError):
        c.append("q", b"x")
    assert c.set("q", b"still fine") is True
    assert c.get("q") == b"still fine"


def test_noreply_requests_read_no_error_either_as_pymemcache_sends_them_by_default(make_server):
    # pymemcache sends `set … noreply` unless told otherwise. An error line the server sent
    # anyway would be read as the next request's answer: that get's item would be taken and
    # lost with the connection pymemcache then closes.
    s = make_server(config="max_message_bytes = 1024\n")
    c = s.client(default_noreply=True)
    assert c.set("q", b"x" * 2000) is True  # too large: refused, silently
    assert c.set("q", b"kept") is True
    assert c.get("q") == b"kept"
    assert c.get("q") is None
    # The connection stayed in step: the refused block was skipped, silently.
    c.set("q", b"after")
    assert c.get("q") == b"after"

