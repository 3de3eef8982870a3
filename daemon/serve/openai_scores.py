"""vLLM's /score and /rerank for an embedding model: the cosine similarity of two texts'
embeddings (openai_embeddings.py's vectors, normalized), over the HTTP API.

`parse_score` reads /score's `text_1` and `text_2` (a string and a string, a string and
a list, or two lists of one length: the pairs scored, as vLLM pairs them) and
`parse_rerank` /rerank's `query`, `documents` and `top_n` (Jina's and Cohere's shape);
both raise ApiError (400) naming the parameter. Each distinct text runs once, as an
embedding request of its own; `score_answer` and `rerank_answer` spell the replies.

Guarantees: a score is the dot product, in float64, of the two unit vectors the
/v1/embeddings route would return for the texts, so it is the same whatever was cached;
rerank's results are the documents by score, highest first (ties by index), at most
`top_n` of them.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ...ipc.codec import logits_from_wire
from ...ipc.messages import Done
from .openai_api import ParsedRequest, object_body
from .openai_embeddings import (
    MAX_INPUTS,
    EmbeddingFormat,
    embedding_requests,
    known_only,
    shaped,
)
from .openai_errors import ApiError, bad
from .openai_errors import is_a as _is

UNIT = EmbeddingFormat(base64=False, dimensions=None, normalize=True)
KNOWN_SCORE = {"model", "text_1", "text_2", "user", "truncate_prompt_tokens", "priority",
               "cache_salt", "add_special_tokens"}  # fmt: skip
KNOWN_RERANK = {"model", "query", "documents", "top_n", "return_documents", "user",
                "truncate_prompt_tokens", "priority", "cache_salt",
                "add_special_tokens"}  # fmt: skip


def parse_score(body: object, max_inputs: int) -> tuple[ParsedRequest, list[tuple[int, int]]]:
    """The embedding requests of a /score body (its distinct texts) and the pairs scored,
    as indices into them."""
    body = known_only(object_body(body), KNOWN_SCORE)
    first, second = _texts(body, "text_1"), _texts(body, "text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise bad("text_2", f"holds {len(second)} texts for text_1's {len(first)}: give one "
                  "text_1, or lists of one length")  # fmt: skip
    texts = list(dict.fromkeys([*first, *second]))
    index = {text: i for i, text in enumerate(texts)}
    pairs = [(index[a], index[b]) for a, b in zip(first, second, strict=True)]
    return _requests(body, texts, max_inputs), pairs


def parse_rerank(body: object, max_inputs: int) -> tuple[ParsedRequest, int, bool]:
    """The embedding requests of a /rerank body (the query, then its distinct documents),
    how many results to give (top_n, default all) and whether they carry the documents."""
    body = known_only(object_body(body), KNOWN_RERANK)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise bad("query", "must be a non-empty string")
    documents = _texts(body, "documents")
    top_n = body.get("top_n", len(documents))
    if not (_is(top_n, int) and top_n >= 1):
        raise bad("top_n", "must be an integer >= 1")
    keep = body.get("return_documents", True)
    if not _is(keep, bool):
        raise bad("return_documents", "must be a boolean")
    return _requests(body, [query, *documents], max_inputs), min(top_n, len(documents)), keep


def score_answer(dones: list[Done], pairs: list[tuple[int, int]], model: str) -> dict[str, Any]:
    vectors = _unit_vectors(dones)
    data = [{"index": i, "object": "score", "score": _cosine(vectors[a], vectors[b])}
            for i, (a, b) in enumerate(pairs)]  # fmt: skip
    tokens = sum(done.prompt_tokens for done in dones)
    return {"id": f"score-{time.time_ns():x}", "object": "list", "created": int(time.time()),
            "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip


def rerank_answer(
    dones: list[Done], texts: list[str], top_n: int, keep: bool, model: str
) -> dict[str, Any]:
    """`texts`: the query, then the documents (as the requests ran)."""
    vectors = _unit_vectors(dones)
    scores = [_cosine(vectors[0], vector) for vector in vectors[1:]]
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if keep:
            result["document"] = {"text": texts[1 + i]}
        results.append(result)
    tokens = sum(done.prompt_tokens for done in dones)
    return {"id": f"rerank-{time.time_ns():x}", "model": model, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip


def _texts(body: dict[str, Any], name: str) -> list[str]:
    value = body.get(name)
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise bad(name, "must be a non-empty string or a non-empty list of them")
    return texts


def _requests(body: dict[str, Any], texts: list[str], max_inputs: int) -> ParsedRequest:
    most = min(max_inputs, MAX_INPUTS)
    if len(texts) > most:
        raise ApiError(400, f"{len(texts)} distinct texts; at most {most} a request (each "
                       "runs as a request: the server's --max-queue)")  # fmt: skip
    return embedding_requests(body, texts)


def _unit_vectors(dones: list[Done]) -> list[np.ndarray]:
    vectors = []
    for done in dones:
        assert done.embedding is not None, "the daemon returns an embedding when asked"
        vectors.append(shaped(logits_from_wire(done.embedding), UNIT).astype(np.float64))
    return vectors


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b))
