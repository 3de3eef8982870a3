"""The eviction queue's batch moves (`append_all`, `remove_all`: a request's blocks
freed at once, a matched prefix held at once) leave the queue exactly as the same
blocks appended or removed one at a time: the same eviction order, priorities expiring
at the same moments, the same links and counts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from reprise.blockpool.block import DEFAULT_PRIORITY, BlockId, KVBlock
from reprise.blockpool.free_queue import EvictionQueue

N = 24


def blocks_of(specs: list[tuple[bool, int, float | None]]) -> list[KVBlock]:
    """One block per spec: (cached, priority, retention seconds)."""
    out = []
    for i, (cached, priority, duration) in enumerate(specs):
        block = KVBlock(block_id=BlockId(i))
        if cached:
            block.block_hash = bytes([i]) * 32  # type: ignore[assignment]
            block.set_retention(priority, duration)
        out.append(block)
    return out


def order(queue: EvictionQueue[KVBlock]) -> list[int]:
    return [int(b.block_id) for b in queue]


spec = st.tuples(st.booleans(), st.sampled_from([0, 20, DEFAULT_PRIORITY, 80]),
                 st.sampled_from([None, 0.5, 2.0]))  # fmt: skip
# an operation: ("free", ids) frees held blocks in that order, ("hold", ids) takes queued
# ones out, ("tick", seconds) moves the clock
op = st.one_of(
    st.tuples(st.just("free"), st.lists(st.integers(0, N - 1), max_size=8)),
    st.tuples(st.just("hold"), st.lists(st.integers(0, N - 1), max_size=8)),
    st.tuples(st.just("tick"), st.sampled_from([0.0, 0.3, 1.0, 3.0])),
)


@settings(max_examples=200, deadline=None)
@given(specs=st.lists(spec, min_size=N, max_size=N), ops=st.lists(op, max_size=30))
def test_batch_moves_equal_one_at_a_time(specs, ops) -> None:  # type: ignore[no-untyped-def]
    one, batch = blocks_of(specs), blocks_of(specs)
    q1: EvictionQueue[KVBlock] = EvictionQueue()
    q2: EvictionQueue[KVBlock] = EvictionQueue()
    for b in one:
        b.ref_count = 1
    for b in batch:
        b.ref_count = 1
    now = 0.0
    for kind, arg in ops:
        if kind == "tick":
            now += arg
            q1.refresh(now)
            q2.refresh(now)
            continue
        ids = list(dict.fromkeys(arg))  # each block once
        if kind == "free":
            ids = [i for i in ids if one[i].ref_count == 1]
            for i in ids:
                one[i].ref_count = batch[i].ref_count = 0
                q1.append(one[i], now)
            q2.append_all([batch[i] for i in ids], now)
        else:
            ids = [i for i in ids if one[i].queue_level is not None]
            for i in ids:
                q1.remove(one[i])
                one[i].ref_count = batch[i].ref_count = 1
            q2.remove_all([batch[i] for i in ids])
        q1.check()
        q2.check()
        assert order(q1) == order(q2) and len(q1) == len(q2)
        assert [(b.priority, b.priority_expiry) for b in one] == [
            (b.priority, b.priority_expiry) for b in batch
        ]
    # the rest of the order, expiries included, as the pool would take the blocks
    for later in (now + 1.0, now + 5.0):
        popped = [q1.pop(later), q2.pop(later)]
        assert (popped[0] is None) == (popped[1] is None)
        if popped[0] is not None and popped[1] is not None:
            assert popped[0].block_id == popped[1].block_id
    assert order(q1) == order(q2)
