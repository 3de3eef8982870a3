"""The scheduler's bookkeeping without a model: continuous batching within a token
budget, admission by priority, preemption of the request that sorts last, and
shared-prefix dedup (a request waits for the blocks another one is computing).

Each simulated step does what the engine does around the forward pass: advance
the computed counts, register the blocks that became full, append a token to
every sequence that sampled.
"""

from __future__ import annotations

import numpy as np
import pytest

from reprise.blockpool.pool import BlockPool
from reprise.daemon.engine.kvmanager import KVCacheManager
from reprise.daemon.engine.params import SamplingParams
from reprise.daemon.engine.scheduler import ScheduledSeq, Scheduler
from reprise.daemon.engine.sequence import RequestId, SeqStatus, Sequence

BS = 32
PARAMS = SamplingParams(max_tokens=1000, temperature=0)


class Sim:
    def __init__(
        self, num_blocks: int, budget: int, *, enable_reuse: bool = True,
        max_num_seqs: int | None = None,
    ) -> None:  # fmt: skip
        self.pool = BlockPool(num_blocks, BS, enable_reuse=enable_reuse)
        self.kv = KVCacheManager(self.pool, b"model")
        self.scheduler = Scheduler(self.kv, budget, max_num_seqs=max_num_seqs)
        self.prompt_tokens_computed = 0
        self._next_id = 0

    def add(self, prompt: list[int], priority: int = 0) -> Sequence:
        seq = Sequence(RequestId(self._next_id), prompt, PARAMS, seed=0, priority=priority)
        self._next_id += 1
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[ScheduledSeq]:
        """The engine's step with a runner that computes nothing and samples token 7."""
        plan = self.scheduler.schedule()
        scheduled = plan.scheduled
        assert sum(s.num_tokens for s in scheduled) <= self.scheduler.max_num_batched_tokens
        assert all(c.kind == "device" for c in plan.copies)  # no host tier: partial reuse only
        self.pool.complete_copies()
        samples = [item.samples for item in scheduled]
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            num_prompt = len(seq.prompt_token_ids)
            self.prompt_tokens_computed += max(0, min(start + item.num_tokens, num_prompt) - start)
            seq.num_computed_tokens += item.num_tokens
        for item in scheduled:  # the plan names exactly the sequences with a block to register
            num_full = item.seq.num_computed_tokens // BS
            assert (item in plan.to_register) == (num_full > len(item.seq.block_hashes))
        for item in plan.to_register:
            self.kv.register_full_blocks(item.seq)
        for item, sampled in zip(scheduled, samples, strict=True):
            if sampled:
                item.seq.output_token_ids.append(7)
        self.pool.check_integrity()
        return scheduled


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 50000, size=n).tolist()


def test_a_burst_sharing_a_system_prompt_computes_it_once() -> None:
    system = tokens(1024, seed=0)
    sim = Sim(num_blocks=16 * 40, budget=2048)
    seqs = [sim.add(system + tokens(40, seed=1 + i)) for i in range(16)]

    first = sim.step()
    assert [s.seq for s in first] == [seqs[0]]  # the rest wait for its blocks
    assert all(s.status is SeqStatus.WAITING for s in seqs[1:])
    second = sim.step()
    assert {s.seq.request_id for s in second} == {s.request_id for s in seqs}
    assert all(s.num_cached_tokens == 1024 for s in seqs[1:])
    assert seqs[0].num_cached_tokens == 0
    assert sim.prompt_tokens_computed == 1024 + 16 * 40
    assert sim.scheduler.num_prefix_waits == 15


def test_without_reuse_nobody_waits_and_everything_is_computed() -> None:
    system = tokens(1024, seed=0)
    sim = Sim(num_blocks=16 * 40, budget=1 << 16, enable_reuse=False)
    for i in range(16):
        sim.add(system + tokens(40, seed=1 + i))
    assert len(sim.step()) == 16
    assert sim.prompt_tokens_computed == 16 * 1064
    assert sim.scheduler.num_prefix_waits == 0


def test_a_chunked_prefix_is_waited_for_until_its_last_shared_block() -> None:
    """The first request's prompt takes four steps of the budget; the second, sharing
    its first 6 blocks, waits until they are all computed, then computes only its
    own suffix; a request with another prefix is not held up by it."""
    shared = tokens(6 * BS, seed=3)
    sim = Sim(num_blocks=64, budget=2 * BS)
    a = sim.add(shared + tokens(10, seed=4))
    b = sim.add(shared + tokens(20, seed=5))
    c = sim.add(tokens(8, seed=6))
    assert [s.seq for s in sim.step()] == [a]  # the whole budget
    assert [s.seq for s in sim.step()] == [a]
    assert [s.seq for s in sim.step()] == [a]  # the last shared block
    assert b.status is SeqStatus.WAITING and b.num_cached_tokens is None
    fourth = sim.step()
    assert [(s.seq, s.num_tokens) for s in fourth] == [(a, 10), (b, 20), (c, 8)]
    assert b.num_cached_tokens == 6 * BS
    sim.step()
    assert sim.prompt_tokens_computed == 6 * BS + 10 + 20 + 8


def test_a_cancelled_prefix_computer_releases_the_waiters() -> None:
    shared = tokens(4 * BS, seed=7)
    sim = Sim(num_blocks=64, budget=BS)
    a = sim.add(shared + tokens(5, seed=8))
    b = sim.add(shared + tokens(5, seed=9))
    sim.step()  # a computes its first block; b waits
    assert b.status is SeqStatus.WAITING
    sim.scheduler.finish(a)
    scheduled = sim.step()
    assert [s.seq for s in scheduled] == [b]
    assert b.num_cached_tokens == BS  # the one block a registered before it went


def test_admission_follows_priority_then_arrival() -> None:
    sim = Sim(num_blocks=64, budget=10)
    seqs = [sim.add(tokens(10, seed=10 + i), priority=p) for i, p in enumerate([5, 0, 3, 0])]
    order: list[Sequence] = []
    for _ in range(8):
        order += [s.seq for s in sim.step() if s.seq not in order]
    assert order == [seqs[1], seqs[3], seqs[2], seqs[0]]


def test_at_most_max_num_seqs_run_and_the_rest_wait_their_turn() -> None:
    """vLLM's max_num_seqs: admission stops at that many running requests (token budget
    and blocks to spare); the next waiting one is admitted, in priority order, when one
    finishes."""
    sim = Sim(num_blocks=64, budget=1 << 10, max_num_seqs=2)
    seqs = [sim.add(tokens(10, seed=30 + i), priority=p) for i, p in enumerate([3, 0, 1, 0])]
    assert {s.seq.request_id for s in sim.step()} == {seqs[1].request_id, seqs[3].request_id}
    for _ in range(3):
        assert len(sim.step()) == 2 and len(sim.scheduler.running) == 2
        assert seqs[0].status == seqs[2].status == SeqStatus.WAITING
    sim.scheduler.finish(seqs[3])
    assert seqs[2] in [s.seq for s in sim.step()] and seqs[0].status == SeqStatus.WAITING


def test_preemption_takes_the_lowest_priority_then_the_youngest() -> None:
    """Three requests fill a 6-block pool; when the most urgent one needs a block,
    the least urgent gives way, not the youngest."""
    sim = Sim(num_blocks=6, budget=1 << 10)
    urgent = sim.add(tokens(2 * BS, seed=20), priority=0)
    lax = sim.add(tokens(2 * BS, seed=21), priority=9)
    young = sim.add(tokens(2 * BS, seed=22), priority=1)
    sim.step()  # all three prefills fill the 6 blocks; each sampled a token
    assert sim.pool.num_free_blocks == 0
    second = sim.step()  # each token needs a third block: lax gives its two up
    assert [s.seq for s in second] == [urgent, young]
    assert lax.status is SeqStatus.WAITING and not lax.block_ids
    assert sim.scheduler.waiting == [lax] and sim.scheduler.num_preemptions == 1


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_finishes_and_leaks_nothing(seed: int) -> None:
    """Random arrivals, shared prefixes, priorities, cancellations and a small pool:
    every request finishes, and at the end every block is free."""
    rng = np.random.default_rng(seed)
    prefixes = [tokens(int(n), seed=100 + i) for i, n in enumerate(rng.integers(1, 5 * BS, 3))]
    sim = Sim(num_blocks=24, budget=int(rng.integers(8, 200)))
    live: list[Sequence] = []
    target = {}
    for step in range(400):
        if step < 60 and rng.random() < 0.5:
            prompt = prefixes[int(rng.integers(3))] + tokens(int(rng.integers(1, 40)), seed=step)
            seq = sim.add(prompt[: 4 * BS], priority=int(rng.integers(0, 3)))
            target[seq.request_id] = int(rng.integers(1, 3 * BS))
            live.append(seq)
        sim.step()
        for seq in list(live):
            if len(seq.output_token_ids) >= target[seq.request_id] or (
                rng.random() < 0.01 and seq.status is not SeqStatus.FINISHED
            ):
                sim.scheduler.finish(seq)
                live.remove(seq)
        sim.pool.check_integrity()
        if step >= 60 and not live:
            break
    assert not live and not sim.scheduler.has_work()
    assert sim.pool.num_free_blocks == sim.pool.num_blocks
