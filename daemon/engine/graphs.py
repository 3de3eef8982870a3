"""Decode steps at fixed batch sizes, replayed as CUDA graphs on the GPU backend.

A decode step runs one token per sequence. Launching its few hundred kernels
one by one from Python costs more CPU time than the GPU needs to run them on a
small batch, so each batch-size bucket's step is captured once as a CUDA graph
(the backend's `capture`) and replayed after that: one launch a step.

A graph replays fixed kernels on fixed buffers, so a bucket owns static inputs
(token ids, positions, slots, sequence lengths, block tables) that each step
uploads into, in two copies from pinned host memory, and the graph leaves its
logits and greedy tokens in buffers of its own. A batch smaller than its
bucket is padded with rows that compute a token 0 at position 0 whose K/V go to
the scratch block, a block past the pool's that the pool never hands out, and
that attend only to it. Every op computes a row from that row's inputs alone,
and the GEMM's rows do not depend on M (DESIGN §4), so padding changes no real
row's bits: a sequence's logits are the same in a replayed step, an eager step
of the same batch, or any other step.

A drafted step (speculative.py: a decoding request's pending token and its draft,
every row sampled) has buckets of its own, up to MAX_DRAFTED_SEQS sequences: a
bucket of `size` holds `size` sequences of up to 1 + K rows each (K the draft
length) and `extra` padding sequences, `size * (1 + K) + extra` rows in all. The
launch geometry of every kernel comes from the row and sequence counts alone (the
attention's from T, B and the table's width, never from how the rows fall into
sequences: attention_kernel.split_grid), so one graph serves every split of the
rows; `query_start_loc` is uploaded with the rest. The rows the batch leaves go to
the padding sequences, 1 to `pad_cap` rows each, at positions 0 .. on the scratch
block: a padding row is never put inside a real sequence, where it would stretch
its seq_len over slots that hold stale bytes.

On the NumPy backend, `capture` returns the step itself: the same padded step
runs eagerly, which is how the tests check the padding on a machine without a GPU.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ..model.llama import ForwardBatch, LlamaModel

log = logging.getLogger(__name__)
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Drafted steps of more sequences run eagerly: a bucket's logits ([size * (1 + K) + extra,
# vocab] fp32) and activations grow with K, and at these batch sizes a decode step is
# still bound by reading the weights, which is what a draft's rows share.
MAX_DRAFTED_SEQS = 16
# A drafted bucket's padding sequences hold up to this many rows each (their table's
# columns all the scratch block), or one block's where blocks are larger.
MIN_PAD_CAP = 16


class _Bucket:
    """The static buffers and the replay of one bucket's step: `num_seqs` sequences
    of `num_rows` rows in all (a decode bucket's: one row each).

    Its host buffers come in two sets, used by turns (`turn`): with asynchronous
    scheduling a step is filled while the one before it may not have uploaded yet, and
    a set is filled again only two steps after its last use, whose upload the engine
    has waited for by then (it read that step's tokens)."""

    def __init__(
        self, model: LlamaModel, kv_cache: Any, num_seqs: int, num_rows: int, width: int
    ) -> None:
        ops = model.ops
        self.num_seqs, self.num_rows = num_seqs, num_rows
        # one vector for the per-row inputs, so a step uploads them in one copy:
        # slot_mapping (int64, first so it is aligned) | token_ids | positions | seq_lens |
        # query_start_loc (num_seqs + 1; constant in a decode bucket: one row a sequence) |
        # feed rows (num_rows: the earlier step's row each row's token comes from, when
        # it comes from the device: `StaticDecode.run`'s `feed`)
        length = 5 * num_rows + 2 * num_seqs + 1
        self.hosts = [ops.staging_buffer((length,), np.int32) for _ in range(2)]
        self.hosts_tables = [ops.staging_buffer((num_seqs, width), np.int32) for _ in range(2)]
        self.device = ops.zeros((length,), np.int32)
        self.device_tables = ops.zeros((num_seqs, width), np.int32)
        self.hosts_fields = [
            _split(host, tables, num_seqs, num_rows)
            for host, tables in zip(self.hosts, self.hosts_tables, strict=True)
        ]
        if num_rows == num_seqs:
            for fields in self.hosts_fields:
                fields.query_start_loc[:] = np.arange(num_seqs + 1, dtype=np.int32)
        self.turn = 0
        static = _split(self.device, self.device_tables, num_seqs, num_rows)
        self.static_token_ids = static.token_ids
        self.static_feed_rows = _feed_rows(self.device, num_seqs, num_rows)

        def step() -> tuple[Any, Any]:
            logits = model.forward_device(static, kv_cache)
            return logits, ops.argmax(logits)

        self.step: Callable[[], tuple[Any, Any]] = step
        self.replay: Callable[[], tuple[Any, Any]] | None = None

    @property
    def host(self) -> Any:
        return self.hosts[self.turn]

    @property
    def host_tables(self) -> Any:
        return self.hosts_tables[self.turn]

    @property
    def host_fields(self) -> ForwardBatch:
        return self.hosts_fields[self.turn]


def _split(vector: Any, tables: Any, num_seqs: int, num_rows: int) -> ForwardBatch:
    """The per-row fields as views of one int32 vector, as _Bucket lays them out."""
    token_ids, positions = vector[2 * num_rows : 3 * num_rows], vector[3 * num_rows : 4 * num_rows]
    seq_lens = vector[4 * num_rows : 4 * num_rows + num_seqs]
    return ForwardBatch(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=vector[: 2 * num_rows].view(np.int64),
        block_tables=tables,
        seq_lens=seq_lens,
        query_start_loc=vector[4 * num_rows + num_seqs : 4 * num_rows + 2 * num_seqs + 1],
        logit_rows=None,
    )


def _feed_rows(vector: Any, num_seqs: int, num_rows: int) -> Any:
    """The feed rows' view of a _Bucket vector (its last `num_rows` entries)."""
    return vector[4 * num_rows + 2 * num_seqs + 1 :]


class StaticDecode:
    """Runs decode steps of up to `max(buckets)` sequences at their bucket's size,
    and with `draft_tokens` drafted steps of up to MAX_DRAFTED_SEQS sequences in
    drafted buckets, each bucket captured on its first step (a device synchronize,
    once) or ahead of time by `capture`."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: Any,
        *,
        scratch_block: int,
        block_size: int,
        max_blocks_per_seq: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        draft_tokens: int = 0,
    ) -> None:
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets must be ascending distinct sizes >= 1; got {buckets}")
        self.model = model
        self.kv_cache = kv_cache
        self.scratch_block = scratch_block
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        self.width = max_blocks_per_seq
        self.buckets = tuple(buckets)
        self.draft_tokens = draft_tokens  # K: the most draft tokens a request has a step
        # a drafted bucket's padding sequence holds at most pad_cap rows, all on the
        # scratch block (its table's first pad_cap / block_size columns)
        self.pad_cap = min(block_size * max_blocks_per_seq, max(block_size, MIN_PAD_CAP))
        self.drafted_buckets = tuple(
            b for b in buckets if draft_tokens and b <= MAX_DRAFTED_SEQS and self.pad_cap > 1
        )
        self._built: dict[tuple[int, bool], _Bucket] = {}  # (size, drafted)
        self.steps = 0  # steps run through a bucket
        self.drafted_steps = 0  # of them, those run through a drafted bucket
        self.failed: str | None = None  # why capturing failed; then every step runs eagerly
        self.drafted_failed: str | None = None  # why a drafted capture failed; then they do

    @property
    def max_drafted_seqs(self) -> int:
        """The most sequences a drafted step may have to run in a drafted bucket (0: none
        does)."""
        return self.drafted_buckets[-1] if self.drafted_buckets else 0

    def built_buckets(self, drafted: bool = False) -> list[int]:
        """The bucket sizes captured so far (the drafted buckets' with `drafted`)."""
        return sorted(size for size, kind in self._built if kind == drafted)

    def drafted_shape(self, size: int) -> tuple[int, int]:
        """(sequences, rows) of the drafted bucket of `size`: `size` sequences of up to
        1 + K rows, and the fewest padding sequences of at most pad_cap rows that hold
        the rows a batch of up to `size` sequences leaves whatever its drafts."""
        # padding sequences P = num_seqs - n and rows Q = num_rows - t for n sequences of
        # t rows (D = t - n draft tokens, D <= n * K): Q - P = size * K - D >= 0 (a row
        # each), and Q - P <= size * K <= extra * (pad_cap - 1) <= P * (pad_cap - 1)
        extra = -(-size * self.draft_tokens // (self.pad_cap - 1))
        return size + extra, size * (1 + self.draft_tokens) + extra

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether `run` takes this batch: every row sampling (`logit_rows` all of them,
        in order), no prompt-table rows (generated tokens never are fake ids, but a
        prompt's last token, computed alone after a cache hit, may be; that step runs
        eagerly), block tables no wider than the static ones, and either one row per
        sequence, at most the largest bucket, or a drafted step's rows (at most K draft
        rows a sequence) of at most the largest drafted bucket's sequences."""
        num_seqs, num_rows = batch.seq_lens.shape[0], batch.token_ids.shape[0]
        if not (
            self.failed is None
            and batch.prompt_rows is None
            and batch.logit_rows is not None
            and batch.logit_rows.shape[0] == num_rows
            and batch.block_tables.shape[1] <= self.width
        ):
            return False
        if num_rows == num_seqs:
            return num_seqs <= self.buckets[-1]
        return (
            bool(self.drafted_buckets)
            and num_seqs <= self.drafted_buckets[-1]
            and num_rows - num_seqs <= num_seqs * self.draft_tokens
        )

    def ready(self, batch: ForwardBatch) -> bool:
        """Whether `run` will replay a graph for `batch` (its bucket is captured now if it
        was not): False once a capture has failed."""
        return self._bucket_of(batch) is not None

    def run(
        self, batch: ForwardBatch, feed: tuple[Any, list[int]] | None = None
    ) -> tuple[Any, Any] | None:
        """Replay the step of `batch`'s bucket on its tokens. Returns the bucket's logits
        [rows, vocab] fp32 and greedy tokens [rows] int32, device arrays of which the first
        `len(batch.token_ids)` rows are the batch's, in its order. They are overwritten by
        the next step of the same bucket. None if the bucket could not be captured (the
        reason is logged once and kept in `failed`): the caller runs the step eagerly.

        `feed` (asynchronous scheduling, a decode batch): (tokens, rows), the device array
        an earlier step's tokens are drawn into, and for each row of `batch` the entry its
        token id is (the batch's own token ids are placeholders). Its entries are copied
        into the step's inputs on the device, after the upload and before the replay."""
        assert self.fits(batch)
        bucket = self._bucket_of(batch)
        if bucket is None:
            return None
        bucket.turn ^= 1
        width = self._fill(bucket, batch)
        ops = self.model.ops
        identity = feed is not None and feed[1] == list(range(len(feed[1])))
        if feed is not None and not identity:
            _feed_rows(bucket.host, bucket.num_seqs, bucket.num_rows)[: len(feed[1])] = feed[1]
        ops.upload(bucket.device, bucket.host)
        ops.upload(bucket.device_tables[:, :width], bucket.host_tables[:, :width])
        if feed is not None:
            num = len(feed[1])
            assert num == batch.token_ids.shape[0] == batch.seq_lens.shape[0], "a decode batch"
            rows = None if identity else bucket.static_feed_rows[:num]
            ops.copy_rows(bucket.static_token_ids[:num], feed[0], rows)
        assert bucket.replay is not None
        self.steps += 1
        self.drafted_steps += bucket.num_rows > bucket.num_seqs
        return bucket.replay()

    def capture(self, max_seqs: int | None = None) -> list[int]:
        """Capture now, not on first use, every bucket a step of at most `max_seqs`
        sequences would run in (all of them with None), drafted ones included, the one
        of most rows first, so the graphs' memory pool grows once to the largest step's
        temporaries. Returns the decode bucket sizes captured by now; stops at a failed
        capture (`failed` says why; steps then run eagerly), but for a drafted bucket's,
        which turns the drafted buckets off alone (`drafted_failed`)."""
        wanted: list[tuple[int, int, bool]] = []  # (rows, size, drafted)
        for sizes, drafted in ((self.buckets, False), (self.drafted_buckets, True)):
            last = len(sizes)
            if max_seqs is not None:
                last = min(bisect.bisect_left(sizes, max_seqs) + 1, last)
            for size in sizes[:last]:
                rows = self.drafted_shape(size)[1] if drafted else size
                wanted.append((rows, size, drafted))
        for _, size, drafted in sorted(wanted, reverse=True):
            if drafted and not self.drafted_buckets:
                continue  # a drafted capture failed: drafted steps run eagerly
            if self._bucket(size, drafted) is None and not drafted:
                break
        return self.built_buckets()

    def _bucket_of(self, batch: ForwardBatch) -> _Bucket | None:
        """The bucket `batch` runs in (captured now if it was not); None once a capture
        has failed."""
        num_seqs = batch.seq_lens.shape[0]
        drafted = batch.token_ids.shape[0] > num_seqs
        sizes = self.drafted_buckets if drafted else self.buckets
        return self._bucket(sizes[bisect.bisect_left(sizes, num_seqs)], drafted)

    def _bucket(self, size: int, drafted: bool = False) -> _Bucket | None:
        """The bucket of `size`, captured on first use; None once a capture has failed."""
        if self.failed is not None:
            return None
        bucket = self._built.get((size, drafted))
        if bucket is not None:
            return bucket
        try:
            num_seqs, num_rows = self.drafted_shape(size) if drafted else (size, size)
            bucket = _Bucket(self.model, self.kv_cache, num_seqs, num_rows, self.width)
            # capture on padding rows alone: the warm-up run touches no pool block
            self._fill(bucket, None)
            ops = self.model.ops
            ops.upload(bucket.device, bucket.host)
            ops.upload(bucket.device_tables, bucket.host_tables)
            bucket.replay = ops.capture(bucket.step)
        except Exception as e:  # a driver or CuPy that cannot capture: serve without graphs
            reason = f"{type(e).__name__}: {e}"
            if drafted:  # (its memory, say): drafted steps run eagerly, decode steps keep theirs
                self.drafted_buckets, self.drafted_failed = (), reason
                log.warning("CUDA graph capture of a drafted step failed, drafted steps run "
                            "eagerly from now on: %s", reason)  # fmt: skip
                return None
            self.failed = reason
            log.warning("CUDA graph capture failed, decoding eagerly from now on: %s", self.failed)
            return None
        self._built[size, drafted] = bucket
        return bucket

    def _fill(self, bucket: _Bucket, batch: ForwardBatch | None) -> int:
        """Write the batch's rows, then padding rows, into the bucket's host buffers.
        Returns the block-table columns to upload: the batch's width, or the padding
        sequences' where wider (the columns past it may be stale, but no row reads past
        its seq_len's blocks)."""
        fields, n, t = bucket.host_fields, 0, 0
        width = 1
        if batch is not None:
            n, t = batch.seq_lens.shape[0], batch.token_ids.shape[0]
            width = max(batch.block_tables.shape[1], 1)
            fields.token_ids[:t] = batch.token_ids
            fields.positions[:t] = batch.positions
            fields.slot_mapping[:t] = batch.slot_mapping
            fields.seq_lens[:n] = batch.seq_lens
            fields.block_tables[:n, : batch.block_tables.shape[1]] = batch.block_tables
        fields.token_ids[t:] = 0
        fields.positions[t:] = 0
        fields.slot_mapping[t:] = self.scratch_slot
        if bucket.num_rows == bucket.num_seqs:  # a padding row a sequence, at position 0
            fields.seq_lens[n:] = 1
            fields.block_tables[n:, 0] = self.scratch_block
            return width
        # the rows left spread evenly over the padding sequences, at most pad_cap each
        pads, rows = bucket.num_seqs - n, bucket.num_rows - t
        assert pads <= rows <= pads * self.pad_cap, (pads, rows, self.pad_cap)
        counts = np.full(pads, rows // pads, dtype=np.int32)
        counts[: rows % pads] += 1
        fields.seq_lens[n:] = counts
        starts = fields.query_start_loc
        starts[: n + 1] = 0 if batch is None else batch.query_start_loc
        starts[n + 1 :] = t + np.cumsum(counts, dtype=np.int32)
        columns = -(-int(counts[0]) // self.block_size)
        fields.block_tables[n:, :columns] = self.scratch_block
        return max(width, columns)
