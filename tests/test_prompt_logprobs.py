"""Prompt logprobs (SamplingParams.prompt_logprobs) on a tiny random Llama and the
NumPy backend: a fresh prompt's entries are those of an independent reference (the
sampling rows of a no-cache engine, one prefix at a time), and they are
bit-identical whether the prompt was computed fresh, fully or partly reused, in
chunks of any size, batched, onboarded from the host tier, or preempted; requests
without them compute no extra row and store nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from reprise.daemon import Engine, SamplingParams
from reprise.daemon.engine.config import EngineConfig, SettingError
from reprise.daemon.engine.sampling.logprobs import token_logprobs
from reprise.daemon.model.synth import synth_model

BS = 16
MAX_TOP = 5  # the engines' max_prompt_logprobs


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(4, 250, size=n).tolist()


A48, A50 = prompt(48, 1), prompt(50, 2)  # a multiple of the block size, and not


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield synth_model("tiny", tmp_path_factory.mktemp("plp") / "tiny")


def engine(path: Path, **kwargs) -> Engine:
    kwargs.setdefault("num_device_blocks", 64)
    kwargs.setdefault("max_prompt_logprobs", MAX_TOP)
    kwargs.setdefault("logits_cache_mb", 0)  # the KV paths; exact repeats: the test below
    return Engine.from_pretrained(path, backend="numpy", block_size=BS, **kwargs)


def asking(num_top: int = MAX_TOP, max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=num_top
    )


def fresh(path: Path, prompt_ids: list[int], num_top: int = MAX_TOP) -> list:
    entries = engine(path).generate(prompt_ids, asking(num_top)).prompt_logprobs
    assert entries is not None
    return entries


def all_cached(prompt_ids: list[int]) -> int:
    """Cached tokens of a prompt whose entries are all stored, its tail's too (the
    tokens past its last full block): as without prompt logprobs, every token but the
    last, or, when it ends in a partial block (which no cached block shares here), its
    full blocks."""
    size = len(prompt_ids)
    return size - 1 if size % BS == 0 else size // BS * BS


def cut(entries: list, num_top: int) -> list:
    return [
        e if e is None else type(e)(e.token_id, e.logprob, e.top[:num_top], e.rank) for e in entries
    ]


@pytest.mark.parametrize("num_top", [0, MAX_TOP])
@pytest.mark.parametrize("prompt_ids", [A48, A50], ids=["48", "50"])
def test_fresh_entries_are_the_no_cache_references(
    tiny: Path, prompt_ids: list[int], num_top: int
) -> None:
    """Entry t is token_logprobs of the row that position t - 1 samples from when the
    prompt ends there, from an engine without reuse, one prefix at a time."""
    ref = engine(tiny, enable_reuse=False)
    row_params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, return_logits=True)
    want: list = [None]
    for t in range(1, len(prompt_ids)):
        out = ref.generate(prompt_ids[:t], row_params)
        assert out.logits is not None
        row = out.logits[0]
        want.append(token_logprobs(row, prompt_ids[t], num_top))
        exact = row.astype(np.float64) - np.logaddexp.reduce(row.astype(np.float64))
        assert abs(want[-1].logprob - exact[prompt_ids[t]]) < 1e-5  # within fp32 rounding
    got = fresh(tiny, prompt_ids, num_top)
    assert len(got) == len(prompt_ids) and got[0] is None
    assert all(len(e.top) == num_top for e in got[1:])
    assert got == want


@pytest.mark.parametrize("prompt_ids", [A48, A50], ids=["48", "50"])
def test_partly_and_fully_cached_prompts_give_the_same_entries(
    tiny: Path, prompt_ids: list[int]
) -> None:
    """A prompt sharing its first j blocks (every j) with one computed before reuses
    j blocks but the last token of the j-th, whose row gives block j's first entry."""
    size = len(prompt_ids)
    for j in range(size // BS + 1):
        other = prompt_ids[: j * BS] + prompt(size - j * BS, 100 + j)
        eng = engine(tiny)
        first = eng.generate(other, asking())
        assert first.cached_tokens == 0 and first.prompt_logprobs == fresh(tiny, other)
        again = eng.generate(prompt_ids, asking())
        assert again.prompt_logprobs == fresh(tiny, prompt_ids), j
        assert again.cached_tokens == max(j * BS - 1, 0), j
        whole = eng.generate(prompt_ids, asking())  # every block's entries stored
        assert whole.cached_tokens == all_cached(prompt_ids)
        assert whole.prompt_logprobs == again.prompt_logprobs
        assert whole.token_ids == again.token_ids


@pytest.mark.parametrize("prompt_ids", [A48, A50], ids=["48", "50"])
def test_a_prompt_with_every_entry_stored_is_an_exact_repeat(
    tiny: Path, prompt_ids: list[int]
) -> None:
    """With the logits cache on, a prompt whose blocks' entries are all kept and that
    ends on a block boundary runs no token at all (an exact repeat) and gets the same
    entries and tokens; one ending in a partial block computes as without the cache."""
    eng = engine(tiny, logits_cache_mb=64)
    first = eng.generate(prompt_ids, asking())
    again = eng.generate(prompt_ids, asking())
    whole = len(prompt_ids) % BS == 0
    assert again.cached_tokens == (len(prompt_ids) if whole else all_cached(prompt_ids))
    assert eng.stats()["exact_repeats"] == int(whole)
    assert again.prompt_logprobs == first.prompt_logprobs == fresh(tiny, prompt_ids)
    assert again.token_ids == first.token_ids


def test_a_stored_tail_costs_no_token_more_than_without_them(tiny: Path) -> None:
    """A50's repeat finds its tail's entries (tokens 48 and 49) by the whole prompt's
    key: it computes what the same repeat without prompt logprobs computes, where it
    used to compute the last full block's last position too. A prompt with the same
    full blocks but another tail finds none of that tail's entries."""
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with_them, without = engine(tiny), engine(tiny)
    for eng, params in ((with_them, asking()), (without, plain)):
        eng.generate(A50, params)
    before = with_them.prefill_tokens_computed, without.prefill_tokens_computed
    again = with_them.generate(A50, asking())
    repeat = without.generate(A50, plain)
    computed = with_them.prefill_tokens_computed - before[0]
    assert computed == without.prefill_tokens_computed - before[1] == 50 - 48
    assert again.cached_tokens == repeat.cached_tokens == all_cached(A50) == 48
    assert again.prompt_logprobs == fresh(tiny, A50)
    assert again.token_ids == repeat.token_ids
    other_tail = [*A50[:48], 7, 9]  # the same full blocks (their entries kept), not the tail
    other = with_them.generate(other_tail, asking())
    assert other.prompt_logprobs == fresh(tiny, other_tail)
    assert other.cached_tokens == 47  # computes the row before its tail's first entry


@pytest.mark.parametrize("budget", [1, 5, 16, 17])
def test_chunked_prefill_gives_the_same_entries(tiny: Path, budget: int) -> None:
    eng = engine(tiny, max_num_batched_tokens=budget)
    assert eng.generate(A50, asking()).prompt_logprobs == fresh(tiny, A50)
    # and chunked on top of a partial hit (3 blocks of A50 shared)
    other = A50[: 3 * BS] + prompt(20, 7)
    out = eng.generate(other, asking())
    assert out.cached_tokens == 3 * BS - 1 and out.prompt_logprobs == fresh(tiny, other)


def test_batched_requests_keep_their_entries_and_rows(tiny: Path) -> None:
    """Batched with requests that ask and that do not: the same entries, and the plain
    request's logits rows are those it gets alone (sampling rows are untouched)."""
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, return_logits=True)
    x = prompt(40, 9)
    alone = engine(tiny).generate(x, plain)
    for budget in (None, 24):
        eng = engine(tiny, max_num_batched_tokens=budget)
        outs = eng.generate([A50, x, A48], [asking(), plain, asking(2)])
        assert outs[0].prompt_logprobs == fresh(tiny, A50)
        assert outs[2].prompt_logprobs == cut(fresh(tiny, A48), 2)
        assert outs[1].prompt_logprobs is None and outs[1].token_ids == alone.token_ids
        assert np.array_equal(outs[1].logits, alone.logits)


def test_host_tier_onboarded_blocks_serve_their_entries(tiny: Path) -> None:
    eng = engine(tiny, num_device_blocks=8, num_host_blocks=32)
    want = eng.generate(A50, asking()).prompt_logprobs
    for seed in (21, 22):  # push A50's blocks out of the device pool into the host tier
        eng.generate(prompt(100, seed), SamplingParams(max_tokens=2, ignore_eos=True))
    out = eng.generate(A50, asking())
    assert out.host_cached_tokens > 0 and out.cached_tokens == all_cached(A50)
    assert out.prompt_logprobs == want == fresh(tiny, A50)


def test_blocks_cached_without_entries_are_computed_again(tiny: Path) -> None:
    eng = engine(tiny)
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    before = eng.generate(A50, plain)
    out = eng.generate(A50, asking())  # its KV is cached, its entries are not
    assert out.cached_tokens == 0 and out.prompt_logprobs == fresh(tiny, A50)
    assert out.token_ids == before.token_ids
    again = eng.generate(A50, asking())
    assert again.cached_tokens == all_cached(A50) and again.prompt_logprobs == out.prompt_logprobs
    after = eng.generate(A50, plain)  # and a plain request after one that asked
    assert after.cached_tokens == 3 * BS and after.prompt_logprobs is None  # its full blocks
    assert after.token_ids == before.token_ids


def test_fewer_top_tokens_are_a_prefix_of_the_stored(tiny: Path) -> None:
    eng = engine(tiny)
    full = eng.generate(A48, asking(MAX_TOP)).prompt_logprobs
    for num_top in (0, 2):
        out = eng.generate(A48, asking(num_top))
        assert out.cached_tokens == len(A48) - 1
        assert out.prompt_logprobs == cut(full, num_top) == cut(fresh(tiny, A48), num_top)


def test_salts_isolate_entries(tiny: Path) -> None:
    eng = engine(tiny)
    salted = eng.generate(A50, asking(), cache_salt="tenant-a")
    other = eng.generate(A50, asking(), cache_salt="tenant-b")
    assert other.cached_tokens == 0
    same = eng.generate(A50, asking(), cache_salt="tenant-a")
    assert same.cached_tokens == all_cached(A50)
    assert salted.prompt_logprobs == other.prompt_logprobs == same.prompt_logprobs


def test_preempted_requests_keep_their_entries(tiny: Path) -> None:
    eng = engine(tiny, num_device_blocks=9, max_num_batched_tokens=20)
    params = asking(max_tokens=40)
    outs = eng.generate([A50, A48], [params, params])
    assert eng.stats()["preemptions"] > 0
    assert outs[0].prompt_logprobs == fresh(tiny, A50)
    assert outs[1].prompt_logprobs == fresh(tiny, A48)


def test_requests_without_them_compute_no_extra_row(tiny: Path) -> None:
    eng = engine(tiny, max_num_batched_tokens=16)
    rows: list[int] = []
    forward = eng.runner.model.forward

    def counting(batch, kv_cache):
        rows.append(int(batch.logit_rows.shape[0]))
        return forward(batch, kv_cache)

    eng.runner.model.forward = counting  # an instance attribute shadows the method
    eng.generate(A50, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert rows == [0, 0, 0, 1, 1] and len(eng.logprob_store) == 0
    rows.clear()
    eng.generate(A48, asking(max_tokens=1))
    assert rows == [16, 16, 15 + 1]  # positions 0..46 give entries 1..47; 47 samples
    assert len(eng.logprob_store) == 3


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_bad_values_are_refused_with_one_line(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^prompt_logprobs must be an integer >= 0") as info:
        SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_the_engine_bounds_them_by_its_setting(tiny: Path) -> None:
    eng = engine(tiny)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be an integer in \[0, 5\]"):
        eng.add_request(A48, asking(MAX_TOP + 1))
    with pytest.raises(ValueError, match="not available with prompt_table"):
        eng.add_request(A48, asking(), extra_ids=[0] * len(A48))
    for bad in (-1, 1001, True, "20"):
        with pytest.raises(SettingError, match=r"^max_prompt_logprobs must be an integer in"):
            EngineConfig(max_prompt_logprobs=bad)  # type: ignore[arg-type]


def test_the_entries_read_as_their_list(tiny: Path) -> None:
    """Completion.prompt_logprobs makes each TokenLogprobs when it is read (a 2k prompt's
    list took 3 ms to make, 15x an exact repeat's whole request), and reads as the list
    of them would: by index (negative too), slice, iteration and equality."""
    eng = engine(tiny)
    got = eng.generate(A50, asking()).prompt_logprobs
    assert got is not None and not isinstance(got, list)
    want = list(got)
    assert len(got) == len(want) == len(A50) and want[0] is None and None not in want[1:]
    assert [got[i] for i in range(len(got))] == want
    assert got[-1] == want[-1] and got[-len(A50)] is None
    assert got[3:17] == want[3:17] and got[::7] == want[::7] and got[:] == want
    assert got == want and want == got and got == tuple(want)
    for idx in (len(A50), -len(A50) - 1):
        with pytest.raises(IndexError):
            got[idx]
    other = list(want)
    other[9] = type(want[9])(want[9].token_id, want[9].logprob, want[9].top, want[9].rank + 1)
    assert got != other and got != want[:-1] and got != "not entries"
    assert eng.generate(A50[:1], asking()).prompt_logprobs == [None]  # one token: no row


def test_an_exact_repeat_with_entries_hashes_no_block(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repeat's prompt key takes the keys of the blocks the pool holds from the
    pool (found by their ids), so neither its logits row's lookup nor its entries'
    hash a block, and it is still the exact repeat with the same entries."""
    from reprise.daemon.engine import kvmanager

    eng = engine(tiny, logits_cache_mb=64)
    first = eng.generate(A48, asking())  # ends on a block boundary: repeats exactly
    hashed: list[int] = []
    real = kvmanager.hash_encoded_blocks

    def counting(parent, id_bytes, block_size, **kwargs):
        hashed.append(len(id_bytes) // (8 * block_size))
        return real(parent, id_bytes, block_size, **kwargs)

    monkeypatch.setattr(kvmanager, "hash_encoded_blocks", counting)
    again = eng.generate(A48, asking())
    assert eng.scheduler.num_exact_repeats == 1 and sum(hashed) == 0, hashed
    assert again.prompt_logprobs == first.prompt_logprobs and again.token_ids == first.token_ids
    eng.generate(prompt(48, 9), asking())  # a new prompt's blocks are hashed as before
    assert sum(hashed) >= 48 // BS
