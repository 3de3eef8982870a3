"""Bit-identical logits under every reuse path (DESIGN §4), on the default model,
on the NumPy backend and (with a CUDA device) on the CuPy backend.

One greedy and one seeded-sampled request, 64 tokens each, are computed once
alone with reuse off; that is the reference. Every other way of running them
(repeated with reuse on, fully or partially reused, onboarded from the host
tier, prefilled in chunks of any size, batched with random traffic that joins
and leaves, preempted by a small pool) must return the same tokens and the same
full logits arrays, compared with `np.array_equal`, not a tolerance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gpu_support import needs_gpu

from reprise.cuda.backend import get_backend
from reprise.daemon import Completion, Engine, SamplingParams
from reprise.daemon.engine.engine import model_fingerprint
from reprise.daemon.model.config import ModelConfig
from reprise.daemon.model.llama import LlamaModel
from reprise.daemon.model.tokenizer import Tokenizer
from reprise.daemon.model.weights import load_weights

pytestmark = pytest.mark.model

BS = 16
PROMPT_LEN = 100  # 6 full blocks of 16 and 4 tokens
NUM_TOKENS = 64
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, return_logits=True)
SEEDED = SamplingParams(
    max_tokens=NUM_TOKENS,
    temperature=0.8,
    top_p=0.95,
    top_k=200,
    seed=1234,
    ignore_eos=True,
    return_logits=True,
)
PARAMS = [GREEDY, SEEDED]


def random_prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 49000, size=n).tolist()


PROMPTS = [random_prompt(PROMPT_LEN, seed=11), random_prompt(PROMPT_LEN, seed=12)]


class Engines:
    """Engines of any pool shape around one loaded model (loading it is the slow part)."""

    def __init__(self, path: Path, backend: str) -> None:
        self.config = ModelConfig.from_dir(path)
        self.tokenizer = Tokenizer.from_dir(path)
        if backend == "cupy-cc":  # the GPU backend with the CUDA-core attention kernel
            from reprise.cuda.cupy_backend import CupyBackend

            ops = CupyBackend(attention="cuda-cores")
        elif backend == "cupy-mma":  # every GEMM on gemm.cu (the default is the Hopper
            # GEMM on sm_90, wherever gemm_family allows it; mma.sync elsewhere)
            from reprise.cuda.cupy_backend import CupyBackend

            ops = CupyBackend(gemm="mma")
        else:
            ops = get_backend(backend)
        self.model = LlamaModel(self.config, load_weights(path, self.config), ops)
        self.fingerprint = model_fingerprint(path)

    def __call__(self, **kwargs) -> Engine:
        kwargs.setdefault("block_size", BS)
        kwargs.setdefault("num_device_blocks", 128)
        return Engine(
            self.config, self.tokenizer, self.model, model_fingerprint=self.fingerprint, **kwargs
        )


@pytest.fixture(
    scope="module",
    params=[
        "numpy",
        *(
            pytest.param(
                name,
                marks=[
                    pytest.mark.gpu,
                    needs_gpu,
                ],
            )
            for name in ("cupy", "cupy-cc", "cupy-mma")
        ),
    ],
)
def engines(request: pytest.FixtureRequest, default_model_dir: Path) -> Engines:
    return Engines(default_model_dir, request.param)


@pytest.fixture(scope="module")
def reference(engines: Engines) -> list[Completion]:
    """Each request alone, reuse off, the whole prompt in one step."""
    outs = []
    for prompt, params in zip(PROMPTS, PARAMS, strict=True):
        out = engines(enable_reuse=False).generate(prompt, params)
        assert isinstance(out, Completion) and out.cached_tokens == 0
        outs.append(out)
    assert outs[1].token_ids != outs[0].token_ids  # the sampled one really sampled
    return outs


def assert_identical(
    got: list[Completion], want: list[Completion], shape: tuple[int, int] = (NUM_TOKENS, 49152)
) -> None:
    """The same tokens and logits bits, each of `shape` (tokens, vocab)."""
    for g, w, name in zip(got, want, ["greedy", "seeded"], strict=True):
        assert g.logits is not None and w.logits is not None
        assert g.token_ids == w.token_ids, name
        assert g.logits.shape == shape == w.logits.shape, name
        assert np.array_equal(g.logits.view(np.uint32), w.logits.view(np.uint32)), (
            name,
            f"first differing token: {int(np.argmax(np.any(g.logits != w.logits, axis=1)))}",
        )


def run_both(engine: Engine) -> list[Completion]:
    outs = engine.generate(PROMPTS, PARAMS)
    assert isinstance(outs, list)
    return outs


@pytest.mark.parametrize("logits_cache_mb", [64, 0], ids=["exact-repeat", "no-stored-row"])
def test_the_same_prompt_six_times_with_reuse(
    engines: Engines, reference, logits_cache_mb: int
) -> None:
    engine = engines(logits_cache_mb=logits_cache_mb)
    # the first run's generated tokens filled the prompt's last block: from then on it
    # is partly reused too; with its stored logits row every prompt token is cached and
    # the first token comes from the row (an exact repeat), else the last one is computed
    num_cached = PROMPT_LEN if logits_cache_mb else PROMPT_LEN - 1
    for run in range(6):
        outs = run_both(engine)
        assert [o.cached_tokens for o in outs] == [0 if run == 0 else num_cached] * 2
        assert_identical(outs, reference)
    assert engine.stats()["exact_repeats"] == (10 if logits_cache_mb else 0)
    engine.pool.check_integrity()


@pytest.mark.parametrize("shared", [2 * BS, 2 * BS + 9, PROMPT_LEN - 1])
def test_partially_reused_prefix(engines: Engines, reference, shared: int) -> None:
    """Another prompt with the same first `shared` tokens ran before: its full blocks
    are reused, and the tokens it shares with the next block are copied."""
    engine = engines()
    for prompt, seed in zip(PROMPTS, (21, 22), strict=True):
        # long enough that the block holding token `shared` is full, hence cached
        other = prompt[:shared] + random_prompt(PROMPT_LEN + BS - shared, seed=seed)
        other[shared] = prompt[shared] + 1  # still a token id: prompts draw ids below 49000
        engine.generate(other, SamplingParams(max_tokens=1, temperature=0))
    outs = run_both(engine)
    assert [o.cached_tokens for o in outs] == [shared] * 2
    assert engine.stats()["partial_hits"] == (2 if shared % BS else 0)
    assert_identical(outs, reference)


def test_onboarded_from_the_host_tier(engines: Engines, reference) -> None:
    engine = engines(num_device_blocks=24, num_host_blocks=64)
    run_both(engine)
    for seed in range(3):  # other prompts push the first ones' blocks to the host tier
        engine.generate(random_prompt(150, seed=100 + seed), SamplingParams(max_tokens=1))
    outs = run_both(engine)
    assert all(o.host_cached_tokens > 0 for o in outs), [o.host_cached_tokens for o in outs]
    assert engine.stats()["host_onboards"] > 0
    assert_identical(outs, reference)
    engine.pool.check_integrity()


@pytest.mark.parametrize("chunk", [1, 7, 32, 100])
def test_prefill_in_chunks(engines: Engines, reference, chunk: int) -> None:
    """The token budget caps each step: the prompts are prefilled `chunk` tokens at a
    time (after decode tokens, when both run), with reuse off."""
    outs = run_both(engines(enable_reuse=False, max_num_batched_tokens=chunk))
    assert_identical(outs, reference)


def other_decode_path(engines: Engines) -> bool:
    """Decode steps at padded bucket sizes (CUDA graphs on the GPU backend, the same
    padded steps run eagerly on NumPy) or eager ones: whichever the backend's default
    is not."""
    return not engines.model.ops.name.startswith("cupy")


def test_decode_the_other_way(engines: Engines, reference) -> None:
    assert_identical(run_both(engines(cuda_graphs=other_decode_path(engines))), reference)


@pytest.mark.parametrize("flip_decode", [False, True], ids=["default-decode", "other-decode"])
def test_batched_with_traffic_that_joins_leaves_and_preempts(
    engines: Engines, reference, flip_decode: bool
) -> None:
    """Random prompts of random lengths join at random steps and leave when done (or
    cancelled); a small pool forces preemptions; the budget chunks the prefills."""
    rng = np.random.default_rng(5)
    graphs = other_decode_path(engines) if flip_decode else None
    engine = engines(num_device_blocks=22, max_num_batched_tokens=96, cuda_graphs=graphs)
    ids = [engine.add_request(p, params) for p, params in zip(PROMPTS, PARAMS, strict=True)]
    others: list = []
    finished: set = set()
    steps = 0
    while not finished.issuperset(ids):
        if rng.random() < 0.3 and len(others) < 12:
            length = int(rng.integers(1, 120))
            params = SamplingParams(
                max_tokens=int(rng.integers(1, 40)),
                temperature=float(rng.choice([0.0, 1.0])),
                ignore_eos=True,
            )
            others.append(engine.add_request(random_prompt(length, seed=1000 + steps), params))
        if rng.random() < 0.05 and others:
            engine.cancel(others[int(rng.integers(len(others)))])
        finished.update(o.request_id for o in engine.step() if o.finish_reason)
        steps += 1
    outs = [engine.take_completion(r) for r in ids]
    assert engine.stats()["preemptions"] > 0, "the pool was meant to force preemptions"
    assert len(others) >= 5
    assert_identical(outs, reference)
    while engine.has_work():
        engine.step()
    assert engine.stats()["used_blocks"] == 0
    engine.pool.check_integrity()
