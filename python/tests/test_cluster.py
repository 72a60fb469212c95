"""`petrel.Cluster` against three real `petrel serve` processes on loopback: spreading, routing,
reliable takes acknowledged on their own server, a server killed mid-load and restarted, topics
and functions on every server, and close."""

import signal
import threading
import time

import pytest

import petrel
from conftest import restartable_addr, start, stop


class Servers:
    """Three servers, each in a data directory of its own; one can be killed and restarted on its
    address."""

    def __init__(self, tmp_path, n=3):
        self.dirs = [tmp_path / f"server{i}" for i in range(n)]
        self.processes, self.addresses = [], []
        for d in self.dirs:
            process, address = start(d, restartable_addr())
            self.processes.append(process)
            self.addresses.append(address)

    def kill(self, i):
        self.processes[i].send_signal(signal.SIGKILL)
        self.processes[i].wait(timeout=10)

    def restart(self, i):
        self.processes[i], address = start(self.dirs[i], self.addresses[i])
        assert address == self.addresses[i]

    def stop_all(self):
        for p in self.processes:
            if p.poll() is None:
                stop(p)


@pytest.fixture
def servers(tmp_path):
    s = Servers(tmp_path)
    try:
        yield s
    finally:
        s.stop_all()


def take_all(cluster, queue, expected, timeout=10):
    """Takes tentatively and acknowledges until `expected` messages came; returns their payloads."""
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < expected and time.monotonic() < deadline:
        batch = cluster.poll_many(queue, max=50, timeout=0.5, visibility=30)
        if batch:
            assert cluster.ack(queue, [m.handle for m in batch]) == len(batch)
            got += [m.payload for m in batch]
    return got


def test_offers_spread_routes_stay_and_acks_go_to_their_server(servers):
    with petrel.Cluster(servers.addresses) as c:
        assert c.servers == servers.addresses
        c.create_queue("jobs", durable=True)
        assert c.list_queues() == ["jobs"]
        spread = {c.offer("jobs", b"spread-%d" % i)[0] for i in range(30)}
        assert spread == set(servers.addresses), "round robin reaches every server"
        routed = {c.offer("jobs", b"routed-%d" % i, route="customer-7")[0] for i in range(10)}
        assert len(routed) == 1, "one route stays on one server"
        where, first = c.offer_many("jobs", [b"batch-a", b"batch-b"], route=b"customer-7")
        assert {where} == routed and first > 0

        m = c.take("jobs", timeout=2)
        assert isinstance(m.handle, petrel.ClusterHandle) and m.handle.server in servers.addresses
        assert c.abort("jobs", [m.handle]) == 1, "back on its server"
        got = take_all(c, "jobs", 42)
        assert sorted(got) == sorted([b"spread-%d" % i for i in range(30)] + [b"routed-%d" % i for i in range(10)]
                                     + [b"batch-a", b"batch-b"])
        routed_order = [p for p in got if p.startswith(b"routed-")]
        assert routed_order == [b"routed-%d" % i for i in range(10)], "in order on its server"
        assert c.poll("jobs") is None
        assert c.poll("jobs", timeout=0.3) is None, "a waiting poll on every server, then nothing"

        with pytest.raises(petrel.ServerError, match="QUEUE_NOT_FOUND"):
            c.poll("nowhere")
        with pytest.raises(ValueError):
            petrel.Cluster([])
        assert c.stats()["servers"][0]["up"] is True
        assert c.stats()["servers"][0]["unserved"] == {}


def test_a_killed_server_is_routed_around_and_its_messages_wait_for_it(servers):
    c = petrel.Cluster(",".join(servers.addresses), request_timeout=0.5)
    c.create_queue("work", durable=True)
    offered, stop_offering, errors = [], threading.Event(), []

    def produce():
        i = 0
        while not stop_offering.is_set():
            try:
                c.offer("work", b"m-%d" % i, key="m-%d" % i)
                offered.append(b"m-%d" % i)
            except petrel.PetrelError as e:  # pragma: no cover - the assertion below says it
                errors.append(e)
            i += 1

    producer = threading.Thread(target=produce)
    producer.start()
    time.sleep(0.3)
    servers.kill(1)
    killed_at = len(offered)
    time.sleep(0.5)
    stop_offering.set()
    producer.join()
    assert errors == [], "no offer failed at the caller"
    assert len(offered) > killed_at, "offers went on while a server was dead"
    assert not c.stats()["servers"][1]["up"]

    servers.restart(1)
    deadline = time.monotonic() + 10
    while not c.stats()["servers"][1]["up"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.stats()["servers"][1]["up"], "reconnected in the background"
    got = take_all(c, "work", len(set(offered)))
    assert set(got) == set(offered), "every acknowledged offer, the dead server's after its restart"
    c.close()
    with pytest.raises(petrel.ClosedError):
        c.offer("work", b"after close")


def test_topics_and_functions_on_every_server(servers):
    with petrel.Cluster(servers.addresses) as c:
        c.create_topic("news")
        assert c.list_topics() == ["news"]
        with c.subscribe("news") as sub:
            for i in range(6):
                c.publish("news", b"n-%d" % i)  # to each server in turn
            got = sorted(sub.get(timeout=5).payload for _ in range(6))
            assert got == sorted(b"n-%d" % i for i in range(6))
        assert not sub.active

        # A consumer group on every server's log: acknowledged on its own server, so a new
        # subscriber of the group gets only what came after.
        c.create_topic("events", durable=True)
        for i in range(6):
            c.publish("events", b"e-%d" % i)
        with c.subscribe_group("events", "g", "oldest") as group:
            got = [group.get(timeout=5) for _ in range(6)]
            assert sorted(m.payload for m in got) == [b"e-%d" % i for i in range(6)]
            assert {m.handle.server for m in got} == set(servers.addresses)
            assert group.ack([m.handle for m in got]) == 6
        for i in range(6, 9):
            c.publish("events", b"e-%d" % i)
        with c.subscribe_group("events", "g") as group:
            again = sorted(group.get(timeout=5).payload for _ in range(3))
            assert again == [b"e-6", b"e-7", b"e-8"]
            assert group.get(timeout=0.3) is None

        c.serve("upper", lambda m: m.payload.upper())
        assert [c.call("upper", b"x%d" % i, timeout=5).payload for i in range(6)] == [b"X%d" % i for i in range(6)]
        with pytest.raises(petrel.ServerError, match="FUNCTION_NOT_FOUND"):
            c.call("lower", b"x", timeout=1)
        c.unserve("upper")
        with pytest.raises(petrel.ServerError, match="FUNCTION_NOT_FOUND"):
            c.call("upper", b"x", timeout=1)


def test_a_group_resumes_where_it_stands_on_a_restarted_server(servers):
    with petrel.Cluster(servers.addresses) as c:
        c.create_topic("audit", durable=True)
        with c.subscribe_group("audit", "g", "oldest") as group:
            for i in range(6):
                c.publish("audit", b"a-%d" % i)
            got = [group.get(timeout=5) for _ in range(6)]
            assert sorted(m.payload for m in got) == [b"a-%d" % i for i in range(6)]
            assert group.ack([m.handle for m in got]) == 6

            servers.kill(1)
            servers.restart(1)
            deadline = time.monotonic() + 10
            while not c.stats()["servers"][1]["up"] and time.monotonic() < deadline:
                time.sleep(0.05)
            for i in range(6, 12):
                c.publish("audit", b"a-%d" % i)
            again = sorted(group.get(timeout=5).payload for _ in range(6))
            assert again == sorted(b"a-%d" % i for i in range(6, 12)), "what was acknowledged did not come again"
            assert group.get(timeout=0.5) is None


def test_a_signal_interrupts_a_cluster_call(servers):
    """A signal's handler that raises ends a cluster request that waits (Ctrl-C did nothing to
    one: its wait never looked at Python's signals)."""

    class Alarm(Exception):
        pass

    def on_alarm(signum, frame):
        raise Alarm()

    with petrel.Cluster(servers.addresses) as c, petrel.Client(servers.addresses[0]) as worker:
        release = threading.Event()

        def slow(message):
            release.wait(30)
            return message.payload

        worker.serve("slow", slow)
        previous = signal.signal(signal.SIGALRM, on_alarm)
        started = time.monotonic()
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(Alarm):
                c.call("slow", b"x", timeout=60)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            release.set()
        assert time.monotonic() - started < 10


def test_a_cluster_subscriber_that_fell_behind_is_told_and_reads_on(tmp_path):
    """What one server says of a cluster subscription's part (it fell behind: SLOW_CONSUMER) is
    raised, as the Rust subscription yields it, and the next get reads on. (It was swallowed: a
    subscriber never learned it had missed messages.)"""
    one = Servers(tmp_path, n=1)
    try:
        with petrel.Cluster(one.addresses) as c, petrel.Client(one.addresses[0]) as publisher:
            c.create_topic("ticks")
            with c.subscribe("ticks", buffer=16) as sub:
                for i in range(5000):
                    publisher.publish("ticks", b"t%d" % i)
                # It read nothing meanwhile: a prefix, then the notice.
                with pytest.raises(petrel.ServerError) as told:
                    for _ in range(5001):
                        assert sub.get(timeout=10) is not None
                assert told.value.status == "SLOW_CONSUMER", told.value
                # Followed again: what is published from now on arrives.
                deadline = time.monotonic() + 10
                while True:
                    publisher.publish("ticks", b"after")
                    m = sub.get(timeout=0.2)
                    if m is not None and m.payload == b"after":
                        break
                    assert time.monotonic() < deadline, "not followed again"
    finally:
        one.stop_all()
