"""llama.cpp's /completion answers, built from what the daemon sent (TokenChunk, Done).

`CompletionAnswers` spells one request's answers: a streamed chunk (`chunk`: the new
`content`, its `tokens`, `stop: false`) and a prompt's last event or whole answer
(`final`: `content`, `tokens` (with return_tokens), `stop: true`, `stop_type`,
`stopping_word`, the token counts, `generation_settings`, `prompt`, `timings` and, with
n_probs, `completion_probabilities`). As in llama.cpp, a stream's last event carries
no content or tokens of its own: the chunks before it had them all.

Values are the daemon's, reshaped: `stop_type` is "limit" for finish_reason "length",
"word" when a stop string ended it (`stopping_word`), "eos" for any other stop (an end
token, or a grammar's end); a probability entry is a token's raw log-probability and
its top alternatives (Done.logprobs), each with its text and that text's UTF-8 bytes (a
piece of a multi-byte character is U+FFFD there, as in the OpenAI routes' logprobs).

`timings`, from the Done: `prompt_n` the prompt tokens computed (not cached; `cache_n`
the cached ones), `prompt_ms` the daemon's time from receipt to the first token
(Done.ttft_ms: its queue wait too, none on an idle daemon), `predicted_n` the tokens
generated and `predicted_ms` the rest of the request's time in the daemon (its total,
Done.tokens_per_s's tokens over time, less prompt_ms). The daemon reports no total for
a request that generated no token; then it is the HTTP layer's wall clock from the
request's arrival to its Done (`wall_ms`).
"""

from __future__ import annotations

from typing import Any

from ...ipc.messages import Done, TokenChunk
from .llama_cpp_api import LlamaOptions
from .openai_api import ParsedRequest

ID_SLOT = -1  # no slots here: llama.cpp's "any slot"


class CompletionAnswers:
    """The answers of one /completion request, prompt by prompt (`index`)."""

    def __init__(
        self, parsed: ParsedRequest, options: LlamaOptions, model: str, n_ctx: int
    ) -> None:
        self.options = options
        self.model = model
        self.settings = {**options.settings, "n_ctx": n_ctx, "model": model}
        self.num_predicted = [0] * parsed.num_choices

    def chunk(self, index: int, chunk: TokenChunk) -> dict[str, Any]:
        self.num_predicted[index] += len(chunk.token_ids)
        event = {"index": index, "content": chunk.text, "tokens": chunk.token_ids, "stop": False,
                 "id_slot": ID_SLOT, "tokens_predicted": self.num_predicted[index],
                 "tokens_evaluated": chunk.prompt_tokens}  # fmt: skip
        if self.options.n_probs and chunk.logprobs is not None:
            event["completion_probabilities"] = probabilities(chunk.logprobs)
        return event

    def final(
        self, index: int, done: Done, prompt: str, wall_ms: float, *, stream: bool
    ) -> dict[str, Any]:
        """A prompt's whole answer, or (`stream`) its last event. `prompt` is the text of
        the prompt's ids; `wall_ms` the HTTP layer's time from arrival to the Done."""
        kind, word = stop_type(done)
        answer = {
            "index": index,
            "content": "" if stream else done.text,
            "tokens": done.token_ids if self.options.return_tokens and not stream else [],
            "id_slot": ID_SLOT,
            "stop": True,
            "model": self.model,
            "tokens_predicted": len(done.token_ids),
            "tokens_evaluated": done.prompt_tokens,
            "generation_settings": self.settings,
            "prompt": prompt,
            "has_new_line": "\n" in done.text,
            "truncated": False,
            "stop_type": kind,
            "stopping_word": word,
            "tokens_cached": done.cached_tokens,
            "timings": timings(done, wall_ms),
        }
        if self.options.n_probs and not stream and done.logprobs is not None:
            answer["completion_probabilities"] = probabilities(done.logprobs)
        return answer


def stop_type(done: Done) -> tuple[str, str]:
    """llama.cpp's stop_type and stopping_word of a finished request."""
    if done.finish_reason == "length":
        return "limit", ""
    if isinstance(done.stop_reason, str):
        return "word", done.stop_reason
    return ("eos", "") if done.finish_reason == "stop" else ("none", "")


def probabilities(wire: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """llama.cpp's completion_probabilities of the daemon's logprobs entries."""

    def entry(token_id: int, text: str, logprob: float) -> dict[str, Any]:
        return {"id": token_id, "token": text, "bytes": list(text.encode()), "logprob": logprob}

    return [{**entry(lp["id"], lp["token"], lp["logprob"]),
             "top_logprobs": [entry(*top) for top in lp["top"]]} for lp in wire]  # fmt: skip


def timings(done: Done, wall_ms: float) -> dict[str, Any]:
    """llama.cpp's timings of a finished request (the module docstring says from what)."""
    prompt_n = max(done.prompt_tokens - done.cached_tokens, 0)
    predicted_n = len(done.token_ids)
    prompt_ms = done.ttft_ms
    total_ms = 1e3 * predicted_n / done.tokens_per_s if done.tokens_per_s > 0 else wall_ms
    predicted_ms = max(total_ms - prompt_ms, 0.0)
    return {
        "cache_n": done.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1e3 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0,
    }
