"""decode_block.cu's persistent layer tail in the emulated CuPy (tests/kernel_emu/emucupy.py,
its grid run as one cluster of CTAs that meet at grid barriers): the same bits as the
op-by-op path it replaces (CupyBackend's gemm_add_rmsnorm, swiglu, gemm_add_rmsnorm, the
emulated gemm.cu, add_rmsnorm and silu_mul kernels), whatever the grid's size, on the plain
and the packed (and gated) weight layouts, and within BF16 rounding of the NumPy twin."""

from __future__ import annotations

import ctypes
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from kernel_emu import emucupy
from test_cupy_emulated import PARAMS, Engines, assert_identical, emulated, model_dir, random_prompt
from test_kernels_compile import compiled, nvrtc_or_skip

from reprise.cuda import decode_block_kernel, gemm_kernel, pdl
from reprise.cuda.decode_block import decode_tail_ref
from reprise.cuda.dtypes import BF16

pytestmark = pytest.mark.kernels
__all__ = ["emulated", "model_dir"]  # fixtures, used by name

EPS = 1e-5
# (q_size, hidden, inter): the emulated model's (o and down split in two, gate_up
# unsplit), and one whose every projection splits, with N not a multiple of 64
SHAPES = {"emulated": (384, 256, 512), "uneven": (512, 320, 704)}


@pytest.fixture(autouse=True)
def launched(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The emulated device has one SM (emucupy's properties), so a persistent grid would be
    one CTA whatever a test asks: here it has 16 (the occupancy calculator asked afresh),
    so `num_ctas` makes the grid. Returns each persistent launch's CTAs, in order."""
    monkeypatch.setattr(decode_block_kernel, "_num_sms", lambda device: 16)
    decode_block_kernel._resident_ctas.cache_clear()
    grids: list[int] = []
    launch = decode_block_kernel.launch_kernel

    def counted(fn, grid, *args, **kwargs):
        grids.append(grid[0])
        return launch(fn, grid, *args, **kwargs)

    monkeypatch.setattr(decode_block_kernel, "launch_kernel", counted)
    yield grids
    decode_block_kernel._resident_ctas.cache_clear()


def operands(rng: np.random.Generator, rows: int, q_size: int, hidden: int, inter: int) -> dict:
    def bf16(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(BF16)

    return {
        "attn": bf16(rows, q_size),
        "w_o": bf16(hidden, q_size, scale=q_size**-0.5),
        "w_gate_up": bf16(2 * inter, hidden, scale=hidden**-0.5),
        "w_down": bf16(hidden, inter, scale=inter**-0.5),
        "residual": rng.standard_normal((rows, hidden)).astype(np.float32),
        "mlp_norm": (1 + 0.1 * rng.standard_normal(hidden)).astype(BF16),
        "next_norm": (1 + 0.1 * rng.standard_normal(hidden)).astype(BF16),
    }


def op_by_op(ops, d: dict) -> tuple[np.ndarray, np.ndarray]:
    """The path the persistent launch replaces, on the emulated device: (summed, normed)."""
    from reprise.cuda.kernels import to_device, to_host

    dev = {k: to_device(v) for k, v in d.items()}
    summed1, x1 = ops.gemm_add_rmsnorm(
        dev["attn"], dev["w_o"], dev["residual"], dev["mlp_norm"], EPS
    )
    h = ops.swiglu(x1, dev["w_gate_up"])
    summed, normed = ops.gemm_add_rmsnorm(h, dev["w_down"], summed1, dev["next_norm"], EPS)
    return to_host(summed, bf16=False), to_host(normed)


def persistent(d: dict, num_ctas: int, *, packed: bool = False, gated: bool = False):
    from reprise.cuda.gemm_sm90_kernel import prepare_weight
    from reprise.cuda.kernels import to_device, to_host

    weights = {}
    for name in ("w_o", "w_gate_up", "w_down"):
        bits = d[name].view(np.uint16)
        if packed:
            pw = prepare_weight(bits, gated=gated and name == "w_gate_up")
            weights[name] = type(pw)(
                to_device(pw.data.view(BF16)), pw.num_cols, pw.k, pw.swizzled, pw.gated
            )
        else:
            weights[name] = to_device(d[name])
    summed, normed = decode_block_kernel.decode_tail(
        to_device(d["attn"]), weights["w_o"], weights["w_gate_up"], weights["w_down"],
        to_device(d["residual"]), to_device(d["mlp_norm"]), to_device(d["next_norm"]), EPS,
        num_ctas=num_ctas,
    )  # fmt: skip
    return to_host(summed, bf16=False), to_host(normed)


def evict_first_bytes(lib) -> int:
    """Bytes the emulated kernels read under L2's evict-first policy (common.cuh's
    ldg_evict_first: the persistent launches' weight words) since the last call."""
    lib.emu_evict_first_bytes.restype = ctypes.c_ulonglong
    return int(lib.emu_evict_first_bytes())


def same_bits(got: tuple, want: tuple) -> None:
    for g, w, what in zip(got, want, ("summed", "normed"), strict=True):
        assert g.shape == w.shape, what
        differ = np.count_nonzero(g.view(np.uint8) != w.view(np.uint8))
        assert differ == 0, f"{what}: {differ} bytes differ"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_persistent_tail_gives_the_op_by_op_bits(
    emulated: None, launched: list[int], shape: str, rows: int
) -> None:
    from reprise.cuda.cupy_backend import CupyBackend

    d = operands(np.random.default_rng(rows + len(shape)), rows, *SHAPES[shape])
    want = op_by_op(CupyBackend(), d)
    for num_ctas in (1, 3, 7):  # fewer CTAs than items, one a tile, ...
        same_bits(persistent(d, num_ctas), want)
    assert launched == [1, 3, 7]  # the grids asked
    twin = decode_tail_ref(**d, eps=EPS)
    np.testing.assert_allclose(want[0], twin[0], rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(
        want[1].astype(np.float32), twin[1].astype(np.float32), rtol=5e-2, atol=5e-2
    )


@pytest.mark.parametrize("gated", [False, True], ids=["packed", "packed-gated"])
def test_the_packed_layouts_give_the_plain_bits(emulated: None, gated: bool) -> None:
    """gemm_sm90_kernel.prepare_weight's swizzled panels (and the gated packing's
    interleaved gate/up rows) read by the kernel give the plain layout's bits."""
    from reprise.cuda.cupy_backend import CupyBackend

    d = operands(np.random.default_rng(11), 3, *SHAPES["uneven"])
    want = op_by_op(CupyBackend(), d)
    same_bits(persistent(d, 5, packed=True, gated=gated), want)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize(
    ("head_dim", "shape"),
    [(64, "emulated"), (64, "uneven"), (128, "uneven")],
    ids=["rope-by-tile", "rope-by-tile-folded", "rope-after-a-barrier"],
)
def test_the_next_layers_head_gives_gemm_rope_kv_writes_bits(
    emulated: None, emu_lib, rows: int, packed: bool, head_dim: int, shape: str
) -> None:
    """With the next layer's head (decode_tail_qkv: its bias-free qkv projection of the
    next norm's rows, then rope_kv_write) in the same launch: the rotated queries, the
    residual stream and every byte of the cache (the keys and values written into their
    slots, nothing else touched) equal decode_tail then gemm_rope_kv_write, op by op. At
    head_dim 64 each head's rope runs in the CTA that finished its columns (the emulated
    shape's qkv unsplit: the CTA that stored them; the uneven one's split in two: the CTA
    that folded them); at 128 after a grid barrier."""
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.gemm_sm90_kernel import prepare_weight
    from reprise.cuda.kernels import to_device, to_host
    from reprise.cuda.rope import rope_table

    rng = np.random.default_rng(40 + rows)
    q_size, hidden, inter = SHAPES[shape]
    heads, kv_heads, block_size, layers = 6, 2, 16, 3
    w_qkv_shape = ((heads + 2 * kv_heads) * head_dim, hidden)
    assert gemm_kernel.split_k(*w_qkv_shape) == (1 if shape == "emulated" else 2)
    d = operands(rng, rows, q_size, hidden, inter)
    w_qkv = (rng.standard_normal(w_qkv_shape) * hidden**-0.5).astype(BF16)
    cos, sin = rope_table(head_dim, 4096, 10000.0)
    positions = rng.integers(0, 4000, rows).astype(np.int32)
    slots = rng.choice(8 * block_size, rows, replace=False).astype(np.int64)
    cache0 = rng.standard_normal((8, layers, 2, kv_heads, block_size, head_dim)).astype(BF16)

    def run(persistent: bool) -> tuple[np.ndarray, ...]:
        weights = []
        for w, gated in (
            (d["w_o"], False),
            (d["w_gate_up"], False),
            (d["w_down"], False),
            (w_qkv, False),
        ):
            if packed:
                pw = prepare_weight(w.view(np.uint16), gated=gated)
                weights.append(
                    type(pw)(
                        to_device(pw.data.view(BF16)), pw.num_cols, pw.k, pw.swizzled, pw.gated
                    )
                )
            else:
                weights.append(to_device(w))
        cache = to_device(cache0)
        rope = (
            to_device(positions),
            to_device(cos),
            to_device(sin),
            cache,
            1,
            to_device(slots),
            heads,
        )
        rest = [to_device(d[k]) for k in ("residual", "mlp_norm", "next_norm")]
        if persistent:
            head = decode_block_kernel.NextHead(weights[3], decode_block_kernel.Rope(*rope))
            summed, q = decode_block_kernel.decode_tail(to_device(d["attn"]), *weights[:3], *rest, EPS,
                                                        head=head, num_ctas=5)  # fmt: skip
        else:
            ops = CupyBackend()
            if packed:  # the op-by-op path on the plain weights (the emulation runs gemm.cu)
                weights = [to_device(w) for w in (d["w_o"], d["w_gate_up"], d["w_down"], w_qkv)]
            summed, q = ops.decode_tail_qkv(
                to_device(d["attn"]), *weights[:3], *rest, EPS, weights[3], *rope
            )
        return to_host(summed, bf16=False), to_host(q), to_host(cache)

    evict_first_bytes(emu_lib)  # zeroed
    got = run(True)
    # every weight word read once, under L2's evict-first policy
    assert (
        evict_first_bytes(emu_lib)
        == sum(d[k].nbytes for k in ("w_o", "w_gate_up", "w_down")) + w_qkv.nbytes
    )
    want = run(False)
    assert evict_first_bytes(emu_lib) == 0  # the op-by-op path's kernels read no weight so
    for g, w, what in zip(got, want, ("summed", "q", "cache"), strict=True):
        assert g.shape == w.shape, what
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), what
    assert not np.array_equal(want[2].view(np.uint16), cache0.view(np.uint16))  # it wrote keys


@pytest.mark.parametrize("schedule", [1, 2], ids=["warps-first-to-last", "warps-last-to-first"])
def test_every_thread_schedule_gives_the_same_bits(emulated: None, emu_lib, schedule: int) -> None:
    """The emulator's other thread schedules (a warp at a time as far as it goes alone,
    first to last or last to first, as a GPU may run them): the same bits, on a grid of
    fewer CTAs than items."""
    from reprise.cuda.cupy_backend import CupyBackend

    d = operands(np.random.default_rng(21), 4, *SHAPES["uneven"])
    want = op_by_op(CupyBackend(), d)
    emu_lib.set_warp_major(schedule)
    try:
        got = persistent(d, 3)
    finally:
        emu_lib.set_warp_major(0)
    same_bits(got, want)


def test_counters_and_the_barrier_are_left_zero(emulated: None) -> None:
    """Every tile's counter and the grid barrier's count end at zero (the next launch,
    a graph's replay, starts from them); the barrier's round number advances by the
    launch's three barriers."""
    from reprise.cuda.gemm_kernel import _device_id
    from reprise.cuda.kernels import stream_counters

    d = operands(np.random.default_rng(5), 2, *SHAPES["emulated"])
    persistent(d, 4)
    counters = emucupy.asnumpy(
        stream_counters("decode tail", decode_block_kernel.COUNTERS, _device_id())
    )
    rounds = int(counters[-1])
    persistent(d, 4)
    counters = emucupy.asnumpy(
        stream_counters("decode tail", decode_block_kernel.COUNTERS, _device_id())
    )
    assert not counters[:-1].any()
    assert int(counters[-1]) == rounds + 3


def test_takes_refuses_what_it_cannot_run() -> None:
    def w(n: int, k: int) -> SimpleNamespace:  # takes reads a plain weight's shape alone
        return SimpleNamespace(shape=(n, k))

    w_o, w_gu, w_down = w(256, 384), w(1024, 256), w(256, 512)
    rows = decode_block_kernel.MAX_ROWS
    assert decode_block_kernel.takes(1, w_o, w_gu, w_down)
    assert decode_block_kernel.takes(rows, w_o, w_gu, w_down)
    assert not decode_block_kernel.takes(rows + 1, w_o, w_gu, w_down)
    assert not decode_block_kernel.takes(0, w_o, w_gu, w_down)
    assert not decode_block_kernel.takes(1, w_o, w(1024, 320), w_down)  # gate_up's K is not hidden
    assert not decode_block_kernel.takes(1, w_o, w_gu, w(256, 384))  # down's K is not inter
    assert not decode_block_kernel.takes(
        1, w(256, 352), w_gu, w_down
    )  # K = 352: not a multiple of 64
    # the 8B's tail fits at batch 3, not at 4 (its rows of 14,336 past the shared memory)
    llama = w(4096, 4096), w(28672, 4096), w(4096, 14336)
    assert decode_block_kernel.takes(3, *llama)
    assert not decode_block_kernel.takes(4, *llama)


def test_the_persistent_kernels_do_not_spill_and_fit_an_sm() -> None:
    """Every entry point, from the sm_90 cubin (printed for the record; test_kernels_compile
    builds sm_80 too): no local memory, and registers that let one CTA of PERSIST_THREADS
    sit on an SM (the grid barriers need every CTA resident: one an SM)."""
    from reprise.cuda import nvrtc

    nvrtc_or_skip("sm_90")
    source = nvrtc.kernel_source(nvrtc.KERNEL_DIR / "decode_block.cu")
    resources = nvrtc.kernel_resources(compiled(source, "decode_block.cu", "sm_90").cubin)
    layers = {f"decode_layer_{layout}_d{d}_b{b}" for layout in ("plain", "packed")
              for d, b in decode_block_kernel.LAYER_SHAPES}  # fmt: skip
    assert set(resources) == {"decode_tail_plain", "decode_tail_packed"} | layers
    for kernel, used in sorted(resources.items()):
        print(f"sm_90 {kernel}: {used.registers} registers, {used.local_bytes} B local")
        assert used.local_bytes == 0, (kernel, used)
        assert used.registers * decode_block_kernel.THREADS <= 65536, (kernel, used)
    # the benchmark's build with plain weight loads (WEIGHTS_EVICT_NORMAL) likewise
    plain = nvrtc.kernel_resources(
        nvrtc.compile_source(
            "#define REPRISE_WEIGHTS_EVICT_FIRST 0\n" + source, "decode_block.cu", "sm_90"
        ).cubin
    )
    assert set(plain) == set(resources)
    assert all(used.local_bytes == 0 for used in plain.values()), plain


@pytest.mark.parametrize("prompt_len", [45, 300], ids=["short", "two-chunks"])
@pytest.mark.parametrize(
    ("per_launch", "loop"),
    [(None, True), (1, True), (None, False)],
    ids=["all-layers", "a-layer", "layer-calls"],
)
def test_the_engine_with_the_persistent_layer_changes_no_logit(
    emulated: None, model_dir: Path, monkeypatch: pytest.MonkeyPatch, prompt_len: int,
    per_launch: int | None, loop: bool,
) -> None:  # fmt: skip
    """The emulated engine (the tensor-core attention) with decode_block_kernel.BY_DEFAULT
    on, its grids of 4 CTAs, decode steps eager and replayed from CUDA graphs (PDL's
    default mode): every logit of two requests batched and decoded together equals the
    op-by-op engine's, each request alone. A decode step's layers after its first head run
    as persistent launches, attention and all (decode_layers: every layer in one, or one a
    launch with MAX_LAYERS_A_LAUNCH = 1), whether its attention splits (past one KV chunk
    of 256 keys) or not (one lane, the short prompt's first steps); and, where no shape
    loops (LOOP_SHAPES empty, as at head_dim 128), layer by layer through attention_tail_qkv
    and attention_tail, a decode_layer launch each (their weight tables made before the
    capture: an upload inside it would fail it). The graphs are replayed, not given up.
    The prefills (past 16 rows) run op by op."""
    engines = Engines(model_dir, "tensor-cores")
    prompts = [random_prompt(prompt_len, seed=5), random_prompt(prompt_len - 30, seed=6)]
    want = [
        engines(enable_reuse=False).generate(p, q) for p, q in zip(prompts, PARAMS, strict=True)
    ]
    ran: dict[str, list[tuple[int, int]]] = {"decode_layers": [], "decode_tail": []}
    for name, shape in (
        ("decode_layers", lambda a: (a[0].q.shape[0], len(a[1]))),
        ("decode_tail", lambda a: (a[0].shape[0], 1)),
    ):
        launch = getattr(decode_block_kernel, name)
        monkeypatch.setattr(decode_block_kernel, name,
                            lambda *a, _n=name, _l=launch, _s=shape, **k: ran[_n].append(_s(a)) or _l(*a, **k))  # fmt: skip
    monkeypatch.setattr(decode_block_kernel, "BY_DEFAULT", True)
    monkeypatch.setattr(decode_block_kernel, "MAX_LAYERS_A_LAUNCH", per_launch)
    if not loop:
        monkeypatch.setattr(decode_block_kernel, "LOOP_SHAPES", ())
    monkeypatch.setattr(decode_block_kernel, "_num_sms", lambda device: 4)
    monkeypatch.setattr(pdl, "active", lambda: "graphs")
    num_layers = engines.config.num_layers
    for graphs in (False, True):
        for calls in ran.values():
            calls.clear()
        replays = emucupy.replays()
        got = engines(cuda_graphs=graphs).generate(prompts, PARAMS)
        assert_identical(got, want)
        assert (emucupy.replays() > replays) == graphs  # captured, then replayed
        # the decode steps' rows (the prefills' are more)
        assert ran["decode_layers"] or ran["decode_tail"], ran
        assert {rows for rows, _ in ran["decode_layers"] + ran["decode_tail"]} <= {1, 2}, ran
        assert {n for _, n in ran["decode_layers"]} <= {
            per_launch or (num_layers if loop else 1)
        }, ran
        assert ran["decode_layers"] and not ran["decode_tail"], ran  # split or one lane


def test_drafted_steps_through_the_persistent_layers_change_no_logit(
    emulated: None, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculation with the persistent layers on: a drafted step's sequences have 1 + K
    rows each (K = 3), in a drafted bucket's graph (padding sequences of several rows
    after them) or eagerly, and its layers run as decode_layers launches of up to 16
    rows: every logit equals the op-by-op engine's decoding one token a step."""
    from test_speculative import planted

    engines = Engines(model_dir, "tensor-cores")
    prompts = [random_prompt(45, seed=5), random_prompt(20, seed=6)]
    want = [
        engines(enable_reuse=False).generate(p, q) for p, q in zip(prompts, PARAMS, strict=True)
    ]
    rows: list[int] = []
    launch = decode_block_kernel.decode_layers
    monkeypatch.setattr(decode_block_kernel, "decode_layers",
                        lambda *a, **k: rows.append(a[0].q.shape[0]) or launch(*a, **k))  # fmt: skip
    monkeypatch.setattr(decode_block_kernel, "BY_DEFAULT", True)
    monkeypatch.setattr(decode_block_kernel, "_num_sms", lambda device: 4)
    monkeypatch.setattr(pdl, "active", lambda: "graphs")
    for graphs in (False, True):
        rows.clear()
        engine = engines(cuda_graphs=graphs, speculative_tokens=3)
        plant = planted(engine, want, seed=13)
        assert_identical(engine.generate(prompts, PARAMS), want)
        assert plant.num_right > 0
        assert max(rows) > 2 and max(rows) <= decode_block_kernel.MAX_ROWS, rows  # drafted
        if graphs:
            decode = engine.runner.decode
            assert decode is not None and decode.drafted_steps > 0


def test_a_device_that_holds_no_cta_is_refused_before_the_launch(
    emulated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the occupancy calculator says no SM holds a CTA of the tail (its registers and
    shared memory), decode_tail says so and launches nothing (a cooperative launch would
    be refused; a plain one would hang at its first grid barrier)."""
    monkeypatch.setattr(emucupy.PdlDriver, "occupancy", lambda self, fn, threads, smem: 0)
    decode_block_kernel._resident_ctas.cache_clear()  # asked once a process: ask again
    launches = emucupy.launches()
    d = operands(np.random.default_rng(3), 1, *SHAPES["emulated"])
    with pytest.raises(RuntimeError, match="no SM holds a CTA"):
        persistent(d, 4)
    assert emucupy.launches() == launches
    decode_block_kernel._resident_ctas.cache_clear()  # the refusal is not kept for others


def attention_case(rng: np.random.Generator, seq_lens: list[int], *, heads: int = 6, kv_heads: int = 2,
                   head_dim: int = 64, block_size: int = 16, layers: int = 3) -> dict:  # fmt: skip
    """A decode step's attention inputs: one query a sequence at its last position, a
    paged cache of random keys and values (stale slots too), each sequence's blocks
    scattered over the pool."""
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    pool = len(seq_lens) * max_blocks + 3
    ids = rng.permutation(pool)[: len(seq_lens) * max_blocks].reshape(len(seq_lens), max_blocks)
    return {
        "q": rng.standard_normal((len(seq_lens), heads, head_dim)).astype(BF16),
        "cache": rng.standard_normal((pool, layers, 2, kv_heads, block_size, head_dim)).astype(
            BF16
        ),
        "layer": 1,
        "block_tables": ids.astype(np.int32),
        "seq_lens": np.array(seq_lens, dtype=np.int32),
        "query_start_loc": np.arange(len(seq_lens) + 1, dtype=np.int32),
        "scale": head_dim**-0.5,
    }


@pytest.mark.parametrize(
    ("seq_lens", "window"),
    [([700], 0), ([300, 37, 700], 0), ([37], 0), ([200, 5, 256], 0), ([700], 300),
     ([300, 37, 700], 290)],
    ids=["alone", "three", "one-lane-alone", "one-lane-three", "alone-window",
         "three-window"],
)  # fmt: skip
@pytest.mark.parametrize("with_head", [False, True], ids=["last-layer", "with-head"])
def test_the_layer_with_its_attention_gives_the_op_by_op_bits(
    emulated: None, launched: list[int], seq_lens: list[int], window: int, with_head: bool
) -> None:
    """decode_layer (the layer's attention run in the persistent launch as virtual CTAs of
    the tensor-core kernel, two a CTA, on its planned split grid, then the tail) against
    CupyBackend's paged_attention (the tensor-core kernel's own launch) then decode_tail
    or decode_tail_qkv: the residual stream, the normed rows or the next layer's queries,
    and every byte of the cache. With a sliding window too (the split's lanes then start
    past chunk 0)."""
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.kernels import to_device, to_host
    from reprise.cuda.rope import rope_table

    rng = np.random.default_rng(len(seq_lens) + 10 * with_head)
    q_size, hidden, inter = SHAPES["emulated"]
    rows = len(seq_lens)
    d = operands(rng, rows, q_size, hidden, inter)
    case = attention_case(rng, seq_lens)
    w_qkv = (rng.standard_normal(((6 + 4) * 64, hidden)) * hidden**-0.5).astype(BF16)
    cos, sin = rope_table(64, 4096, 10000.0)
    positions = np.array(seq_lens, dtype=np.int32)  # the next token's position
    slots = rng.choice(case["cache"].shape[0] * 16, rows, replace=False).astype(np.int64)

    def run(persistent: bool) -> list[np.ndarray]:
        ops = CupyBackend(attention="tensor-cores")
        cache = to_device(case["cache"])
        attention = decode_block_kernel.Attention(
            to_device(case["q"]), cache, case["layer"], to_device(case["block_tables"]),
            to_device(case["seq_lens"]), to_device(case["query_start_loc"]), case["scale"],
            window,
        )  # fmt: skip
        weights = [to_device(d[k]) for k in ("w_o", "w_gate_up", "w_down")]
        rest = [to_device(d[k]) for k in ("residual", "mlp_norm", "next_norm")]
        rope = (to_device(positions), to_device(cos), to_device(sin), cache, 2, to_device(slots), 6)
        head = (
            decode_block_kernel.NextHead(to_device(w_qkv), decode_block_kernel.Rope(*rope))
            if with_head
            else None
        )
        if persistent:
            plan = decode_block_kernel.layer_plan(attention, rows)
            assert plan is not None and plan.splits == (max(seq_lens) > 256)  # one lane: a chunk
            out = decode_block_kernel.decode_layer(
                attention, *weights, *rest, EPS, head=head, num_ctas=4
            )
        else:
            attn = ops.paged_attention(*attention).reshape(rows, q_size)
            if with_head:
                out = ops.decode_tail_qkv(attn, *weights, *rest, EPS, to_device(w_qkv), *rope)
            else:
                out = ops.decode_tail(attn, *weights, *rest, EPS)
        return [to_host(out[0], bf16=False), to_host(out[1]), to_host(cache)]

    got, want = run(True), run(False)
    assert launched == [4]  # one launch, of the CTAs asked
    for g, w, what in zip(got, want, ("summed", "normed or q", "cache"), strict=True):
        assert g.shape == w.shape, what
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), what


def last_positions(case: dict, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's last position and its cache slot (its block table's): where a decode
    step's head writes the token's keys and values, which its next layer's attention reads."""
    pos = case["seq_lens"] - 1
    tables = case["block_tables"]
    blocks = tables[np.arange(len(pos)), pos // block_size].astype(np.int64)
    return pos.astype(np.int32), blocks * block_size + pos % block_size


@pytest.mark.parametrize(
    ("seq_lens", "last_head", "num_ctas", "window"),
    [([700], False, 4, 0), ([300, 37, 700], True, 3, 0), ([300, 37, 700], True, 3, 290)],
    ids=["alone-last-norm", "three-last-head", "three-last-head-window"],
)
@pytest.mark.parametrize("reversed_ctas", [False, True], ids=["ctas-up", "ctas-down"])
def test_layers_in_one_launch_give_the_layer_by_layer_bits(
    emulated: None, emu_lib, launched: list[int], seq_lens: list[int], last_head: bool,
    num_ctas: int, window: int, reversed_ctas: bool,
) -> None:  # fmt: skip
    """decode_layers (three layers, each its attention as virtual CTAs then its tail with
    the next layer's head, the residual stream carried in shared memory between them, the
    later layers' queries through the launch's own buffer) against the same layers one at a
    time op by op (layer_by_layer on CupyBackend's attention_tail_qkv and attention_tail:
    the tensor-core attention's launch, then the tail's ops): the residual stream, the
    last layer's normed rows or next queries, and every byte of the cache (each layer's
    new keys and values written in its sequence's last slot, which the next layer's
    attention reads). Its CTAs
    take turns first to last or last to first (the emulator runs the grid as one cluster,
    a CTA as far as it goes alone): so a CTA that passes a barrier ahead of the others
    differs between the two, and a layer's attention reading queries before every CTA
    has written them fails one."""
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.cuda.kernels import to_device, to_host
    from reprise.cuda.protocol import layer_by_layer
    from reprise.cuda.rope import rope_table

    rng = np.random.default_rng(len(seq_lens) + 20 * last_head)
    q_size, hidden, inter = SHAPES["emulated"]
    rows, first = len(seq_lens), 1
    case = attention_case(rng, seq_lens, layers=5)
    layers = [operands(rng, rows, q_size, hidden, inter) for _ in range(3)]
    w_qkv = [(rng.standard_normal(((6 + 4) * 64, hidden)) * hidden**-0.5).astype(BF16)
             for _ in layers]  # fmt: skip
    cos, sin = rope_table(64, 4096, 10000.0)
    positions, slots = last_positions(case, 16)  # what the next layer's attention reads

    def run(persistent: bool) -> list[np.ndarray]:
        cache = to_device(case["cache"])
        attention = decode_block_kernel.Attention(
            to_device(case["q"]), cache, first, to_device(case["block_tables"]),
            to_device(case["seq_lens"]), to_device(case["query_start_loc"]), case["scale"],
            window,
        )  # fmt: skip
        weights = [
            decode_block_kernel.LayerWeights(
                *(to_device(d[k]) for k in ("w_o", "w_gate_up", "w_down", "mlp_norm", "next_norm")),
                to_device(w) if i < len(layers) - 1 or last_head else None,
            )
            for i, (d, w) in enumerate(zip(layers, w_qkv, strict=True))
        ]
        rope = (to_device(positions), to_device(cos), to_device(sin), cache, to_device(slots), 6)
        residual = to_device(layers[0]["residual"])
        if persistent:
            plan = decode_block_kernel.layer_plan(attention, rows)
            assert plan is not None and decode_block_kernel.layers_take(attention, weights)
            out = decode_block_kernel.decode_layers(
                attention, weights, residual, EPS, num_ctas=num_ctas,
                rope=decode_block_kernel.Rope(*rope[:4], first + 1, *rope[4:]),
            )  # fmt: skip
        else:
            ops = CupyBackend(attention="tensor-cores")
            out = layer_by_layer(ops, tuple(attention), weights, residual, EPS, rope)
        return [to_host(out[0], bf16=False), to_host(out[1]), to_host(cache)]

    want = run(False)
    evict_first_bytes(emu_lib)  # zeroed
    emu_lib.set_reversed_ctas(int(reversed_ctas))
    try:
        got = run(True)
    finally:
        emu_lib.set_reversed_ctas(0)
    assert launched == [num_ctas]  # one launch, of the CTAs asked
    heads = [w for i, w in enumerate(w_qkv) if i < len(layers) - 1 or last_head]
    weight_bytes = sum(d[k].nbytes for d in layers for k in ("w_o", "w_gate_up", "w_down"))
    assert evict_first_bytes(emu_lib) == weight_bytes + sum(w.nbytes for w in heads)
    for g, w, what in zip(got, want, ("summed", "normed or q", "cache"), strict=True):
        assert g.shape == w.shape, what
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), what
