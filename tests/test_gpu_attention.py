"""Both paged attention kernels (cuda/attention.cu on CUDA cores, cuda/attention_tc.cu
on tensor cores) against their NumPy twin on fresh random inputs, with the output
poisoned first, and held to DESIGN §4 bit for bit: a query's output is the same
whether it runs with its whole prompt, in a chunk of any size (unwritten future
slots holding garbage, NaN included), alone as a decode step, or batched with other
sequences in any order. Skipped without a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import dev, host, needs_gpu, poisoned

from reprise.cuda import attention_kernel, attention_tc_kernel
from reprise.cuda.attention import KV_CHUNK, paged_attention_ref
from reprise.cuda.dtypes import BF16
from reprise.cuda.kvcache import kv_cache_shape, kv_write_ref

pytestmark = [
    pytest.mark.gpu,
    needs_gpu,
]

# (num_heads, num_kv_heads, head_dim)
SHAPES = {
    "smollm2-135m": (9, 3, 64),
    "llama-3.1-8b": (32, 8, 128),
    "group-1": (8, 8, 64),
    "group-8": (16, 2, 128),
    "gemma-3-1b": (4, 1, 256),  # head_dim 256: the tensor-core kernel's in 16- and 32-key pages
}
MODEL_SHAPES = ["smollm2-135m", "llama-3.1-8b"]
BLOCK_SIZES = [16, 32, 64]
NUM_LAYERS, LAYER = 2, 1
# each kernel's launcher and the most query heads a KV head may have with it
KERNELS = {
    "cuda-cores": (attention_kernel.paged_attention, attention_kernel.ROWS_PER_CTA),
    "tensor-cores": (attention_tc_kernel.paged_attention_tc, attention_tc_kernel.ROWS_PER_CTA),
}


@pytest.fixture(params=list(KERNELS))
def kernel(request: pytest.FixtureRequest) -> str:
    return request.param


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


def bf16_close(got: np.ndarray, want: np.ndarray, ulps: int = 2) -> None:
    """Every element within `ulps` BF16 ulps of its (token, head) row's scale, and the
    whole within 1e-2 relative L2; no NaN (so every element was written)."""
    assert got.dtype == BF16 == want.dtype
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert not np.isnan(g).any(), np.argwhere(np.isnan(g))[:5]
    row_max = np.maximum(np.abs(w).max(axis=-1, keepdims=True), 1e-30)
    ulp = np.exp2(np.floor(np.log2(row_max)) - 7)
    assert np.all(np.abs(g - w) <= ulps * ulp), float(np.max(np.abs(g - w) / ulp))
    assert np.linalg.norm(g - w) <= 1e-2 * np.linalg.norm(w)


def stale(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 3.0) -> np.ndarray:
    """What a page's earlier use may leave behind: large values, some NaN."""
    x = (rng.standard_normal(shape) * scale).astype(BF16)
    x.reshape(-1)[rng.random(x.size) < 0.02] = np.nan
    return x


class PagedSequences:
    """Sequences of random K/V in a shuffled block pool; free blocks and the tail of
    each sequence's last page hold stale garbage, NaN included. `gpu` runs `kernel`."""

    def __init__(
        self,
        rng: np.random.Generator,
        shape: tuple[int, int, int],
        block_size: int,
        seq_lens: list[int],
        kernel: str,
    ) -> None:
        self.rng, self.block_size, self.kernel = rng, block_size, kernel
        self.window = 0  # a sliding window every call applies (0: none)
        self.softcap = 0.0  # a soft cap every call applies (0: none)
        self.num_heads, self.num_kv_heads, self.head_dim = shape
        num_blocks = sum(-(-s // block_size) for s in seq_lens) + 4
        shape6 = kv_cache_shape(
            num_blocks, NUM_LAYERS, self.num_kv_heads, block_size, self.head_dim
        )
        self.cache = stale(rng, shape6)
        free = list(rng.permutation(num_blocks))
        self.tables = [[int(free.pop()) for _ in range(-(-s // block_size))] for s in seq_lens]
        self.queries = []
        for table, seq_len in zip(self.tables, seq_lens, strict=True):
            kv_shape = (seq_len, self.num_kv_heads, self.head_dim)
            scale = np.exp2(rng.integers(-3, 3, size=(seq_len, self.num_kv_heads, 1)))
            k = (rng.standard_normal(kv_shape) * scale).astype(BF16)
            v = (rng.standard_normal(kv_shape) * scale).astype(BF16)
            kv_write_ref(self.cache, LAYER, k, v, self.slots(table, 0, seq_len))
            q_shape = (seq_len, self.num_heads, self.head_dim)
            self.queries.append((rng.standard_normal(q_shape) * 2).astype(BF16))
        self.device_cache = dev(self.cache)

    def slots(self, table: list[int], first: int, last: int) -> np.ndarray:
        pos = np.arange(first, last)
        return np.asarray(table)[pos // self.block_size] * self.block_size + pos % self.block_size

    def inputs(self, spans: list[tuple[int, int, int]]) -> tuple[np.ndarray, ...]:
        """q, block_tables, seq_lens, query_start_loc for (sequence, first, last) query
        spans batched in one call."""
        tables = [self.tables[b] for b, _, _ in spans]
        width = max(len(t) for t in tables)
        block_tables = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
        lens = [last - first for _, first, last in spans]
        return (
            np.concatenate([self.queries[b][first:last] for b, first, last in spans]),
            block_tables,
            np.array([last for _, _, last in spans], dtype=np.int32),
            np.cumsum([0, *lens]).astype(np.int32),
        )

    def ref(self, spans: list[tuple[int, int, int]]) -> np.ndarray:
        q, block_tables, seq_lens, query_start_loc = self.inputs(spans)
        scale = 1 / np.sqrt(self.head_dim)
        window, softcap = self.window, self.softcap
        return paged_attention_ref(
            q, self.cache, LAYER, block_tables, seq_lens, query_start_loc, scale, window, softcap
        )

    def gpu(self, spans: list[tuple[int, int, int]], cache=None, out=None):
        """The kernel's output (a device array) for the spans, on `cache` (a device
        array; default: this pool as written)."""
        q, block_tables, seq_lens, query_start_loc = self.inputs(spans)
        return KERNELS[self.kernel][0](
            dev(q),
            self.device_cache if cache is None else cache,
            LAYER,
            dev(block_tables),
            dev(seq_lens),
            dev(query_start_loc),
            1 / np.sqrt(self.head_dim),
            self.window,
            self.softcap,
            out=out,
        )

    def run(self, spans: list[tuple[int, int, int]], cache=None) -> np.ndarray:
        return host(self.gpu(spans, cache))

    def with_garbage_after(self, b: int, last: int):
        """The cache (on the device) as a chunked prefill sees it: sequence b's slots
        past `last` not yet written, holding garbage."""
        cache = self.cache.copy()
        end = len(self.tables[b]) * self.block_size
        garbage = stale(self.rng, (end - last, self.num_kv_heads, self.head_dim), scale=50.0)
        garbage[::3, 0, :5] = np.nan
        kv_write_ref(cache, LAYER, garbage, garbage, self.slots(self.tables[b], last, end))
        return dev(cache)


def mixed_spans(rng: np.random.Generator, seq_lens: list[int]) -> list[tuple[int, int, int]]:
    """Per sequence in turn: a decode step, a whole prefill, a partial prefill (a chunk
    ending at seq_len after an earlier part was computed)."""
    spans = []
    for b, seq_len in enumerate(seq_lens):
        q_len = [1, seq_len, int(rng.integers(1, seq_len + 1))][b % 3]
        spans.append((b, seq_len - q_len, seq_len))
    return spans


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_matches_its_twin(cp, rng, kernel: str, shape: str, block_size: int) -> None:
    """Decode rows, whole and partial prefills in one call, within BF16 rounding of
    paged_attention_ref; every element written; a second call gives the same bits."""
    seq_lens = [int(n) for n in rng.integers(1, 300, size=9)]
    # a one-key prompt, a prompt of exactly one page, one key into the third page
    seq_lens[1], seq_lens[3], seq_lens[5] = 1, block_size, 2 * block_size + 1
    seqs = PagedSequences(rng, SHAPES[shape], block_size, seq_lens, kernel)
    spans = mixed_spans(rng, seq_lens)
    num_tokens = sum(last - first for _, first, last in spans)
    out = poisoned((num_tokens, seqs.num_heads, seqs.head_dim), np.uint16)
    if kernel == "tensor-cores" and not attention_tc_kernel.takes(seqs.head_dim, block_size):
        # pages the tensor-core kernel lacks (Gemma 3's head of 256 in 64-key pages) are
        # refused in one line; the engine runs them on the CUDA cores
        with pytest.raises(ValueError, match="block_size must be one of"):
            seqs.gpu(spans, out=out)
        return
    assert seqs.gpu(spans, out=out) is out
    got = host(out)
    bf16_close(got, seqs.ref(spans))
    assert np.array_equal(bits(seqs.run(spans)), bits(got))  # out=None: a fresh array


@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_attention_many_sequences_in_one_call(cp, rng, kernel: str, shape: str) -> None:
    """More sequences than a warp scans at once (the CTAs find their work in rounds of
    32): every row within BF16 rounding of the twin, and the bits each gets alone."""
    seq_lens = [int(n) for n in rng.integers(1, 100, size=75)]
    seqs = PagedSequences(rng, SHAPES[shape], 32, seq_lens, kernel)
    spans = mixed_spans(rng, seq_lens)
    got = seqs.run(spans)
    bf16_close(got, seqs.ref(spans))
    starts = np.cumsum([0] + [last - first for _, first, last in spans])
    for i, span in enumerate(spans):
        alone = seqs.run([span])
        assert np.array_equal(bits(got[starts[i] : starts[i + 1]]), bits(alone)), span


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_attention_query_independent_of_chunking(
    cp, rng, kernel: str, shape: str, block_size: int
) -> None:
    """A query's output is bit-identical whether it runs with its whole prompt, in a
    chunk of any size (unwritten future slots holding garbage, NaN included), or alone
    as a decode step (chunks of 1)."""
    seq_len = int(rng.integers(150, 260))
    seqs = PagedSequences(rng, SHAPES[shape], block_size, [seq_len], kernel)
    whole = seqs.run([(0, 0, seq_len)])
    bf16_close(whole, seqs.ref([(0, 0, seq_len)]))
    for chunk in (1, 7, 16, 32, 33, 50):
        pieces = []
        for first in range(0, seq_len, chunk):
            last = min(first + chunk, seq_len)
            pieces.append(seqs.run([(0, first, last)], seqs.with_garbage_after(0, last)))
        assert np.array_equal(bits(np.concatenate(pieces)), bits(whole)), chunk


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_attention_query_independent_of_other_sequences(
    cp, rng, kernel: str, shape: str, block_size: int
) -> None:
    """Seven sequences of random lengths batched in one call in random order, each with
    a decode step, a whole or a partial prefill, give every query the bits it gets in
    its span alone and alone as a decode step."""
    seq_lens = [int(n) for n in rng.integers(1, 200, size=7)]
    seqs = PagedSequences(rng, SHAPES[shape], block_size, seq_lens, kernel)
    spans = []
    for b, seq_len in enumerate(seq_lens):
        q_len = int(rng.choice([1, seq_len, rng.integers(1, seq_len + 1)]))
        spans.append((b, seq_len - q_len, seq_len))
    order = rng.permutation(len(spans))
    batched = seqs.run([spans[i] for i in order])
    starts = np.cumsum([0] + [spans[i][2] - spans[i][1] for i in order])
    for row, i in enumerate(order):
        b, first, last = spans[i]
        got = batched[starts[row] : starts[row + 1]]
        assert np.array_equal(bits(got), bits(seqs.run([(b, first, last)]))), (b, "alone")
        for pos in range(first, last):
            alone = seqs.run([(b, pos, pos + 1)])
            assert np.array_equal(bits(alone), bits(got[pos - first : pos - first + 1])), (b, pos)


def test_attention_rejects_bad_inputs(cp, rng, kernel: str) -> None:
    num_heads, num_kv_heads, head_dim = SHAPES["smollm2-135m"]
    seqs = PagedSequences(rng, (num_heads, num_kv_heads, head_dim), 16, [20, 5], kernel)
    q, block_tables, seq_lens, query_start_loc = (
        dev(x) for x in seqs.inputs([(0, 0, 20), (1, 4, 5)])
    )
    cache = seqs.device_cache
    good = dict(
        q=q,
        cache=cache,
        layer=LAYER,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        scale=0.125,
    )
    launch, max_group = KERNELS[kernel]
    launch(**good)  # the baseline is accepted

    def rejects(match: str, **change) -> None:
        with pytest.raises(ValueError, match=match):
            launch(**{**good, **change})

    rejects("q must be a 3-d uint16", q=q.astype(np.float32))
    rejects("q must be a 3-d uint16", q=q.reshape(q.shape[0], -1))
    rejects("q must be C-contiguous", q=cp.asfortranarray(q))
    rejects("q must be a CuPy", q=host(q))
    rejects("seq_lens must be a CuPy", seq_lens=host(seq_lens))
    rejects("cache must be a 6-d uint16", cache=cache[0])
    rejects("block_tables must be a 2-d int32", block_tables=block_tables.astype(np.int64))
    rejects("seq_lens must be a 1-d int32", seq_lens=seq_lens.astype(np.uint32))
    rejects("head_dim must be one of", q=cp.zeros((21, num_heads, 96), dtype=np.uint16))
    rejects("cache must be", cache=cp.zeros((*cache.shape[:5], 128), dtype=np.uint16))
    rejects("cache must be", cache=cp.zeros((*cache.shape[:2], 3, *cache.shape[3:]), np.uint16))
    rejects("block_size must be one of", cache=cp.zeros((*cache.shape[:4], 8, 64), np.uint16))
    rejects("must be a multiple of num_kv_heads", q=cp.zeros((21, 10, head_dim), np.uint16))
    big_group = 3 * (max_group + 1)  # three KV heads
    rejects(f"must be at most {max_group}", q=cp.zeros((21, big_group, head_dim), np.uint16))
    rejects("layer must be in", layer=NUM_LAYERS)
    rejects("layer must be in", layer=-1)
    rejects("seq_lens must be", seq_lens=seq_lens[:1])
    rejects("query_start_loc", query_start_loc=query_start_loc[:2])
    rejects("holds no pages", block_tables=cp.zeros((2, 0), np.int32))
    rejects("out must have q's shape", out=cp.zeros((20, num_heads, head_dim), np.uint16))
    rejects("out must be a 3-d uint16", out=cp.zeros(q.shape, np.float32))
    rejects(
        "q must start on a 16-byte boundary", q=cp.zeros(q.size + 1, np.uint16)[1:].reshape(q.shape)
    )


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_attention_long_llama_prefill(cp, rng, kernel: str, block_size: int) -> None:
    """A 700-token prefill at Llama-3.1-8B shapes (many CTAs a sequence; the tensor-core
    kernel's page ring wrapped many times): within BF16 rounding of the twin, and the
    same bits when cut in chunks of 256 and 333 (garbage past each), or run after
    another prefill."""
    seq_len = 700
    seqs = PagedSequences(rng, SHAPES["llama-3.1-8b"], block_size, [seq_len, 300], kernel)
    whole = seqs.run([(0, 0, seq_len)])
    bf16_close(whole, seqs.ref([(0, 0, seq_len)]))
    for chunk in (256, 333):
        pieces = []
        for first in range(0, seq_len, chunk):
            last = min(first + chunk, seq_len)
            pieces.append(seqs.run([(0, first, last)], seqs.with_garbage_after(0, last)))
        assert np.array_equal(bits(np.concatenate(pieces)), bits(whole)), chunk
    batched = seqs.run([(1, 0, 300), (0, 0, seq_len)])
    assert np.array_equal(bits(batched[300:]), bits(whole))


def tc_grid(seqs: PagedSequences, spans: list[tuple[int, int, int]]) -> attention_kernel.SplitGrid:
    """split_grid's geometry for the spans batched in one tensor-core launch."""
    q, block_tables, _, _ = seqs.inputs(spans)
    return attention_kernel.split_grid(
        q.shape[0], len(spans), seqs.num_kv_heads, seqs.num_heads // seqs.num_kv_heads,
        block_tables.shape[1], seqs.block_size, attention_tc_kernel.ROWS_PER_CTA,
    )  # fmt: skip


def tc_ring(seqs: PagedSequences, spans: list[tuple[int, int, int]], *, deep: bool) -> np.ndarray:
    """The tensor-core kernel's output for the spans on split_grid's grid, through its
    deep ring's entry point (split grids only) or its normal one's, whichever the
    launcher would take."""
    import cupy

    q, block_tables, seq_lens, query_start_loc = seqs.inputs(spans)
    head_dim, block_size = seqs.head_dim, seqs.block_size
    name = attention_tc_kernel.kernel_name(head_dim, block_size, deep=deep)
    smem = attention_tc_kernel.smem_bytes(head_dim, block_size, deep=deep)
    fn = attention_tc_kernel._kernel(name, smem, int(cupy.cuda.runtime.getDevice()))
    out = poisoned(q.shape, np.uint16)
    attention_kernel.launch(lambda grid: (fn, smem), attention_tc_kernel.ROWS_PER_CTA, out,
                            dev(q), seqs.device_cache, LAYER, dev(block_tables), dev(seq_lens),
                            dev(query_start_loc), 1 / np.sqrt(head_dim), workspace=None)  # fmt: skip
    return host(out)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_attention_tc_deep_ring_gives_the_normal_rings_bits(cp, rng, block_size: int) -> None:
    """The tensor-core kernel's deep ring (which its launcher takes for split launches,
    the only ones it runs) against its normal ring on the same grids, on the device
    (asynchronous copy groups and barriers as the hardware runs them, which the emulator only
    models): Llama-3.1-8B decode steps at 1, S - 1, S, S + 1 and 3S + 7 keys (S =
    KV_CHUNK) and two random lengths, batch 7 and each alone, where split_grid splits
    them, bit for bit, the launcher's output too; within BF16 rounding of the twin."""
    s = KV_CHUNK
    seq_lens = [1, s - 1, s, s + 1, 3 * s + 7, *(int(n) for n in rng.integers(2, 2 * s, size=2))]
    seqs = PagedSequences(rng, SHAPES["llama-3.1-8b"], block_size, seq_lens, "tensor-cores")
    decode = [(b, n - 1, n) for b, n in enumerate(seq_lens)]
    split = [
        spans for spans in (decode, *([span] for span in decode)) if tc_grid(seqs, spans).splits
    ]
    assert decode in split and len(split) > 1, split
    for spans in split:
        deep = tc_ring(seqs, spans, deep=True)
        assert np.array_equal(bits(deep), bits(tc_ring(seqs, spans, deep=False))), spans
        assert np.array_equal(bits(deep), bits(seqs.run(spans))), spans
        if spans is decode:
            bf16_close(deep, seqs.ref(decode))


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_attention_tc_shared_page_gives_the_same_bits(
    cp, rng, monkeypatch: pytest.MonkeyPatch, shape: str, block_size: int
) -> None:
    """The shared page (attention_tc_kernel.COOP: a split launch's CTA of one m16 tile of
    rows runs each page on all four warps) on the device, where the warps truly run at
    once: decode steps at 1, S - 1, S, S + 1 and 3S + 7 keys and two random lengths,
    batch 7 and each alone, and a launch holding a prefill too, bit for bit the default
    build's, twice (counters left zero); within BF16 rounding of the twin."""
    s = KV_CHUNK
    seq_lens = [1, s - 1, s, s + 1, 3 * s + 7, *(int(n) for n in rng.integers(2, 2 * s, size=2))]
    seqs = PagedSequences(rng, SHAPES[shape], block_size, seq_lens, "tensor-cores")
    decode = [(b, n - 1, n) for b, n in enumerate(seq_lens)]
    mixed = [*decode[:4], (4, 0, seq_lens[4])]
    cases = [decode, *([span] for span in decode), mixed]
    assert any(tc_grid(seqs, spans).splits for spans in cases)
    want = [bits(seqs.run(spans)) for spans in cases]
    monkeypatch.setattr(attention_tc_kernel, "COOP", True)
    for _ in range(2):
        for spans, expected in zip(cases, want, strict=True):
            assert np.array_equal(bits(seqs.run(spans)), expected), spans
    bf16_close(seqs.run(decode), seqs.ref(decode))


def spans_keep_their_bits(seqs: PagedSequences, spans: list, got: np.ndarray) -> None:
    """Each span run alone, and each span's last row run as a decode step, gives the bits
    it had in the batch `got`."""
    starts = np.cumsum([0] + [last - first for _, first, last in spans])
    for i, (b, first, last) in enumerate(spans):
        alone = seqs.run([(b, first, last)])
        assert np.array_equal(bits(got[starts[i] : starts[i + 1]]), bits(alone)), (b, "alone")
        step = seqs.run([(b, last - 1, last)])
        assert np.array_equal(bits(got[starts[i + 1] - 1 : starts[i + 1]]), bits(step)), b


@pytest.mark.parametrize("window", [1, 17, KV_CHUNK - 1, KV_CHUNK + 1, 2 * KV_CHUNK + 3])
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_windowed_attention_matches_its_twin_and_keeps_its_bits(
    cp, rng, kernel: str, shape: str, window: int
) -> None:
    """A sliding window: decodes, whole and partial prefills (some over many KV chunks,
    so rows and CTAs start past chunk 0) within BF16 rounding of the twin with the same
    window; each span alone and each prefill's last row as a decode step, the same bits."""
    seq_lens = [int(n) for n in rng.integers(1, 4 * KV_CHUNK, size=9)]
    seq_lens[0], seq_lens[2] = 3 * KV_CHUNK + 7, 1
    seqs = PagedSequences(rng, SHAPES[shape], 16, seq_lens, kernel)
    seqs.window = window
    spans = mixed_spans(rng, seq_lens)
    got = seqs.run(spans)
    bf16_close(got, seqs.ref(spans))
    spans_keep_their_bits(seqs, spans, got)
    seqs.window = 0
    assert not np.array_equal(bits(seqs.run(spans)), bits(got))  # the window binds


@pytest.mark.parametrize(
    ("window", "softcap", "loudness"),
    [(0, 50.0, 8), (KV_CHUNK + 1, 2.0, 1)],
    ids=["cap50-loud", "cap2-window"],
)
@pytest.mark.parametrize("shape", [*MODEL_SHAPES, "gemma-3-1b"])
def test_softcapped_attention_matches_its_twin_and_keeps_its_bits(
    cp, rng, kernel: str, shape: str, window: int, softcap: float, loudness: int
) -> None:
    """Gemma 2's soft cap (the twin's `softcap`: each scaled score s becomes c * tanh(s / c)
    before the mask): a cap of 50 on queries 8 times louder (exact in BF16; scores past
    it), and one of 2 under a window; decodes, whole and partial prefills (some over many
    KV chunks) within BF16 rounding of the capped twin; each span alone and each prefill's
    last row as a decode step, the same bits; the cap binds; a cap of 0 gives the bits of a
    launch without the argument."""
    seq_lens = [int(n) for n in rng.integers(1, 4 * KV_CHUNK, size=9)]
    seq_lens[0], seq_lens[2] = 3 * KV_CHUNK + 7, 1
    seqs = PagedSequences(rng, SHAPES[shape], 16, seq_lens, kernel)
    seqs.queries = [(q.astype(np.float32) * loudness).astype(BF16) for q in seqs.queries]
    seqs.window, seqs.softcap = window, softcap
    spans = mixed_spans(rng, seq_lens)
    got = seqs.run(spans)
    bf16_close(got, seqs.ref(spans))
    spans_keep_their_bits(seqs, spans, got)
    seqs.softcap = 0.0
    plain = seqs.run(spans)
    assert not np.array_equal(bits(plain), bits(got))  # the cap binds
    q, tables, lens, starts = (dev(x) for x in seqs.inputs(spans))
    scale = 1 / np.sqrt(seqs.head_dim)
    without = KERNELS[kernel][0](q, seqs.device_cache, LAYER, tables, lens, starts, scale, window)
    assert np.array_equal(bits(host(without)), bits(plain))


@pytest.mark.parametrize("window", [0, 512])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_head_dim_256(cp, rng, kernel: str, block_size: int, window: int) -> None:
    """Gemma 3's head (256; the CUDA-core kernel stages a 128-dim part at a time, the
    tensor-core one takes 16- and 32-key pages on its normal ring): decodes, whole and
    partial prefills within BF16 rounding of the twin, its 512 window or none; each span
    alone and each prefill's last row as a decode step, the same bits."""
    if not attention_tc_kernel.takes(256, block_size) and kernel == "tensor-cores":
        pytest.skip("64-key pages of 256: the CUDA-core kernel's alone")
    seq_lens = [int(n) for n in rng.integers(1, 4 * KV_CHUNK, size=7)]
    seq_lens[0], seq_lens[2] = 3 * KV_CHUNK + 7, 1
    seqs = PagedSequences(rng, SHAPES["gemma-3-1b"], block_size, seq_lens, kernel)
    seqs.window = window
    spans = mixed_spans(rng, seq_lens)
    got = seqs.run(spans)
    bf16_close(got, seqs.ref(spans))
    spans_keep_their_bits(seqs, spans, got)
