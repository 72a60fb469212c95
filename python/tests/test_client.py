"""The client against a real `petrel serve`: blocking, from threads, and asyncio."""

import asyncio
import threading

import pytest

import petrel


def test_queue_offer_poll_and_reliable_reads(server):
    with petrel.Client(server) as c:
        c.create_queue("jobs", durable=True)
        assert c.offer("jobs", b"one") == 1
        assert c.offer_many("jobs", [b"two", b"three"]) == 2
        assert "jobs" in c.list_queues()
        message = c.poll("jobs", timeout=1)
        assert (message.id, message.payload, message.queue) == (1, b"one", "jobs")
        taken = c.take("jobs", visibility=30)
        assert taken.payload == b"two" and taken.handle != 0 and taken.deliveries == 1
        assert c.abort("jobs", [taken.handle]) == 1
        again = c.take("jobs", visibility=30)
        assert again.payload == b"two", "an aborted take is first again"
        assert again.deliveries == 2, "its second delivery"
        assert c.ack("jobs", [again.handle]) == 1
        assert [m.payload for m in c.poll_many("jobs", max=10)] == [b"three"]
        assert c.poll("jobs", timeout=0) is None


def test_a_client_reaches_the_server_over_its_unix_socket(tmp_path):
    from conftest import start, stop
    socket = tmp_path / "petrel.sock"
    process, address = start(tmp_path, "127.0.0.1:0", "--unix-socket", str(socket))
    try:
        with petrel.Client(f"unix:{socket}") as c:
            c.create_queue("local", durable=True)
            c.offer("local", b"over the socket")
        with petrel.Client(address) as c:
            assert c.poll("local", timeout=1).payload == b"over the socket"
        with petrel.Client(str(socket)) as c:
            assert c.list_queues() == ["local"]
    finally:
        stop(process)


def test_a_retried_offer_with_a_key_is_stored_once(server):
    with petrel.Client(server) as c:
        c.create_queue("orders", durable=True)
        first = c.offer("orders", b"order 7", key="order-7")
        assert c.offer("orders", b"order 7", key="order-7") == first, "the retry gets the original id"
        assert c.offer("orders", b"order 8", key="order-8") == first + 1
        taken = c.poll_many("orders", max=10)
        assert [m.payload for m in taken] == [b"order 7", b"order 8"], "stored once"
        assert (taken[0].idempotency_key, taken[0].priority) == ("order-7", 0)

    async def retry():
        async with petrel.AsyncClient(server) as a:
            return await a.offer("orders", b"order 8", key="order-8"), await a.offer("orders", b"new", key="order-9")

    assert asyncio.run(retry()) == (first + 1, first + 2)


def test_delays_priorities_and_a_redelivery_delay_from_python(server):
    import time

    with petrel.Client(server) as c:
        c.create_queue("retry", durable=True, priorities=3, redelivery_delay=0.6, dead_letter="retry.dead", max_deliveries=5)
        with pytest.raises(ValueError, match="no setting named"):
            c.create_queue("typo", redelivry_delay=1)
        start = time.time()
        c.offer("retry", b"later", delay=0.3)
        c.offer("retry", b"at", deliver_at=start + 0.1, priority=2)
        early = c.take("retry", timeout=0)
        if early is not None:  # only on a machine held up for 0.1 s, with "at" due already
            assert time.time() >= start + 0.1, "nothing due yet"
        first = early or c.take("retry", timeout=2)
        assert first.payload == b"at" and first.priority == 2
        assert abs(first.deliver_at / 1e9 - (start + 0.1)) < 1e-6, "it says when it was due"
        assert time.time() >= start + 0.1, "not before it was due"
        # The queue's 0.6 s redelivery delay puts it well after "later" (due at 0.3 s): were the
        # two due together, its higher priority would go first.
        assert c.abort("retry", [first.handle]) == 1
        second = c.take("retry", timeout=2)
        assert second.payload == b"later" and time.time() >= start + 0.3
        c.ack("retry", [second.handle])
        again = c.take("retry", timeout=2)
        assert again.payload == b"at" and again.deliveries == 2 and time.time() >= start + 0.7
        assert c.abort("retry", [again.handle], delay=0.05) == 1  # its own delay wins
        assert c.take("retry", timeout=2).deliveries == 3

    async def later():
        async with petrel.AsyncClient(server) as a:
            await a.create_queue("async.later", durable=False, redelivery_delay=0.05)
            await a.offer("async.later", b"x", delay=0.05)
            taken = await a.take("async.later", timeout=2)
            await a.abort("async.later", [taken.handle], delay=0.05)
            return (await a.take("async.later", timeout=2)).deliveries

    assert asyncio.run(later()) == 2


def test_errors_name_what_went_wrong(server):
    with petrel.Client(server) as c:
        with pytest.raises(petrel.ServerError, match="QUEUE_NOT_FOUND") as refused:
            c.offer("nowhere", b"x")
        assert refused.value.status == "QUEUE_NOT_FOUND", "the status, for code that handles one"
        c.create_queue("errors", durable=True)
        # Larger than the server's max_message_bytes (16 MiB).
        with pytest.raises(petrel.ServerError, match="^TOO_LARGE: ") as too_large:
            c.offer("errors", bytes(17 << 20))
        assert too_large.value.status == "TOO_LARGE"
        # Arguments the client cannot send are refused here, saying why.
        with pytest.raises(ValueError, match="no payloads"):
            c.offer_many("errors", [])
        with pytest.raises(ValueError, match="not both"):
            c.offer("errors", b"x", delay=5, deliver_at=1)
        for priority in (-1, 256):
            with pytest.raises(ValueError, match=f"priority {priority}: 0 to 255"):
                c.offer("errors", b"x", priority=priority)
        assert c.poll("errors") is None, "nothing refused was stored"

    async def asynchronously():
        async with petrel.AsyncClient(server) as a:
            with pytest.raises(ValueError, match="no payloads"):
                await a.offer_many("errors", [])
            with pytest.raises(petrel.ServerError) as refused:
                await a.poll("nowhere")
            return refused.value.status

    assert asyncio.run(asynchronously()) == "QUEUE_NOT_FOUND"
    with pytest.raises(petrel.ConnectionError):
        petrel.Client("127.0.0.1:1")


def test_a_poll_waits_for_an_offer_from_another_thread(server):
    with petrel.Client(server) as c:
        c.create_queue("later", durable=False)
        threading.Timer(0.2, lambda: c.offer("later", b"late")).start()
        assert c.poll("later", timeout=5).payload == b"late"


def test_threads_share_one_client(server):
    with petrel.Client(server) as c:
        c.create_queue("shared")
        threads = [threading.Thread(target=lambda t=t: [c.offer("shared", b"%d-%d" % (t, i)) for i in range(200)]) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = c.poll_many("shared", max=10_000)
        assert len(got) == 1600
        for t in range(8):
            mine = [m.payload for m in got if m.payload.startswith(b"%d-" % t)]
            assert mine == [b"%d-%d" % (t, i) for i in range(200)]


def test_asyncio_client_pipelines_offers_and_subscribes(server):
    async def main():
        async with petrel.AsyncClient(server) as c:
            await c.create_queue("async-jobs", durable=True)
            # 500 offers in flight together: each answered with the id its message got.
            payloads = [b"m%d" % i for i in range(500)]
            ids = await asyncio.gather(*(c.offer("async-jobs", p) for p in payloads))
            assert sorted(ids) == list(range(1, 501))
            id_of = dict(zip(payloads, ids))
            first = await c.poll("async-jobs", timeout=1)
            assert first.id == 1 and id_of[first.payload] == 1
            rest = await c.poll_many("async-jobs", max=1000)
            assert [m.id for m in rest] == list(range(2, 501))
            assert all(id_of[m.payload] == m.id for m in rest)
            # Waiting for a message that comes later.
            waiter = asyncio.ensure_future(c.poll("async-jobs", timeout=5))
            await asyncio.sleep(0.1)
            await c.offer("async-jobs", b"late")
            assert (await waiter).payload == b"late"

            await c.create_topic("news")
            received = []

            async def listen():
                async for message in c.subscribe("news"):
                    received.append(message.payload)
                    if len(received) == 3:
                        return

            listener = asyncio.ensure_future(listen())
            while await c.publish("news", b"ping") == 0:  # until the subscription is in place
                await asyncio.sleep(0.01)
            for payload in (b"a", b"b"):
                await c.publish("news", payload)
            await asyncio.wait_for(listener, 5)
            assert received == [b"ping", b"a", b"b"]

    asyncio.run(main())


def test_a_cancelled_asyncio_poll_loses_nothing(server):
    async def main():
        async with petrel.AsyncClient(server) as c:
            await c.create_queue("cancelled", durable=False)
            for _ in range(3):
                # Cancelled while its poll waits on the server…
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(c.poll("cancelled", timeout=5), 0.1)
            # …then the message comes: the orphaned polls give it back at once.
            await c.offer("cancelled", b"kept")
            got = await c.poll("cancelled", timeout=5)
            assert got is not None and got.payload == b"kept"

    asyncio.run(main())


def test_a_cancelled_asyncio_poll_does_not_count_a_delivery(server):
    """What a cancelled poll took is given back unseen: with max_deliveries 1 the message is not
    dead-lettered before the application ever had it, and its delivery count is its first."""

    async def main():
        async with petrel.AsyncClient(server) as c:
            await c.create_queue("dead1")
            await c.create_queue("work1", max_deliveries=1, dead_letter="dead1", redelivery_delay=30.0)
            for _ in range(3):
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(c.poll("work1", timeout=None), 0.2)
            await c.offer("work1", b"important")
            got = await c.take("work1", visibility=30, timeout=5)
            assert got is not None and got.payload == b"important" and got.deliveries == 1
            await c.ack("work1", [got.handle])
            assert await c.poll("dead1", timeout=0.2) is None

    asyncio.run(main())


def test_asyncio_polls_cancelled_at_any_moment_lose_and_repeat_nothing(server):
    """Polls cut short by timeouts of every length, while messages flow: a cancellation may land
    while the poll waits, while its answer is on the way, or as it arrives. Every message offered
    is received exactly once, taken for good or tentatively (and then acknowledged)."""
    import random

    async def main():
        async with petrel.AsyncClient(server) as producer, petrel.AsyncClient(server) as c:
            await producer.create_queue("flow", durable=False)
            count = 3000
            sent = [str(i).encode() for i in range(count)]

            async def produce():
                for i in range(0, count, 10):
                    await producer.offer_many("flow", sent[i:i + 10])
                    await asyncio.sleep(0)

            producing = asyncio.ensure_future(produce())
            rng = random.Random(7)
            received = []
            while not producing.done() or len(received) < count:
                tentative = rng.random() < 0.5
                try:
                    if tentative:
                        m = await asyncio.wait_for(c.take("flow", visibility=30, timeout=1), rng.uniform(0, 0.003))
                        if m is not None:
                            received.append(m.payload)
                            await c.ack("flow", [m.handle])
                    else:
                        m = await asyncio.wait_for(c.poll("flow", timeout=1), rng.uniform(0, 0.003))
                        if m is not None:
                            received.append(m.payload)
                except asyncio.TimeoutError:
                    pass
                if producing.done() and len(received) < count:
                    # Nothing in flight is lost: what is left comes within a second.
                    m = await c.poll("flow", timeout=1)
                    if m is None:
                        break
                    received.append(m.payload)
            await producing
            assert len(received) == len(set(received)), "nothing twice"
            assert sorted(received) == sorted(sent), f"{count - len(set(received))} lost"

    asyncio.run(main())


def test_an_asyncio_client_closed_refuses_new_requests_at_once(server):
    """After close(), a request (on the client, or on a subscription it made) raises
    ClosedError: it waited for ever, its outcome never looked for."""

    async def main():
        c = petrel.AsyncClient(server)
        await c.create_queue("shut")
        await c.create_topic("news")
        sub = await c.subscribe("news")
        await c.close()
        with pytest.raises(petrel.ClosedError):
            await asyncio.wait_for(c.offer("shut", b"x"), timeout=5)
        with pytest.raises(petrel.ClosedError):
            await asyncio.wait_for(sub.get(timeout=1), timeout=5)
        await sub.unsubscribe()  # gone with the connection: nothing to do

    asyncio.run(main())


def test_an_asyncio_take_for_good_stays_taken_when_the_client_closes_at_once(server):
    """A take for good is acknowledged after it returns: closing the client right after waits for
    that, or the server would give the message back as the connection ends."""

    async def main():
        async with petrel.AsyncClient(server) as producer:
            await producer.create_queue("once", durable=False)
            await producer.offer_many("once", [b"a", b"b", b"c"])
            for expected in [b"a", b"b", b"c"]:
                async with petrel.AsyncClient(server) as c:
                    got = await c.poll("once", timeout=5)
                    assert got is not None and got.payload == expected
            assert await producer.poll("once", timeout=0.3) is None, "none came back"

    asyncio.run(main())


def test_ctrl_c_interrupts_a_blocking_request(server):
    """A sync call waiting on the server (an offer waiting for room) stops at SIGINT with
    KeyboardInterrupt, as polls do, instead of running to its timeout."""
    import signal
    import subprocess
    import sys
    import time

    script = f"""
import petrel
c = petrel.Client({server!r})
c.create_queue("full", max_items=1)
c.offer("full", b"x")
print("ready", flush=True)
try:
    c.offer("full", b"y", timeout=30)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        started = time.monotonic()
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=10)
        assert out.strip() == "interrupted" and time.monotonic() - started < 5
    finally:
        child.kill()


def test_a_signal_handler_may_use_the_client_a_waiting_call_uses(server):
    """A signal handler runs inside the waiting call's check for signals; a call it makes on
    the same client (an ack, an offer, a ping) runs on a thread of its own. It raised
    PanicException ("Cannot start a runtime from within a runtime"), which `except Exception`
    does not catch."""
    import signal

    seen = []

    def on_alarm(signum, frame):
        with petrel.Client(server) as other:
            other.ping()
        c.offer("wake", b"from the handler")
        seen.append("handled")

    with petrel.Client(server) as c:
        c.create_queue("wake")
        previous = signal.signal(signal.SIGALRM, on_alarm)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            message = c.poll("wake", timeout=10)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert seen == ["handled"]
        assert message is not None and message.payload == b"from the handler"


def test_functions_are_served_again_after_the_server_restarts(tmp_path):
    """A client that only serves sends nothing, so no request of its own finds the connection
    lost: its functions used to stay unserved after a server restart. Now the client notices the
    loss, connects again and serves them all again, the blocking and the asyncio client alike."""
    import time
    from conftest import restartable_addr, start, stop

    def call_until_served(caller, function, payload, deadline=10.0):
        started = time.monotonic()
        while True:
            try:
                return caller.call(function, payload, timeout=2.0)
            except (petrel.ConnectionError, petrel.ServerError) as e:
                if time.monotonic() - started > deadline:
                    raise AssertionError(f"{function} not served again: {e}")
                time.sleep(0.05)

    process, address = start(tmp_path, restartable_addr())
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    try:
        server = petrel.Client(address)
        server.serve("upper", lambda m: m.payload.upper())
        server.serve("twice", lambda m: m.payload * 2)

        async def serving():
            c = petrel.AsyncClient(address)

            async def lower(m):
                return m.payload.lower()

            await c.serve("lower", lower)
            ready.set()
            return c

        thread = threading.Thread(target=lambda: (asyncio.set_event_loop(loop), loop.run_forever()))
        thread.start()
        async_server = asyncio.run_coroutine_threadsafe(serving(), loop).result(10)
        assert ready.wait(10)
        caller = petrel.Client(address)
        assert caller.call("upper", b"a").payload == b"A"
        assert caller.call("lower", b"A").payload == b"a"

        stop(process)
        process, _ = start(tmp_path, address)
        caller = petrel.Client(address)
        assert call_until_served(caller, "upper", b"abc").payload == b"ABC"
        assert call_until_served(caller, "twice", b"ab").payload == b"abab"
        assert call_until_served(caller, "lower", b"XY").payload == b"xy"

        # Unserved before a restart: not served again after it.
        server.unserve("twice")
        stop(process)
        process, _ = start(tmp_path, address)
        caller = petrel.Client(address)
        assert call_until_served(caller, "upper", b"q").payload == b"Q"
        with pytest.raises(petrel.ServerError) as refused:
            caller.call("twice", b"x", timeout=1.0)
        assert refused.value.status == "FUNCTION_NOT_FOUND"

        server.close()
        asyncio.run_coroutine_threadsafe(async_server.close(), loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        stop(process)


def test_a_function_the_server_will_not_serve_again_is_told_by_a_warning(tmp_path, caplog):
    """A client serving a function serves it again on each new connection. When the server
    refused that (its rights changed while it was down), the function silently stopped being
    served; and a login refused on reconnection was retried forever without a word. Now the
    `petrel` logger says each, with the function and the server's answer."""
    import subprocess
    import time
    from conftest import BINARY, restartable_addr, start, stop

    users = tmp_path / "users.toml"
    subprocess.run([BINARY, "user", "add", str(users), "tom"], input="S3cret-tom\n", text=True,
                   check=True, capture_output=True)
    config = tmp_path / "petrel.toml"
    security = f'[security]\nusers_file = "{users}"\nallow_plaintext_auth = true\n'
    may_serve = '[[security.acl]]\nkind = "function"\nname = "upper"\nuser = "tom"\naccess = "serve"\n'

    def warned(*words, deadline=10.0):
        started = time.monotonic()
        while time.monotonic() - started < deadline:
            said = [r.getMessage() for r in caplog.records if r.name == "petrel"]
            if any(all(w in m for w in words) for m in said):
                return
            time.sleep(0.05)
        raise AssertionError(f"no warning saying {words}: {said}")

    config.write_text(security + may_serve)
    process, address = start(tmp_path, restartable_addr(), "--config", str(config))
    try:
        server = petrel.Client(address, user="tom", password="S3cret-tom")
        server.serve("upper", lambda m: m.payload.upper())
        assert not [r for r in caplog.records if r.name == "petrel"]

        # Restarted without the right to serve: the client reconnects, and is refused.
        stop(process)
        config.write_text(security)
        process, _ = start(tmp_path, address, "--config", str(config))
        warned('"upper"', "not served any more", "FORBIDDEN")

        # Restarted with tom's password changed: the login is refused.
        stop(process)
        subprocess.run([BINARY, "user", "passwd", str(users), "tom"], input="N3w-secret-tom\n", text=True,
                       check=True, capture_output=True)
        process, _ = start(tmp_path, address, "--config", str(config))
        warned('["upper"]', "refuses this client's connection", "UNAUTHORIZED")
        server.close()
    finally:
        stop(process)


def test_clients_connect_again_after_the_server_restarts(tmp_path):
    """A server restart used to leave a client failing every request for good. Now the request
    that finds the connection lost fails (what it sent may have arrived: it is not sent again),
    and the next one connects first, for the blocking and the asyncio client alike."""
    from conftest import restartable_addr, start, stop

    def again(request):
        try:
            return request()
        except petrel.ConnectionError:
            return request()

    process, address = start(tmp_path, restartable_addr())
    try:
        blocking = petrel.Client(address)
        blocking.create_queue("jobs")
        blocking.offer("jobs", b"before")

        async def before():
            c = petrel.AsyncClient(address)
            await c.offer("jobs", b"async before")
            return c

        loop = asyncio.new_event_loop()
        async_client = loop.run_until_complete(before())
        stop(process)
        process, _ = start(tmp_path, address)

        again(lambda: blocking.offer("jobs", b"after"))
        blocking.offer("jobs", b"and on")

        async def after():
            try:
                await async_client.offer("jobs", b"async after")
            except petrel.ConnectionError:
                await async_client.offer("jobs", b"async after")
            await async_client.offer("jobs", b"async and on")
            await async_client.close()

        loop.run_until_complete(after())
        loop.close()
        got = [m.payload for m in blocking.poll_many("jobs", max=10)]
        assert got == [b"before", b"async before", b"after", b"and on", b"async after", b"async and on"]
        blocking.close()
        with pytest.raises(petrel.PetrelError):
            blocking.offer("jobs", b"closed")  # closed by its user: never connected again
    finally:
        stop(process)


def test_arguments_the_client_cannot_send_are_value_errors(server, tmp_path):
    """Nothing is sent for them, and the connection is fine: they were ConnectionError (and a bad
    segment size a PetrelError)."""
    with petrel.Client(server) as c:
        c.create_queue("args")
        with pytest.raises(ValueError):
            c.offer("args", b"x", key="k" * 70_000)
        c.ping()
    with pytest.raises(ValueError):
        petrel.Cluster([server, server])
    with pytest.raises(ValueError):
        petrel.Log(str(tmp_path / "log"), segment_bytes=1000)


def test_an_infinite_offer_timeout_waits_for_room_and_a_nan_poll_timeout_is_zero(server):
    """`timeout=float("inf")` on an offer waits for room (it was no wait at all, QUEUE_FULL at
    once), as it waits for ever on a poll; an asyncio poll with a NaN timeout returns at once
    (it polled for ever)."""
    import asyncio
    import threading

    c = petrel.Client(server)
    c.create_queue("full", max_items=1)
    c.offer("full", b"x")
    other = petrel.Client(server)
    threading.Timer(0.5, lambda: other.poll("full", timeout=0)).start()
    assert c.offer("full", b"y", timeout=float("inf")) is not None

    async def nan_poll():
        ac = petrel.AsyncClient(server)
        try:
            ac_result = await asyncio.wait_for(ac.poll("empty-nan", timeout=float("nan")), 5)
        finally:
            await ac.close()
        return ac_result

    c.create_queue("empty-nan")
    assert asyncio.run(nan_poll()) is None


def test_a_signal_that_interrupts_a_waiting_poll_loses_nothing(server):
    """A poll waiting on the server cut short by a signal whose handler raises (Ctrl-C, an
    alarm): what the poll takes once given up goes back to the queue, unseen (it was taken for
    good and dropped with the answer nobody read)."""
    import signal

    class Alarm(Exception):
        pass

    def raise_alarm(signum, frame):
        raise Alarm()

    c = petrel.Client(server)
    c.create_queue("signalled")
    before = signal.signal(signal.SIGALRM, raise_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Alarm):
            c.poll("signalled", timeout=None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    producer = petrel.Client(server)
    producer.offer("signalled", b"kept")
    got = producer.poll("signalled", timeout=3)
    assert got is not None and got.payload == b"kept"


def test_a_waiting_poll_for_good_then_close_delivers_once(server):
    """A poll that waited takes its message tentatively and acknowledges it before returning
    it: a close right after does not give it back to be delivered again."""
    c = petrel.Client(server)
    c.create_queue("once")
    other = petrel.Client(server)
    other.offer("once", b"only")
    got = c.poll("once", timeout=1)
    assert got is not None and got.payload == b"only" and got.handle == 0
    c.close()
    assert other.poll("once", timeout=0.3) is None


def _offer_in_child(address, client, payload):
    # A client made here, and one made by the parent before the fork.
    petrel.Client(address).offer("forked", payload)
    client.offer("forked", payload + b"-inherited")


def test_a_forked_child_uses_the_client(server):
    """A child made by fork (multiprocessing's default start method on Linux, gunicorn and celery
    workers) uses the client: the parent's runtime threads are not in the child, and every call
    there waited for ever, Ctrl-C included."""
    import multiprocessing

    parent = petrel.Client(server)
    parent.create_queue("forked")
    child = multiprocessing.get_context("fork").Process(target=_offer_in_child, args=(server, parent, b"child"))
    child.start()
    child.join(20)
    hung = child.is_alive()
    if hung:
        child.kill()
        child.join()
    assert not hung and child.exitcode == 0
    got = sorted(m.payload for m in parent.poll_many("forked", max=10))
    assert got == [b"child", b"child-inherited"]
    parent.offer("forked", b"parent")  # and the parent's client goes on
    assert parent.poll("forked").payload == b"parent"


def test_a_server_killed_during_a_poll_is_a_connection_error(tmp_path):
    """A server that goes away while a call waits raises ConnectionError, what a retry loop
    catches; ClosedError is for a client the program closed. (The crate says `Closed` for both.)"""
    from conftest import start

    process, address = start(tmp_path)
    try:
        c = petrel.Client(address)
        c.create_queue("q")
        threading.Timer(0.5, process.kill).start()
        with pytest.raises(petrel.ConnectionError):
            c.poll("q", timeout=10)
    finally:
        process.kill()
        process.wait()


def test_an_async_client_used_on_a_second_loop_refuses_before_sending(server):
    """An AsyncClient belongs to the loop it was first used on. Used on another (a loop per test,
    a client shared), the request was sent and done, and only then failed with RuntimeError: a
    retry stored the message twice. Now it fails before anything is sent."""
    client = petrel.AsyncClient(server)
    asyncio.run(client.create_queue("loops"))
    with pytest.raises(RuntimeError, match="event loop"):
        asyncio.run(client.offer("loops", b"x"))
    with petrel.Client(server) as c:
        assert c.poll("loops") is None, "nothing was stored"


def test_an_unclosed_async_client_gives_its_descriptors_back(server):
    """AsyncClients dropped without close give back their descriptors once collected: the loop
    held each one's completions (two descriptors) for as long as the loop lived."""
    import gc
    import os

    async def main() -> int:
        async with petrel.AsyncClient(server) as first:
            await first.create_queue("fds")
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            c = petrel.AsyncClient(server)
            await c.offer("fds", b"x")
            del c
        gc.collect()
        await asyncio.sleep(0.5)
        return len(os.listdir("/proc/self/fd")) - before

    assert asyncio.run(main()) < 10
