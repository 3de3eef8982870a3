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


class _Bucket:
    """The static buffers and the replay of one batch size's decode step."""

    def __init__(self, model: LlamaModel, kv_cache: Any, size: int, width: int) -> None:
        ops = model.ops
        self.size = size
        # one vector for the per-row inputs, so a step uploads them in one copy:
        # slot_mapping (int64, first so it is aligned) | token_ids | positions | seq_lens |
        # query_start_loc (size + 1, constant: one token per sequence)
        length = 2 * size + 3 * size + size + 1
        self.host = ops.staging_buffer((length,), np.int32)
        self.host_tables = ops.staging_buffer((size, width), np.int32)
        self.device = ops.zeros((length,), np.int32)
        self.device_tables = ops.zeros((size, width), np.int32)
        self.host_fields = _split(self.host, self.host_tables, size)
        self.host_fields.query_start_loc[:] = np.arange(size + 1, dtype=np.int32)
        static = _split(self.device, self.device_tables, size)

        def step() -> tuple[Any, Any]:
            logits = model.forward_device(static, kv_cache)
            return logits, ops.argmax(logits)

        self.step: Callable[[], tuple[Any, Any]] = step
        self.replay: Callable[[], tuple[Any, Any]] | None = None


def _split(vector: Any, tables: Any, size: int) -> ForwardBatch:
    """The per-row fields as views of one int32 vector, as _Bucket lays them out."""
    rows = [vector[start : start + size] for start in range(2 * size, 5 * size, size)]
    return ForwardBatch(
        token_ids=rows[0],
        positions=rows[1],
        slot_mapping=vector[: 2 * size].view(np.int64),
        block_tables=tables,
        seq_lens=rows[2],
        query_start_loc=vector[5 * size :],
        logit_rows=None,
    )


class StaticDecode:
    """Runs decode steps of up to `max(buckets)` sequences at their bucket's size,
    each bucket captured on its first step (a device synchronize, once) or ahead of
    time by `capture`."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: Any,
        *,
        scratch_block: int,
        block_size: int,
        max_blocks_per_seq: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
    ) -> None:
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets must be ascending distinct sizes >= 1; got {buckets}")
        self.model = model
        self.kv_cache = kv_cache
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        self.width = max_blocks_per_seq
        self.buckets = tuple(buckets)
        self._built: dict[int, _Bucket] = {}
        self.steps = 0  # steps run through a bucket
        self.failed: str | None = None  # why capturing failed; then every step runs eagerly

    def built_buckets(self) -> list[int]:
        """The bucket sizes captured so far."""
        return sorted(self._built)

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether `run` takes this batch: one token per sequence, each sampling, at most
        the largest bucket, block tables no wider than the static ones, no prompt-table
        rows (generated tokens never are fake ids, but a prompt's last token, computed
        alone after a cache hit, may be; that step runs eagerly)."""
        num_seqs = batch.seq_lens.shape[0]
        return (
            self.failed is None
            and batch.prompt_rows is None
            and batch.token_ids.shape[0] == num_seqs <= self.buckets[-1]
            and batch.logit_rows is not None
            and batch.logit_rows.shape[0] == num_seqs
            and batch.block_tables.shape[1] <= self.width
        )

    def run(self, batch: ForwardBatch) -> tuple[Any, Any] | None:
        """Replay the step of `batch`'s bucket on its tokens. Returns the bucket's logits
        [size, vocab] fp32 and greedy tokens [size] int32, device arrays of which the first
        `len(batch.seq_lens)` rows are the batch's, in its order. They are overwritten by
        the next step of the same bucket. None if the bucket could not be captured (the
        reason is logged once and kept in `failed`): the caller runs the step eagerly."""
        assert self.fits(batch)
        num_seqs = batch.seq_lens.shape[0]
        bucket = self._bucket(self.buckets[bisect.bisect_left(self.buckets, num_seqs)])
        if bucket is None:
            return None
        width = self._fill(bucket, batch)
        ops = self.model.ops
        ops.upload(bucket.device, bucket.host)
        ops.upload(bucket.device_tables[:, :width], bucket.host_tables[:, :width])
        assert bucket.replay is not None
        self.steps += 1
        return bucket.replay()

    def capture(self, max_seqs: int | None = None) -> list[int]:
        """Capture now, not on first use, every bucket a step of at most `max_seqs`
        sequences would run in (all of them with None), largest first, so the graphs'
        memory pool grows once to the largest step's temporaries. Returns the sizes
        captured by now; stops at a failed capture (`failed` says why; steps then run
        eagerly)."""
        last = len(self.buckets)
        if max_seqs is not None:
            last = min(bisect.bisect_left(self.buckets, max_seqs) + 1, last)
        for size in reversed(self.buckets[:last]):
            if self._bucket(size) is None:
                break
        return self.built_buckets()

    def _bucket(self, size: int) -> _Bucket | None:
        """The bucket of `size`, captured on first use; None once a capture has failed."""
        if self.failed is not None:
            return None
        bucket = self._built.get(size)
        if bucket is not None:
            return bucket
        try:
            bucket = _Bucket(self.model, self.kv_cache, size, self.width)
            # capture on padding rows alone: the warm-up run touches no pool block
            self._fill(bucket, None)
            ops = self.model.ops
            ops.upload(bucket.device, bucket.host)
            ops.upload(bucket.device_tables, bucket.host_tables)
            bucket.replay = ops.capture(bucket.step)
        except Exception as e:  # a driver or CuPy that cannot capture: serve without graphs
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("CUDA graph capture failed, decoding eagerly from now on: %s", self.failed)
            return None
        self._built[size] = bucket
        return bucket

    def _fill(self, bucket: _Bucket, batch: ForwardBatch | None) -> int:
        """Write the batch's rows, then padding rows, into the bucket's host buffers.
        Returns the block-table columns to upload: the batch's width (the columns past
        it may be stale, but no row reads past its seq_len's blocks)."""
        fields, n = bucket.host_fields, 0
        width = 1
        if batch is not None:
            n = batch.seq_lens.shape[0]
            width = max(batch.block_tables.shape[1], 1)
            fields.token_ids[:n] = batch.token_ids
            fields.positions[:n] = batch.positions
            fields.slot_mapping[:n] = batch.slot_mapping
            fields.seq_lens[:n] = batch.seq_lens
            fields.block_tables[:n, : batch.block_tables.shape[1]] = batch.block_tables
        fields.token_ids[n:] = 0
        fields.positions[n:] = 0
        fields.slot_mapping[n:] = self.scratch_slot
        fields.seq_lens[n:] = 1
        fields.block_tables[n:, 0] = self.scratch_block
        return width
