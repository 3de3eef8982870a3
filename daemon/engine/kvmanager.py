"""Per-request KV block bookkeeping on top of the block pool.

Admission matches a request's longest cached prefix (device or host tier),
then copies the first tokens of a partially matching block into a fresh
block of its own. A prefix without extra ids is matched by its ids: the pool
finds its blocks by content and gives their keys (`MatchResult.block_hashes`),
so only the blocks past it are hashed, to register them once computed (with a
disk tier, ahead: the disk is searched by key, `BlockPool.chain_of_ids`).
Growth allocates blocks as tokens are added; after each step every block
that became full is registered, prompt and generated tokens alike, so another
request can reuse it at once. The last token of a request
is always computed into a block the request owns (an exact repeat's next
one): a cached block is never written.

Prompt logprobs (prompt_logprobs.py): a request still missing prompt entries
matches only blocks whose entries it can take from the store, and computes the
row before its first missing entry itself. The entries of a prompt's tail (past its
last full block) are kept by the tail's key, so a repeat that finds them all is
admitted as a request without prompt logprobs.

Extra ids (p-tuning, Sequence.extra_ids) enter every key, match, partial match
and registration, so blocks whose fake ids select different embeddings never
meet.

Sliding windows (a model whose layers all have the same `window`): a running request
gives back each block once the next query's window starts past it, registered and
still cached for others (`release_past_window`), so a long request holds about a
window's worth of blocks. Its block table keeps the ids: no query uses a page wholly
before its window (cuda/attention.py), whatever the block now holds.
The last registered block is kept, as the parent the next registration names.

Exact repeats (logits_cache.py): a prompt whose last logits row is stored is
admitted with every prompt token's KV, the last one's too (`whole_prompt`); its
tail comes as a partial copy into a block of its own, so the first token it
generates is still written into a block the request owns.
"""

from __future__ import annotations

from ...blockpool.hashing import BlockHash, Namespace, hash_block, hash_encoded_blocks
from ...blockpool.pool import BlockId, BlockPool
from .logits_cache import PromptKey, prompt_key
from .params import Retention
from .prompt_logprobs import PromptLogprobStore, tail_key
from .sequence import Sequence


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        model_fingerprint: bytes,
        logprob_store: PromptLogprobStore | None = None,
        window: int | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.model_fingerprint = model_fingerprint
        self.logprob_store = logprob_store  # None: no request may ask for prompt logprobs
        self.window = window  # every layer's sliding window, if they share one

    def admit(self, seq: Sequence, *, whole_prompt: bool = False) -> int:
        """Give a request with no blocks its cached prefix; returns the tokens it skips.

        Matches at most the full blocks before its last token, then tries a
        partial match of the next block (its tokens up to the last one). With
        `whole_prompt` (an exact repeat), the last token is matched too.
        """
        assert not seq.block_ids and seq.num_computed_tokens == 0, seq.request_id
        bs = self.block_size
        num_wanted = seq.num_tokens if whole_prompt else seq.num_tokens - 1
        num_matchable = num_wanted // bs
        by_ids = seq.prompt_extra_ids is None  # the pool finds the blocks by their ids
        if by_ids and not self.pool.searches_disk:
            hashes = seq.hash_chain[:num_matchable]  # the keys known; the pool has the rest
        else:
            if by_ids and len(seq.hash_chain) < num_matchable:
                self._take_cached_keys(seq, num_matchable)
            hashes = self.hash_chain(seq, num_matchable)
        wanted = seq.prompt_logprobs
        if wanted is not None and not wanted.complete:
            store = self.logprob_store
            assert store is not None
            wanted.take_stored(self.hash_chain(seq, len(seq.prompt_token_ids) // bs), store)
            wanted.take_stored_tail(tail_key(self.tail_hash(seq)), store)
            if not wanted.complete:  # match only blocks whose entries it has
                num_matchable = min(num_matchable, wanted.num_known // bs)
                hashes = hashes[:num_matchable]
        if wanted is not None and wanted.complete:
            wanted = None  # it has all its prompt entries: an ordinary admission
        extra = None  # no prompt table: no block has extra ids
        blocks: bytes | list[tuple[int, ...]]
        if by_ids:
            blocks = seq.encoded_ids(0, num_matchable * bs)
        else:  # ids and extra ids per block, tuples as keys hold
            spans = [(idx * bs, (idx + 1) * bs) for idx in range(num_matchable)]
            extra = [seq.extra_ids(*span) for span in spans]
            ids = tuple(seq.token_ids(0, num_matchable * bs))
            blocks = [ids[start:end] for start, end in spans]
        retention = seq.retention
        match = self.pool.match(  # a request that names a retention re-ranks the prefix it reuses
            hashes,
            blocks,
            extra_ids_per_block=extra,
            namespace=seq.namespace,
            priority=None if retention is None else retention.priority,
            priority_duration_s=None if retention is None else retention.duration_s,
        )
        seq.block_ids = list(match.block_ids)
        seq.block_hashes = match.block_hashes
        if len(match.block_hashes) > len(seq.hash_chain):  # keys the pool found by ids
            seq.hash_chain += match.block_hashes[len(seq.hash_chain) :]
        seq.num_computed_tokens = match.num_blocks * bs
        seq.num_host_hit_tokens = match.num_host_hits * bs
        seq.num_disk_hit_tokens = match.num_disk_hits * bs
        limit = num_wanted
        if wanted is not None:
            limit = wanted.num_known - 1  # that position's row gives the first missing entry
            if seq.num_computed_tokens > limit:
                self._back_off(seq, match.num_host_hits > 0, match.num_disk_hits > 0)
        self._reuse_partial(seq, limit)
        return seq.num_computed_tokens

    def store_prompt_logprobs(self, seq: Sequence) -> None:
        """Keep the entries of `seq`'s prompt blocks that became known, by block key."""
        wanted = seq.prompt_logprobs
        if wanted is None or self.logprob_store is None or not self.pool.enable_reuse:
            return
        num_full = wanted.num_known // self.block_size
        if num_full > wanted.num_stored_blocks:
            wanted.store_new(self.hash_chain(seq, num_full), self.logprob_store)
        if wanted.complete and not wanted.tail_stored:
            wanted.store_tail(tail_key(self.tail_hash(seq)), self.logprob_store)

    def _back_off(self, seq: Sequence, host_hit: bool, disk_hit: bool) -> None:
        """Give back the last matched block but its first bs - 1 tokens (copied into a
        block of the request's own), so its last position is computed in this request.

        NOTE: the row computed there is bit-identical to the one computed when the
        block was (DESIGN §4: a position's logits do not depend on where a prefill
        split its prompt), so backing off changes no entry and no logit."""
        source = seq.block_ids.pop()
        seq.block_hashes.pop()
        seq.num_computed_tokens -= self.block_size
        # the match's tiers come in order (device, host, disk): the last block is the latest's
        if disk_hit:
            seq.num_disk_hit_tokens -= self.block_size
        elif host_hit:
            seq.num_host_hit_tokens -= self.block_size
        self._copy_prefix(seq, source, self.block_size - 1, from_disk=disk_hit)

    def prompt_key(self, seq: Sequence) -> PromptKey:
        """The key of `seq`'s whole prompt, for its stored last logits row."""
        return prompt_key(self.tail_hash(seq))

    def tail_hash(self, seq: Sequence) -> BlockHash:
        """A block-style digest of `seq`'s prompt tail (tokens past the last full block,
        maybe none) chained to the full blocks' keys: it fixes the whole prompt. The keys
        of full blocks the pool holds are taken from it (`_take_cached_keys`), not hashed:
        an exact repeat's key hashed all of a 2k prompt's blocks before (about 50 us)."""
        if seq.tail_digest is not None:
            return seq.tail_digest
        bs, num_prompt = self.block_size, len(seq.prompt_token_ids)
        num_full = num_prompt // bs
        if seq.prompt_extra_ids is None and len(seq.hash_chain) < num_full:
            self._take_cached_keys(seq, num_full)
        chain = self.hash_chain(seq, num_full)
        start = len(chain) * bs
        seq.tail_digest = hash_block(
            chain[-1] if chain else None,
            seq.prompt_token_ids[start:],
            extra_ids=seq.extra_ids(start, num_prompt),
            namespace=seq.namespace,
            model_fingerprint=self.model_fingerprint,
        )
        return seq.tail_digest

    def hash_chain(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """Keys of the first `num_blocks` full blocks of `seq`'s tokens (memoized:
        a token never changes once the sequence has it). The missing ones are hashed
        in one call, from the ids encoded once."""
        bs, chain = self.block_size, seq.hash_chain
        assert num_blocks * bs <= seq.num_tokens, (num_blocks, seq.num_tokens)
        first = len(chain)
        if first < num_blocks:
            extra = None
            if seq.prompt_extra_ids is not None:
                extra = [seq.extra_ids(i * bs, (i + 1) * bs) for i in range(first, num_blocks)]
            chain += hash_encoded_blocks(
                chain[-1] if chain else None,
                seq.encoded_ids(first * bs, num_blocks * bs),
                bs,
                extra_ids_per_block=extra,
                namespace=seq.namespace,
                model_fingerprint=self.model_fingerprint,
            )
        return chain[:num_blocks]

    def _take_cached_keys(self, seq: Sequence, num_blocks: int) -> None:
        """Extend `seq`'s key memo with the keys of its first `num_blocks` blocks that the
        pool holds, found by their ids (`BlockPool.chain_of_ids`): the digests hashing
        would give, at a dict lookup a block instead of a SHA-256 (a cached prompt's
        admission hashed 4k tokens in ~0.15 ms). For a pool that searches the disk tier
        past them, by key; otherwise the match itself finds them."""
        chain = seq.hash_chain
        found = self.pool.chain_of_ids(
            seq.encoded_ids(0, num_blocks * self.block_size), seq.namespace
        )
        if len(found) > len(chain):
            chain += found[len(chain) :]

    def prompt_keys(self, id_bytes: bytes, namespace: Namespace) -> list[BlockHash]:
        """Keys of the full blocks of a prompt without extra ids (its ids encoded as keys
        encode them), under `namespace`: what `hash_chain` computes for such a request's
        prompt blocks (Engine.prepare_prompt computes them ahead)."""
        width = 8 * self.block_size
        return hash_encoded_blocks(
            None,
            id_bytes[: len(id_bytes) // width * width],
            self.block_size,
            namespace=namespace,
            model_fingerprint=self.model_fingerprint,
        )

    def blocks_in_flight(self, seq: Sequence) -> list[BlockHash]:
        """Keys of the full blocks a running `seq` has yet to compute from tokens it
        already knows: another request that needs one should wait, then reuse it."""
        num_full, num_registered = seq.num_tokens // self.block_size, len(seq.block_hashes)
        if not self.pool.enable_reuse or num_registered >= num_full:
            return []  # the decode case: nothing in flight, nothing to hash
        return self.hash_chain(seq, num_full)[num_registered:]

    def waits_for(self, seq: Sequence, in_flight: set[BlockHash]) -> bool:
        """Whether a waiting `seq` needs a block that a running request is computing."""
        if not in_flight:
            return False
        return any(
            h in in_flight for h in self.hash_chain(seq, (seq.num_tokens - 1) // self.block_size)
        )

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` the blocks to hold `num_tokens` more tokens; False if the pool is short."""
        needed = -(-(seq.num_computed_tokens + num_tokens) // self.block_size) - len(seq.block_ids)
        if needed <= 0:
            return True
        block_ids = self.pool.allocate(needed)
        if block_ids is None:
            return False
        seq.block_ids.extend(block_ids)
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Make every block of `seq` that is now full and written findable."""
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        if num_full <= len(seq.block_hashes):
            return  # most decode steps: no block filled up
        num_prompt = len(seq.prompt_token_ids)
        retention = seq.retention or Retention()
        hashes = self.hash_chain(seq, num_full)
        for idx in range(len(seq.block_hashes), num_full):
            generated = (idx + 1) * bs > num_prompt
            self.pool.register(
                seq.block_ids[idx],
                hashes[idx],
                seq.token_ids(idx * bs, (idx + 1) * bs),
                seq.block_ids[idx - 1] if idx else None,
                extra_ids=seq.extra_ids(idx * bs, (idx + 1) * bs),
                namespace=seq.namespace,
                priority=retention.generated_priority if generated else retention.priority,
                priority_duration_s=retention.duration_s,
            )
            seq.block_hashes.append(hashes[idx])

    def release(self, seq: Sequence) -> None:
        """Return a request's blocks to the pool (its full blocks stay cached)."""
        self.pool.free(seq.block_ids[seq.num_released_blocks :])
        seq.block_ids = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.num_released_blocks = 0

    def release_past_window(self, seq: Sequence) -> None:
        """Give back the blocks of a running `seq` that no later query of it sees: those
        wholly before the window of its next position (num_computed_tokens), registered,
        but for the last registered one. Only with a shared window."""
        assert self.window is not None
        first_seen = seq.num_computed_tokens - self.window + 1  # the next query's window
        num_past = min(max(first_seen, 0) // self.block_size, len(seq.block_hashes) - 1)
        if num_past > seq.num_released_blocks:
            self.pool.free(seq.block_ids[seq.num_released_blocks : num_past])
            seq.num_released_blocks = num_past

    def _reuse_partial(self, seq: Sequence, num_wanted: int) -> None:
        """Copy the leading tokens a cached block shares with the request's next block
        (of its first `num_wanted` tokens)."""
        bs = self.block_size
        start = seq.num_computed_tokens
        end = min(start + bs, num_wanted)
        wanted = seq.token_ids(start, end)
        if not wanted:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        found = self.pool.find_partial(
            parent, wanted, extra_ids=seq.extra_ids(start, end), namespace=seq.namespace
        )
        if found is None:
            return
        self._copy_prefix(seq, *found)

    def _copy_prefix(
        self, seq: Sequence, source: BlockId, num_shared: int, *, from_disk: bool = False
    ) -> None:
        """Copy held block `source`, whose first `num_shared` tokens are the request's
        next ones, into a fresh block of the request's, and let go of `source`."""
        from_disk = from_disk or self.pool.is_disk_partial(source)
        from_host = self.pool.is_arriving(source) and not from_disk
        fresh = self.pool.allocate(1) if num_shared else None
        if fresh is not None:
            # NOTE: the source may still be arriving from the host tier, and taking the
            # fresh block may have planned an offload that reads its old bytes: the
            # pool's copy list runs in order, so this copy comes after both.
            self.pool.copy_block(source, fresh[0])
            seq.block_ids.append(fresh[0])
            seq.num_computed_tokens += num_shared
            if from_host:
                seq.num_host_hit_tokens += num_shared
            elif from_disk:
                seq.num_disk_hit_tokens += num_shared
        self.pool.free([source])
