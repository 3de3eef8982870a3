"""The GPU backend end to end without a GPU: CupyBackend, the launchers, the CUDA graph
decode and the host tier's copies run as written against an emulated CuPy
(tests/kernel_emu/emucupy.py), whose every kernel launch runs that kernel's `.cu`
source compiled for the host (tests/kernel_emu/driver.cpp).

This is what the kernel tests cannot see: the arguments each launcher packs, the
buffers a captured step reads and writes (a replay sees only what was uploaded into
its static inputs), the copy stream's ordering, and the invariance of DESIGN §4
through the whole engine on both attention kernels. It does not reproduce device
arithmetic or speed: the GPU tests do (tests/test_gpu_*.py, tests/test_invariance.py
with a device).

The model is a small synthetic Llama with head dim 64 (the kernels take 64 and 128),
three query heads per KV head (as the default model) and a tied-off lm_head.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import test_invariance as invariance
from kernel_emu import emucupy

from reprise.cuda import (
    attention_tc_kernel,
    decode_block_kernel,
    gemm_kernel,
    kernels,
    launchers,
    pdl,
)
from reprise.cuda.backend import NumpyBackend
from reprise.cuda.dtypes import BF16
from reprise.cuda.sampling import Draws
from reprise.daemon import Completion, Engine, SamplingParams
from reprise.daemon.engine.engine import model_fingerprint
from reprise.daemon.model import synth
from reprise.daemon.model.config import ModelConfig
from reprise.daemon.model.llama import LlamaModel
from reprise.daemon.model.tokenizer import Tokenizer
from reprise.daemon.model.weights import load_weights

pytestmark = pytest.mark.kernels

SHAPE = {
    **synth.SHAPES["tiny"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
BS = 16
PROMPT_LEN = 45  # 2 full blocks and 13 tokens
NUM_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, return_logits=True)
SEEDED = SamplingParams(
    max_tokens=NUM_TOKENS, temperature=0.9, top_p=0.9, top_k=50, seed=77, ignore_eos=True,
    return_logits=True,
)  # fmt: skip
PARAMS = [GREEDY, SEEDED]
# per-process caches of device objects (kernels, per-stream counters): an emulated one
# must never reach a real CuPy launch, nor a real one an emulated launch
KERNEL_CACHES = [kernels.module, kernels._stream_counters, gemm_kernel._kernel,
                 attention_tc_kernel._kernel, decode_block_kernel._resident_ctas,
                 decode_block_kernel._num_sms]  # fmt: skip


def random_prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, size=n).tolist()  # byte tokens


PROMPTS = [random_prompt(PROMPT_LEN, seed=1), random_prompt(PROMPT_LEN, seed=2)]


@pytest.fixture(scope="module")
def emulated(emu_lib: ctypes.CDLL) -> Iterator[None]:
    """`import cupy` is the emulation for this module's tests (kernels compiled before,
    by a real CuPy, are forgotten before and after)."""
    with pytest.MonkeyPatch.context() as mp:
        for cache in KERNEL_CACHES:
            cache.cache_clear()
        emucupy.install(emu_lib, mp.setitem)
        yield
        for cache in KERNEL_CACHES:
            cache.cache_clear()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(synth.SHAPES, "emulated", SHAPE)
        return synth.synth_model("emulated", tmp_path_factory.mktemp("model") / "m", seed=3)


class Engines:
    """Engines of any pool shape around one loaded model."""

    def __init__(self, path: Path, backend: str) -> None:
        from reprise.cuda.cupy_backend import CupyBackend

        self.config = ModelConfig.from_dir(path)
        self.tokenizer = Tokenizer.from_dir(path)
        ops = NumpyBackend() if backend == "numpy" else CupyBackend(attention=backend)
        self.model = LlamaModel(self.config, load_weights(path, self.config), ops)
        self.fingerprint = model_fingerprint(path)

    def __call__(self, **kwargs) -> Engine:
        kwargs.setdefault("block_size", BS)
        kwargs.setdefault("num_device_blocks", 64)
        kwargs.setdefault("cuda_graphs", False)
        return Engine(
            self.config, self.tokenizer, self.model, model_fingerprint=self.fingerprint, **kwargs
        )


@pytest.fixture(scope="module", params=["cuda-cores", "tensor-cores"])
def engines(request: pytest.FixtureRequest, emulated: None, model_dir: Path) -> Engines:
    return Engines(model_dir, request.param)


@pytest.fixture(scope="module")
def reference(engines: Engines) -> list[Completion]:
    """Each request alone, reuse off, the whole prompt in one step, decode eager."""
    outs = []
    for prompt, params in zip(PROMPTS, PARAMS, strict=True):
        out = engines(enable_reuse=False).generate(prompt, params)
        assert isinstance(out, Completion) and out.cached_tokens == 0
        outs.append(out)
    return outs


def assert_identical(got: list[Completion], want: list[Completion]) -> None:
    invariance.assert_identical(got, want, shape=(NUM_TOKENS, SHAPE["vocab_size"]))


def run_both(engine: Engine) -> list[Completion]:
    outs = engine.generate(PROMPTS, PARAMS)
    assert isinstance(outs, list)
    return outs


def test_logits_match_the_numpy_backend(engines: Engines, reference, model_dir: Path) -> None:
    """Within BF16 tolerance: a few BF16 ulps of the row's largest logit."""
    numpy_engines = Engines(model_dir, "numpy")
    want = numpy_engines(enable_reuse=False).generate(PROMPTS[0], GREEDY)
    got = reference[0]
    assert got.token_ids == want.token_ids
    scale = np.max(np.abs(want.logits), axis=1, keepdims=True)
    worst = float(np.max(np.abs(got.logits - want.logits) / scale))
    assert worst < 4 * 2.0**-8, f"{worst / 2.0**-8:.2f} BF16 ulps of the row's largest logit"
    assert not np.array_equal(want.logits, numpy_engines(enable_reuse=False).generate(
        PROMPTS[1], GREEDY).logits)  # fmt: skip


def test_graph_replay_is_bit_identical_to_eager_decode(engines: Engines, reference) -> None:
    before = emucupy.replays()
    outs = run_both(engines(cuda_graphs=True))
    assert emucupy.replays() - before >= NUM_TOKENS - 1  # a replay per decode step
    assert_identical(outs, reference)


def test_programmatic_dependent_launch_keeps_every_bit(
    engines: Engines, reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With PDL on (cuda/pdl.py), every kernel of a step goes through the driver launch
    (arguments packed as cuLaunchKernelEx takes them), eager and captured in graphs, and
    every thread of each calls pdl_enter (the emulator counts), reading before it none of
    the bytes the kernel before it changed (emucupy.watch_early_reads: the attention
    kernel's early page copies included): the same bits as without."""
    monkeypatch.setattr(pdl, "active", lambda: "1")
    monkeypatch.setattr(pdl, "_driver", emucupy.PdlDriver())
    emucupy.watch_early_reads(monkeypatch)
    launches, dependents = emucupy.launches(), emucupy.pdl_launches()
    outs = run_both(engines(cuda_graphs=True))
    assert_identical(outs, reference)
    ran = emucupy.launches() - launches
    assert ran > 0 and emucupy.pdl_launches() - dependents == ran


def test_dependent_launches_in_graphs_only_keep_every_bit(
    engines: Engines, reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PDL's default mode on sm_90+ (`graphs`): the kernels captured into the decode
    graphs go through the driver launch as dependents, the eager ones (prefill, the
    capture's warm-up run) as CuPy launches them: the same bits as without PDL, and no
    dependent reads before its wait what the kernel before it changed."""
    monkeypatch.setattr(pdl, "active", lambda: "graphs")
    monkeypatch.setattr(pdl, "_driver", emucupy.PdlDriver())
    emucupy.watch_early_reads(monkeypatch)
    launches, dependents = emucupy.launches(), emucupy.pdl_launches()
    outs = run_both(engines(cuda_graphs=True))
    assert_identical(outs, reference)
    ran, captured = emucupy.launches() - launches, emucupy.pdl_launches() - dependents
    assert 0 < captured < ran


def test_penalties_and_logprobs_stay_bit_identical(engines: Engines) -> None:
    """Penalized greedy and seeded requests with logprobs, a logit bias and min_tokens
    (stop tokens at -inf through the sampler) on the GPU backend: the same tokens, logits
    and logprobs alone and eager with reuse off, through replayed graphs, and repeated
    from the prefix cache."""
    penalties = {"frequency_penalty": 0.6, "presence_penalty": 0.3, "repetition_penalty": 1.4,
                 "logit_bias": {5: 3.0, 17: -2.5, 200: 1.5, 201: -100.0},
                 "min_tokens": NUM_TOKENS, "stop_token_ids": [7, 9, 200]}  # fmt: skip
    params = [
        SamplingParams(**{**_fields(p), **penalties, "logprobs": 4}) for p in (GREEDY, SEEDED)
    ]
    want = [
        engines(enable_reuse=False).generate(p, s) for p, s in zip(PROMPTS, params, strict=True)
    ]
    engine = engines(cuda_graphs=True)
    first, again = run_both_with(engine, params), run_both_with(engine, params)
    assert all(c.cached_tokens > 0 for c in again)
    for outs in (first, again):
        assert_identical(outs, want)
        assert [c.logprobs for c in outs] == [c.logprobs for c in want]
    assert all(c.logprobs is not None and len(c.logprobs) == NUM_TOKENS for c in want)


def test_structured_outputs_stay_bit_identical(engines: Engines) -> None:
    """Greedy and seeded requests held to a regex (the token mask kernel, through the
    sampler after the graph's replay): answers in the regex, and the same tokens, logits
    and logprobs eager with reuse off, through replayed graphs and repeated."""
    import re

    from reprise.daemon import StructuredOutput

    head, pattern = "[a-z]{3}-[0-9]", "[a-z]{3}-[0-9]{1,8}"  # 5 to 12 tokens (byte tokens)
    spec = StructuredOutput("regex", pattern)
    params = [
        SamplingParams(**{**_fields(p), "structured": spec, "logprobs": 2})
        for p in (GREEDY, SEEDED)
    ]
    want = [
        engines(enable_reuse=False).generate(p, s) for p, s in zip(PROMPTS, params, strict=True)
    ]
    for c in want:  # whole when the grammar ended it, else cut at max_tokens (12)
        assert re.fullmatch(pattern if c.finish_reason == "stop" else head + "*", c.text), c
    engine = engines(cuda_graphs=True)
    for outs in (run_both_with(engine, params), run_both_with(engine, params)):
        for got, exp in zip(outs, want, strict=True):
            assert got.token_ids == exp.token_ids and got.logprobs == exp.logprobs
            assert np.array_equal(got.logits.view(np.uint32), exp.logits.view(np.uint32))


def test_allowed_token_ids_mask_the_rows_on_the_device(engines: Engines) -> None:
    """allowed_token_ids through the GPU backend's token mask (the grammar's kernel):
    greedy and seeded requests draw only allowed tokens, the same tokens and logits
    eager with reuse off, through replayed graphs and repeated, drafted too."""
    from test_speculative import planted

    allowed = list(range(97, 123))  # byte tokens: the lowercase letters
    params = [SamplingParams(**{**_fields(p), "allowed_token_ids": allowed}) for p in PARAMS]
    want = [
        engines(enable_reuse=False).generate(p, s) for p, s in zip(PROMPTS, params, strict=True)
    ]
    assert all(set(c.token_ids) <= set(allowed) for c in want)
    engine = engines(cuda_graphs=True, speculative_tokens=3)
    planted(engine, want, seed=14)
    for outs in (run_both_with(engine, params), run_both_with(engine, params)):
        assert_identical(outs, want)
    assert engine.stats()["spec_accepted_tokens"] > 0


def test_speculative_drafts_keep_every_bit(engines: Engines, reference) -> None:
    """Drafts planted from the reference, right or wrong from a random offset on
    (test_speculative.py): a drafted step replays its drafted bucket's graph (its
    rows, padding sequences after them), with the sampler's seeded draws at each row's
    own position, beside replayed plain decode steps, and eagerly without graphs; the
    same tokens and logits as decoding one token a step."""
    from test_speculative import planted

    for graphs in (True, False):
        engine = engines(cuda_graphs=graphs, speculative_tokens=4)
        plant = planted(engine, reference, seed=11)
        before = emucupy.replays()
        assert_identical(run_both(engine), reference)
        assert engine.stats()["spec_accepted_tokens"] == plant.num_right > 0
        decode = engine.runner.decode
        if graphs:
            assert decode is not None and decode.steps > decode.drafted_steps > 0
            assert max(decode.built_buckets(drafted=True)) == 2  # both requests, drafted
            assert emucupy.replays() - before == decode.steps


def test_speculative_drafts_of_stateful_rows_keep_every_bit(engines: Engines) -> None:
    """Penalized and structured requests drafted (planted): each draft row penalized by
    the counts and masked by the grammar's mask it would have there, on the device."""
    from test_speculative import planted

    from reprise.daemon import StructuredOutput

    spec = StructuredOutput("regex", "[a-z]{3}-[0-9]{1,8}")
    params = [
        SamplingParams(**{**_fields(GREEDY), "repetition_penalty": 1.3, "logprobs": 2}),
        SamplingParams(**{**_fields(SEEDED), "structured": spec, "logprobs": 2}),
    ]
    want = [
        engines(enable_reuse=False).generate(p, s) for p, s in zip(PROMPTS, params, strict=True)
    ]
    engine = engines(cuda_graphs=True, speculative_tokens=4)
    plant = planted(engine, want, seed=12)
    for got, exp in zip(run_both_with(engine, params), want, strict=True):
        assert got.token_ids == exp.token_ids and got.logprobs == exp.logprobs
        assert np.array_equal(got.logits.view(np.uint32), exp.logits.view(np.uint32))
    assert engine.stats()["spec_accepted_tokens"] > 0 and plant.num_right > 0


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


def run_both_with(engine: Engine, params: list[SamplingParams]) -> list[Completion]:
    outs = engine.generate(PROMPTS, params)
    assert isinstance(outs, list)
    return outs


def test_async_scheduling_keeps_every_token(engines: Engines) -> None:
    """Asynchronous scheduling on the GPU backend (engine.py's `step`): each step after the
    first is replayed before the one before it has its tokens on the host, fed them on the
    device (a device-to-device copy, or a gather once a request has ended), its tokens
    brought back by an asynchronous copy into pinned memory. The same tokens as the
    synchronous graphs, for a batch that shrinks as requests end on stop ids; no block held."""
    params = [
        SamplingParams(**{**_fields(p), "return_logits": False, "max_tokens": n})
        for p, n in ((GREEDY, 5), (SEEDED, NUM_TOKENS))  # the first ends: row 1 is gathered
    ]
    want = run_both_with(engines(cuda_graphs=True), params)
    engine = engines(cuda_graphs=True, async_scheduling=True)
    got = run_both_with(engine, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [len(c.token_ids) for c in got] == [5, NUM_TOKENS]
    assert engine.num_async_steps >= NUM_TOKENS - 3
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_graphs_captured_ahead_of_time(engines: Engines, reference) -> None:
    """Captured before any request (the daemon's warm-up), on padding rows alone: no pool
    block changes, no step captures again, and the steps that replay them keep their bits."""
    engine = engines(cuda_graphs=True, kv_events=True)
    ops, captures = engine.runner.model.ops, []

    def counting(fn):
        captures.append(fn)
        return type(ops).capture(ops, fn)

    ops.capture = counting  # an instance attribute shadows the method
    try:
        assert engine.capture_decode_graphs(max_seqs=len(PROMPTS)) == [1, 2]
        assert len(captures) == 2
        assert engine.take_events() == [] and engine.stats()["used_blocks"] == 0
        assert not engine.runner.kv_cache[: engine.pool.num_blocks].any()  # zeros, as allocated
        replays = emucupy.replays()
        outs = run_both(engine)
    finally:
        del ops.capture
    assert len(captures) == 2, "a step captured again"
    assert emucupy.replays() - replays >= NUM_TOKENS - 1
    assert_identical(outs, reference)


def test_a_cached_prompts_first_token_runs_as_a_decode_step_does(engines: Engines) -> None:
    """The first token of a fully cached prompt (no stored logits row) costs the device
    what a batch-1 decode step does: one replay of the batch-1 graph, its kernels and no
    other, beside one block copy (the last block's shared tokens, so that the last one is
    computed in a block of the request's own). An eager forward there would be several
    times the step on a GPU (bench_gpu_e2e's cached row)."""
    engine = engines(cuda_graphs=True, logits_cache_mb=0)
    assert engine.capture_decode_graphs(max_seqs=1) == [1]  # not inside what is counted
    ops, model = engine.runner.model.ops, engine.runner.model
    events: list[str] = []

    def record(name: str, fn):
        def call(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)

        return call

    model.forward = record("eager forward", model.forward)  # instance attributes shadow
    ops.copy_block = record("copy_block", ops.copy_block)  # the methods
    try:
        prompt = random_prompt(6 * BS, seed=31)
        once = SamplingParams(max_tokens=1, temperature=0)
        assert engine.generate(prompt, once).cached_tokens == 0
        del events[:]
        launches, replays = emucupy.launches(), emucupy.replays()
        assert engine.generate(prompt, once).cached_tokens == len(prompt) - 1
        cached = emucupy.launches() - launches
        assert emucupy.replays() - replays == 1
        assert events == ["copy_block"], events
        other = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        engine.add_request(random_prompt(2 * BS + 5, seed=32), other)
        engine.step()  # the prompt (eager), then its first decode step, replayed
        del events[:]
        launches, replays = emucupy.launches(), emucupy.replays()
        engine.step()
        assert emucupy.replays() - replays == 1 and events == []
        assert cached == emucupy.launches() - launches  # the same kernels
        while engine.has_work():
            engine.step()
    finally:
        del model.forward, ops.copy_block


def test_reused_and_partly_reused_prefixes(engines: Engines, reference) -> None:
    engine = engines(cuda_graphs=True)
    for run in range(3):  # from the second run on, exact repeats: every prompt token cached
        outs = run_both(engine)  # and the first token from the stored (uploaded) logits row
        assert [o.cached_tokens for o in outs] == [0 if run == 0 else PROMPT_LEN] * 2
        assert_identical(outs, reference)
    assert engine.stats()["exact_repeats"] == 4
    engine = engines(cuda_graphs=True, logits_cache_mb=0)  # the last prompt token computed
    for run in range(2):
        outs = run_both(engine)
        assert [o.cached_tokens for o in outs] == [0 if run == 0 else PROMPT_LEN - 1] * 2
        assert_identical(outs, reference)
    engine = engines()
    shared = BS + 5
    for prompt, seed in zip(PROMPTS, (21, 22), strict=True):
        other = prompt[:shared] + random_prompt(PROMPT_LEN, seed=seed)
        other[shared] = (prompt[shared] + 1) % 256
        engine.generate(other, SamplingParams(max_tokens=1, temperature=0))
    outs = run_both(engine)
    assert [o.cached_tokens for o in outs] == [shared] * 2
    assert engine.stats()["partial_hits"] == 2
    assert_identical(outs, reference)
    engine.pool.check_integrity()


@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_prefill_in_chunks(engines: Engines, reference, chunk: int) -> None:
    assert_identical(run_both(engines(enable_reuse=False, max_num_batched_tokens=chunk)), reference)


def test_onboarded_from_the_host_tier(engines: Engines, reference) -> None:
    """The copies run on their own stream, and emucupy runs them only when something
    waits for them: a read or an overwrite that does not wait sees stale bytes."""
    engine = engines(num_device_blocks=12, num_host_blocks=32, cuda_graphs=True)
    run_both(engine)
    for seed in range(3):  # other prompts push the first ones' blocks to the host tier
        engine.generate(random_prompt(70, seed=100 + seed), SamplingParams(max_tokens=1))
    outs = run_both(engine)
    assert all(o.host_cached_tokens > 0 for o in outs), [o.host_cached_tokens for o in outs]
    assert engine.stats()["host_onboards"] > 0
    assert_identical(outs, reference)
    engine.pool.check_integrity()


def test_batched_with_traffic_that_joins_leaves_and_preempts(engines: Engines, reference) -> None:
    rng = np.random.default_rng(5)
    engine = engines(num_device_blocks=10, max_num_batched_tokens=40, cuda_graphs=True)
    ids = [engine.add_request(p, params) for p, params in zip(PROMPTS, PARAMS, strict=True)]
    others: list = []
    finished: set = set()
    steps = 0
    while not finished.issuperset(ids):
        if rng.random() < 0.4 and len(others) < 8:
            params = SamplingParams(
                max_tokens=int(rng.integers(1, 24)),
                temperature=float(rng.choice([0.0, 1.0])),
                ignore_eos=True,
            )
            length = int(rng.integers(1, 60))
            others.append(engine.add_request(random_prompt(length, seed=1000 + steps), params))
        finished.update(o.request_id for o in engine.step() if o.finish_reason)
        steps += 1
    outs = [engine.take_completion(r) for r in ids]
    assert engine.stats()["preemptions"] > 0, "the pool was meant to force preemptions"
    assert len(others) >= 3
    assert_identical(outs, reference)
    while engine.has_work():
        engine.step()
    assert engine.stats()["used_blocks"] == 0
    engine.pool.check_integrity()


def test_argmax_of_a_decode_steps_rows_spreads_each_row_and_gives_the_same_ids(
    emulated: None, rng
) -> None:
    """The backend's argmax: a decode step's rows (at most ARGMAX_SPLIT_MAX_ROWS) through
    argmax_split, more rows a CTA each, both np.argmax's ids; eager, twice on one stream
    (its counters left zero), and replayed from a captured graph."""
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.kernels import to_device, to_host

    gpu = CupyBackend()
    vocab = 3 * launchers.ARGMAX_SLICE + 17
    most = launchers.ARGMAX_SPLIT_MAX_ROWS
    logits = (rng.standard_normal((most + 1, vocab)) * 3).astype(np.float32)
    logits[1, [3, vocab - 1]] = 30.0  # a tie across slices: the lower id
    launched: list[str] = []
    real = launchers.launch_kernel
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launchers, "launch_kernel",
                   lambda fn, *a, **k: launched.append(fn.name) or real(fn, *a, **k))  # fmt: skip
        for rows in (1, most, most + 1):
            x = to_device(np.ascontiguousarray(logits[:rows]))
            for _ in range(2):
                assert to_host(gpu.argmax(x)).tolist() == np.argmax(logits[:rows], axis=1).tolist()
    assert launched == ["argmax_split"] * 4 + ["argmax"] * 2
    x = to_device(np.ascontiguousarray(logits[:2]))
    replay = gpu.capture(lambda: gpu.argmax(x))
    for _ in range(2):
        assert to_host(replay()).tolist() == np.argmax(logits[:2], axis=1).tolist()


def test_device_sampling_matches_the_numpy_backend(emulated: None, rng) -> None:
    """Device sampling (sort keys, ranks and Philox draws on the device) picks what the
    NumPy backend picks from the same logits, rows and draws, through the sampler."""
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.kernels import to_device, to_host
    from reprise.daemon.engine.sampling.batch import SamplingBatch
    from reprise.daemon.engine.sampling.sampler import sample

    rows, vocab = 6, 1000
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 3
    logits[2, 10:20] = logits[2, 10]  # ties, broken by id
    picked = np.array([0, 2, 3, 5])
    greedy = np.argmax(logits, axis=1).astype(np.int32)
    gpu = CupyBackend()
    for min_p in ([0.0, 0.0, 0.0, 0.0], [0.05, 0.2, 0.0, 0.5]):
        draws = Draws(
            temperature=rng.uniform(0.3, 1.5, size=4).astype(np.float32),
            top_k=np.array([vocab, 5, 1, 40], dtype=np.int32),  # vocab: no cut
            top_p=np.array([1.0, 0.8, 0.5, 0.95], dtype=np.float32),
            min_p=np.array(min_p, dtype=np.float32),
            seeds=rng.integers(0, 2**63, size=4, dtype=np.uint64),
            positions=rng.integers(0, 4096, size=4).astype(np.int64),
        )
        batch = SamplingBatch(rows=picked, num_greedy=0, draws=draws, penalties=None)
        want = sample(NumpyBackend(), logits, greedy, batch)
        got = to_host(sample(gpu, to_device(logits), to_device(greedy), batch))
        assert got.tolist() == np.asarray(want).tolist()
    # min_p on the device cuts as the twin does: a row whose draws land past the cut
    row = np.zeros((1, vocab), np.float32)
    row[0, :5] = [2.0, 1.9, 1.0, 0.5, 0.4]  # the other 995 ids at 0: most of the mass
    for min_p, allowed in ((0.0, None), (0.5, {0, 1, 2}), (0.9, {0, 1})):
        n = 64
        draws = Draws(
            temperature=np.ones(n, np.float32), top_k=np.full(n, vocab, np.int32),
            top_p=np.ones(n, np.float32), min_p=np.full(n, min_p, np.float32),
            seeds=np.full(n, 3, np.uint64), positions=np.arange(n, dtype=np.int64),
        )  # fmt: skip
        logits_n = np.repeat(row, n, axis=0)
        want = NumpyBackend.sample(logits_n, draws)
        got = to_host(gpu.sample(to_device(logits_n), draws))
        assert got.tolist() == want.tolist()
        if allowed is None:
            assert (want >= 5).sum() > n // 2  # uncut, most draws go to the 995
        else:
            assert set(want.tolist()) <= allowed and len(set(want.tolist())) > 1
    assert got.tolist() != greedy.tolist()  # something was sampled, not argmaxed
    # a row whose every token is banned (-inf) gives its lowest id on both, whatever the cuts
    banned = np.full((4, vocab), -np.inf, np.float32)
    draws = Draws(
        temperature=np.array([1.0, 0.5, 2.0, 1.0], np.float32),
        top_k=np.array([vocab, 5, vocab, 1], np.int32), top_p=np.array([1, 0.9, 1, 0.5], np.float32),
        min_p=np.array([0, 0, 0.1, 0], np.float32), seeds=np.full(4, 3, np.uint64),
        positions=np.arange(4, dtype=np.int64),
    )  # fmt: skip
    assert NumpyBackend.sample(banned, draws).tolist() == [0] * 4
    assert to_host(gpu.sample(to_device(banned), draws)).tolist() == [0] * 4


def test_device_penalties_match_the_numpy_backend(emulated: None, rng) -> None:
    """The sampler on the device (penalties kernel, argmax of penalized greedy rows, draws
    from penalized rows) picks what it picks on NumPy; the raw logits stay untouched."""
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.kernels import to_device, to_host
    from reprise.daemon.engine.sampling import SamplingBatch, SamplingParams, SamplingState
    from reprise.daemon.engine.sampling.sampler import sample

    rows, vocab = 5, 700
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 3
    logits[:, 42] = 20.0  # every raw argmax; the penalized rows generated it often
    settings = [
        SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=1.5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.9, seed=3, top_k=30, repetition_penalty=1.7),
        SamplingParams(temperature=0.7, seed=4),
        SamplingParams(temperature=0, repetition_penalty=30.0),
    ]
    states = [SamplingState.build(p, p.seed or 0, [42, 7, 7, 9]) for p in settings]
    for state in states:
        for token in [42] * 8 + [5, 6, 5]:
            state.record(token, None)
    batch = SamplingBatch.build(states, [100] * rows, vocab)
    assert batch is not None and batch.penalties is not None
    greedy = np.argmax(logits, axis=1).astype(np.int32)
    want = sample(NumpyBackend(), logits, greedy, batch)
    device_logits = to_device(logits)
    got = to_host(sample(CupyBackend(), device_logits, to_device(greedy), batch))
    assert got.tolist() == want.tolist()
    assert got[0] != 42 and got[4] != 42 and got[1] == 42  # the penalties moved greedy rows
    assert np.array_equal(to_host(device_logits), logits)


# ---- the emulation itself: strict where a GPU would silently go wrong ----------------------


def test_a_captured_step_may_not_allocate_from_the_default_pool(emulated: None) -> None:
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        with pytest.raises(emucupy.CaptureError, match="allocation"):
            cupy.zeros((4,), np.float32)
        with pytest.raises(emucupy.CaptureError, match="CuPy op"):
            cupy.arange(4, dtype=np.int32)
        stream.end_capture()


def test_copy_block_copies_one_block_exactly_on_both_backends(emulated: None, rng) -> None:
    """The runner's device block copy (a cached prompt's last block, copied to compute
    its last token): the source block's bytes over the destination's, NaN payloads and
    signed zeros included, every other block untouched, on NumPy and on the GPU backend."""
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.kernels import to_device

    bits = rng.integers(0, 1 << 16, size=(5, 2, 3, 4, 8), dtype=np.uint16)
    src, dst = (int(b) for b in rng.choice(5, size=2, replace=False))
    want = bits.copy()
    want[dst] = bits[src]
    host = bits.copy().view(BF16)
    NumpyBackend().copy_block(host, src, dst)
    assert host.view(np.uint16).tobytes() == want.tobytes()
    ops = CupyBackend()
    device = to_device(bits.view(BF16))
    ops.copy_block(device, src, dst)
    assert ops.to_host(device).view(np.uint16).tobytes() == want.tobytes()


def test_a_copy_on_another_stream_lands_only_once_waited_for(emulated: None) -> None:
    import cupy

    device = cupy.zeros((4,), np.float32)
    host = np.arange(4, dtype=np.float32)
    copies = cupy.cuda.Stream(non_blocking=True)
    device.set(host, stream=copies)
    assert device._a.tolist() == [0] * 4  # nobody waited: not landed yet
    with pytest.raises(emucupy.RaceError, match="device-to-host copy on the null stream"):
        cupy.asnumpy(device)  # reading it unordered is a race
    cupy.cuda.get_current_stream().wait_event(copies.record())
    assert cupy.asnumpy(device).tolist() == host.tolist()


def test_streams_that_share_memory_must_be_ordered(emulated: None) -> None:
    """The two orders the host tier's copies need, each caught when missing: a copy
    after the kernel that writes its source, a kernel after the copy into its input."""
    import cupy

    from reprise.cuda import launchers

    x = cupy.asarray(np.ones((2, 64), dtype=np.float32))
    w = cupy.asarray(np.full(64, 0x3F80, dtype=np.uint16))  # BF16 ones
    copies = cupy.cuda.Stream(non_blocking=True)
    host = np.empty((2, 64), dtype=np.uint16)

    out = launchers.rmsnorm(x, w, 1e-5)  # on the null stream
    with pytest.raises(emucupy.RaceError, match="kernel rmsnorm"):
        cupy.asnumpy(out, stream=copies, out=host, blocking=False)  # an offload, unordered
    copies.wait_event(cupy.cuda.get_current_stream().record())
    cupy.asnumpy(out, stream=copies, out=host, blocking=False)  # ordered after the kernel

    x.set(np.full((2, 64), 2, dtype=np.float32), stream=copies)  # onboarding the input
    with pytest.raises(emucupy.RaceError, match="host-to-device copy on stream"):
        launchers.rmsnorm(x, w, 1e-5)
    cupy.cuda.get_current_stream().wait_event(copies.record())
    launchers.rmsnorm(x, w, 1e-5)  # ordered after the copy
    cupy.cuda.Device().synchronize()


def test_launch_arguments_are_checked_against_the_kernel(emulated: None) -> None:
    from reprise.cuda.kernels import kernel

    x = emucupy.zeros((8,), np.float32)
    fn = kernel("sampling", "philox_uniform")
    seeds, positions = emucupy.zeros((8,), np.uint64), emucupy.zeros((8,), np.int64)
    with pytest.raises(RuntimeError, match="argument 3 must be a value of 4 bytes; got 8"):
        fn((1,), (256,), (seeds, positions, x, np.int64(8)))
    with pytest.raises(TypeError, match="NumPy scalar"):
        fn((1,), (256,), (seeds, positions, x, 8))
    fn((1,), (256,), (seeds, positions, x, np.int32(8)))
    assert float(x.max()) > 0


def test_skipped_kernels_are_counted_and_write_nothing(engines: Engines) -> None:
    """run_emulated.py --skip-kernels: a step's CPU side runs (scheduling, launches, the
    replay, the readback) and no kernel writes memory."""
    engine = engines(cuda_graphs=True, enable_reuse=False)  # no block of zeros is reused
    launches = emucupy.launches()
    emucupy.skip_kernels()
    try:
        out = engine.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0))
    finally:
        emucupy.skip_kernels(False)
    assert out.token_ids == [0, 0, 0]  # argmax never ran: its zeroed output was read back
    assert emucupy.launches() - launches > 3 * SHAPE["num_hidden_layers"]
    assert not engine.runner.kv_cache.any()  # no K/V was written
    assert engine.generate(PROMPTS[0], GREEDY).token_ids != [0] * NUM_TOKENS  # kernels again


def test_prompt_tables_share_by_extra_ids_and_keep_their_bits(engines: Engines) -> None:
    """TensorRT-LLM's p-tuning example at this block size on the GPU backend: fake ids
    read table rows in the embedding kernel, requests 1 and 2 (same ids, other tables)
    share nothing, request 3 reuses request 1's first block, and every logit equals the
    same request's alone on a fresh engine; the decode steps replay graphs."""
    v = SHAPE["vocab_size"]
    rng = np.random.default_rng(24)
    t1, t2 = ((rng.standard_normal((BS, SHAPE["hidden_size"])) * 0.05).astype(BF16) for _ in "12")
    fake, marks = list(range(v, v + BS)), [0] * BS
    requests = [
        ([*fake, *PROMPTS[0][:BS]], t1, [1] * BS + marks),
        ([*fake, *PROMPTS[0][:BS]], t2, [2] * BS + marks),
        ([*fake, *PROMPTS[1][:BS]], t1, [1] * BS + marks),
    ]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, return_logits=True)
    engine = engines(cuda_graphs=True)
    before = emucupy.replays()
    outs = [engine.generate(p, params, prompt_table=t, extra_ids=e) for p, t, e in requests]
    assert emucupy.replays() - before >= 3 * 2
    assert [o.cached_tokens for o in outs] == [0, 0, BS]
    assert not np.array_equal(outs[0].logits, outs[1].logits)
    for (prompt, table, extra), out in zip(requests, outs, strict=True):
        alone = engines(enable_reuse=False).generate(prompt, params, prompt_table=table,
                                                     extra_ids=extra)  # fmt: skip
        assert np.array_equal(out.logits, alone.logits)
