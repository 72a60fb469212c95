"""Petrel: a fast, durable message queue, from Python.

Two ways to use it:

* **Embedded** — the storage engine in this process, no server:
  :class:`Log` (an append-only, crash-safe log of records with dense offsets, consumer
  groups with at-least-once delivery, lookups by offset, time and key) and :class:`Queue`
  (a persistent FIFO shaped like :class:`queue.Queue`).
* **Client** — a connection to ``petrel serve``: :class:`Client` (blocking, thread-safe)
  and :class:`AsyncClient` (asyncio) for queues, topics and reliable reads.

Errors are :class:`PetrelError` and its subclasses, carrying the Rust error's message.
Every call that touches the disk or the network, or waits, releases the GIL.
"""

from __future__ import annotations

import asyncio
import atexit
import builtins
import time
from typing import AsyncIterator, List, Optional

from ._petrel import (
    AsyncCore as _AsyncCore,
    AsyncSubscription as _AsyncSubscription,
    Client,
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
    TooLargeError,
    __version__,
)

__all__ = [
    "AsyncClient",
    "Client",
    "ClosedError",
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
    "TooLargeError",
    "__version__",
]

# A server-side poll waits at most about a second at a time; longer waits loop.
_LONG_POLL = 1.0


def _let_completions_finish() -> None:
    # AsyncClient's awaitables are completed from threads of the native runtime, which hold the
    # GIL for a moment after the coroutine already has its result. At exit, let such a thread
    # finish before the interpreter finalizes: one still inside would abort the process.
    time.sleep(0.05)


_completions_guarded = False


class AsyncClient:
    """An asyncio connection to ``petrel serve`` (the native protocol, default port 22134).

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
    ) -> None:
        self._args = (address, user, password, tls_ca)
        self._core: Optional[_AsyncCore] = None
        self._connecting: Optional[asyncio.Future] = None

    async def connect(self) -> "AsyncClient":
        """Connects now (once); returns the client."""
        await self._client()
        return self

    async def _client(self) -> _AsyncCore:
        if self._core is not None:
            return self._core
        global _completions_guarded
        if not _completions_guarded:
            atexit.register(_let_completions_finish)
            _completions_guarded = True
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(_AsyncCore.connect(*self._args))
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

    async def create_queue(
        self, name: str, durable: bool = True, max_items: int = 0, max_bytes: int = 0, ttl: Optional[float] = None
    ) -> None:
        """Creates a queue (nothing if it exists with this configuration)."""
        await (await self._client()).create_queue(name, durable, max_items, max_bytes, ttl)

    async def remove_queue(self, name: str) -> None:
        await (await self._client()).remove_queue(name)

    async def offer(self, queue: str, payload: bytes, timeout: Optional[float] = None) -> int:
        """Adds a message at the queue's tail; returns its id."""
        return await (await self._client()).offer(queue, payload, timeout)

    async def offer_many(self, queue: str, payloads: List[bytes], timeout: Optional[float] = None) -> int:
        """Adds messages together, all or none; returns the first id."""
        return await (await self._client()).offer_many(queue, payloads, timeout)

    async def poll_many(
        self, queue: str, max: int = 100, timeout: Optional[float] = 0.0, visibility: Optional[float] = None
    ) -> List[Message]:
        """Takes up to ``max`` messages, waiting up to ``timeout`` seconds for the first
        (``None``: until one comes); with ``visibility`` tentatively (see :meth:`ack`)."""
        core = await self._client()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + builtins.max(timeout, 0.0)
        while True:
            wait = _LONG_POLL if deadline is None else builtins.max(min(deadline - loop.time(), _LONG_POLL), 0.0)
            messages = await core.poll_once(queue, max, wait, visibility)
            if messages or (deadline is not None and loop.time() >= deadline):
                return messages

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
        return await (await self._client()).ack(queue, handles)

    async def abort(self, queue: str, handles: List[int]) -> int:
        return await (await self._client()).abort(queue, handles)

    async def create_topic(self, name: str, durable: bool = False) -> None:
        await (await self._client()).create_topic(name, durable)

    async def publish(self, topic: str, payload: bytes) -> int:
        """Publishes to every current subscriber; returns how many it reached."""
        return await (await self._client()).publish(topic, payload)

    async def subscribe(self, topic: str, buffer: int = 0) -> AsyncIterator[Message]:
        """The topic's messages from now on: ``async for message in client.subscribe(t)``.

        Leaving the loop early ends the subscription when the generator is closed; wrap it in
        ``contextlib.aclosing`` to end it at once."""
        subscription: _AsyncSubscription = await (await self._client()).subscribe(topic, buffer)
        try:
            while True:
                message = await subscription.next()
                if message is None:
                    return
                yield message
        finally:
            try:
                await subscription.unsubscribe()
            except PetrelError:
                pass  # the connection ended: so did the subscription

    async def close(self) -> None:
        """Ends the connection; tentative takes not acknowledged go back to their queues."""
        if self._core is not None:
            self._core.close()

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
