"""The HTTP front end's utility routes: /health, /version, /v1/models (and one model),
/metrics, and vLLM's /tokenize and /detokenize.

Each is a function of the `Frontend` and the request (bound by `http.create_app`);
/tokenize gives the ids a completion (or chat completion) of the same prompt would
be given, as the daemon tokenizes them.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...ipc.client import DaemonUnavailable, RequestError
from ...ipc.messages import ProtocolError
from .http_frontend import Frontend
from .openai_errors import api_error
from .openai_tokenize import parse_detokenize, parse_tokenize


async def health(frontend: Frontend, request: Request) -> Response:
    try:
        reply = await frontend.client.health(timeout_s=2)
    except (DaemonUnavailable, TimeoutError):
        return JSONResponse({"status": "loading"}, status_code=503)
    status = 200 if reply.status == "ok" else 503
    return JSONResponse({"status": reply.status}, status_code=status)


async def version(frontend: Frontend, request: Request) -> Response:
    """vLLM's GET /version: the server's version."""
    try:
        version = importlib.metadata.version("reprise")
    except importlib.metadata.PackageNotFoundError:  # a source tree run without installing
        version = "unknown"
    return JSONResponse({"version": version})


async def models(frontend: Frontend, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [await _model(frontend)]})


async def model(frontend: Frontend, request: Request) -> Response:
    """OpenAI's GET /v1/models/{model}: the served model, or 404."""
    frontend.check_model(request.path_params["model"])
    return JSONResponse(await _model(frontend))


async def _model(frontend: Frontend) -> dict[str, Any]:
    """OpenAI's model object, with vLLM's root, parent and max_model_len (the context,
    once the daemon is up: clients such as LiteLLM read it)."""
    card = {"id": frontend.config.model_name, "object": "model", "created": 0,
            "owned_by": "reprise", "root": frontend.config.model_name, "parent": None}  # fmt: skip
    with contextlib.suppress(RequestError, DaemonUnavailable, TimeoutError):
        card["max_model_len"] = (await frontend.model_sizes(timeout_s=2)).max_model_len
    return card


async def metrics_route(frontend: Frontend, request: Request) -> Response:
    text = await run_in_threadpool(generate_latest, frontend.metrics.registry)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


async def tokenize(frontend: Frontend, request: Request) -> Response:
    """vLLM's /tokenize: the ids a completion of `prompt` (or a chat completion of
    `messages`) would be given, their count and the context length."""
    asked = parse_tokenize(await frontend.read_json(request))
    frontend.check_model(asked.model)
    try:
        ids = await frontend.client.tokenize(asked.prompt, tools=asked.tools,
                                             chat_options=asked.chat_options,
                                             add_special_tokens=asked.add_special_tokens)  # fmt: skip
        limit = (await frontend.model_sizes()).max_model_len
    except (RequestError, ProtocolError, DaemonUnavailable) as e:
        raise api_error(e) from None
    return JSONResponse({"count": len(ids), "max_model_len": limit, "tokens": ids,
                         "token_strs": None})  # fmt: skip


async def detokenize(frontend: Frontend, request: Request) -> Response:
    """vLLM's /detokenize: the text of `tokens`."""
    model, ids = parse_detokenize(await frontend.read_json(request))
    frontend.check_model(model)
    try:
        text = await frontend.client.detokenize(ids)
    except (RequestError, ProtocolError, DaemonUnavailable) as e:
        error = api_error(e)
        error.param = "tokens" if error.param == "prompt" else error.param  # token_ids
        raise error from None
    return JSONResponse({"prompt": text})
