"""The model runner: owns the model, the KV cache and the host arena, and executes
a step plan: the planned block copies in order, then one forward pass, then the
next tokens. It reads the plan and never changes a sequence or the pool.

Disk copies: a disk hit's bytes were read and checked when the pool matched it,
so onboarding one only moves them into its device block; a block written to disk
is copied into one of the disk tier's staging buffers (from a device block on the
backend's copy stream, without waiting; from a host slot at once) and handed to
the tier's writer thread, which waits for the copy, then encodes, checksums and
writes it off the engine loop."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from ...blockpool.copies import BlockCopy
from ...blockpool.disk import DiskTier
from ...blockpool.disk_config import ReadBlock
from ...cuda.kvcache import kv_cache_shape
from ...cuda.protocol import CopyDone
from ..model.config import ModelConfig
from ..model.llama import ForwardBatch, LlamaModel
from .graphs import DEFAULT_BUCKETS, StaticDecode
from .prompt_logprobs import EntryRows
from .sampling import SamplingState, next_tokens
from .scheduler import ScheduledSeq, StepPlan
from .sequence import Sequence

# (sequence, its tokens, their logits rows [len(tokens), vocab] or None, whether no token
# can come after them): one token, or, after a draft, the samples kept (speculative.py);
# none when no token can come next (SamplingBatch.dead_rows: a dead end, an error)
Sampled = tuple[Sequence, list[int], np.ndarray | None, bool]
PromptSpan = tuple[Sequence, int, range]  # (sequence, batch row of the first, positions)


@dataclass(slots=True)
class RunOutput:
    """What a step computed: each sampling sequence's tokens (`sampled`, in schedule
    order: one, or a draft's kept samples and the first that differs from it), the
    prompt entries (prompt_logprobs.py) its rows gave, as (sequence, index of the first
    prompt token they are for, entries), and the embeddings of the requests that asked."""

    sampled: list[Sampled] = field(default_factory=list)
    prompt_entries: list[tuple[Sequence, int, EntryRows]] = field(default_factory=list)
    # (sequence, its prompt's last-token embedding fp32 [hidden]): params.embed's
    embeddings: list[tuple[Sequence, np.ndarray]] = field(default_factory=list)


@dataclass(slots=True)
class Launched:
    """A decode step queued on the device (asynchronous scheduling): its forward and
    sampling are launched and its tokens are on their way into a pinned host buffer;
    `result` waits for them alone, while later work on the device runs on."""

    seqs: list[Sequence]  # row i's sequence
    tokens: Any  # backend int32 array: row i's token at entry i (what a later step is fed)
    host: np.ndarray  # pinned int32 [len(seqs)]: the tokens, once `landed`
    landed: CopyDone
    dead: tuple[int, ...]  # rows no token can be drawn from (SamplingBatch.dead_rows)

    def result(self) -> RunOutput:
        self.landed.synchronize()
        tokens = self.host.tolist()
        return RunOutput([
            (seq, [], None, True) if i in self.dead else (seq, [tokens[i]], None, False)
            for i, seq in enumerate(self.seqs)
        ])  # fmt: skip


class ModelRunner:
    """Block copies are whole blocks within the device cache and between it and the
    host arena (same per-block layout), byte for byte.

    With `decode_graphs`, steps that run one token per sequence, and with
    `draft_tokens` (speculation's K) small drafted steps, go through `StaticDecode`
    (CUDA graphs on the GPU backend); the cache then holds one block past the pool's,
    the padding rows' scratch block."""

    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        *,
        decode_graphs: bool = False,
        max_model_len: int | None = None,
        decode_buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        disk_tier: DiskTier | None = None,
        keep_prompt_logits: bool = False,
        draft_tokens: int = 0,
    ) -> None:
        cfg: ModelConfig = model.config
        self.model = model
        # bring back every prompt's last logits row, for the exact-repeat cache
        self.keep_prompt_logits = keep_prompt_logits
        self.block_size = block_size
        shape = kv_cache_shape(
            num_blocks + decode_graphs, cfg.num_layers, cfg.num_kv_heads, block_size, cfg.head_dim
        )
        self.kv_cache = model.ops.kv_cache(shape)
        # [num_host_blocks, num_layers, 2, num_kv_heads, block_size, head_dim] on the host
        self.host_cache = model.ops.host_kv_cache((num_host_blocks, *shape[1:]))
        self.disk_tier = disk_tier
        self._tier_copies_in_flight = False  # issued, and the compute not yet after them
        # pinned [max bucket] int32 pairs the launched steps' tokens land in (`launch`)
        self._token_buffers: list[np.ndarray] | None = None
        self._token_turn = 0
        self.decode: StaticDecode | None = None
        if decode_graphs:
            max_len = max_model_len or cfg.max_position_embeddings
            self.decode = StaticDecode(
                model,
                self.kv_cache,
                scratch_block=num_blocks,
                block_size=block_size,
                max_blocks_per_seq=-(-max_len // block_size),
                buckets=decode_buckets,
                draft_tokens=draft_tokens,
            )

    def execute(self, plan: StepPlan) -> RunOutput:
        """Run the plan's copies, then its forward (`run`); the copies, those the engine
        started ahead of the plan too, are complete when this returns."""
        self.run_copies(plan.copies)
        if plan.scheduled:  # reading its results back waits for it, and it for the copies
            return self.run(plan.scheduled)
        # No forward to wait behind: wait here, so that a host slot whose pin is released
        # next is never written (a disk read into it) while a copy still reads it.
        self.model.ops.copies_done().synchronize()
        return RunOutput()

    def launch(self, plan: StepPlan, after: Launched | None = None) -> Launched | None:
        """Queue `plan` on the device without waiting for its tokens (asynchronous
        scheduling): its copies, then its decode graph's replay and the sampling, then the
        tokens' copy to the host. None, with nothing queued, when the plan cannot run so
        (no decode graphs, or a step that is not one token per sequence, sampling on the
        device alone: `Engine` asks only for those, so None means a failed capture).

        `after`: the step queued before this one, whose tokens this one's sequences have
        not recorded yet: the plan is then a step ahead of them (`pipeline.plan_ahead`).
        Each sequence's position is one past its recorded tokens, and its input token is
        fed on the device from `after`'s tokens (its row there)."""
        if self.decode is None:
            return None
        scheduled, ahead = plan.scheduled, after is not None
        batch = self.build_batch(scheduled, ahead=ahead)
        if not self.decode.fits(batch) or not self.decode.ready(batch):
            return None
        self.run_copies(plan.copies)
        seqs = [item.seq for item in scheduled]
        feed = None
        if after is not None:
            row_of = {id(seq): i for i, seq in enumerate(after.seqs)}
            feed = (after.tokens, [row_of[id(seq)] for seq in seqs])
        static = self.decode.run(batch, feed)
        assert static is not None, "the bucket was captured by `ready`"
        logits, greedy = static
        ops = self.model.ops
        states = [seq.sampling for seq in seqs]
        positions = [seq.num_tokens + ahead for seq in seqs]
        tokens, dead = next_tokens(ops, logits, greedy, states, positions)
        num = len(seqs)
        buffers = self._token_buffers
        if buffers is None or buffers[0].shape[0] < num:
            size = max(num, self.decode.buckets[-1])
            buffers = self._token_buffers = [
                ops.staging_buffer((size,), np.int32) for _ in range(2)
            ]
        # the two buffers by turns: one is read by `result` while the next step lands in the other
        self._token_turn ^= 1
        host = buffers[self._token_turn][:num]
        landed = ops.download(host, tokens[:num])
        return Launched(seqs, tokens, host, landed, dead)

    def run_copies(self, copies: list[BlockCopy], *, wait: bool = True) -> None:
        """Execute block copies in list order and, with `wait`, order the compute to come
        after every tier copy issued so far (those of earlier calls without it too).

        Tier copies go through the backend's copy engine (asynchronous on the GPU:
        its own streams, waited for in `wait_copies`); a device copy is ordered after
        every tier copy before it, since it may read a block being onboarded or
        write one whose old bytes are being offloaded. Without `wait` (copies started
        inside a match, ahead of the step: the engine's `_start_copies`), the next
        call's tier copies are not held behind these: the step's `execute` waits for all.
        """
        ops = self.model.ops
        tier: list[tuple[str, int, int]] = []  # a run of offloads and onboards, issued in one call
        for copy in copies:
            if copy.kind in ("offload", "onboard"):
                assert copy.src is not None and copy.dst is not None, copy
                tier.append((copy.kind, copy.src, copy.dst))
                continue
            if tier:
                ops.tier_copies(self.kv_cache, self.host_cache, tier)
                self._tier_copies_in_flight, tier = True, []
            if copy.kind == "device_to_disk":
                self._disk_copy(copy)  # a read of the block, as an offload
                self._tier_copies_in_flight = True
            else:
                self._wait_tier_copies()
                if copy.kind == "device":
                    assert copy.src is not None and copy.dst is not None, copy
                    ops.copy_block(self.kv_cache, copy.src, copy.dst)
                else:
                    self._disk_copy(copy)
        if tier:
            ops.tier_copies(self.kv_cache, self.host_cache, tier)
            self._tier_copies_in_flight = True
        if wait:
            self._wait_tier_copies()  # the forward reads onboarded blocks, writes offloaded ones

    def _wait_tier_copies(self) -> None:
        if self._tier_copies_in_flight:
            self.model.ops.wait_copies()
            self._tier_copies_in_flight = False

    def _disk_copy(self, copy: BlockCopy) -> None:
        """Move a disk hit's checked bytes into its device block, or queue a block's
        bytes for writing (into a staging buffer of the disk tier; none free drops it).

        NOTE: a device block's bytes are read on the backend's device-to-host copy
        stream after the compute queued so far (which wrote them), and every later write
        of that block is ordered after the read: a device or disk-onboard copy into it
        waits for the copy streams first (`wait_copies`), an onboard into it waits for
        the read's event (the backend's cross-stream waits), and the forward waits for
        the copy streams before it starts. So the staged bytes
        are the block's as planned, even when its device block has a new owner already.
        The engine loop never waits for the read: the writer thread does."""
        ops = self.model.ops
        if copy.kind == "disk_onboard":
            staged = copy.staged
            assert staged is not None and copy.dst is not None
            cache_dtype = self.kv_cache.dtype  # BF16, or its bits (uint16) on the GPU
            payload = staged if staged.dtype == cache_dtype else staged.view(cache_dtype)
            # one copy into the block, in order on the compute stream (not a device array
            # made from it and copied over: an allocation and a copy kernel a block).
            # NOTE: the payload is pageable memory the disk read made (a hit read into a
            # host slot is an onboard instead), so the copy has read it when upload returns
            ops.upload(self.kv_cache[copy.dst], payload)
            return
        disk, entry, src = self.disk_tier, copy.entry, copy.src
        assert disk is not None and entry is not None and src is not None
        kv: np.ndarray | ReadBlock
        if copy.kind == "device_to_disk":
            kv = functools.partial(ops.read_block, self.kv_cache, src)
        else:
            assert copy.kind == "host_to_disk", copy.kind
            slot, dtype = self.host_cache[src], disk.config.np_dtype
            kv = slot if slot.dtype == dtype else slot.view(dtype)
        disk.put(
            entry.block_hash,
            entry.parent_hash,
            entry.token_ids,
            kv,
            extra_ids=entry.extra_ids,
            namespace=entry.namespace,
            allocate=ops.staging_buffer,
            lineage=entry.lineage,
            parent_lineage=entry.parent_lineage,
        )

    def build_batch(
        self,
        scheduled: list[ScheduledSeq],
        prompt_spans: list[PromptSpan] | None = None,
        *,
        ahead: bool = False,
    ) -> ForwardBatch:
        """The step's flat arrays. Per sequence this is a few Python list operations (a
        decode step of 64 sequences must cost the CPU far less than the GPU's step).
        Logits rows: the sampling ones, then those of `prompt_spans` in order.
        `ahead` (`launch`'s): decode tokens one past each sequence's computed ones, whose
        ids are not on the host yet (0 stands in for each: the device feeds them)."""
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        logit_rows: list[int] = []
        max_blocks = max(len(s.seq.block_ids) for s in scheduled)
        tables: list[int] = []
        tabled: list[tuple[int, Sequence]] = []  # (first row, seq) of chunks that may hold fake ids
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens + ahead
            end = start + item.num_tokens
            table = seq.block_ids
            if seq.prompt_table is not None and start < len(seq.prompt_token_ids):
                tabled.append((len(token_ids), seq))
            if end == start + 1:  # a decode token: the common case, kept cheap
                token_ids.append(0 if ahead else seq.token_at(start))
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                if item.draft:  # its pending token, then the draft's: every row samples
                    token_ids.append(seq.token_at(start))
                    token_ids.extend(item.draft)
                    logit_rows.extend(range(starts[-1], starts[-1] + item.num_tokens - 1))
                else:
                    token_ids.extend(seq.token_ids(start, end))
                span = range(start, end)
                positions.extend(span)
                slots.extend(table[pos // bs] * bs + pos % bs for pos in span)
            tables.extend(table)
            tables.extend([0] * (max_blocks - len(table)))
            seq_lens.append(end)
            starts.append(starts[-1] + item.num_tokens)
            if item.samples:
                logit_rows.append(starts[-1] - 1)
        for _, first, span_positions in prompt_spans or ():
            logit_rows.extend(range(first, first + len(span_positions)))
        ids = np.asarray(token_ids, dtype=np.int32)
        return ForwardBatch(
            token_ids=ids,
            positions=np.asarray(positions, dtype=np.int32),
            slot_mapping=np.asarray(slots, dtype=np.int64),
            block_tables=np.asarray(tables, dtype=np.int32).reshape(len(scheduled), max_blocks),
            seq_lens=np.asarray(seq_lens, dtype=np.int32),
            query_start_loc=np.asarray(starts, dtype=np.int32),
            logit_rows=np.asarray(logit_rows, dtype=np.int32),
            prompt_rows=_gather_prompt_rows(ids, tabled, self.model.config.vocab_size),
        )

    def run(self, scheduled: list[ScheduledSeq]) -> RunOutput:
        """Forward one step over the scheduled tokens (their blocks in place), and
        sample the exact repeats from their stored rows; no forward runs when the
        step holds nothing else.

        Returns (sequence, sampled token ids, their logits rows or None) for each
        sequence whose pending tokens all ran (one token, or a draft's kept samples
        and the first that differs from it), in schedule order, and the prompt
        entries of the positions that give a prompt_logprobs request's missing ones.
        Tokens are chosen on the device and read back once (once more for a step that
        also holds exact repeats); a logits row comes to the host only for a sequence
        that returns logits or logprobs, or, with `keep_prompt_logits`, samples its
        first token, or for prompt entries.
        """
        computed = [item for item in scheduled if item.stored_logits is None]
        out = self._forward(computed) if computed else RunOutput()
        if len(computed) == len(scheduled):
            return out
        repeats = [item for item in scheduled if item.stored_logits is not None]
        sampled = out.sampled + self._sample_stored(repeats)
        position = {id(item.seq): idx for idx, item in enumerate(scheduled)}
        sampled.sort(key=lambda result: position[id(result[0])])
        stored = [(r.seq, r.stored_embedding) for r in repeats if r.stored_embedding is not None]
        return RunOutput(sampled, out.prompt_entries, out.embeddings + stored)

    def _sample_stored(self, repeats: list[ScheduledSeq]) -> list[Sampled]:
        """Exact repeats' first tokens, drawn from their stored rows as `_forward`
        draws from the forward's: the same sampler, and the same row bits."""
        ops = self.model.ops
        rows = [cast(np.ndarray, item.stored_logits) for item in repeats]  # a repeat has its row
        logits = ops.from_host(np.stack(rows))  # [R, vocab] fp32
        seqs = [item.seq for item in repeats]
        states, positions = [seq.sampling for seq in seqs], [seq.num_tokens for seq in seqs]
        tokens, dead = next_tokens(ops, logits, ops.argmax(logits), states, positions)
        tokens = ops.to_host(tokens)
        return [
            (seq, [], None, True) if i in dead else (seq, [int(tokens[i])], rows[i][None], False)
            for i, seq in enumerate(seqs)
        ]

    def _forward(self, scheduled: list[ScheduledSeq]) -> RunOutput:
        ops = self.model.ops
        spans = _prompt_spans(scheduled)
        batch = self.build_batch(scheduled, spans)
        sampling = [item for item in scheduled if item.samples]
        embedding = [i for i, item in enumerate(sampling) if _embeds(item.seq)]
        static, hidden = None, None
        if self.decode is not None and not spans and not embedding and self.decode.fits(batch):
            static = self.decode.run(batch)  # row i is the batch's row i; None: capture failed
        if static is not None:
            logits, greedy = static
        else:
            if embedding:  # row i: the i-th that samples, as the logits' rows
                logits, hidden = self.model.forward_hidden(batch, self.kv_cache)
            else:
                logits = self.model.forward(batch, self.kv_cache)  # row i: the i-th that samples
            greedy = ops.argmax(logits[: len(logits) - _num_rows(spans)] if spans else logits)
        embeddings = _embeddings(ops, hidden, sampling, embedding) if embedding else []
        if any(item.draft for item in sampling):
            sampled, num_rows = self._sample_drafted(logits, greedy, sampling)
        else:  # the common case, kept cheap: one row a sequence
            sampled, num_rows = self._sample(logits, greedy, sampling), len(sampling)
        if not spans:
            return RunOutput(sampled, embeddings=embeddings)
        entries = _prompt_entries(ops.to_host(logits[num_rows:]), spans)
        return RunOutput(sampled, entries, embeddings)

    def _sample(self, logits: Any, greedy: Any, sampling: list[ScheduledSeq]) -> list[Sampled]:
        """The next token of each of `sampling` (one logits row each, in order), and the
        rows that come back (those of requests that return them or keep them)."""
        ops = self.model.ops
        seqs = [item.seq for item in sampling]
        states, positions = [seq.sampling for seq in seqs], [seq.num_tokens for seq in seqs]
        tokens, dead = next_tokens(ops, logits, greedy, states, positions)
        tokens = ops.to_host(tokens).tolist()
        wanted = [i for i, seq in enumerate(seqs) if self._reads_rows(seq) and i not in dead]
        row_of: dict[int, np.ndarray] = {}
        if wanted:
            rows = ops.to_host(logits[ops.from_host(np.asarray(wanted))])
            row_of = {i: rows[j : j + 1] for j, i in enumerate(wanted)}
        return [
            (seq, [], None, True) if i in dead else (seq, [tokens[i]], row_of.get(i), False)
            for i, seq in enumerate(seqs)
        ]

    def _sample_drafted(
        self, logits: Any, greedy: Any, sampling: list[ScheduledSeq]
    ) -> tuple[list[Sampled], int]:
        """`_sample` for a step with drafts: a drafted request has a row for its pending
        token and one for each draft token, each sampled at its own position with the
        state it has there if the draft before it is its (`SamplingState.ahead`, the
        grammar's masks along the draft); it keeps the samples while they equal its
        draft (`_num_kept`). Also the rows used."""
        ops = self.model.ops
        # per logits row; each item's first row
        states: list[SamplingState] = []
        positions: list[int] = []
        firsts: list[int] = []
        masks: dict[int, np.ndarray] = {}  # a drafted grammar's rows' masks
        for item in sampling:
            seq, draft = item.seq, item.draft
            first = len(states)
            firsts.append(first)
            # row j is sampled as if the draft's first j tokens were the request's
            states.extend(seq.sampling.ahead(draft[:j]) for j in range(1 + len(draft)))
            positions.extend(range(seq.num_tokens, seq.num_tokens + 1 + len(draft)))
            if draft and (grammar := seq.sampling.grammar) is not None:
                masks.update(enumerate(grammar.masks_with_draft(draft), start=first))
        tokens, dead = next_tokens(ops, logits, greedy, states, positions, masks or None)
        tokens = ops.to_host(tokens).tolist()
        reads = [self._reads_rows(item.seq) for item in sampling]
        wanted = [  # all rows of the items that read theirs, in order
            row
            for i, item in enumerate(sampling)
            if reads[i]
            for row in range(firsts[i], firsts[i] + 1 + len(item.draft))
        ]
        rows = ops.to_host(logits[ops.from_host(np.asarray(wanted))]) if wanted else None
        sampled = []
        read = 0  # rows of `rows` taken
        for i, item in enumerate(sampling):
            drawn = tokens[firsts[i] : firsts[i] + 1 + len(item.draft)]
            num_kept = _num_kept(drawn, item.draft)
            # a dead row the kept samples reach: no token comes after those before it
            ends = [r - firsts[i] for r in dead if firsts[i] <= r < firsts[i] + num_kept]
            kept = drawn[: min(ends, default=num_kept)]
            mine = None
            if reads[i]:
                assert rows is not None
                mine, read = rows[read : read + len(kept)], read + len(drawn)
            sampled.append((item.seq, kept, mine if kept else None, bool(ends)))
        return sampled, len(states)

    def _reads_rows(self, seq: Sequence) -> bool:
        """Whether a sampling sequence's logits rows come back to the host: it returns
        them (logits or logprobs), or its first token's row is kept for exact repeats."""
        return seq.sampling.reads_row or (self.keep_prompt_logits and not seq.output_token_ids)


def _embeds(seq: Sequence) -> bool:
    """Whether this step's sample is an embedding request's first: its prompt's last token."""
    return seq.params.embed and not seq.output_token_ids


def _embeddings(
    ops: Any, hidden: Any, sampling: list[ScheduledSeq], embedding: list[int]
) -> list[tuple[Sequence, np.ndarray]]:
    """The hidden rows [hidden] fp32 of the sampling sequences at `embedding`: a sequence's
    row is its last (after the rows of the drafts before it, one per drafted token)."""
    last_rows = np.cumsum([1 + len(item.draft) for item in sampling]) - 1
    rows = ops.to_host(hidden[ops.from_host(last_rows[embedding].astype(np.int32))])
    return [(sampling[i].seq, rows[j].astype(np.float32)) for j, i in enumerate(embedding)]


def _num_kept(drawn: list[int], draft: list[int]) -> int:
    """How many of a draft's samples a request keeps: those drawn where the draft's
    tokens before were its own (each equal to the sample there), and the first that
    differs, or the one after the whole draft."""
    kept = 1
    for sample, proposed in zip(drawn, draft, strict=False):
        if sample != proposed:
            break
        kept += 1
    return kept


def _prompt_spans(scheduled: list[ScheduledSeq]) -> list[PromptSpan]:
    """The chunks whose positions give prompt entries a request is missing (none for
    a request without prompt_logprobs: one attribute test each)."""
    spans: list[PromptSpan] = []
    first = 0
    for item in scheduled:
        wanted = item.seq.prompt_logprobs
        if wanted is not None and not wanted.complete:
            start = item.seq.num_computed_tokens
            positions = wanted.row_positions(start, start + item.num_tokens)
            if positions:
                spans.append((item.seq, first + positions.start - start, positions))
        first += item.num_tokens
    return spans


def _num_rows(spans: list[PromptSpan]) -> int:
    return sum(len(positions) for _, _, positions in spans)


def _prompt_entries(
    rows: np.ndarray, spans: list[PromptSpan]
) -> list[tuple[Sequence, int, EntryRows]]:
    """Entries from the spans' logits rows ([num rows, vocab] fp32 on the host, in
    span order): position p's row gives prompt token p + 1's entry."""
    out = []
    offset = 0
    for seq, _, positions in spans:
        wanted = seq.prompt_logprobs
        assert wanted is not None
        num = len(positions)
        token_ids = seq.prompt_token_ids[positions.start + 1 : positions.stop + 1]
        max_top = wanted.max_top
        entries = EntryRows.of_rows(rows[offset : offset + num], token_ids, max_top)
        out.append((seq, positions.start + 1, entries))
        offset += num
    return out


def _gather_prompt_rows(
    token_ids: np.ndarray, tabled: list[tuple[int, Sequence]], vocab_size: int
) -> np.ndarray | None:
    """The prompt-table rows the step's fake ids select, stacked; each fake id in
    `token_ids` becomes `vocab_size + ` its row's index in the stack (in place).
    None when the step has no fake id. `tabled`: (first row, sequence) of each chunk
    of a sequence with a prompt table, in row order."""
    rows: list[np.ndarray] = []
    num_rows = 0
    for idx, (first, seq) in enumerate(tabled):
        assert seq.prompt_table is not None
        last = tabled[idx + 1][0] if idx + 1 < len(tabled) else None
        chunk = token_ids[first:last]
        fake = np.flatnonzero(chunk >= vocab_size)
        if not fake.size:
            continue
        rows.append(seq.prompt_table[chunk[fake] - vocab_size])
        chunk[fake] = vocab_size + num_rows + np.arange(fake.size, dtype=np.int32)
        num_rows += fake.size
    return np.concatenate(rows) if rows else None
