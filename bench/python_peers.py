#!/usr/bin/env python3
"""Petrel's Python package beside its Python peers, in one run; prints Markdown tables with ratios.

Run it through ``bench/python_peers.sh`` (which installs what is needed), or directly with a
Python that has ``petrel``, ``persist-queue``, ``diskcache``, ``redis`` and ``nats-py``:

    python bench/python_peers.py --petrel-bin target/release/petrel [--count N] [--json]

Every figure is messages (or calls) per second from the calling Python process; all payloads are
32 random-looking bytes. Each system runs in a fresh directory (embedded) or a fresh queue/key on
servers this script starts on 127.0.0.1 and stops. There is no warm-up: every figure is the
first run of its kind in the process; with ``--rounds R`` each row is repeated R times and every
round is shown (ratios use the median). Petrel always runs first in a row, so the VM's cold-memory
cost (docs/benchmarks.md), if any, falls on Petrel.

1. **Embedded put, then get** (``--count``, default 1,000,000; peers that cannot do ~20,000/s,
   and every row that syncs each operation, use ``--slow-count``, default 50,000 — the figures are
   rates, so they compare; a peer is not slower at 50 k than at 1 M).

   * ``petrel.Queue(path)`` ``put(b)`` / ``get(timeout=0)`` — durability ``none``: a put is in
     the page cache (a memory mapping) when it returns, so it survives ``kill -9`` of the process;
     a power loss keeps what the kernel had written back (recovery cuts a torn tail; a bad frame
     before a good one needs ``petrel log repair``). ``durability="always"``: fdatasync before
     ``put`` returns (and ``get``'s position likewise): survives a power loss.
   * ``persistqueue.Queue`` (file queue, ``autosave=True`` so that a get is persisted as Petrel's
     is): each put pickles the item, ``write()``s it to the chunk file and replaces the ``info``
     file (temp file + ``rename``), fsyncing the chunk file every 100 items (``chunksize``); no
     fsync of ``info`` or of the directory. Survives ``kill -9`` (a half-written item is cut at
     open); a power loss can leave ``info`` pointing past data that never reached the disk. It
     has no batch put and no fsync-each-put setting.
   * ``persistqueue.SQLiteQueue`` (WAL journal; ``auto_commit=True``: one transaction per put
     and per get, which deletes the row). Its default ``synchronous`` is SQLite's default, FULL:
     in WAL mode, an fsync of the WAL at every commit — survives a power loss. Also measured with
     ``PRAGMA synchronous=NORMAL`` on its connection (the comparable setting to Petrel's
     ``none``: no sync at commit; survives ``kill -9``; a power loss loses the last commits, the
     database stays consistent), and batched: ``auto_commit=False`` with ``task_done()`` (the
     commit) every 1,000 puts. Its gets with ``auto_commit=False`` never delete the row (the
     read position is in memory only), so that variant's get is not a consume and is not shown.
   * ``diskcache.Deque`` ``append`` / ``popleft`` (one SQLite transaction each; diskcache's
     defaults are WAL with ``synchronous=NORMAL`` — as above, ``kill -9`` safe, power loss may
     lose the last commits), batched as 1,000 calls in one ``transact()``, and with
     ``sqlite_synchronous=2`` (FULL: fsync per transaction).
   * Extra rows with no peer: ``petrel.Log(path).append(b)`` and ``append_batch`` (1,000 per
     call), reading the log back by iteration, and consuming through a consumer group
     (``poll(max=1000)`` + ``ack``), which is also the batched consume row.

   Peers pickle their items (their default serializer); Petrel stores the bytes as they are.

2. **Client offers and polls** (``--client-count``, default 100,000 per row; rows that wait for
   each answer before the next request use ``--latency-count``, default 20,000): a Petrel server
   (``petrel serve``, its default durability ``none``; the queue created with ``durable=True``:
   an answered offer is in the page cache, survives ``kill -9`` of the server, not a power loss)
   against Debian's Redis with ``appendonly yes, appendfsync everysec`` (the AOF is written
   before the reply, so an answered LPUSH survives ``kill -9``; fsync once a second, so a power
   loss loses about the last second) and with ``appendonly no`` (memory only: ``kill -9`` loses
   everything; RDB snapshots off). Rows: one message per request with 100 in flight (Petrel's
   ``AsyncClient``, 100 coroutines each awaiting its own offer in turn; redis-py pipelines of 100
   LPUSH); the blocking ``petrel.Client`` shared by 8 threads against redis-py from 8 threads;
   100 messages per request, one request at a time (blocking ``Client.offer_many`` / ``LPUSH``
   with 100 values) and 8 at a time (``AsyncClient.offer_many`` from 8 coroutines / redis-py
   pipelines of 8 such LPUSH); and the consume side the same ways (``poll`` / ``RPOP``, ``poll_many(100)`` /
   ``RPOP key 100``, and a blocking poll one at a time, ``poll(timeout=1)`` / ``BRPOP``).

3. **Request/reply** (``--rr-count``, default 50,000 per row; one at a time: ``--latency-count``),
   32 B echoed back, the server side
   in this process on its own connection: Petrel ``AsyncClient.call`` served by
   ``AsyncClient.serve`` with an ``async def`` handler, one call at a time and 100 in flight,
   against nats-py core request/reply (``nc.request``; a subscriber on a second connection
   answering with ``msg.respond``) on nats-server; and, with no peer, the blocking
   ``Client.call`` / ``Client.serve`` (plain function) from 1 and 8 threads. Neither keeps
   anything on disk. One call to each system before timing checks that its responder is
   reachable. Petrel's side is skipped (NATS still measured) when the installed ``petrel`` has
   no ``Client.call``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional

import petrel

PAYLOAD = bytes(range(7, 7 + 32))  # 32 B
BATCH = 1000  # embedded batch size
DEPTH = 100  # client requests in flight / pipeline depth / values per request
THREADS = 8
PIPE = 8  # batches of DEPTH in flight


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def rate(n: int, fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return n / (time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------
# Results


class Row:
    """One line of a table: a figure per system (a list of rates, one per round)."""

    def __init__(self, section: str, path: str, ratio_to: Optional[List[str]] = None) -> None:
        self.section = section
        self.path = path
        self.figures: Dict[str, List[float]] = {}
        self.counts: Dict[str, int] = {}
        self.notes: Dict[str, str] = {}
        self.ratio_to = ratio_to  # the peer columns the ratio is taken against (None: all)

    def add(self, system: str, count: int, value: float) -> None:
        self.figures.setdefault(system, []).append(value)
        self.counts[system] = count

    def value(self, system: str) -> Optional[float]:
        values = self.figures.get(system)
        return statistics.median(values) if values else None

    def ratio(self) -> Optional[tuple]:
        petrel_value = self.value("petrel")
        peers = [(self.value(s), s) for s in self.figures if s != "petrel" and (self.ratio_to is None or s in self.ratio_to)]
        peers = [(v, s) for v, s in peers if v]
        if petrel_value is None or not peers:
            return None
        best, name = max(peers)
        return petrel_value / best, name


def fmt(values: Optional[List[float]], count: Optional[int], default_count: int) -> str:
    if not values:
        return "—"
    text = " / ".join(f"{v:,.0f}" for v in values)
    if count is not None and count != default_count:
        text += f" ({count // 1000:,} k)" if count >= 1000 else f" ({count})"
    return text


def table(rows: List[Row], columns: List[tuple], default_count: int, ratio_title: str) -> str:
    """`columns`: (key, title, short name) per system, Petrel's first."""
    head = "| path | " + " | ".join(title for _, title, _ in columns) + f" | {ratio_title} |"
    lines = [head, "|" + "---|" * (len(columns) + 2)]
    short = {key: name for key, _, name in columns}
    for row in rows:
        cells = [fmt(row.figures.get(key), row.counts.get(key), default_count) for key, _, _ in columns]
        r = row.ratio()
        ratio = f"**{r[0]:.1f}×** ({short[r[1]]})" if r else "—"
        lines.append(f"| {row.path} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 1. Embedded


def put_loop(put: Callable, n: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(n):
            put(PAYLOAD)

    return run


def get_loop(get: Callable, n: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(n):
            if get() != PAYLOAD:
                raise RuntimeError("wrong or missing item")

    return run


def batch_put_loop(put_many: Callable, n: int) -> Callable[[], None]:
    chunk = [PAYLOAD] * BATCH

    def run() -> None:
        for _ in range(n // BATCH):
            put_many(chunk)

    return run


class Embedded:
    """Each method measures one system in a fresh directory: returns {op: rate}."""

    def __init__(self, base: str) -> None:
        self.base = base

    @contextlib.contextmanager
    def fresh(self):
        path = tempfile.mkdtemp(dir=self.base)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def petrel_queue(self, n: int, durability: str) -> dict:
        with self.fresh() as path:
            q = petrel.Queue(os.path.join(path, "q"), durability=durability)
            put = rate(n, put_loop(q.put, n))
            get = rate(n, get_loop(lambda: q.get(timeout=0), n))
            assert q.get(timeout=0) is None
            q.close()
        return {"put": put, "get": get}

    def petrel_queue_batched(self, n: int) -> dict:
        with self.fresh() as path:
            q = petrel.Queue(os.path.join(path, "q"))
            put = rate(n, batch_put_loop(q.put_many, n))
            assert len(q) == n
            q.close()
        return {"put": put}

    def petrel_log(self, n: int) -> dict:
        result = {}
        with self.fresh() as path:
            lg = petrel.Log(os.path.join(path, "log"))
            result["append"] = rate(n, put_loop(lg.append, n))

            def read() -> None:
                seen = 0
                for record in lg:
                    seen += 1
                assert seen == n

            result["read"] = rate(n, read)
            lg.close()
        with self.fresh() as path:
            lg = petrel.Log(os.path.join(path, "log"))
            result["append_batch"] = rate(n, batch_put_loop(lg.append_batch, n))
            group = lg.group("consumer")

            def consume() -> None:
                seen = 0
                while seen < n:
                    records = group.poll(max=BATCH, timeout=0)
                    if not records:
                        raise RuntimeError("group ran dry early")
                    for record in records:  # acks are one offset each
                        group.ack(record.offset)
                    seen += len(records)

            result["group_poll"] = rate(n, consume)
            group.close()
            lg.close()
        return result

    def pq_file(self, n: int) -> dict:
        import persistqueue

        with self.fresh() as path:
            q = persistqueue.Queue(os.path.join(path, "q"), autosave=True)
            put = rate(n, put_loop(q.put, n))
            get = rate(n, get_loop(lambda: q.get(block=False), n))
            q.headf.close()  # it has no close(); its files, before the directory goes
            q.tailf.close()
        return {"put": put, "get": get}

    def pq_sqlite(self, n: int, synchronous: Optional[str]) -> dict:
        import persistqueue

        with self.fresh() as path:
            q = persistqueue.SQLiteQueue(os.path.join(path, "q"), auto_commit=True)
            if synchronous:
                q._putter.execute(f"PRAGMA synchronous={synchronous}")  # its one connection
            self.sqlite_synchronous = q._putter.execute("PRAGMA synchronous").fetchone()[0]
            put = rate(n, put_loop(q.put, n))
            get = rate(n, get_loop(lambda: q.get(block=False), n))
            q.close()
        return {"put": put, "get": get}

    def pq_sqlite_batched(self, n: int) -> dict:
        import persistqueue

        with self.fresh() as path:
            q = persistqueue.SQLiteQueue(os.path.join(path, "q"), auto_commit=False)
            q._putter.execute("PRAGMA synchronous=NORMAL")

            def run() -> None:
                for _ in range(n // BATCH):
                    for _ in range(BATCH):
                        q.put(PAYLOAD)
                    q.task_done()  # the commit

            put = rate(n, run)
            assert q.qsize() == n
            q.close()
        return {"put": put}

    def diskcache_deque(self, n: int, synchronous: int = 1) -> dict:
        import diskcache

        with self.fresh() as path:
            cache = diskcache.Cache(os.path.join(path, "d"), eviction_policy="none", sqlite_synchronous=synchronous)
            dq = diskcache.Deque.fromcache(cache)
            put = rate(n, put_loop(dq.append, n))
            get = rate(n, get_loop(dq.popleft, n))
            cache.close()
        return {"put": put, "get": get}

    def diskcache_batched(self, n: int) -> dict:
        import diskcache

        with self.fresh() as path:
            dq = diskcache.Deque(directory=os.path.join(path, "d"))

            def put() -> None:
                for _ in range(n // BATCH):
                    with dq.transact():
                        for _ in range(BATCH):
                            dq.append(PAYLOAD)

            def get() -> None:
                for _ in range(n // BATCH):
                    with dq.transact():
                        for _ in range(BATCH):
                            if dq.popleft() != PAYLOAD:
                                raise RuntimeError("wrong item")

            result = {"put": rate(n, put), "get": rate(n, get)}
            dq.cache.close()
        return result


def embedded(args) -> List[Row]:
    e = Embedded(args.dir)
    n, slow = args.count, min(args.slow_count, args.count)
    rows = {
        "put": Row("embedded", "put, 1 per call — survives kill -9"),
        "get": Row("embedded", "get, 1 per call — survives kill -9"),
        "put_batch": Row("embedded", f"put, {BATCH:,} per call or transaction — survives kill -9"),
        "get_batch": Row("embedded", f"get, {BATCH:,} per call or transaction — survives kill -9 ¹"),
        "put_sync": Row("embedded", "put, 1 per call — fsync each: survives a power loss"),
        "get_sync": Row("embedded", "get, 1 per call — fsync each: survives a power loss"),
        "append": Row("embedded", "Petrel `Log.append`, 1 per call (`none`)"),
        "append_batch": Row("embedded", f"Petrel `Log.append_batch`, {BATCH:,} per call (`none`)"),
        "read": Row("embedded", "Petrel `Log` read back (iteration)"),
    }

    def record(pairs: dict, system: str, count: int, result: dict) -> None:
        for op, key in pairs.items():
            if op in result:
                rows[key].add(system, count, result[op])

    for r in range(args.rounds):
        tag = f" (round {r + 1})" if args.rounds > 1 else ""
        log(f"embedded: petrel{tag}…")
        record({"put": "put", "get": "get"}, "petrel", n, e.petrel_queue(n, "none"))
        record({"put": "put_batch"}, "petrel", n, e.petrel_queue_batched(n))
        record({"append": "append", "append_batch": "append_batch", "read": "read", "group_poll": "get_batch"},
               "petrel", n, e.petrel_log(n))
        record({"put": "put_sync", "get": "get_sync"}, "petrel", slow, e.petrel_queue(slow, "always"))
        log(f"embedded: persist-queue file{tag}…")
        record({"put": "put", "get": "get"}, "pq_file", slow, e.pq_file(slow))
        log(f"embedded: persist-queue SQLite{tag}…")
        record({"put": "put", "get": "get"}, "pq_sqlite", slow, e.pq_sqlite(slow, "NORMAL"))
        record({"put": "put_batch"}, "pq_sqlite", slow, e.pq_sqlite_batched(slow))
        record({"put": "put_sync", "get": "get_sync"}, "pq_sqlite", slow, e.pq_sqlite(slow, None))
        if e.sqlite_synchronous != 2:
            log(f"note: SQLiteQueue's default synchronous here is {e.sqlite_synchronous}, not 2 (FULL)")
        log(f"embedded: diskcache{tag}…")
        record({"put": "put", "get": "get"}, "diskcache", slow, e.diskcache_deque(slow))
        record({"put": "put_batch", "get": "get_batch"}, "diskcache", slow, e.diskcache_batched(slow))
        record({"put": "put_sync", "get": "get_sync"}, "diskcache", slow, e.diskcache_deque(slow, synchronous=2))
    return list(rows.values())


EMBEDDED_COLUMNS = [
    ("petrel", "Petrel `Queue` (`none` / `always`)", "Petrel"),
    ("pq_file", "persist-queue file `Queue`", "persist-queue file"),
    ("pq_sqlite", "persist-queue `SQLiteQueue` (NORMAL / FULL)", "SQLiteQueue"),
    ("diskcache", "diskcache `Deque` (NORMAL / FULL)", "diskcache"),
]


# ---------------------------------------------------------------------------------------------
# Servers


def wait_port(port: int, proc: subprocess.Popen, name: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{name} did not listen on port {port}")


@contextlib.contextmanager
def server(name: str, argv: List[str], port: int):
    log(f"starting {name}: {' '.join(argv)}")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, proc, name)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------
# 2. Client offers and polls


async def in_flight(n: int, depth: int, op: Callable) -> None:
    """`depth` coroutines, each awaiting its own `op()` in turn, `n` in all."""

    async def worker(k: int) -> None:
        for _ in range(k):
            await op()

    share, extra = divmod(n, depth)
    await asyncio.gather(*(worker(share + (i < extra)) for i in range(depth)))


def threaded(n: int, threads: int, op: Callable) -> None:
    share, extra = divmod(n, threads)

    def worker(k: int) -> None:
        for _ in range(k):
            op()

    pool = [threading.Thread(target=worker, args=(share + (i < extra),)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


def client_rows() -> Dict[str, Row]:
    return {
        "offer": Row("client", f"offer, 1 per request, {DEPTH} in flight (async / pipeline)"),
        "offer_threads": Row("client", f"offer, 1 per request, blocking client, {THREADS} threads"),
        "offer_batch": Row("client", f"offer, {DEPTH} per request, 1 in flight (blocking)"),
        "offer_batch_async": Row("client", f"offer, {DEPTH} per request, {PIPE} in flight (async / pipeline)"),
        "poll": Row("client", f"poll, 1 per request, {DEPTH} in flight (async / pipeline)"),
        "poll_batch": Row("client", f"poll, up to {DEPTH} per request, 1 in flight (blocking)"),
        "poll_blocking": Row("client", "blocking poll, 1 at a time (`poll(timeout=1)` / `BRPOP`)"),
    }


def petrel_client(addr: str, n: int, slow: int, round_no: int, rows: Dict[str, Row]) -> None:
    names = [f"bench-{round_no}-{k}" for k in ("a", "b", "c", "d")]

    async def run_async() -> None:
        c = petrel.AsyncClient(addr)
        for name in names:
            await c.create_queue(name, durable=True)
        rows["offer"].add("petrel", n, await arate(n, in_flight(n, DEPTH, lambda: c.offer(names[0], PAYLOAD))))

        async def poll() -> None:
            if await c.poll(names[0]) is None:
                raise RuntimeError("queue ran dry early")

        rows["poll"].add("petrel", n, await arate(n, in_flight(n, DEPTH, poll)))
        chunk = [PAYLOAD] * DEPTH
        rows["offer_batch_async"].add("petrel", n, await arate(n, in_flight(n // DEPTH, PIPE,
                                                                             lambda: c.offer_many(names[3], chunk))))
        await c.close()

    asyncio.run(run_async())
    with petrel.Client(addr) as c:
        rows["offer_threads"].add("petrel", n, rate(n, lambda: threaded(n, THREADS, lambda: c.offer(names[1], PAYLOAD))))
        chunk = [PAYLOAD] * DEPTH
        rows["offer_batch"].add("petrel", n, rate(n, lambda: [c.offer_many(names[2], chunk) for _ in range(n // DEPTH)]))

        def drain(name: str, k: int, batch: int, timeout: float) -> None:
            seen = 0
            while seen < k:
                got = c.poll_many(name, max=min(batch, k - seen), timeout=timeout)
                if not got:
                    raise RuntimeError("queue ran dry early")
                seen += len(got)

        rows["poll_batch"].add("petrel", n, rate(n, lambda: drain(names[1], n, DEPTH, 0.0)))

        def blocking() -> None:
            for _ in range(slow):
                if c.poll(names[2], timeout=1) is None:
                    raise RuntimeError("queue ran dry early")

        rows["poll_blocking"].add("petrel", slow, rate(slow, blocking))
        for name in names:
            c.remove_queue(name)


async def arate(n: int, coro) -> float:
    start = time.perf_counter()
    await coro
    return n / (time.perf_counter() - start)


def redis_client(port: int, system: str, n: int, slow: int, round_no: int, rows: Dict[str, Row]) -> None:
    import redis

    r = redis.Redis(host="127.0.0.1", port=port)
    keys = [f"bench-{round_no}-{k}" for k in ("a", "b", "c", "d")]

    def pipelined(cmd: Callable) -> None:
        for _ in range(n // DEPTH):
            p = r.pipeline(transaction=False)
            for _ in range(DEPTH):
                cmd(p)
            replies = p.execute()
            if replies[-1] is None:
                raise RuntimeError("list ran dry early")

    rows["offer"].add(system, n, rate(n, lambda: pipelined(lambda p: p.lpush(keys[0], PAYLOAD))))
    rows["offer_threads"].add(system, n, rate(n, lambda: threaded(n, THREADS, lambda: r.lpush(keys[1], PAYLOAD))))
    values = [PAYLOAD] * DEPTH
    rows["offer_batch"].add(system, n, rate(n, lambda: [r.lpush(keys[2], *values) for _ in range(n // DEPTH)]))

    def pipelined_batches() -> None:
        for _ in range(n // DEPTH // PIPE):
            p = r.pipeline(transaction=False)
            for _ in range(PIPE):
                p.lpush(keys[3], *values)
            p.execute()

    rows["offer_batch_async"].add(system, n, rate(n, pipelined_batches))
    rows["poll"].add(system, n, rate(n, lambda: pipelined(lambda p: p.rpop(keys[0]))))

    def drain() -> None:
        seen = 0
        while seen < n:
            got = r.rpop(keys[1], min(DEPTH, n - seen))
            if not got:
                raise RuntimeError("list ran dry early")
            seen += len(got)

    rows["poll_batch"].add(system, n, rate(n, drain))

    def blocking() -> None:
        for _ in range(slow):
            if r.brpop(keys[2], timeout=1) is None:
                raise RuntimeError("list ran dry early")

    rows["poll_blocking"].add(system, slow, rate(slow, blocking))
    r.delete(*keys)
    r.close()


def start_petrel(stack: contextlib.ExitStack, args, ports: dict) -> None:
    """A `petrel serve` in a temporary data directory, stopped and removed with `stack`."""
    petrel_dir = tempfile.mkdtemp(dir=args.dir)
    stack.callback(shutil.rmtree, petrel_dir, True)
    stack.enter_context(server("petrel", [args.petrel_bin, "serve", "--data", petrel_dir,
                                          "--native-addr", f"127.0.0.1:{ports['petrel']}",
                                          "--memcache-addr", "off", "--http-addr", "off"], ports["petrel"]))


def client(args, ports: dict) -> List[Row]:
    rows = client_rows()
    n, slow = args.client_count, min(args.latency_count, args.client_count)
    with contextlib.ExitStack() as stack:
        start_petrel(stack, args, ports)
        redis_servers = []
        if args.redis_server:
            for system, aof in (("redis_aof", ["--appendonly", "yes", "--appendfsync", "everysec"]),
                                ("redis_mem", ["--appendonly", "no"])):
                d = tempfile.mkdtemp(dir=args.dir)
                stack.callback(shutil.rmtree, d, True)
                stack.enter_context(server(system, [args.redis_server, "--port", str(ports[system]), "--bind", "127.0.0.1",
                                                    "--dir", d, "--save", "", *aof], ports[system]))
                redis_servers.append(system)
        else:
            log("redis-server not found: Redis columns skipped")
        for r in range(args.rounds):
            tag = f" (round {r + 1})" if args.rounds > 1 else ""
            log(f"client: petrel{tag}…")
            petrel_client(f"127.0.0.1:{ports['petrel']}", n, slow, r, rows)
            for system in redis_servers:
                log(f"client: {system}{tag}…")
                redis_client(ports[system], system, n, slow, r, rows)
    for row in rows.values():
        row.ratio_to = ["redis_aof"]
    return list(rows.values())


CLIENT_COLUMNS = [
    ("petrel", "Petrel (durable queue, `none`)", "Petrel"),
    ("redis_aof", "Redis (AOF, fsync everysec)", "Redis AOF"),
    ("redis_mem", "Redis (no AOF)", "Redis no AOF"),
]


# ---------------------------------------------------------------------------------------------
# 3. Request/reply


async def ready(call: Callable, what: str) -> None:
    """One call that must succeed (retried for up to 5 s while the responder registers)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            reply = await call()
            break
        except Exception as e:  # not served yet: petrel's FUNCTION_NOT_FOUND, nats' NoResponders
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: responder not reachable: {e}") from e
            await asyncio.sleep(0.02)
    payload = getattr(reply, "payload", None) or getattr(reply, "data", None)
    if payload != PAYLOAD:
        raise RuntimeError(f"{what}: wrong reply {payload!r}")


def check_reply(reply) -> None:
    if reply.payload != PAYLOAD:
        raise RuntimeError("wrong reply")


def petrel_rr(addr: str, n: int, one: int, rows: Dict[str, Row]) -> None:
    async def run_async() -> None:
        responder, caller = petrel.AsyncClient(addr), petrel.AsyncClient(addr)

        async def echo(message):
            return message.payload

        # serve may register and return, or run until the connection ends: either works here.
        serving = asyncio.ensure_future(responder.serve("bench-echo", echo))
        await ready(lambda: caller.call("bench-echo", PAYLOAD, timeout=1.0), "petrel async serve")

        async def call() -> None:
            check_reply(await caller.call("bench-echo", PAYLOAD))

        rows["one"].add("petrel", one, await arate(one, in_flight(one, 1, call)))
        rows["many"].add("petrel", n, await arate(n, in_flight(n, DEPTH, call)))
        await caller.close()
        await responder.close()
        if not serving.done():
            serving.cancel()
        with contextlib.suppress(BaseException):
            await serving

    asyncio.run(run_async())

    responder, caller = petrel.Client(addr), petrel.Client(addr)
    serving = threading.Thread(target=responder.serve, args=("bench-echo-sync", lambda m: m.payload), daemon=True)
    serving.start()

    async def sync_ready() -> None:
        await ready(lambda: asyncio.to_thread(caller.call, "bench-echo-sync", PAYLOAD, 1.0), "petrel serve")

    asyncio.run(sync_ready())
    call = lambda: check_reply(caller.call("bench-echo-sync", PAYLOAD))  # noqa: E731
    rows["sync_one"].add("petrel", one, rate(one, lambda: threaded(one, 1, call)))
    rows["sync_many"].add("petrel", n, rate(n, lambda: threaded(n, THREADS, call)))
    caller.close()
    responder.close()
    serving.join(timeout=2)


def nats_rr(port: int, n: int, one: int, rows: Dict[str, Row]) -> None:
    import nats

    async def run() -> None:
        url = f"nats://127.0.0.1:{port}"
        responder, caller = await nats.connect(url), await nats.connect(url)

        async def echo(msg) -> None:
            await msg.respond(msg.data)

        await responder.subscribe("bench.echo", cb=echo)
        await responder.flush()
        await ready(lambda: caller.request("bench.echo", PAYLOAD, timeout=1.0), "nats")

        async def call() -> None:
            reply = await caller.request("bench.echo", PAYLOAD, timeout=10.0)
            if reply.data != PAYLOAD:
                raise RuntimeError("wrong reply")

        rows["one"].add("nats", one, await arate(one, in_flight(one, 1, call)))
        rows["many"].add("nats", n, await arate(n, in_flight(n, DEPTH, call)))
        await caller.close()
        await responder.close()

    asyncio.run(run())


def request_reply(args, ports: dict) -> List[Row]:
    rows = {
        "one": Row("rr", "call, 1 at a time (asyncio)"),
        "many": Row("rr", f"call, {DEPTH} in flight (asyncio)"),
        "sync_one": Row("rr", "Petrel blocking `Client.call`, 1 thread"),
        "sync_many": Row("rr", f"Petrel blocking `Client.call`, {THREADS} threads"),
    }
    has_call = hasattr(petrel.Client, "call")
    n, one = args.rr_count, min(args.latency_count, args.rr_count)
    with contextlib.ExitStack() as stack:
        start_petrel(stack, args, ports)
        if args.nats_server:
            stack.enter_context(server("nats", [args.nats_server, "-a", "127.0.0.1", "-p", str(ports["nats"])], ports["nats"]))
        else:
            log("nats-server not found: NATS column skipped")
        for r in range(args.rounds):
            tag = f" (round {r + 1})" if args.rounds > 1 else ""
            if has_call:
                log(f"request/reply: petrel{tag}…")
                petrel_rr(f"127.0.0.1:{ports['petrel']}", n, one, rows)
            if args.nats_server:
                log(f"request/reply: nats{tag}…")
                nats_rr(ports["nats"], n, one, rows)
    return list(rows.values())


RR_COLUMNS = [("petrel", "Petrel `call` / `serve`", "Petrel"), ("nats", "NATS core request/reply", "NATS")]


# ---------------------------------------------------------------------------------------------
# Output


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def versions(args) -> Dict[str, str]:
    found = {"python": platform.python_version()}
    for package in ("petrel", "persist-queue", "diskcache", "redis", "nats-py"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[package] = importlib.metadata.version(package)
    for name, argv in (("redis-server", [args.redis_server, "--version"]), ("nats-server", [args.nats_server, "--version"])):
        if argv[0]:
            with contextlib.suppress(OSError):
                found[name] = subprocess.run(argv, capture_output=True, text=True).stdout.split("\n")[0].strip()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=1_000_000, help="embedded messages per row (default 1,000,000)")
    parser.add_argument("--slow-count", type=int, default=50_000,
                        help="messages for embedded peers and rows that sync every operation (default 50,000)")
    parser.add_argument("--client-count", type=int, default=100_000, help="client messages per row (default 100,000)")
    parser.add_argument("--rr-count", type=int, default=50_000, help="calls per request/reply row (default 50,000)")
    parser.add_argument("--latency-count", type=int, default=20_000,
                        help="messages or calls for the client rows that do one at a time (default 20,000)")
    parser.add_argument("--rounds", type=int, default=1, help="times each row is measured (default 1)")
    parser.add_argument("--only", choices=["embedded", "client", "rr"], action="append", help="run only these parts")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of tables")
    parser.add_argument("--petrel-bin", default=os.environ.get("PETREL_BIN") or shutil.which("petrel"))
    parser.add_argument("--redis-server", default=os.environ.get("REDIS_SERVER") or shutil.which("redis-server"))
    parser.add_argument("--nats-server", default=os.environ.get("NATS_SERVER") or shutil.which("nats-server"))
    parser.add_argument("--port-base", type=int, default=23100, help="servers listen on 127.0.0.1 from here (default 23100)")
    parser.add_argument("--dir", default=None, help="where the temporary data goes (default: $TMPDIR)")
    args = parser.parse_args()
    parts = args.only or ["embedded", "client", "rr"]
    if ("client" in parts or "rr" in parts) and not args.petrel_bin:
        parser.error("the client parts need the petrel binary: --petrel-bin or PETREL_BIN")
    base = args.dir or tempfile.gettempdir()
    args.dir = tempfile.mkdtemp(prefix="petrel-pybench-", dir=base)
    ports = {"petrel": args.port_base + 1, "redis_aof": args.port_base + 2, "redis_mem": args.port_base + 3,
             "nats": args.port_base + 4}

    started = time.monotonic()
    sections = []
    skipped: List[str] = []
    try:
        if "embedded" in parts:
            sections.append(("Embedded (operations/s)", embedded(args), EMBEDDED_COLUMNS, args.count,
                             "Petrel ÷ fastest peer"))
        if "client" in parts:
            sections.append(("Client, 32 B messages (messages/s)", client(args, ports), CLIENT_COLUMNS,
                             args.client_count, "Petrel ÷ Redis (AOF)"))
        if "rr" in parts:
            if not hasattr(petrel.Client, "call"):
                skipped.append("request/reply: Petrel skipped, this `petrel` package has no `Client.call` (call/serve)")
                log(skipped[-1])
            rows = request_reply(args, ports)
            if any(row.figures for row in rows):
                sections.append(("Request/reply, 32 B echoed (calls/s)", rows, RR_COLUMNS, args.rr_count,
                                 "Petrel ÷ NATS"))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    elapsed = time.monotonic() - started

    info = {"cpu": cpu_name(), "cpus": os.cpu_count(), "kernel": platform.release(), "versions": versions(args),
            "rounds": args.rounds, "seconds": round(elapsed, 1)}
    if args.json:
        out = dict(info, skipped=skipped, rows=[{"section": row.section, "path": row.path, "figures": row.figures, "counts": row.counts,
                                "ratio": row.ratio()[0] if row.ratio() else None,
                                "ratio_to": row.ratio()[1] if row.ratio() else None}
                               for _, rows, _, _, _ in sections for row in rows])
        print(json.dumps(out, indent=1))
        return
    print(f"CPU: {info['cpu']} ({info['cpus']} logical CPUs), Linux {info['kernel']}")
    print("Versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    print(f"{args.rounds} round(s), no warm-up (every figure includes the first run); {elapsed:.0f} s in all. "
          "Figures in parentheses were measured on that many messages instead of the section's count.")
    for title, rows, columns, count, ratio_title in sections:
        print(f"\n### {title}, {count:,} per row\n")
        print(table(rows, columns, count, ratio_title))
    for line in skipped:
        print(f"\n{line}")
    if "embedded" in parts:
        print(f"\n¹ Petrel: `Log` consumer group `poll(max={BATCH})` + an `ack` per record (the queue's mechanism; `Queue` has no "
              f"get_many); diskcache: {BATCH:,} `popleft` in one `transact()`. persist-queue's batched SQLiteQueue "
              "(auto_commit=False) does not delete on get, so it has no comparable figure.")


if __name__ == "__main__":
    main()
