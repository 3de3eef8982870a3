"""Start-up work done before the socket is bound, so the first client pays none of it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..engine.engine import Engine
from ..engine.params import SamplingParams
from .intake import RequestChecks

log = logging.getLogger("reprise.server")


def warm_up(
    engine: Engine,
    checks: RequestChecks,
    max_seqs: int,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """On the GPU, capture the decode graph of every batch size a step can have (up to
    `max_seqs` sequences; with speculation, the drafted steps' too); on every backend,
    run one tiny request (3 prompt tokens, 2 generated) through admission, prefill,
    sampling, decode and retirement.
    `progress(done, total)` counts these stages."""
    start = time.perf_counter()
    report = progress or (lambda done, total: None)
    _ = checks.max_token_bytes  # the prompt-size bound, read once from the vocabulary
    decode = engine.runner.decode  # None: no decode graphs (set when the runner is made)
    total = 2 if decode is not None else 1
    report(0, total)
    if decode is not None:
        log.info("warm-up: capturing the decode graphs (CUDA graphs) of every batch size")
        sizes = engine.capture_decode_graphs(max_seqs)
        if sizes:
            drafted = decode.built_buckets(drafted=True)
            log.info("decode graphs captured for batch sizes %s%s in %.1f s",
                     ",".join(map(str, sizes)),
                     f" (drafted steps: {','.join(map(str, drafted))})" if drafted else "",
                     time.perf_counter() - start)  # fmt: skip
        else:
            log.warning("decode graphs off: %s", decode.failed)
        report(1, total)
    else:
        log.info("warm-up: no decode graphs on the %s backend; one tiny request runs "
                 "through every stage", engine.runner.model.ops.name)  # fmt: skip
    params = SamplingParams(max_tokens=2, temperature=0)
    request_id = engine.add_request([1, 2, 3], params, cache_salt="reprise-warm-up")
    while engine.has_work():
        engine.step()
    engine.take_completion(request_id)
    report(total, total)
    log.info("warm-up done in %.1f s", time.perf_counter() - start)
