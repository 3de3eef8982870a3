"""The HTTP front end's OpenAI routes: /v1/completions and /v1/chat/completions.

A body is parsed (openai_api.py), run as the daemon's requests (`Frontend.run`) and
answered whole, or streamed as server-sent events ending in `[DONE]`
(openai_responses.py builds both). An error before the first token is a plain JSON
error; one after it is a single error event in the stream.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ...ipc.messages import Done
from .http_frontend import Frontend
from .http_streams import Timing, after, first_of, gathered
from .openai_api import parse_request
from .openai_errors import ApiError
from .openai_responses import StreamBuilder, new_id, response

log = logging.getLogger("reprise.http")


async def completions(frontend: Frontend, request: Request) -> Response:
    return await _generate(frontend, request, "completions")


async def chat(frontend: Frontend, request: Request) -> Response:
    return await _generate(frontend, request, "chat")


async def _generate(frontend: Frontend, request: Request, kind: str) -> Response:
    t_start = time.monotonic()
    default = (
        frontend.config.max_tokens_cap if kind == "chat" else frontend.config.max_tokens_default
    )
    parsed = parse_request(kind, await frontend.read_json(request), max_tokens_default=default,
                           tool_call_parser=frontend.config.tool_call_parser,
                           defaults=frontend.config.generation_defaults)  # fmt: skip
    frontend.check_model(parsed.model)
    if parsed.suffix is not None:  # fill in the middle, with the model's tokens
        parsed.fill_in(await frontend.fim_tokens())
    frontend.set_reasoning_parser(parsed)
    if parsed.prompt is None:  # prompt_embeds alone: its rows are the prompt
        parsed.table_prompt(await frontend.vocab_size())
    if parsed.user is not None:
        log.info("request from user %r", parsed.user[:128])
    request_id = new_id(kind)
    timing = Timing(frontend.metrics, t_start, parsed.num_choices)
    items = frontend.run(parsed)
    if not parsed.stream:
        dones = await gathered(request, items, frontend.collect(items, timing, parsed.num_choices))
        return JSONResponse(response(parsed, request_id, frontend.config.model_name, dones))
    first = await first_of(request, items)
    builder = StreamBuilder(parsed, request_id, frontend.config.model_name)
    return StreamingResponse(_events(frontend, first, items, builder, timing, parsed.num_choices),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})  # fmt: skip


async def _events(frontend: Frontend, first: Any, items: AsyncGenerator, builder: StreamBuilder,
                  timing: Timing, n: int) -> AsyncIterator[str]:  # fmt: skip
    dones: list[Done | None] = [None] * n
    try:
        async for index, item in after(first, items):
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
        frontend.metrics.errors.labels(str(e.status)).inc()
        yield f"data: {json.dumps(e.body())}\n\n"
    finally:
        await items.aclose()
    yield "data: [DONE]\n\n"
