"""Detokenizing off the engine loop (DESIGN §6, issue 19).

The daemon runs every request with `detokenize=False` and no stop strings in the
engine, so the engine tracks token ids only and ends a request on them alone (eos,
stop_token_ids, max_tokens, the context). The serving loop hands each step's new token
ids here, and one thread turns them into text with the same incremental detokenizer
the engine would have used (same window, same held-back partial characters, same
final flush) and applies the request's stop strings with the rules of
`extend_text` (daemon/engine/outputs.py), token by token and in its precedence:

1. the engine ended the request on this token with "stop" (eos or a stop token id):
   the held characters are flushed, no stop string is looked for, and the stop token's
   own text is left out unless include_stop_str_in_output (vLLM's rule);
2. else a stop string that begins at or after the searched point (the text before the
   token, less the longest stop's length plus one: a stop string ending in the token's
   text; from the request's min_tokens-th token on) ends the request here: the text is
   cut where the earliest one begins (after it, with include_stop_str_in_output),
   nothing is flushed, and the tokens after this one (the engine may have computed one
   or two more) are never sent;
3. else the engine ended it with "length": flushed.

While a request runs, its deltas hold back the characters that could still begin a
stop string (as the engine's `step_output`), so the text, the deltas and the token lists
sent are those the engine gives in process with the same stop strings.

Guarantees: tasks run one at a time in submission order, so a request's replies
(built and sent by the callbacks, on this thread) keep their order; a request a stop
string ended is put in `stopped` once (the loop cancels it in the engine, and its one
Done comes from `close`); a task that fails is logged and the next one runs.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..engine.outputs import active_stops, extend_text, next_delta
from ..engine.params import FinishReason
from ..engine.sequence import RequestId
from ..model.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("reprise.server")


@dataclass(frozen=True, slots=True)
class TextEnd:
    """A request's text when it ended, and how many of its tokens the reply keeps."""

    text: str
    num_tokens: int  # tokens pushed, up to and including the one a stop string ended on
    # the stop string that ended it (its finish reason is "stop", whatever the engine's)
    stop_string: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None


ChunkCallback = Callable[[str, int], None]  # (new text, how many of the pushed tokens to send)
EndCallback = Callable[[TextEnd], None]


@dataclass(slots=True)
class _Text:
    """One request's text, touched only on the detokenizing thread."""

    detok: IncrementalDetokenizer
    stop: list[str]
    max_stop_chars: int  # the longest stop string's length (0 without any): the hold-back
    min_tokens: int  # stop strings are looked for from this token on
    include_stop: bool = False  # the stop string stays at the end of the text
    text: str = ""
    num_emitted: int = 0  # characters of `text` already sent as deltas
    num_tokens: int = 0
    finished: bool = False  # by the engine's last token or a stop string: later pushes are dropped
    stop_string: str | None = None  # the stop string that ended it


class Detokenizing:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.stopped: queue.SimpleQueue[RequestId] = queue.SimpleQueue()  # for the loop to cancel
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="detokenize")
        self._texts: dict[RequestId, _Text] = {}  # this thread's only

    def open(
        self,
        request_id: RequestId,
        prompt_ids: list[int],
        skip_special_tokens: bool,
        stop: list[str] | None = None,
        min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        stops = list(stop or ())

        def start() -> None:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens
            )
            longest = max(map(len, stops), default=0)
            self._texts[request_id] = _Text(detok, stops, longest, min_tokens, include_stop)

        self._submit(start)

    def push(
        self,
        request_id: RequestId,
        token_ids: list[int],
        *,
        finish_reason: FinishReason | None,
        then: ChunkCallback | None,
        stop_token: bool = False,
    ) -> None:
        """Add generated tokens (`finish_reason`: the engine's, when it ended the request
        on the last of them; `stop_token`: on a stop token, whose text is left out);
        `then(new_text, num_tokens)` runs next, on this thread,
        unless an earlier stop string ended the request: `num_tokens` of `token_ids` are
        to be sent (fewer than all when a stop string ends it on one of them)."""

        def push() -> None:
            state = self._texts[request_id]
            if state.finished:
                return
            num_kept = _advance(state, token_ids, finish_reason, stop_token)
            if state.stop_string is not None:
                self.stopped.put(request_id)
            delta, state.num_emitted = next_delta(
                state.text, state.num_emitted, state.max_stop_chars, finished=state.finished
            )
            if then is not None:
                then(delta, num_kept)

        self._submit(push)

    def close(self, request_id: RequestId, then: EndCallback) -> None:
        """The request ended (finished, cancelled or stopped): `then(end)` gets its text."""

        def close() -> None:
            state = self._texts.pop(request_id)
            then(TextEnd(state.text, state.num_tokens, state.stop_string))

        self._submit(close)

    def discard(self, request_id: RequestId) -> None:
        def discard() -> None:
            self._texts.pop(request_id, None)

        self._submit(discard)

    def then(self, fn: Callable[[], None]) -> None:
        """Run `fn` after everything submitted so far (a reply that must follow them)."""
        self._submit(fn)

    def take_stopped(self) -> list[RequestId]:
        """The requests stop strings ended since the last call (for the loop to cancel)."""
        out = []
        while True:
            try:
                out.append(self.stopped.get_nowait())
            except queue.Empty:
                return out

    def shutdown(self) -> None:
        """Run what is queued, then stop."""
        self._pool.shutdown(wait=True)

    def _submit(self, fn: Callable[[], None]) -> None:
        self._pool.submit(_logged, fn)


def _advance(
    state: _Text, token_ids: list[int], finish_reason: FinishReason | None, stop_token: bool
) -> int:
    """Add tokens to `state` by the engine's rule (`extend_text`); returns how many of
    them the request keeps (all, unless a stop string ends it before the last)."""
    for num_kept, token in enumerate(token_ids, 1):
        last = num_kept == len(token_ids)
        by_ids = finish_reason if last else None  # the engine's end
        stop = active_stops(state.stop, state.num_tokens + 1, state.min_tokens)
        step = extend_text(state.text, state.detok, token, stop, by_ids,
                           include_stop=state.include_stop,
                           stop_token=last and stop_token)  # fmt: skip
        state.text = step.text
        state.num_tokens += 1
        if step.finish_reason is not None:
            state.finished, state.stop_string = True, step.stop_string
            return num_kept
    return len(token_ids)


def _logged(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # our bug: one request's replies are lost, the others go on
        log.exception("internal error detokenizing")
