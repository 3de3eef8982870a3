"""The plumbing between the daemon's streams and an HTTP client.

A pool of blocking daemon Clients (`ClientPool`), the choices' latency and token
metrics (`Timing`), several streams merged as their items come (`merged`: the first
error ends them all), and an await cancelled when the client hangs up
(`unless_disconnected`: 499), for a whole answer (`gathered`) or a stream's first item
(`first_of`). Every stream left early is closed here, so its daemon requests are
cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from starlette.requests import Request

from ...ipc.client import Client
from ...ipc.messages import Done, TokenChunk
from .metrics import Metrics
from .openai_errors import ApiError

T = TypeVar("T")


class ClientPool:
    """Idle Clients of the daemon, reused across requests (each used by one thread at once)."""

    def __init__(self, address: str, timeout_s: float = 300.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._idle: queue.SimpleQueue[Client] = queue.SimpleQueue()

    def take(self) -> Client:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            return Client(self.address, timeout_s=self.timeout_s)

    def give(self, client: Client, healthy: bool = True) -> None:
        if healthy:
            self._idle.put(client)
        else:
            client.close()

    def call(self, fn: Callable[[Client], Any]) -> Any:
        client = self.take()
        try:
            result = fn(client)
        except BaseException:
            self.give(client, healthy=False)
            raise
        self.give(client)
        return result


class Timing:
    """Latency and token metrics of one request's choices, measured in the HTTP layer."""

    def __init__(self, metrics: Metrics, t_start: float, n: int) -> None:
        self.metrics = metrics
        self.t_start = t_start
        self.t_last: list[float | None] = [None] * n

    def on(self, index: int, item: TokenChunk | Done) -> None:
        now, m = time.monotonic(), self.metrics
        if isinstance(item, Done):
            m.requests.labels(item.finish_reason).inc()
            m.prompt_tokens.inc(item.prompt_tokens)
            m.generation_tokens.inc(len(item.token_ids))
            m.e2e.observe(now - self.t_start)
            m.queue.observe(item.queue_ms / 1e3)
            return
        last = self.t_last[index]
        if last is None:
            m.ttft.observe(now - self.t_start)
        else:
            m.itl.observe(now - last)
        self.t_last[index] = now


async def after(first: Any, items: AsyncIterator) -> AsyncIterator[Any]:
    """`first` (an item already read, unless None), then the rest of `items`."""
    if first is not None:
        yield first
    async for item in items:
        yield item


async def gathered(request: Request, items: AsyncGenerator, gather: Awaitable[T]) -> T:
    """What `gather` makes of `items` (a request's whole answer); `items` is closed after,
    whatever happens, and a client hanging up first cancels it (ApiError 499)."""
    try:
        return await unless_disconnected(request, gather)
    finally:
        await items.aclose()


async def first_of(request: Request, items: AsyncGenerator) -> Any:
    """A stream's first item (None if it has none), read before its response starts, so
    that an error before any token is a plain JSON error; `items` is closed if it fails."""
    try:
        return await unless_disconnected(request, anext(items, None))
    except BaseException:
        await items.aclose()
        raise


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result; if the client hangs up first, it is cancelled (which closes
    the daemon streams it reads) and ApiError 499 is raised."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
    if work.cancelled():
        raise ApiError(499, "the client closed the request")
    return work.result()


async def merged(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[T, None]:
    """The items of several async iterators as they come. The first error is raised here
    and ends the others; leaving early ends them all (each iterator's own cleanup runs)."""
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()  # (ended, item or error)

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((False, item))
            await queue.put((True, None))
        except Exception as e:  # handed to the reader, which raises it
            await queue.put((True, e))

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            ended, value = await queue.get()
            if not ended:
                yield value
                continue
            running -= 1
            if value is not None:
                raise value
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
