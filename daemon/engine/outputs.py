"""What a sampled token does to its request, and what the request hands back.

`record_token` adds a token to a Sequence and decides whether the request ends
there; `step_output` is what one step gives a request's stream; `completion` is
what a finished request gives its caller.

Guarantees:
- A request ends on the first of, in this precedence: a stop token (eos unless
  `ignore_eos`, or one of `stop_token_ids`) after its `min_tokens`-th token (before, the
  sampler held them back): finish "stop", held characters flushed, the stop token's own
  text left out unless `include_stop_str_in_output` (vLLM's);
  the end of its structured output's grammar (it admits nothing more): "stop", flushed;
  a stop string beginning in the text this token could have completed: "stop", the
  text cut where the earliest one begins (after it, with `include_stop_str_in_output`;
  of two beginning there, the first listed), nothing flushed (looked for from the
  `min_tokens`-th token on); `max_tokens` or the
  context full: "length", flushed (`extend_text`, which daemon/serve/detokenize.py
  applies off the engine loop too).
- A request no token can come next for (its mask keeps only tokens bad_words or
  min_tokens forbid: SamplingBatch.dead_rows) gets none: the engine ends it with
  "error", `error` saying why, and its last output has no token.
- Deltas joined give the text; while a request runs they hold back the characters
  that could still begin a stop string, so no delta is ever taken back.
- Without a detokenizer (`detokenize=False`) text stays empty and only token ids
  decide the end.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from ..model.tokenizer import IncrementalDetokenizer, Tokenizer
from .params import Completion, FinishReason, StepOutput
from .prompt_logprobs import PromptEntries
from .sequence import Sequence


def new_detokenizer(seq: Sequence, tokenizer: Tokenizer) -> IncrementalDetokenizer | None:
    """The detokenizer of a request that asked for text, None for one that did not
    (the daemon detokenizes on its own thread). It starts from the prompt's text
    tokens: prompt-table ids are no vocabulary entries."""
    params = seq.params
    if not params.detokenize:
        return None
    return IncrementalDetokenizer(
        tokenizer, seq.text_prompt_ids(), skip_special_tokens=params.skip_special_tokens
    )


def record_token(
    seq: Sequence,
    token: int,
    logits: np.ndarray | None,
    detok: IncrementalDetokenizer | None,
    stop_token_ids: Collection[int],
    max_model_len: int,
) -> bool:
    """Record a sampled token (with its logprobs, logits and text); returns True when
    the request is finished, its `finish_reason` set (module docstring)."""
    params = seq.params
    seq.output_token_ids.append(token)
    if (logprobs := seq.sampling.record(token, logits)) is not None:
        seq.logprobs.append(logprobs)
    if params.return_logits:  # the runner brings the row back: it is returned
        seq.logits.append(np.array(logits, dtype=np.float32))
    num_out = len(seq.output_token_ids)
    eos = token in stop_token_ids and not params.ignore_eos
    grammar = seq.sampling.grammar
    if (eos or token in params.stop_token_ids) and num_out > params.min_tokens:
        by_ids: FinishReason | None = "stop"  # min_tokens held its stop tokens back before
        seq.stop_reason = None if eos else token  # vLLM's: eos is no stop reason
        seq.ended_on_stop_token = True
    elif grammar is not None and grammar.ended:  # its structured output admits nothing more
        by_ids = "stop"
    elif room_left(seq, max_model_len) <= 0:
        by_ids = "length"
    else:
        by_ids = None
    text = extend_text(
        seq.text, detok, token, active_stops(params.stop, num_out, params.min_tokens), by_ids,
        include_stop=params.include_stop_str_in_output, stop_token=seq.ended_on_stop_token,
    )  # fmt: skip
    seq.text, seq.finish_reason = text.text, text.finish_reason
    if text.stop_string is not None:
        seq.stop_reason = text.stop_string
    return text.finish_reason is not None


def room_left(seq: Sequence, max_model_len: int) -> int:
    """The tokens `seq` may still generate before it ends by length: its max_tokens, or
    the context's end."""
    return min(seq.params.max_tokens - len(seq.output_token_ids), max_model_len - seq.num_tokens)


def active_stops(stop: list[str], num_tokens: int, min_tokens: int) -> list[str]:
    """The stop strings looked for at a request's `num_tokens`-th token: none before its
    `min_tokens`-th (vLLM's rule)."""
    return stop if num_tokens >= min_tokens else []


@dataclass(frozen=True, slots=True)
class TextStep:
    text: str  # the request's text after the token
    finish_reason: FinishReason | None  # its end, if this token ended it
    stop_string: str | None = None  # the stop string that ended it (the text cut at it)

    @property
    def stopped(self) -> bool:
        """A stop string ended it."""
        return self.stop_string is not None


def extend_text(
    text: str,
    detok: IncrementalDetokenizer | None,
    token: int,
    stop: list[str],
    by_ids: FinishReason | None,
    *,
    include_stop: bool = False,
    stop_token: bool = False,
) -> TextStep:
    """A request's text after one more token, and whether the token ends it: `by_ids`
    is the end its token ids give ("stop": eos or a stop token id; "length"), a stop
    string comes between the two (module docstring), the text cut where it begins, or
    after it with `include_stop`. `stop_token`: the token is the stop token (eos or a
    stop token id) that ends it, whose text is left out unless `include_stop` (vLLM's
    rule). The engine's rule, and the daemon's detokenizing thread's
    (daemon/serve/detokenize.py)."""
    # a stop string this token completes ends in its text, so it begins at most the
    # longest one's length less one before it (one wholly before was looked for then, or,
    # under min_tokens, not yet to be looked for)
    searched = max(len(text) - max(map(len, stop), default=1) + 1, 0)
    if detok is not None and not (stop_token and not include_stop):
        text += detok.push(token)
    if by_ids != "stop" and stop and (found := find_stop(text, stop, searched)) is not None:
        cut, matched = found
        end = cut + len(matched) if include_stop else cut
        return TextStep(text[:end], "stop", matched)  # nothing flushed: the cut ends it
    if by_ids is not None and detok is not None:
        text += detok.flush()
    return TextStep(text, by_ids)


def step_output(seq: Sequence, tokens: list[int], logits: np.ndarray | None) -> StepOutput:
    """What this step gave the request: its tokens (one, or more after a draft, or none
    when no token could come next; `logits` their rows, [len(tokens), vocab]), the text
    not handed out before (less what could still begin a stop string, while it runs), and
    its end if it ended. Advances `seq.num_text_emitted`."""
    max_stop_chars = max(map(len, seq.params.stop), default=0)
    delta, seq.num_text_emitted = next_delta(
        seq.text, seq.num_text_emitted, max_stop_chars, finished=seq.finish_reason is not None
    )
    return StepOutput(
        seq.request_id,
        tokens,
        delta,
        seq.finish_reason,
        np.array(logits, dtype=np.float32) if seq.params.return_logits and tokens else None,
        seq.logprobs[len(seq.logprobs) - len(tokens) :]
        if seq.params.logprobs is not None
        else None,
        seq.ended_on_stop_token,
        seq.error,
    )


def next_delta(
    text: str, num_emitted: int, max_stop_chars: int, *, finished: bool
) -> tuple[str, int]:
    """The text not handed out yet, and how much of `text` is handed out after it: while
    the request runs, less the characters that could still begin a stop string (the
    longest one's length less one), so no delta is ever taken back."""
    hold = 0 if finished else max(max_stop_chars - 1, 0)
    end = max(len(text) - hold, num_emitted)
    return text[num_emitted:end], end


def completion(seq: Sequence) -> Completion:
    """The result of a finished (or cancelled) request."""
    assert seq.finish_reason is not None
    return Completion(
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=seq.output_token_ids,
        text=seq.text,
        finish_reason=seq.finish_reason,
        cached_tokens=seq.num_cached_tokens or 0,
        host_cached_tokens=seq.num_cached_host_tokens,
        disk_cached_tokens=seq.num_cached_disk_tokens,
        logits=np.stack(seq.logits) if seq.params.return_logits else None,
        logprobs=seq.logprobs if seq.params.logprobs is not None else None,
        prompt_logprobs=_prompt_entries(seq),
        stop_reason=seq.stop_reason if seq.finish_reason == "stop" else None,
        embedding=seq.embedding,
        error=seq.error,
    )


def find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """Where the earliest stop string begins at or after `start`, and which it is (of
    two beginning there, the first listed), if any."""
    hits = [(i, k) for k, s in enumerate(stops) if (i := text.find(s, start)) != -1]
    if not hits:
        return None
    index, k = min(hits)
    return index, stops[k]


def _prompt_entries(seq: Sequence) -> PromptEntries | None:
    """A finished request's prompt entries; None unless it asked and got them all (a
    request cancelled during its prefill has not)."""
    wanted = seq.prompt_logprobs
    return wanted.entries() if wanted is not None and wanted.complete else None
