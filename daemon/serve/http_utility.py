"""The HTTP front end's utility routes: /health, /version, /v1/models (and one model),
/metrics, and vLLM's /tokenize and /detokenize (which take llama.cpp's bodies too).

Each is a function of the `Frontend` and the request (bound by `http.create_app`);
/tokenize gives the ids a completion (or chat completion) of the same prompt would
be given, as the daemon tokenizes them. llama.cpp's `with_pieces` gives each id with
its text as the daemon decodes that token alone (one detokenize each, at most
MAX_PIECES): a piece of a multi-byte character is U+FFFD there, not llama.cpp's list
of bytes, since the protocol carries no token's bytes. /detokenize answers with both
servers' keys: vLLM's `prompt` and llama.cpp's `content`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...ipc.client import DaemonUnavailable, RequestError
from ...ipc.messages import ProtocolError
from .http_frontend import Frontend, answered
from .openai_errors import api_error, bad
from .openai_tokenize import TokenizeRequest, parse_detokenize, parse_tokenize

MAX_PIECES = 4096  # tokens a /tokenize with_pieces may give (one detokenize each)
PIECES_AT_ONCE = 16  # of those detokenizes in flight together


async def health(frontend: Frontend, request: Request) -> Response:
    try:
        reply = await frontend.client.health(timeout_s=2)
    except (DaemonUnavailable, TimeoutError):
        return JSONResponse({"status": "loading"}, status_code=503)
    status = 200 if reply.status == "ok" else 503
    return JSONResponse({"status": reply.status}, status_code=status)


async def version(frontend: Frontend, request: Request) -> Response:
    """vLLM's GET /version: the server's version."""
    return JSONResponse({"version": server_version()})


def server_version() -> str:
    try:
        return importlib.metadata.version("reprise")
    except importlib.metadata.PackageNotFoundError:  # a source tree run without installing
        return "unknown"


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
    `messages`) would be given, their count and the context length; llama.cpp's body
    (`content`) gets the same answer, its `tokens` {"id", "piece"} with `with_pieces`."""
    asked = parse_tokenize(await frontend.read_json(request))
    ids = await tokenized(frontend, asked)
    tokens: list[Any] = ids
    if asked.with_pieces:
        if len(ids) > MAX_PIECES:
            raise bad("with_pieces", f"gives at most {MAX_PIECES} tokens' pieces (MAX_PIECES); "
                      f"the content has {len(ids)} tokens")  # fmt: skip
        texts = await pieces(frontend, ids)
        tokens = [{"id": t, "piece": text} for t, text in zip(ids, texts, strict=True)]
    limit = (await answered(frontend.model_sizes())).max_model_len
    return JSONResponse({"count": len(ids), "max_model_len": limit, "tokens": tokens,
                         "token_strs": None})  # fmt: skip


async def tokenized(frontend: Frontend, asked: TokenizeRequest) -> list[int]:
    """The ids of a /tokenize body's prompt, as the daemon tokenizes them."""
    frontend.check_model(asked.model)
    return await answered(frontend.client.tokenize(asked.prompt, tools=asked.tools,
                                                   chat_options=asked.chat_options,
                                                   add_special_tokens=asked.add_special_tokens))  # fmt: skip


async def pieces(frontend: Frontend, ids: list[int]) -> list[str]:
    """Each token's text, decoded alone: PIECES_AT_ONCE detokenizes in flight at once, and
    never more than half the daemon's queue (`--max-queue`), so others keep their room."""
    at_once = max(1, min(PIECES_AT_ONCE, frontend.config.max_queue // 2))
    texts: list[str] = []
    for start in range(0, len(ids), at_once):
        batch = ids[start : start + at_once]
        texts += await answered(asyncio.gather(*(frontend.client.detokenize([t]) for t in batch)))
    return texts


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
    return JSONResponse({"prompt": text, "content": text})  # vLLM's key, llama.cpp's
