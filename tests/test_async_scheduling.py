"""Asynchronous scheduling (EngineConfig.async_scheduling, Engine.step): a decode step is
launched ahead, before the tokens of the step before it are on the host, and fed them on
the device. Every request's tokens, finish and text, and every KV block written, must be
bit-identical to the synchronous engine's, whatever ends, is cancelled or arrives while a
step is in flight, and no block may leak. On NumPy the decode graphs' padded steps run
eagerly (graphs.py), so the launches, the feeding and the dropped rows run as on the GPU;
the GPU backend's copies are checked in tests/test_cupy_emulated.py, and with a CUDA
device the engine tests here run on it too (`backend`: the CuPy backend, its graphs
replayed, tokens fed by a device copy and read back through pinned buffers and events)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gpu_support import needs_gpu
from http_support import scrape, served

from reprise.blockpool.copies import PINNED_KINDS
from reprise.daemon import Engine, SamplingParams
from reprise.daemon.engine.config import EngineConfig, SettingError
from reprise.daemon.model.synth import SHAPES, synth_model
from reprise.ipc import Client
from reprise.ipc.messages import Done, TokenChunk

# "tiny" with head dim 64, as tests/test_graphs.py
SHAPE = {**SHAPES["tiny"], "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64}
STOPS = [5, 7, 9, 11, 13, 17, 19]  # ids that end a request that does not ignore eos
BACKENDS = ["numpy", pytest.param("cupy", marks=[pytest.mark.gpu, needs_gpu])]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(SHAPES, "tiny-d64", SHAPE)
        yield synth_model("tiny-d64", tmp_path_factory.mktemp("async") / "tiny")


def engine(path: Path, asynchronous: bool, backend: str = "numpy", **kwargs) -> Engine:
    kwargs.setdefault("num_device_blocks", 128)
    kwargs.setdefault("block_size", 16)
    return Engine.from_pretrained(
        path, backend=backend, cuda_graphs=True, async_scheduling=asynchronous, **kwargs
    )


def traffic(rng: np.random.Generator, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """n requests of random lengths, greedy and seeded, some ending on stop ids at steps
    no one knows ahead, the rest at their max_tokens."""
    prompts = [rng.integers(20, 1000, size=int(rng.integers(1, 70))).tolist() for _ in range(n)]
    params = [
        SamplingParams(
            max_tokens=int(rng.integers(1, 40)),
            temperature=0.0 if i % 3 else 0.9,
            top_k=50,
            seed=100 + i,
            ignore_eos=i % 2 == 0,
            stop_token_ids=STOPS,
        )
        for i in range(n)
    ]
    return prompts, params


def run(eng: Engine, prompts, params, *, arrivals: dict[int, list[int]] | None = None) -> dict:
    """Step `eng` to the end; request i of `arrivals[k]` is added before step k (all of
    them before step 0 without). Returns each request's (tokens, finish reason, text)."""
    arrivals = arrivals or {0: list(range(len(prompts)))}
    ids: dict[int, int] = {}
    step = 0
    while step <= max(arrivals) or eng.has_work():
        for i in arrivals.get(step, []):
            ids[i] = eng.add_request(prompts[i], params[i])
        eng.step()
        if eng._ahead is not None and any(c.kind in PINNED_KINDS for c in eng._ahead[0].copies):
            # a step in flight whose copies pin blocks: their pins held until it is recorded
            assert eng.pool.num_pending_copies > 0, "the pins of a step in flight were released"
        step += 1
    done = {i: eng.take_completion(rid) for i, rid in ids.items()}
    return {i: (c.token_ids, c.finish_reason, c.text) for i, c in done.items()}


def assert_same_blocks(sync: Engine, asynchronous: Engine) -> None:
    """The same blocks cached, each with the same KV bytes, and none held."""
    for eng in (sync, asynchronous):
        assert eng.pool.num_free_blocks == eng.pool.num_blocks, "a block leaked"
        eng.pool.check_integrity()
    where = {b.block_hash: b.block_id for b in asynchronous.pool.blocks if b.block_hash}
    cached = [(b.block_hash, b.block_id) for b in sync.pool.blocks if b.block_hash]
    assert cached and sorted(h for h, _ in cached) == sorted(where)
    for block_hash, block_id in cached:
        assert np.array_equal(bits(sync, block_id), bits(asynchronous, where[block_hash]))


def bits(eng: Engine, block_id: int) -> np.ndarray:
    """A device block's KV bytes on the host, as uint16 (BF16 bits)."""
    block = eng.runner.kv_cache[block_id]
    return (block.get() if hasattr(block, "get") else block).view(np.uint16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_requests", [1, 4, 9])
def test_tokens_and_blocks_are_bit_identical_to_synchronous(
    tiny: Path, rng: np.random.Generator, num_requests: int, backend: str
) -> None:
    prompts, params = traffic(rng, num_requests)
    sync, asynchronous = engine(tiny, False, backend), engine(tiny, True, backend)
    want, got = run(sync, prompts, params), run(asynchronous, prompts, params)
    assert got == want
    assert sync.num_async_steps == 0
    assert asynchronous.num_async_steps > 0, "no step was launched ahead"
    assert asynchronous.stats()["async_steps"] == asynchronous.num_async_steps
    assert_same_blocks(sync, asynchronous)


@pytest.mark.parametrize("backend", BACKENDS)
def test_arrivals_while_a_step_is_in_flight(
    tiny: Path, rng: np.random.Generator, backend: str
) -> None:
    """Requests added between steps, while a step launched ahead is in flight, wait for
    it and are then admitted; a batch that shrinks and grows feeds each row its own token."""
    prompts, params = traffic(rng, 8)
    arrivals = {0: [0, 1], 3: [2], 4: [3, 4], 9: [5], 15: [6, 7]}
    sync, asynchronous = engine(tiny, False, backend), engine(tiny, True, backend)
    want = run(sync, prompts, params, arrivals=arrivals)
    got = run(asynchronous, prompts, params, arrivals=arrivals)
    assert got == want
    assert asynchronous.num_async_steps > 0
    assert_same_blocks(sync, asynchronous)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancel_while_its_step_is_in_flight(
    tiny: Path, rng: np.random.Generator, backend: str
) -> None:
    """A request cancelled while a step that computes its next token is in flight: the
    others' tokens are unchanged, its row is dropped, and its blocks come back."""
    prompts = [rng.integers(20, 1000, size=30).tolist() for _ in range(3)]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True) for _ in range(3)]
    results = []
    for asynchronous in (False, True):
        eng = engine(tiny, asynchronous, backend)
        ids = [eng.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
        for _ in range(6):
            eng.step()
        assert eng._ahead is not None if asynchronous else eng._ahead is None
        assert eng.cancel(ids[1])
        while eng.has_work():
            eng.step()
        outs = [eng.take_completion(rid) for rid in ids]
        assert eng.pool.num_free_blocks == eng.pool.num_blocks
        eng.pool.check_integrity()
        results.append([(c.token_ids, c.finish_reason) for c in outs])
    assert results[1] == results[0]
    assert results[0][1][1] == "cancelled" and len(results[0][1][0]) == 6  # a token a step


@pytest.mark.parametrize(
    "special",
    [
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3),
        SamplingParams(max_tokens=12, temperature=0, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0, return_logits=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=5, min_tokens=8),
    ],
    ids=["penalty", "logprobs", "logits", "min_tokens"],
)
def test_steps_that_need_the_host_run_synchronously(
    tiny: Path, rng: np.random.Generator, special: SamplingParams
) -> None:
    """While a request whose next token needs the token before it on the host runs
    (penalties, min_tokens' hold) or whose row comes back (logprobs, logits), no step is
    launched ahead; the others' output is the same either way."""
    prompts = [rng.integers(20, 1000, size=20).tolist() for _ in range(2)]
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sync, asynchronous = engine(tiny, False), engine(tiny, True)
    want = sync.generate(prompts, [special, plain])
    got = asynchronous.generate(prompts, [special, plain])
    for a, b in zip(got, want, strict=True):
        assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
        assert [x.logprob for x in a.logprobs or []] == [x.logprob for x in b.logprobs or []]
    if special.min_tokens:  # stateless once the hold is lifted: launched ahead after it
        assert asynchronous.num_async_steps > 0
    else:
        assert asynchronous.num_async_steps == 0


def test_close_records_the_step_in_flight(tiny: Path, rng: np.random.Generator) -> None:
    eng = engine(tiny, True)
    rid = eng.add_request(rng.integers(20, 1000, size=10).tolist(),
                          SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))  # fmt: skip
    for _ in range(4):
        eng.step()
    assert eng._ahead is not None and eng.has_work()
    seq = eng._live[rid]
    computed = seq.num_computed_tokens
    eng.close()
    assert eng._ahead is None
    assert seq.num_computed_tokens == computed + 1 and len(seq.output_token_ids) == 5


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"async_scheduling": True, "cuda_graphs": False}, "needs decode graphs"),
        ({"async_scheduling": True, "speculative_tokens": 3}, "speculative_tokens"),
        ({"async_scheduling": 1}, "must be a bool"),
    ],
)
def test_settings_refused(settings: dict, words: str) -> None:
    with pytest.raises(SettingError, match=words) as info:
        EngineConfig(**settings)
    assert info.value.flag == "--async-scheduling"


def test_a_plan_ahead_that_cannot_launch_runs_next_call(
    tiny: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan ahead whose graph cannot run (its bucket's capture failed) is dropped: its
    blocks stay its requests', the next call schedules the step itself, and the tokens
    are the same; no block leaks."""
    prompts, params = traffic(rng, 5)
    want = run(engine(tiny, False), prompts, params)
    eng = engine(tiny, True, num_host_blocks=32, num_device_blocks=24)
    real = eng.runner.launch
    refused = []

    def launch(plan, after=None):  # type: ignore[no-untyped-def]
        if after is not None and len(refused) < 3:
            refused.append(len(plan.copies))
            return None
        return real(plan, after)

    monkeypatch.setattr(eng.runner, "launch", launch)
    assert run(eng, prompts, params) == want
    assert len(refused) == 3 and eng.num_async_steps > 0
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    eng.pool.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tight_pool_with_a_host_tier(tiny: Path, backend: str) -> None:
    """Twice the traffic through 20 device blocks and a host tier: steps launched ahead
    grow into blocks whose eviction offloads them (their pins held until that step is
    recorded), a plan ahead falls short of blocks after its growth planned offloads
    (taken by the next step), requests are preempted and resumed; the same tokens, and no
    pin or block is left held."""
    copies: list[int] = []
    preempted = 0
    for seed in (0, 1, 3, 5):
        prompts, params = traffic(np.random.default_rng(seed), 6)
        prompts, params = prompts * 2, params * 2
        settings = {"num_host_blocks": 32, "num_device_blocks": 20}
        sync, eng = engine(tiny, False, backend, **settings), engine(tiny, True, backend, **settings)
        want = run(sync, prompts, params)
        real = eng.runner.launch

        def launch(plan, after=None, real=real):  # type: ignore[no-untyped-def]
            if after is not None:
                copies.append(len(plan.copies))
            return real(plan, after)

        eng.runner.launch = launch  # type: ignore[method-assign]
        assert run(eng, prompts, params) == want
        assert eng.stats()["host_offloads"] > 0
        assert eng.pool.num_free_blocks == eng.pool.num_blocks and not eng.pool.num_pending_copies
        eng.pool.check_integrity()
        preempted += eng.stats()["preemptions"]
    assert any(copies), "no plan ahead took a copy"
    assert preempted > 0


@pytest.mark.parametrize("num_host_blocks", [0, 6], ids=["device-to-disk", "host-to-disk"])
def test_a_tight_pool_with_a_disk_tier(tiny: Path, tmp_path: Path, num_host_blocks: int) -> None:
    """Blocks evicted while steps go ahead are written to a disk tier (straight from the
    device without a host tier, or on from a small one) and found there again by the
    repeated traffic; the same tokens as the synchronous engine, no block held."""
    hits = 0
    for seed in (3, 10):
        prompts, params = traffic(np.random.default_rng(seed), 7)
        prompts, params = prompts * 2, params * 2
        results = []
        for asynchronous in (False, True):
            folder = tmp_path / f"{seed}-{asynchronous}"
            folder.mkdir()
            eng = engine(tiny, asynchronous, num_device_blocks=18, num_host_blocks=num_host_blocks,
                         disk_cache=str(folder), disk_cache_gb=0.01)  # fmt: skip
            results.append(run(eng, prompts, params))
            assert eng.pool.num_free_blocks == eng.pool.num_blocks
            eng.pool.check_integrity()
            stats = eng.stats()
            eng.close()
        assert results[1] == results[0]
        assert stats["async_steps"] > 0 and stats["disk_writes"] > 0
        hits += stats["disk_hits"]
    assert hits > 0, "no block came back from the disk tier"


def test_a_full_batch_goes_ahead_while_requests_wait(tiny: Path, rng: np.random.Generator) -> None:
    """At max_num_seqs, waiting requests cannot be admitted before one ends, so steps go
    ahead while they wait; once one ends, the next step admits the first of them. Requests
    waiting with room to spare stop steps going ahead (`test_arrivals...`)."""
    prompts, params = traffic(rng, 7)
    params = [
        SamplingParams(**{**_fields(p), "max_tokens": 12 + 3 * i}) for i, p in enumerate(params)
    ]
    sync, eng = engine(tiny, False, max_num_seqs=2), engine(tiny, True, max_num_seqs=2)
    want = run(sync, prompts, params)
    waiting_ahead = []
    real = eng.runner.launch

    def launch(plan, after=None):  # type: ignore[no-untyped-def]
        if after is not None:
            waiting_ahead.append(len(eng.scheduler.waiting))
        return real(plan, after)

    eng.runner.launch = launch  # type: ignore[method-assign]
    assert run(eng, prompts, params) == want
    assert max(waiting_ahead) > 0, "no step went ahead while requests waited"


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


def test_a_daemon_serves_concurrent_clients_with_it(
    tiny: Path, tmp_path: Path, rng: np.random.Generator
) -> None:
    """`reprise serve --cuda-graphs --async-scheduling`: clients streaming at once on the
    socket, one of them closing its stream early (a cancel while a step computing its
    next token may be in flight), get the in-process synchronous engine's tokens; the
    metrics count steps launched ahead, and every block comes back."""
    prompts = [rng.integers(20, 250, size=int(rng.integers(5, 60))).tolist() for _ in range(4)]
    params = [SamplingParams(max_tokens=24 + 5 * i, temperature=0.7 * (i % 2), seed=i,
                             ignore_eos=True) for i in range(4)]  # fmt: skip
    want = Engine.from_pretrained(
        tiny, backend="numpy", block_size=16, num_device_blocks=96, max_model_len=256
    ).generate(prompts, params)
    got: dict[int, list[int]] = {}

    def client(i: int) -> None:
        with Client(daemon.address) as c:
            stream = c.stream(prompts[i], max_tokens=params[i].max_tokens, seed=i,
                              temperature=params[i].temperature, ignore_eos=True)  # fmt: skip
            tokens = []
            for reply in stream:
                if isinstance(reply, TokenChunk):
                    tokens.extend(reply.token_ids)
                    if i == 3 and len(tokens) >= 10:
                        stream.close()  # type: ignore[attr-defined]  # cancels it
                        break
                else:
                    assert isinstance(reply, Done)
            got[i] = tokens

    with served(tmp_path, tiny, "--cuda-graphs", "--async-scheduling") as daemon:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        with Client(daemon.address) as c:
            deadline = time.monotonic() + 30
            while (stats := c.stats())["num_running"] and time.monotonic() < deadline:
                time.sleep(0.05)  # the cancelled one's end reaches the loop
        metrics = scrape(daemon.url)
    for i in range(3):
        assert got[i] == want[i].token_ids
    assert got[3] == want[3].token_ids[: len(got[3])] and len(got[3]) >= 10
    assert stats["used_blocks"] == 0 and stats["num_running"] == 0
    assert metrics[("reprise_async_steps_total", ())] > 0
