"""The clients' generate requests, from their arrival on the loop to their one final reply.

A generate is checked on the I/O thread (intake.py) and reaches `start` as `Ready`. Its
prompt is tokenized on one of a few threads (`PendingRequest`), then it is handed to
the engine (`admit_ready`) as one engine request per choice (`LiveRequest`). Each
step's tokens go to the detokenizing thread (detokenize.py), which streams their text;
the request's end (the engine's, a stop string's, a cancel, a client gone, a drain)
sends its Done or ErrorReply after its chunks (an ErrorReply "bad_request" when the
engine ended it with an error: no token could come next).

Guarantees:
- one final reply per client request and choice: a Done each, or one ErrorReply for
  all of a request's choices (`finish` with `abort`), never both, never two;
- replies go to the connection (`Route`) the request came on, and to no other;
- a request whose client is gone is cancelled in the engine at once (`drop_client`),
  so its blocks return to the pool;
- at most `max_queue` choices are queued or running (pending ones counted by their n).
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from ...ipc.codec import encode, error_bytes
from ...ipc.messages import (
    Detokenize,
    DetokenizeReply,
    Generate,
    ProtocolError,
    TokenChunk,
    Tokenize,
    TokenizeReply,
)
from ..engine.engine import Engine
from ..engine.params import Retention, SamplingParams, StepOutput
from ..engine.prompts import PreparedPrompt
from ..engine.sequence import RequestId
from .detokenize import Detokenizing, TextEnd
from .intake import Ready, RequestChecks
from .replies import Outbox, Route, cancelled_done, done_reply, log_done, logprobs_wire
from .status import Counters

log = logging.getLogger("reprise.server")
TOKENIZING_THREADS = 4  # prompts tokenized at once, off the loop


@dataclass(slots=True)
class LiveRequest:
    route: Route
    client_id: str
    stream: bool
    t_received: float
    index: int = 0  # which of the client request's choices (sampling.n) this is
    num_choices: int = 1
    prompt_tokens: int = 0  # the prompt's length, which each streamed chunk carries
    # the prompt's ids, for the first chunk and the Done (Generate.return_token_ids)
    prompt_token_ids: list[int] | None = None
    prompt_ids_sent: bool = False  # on a chunk (set on the detokenizing thread alone)
    t_first: float | None = None
    t_first_step: float | None = None  # when the step that gave the first token began


@dataclass(slots=True)
class PreparedRequest:
    """What a tokenizing thread makes of a generate's prompt (Requests._prepare)."""

    prompt: PreparedPrompt | list[int]  # the ids, checked and keyed by the engine if it could
    text_ids: list[int]  # its text tokens (no prompt-table ids): the detokenizer's context


@dataclass(slots=True)
class PendingRequest:
    """A generate whose prompt is being tokenized off the loop (Requests.admit_ready)."""

    ready: Ready
    prepared: Future[PreparedRequest]


class Requests:
    """The requests of every connection; used by the loop (and, past a drain deadline,
    by the drain's thread while it holds the loop's turn)."""

    def __init__(
        self,
        engine: Engine,
        checks: RequestChecks,
        counters: Counters,
        outbox: Outbox,
        *,
        max_queue: int,
    ) -> None:
        self.engine = engine
        self.checks = checks
        self.counters = counters
        self.outbox = outbox
        self.max_queue = max_queue
        self.live: dict[RequestId, LiveRequest] = {}
        # a client request's choices still running, in choice order
        self.by_client: dict[tuple[Route, str], list[RequestId]] = {}
        # Prompts are tokenized (and chat templates rendered) on these threads, never on
        # the loop; the tokenizer releases the GIL while it encodes. Several, so that one
        # long prompt (up to the message size limit) holds up no other request's admission.
        self.pending: dict[tuple[Route, str], PendingRequest] = {}
        # tokenize and detokenize requests, answered from those threads too: their replies
        self.texts: dict[tuple[Route, str], Future[bytes]] = {}
        self._tokenizing = ThreadPoolExecutor(
            max_workers=TOKENIZING_THREADS, thread_name_prefix="tokenize"
        )
        self.text = Detokenizing(engine.tokenizer)  # every request's text and stop strings
        # each vocabulary token's own text, decoded once a daemon (a 2k prompt's logprobs
        # with top 5 name thousands of tokens: decoding them for each Done was about a
        # third of the 12 ms its prompt entries took to go out)
        self._token_texts: dict[int, str] = {}

    @property
    def num_open(self) -> int:
        """Client requests not yet answered, admitted or still tokenizing (tokenizes and
        detokenizes included)."""
        return len(self.live) + len(self.pending) + len(self.texts)

    def shutdown(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        self.text.shutdown()  # the replies it still has to build go out first

    # -- arrival and admission ---------------------------------------------------------------

    def start(self, route: Route, ready: Ready) -> None:
        """Queue a checked generate for tokenizing (ProtocolError: busy, duplicate id)."""
        request = ready.request
        queued = len(self.live) + sum(p.ready.params.n for p in self.pending.values())
        if queued + ready.params.n > self.max_queue:
            raise ProtocolError(
                "busy",
                f"the queue is full ({self.max_queue} requests, max_queue, "
                "each choice of n counting as one); retry later",
            )
        if (route, request.id) in self.by_client or (route, request.id) in self.pending:
            raise ProtocolError("duplicate_id", f"request {request.id!r} is already running")
        future = self._tokenizing.submit(self._prepare, request, ready.params)
        self.pending[(route, request.id)] = PendingRequest(ready, future)

    def start_text(self, route: Route, request: Tokenize | Detokenize) -> None:
        """Queue a tokenize or detokenize on the tokenizing threads (ProtocolError: busy,
        duplicate id); at most `max_queue` at once, apart from the generates."""
        if len(self.texts) >= self.max_queue:
            raise ProtocolError(
                "busy",
                f"{self.max_queue} tokenize and detokenize requests are in flight "
                "(max_queue); retry later",
            )
        if (route, request.id) in self.texts:
            raise ProtocolError("duplicate_id", f"request {request.id!r} is already running")
        self.texts[(route, request.id)] = self._tokenizing.submit(self._text_reply, request)

    def _text_reply(self, request: Tokenize | Detokenize) -> bytes:
        """On a tokenizing thread: the reply's bytes (ProtocolError for a bad request)."""
        if isinstance(request, Tokenize) and request.messages is not None:
            ids, text = self.checks.chat_ids(request)  # the text too, for /apply-template
            return encode(TokenizeReply(request.id, ids, text))
        if isinstance(request, Tokenize):
            return encode(TokenizeReply(request.id, self.checks.text_ids(request)))
        return encode(DetokenizeReply(request.id, self.checks.text_of(request)))

    def answer_texts(self) -> None:
        """Send the replies of the tokenizes and detokenizes that are done (on the loop)."""
        for key in [key for key, future in self.texts.items() if future.done()]:
            route, future = key[0], self.texts.pop(key)
            send = functools.partial(self._send_text, route, future)
            self.outbox.answering(route, "answering a tokenize", send, key[1])

    def _send_text(self, route: Route, future: Future[bytes]) -> None:
        self.outbox.send(route, future.result())  # a ProtocolError raised there comes here

    def _prepare(self, request: Generate, params: SamplingParams) -> PreparedRequest:
        """On a tokenizing thread: the prompt's ids (ProtocolError for a bad one), then
        what of its admission depends on them alone (Engine.prepare_prompt: the checks,
        the blocks' keys) and its text tokens, so the loop does none of it. A prompt the
        engine refuses goes on as ids, for `add_choices` to refuse on the loop. A
        structured output's grammar is compiled here too (kept by the engine for the
        loop's `add_choices`), and a spec that does not compile refused; and bad_words
        are tokenized (kept by the engine likewise)."""
        ids = self.checks.prompt_ids(request)
        try:
            if params.structured is not None:
                self.engine.grammars.compile(params.structured)
            self.engine.bad_words_ids(params.bad_words)
        except ValueError as e:
            raise ProtocolError("bad_request", str(e)) from None
        vocab = self.engine.config.vocab_size
        text_ids = [t for t in ids if t < vocab]
        try:
            return PreparedRequest(
                self.engine.prepare_prompt(ids, cache_salt=request.cache_salt), text_ids
            )
        except (TypeError, ValueError):
            return PreparedRequest(ids, text_ids)

    def admit_ready(self) -> None:
        """Hand the engine every request whose prompt is tokenized, in arrival order (one
        still tokenizing lets those behind it that are done go first)."""
        for key in [key for key, p in self.pending.items() if p.prepared.done()]:
            route, pending = key[0], self.pending.pop(key)
            admit = functools.partial(self._admit, route, pending)
            self.outbox.answering(route, "admitting a request", admit, pending.ready.request.id)

    def _admit(self, route: Route, pending: PendingRequest) -> None:
        request, params = pending.ready.request, pending.ready.params
        prepared = pending.prepared.result()  # a ProtocolError raised there comes here
        prompt = prepared.prompt if isinstance(prepared.prompt, list) else prepared.prompt.ids
        retention = Retention(priority=request.priority) if request.priority is not None else None
        try:
            if request.fit_max_tokens:  # vLLM's chat default: to what fits after the prompt
                room = self.engine.token_room(len(prompt))
                if room < params.max_tokens:  # (min_tokens past it: refused as bad_request)
                    params = replace(params, max_tokens=max(room, 1))
            # Token ids alone end it in the engine; its text and stop strings are the
            # detokenizing thread's (detokenize.py), which has the loop cancel it at a stop.
            request_ids = self.engine.add_choices(
                prepared.prompt,
                replace(params, stop=[], detokenize=False),
                cache_salt=request.cache_salt,
                retention=retention,
                priority=request.queue_priority,
                prompt_table=pending.ready.prompt_table,
                extra_ids=request.extra_ids,
            )
        except ValueError as e:
            raise ProtocolError("bad_request", str(e)) from None
        self.counters.num_requests_total += 1
        ids = list(prompt) if request.return_token_ids else None  # copied only when asked
        for index, request_id in enumerate(request_ids):
            self.text.open(request_id, prepared.text_ids, params.skip_special_tokens, params.stop,
                           params.min_tokens, params.include_stop_str_in_output)  # fmt: skip
            self.live[request_id] = LiveRequest(
                route,
                request.id,
                request.stream,
                pending.ready.t_received,
                index,
                len(request_ids),
                len(prompt),
                ids,
            )
        self.by_client[(route, request.id)] = list(request_ids)

    def cancel(self, route: Route, client_id: str) -> None:
        """A client's Cancel: every choice of its request ends with "cancelled"."""
        pending = self.pending.pop((route, client_id), None)
        if pending is not None:  # not admitted yet: nothing to free
            pending.prepared.cancel()
            for index in range(pending.ready.params.n):
                self.outbox.send(route, cancelled_done(client_id, index))
            return
        request_ids = self.by_client.get((route, client_id))
        if request_ids is None:
            raise ProtocolError("not_found", f"no running request {client_id!r}", client_id)
        for request_id in list(request_ids):
            self.engine.cancel(request_id)
            self.finish(request_id)

    # -- a step's tokens and the end ---------------------------------------------------------

    def on_output(self, output: StepOutput, t_step: float) -> None:
        request_id = RequestId(output.request_id)
        live = self.live.get(request_id)
        if live is None:
            return  # cancelled earlier in this turn (its client vanished)
        if output.token_ids:  # none when no token could come next (an error ends it)
            if live.t_first is None:
                live.t_first, live.t_first_step = time.monotonic(), t_step
            self._push_text(request_id, live, output)
        if output.error is not None:  # its options contradict each other: a bad request
            self.finish(request_id, abort=("bad_request", output.error))
        elif output.finish_reason is not None:
            self.finish(request_id)

    def _push_text(self, request_id: RequestId, live: LiveRequest, output: StepOutput) -> None:
        """Hand new tokens to the detokenizing thread, which streams their text (and the
        tokens up to a stop string, when one ends the request)."""
        route, client_id, token_ids = live.route, live.client_id, output.token_ids
        logprobs, index, prompt_tokens = output.logprobs, live.index, live.prompt_tokens

        def send_chunk(text: str, num_tokens: int) -> None:  # on the detokenizing thread
            kept = None if logprobs is None else logprobs[:num_tokens]
            prompt_ids = None if live.prompt_ids_sent else live.prompt_token_ids
            live.prompt_ids_sent = True  # the prompt's ids go once, on the first chunk
            chunk = TokenChunk(client_id, token_ids[:num_tokens], text,
                               logprobs_wire(kept, self._token_text), index, prompt_tokens,
                               prompt_ids)  # fmt: skip
            self.outbox.send_quietly(route, encode(chunk))

        self.text.push(
            request_id,
            token_ids,
            finish_reason=output.finish_reason,
            then=send_chunk if live.stream else None,
            stop_token=output.stop_token,
        )

    def cancel_stopped(self) -> None:
        """Cancel in the engine the requests a stop string ended on the detokenizing thread
        (the engine may have computed a token or two more; the reply leaves them out).
        Their one Done comes from `finish`, with the text and tokens cut at the stop."""
        for request_id in self.text.take_stopped():
            if request_id in self.live:  # else the engine finished it first, or it was dropped
                self.engine.cancel(request_id)
                self.finish(request_id)

    def cancel_with(self, request_ids: list[RequestId], abort: tuple[str, str]) -> None:
        """Cancel running requests, each answered with the error `abort` (code, message)
        unless a stop string has ended it."""
        for request_id in request_ids:
            if request_id in self.live:  # else a choice cancelled with an earlier one
                self.engine.cancel(request_id)
                self.finish(request_id, abort=abort)

    def finish(self, request_id: RequestId, abort: tuple[str, str] | None = None) -> None:
        """Send the Done of a request the engine finished or cancelled (or a stop string
        ended), and forget it. With `abort` (code, message), a request no stop string
        ended gets that error instead of a Done; a choice of n gets it in any case, for
        the whole client request, whose other choices still running end with it."""
        live = self.live.pop(request_id)
        key = (live.route, live.client_id)
        siblings = self.by_client.pop(key)
        siblings.remove(request_id)
        if abort is not None:
            for sibling in siblings:  # their chunks already queued still go out first
                self.engine.cancel(sibling)
                self._forget(sibling)
        elif siblings:
            self.by_client[key] = siblings
        whole = self.engine.take_completion(request_id)
        now = time.monotonic()
        t_first = live.t_first if live.t_first is not None else now
        with_ids = live.prompt_token_ids is not None

        def send_done(end: TextEnd) -> None:  # on the detokenizing thread, after the chunks
            if abort is not None and (live.num_choices > 1 or not end.stopped):
                self.counters.num_errors_total += 1
                self.outbox.send_quietly(live.route, error_bytes(*abort, live.client_id))
                return
            done = done_reply(whole, end, client_id=live.client_id, index=live.index,
                              t_received=live.t_received, t_first=t_first,
                              t_first_step=live.t_first_step, now=now,
                              token_text=self._token_text, with_prompt_ids=with_ids)  # fmt: skip
            log_done(done, (now - live.t_received) * 1000)
            self.outbox.send_quietly(live.route, encode(done))

        self.text.close(request_id, then=send_done)

    def _token_text(self, token_id: int) -> str:
        """One token's text on its own (a piece of a multi-byte character shows as U+FFFD),
        kept for the vocabulary's ids (at most vocab_size of them; the detokenizing thread
        and the loop may both ask: a dict's get and set are each atomic)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id])
            if 0 <= token_id < self.engine.config.vocab_size:
                self._token_texts[token_id] = text
        return text

    def drop_client(self, route: Route) -> None:
        """The client is gone or not reading: cancel its requests, so their blocks
        return to the pool (the caller hangs up on it)."""
        for key in [key for key in self.pending if key[0] == route]:
            self.pending.pop(key).prepared.cancel()
        for key in [key for key in self.by_client if key[0] == route]:
            self.counters.num_disconnect_cancels += 1
            for request_id in self.by_client.pop(key):
                self.engine.cancel(request_id)
                self._forget(request_id)

    def _forget(self, request_id: RequestId) -> None:
        """Drop a cancelled request with no reply (its client is gone, or is answered
        for the whole client request by another choice's reply)."""
        del self.live[request_id]
        self.engine.take_completion(request_id)
        self.text.discard(request_id)

    def _refuse_pending(self, code: str, message: str) -> None:
        for (route, client_id), pending in list(self.pending.items()):
            pending.prepared.cancel()
            self.outbox.send_error(route, code, message, client_id)
        self.pending.clear()
        for (route, client_id), future in list(self.texts.items()):
            future.cancel()
            self.outbox.send_error(route, code, message, client_id)
        self.texts.clear()

    def abort_all(self, code: str, message: str) -> None:
        """Answer every request with the error (code, message): on the loop, at the end of
        a drain. Each running one's error follows its chunks still queued."""
        self._refuse_pending(code, message)
        self.cancel_stopped()
        self.cancel_with(list(self.live), (code, message))

    def abort_all_now(self, code: str, message: str) -> None:
        """Answer every request with the error, without the engine: on the drain's thread,
        while an engine step overruns the deadline (the process exits next). The errors
        go out after the chunks still queued; the detokenizing thread is then stopped."""
        self._refuse_pending(code, message)
        for route, client_id in self.by_client:
            data = error_bytes(code, message, client_id)
            self.text.then(functools.partial(self.outbox.send_quietly, route, data))
        self.counters.num_errors_total += len(self.by_client)
        self.text.shutdown()
