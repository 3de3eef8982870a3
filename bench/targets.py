"""What `reprise bench` measures: an engine in this process, or a running daemon.

Both answer `run(batch)`: submit a batch of token-id prompts at once and return,
per request, its prompt and cached token counts and its time to first token and
to the end, measured from the submission. Reuse is switched off per request by a
cache salt of its own (requests with different salts share no block), so one
target measures reuse on and off side by side.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from ..daemon import Engine, SamplingParams


@dataclass(frozen=True, slots=True)
class Request:
    token_ids: list[int]
    max_tokens: int
    reuse: bool = True  # False: a salt of its own, so nothing is shared with anyone


@dataclass(frozen=True, slots=True)
class Result:
    prompt_tokens: int
    cached_tokens: int
    host_cached_tokens: int
    token_ids: tuple[int, ...]  # the generated tokens
    ttft_s: float
    total_s: float

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class Target(Protocol):
    name: str

    def run(self, batch: list[Request]) -> list[Result]: ...
    def stats(self) -> dict[str, Any]: ...


def _salt(request: Request) -> str | None:
    return None if request.reuse else uuid.uuid4().hex


def _params(request: Request) -> SamplingParams:
    return SamplingParams(max_tokens=request.max_tokens, temperature=0, ignore_eos=True)


class InProcess:
    """An Engine stepped in this thread; times are taken at each step's end."""

    name = "in-process"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def run(self, batch: list[Request]) -> list[Result]:
        engine = self.engine
        start = time.perf_counter()
        ids = [engine.add_request(r.token_ids, _params(r), cache_salt=_salt(r)) for r in batch]
        first: dict[Any, float] = {}
        end: dict[Any, float] = {}
        while len(end) < len(ids):
            for out in engine.step():
                now = time.perf_counter() - start
                first.setdefault(out.request_id, now)
                if out.finish_reason:
                    end[out.request_id] = now
        results = []
        for request_id in ids:
            done = engine.take_completion(request_id)
            results.append(
                Result(
                    len(done.prompt_token_ids),
                    done.cached_tokens,
                    done.host_cached_tokens,
                    tuple(done.token_ids),
                    first[request_id],
                    end[request_id],
                )
            )
        return results

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()


class Daemon:
    """A running `reprise serve`, one client connection per concurrent request; the
    time to first token is the daemon's own (from receipt), the total the client's."""

    name = "daemon"

    def __init__(self, address: str | None, timeout_s: float = 600.0) -> None:
        from ..ipc import Client

        self._client = lambda: Client(address, timeout_s=timeout_s)
        with self._client() as client:
            self.vocab_size = client.health().vocab_size

    def run(self, batch: list[Request]) -> list[Result]:
        results: list[Result | BaseException | None] = [None] * len(batch)
        start = time.perf_counter()

        def one(idx: int, request: Request) -> None:
            try:
                with self._client() as client:
                    done = client.generate(
                        request.token_ids,
                        max_tokens=request.max_tokens,
                        temperature=0,
                        ignore_eos=True,
                        cache_salt=_salt(request),
                    )
                results[idx] = Result(
                    done.prompt_tokens,
                    done.cached_tokens,
                    done.host_cached_tokens,
                    tuple(done.token_ids),
                    done.ttft_ms / 1e3,
                    time.perf_counter() - start,
                )
            except BaseException as e:  # handed to the caller below
                results[idx] = e

        threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(batch)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [r for r in results if isinstance(r, Result)]

    def stats(self) -> dict[str, Any]:
        with self._client() as client:
            return client.stats()
