"""The HTTP front end's Responses API routes: POST /v1/responses, and GET and DELETE
of a stored response.

A Responses body is parsed as the chat it amounts to (responses_api.py), run as
one (`Frontend.run`) and answered whole or as the Responses API's events
(responses_answer.py), without `[DONE]`; errors carry the Responses API's parameter
names (`RENAMED`). A response that asks to be stored is kept once finished, when the
server keeps any (responses_store.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ...ipc.messages import Done
from .http_frontend import Frontend
from .http_streams import Timing, after, unless_disconnected
from .openai_errors import ApiError, renamed
from .responses_answer import EventStream, new_response_id
from .responses_answer import answer as responses_answer
from .responses_api import RENAMED, ResponsesRequest, parse_responses

log = logging.getLogger("reprise.http")


async def responses(frontend: Frontend, request: Request) -> Response:
    """OpenAI's Responses API, over the chat path (responses_api.py)."""
    t_start = time.monotonic()
    asked = parse_responses(await frontend.read_json(request),
                            max_tokens_default=frontend.config.max_tokens_cap,
                            tool_call_parser=frontend.config.tool_call_parser,
                            store=frontend.stored,
                            defaults=frontend.config.generation_defaults)  # fmt: skip
    parsed = asked.parsed
    frontend.check_model(parsed.model)
    frontend.set_reasoning_parser(parsed)
    if parsed.user is not None:
        log.info("request from user %r", parsed.user[:128])
    response_id, model = new_response_id(), frontend.config.model_name
    timing = Timing(frontend.metrics, t_start, 1)
    items = frontend.run(parsed)
    if not parsed.stream:
        try:
            dones = await unless_disconnected(request, frontend.collect(items, timing, 1))
        except ApiError as e:
            raise renamed(e, RENAMED) from None
        finally:
            await items.aclose()
        answer = responses_answer(asked, response_id, model, dones[0])
        _keep(frontend, asked, answer)
        return JSONResponse(answer)
    try:  # an error before any token is a plain JSON error, as for the other routes
        first = await unless_disconnected(request, anext(items, None))
    except BaseException as e:
        await items.aclose()
        if isinstance(e, ApiError):
            raise renamed(e, RENAMED) from None
        raise
    stream = EventStream(asked, response_id, model)
    return StreamingResponse(_response_events(frontend, first, items, stream, timing),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})  # fmt: skip


def _keep(frontend: Frontend, asked: ResponsesRequest, response: dict[str, Any] | None) -> None:
    """A finished response into the store, when it asked to be kept (store)."""
    if asked.store and frontend.stored is not None and response is not None:
        kept = frontend.stored.put(response, asked.conversation)
        response["store"] = kept  # false when larger than the whole store


async def stored_response(frontend: Frontend, request: Request) -> Response:
    """OpenAI's GET (the response) and DELETE (forget it) of a stored response."""
    response_id = request.path_params["response_id"]
    stored = None if frontend.stored is None else frontend.stored.get(response_id)
    if stored is None:
        raise ApiError(404, f"no stored response {response_id!r:.80} (store false, "
                       "deleted, evicted, or a server keeping none)", param="response_id",
                       code="not_found")  # fmt: skip
    if request.method == "DELETE":
        frontend.stored.delete(response_id)  # type: ignore[union-attr]
        return JSONResponse({"id": response_id, "object": "response.deleted",
                             "deleted": True})  # fmt: skip
    return JSONResponse(stored)


async def _response_events(
    frontend: Frontend, first: Any, items: AsyncGenerator, stream: EventStream, timing: Timing
) -> AsyncIterator[str]:
    """The Responses API's events: the response's start, its items as they come, its
    end (or an error event); no `[DONE]` (OpenAI's stream ends with the response)."""
    try:
        for event in stream.start():
            yield event
        async for index, item in after(first, items):
            timing.on(index, item)
            events = stream.done(item) if isinstance(item, Done) else stream.chunk(item)
            for event in events:
                yield event
        _keep(frontend, stream.request, stream.final)
    except ApiError as e:  # a daemon error after the first token: one error event
        frontend.metrics.errors.labels(str(e.status)).inc()
        yield stream.error(renamed(e, RENAMED))
    finally:
        await items.aclose()
