"""The HTTP front end's embedding routes: OpenAI's /v1/embeddings, and vLLM's /score and
/rerank built on it (openai_embeddings.py and openai_scores.py read the bodies and spell
the answers). A body's inputs run side by side as the daemon's requests, each asking for
its prompt's embedding, and the answer comes when all are done."""

from __future__ import annotations

import logging
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...ipc.messages import Done
from .http_frontend import Frontend
from .http_streams import Timing, gathered
from .openai_api import ParsedRequest
from .openai_embeddings import embeddings_answer, parse_embeddings
from .openai_errors import ApiError, bad
from .openai_scores import parse_rerank, parse_score, rerank_answer, score_answer

log = logging.getLogger("reprise.http")


async def embeddings(frontend: Frontend, request: Request) -> Response:
    t_start = time.monotonic()
    parsed, fmt = parse_embeddings(await frontend.read_json(request), frontend.config.max_queue)
    hidden = (await frontend.model_sizes()).hidden_size
    if fmt.dimensions is not None and fmt.dimensions > hidden > 0:  # refused before it runs
        raise bad("dimensions", f"must be at most {hidden} (the model's hidden size)")
    dones = await embed_all(frontend, request, parsed, t_start, "input")
    return JSONResponse(embeddings_answer(dones, frontend.config.model_name, fmt))


async def score(frontend: Frontend, request: Request) -> Response:
    t_start = time.monotonic()
    parsed, pairs = parse_score(await frontend.read_json(request), frontend.config.max_queue)
    dones = await embed_all(frontend, request, parsed, t_start, "text_1")
    return JSONResponse(score_answer(dones, pairs, frontend.config.model_name))


async def rerank(frontend: Frontend, request: Request) -> Response:
    t_start = time.monotonic()
    body = await frontend.read_json(request)
    parsed, top_n, keep = parse_rerank(body, frontend.config.max_queue)
    dones = await embed_all(frontend, request, parsed, t_start, "documents")
    answer = rerank_answer(dones, parsed.prompts, top_n, keep, frontend.config.model_name)
    return JSONResponse(answer)


async def embed_all(
    frontend: Frontend, request: Request, parsed: ParsedRequest, t_start: float, param: str
) -> list[Done]:
    """The Dones of `parsed`'s embedding requests, in order; a daemon error about the
    prompt names `param`, the body's name for it."""
    frontend.check_model(parsed.model)
    if parsed.user is not None:
        log.info("request from user %r", parsed.user[:128])
    items = frontend.run(parsed)
    timing = Timing(frontend.metrics, t_start, parsed.num_choices)
    try:
        return await gathered(request, items, frontend.collect(items, timing, parsed.num_choices))
    except ApiError as e:
        if e.param == "prompt":  # the daemon's name for what this body calls `param`
            e.param = param
        raise
