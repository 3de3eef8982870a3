"""OpenAI's /v1/embeddings: a body read into the daemon's requests, and their answer.

Each input runs as a request of its own asking for its prompt's embedding
(SamplingParams.embed: the final norm's output at its last token, last-token pooling),
with one greedy token the answer drops. `parse_embeddings` reads the body (OpenAI's
`input`, `encoding_format`, `dimensions`, `user`; vLLM's `truncate_prompt_tokens`,
`add_special_tokens`, `normalize`, `priority`; our `cache_salt`) or raises ApiError (400)
naming the parameter; `embeddings_answer` builds the reply from the requests' Dones.

Guarantees: a vector is the model's row, cut to its first `dimensions` values (a
Matryoshka model's shorter embedding) and then L2-normalized in float64 and rounded to
float32 once (unless `normalize` is false), so an input gives the same bits whether it
was computed fresh or from cached blocks; `base64` is those float32 values' little-endian
bytes, as OpenAI's.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...ipc.codec import logits_from_wire
from ...ipc.messages import Done
from .openai_api import ParsedRequest, object_body
from .openai_errors import ApiError, bad
from .openai_errors import is_a as _is
from .openai_prompts import prompt_batch

MAX_INPUTS = 2048  # OpenAI's; the server's max_queue bounds it further
KNOWN = {"input", "model", "encoding_format", "dimensions", "user", "truncate_prompt_tokens",
         "add_special_tokens", "normalize", "cache_salt", "priority"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class EmbeddingFormat:
    """How the answer spells each vector."""

    base64: bool  # encoding_format "base64" (else "float": a list of numbers)
    dimensions: int | None  # the first this many values (None: all)
    normalize: bool  # to unit L2 length (vLLM's default for an embedding)


def parse_embeddings(body: object, max_inputs: int) -> tuple[ParsedRequest, EmbeddingFormat]:
    """The requests of an /v1/embeddings body (one an input, greedy, one token) and the
    answer's format; at most min(`max_inputs`, MAX_INPUTS) inputs."""
    body = known_only(object_body(body), KNOWN)
    inputs = prompt_batch(body.get("input"), "input", min(max_inputs, MAX_INPUTS))
    if any(v == "" for v in inputs):  # OpenAI's rule: an empty string has no embedding
        raise bad("input", "must not hold an empty string")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad("encoding_format", "must be 'float' or 'base64'")
    dimensions = body.get("dimensions")
    if dimensions is not None and not (_is(dimensions, int) and dimensions >= 1):
        raise bad("dimensions", "must be an integer >= 1 (at most the model's hidden size)")
    normalize = body.get("normalize", True)
    if not _is(normalize, bool):
        raise bad("normalize", "must be a boolean")
    parsed = embedding_requests(body, inputs)
    return parsed, EmbeddingFormat(encoding == "base64", dimensions, normalize)


def known_only(body: dict[str, Any], known: set[str]) -> dict[str, Any]:
    """`body`, once every key is one of `known` and `user` a string; else ApiError (400)."""
    for key in body:
        if key not in known:
            raise ApiError(400, f"unsupported parameter: {key}", param=key,
                           code="unsupported_parameter")  # fmt: skip
    if body.get("user") is not None and not _is(body["user"], str):
        raise bad("user", "must be a string")
    return body


def embedding_requests(body: dict[str, Any], inputs: list[Any]) -> ParsedRequest:
    """One embedding request an input (greedy, one token, `embed`), with the body's
    `truncate_prompt_tokens`, `add_special_tokens`, `cache_salt` and vLLM's `priority`."""
    options: dict[str, Any] = {"max_tokens": 1, "temperature": 0, "embed": True}
    for name in ("truncate_prompt_tokens", "add_special_tokens", "cache_salt"):
        if name in body:
            options[name] = body[name]
    if "priority" in body:  # vLLM's: orders the queue (lower first)
        options["queue_priority"] = body["priority"]
    return ParsedRequest("embeddings", body.get("model"), inputs[0], options,
                         user=body.get("user"), batch=list(inputs))  # fmt: skip


def embeddings_answer(dones: list[Done], model: str, fmt: EmbeddingFormat) -> dict[str, Any]:
    """The answer's JSON: one vector an input, in order, and the prompt tokens used."""
    data = []
    for index, done in enumerate(dones):
        assert done.embedding is not None, "the daemon returns an embedding when asked"
        vector = shaped(logits_from_wire(done.embedding), fmt)
        spelled: Any = (
            base64.b64encode(vector.astype("<f4").tobytes()).decode()
            if fmt.base64
            else vector.tolist()
        )
        data.append({"object": "embedding", "index": index, "embedding": spelled})
    tokens = sum(done.prompt_tokens for done in dones)
    return {"id": f"embd-{time.time_ns():x}", "object": "list", "created": int(time.time()),
            "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip


def shaped(row: np.ndarray, fmt: EmbeddingFormat) -> np.ndarray:
    """A model row as the answer gives it: cut to `dimensions`, then normalized (float64
    sum, one rounding to float32); ApiError when `dimensions` exceeds the row."""
    if fmt.dimensions is not None:
        if fmt.dimensions > row.shape[-1]:
            raise bad("dimensions", f"must be at most {row.shape[-1]} (the model's hidden size)")
        row = row[: fmt.dimensions]
    if not fmt.normalize:
        return row.astype(np.float32)
    wide = row.astype(np.float64)
    norm = float(np.sqrt(np.dot(wide, wide)))
    return (wide / max(norm, 1e-12)).astype(np.float32)
