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

This module builds the app (`create_app`: the routes, each behind the API key check)
and serves it (`HttpThread`). The routes are functions of the `Frontend` (the app's
state, http_frontend.py): http_completions.py (completions and chat completions),
http_responses.py (the Responses API), http_embeddings.py (embeddings, score, rerank),
http_utility.py (health, version, models, metrics, tokenize, detokenize),
http_llama_cpp.py (llama.cpp's native /completion, /apply-template, /props, /embedding);
http_streams.py holds the plumbing between the daemon's streams and the client.

Guarantees: every route but /health needs the API key when one is set (compared
in constant time); every error is OpenAI's JSON error shape. Browsers may call it
cross-origin only from `--allowed-origins` (none by default: unlike vLLM's and
llama.cpp's "*", so a web page cannot reach a loopback server); with `--ssl-certfile`
and `--ssl-keyfile` it speaks HTTPS only.
"""

from __future__ import annotations

import hmac
import logging
import socket
import sys
import threading
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .http_completions import chat, completions
from .http_config import HttpConfig
from .http_embeddings import embeddings, rerank, score
from .http_frontend import Frontend
from .http_llama_cpp import apply_template, completion, embedding, infill, props
from .http_responses import responses, stored_response
from .http_utility import detokenize, health, metrics_route, model, models, tokenize, version
from .openai_errors import ApiError

log = logging.getLogger("reprise.http")
SWITCH_INTERVAL_S = 0.0005


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
            return await route(frontend, request)
        except Exception as exc:  # a bug in a route: OpenAI's JSON 500, the traceback logged
            e = exc if isinstance(exc, ApiError) else None
            if e is None:
                log.exception("internal error answering %s", request.url.path)
                e = ApiError(500, f"internal error: {type(exc).__name__}", code="internal")
            frontend.metrics.errors.labels(str(e.status)).inc()
            return JSONResponse(e.body(), status_code=e.status)

    def guarded(route: Callable) -> Callable:
        async def endpoint(request: Request) -> Response:
            return await authorize_and_answer(request, route)

        return endpoint

    routes = [
        Route("/health", guarded(health), methods=["GET"]),
        Route("/version", guarded(version), methods=["GET"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(model), methods=["GET"]),
        Route("/metrics", guarded(metrics_route), methods=["GET"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
        Route("/v1/responses", guarded(responses), methods=["POST"]),
        Route(
            "/v1/responses/{response_id:path}",
            guarded(stored_response),
            methods=["GET", "DELETE"],
        ),
        Route("/v1/embeddings", guarded(embeddings), methods=["POST"]),
        *(Route(path, guarded(score), methods=["POST"]) for path in ("/score", "/v1/score")),
        *(
            Route(path, guarded(rerank), methods=["POST"])
            for path in ("/rerank", "/v1/rerank", "/v2/rerank")
        ),
        Route("/tokenize", guarded(tokenize), methods=["POST"]),
        Route("/detokenize", guarded(detokenize), methods=["POST"]),
        # llama.cpp's llama-server native routes (not OpenAI's: no /v1)
        *(Route(p, guarded(completion), methods=["POST"]) for p in ("/completion", "/completions")),
        Route("/apply-template", guarded(apply_template), methods=["POST"]),
        Route("/infill", guarded(infill), methods=["POST"]),
        Route("/props", guarded(props), methods=["GET"]),
        *(Route(p, guarded(embedding), methods=["POST"]) for p in ("/embedding", "/embeddings")),
    ]
    middleware = []
    if config.allowed_origins:  # browsers' cross-origin calls (preflights answered here)
        middleware.append(Middleware(
            CORSMiddleware, allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"], max_age=600,
        ))  # fmt: skip
    app = Starlette(routes=routes, middleware=middleware)
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
                                   timeout_graceful_shutdown=5, ssl_keyfile=config.ssl_keyfile,
                                   ssl_certfile=config.ssl_certfile)  # fmt: skip
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
        scheme, host = self.config.scheme, self.config.host
        log.info("HTTP on %s://%s:%d (OpenAI API under /v1)", scheme, host, self.port)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
