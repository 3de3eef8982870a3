"""The OpenAI-compatible HTTP front end: a Starlette app served by uvicorn on its own
thread (and asyncio loop) inside the daemon process.

The app talks to the engine through the daemon's own socket, as an in-process
client speaking the same protocol as `ipc.Client` (`async_client.AsyncClient`, on
the HTTP thread's event loop), so both front ends share one protocol and one set of
limits and validation. Each request streams over a pooled connection of its own (its
n choices too: the daemon runs them, and their replies carry their index); the
daemon's replies are read by the event loop itself, with no thread between the
socket and the response. At most `max_queue` choices are in flight
(more get 429 here, before the daemon is asked). A client that disconnects cancels
its request (Cancel is sent; the daemon frees the request's blocks).

Guarantees: every route but /health needs the API key when one is set (compared
in constant time); every error is OpenAI's JSON error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import json
import logging
import queue
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ...ipc.client import Client, DaemonUnavailable, RequestError
from ...ipc.messages import (
    SAMPLING_FIELDS,
    Done,
    Generate,
    HealthReply,
    ProtocolError,
    TokenChunk,
)
from .async_client import AsyncClient
from .http_config import HttpConfig
from .metrics import Metrics
from .openai_api import ParsedRequest, parse_detokenize, parse_request, parse_tokenize
from .openai_errors import OPENAI_CODE, STATUS_OF_CODE, ApiError
from .openai_responses import StreamBuilder, new_id, response
from .responses_answer import EventStream, new_response_id
from .responses_answer import answer as responses_answer
from .responses_api import ResponsesRequest, parse_responses, renamed
from .responses_store import ResponseStore

log = logging.getLogger("reprise.http")
T = TypeVar("T")
SWITCH_INTERVAL_S = 0.0005


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


class Frontend:
    """The app's state: config, client pool, workers and metrics."""

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

    async def run(self, parsed: ParsedRequest) -> AsyncIterator[tuple[int, TokenChunk | Done]]:
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
            items = streams[0] if len(streams) == 1 else _merged(streams)
            try:
                async for item in items:
                    yield item
            finally:  # now, not when collected: closing them cancels the daemon requests
                await items.aclose()  # type: ignore[attr-defined]
        finally:
            self.num_in_flight -= total

    async def _choices(
        self, prompt: Any, parsed: ParsedRequest, first: int
    ) -> AsyncIterator[tuple[int, TokenChunk | Done]]:
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
            raise _api_error(e, embeds="prompt_table" in parsed.options) from None
        finally:
            await stream.aclose()

    # -- routes --------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        try:
            reply = await self.client.health(timeout_s=2)
        except (DaemonUnavailable, TimeoutError):
            return JSONResponse({"status": "loading"}, status_code=503)
        status = 200 if reply.status == "ok" else 503
        return JSONResponse({"status": reply.status}, status_code=status)

    async def version(self, request: Request) -> Response:
        """vLLM's GET /version: the server's version."""
        try:
            version = importlib.metadata.version("reprise")
        except importlib.metadata.PackageNotFoundError:  # a source tree run without installing
            version = "unknown"
        return JSONResponse({"version": version})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [await self._model()]})

    async def model(self, request: Request) -> Response:
        """OpenAI's GET /v1/models/{model}: the served model, or 404."""
        self._check_model(request.path_params["model"])
        return JSONResponse(await self._model())

    async def _model(self) -> dict[str, Any]:
        """OpenAI's model object, with vLLM's root, parent and max_model_len (the context,
        once the daemon is up: clients such as LiteLLM read it)."""
        card = {"id": self.config.model_name, "object": "model", "created": 0,
                "owned_by": "reprise", "root": self.config.model_name, "parent": None}  # fmt: skip
        with contextlib.suppress(RequestError, DaemonUnavailable, TimeoutError):
            card["max_model_len"] = (await self._health(timeout_s=2)).max_model_len
        return card

    async def metrics_route(self, request: Request) -> Response:
        text = await run_in_threadpool(generate_latest, self.metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: the ids a completion of `prompt` (or a chat completion of
        `messages`) would be given, their count and the context length."""
        asked = parse_tokenize(await self._json(request))
        self._check_model(asked.model)
        try:
            ids = await self.client.tokenize(asked.prompt, tools=asked.tools,
                                             chat_options=asked.chat_options,
                                             add_special_tokens=asked.add_special_tokens)  # fmt: skip
            limit = (await self._health()).max_model_len
        except (RequestError, ProtocolError, DaemonUnavailable) as e:
            raise _api_error(e) from None
        return JSONResponse({"count": len(ids), "max_model_len": limit, "tokens": ids,
                             "token_strs": None})  # fmt: skip

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: the text of `tokens`."""
        model, ids = parse_detokenize(await self._json(request))
        self._check_model(model)
        try:
            text = await self.client.detokenize(ids)
        except (RequestError, ProtocolError, DaemonUnavailable) as e:
            error = _api_error(e)
            error.param = "tokens" if error.param == "prompt" else error.param  # token_ids
            raise error from None
        return JSONResponse({"prompt": text})

    def _reasoning(self, parsed: ParsedRequest) -> None:
        """A chat's reasoning parser: the server's, unless the request asks for none
        (separate_reasoning false) or its tool choice holds the answer to a grammar."""
        if (
            parsed.kind == "chat"
            and parsed.separate_reasoning
            and parsed.tool_mode not in ("named", "required")
        ):
            parsed.reasoning_parser = self.config.reasoning_parser

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this daemon "
                           f"serves {self.config.model_name!r}", param="model",
                           code="model_not_found")  # fmt: skip

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, kind: str) -> Response:
        t_start = time.monotonic()
        default = self.config.max_tokens_cap if kind == "chat" else self.config.max_tokens_default
        parsed = parse_request(kind, await self._json(request), max_tokens_default=default,
                               tool_call_parser=self.config.tool_call_parser)  # fmt: skip
        self._check_model(parsed.model)
        self._reasoning(parsed)
        if parsed.prompt is None:  # prompt_embeds alone: its rows are the prompt
            parsed.table_prompt(await self._vocab_size())
        if parsed.user is not None:
            log.info("request from user %r", parsed.user[:128])
        request_id = new_id(kind)
        timing = _Timing(self.metrics, t_start, parsed.num_choices)
        items = self.run(parsed)
        if not parsed.stream:
            try:
                collect = self._collect(items, timing, parsed.num_choices)
                dones = await _unless_disconnected(request, collect)
            finally:
                await items.aclose()
            return JSONResponse(response(parsed, request_id, self.config.model_name, dones))
        # The first item decides the status: an error before any token is a plain JSON error.
        try:
            first = await _unless_disconnected(request, anext(items, None))
        except BaseException:
            await items.aclose()
            raise
        builder = StreamBuilder(parsed, request_id, self.config.model_name)
        return StreamingResponse(self._events(first, items, builder, timing, parsed.num_choices),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})  # fmt: skip

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, over the chat path (responses_api.py)."""
        t_start = time.monotonic()
        asked = parse_responses(await self._json(request),
                                max_tokens_default=self.config.max_tokens_cap,
                                tool_call_parser=self.config.tool_call_parser,
                                store=self.stored)  # fmt: skip
        parsed = asked.parsed
        self._check_model(parsed.model)
        self._reasoning(parsed)
        if parsed.user is not None:
            log.info("request from user %r", parsed.user[:128])
        response_id, model = new_response_id(), self.config.model_name
        timing = _Timing(self.metrics, t_start, 1)
        items = self.run(parsed)
        if not parsed.stream:
            try:
                dones = await _unless_disconnected(request, self._collect(items, timing, 1))
            except ApiError as e:
                raise renamed(e) from None
            finally:
                await items.aclose()
            answer = responses_answer(asked, response_id, model, dones[0])
            self._keep(asked, answer)
            return JSONResponse(answer)
        try:  # an error before any token is a plain JSON error, as for the other routes
            first = await _unless_disconnected(request, anext(items, None))
        except BaseException as e:
            await items.aclose()
            if isinstance(e, ApiError):
                raise renamed(e) from None
            raise
        stream = EventStream(asked, response_id, model)
        return StreamingResponse(self._response_events(first, items, stream, timing),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})  # fmt: skip

    def _keep(self, asked: ResponsesRequest, response: dict[str, Any] | None) -> None:
        """A finished response into the store, when it asked to be kept (store)."""
        if asked.store and self.stored is not None and response is not None:
            kept = self.stored.put(response, asked.conversation)
            response["store"] = kept  # false when larger than the whole store

    async def stored_response(self, request: Request) -> Response:
        """OpenAI's GET (the response) and DELETE (forget it) of a stored response."""
        response_id = request.path_params["response_id"]
        stored = None if self.stored is None else self.stored.get(response_id)
        if stored is None:
            raise ApiError(404, f"no stored response {response_id!r:.80} (store false, "
                           "deleted, evicted, or a server keeping none)", param="response_id",
                           code="not_found")  # fmt: skip
        if request.method == "DELETE":
            self.stored.delete(response_id)  # type: ignore[union-attr]
            return JSONResponse({"id": response_id, "object": "response.deleted",
                                 "deleted": True})  # fmt: skip
        return JSONResponse(stored)

    async def _response_events(
        self, first: Any, items: AsyncIterator, stream: EventStream, timing: _Timing
    ) -> AsyncIterator[str]:
        """The Responses API's events: the response's start, its items as they come, its
        end (or an error event); no `[DONE]` (OpenAI's stream ends with the response)."""
        try:
            for event in stream.start():
                yield event
            async for index, item in _after(first, items):
                timing.on(index, item)
                events = stream.done(item) if isinstance(item, Done) else stream.chunk(item)
                for event in events:
                    yield event
            self._keep(stream.request, stream.final)
        except ApiError as e:  # a daemon error after the first token: one error event
            self.metrics.errors.labels(str(e.status)).inc()
            yield stream.error(renamed(e))
        finally:
            await items.aclose()  # type: ignore[attr-defined]

    async def _vocab_size(self) -> int:
        """The model's vocabulary size (the first table id), asked of the daemon once."""
        return (await self._health()).vocab_size

    async def _health(self, timeout_s: float = 10) -> HealthReply:
        """The daemon's health reply, asked once: its model's fixed sizes."""
        if self._sizes is None:
            self._sizes = await self.client.health(timeout_s=timeout_s)
        return self._sizes

    async def _collect(self, items: AsyncIterator, timing: _Timing, n: int) -> list[Done]:
        dones: list[Done | None] = [None] * n
        async for index, item in items:
            timing.on(index, item)
            if isinstance(item, Done):
                dones[index] = item
        assert all(d is not None for d in dones), dones
        return dones  # type: ignore[return-value]

    async def _events(self, first: Any, items: AsyncIterator, builder: StreamBuilder,
                      timing: _Timing, n: int) -> AsyncIterator[str]:  # fmt: skip
        dones: list[Done | None] = [None] * n
        try:
            async for index, item in _after(first, items):
                timing.on(index, item)
                if isinstance(item, Done):
                    dones[index] = item
                    event = builder.done(index, item)
                else:
                    event = builder.chunk(index, item)
                yield f"data: {json.dumps(event)}\n\n"
            if builder.parsed.include_usage and all(dones):
                yield f"data: {json.dumps(builder.usage(dones))}\n\n"  # type: ignore[arg-type]
        except ApiError as e:  # a daemon error after the first token: one error event
            self.metrics.errors.labels(str(e.status)).inc()
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            await items.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"

    async def _json(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        if (
            declared is not None
            and declared.isdigit()
            and int(declared) > self.config.max_body_bytes
        ):
            raise _too_large(int(declared), self.config.max_body_bytes)
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > self.config.max_body_bytes:
                raise _too_large(len(body), self.config.max_body_bytes)
        try:
            return json.loads(body)
        except ValueError as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, "the body's JSON is nested too deeply") from None


class _Timing:
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


async def _after(first: Any, items: AsyncIterator) -> AsyncIterator[Any]:
    """`first` (an item already read, unless None), then the rest of `items`."""
    if first is not None:
        yield first
    async for item in items:
        yield item


async def _unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
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


async def _merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
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


def _too_large(num_bytes: int, limit: int) -> ApiError:
    return ApiError(413, f"the body has {num_bytes} bytes; the limit is {limit}",
                    code="too_large")  # fmt: skip


def _api_error(e: BaseException, *, embeds: bool = False) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RequestError | ProtocolError):
        status, param, message = STATUS_OF_CODE.get(e.code, 500), _param_named(e.message), e.message
        if embeds and param == "prompt_table":  # the table the daemon checked is prompt_embeds
            param, message = "prompt_embeds", f"prompt_embeds (as the prompt table): {message}"
        return ApiError(status, message, param=param, code=OPENAI_CODE.get(e.code, e.code))
    if isinstance(e, DaemonUnavailable):
        return ApiError(503, "the daemon is not serving yet (or has stopped)",
                        code="unavailable")  # fmt: skip
    log.error("internal error in the HTTP layer: %r", e)
    return ApiError(500, f"internal error: {type(e).__name__}", code="internal")


# The request's fields a daemon message may start with, and their names in OpenAI's body.
_PARAMS = {name: name for name in (*SAMPLING_FIELDS, *Generate.__dataclass_fields__)
           if name not in ("id", "sampling")}  # fmt: skip
_PARAMS.update(token_ids="prompt", queue_priority="priority")


def _param_named(message: str) -> str | None:
    """The parameter a daemon message names first, by its name in the request body
    ("top_p must be ..." -> "top_p", "sampling.stop_token_ids[] must ..." ->
    "stop_token_ids", "token_ids[] must ..." -> "prompt"); None if it names none."""
    word = message.split(" ", 1)[0].removeprefix("sampling.").rstrip(":")
    return _PARAMS.get(word.split("[", 1)[0].split(".", 1)[0])


def create_app(config: HttpConfig, daemon_address: str) -> Starlette:
    frontend = Frontend(config, daemon_address)
    key = config.api_key.encode() if config.api_key else None

    async def authorize_and_answer(request: Request, route: Callable) -> Response:
        try:
            if key is not None and request.url.path != "/health":
                given = request.headers.get("authorization", "")
                token = given[7:].encode() if given[:7].lower() == "bearer " else b""
                if not hmac.compare_digest(token, key):
                    raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)",
                                   code="invalid_api_key")  # fmt: skip
            return await route(request)
        except ApiError as e:
            frontend.metrics.errors.labels(str(e.status)).inc()
            return JSONResponse(e.body(), status_code=e.status)

    def guarded(route: Callable) -> Callable:
        async def endpoint(request: Request) -> Response:
            return await authorize_and_answer(request, route)

        return endpoint

    routes = [
        Route("/health", guarded(frontend.health), methods=["GET"]),
        Route("/version", guarded(frontend.version), methods=["GET"]),
        Route("/v1/models", guarded(frontend.models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(frontend.model), methods=["GET"]),
        Route("/metrics", guarded(frontend.metrics_route), methods=["GET"]),
        Route("/v1/completions", guarded(frontend.completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(frontend.chat), methods=["POST"]),
        Route("/v1/responses", guarded(frontend.responses), methods=["POST"]),
        Route(
            "/v1/responses/{response_id:path}",
            guarded(frontend.stored_response),
            methods=["GET", "DELETE"],
        ),
        Route("/tokenize", guarded(frontend.tokenize), methods=["POST"]),
        Route("/detokenize", guarded(frontend.detokenize), methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    app.state.frontend = frontend
    return app


class HttpThread:
    """uvicorn serving the app on a thread of its own; the socket is bound by `__init__`
    (so a busy port fails at once, before any model loads)."""

    def __init__(self, config: HttpConfig, daemon_address: str) -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY on accepted sockets only when
        # their proto says TCP (proto 0 costs ~40 ms a response: Nagle meets delayed ACKs).
        self.sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((config.host, config.port))
            self.sock.listen(2048)  # connections wait in the backlog until uvicorn runs
        except OSError as e:
            self.sock.close()
            raise RuntimeError(f"--http {config.host}:{config.port}: cannot bind: {e}") from None
        self.port = self.sock.getsockname()[1]
        app = create_app(config, daemon_address)
        uv_config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                   timeout_graceful_shutdown=5)  # fmt: skip
        self.server = uvicorn.Server(uv_config)
        self.thread = threading.Thread(target=self._serve, name="http", daemon=True)
        self.config = config

    def _serve(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self) -> None:
        # The engine loop and this thread share the GIL: when a token is ready the loop
        # goes on with Python work, and by default this thread waits up to 5 ms for its
        # turn to pass the token on. A shorter interval bounds that wait (ZeroMQ clients,
        # in processes of their own, never wait for it).
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.thread.start()
        log.info("HTTP on http://%s:%d (OpenAI API under /v1)", self.config.host, self.port)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
