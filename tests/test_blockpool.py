"""The block pool, scripted: a pool of 11 blocks of 16 tokens, exact block ids,
eviction orders, priorities, collisions, namespaces, the host tier, stats, events."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import pytest

from reprise.blockpool.block import BlockId
from reprise.blockpool.copies import BlockCopy
from reprise.blockpool.events import (
    MEDIUM_DEVICE as GPU,
)
from reprise.blockpool.events import (
    MEDIUM_HOST as CPU,
)
from reprise.blockpool.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventQueue,
)
from reprise.blockpool.hashing import Hasher, Namespace, encode_ids, hash_token_blocks, sha256
from reprise.blockpool.host import HostTier
from reprise.blockpool.pool import BlockPool

BS = 16
NUM_BLOCKS = 11
FP = b"test-model"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class NumpyBlockCopier:
    """Executes the pool's planned copies on a device and a host array, as the model
    runner does on the KV arenas: `complete(pool)` takes the copies planned so far,
    runs them in order, and then lets the pool release their pins."""

    def __init__(self, device: np.ndarray, host: np.ndarray) -> None:
        self.device, self.host = device, host
        self.log: list[tuple[str, int, int]] = []  # (kind, device block, host slot) run so far

    def complete(self, pool: BlockPool) -> int:
        for copy in pool.take_copies():
            self._run(copy)
        return pool.complete_copies()

    def _run(self, copy: BlockCopy) -> None:
        if copy.kind == "offload":
            self.host[copy.dst] = self.device[copy.src]
            self.log.append(("offload", copy.src, copy.dst))
        elif copy.kind == "onboard":
            self.device[copy.dst] = self.host[copy.src]
            self.log.append(("onboard", copy.dst, copy.src))
        else:
            assert copy.kind == "device", copy.kind
            self.device[copy.dst] = self.device[copy.src]
            self.log.append(("device", copy.src, copy.dst))


class Request:
    """A prompt's full blocks and keys, as the engine would compute them."""

    def __init__(
        self,
        tokens: Sequence[int],
        namespace: Namespace | None = None,
        extra_ids: Sequence[int] | None = None,
        hasher: Hasher = sha256,
    ) -> None:
        self.tokens = list(tokens)
        self.namespace = namespace
        self.extra_ids = extra_ids
        self.hashes = hash_token_blocks(
            tokens,
            BS,
            extra_ids=extra_ids,
            namespace=namespace,
            model_fingerprint=FP,
            hasher=hasher,
        )
        self.blocks = [self.tokens[i * BS : (i + 1) * BS] for i in range(len(self.hashes))]
        self.extra_blocks = (
            None
            if extra_ids is None
            else [list(extra_ids[i * BS : (i + 1) * BS]) for i in range(len(self.hashes))]
        )

    def match(self, pool: BlockPool, **kwargs) -> list[BlockId]:
        result = pool.match(
            self.hashes,
            self.blocks,
            extra_ids_per_block=self.extra_blocks,
            namespace=self.namespace,
            **kwargs,
        )
        return result.block_ids

    def register(
        self, pool: BlockPool, block_ids: Sequence[BlockId], start: int = 0, **kwargs
    ) -> list[bool]:
        return [
            pool.register(
                block_ids[i],
                self.hashes[i],
                self.blocks[i],
                block_ids[i - 1] if i else None,
                extra_ids=None if self.extra_blocks is None else self.extra_blocks[i],
                namespace=self.namespace,
                **kwargs,
            )
            for i in range(start, min(len(block_ids), len(self.hashes)))
        ]

    def run(self, pool: BlockPool, **kwargs) -> list[BlockId]:
        """Match, allocate the rest, 'compute' and register the full blocks; the blocks stay held."""
        block_ids = self.match(pool)
        num_cached = len(block_ids)
        new = pool.allocate(-(-len(self.tokens) // BS) - num_cached)
        assert new is not None
        block_ids += new
        copier = getattr(pool, "test_copier", None)  # a host pool's (make_host_pool)
        copier.complete(pool) if copier is not None else pool.complete_copies()
        self.register(pool, block_ids, num_cached, **kwargs)
        return block_ids


def toks(start: int, n: int = BS) -> list[int]:
    return list(range(start, start + n))


def make_pool(num_blocks: int = NUM_BLOCKS, **kwargs) -> tuple[BlockPool, EventQueue, Clock]:
    events, clock = EventQueue(), Clock()
    pool = BlockPool(num_blocks, BS, clock=clock, event_sink=events, **kwargs)
    return pool, events, clock


def refs(pool: BlockPool, block_ids: Sequence[int]) -> list[int]:
    return [pool.blocks[i].ref_count for i in block_ids]


# Allocation, references, eviction order.


def test_fresh_pool_hands_out_blocks_in_id_order_and_none_when_short() -> None:
    pool, _, _ = make_pool()
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(9) is None
    assert pool.num_free_blocks == 8
    assert pool.allocate(8) == [3, 4, 5, 6, 7, 8, 9, 10]
    assert pool.allocate(1) is None and pool.allocate(0) == []
    pool.free([0, 1, 2])
    assert pool.eviction_order() == [2, 1, 0]  # tail first
    pool.check_integrity()
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([3, 3])


def test_match_reuses_registered_blocks_and_bumps_ref_counts() -> None:
    pool, _, _ = make_pool()
    req = Request(toks(0, 3 * BS + 5))
    assert req.run(pool) == [0, 1, 2, 3]
    assert pool.stats().cached_blocks == 3  # the partial fourth block is not registered
    pool.free([0, 1, 2, 3])
    assert pool.eviction_order() == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1, 0]
    assert req.match(pool) == [0, 1, 2]
    assert refs(pool, [0, 1, 2, 3]) == [1, 1, 1, 0]
    assert req.match(pool) == [0, 1, 2]
    assert refs(pool, [0, 1, 2]) == [2, 2, 2]
    assert pool.num_free_blocks == 8
    stats = pool.stats()
    assert (stats.reused_blocks, stats.missed_blocks, stats.alloc_new_blocks) == (6, 3, 4)
    assert stats.alloc_total_blocks == 10 and stats.hit_rate == 6 / 9
    pool.check_integrity()


def test_match_stops_at_the_first_miss_and_when_stored_tokens_differ() -> None:
    pool, _, _ = make_pool()
    req = Request(toks(0, 3 * BS))
    pool.free(req.run(pool))
    other = Request([*toks(0, BS), *toks(500, 2 * BS)])
    assert other.match(pool) == [0]
    # The right digests with other tokens: a miss, never a hit on the digest alone.
    assert pool.match(req.hashes, [toks(1000)] * 3).block_ids == []
    assert pool.match(req.hashes[1:], req.blocks[1:]).block_ids == []  # no parent: no hit
    pool.check_integrity()


def test_ids_as_bytes_find_the_chain_by_content_and_match_as_tuples_do() -> None:
    """The engine's way (ids as keys encode them): `chain_of_ids` gives the keys hashing
    gives for the cached prefix, a match confirms by the content map the hits tuples
    of ids confirm (the same misses: other tokens under the right digests, another
    namespace, no parent), and the disk-less tail of a chain is simply not found."""
    pool, _, _ = make_pool()
    req = Request(toks(0, 3 * BS))
    pool.free(req.run(pool))
    given = encode_ids(req.tokens)
    assert pool.chain_of_ids(given) == req.hashes
    assert pool.chain_of_ids(given[: 2 * 8 * BS]) == req.hashes[:2]
    assert pool.chain_of_ids(given, Namespace("salt")) == []
    other = Request([*toks(0, BS), *toks(500, 2 * BS)])
    assert pool.chain_of_ids(encode_ids(other.tokens)) == req.hashes[:1] == other.hashes[:1]
    assert pool.match(other.hashes, encode_ids(other.tokens)).block_ids == [0]
    assert pool.match(req.hashes, encode_ids(toks(1000, 3 * BS))).block_ids == []
    assert pool.match(req.hashes[1:], given[8 * BS :]).block_ids == []  # no parent: no hit
    assert pool.match(req.hashes, given, namespace=Namespace("salt")).block_ids == []
    assert pool.match(req.hashes, given).block_ids == [0, 1, 2]
    # keys may stop short of the ids: past them, the entries' own (those hashing gives)
    for num_keys in (0, 1):
        got = pool.match(req.hashes[:num_keys], given)
        assert got.block_ids == [0, 1, 2] and got.block_hashes == req.hashes
    assert pool.match([], encode_ids(other.tokens)).block_hashes == req.hashes[:1]
    assert pool.match(other.hashes[:2], given).block_ids == [0]  # a given key must agree
    with pytest.raises(ValueError, match="3 hashes but 256 bytes of ids"):
        pool.match(req.hashes, given[:256])
    with pytest.raises(ValueError, match="no extra ids"):
        pool.match(req.hashes, given, extra_ids_per_block=[[1] * BS] * 3)
    pool.free([0] * 6 + [1, 1, 1, 2, 2, 2])  # the matches that hit
    pool.check_integrity()
    # forgotten entries leave the content map: nothing found, nothing stale
    pool.clear()
    assert pool.chain_of_ids(given) == [] and pool.match(req.hashes, given).block_ids == []
    pool.check_integrity()


def test_blocks_with_extra_ids_are_never_found_by_content() -> None:
    pool, _, _ = make_pool()
    tokens = toks(0, 2 * BS)
    with_extra = Request(tokens, extra_ids=[1] * (2 * BS))
    pool.free(with_extra.run(pool))
    assert pool.chain_of_ids(encode_ids(tokens)) == []
    assert pool.match(Request(tokens).hashes, encode_ids(tokens)).block_ids == []
    assert with_extra.match(pool) == [0, 1]  # found as before, by its ids and extra ids
    pool.check_integrity()


def test_a_hit_is_confirmed_by_id_values_whatever_their_integer_type() -> None:
    """match confirms stored keys against the ids as given (lists, tuples, NumPy arrays
    of any integer dtype), as the keys BlockKey.of would make of them: every equal id
    sequence hits, and one id, extra id or namespace off by anything ends the prefix."""
    rng = np.random.default_rng()
    tokens = rng.integers(0, 50_000, size=3 * BS).tolist()
    extra = [0] * BS + rng.integers(1, 9, size=2 * BS).tolist()
    salt = f"s{rng.integers(1 << 30)}"
    req = Request(tokens, Namespace(cache_salt=salt), extra_ids=extra)
    pool, _, _ = make_pool()
    pool.free(req.run(pool))
    assert req.extra_blocks is not None
    same_namespace = Namespace(cache_salt=salt)  # equal, not the same object
    for convert in (tuple, np.asarray, lambda ids: np.asarray(ids, np.uint32)):
        found = pool.match(
            req.hashes,
            [convert(block) for block in req.blocks],
            extra_ids_per_block=[convert(block) for block in req.extra_blocks],
            namespace=same_namespace,
        ).block_ids
        assert found == [0, 1, 2]
        pool.free(found)
    for block in range(3):
        pos = int(rng.integers(BS))
        for field in ("tokens", "extra"):
            blocks = [list(b) for b in req.blocks]
            extra_blocks = [list(b) for b in req.extra_blocks]
            changed = blocks if field == "tokens" else extra_blocks
            changed[block][pos] += int(rng.integers(1, 5))
            found = pool.match(
                req.hashes, blocks, extra_ids_per_block=extra_blocks, namespace=same_namespace
            ).block_ids
            assert found == list(range(block)), (block, field)
            pool.free(found)
    other = pool.match(req.hashes, req.blocks, extra_ids_per_block=req.extra_blocks).block_ids
    assert other == []  # the default namespace: the first block's stored one differs
    pool.check_integrity()


def test_eviction_order_is_blank_then_priority_then_lru_tail_first() -> None:
    pool, events, _ = make_pool()
    a, b, c = Request(toks(0, 2 * BS)), Request(toks(100, 2 * BS)), Request(toks(200, 2 * BS))
    assert a.run(pool) == [0, 1]
    assert b.run(pool, priority=80) == [2, 3]
    assert c.run(pool, priority=10) == [4, 5]
    for block_ids in ([0, 1], [2, 3], [4, 5]):
        pool.free(block_ids)
    assert pool.eviction_order() == [6, 7, 8, 9, 10, 5, 4, 1, 0, 3, 2]
    events.take()
    assert pool.allocate(6) == [6, 7, 8, 9, 10, 5]
    assert events.take() == [BlockRemoved([c.hashes[1]], GPU)]
    assert c.match(pool) == [4]  # the head survives its evicted tail
    assert pool.stats().evictions == 1
    pool.check_integrity()


def test_lru_within_a_priority_and_touch() -> None:
    pool, _, _ = make_pool()
    a, b = Request(toks(0, 2 * BS)), Request(toks(100, 2 * BS))
    pool.free(a.run(pool))
    pool.free(b.run(pool))
    assert pool.eviction_order()[-4:] == [1, 0, 3, 2]
    pool.free(a.match(pool))  # used again: now the most recent
    assert pool.eviction_order()[-4:] == [3, 2, 1, 0]
    pool.touch([3])
    assert refs(pool, [3]) == [1] and 3 not in pool.eviction_order()
    pool.free([3])
    assert pool.eviction_order()[-4:] == [2, 1, 0, 3]
    pool.check_integrity()


def test_priority_falls_back_to_default_after_its_duration() -> None:
    pool, _, clock = make_pool()
    a, b, c = Request(toks(0, 2 * BS)), Request(toks(100, 2 * BS)), Request(toks(200, 2 * BS))
    pool.free(a.run(pool, priority=80, priority_duration_s=10))  # countdown runs from t=0
    clock.now = 1
    pool.free(b.run(pool))
    clock.now = 9.5
    assert pool.eviction_order()[-4:] == [3, 2, 1, 0]  # A still at 80
    assert pool.blocks[0].priority == 80
    clock.now = 12
    pool.free(c.run(pool))  # A expired at t=10: ranks as if freed then, behind B, ahead of C
    assert pool.eviction_order()[-6:] == [3, 2, 1, 0, 5, 4]
    assert [pool.blocks[i].priority for i in (0, 1)] == [35, 35]
    pool.check_integrity()


def test_priority_countdown_runs_only_while_free() -> None:
    pool, _, clock = make_pool()
    a, d, e = Request(toks(0, BS)), Request(toks(100, BS)), Request(toks(200, BS))
    held = a.run(pool, priority=80, priority_duration_s=10)
    clock.now = 100
    pool.free(held)  # countdown starts now, not at registration
    clock.now = 101
    pool.free(d.run(pool))
    clock.now = 105
    assert pool.eviction_order()[-2:] == [1, 0]  # D (default) before A (80)
    clock.now = 111
    pool.free(e.run(pool))
    assert pool.eviction_order()[-3:] == [1, 0, 2]
    pool.check_integrity()


def test_a_parent_evicted_before_its_child_takes_the_child_with_it() -> None:
    pool, events, _ = make_pool()
    req = Request(toks(0, 2 * BS))
    block_ids = req.run(pool)
    pool.free(block_ids)
    # Later requests rank the child above its parent: an inversion.
    pool.free(req.match(pool, priority=90))
    pool.free(pool.match(req.hashes[:1], req.blocks[:1], priority=10).block_ids)
    assert pool.eviction_order() == [2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1]
    events.take()
    assert pool.allocate(10) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 0]
    # The child is never left findable without its parent: forgotten, and blank.
    assert events.take() == [BlockRemoved([req.hashes[0]], GPU), BlockRemoved([req.hashes[1]], GPU)]
    assert pool.eviction_order() == [1] and pool.blocks[1].block_hash is None
    assert req.match(pool) == [] and pool.stats().cached_blocks == 0
    pool.check_integrity()


# Registration: duplicates and collisions.


def test_a_duplicate_registration_keeps_the_first_block_and_leaks_nothing() -> None:
    pool, events, _ = make_pool()
    req = Request(toks(0, 2 * BS))
    first, second = pool.allocate(2), pool.allocate(2)
    assert (first, second) == ([0, 1], [2, 3])
    assert req.register(pool, first) == [True, True]
    events.take()
    assert req.register(pool, second) == [True, True]  # duplicates: chainable, not findable
    assert events.take() == []
    # The second request goes on generating: its next block chains onto its own duplicates.
    longer = Request(toks(0, 3 * BS))
    [new] = pool.allocate(1) or []
    assert new == 4
    assert longer.register(pool, [2, 3, new], start=2) == [True]
    assert longer.match(pool) == [0, 1, 4]
    pool.free([0, 1, 4])
    pool.free([0, 1])
    pool.free([2, 3, 4])  # duplicates turn blank and are taken first
    assert pool.eviction_order() == [5, 6, 7, 8, 9, 10, 3, 2, 1, 0, 4]
    assert pool.blocks[2].block_hash is None and pool.stats().cached_blocks == 3
    pool.check_integrity()


def test_forced_collision_everything_on_one_digest_never_serves_other_kv() -> None:
    def same(_: bytes) -> bytes:
        return b"\x00" * 32

    pool, _, _ = make_pool()
    first = Request(toks(0, BS), hasher=same)
    second = Request(toks(100, BS), hasher=same)
    assert first.hashes == second.hashes
    assert first.run(pool) == [0]
    assert second.match(pool) == []  # same digest, other tokens: a miss
    [block_id] = pool.allocate(1) or []
    assert second.register(pool, [block_id]) == [False]  # the digest stays with the first
    assert first.match(pool) == [0] and second.match(pool) == []
    pool.check_integrity()


def test_a_collision_across_namespaces_is_a_miss() -> None:
    def same(_: bytes) -> bytes:
        return b"\x00" * 32

    pool, _, _ = make_pool()
    salted = Request(toks(0, BS), Namespace("a"), hasher=same)
    other = Request(toks(0, BS), Namespace("b"), hasher=same)
    assert salted.run(pool) == [0]
    assert other.match(pool) == []  # same digest and tokens, another namespace
    assert other.run(pool) == [1]
    assert other.match(pool) == [] and pool.blocks[1].block_hash is None  # refused
    assert salted.match(pool) == [0]


def test_a_colliding_parent_never_lends_its_children() -> None:
    x, y, child = toks(0), toks(100), toks(200)
    real = Request([*x, *child])
    fake_encoding = hash_token_blocks(y, BS, model_fingerprint=FP, hasher=lambda d: d)[0]

    def collide(data: bytes) -> bytes:
        # Block y hashes like block x; everything chained below inherits the collision.
        if data == fake_encoding:
            return real.hashes[0]
        return hashlib.sha256(data).digest()

    fake = Request([*y, *child], hasher=collide)
    assert fake.hashes == real.hashes  # both blocks collide, the second through its parent
    pool, _, _ = make_pool()
    assert real.run(pool) == [0, 1]
    assert fake.match(pool) == []
    block_ids = pool.allocate(2)
    assert block_ids == [2, 3]
    # Its first block collides (refused); its second, with equal tokens and
    # parent digest, is refused too: its parent's bytes are not the findable ones.
    assert fake.register(pool, block_ids) == [False, False]
    assert real.match(pool) == [0, 1] and fake.match(pool) == []
    pool.check_integrity()


def test_a_duplicate_outliving_its_entry_cannot_chain_onto_a_collision() -> None:
    x, y = toks(0), toks(100)
    fake_encoding = hash_token_blocks(y, BS, model_fingerprint=FP, hasher=lambda d: d)[0]
    real = Request(x)

    def collide(data: bytes) -> bytes:
        return real.hashes[0] if data == fake_encoding else hashlib.sha256(data).digest()

    pool, _, _ = make_pool(num_blocks=4)
    assert real.run(pool) == [0]
    [dup] = pool.allocate(1) or []
    assert real.register(pool, [dup]) == [True]  # a duplicate of block 0, held
    pool.free([0])
    assert pool.allocate(3) == [2, 3, 0]  # block 0 evicted: its entry is gone
    fake = Request(y, hasher=collide)
    pool.free([2, 3])
    assert fake.run(pool) == [3]  # now the digest names y's bytes
    longer = Request([*x, *toks(300)])
    assert pool.allocate(1) == [2]
    # The duplicate holds x's bytes, not those now under the digest: no chaining.
    assert longer.register(pool, [dup, 2], start=1) == [False]
    assert longer.match(pool) == [] and pool.stats().cached_blocks == 1
    pool.check_integrity()


# Namespaces and extra ids.


def test_the_same_prompt_under_two_salts_never_shares_a_block() -> None:
    pool, _, _ = make_pool()
    tokens = toks(0, 2 * BS)
    a = Request(tokens, Namespace("tenant-a"))
    b = Request(tokens, Namespace("tenant-b"))
    plain = Request(tokens)
    assert a.run(pool) == [0, 1]
    assert b.match(pool) == [] and plain.match(pool) == []
    assert b.run(pool) == [2, 3]
    assert a.match(pool) == [0, 1] and b.match(pool) == [2, 3]
    # None and Namespace() are the same namespace.
    assert plain.run(pool) == [4, 5]
    assert Request(tokens, Namespace()).match(pool) == [4, 5]
    pool.check_integrity()


@pytest.mark.parametrize(
    ("ns_a", "ns_b"),
    [
        (Namespace("a", "bc"), Namespace("ab", "c")),
        (Namespace("a"), Namespace(b"a")),
        (Namespace(""), Namespace(None)),
        (Namespace(None, ""), Namespace(None)),
        (Namespace("x"), Namespace(None, "x")),
    ],
)
def test_adversarial_namespaces_never_alias_in_the_pool(ns_a: Namespace, ns_b: Namespace) -> None:
    pool, _, _ = make_pool()
    a, b = Request(toks(0, BS), ns_a), Request(toks(0, BS), ns_b)
    assert a.run(pool) == [0]
    assert b.match(pool) == []
    assert b.run(pool) == [1]


def test_extra_ids_separate_otherwise_equal_tokens() -> None:
    pool, _, _ = make_pool()
    tokens = toks(0, 2 * BS)
    a = Request(tokens, extra_ids=[0] * (2 * BS))
    b = Request(tokens, extra_ids=[0] * BS + [7] * BS)
    none = Request(tokens)
    assert a.run(pool) == [0, 1]
    assert b.match(pool) == [0]  # first block equal, second differs in its extra ids
    assert none.match(pool) == []
    pool.free([0])
    assert pool.find_partial(a.hashes[0], tokens[BS:], extra_ids=[0] * 3 + [7] * 13) == (1, 3)
    pool.check_integrity()


# Partial reuse.


def test_find_partial_returns_the_longest_shared_prefix_and_holds_the_block() -> None:
    pool, _, _ = make_pool()
    a = Request(toks(0, 2 * BS))
    b = Request([*toks(0, BS), *toks(BS, 5), *toks(900, BS - 5)])
    pool.free(a.run(pool))
    assert pool.find_partial(a.hashes[0], b.tokens[BS:]) == (1, 5)
    assert refs(pool, [1]) == [1]  # held until its tokens are copied
    pool.free([1])
    assert pool.find_partial(a.hashes[0], toks(BS, 9)) == (1, 9)  # fewer than a block
    pool.free([1])
    assert pool.find_partial(None, [*toks(0, 10), 77]) == (0, 10)  # the root's children
    pool.free([0])
    assert pool.find_partial(None, toks(0, 4), namespace=Namespace("other")) is None
    assert pool.find_partial(a.hashes[0], toks(500, 4)) is None
    assert pool.find_partial(a.hashes[1], toks(0, 4)) is None  # no children
    assert pool.stats().partial_hits == 3
    pool.check_integrity()


def test_find_partial_prefers_the_longest_then_the_oldest() -> None:
    pool, _, _ = make_pool()
    head = toks(0)
    for tail in ([1] * 4 + [2] * 12, [1] * 6 + [3] * 10, [1] * 6 + [4] * 10):
        pool.free(Request([*head, *tail]).run(pool))
    assert pool.find_partial(Request(head).hashes[0], [1] * 6 + [9]) == (2, 6)


# Host tier.


def _kv(num_blocks: int, seed: int) -> np.ndarray:
    # [num_blocks, block_size, 8] bytes standing in for a block's K and V of every layer.
    return np.random.default_rng(seed).integers(0, 256, (num_blocks, BS, 8), dtype=np.uint8)


def make_host_pool(num_host: int, **kwargs):
    device, host = _kv(NUM_BLOCKS, 1), np.zeros((num_host, BS, 8), np.uint8)
    copier = NumpyBlockCopier(device, host)
    pool, events, clock = make_pool(host_tier=HostTier(num_host), **kwargs)
    pool.test_copier = copier  # Request.run executes the planned copies through it
    return pool, events, clock, copier


def test_eviction_offloads_qualifying_blocks_only() -> None:
    pool, events, _, copier = make_host_pool(4)
    keep, drop = Request(toks(0, 2 * BS)), Request(toks(100, 2 * BS))
    assert keep.run(pool) == [0, 1] and drop.run(pool, priority=10) == [2, 3]
    original = copier.device[[0, 1]].copy()
    pool.free([0, 1])
    pool.free([2, 3])
    assert pool.eviction_order()[-4:] == [3, 2, 1, 0]
    events.take()
    assert pool.allocate(11) is not None
    assert copier.complete(pool) == 2
    assert copier.log == [("offload", 1, 0), ("offload", 0, 1)]  # tail first
    assert events.take() == [
        BlockRemoved([drop.hashes[1]], GPU),
        BlockRemoved([drop.hashes[0]], GPU),
        BlockStored([keep.hashes[1]], keep.hashes[0], keep.blocks[1], BS, None, CPU),
        BlockRemoved([keep.hashes[1]], GPU),
        BlockStored([keep.hashes[0]], None, keep.blocks[0], BS, None, CPU),
        BlockRemoved([keep.hashes[0]], GPU),
    ]
    assert np.array_equal(copier.host[[1, 0]], original)
    stats = pool.stats()
    assert (stats.evictions, stats.host_offloads, stats.host_cached_blocks) == (4, 2, 2)
    pool.check_integrity()


def test_host_round_trip_is_byte_exact() -> None:
    pool, events, _, copier = make_host_pool(4)
    req = Request(toks(0, 2 * BS + 3))
    assert req.run(pool) == [0, 1, 2]
    original = copier.device[[0, 1]].copy()
    pool.free([0, 1, 2])
    held = pool.allocate(11)  # evicts and offloads blocks 1 and 0
    assert held is not None and copier.complete(pool) == 2
    copier.device[:] = 0xAB  # the device blocks are overwritten by their new owners
    pool.free(held[:8])  # frees 3..10 (blank)
    events.take()
    result = pool.match(req.hashes, req.blocks)
    assert result.block_ids == [10, 9] and result.num_host_hits == 2
    assert pool.num_pending_copies == 2
    assert copier.complete(pool) == 2
    assert np.array_equal(copier.device[[10, 9]], original)  # byte for byte
    assert events.take() == [
        BlockStored([req.hashes[0]], None, req.blocks[0], BS, None, GPU),
        BlockRemoved([req.hashes[0]], CPU),
        BlockStored([req.hashes[1]], req.hashes[0], req.blocks[1], BS, None, GPU),
        BlockRemoved([req.hashes[1]], CPU),
    ]
    stats = pool.stats()
    assert (stats.host_hits, stats.host_onboards, stats.host_cached_blocks) == (2, 2, 0)
    # Onboarded blocks are ordinary device hits from now on.
    assert req.match(pool) == [10, 9]
    pool.check_integrity()


def test_find_partial_onboards_a_child_from_the_host_tier() -> None:
    pool, _, _, copier = make_host_pool(4)
    req = Request(toks(0, 2 * BS))
    assert req.run(pool) == [0, 1]
    original = copier.device[1].copy()
    pool.free([0, 1])
    held = pool.allocate(NUM_BLOCKS)  # evicts and offloads both
    assert held is not None and copier.complete(pool) == 2
    copier.device[:] = 0xAB
    pool.free(held[:4])  # blank blocks 2..5 come free
    parent = pool.match(req.hashes[:1], req.blocks[:1]).block_ids  # the first block, onboarded
    assert len(parent) == 1 and copier.complete(pool) == 1
    found = pool.find_partial(req.hashes[0], [*toks(BS, 7), 999])
    assert found is not None and found[1] == 7
    source = found[0]
    assert source not in parent and pool.is_arriving(source) and pool.num_pending_copies == 1
    assert copier.complete(pool) == 1 and not pool.is_arriving(source)
    assert np.array_equal(copier.device[source], original)  # byte for byte
    stats = pool.stats()
    assert (stats.partial_hits, stats.host_hits, stats.host_onboards) == (1, 2, 2)
    pool.check_integrity()
    pool.free([source, *parent])
    pool.check_integrity()


def test_a_host_hit_without_a_free_device_block_ends_the_match() -> None:
    pool, _, _, copier = make_host_pool(4)
    req = Request(toks(0, 2 * BS))
    pool.free(req.run(pool))
    held = pool.allocate(11)  # both blocks offloaded; every device block held
    assert held is not None and copier.complete(pool) == 2
    assert req.match(pool) == [] and pool.stats().host_cached_blocks == 2
    pool.free(held[-1:])  # one device block frees up: room for the first hit only
    result = pool.match(req.hashes, req.blocks)
    assert result.block_ids == [held[-1]] and result.num_host_hits == 1
    assert pool.stats().host_cached_blocks == 1  # the second stays on the host, unpinned
    assert copier.complete(pool) == 1
    pool.check_integrity()


def test_a_long_host_match_hands_its_copies_out_every_copy_batch_hits() -> None:
    """Inside a match, copies_ready is called every copy_batch host hits; the copies
    taken then are those planned so far, in order (each evicted block's offload before
    the onboard into it), so the engine can start them while the match goes on. They
    stay pinned until complete_copies, and the bytes land as if run at the step."""
    taken: list[list[tuple[str, int, int]]] = []

    def copies_ready() -> None:
        copies = pool.take_copies()
        for copy in copies:
            copier._run(copy)
        taken.append(copier.log[len(copier.log) - len(copies) :])

    pool, _, _, copier = make_host_pool(16, copies_ready=copies_ready, copy_batch=2)
    req = Request(toks(0, 5 * BS))
    pool.free(req.run(pool))
    held = pool.allocate(NUM_BLOCKS)  # evicts and offloads all five
    assert held is not None and copier.complete(pool) == 5
    original = copier.host[[4, 3, 2, 1, 0]].copy()  # offloaded tail first
    copier.device[:] = 0xAB
    pool.free(held)
    other = Request(toks(1000, NUM_BLOCKS * BS))
    pool.free(other.run(pool))  # every device block now cached: each host hit evicts one
    result = pool.match(req.hashes, req.blocks)
    assert result.num_host_hits == 5 and len(taken) == 2  # after the 2nd and the 4th hit
    for batch in taken:
        assert [kind for kind, _, _ in batch] == ["offload", "onboard"] * 2
        offloaded, onboarded = batch[0::2], batch[1::2]
        assert [b for _, b, _ in offloaded] == [b for _, b, _ in onboarded]  # into the victim
    assert [b for batch in taken for _, b, _ in batch[1::2]] == result.block_ids[:4]
    assert pool.num_pending_copies == 8 + 2  # taken early, still pinned; the 5th's two left
    assert copier.complete(pool) == 10
    assert np.array_equal(copier.device[result.block_ids], original)
    pool.check_integrity()


def test_evicting_a_child_whose_parent_holds_the_last_host_slot_drops_both() -> None:
    pool, events, _, copier = make_host_pool(1)
    req = Request(toks(0, 2 * BS))
    assert req.run(pool) == [0, 1]
    pool.free([0])
    assert pool.allocate(10) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 0]  # the parent goes to the host
    assert copier.complete(pool) == 1
    pool.free([1])
    events.take()
    # The child needs the only slot, whose victim is its own parent: both are dropped.
    assert pool.allocate(1) == [1]
    assert events.take() == [BlockRemoved([req.hashes[0]], CPU), BlockRemoved([req.hashes[1]], GPU)]
    assert copier.log == [("offload", 0, 0)]
    stats = pool.stats()
    assert (stats.host_cached_blocks, stats.host_evictions, stats.host_offloads) == (0, 1, 1)
    pool.check_integrity()


def test_host_tier_evicts_by_the_same_policy() -> None:
    pool, events, _, copier = make_host_pool(2)
    low, high = Request(toks(0, 2 * BS)), Request(toks(100, 2 * BS))
    assert low.run(pool) == [0, 1] and high.run(pool, priority=50) == [2, 3]
    pool.free([0, 1])
    assert pool.allocate(8) == [4, 5, 6, 7, 8, 9, 10, 1]  # low's tail offloaded
    copier.complete(pool)
    pool.free([2, 3])
    assert pool.allocate(1) == [0]  # low's head offloaded: the host is full of low's blocks
    copier.complete(pool)
    events.take()
    assert pool.allocate(2) == [3, 2]  # high's blocks need room: low's host blocks go, tail first
    assert [e for e in events.take() if isinstance(e, BlockRemoved) and e.medium == CPU] == [
        BlockRemoved([low.hashes[1]], CPU),
        BlockRemoved([low.hashes[0]], CPU),
    ]
    assert copier.complete(pool) == 2
    assert copier.log[-2:] == [("offload", 3, 0), ("offload", 2, 1)]
    assert low.match(pool) == [] and pool.stats().host_evictions == 2
    pool.check_integrity()


def test_pinned_host_slots_are_never_evicted() -> None:
    pool, _, _, copier = make_host_pool(2)
    a, b = Request(toks(0, 2 * BS)), Request(toks(100, 2 * BS))
    assert a.run(pool) == [0, 1] and b.run(pool) == [2, 3]
    pool.free([0, 1])
    taken = pool.allocate(9)  # 7 blank, then A's blocks: offloads issued, not done
    assert taken == [4, 5, 6, 7, 8, 9, 10, 1, 0]
    assert pool.num_pending_copies == 2 and refs(pool, [1, 0]) == [2, 2]
    pool.free(taken)
    assert pool.num_free_blocks == 7  # blocks 0 and 1 stay pinned while read
    pool.free([2, 3])
    pool.allocate(9)  # B's blocks: every host slot is pinned, so B is dropped
    assert b.match(pool) == [] and pool.stats().host_offloads == 2
    assert copier.complete(pool) == 2
    assert copier.log == [("offload", 1, 0), ("offload", 0, 1)]
    assert pool.num_pending_copies == 0 and pool.num_free_blocks == 2
    assert a.match(pool) == [1, 0]  # A survived on the host; onboarded into 1 and 0
    pool.check_integrity()


def test_copies_complete_before_anyone_writes() -> None:
    pool, _, _, copier = make_host_pool(2)
    req = Request(toks(0, BS))
    assert req.run(pool) == [0]
    original = copier.device[0].copy()
    pool.free([0])
    block_ids = pool.allocate(11)
    assert block_ids is not None and block_ids[-1] == 0
    assert copier.complete(pool) == 1  # the owner's forward waits for this
    copier.device[0] = 0  # ... and only then writes the block
    pool.free(block_ids)
    assert pool.match([req.hashes[0]], req.blocks).block_ids == [0]
    copier.complete(pool)
    assert np.array_equal(copier.device[0], original)
    pool.check_integrity()


def test_a_chain_split_across_tiers_matches_in_order() -> None:
    pool, _, _, copier = make_host_pool(4)
    req = Request(toks(0, 2 * BS))
    assert req.run(pool) == [0, 1]
    pool.free([0])  # the head first: it is evicted (offloaded) while the tail is held
    assert pool.allocate(10) is not None
    assert pool.stats().host_cached_blocks == 1
    pool.free([1])
    pool.free(list(range(2, 11)))
    result = pool.match(req.hashes, req.blocks)
    assert result.block_ids == [10, 1] and result.num_host_hits == 1
    copier.complete(pool)
    pool.check_integrity()


def test_host_tier_sizes_in_blocks_or_bytes() -> None:
    assert HostTier.from_num_bytes(10_000, 1024).num_blocks == 9
    with pytest.raises(ValueError, match="a host tier of 1000 bytes holds no block of 1024 bytes"):
        HostTier.from_num_bytes(1000, 1024)
    with pytest.raises(ValueError, match="num_blocks must be >= 1; got 0"):
        HostTier(0)


# Clear, validation, reuse off.


def test_clear_forgets_everything_and_keeps_held_blocks() -> None:
    pool, events, _, copier = make_host_pool(2)
    a, b = Request(toks(0, 2 * BS)), Request(toks(100, BS))
    held = a.run(pool)
    pool.free(b.run(pool))
    taken = pool.allocate(9)  # 8 blank, then b's block, offloaded
    assert taken is not None and taken[-1] == 2
    copier.complete(pool)
    pool.free(taken)
    assert pool.stats().host_cached_blocks == 1
    events.take()
    pool.clear()
    assert events.take() == [AllBlocksCleared()]
    assert a.match(pool) == [] and b.match(pool) == []
    assert refs(pool, held) == [1, 1] and pool.blocks[0].block_hash is None
    assert pool.stats().cached_blocks == 0 and pool.stats().host_cached_blocks == 0
    pool.check_integrity()
    pool.free(held)
    pool.check_integrity()


@pytest.mark.parametrize("priority", [-1, 101, 3.5, True, "35"])
def test_priorities_outside_0_to_100_are_value_errors(priority) -> None:
    pool, _, _ = make_pool()
    req = Request(toks(0, BS))
    [block_id] = pool.allocate(1) or []
    with pytest.raises(ValueError, match=f"got {priority!r}"):
        pool.register(block_id, req.hashes[0], req.blocks[0], None, priority=priority)
    with pytest.raises(ValueError, match=f"got {priority!r}"):
        pool.match(req.hashes, req.blocks, priority=priority)
    with pytest.raises(ValueError, match="priority"):
        BlockPool(4, BS, offload_min_priority=priority)


@pytest.mark.parametrize("duration", [0, -1.0, float("inf"), float("nan")])
def test_bad_durations_are_value_errors(duration: float) -> None:
    pool, _, _ = make_pool()
    req = Request(toks(0, BS))
    [block_id] = pool.allocate(1) or []
    with pytest.raises(ValueError, match="priority_duration_s must be > 0 and finite; got"):
        pool.register(
            block_id, req.hashes[0], req.blocks[0], None, priority=50, priority_duration_s=duration
        )


def test_bad_shapes_are_value_errors() -> None:
    pool, _, _ = make_pool()
    req = Request(toks(0, BS))
    [block_id] = pool.allocate(1) or []
    with pytest.raises(ValueError, match="only full blocks are registered; got 15 tokens"):
        pool.register(block_id, req.hashes[0], req.blocks[0][:-1], None)
    with pytest.raises(ValueError, match="1 hashes but 2 token blocks"):
        pool.match(req.hashes, [req.blocks[0]] * 2)
    with pytest.raises(ValueError, match="block_size must be a power of two; got 12"):
        BlockPool(4, 12)
    with pytest.raises(ValueError, match="num_blocks must be >= 1; got 0"):
        BlockPool(0, 16)


def test_with_reuse_off_nothing_is_found() -> None:
    pool, events, _ = make_pool(enable_reuse=False)
    req = Request(toks(0, 2 * BS))
    block_ids = pool.allocate(2)
    assert block_ids == [0, 1]
    assert req.register(pool, block_ids) == [False, False]
    pool.free(block_ids)
    assert req.match(pool) == [] and pool.find_partial(None, toks(0, 4)) is None
    assert events.take() == [] and pool.stats().missed_blocks == 2


# Stats and events over one scenario.


def test_stats_and_events_agree_with_what_happened() -> None:
    pool, events, _, _ = make_host_pool(2)
    a = Request(toks(0, 2 * BS), Namespace("s", "lora-1"))
    assert a.run(pool) == [0, 1]
    assert events.take() == [  # salted: hashes only, no token ids (DESIGN §7)
        BlockStored([a.hashes[0]], None, [], BS, None, GPU, "lora-1"),
        BlockStored([a.hashes[1]], a.hashes[0], [], BS, None, GPU, "lora-1"),
    ]
    pool.free([0, 1])
    assert a.match(pool) == [0, 1]
    pool.free([0, 1])
    assert pool.allocate(10) is not None  # 9 blank + block 1 offloaded
    events.take()
    assert pool.stats().as_dict() == {
        "max_blocks": 11,
        "free_blocks": 1,
        "used_blocks": 10,
        "tokens_per_block": 16,
        "cached_blocks": 1,
        "host_max_blocks": 2,
        "host_cached_blocks": 1,
        "alloc_total_blocks": 14,
        "alloc_new_blocks": 12,
        "reused_blocks": 2,
        "missed_blocks": 2,
        "hit_rate": 0.5,
        "evictions": 1,
        "host_offloads": 1,
        "host_onboards": 0,
        "host_hits": 0,
        "host_evictions": 0,
        "partial_hits": 0,
        "disk_hits": 0,
        **dict.fromkeys(
            ("disk_enabled", "disk_blocks", "disk_bytes", "disk_writes", "disk_writes_dropped"),
            0,
        ),
        "disk_evictions": 0,
        "disk_corrupt_removed": 0,
        "disk_stale_bytes": 0,
        "disk_stale_removed": 0,
    }
