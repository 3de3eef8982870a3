"""llama.cpp's native llama-server routes, as thin layers over the OpenAI ones, so that
clients written for llama-server's own API work unchanged.

Served (each a function of the `Frontend` and the request, bound by `http.create_app`):
- POST /completion (and /completions): llama.cpp's body (llama_cpp_api.py, which reads
  it as the /v1/completions request it amounts to: one parser, one set of limits) and
  answer (llama_cpp_answers.py); streamed as `data: {...}` events, `stop: false` until
  the last, `stop: true`, with no `[DONE]` (llama.cpp sends none on this route). Several
  prompts answer with a list, a streamed one's events told apart by `index`.
- POST /apply-template: `{"messages"}` (with /tokenize's chat options and tools) ->
  `{"prompt"}`: the chat as the daemon renders it with its chat template (the text
  whose ids a chat completion of them is given: the tokenize reply carries it).
- GET /props: default_generation_settings (DEFAULTS, as a /completion without them
  runs), total_slots (the engine's max_num_seqs: there are no slots, that is how many
  requests run at once), model_path (the daemon's --model), model_alias (the served
  name), chat_template (the one chats are rendered with), build_info (our version).
- POST /embedding (and /embeddings, llama.cpp's, not OpenAI's /v1/embeddings):
  `content` (or `input`): a text, token ids, or a list of them; each answered as
  `{"index", "embedding": [[...]]}`, one pooled row (the last token's, as
  /v1/embeddings'), L2-normalized as llama.cpp's default `embd_normalize: 2`; -1 gives
  the raw row. The other norms (0, 1, p > 2) are refused.
- POST /infill: `input_prefix`, `input_suffix`, `input_extra` (other files) and `prompt`
  (the middle's start) in the model's fill-in-the-middle layout (fim.py), with any
  /completion setting, answered as a /completion; a model without those tokens is a 400.
/tokenize and /detokenize take llama.cpp's bodies too (http_utility.py). Errors keep
our OpenAI shape, named by llama.cpp's parameter; /slots, /reranking,
/lora-adapters and POST /props are not served (404 or 405).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ...ipc.codec import logits_from_wire
from ...ipc.messages import Done, HealthReply
from .http_embeddings import embed_all
from .http_frontend import Frontend, answered
from .http_streams import Timing, after, first_of, gathered
from .http_utility import server_version
from .llama_cpp_answers import CompletionAnswers
from .llama_cpp_api import (
    DEFAULTS,
    LlamaOptions,
    generation_settings,
    infill_body,
    parse_completion,
)
from .openai_api import object_body
from .openai_embeddings import MAX_INPUTS, EmbeddingFormat, embedding_requests, known_only, shaped
from .openai_errors import ApiError, bad
from .openai_prompts import prompt_batch
from .openai_tokenize import parse_tokenize

EMBEDDING_KEYS = {"content", "input", "embd_normalize", "model", "cache_salt"}
NORMS = {-1: False, 2: True}  # llama.cpp's embd_normalize -> normalized to unit length


async def completion(frontend: Frontend, request: Request) -> Response:
    t_start = time.monotonic()
    return await _complete(frontend, request, await frontend.read_json(request), t_start)


async def infill(frontend: Frontend, request: Request) -> Response:
    """llama.cpp's /infill: the text between `input_prefix` and `input_suffix`, in the
    model's fill-in-the-middle layout (infill_body), answered as a /completion."""
    t_start = time.monotonic()
    body = infill_body(await frontend.read_json(request), await frontend.fim_tokens())
    return await _complete(frontend, request, body, t_start)


async def _complete(frontend: Frontend, request: Request, body: object, t_start: float) -> Response:
    async def tokenize(text: str, bos: bool) -> list[int]:
        return await answered(frontend.client.tokenize(text, add_special_tokens=bos))

    cap = frontend.config.max_tokens_cap
    parsed, options = await parse_completion(body, tokenize, max_tokens_cap=cap)
    frontend.check_model(parsed.model)
    sizes = await _sizes(frontend)
    answers = CompletionAnswers(parsed, options, frontend.config.model_name, sizes.max_model_len)
    timing = Timing(frontend.metrics, t_start, parsed.num_choices)
    items = frontend.run(parsed)
    try:
        if not parsed.stream:
            collect = frontend.collect(items, timing, parsed.num_choices)
            dones = await gathered(request, items, collect)
            wall_ms = (time.monotonic() - t_start) * 1e3
            results = [answers.final(i, done, await _prompt(frontend, done), wall_ms,
                                     stream=False) for i, done in enumerate(dones)]  # fmt: skip
            return JSONResponse(results[0] if len(results) == 1 else results)
        first = await first_of(request, items)
    except ApiError as e:  # named as the body named it
        raise options.rename(e) from None
    events = _events(frontend, first, items, answers, options, timing, t_start)
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})  # fmt: skip


async def _events(frontend: Frontend, first: Any, items: AsyncGenerator, answers: CompletionAnswers,
                  options: LlamaOptions, timing: Timing, t_start: float) -> AsyncIterator[str]:  # fmt: skip
    try:
        async for index, item in after(first, items):
            timing.on(index, item)
            if isinstance(item, Done):
                wall_ms = (time.monotonic() - t_start) * 1e3
                prompt = await _prompt(frontend, item)
                event = answers.final(index, item, prompt, wall_ms, stream=True)
            else:
                event = answers.chunk(index, item)
            yield f"data: {json.dumps(event)}\n\n"
    except ApiError as e:  # a daemon error after the first token: one error event
        frontend.metrics.errors.labels(str(e.status)).inc()
        yield f"data: {json.dumps(options.rename(e).body())}\n\n"
    finally:
        await items.aclose()


async def apply_template(frontend: Frontend, request: Request) -> Response:
    """llama.cpp's /apply-template: the chat `messages` rendered by the daemon's chat
    template, the text a chat completion of them encodes."""
    body = await frontend.read_json(request)
    if not isinstance(body, dict) or "messages" not in body:
        raise bad("messages", "is required: the chat to render")
    asked = parse_tokenize(body)
    frontend.check_model(asked.model)
    assert isinstance(asked.prompt, list)  # messages, so a chat
    text = await answered(frontend.client.render(asked.prompt, tools=asked.tools,
                                                chat_options=asked.chat_options))  # fmt: skip
    return JSONResponse({"prompt": text})


async def props(frontend: Frontend, request: Request) -> Response:
    """llama.cpp's GET /props: the server's settings (the module docstring says which)."""
    sizes = await _sizes(frontend)
    name = frontend.config.model_name
    settings = generation_settings(dict(DEFAULTS), -1, False, {})
    return JSONResponse({
        "default_generation_settings": {"n_ctx": sizes.max_model_len, "model": name,
                                        "params": {**settings, "n_ctx": sizes.max_model_len}},
        "total_slots": sizes.max_num_seqs,
        "model_alias": name,
        "model_path": sizes.model,
        "chat_template": sizes.chat_template or "",
        "modalities": {"vision": False, "audio": False},
        "build_info": f"reprise {server_version()}",
    })  # fmt: skip


async def embedding(frontend: Frontend, request: Request) -> Response:
    """llama.cpp's /embedding: each input's pooled embedding, `[{"index", "embedding":
    [[...]]}]`, normalized as `embd_normalize` says (2, L2, by default; -1 none)."""
    t_start = time.monotonic()
    body = known_only(object_body(await frontend.read_json(request)), EMBEDDING_KEYS)
    if "content" in body and "input" in body:
        raise bad("input", "give content or input (its alias), not both")
    param = "input" if "input" in body else "content"
    inputs = prompt_batch(body.get(param), param, min(frontend.config.max_queue, MAX_INPUTS))
    norm = body.get("embd_normalize", 2)
    if isinstance(norm, bool) or not isinstance(norm, int) or norm not in NORMS:
        raise bad("embd_normalize", f"must be 2 (Euclidean, the default) or -1 (none); the "
                  f"other norms are not served; got {norm!r:.40}")  # fmt: skip
    dones = await embed_all(frontend, request, embedding_requests(body, inputs), t_start, param)
    fmt = EmbeddingFormat(base64=False, dimensions=None, normalize=NORMS[norm])
    answer = []
    for index, done in enumerate(dones):
        assert done.embedding is not None, "the daemon returns an embedding when asked"
        row = shaped(logits_from_wire(done.embedding), fmt)
        answer.append({"index": index, "embedding": [row.tolist()]})  # one pooled row
    return JSONResponse(answer)


async def _prompt(frontend: Frontend, done: Done) -> str:
    """The text of a finished request's prompt ids, special tokens kept (llama.cpp's
    `prompt`: the prompt as processed)."""
    return await answered(frontend.client.detokenize(done.prompt_token_ids or []))


async def _sizes(frontend: Frontend) -> HealthReply:
    return await answered(frontend.model_sizes())
