"""The HTTP front end's state, and what its routes share.

`Frontend` holds the config, the daemon's clients (the async one every request
streams over; a pool of blocking ones for /metrics' stats), the metrics and the
Responses API's store. `run` streams a parsed request's choices from the daemon,
all together, refusing with 429 past `max_queue` choices in flight and cancelling
them all when left early; a daemon's error comes out as an ApiError.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

from ...ipc.client import DaemonUnavailable, RequestError
from ...ipc.messages import Done, HealthReply, ProtocolError, TokenChunk
from ..model.fim import FimTokens
from .async_client import AsyncClient
from .http_config import HttpConfig
from .http_streams import ClientPool, Timing, merged
from .metrics import Metrics
from .openai_api import ParsedRequest
from .openai_errors import ApiError, api_error, bad, renamed, too_large
from .responses_store import ResponseStore

T = TypeVar("T")


class Frontend:
    """The app's state (config, daemon clients, metrics, the response store), and the
    helpers every route shares."""

    def __init__(self, config: HttpConfig, daemon_address: str) -> None:
        self.config = config
        self.client = AsyncClient(daemon_address)
        self.pool = ClientPool(daemon_address)  # blocking Clients, for /metrics' stats
        self.num_in_flight = 0
        self._sizes: HealthReply | None = None
        self.metrics = Metrics(lambda: self.pool.call(lambda c: c.stats()), config.model_name)
        megabytes = config.responses_store_mb
        self.stored = ResponseStore(megabytes << 20) if megabytes else None

    # -- the streams of one request ------------------------------------------------------

    async def run(
        self, parsed: ParsedRequest
    ) -> AsyncGenerator[tuple[int, TokenChunk | Done], None]:
        """(choice index, item) as the daemon sends them, for every choice together (a
        batch's prompts run as requests of their own, side by side); raises ApiError for
        a daemon error, which ends them all. Leaving early cancels every choice."""
        total = parsed.num_choices
        if self.num_in_flight + total > self.config.max_queue:
            raise ApiError(429, f"the queue is full ({self.config.max_queue} requests); "
                           "retry later", code="busy")  # fmt: skip
        self.num_in_flight += total
        try:
            streams = [self._choices(prompt, parsed, i * parsed.n)
                       for i, prompt in enumerate(parsed.prompts)]  # fmt: skip
            items = streams[0] if len(streams) == 1 else merged(streams)
            try:
                async for item in items:
                    yield item
            finally:  # now, not when collected: closing them cancels the daemon requests
                await items.aclose()
        finally:
            self.num_in_flight -= total

    async def _choices(
        self, prompt: Any, parsed: ParsedRequest, first: int
    ) -> AsyncGenerator[tuple[int, TokenChunk | Done], None]:
        """One prompt's n choices, indexed from `first`."""
        options = parsed.options
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], dict):
            options = {k: v for k, v in options.items() if k != "add_special_tokens"}  # ids
        stream = self.client.stream(prompt, **options)
        try:
            async for item in stream:
                yield first + item.index, item
        # ProtocolError: the request message refused before it is sent (a value of the
        # wrong type, or an integer msgpack cannot carry), as the daemon would refuse it
        except (RequestError, ProtocolError, DaemonUnavailable) as e:
            error = api_error(e, embeds="prompt_table" in parsed.options)
            raise renamed(error, parsed.param_names) from None
        finally:
            await stream.aclose()

    # -- what the routes share ---------------------------------------------------------

    def check_model(self, model: object) -> None:
        if model is not None and not isinstance(model, str):
            raise bad("model", f"must be a string (the served model's name); got {model!r:.60}")
        if model is not None and model != self.config.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this daemon "
                           f"serves {self.config.model_name!r}", param="model",
                           code="model_not_found")  # fmt: skip

    def set_reasoning_parser(self, parsed: ParsedRequest) -> None:
        """A chat's reasoning parser: the server's, unless the request asks for none
        (separate_reasoning false) or its tool choice holds the answer to a grammar."""
        if (
            parsed.kind == "chat"
            and parsed.separate_reasoning
            and parsed.tool_mode not in ("named", "required")
        ):
            parsed.reasoning_parser = self.config.reasoning_parser

    async def read_json(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        if (
            declared is not None
            and declared.isdigit()
            and int(declared) > self.config.max_body_bytes
        ):
            raise too_large(int(declared), self.config.max_body_bytes)
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > self.config.max_body_bytes:
                raise too_large(len(body), self.config.max_body_bytes)
        try:
            return json.loads(body)
        except ValueError as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, "the body's JSON is nested too deeply") from None

    async def vocab_size(self) -> int:
        """The model's vocabulary size (the first table id), asked of the daemon once."""
        return (await self.model_sizes()).vocab_size

    async def fim_tokens(self) -> FimTokens | None:
        """The model's fill-in-the-middle tokens (fim.py), or None: it has none (a
        daemon's error as an ApiError)."""
        fim = (await answered(self.model_sizes())).fim
        return None if fim is None else FimTokens.from_wire(fim)

    async def model_sizes(self, timeout_s: float = 10) -> HealthReply:
        """The daemon's health reply, asked once: its model's fixed sizes."""
        if self._sizes is None:
            self._sizes = await self.client.health(timeout_s=timeout_s)
        return self._sizes

    async def collect(self, items: AsyncIterator, timing: Timing, n: int) -> list[Done]:
        dones: list[Done | None] = [None] * n
        async for index, item in items:
            timing.on(index, item)
            if isinstance(item, Done):
                dones[index] = item
        assert all(d is not None for d in dones), dones
        return dones  # type: ignore[return-value]


async def answered(awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result (a daemon call); the daemon's error as an ApiError."""
    try:
        return await awaitable
    except (RequestError, ProtocolError, DaemonUnavailable) as e:
        raise api_error(e) from None
