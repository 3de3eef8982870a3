"""Random interleavings of requests against a tiny pool with a host tier and a disk tier.

A state machine plays the engine: requests start (match, partial reuse,
allocate, write, register), generate more tokens, finish; other work puts
the pool under pressure; the clock moves; the cache is cleared. The "KV" of
each token is a digest of its namespace and whole prefix, written by the
test into numpy arrays; the pool's planned copies (offloads, onboards, the
partial-reuse copy) run in plan order when the engine would run them. After every step: `check_integrity()`, reference counts equal what
the requests hold plus copy pins, and every cached block (either tier)
holds byte-exactly the KV of its prefix; every matched block is checked the
same way when it is served. In half the runs the hash function has only 8
values, so digests collide on almost every step: the pool must still never
serve a block that is not the request's own prefix. In half the runs a disk
tier holds what the pool writes to it (its writes land before the next rule),
disk hits are read into host slots (or fresh memory when none is free), and the
pool may be restarted over it.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_blockpool import NumpyBlockCopier

from reprise.blockpool.block import BlockId
from reprise.blockpool.disk import DiskTier
from reprise.blockpool.disk_config import DiskTierConfig
from reprise.blockpool.hashing import (
    BlockHash,
    Namespace,
    encode_ids,
    hash_block,
    hash_token_blocks,
    sha256,
)
from reprise.blockpool.host import HostTier
from reprise.blockpool.pool import BlockPool

BS = 4
ROW = 8  # bytes of "KV" per token
FP = b"prop-model"
NAMESPACES = [None, Namespace("a"), Namespace(None, "lora")]
PRIORITIES = [10, 35, 80]

# Prompts are a cut of one of three documents plus a short random tail, over a
# three-token alphabet, so that prefixes (and digests, under the weak hasher) repeat.
DOCUMENTS = [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [2] * 12]
tokens_st = st.builds(
    lambda doc, cut, tail: (DOCUMENTS[doc][:cut] + tail) or [0],
    st.integers(0, len(DOCUMENTS) - 1),
    st.sampled_from([0, 3, 4, 5, 8, 9, 12]),
    st.lists(st.integers(0, 2), max_size=5),
)


def weak_hasher(data: bytes) -> bytes:
    return bytes([hashlib.sha256(data).digest()[0] % 8]) * 32


def kv_row(namespace: Namespace | None, prefix: list[int]) -> np.ndarray:
    """The KV the 'model' computes for the last token of `prefix`."""
    digest = hashlib.sha256(repr((namespace or Namespace(), prefix)).encode()).digest()
    return np.frombuffer(digest[:ROW], np.uint8)


def kv_block(namespace: Namespace | None, tokens: list[int], block_idx: int) -> np.ndarray:
    start = block_idx * BS
    return np.stack([kv_row(namespace, tokens[: i + 1]) for i in range(start, start + BS)])


@dataclass
class Req:
    tokens: list[int]
    namespace: Namespace | None
    priority: int
    block_ids: list[BlockId] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)  # of its full blocks so far

    @property
    def num_full_blocks(self) -> int:
        return len(self.tokens) // BS


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.requests: dict[int, Req] = {}
        self.history: list[tuple[list[int], Namespace | None]] = []
        self.next_id = 0
        self.now = 0.0
        # Entry serial -> the KV its blocks must hold (serials, not digests: with the
        # weak hasher one digest names many prefixes).
        self.expected: dict[int, np.ndarray] = {}

    @initialize(
        num_device=st.integers(4, 10),
        num_host=st.integers(0, 4),
        offload_min=st.sampled_from([0, 35, 50]),
        weak_hash=st.booleans(),
        disk=st.booleans(),
        drop_writes=st.booleans(),
        early_copies=st.sampled_from([None, 1, 2]),
    )
    def make_pool(
        self,
        num_device: int,
        num_host: int,
        offload_min: int,
        weak_hash: bool,
        disk: bool,
        drop_writes: bool,
        early_copies: int | None,
    ) -> None:
        # The weak hasher has 8 digests: collisions on almost every step.
        self.hasher = weak_hasher if weak_hash else sha256
        self.device = np.zeros((num_device, BS, ROW), np.uint8)  # [num_blocks, block_size, row]
        self.host = np.zeros((max(num_host, 1), BS, ROW), np.uint8)
        self.num_host, self.offload_min = num_host, offload_min
        self.drop_writes = drop_writes  # every other write-through: a full write queue
        # disk hits a match plans between running the copies so far (the engine's
        # copies_ready), or None: copies run only when complete_copies takes them
        self.early_copies = early_copies
        # digest -> its block's KV, where a digest names one prefix (not the weak hasher)
        self.kv_of_digest: dict[BlockHash, np.ndarray] | None = None if weak_hash else {}
        self.folder = tempfile.mkdtemp(prefix="reprise-prop-disk-") if disk else None
        self._open()

    def _open(self) -> None:
        """A new pool (and disk tier over the same folder): a start or a restart."""
        self.tier = None
        if self.folder is not None:
            self.tier = DiskTier.open(DiskTierConfig(
                self.folder, max_bytes=4 * 240, block_shape=(BS, ROW),
                block_size=BS, model_fingerprint=FP, producer="test", dtype="uint8",
            ))  # fmt: skip
            assert self.tier.enabled
        self.copier = DiskCopier(
            self.device, self.host, self.tier, self.kv_of_digest, self.drop_writes
        )
        host_tier = HostTier(self.num_host) if self.num_host else None
        self.pool = BlockPool(
            len(self.device),
            BS,
            host_tier=host_tier,
            disk_tier=self.tier,
            offload_min_priority=self.offload_min,
            clock=lambda: self.now,
            host_memory=self.host.__getitem__,
            copies_ready=None if self.early_copies is None else self._run_copies_early,
            copy_batch=self.early_copies or 1,
        )

    def _run_copies_early(self) -> None:
        """The engine's copies_ready: run the copies planned so far, pins kept."""
        self.copier.early_runs += 1
        self.copier.run(self.pool)

    # Requests.

    @rule(
        tokens=tokens_st,
        ns_idx=st.sampled_from([0, 0, 0, 1, 2]),  # mostly the default namespace
        priority=st.sampled_from([None, *PRIORITIES]),
        duration=st.sampled_from([None, 1.0, 5.0]),
        use_partial=st.booleans(),
        keep=st.booleans(),
        by_ids=st.sampled_from([None, 0, 1, 99]),  # None: ids per block; else keys given
    )
    def start_request(self, tokens, ns_idx, priority, duration, use_partial, keep, by_ids) -> None:
        self.history.append((tokens, NAMESPACES[ns_idx]))
        self._start(tokens, NAMESPACES[ns_idx], priority, duration, use_partial, keep, by_ids)

    @precondition(lambda self: self.history)
    @rule(
        pick=st.integers(0, 1 << 16),
        priority=st.sampled_from([None, *PRIORITIES]),
        use_partial=st.booleans(),
        keep=st.booleans(),
        by_ids=st.sampled_from([None, 0, 1, 99]),
    )
    def repeat_request(self, pick, priority, use_partial, keep, by_ids) -> None:
        """A prompt seen before: a device hit, a host hit, or a miss after eviction."""
        tokens, namespace = self.history[pick % len(self.history)]
        self._start(tokens, namespace, priority, None, use_partial, keep, by_ids)

    def _start(self, tokens, namespace, priority, duration, use_partial, keep, by_ids=None) -> None:
        """Admit a request; unless `keep`, it finishes at once (a one-step request)."""
        pool = self.pool
        hashes = hash_token_blocks(
            tokens, BS, namespace=namespace, model_fingerprint=FP, hasher=self.hasher
        )
        # The last prompt token is always computed, into a block of the request's own.
        hashes = hashes[: (len(tokens) - 1) // BS]
        blocks = [tokens[i * BS : (i + 1) * BS] for i in range(len(hashes))]
        given: list[list[int]] | bytes = blocks
        keys = hashes
        if by_ids is not None:  # as the engine gives them: ids as bytes, keys known so far
            given = encode_ids(tokens[: len(hashes) * BS])
            ns = namespace or Namespace()
            found = pool.chain_of_ids(given, namespace)
            assert found == hashes[: len(found)], "a chain found by content has other keys"
            # the same prefix whether confirmed by tuples of ids or by the content map
            by_tuples = pool._index.find_prefix(hashes, blocks, None, ns)
            assert pool._index.find_prefix_by_ids(hashes, given, ns) == by_tuples
            assert len(found) == len(by_tuples)
            # the engine gives the keys it knows (none, or a prepared prompt's), and past
            # them the pool's entries give theirs (the disk tier searched only with keys)
            keys = hashes[: min(by_ids, len(hashes))]
            event(f"found by content: {len(found)} of {len(hashes)}, {len(keys)} keys given")
        result = pool.match(
            keys, given, namespace=namespace, priority=priority, priority_duration_s=duration
        )
        assert result.block_hashes == hashes[: result.num_blocks], "a match's keys"
        block_ids = list(result.block_ids)
        num_cached = len(block_ids) * BS
        partial = None
        if use_partial:
            rest = tokens[num_cached : min(num_cached + BS, len(tokens) - 1)]
            parent = hashes[len(block_ids) - 1] if block_ids else None
            partial = pool.find_partial(parent, rest, namespace=namespace)
        needed = -(-len(tokens) // BS) - len(block_ids)
        new = pool.allocate(needed)
        if new is None:  # no room: give everything back, as the scheduler would
            pool.free(block_ids + ([partial[0]] if partial else []))
            if self.tier is not None:  # the step runs the disk hits' copies (their pins
                self.copier.complete(pool)  # are not the host tier's, which the checks see)
                self._check_served(block_ids, namespace, tokens)
            return
        if partial is not None:  # the KV manager's partial copy, freed before it runs
            pool.copy_block(partial[0], new[0])
            pool.free([partial[0]])
        self.copier.complete(pool)  # the runner, before the forward touches these blocks
        self._check_served(block_ids, namespace, tokens)
        block_ids += new
        computed_from = num_cached
        if partial is not None:
            n = partial[1]
            for i in range(n):
                assert np.array_equal(
                    self.device[new[0], i], kv_row(namespace, tokens[: num_cached + i + 1])
                )
            computed_from += n
        req = Req(
            tokens,
            namespace,
            priority if priority is not None else 35,
            block_ids,
            list(hashes[: len(result.block_ids)]),
        )
        self._compute(req, computed_from, duration)
        if keep:
            self.requests[self.next_id] = req
            self.next_id += 1
        else:
            pool.free(req.block_ids)

    @precondition(lambda self: self.requests)
    @rule(
        pick=st.integers(0, 1 << 16),
        new_tokens=st.lists(st.integers(0, 2), min_size=1, max_size=6),
        priority=st.sampled_from(PRIORITIES),
    )
    def generate(self, pick, new_tokens, priority) -> None:
        req_id = sorted(self.requests)[pick % len(self.requests)]
        req = self.requests[req_id]
        num_computed = len(req.tokens)
        req.tokens = req.tokens + new_tokens
        needed = -(-len(req.tokens) // BS) - len(req.block_ids)
        new = self.pool.allocate(needed)
        if new is None:  # preempted: its blocks go back, the request is dropped
            self.pool.free(req.block_ids)
            del self.requests[req_id]
            return
        self.copier.complete(self.pool)
        req.block_ids += new
        req.priority = priority  # generated blocks may rank differently
        self._compute(req, num_computed, None)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 1 << 16))
    def finish(self, pick) -> None:
        req_id = sorted(self.requests)[pick % len(self.requests)]
        self.pool.free(self.requests.pop(req_id).block_ids)

    # Other load, time, clearing.

    @rule(n=st.one_of(st.just(None), st.integers(1, 10)))
    def pressure(self, n) -> None:
        """Other work takes `n` free blocks (None: all of them) and gives them back
        blank: evictions, offloads, host evictions."""
        num_free = self.pool.num_free_blocks
        block_ids = self.pool.allocate(num_free if n is None else min(n, num_free))
        assert block_ids is not None
        self.pool.free(block_ids)  # copies may still be in flight: their pins keep the blocks

    @rule()
    def complete_copies(self) -> None:
        self.copier.complete(self.pool)

    @rule(dt=st.sampled_from([0.5, 2.0, 10.0]))
    def advance_clock(self, dt) -> None:
        self.now += dt

    @rule(roll=st.integers(0, 9))
    def clear(self, roll) -> None:
        if roll == 0:  # rarely, or nothing would stay cached long enough to be reused
            self.pool.clear()
            self.copier.complete(self.pool)

    @precondition(lambda self: getattr(self, "tier", None) is not None)
    @rule(
        pick=st.integers(0, 1 << 16),
        priority=st.sampled_from([None, *PRIORITIES]),
        keep=st.booleans(),
    )
    def restart(self, pick, priority, keep) -> None:
        """The daemon restarts: memory is lost, the disk tier's files are found again by
        a prompt seen before."""
        for req in self.requests.values():
            self.pool.free(req.block_ids)
        self.requests.clear()
        self.copier.complete(self.pool)
        assert self.tier is not None
        self.tier.close()
        self.expected.clear()  # serials start again
        self._open()
        if self.history:
            tokens, namespace = self.history[pick % len(self.history)]
            self._start(tokens, namespace, priority, None, False, keep)

    # Checks.

    @invariant()
    def pool_is_consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        pool.check_integrity()
        held = Counter(b for req in self.requests.values() for b in req.block_ids)
        pending = pool.host_tier.pending_copies() if pool.host_tier is not None else ()
        pins = Counter(copy.device_block.block_id for copy in pending)
        assert [b.ref_count for b in pool.blocks] == [
            held[i] + pins[i] for i in range(pool.num_blocks)
        ]

    @invariant()
    def cached_blocks_hold_their_kv(self) -> None:
        if not hasattr(self, "pool"):
            return
        pending = self.pool.host_tier.pending_copies() if self.pool.host_tier is not None else ()
        busy_device = {id(c.device_block) for c in pending}
        busy_host = {id(c.host_block) for c in pending}
        for block in self.pool.blocks:
            if block.block_hash is not None and id(block) not in busy_device:
                assert block.serial is not None
                assert np.array_equal(self.device[block.block_id], self.expected[block.serial])
        if self.pool.host_tier is not None:
            for slot in self.pool.host_tier.slots():
                if slot.block_hash is not None and id(slot) not in busy_host:
                    assert slot.serial is not None
                    assert np.array_equal(self.host[slot.slot], self.expected[slot.serial])

    def teardown(self) -> None:
        # Shown by --hypothesis-show-statistics: how often each path was reached.
        if hasattr(self, "pool"):
            stats = self.pool.stats()
            for name in (
                "evictions",
                "host_offloads",
                "host_hits",
                "host_evictions",
                "partial_hits",
                "disk_hits",
            ):
                event(f"{name} > 0: {getattr(stats, name) > 0}")
            event(f"disk hits read into host slots: {self.copier.slot_onboards > 0}")
            event(f"copies run during a match: {self.copier.early_runs > 0}")
        if getattr(self, "tier", None) is not None:
            self.tier.close()
        if getattr(self, "folder", None) is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _check_served(self, block_ids: list[BlockId], namespace, tokens: list[int]) -> None:
        """Every block a match served holds its prefix's KV once the copies ran."""
        for idx, block_id in enumerate(block_ids):
            kv = kv_block(namespace, tokens, idx)
            assert np.array_equal(self.device[block_id], kv)
            serial = self.pool.blocks[block_id].serial  # a disk hit's entry is new
            assert serial is not None and np.array_equal(self.expected.setdefault(serial, kv), kv)

    def _compute(self, req: Req, start: int, duration: float | None) -> None:
        """Write the KV of tokens [start, end) and register every block that became full."""
        for pos in range(start, len(req.tokens)):
            block_id = req.block_ids[pos // BS]
            self.device[block_id, pos % BS] = kv_row(req.namespace, req.tokens[: pos + 1])
        # A block the pool refuses (its parent is no longer cached) is not findable,
        # and neither is any block after it: the pool checks that, not the test.
        for idx in range(len(req.hashes), req.num_full_blocks):
            parent = req.hashes[idx - 1] if idx else None
            block = req.tokens[idx * BS : (idx + 1) * BS]
            block_hash = hash_block(
                parent, block, namespace=req.namespace, model_fingerprint=FP, hasher=self.hasher
            )
            block_id = req.block_ids[idx]
            self.pool.register(
                block_id,
                block_hash,
                block,
                req.block_ids[idx - 1] if idx else None,
                namespace=req.namespace,
                priority=req.priority,
                priority_duration_s=duration,
            )
            req.hashes.append(block_hash)
            if self.kv_of_digest is not None:
                self.kv_of_digest[block_hash] = kv_block(req.namespace, req.tokens, idx)
            serial = self.pool.blocks[block_id].serial
            if serial is not None:  # findable, or a duplicate of the entry with this serial
                kv = kv_block(req.namespace, req.tokens, idx)
                assert np.array_equal(self.expected.setdefault(serial, kv), kv)


class DiskCopier(NumpyBlockCopier):
    """The copier, with the disk tier's copies: writes put the block's bytes (as the
    runner does) and land before the next rule; a disk hit's bytes come staged, or
    in the host slot they were read into (then it is an onboard)."""

    def __init__(
        self,
        device: np.ndarray,
        host: np.ndarray,
        tier: DiskTier | None,
        kv_of_digest: dict[BlockHash, np.ndarray] | None,
        drop_writes: bool,
    ) -> None:
        super().__init__(device, host)
        self.tier, self.kv_of_digest = tier, kv_of_digest
        self.drop_writes = drop_writes
        self.num_writes = 0
        self.slot_onboards = 0
        self.early_runs = 0  # runs of copies_ready

    def complete(self, pool: BlockPool) -> int:
        self.run(pool)
        return pool.complete_copies()

    def run(self, pool: BlockPool) -> None:
        """Run the copies planned so far, in order, as the runner does."""
        copies = pool.take_copies()
        for copy in copies:
            if copy.kind in ("device_to_disk", "host_to_disk"):
                entry = copy.entry
                assert self.tier is not None and entry is not None and copy.src is not None
                kv = (self.device if copy.kind == "device_to_disk" else self.host)[copy.src]
                if self.kv_of_digest is not None:  # what is written is the block's own KV
                    assert np.array_equal(kv, self.kv_of_digest[entry.block_hash]), copy
                self.num_writes += 1
                if self.drop_writes and copy.kind == "device_to_disk" and self.num_writes % 2:
                    continue  # dropped, as by a full write queue: the tier does not know it
                self.tier.put(
                    entry.block_hash, entry.parent_hash, entry.token_ids, kv,
                    extra_ids=entry.extra_ids, namespace=entry.namespace,
                )  # fmt: skip
            elif copy.kind == "disk_onboard":
                assert copy.staged is not None and copy.dst is not None
                self.device[copy.dst] = copy.staged
            else:
                if copy.kind == "onboard" and self.tier is not None:
                    self.slot_onboards += 1
                self._run(copy)
        if self.tier is not None:
            assert self.tier.flush(10)


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestPool = PoolMachine.TestCase


def test_a_disk_child_of_a_colliding_parent_digest_is_not_served() -> None:
    """Found by the machine above at 3,000 examples (the weak hasher, a disk tier, a
    restart): [2]*8 writes blocks A0 and A1 (A1's parent digest P); after a restart,
    [0, 1, 2, 2, 2, 0] computes C0, which the weak hasher also names P; its repeat's
    partial match found A1 on disk as a child of P and served A1's first token, whose
    KV is that of [2, 2, 2, 2, 2], not [0, 1, 2, 2, 2]. In memory the same collision
    is harmless (one entry a digest, children only under the live one); on disk a file
    outlives the entry it was written under. Now each file names its entry's lineage
    and its parent's, and a disk hit needs its parent entry's (disk_format.py): the
    partial match finds no child of C0 on disk, and the machine's checks pass."""
    state = PoolMachine()
    try:
        state.make_pool(num_device=4, num_host=0, offload_min=0, weak_hash=True, disk=True,
                        drop_writes=False, early_copies=None)  # fmt: skip
        for tokens in ([2] * 8, [0], [0, 1, 2, 2, 2, 0]):
            state.start_request(tokens=tokens, ns_idx=0, priority=None, duration=None,
                                use_partial=False, keep=False, by_ids=None)  # fmt: skip
            state.pool_is_consistent()
        state.restart(keep=False, pick=2, priority=None)  # history[2]: [0, 1, 2, 2, 2, 0]
        state.pool_is_consistent()
        state.repeat_request(pick=2, priority=None, use_partial=True, keep=False, by_ids=None)
    finally:
        if state.tier is not None:
            state.tier.close()
        shutil.rmtree(state.folder, ignore_errors=True)
