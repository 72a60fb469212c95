"""Topics (live subscriptions, durable consumer groups with acknowledgements and replay),
functions (serve with a callable or a coroutine, call) and security (TLS, passwords, client
certificates), against a real `petrel serve`."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import petrel
from conftest import USERS


def test_a_blocking_subscription_iterates_and_ends_from_another_thread(server):
    with petrel.Client(server) as c, petrel.Client(server) as publisher:
        c.create_topic("news")
        with c.subscribe("news") as sub:
            assert sub.active
            for i in range(5):
                assert publisher.publish("news", b"n%d" % i, subject="s") == 1
            got = [next(sub) for _ in range(5)]
            assert [m.payload for m in got] == [b"n%d" % i for i in range(5)]
            assert {m.subject for m in got} == {"s"}
            assert sub.get(timeout=0.05) is None, "nothing more was published"
            # A reader waiting without a limit is ended by an unsubscribe from another thread.
            threading.Timer(0.2, sub.unsubscribe).start()
            assert list(sub) == []
            assert not sub.active
        assert publisher.publish("news", b"after") == 0, "the subscriber is gone"


def test_a_durable_group_resumes_after_its_acks_and_replays_from_offset_or_time(server):
    with petrel.Client(server) as c:
        c.create_topic("events", durable=True)
        for i in range(10):
            c.publish("events", b"e%d" % i)
            time.sleep(0.02)  # distinct publish times (the server's clock may be coarse)

        with c.subscribe_group("events", "billing", "oldest", max_unacked=100) as sub:
            first = [sub.get(timeout=5) for _ in range(4)]
            assert [m.payload for m in first] == [b"e0", b"e1", b"e2", b"e3"]
            assert sub.ack([m.id for m in first]) == 4
        # Delivered but not acknowledged (e4.. may have been pushed already): they come again.
        with c.subscribe_group("events", "billing") as sub:
            rest = [sub.get(timeout=5) for _ in range(6)]
            assert [m.payload for m in rest] == [b"e%d" % i for i in range(4, 10)]
            sub.ack([m.id for m in rest])
            assert sub.get(timeout=0.05) is None
        # Another group has its own position; replay from an offset and from a time.
        with c.subscribe_group("events", "audit", 7) as sub:
            assert [sub.get(timeout=5).payload for _ in range(3)] == [b"e7", b"e8", b"e9"]
        # The first message published at or after e6's time is e6.
        with c.subscribe_group("events", "audit", time=rest[2].timestamp) as sub:
            assert sub.get(timeout=5).payload == b"e6"
        assert rest[1].timestamp < rest[2].timestamp
        with pytest.raises(ValueError, match="not both"):
            c.subscribe_group("events", "audit", "oldest", time=1)
        with pytest.raises(petrel.ServerError, match="TOPIC_NOT_FOUND"):
            c.subscribe_group("nowhere", "g")


def test_served_functions_reply_fail_time_out_and_stop(server):
    with petrel.Client(server) as worker, petrel.Client(server) as c:
        worker.serve("upper", lambda m: m.payload.upper())
        worker.serve("divide", lambda m: b"%d" % (1 // int(m.payload)))
        worker.serve("nothing", lambda m: None)
        worker.serve("slow", lambda m: time.sleep(1) or b"late")
        worker.serve("wrong-type", lambda m: 42)

        assert c.call("upper", b"abc", timeout=5).payload == b"ABC"
        assert c.call("divide", b"1").payload == b"1"
        with pytest.raises(petrel.ServerError, match="HANDLER_ERROR.*ZeroDivisionError"):
            c.call("divide", b"0")
        with pytest.raises(petrel.ServerError, match="HANDLER_ERROR.*int, not bytes"):
            c.call("wrong-type", b"")
        assert c.call("nothing", b"x").payload == b""
        with pytest.raises(petrel.ServerError, match="TIMEOUT"):
            c.call("slow", b"", timeout=0.2)
        with pytest.raises(petrel.ServerError, match="FUNCTION_NOT_FOUND"):
            c.call("nobody", b"")
        c.call_oneway("upper", b"fire and forget")

        # Calls from many threads, in flight together on one connection each way.
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda i: c.call("upper", b"x%d" % i, timeout=5).payload, range(300)))
        assert replies == [b"X%d" % i for i in range(300)]

        worker.unserve("upper")
        with pytest.raises(petrel.ServerError, match="FUNCTION_NOT_FOUND"):
            c.call("upper", b"abc")


def test_asyncio_serves_coroutines_with_many_calls_in_flight(server):
    async def main():
        async with petrel.AsyncClient(server) as worker, petrel.AsyncClient(server) as c:
            running = 0
            most = 0

            async def reverse(message):
                nonlocal running, most
                running += 1
                most = max(most, running)
                await asyncio.sleep(0.05)
                running -= 1
                return message.payload[::-1]

            def refuse(message):
                raise PermissionError("not today")

            await worker.serve("reverse", reverse)
            await worker.serve("refuse", refuse)
            await worker.serve("plain", lambda m: b"plain:" + m.payload)

            payloads = [b"ab%d" % i for i in range(200)]
            replies = await asyncio.gather(*(c.call("reverse", p, timeout=10) for p in payloads))
            assert [r.payload for r in replies] == [p[::-1] for p in payloads]
            assert most > 1, "coroutine handlers ran concurrently"
            assert (await c.call("plain", b"x")).payload == b"plain:x"
            with pytest.raises(petrel.ServerError, match="HANDLER_ERROR.*PermissionError: not today"):
                await c.call("refuse", b"")

            # Unserving lets a call already taken finish with its reply.
            slow = asyncio.ensure_future(c.call("reverse", b"last", timeout=10))
            while running == 0:
                await asyncio.sleep(0.001)
            await worker.unserve("reverse")
            assert (await slow).payload == b"tsal"
            with pytest.raises(petrel.ServerError, match="FUNCTION_NOT_FOUND"):
                await c.call("reverse", b"x")
            # Again, or a function it never served: nothing to stop (it was a KeyError).
            await worker.unserve("reverse")
            await worker.unserve("never-served")

    asyncio.run(main())


def test_asyncio_group_subscription_acks_and_a_timed_get(server):
    async def main():
        async with petrel.AsyncClient(server) as c:
            await c.create_topic("log", durable=True)
            for i in range(5):
                await c.publish("log", b"r%d" % i)
            async with c.subscribe_group("log", "readers", "oldest") as sub:
                got = []
                async for message in sub:
                    got.append(message)
                    if len(got) == 3:
                        break
                assert await sub.ack([m.id for m in got]) == 3
            async with c.subscribe_group("log", "readers") as sub:
                assert [(await sub.get(timeout=5)).payload for _ in range(2)] == [b"r3", b"r4"]
                assert await sub.get(timeout=0.05) is None

    asyncio.run(main())


def test_an_awaited_asyncio_subscription_gets_what_is_published_next(server):
    async def main():
        async with petrel.AsyncClient(server) as c:
            await c.create_topic("live")
            sub = await c.subscribe("live")
            assert sub.id is not None
            assert await c.publish("live", b"first") == 1
            got = await sub.get(timeout=5)
            assert got is not None and got.payload == b"first"
            await sub.unsubscribe()

    asyncio.run(main())


def test_an_asyncio_subscription_read_cancelled_as_its_message_arrives_loses_nothing(server):
    """Reads cut short by `wait_for` again and again while messages arrive: a message that
    reached a cancelled read is handed to the next, so every one comes, in order."""

    async def main():
        async with petrel.AsyncClient(server) as c, petrel.AsyncClient(server) as publisher:
            await c.create_topic("cut")
            sub = await c.subscribe("cut")
            count = 300

            async def publish():
                for i in range(count):
                    await publisher.publish("cut", b"%d" % i)
                    if i % 3 == 0:
                        await asyncio.sleep(0)

            publishing = asyncio.ensure_future(publish())
            got, cancelled = [], 0
            deadline = time.monotonic() + 30
            while len(got) < count and time.monotonic() < deadline:
                try:
                    message = await asyncio.wait_for(sub.get(), timeout=0.0002)
                except asyncio.TimeoutError:
                    cancelled += 1
                    continue
                got.append(int(message.payload))
            await publishing
            assert cancelled > 0
            assert got == list(range(count))
            await sub.unsubscribe()

    asyncio.run(main())


def test_tls_with_a_password_or_a_client_certificate(secure_server):
    address, certs = secure_server
    ca = certs / "ca.pem"
    admin_password = USERS["max"][0]
    with pytest.raises(petrel.PetrelError, match="TLS"):
        petrel.Client(address)  # the server requires TLS
    with pytest.raises(petrel.ServerError, match="UNAUTHORIZED.*invalid user name or password"):
        petrel.Client(address, user="max", password="wrong", tls_ca=ca)
    with pytest.raises(petrel.ConnectionError, match="TLS"):
        petrel.Client(address, user="max", password=admin_password, tls_ca=certs / "client.pem")  # not the CA

    with petrel.Client(address, user="max", password=admin_password, tls_ca=ca) as admin:
        admin.create_queue("secured")
        admin.offer("secured", b"over TLS")
    with petrel.Client(address, user="tom", password=USERS["tom"][0], tls_ca=str(ca)) as tom:
        with pytest.raises(petrel.ServerError, match="FORBIDDEN"):
            tom.create_queue("mine")
    # Mutual TLS: the certificate names the user ("client"), no password.
    with petrel.Client(address, tls_ca=ca, tls_cert=certs / "client.pem", tls_key=certs / "client.key") as by_cert:
        by_cert.ping()
    with pytest.raises(ValueError, match="tls_ca"):
        petrel.Client(address, tls_cert=certs / "client.pem", tls_key=certs / "client.key")

    async def main():
        async with petrel.AsyncClient(address, user="max", password=admin_password, tls_ca=str(ca)) as c:
            assert (await c.poll("secured", timeout=5)).payload == b"over TLS"

    asyncio.run(main())
