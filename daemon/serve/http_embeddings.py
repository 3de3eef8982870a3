"""The HTTP front end's /v1/embeddings route (openai_embeddings.py reads the body and
spells the answer): the inputs run side by side as the daemon's requests, each asking
for its prompt's embedding, and the answer comes when all are done."""

from __future__ import annotations

import logging
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .http_frontend import Frontend
from .http_streams import Timing, unless_disconnected
from .openai_embeddings import embeddings_answer, parse_embeddings
from .openai_errors import ApiError, bad

log = logging.getLogger("reprise.http")


async def embeddings(frontend: Frontend, request: Request) -> Response:
    t_start = time.monotonic()
    body = await frontend.read_json(request)
    parsed, fmt = parse_embeddings(body, frontend.config.max_queue)
    frontend.check_model(parsed.model)
    hidden = (await frontend.model_sizes()).hidden_size
    if fmt.dimensions is not None and fmt.dimensions > hidden > 0:  # refused before it runs
        raise bad("dimensions", f"must be at most {hidden} (the model's hidden size)")
    if parsed.user is not None:
        log.info("request from user %r", parsed.user[:128])
    items = frontend.run(parsed)
    try:
        timing = Timing(frontend.metrics, t_start, parsed.num_choices)
        collect = frontend.collect(items, timing, parsed.num_choices)
        dones = await unless_disconnected(request, collect)
    except ApiError as e:
        if e.param == "prompt":  # the daemon's name for what this body calls input
            e.param = "input"
        raise
    finally:
        await items.aclose()  # type: ignore[attr-defined]
    return JSONResponse(embeddings_answer(dones, frontend.config.model_name, fmt))
