"""Petrel: a fast, durable message queue, from Python.

Two ways to use it:

* **Embedded** — the storage engine in this process, no server:
  :class:`Log` (an append-only, crash-safe log of records with dense offsets, consumer
  groups with at-least-once delivery, lookups by offset, time and key) and :class:`Queue`
  (a persistent FIFO shaped like :class:`queue.Queue`).
* **Client** — a connection to ``petrel serve``: :class:`Client` (blocking, thread-safe)
  and :class:`AsyncClient` (asyncio) for queues and reliable reads, topics (live
  subscriptions and durable consumer groups) and functions (call, and serve with a Python
  callable or coroutine), with authentication and TLS; and :class:`Cluster` (blocking), a
  client of several independent servers that spreads offers over them, takes from all of them
  and routes around one that fails.

Errors are :class:`PetrelError` and its subclasses, carrying the Rust error's message.
Every call that touches the disk or the network, or waits, releases the GIL.
"""

from __future__ import annotations

import asyncio
import collections
import atexit
import builtins
import inspect
import itertools
import time
import weakref
from typing import Any, Awaitable, Callable, Deque, Dict, Generator, List, Optional, Set, Tuple, Union

from ._petrel import (
    AsyncCalls as _AsyncCalls,
    AsyncCore as _AsyncCore,
    AsyncSubscriptionCore as _AsyncSubscriptionCore,
    Client,
    Cluster,
    ClusterHandle,
    ClusterSubscription,
    Completions as _Completions,
    IncomingCall as _IncomingCall,
    ClosedError,
    ConnectionError,
    CorruptLogError,
    Group,
    LockedError,
    Log,
    LogIterator,
    Message,
    PetrelError,
    PoisonedError,
    Queue,
    Record,
    ServerError,
    Subscription,
    TooLargeError,
    __version__,
    _stop_serving,
)

__all__ = [
    "AsyncClient",
    "AsyncSubscription",
    "Client",
    "ClosedError",
    "Cluster",
    "ClusterHandle",
    "ClusterSubscription",
    "ConnectionError",
    "CorruptLogError",
    "Group",
    "LockedError",
    "Log",
    "LogIterator",
    "Message",
    "PetrelError",
    "PoisonedError",
    "Queue",
    "Record",
    "ServerError",
    "Subscription",
    "TooLargeError",
    "__version__",
]

# A server-side poll waits at most about a second at a time; longer waits loop.
_LONG_POLL = 1.0
# How long `AsyncClient.close` waits for acknowledgements of takes for good still on their way.
_CLOSE_ACKS_TIMEOUT = 10.0


@atexit.register
def _let_handlers_finish() -> None:
    # Client.serve's handlers run on threads of the native runtime. At exit, stop new calls of
    # served functions and let a running handler finish before the interpreter finalizes: a
    # native thread inside Python then would abort the process.
    if _stop_serving():
        time.sleep(0.05)


class _Requests:
    """The asyncio client's requests in flight on one event loop.

    A request runs natively and leaves its outcome with :class:`Completions`, which makes a
    descriptor readable; the loop then resolves the request's future here, on its own thread.
    No native thread ever waits for the GIL to deliver a result.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.completions = _Completions()
        # Each request's future, and what gives back what it took if no one awaits it any more.
        self.waiting: Dict[int, Tuple["asyncio.Future[Any]", Optional[Callable[[Any], None]]]] = {}
        self.tokens = itertools.count(1)
        self.closing = False
        self.watching = True
        loop.add_reader(self.completions.fileno(), self._drain)

    def _drain(self) -> None:
        for token, succeeded, value in self.completions.drain():
            entry = self.waiting.pop(token, None)
            if entry is None:
                continue
            future, give_back = entry
            if future.done():
                # Its coroutine was cancelled and has not said so yet (see `run`).
                if succeeded and give_back is not None:
                    give_back(value)
                continue
            if succeeded:
                future.set_result(value)
            else:
                future.set_exception(value)
        if self.closing and not self.waiting:
            self._unwatch()

    def _unwatch(self) -> None:
        if self.watching and not self.loop.is_closed():
            self.loop.remove_reader(self.completions.fileno())
        self.watching = False

    async def run(
        self,
        start: Callable[..., None],
        *args: Any,
        give_back: Optional[Callable[[Any], None]] = None,
        **kwargs: Any,
    ) -> Any:
        """Starts a native request (``start(token, *args)``) and waits for its outcome; a
        cancelled wait aborts the request. What a cancelled request took (a poll's messages) is
        given back whenever its outcome comes: natively if it was not drained yet, else by
        ``give_back(value)`` here."""
        token, future = self._begin(start, args, kwargs, give_back)
        try:
            return await future
        except asyncio.CancelledError:
            if self.waiting.pop(token, None) is not None:
                self.completions.cancel(token)  # not drained: never reaches Python
            elif future.done() and not future.cancelled() and future.exception() is None:
                # Drained and resolved, and cancelled before this coroutine went on.
                if give_back is not None:
                    give_back(future.result())
            raise

    def start(self, start: Callable[..., None], *args: Any) -> "asyncio.Future[Any]":
        """Starts a native request now, not awaited here: its future resolves with the outcome."""
        return self._begin(start, args, {}, None)[1]

    def _begin(
        self,
        start: Callable[..., None],
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        give_back: Optional[Callable[[Any], None]],
    ) -> Tuple[int, "asyncio.Future[Any]"]:
        """Registers a request's future under a new token, then starts it natively."""
        if self.closing:
            # Its outcome would never be looked for: the completions are no longer watched.
            raise ClosedError("the client was closed")
        try:
            running: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and running is not self.loop:
            # Refused before it is sent: started, it would be done by the server while its
            # future (of the other loop) could not be awaited here, and a retry would do it twice.
            raise RuntimeError(
                "this AsyncClient belongs to the event loop it was first used on; make one per loop"
            )
        token = next(self.tokens)
        future = self.loop.create_future()
        self.waiting[token] = (future, give_back)
        try:
            start(token, *args, **kwargs)
        except BaseException:
            del self.waiting[token]
            raise
        return token, future

    def close(self) -> None:
        """Stops watching once the requests in flight have their outcomes."""
        self.closing = True
        if not self.waiting:
            self._unwatch()


def _let_go_of(requests: _Requests) -> None:
    """The requests of an AsyncClient collected without ``close``: no longer watched once those
    in flight have their outcomes."""
    try:
        requests.loop.call_soon_threadsafe(requests.close)
    except RuntimeError:
        pass  # the loop is closed: nothing watches them any more


class AsyncSubscription:
    """A topic subscription for asyncio: ``async for message in subscription``.

    Made by :meth:`AsyncClient.subscribe` (live messages from now on) or
    :meth:`AsyncClient.subscribe_group` (a durable topic's consumer group: acknowledge with
    :meth:`ack`). It subscribes on first use, or when awaited (``sub = await
    client.subscribe(t)``) or entered (``async with``): await or enter it before publishing what
    it must get, since a live subscription gets only what is published after it is made.
    ``async with`` ends it on leaving, and so does dropping it. Ends with an error (``ServerError`` naming ``SLOW_CONSUMER``) if the server
    dropped a live subscriber too slow to keep up.
    """

    def __init__(self, subscribing: Callable[[], Awaitable[Tuple[_Requests, _AsyncSubscriptionCore]]]) -> None:
        self._subscribing = subscribing
        self._core: Optional[_AsyncSubscriptionCore] = None
        self._requests: Optional[_Requests] = None
        # Messages that reached a coroutine cancelled before it took them: handed out first.
        self._kept: Deque[Message] = collections.deque()

    async def _subscription(self) -> Tuple[_Requests, _AsyncSubscriptionCore]:
        if self._core is None:
            self._requests, self._core = await self._subscribing()
        assert self._requests is not None
        return self._requests, self._core

    @property
    def id(self) -> Optional[int]:
        """The server's number for it, once subscribed."""
        return None if self._core is None else self._core.id

    def __aiter__(self) -> "AsyncSubscription":
        return self

    def __await__(self) -> Generator[Any, None, "AsyncSubscription"]:
        """Subscribes now (if not yet): ``sub = await client.subscribe(t)``."""

        async def subscribed() -> "AsyncSubscription":
            await self._subscription()
            return self

        return subscribed().__await__()

    async def __anext__(self) -> Message:
        message = await self.get()
        if message is None:
            raise StopAsyncIteration
        return message

    async def get(self, timeout: Optional[float] = None) -> Optional[Message]:
        """The next message, waiting up to ``timeout`` seconds (``None``: until one comes);
        ``None`` if none came in time or the subscription is over."""
        # The wait is timed on the native side: a message that arrives as it ends is kept, and
        # so is one that arrives for a coroutine cancelled meanwhile (for the next call).
        requests, core = await self._subscription()
        if self._kept:
            return self._kept.popleft()
        return await requests.run(core.next, timeout, give_back=self._keep)

    def _keep(self, message: Optional[Message]) -> None:
        if message is not None:
            self._kept.append(message)

    async def ack(self, ids: List[int]) -> int:
        """Acknowledges messages of a group subscription by ``Message.id``; returns how many
        counted."""
        requests, core = await self._subscription()
        return await requests.run(core.ack, ids)

    async def unsubscribe(self) -> None:
        """Ends the subscription; unacknowledged messages of a group come again to its next
        subscriber."""
        # (Its client closed: the connection, and the subscription with it, are gone.)
        if self._core is not None and self._requests is not None and not self._requests.closing:
            await self._requests.run(self._core.unsubscribe)

    async def __aenter__(self) -> "AsyncSubscription":
        await self._subscription()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.unsubscribe()


Handler = Callable[[Message], Union[Optional[bytes], Awaitable[Optional[bytes]]]]


class AsyncClient:
    """An asyncio connection to ``petrel serve`` (the native protocol, default port 22134; or its
    Unix socket, ``"unix:PATH"``).

    It connects on first use (or ``await client.connect()``, or ``async with``). Coroutines
    may call it concurrently: their requests share the connection, in flight together.
    """

    def __init__(
        self,
        address: str = "127.0.0.1:22134",
        *,
        user: Optional[str] = None,
        password: Optional[str] = None,
        tls_ca: Optional[str] = None,
        tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None,
    ) -> None:
        self._args = (address, user, password, tls_ca, tls_cert, tls_key)
        self._core: Optional[_AsyncCore] = None
        self._requests: Optional[_Requests] = None
        self._connecting: Optional[asyncio.Future] = None
        self._closed = False
        # Served functions: each one's stream of calls and the task answering them.
        self._serving: Dict[str, Tuple[_AsyncCalls, "asyncio.Task[None]"]] = {}
        # Acknowledgements of takes for good on their way (`close` waits for them).
        self._acks: Set["asyncio.Future[Any]"] = set()

    async def connect(self) -> "AsyncClient":
        """Connects now (once); returns the client."""
        await self._client()
        return self

    async def _client(self) -> _AsyncCore:
        if self._closed:
            raise ClosedError("the client was closed")
        if self._core is not None:
            return self._core
        if self._requests is None:
            self._requests = _Requests(asyncio.get_running_loop())
            # Collected without `close`: the loop lets go of the requests' descriptor (it held
            # it, and two descriptors with it, for as long as the loop lived).
            weakref.finalize(self, _let_go_of, self._requests)
        requests = self._requests
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(
                requests.run(_AsyncCore.connect, requests.completions, *self._args)
            )
        connecting = self._connecting
        try:
            # Shielded: a caller cancelled while connecting leaves the connection to the others.
            core = await asyncio.shield(connecting)
        except asyncio.CancelledError:
            raise
        except BaseException:
            # The connection failed: the next call tries again.
            if self._connecting is connecting:
                self._connecting = None
            raise
        self._core = core
        return core

    async def _run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Runs request ``method`` of the native client and waits for its outcome."""
        core = await self._client()
        assert self._requests is not None
        return await self._requests.run(getattr(core, method), *args, **kwargs)

    async def create_queue(
        self,
        name: str,
        durable: bool = True,
        max_items: int = 0,
        max_bytes: int = 0,
        ttl: Optional[float] = None,
        **settings: Any,
    ) -> None:
        """Creates a queue (nothing if it exists with this configuration); ``settings`` as
        :meth:`Client.create_queue`'s (times in seconds)."""
        await self._run("create_queue", name, durable, max_items, max_bytes, ttl, **settings)

    async def remove_queue(self, name: str) -> None:
        """Removes a queue and the messages in it."""
        await self._run("remove_queue", name)

    async def offer(
        self,
        queue: str,
        payload: bytes,
        timeout: Optional[float] = None,
        *,
        priority: int = 0,
        key: Optional[str] = None,
        delay: Optional[float] = None,
        deliver_at: Optional[float] = None,
    ) -> int:
        """Adds a message at the queue's tail; returns its id (with a `key` offered before: the
        original's, and nothing is stored twice). With ``delay`` (seconds) or ``deliver_at``
        (seconds since the epoch) it is handed out no earlier."""
        return await self._run("offer", queue, payload, timeout, priority, key, delay, deliver_at)

    async def offer_many(self, queue: str, payloads: List[bytes], timeout: Optional[float] = None) -> int:
        """Adds messages together, all or none; returns the first id."""
        return await self._run("offer_many", queue, payloads, timeout)

    async def poll_many(
        self, queue: str, max: int = 100, timeout: Optional[float] = 0.0, visibility: Optional[float] = None
    ) -> List[Message]:
        """Takes up to ``max`` messages, waiting up to ``timeout`` seconds for the first
        (``None``: until one comes); with ``visibility`` tentatively (see :meth:`ack`)."""
        loop = asyncio.get_running_loop()
        # (NaN is zero, as for every other timeout: `max` would keep it, and the loop below
        # would poll for ever.)
        if timeout is not None and timeout != timeout:
            timeout = 0.0
        deadline = None if timeout is None else loop.time() + builtins.max(timeout, 0.0)
        core = await self._client()
        assert self._requests is not None

        def give_back(answer: Tuple[List[Message], List[int]]) -> None:
            core.abort_detached(queue, answer[1])

        while True:
            wait = _LONG_POLL if deadline is None else builtins.max(min(deadline - loop.time(), _LONG_POLL), 0.0)
            messages, handles = await self._requests.run(
                core.poll_once, queue, max, wait, visibility, give_back=give_back
            )
            if messages and visibility is None:
                # Taken tentatively: gone for good once in this coroutine's hands (here, with no
                # wait before the return that could be cancelled).
                self._acknowledge(core, queue, handles)
            if messages or (deadline is not None and loop.time() >= deadline):
                return messages

    def _acknowledge(self, core: Any, queue: str, handles: List[int]) -> None:
        """Acknowledges a take for good in the background (`close` waits for it). One that
        fails (the connection lost) is delivered again when its visibility ends."""
        assert self._requests is not None
        ack = self._requests.start(core.ack, queue, handles)
        self._acks.add(ack)

        def done(ack: "asyncio.Future[Any]") -> None:
            self._acks.discard(ack)
            if not ack.cancelled():
                ack.exception()  # (retrieved: see above)

        ack.add_done_callback(done)

    async def poll(self, queue: str, timeout: Optional[float] = 0.0) -> Optional[Message]:
        """Takes the message at the head for good, waiting up to ``timeout`` seconds
        (``None``: until one comes); ``None`` if none came."""
        messages = await self.poll_many(queue, 1, timeout)
        return messages[0] if messages else None

    async def take(self, queue: str, visibility: float = 30.0, timeout: Optional[float] = 0.0) -> Optional[Message]:
        """Takes the message at the head tentatively (acknowledge with :meth:`ack`)."""
        messages = await self.poll_many(queue, 1, timeout, visibility)
        return messages[0] if messages else None

    async def ack(self, queue: str, handles: List[int]) -> int:
        """Acknowledges tentative takes by handle; returns how many were still open."""
        return await self._run("ack", queue, handles)

    async def abort(self, queue: str, handles: List[int], delay: Optional[float] = None) -> int:
        """Puts tentative takes back at the head, or with ``delay`` (seconds) to be handed out
        again no earlier; returns how many were still open."""
        return await self._run("abort", queue, handles, delay)

    async def create_topic(self, name: str, durable: bool = False) -> None:
        """Creates a topic (nothing if it exists); a durable one keeps a log for groups."""
        await self._run("create_topic", name, durable)

    async def remove_topic(self, name: str) -> None:
        """Removes a topic; its subscriptions end."""
        await self._run("remove_topic", name)

    async def publish(self, topic: str, payload: bytes, subject: str = "") -> int:
        """Publishes to every current subscriber (and a durable topic's log); returns how many
        subscribers it reached."""
        return await self._run("publish", topic, payload, subject)

    def subscribe(self, topic: str, buffer: int = 0) -> AsyncSubscription:
        """The topic's messages from when it subscribes (at its first use, or ``await``:
        ``sub = await client.subscribe(t)``): ``async for message in client.subscribe(t)``.
        ``buffer``: how many the server holds for this subscriber before it ends the
        subscription as too slow (0: the server's default)."""

        async def subscribing() -> Tuple[_Requests, _AsyncSubscriptionCore]:
            core = await self._run("subscribe", topic, buffer)
            assert self._requests is not None
            return self._requests, core

        return AsyncSubscription(subscribing)

    def subscribe_group(
        self,
        topic: str,
        group: str,
        start: Union[int, str, None] = None,
        *,
        time: Optional[int] = None,
        max_unacked: int = 0,
    ) -> AsyncSubscription:
        """Reads a durable topic as consumer group ``group``: from where the group stands
        (``start=None``), ``"oldest"``, ``"newest"``, an offset, or ``time=NS``. At most
        ``max_unacked`` messages are out unacknowledged (0: the server's default)."""

        async def subscribing() -> Tuple[_Requests, _AsyncSubscriptionCore]:
            core = await self._run("subscribe_group", topic, group, start, time=time, max_unacked=max_unacked)
            assert self._requests is not None
            return self._requests, core

        return AsyncSubscription(subscribing)

    async def call(self, function: str, payload: bytes, timeout: Optional[float] = None, subject: str = "") -> Message:
        """Calls ``function`` and returns its reply, waiting up to ``timeout`` seconds
        (``None``: the server's default). Many calls may be in flight at once."""
        return await self._run("call", function, payload, timeout, subject)

    async def call_oneway(self, function: str, payload: bytes, subject: str = "") -> None:
        """Calls ``function`` without waiting for a reply."""
        await self._run("call_oneway", function, payload, subject)

    async def serve(self, function: str, handler: Handler) -> None:
        """Serves ``function`` with ``handler``: a callable or coroutine function taking the
        request :class:`Message` and returning the reply's payload (bytes or ``None``). An
        exception it raises is the caller's ``HANDLER_ERROR``. Calls are handled concurrently
        on this event loop until :meth:`unserve` or :meth:`close`."""
        if not callable(handler):
            raise TypeError("the handler must be callable")
        if function in self._serving:
            raise ValueError(f"{function!r} is already served by this client")
        calls: _AsyncCalls = await self._run("serve", function)
        assert self._requests is not None
        answering = asyncio.ensure_future(self._answer_calls(self._requests, calls, handler))
        self._serving[function] = (calls, answering)

    @staticmethod
    async def _answer_calls(requests: _Requests, calls: _AsyncCalls, handler: Handler) -> None:
        running: Set["asyncio.Task[None]"] = set()

        async def answer(call: _IncomingCall) -> None:
            try:
                reply: Any = handler(call.message)
                if inspect.isawaitable(reply):
                    reply = await reply
                call.reply(reply)
            except asyncio.CancelledError:
                call.fail("the server's handler was cancelled")
                raise
            except Exception as e:  # the caller gets it, as the handler's error
                call.fail(f"{type(e).__name__}: {e}")

        try:
            while True:
                taken = await requests.run(calls.next)
                if taken is None:
                    break
                for call in taken:
                    task = asyncio.ensure_future(answer(call))
                    running.add(task)
                    task.add_done_callback(running.discard)
            # Unserved: the calls already taken still get their replies.
            await asyncio.gather(*running, return_exceptions=True)
        finally:
            for task in list(running):
                task.cancel()

    async def unserve(self, function: str) -> None:
        """Stops serving ``function``; calls already taken still get their replies. A function
        this client does not serve is left as it is (as with ``Client.unserve``)."""
        serving = self._serving.pop(function, None)
        if serving is None:
            await self._run("unserve", function)
            return
        calls, answering = serving
        try:
            await self._run("unserve", function)
        finally:
            calls.close()
        await answering

    async def close(self) -> None:
        """Ends the connection; tentative takes not acknowledged go back to their queues."""
        for calls, answering in self._serving.values():
            calls.close()
            answering.cancel()
        self._serving.clear()
        self._closed = True
        if self._acks:
            # Takes for good returned to their callers are acknowledged before the connection
            # goes (closed first, it would give them back to their queues).
            await asyncio.wait(list(self._acks), timeout=_CLOSE_ACKS_TIMEOUT)
        if self._core is not None:
            self._core.close()
        if self._requests is not None:
            self._requests.close()

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
