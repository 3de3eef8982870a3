"""Exact repeats, on the tiny synthetic model and the NumPy backend: a prompt whose
last logits row is stored and whose every token's KV is cached samples its first
token from the row, with no forward step; its tokens, logits rows and logprobs are
bit-identical to the same request on an engine without the cache (and without
reuse); salts, prompt tables, eviction, batching with fresh work, the LRU's bound in
bytes, and the setting's checks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from reprise.cli.main import main as cli
from reprise.cuda.dtypes import BF16
from reprise.daemon import Completion, Engine, SamplingParams
from reprise.daemon.engine.config import EngineConfig, SettingError
from reprise.daemon.engine.logits_cache import LogitsCache, PromptKey
from reprise.daemon.model.synth import synth_model

BS = 16
# fills the block that holds a prompt's tail, so that a repeat finds every prompt token
WARM = SamplingParams(max_tokens=BS, temperature=0, ignore_eos=True)
GREEDY = SamplingParams(
    max_tokens=6, temperature=0, ignore_eos=True, return_logits=True, logprobs=3
)
SEEDED_PENALIZED = SamplingParams(
    max_tokens=6, temperature=0.9, top_k=50, top_p=0.9, seed=7, ignore_eos=True,
    return_logits=True, logprobs=2, frequency_penalty=0.5, presence_penalty=0.3,
    repetition_penalty=1.2,
)  # fmt: skip
ONE_TOKEN = SamplingParams(
    max_tokens=1, temperature=0.7, seed=3, ignore_eos=True, return_logits=True, logprobs=1
)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(4, 250, size=n).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield synth_model("tiny", tmp_path_factory.mktemp("repeat") / "tiny")


def engine(path: Path, **kwargs) -> Engine:
    kwargs.setdefault("num_device_blocks", 64)
    return Engine.from_pretrained(path, backend="numpy", block_size=BS, **kwargs)


class ForwardCounter:
    """Counts the model's forward calls (wraps the engine's model instance)."""

    def __init__(self, eng: Engine) -> None:
        self.calls = 0
        model = eng.runner.model
        inner = model.forward

        def forward(*args, **kwargs):
            self.calls += 1
            return inner(*args, **kwargs)

        model.forward = forward  # type: ignore[method-assign]


def assert_same(got: Completion, want: Completion) -> None:
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    if want.logits is None:
        assert got.logits is None
    else:
        assert got.logits is not None and got.logits.dtype == want.logits.dtype
        assert np.array_equal(got.logits.view(np.uint32), want.logits.view(np.uint32))
    assert got.logprobs == want.logprobs


def reference(tiny: Path, prompt_ids: list[int], params: SamplingParams, **request) -> Completion:
    """The request on a fresh engine without the logits cache, and again without reuse
    (both must agree: the reference itself is checked)."""
    off = engine(tiny, logits_cache_mb=0).generate(prompt_ids, params, **request)
    no_reuse = engine(tiny, enable_reuse=False).generate(prompt_ids, params, **request)
    assert isinstance(off, Completion) and isinstance(no_reuse, Completion)
    assert_same(no_reuse, off)
    return off


def repeat(eng: Engine, prompt_ids: list[int], params: SamplingParams, **request):
    """Run a request; returns its completion and (forward calls, prefill tokens computed,
    exact repeats) it cost."""
    counter = ForwardCounter(eng)
    before = eng.stats()
    out = eng.generate(prompt_ids, params, **request)
    after = eng.stats()
    eng.pool.check_integrity()
    assert isinstance(out, Completion)
    costs = (
        counter.calls,
        after["prefill_tokens_computed"] - before["prefill_tokens_computed"],
        after["exact_repeats"] - before["exact_repeats"],
    )
    return out, costs


@pytest.mark.parametrize("num_prompt", [2 * BS, 2 * BS + 5, 7])
@pytest.mark.parametrize(
    "params", [GREEDY, SEEDED_PENALIZED, ONE_TOKEN], ids=["greedy", "seeded", "one-token"]
)
def test_exact_repeat_is_bit_identical_and_runs_no_forward(
    tiny: Path, num_prompt: int, params: SamplingParams
) -> None:
    ids = prompt(num_prompt, seed=num_prompt)
    eng = engine(tiny)
    repeat(eng, ids, WARM)
    out, (forwards, computed, exact) = repeat(eng, ids, params)
    assert exact == 1 and computed == 0
    assert out.cached_tokens == num_prompt
    # the first token needs no forward; each later one needs its own decode step
    assert forwards == params.max_tokens - 1
    assert_same(out, reference(tiny, ids, params))
    # and again: the repeat's own KV and row serve a third time
    again, (_, computed, exact) = repeat(eng, ids, params)
    assert exact == 1 and computed == 0
    assert_same(again, out)


def test_a_prompt_seen_once_stores_its_row_and_a_partial_tail_falls_back(tiny: Path) -> None:
    """A first request stores the row; a repeat whose tail block was never filled (the
    first request generated too few tokens) finds the row but not every token's KV: it
    computes the last token, as without the cache, and gives the same bits."""
    ids = prompt(2 * BS + 5, seed=11)
    eng = engine(tiny)
    first, (_, computed, exact) = repeat(eng, ids, GREEDY)  # fills 5 + 6 < 16 of the tail block
    assert exact == 0 and computed == len(ids)
    stats = eng.stats()
    assert stats["logits_cache_entries"] == 1
    assert stats["logits_cache_bytes"] == eng.config.vocab_size * 4
    second, (forwards, computed, exact) = repeat(eng, ids, GREEDY)
    assert exact == 0 and computed == 5 and second.cached_tokens == 2 * BS
    assert forwards == GREEDY.max_tokens
    assert_same(second, first)
    assert_same(second, reference(tiny, ids, GREEDY))


def test_every_first_token_of_a_batch_is_as_without_the_cache(tiny: Path) -> None:
    """An exact repeat in the same step as a fresh prompt and a repeat that falls back:
    the forward serves the others, the stored row the repeat, each as if alone."""
    repeated, fresh = prompt(3 * BS, seed=21), prompt(BS + 3, seed=22)
    eng = engine(tiny)
    repeat(eng, repeated, WARM)
    params = [SEEDED_PENALIZED, GREEDY]
    before = eng.stats()
    outs = eng.generate([repeated, fresh], params)
    assert eng.stats()["exact_repeats"] - before["exact_repeats"] == 1
    assert [o.cached_tokens for o in outs] == [3 * BS, 0]
    for out, ids, p in zip(outs, [repeated, fresh], params, strict=True):
        assert_same(out, reference(tiny, ids, p))


def test_another_salt_never_meets_the_row(tiny: Path) -> None:
    ids = prompt(2 * BS, seed=31)
    eng = engine(tiny)
    repeat(eng, ids, WARM, cache_salt="tenant-a")
    for salt in ("tenant-b", None, b"tenant-a"):
        out, (_, computed, exact) = repeat(eng, ids, GREEDY, cache_salt=salt)
        assert exact == 0 and computed == len(ids) and out.cached_tokens == 0
    out, (_, computed, exact) = repeat(eng, ids, GREEDY, cache_salt="tenant-a")
    assert exact == 1 and computed == 0 and out.cached_tokens == len(ids)
    assert_same(out, reference(tiny, ids, GREEDY, cache_salt="tenant-a"))
    for salt in ("tenant-a", "tenant-b", None, b"tenant-a"):
        eng.add_request(ids, GREEDY, cache_salt=salt)
    assert len({eng.kv.prompt_key(seq) for seq in eng.scheduler.waiting}) == 4


def test_a_prompt_table_enters_the_key(tiny: Path) -> None:
    eng = engine(tiny)
    vocab, hidden = eng.config.vocab_size, eng.config.hidden_size
    rng = np.random.default_rng(41)
    t1, t2 = (rng.standard_normal((4, hidden)).astype(BF16) for _ in range(2))
    ids = [vocab, vocab + 1, vocab + 2, vocab + 3, *prompt(BS + 4, seed=42)]
    repeat(eng, ids, WARM, prompt_table=t1)
    out, (forwards, _, exact) = repeat(eng, ids, ONE_TOKEN, prompt_table=t1)
    assert exact == 1 and forwards == 0
    assert_same(out, reference(tiny, ids, ONE_TOKEN, prompt_table=t1))
    other, (_, computed, exact) = repeat(eng, ids, ONE_TOKEN, prompt_table=t2)
    assert exact == 0 and computed == len(ids)
    assert_same(other, reference(tiny, ids, ONE_TOKEN, prompt_table=t2))
    assert not np.array_equal(other.logits, out.logits)


def test_evicted_blocks_fall_back_and_stay_identical(tiny: Path) -> None:
    """The row outlives the prompt's KV blocks (a small pool): the repeat computes the
    prompt again and samples from the forward's row, the same bits."""
    ids = prompt(3 * BS + 2, seed=51)
    eng = engine(tiny, num_device_blocks=6)
    repeat(eng, ids, WARM)
    for seed in range(3):  # other prompts take every block
        repeat(eng, prompt(5 * BS, seed=100 + seed), WARM)
    assert eng.stats()["logits_cache_entries"] == 4
    out, (_, computed, exact) = repeat(eng, ids, SEEDED_PENALIZED)
    assert exact == 0 and computed == len(ids)
    assert_same(out, reference(tiny, ids, SEEDED_PENALIZED))


def test_the_cache_off_or_reuse_off_stores_nothing(tiny: Path) -> None:
    ids = prompt(2 * BS, seed=61)
    for settings in ({"logits_cache_mb": 0}, {"enable_reuse": False}):
        eng = engine(tiny, **settings)
        assert eng.logits_cache is None
        repeat(eng, ids, WARM)
        _, (forwards, _, exact) = repeat(eng, ids, ONE_TOKEN)
        assert exact == 0 and forwards == 1
        stats = eng.stats()
        assert stats["logits_cache_entries"] == stats["logits_cache_max_bytes"] == 0


def test_prompt_keys_cover_every_token_and_never_equal_a_block_key(tiny: Path) -> None:
    eng = engine(tiny)
    base = prompt(2 * BS + 1, seed=71)
    variants = [base[: 2 * BS - 1], base[: 2 * BS], base, [*base[:-1], base[-1] + 1]]
    variants += [[*base[:3], base[3] + 1, *base[4:]], base[:1]]
    for ids in variants:
        eng.add_request(ids, GREEDY)
    seqs = eng.scheduler.waiting
    keys = [eng.kv.prompt_key(seq) for seq in seqs]
    assert len(set(keys)) == len(variants)
    block_keys = {h for seq in seqs for h in eng.kv.hash_chain(seq, seq.num_tokens // BS)}
    assert not block_keys & set(keys)
    assert eng.kv.prompt_key(seqs[0]) == keys[0]  # a function of the prompt alone


def test_the_lru_holds_its_bound_in_bytes() -> None:
    row = np.arange(100, dtype=np.float32)  # 400 bytes

    def key(i: int) -> PromptKey:
        return PromptKey(bytes([i]) * 32)

    cache = LogitsCache(1000)
    for i in range(3):
        assert cache.put(key(i), row + i)
        assert cache.num_bytes <= 1000
    assert len(cache) == 2 and key(0) not in cache  # the third evicted the first
    assert cache.get(key(1)) is not None  # now 2 is the least recently used
    cache.put(key(3), row)
    assert key(2) not in cache and key(1) in cache and key(3) in cache
    assert cache.num_bytes == 800 and cache.num_evictions == 2
    stored = cache.get(key(1))
    assert stored is not None and not stored.flags.writeable
    assert np.array_equal(stored, row + 1)
    assert not cache.put(key(4), np.zeros(251, dtype=np.float32))  # 1004 bytes: never fits
    assert len(cache) == 2 and cache.num_bytes == 800
    cache.put(key(1), row[:50])  # a new row under a known key replaces the old one
    assert cache.num_bytes == 600
    empty = LogitsCache(0)
    assert not empty.put(key(0), row[:1]) and len(empty) == 0


@pytest.mark.parametrize("value", [-1, 1.5, True, "64"])
def test_a_bad_setting_is_refused_naming_the_flag(value: object) -> None:
    with pytest.raises(SettingError, match="logits_cache_mb must be an integer >= 0") as info:
        EngineConfig(logits_cache_mb=value)  # type: ignore[arg-type]
    assert info.value.flag == "--logits-cache-mb"


def test_the_cache_with_reuse_off_is_refused() -> None:
    """--logits-cache-mb without reuse would be ignored: refused, naming both."""
    with pytest.raises(SettingError, match=r"logits_cache_mb \(8\) needs reuse") as info:
        EngineConfig(enable_reuse=False, logits_cache_mb=8)
    assert info.value.flag == "--logits-cache-mb"
    assert EngineConfig(enable_reuse=False).logits_cache_bytes == 0  # its default follows
    assert EngineConfig(enable_reuse=False, logits_cache_mb=0).logits_cache_bytes == 0
    assert EngineConfig().logits_cache_bytes == 64 << 20


def test_serve_has_the_flag() -> None:
    result = CliRunner().invoke(cli, ["serve", "--help"])
    assert result.exit_code == 0 and "--logits-cache-mb" in result.output
    bad = CliRunner().invoke(cli, ["serve", "--logits-cache-mb", "-1"])
    assert bad.exit_code == 2
    assert "--logits-cache-mb" in bad.output and "Traceback" not in bad.output
