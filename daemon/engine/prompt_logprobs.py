"""Prompt logprobs (SamplingParams.prompt_logprobs), served from the cache.

Entry t of a prompt is the log-probability of token t given tokens [0, t) (and
the `num_top` most likely tokens there): `token_logprobs` of the logits row of
position t - 1. Entry 0 has no context and is None, as in vLLM.

A full prompt block's entries (those of its own tokens, the first from the
previous block's last position) are a function of its digest alone: the digest
fixes every token before and in the block (and the namespace, the extra ids and
the model), and each row is bit-identical however its prefix was computed
(DESIGN §4). So `PromptLogprobStore` keeps them by digest, top-`max_top` (the
engine's `max_prompt_logprobs`), and a request asking for n <= max_top takes a
prefix of the top list (`ranked` orders like a stable sort, so the top n of a
row are the first n of its top max_top).

A prompt's tail (its tokens past the last full block, when it does not end on a
block boundary) is no block, but its entries are a function of its tail key alone
(`tail_key`: the tail's tokens chained to the full blocks' keys, as the exact-repeat
key is), so the store keeps them by that key too, in memory only (a sidecar belongs to
a block file). A repeated prompt whose full blocks' and tail's entries are all kept
is then admitted as one without prompt logprobs: it computes no extra token.

Admission (kvmanager) takes the stored entries of the prompt's leading full
blocks (the last one's too, which the KV match leaves out to compute the last
token) and of its tail, and matches, for a request still missing entries, only
leading blocks whose entries it has. If it matched m > 0 blocks and
entry m * bs is unknown, the row of position m * bs - 1 must be computed here:
it backs off one token (the last matched block's first bs - 1 tokens are copied
into a block of its own, as partial reuse does), so that row comes out of this
request's own forward. No hidden state is stored.

The store is an LRU bounded by the number of blocks the device pool and the host
tier hold together, so every block the pool can keep may keep its entries; it
does not follow the pool's evictions, since an entry whose block is gone is
never wrong, only unused until the block is computed again.

With a disk tier, every block's entries stored are also written as the block's
sidecar file (disk.py `put_sidecar`: by the writer thread, dropped when its queue
is full), and an entry missing here is looked up there (`get_sidecar`: checksummed
and of this block's digest; a body of the wrong shape is removed too) and kept
here again, so after a restart a prompt's entries come from disk, not a forward.
The bytes round-trip exactly (fp32 and int32 as stored). A sidecar holds top
`k` >= max_top (a larger k from a run with a larger max_prompt_logprobs is cut).
"""

from __future__ import annotations

import operator
import struct
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, overload

import numpy as np

from ...blockpool.hashing import BlockHash, sha256
from ...cuda.dtypes import F32
from .sampling.logprobs import TokenLogprobs, token_logprobs


@dataclass(slots=True)
class EntryRows:
    """Entries of consecutive prompt tokens as arrays (compact: a stored block of 32
    tokens with top 20 takes 5 KiB, not the 70 KiB of TokenLogprobs objects)."""

    logprobs: np.ndarray  # [n] fp32: each token's own logprob
    ranks: np.ndarray  # [n] int32: each token's own rank (TokenLogprobs.rank)
    top_ids: np.ndarray  # [n, max_top] int32, most likely first
    top_logprobs: np.ndarray  # [n, max_top] fp32

    @classmethod
    def of_rows(cls, rows: np.ndarray, token_ids: Sequence[int], max_top: int) -> EntryRows:
        """Entries of `token_ids` from their logits rows ([n, vocab] fp32, row i the
        distribution token_ids[i] was drawn from), through `token_logprobs`."""
        num = len(token_ids)
        out = cls.empty(num, max_top)
        for idx in range(num):
            entry = token_logprobs(rows[idx], token_ids[idx], max_top)
            out.logprobs[idx] = entry.logprob
            out.ranks[idx] = entry.rank
            if max_top:
                out.top_ids[idx] = [t for t, _ in entry.top]
                out.top_logprobs[idx] = [v for _, v in entry.top]
        return out

    @classmethod
    def empty(cls, num: int, max_top: int) -> EntryRows:
        return cls(
            np.zeros(num, dtype=F32),
            np.zeros(num, dtype=np.int32),
            np.zeros((num, max_top), dtype=np.int32),
            np.zeros((num, max_top), dtype=F32),
        )

    @classmethod
    def joined(cls, parts: Sequence[EntryRows], num_top: int) -> EntryRows:
        """The entries of `parts` in turn, as one, top lists cut to `num_top`."""
        return cls(
            np.concatenate([part.logprobs for part in parts]),
            np.concatenate([part.ranks for part in parts]),
            np.concatenate([part.top_ids[:, :num_top] for part in parts]),
            np.concatenate([part.top_logprobs[:, :num_top] for part in parts]),
        )

    def __len__(self) -> int:
        return int(self.logprobs.shape[0])

    def cut(self, span: slice) -> EntryRows:
        """A copy of the entries of `span`."""
        return EntryRows(
            self.logprobs[span].copy(),
            self.ranks[span].copy(),
            self.top_ids[span].copy(),
            self.top_logprobs[span].copy(),
        )

    def put(self, first: int, rows: EntryRows) -> None:
        """Write `rows` over the entries from `first` on."""
        end = first + len(rows)
        self.logprobs[first:end] = rows.logprobs
        self.ranks[first:end] = rows.ranks
        self.top_ids[first:end] = rows.top_ids
        self.top_logprobs[first:end] = rows.top_logprobs

    def to_bytes(self) -> bytes:
        """Number of entries and max_top, then the four arrays' bytes (little-endian)."""
        num, max_top = self.top_ids.shape
        return b"".join(
            (
                _SHAPE.pack(num, max_top),
                self.logprobs.astype("<f4").tobytes(),
                self.ranks.astype("<i4").tobytes(),
                self.top_ids.astype("<i4").tobytes(),
                self.top_logprobs.astype("<f4").tobytes(),
            )
        )

    @classmethod
    def of_bytes(cls, data: bytes, num: int, max_top: int) -> EntryRows:
        """Rows written by `to_bytes`, `num` of them, cut to top `max_top`; ValueError
        when `data` holds another number of entries, fewer than max_top or other sizes."""
        if len(data) < _SHAPE.size:
            raise ValueError(f"{len(data)} bytes")
        got_num, got_top = _SHAPE.unpack_from(data)
        if got_num != num or got_top < max_top:
            raise ValueError(f"{got_num} entries of top {got_top}; need {num} of top {max_top}")
        cells = num * got_top
        if len(data) != _SHAPE.size + 4 * (2 * num + 2 * cells):
            raise ValueError(f"{len(data)} bytes for {num} entries of top {got_top}")
        at = _SHAPE.size
        logprobs = np.frombuffer(data, "<f4", num, at)
        ranks = np.frombuffer(data, "<i4", num, at + 4 * num)
        top_ids = np.frombuffer(data, "<i4", cells, at + 8 * num).reshape(num, got_top)
        top_logprobs = np.frombuffer(data, "<f4", cells, at + 4 * (2 * num + cells))
        top_logprobs = top_logprobs.reshape(num, got_top)
        return cls(
            logprobs.astype(F32),
            ranks.astype(np.int32),
            np.ascontiguousarray(top_ids[:, :max_top], dtype=np.int32),
            np.ascontiguousarray(top_logprobs[:, :max_top], dtype=F32),
        )


_SHAPE = struct.Struct("<II")  # entries, max_top
# A tail's entries are kept by this tag and the tail's block-style digest: the tag keeps
# the key apart from every block key.
_TAIL_TAG = b"reprise/prompt-logprobs-tail\x00v1\x00"


def tail_key(tail_digest: BlockHash) -> BlockHash:
    """The store's key of the entries of a prompt tail that hashes to `tail_digest`."""
    return BlockHash(sha256(_TAIL_TAG + tail_digest))


class SidecarStore(Protocol):
    """Where entries persist (the disk tier's sidecars, blockpool/disk.py)."""

    @property
    def enabled(self) -> bool: ...

    def put_sidecar(self, block_hash: BlockHash, body: bytes) -> bool: ...

    def get_sidecar(self, block_hash: BlockHash) -> bytes | None: ...

    def drop_sidecar(self, block_hash: BlockHash, detail: str) -> None: ...


class PromptLogprobStore:
    """Block digest -> the EntryRows of its `block_size` tokens, least recently used
    dropped past `max_blocks`."""

    def __init__(
        self,
        max_blocks: int,
        max_top: int,
        *,
        block_size: int = 0,
        disk: SidecarStore | None = None,
    ) -> None:
        assert max_blocks >= 1, max_blocks
        assert disk is None or block_size >= 1, block_size
        self.max_blocks = max_blocks
        self.max_top = max_top
        self.block_size = block_size
        self.disk = disk  # None: entries live in memory only
        self._entries: OrderedDict[BlockHash, EntryRows] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def get(self, block_hash: BlockHash) -> EntryRows | None:
        rows = self._entries.get(block_hash)
        if rows is not None:
            self._entries.move_to_end(block_hash)
            return rows
        if self.disk is None or not self.disk.enabled:
            return None
        body = self.disk.get_sidecar(block_hash)
        if body is None:
            return None
        try:
            rows = EntryRows.of_bytes(body, self.block_size, self.max_top)
        except ValueError as exc:
            self.disk.drop_sidecar(block_hash, str(exc))
            return None
        self._keep(block_hash, rows)
        return rows

    def get_run(self, hashes: Sequence[BlockHash]) -> list[EntryRows]:
        """`get` of each of `hashes` in turn, up to the first not stored."""
        found: list[EntryRows] = []
        entries = self._entries
        lookup, touch = entries.get, entries.move_to_end
        for block_hash in hashes:
            rows = lookup(block_hash)
            if rows is not None:
                touch(block_hash)
            elif (rows := self.get(block_hash)) is None:  # a sidecar on disk, if any
                break
            found.append(rows)
        return found

    def put(self, block_hash: BlockHash, rows: EntryRows) -> None:
        self._keep(block_hash, rows)
        if self.disk is not None and self.disk.enabled:
            self.disk.put_sidecar(block_hash, rows.to_bytes())

    def get_tail(self, key: BlockHash) -> EntryRows | None:
        """A prompt tail's entries (`tail_key`), kept in memory only."""
        rows = self._entries.get(key)
        if rows is not None:
            self._entries.move_to_end(key)
        return rows

    def put_tail(self, key: BlockHash, rows: EntryRows) -> None:
        self._keep(key, rows)

    def _keep(self, block_hash: BlockHash, rows: EntryRows) -> None:
        self._entries[block_hash] = rows
        self._entries.move_to_end(block_hash)
        while len(self._entries) > self.max_blocks:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


@dataclass(slots=True)
class PromptLogprobs:
    """One request's prompt entries as they become known, stored or computed.

    NOTE: entries [0, num_known) are known (entry 0, None, always is); computed rows
    extend them in order, and while some are unknown the request's computed tokens
    stay below num_known, so the row of position num_known - 1 is still to come. They
    are kept as the pieces they came in, in order, each shared rather than copied (a
    stored block's rows are the store's own object): no piece is written after it is
    made, and a 2k prompt's 64 stored blocks join in 64 list appends, not 256 array
    writes."""

    num_top: int  # what the request asked for (<= max_top)
    token_ids: list[int]  # the prompt's
    block_size: int
    max_top: int  # of every piece's top lists (the engine's max_prompt_logprobs)
    # entries [0, num_known) in order (entry 0's row is unused), or none while only entry
    # 0 is known
    pieces: list[EntryRows]
    num_known: int = 1
    num_stored_blocks: int = 0  # leading blocks whose entries are in the store
    tail_stored: bool = False  # the tail's entries are in the store (or there is no tail)

    @classmethod
    def build(
        cls, num_top: int, token_ids: list[int], block_size: int, max_top: int
    ) -> PromptLogprobs:
        return cls(num_top, token_ids, block_size, max_top, [])

    @property
    def num_prompt(self) -> int:
        return len(self.token_ids)

    @property
    def complete(self) -> bool:
        return self.num_known == self.num_prompt

    def row_positions(self, start: int, end: int) -> range:
        """Positions in [start, end) whose logits rows give still unknown entries."""
        return range(max(start, self.num_known - 1), min(end, self.num_prompt - 1))

    def add(self, first: int, rows: EntryRows) -> None:
        """Record entries of tokens [first, first + len(rows)), computed or stored (those
        already known are the same bits, DESIGN §4, and are not taken again)."""
        assert first <= self.num_known, (first, self.num_known)
        end = first + len(rows)
        if end <= self.num_known:
            return
        if not self.pieces:  # entry 0 (None) needs no row: any row stands in for it
            assert first <= 1, first
            self.pieces += [EntryRows.empty(1, self.max_top), rows] if first else [rows]
            self.num_known = end
            return
        skip = self.num_known - first
        self.pieces.append(rows if skip == 0 else rows.cut(slice(skip, None)))
        self.num_known = end

    def take_stored(self, hashes: Sequence[BlockHash], store: PromptLogprobStore) -> None:
        """Fill the entries of the leading blocks of `hashes` (the prompt's full blocks'
        keys) that are stored, up to the first neither known nor stored. Blocks past
        the KV match count too: an entry needs its block's key, not its KV."""
        bs = self.block_size
        first = self.num_known // bs  # the blocks before are known
        found = store.get_run(hashes[first:])
        if not found:
            return
        self.add(first * bs, found[0])
        self.pieces += found[1:]  # whole blocks, each starting where the last ended
        self.num_known = (first + len(found)) * bs
        self.num_stored_blocks = max(self.num_stored_blocks, first + len(found))

    @property
    def tail_start(self) -> int:
        """The first token past the prompt's last full block."""
        return self.num_prompt // self.block_size * self.block_size

    def take_stored_tail(self, key: BlockHash, store: PromptLogprobStore) -> None:
        """Fill the tail's entries from the store, once every full block's are known."""
        start = self.tail_start
        if self.num_known != start or start == self.num_prompt:
            return
        rows = store.get_tail(key)
        if rows is not None and len(rows) == self.num_prompt - start:
            self.add(start, rows)
            self.tail_stored = True

    def store_tail(self, key: BlockHash, store: PromptLogprobStore) -> None:
        """Put the tail's entries into the store once all are known (once)."""
        start = self.tail_start
        if self.tail_stored or not self.complete or start == self.num_prompt:
            return
        store.put_tail(key, self._span(start, self.num_prompt))
        self.tail_stored = True

    def store_new(self, hashes: Sequence[BlockHash], store: PromptLogprobStore) -> None:
        """Put the entries of every full block now known into the store (`hashes`: the
        keys of the leading `num_known // block_size` blocks)."""
        bs = self.block_size
        num_full = self.num_known // bs
        for idx in range(self.num_stored_blocks, num_full):
            store.put(hashes[idx], self._span(idx * bs, (idx + 1) * bs))
        self.num_stored_blocks = max(self.num_stored_blocks, num_full)

    def _span(self, start: int, end: int) -> EntryRows:
        """A copy of the known entries [start, end), from the pieces holding them."""
        assert end <= self.num_known, (end, self.num_known)
        parts, at = [], 0
        for piece in self.pieces:
            lo, hi = max(start, at), min(end, at + len(piece))
            if lo < hi:
                parts.append(piece.cut(slice(lo - at, hi - at)))
            at += len(piece)
            if at >= end:
                break
        return parts[0] if len(parts) == 1 else EntryRows.joined(parts, self.max_top)

    def entries(self) -> PromptEntries:
        """One per prompt token, the first None; top lists cut to `num_top`."""
        assert self.complete, (self.num_known, self.num_prompt)
        pieces = self.pieces or [EntryRows.empty(1, self.max_top)]  # a one-token prompt's
        return PromptEntries(self.token_ids, tuple(pieces), self.num_top)


class PromptEntries(Sequence[TokenLogprobs | None]):
    """A finished request's prompt entries (Completion.prompt_logprobs): one per prompt
    token, the first None, each TokenLogprobs made when it is read. A list of them would
    be made whether read or not: 2,047 objects for a 2k prompt took 3 ms, 15x the whole
    of an exact repeat's request. Equal to any sequence of the same entries (a list of
    them included); slices are lists."""

    __slots__ = ("_arrays", "_num_top", "_pieces", "_token_ids")
    __hash__ = None  # type: ignore[assignment]  # equal to lists, which do not hash

    def __init__(self, token_ids: Sequence[int], pieces: Sequence[EntryRows], num_top: int) -> None:
        self._token_ids = token_ids
        self._pieces = pieces
        self._num_top = num_top
        self._arrays: EntryRows | None = None  # the pieces joined, at the first read

    def rows(self) -> EntryRows:
        """Every entry as arrays ([num_prompt], top lists [num_prompt, num_top]; row 0
        unused): what a reader of many entries takes at once."""
        if self._arrays is None:
            joined = EntryRows.joined(self._pieces, self._num_top)
            assert len(joined) == len(self._token_ids), (len(joined), len(self._token_ids))
            self._arrays, self._pieces = joined, (joined,)
        return self._arrays

    def __len__(self) -> int:
        return len(self._token_ids)

    @overload
    def __getitem__(self, index: int) -> TokenLogprobs | None: ...

    @overload
    def __getitem__(self, index: slice) -> list[TokenLogprobs | None]: ...

    def __getitem__(self, index: int | slice) -> TokenLogprobs | list[TokenLogprobs | None] | None:
        if isinstance(index, slice):
            return list(self._made(range(len(self))[index]))
        idx = operator.index(index)
        idx += len(self) if idx < 0 else 0
        if not 0 <= idx < len(self):
            raise IndexError(f"prompt entry {index} of {len(self)}")
        return next(self._made((idx,)))

    def __iter__(self) -> Iterator[TokenLogprobs | None]:
        return self._made(range(len(self)))

    def _made(self, positions: Sequence[int]) -> Iterator[TokenLogprobs | None]:
        """The entries of `positions` (each in range), made from the rows read at once."""
        rows, token_ids = self.rows(), self._token_ids
        at = np.asarray(positions, dtype=np.intp)
        logprobs, ranks = rows.logprobs[at].tolist(), rows.ranks[at].tolist()
        top_ids, top_logprobs = rows.top_ids[at].tolist(), rows.top_logprobs[at].tolist()
        for k, idx in enumerate(positions):
            if idx == 0:
                yield None  # the first token has no context
            else:
                top = tuple(zip(top_ids[k], top_logprobs[k], strict=True))
                yield TokenLogprobs(token_ids[idx], logprobs[k], top, ranks[k])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PromptEntries | list | tuple):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"PromptEntries({list(self)!r})"
