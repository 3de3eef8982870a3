"""Prefix reuse wired through the engine on the default model: cached tokens,
skipped prefill, salts, partial reuse, reuse of generated blocks, the host tier,
stats and events."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from reprise.blockpool.events import BlockStored
from reprise.daemon import Engine, SamplingParams

pytestmark = pytest.mark.model
BS = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def random_prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 49152, size=n).tolist()


@pytest.fixture
def make_engine(default_model_dir: Path):
    def make(**kwargs) -> Engine:
        kwargs.setdefault("block_size", BS)
        return Engine.from_pretrained(default_model_dir, backend="numpy", **kwargs)

    return make


def test_same_prompt_six_times_computes_only_the_uncached_tail(make_engine) -> None:
    engine = make_engine(num_device_blocks=64)
    prompt = random_prompt(90, seed=1)  # 5 full blocks of 16 and 10 tokens
    expected_cached = (len(prompt) - 1) // BS * BS
    outs = []
    for run in range(6):
        before = engine.stats()
        out = engine.generate(prompt, GREEDY)
        after = engine.stats()
        outs.append(out)
        cached = 0 if run == 0 else expected_cached
        assert out.cached_tokens == cached
        assert (
            after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
            == len(prompt) - cached
        )
        assert after["prefill_tokens_skipped"] - before["prefill_tokens_skipped"] == cached
        engine.pool.check_integrity()
    assert all(o.token_ids == outs[0].token_ids for o in outs)
    stats = engine.stats()
    assert stats["reused_blocks"] == 5 * 5 and stats["used_blocks"] == 0
    assert stats["hit_rate"] == pytest.approx(25 / 30)


def test_whole_prompt_hit_still_computes_the_last_token(make_engine) -> None:
    # without its stored logits row (test_exact_repeat.py), a prompt's last token is computed
    engine = make_engine(num_device_blocks=32, logits_cache_mb=0)
    prompt = random_prompt(4 * BS, seed=2)  # exactly 4 full blocks
    engine.generate(prompt, GREEDY)
    out = engine.generate(prompt, GREEDY)
    assert out.cached_tokens == 3 * BS + (BS - 1)  # 3 blocks, then 15 tokens copied from the 4th


def test_salts_never_share_blocks(make_engine) -> None:
    engine = make_engine(num_device_blocks=64)
    prompt = random_prompt(70, seed=3)
    assert engine.generate(prompt, GREEDY, cache_salt="tenant-a").cached_tokens == 0
    assert engine.generate(prompt, GREEDY, cache_salt="tenant-b").cached_tokens == 0
    assert engine.generate(prompt, GREEDY).cached_tokens == 0
    assert engine.generate(prompt, GREEDY, cache_salt="tenant-a").cached_tokens == 64


def test_partial_block_reuse_copies_the_shared_tokens(make_engine) -> None:
    engine = make_engine(num_device_blocks=64)
    first = random_prompt(100, seed=4)
    second = first[:75] + random_prompt(25, seed=5)
    a = engine.generate(first, GREEDY)
    b = engine.generate(second, GREEDY)
    assert a.cached_tokens == 0
    assert b.cached_tokens == 75  # 4 full blocks (64) + 11 tokens of the 5th block
    assert engine.stats()["partial_hits"] == 1
    fresh = make_engine(num_device_blocks=64).generate(second, GREEDY)
    assert fresh.token_ids == b.token_ids
    engine.pool.check_integrity()


def test_generated_blocks_are_reusable(make_engine) -> None:
    engine = make_engine(num_device_blocks=64)
    prompt = random_prompt(20, seed=6)
    out = engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    follow_up = (
        prompt + out.token_ids[:30]
    )  # 50 tokens: 3 full blocks, 2 of them hold generated tokens
    again = engine.generate(follow_up, GREEDY)
    assert again.cached_tokens == 48


def test_reuse_off_computes_everything(make_engine) -> None:
    engine = make_engine(num_device_blocks=64, enable_reuse=False, kv_events=True)
    prompt = random_prompt(70, seed=7)
    engine.generate(prompt, GREEDY)
    assert engine.generate(prompt, GREEDY).cached_tokens == 0
    assert engine.stats()["prefill_tokens_computed"] == 140
    assert engine.take_events() == []


def test_host_tier_round_trip_is_byte_exact(make_engine) -> None:
    """A prompt served from the host tier gives the same logits, bit for bit, as the
    same prompt served from the device pool (same computed tail, same cached bytes)."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, return_logits=True)
    prompt = random_prompt(100, seed=8)  # 6 full blocks + 4 tokens
    device = make_engine(num_device_blocks=64)
    device.generate(prompt, params)
    from_device = device.generate(prompt, params)
    engine = make_engine(num_device_blocks=12, num_host_blocks=32)
    engine.generate(prompt, params)
    for seed in range(9, 12):  # push the first prompt's blocks out of the device pool
        engine.generate(random_prompt(150, seed=seed), GREEDY)
    assert engine.stats()["host_offloads"] >= 6
    from_host = engine.generate(prompt, params)
    assert from_host.cached_tokens == 96 and from_host.host_cached_tokens == 96
    assert from_device.cached_tokens == 96 and from_device.host_cached_tokens == 0
    assert np.array_equal(from_host.logits, from_device.logits)
    assert from_host.token_ids == from_device.token_ids
    stats = engine.stats()
    assert stats["host_onboards"] == stats["host_hits"] == 6
    engine.pool.check_integrity()


def test_events_mirror_registered_blocks(make_engine) -> None:
    engine = make_engine(num_device_blocks=64, kv_events=True)
    prompt = random_prompt(50, seed=13)
    engine.generate(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    stored = [e for e in engine.take_events() if isinstance(e, BlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    # 50 prompt + 19 computed generated tokens = 69 tokens: 4 full blocks, chained
    assert len(hashes) == 4
    assert stored[0].parent_block_hash is None
    tokens = [t for e in stored for t in e.token_ids]
    out_tokens = prompt + engine.generate(prompt, GREEDY).token_ids  # reuses them
    assert tokens == (prompt + tokens[50:])[:64] and tokens[:50] == out_tokens[:50]
    assert all(e.block_size == BS and e.medium == "GPU" for e in stored)


def test_retention_priority_keeps_a_prompt_cached(make_engine) -> None:
    from reprise.daemon.engine.params import Retention

    engine = make_engine(num_device_blocks=14)
    pinned = random_prompt(100, seed=14)  # 6 full blocks
    engine.generate(pinned, GREEDY, retention=Retention(priority=90))
    for seed in range(15, 19):  # 7 blocks each at the default priority
        engine.generate(random_prompt(110, seed=seed), GREEDY)
    assert engine.stats()["evictions"] > 0
    assert engine.generate(pinned, GREEDY).cached_tokens == 96
    # the same flood without the retention evicts it
    engine = make_engine(num_device_blocks=14)
    engine.generate(pinned, GREEDY)
    for seed in range(15, 19):
        engine.generate(random_prompt(110, seed=seed), GREEDY)
    assert engine.generate(pinned, GREEDY).cached_tokens == 0
    with pytest.raises(ValueError, match="priority"):
        Retention(priority=101)


def test_events_of_a_salted_request_carry_hashes_only(make_engine) -> None:
    """DESIGN §7: a KV event subscriber learns nothing of a salted tenant's tokens; the
    same prompt unsalted publishes its tokens, and the salted blocks' hashes differ."""
    engine = make_engine(num_device_blocks=64, kv_events=True)
    prompt = random_prompt(50, seed=21)
    engine.generate(prompt, GREEDY, cache_salt="tenant-a")
    salted = [e for e in engine.take_events() if isinstance(e, BlockStored)]
    engine.generate(prompt, GREEDY)
    plain = [e for e in engine.take_events() if isinstance(e, BlockStored)]
    assert len(salted) == len(plain) == 3
    assert all(e.token_ids == [] and len(e.block_hashes) == 1 for e in salted)
    assert [t for e in plain for t in e.token_ids] == prompt[:48]
    assert {h for e in salted for h in e.block_hashes}.isdisjoint(
        h for e in plain for h in e.block_hashes
    )


def test_admission_hashes_no_block_it_finds_cached(make_engine, monkeypatch) -> None:
    """A prompt's cached blocks are found by their ids (the index's content map), with
    the keys hashing them gives: only blocks the pool does not hold are hashed, and the
    blocks, tokens and bits are those of hashing everything (reuse tests above)."""
    from reprise.blockpool.hashing import hash_encoded_blocks
    from reprise.daemon.engine import kvmanager

    hashed: list[int] = []

    def counting(parent, token_bytes, block_size, **kwargs):
        hashed.append(len(token_bytes) // (8 * block_size))
        return hash_encoded_blocks(parent, token_bytes, block_size, **kwargs)

    monkeypatch.setattr(kvmanager, "hash_encoded_blocks", counting)
    engine = make_engine(num_device_blocks=64, logits_cache_mb=0)
    one = SamplingParams(max_tokens=1, temperature=0)
    prompt = random_prompt(6 * BS + 5, seed=7)  # 6 full blocks, all cached once computed
    first = engine.generate(prompt, one)
    assert sum(hashed) == 6
    hashed.clear()
    again = engine.generate(prompt, one)
    assert again.cached_tokens == 6 * BS and sum(hashed) == 0
    assert again.token_ids == first.token_ids
    # a shared head of 4 blocks and a new tail of 3: only the tail's blocks are hashed
    hashed.clear()
    other = prompt[: 4 * BS] + random_prompt(3 * BS + 2, seed=8)
    out = engine.generate(other, one)
    assert out.cached_tokens == 4 * BS and sum(hashed) == 3
    # a salted request shares nothing with the unsalted chain: all its blocks are hashed
    hashed.clear()
    engine.add_request(prompt, one, cache_salt="tenant")
    while engine.has_work():
        engine.step()
    assert sum(hashed) == 6
    engine.pool.check_integrity()
