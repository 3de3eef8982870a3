"""Detokenizing off the engine loop (DESIGN §6, issue 19).

A request without stop strings ends on token ids alone (eos, stop_token_ids,
max_tokens), so the engine runs it with `detokenize=False` and the serving loop hands
its new token ids here; one thread turns them into text with the same incremental
detokenizer the engine would have used (same window, same held-back partial
characters, same final flush), so the text is identical. Requests with stop strings
keep detokenizing on the loop: the text decides when they finish, and its cost there
is bounded by the stop-string limits.

Guarantees: tasks run one at a time in submission order, so a request's replies
(built and sent by the callbacks, on this thread) keep their order; a task that fails
is logged and the next one runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..engine.sequence import RequestId
from ..model.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("reprise.server")
TextCallback = Callable[[str], None]


class Detokenizing:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="detokenize")
        self._detokenizers: dict[RequestId, IncrementalDetokenizer] = {}  # this thread's only

    def open(self, request_id: RequestId, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        def start() -> None:
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens
            )

        self._submit(start)

    def push(
        self, request_id: RequestId, token_ids: list[int], *, last: bool, then: TextCallback | None
    ) -> None:
        """Add generated tokens; `then(new_text)` runs next (on this thread). With `last`
        (the engine finished the request) the held characters are flushed too, as the
        engine does; a cancelled request is never flushed."""

        def push() -> None:
            detok = self._detokenizers[request_id]
            text = "".join([detok.push(token) for token in token_ids])
            if last:
                text += detok.flush()
            if then is not None:
                then(text)

        self._submit(push)

    def close(self, request_id: RequestId, then: TextCallback) -> None:
        """The request ended: `then(text)` gets all of its text."""

        def close() -> None:
            then(self._detokenizers.pop(request_id).text)

        self._submit(close)

    def discard(self, request_id: RequestId) -> None:
        self._submit(lambda: self._detokenizers.pop(request_id, None) and None)

    def then(self, fn: Callable[[], None]) -> None:
        """Run `fn` after everything submitted so far (a reply that must follow them)."""
        self._submit(fn)

    def shutdown(self) -> None:
        """Run what is queued, then stop."""
        self._pool.shutdown(wait=True)

    def _submit(self, fn: Callable[[], None]) -> None:
        self._pool.submit(_logged, fn)


def _logged(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # our bug: one request's replies are lost, the others go on
        log.exception("internal error detokenizing")
